"""Work done for a viewer that needs the code a spec names, or builds what they asked for, runs here: in a
short-lived child process with limits, never in the process that serves the UI.

    python -m commlab.lab.base.sandbox TASK LIMITS_JSON < spec.json     one JSON object on stdout

Tasks (commlab/engine/preflight.py): ``describe`` (the model's size: the New run form's preview, and a student's
parameter quota), ``parameters`` (each parameter's name and bytes: what the performance model calibrates a
run's timeline with) and ``check`` (a first batch through the model and the loss before a run is queued). A
higher layer adds tasks of its own (``register``): its module is the child's, ``python -m MODULE TASK LIMITS_JSON``,
and runs ``main`` with its own work (commlab.lab.strategy.perfmodel.child: the Performance model page's measurements).

The child is forked by this user's warm server (commlab.lab.base.warm: torch imported already, nothing of the
lab's), in about half a second where a child started cold spends three or four importing torch; where there is
no warm server (``COMMLAB_WARM=0``, or it fails) it is started as a process of this one's. Either way it sets
its limits before it imports the engine or anything the spec names (and torch, started cold): data
(RLIMIT_DATA: the heap and every private writable mapping, so every tensor and buffer it allocates; not the
address space, which a CUDA build of torch passes 2 GiB of with its libraries' code alone), CPU seconds (RLIMIT_CPU), open files (RLIMIT_NOFILE), the size of a file
it writes (RLIMIT_FSIZE), no core files, no new processes (RLIMIT_NPROC, which binds every user but root),
one thread (OMP_NUM_THREADS and torch.set_num_threads), with the Hugging Face hub switched off (it needs no
network). It runs in a session and process group of its own, which the parent kills at the wall-clock
limit and again when the child ends (whatever it started goes with it). Its answer is one JSON object on
its own stdout; what the code prints goes to its stderr, which is dropped. A limit it hits is one line
naming it: "preview: took more than 30 s", "preview: more than 2 GiB of memory".

Children are bounded: at most ``MAX_CHILDREN`` at once in one server process; more wait up to ``WAIT_S``
for a place, then are refused with a message (``Busy``). Who takes a free place is the installed gate's
(``install_gate``): the first to ask, in a lab without a room; in a room, the person who has had the least
child time lately, one child per person, each person's child time bounded (commlab.room.places).

This module imports only the standard library at its top, so the child's limits come first. The warm server
and the app's spawner (commlab.lab.service.spawn) refuse a caller that may not start processes (this child): it
cannot ask them for what its limits deny it (commlab.lab.base.procs.refuse_limited_caller).
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

REPO = Path(__file__).resolve().parents[3]  # the source tree (commlab/lab/base/paths.py SOURCE; this module imports only the standard library)


@dataclass(frozen=True)
class Limits:
    wall_s: float
    """Wall-clock seconds before the child's process group is killed."""
    cpu_s: int
    """CPU seconds (RLIMIT_CPU): SIGXCPU at this many, SIGKILL a few later."""
    memory: int
    """Bytes of data (RLIMIT_DATA): what the child allocates; its libraries' code is not counted."""
    files: int = 256
    """Open files (RLIMIT_NOFILE)."""
    file_size: int = 256 << 20
    """The largest file it may write (RLIMIT_FSIZE): the data cache of a shipped data set fits."""


PREVIEW = Limits(wall_s=30.0, cpu_s=20, memory=2 << 30)
"""A model's size for the New run form (the lab's own models are counted on the meta device: no weights).
About 0.5 s here forked warm, 4 s started cold (most of it importing torch); the wall-clock limit leaves room
for a machine whose cores train runs at a higher priority."""
CHECK = Limits(wall_s=60.0, cpu_s=60, memory=4 << 30)
"""A first batch through a model from outside the zoo, before its run is queued."""
LABELS = {"describe": "preview", "parameters": "preview", "check": "check"}
"""Each task's name in its errors ("preview: took more than 30 s"); ``register`` adds a higher layer's."""
MODULE = "commlab.lab.base.sandbox"
_MODULES: Dict[str, str] = {}
"""A registered task -> the module its child runs (``python -m``); this module's own tasks are not in it."""
MAX_CHILDREN = 2
"""Children running at once in one server process, for every viewer together."""
WAIT_S = 10.0
"""How long a request waits for one of the server's children to be free before it is refused."""
CHECK_WAIT_S = PREVIEW.wall_s + WAIT_S
"""How long a submit's check waits for a place: it goes before every waiting preview, so one running child
ending is all it waits for, and the longest a preview may run is PREVIEW.wall_s."""
MAX_ANSWER = 1 << 20
"""The most bytes of a child's answer that are read."""
TEMP_SUFFIX = ".commlab-sandbox"


