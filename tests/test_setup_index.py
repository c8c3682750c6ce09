"""setup.sh's torch step (scripts/install_torch.sh) on an ordinary machine: only the default package index,
which has no +cpu builds. Two fake indexes served on loopback stand in for the default index (the plain
build only) and PyTorch's CPU wheel index (the +cpu build), with tiny wheels that say which build they are;
pip's own configuration on this machine is switched off (PIP_CONFIG_FILE=/dev/null), so nothing else is
found."""
import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_torch.sh"


def fake_wheel(folder: Path, version: str, cuda) -> str:
    """A wheel of a package named torch at ``version`` whose torch.version.cuda is ``cuda``."""
    name = f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f"__version__ = {version!r}\nfrom torch import version\n",
        "torch/version.py": f"cuda = {cuda!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / name, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return name


def simple_index(root: Path, wheels) -> None:
    """A PEP 503 index at ``root``/simple with project torch holding ``wheels`` (version, cuda)."""
    proj = root / "simple" / "torch"
    proj.mkdir(parents=True)
    links = [fake_wheel(proj, v, c) for v, c in wheels]
    (proj / "index.html").write_text("".join(f'<a href="{n}">{n}</a><br>\n' for n in links))
    (root / "simple" / "index.html").write_text('<a href="torch/">torch</a>\n')


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    """(url of the default index, url of the CPU index, url of an empty CPU index), served on 127.0.0.1."""
    base = tmp_path_factory.mktemp("indexes")
    simple_index(base / "default", [("2.13.0", "12.8")])
    simple_index(base / "cpu", [("2.13.0+cpu", None)])
    (base / "empty" / "simple").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(base))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield f"{url}/default/simple", f"{url}/cpu/simple", f"{url}/empty/simple"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A fresh venv with pip and nothing else, made once for the module (ensurepip takes seconds of CPU);
    ``fresh_python`` gives each test a copy of its own."""
    where = tmp_path_factory.mktemp("pristine") / "venv"
    venv.EnvBuilder(with_pip=True).create(where)
    return where


def fresh_python(tmp_path, pristine) -> str:
    shutil.copytree(pristine, tmp_path / "venv", symlinks=True)  # bin/python stays a link to the interpreter
    return str(tmp_path / "venv" / "bin" / "python")


def install(py, default, cpu, what="torch"):
    # a CPU machine: an nvidia-smi that finds no GPU comes first on PATH (dropping the folders that hold the
    # real one would drop bash too where it lives in /usr/bin, as on a GPU machine)
    nogpu = Path(py).parent.parent / "nogpu"
    nogpu.mkdir(exist_ok=True)
    (nogpu / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices' >&2\nexit 9\n")
    (nogpu / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=default, PIP_NO_CACHE_DIR="1", PIP_DEFAULT_TIMEOUT="10",
               PIP_RETRIES="0", COMMLAB_TORCH_CPU_INDEX=cpu, PATH=str(nogpu) + os.pathsep + env["PATH"])
    return subprocess.run(["bash", str(SCRIPT), py, what], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def torch_in(py) -> tuple:
    out = subprocess.run([py, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                         capture_output=True, text=True)
    return tuple(out.stdout.split()) if out.returncode == 0 else None


def test_the_cpu_build_comes_from_pytorchs_cpu_index(indexes, tmp_path, pristine):
    default, cpu, _ = indexes
    py = fresh_python(tmp_path, pristine)
    r = install(py, default, cpu)
    assert r.returncode == 0, r.stderr
    assert torch_in(py) == ("2.13.0+cpu", "None")
    assert "not on the configured indexes; trying PyTorch's CPU wheel index" in r.stderr
    assert f"installed torch==2.13.0+cpu from {cpu}" in r.stderr
    again = install(py, default, cpu)  # a torch that imports is kept: nothing is asked of pip
    assert again.returncode == 0 and again.stderr == "", again.stderr


def test_without_the_cpu_index_the_default_build_is_said_before_it_installs(indexes, tmp_path, pristine):
    default, _, empty = indexes
    py = fresh_python(tmp_path, pristine)
    r = install(py, default, empty)
    assert r.returncode == 0, r.stderr
    assert torch_in(py) == ("2.13.0", "12.8")
    said = r.stderr.splitlines()
    big = next(i for i, line in enumerate(said) if "a CUDA build of several GB" in line)
    assert any("rm -rf .venv" in line for line in said[big:]), r.stderr


def test_an_existing_cuda_torch_is_never_replaced(indexes, tmp_path, pristine):
    default, cpu, _ = indexes
    py = fresh_python(tmp_path, pristine)
    wheels = tmp_path / "w"
    wheels.mkdir()
    name = fake_wheel(wheels, "2.13.0", "12.8")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", str(wheels / name)], check=True,
                   env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    r = install(py, default, cpu)
    assert r.returncode == 0 and torch_in(py) == ("2.13.0", "12.8"), r.stderr


def test_nothing_to_install_fails_with_the_reason(tmp_path, indexes, pristine):
    _, _, empty = indexes
    py = fresh_python(tmp_path, pristine)
    r = install(py, empty, empty)
    assert r.returncode != 0 and torch_in(py) is None
    assert "setup: torch==2.13.0+cpu is not on the configured indexes" in r.stderr
    assert "a CUDA build of several GB" in r.stderr  # the last try was said before it failed


def test_bad_argument_is_one_line(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), sys.executable, "jax"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "must be torch or torchvision" in r.stderr
