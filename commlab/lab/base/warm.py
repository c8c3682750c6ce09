"""Warm ranks: a per-user server that has imported torch once and forks each rank of a one-machine run.

A rank spends about 2.5 s of CPU importing before it does anything: torch itself (1.0 s) and ``torch._dynamo``
(1.4 s), which every ``torch.optim`` optimizer imports on its first step. A two-rank run paid that twice, every
time. The warm server pays it once: it imports torch and ``torch._dynamo`` (nothing of the lab's or the
engine's, so edited code is always read fresh), then waits on a UNIX socket; for each rank the launcher asks
for, it forks a child that takes the launcher's environment, working directory, log file and priority, and
runs ``python -m commlab.engine.worker --run-dir DIR`` as if started so. A rank then starts in milliseconds. A
fault-tolerant run of your own script (``commlab run --script``) asks for ``python SCRIPT ARGS`` instead: the
child runs the script as ``__main__`` with its argv and its folder first on ``sys.path``, as Python would (torch
and ``torch._dynamo`` already imported, which a script's own ``import torch`` then finds). The limited child of
commlab.lab.base.sandbox (a model's preview, a spec's check) asks for ``python -m MODULE ARGS`` with its stdin and
stdout in files, and so does ``commlab run``'s check of its spec (commlab.lab.base.specs.admit_spec); a caller that
may not start processes itself (that child, RLIMIT_NPROC 0) is refused.

What a rank started by the launcher had, a warm rank has too:

- its own session (``killpg`` stops it), its output appended to the run's log, stdin ``/dev/null``;
- it ends with the launcher: the server SIGKILLs a rank whose launcher's connection closes before the rank
  has ended (a ``kill -9`` of ``commlab run``), as the parent-death signal did; ranks die with the server;
- its exit code (a signal as ``-N``) reaches the launcher, and so does its CPU time: the server reports the
  rank's end while it is still a zombie (its CPU still in ``/proc``) and reaps it only when the launcher has
  read the report, so the run's own CPU (``commlab.lab.rundir.disturbance``) never drops out between two samples.

The server is started on demand (``ready``), under a lock, by the first launcher that needs it, in a session
of its own with its output in its directory (never a caller's terminal or pipe); it listens in a directory
only its user can enter (mode 0700, checked), one per interpreter and torch build, and exits when it has had
nothing to do for ``IDLE_S``. It serves nothing, and the launcher starts its ranks as processes of its own,
when: ``COMMLAB_WARM=0``, torch started a thread or CUDA while importing (forking would not be safe), the
caller runs at a higher priority than the server (a rank cannot be made faster than its parent), or
anything about the server fails.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import io
import json
import os
import random
import runpy
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

from commlab.lab.base.paths import SOURCE
from commlab.lab.base.procs import WARM_MARK, limit_data, refuse_limited_caller
from commlab.lab.base.procs import __file__ as procs_file

ENV = "COMMLAB_WARM"
"""``0`` turns warm ranks off (every rank a process of the launcher's own)."""
IDLE_S = 120.0
"""The server exits after this long with no rank running and no request (``COMMLAB_WARM_IDLE_S`` in the
environment of the launcher that starts it says otherwise)."""
START_S = 60.0
"""How long a launcher waits for a server it started to be ready."""
PRELOAD = ("torch", "torch._dynamo")
READY = "warm: pid "
"""How the line the server writes to its log when it serves begins: ``warm: pid N serving SOCKET``."""
MARK = WARM_MARK
"""In every warm rank's command line (the server's): ``procs.kill_if_ours`` knows a warm rank by it."""


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "", "off", "false")


def _key(nice: int) -> str:
    """One server per interpreter, torch build, version of this file and of commlab.lab.base.procs (its ranks'
    memory limit), and priority: a server runs at the priority of whoever started it and serves no caller of a
    higher one, so a niced caller (the UI's server, for its previews) never starts the server the runs' launchers
    use; it uses that one where it runs."""
    spec = importlib.util.find_spec("torch")
    parts = [sys.executable] + ([f"nice {nice}"] if nice else [])
    for p in (spec.origin if spec else "", __file__, procs_file):
        with contextlib.suppress(OSError):
            parts.append(str(os.stat(p).st_mtime_ns))
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:12]


