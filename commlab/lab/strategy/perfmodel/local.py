"""Methods that communicate less often (commlab/engine/methods/), simulated over a run's steps: the mean iteration
time and the bytes per step, from the method's own schedule (``Method.schedule``: which steps exchange how
many bytes, with how much overlap).

A step of a run with a method is one of:

- a **local step**: forward, backward and the optimizer step; nothing is sent (the communicator lands the
  gradients where the optimizer reads them);
- a **gradient step** (post-local SGD's warm-up): the spec's synchronous step, as ``iteration.py`` simulates it;
- a local step followed by a **sync** (after the optimizer step): encode, the collective rounds on the link,
  decode, then the outer step (DiLoCo's outer SGD). A sync is blocking (local SGD, DiLoCo: ``overlap`` 0) or
  overlapped (Streaming DiLoCo: issued after step s, its first round in flight while the ``overlap`` (tau)
  inner steps compute, waited for after step s + tau; later rounds, if any, run then);
- a step with **components** (DeMo): encode, an all-gather and decode between backward and the optimizer step.

So H-step local SGD with an exchange of X seconds and compute of Y seconds per step costs (H Y + X) / H per step
on average. The link serialises collectives first come, first served (a fragment in flight delays the next
one issued before it completes); a token bucket (emulated links) is carried through the whole run.

Assumptions beyond iteration.py's: an overlapped collective does not slow the compute it overlaps (it runs on
gloo's or NCCL's own threads; backward's ``overlap_slowdown`` is for bucket exchanges inside backward); the outer
step costs what it is given (the inner optimizer's step time, for an SGD step over the same parameters); the
copies in and out of the flat buffers are not counted. This module is pure arithmetic: ``predict.py`` prices
the events from a profile and calls ``simulate``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

from commlab.lab.strategy.perfmodel import costs
from commlab.lab.strategy.perfmodel.iteration import Result, Round

GRADIENTS = "gradients"
COMPONENTS = "components"


@dataclass
class Sync:
    """One of a method's exchanges, priced: the compute before its first collective, its rounds (each with
    the compute after it: the next round's encoding, or the decode), and the outer step once it is applied."""
    encode: float
    rounds: List[Round]
    outer: float = 0.0

    @property
    def payload(self) -> float:
        """Bytes this rank hands to the collectives (an all-gather's: its own contribution)."""
        return sum(r.nbytes for r in self.rounds)


@dataclass
class MethodResult(Result):
    """``Result``'s figures as means per step over the run, and the method's traffic."""
    steps: int = 0
    syncs: int = 0
    """the method's own exchanges in the run (a fragment counts once; DeMo's: one per step)"""
    bytes_per_step: float = 0.0
    """payload bytes per rank and step, amortized over the run (gradient steps included)"""
    bytes_per_sync: float = 0.0
    """payload bytes per rank of one of the method's own exchanges (mean)"""
    step_s: Dict[str, float] = field(default_factory=dict)
    """the mean time of each kind of step in the run: local, gradient, sync"""

    def as_dict(self) -> Dict[str, float]:
        return {**super().as_dict(), "steps": self.steps, "syncs": self.syncs, "bytes_per_step": self.bytes_per_step,
                "bytes_per_sync": self.bytes_per_sync, **{f"{k}_step": v for k, v in self.step_s.items()}}


class _Link:
    """Collectives on one link, first come first served, with the emulated link's token bucket."""

    def __init__(self, link, world: int):
        self.world = world
        self.wire = costs.TokenBucket(link) if isinstance(link, costs.Link) else None
        self.link = link
        self.free = 0.0
        self.busy = 0.0

    def collective(self, op: str, nbytes: float, t: float) -> float:
        start = max(t, self.free)
        d = (self.wire.duration(op, nbytes, self.world, start) if self.wire is not None
             else costs.collective(op, nbytes, self.world, self.link))
        self.free = start + d
        self.busy += d
        return self.free

    def round(self, r: Round, t: float) -> Tuple[float, float]:
        """Issue ``r`` at ``t``: (when the compute thread may go on, when the round completes). An all-gather's
        header exchange is synchronous: it holds the compute thread."""
        if r.op == "allgather" and r.header:
            t = self.collective("header", costs.HEADER_BYTES_PER_TENSOR * r.tensors, t)
        return t, self.collective(r.op, r.nbytes, t)


