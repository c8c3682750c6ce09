"""The wheel installs: ``pip wheel .`` of a copy of the tracked sources, installed (not editable) into a fresh
virtual environment that cannot see this checkout, runs ``commlab --help``, imports every package, trains a
short two-rank job and renders the UI's first page from a folder outside the repository that holds a user's own
``engine/``, ``app/`` and ``lab.py`` (the install puts only ``commlab`` into site-packages, so none shadows it).

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
SOURCES = ("pyproject.toml", "README.md", "commlab")
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


SHADOWS = ("engine/__init__.py", "app/__init__.py", "lab.py")
"""What a user may keep beside a notebook or a training script; each raises when imported."""


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
    for name in SHADOWS:  # a user's own modules beside their script, first on sys.path
        f = cwd / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"raise ImportError('the user\\'s own {name} was imported')\n")
    return py, venv / "bin" / "commlab", env, cwd, Path(purelib)


def run(argv, installed, timeout=120):
    _, _, env, cwd, _ = installed
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_wheel_holds_every_package_and_its_data(installed):
    py, _, _, _, purelib = installed
    tops = sorted(p.name for p in purelib.iterdir() if p.is_dir() and not p.name.endswith((".dist-info", "__pycache__")))
    assert tops == ["commlab"], tops  # one import package
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import commlab
        assert commlab.__file__.startswith({str(purelib)!r}), commlab.__file__  # the wheel's, not this checkout's
        for m in pkgutil.walk_packages(commlab.__path__, "commlab."):
            if m.ispkg:
                importlib.import_module(m.name)
        import commlab.engine.tuners, commlab.engine.comm, commlab.lab.strategy.perfmodel, commlab.lab.front.cli
        from commlab.lab.front import appserver
        assert appserver.DEMO_SPEC.is_file(), appserver.DEMO_SPEC
        assert appserver.APP_ENTRY.is_file(), appserver.APP_ENTRY
        assert commlab.spec(str(appserver.DEMO_SPEC)).model.name
        from pathlib import Path
        import commlab.app
        views = sorted(p.name for p in (Path(commlab.app.__file__).parent / "views").glob("*.py"))
        assert "home.py" in views and "new_run.py" in views, views
        for name in ("engine", "app", "lab"):
            assert name not in sys.modules, name
        print("ok")
    """)
    r = run([py, "-c", code], installed)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert (ROOT / "examples" / "demo.yaml").read_bytes() == (ROOT / "commlab" / "lab" / "front" / "demo.yaml").read_bytes()


def test_a_users_own_engine_app_and_lab_beside_the_script_are_theirs(installed):
    """The folder the commands run from holds the user's engine/, app/ and lab.py (first on sys.path for
    ``python -c``); they stay importable as the user's, and commlab never reaches them."""
    py, _, _, _, _ = installed
    r = run([py, "-c", "import lab"], installed)
    assert r.returncode == 1 and "the user's own lab.py was imported" in r.stderr, r.stderr[-2000:]
    r = run([py, "-c", "import commlab, commlab.lab.front.cli, commlab.engine.trainer; print('ok')"], installed)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_the_uis_first_page_renders_from_the_wheel(installed):
    """The Home page, as Streamlit's AppTest runs it, from the wheel's commlab/app and the user's folder."""
    py, _, _, cwd, purelib = installed
    code = textwrap.dedent(f"""
        import os
        os.environ["COMMLAB_RUNS"] = {str(cwd / "ui-runs")!r}
        from streamlit.testing.v1 import AppTest
        at = AppTest.from_file({str(purelib / "commlab" / "app" / "streamlit_app.py")!r}, default_timeout=120).run()
        assert not at.exception, [e.value for e in at.exception]
        print("TITLE", at.title[0].value if at.title else "")
    """)
    r = run([py, "-c", code], installed, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TITLE commlab" in r.stdout, r.stdout[-2000:]


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
