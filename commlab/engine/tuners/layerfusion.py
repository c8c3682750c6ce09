"""LayerFusion (Sketch-Fusion SGD, Dai et al. 2024): merges layers from measured per-layer ready
times and a fitted per-call cost, in one decision.

``LayerFusionTuner`` is pure (fed a profile); ``LayerFusion`` is the tuner the driver
(commlab/engine/tuners/driver.py) runs: it profiles ``schedule.profile_steps`` steps, calibrates the
exchange on every rank, and rank 0 decides.
"""
from __future__ import annotations

import statistics
from typing import List, Optional, Sequence, Tuple

from commlab.engine import schedules
from commlab.engine.comm.exchange import time_exchange
from commlab.engine.schedules import Buckets, CallCost, ParamInfo
from commlab.engine.tuners.driver import Decision, Tuner


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


class LayerFusion(Tuner):
    name = "layerfusion"
    profile = True

    def __init__(self, spec, comm, run_dir: Optional[str]):
        super().__init__(spec, comm, run_dir)
        self.window = 1 + spec.schedule.profile_steps  # the first step records the ready order; the others profile

    @classmethod
    def steps_to_decide(cls, spec) -> int:
        return 1 + spec.schedule.profile_steps

    def measure(self):
        return calibrate(self.comm)  # every rank: the same exchanges in the same order

    def decide(self, times, ready_steps, samples) -> Decision:
        order = list(self.comm.ready_order)
        tuner = LayerFusionTuner([self.comm.infos[i] for i in order])
        layout = tuner.propose(ready_steps, samples)
        c = tuner.cost
        self.info.update({"ready_ms": [1e3 * r for r in tuner.ready], "samples": samples,
                          "cost": {"fixed_ms": 1e3 * c.fixed, "per_mb_ms": 1e3 * c.per_byte * 2**20,
                                   "compute_fixed_ms": 1e3 * c.compute_fixed,
                                   "compute_per_mb_ms": 1e3 * c.compute_per_byte * 2**20},
                          "profile_steps": len(ready_steps), "chosen": {"buckets": len(layout)}})
        return Decision(layout, order, final=True, what=f"layerfusion: {len(layout)} groups")


def calibrate(dp, reps: int = 3, sizes: int = 6) -> List[Tuple[float, float, float]]:
    """(raw bytes, total seconds, compressor seconds) of whole one-bucket exchanges with the
    run's compressor, at ``sizes`` sizes spread geometrically from the smallest tensor to the
    whole model; medians of ``reps`` each. A throwaway compressor per exchange: the run's
    state is untouched."""
    p0 = dp.params[0]
    lo = max(min(p.numel() for p in dp.params), 64)
    hi = max(sum(p.numel() for p in dp.params), lo + 1)
    out = []
    for j in range(sizes):
        n = int(round(lo * (hi / lo) ** (j / (sizes - 1))))
        ts = [time_exchange(lambda: dp.plan.make(n * p0.element_size()), n, p0.dtype, p0.device, dp.group,
                            dp.link)
              for _ in range(reps + 1)][1:]  # the first warms up
        out.append((float(n * p0.element_size()), statistics.median(t for t, _ in ts),
                    statistics.median(c for _, c in ts)))
    return out