def home() -> Path:
    """This user's directory of servers: made 0700, and refused unless it is a directory of this user's
    that nobody else may enter (a shared /tmp)."""
    d = Path(tempfile.gettempdir()) / f"commlab-warm-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        d.mkdir(mode=0o700)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{d}: not a private directory of this user's")
    return d


# --------------------------------------------------------------------------- the launcher's side

class WarmRank:
    """A rank the server forked, as the launcher sees it: what it uses of ``subprocess.Popen`` (``pid``,
    ``returncode``, ``poll``, ``wait``), plus ``ticks``, the CPU it used (clock ticks, with what it reaped),
    known once it has ended."""

    def __init__(self, conn: socket.socket, pid: int, buf: bytes = b""):
        self.conn, self.pid, self.buf = conn, pid, buf
        self.returncode: Optional[int] = None
        self.ticks = 0

    def _read(self, timeout: Optional[float], ack: bool = True) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            r, _, _ = select.select([self.conn], [], [], left)
            if not r:
                return
            try:
                chunk = self.conn.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:  # the server is gone: its ranks died with it (parent-death signal)
                self._ended(-signal.SIGKILL, 0)
                return
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        self.returncode, self.ticks = int(msg["exit"]), int(msg.get("ticks", 0))
        if ack:
            self.release()

    def _ended(self, code: int, ticks: int) -> None:
        self.returncode, self.ticks = code, ticks
        with contextlib.suppress(OSError):
            self.conn.close()

    def release(self, reaped_s: float = 0.0) -> None:
        """Let the server reap the ended child (until then its process group id is nobody else's); with
        ``reaped_s``, wait up to that long for it to have done so (it closes the connection once it has)."""
        with contextlib.suppress(OSError):
            self.conn.sendall(b"ack\n")
            deadline = time.monotonic() + reaped_s
            while reaped_s and time.monotonic() < deadline:
                r, _, _ = select.select([self.conn], [], [], max(0.0, deadline - time.monotonic()))
                if r and not self.conn.recv(64):
                    break
        self._ended(self.returncode, self.ticks)

    def ended(self, timeout: Optional[float]) -> bool:
        """Whether the child ended within ``timeout`` s (None: waits for it), its end read but the child not yet
        reaped (``release``)."""
        if self.returncode is None:
            self._read(timeout, ack=False)
        return self.returncode is not None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(["commlab.engine.worker"], timeout)
        return self.returncode


