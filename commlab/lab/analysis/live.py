"""What a page that follows a run re-reads on every refresh, read incrementally.

The Live run page refreshes every ``commlab.lab.front.ui.REFRESH_S`` seconds while a run trains, on the same
machine and the same cores as the run. Re-reading metrics.jsonl and the last ~40 steps of every
timeline file (about a megabyte per rank for a resnet run) and recomputing the breakdown of 40
steps with pandas took about half a second of CPU per refresh, a quarter of a core that the ranks
lost (see docs/explanation/presets.md, "Watching a run"). ``LiveRun`` keeps what it read:

- each file is read from where the last refresh stopped (only appended bytes; a torn last line
  waits for its end), and a file that was replaced or truncated is read again from the start: the run
  directory's one reader of JSON lines, ``commlab.engine.runlog.JsonlTail``;
- a timeline file opened late is read from its end (the last ``keep`` steps, ``JsonlTail.last``), never whole;
  in a thread serving a viewer the kept steps of every rank together take at most
  ``commlab.lab.rundir.store.VIEW_MB`` of the files (fewer steps of a model of many tensors);
- timeline events are kept grouped by step (a step's events end with its ``step`` span, the
  order ``commlab.engine.timeline`` flushes them in), the last ``keep`` steps per rank;
- the per-step breakdown (``plots.step_breakdown``'s rule) of a step is computed once, from plain
  events, when the step's events and the next step's are in, and kept.

``live_run(run)`` returns the one ``LiveRun`` of a run directory for this process (the app's
sessions share it; a lock serialises refreshes). Nothing here imports streamlit.
"""
from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Deque, Dict, List, Optional

import pandas as pd

from commlab.engine import runfiles
from commlab.engine.runlog import JsonlTail
from commlab.engine.timeline import LANE_NAMES, ends_step
from commlab.lab.analysis import plots
from commlab.lab.rundir.store import Run, timeline_frame, view_bytes

KEEP_STEPS = 100
"""Steps of timeline kept per rank (the live page shows up to 40 in its breakdown and 20 in its timeline;
``commlab.lab.analysis.timelines.run_breakdown``, which the results page uses, averages the last 100)."""


class _RankTimeline:
    """One rank's file: its last ``keep`` steps as lists of events, and what came after the last step; with
    ``max_bytes`` (a thread serving a viewer: commlab.lab.rundir.store.view_bytes) only as many of them as take
    that many bytes of the file."""

    def __init__(self, path: Path, keep: int, max_bytes: Optional[int] = None):
        self.tail = JsonlTail.last(path, keep, ends_step, max_bytes=max_bytes)
        self.max_bytes = max_bytes
        self.whole = self.tail.offset == 0
        """every step the file holds is kept (it was read from its start and none dropped for bytes)"""
        self.steps: Deque[List[dict]] = deque(maxlen=keep)
        self.sizes: Deque[float] = deque(maxlen=keep)
        """the bytes of the file each kept step took (its share of the read it came in)"""
        self.open: List[dict] = []
        self.rows: Dict[int, list] = {}
        """step number -> its breakdown row (computed once)."""

    def update(self) -> None:
        before = self.tail.bytes_read
        events = self.tail.read()
        per_event = (self.tail.bytes_read - before) / max(1, len(events))
        if self.tail.restarted:
            self.steps.clear()
            self.sizes.clear()
            self.open, self.rows = [], {}
        for e in events:
            self.open.append(e)
            if ends_step(e):
                self.steps.append(self.open)
                self.sizes.append(len(self.open) * per_event)
                self.open = []
        while self.max_bytes is not None and len(self.steps) > 1 and sum(self.sizes) > self.max_bytes:
            self.steps.popleft()
            self.sizes.popleft()
            self.whole = False

    def events(self, n: int) -> List[dict]:
        chunks = list(self.steps)[-n:] if n > 0 else []
        return [e for c in chunks for e in c] + self.open

    def breakdown(self, final: bool) -> List[list]:
        """Breakdown rows of the kept steps. A step's row is computed once its successor's events
        are in (a span of step k can be written with step k+1's), or at once when the run is final."""
        chunks = list(self.steps)
        ready = len(chunks) if final else len(chunks) - 1
        todo = [i for i in range(ready) if _step_of(chunks[i][-1]) not in self.rows]
        if todo:
            lo, hi = max(0, todo[0] - 1), min(len(chunks), todo[-1] + 2)
            events = [e for c in chunks[lo:hi] for e in c]
            for row in breakdown_rows(events):
                if row[1] in {_step_of(chunks[i][-1]) for i in todo}:
                    self.rows[row[1]] = row
        kept = {_step_of(c[-1]) for c in chunks}
        for s in [s for s in self.rows if s not in kept]:
            del self.rows[s]
        return [self.rows[s] for s in sorted(self.rows)]


