"""MergeComp (Wang, Wu, Ng 2021): an online search of the split points of the gradient buffer
by measured iteration time, and its cache of chosen partitions beside the run directories.

``MergeCompSearch`` is pure (fed times, no clocks or collectives); ``MergeComp`` is the tuner the
driver (commlab/engine/tuners/driver.py) runs inside a training run.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Dict, Generator, List, Optional, Sequence, Tuple

from commlab.engine import runfiles, schedules
from commlab.engine.runlog import set_aside, write_json_atomic
from commlab.engine.schedules import Buckets, ParamInfo
from commlab.engine.tuners.driver import Decision, Tuner

Cuts = List[int]


class MergeCompSearch:
    """Search the cuts of the gradient buffer (in ready order) by measured step time.

    The paper's code tries one cut and moves it by a slope rule. This search covers
    more: (1) the number of groups k = 1, 2, ... with cuts balancing bytes, stopping
    after ``patience`` k in a row that were no better than the best; (2) coordinate
    descent on the best cuts: move each cut left or right by a step that halves when
    no move helps. Every candidate is measured once (the caller gives the median of
    several steps); the best measured one wins.

        s = MergeCompSearch(params)
        cuts = s.next_candidate()          # [] first: one group
        while cuts is not None:
            s.report(measure(cuts))        # seconds per step, median
            cuts = s.next_candidate()
        s.best                             # (cuts, seconds)
    """

    def __init__(self, params: Sequence[ParamInfo], max_groups: int = 8, max_candidates: int = 24,
                 patience: int = 2):
        self.params = list(params)
        self.max_groups = max(1, min(max_groups, len(self.params)))
        self.max_candidates = max_candidates
        self.patience = patience
        self.trace: List[Tuple[Cuts, float]] = []
        """Every measured candidate in order: (cuts, seconds)."""
        self._seen: Dict[Tuple[int, ...], float] = {}
        self._gen = self._search()
        self._pending: Optional[Cuts] = None
        self._pending = next(self._gen, None)

    @property
    def best(self) -> Tuple[Cuts, float]:
        cuts, t = min(self.trace, key=lambda ct: ct[1])
        return list(cuts), t

    def next_candidate(self) -> Optional[Cuts]:
        """The cuts to measure next, or None when the search is over."""
        return None if self._pending is None else list(self._pending)

    def report(self, seconds: float) -> None:
        """The measured time of the candidate ``next_candidate`` returned."""
        if self._pending is None:
            raise RuntimeError("report: the search is over")
        try:
            self._pending = self._gen.send(float(seconds))
        except StopIteration:
            self._pending = None

    def layout(self, cuts: Cuts) -> Buckets:
        return schedules.from_cuts(self.params, cuts)

    # the search as a generator: yields cuts, receives their time
    def _measure(self, cuts: Cuts) -> Generator[Cuts, float, float]:
        key = tuple(cuts)
        if key not in self._seen:
            t = yield list(cuts)
            self._seen[key] = t
            self.trace.append((list(cuts), t))
        return self._seen[key]

    def _budget(self) -> bool:
        return len(self.trace) < self.max_candidates

    def _search(self) -> Generator[Cuts, float, None]:
        n = len(self.params)
        best_cuts, best_t, worse = [], float("inf"), 0
        for k in range(1, self.max_groups + 1):
            if not self._budget():
                return
            cuts = schedules.balanced_cuts(self.params, k)
            t = yield from self._measure(cuts)
            if t < best_t:
                best_cuts, best_t, worse = cuts, t, 0
            else:
                worse += 1
                if worse >= self.patience:
                    break
        step = max(1, n // (2 * (len(best_cuts) + 1)))
        while self._budget():
            for c in self._neighbours(best_cuts, step):
                if tuple(c) in self._seen:
                    continue
                if not self._budget():
                    return
                t = yield from self._measure(c)
                if t < best_t:
                    best_cuts, best_t = c, t
                    break
            else:  # no neighbour helped: look closer, or stop
                if step == 1:
                    return
                step //= 2

    def _neighbours(self, cuts: Cuts, step: int):
        """Partitions one move away: a cut shifted by ``step``, a cut removed, a cut added
        near the byte middle of a group (at it, or ``step`` either side)."""
        n = len(self.params)
        bounds = [0] + cuts + [n]
        for j in range(len(cuts)):
            for d in (-step, step):
                if bounds[j] < cuts[j] + d < bounds[j + 2]:
                    yield cuts[:j] + [cuts[j] + d] + cuts[j + 1:]
        for j in range(len(cuts)):
            yield cuts[:j] + cuts[j + 1:]
        if len(cuts) + 1 < self.max_groups:
            for a, b in zip(bounds, bounds[1:]):
                if b - a < 2:
                    continue
                mid = a + schedules.balanced_cuts(self.params[a:b], 2)[0]
                for c in (mid, mid - step, mid + step):
                    if a < c < b:
                        yield sorted(cuts + [c])


SEARCH_FIELDS = ("warmup_steps", "steps_per_candidate", "max_groups", "max_candidates")
"""The schedule's fields that decide how far the search looks: in the key, so that a search told to try one
partition does not answer for runs that would have tried more."""


def cache_key(spec) -> str:
    """What the best partition depends on: model (and batch, comm mode: they set the compute
    that communication overlaps), compressor, world size and network, and how far the search looked."""
    d = spec.to_dict()
    return json.dumps({"model": d["model"], "dataset": d["dataset"]["name"], "batch_size": d["batch_size"],
                       "comm": d["comm"], "compressor": d["compressor"], "world_size": d["world_size"],
                       "network": d["network"], "search": {k: d["schedule"].get(k) for k in SEARCH_FIELDS}},
                      sort_keys=True)


class CacheCorrupt(ValueError):
    """The cache file could not be parsed; it was renamed aside. ``str(e)`` says where to."""


def read_cache(runs_root: str, key: str) -> Optional[dict]:
    """The cached entry for ``key``, or None. A cache that cannot be read or parsed is renamed to
    ``mergecomp-cache.json.corrupt-<time>`` (kept for a look, never silently replaced) and raised
    as ``CacheCorrupt``."""
    path = os.path.join(runs_root, runfiles.MERGECOMP_CACHE)
    try:
        return _load_cache(path).get(key)
    except FileNotFoundError:
        return None


CACHE_ENTRIES = 64
"""Partitions the cache keeps, the newest written; an older one is searched for again. Every MergeComp run reads and
rewrites the whole file, and an entry holds its model's parameter names (2,000 for a model at the tensors
quota of an exposed lab): a room's runs of many settings would otherwise grow it without bound."""


