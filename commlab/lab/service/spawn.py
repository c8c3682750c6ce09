"""Detached processes (run supervisors, sweeps) at normal priority, even when asked for by the UI's server.

``commlab app`` runs its Streamlit server at a lower CPU priority (``nice`` ``APP_NICE``): reading a run's
files, building figures and answering the browser every refresh then take a small share of the
cores while training ranks are busy (all of what they leave idle), instead of competing with them on
equal terms (docs/explanation/presets.md,
"Watching a run"). A process inherits its parent's nice value, and an unprivileged one can never lower it again,
so the runs and sweeps that the UI starts must not be children of the server: ``commlab app``'s own
process, which keeps normal priority, starts them. Where the kernel groups processes by session for
scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in Debian's and many desktop
kernels), a nice value only ranks processes within their session, and every run has a session of its
own: a niced server still took an equal share against a run. So the server gets a session of its own,
and that session's group is niced too (``/proc/self/autogroup``), which is what ranks it below the runs.

``commlab app``'s process listens on a UNIX socket in a private
directory (mode 0700) whose path the server finds in ``$COMMLAB_SPAWNER``; ``spawn_detached`` sends
one JSON request per process (argv, log file, cwd, environment) and gets its pid back. Without the
variable (``streamlit run`` by hand, the CLI, notebooks), or when the app's process is gone,
``spawn_detached`` starts the process itself.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from commlab.lab.base.procs import die_with_parent, refuse_limited_caller

ENV = "COMMLAB_SPAWNER"
APP_NICE = 4
"""How much lower than normal the app's Streamlit server runs (0 = normal, 19 = lowest). Against a run
that keeps both cores busy, a group at nice 4 gets about a quarter of the machine (weights 423 against
1024): a lone viewer's refreshes need far less, and 20 students' pages on the workshop bench about half
a core. At nice 10 (weight 110; 0.2 of a core) the bench's Home page took a median 2.7 s, over its 2 s."""


def _popen(argv: List[str], log: str, cwd: Optional[str], env: Optional[dict]) -> subprocess.Popen:
    env = dict(os.environ if env is None else env)
    env.pop(ENV, None)  # the child starts its own children itself
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=cwd, env=env)


KINDS = ("run", "sweep")
"""What ``spawn_detached`` starts: a run's supervisor (it outlives the app: the run keeps going) or a
background sweep (the app that started it stops it when the app stops)."""


def spawn_detached(argv: List[str], log: os.PathLike, cwd: Optional[os.PathLike] = None,
                   env: Optional[dict] = None, kind: str = "run") -> int:
    """Start ``argv`` in its own session (stdin /dev/null, output appended to ``log``) and return its pid.
    Under ``commlab app`` the app's normal-priority process starts it (see the module docstring) and
    records its ``kind`` (KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} not in {KINDS}")
    log, cwd = str(log), (str(cwd) if cwd is not None else None)
    addr = os.environ.get(ENV)
    if addr:
        try:
            return _ask(addr, {"argv": [str(a) for a in argv], "log": log, "cwd": cwd, "kind": kind,
                               "env": dict(os.environ if env is None else env)})
        except (OSError, ValueError, KeyError):
            pass  # the app's process is gone (or not ours): start it here
    p = _popen(list(argv), log, cwd, env)
    _children.append(p)
    _reap(_children)
    return p.pid


_children: List[subprocess.Popen] = []


def _reap(children: List[subprocess.Popen]) -> None:
    """Collect finished children (no zombies left behind); running ones are kept, never signalled."""
    children[:] = [p for p in children if p.poll() is None]


def _ask(addr: str, req: dict) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(addr)
        s.sendall(json.dumps(req).encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data)
    if "error" in reply:
        raise OSError(reply["error"])
    return int(reply["pid"])


class Spawner:
    """The app's side: a thread that starts what ``spawn_detached`` asks for, at this process's priority.

        with Spawner(start=False) as sp:
            server = subprocess.Popen(argv, env={**os.environ, ENV: sp.address}, start_new_session=True,
                                      preexec_fn=lower_priority)
            sp.start()
            server.wait()
    """

    def __init__(self, start: bool = True):
        self.dir = tempfile.mkdtemp(prefix="commlab-app-")  # mode 0700: only this user can connect
        self.address = str(Path(self.dir) / "spawn.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(16)
        self.sock.settimeout(1.0)
        self.children: List[subprocess.Popen] = []
        self.started: List[int] = []
        """Pids started so far (for tests and logs)."""
        self.kinds: Dict[int, str] = {}
        """pid -> kind (KINDS) of everything started."""
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="commlab-spawner", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Serve requests (they queue on the socket until then: a caller can fork the server first, with no
        thread of ours running during the fork)."""
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            _reap(self.children)
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(30)
                    data = b""
                    while not data.endswith(b"\n"):
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    refuse_limited_caller(conn)
                    req = json.loads(data)
                    kind = req.get("kind", "run")
                    if kind not in KINDS:
                        raise ValueError(f"kind: {kind!r} not in {KINDS}")
                    p = _popen(list(req["argv"]), req["log"], req.get("cwd"), req.get("env"))
                    self.children.append(p)
                    self.started.append(p.pid)
                    self.kinds[p.pid] = kind
                    reply = {"pid": p.pid}
                except Exception as e:  # a bad request must not stop the app
                    reply = {"error": f"{type(e).__name__}: {e}"}
                try:
                    conn.sendall(json.dumps(reply).encode())
                except OSError:
                    pass

    def stop_owned(self, kind: str = "sweep", grace_s: float = 10.0) -> List[int]:
        """End what this spawner started of ``kind`` and is still running: SIGTERM to its process group
        (each was started in a session of its own, so nothing else is in it: a sweep's runs have
        supervisors in sessions of their own and keep going), SIGKILL after ``grace_s``. The pids ended."""
        mine = [p for p in self.children if self.kinds.get(p.pid) == kind and p.poll() is None]
        for p in mine:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in mine:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        _reap(self.children)
        return [p.pid for p in mine]

    def close(self) -> None:
        """Stop listening. What was started keeps running (runs outlive the UI, as before; ``stop_owned``
        ends the sweeps)."""
        self._stop.set()
        self.sock.close()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Spawner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def lower_cpu_priority(n: int = APP_NICE) -> None:
    """Run this process ``n`` nice levels below normal (threads it makes inherit it) and, when it leads
    its own session, that session's scheduling group too (see the module docstring). Raising a nice
    value never needs privileges; without autogroups (the file is absent) the nice value alone ranks it."""
    os.nice(n)
    if os.getsid(0) == os.getpid():
        try:
            Path("/proc/self/autogroup").write_text(str(n))
        except FileNotFoundError:  # a kernel built without autogroups: nothing groups the sessions
            pass


def lower_priority(n: int = APP_NICE) -> None:
    """``preexec_fn`` of the app's server (started in a session of its own): ``lower_cpu_priority``, and
    end with the app's process (a niced server left behind would start runs niced)."""
    lower_cpu_priority(n)
    die_with_parent()