@contextlib.contextmanager
def _address(path) -> str:
    """A UNIX socket address for ``path`` however long its directory's name (an address holds 107 bytes):
    the name under ``/proc/self/fd/N``, N an open descriptor of the directory."""
    path = Path(path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _connect(path: Path, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        with _address(path) as addr:
            s.connect(addr)
    except OSError:
        s.close()
        raise
    return s


_started: List[subprocess.Popen] = []


def ready() -> Optional[Path]:
    """The socket of a ready server (started, and waited for, when none answers), or None when warm ranks
    are off or no server can be had. A launcher asks before it starts sampling the machine: a server's
    start-up is nobody's run."""
    if not enabled():
        return None
    _started[:] = [p for p in _started if p.poll() is None]  # reap servers of ours that have exited
    nice = os.nice(0)
    try:
        d = home()
        if nice > 0:  # a niced caller uses a server at normal priority where one runs (its forks are niced to it)
            with contextlib.suppress(OSError):
                sock = d / f"{_key(0)}.sock"
                _connect(sock, 2.0).close()
                return sock
        return _server(d, _key(nice))
    except OSError as e:
        print(f"commlab: warm ranks unavailable ({e}); starting the ranks as processes", file=sys.stderr)
        return None


def _server(d: Path, key: str) -> Path:
    """The socket of a ready server, started (and waited for) under a lock when none answers."""
    sock = d / f"{key}.sock"
    with open(d / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _connect(sock, 2.0).close()
            return sock
        except OSError:
            pass
        with open(d / f"{key}.log", "ab") as log:
            env = {k: v for k, v in os.environ.items() if k != ENV}
            env["OMP_NUM_THREADS"] = "1"  # read when torch is imported; every rank sets its own threads
            env["PYTHONPATH"] = str(SOURCE) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            p = subprocess.Popen([sys.executable, "-m", MARK, str(sock)], stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True, cwd="/", env=env)
            _started.append(p)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise OSError(f"the warm server exited with code {p.returncode}; see {d / (key + '.log')}")
            try:
                _connect(sock, 2.0).close()
                return sock
            except OSError:
                time.sleep(0.05)
        raise OSError(f"the warm server was not ready after {START_S:.0f} s")


def start(sock: Path, jobs: List[tuple], log: str, cwd: Optional[str] = None,
          memory: Optional[int] = None) -> Optional[List[WarmRank]]:
    """Start every ``(argv, env)`` of ``commlab.lab.base.torchrun.direct_ranks`` as a warm rank (``env`` the whole
    environment) through the server at ``sock``, or None when that fails (the launcher then starts them
    itself); the ranks already started are killed first. ``memory``: MB of data each rank may use
    (procs.limit_data, set in the forked child before the worker runs). An ``argv`` without ``--run-dir`` is
    ``[python, SCRIPT, ARGS...]``: the child runs that script, from ``cwd``."""
    started: List[WarmRank] = []
    cwd = cwd or os.getcwd()
    try:
        for argv, env in jobs:
            if "--run-dir" in argv:  # python -m commlab.engine.worker --run-dir DIR
                what = {"module": [argv[argv.index("-m") + 1], "--run-dir",
                                   os.path.abspath(argv[argv.index("--run-dir") + 1])]}
            else:
                what = {"script": argv[1:]}  # the script's path as given, from cwd
            # paths made absolute here: the server's own working directory is "/"
            started.append(_ask(sock, {**what, "env": env, "cwd": cwd, "log": os.path.abspath(log),
                                       "memory": memory}))
        return started
    except (OSError, ValueError, KeyError) as e:
        print(f"commlab: warm ranks failed to start ({e}); starting the ranks as processes", file=sys.stderr)
        for r in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.wait(10)
        return None


def start_module(sock: Path, module: str, args: List[str], env: dict, stdin: str, stdout: str,
                 cwd: Optional[str] = None) -> Optional[WarmRank]:
    """``python -m MODULE ARGS`` forked warm, its stdin read from the file ``stdin``, its stdout written to the file
    ``stdout`` and its stderr dropped (the limited child of commlab.lab.base.sandbox), or None when that fails
    (the caller then starts a process of its own)."""
    try:
        return _ask(sock, {"module": [module, *args], "env": env, "cwd": cwd or os.getcwd(), "log": os.devnull,
                           "stdin": os.path.abspath(stdin), "stdout": os.path.abspath(stdout), "memory": None})
    except (OSError, ValueError, KeyError) as e:
        print(f"commlab: warm child failed to start ({e}); starting it as a process", file=sys.stderr)
        return None


def _ask(sock: Path, req: dict) -> WarmRank:
    """One child forked by the server for ``req``, at this process's priority."""
    s = _connect(sock, 10.0)
    try:
        s.sendall(json.dumps({**req, "nice": os.nice(0)}).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(4096)
            if not chunk:
                raise OSError("the warm server closed the connection")
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        reply = json.loads(line)
        if "pid" not in reply:
            raise OSError(reply.get("error", "no pid"))
    except BaseException:
        s.close()
        raise
    s.settimeout(None)
    return WarmRank(s, int(reply["pid"]), buf)


# --------------------------------------------------------------------------- the server

def _ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of a (zombie) child, from /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            f_ = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
        return sum(int(x) for x in f_[11:15])
    except (OSError, ValueError, IndexError):
        return 0


class Server:
    def __init__(self, path: str, idle_s: float = IDLE_S):
        self.path, self.idle_s = path, idle_s
        self.base_path = [p for p in sys.path if p not in ("", os.getcwd())
                          and p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        self.conns: Dict[socket.socket, bytes] = {}
        self.children: Dict[int, socket.socket] = {}
        """pid -> the launcher's connection, until the launcher has read the rank's end"""
        self.reported: Dict[int, bool] = {}
        self.nice = os.nice(0)

    def run(self) -> int:
        tmp = f"{self.path}.{os.getpid()}"
        self.listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _address(tmp) as addr:
            self.listen.bind(addr)
        self.listen.listen(64)
        os.replace(tmp, self.path)  # ready: a client that connects is served at once
        ino = os.stat(self.path).st_ino
        idle_since = time.monotonic()
        while True:
            self._reap_ended()
            if self.children or self.conns:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > self.idle_s:
                with contextlib.suppress(OSError):
                    if os.stat(self.path).st_ino == ino:  # still ours (a newer server may have replaced it)
                        os.unlink(self.path)
                return 0
            r, _, _ = select.select([self.listen, *self.conns, *self.children.values()], [], [], 0.1)
            for s in r:
                if s is self.listen:
                    conn, _ = self.listen.accept()
                    self.conns[conn] = b""
                elif s in self.conns:
                    self._request(s)
                else:
                    self._from_launcher(s)

    def _request(self, conn: socket.socket) -> None:
        try:
            chunk = conn.recv(1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            del self.conns[conn]
            conn.close()
            return
        self.conns[conn] += chunk
        if b"\n" not in self.conns[conn]:
            return
        line = self.conns.pop(conn).split(b"\n", 1)[0]
        try:
            req = json.loads(line)
            if int(req["nice"]) < self.nice:
                raise ValueError(f"the caller runs at nice {req['nice']}, this server at {self.nice}")
            refuse_limited_caller(conn)
            pid = os.fork()
            if pid == 0:
                self._child(req)  # never returns
            self.children[pid] = conn
            self.reported[pid] = False
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except Exception as e:  # a bad request must not stop the server
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
            conn.close()

    def _reap_ended(self) -> None:
        for pid in list(self.children):
            if self.reported[pid]:
                continue
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = None
                self._forget(pid)
                continue
            if info is None:
                continue
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            self.reported[pid] = True
            try:
                self.children[pid].sendall(json.dumps({"exit": code, "ticks": _ticks(pid)}).encode() + b"\n")
            except OSError:
                self._forget(pid)

    def _from_launcher(self, conn: socket.socket) -> None:
        pid = next(p for p, c in self.children.items() if c is conn)
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if data and not self.reported[pid]:
            return  # nothing is expected before the end
        if not self.reported[pid]:  # the launcher is gone while its rank runs: the rank goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self._forget(pid)

    def _forget(self, pid: int) -> None:
        """Reap (waiting for it to end if it has not) and drop the launcher's connection."""
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        conn = self.children.pop(pid, None)
        self.reported.pop(pid, None)
        if conn is not None:
            conn.close()

    def _child(self, req: dict) -> None:
        code = 1
        try:
            os.setsid()
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            for s in (self.listen, *self.conns, *self.children.values()):
                s.close()
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            if req.get("stdout"):
                fd = os.open(req["stdout"], os.O_WRONLY | os.O_TRUNC)
                os.dup2(fd, 1)
                os.close(fd)
            fd = os.open(req.get("stdin") or os.devnull, os.O_RDONLY)
            os.dup2(fd, 0)
            os.close(fd)
            if int(req["nice"]) > self.nice:
                os.nice(int(req["nice"]) - self.nice)
            limit_data(req.get("memory"))  # before the worker runs: a rank's memory limit (a student's rank_mb)
            env = {str(k): str(v) for k, v in req["env"].items()}
            os.environ.clear()
            os.environ.update(env)
            os.chdir(req["cwd"])
            extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            script = req.get("script")
            first = os.path.dirname(os.path.realpath(script[0])) if script else os.getcwd()
            sys.path[:] = [first, *extra, *self.base_path]
            sys.stdin = open(0, "r", closefd=False)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
            random.seed()
            for name in [m for m in sys.modules if m.split(".")[0] in ("commlab", "__mp_main__")]:
                del sys.modules[name]
            if script:  # python SCRIPT ARGS, from cwd: run_path sets argv[0] to the path as given
                sys.argv = list(script)
                runpy.run_path(script[0], run_name="__main__")
            else:  # python -m MODULE ARGS: a rank (commlab.engine.worker) or a limited child
                sys.argv = ["-m", *req["module"][1:]]
                runpy.run_module(req["module"][0], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m commlab.lab.base.warm SOCKET", file=sys.stderr)
        return 2
    for name in PRELOAD:
        __import__(name)
    import torch
    if torch.cuda.is_initialized():
        print("warm: CUDA was initialized while importing; a forked rank could not use it", file=sys.stderr)
        return 1
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        print(f"warm: {threads} threads after importing {PRELOAD}; forking would not be safe", file=sys.stderr)
        return 1
    print(f"{READY}{os.getpid()} serving {argv[0]}", file=sys.stderr, flush=True)
    return Server(argv[0], float(os.environ.get("COMMLAB_WARM_IDLE_S", IDLE_S))).run()


if __name__ == "__main__":
    sys.exit(main())
