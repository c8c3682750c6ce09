"""The job queue: a concurrency limit shared by every process that starts runs.

There is no daemon. Each run has a *supervisor*: the process that waits for a
slot, launches torchrun and writes the final status. ``commlab run`` is its
own supervisor; the UI and ``commlab.run(..., wait=False)`` start a detached one
(``python -m commlab.lab.service.supervise``). Slots are ``flock`` locks on files under
``runs/.slots/``: the kernel releases a dead supervisor's lock, so a crash
never leaks a slot. A queued supervisor only tries for a slot when fewer than
``max_jobs`` queued runs come before its own in the queue's order, which is
the lab's admission rule's (commlab.lab.service.admission): first come, first
served; in a room, fair by run time over the runs' owners (commlab.room.policy).

A supervisor that dies (``kill -9``) takes its torchrun with it (parent-death
signal) and leaves its run ``running`` or ``queued``; the next lab command
finds such runs through the recorded (pid, start time) and marks them failed
as stale. Cancel writes ``cancel.request`` into the run directory; the
supervisor sees it within a poll interval in every state.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from commlab.engine import runfiles
from commlab.engine.runfiles import FINAL, UNFINISHED, State
from commlab.lab.base import procs
from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import CONFIG, SLOTS, SOURCE
from commlab.lab.base.specs import load_spec
from commlab.lab.net.netns import NetworkUnavailable, check_shaped_supported
from commlab.lab.rundir.index import Index, RunIndexError
from commlab.lab.rundir.launcher import kill_strays, launch
from commlab.lab.rundir.progress import quiet
from commlab.lab.rundir.store import Run, RunError, RunStore, lab_config
from commlab.lab.service.admission import Admission
from commlab.lab.service.spawn import spawn_detached
from commlab.lab.strategy import auto, ftsearch
from commlab.lab.strategy.auto import keep_record

POLL_S = 0.2
BACK_POLL_S = 1.0
"""How often a queued supervisor further back than ``NEAR`` runs past the free slots checks its place.
Every check reads the whole index (about 3 ms with 90 runs here); at ``POLL_S`` the 60 to 80 supervisors
queued on the workshop bench took most of a core from the one run going."""
NEAR = 2


def default_max_jobs() -> int:
    """One job per GPU on a GPU box; otherwise one per two cores (a job has two ranks by default). torch is
    asked only where its build has a GPU backend (``gpu_build``): importing it costs every detached supervisor
    three seconds of CPU on a small machine, for nothing where the build is for the CPU."""
    if "torch" in sys.modules or gpu_build():
        try:
            import torch
            if torch.cuda.is_available():
                return max(1, torch.cuda.device_count())
        except ImportError:
            pass
    return max(1, (os.cpu_count() or 1) // 2)


def gpu_build(version_text: Optional[str] = None) -> bool:
    """Whether the installed torch is built for CUDA or ROCm, read from its ``torch/version.py`` (``cuda`` or
    ``hip`` set to a version, not None) without importing it; True where the file cannot be read (torch then
    decides), False where torch is not installed."""
    if version_text is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return False
        try:
            version_text = (Path(spec.origin).parent / "version.py").read_text()
        except OSError:
            return True
    found = dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(\S+)", version_text, re.M))
    if set(found) != {"cuda", "hip"}:
        return True
    return any(v != "None" for v in found.values())


class Slots:
    def __init__(self, root: Path, n: int):
        self.dir = Path(root) / SLOTS
        self.n = n

    def try_acquire(self) -> Optional[int]:
        """A held slot's file descriptor, or None when all slots are busy."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for k in range(self.n):
            fd = os.open(self.dir / f"{k}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                os.close(fd)
        return None

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)  # closing the descriptor drops the flock


