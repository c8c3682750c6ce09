"""The wheel installs: ``pip wheel .`` of a copy of the tracked sources, installed (not editable) into a fresh
virtual environment that cannot see this checkout, runs ``commlab --help``, imports every package and trains a
short two-rank job from a folder outside the repository.

The fresh environment gets its dependencies (torch, numpy, ...) without a download: a ``.pth`` file lists the
site-packages folders of the interpreter running the tests. Lines of a ``.pth`` file are added to ``sys.path``
as they are, without reading the ``.pth`` files inside them, so the editable install of this checkout that
setup.sh makes there stays invisible."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "engine", "lab", "app", "commlab")
"""What a wheel is built from (what a fresh clone holds of them, tracked files only)."""


def tracked_copy(dest: Path) -> Path:
    """The tracked files of SOURCES, copied to ``dest`` (a build leaves ``build/`` and egg-info behind, and
    untracked files of this checkout must not reach the wheel)."""
    out = subprocess.run(["git", "ls-files", "-z", *SOURCES], cwd=ROOT, capture_output=True, check=True)
    files = [f for f in out.stdout.decode().split("\0") if f]
    assert "pyproject.toml" in files
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)  # follows links: the wheel gets the file itself
    return dest


def dependency_dirs():
    """The site-packages folders the running interpreter imports from, this checkout left out."""
    out = []
    for p in sys.path:
        if p and Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir():
            if Path(p).resolve() != ROOT and p not in out:
                out.append(p)
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, commlab, env, cwd) of a fresh venv with the built wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tracked_copy(tmp / "src")
    dist = tmp / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-q", "-w", str(dist), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheels = list(dist.glob("commlab-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                           "--disable-pip-version-check", "-q", str(wheels[0])],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-3000:]
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "commlab-test-deps.pth").write_text("\n".join(dependency_dirs()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COMMLAB_RUNS", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    return py, venv / "bin" / "commlab", env, cwd, Path(purelib)


def run(argv, installed, timeout=120):
    _, _, env, cwd, _ = installed
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_wheel_holds_every_package_and_its_data(installed):
    py, _, _, _, purelib = installed
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import engine, lab, app, commlab
        for top in (engine, lab, app, commlab):
            assert top.__file__.startswith({str(purelib)!r}), top.__file__  # the wheel's, not this checkout's
            for m in pkgutil.walk_packages(top.__path__, top.__name__ + "."):
                if m.ispkg:
                    importlib.import_module(m.name)
        import engine.tuners, engine.comm, lab.strategy.perfmodel, lab.front.cli
        from lab.front import appserver
        assert appserver.DEMO_SPEC.is_file(), appserver.DEMO_SPEC
        from lab.base.specs import load_spec
        assert load_spec(str(appserver.DEMO_SPEC)).model.name
        from pathlib import Path
        views = sorted(p.name for p in (Path(app.__file__).parent / "views").glob("*.py"))
        assert "home.py" in views and "new_run.py" in views, views
        print("ok")
    """)
    r = run([py, "-c", code], installed)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert (ROOT / "examples" / "demo.yaml").read_bytes() == (ROOT / "lab" / "front" / "demo.yaml").read_bytes()


def test_commlab_help_and_version(installed):
    _, commlab, _, _, _ = installed
    r = run([commlab, "--help"], installed)
    assert r.returncode == 0, r.stderr
    assert "usage: commlab" in r.stdout and "run" in r.stdout
    if "--version" in r.stdout:
        v = run([commlab, "--version"], installed)
        assert v.returncode == 0 and v.stdout.strip(), v.stderr


def test_what_needs_a_checkout_says_so_in_one_line(installed):
    _, commlab, _, _, _ = installed
    for argv in (["bench"], ["notebooks", "--no-browser", "--port", "18873"]):
        r = run([commlab, *argv], installed)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "source checkout" in lines[0], (argv, r.stderr)


def test_a_short_job_runs_from_the_wheel(installed):
    _, commlab, _, cwd, _ = installed
    (cwd / "tiny.yaml").write_text("name: wheel\nmodel: mlp\ndataset: digits\nworld_size: 2\nsteps: 3\n"
                                   "batch_size: 16\neval_every: 0\nthreads: 1\n")
    r = run([commlab, "run", "tiny.yaml", "--quiet", "--runs", cwd / "runs"], installed, timeout=240)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "status         done" in r.stdout, r.stdout
    runs = [p for p in (cwd / "runs").iterdir() if (p / "spec.json").is_file()]
    assert len(runs) == 1 and (runs[0] / "timeline-rank1.jsonl").is_file()  # both ranks trained
