"""The exchange driver: runs a compressor's exchange generator (commlab/engine/compressors/base.py) a round at a
time: compress (error feedback inside ``BucketContext.encode``), one collective per round, decompress. The comm modes
(sync, wfbp and dear alike), the DDP hooks (commlab/engine/comm/hooks.py), LayerFusion's calibration, the
performance model and the tests all drive exchanges through it, over a process group
(``process_group_collective``) or in one process (``local_collective``). An exchange is either whole
(``Compressor.exchange``: every rank ends with the average) or sharded (dear's,
commlab.engine.compressors.contract.shard_exchange: rank r ends with its shard of the average). The driver counts
the payload bytes each round puts on the wire (``Exchange.sent``): the compressors keep no measurement."""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from commlab.engine.comm.collectives import OPS, group_backend, issue
from commlab.engine.compressors import contract
from commlab.engine.compressors.base import Compressor, Round, round_bytes
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext
from commlab.engine.netmodel import ModeledLink

Tensor = torch.Tensor


class Exchange:
    """One compressor's exchange of one tensor, driven a round at a time.

        ex = Exchange(compressor, t, world)
        rnd = ex.start()                 # compress: the first round
        while rnd is not None:
            rnd = ex.send(collective(rnd))   # the round's result in: the next round, or None
        ex.out                           # the average (it may be ``t`` itself)
        ex.sent                          # the payload bytes this rank put on the wire, every round

    ``bucket``: the bucket the compressor serves (``BucketContext``: its index, this rank, the layout); a
    compressor used on its own gets ``DEFAULT_BUCKET``. With ``rank`` the exchange is sharded (dear's,
    ``contract.shard_exchange``): ``ex.out`` is this rank's shard of the average, ``t.numel() // world``
    elements. With ``timer`` (a clock that waits for the device, e.g. ``perf_counter`` after a CUDA
    synchronize), ``compute`` lists the seconds spent in the compressor per call: encode, the work between
    rounds, decode."""

    __slots__ = ("gen", "out", "rounds", "sent", "timer", "compute", "alike")

    def __init__(self, compressor: Compressor, t: Tensor, world: int, timer: Optional[Callable[[], float]] = None,
                 prescaled: bool = False, rank: Optional[int] = None, bucket: BucketContext = DEFAULT_BUCKET):
        """``prescaled``: ``t`` was already divided by ``world`` (only where ``prescales(compressor)``):
        the exchange is one all-reduce of ``t`` in place. ``rank``: this rank, for a sharded exchange."""
        if prescaled and (rank is not None or not Exchange.prescales(compressor)):
            raise ValueError(f"compressor {compressor.name}: only a whole exchange of an identity compressor "
                             "without error feedback takes a pre-scaled input")
        if prescaled:
            self.gen = _sum(t)
        elif rank is not None:
            self.gen = contract.shard_exchange(compressor, t, world, rank, bucket)
        else:
            self.gen = compressor.exchange(t, world, bucket)
        self.out: Optional[Tensor] = None
        self.rounds = 0
        """Rounds issued so far."""
        self.sent = 0
        """Payload bytes this rank put on the wire so far, over every round (an all-to-all: every destination's
        part): what the exchange sent once it is done."""
        self.timer = timer
        self.compute: List[float] = []
        self.alike = compressor.capabilities.fixed_payload
        """Its all-gathers' payloads have the same tensor sizes on every rank (``Round.alike``)."""

    @staticmethod
    def prescales(compressor: Compressor) -> bool:
        """True when ``compressor``'s exchange is a plain sum of its input divided by the world size
        (``Capabilities.identity``; error feedback is no identity): the division can then be fused into the
        copy that lands the gradient, before the all-reduce, as DDP does, instead of a pass after it."""
        return compressor.capabilities.identity

    def start(self) -> Round:
        return self._step(None)

    def send(self, reply) -> Optional[Round]:
        return self._step(reply)

    def _step(self, reply) -> Optional[Round]:
        t0 = self.timer() if self.timer else 0.0
        try:
            rnd = next(self.gen) if self.rounds == 0 else self.gen.send(reply)
        except StopIteration as stop:
            self.out = stop.value
            rnd = None
        if self.timer:
            self.compute.append(self.timer() - t0)
        if rnd is not None:
            self.rounds += 1
            if self.alike and rnd.op == "allgather":
                rnd.alike = True
            if rnd.parts is None:  # counted inline: no call per round on the hot path
                n = self.sent
                for x in rnd.tensors:
                    n += x.numel() * x.element_size()
                self.sent = n
            else:
                self.sent += round_bytes(rnd)
        return rnd


def _sum(t: Tensor):
    """The exchange of an identity compressor whose input is already divided by the world size."""
    (out,) = yield Round("allreduce", [t])
    return out


Collective = Callable[[str, list], list]
"""``collective(op, payloads)``: one payload per rank this process stands for (a list of tensors; for
all_to_all the round's ``parts``, one payload per destination rank); returns one reply per rank, as
``Round`` describes them (all-reduce: the summed tensors; all-gather: every rank's payload;
reduce-scatter: [this rank's chunk of the sum]; all-to-all: [the payload from each rank])."""