def simulate(events: Sequence, steps: int, forward_backward: float, optimizer: float, gradient_step: Result,
             price: Callable[[object], Sync], link, world: int) -> MethodResult:
    """The mean step of ``steps`` steps whose method issues ``events`` (``commlab.engine.methods.base.Event``s, in
    issue order): local steps of ``forward_backward + optimizer`` seconds, ``gradient_step`` for the events of
    kind "gradients" (its payload from ``price`` too), every other event priced by ``price(event)``. With one
    worker nothing is sent and every step is compute."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    local = forward_backward + optimizer
    if world == 1:
        return MethodResult(local, local, steps=steps, step_s={"local": local})
    by_step: Dict[int, list] = {}
    for e in events:
        by_step.setdefault(e.step, []).append(e)
    wire = _Link(link, world)
    t = compute = coder = sent = 0.0
    syncs, sync_bytes = 0, 0.0
    pending: Dict[int, List[Tuple[float, Sync]]] = {}
    kinds: Dict[str, List[float]] = {"local": [], "gradient": [], "sync": []}
    for s in range(steps):
        t_step = t
        evs = by_step.get(s, [])
        if any(e.kind == GRADIENTS for e in evs):
            t += gradient_step.total
            compute += gradient_step.compute
            coder += gradient_step.encode_decode
            wire.busy += gradient_step.link_busy
            sent += sum(price(e).payload for e in evs if e.kind == GRADIENTS)
            kind = "gradient"
        else:
            t += forward_backward
            compute += local
            for e in evs:
                if e.kind == COMPONENTS:  # DeMo: exchanged between backward and the optimizer step
                    sy = price(e)
                    t, done = _start(wire, sy, t)
                    t = _finish(wire, sy, t, done)
                    coder += sy.encode + sum(r.after for r in sy.rounds)
                    sent += sy.payload
                    syncs, sync_bytes = syncs + 1, sync_bytes + sy.payload
            t += optimizer
            kind = "sync" if evs else "local"
        for e in evs:
            if e.kind in (GRADIENTS, COMPONENTS):
                continue
            sy = price(e)
            t, done = _start(wire, sy, t)
            coder += sy.encode + sum(r.after for r in sy.rounds)
            sent += sy.payload
            syncs, sync_bytes = syncs + 1, sync_bytes + sy.payload
            pending.setdefault(s + e.overlap, []).append((done, sy))
            kind = "sync"
        for done, sy in pending.pop(s, []):  # applied after this step's own issues, as the engine does
            t = _finish(wire, sy, t, done) + sy.outer
            compute += sy.outer
            kind = "sync"
        kinds[kind].append(t - t_step)
    # exchanges still in flight at the end: the run drains them (their results are dropped)
    for items in pending.values():
        for done, _ in items:
            t = max(t, done)
    total = t / steps
    return MethodResult(total, compute / steps, exposed_comm=max(0.0, (t - compute - coder) / steps),
                        link_busy=wire.busy / steps, encode_decode=coder / steps, steps=steps, syncs=syncs,
                        bytes_per_step=sent / steps, bytes_per_sync=sync_bytes / syncs if syncs else 0.0,
                        step_s={k: sum(v) / len(v) for k, v in kinds.items() if v})


def _start(wire: _Link, sy: Sync, t: float) -> Tuple[float, float]:
    """Encode and issue the first round; (compute thread time, when that round completes)."""
    return wire.round(sy.rounds[0], t + sy.encode)


def _finish(wire: _Link, sy: Sync, t: float, done: float) -> float:
    """Wait for the first round, then run the rest as the engine's ``Transfer.finish`` does: the compute after
    each round, the next round issued and waited for; the decode last."""
    t = max(t, done) + sy.rounds[0].after
    for r in sy.rounds[1:]:
        t, done = wire.round(r, t)
        t = done + r.after
    return t
