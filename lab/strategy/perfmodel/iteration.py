"""Iteration time of one training step for each comm mode, simulated.

The simulation follows what engine.comm.wfbp (sync and wfbp) and engine.comm.dear do, with two
resources: the *compute thread* (forward, backward, and everything the engine
runs in its hooks and in ``finish``: encoding, decoding, waiting) and *one
link* that serialises collectives first come, first served (one process
group; the ring algorithms of consecutive collectives do not overlap).

Assumptions, stated because they decide the answers:

- Encoding and decoding run on the compute thread (they do in the engine: the
  bucket's compress runs inside the post-accumulate-grad hook, decode in
  ``finish``), so they delay backward and are never hidden behind it.
- A blocking wait inside backward (wfbp advancing a multi-round exchange such
  as PowerSGD, or the synchronous header all-gather of an all-gathered
  payload) stops backward until the collective completes.
- While collectives overlap backward (wfbp, dear), backward runs ``slowdown``
  times slower (the paper's overlap slowdown: the communication thread
  competes with compute for cores and memory bandwidth). 1.0 = no slowdown.
- An all-gathered payload is decoded once per rank: decode cost x world.

``dear`` (reduce-scatter in backward, all-gather of the updated parameters
before the next forward, optimizer step on a 1/p shard): every bucket's
all-gather is issued at the start of the step, in forward order; a bucket's
layers start their forward once the previous layers are done and its own
all-gather has completed. Its reduce-scatter is issued when it is ready in
backward, like wfbp.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from lab.strategy.perfmodel import costs

MODES = ("sync", "wfbp", "dear")


@dataclass
class Round:
    """One collective of a bucket's exchange and the compute that follows it on the
    compute thread (the next round's encoding, or the final decode)."""
    op: str
    nbytes: float
    """per rank: all-reduce/reduce-scatter input bytes, or the all-gather contribution"""
    after: float = 0.0
    tensors: int = 1
    """payload tensors (the header of an all-gather)"""
    header: bool = True
    """an all-gather first exchanges its payloads' shapes, synchronously (the engine's protocol; False
    for systems that agree on sizes elsewhere, e.g. Horovod's background negotiation)"""


@dataclass
class Bucket:
    ready: float
    """backward compute (seconds from the start of backward) when its last gradient exists"""
    encode: float
    rounds: List[Round]
    raw_bytes: float = 0.0
    forward: float = 0.0
    """forward compute of its layers (dear: what waits for its all-gather)"""


@dataclass
class Step:
    forward: float
    backward: float
    optimizer: float
    buckets: List[Bucket]
    other: float = 0.0
    """per-step time outside forward, backward and optimizer (loss.item, bookkeeping)"""


@dataclass
class Result:
    total: float
    compute: float
    """forward + backward + optimizer + other with no communication at all"""
    exposed_comm: float = 0.0
    link_busy: float = 0.0
    encode_decode: float = 0.0
    events: List[dict] = field(default_factory=list)

    def as_dict(self) -> Dict[str, float]:
        return {"total": self.total, "compute": self.compute, "exposed_comm": self.exposed_comm,
                "link_busy": self.link_busy, "encode_decode": self.encode_decode}


class _Sim:
    def __init__(self, link: costs.Link, world: int, record: bool):
        self.link, self.world = link, world
        self.wire = costs.TokenBucket(link)
        self.free = 0.0      # when the link is next free
        self.busy = 0.0
        self.events = [] if record else None

    def collective(self, op: str, nbytes: float, t: float, label: str) -> float:
        """Issue at ``t``; returns when it completes (after whatever holds the link)."""
        start = max(t, self.free)
        self.free = start + self.wire.duration(op, nbytes, self.world, start)
        self.busy += self.free - start
        if self.events is not None:
            self.events.append({"lane": "comm", "name": f"{op} {label}", "start": start, "end": self.free})
        return self.free

    def issue(self, rnd: Round, t: float, label: str):
        """Returns (compute thread time after issuing, completion time)."""
        if rnd.op == "allgather" and rnd.header:  # the header exchange is synchronous: it blocks the compute thread
            t = self.collective("allgather", costs.HEADER_BYTES_PER_TENSOR * rnd.tensors, t, label + " header")
        return t, self.collective(rnd.op, rnd.nbytes, t, label)


WARM_STEPS = 3
"""Steps simulated before the one reported, when the link has a token bucket: what the
bucket holds at the start of a step depends on the steps before it."""


def iteration_time(step: Step, link: costs.Link, world: int, mode: str = "wfbp",
                   slowdown: float = 1.0, record: bool = False) -> Result:
    """Predicted time of one step (see the module docstring for the model)."""
    if mode not in MODES:
        raise ValueError(f"comm mode {mode!r}; allowed: {', '.join(MODES)}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    compute = step.forward + step.backward + step.optimizer + step.other
    if world == 1:
        return Result(compute, compute)
    one = _dear if mode == "dear" else _overlapped
    if link.burst_bytes <= 0:
        return one(step, _Sim(link, world, record), mode, slowdown, compute, 0.0)
    sim, t0 = _Sim(link, world, False), 0.0
    for _ in range(WARM_STEPS):
        t0 += one(step, sim, mode, slowdown, compute, t0).total
    sim.busy, sim.events = 0.0, [] if record else None
    return one(step, sim, mode, slowdown, compute, t0)


def _overlapped(step: Step, sim: "_Sim", mode: str, slowdown: float, compute: float, t0: float) -> Result:
    """sync and wfbp, one step starting at ``t0`` on the simulation's clock."""
    n = len(step.buckets)
    pos = [0] * n          # next round of each bucket
    done_at = [0.0] * n    # completion of its current round
    coder = 0.0            # encode + decode time spent on the compute thread

    def launch(k: int, c: float) -> float:
        nonlocal coder
        b = step.buckets[k]
        c += b.encode
        coder += b.encode
        c, done_at[k] = sim.issue(b.rounds[0], c, f"b{k}")
        return c

    def advance(k: int, c: float) -> float:
        """Wait for bucket k's current round, then encode its next one or decode."""
        nonlocal coder
        b, r = step.buckets[k], pos[k]
        c = max(c, done_at[k]) + b.rounds[r].after
        coder += b.rounds[r].after
        pos[k] = r + 1
        if pos[k] < len(b.rounds):
            c, done_at[k] = sim.issue(b.rounds[pos[k]], c, f"b{k} r{pos[k] + 1}")
        return c

    c = t0 + step.forward
    if mode == "sync":
        c += step.backward
        for k in range(n):
            c = launch(k, c)
    else:
        shift = 0.0  # time the hooks held backward up (encoding, waits)
        for k, b in enumerate(step.buckets):
            c = max(c, t0 + step.forward + b.ready * slowdown + shift)
            c0 = c
            for j in range(k):  # engine: multi-round exchanges advance whenever a later bucket launches
                if pos[j] < len(step.buckets[j].rounds) and len(step.buckets[j].rounds) > 1:
                    c = advance(j, c)
            c = launch(k, c)
            shift += c - c0
        c = max(c, t0 + step.forward + step.backward * slowdown + shift)
    t_bwd = c
    active = [k for k in range(n) if pos[k] < len(step.buckets[k].rounds)]
    while active:  # finish(): round robin in bucket order
        for k in active:
            c = advance(k, c)
        active = [k for k in active if pos[k] < len(step.buckets[k].rounds)]
    total = c + step.optimizer + step.other - t0
    res = Result(total, compute, exposed_comm=max(0.0, total - compute - coder), link_busy=sim.busy,
                 encode_decode=coder, events=sim.events or [])
    res.events.append({"lane": "compute", "name": "forward+backward", "start": t0, "end": t_bwd})
    return res


def _dear(step: Step, sim: "_Sim", mode: str, slowdown: float, compute: float, t0: float) -> Result:
    world = sim.world
    n = len(step.buckets)
    fwd_total = sum(b.forward for b in step.buckets)
    # forward compute outside the buckets' layers (activations, loss) spread in proportion
    scale = step.forward / fwd_total if fwd_total > 0 else 0.0
    ag_done = {}
    for k in reversed(range(n)):  # forward order is the reverse of gradient-ready order
        ag_done[k] = sim.collective("allgather", step.buckets[k].raw_bytes / world, t0, f"b{k} params")
    c = t0
    for k in reversed(range(n)):
        c = max(c, ag_done[k]) + step.buckets[k].forward * scale
    if fwd_total == 0:
        c = max([c] + list(ag_done.values())) + step.forward
    t_fwd = c
    coder, shift, rs_done = 0.0, 0.0, []
    for k, b in enumerate(step.buckets):
        c = max(c, t_fwd + b.ready * slowdown + shift)
        c0 = c
        c += b.encode
        coder += b.encode
        # the bucket's sharded round: a reduce-scatter of the payload, or a shard codec's all-to-all
        rs_done.append(sim.collective(b.rounds[0].op, b.rounds[0].nbytes, c, f"b{k}"))
        shift += c - c0
    c = max(c, t_fwd + step.backward * slowdown + shift)
    for k, b in enumerate(step.buckets):
        c = max(c, rs_done[k]) + b.rounds[0].after
        coder += b.rounds[0].after
    total = c + step.optimizer / world + step.other - t0
    return Result(total, compute, exposed_comm=max(0.0, total - compute - coder), link_busy=sim.busy,
                  encode_decode=coder, events=sim.events or [])
