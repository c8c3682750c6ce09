"""The run store: one directory per run, which is the run's whole state.

What each file of ``runs/<run-id>/`` holds, who writes it and when, and which reader every consumer uses is
the run directory's protocol, ``commlab.engine.runfiles`` (docs/reference/run-directory.md is generated from it).
``Run`` is the lab's side of it: the readers (``status``, ``spec_dict``, ``metric_rows``, ``timeline_events``,
``errors``, ``divergences``, ``worker_pids``, ``log_tail``) and the transitions of status.json, the only way the
lab writes it: ``mark_queued``, ``mark_running``, ``mark_done``, ``mark_failed``, ``mark_cancelled``,
``mark_diverged``, and ``note`` for figures while the run goes on.

Run ids from users are checked against a strict pattern, and every path is
resolved inside the runs directory, so nothing reads or writes outside it.

status.json has several writers (the supervisor, ``commlab cancel``, a later
lab command that finds a dead supervisor) and many readers. Every change is a
read-modify-write under an ``flock`` on ``.status.lock`` in the run directory,
and every write goes to a temporary file of its own that is fsynced and then
renamed over status.json, so a reader sees the old file or the new one, never
half of one, even when a writer is killed mid-write. A file that cannot be
parsed anyway (a foreign writer, a damaged disk) is never rebuilt from nothing:
the change is refused with ``StatusError``, unless this process holds a whole
copy it read or wrote earlier; then the damaged file is kept aside as
``status.json.corrupt-<time>`` and the status goes on from that copy, saying so
in ``recovered``.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional

from commlab.engine import runfiles
from commlab.engine.runfiles import FINAL, STATES, STATUS_FIELDS, State
from commlab.engine.runlog import JsonlTail, read_jsonl, set_aside, write_json_atomic
from commlab.engine.spec import JobSpec, upgrade
from commlab.engine.timeline import LANE_NAMES, ends_step
from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import CONFIG, PRIVATE_MODE, default_root, file_in, make_private
from commlab.lab.rundir.summary import summarize

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class RunError(LabError):
    """A bad run id or a missing run; the message is one line."""


class StatusError(LabError):
    """status.json exists but is not a JSON object (nothing was written over it); one line."""


READ_TRIES = 3
"""Attempts of a plain status read before it reports the file unreadable."""
CHANGE_TRIES = 20
"""Attempts, READ_PAUSE_S apart, of the read in a status change: a writer that does not rename
(another tool, a shared file system) gets about half a second to finish its file."""
READ_PAUSE_S = 0.025
CONFIG_KEYS = ("max_jobs", "disturbance_threshold", "quotas", "preset_steps", "access", "rank_mb", "max_ranks")
"""What runs/lab.json may hold; commlab.lab.service.queue, commlab.lab.rundir.disturbance, commlab.room.owners and commlab.room.accounts
check the values."""


def slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
    return s[:40] or "run"


def check_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID.match(run_id) or ".." in run_id:
        raise RunError(f"run id {run_id!r} is not valid: use letters, digits, '.', '_' and '-' only")
    return run_id


class Run:
    def __init__(self, path: Path, on_change=None):
        self.path = Path(path)
        self.id = self.path.name
        self.on_change = on_change
        """Called with the run after every status change (the store keeps its index current)."""
        self._good: Optional[dict] = None
        """The last whole status this object read or wrote: what a change starts from when
        status.json turns out damaged (the supervisor always holds one)."""

    def file(self, name: str) -> Path:
        return self.path / name

    # -- spec and status --------------------------------------------------
    def spec_dict(self) -> dict:
        """spec.json as a dict, with the fields an older version wrote under other names under their names now
        (commlab.engine.spec.upgrade)."""
        with open(self.file(runfiles.SPEC)) as f:
            return upgrade(json.load(f))

    def spec(self) -> JobSpec:
        """The run's spec, as its admission checked it: read as it is, not checked again (JobSpec.from_checked)."""
        return JobSpec.from_checked(self.spec_dict())

    def inherited(self) -> dict:
        """The queued fields a run made for this one takes from it (``RunStore.create``'s): a trial, profiling or
        search run is this run's owner's, under the same limits (memory per rank, wall time)."""
        st = self.status()
        return {k: st[k] for k in ("owner", "rank_limit_mb", "rank_limit_from", "wall_limit_s", "disk_limit_mb",
                                   "free_limit_mb") if st.get(k) is not None}

    def status(self) -> dict:
        """status.json as a dict; ``{"state": "unknown"}`` when there is none yet, and with
        ``unreadable`` (the reason) when the file cannot be parsed."""
        try:
            st = _read_status(self.file(runfiles.STATUS), READ_TRIES)
        except FileNotFoundError:
            return {"state": State.UNKNOWN}
        except StatusError as e:
            return {"state": State.UNKNOWN, "unreadable": str(e)}
        self._good = st
        return st

    @property
    def state(self) -> str:
        return self.status().get("state", State.UNKNOWN)

    # -- the transitions of status.json: every write of the lab goes through one of these. Each takes the
    # fields its state carries (commlab.engine.runfiles.STATUS_FIELDS); one given as None is not written.
    def mark_queued(self, *, supervisor: Optional[dict] = None, owner: Optional[str] = None,
                    sweep: Optional[str] = None, wall_limit_s: Optional[float] = None,
                    rank_limit_mb: Optional[int] = None, rank_limit_from: Optional[str] = None,
                    disk_limit_mb: Optional[int] = None, free_limit_mb: Optional[int] = None,
                    advisor_for: Optional[str] = None, tuning_for: Optional[str] = None) -> dict:
        """queued: the run is made (who it is for, its limits), or a process takes it on as its supervisor
        (``supervisor``: that process's ``procs.identity``)."""
        return self._transition(State.QUEUED, None, supervisor=supervisor, owner=owner, sweep=sweep,
                                wall_limit_s=wall_limit_s, rank_limit_mb=rank_limit_mb,
                                rank_limit_from=rank_limit_from, disk_limit_mb=disk_limit_mb,
                                free_limit_mb=free_limit_mb, advisor_for=advisor_for,
                                tuning_for=tuning_for)

    def mark_running(self, *, torchruns: Optional[List[dict]] = None, argv: Optional[List[str]] = None,
                     supervisor: Optional[dict] = None, own_loop: Optional[dict] = None, **placement) -> dict:
        """running: the launcher started ``torchruns`` (the ranks, or one torchrun per node: their identities,
        the first also as ``torchrun``) with ``argv``, placed as ``placement`` says (``nodes``, ``cluster`` or
        ``joined``); or an own loop (``own_loop``) runs under ``supervisor``."""
        return self._transition(State.RUNNING, None, torchrun=torchruns[0] if torchruns else None,
                                torchruns=torchruns, argv=argv, supervisor=supervisor, own_loop=own_loop, **placement)

    def mark_done(self, returncode: int = 0, disturbance: Optional[dict] = None) -> dict:
        """done: every rank finished."""
        return self._transition(State.DONE, None, returncode=returncode, disturbance=disturbance)

    def mark_failed(self, error: str, *, rank: Optional[int] = None, returncode: Optional[int] = None,
                    cause: Optional[str] = None, disturbance: Optional[dict] = None,
                    only_from: Optional[Iterable[str]] = None) -> dict:
        """failed, with ``error`` (one line) and, when a rank caused it, that ``rank``. With ``only_from``,
        only a run in one of those states changes (another process may have ended it first)."""
        return self._transition(State.FAILED, only_from, error=error, rank=rank, returncode=returncode,
                                cause=cause, disturbance=disturbance)

    def mark_cancelled(self, error: str, *, disturbance: Optional[dict] = None,
                       only_from: Optional[Iterable[str]] = None) -> dict:
        """cancelled, with ``error`` saying by whom or why (as ``mark_failed`` for ``only_from``)."""
        return self._transition(State.CANCELLED, only_from, error=error, disturbance=disturbance)

    def mark_diverged(self, *, rank: Optional[int], step: Optional[int], error: Optional[str], returncode: int,
                      disturbance: Optional[dict] = None) -> dict:
        """diverged: ``rank``'s averaged gradient was not finite at ``step``."""
        return self._transition(State.DIVERGED, None, rank=rank, step=step, error=error, returncode=returncode,
                                disturbance=disturbance)

    def note(self, *, disturbance: Optional[dict] = None, strategy: Optional[dict] = None,
             shared: Optional[bool] = None) -> None:
        """Figures written while the run goes on, the state left as it is (the index picks them up at the next
        state change): the CPU other processes took so far, strategy auto's choice (``strategy_note``), a
        student's run shown to the class."""
        fields = _given(disturbance=disturbance, strategy=strategy, shared=shared)
        if fields:
            self.update_status(**fields)

    def _transition(self, state: str, only_from: Optional[Iterable[str]], **fields) -> dict:
        return self.set_status(state, only_from=only_from, **_given(**fields))

    def set_status(self, state: str, only_from: Optional[Iterable[str]] = None, **fields) -> dict:
        """Change the state (and set ``fields``) in one locked read-modify-write; returns the status.
        With ``only_from``, nothing changes unless the current state is one of those (then the
        current status is returned as it is). The write under the transitions (``mark_...``), which
        the lab's code calls instead."""
        if state not in STATES:
            raise ValueError(f"state: {state!r} not in {STATES}")
        allowed = None if only_from is None else tuple(only_from)

        def change(st: Optional[dict]) -> Optional[dict]:
            st = dict(st or {})
            if allowed is not None and st.get("state") not in allowed:
                return None
            st.update(fields)
            st["state"] = state
            now = time.time()
            st.setdefault("created", now)
            if state == State.RUNNING:
                st.setdefault("started", now)
            if state in FINAL:
                st["ended"] = now
            return st
        st, changed = self._change(change)
        if changed and self.on_change:
            self.on_change(self)
        return st

    def update_status(self, **fields) -> None:
        """Set fields of status.json without changing the state or the index (``note``'s write). A run
        without a status.json (its directory being made or removed) gets none."""
        self._change(lambda st: None if st is None else {**st, **fields})

    def _change(self, fn: Callable[[Optional[dict]], Optional[dict]]):
        """(status, written): ``fn`` maps the current status (None when there is no file) to the new
        one, or to None to leave the file alone (as it is left when the new one is the same); it runs
        under the run's status lock."""
        path = self.file(runfiles.STATUS)
        with _locked(self.file(runfiles.STATUS_LOCK)):
            # every status writer holds this lock, so a temporary file left now is a killed writer's
            for tmp in self.path.glob(f".{runfiles.STATUS}.*.tmp"):
                with contextlib.suppress(OSError):
                    tmp.unlink()
            recovered = False
            try:
                st = _read_status(path, CHANGE_TRIES)
            except FileNotFoundError:
                st = None
            except StatusError as e:
                recovered = True
                if self._good is None:
                    raise StatusError(f"{e}; left as it is, with nothing written over it") from None
                where = set_aside(path)
                st = dict(self._good)
                st["recovered"] = f"{e}; {where} and rebuilt from the status this process last read"
                print(f"commlab: {self.id}: {st['recovered']}", file=sys.stderr, flush=True)
            new = fn(st)
            if new is None and recovered:
                new = st  # the damaged file was moved aside: the rebuilt status must land
            if new is None or (new == st and not recovered):  # nothing changes: nothing is written
                return st or {"state": State.UNKNOWN}, False
            write_json_atomic(path, new)
            self._good = new
            return new, True

    def cancel_requested(self) -> bool:
        return self.file(runfiles.CANCEL).exists()

    def read_all(self, pattern: str, unreadable: Optional[list] = None) -> List[dict]:
        """Every JSON file of the run matching ``pattern``. One that cannot be read is skipped, and
        ``(path, reason)`` goes into ``unreadable`` when that list is given."""
        out = []
        for p in sorted(self.path.glob(pattern)):
            try:
                with open(p) as f:
                    out.append(json.load(f))
            except (OSError, ValueError) as e:
                if unreadable is not None:
                    unreadable.append((p, str(e)))
        return out

    def worker_pids(self) -> List[dict]:
        """The ranks' process identities, as each worker recorded them at start."""
        return self.read_all(runfiles.PIDS)

    def recoveries(self) -> List[dict]:
        """A fault-tolerant run's recoveries (recoveries.jsonl): who recovered, from whom, at which step, the bytes
        and seconds it took."""
        return read_jsonl(str(self.file(runfiles.RECOVERIES)))

    def ft_events(self) -> List[dict]:
        """What the lab did to a fault-tolerant run's processes (ft-events.jsonl): spawns, kills, exits, stops."""
        return read_jsonl(str(self.file(runfiles.FT_EVENTS)))

    def divergences(self) -> List[dict]:
        """The diverged ranks' files (``rank``, ``step``, ``error``)."""
        return self.read_all(runfiles.DIVERGEDS)

    # -- logs -------------------------------------------------------------
    def metric_rows(self) -> List[dict]:
        return read_jsonl(str(self.file(runfiles.METRICS)))

    def timeline_files(self) -> List[Path]:
        return sorted(self.path.glob(runfiles.TIMELINES), key=lambda p: int(re.findall(r"\d+", p.name)[-1]))

    def timeline_events(self, last_steps: Optional[int] = None) -> List[dict]:
        """Every rank's timeline events (rank by rank), or each rank's last ``last_steps`` steps and what
        followed them, each file read from its end. In a thread serving a viewer (``bound_reads_when``) at
        most VIEW_MB of the files together are read: each rank's last whole steps that fit (``view_cut`` says
        whether that left some out)."""
        files = self.timeline_files()
        cap = view_bytes(len(files))
        if last_steps is None and cap is None:
            return [e for p in files for e in read_jsonl(str(p))]
        return [e for p in files for e in JsonlTail.last(p, last_steps, ends_step, max_bytes=cap).read(final=True)]

    def files_key(self, status: bool = False) -> tuple:
        """(name, size, mtime) of its metrics and timeline files (and, with ``status``, of status.json): what a
        view made from them is kept under, so that it is made again when the run grows (or changes state)."""
        out = []
        for p in [*([self.file(runfiles.STATUS)] if status else []), self.file(runfiles.METRICS),
                  *self.timeline_files()]:
            try:
                st = p.stat()
                out.append((p.name, st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                pass
        return tuple(out)

    def view_cut(self) -> bool:
        """Whether a view of this run's whole timeline reads only its last steps here and now (``view_bytes``)."""
        files = self.timeline_files()
        cap = view_bytes(len(files))
        return cap is not None and any(_size(p) > cap for p in files)

    # -- as data frames (the Python API) -----------------------------------
    def metrics(self, kind: str = "step"):
        """Metrics lines of one kind as a DataFrame: "step", "eval", or "final" (rank 0's last line: the digest of
        the model the run ended with, ``params_sha256``)."""
        import pandas as pd
        rows = [m for m in self.metric_rows() if m.get("kind") == kind]
        return pd.DataFrame(rows)

    def timeline(self):
        """Timeline spans of all ranks as a DataFrame: rank, lane, name, start_us, dur_us, and their args."""
        return timeline_frame(self.timeline_events())

    def summary(self):
        """Headline figures and status as a one-row DataFrame."""
        import pandas as pd
        st = self.status()
        row = {"run": self.id, "state": st.get("state"), **summarize(self.metric_rows(), self.spec_dict(), st)}
        return pd.DataFrame([row]).set_index("run")

    def errors(self) -> List[dict]:
        """The failed ranks' error files, oldest first; one that cannot be read is reported as an
        error of its rank (the rank failed: it wrote the file)."""
        bad: list = []
        out = self.read_all(runfiles.ERRORS, bad)
        for p, why in bad:
            m = re.search(r"error-rank(\d+)\.json$", p.name)
            with contextlib.suppress(OSError):
                out.append({"rank": int(m.group(1)) if m else None, "error": f"{p.name} is unreadable: {why}",
                            "time": p.stat().st_mtime})
        return sorted(out, key=lambda e: e.get("time", 0))

    def log_tail(self, n: int = 20, max_bytes: int = 1 << 20) -> str:
        """The last ``n`` lines of the run's log, read from its end (at most ``max_bytes`` of it: a log can be as
        large as its run's directory may grow)."""
        try:
            with open(self.file(runfiles.LOG), "rb") as f:
                start = max(0, f.seek(0, os.SEEK_END) - max_bytes)
                f.seek(start)
                lines = f.read().decode(errors="replace").splitlines(keepends=True)
        except FileNotFoundError:
            return ""
        return "".join(lines[1 if start else 0:][-n:])  # a read from inside the file starts in a cut line

    def __repr__(self) -> str:
        return f"Run({self.id!r}, {self.state})"


class RunStore:
    def __init__(self, root: Optional[os.PathLike] = None, on_change=None):
        self.root = Path(root) if root else default_root()
        self.on_change = on_change

    def create(self, spec: JobSpec, run_id: Optional[str] = None, **queued) -> Run:
        """A new run directory (its owner's alone: paths.make_private), queued with the fields ``queued``
        (``Run.mark_queued``'s: who it is for, its limits). ``run_id`` names it (multi-node runs agree on a
        name)."""
        make_private(self.root)
        if run_id is not None:
            check_id(run_id)
            path = self.root / run_id
            try:
                path.mkdir(mode=PRIVATE_MODE)
            except FileExistsError:
                raise RunError(f"run {run_id!r} exists already in {self.root}") from None
        else:
            for _ in range(100):
                path = file_in(self.root, f"{time.strftime('%Y%m%d-%H%M%S')}-{slug(spec.name)}-{secrets.token_hex(2)}")
                try:
                    path.mkdir(mode=PRIVATE_MODE)
                    break
                except FileExistsError:
                    continue
            else:
                raise RuntimeError("could not allocate a run id")
        run = Run(path, self.on_change)
        write_json_atomic(run.file(runfiles.SPEC), spec.to_dict())
        # which of spec.json's engine switches the admission took from its environment (rank 0 keeps this key)
        write_json_atomic(run.file(runfiles.RESOLVED), {"engine_from_env": spec.engine.from_env})
        run.mark_queued(**queued)
        return run

    def get(self, run_id: str) -> Run:
        check_id(run_id)
        root = self.root.resolve()
        path = (root / run_id).resolve()
        if path.parent != root:
            raise RunError(f"run id {run_id!r} is not inside the runs directory")
        if not (path / runfiles.SPEC).is_file():
            raise RunError(f"no run {run_id!r} in {self.root}")
        return Run(path, self.on_change)

    def list(self) -> List[Run]:
        if not self.root.is_dir():
            return []
        runs = [Run(p, self.on_change) for p in self.root.iterdir() if p.is_dir() and RUN_ID.match(p.name)
                and (p / runfiles.SPEC).is_file()]
        return sorted(runs, key=lambda r: r.id)


def lab_config(root: os.PathLike) -> dict:
    """The runs directory's settings, ``runs/lab.json`` (``{}`` when there is none). A file that cannot
    be read or parsed, is not an object, or holds a key nobody reads is a ``LabError`` naming it."""
    path = Path(root) / CONFIG
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise LabError(f"{path}: cannot be read: {e}") from None
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise LabError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LabError(f"{path}: must be a JSON object such as {{\"max_jobs\": 2}}, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(CONFIG_KEYS))
    if unknown:
        raise LabError(f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(CONFIG_KEYS)}")
    return cfg


def _given(**fields) -> dict:
    """The fields that have a value (not None), each one status.json has (``runfiles.STATUS_FIELDS``)."""
    out = {k: v for k, v in fields.items() if v is not None}
    unknown = sorted(set(out) - set(STATUS_FIELDS))
    if unknown:
        raise ValueError(f"status.json: {unknown[0]!r} is not a status field (commlab.engine.runfiles.STATUS_FIELDS)")
    return out


def strategy_note(chosen: Optional[str], by: str, cost_s: Optional[float]) -> dict:
    """strategy auto's ``strategy`` field: what it chose (None while it is still to choose), how, what the advice
    cost (seconds)."""
    return {"chosen": chosen, "by": by, "cost_s": cost_s}


def _pause() -> None:
    time.sleep(READ_PAUSE_S)


def _read_status(path: Path, tries: int) -> dict:
    """The parsed file; FileNotFoundError when there is none; StatusError when after ``tries``
    attempts it is still not a JSON object."""
    for attempt in range(tries):
        if attempt:
            _pause()
        with open(path) as f:
            text = f.read()
        try:
            st = json.loads(text)
        except ValueError as e:
            why = f"{path}: not valid JSON ({len(text)} bytes: {e})"
            continue
        if isinstance(st, dict):
            return st
        why = f"{path}: must be a JSON object, got {type(st).__name__}"
    raise StatusError(why)


@contextlib.contextmanager
def _locked(lock_path: Path):
    """An exclusive flock on ``lock_path`` (made if missing); the kernel drops it if we die."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


VIEW_MB = 16
"""The most of a run's timeline files (its ranks' together) a thread serving a viewer reads for one view
(``Run.timeline_events``, the live page's kept steps, a trace download): about 120,000 events, some 80 MB once
parsed. A 2000-step run of the zoo's cnn on two ranks writes about 10 MB; a model of 2,000 tensors under
layer-wise (an mlp of depth 999) about 1.6 MB per step and rank, whose views then cover its last steps."""
_bounded_when: Optional[Callable[[], bool]] = None


def bound_reads_when(predicate: Optional[Callable[[], bool]]) -> None:
    """From now on, in this process, read at most VIEW_MB of a run's timelines whenever ``predicate()`` is true
    (the UI's server: in every thread serving a viewer, commlab.lab.front.ui.serve_viewers). Replaces an earlier
    one; None lifts it."""
    global _bounded_when
    _bounded_when = predicate


def view_bytes(files: int) -> Optional[int]:
    """The bytes each of ``files`` timeline files may be read here and now: VIEW_MB over them in a thread serving
    a viewer, else None (whole)."""
    if _bounded_when is None or not _bounded_when():
        return None
    return int(VIEW_MB * 2**20) // max(1, files)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


def timeline_frame(events: List[dict]) :
    """Chrome trace events as the frame ``Run.timeline()`` returns."""
    import pandas as pd  # pandas loads only when a frame is asked for (supervisors never do)
    return pd.DataFrame([{"rank": e["pid"], "lane": LANE_NAMES.get(e["tid"], str(e["tid"])), "name": e["name"],
                          "start_us": e["ts"], "dur_us": e["dur"], **(e.get("args") or {})} for e in events])
