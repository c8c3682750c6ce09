"""`commlab notebooks`: JupyterLab on 127.0.0.1 serves the notebooks in notebooks/, its python3 kernel
is this environment's Python (even with another python3 kernelspec installed for the user) and
imports lab, and SIGTERM or SIGINT stops the server and its kernels with nothing left behind."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("jupyterlab")
pytest.importorskip("ipykernel")
websocket = pytest.importorskip("websocket")  # websocket-client, a dependency of jupyter_server

from commlab.lab.front import jupyter  # noqa: E402
from commlab.lab.front.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
GUARD_S = 180  # hang guards, not speed checks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set:
    """Every live process below ``pid`` (from /proc)."""
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Server:
    """``python -m commlab.lab.front.cli notebooks --no-browser`` in a private Jupyter home, read through its REST API."""

    def __init__(self, tmp_path: Path):
        self.port = free_port()
        self.log = tmp_path / "notebooks.log"
        self.runs = tmp_path / "runs"
        home = tmp_path / "jupyter"
        decoy = home / "data" / "kernels" / "python3"  # a user's python3 kernelspec that must not be used
        decoy.mkdir(parents=True)
        (decoy / "kernel.json").write_text(json.dumps(
            {"argv": ["/bin/false", "{connection_file}"], "display_name": "not commlab", "language": "python"}))
        env = {**os.environ, "COMMLAB_RUNS": str(self.runs), "JUPYTER_DATA_DIR": str(home / "data"),
               "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        env.pop("JUPYTER_TOKEN", None)
        with open(self.log, "wb") as f:
            self.p = subprocess.Popen([sys.executable, "-m", "commlab.lab.front.cli", "notebooks", "--no-browser",
                                       "--port", str(self.port)], env=env, cwd=str(tmp_path),
                                      stdout=f, stderr=subprocess.STDOUT)
        self.procs = set()
        self.token = self._wait_token()
        self._wait_ready()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def _wait_token(self) -> str:
        end = time.monotonic() + GUARD_S
        while time.monotonic() < end:
            m = re.search(rf"http://127\.0\.0\.1:{self.port}/lab\?token=([0-9a-f]+)", self.output())
            if m:
                return m.group(1)
            assert self.p.poll() is None, f"commlab notebooks exited {self.p.returncode}:\n{self.output()}"
            time.sleep(0.2)
        raise AssertionError(f"no URL with a token printed:\n{self.output()}")

    def _wait_ready(self) -> None:
        end = time.monotonic() + GUARD_S
        while time.monotonic() < end:
            assert self.p.poll() is None, f"commlab notebooks exited {self.p.returncode}:\n{self.output()}"
            try:
                self.get("/api/status")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)
        raise AssertionError(f"JupyterLab never answered on port {self.port}:\n{self.output()}")

    def request(self, path: str, method: str = "GET", body=None):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def get(self, path: str):
        return self.request(path)

    def execute(self, kernel_id: str, code: str) -> str:
        """Run ``code`` in a kernel over the websocket the browser uses; return its stdout."""
        ws = websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels?token={self.token}", timeout=GUARD_S)
        try:
            msg_id, session = uuid.uuid4().hex, uuid.uuid4().hex
            ws.send(json.dumps({
                "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                           "session": session, "version": "5.3"},
                "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": True}}))
            stdout, reply, idle = [], None, False
            end = time.monotonic() + GUARD_S
            while (reply is None or not idle) and time.monotonic() < end:
                msg = json.loads(ws.recv())
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["header"]["msg_type"], msg["content"]
                if kind == "stream" and content["name"] == "stdout":
                    stdout.append(content["text"])
                elif kind == "error":
                    raise AssertionError("kernel error: " + "\n".join(content["traceback"]))
                elif kind == "execute_reply":
                    reply = content
                elif kind == "status" and content["execution_state"] == "idle":
                    idle = True
            assert reply is not None and reply["status"] == "ok", reply
            return "".join(stdout)
        finally:
            ws.close()

    def note_processes(self) -> None:
        self.procs |= {self.p.pid} | descendants(self.p.pid)

    def stop(self, sig) -> int:
        self.note_processes()
        self.p.send_signal(sig)
        return self.p.wait(timeout=GUARD_S)

    def kill_leftovers(self) -> None:  # only if a test failed midway: nothing may outlive the test
        self.note_processes()
        for pid in self.procs:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.p.poll() is None:
            self.p.wait(timeout=30)


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    try:
        yield s
    finally:
        s.kill_leftovers()


def assert_all_gone(server) -> None:
    end = time.monotonic() + 30
    while any(alive(p) for p in server.procs) and time.monotonic() < end:
        time.sleep(0.2)
    left = [p for p in server.procs if alive(p)]
    assert not left, f"processes left after the stop: {left}"


def test_serves_the_notebooks_runs_lab_in_the_kernel_and_stops_on_sigterm(server):
    assert f"kernel: {sys.executable}" in server.output()
    contents = server.get("/api/contents")
    assert sorted(c["name"] for c in contents["content"] if c["type"] == "notebook") == NOTEBOOKS
    assert len(NOTEBOOKS) == 9  # the tour, one per paper, local updates, your own compressor, pull the plug,
    # across the internet
    nb = server.get("/api/contents/00_tour.ipynb")
    assert nb["content"]["cells"][0]["source"].startswith("# 00 · ")

    specs = server.get("/api/kernelspecs")
    assert specs["default"] == "python3"
    assert specs["kernelspecs"]["python3"]["spec"]["argv"][0] == sys.executable  # ours, not the decoy

    kernel = server.request("/api/kernels", "POST", {"name": "python3"})
    out = server.execute(kernel["id"], "import os, sys, commlab\n"
                                       "print('KERNEL', sys.executable, commlab.__file__, os.environ['COMMLAB_RUNS'])")
    line = next(l for l in out.splitlines() if l.startswith("KERNEL "))
    _, exe, lab_file, runs = line.split(" ")
    assert exe == sys.executable
    assert Path(lab_file).resolve() == (ROOT / "commlab" / "__init__.py").resolve()
    assert Path(runs) == server.runs.resolve()
    assert [k["id"] for k in server.get("/api/kernels")] == [kernel["id"]]

    server.note_processes()
    assert len(server.procs) >= 3, "expected commlab, the server and a kernel"  # the kernel is a process below us
    assert server.stop(signal.SIGTERM) == 0
    assert "commlab notebooks: stopped" in server.output()
    assert_all_gone(server)


def test_stops_on_sigint(server):
    server.request("/api/kernels", "POST", {"name": "python3"})
    assert server.stop(signal.SIGINT) == 0
    assert_all_gone(server)


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert main(["notebooks", "--port", "70000", "--no-browser"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--port" in err and "65535" in err and len(err.splitlines()) == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["notebooks", "--port", str(s.getsockname()[1]), "--no-browser"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is in use" in err and len(err.splitlines()) == 1


def test_argv_binds_loopback_and_kernelspec_is_this_python():
    argv = jupyter.lab_argv(8888)
    assert "--ServerApp.ip=127.0.0.1" in argv and "--ServerApp.port_retries=0" in argv
    assert f"--ServerApp.root_dir={ROOT / 'notebooks'}" in argv
    assert not any("token" in a.lower() for a in argv)  # the token travels in the environment, not in ps
    assert jupyter.kernelspec()["argv"][:3] == [sys.executable, "-m", "ipykernel_launcher"]