def _step_of(e: dict) -> int:
    a = e.get("args") or {}
    if "step" in a:
        return int(a["step"])
    return int(str(e.get("name", "")).rsplit(" ", 1)[-1])


def breakdown_rows(events: List[dict]) -> List[list]:
    """``plots.step_breakdown`` over plain Chrome trace events (one or more ranks), without pandas:
    rows ``[rank, step, step_ms, compute_ms, compression_ms, exposed_comm_ms, other_ms,
    hidden_comm_ms]``. The same rule: a span belongs to the step whose window (the ``step`` span of
    its rank) holds its start (1 us slack); intervals are unions clipped to the window."""
    by_rank: Dict[int, List[dict]] = {}
    for e in events:
        by_rank.setdefault(int(e["pid"]), []).append(e)
    rows = []
    for rank in sorted(by_rank):
        evs = by_rank[rank]
        wins = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), _step_of(e)) for e in evs if ends_step(e))
        if not wins:
            continue
        starts = [w[0] for w in wins]
        lanes: Dict[int, Dict[str, list]] = {}
        for e in evs:
            s = float(e["ts"])
            i = bisect.bisect_right(starts, s + 1.0) - 1
            if i < 0 or s >= wins[i][1]:
                continue
            lane = LANE_NAMES.get(e.get("tid"), str(e.get("tid")))
            lanes.setdefault(i, {}).setdefault(lane, []).append((s, s + float(e["dur"])))
        for i, (w0, w1, step) in enumerate(wins):
            got = lanes.get(i, {})

            def spans(names, got=got, w0=w0, w1=w1):
                return plots._merge((max(a, w0), min(b, w1)) for n in names for a, b in got.get(n, ()))
            C, H = spans(plots.COMPUTE_LANES), spans(plots.HOOK_LANES)
            M, Mc = spans(plots.COMM_LANES), spans(("comm",))
            CH = plots._merge(C + H)
            length, inter = plots._length, plots._intersect
            compression = length(H)
            compute = length(C) - length(inter(C, H))
            exposed = length(M) - length(inter(M, CH))
            hidden = length(inter(Mc, CH))
            other = (w1 - w0) - compute - compression - exposed
            rows.append([rank, step, (w1 - w0) / 1e3, compute / 1e3, compression / 1e3, exposed / 1e3,
                         max(other, 0.0) / 1e3, hidden / 1e3])
    return rows


BREAKDOWN_COLUMNS = ["rank", "step", "step_ms", *plots.PARTS, "hidden_comm_ms"]