class Lab:
    """The lab's front door for the CLI, the UI, notebooks and scripts."""

    def __init__(self, runs: Optional[os.PathLike] = None, max_jobs: Optional[int] = None,
                 admission: Optional[Callable[[Path], Admission]] = None):
        """``admission``: the rule that admits runs and orders the queue, made for the runs directory
        (default: the single-user lab's, commlab.lab.service.admission.Admission; a room's: commlab.room.open_lab)."""
        self.store = RunStore(runs, on_change=self._changed)
        self.index = Index(self.store)
        configured = _config_max_jobs(self.store.root)  # read even when overridden: a broken file is reported
        max_ranks(self.store.root)  # so is a bad max_ranks, by every command, not only by the next run's admission
        self.admission = (admission or Admission)(self.store.root)
        self._max_jobs = max_jobs or _env_int("COMMLAB_MAX_JOBS") or configured

    @property
    def max_jobs(self) -> int:
        """Runs at a time: as given, ``COMMLAB_MAX_JOBS``, the runs directory's config, else ``default_max_jobs``
        (counted when first asked: it imports torch, which listing or showing runs does not need)."""
        if not self._max_jobs:
            self._max_jobs = default_max_jobs()
        return self._max_jobs

    def _changed(self, run: Run) -> None:
        """status.json changed: its row in the index too. status.json is the truth and is written already; an
        index that cannot take the row now (locked for long, a full disk) owes it (Index.update), and the
        caller, often a supervisor with a run going, carries on with the reason said on stderr."""
        try:
            self.index.update(run)
        except RunIndexError as e:
            print(f"commlab: index: {run.id}'s row is owed ({e}); status.json has it", file=sys.stderr, flush=True)

    @property
    def root(self) -> Path:
        return self.store.root

    # -- submitting -----------------------------------------------------
    def submit(self, spec, wait: bool = True, progress: bool = False, out=None, sweep: Optional[str] = None,
               owner: Optional[str] = None, wall_limit_s: Optional[float] = None) -> Run:
        """Queue a run (``create``'s arguments). With ``wait`` this process supervises it to the end;
        otherwise a detached supervisor does, and the run is returned at once."""
        run = self.create(spec, sweep=sweep, owner=owner, wall_limit_s=wall_limit_s,
                          supervisor=procs.identity() if wait else None)
        if wait:
            self.supervise(run, progress=progress, out=out)
        else:
            self.spawn_supervisor(run)
        return run

    def create(self, spec, sweep: Optional[str] = None, run_id: Optional[str] = None, owner: Optional[str] = None,
               wall_limit_s: Optional[float] = None, say: Optional[Callable[[str], None]] = None,
               supervisor: Optional[dict] = None, ranks_here: Optional[int] = None, look_for_stale: bool = True) -> Run:
        """A new queued run directory (nothing runs until a supervisor takes it), as the lab's admission rule
        admits it (``self.admission.admit``: its owner, default the local user, and its limits, recorded in its
        status; a model or data set from outside the zoo takes one batch first, and ``say`` is told before).
        With ``wall_limit_s`` its supervisor cancels it after that many seconds of running (the launcher reads
        it from the status). ``supervisor``: the identity (procs.identity) of the process that will supervise
        it, when that is known already (``commlab run``). ``ranks_here``: the ranks this machine's launcher starts,
        at most ``max_ranks``: all of them (None), this node's share of a multi-machine run, or 0 where another
        launcher started them (a job torchrun or srun started, your own loop). ``look_for_stale``: first mark
        failed the runs whose supervisor died (``recover_stale``, every run's status); a caller that looked at
        the runs it cares about itself passes False."""
        problem = too_many_ranks(self.root, spec.world_size if ranks_here is None else ranks_here)
        if problem:
            raise LabError(f"world_size: {problem}")
        if spec.network.link == "shaped":
            try:
                check_shaped_supported()
            except NetworkUnavailable as e:
                raise LabError(f"network.link: {e}") from None
        queued = self.admission.admit(spec, owner, say)
        if look_for_stale:
            self.recover_stale()
        return self.store.create(spec, run_id, **queued, sweep=sweep or None,
                                 wall_limit_s=float(wall_limit_s) if wall_limit_s else None, supervisor=supervisor)

    def spawn_supervisor(self, run: Run) -> int:
        argv = [sys.executable, "-m", self.admission.supervisor, "--runs", str(self.root.resolve()), run.id]
        # at normal priority even when the UI's (niced) server asks for it: commlab/lab/service/spawn.py
        pid = spawn_detached(argv, run.file(runfiles.SUPERVISOR_LOG), cwd=SOURCE,
                             env={**os.environ, "COMMLAB_MAX_JOBS": str(self.max_jobs)})
        # recorded here too, so the run is never without a live owner between spawn and its first status write
        run.mark_queued(supervisor=procs.identity(pid))
        return pid

    def supervise(self, run: Run, progress: bool = False, out=None) -> str:
        """Wait for a slot, run the job, write its final status. Returns the final state."""
        run.mark_queued(supervisor=procs.identity())
        out = quiet(out)  # a closed pipe silences the progress; the run goes on (commlab/lab/rundir/progress.py)
        slot = None
        shown = False
        try:
            while slot is None:
                if run.cancel_requested():
                    run.mark_cancelled("cancelled while queued")
                    return State.CANCELLED
                # the spec was checked when the run was admitted (create): a supervisor reads spec.json as it is,
                # without torch or the registries, so a room's 60 queued supervisors cost the run going nothing
                place = self.queue_position(run, upto=self.max_jobs + NEAR)
                if place < self.max_jobs:
                    slot = Slots(self.root, self.max_jobs).try_acquire()
                if slot is None:
                    if progress and not shown:
                        print(f"queued: waiting for a free slot ({self.max_jobs} at a time)",
                              file=out, flush=True)
                        shown = True
                    time.sleep(POLL_S if place < self.max_jobs + NEAR else BACK_POLL_S)
            phase = "strategy auto"
            try:
                record = self._resolve_strategy(run, progress, out)
                phase = "the buckets' search"  # a tuning schedule under fault tolerance (ftsearch)
                ftsearch.choose_partition(self, run, say=_say(progress, out), should_cancel=run.cancel_requested)
            except (LabError, ValueError, OSError) as e:  # said in the run's status, as a rank's failure is
                if run.cancel_requested():
                    run.mark_cancelled(f"cancelled during {phase}")
                    return State.CANCELLED
                why = str(e) if isinstance(e, LabError) else f"{type(e).__name__}: {e}"
                run.mark_failed(f"{phase}: {why}".splitlines()[0])
                return State.FAILED
            # the launcher stops the run on a cancel request or past its wall-time quota (wall_limit_s)
            state = launch(run, progress=progress, out=out, should_cancel=run.cancel_requested)
            if record is not None:
                keep_record(run, record)
            return state
        except KeyboardInterrupt:  # Ctrl-C while queued or choosing: the user stopped it, nothing broke
            if run.state not in FINAL:
                run.mark_cancelled("cancelled by the user (Ctrl-C)")
            raise
        except BaseException as e:
            if run.state not in FINAL:
                run.mark_failed(f"launcher error: {type(e).__name__}: {e}")
            raise
        finally:
            if slot is not None:
                Slots.release(slot)

    def _resolve_strategy(self, run: Run, progress: bool, out) -> Optional[dict]:
        """``strategy: auto``: the advisor chooses in this slot before the ranks start (commlab/lab/strategy/auto.py); returns
        its record for tuning.json, None for a fixed strategy."""
        st = run.spec().strategy
        if st.mode != "auto" or st.decided:
            return None
        auto.resolve_auto(self, run, should_cancel=run.cancel_requested, say=_say(progress, out))
        return auto.read_record(run)

    def queue_position(self, run: Run, upto: Optional[int] = None) -> int:
        """How many queued runs with a live supervisor come before ``run`` in the queue's order
        (the admission rule's ``order``), counted up to ``upto`` (default
        ``max_jobs``: all a supervisor needs to know, and it keeps polling cheap for long queues)."""
        upto = self.max_jobs if upto is None else upto
        everything = self.index.query()
        queued = [r for r in everything if r["state"] == "queued"]
        if run.id not in {r["id"] for r in queued}:  # the index lags the run's own file: count it as queued
            queued.append({"id": run.id, "created": run.status().get("created", 0), "owner": run.status().get("owner")})
        n = 0
        for rid in self.admission.order(queued, everything):
            if rid == run.id or n >= upto:
                break
            if procs.alive(self.store.get(rid).status().get("supervisor")):
                n += 1
        return n

    def running(self) -> int:
        return len(self.index.query(state="running"))

    # -- control ----------------------------------------------------------
    def cancel(self, run_id: str) -> str:
        """Ask a run to stop, in any state. Returns the state after the request."""
        run = self.store.get(run_id)
        state = run.state
        if state in FINAL:
            return state
        run.file(runfiles.CANCEL).write_text(f"{time.time()}\n")
        if not procs.alive(run.status().get("supervisor")):
            kill_strays(run)
            # only_from: a launcher that ended meanwhile keeps the final state it wrote
            return run.mark_cancelled("cancelled (no live launcher)", only_from=UNFINISHED)["state"]
        return state

    def runner(self) -> Callable[..., Run]:
        """A spec dict -> its finished Run, through this lab's queue (it waits for a slot like any run): how
        the performance model measures a profile and the advisor its trials. ``prepare(run)``, when given,
        writes into the run's directory before it starts (a trial session's trials)."""
        def run(spec: dict, prepare: Optional[Callable[[Run], object]] = None) -> Run:
            r = self.create(load_spec(data=spec))
            if prepare is not None:
                prepare(r)
            self.supervise(r)
            return r
        return run

    def wait(self, run_id: str, timeout: Optional[float] = None) -> str:
        run = self.store.get(run_id)
        t0 = time.time()
        while run.state not in FINAL:
            if timeout is not None and time.time() - t0 > timeout:
                break
            if not procs.alive(run.status().get("supervisor")):
                self.recover_stale()
            time.sleep(POLL_S)
        state = run.state
        if state in FINAL:
            # the supervisor writes status.json, then the index: a caller that saw the final state here
            # must find it in the index too (commlab.runs(state="done") right after wait)
            self.index.update(run)
        return state

    def recover_stale(self, ids: Optional[Iterable[str]] = None) -> list:
        """Mark failed every queued or running run whose supervisor died; stop what it left. A run the
        index still lists as queued or running after its status.json ended (a process that died between
        the two writes) gets its row written again. With ``ids``, only those runs are looked at (a
        person's unfinished ones, rather than every run's status)."""
        stale = []
        try:
            listed = self.index.unfinished()
        except RunIndexError as e:  # the rows are a cache: the runs are recovered all the same
            print(f"commlab: index: {e}", file=sys.stderr, flush=True)
            listed = set()
        for run in self.store.list() if ids is None else self._existing(ids):
            st = run.status()
            if st.get("state") not in UNFINISHED:
                if run.id in listed and st.get("state") in FINAL:
                    self._changed(run)
                continue
            if procs.alive(st.get("supervisor")):
                continue
            if time.time() - st.get("created", 0) < 5 and not st.get("supervisor"):
                continue  # just created; its supervisor is about to record itself
            kill_strays(run)
            for ident in st.get("torchruns") or [st.get("torchrun")]:  # what the launcher started: ranks or torchruns
                procs.kill_if_ours(ident, str(run.path))
            sup = st.get("supervisor") or {}
            new = run.mark_failed(f"stale: its launcher (pid {sup.get('pid')}) died; found at a later start",
                                  only_from=UNFINISHED)  # not if another command did it first
            if new.get("state") == State.FAILED:
                stale.append(run.id)
        return stale

    def _existing(self, ids: Iterable[str]) -> Iterator[Run]:
        for run_id in ids:
            try:
                yield self.store.get(run_id)
            except RunError:  # gone meanwhile (removed by its owner): nothing to recover
                continue

    def reindex(self) -> int:
        return self.index.reindex()


