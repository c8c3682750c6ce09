"""Tuners: objects fed measurements that propose bucket layouts.

- ``MergeCompSearch`` (MergeComp, Wang, Wu, Ng 2021): an online search of the
  split points of the gradient buffer by measured iteration time.
- ``LayerFusionTuner`` (Sketch-Fusion SGD, Dai et al. 2024): merges layers from
  measured per-layer ready times and a fitted per-call cost.

Both are pure objects (no collectives, no clocks), so they are tested on fake
timings. ``Tuning`` is the glue a trainer holds: it feeds them the run's step
times, makes rank 0 decide and broadcast, applies the layout on every rank at the
same step boundary (``DataParallel.relayout``), and writes ``tuning.json``.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Dict, Generator, List, Optional, Sequence, Tuple

from engine import schedules
from engine.schedules import Buckets, CallCost, ParamInfo

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


def fit_cost(samples: Sequence[Tuple[float, float]]) -> CallCost:
    """Least-squares ``seconds = fixed + per_byte * bytes`` over (bytes, seconds) samples,
    both terms clamped at zero (a negative latency is noise)."""
    if len(samples) < 2:
        raise ValueError("fit_cost: at least two (bytes, seconds) samples are needed")
    xs = [float(b) for b, _ in samples]
    ys = [float(t) for _, t in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    slope = max(slope, 0.0)
    return CallCost(fixed=max(my - slope * mx, 0.0), per_byte=slope)


class LayerFusionTuner:
    """LayerFusion: one layout from a profile, no hyperparameters.

    Fed the per-parameter ready times of a few steps (seconds from the start of
    backward, in ready order) and (raw bytes, total seconds, compressor seconds)
    samples of whole one-bucket exchanges, it fits the collective's alpha-beta cost
    (total minus compressor time) and the compressor's per-call cost (fixed + per
    byte) and applies ``schedules.layerfusion``."""

    def __init__(self, params: Sequence[ParamInfo]):
        self.params = list(params)
        self.ready: Optional[List[float]] = None
        self.cost: Optional[CallCost] = None

    def propose(self, ready_steps: Sequence[Sequence[float]], samples: Sequence[Tuple[float, float]]) -> Buckets:
        self.ready = [statistics.median(col) for col in zip(*ready_steps)]
        channel = fit_cost([(b, max(t - c, 0.0)) for b, t, c in samples])
        compute = fit_cost([(b, c) for b, _, c in samples])
        self.cost = CallCost(channel.fixed, channel.per_byte, compute.fixed, compute.per_byte)
        return schedules.build("layerfusion", self.params, ready=self.ready, cost=self.cost)


# ------------------------------------------------------------------ the trainer's glue

CACHE = "mergecomp-cache.json"
"""Beside the run directories: chosen MergeComp partitions by setting, for later runs."""


def cache_key(spec) -> str:
    """What the best partition depends on: model (and batch, comm mode: they set the compute
    that communication overlaps), compressor, world size and network."""
    d = spec.to_dict()
    return json.dumps({"model": d["model"], "dataset": d["dataset"]["name"], "batch_size": d["batch_size"],
                       "comm": d["comm"], "compressor": d["compressor"], "world_size": d["world_size"],
                       "network": d["network"]}, sort_keys=True)


class CacheCorrupt(ValueError):
    """The cache file could not be parsed; it was renamed aside. ``str(e)`` says where to."""


def read_cache(runs_root: str, key: str) -> Optional[dict]:
    """The cached entry for ``key``, or None. A cache that cannot be read or parsed is renamed to
    ``mergecomp-cache.json.corrupt-<time>`` (kept for a look, never silently replaced) and raised
    as ``CacheCorrupt``."""
    path = os.path.join(runs_root, CACHE)
    try:
        return _load_cache(path).get(key)
    except FileNotFoundError:
        return None


def write_cache(runs_root: str, key: str, entry: dict) -> Optional[str]:
    """Add ``entry`` under ``key``, under an flock so that two runs finishing at once keep both
    entries. Returns a problem to report (a corrupt cache found and set aside first), or None."""
    import fcntl
    path = os.path.join(runs_root, CACHE)
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
        allc[key] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(allc, f, indent=1)
        os.replace(tmp, path)  # readers never see half a file
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
        aside = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        try:
            os.replace(path, aside)
            where = f"moved to {os.path.basename(aside)}"
        except OSError as e2:
            where = f"could not be moved aside ({e2})"
        raise CacheCorrupt(f"{path} is unreadable ({type(e).__name__}: {e}); {where}") from None


class Tuning:
    """Drives a tuner inside a run. Every rank holds one and calls ``after_step`` after
    every training step; collectives happen only at decision boundaries, on all ranks
    alike: an all-reduce (max) of the window's step times, the calibration exchanges
    (layerfusion), and rank 0's broadcast of the decision."""

    def __init__(self, spec, dp, run_dir: Optional[str], timeline, group=None, on_layout=None):
        import torch.distributed as dist
        s = spec.schedule
        self.kind = s.name
        self.spec, self.dp, self.run_dir, self.timeline, self.group = spec, dp, run_dir, timeline, group
        self.on_layout = on_layout
        self.rank = dist.get_rank(group)
        self.times: List[float] = []
        self.ready_steps: List[List[float]] = []
        self.steps = 0
        self.done = False
        self.info: dict = {"schedule": self.kind, "trace": []}
        self.search: Optional[MergeCompSearch] = None
        self.key = cache_key(spec)
        root = os.path.dirname(os.path.abspath(run_dir)) if run_dir else None
        self.root = root
        if self.kind == "mergecomp":
            self.window = s.warmup_steps + s.steps_per_candidate
            self.measured = s.steps_per_candidate
            self.info["cache"] = "off" if root is None else ("retune" if s.retune else "miss")
            hit = None
            if self.rank == 0 and root is not None and not s.retune:
                try:
                    hit = read_cache(root, self.key)
                except CacheCorrupt as e:
                    self._cache_problem(f"{e}; searching afresh")
                if hit is not None and sorted(hit.get("order", [])) != sorted(dp.order_names):
                    hit = None  # another model under the same key: do not trust it
            hit = self._broadcast(hit)
            if hit is not None:
                self.info["cache"] = "hit"
                self.info["cached_from"] = hit.get("run")
                order = [dp.order_names.index(n) for n in hit["order"]]
                infos = [dp.infos[i] for i in order]
                self._apply(schedules.from_cuts(infos, hit["cuts"]), order, "cached partition")
                self.info["chosen"] = {"cuts": hit["cuts"], "ms": hit.get("ms")}
                self._finish()
        else:
            self.window = 1 + s.profile_steps  # the first step records the ready order; the others profile

    def _cache_problem(self, text: str) -> None:
        """A damaged cache: said in log.txt (stderr) and in tuning.json's ``cache_problem``."""
        self.info["cache"] = "corrupt"
        self.info["cache_problem"] = text
        print(f"[commlab] rank {self.rank}: mergecomp cache: {text}", file=sys.stderr, flush=True)

    def _broadcast(self, obj):
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _ordered_infos(self) -> Tuple[List[int], List[ParamInfo]]:
        order = list(self.dp.ready_order)
        return order, [self.dp.infos[i] for i in order]

    def after_step(self, seconds: float, backward_start: float) -> None:
        if self.done:
            return
        self.steps += 1
        self.times.append(seconds)
        if self.dp.record_ready:
            self.ready_steps.append([self.dp.ready_at[i] - backward_start for i in self.dp.ready_order])
        if self.kind == "layerfusion":
            self.dp.record_ready = True  # from the second step: the first one pays one-time costs
        if len(self.times) < self.window:
            return
        import torch
        import torch.distributed as dist
        t = torch.tensor(self.times[-self.measured:] if self.kind == "mergecomp" else self.times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)  # a step lasts as long as its slowest rank
        self.times = []
        if self.kind == "mergecomp":
            self._mergecomp_boundary(statistics.median(t.tolist()))
        else:
            self._layerfusion_boundary()

    # -- mergecomp
    def _mergecomp_boundary(self, seconds: float) -> None:
        s = self.spec.schedule
        decision = None
        if self.rank == 0:
            if self.search is None:
                order, infos = self._ordered_infos()
                self.search = MergeCompSearch(infos, max_groups=s.max_groups, max_candidates=s.max_candidates)
                self.order = order
            self.search.report(seconds)
            cuts = self.search.next_candidate()
            final = cuts is None
            if final:
                cuts = self.search.best[0]
            decision = {"order": self.order, "cuts": cuts, "final": final}
        decision = self._broadcast(decision)
        order = decision["order"]
        infos = [self.dp.infos[i] for i in order]
        layout = schedules.from_cuts(infos, decision["cuts"])
        # after a relayout the first step pays for new buffers: measure the ones after it
        self.window, self.measured = 1 + s.steps_per_candidate, s.steps_per_candidate
        if self.rank == 0:
            self.info["trace"] = [{"cuts": c, "groups": len(c) + 1, "ms": 1e3 * t} for c, t in self.search.trace]
        if decision["final"]:
            best_cuts, best_t = self.search.best if self.rank == 0 else (decision["cuts"], None)
            self._apply(layout, order, f"mergecomp best: {len(layout)} groups")
            if self.rank == 0:
                self.info["chosen"] = {"cuts": best_cuts, "ms": 1e3 * best_t}
                if self.root is not None:
                    names = [self.dp.order_names[i] for i in order]
                    problem = write_cache(self.root, self.key, {"order": names, "cuts": best_cuts, "ms": 1e3 * best_t,
                                                                "run": os.path.basename(os.path.abspath(self.run_dir))})
                    if problem:
                        self._cache_problem(f"{problem}; a new cache holds this run's partition")
            self._finish()
        else:
            self._apply(layout, order, f"mergecomp candidate: {len(layout)} groups")
            self._write()

    # -- layerfusion
    def _layerfusion_boundary(self) -> None:
        self.dp.record_ready = False
        samples = calibrate(self.dp)  # every rank: the same exchanges in the same order
        decision = None
        if self.rank == 0:
            order, infos = self._ordered_infos()
            tuner = LayerFusionTuner(infos)
            layout = tuner.propose(self.ready_steps, samples)
            decision = {"order": order, "layout": layout}
            self.info.update({"ready_ms": [1e3 * r for r in tuner.ready], "samples": samples,
                              "cost": {"fixed_ms": 1e3 * tuner.cost.fixed, "per_mb_ms": 1e3 * tuner.cost.per_byte * 2**20,
                                       "compute_fixed_ms": 1e3 * tuner.cost.compute_fixed,
                                       "compute_per_mb_ms": 1e3 * tuner.cost.compute_per_byte * 2**20},
                              "profile_steps": len(self.ready_steps)})
        decision = self._broadcast(decision)
        self._apply(decision["layout"], decision["order"], f"layerfusion: {len(decision['layout'])} groups")
        if self.rank == 0:
            self.info["chosen"] = {"buckets": len(decision["layout"])}
        self._finish()

    # -- both
    def _apply(self, layout: Buckets, order: List[int], what: str) -> None:
        t0 = self.timeline.now()
        self.dp.relayout(layout, order)
        self.timeline.span("tune", what, t0, self.timeline.now(), {"buckets": len(layout)})
        if self.on_layout:
            self.on_layout()

    def _finish(self) -> None:
        self.done = True
        self.dp.record_ready = False
        self.info["tuning_steps"] = self.steps
        self._write()

    def _write(self) -> None:
        if self.rank != 0 or not self.run_dir:
            return
        self.info["layout"] = self.dp.layout()
        with open(os.path.join(self.run_dir, "tuning.json"), "w") as f:
            json.dump(self.info, f, indent=1)


def calibrate(dp, reps: int = 3, sizes: int = 6) -> List[Tuple[float, float, float]]:
    """(raw bytes, total seconds, compressor seconds) of whole one-bucket exchanges with the
    run's compressor, at ``sizes`` sizes spread geometrically from the smallest tensor to the
    whole model; medians of ``reps`` each. A throwaway compressor per exchange: the run's
    state is untouched."""
    from engine.core import time_exchange
    p0 = dp.params[0]
    lo = max(min(p.numel() for p in dp.params), 64)
    hi = max(sum(p.numel() for p in dp.params), lo + 1)
    out = []
    for j in range(sizes):
        n = int(round(lo * (hi / lo) ** (j / (sizes - 1))))
        ts = [time_exchange(dp.make_compressor, n, p0.dtype, p0.device, dp.group, dp.link)
              for _ in range(reps + 1)][1:]  # the first warms up
        out.append((float(n * p0.element_size()), statistics.median(t for t, _ in ts),
                    statistics.median(c for _, c in ts)))
    return out