class SandboxError(ValueError):
    """A child's failure as one line, ``<label>: <problem>``; ``path`` and ``msg`` as a SpecError's (the field
    the problem belongs to, or the task's label)."""

    def __init__(self, path: str, msg: str):
        self.path, self.msg = path, msg
        super().__init__(f"{path}: {msg}" if path else msg)


class Busy(SandboxError):
    """No child could be started now (the server's are all busy): not an answer about the spec."""


class TimedOut(SandboxError):
    """The child ran out of wall-clock time: on a loaded machine that says more about the machine than about
    the spec, so it is not kept as the spec's answer."""


def register(task: str, label: str, module: str) -> None:
    """Run ``task`` in a child of ``module`` (``python -m module TASK LIMITS_JSON``, whose ``__main__`` calls
    ``main(work=...)``); its errors start with ``label``. The module imports only this one and the standard
    library at its top, so the child's limits still come before anything else."""
    LABELS[task] = label
    _MODULES[task] = module


# --------------------------------------------------------------------------- the parent's side

SERVER = threading.BoundedSemaphore(MAX_CHILDREN)
"""The server's places: held while a child runs."""


@contextlib.contextmanager
def _first_free(task: str, who, label: str, limits: Limits, wait_s: float):
    """The gate of a lab without a room: the next free place, within ``wait_s`` (else Busy), for whoever asks."""
    if not SERVER.acquire(timeout=wait_s):
        raise Busy(label, f"all {MAX_CHILDREN} of the server's places for previews and checks are taken; "
                          "try again in a moment")
    try:
        yield
    finally:
        SERVER.release()


_gate = _first_free


def install_gate(gate) -> None:
    """Install who takes the server's places: ``gate(task, who, label, limits, wait_s)``, a context manager
    held while ``who``'s child runs, which may refuse (a SandboxError) before it starts. A room installs
    one that is fair over people and bounds each one's child time (commlab.room.places); ``SERVER``
    still bounds the children of the whole process."""
    global _gate
    _gate = gate


def run(task: str, spec: dict, limits: Limits = PREVIEW, who=None, wait_s: Optional[float] = None) -> dict:
    """``task`` on ``spec`` (a spec dict) in a child with ``limits``, for ``who`` (a name or a user, for the
    installed gate; None: whoever this process acts for); its answer. A SpecError-like ``SandboxError``
    (``path``, ``msg``) for a bad spec or a limit hit, ``TimedOut`` past the wall-clock limit, ``Busy`` when no
    place for the child came within ``wait_s`` (default WAIT_S), or what the installed gate refuses."""
    label = LABELS[task]
    wait_s = WAIT_S if wait_s is None else wait_s
    with _gate(task, who, label, limits, wait_s):
        return _spawn(task, spec, limits)


def child_env() -> dict:
    """The child's environment: this process's, with the modules this process can import on PYTHONPATH
    (the teacher's packages included), one thread, and no network wanted."""
    prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    paths = [str(REPO)] + [p for p in sys.path if p and os.path.isdir(p) and not p.startswith(prefixes)]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def _spawn(task: str, spec: dict, limits: Limits) -> dict:
    label = LABELS[task]
    args = [task, json.dumps(asdict(limits))]
    module = _MODULES.get(task, MODULE)
    with tempfile.TemporaryDirectory(suffix=TEMP_SUFFIX) as d:
        inp, out = Path(d) / "spec.json", Path(d) / "answer.json"
        inp.write_text(json.dumps(spec))
        out.touch()
        child = warm_child(module, args, inp, out)
        if child is not None:
            timed_out = not child.ended(limits.wall_s)
            _kill_group(child.pid)  # before the server reaps it: its group id cannot have been given to anyone else
            child.ended(None)  # its end, once killed
            child.release(reaped_s=5.0)  # reaped when this returns, as a child of this process's would be
            code = child.returncode
        else:
            with open(inp, "rb") as stdin, open(out, "wb") as stdout:
                p = subprocess.Popen([sys.executable, "-m", module, *args], stdin=stdin, stdout=stdout,
                                     stderr=subprocess.DEVNULL, env=child_env(), cwd=os.getcwd(),
                                     start_new_session=True, close_fds=True)
            timed_out = not _ended(p.pid, time.monotonic() + limits.wall_s)
            _kill_group(p.pid)  # before the child is reaped: its group id cannot have been given to anyone else
            code = p.wait()
        if timed_out:
            raise TimedOut(label, f"took more than {limits.wall_s:g} s")
        with open(out, "rb") as f:
            raw = f.read(MAX_ANSWER)
    return _answer(label, code, raw, limits)