def write_cache(runs_root: str, key: str, entry: dict) -> Optional[str]:
    """Add ``entry`` under ``key`` (the newest; past CACHE_ENTRIES the oldest written go), under an flock so
    that two runs finishing at once keep both entries. Returns a problem to report (a corrupt cache found and
    set aside first), or None."""
    import fcntl
    path = os.path.join(runs_root, runfiles.MERGECOMP_CACHE)
    problem = None
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            allc = _load_cache(path)
        except FileNotFoundError:
            allc = {}
        except CacheCorrupt as e:
            allc, problem = {}, str(e)
        allc.pop(key, None)
        allc[key] = entry  # the newest last (JSON objects keep their order)
        for old in list(allc)[:max(0, len(allc) - CACHE_ENTRIES)]:
            del allc[old]
        write_json_atomic(path, allc)  # readers never see half a file
    finally:
        os.close(fd)
    return problem


def _load_cache(path: str) -> dict:
    try:
        with open(path) as f:
            text = f.read()
        allc = json.loads(text)
        if not isinstance(allc, dict) or not all(isinstance(v, dict) for v in allc.values()):
            raise ValueError("not a JSON object of entries")
        return allc
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise CacheCorrupt(f"{path} is unreadable ({type(e).__name__}: {e}); {set_aside(path, said='moved to')}") from None