def _say(progress: bool, out) -> Callable[[str], None]:
    """What the lab says before the ranks start (the advisor, a search): on ``out`` with progress, else nothing."""
    return (lambda m: print(m, file=out, flush=True)) if progress else (lambda m: None)


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        raise LabError(f"{name}: must be a positive integer, got {v!r}") from None
    if n < 1:
        raise LabError(f"{name}: must be a positive integer, got {v!r}")
    return n


RANKS_PER_CORE = 4
RANKS_FLOOR = 8
"""Ranks one run may start on this machine unless runs/lab.json's ``max_ranks`` says otherwise: four per core,
and at least eight. Every rank is a process with a core's share of work; more than this only queue on the cores
(and ``world_size: 999`` on a 2-core machine forked over 300 ranks before anything could stop it)."""


def max_ranks(root: Path) -> int:
    """Ranks a run may start on this machine: runs/lab.json's ``max_ranks``, else ``RANKS_PER_CORE`` per core
    (at least ``RANKS_FLOOR``); a value that is not a positive integer is a LabError."""
    v = lab_config(root).get("max_ranks")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise LabError(f"{Path(root) / CONFIG}: max_ranks must be a positive integer, got {v!r}")
    return v or max(RANKS_FLOOR, RANKS_PER_CORE * (os.cpu_count() or 1))


def too_many_ranks(root: Path, here: int) -> Optional[str]:
    """What is wrong with starting ``here`` ranks of one run on this machine (``max_ranks``), or None."""
    cap = max_ranks(root)
    if here <= cap:
        return None
    return (f"{here} ranks on this machine, more than the {cap} it starts for one run ({RANKS_PER_CORE} per core, "
            f"at least {RANKS_FLOOR}; runs/lab.json's max_ranks sets another)")


def _config_max_jobs(root: Path) -> Optional[int]:
    """``max_jobs`` from runs/lab.json, if it sets one; a value that is not a positive integer is a LabError."""
    v = lab_config(root).get("max_jobs")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise LabError(f"{Path(root) / CONFIG}: max_jobs must be a positive integer, got {v!r}")
    return v