def warm_child(module: str, args: list, inp: Path, out: Path):
    """``python -m MODULE ARGS`` (stdin from ``inp``, stdout to ``out``, this process's environment and folder, as
    ``child_env`` gives them) forked by this user's warm server (commlab.lab.base.warm: torch imported already,
    nothing of the lab's or of what the spec names), or None where there is none (the caller then starts a process
    of its own, or does the work itself: commlab.lab.base.specs.admit_spec)."""
    from commlab.lab.base import warm  # lazy: the child's own run of this module imports the standard library alone first
    server = warm.ready()
    return server and warm.start_module(server, module, args, child_env(), str(inp), str(out))


def _ended(pid: int, deadline: float) -> bool:
    """Wait, without reaping it, until the child ends (True) or the deadline passes (False)."""
    delay = 0.005
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already: nothing left to stop
        pass


def _answer(label: str, code: int, raw: bytes, limits: Limits) -> dict:
    if code < 0:
        sig = -code
        if sig == signal.SIGXCPU:
            raise SandboxError(label, f"used more than {limits.cpu_s} s of CPU")
        if sig == signal.SIGXFSZ:
            raise SandboxError(label, f"wrote a file of more than {limits.file_size >> 20} MiB")
        raise SandboxError(label, f"the child process died ({signal.Signals(sig).name})")
    try:
        got = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        got = None
    if not isinstance(got, dict):
        raise SandboxError(label, f"the child process gave no answer (exit status {code})")
    if got.get("limit") == "memory":
        raise SandboxError(label, f"more than {limits.memory / 2**30:g} GiB of memory")
    if "error" in got:
        path, msg = got["error"]
        raise SandboxError(str(path) or label, str(msg).splitlines()[0] if str(msg) else "failed")
    return got["ok"]


# --------------------------------------------------------------------------- the child's side

def _limit(limits: Limits) -> None:
    """Every limit, in this process, before anything else is imported (called first by ``main``)."""
    # not RLIMIT_AS: a CUDA build of torch maps more than 2 GiB of library code on import (seen on an H100
    # machine: every preview failed), while RLIMIT_DATA still stops any allocation past the limit
    for which, n in ((resource.RLIMIT_DATA, limits.memory),
                     (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5)), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_NOFILE, limits.files), (resource.RLIMIT_FSIZE, limits.file_size),
                     (resource.RLIMIT_NPROC, 0)):
        soft, hard = n if isinstance(n, tuple) else (n, n)
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:  # a limit is only ever lowered
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))


def main(argv=None, work=None) -> int:
    """The child: ``work(task, input)`` (default: this module's tasks) under the limits, its answer on stdout."""
    argv = sys.argv[1:] if argv is None else argv
    task, limits = argv[0], Limits(**json.loads(argv[1]))
    _limit(limits)
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the spec's code prints goes to stderr (dropped), never into the answer
    try:
        result = {"ok": (work or _work)(task, json.load(sys.stdin))}
    except MemoryError:
        result = {"limit": "memory"}
    except BaseException as e:  # the spec's code may fail in any way: the parent gets one line
        result = _failure(e)
    answer.write(json.dumps(result))
    answer.flush()
    return 0


def _work(task: str, data: dict) -> dict:
    # imported here, not at the top: only after main has set the limits
    import torch
    torch.set_num_threads(1)
    from commlab.engine import preflight
    from commlab.engine.spec import JobSpec  # lazy: the child's limits come before anything of the lab
    spec = JobSpec.from_dict(data)  # imports what the spec names: in this child, that is the point
    return {"describe": preflight.describe, "parameters": preflight.parameters, "check": preflight.check}[task](spec)


def _failure(e: BaseException) -> dict:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text):
        return {"limit": "memory"}
    path, msg = getattr(e, "path", None), getattr(e, "msg", None)
    if isinstance(e, ValueError) and isinstance(path, str) and isinstance(msg, str):  # a SpecError
        return {"error": [path, msg]}
    return {"error": ["", f"{type(e).__name__}: {text}" if text else type(e).__name__]}


if __name__ == "__main__":
    sys.exit(main())
