"""``commlab notebooks``: JupyterLab over notebooks/, bound to 127.0.0.1, with this environment as kernel.

The server gets a private Jupyter data directory (first on JUPYTER_PATH) holding a ``python3``
kernelspec whose command is this interpreter (``sys.executable``), so the notebooks' kernel is the
lab's own Python even when the user has another ``python3`` kernelspec installed. The token comes
from here (JUPYTER_TOKEN, not the command line), so the URL printed is the one that works.

The server runs in its own session, so a Ctrl-C at the terminal reaches only this process (no
"Shutdown this Jupyter server (y/[n])?" prompt); SIGINT or SIGTERM here sends SIGTERM to the
server, which shuts its kernels down, and SIGKILL follows if it has not exited within
``STOP_TIMEOUT_S``. On Linux the server also gets SIGTERM when this process dies.
"""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import SOURCE, make_private

REPO = SOURCE
NOTEBOOKS = REPO / "notebooks"
STOP_TIMEOUT_S = 20.0


def kernelspec(python: str = sys.executable) -> dict:
    """The ``python3`` kernelspec: ipykernel on ``python`` (this interpreter by default)."""
    return {"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (commlab)", "language": "python", "metadata": {"debugger": True}}


def write_kernelspec(data_dir: Path, python: str = sys.executable) -> Path:
    d = Path(data_dir) / "kernels" / "python3"
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.json").write_text(json.dumps(kernelspec(python), indent=1))
    return d


def lab_argv(port: int, browser: bool = False, root: Path = NOTEBOOKS) -> List[str]:
    """JupyterLab's command line (a list, never a shell string). The token is passed in the environment."""
    return [sys.executable, "-m", "jupyterlab",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={int(port)}", "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={root}", f"--ServerApp.open_browser={bool(browser)}",
            "--ServerApp.allow_remote_access=False",
            *(["--ServerApp.allow_root=True"] if os.geteuid() == 0 else [])]  # as `sudo commlab run` is (shaped links)


def lab_url(port: int, token: str) -> str:
    return f"http://127.0.0.1:{int(port)}/lab?token={token}"


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _child_setup() -> None:  # runs in the child between fork and exec
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked in the parent around Popen
    os.setsid()
    try:  # Linux: SIGTERM to the server when the process that started it dies (even by SIGKILL)
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop(signum)


def stop_server(p: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM (the server stops its kernels), then SIGKILL to its whole session after ``timeout``."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session leader's group: the server and what it started
            except ProcessLookupError:
                pass
    return p.wait()


def notebooks_main(port: int = 8888, browser: bool = True, runs: Optional[os.PathLike] = None,
                   out=sys.stderr) -> int:
    """``commlab notebooks``: serve JupyterLab on 127.0.0.1:port over notebooks/ until SIGINT or SIGTERM.
    The runs directory ``runs`` (default $COMMLAB_RUNS or ./runs, as every command) becomes the kernels'
    COMMLAB_RUNS. Returns 0 after a requested stop, else the server's exit status."""
    if not 1 <= int(port) <= 65535:
        raise LabError(f"--port: must be in 1..65535, got {port}")
    if not NOTEBOOKS.is_dir():  # first: installing JupyterLab would not help an installed wheel
        raise LabError(f"commlab notebooks: the notebooks live in a source checkout (no {NOTEBOOKS}); "
                       f"clone the repository and run it from there")
    missing = [m for m in ("jupyterlab", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:
        raise LabError(f"commlab notebooks needs {' and '.join(missing)}: pip install 'commlab[notebooks]'")
    if not port_free(port):
        raise LabError(f"--port: 127.0.0.1:{port} is in use; pick another port")
    token = secrets.token_hex(24)
    env = {**os.environ, "JUPYTER_TOKEN": token,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    root = Path(runs or os.environ.get("COMMLAB_RUNS") or "runs").resolve()  # the CLI's default: ./runs
    make_private(root)
    env["COMMLAB_RUNS"] = str(root)  # the kernels' commlab.lab.front.notebook.runs_dir()
    data_dir = Path(tempfile.mkdtemp(prefix="commlab-jupyter-"))
    old = {s: signal.signal(s, _raise_stop) for s in STOP_SIGNALS}
    p = None
    try:
        write_kernelspec(data_dir)
        env["JUPYTER_PATH"] = os.pathsep.join(x for x in (str(data_dir), os.environ.get("JUPYTER_PATH")) if x)
        print(f"commlab notebooks in JupyterLab on {lab_url(port, token)}\n"
              f"  (notebooks: {NOTEBOOKS}; kernel: {sys.executable}; "
              f"runs: {root}; Ctrl-C stops it)", file=out, flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a stop signal now would lose the child's pid
        try:
            p = subprocess.Popen(lab_argv(port, browser), env=env, cwd=str(NOTEBOOKS),
                                 stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a pending one is raised here, p is set
        return p.wait()
    except _Stop:
        for s in old:  # a second signal while stopping must not cut the cleanup short
            signal.signal(s, signal.SIG_IGN)
        if p is not None:
            stop_server(p)
        print("commlab notebooks: stopped", file=out, flush=True)
        return 0
    finally:
        if p is not None and p.poll() is None:  # any other way out (an exception): no server left behind
            stop_server(p)
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(data_dir, ignore_errors=True)
