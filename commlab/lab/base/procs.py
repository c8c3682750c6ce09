"""Process identity and clean-up, for the processes the lab itself started.

A pid alone can be reused, so the lab records (pid, start time in clock ticks
since boot) and checks both before it calls a process alive or signals it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import struct
import subprocess
import time
from typing import List, Optional

PR_SET_PDEATHSIG = 1


def start_time(pid: int) -> Optional[int]:
    """The process's start time (field 22 of /proc/<pid>/stat), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may contain spaces; fields after it start after the last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    try:
        if fields[0] == "Z":  # a zombie has finished
            return None
        return int(fields[19])
    except (IndexError, ValueError):
        return None


WARM_MARK = "commlab.lab.base.warm"
"""The module of the warm server (commlab.lab.base.warm.MARK): its forked ranks have its command line."""


def identity(pid: Optional[int] = None) -> dict:
    pid = pid or os.getpid()
    return {"pid": pid, "start": start_time(pid)}


def alive(ident: Optional[dict]) -> bool:
    if not ident or not ident.get("pid"):
        return False
    st = start_time(int(ident["pid"]))
    return st is not None and (ident.get("start") is None or st == ident["start"])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_if_ours(ident: Optional[dict], marker: str, sig: int = signal.SIGKILL) -> bool:
    """Signal a process only if it is the one recorded (pid and start time) and its command line names
    ``marker`` (the run directory), or it is a rank forked by the lab's warm server (``commlab.lab.base.warm``,
    whose command line it has): the lab never signals a process it did not start."""
    if not alive(ident):
        return False
    cmd = cmdline(int(ident["pid"]))
    if marker not in cmd and f"-m {WARM_MARK} " not in cmd:
        return False
    try:
        os.kill(int(ident["pid"]), sig)
        return True
    except ProcessLookupError:
        return False


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (prctl PR_SET_PDEATHSIG).
    Used so that a killed launcher does not leave its job running. No-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def refuse_limited_caller(conn: socket.socket) -> None:
    """A ValueError when the process at the other end of UNIX socket ``conn`` (SO_PEERCRED) may not start processes
    (its RLIMIT_NPROC is 0: the limited child of commlab.lab.base.sandbox): a server that starts processes for its
    callers (the warm server, the app's spawner) would otherwise start for it what it may not start itself."""
    pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    try:
        with open(f"/proc/{pid}/limits") as f:
            nproc = next((line.split()[2] for line in f if line.startswith("Max processes")), None)
    except OSError:
        nproc = "0"  # gone, or not readable: not served
    if nproc == "0":
        raise ValueError("the caller may not start processes (a limited child): neither may it ask for one")


def limit_data(mb: Optional[int]) -> None:
    """Bound this process and what it starts to ``mb`` MB of data (RLIMIT_DATA, soft and hard: it cannot be
    raised again); nothing when ``mb`` is None. A limit is only ever lowered. Called in a rank's process
    before it runs (a ``preexec_fn``, or the warm server's forked child).

    RLIMIT_DATA (Linux 4.7 and later) counts the heap and every private writable mapping, so every tensor
    a rank allocates, and not its libraries' code nor the address space merely reserved: glibc's arenas
    reserve 64 MB each before they use it, torch's CPU build maps about 1 GB of address space for 300 MB
    of data, a CUDA build more than 2 GB (commlab.lab.base.sandbox). RLIMIT_AS would count all of that."""
    if mb is None:
        return
    import resource
    n = int(mb) << 20
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        n = min(n, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (n, n))


def stop(procs_: List[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Stop jobs we started in sessions of their own: SIGTERM to each process group
    (torchrun then stops its ranks), SIGKILL after a grace period."""
    live = [p for p in procs_ if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(deadline - time.monotonic(), 0.01))
    for p in live:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