def run_exchange(comps: Sequence[Compressor], tensors: Sequence[Tensor], world: int, collective: Collective,
                 timer: Optional[Callable[[], float]] = None, ranks: Optional[Sequence[int]] = None,
                 buckets: Optional[Sequence[BucketContext]] = None) -> List[Exchange]:
    """Drive the exchanges of ``comps`` on ``tensors`` (one per rank this process stands for: one on
    a real rank, several when ranks are simulated in one process) to the end, in lockstep, every
    round through ``collective``. ``ranks`` (the rank each one stands for: ``[my rank]`` on a real rank,
    ``range(world)`` when all are simulated) makes the exchanges sharded (dear's). ``buckets``: each one's
    ``BucketContext`` (default ``DEFAULT_BUCKET``). Returns the finished ``Exchange``s (``.out``, ``.sent``,
    ``.compute``)."""
    n = len(comps)
    exs = [Exchange(c, t, world, timer, rank=r, bucket=b)
           for c, t, r, b in zip(comps, tensors, ranks if ranks is not None else [None] * n,
                                 buckets if buckets is not None else [DEFAULT_BUCKET] * n)]
    rounds = [ex.start() for ex in exs]
    while rounds[0] is not None:
        op = rounds[0].op
        if any(r is None or r.op != op for r in rounds):
            raise RuntimeError(f"ranks asked for different collectives: {[r and r.op for r in rounds]}")
        replies = collective(op, [r.parts if op == "all_to_all" else r.tensors for r in rounds])
        rounds = [ex.send(rep) for ex, rep in zip(exs, replies)]
    if any(r is not None for r in rounds):
        raise RuntimeError("ranks needed different numbers of rounds")
    return exs


def process_group_collective(group=None, link: Optional[ModeledLink] = None) -> Collective:
    """The collective of a real rank (one payload per process), over ``group``, waited for."""
    via_alltoall = group_backend(group) == "gloo"  # as dear's: gloo's reduce-scatter moves twice the bytes

    def collective(op: str, payloads: list) -> list:
        (mine,) = payloads
        rnd = Round(op, [], parts=mine) if op == "all_to_all" else Round(op, mine)
        return [issue(rnd, group, link, via_alltoall=via_alltoall).wait()]
    return collective


def local_collective(op: str, payloads: list) -> list:
    """The collectives' results when every rank's payload is in this process (simulated ranks, as many
    as there are payloads). Every rank gets its own copy, as from a real collective (a decoder may
    work in place); a single rank gets its payload back as it is."""
    world = len(payloads)
    if op == "allreduce":
        if world == 1:
            return [list(payloads[0])]
        total = [torch.stack(ts).sum(0) for ts in zip(*payloads)]
        return [[t.clone() for t in total] for _ in payloads]
    if op == "allgather":
        if world == 1:
            return [[list(payloads[0])]]
        return [[[x.clone() for x in p] for p in payloads] for _ in payloads]
    if op == "reduce_scatter":
        if world == 1:
            return [list(payloads[0])]
        total = torch.stack([t for (t,) in payloads]).sum(0)
        return [[c.clone()] for c in total.chunk(world)]
    if op == "all_to_all":
        if world == 1:
            return [[payloads[0][0]]]
        return [[[x.clone() for x in payloads[i][j]] for i in range(world)] for j in range(world)]
    raise ValueError(f"a compressor asked for an unknown collective {op!r}; allowed: {', '.join(OPS)}")


def exchange(comp: Compressor, t: Tensor, world: int, group=None, link: Optional[ModeledLink] = None,
             bucket: BucketContext = DEFAULT_BUCKET) -> Tensor:
    """A whole exchange of ``t`` on this rank, waited for: the average over ranks (a blocking
    convenience for calibrations and tests)."""
    return run_exchange([comp], [t], world, process_group_collective(group, link), buckets=[bucket])[0].out


def time_exchange(make_compressor: Callable[[], Compressor], numel: int, dtype, device, group=None,
                  link: Optional[ModeledLink] = None) -> tuple:
    """``(total, compute)`` seconds of one whole exchange of a bucket of ``numel`` elements with a
    fresh compressor, run synchronously: all of it, and the part spent in the compressor (compress
    and decode, on this thread). Collective: every rank calls it with the same arguments
    (LayerFusion's calibration)."""
    comp = make_compressor()
    bucket = BucketContext(0, dist.get_rank(group), ((0, (numel,)),))
    g = torch.Generator().manual_seed(numel)
    t = torch.randn(numel, generator=g).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if t.is_cuda else None

    def timer():
        if sync:
            sync(t.device)
        return time.perf_counter()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    (ex,) = run_exchange([comp], [t], dist.get_world_size(group), process_group_collective(group, link), timer,
                         buckets=[bucket])
    return time.perf_counter() - t0, sum(ex.compute)