class MergeComp(Tuner):
    """Measure candidate partitions (in the first step's ready order) for
    ``schedule.steps_per_candidate`` steps each (after ``warmup_steps`` at first, and one step
    after every relayout, which pays for new buffers), keep the fastest, cache it by setting."""

    name = "mergecomp"

    def __init__(self, spec, comm, run_dir: Optional[str]):
        super().__init__(spec, comm, run_dir)
        s = spec.schedule
        self.window = s.warmup_steps + s.steps_per_candidate
        self.skip = s.warmup_steps
        self.search: Optional[MergeCompSearch] = None
        self.order: List[int] = []
        self.key = cache_key(spec)
        self.root = os.path.dirname(os.path.abspath(run_dir)) if run_dir else None
        self.info["cache"] = "off" if self.root is None else ("retune" if s.retune else "miss")

    @classmethod
    def steps_to_decide(cls, spec) -> int:
        s = spec.schedule  # the first window, then one per further candidate (its first step not counted)
        return s.warmup_steps + s.steps_per_candidate + (s.max_candidates - 1) * (1 + s.steps_per_candidate)

    def start(self) -> Optional[Decision]:
        if self.root is None or self.spec.schedule.retune:
            return None
        try:
            hit = read_cache(self.root, self.key)
        except CacheCorrupt as e:
            self._cache_problem(f"{e}; searching afresh")
            return None
        if hit is None or sorted(hit.get("order", [])) != sorted(self.comm.order_names):
            return None  # none, or another model under the same key: do not trust it
        self.info.update({"cache": "hit", "cached_from": hit.get("run"), "chosen": {"cuts": hit["cuts"], "ms": hit.get("ms")}})
        order = [self.comm.order_names.index(n) for n in hit["order"]]
        layout = schedules.from_cuts([self.comm.infos[i] for i in order], hit["cuts"])
        return Decision(layout, order, final=True, what="cached partition")

    def decide(self, times: List[float], ready_steps, measured) -> Decision:
        s = self.spec.schedule
        if self.search is None:
            self.order = list(self.comm.ready_order)
            self.search = MergeCompSearch([self.comm.infos[i] for i in self.order], max_groups=s.max_groups,
                                          max_candidates=s.max_candidates)
        self.search.report(statistics.median(times))
        self.info["trace"] = [{"cuts": c, "groups": len(c) + 1, "ms": 1e3 * t} for c, t in self.search.trace]
        cuts = self.search.next_candidate()
        if cuts is not None:
            layout = self.search.layout(cuts)
            return Decision(layout, self.order, final=False, what=f"mergecomp candidate: {len(layout)} groups")
        cuts, best_t = self.search.best
        layout = self.search.layout(cuts)
        self.info["chosen"] = {"cuts": cuts, "ms": 1e3 * best_t}
        if self.root is not None:
            names = [self.comm.order_names[i] for i in self.order]
            problem = write_cache(self.root, self.key, {"order": names, "cuts": cuts, "ms": 1e3 * best_t,
                                                        "run": os.path.basename(os.path.abspath(self.run_dir))})
            if problem:
                self._cache_problem(f"{problem}; a new cache holds this run's partition")
        return Decision(layout, self.order, final=True, what=f"mergecomp best: {len(layout)} groups")

    def applied(self, decision: Decision) -> None:
        # after a relayout the first step pays for new buffers: measure the ones after it
        s = self.spec.schedule
        self.window, self.skip = 1 + s.steps_per_candidate, 1

    def _cache_problem(self, text: str) -> None:
        """A damaged cache: said in log.txt (stderr) and in tuning.json's ``cache_problem``."""
        self.info["cache"] = "corrupt"
        self.info["cache_problem"] = text
        print(f"[commlab] rank {self.comm.rank}: mergecomp cache: {text}", file=sys.stderr, flush=True)