class LiveRun:
    """A run's files as a refreshing page needs them, read incrementally (see the module docstring)."""

    def __init__(self, run: Run, keep: int = KEEP_STEPS):
        self.run = run
        self.keep = keep
        self.lock = threading.Lock()
        self.metrics_tail = JsonlTail(run.file(runfiles.METRICS))
        self.rows: List[dict] = []
        self.ranks: Dict[str, _RankTimeline] = {}
        self.ended = False
        """whether the run had ended at the last ``live_run`` (which of the followed runs ``live_run`` drops)"""
        self.held = 0
        """bytes of the run's files this holds, as of the last refresh (what dropping it would read again)"""
        self.used = time.monotonic()
        """when ``live_run`` last gave it to a page"""

    def refresh(self) -> "LiveRun":
        """Read what was appended to the run's files since the last refresh."""
        with self.lock:
            rows = self.metrics_tail.read()
            if self.metrics_tail.restarted:
                self.rows = []
            self.rows.extend(rows)
            files = self.run.timeline_files()
            share = view_bytes(len(files))  # each rank's, of every rank seen so far (a rank can start late)
            for p in files:
                if p.name not in self.ranks:
                    self.ranks[p.name] = _RankTimeline(p, self.keep, share)
                self.ranks[p.name].max_bytes = share
                self.ranks[p.name].update()
            self.held = self.metrics_tail.bytes_read + int(sum(sum(r.sizes) for r in self.ranks.values()))
        return self

    def metric_rows(self) -> List[dict]:
        return list(self.rows)

    def metrics(self, kind: str = "step") -> pd.DataFrame:
        """As ``Run.metrics``: the metrics lines of one kind as a DataFrame."""
        return pd.DataFrame([m for m in self.rows if m.get("kind") == kind])

    def progress(self) -> tuple:
        """(steps done, steps planned), as ``commlab.lab.analysis.timelines.progress``."""
        done = max((m["step"] + 1 for m in self.rows if m.get("kind") == "step"), default=0)
        return done, self.run.spec_dict()["steps"]

    def has_steps(self, n: int) -> bool:
        """Whether every rank's last ``n`` steps are kept (else read them with
        ``commlab.lab.analysis.timelines.tail_timeline``): no more than ``keep``, and, where fewer were kept for
        their bytes, no more than were kept."""
        with self.lock:
            return n <= self.keep and all(r.whole or len(r.steps) >= n for r in self.ranks.values())

    def timeline(self, steps: int) -> pd.DataFrame:
        """The timeline frame (``Run.timeline``'s columns) of every rank's last ``steps`` steps and
        what followed them."""
        with self.lock:
            events = [e for r in self.ranks.values() for e in r.events(steps)]
        return timeline_frame(events)

    def breakdown(self, steps: Optional[int] = None, final: bool = False) -> pd.DataFrame:
        """``plots.step_breakdown`` of the kept steps (the last ``steps`` of them), each step computed once."""
        with self.lock:
            rows = [row for r in self.ranks.values() for row in r.breakdown(final)]
        bd = pd.DataFrame(rows, columns=BREAKDOWN_COLUMNS)
        if steps and len(bd):
            bd = bd[bd["step"] > bd["step"].max() - steps]
        return bd.sort_values(["rank", "step"], ignore_index=True)


_LIVE: "OrderedDict[str, LiveRun]" = OrderedDict()
_LIVE_LOCK = threading.Lock()
MAX_LIVE = 8
"""Runs followed at once per process. Past it, a run that had ended at its last refresh, or that no page has
refreshed for IDLE_S, is dropped first (the least recently used of them); else the run that holds the fewest
bytes read (a queued run holds none; ties: the least recently used). Opening finished or queued runs, then, never
makes a page that follows a big running run read its files again from their ends (a few seconds of CPU per
refresh), and a big run nobody follows any more does not keep its place."""
IDLE_S = 60.0
"""A followed run no page asked for in this long (the Live page's charts refresh every 20 s) is dropped first."""


def live_run(run: Run) -> LiveRun:
    """The process's ``LiveRun`` of ``run``'s directory, refreshed (read what is new)."""
    key = str(Path(run.path).resolve())
    with _LIVE_LOCK:
        lr = _LIVE.get(key)
        if lr is None:
            lr = _LIVE[key] = LiveRun(run)
        _LIVE.move_to_end(key)
        now = lr.used = time.monotonic()
        while len(_LIVE) > MAX_LIVE:
            others = []
            for n, (k, x) in enumerate(_LIVE.items()):
                if k != key:
                    gone = x.ended or now - x.used > IDLE_S
                    others.append((not gone, 0 if gone else x.held, n))
            del _LIVE[list(_LIVE)[min(others)[2]]]
    lr.refresh()
    lr.ended = run.state in runfiles.FINAL
    return lr
