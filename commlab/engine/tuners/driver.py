"""The tuning driver: one loop for every tuner (MergeComp, LayerFusion, dear's cap search).

Every rank holds a ``Tuning`` and calls ``after_step`` after every training step (search steps
are training steps: they train too). The loop, the same for every tuner:

    [the compressor's plain warm-up exchanges, PowerSGD's ``start_iter``: not measured] ->
    propose -> run ``window`` steps -> report (all-reduce, max: a step lasts as long as its
    slowest rank) -> [measure: extra collective work on every rank] -> decide on rank 0 ->
    broadcast the decision -> relayout on every rank at the same step boundary -> again, or done

Collectives happen only at decision boundaries, on all ranks alike. A tuner is a ``Tuner``
subclass in one file: its window, what it measures, and how rank 0 decides. Rank 0 writes
``tuning.json`` (the tuner's ``info`` and the layout) after every decision.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from commlab.engine import runfiles


@dataclass
class Decision:
    """What rank 0 decided at a boundary; broadcast to every rank, which applies it."""
    layout: Optional[List[List[int]]]
    """Buckets as positions into ``order`` (None: keep the current buckets)."""
    order: Optional[List[int]] = None
    """Indices into the communicator's parameters (None: the current order)."""
    final: bool = False
    """The search is over: this layout stays."""
    what: str = ""
    """A few words for the timeline's tune span."""
    log: dict = field(default_factory=dict)
    """A ``tune`` line for metrics.jsonl (rank 0), when not empty."""


class Tuner:
    """A tuner, on every rank alike (only rank 0's ``start`` and ``decide`` run). Subclasses set
    ``name``, ``window`` and ``skip`` and implement ``decide``; the rest is optional."""

    name = "tuner"
    profile = False
    """Record each gradient's ready time during the window's steps after its first (LayerFusion)."""

    def __init__(self, spec, comm, run_dir: Optional[str]):
        self.spec, self.comm, self.run_dir = spec, comm, run_dir
        self.window = 1
        """Steps per measurement."""
        self.skip = 0
        """Leading steps of a window that are not counted (warm-up, the step after a relayout)."""
        self.info: dict = {"schedule": self.name, "trace": []}
        """What tuning.json holds (rank 0's)."""

    @classmethod
    def steps_to_decide(cls, spec) -> Optional[int]:
        """At most how many steps (after the compressor's warm-up exchanges) the search of ``spec`` takes before
        its final decision, or None where that is not known in advance (dear's cap search)."""
        return None

    def start(self) -> Optional[Decision]:
        """Rank 0, before the first step: a decision to apply at once (a cached one), or None."""
        return None

    def measure(self) -> Any:
        """Every rank, at a boundary, before rank 0 decides: collective work the decision needs."""
        return None

    def decide(self, times: List[float], ready_steps: List[List[float]], measured: Any) -> Decision:
        """Rank 0: the window's counted step times (slowest rank's), ready-time profiles
        (seconds from the start of backward, in ready order) and ``measure``'s result -> a decision."""
        raise NotImplementedError

    def applied(self, decision: Decision) -> None:
        """Every rank, after a decision was applied (the next window's length)."""


class Tuning:
    """Runs one tuner inside a run. ``done`` once the final layout is in place."""

    def __init__(self, tuner: Tuner, comm, run_dir: Optional[str], timeline, group=None,
                 on_layout: Optional[Callable[[], None]] = None, log: Optional[Callable[[dict], None]] = None):
        self.tuner, self.comm, self.run_dir, self.timeline, self.group = tuner, comm, run_dir, timeline, group
        self.on_layout, self.log = on_layout, log
        self.rank = dist.get_rank(group)
        self.info = tuner.info
        self.times: List[float] = []
        self.ready_steps: List[List[float]] = []
        self.steps = 0
        self.done = False
        self.warm = max((b.compressor.capabilities.warmup_exchanges for b in comm.buckets), default=0)
        """Steps at the start whose exchanges are plain all-reduces (PowerSGD's ``start_iter``): a
        partition measured then would be timed uncompressed, so no window starts before they end."""
        if self.warm:
            self.info["compressor_warmup_steps"] = self.warm
        self._apply(self._broadcast(tuner.start() if self.rank == 0 else None))

    def _broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def after_step(self, seconds: float, backward_start: float) -> None:
        """A training step ended; ``backward_start`` is its host time of the start of backward."""
        if self.done:
            return
        comm, tuner = self.comm, self.tuner
        self.steps += 1
        if self.steps <= self.warm:
            return
        self.times.append(seconds)
        if comm.record_ready:
            self.ready_steps.append([comm.ready_at[i] - backward_start for i in comm.ready_order])
        if tuner.profile:
            comm.record_ready = True  # from the window's second step: the first one pays one-time costs
        if len(self.times) < tuner.window:
            return
        comm.record_ready = False
        device = comm.params[0].device if comm.params else torch.device("cpu")
        t = torch.tensor(self.times[tuner.skip:], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)  # a step lasts as long as its slowest rank
        self.times = []
        measured = tuner.measure()
        decision = tuner.decide(t.tolist(), self.ready_steps, measured) if self.rank == 0 else None
        self._apply(self._broadcast(decision))

    def _apply(self, d: Optional[Decision]) -> None:
        if d is None:
            return
        if d.layout is not None:
            t0 = self.timeline.now()
            self.comm.relayout(d.layout, d.order)
            self.timeline.span("tune", d.what, t0, self.timeline.now(), {"buckets": len(d.layout)})
            if self.on_layout:
                self.on_layout()
        if d.log and self.rank == 0 and self.log:
            self.log({"kind": "tune", "step": self.steps, "rank": 0, **d.log, "t": time.time()})
        self.tuner.applied(d)
        if d.final:
            self.done = True
            self.comm.record_ready = False
            self.info["tuning_steps"] = self.steps
        self._write()

    def _write(self) -> None:
        if self.rank != 0 or not self.run_dir:
            return
        self.info["layout"] = self.comm.layout()
        with open(os.path.join(self.run_dir, runfiles.TUNING), "w") as f:
            json.dump(self.info, f, indent=1)
