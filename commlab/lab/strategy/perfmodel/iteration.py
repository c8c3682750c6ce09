"""Iteration time of one training step for each comm mode, simulated.

The simulation follows what commlab.engine.comm.wfbp (sync and wfbp) and commlab.engine.comm.dear do, with two
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
- While a collective is in flight during backward (wfbp, dear), backward runs
  ``slowdown`` times slower (the paper's overlap slowdown: the communication
  thread competes with compute for cores and memory bandwidth); while the link
  is idle it runs at full speed. So a single bucket sent when backward is over
  (a 25 MB cap on a small model) slows nothing. 1.0 = no slowdown.
- An all-gathered payload's decode is the round's ``after``: build_step prices
  it for ``world`` payloads (commlab.lab.strategy.perfmodel.predict).

``dear`` (reduce-scatter in backward, all-gather of the updated parameters
before the next forward, optimizer step on a 1/p shard), as commlab/engine/comm/dear.py
issues it: when a bucket's first layer starts its forward, the all-gathers of
that bucket and of the next one (forward order) are issued if they were not
yet, and the layer waits for its own; so one gather runs ahead of forward, not
all of them. Its reduce-scatter is issued when it is ready in backward, like
wfbp; after backward, one 4-byte all-reduce (the ranks' agreement on finite
gradients) follows the reduce-scatters and is waited for before the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from commlab.engine.spec import COMM_AVAILABLE
from commlab.lab.strategy.perfmodel import costs

DEAR_FLAG_BYTES = 4
"""dear's per-step all-reduce of one float32: do all ranks hold finite gradients (DeAR.finish)."""


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
    """an all-gather first exchanges its payloads' shapes, synchronously (the engine's protocol; False for a
    compressor that declares ``fixed_payload``, and for systems that agree on sizes elsewhere, e.g. Horovod's
    background negotiation)"""


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
        self.spans: List[tuple] = []  # (start, end) of every collective: first come, first served, so in order

    def collective(self, op: str, nbytes: float, t: float, label: str) -> float:
        """Issue at ``t``; returns when it completes (after whatever holds the link)."""
        start = max(t, self.free)
        self.free = start + self.wire.duration(op, nbytes, self.world, start)
        self.busy += self.free - start
        if self.free > start:
            self.spans.append((start, self.free))
        if self.events is not None:
            self.events.append({"lane": "comm", "name": f"{op} {label}", "start": start, "end": self.free})
        return self.free

    def compute(self, t: float, work: float, slowdown: float) -> float:
        """When ``work`` seconds of compute started at ``t`` end, running ``slowdown`` times slower while a
        collective issued so far is in flight. Collectives are only issued between pieces of compute, so
        those issued so far are all that can overlap this piece."""
        if slowdown == 1.0 or work <= 0:
            return t + max(work, 0.0)
        for s0, s1 in self.spans[self._first_after(t):]:
            if s0 > t:  # the link idle until s0: full speed
                if work <= s0 - t:
                    return t + work
                work -= s0 - t
                t = s0
            if work * slowdown <= s1 - t:
                return t + work * slowdown
            work -= (s1 - t) / slowdown
            t = s1
        return t + work

    def _first_after(self, t: float) -> int:
        """Index of the first span that ends after ``t`` (spans end in order)."""
        lo, hi = 0, len(self.spans)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.spans[mid][1] <= t:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def issue(self, rnd: Round, t: float, label: str):
        """Returns (compute thread time after issuing, completion time)."""
        if rnd.op == "allgather" and rnd.header:  # the header exchange is synchronous: it blocks the compute thread
            t = self.collective("header", costs.HEADER_BYTES_PER_TENSOR * rnd.tensors, t, label)
        return t, self.collective(rnd.op, rnd.nbytes, t, label)


WARM_STEPS = 3
"""Steps simulated before the one reported, when the link has a token bucket: what the
bucket holds at the start of a step depends on the steps before it."""


def iteration_time(step: Step, link: costs.Link, world: int, mode: str = "wfbp",
                   slowdown: float = 1.0, record: bool = False) -> Result:
    """Predicted time of one step (see the module docstring for the model)."""
    if mode not in COMM_AVAILABLE:
        raise ValueError(f"comm mode {mode!r}; allowed: {', '.join(COMM_AVAILABLE)}")
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
        done = 0.0  # backward compute done so far; the hooks (encoding, waits) hold it up in between
        pending: List[int] = []  # launched multi-round buckets with rounds left, in bucket order
        for k, b in enumerate(step.buckets):
            if b.ready > done:
                c, done = sim.compute(c, b.ready - done, slowdown), b.ready
            if pending:  # engine: multi-round exchanges advance whenever a later bucket launches
                for j in pending:
                    c = advance(j, c)
                pending = [j for j in pending if pos[j] < len(step.buckets[j].rounds)]
            c = launch(k, c)
            if len(b.rounds) > 1:
                pending.append(k)
        c = sim.compute(c, step.backward - done, slowdown)
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
    n = len(step.buckets)
    fwd_total = sum(b.forward for b in step.buckets)
    # forward compute outside the buckets' layers (activations, loss) spread in proportion
    scale = step.forward / fwd_total if fwd_total > 0 else 0.0
    ag_done = {}

    def gather(f: int, t: float) -> None:  # the f-th bucket in forward order (the reverse of gradient order)
        k = n - 1 - f
        ag_done[k] = sim.collective("allgather", step.buckets[k].raw_bytes / sim.world, t, f"b{k} params")
    c = t0
    if fwd_total == 0:
        for f in range(n):
            gather(f, t0)
        c = max([c] + list(ag_done.values())) + step.forward
    else:
        issued = 0
        for f in range(n):
            while issued <= min(f + 1, n - 1):  # its own gather and the next one, as DeAR._fetch does
                gather(issued, c)
                issued += 1
            k = n - 1 - f
            c = max(c, ag_done[k]) + step.buckets[k].forward * scale
    coder, done, rs_done = 0.0, 0.0, []
    for k, b in enumerate(step.buckets):
        if b.ready > done:
            c, done = sim.compute(c, b.ready - done, slowdown), b.ready
        c += b.encode
        coder += b.encode
        # the bucket's sharded round: a reduce-scatter of the payload, or a shard codec's all-to-all
        rs_done.append(sim.collective(b.rounds[0].op, b.rounds[0].nbytes, c, f"b{k}"))
    c = sim.compute(c, step.backward - done, slowdown)
    flag = sim.collective("allreduce", DEAR_FLAG_BYTES, c, "finite flag")
    for k, b in enumerate(step.buckets):
        c = max(c, rs_done[k]) + b.rounds[0].after
        coder += b.rounds[0].after
    c = max(c, flag)
    total = c + step.optimizer / sim.world + step.other - t0
    return Result(total, compute, exposed_comm=max(0.0, total - compute - coder), link_busy=sim.busy,
                  encode_decode=coder, events=sim.events or [])
