"""Alpha-beta cost of the collectives the engine issues, in terms of a ``Link``.

A link is ``alpha`` seconds per algorithm step and ``beta`` seconds per byte
on one rank's link (full duplex, one link per rank, as in the shaped cluster).
The ring formulas themselves live in commlab/engine/netmodel.py (the engine's modeled
link uses them); this module only expresses them per Link and adds what the
engine does around them:

- an all-gather of payloads that differ in size between ranks is padded to
  the largest (commlab.engine.comm.collectives.issue_allgather), and preceded by a synchronous
  all-gather of a small header of shapes (40 bytes per payload tensor);
- a parameter server (not used by the engine; for what-ifs): every worker
  pushes its ``n`` bytes to the server(s) and pulls the result back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from commlab.engine import netmodel

HEADER_BYTES_PER_TENSOR = 40
"""issue_allgather's header: 5 int64 per payload tensor (ndim + up to 4 dims)."""


@dataclass(frozen=True)
class Link:
    alpha: float
    """seconds per algorithm step (latency, per message)"""
    beta: float
    """seconds per byte on one rank's link (sustained)"""
    burst_bytes: float = 0.0
    """a token bucket of this many bytes (the tbf of an emulated link), full after idle time"""
    beta_burst: float = 0.0
    """seconds per byte while the token bucket lasts (the unshaped path's speed)"""
    gamma: float = 0.0
    """seconds per byte a rank sums after a reduce-scatter's transfer (dear's reduce-scatter on gloo adds what its
    all-to-all brought, (p-1)/p of the buffer, once it has arrived); 0 where the sum runs inside the transfer, as
    in NCCL's kernels and in gloo's ring all-reduce (each chunk summed while the next is on the wire)"""
    fixed: Tuple[Tuple[str, float], ...] = ()
    """each collective's cost per call beyond its steps' latency, as ``(op, seconds)`` pairs (NCCL's tuning model
    has such a base latency per algorithm; on gloo it is the call's own host work): ``allreduce``, ``allgather``,
    ``reduce_scatter``, ``all_to_all``, and ``header`` (the synchronous shape exchange in front of a payload
    all-gather, beyond the all-gather it is)"""

    @classmethod
    def from_gbps(cls, gbps: float, latency_us: float = 0.0) -> "Link":
        return cls(latency_us / 1e6, netmodel.seconds_per_byte(gbps))

    @property
    def gbps(self) -> float:
        return 8.0 / (self.beta * 1e9) if self.beta > 0 else float("inf")

    def scaled(self, nominal_gbps: float, gbps: float) -> "Link":
        """This link, measured on a ``nominal_gbps`` link, at another nominal rate with the same
        efficiency: a 1 Gbit link with a goodput of 0.9 Gbit becomes 9 Gbit at 10. A token
        bucket keeps its length in time (its bytes scale with the rate)."""
        return Link(self.alpha, self.beta * nominal_gbps / gbps, self.burst_bytes * gbps / nominal_gbps,
                    self.beta_burst, self.gamma, self.fixed)

    def host_cost(self, op: str, nbytes: float, world: int) -> float:
        """What one call of ``op`` costs beyond its steps and wire bytes: its ``fixed`` cost (a ``header``'s and
        the all-gather's it is), and for a reduce-scatter ``gamma`` times the (p-1)/p of ``nbytes`` a rank adds."""
        if world <= 1:
            return 0.0
        fixed = dict(self.fixed)
        summed = (world - 1) / world * nbytes if op in SUMMED else 0.0
        own = fixed.get(op, 0.0) + (fixed.get("allgather", 0.0) if op == "header" else 0.0)  # a header is an all-gather
        return own + self.gamma * summed


def _net(link: Link):
    # netmodel takes a rate and a latency; beta = 0 (an infinitely fast link) is a rate of +inf
    return (8.0 / (link.beta * 1e9) if link.beta > 0 else float("inf")), link.alpha * 1e6


def allreduce(nbytes: float, world: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` per rank: ``2(p-1) alpha + 2(p-1)/p n beta``, plus its fixed cost
    (``Link.host_cost``)."""
    gbps, lat = _net(link)
    return netmodel.ring_allreduce_s(nbytes, world, gbps, lat) + link.host_cost("allreduce", nbytes, world)


def reduce_scatter(nbytes: float, world: int, link: Link) -> float:
    """Ring reduce-scatter of ``nbytes`` per rank: ``(p-1) alpha + (p-1)/p n beta``, plus the host cost
    (fixed, and ``(p-1)/p n gamma`` summed)."""
    gbps, lat = _net(link)
    return netmodel.reduce_scatter_s(nbytes, world, gbps, lat) + link.host_cost("reduce_scatter", nbytes, world)


def all_to_all(nbytes: float, world: int, link: Link) -> float:
    """All-to-all of ``nbytes`` per rank (1/p of it to each rank): what a ring reduce-scatter moves, ``(p-1)
    alpha + (p-1)/p n beta``, plus its fixed cost; nothing is summed."""
    gbps, lat = _net(link)
    return netmodel.reduce_scatter_s(nbytes, world, gbps, lat) + link.host_cost("all_to_all", nbytes, world)


def allgather(nbytes_per_rank: float, world: int, link: Link) -> float:
    """Ring all-gather, every rank contributing ``m`` bytes: ``(p-1) alpha + (p-1) m beta``, plus its fixed
    cost."""
    gbps, lat = _net(link)
    return netmodel.allgather_s(nbytes_per_rank, world, gbps, lat) + link.host_cost("allgather", nbytes_per_rank,
                                                                                    world)


def header(nbytes_per_rank: float, world: int, link: Link) -> float:
    """The synchronous header exchange in front of a payload all-gather: an all-gather of the shapes, plus
    what the engine does around it (``fixed`` ``header``)."""
    gbps, lat = _net(link)
    return netmodel.allgather_s(nbytes_per_rank, world, gbps, lat) + link.host_cost("header", nbytes_per_rank, world)


def allgather_var(payload_bytes: Sequence[float], world: int, link: Link, tensors: int = 1) -> float:
    """The engine's all-gather of payloads of different sizes per rank (``payload_bytes``,
    one per rank; a shorter list is repeated): a header all-gather (``tensors`` shapes),
    then one all-gather padded to the largest payload."""
    if not payload_bytes:
        raise ValueError("payload_bytes: need at least one rank's size")
    return header(HEADER_BYTES_PER_TENSOR * tensors, world, link) + allgather(max(payload_bytes), world, link)


def steps_and_wire(op: str, nbytes: float, world: int):
    """Ring steps and the bytes each rank sends for one collective (as in commlab.engine.netmodel):
    all-reduce ``2(p-1)`` and ``2(p-1)/p n``, reduce-scatter ``p-1`` and ``(p-1)/p n``,
    all-gather ``p-1`` and ``(p-1) m`` (m per rank); an all-to-all as a reduce-scatter (``SAME_COST``)."""
    p = world
    op = SAME_COST.get(op, op)
    if op == "allreduce":
        return 2 * (p - 1), 2 * (p - 1) / p * nbytes
    if op == "reduce_scatter":
        return p - 1, (p - 1) / p * nbytes
    if op == "allgather":
        return p - 1, (p - 1) * nbytes
    raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(COLLECTIVES)}")


@dataclass(frozen=True)
class Cluster:
    """A two-level cluster: nodes of ``node_size`` workers joined by a fast ``intra`` link, the
    nodes joined by a slower ``inter`` link. Collectives are hierarchical (as NCCL's and Horovod's
    hierarchical all-reduce), each level a ring:

    - all-reduce of n bytes: reduce-scatter inside the node (g = node_size ranks, intra link),
      all-reduce of the n/g shard across the N nodes (the g ranks of a node at once, one ring per
      local rank), all-gather inside the node:
      ``2(g-1) a_i + 2(g-1)/g n b_i + 2(N-1) a_e + 2(N-1)/N (n/g) b_e``
    - reduce-scatter of n: inside the node, then of the n/g shard across nodes:
      ``(g-1) a_i + (g-1)/g n b_i + (N-1) a_e + (N-1)/N (n/g) b_e``
    - all-gather of m per rank: across nodes first (m each), then inside the node (N m each):
      ``(N-1) a_e + (N-1) m b_e + (g-1) a_i + (g-1) N m b_i``

    ``b_e`` is the time per byte of one inter-node ring: a node's ``nics`` network interfaces
    (``inter`` each) are shared by its g concurrent rings, so ``b_e = inter.beta * g / min(nics, g)``.
    A world of at most one node is a flat ring on the intra link; a larger one must fill whole nodes.
    """
    node_size: int
    intra: Link
    inter: Link
    nics: int = 1

    burst_bytes = 0.0  # no token bucket: iteration.py reads this of any link

    def __post_init__(self):
        if self.node_size < 1:
            raise ValueError(f"node_size must be >= 1, got {self.node_size}")
        if self.nics < 1:
            raise ValueError(f"nics must be >= 1, got {self.nics}")

    def nodes(self, world: int) -> int:
        if world <= self.node_size:
            return 1
        if world % self.node_size:
            raise ValueError(f"workers: {world} does not fill whole nodes of {self.node_size}; "
                             f"use a multiple of {self.node_size}")
        return world // self.node_size

    def inter_ring(self) -> Link:
        """The link one inter-node ring gets: the node's NICs shared by its node_size rings."""
        g = self.node_size
        return Link(self.inter.alpha, self.inter.beta * g / min(self.nics, g))

    def time(self, op: str, nbytes: float, world: int) -> float:
        nodes = self.nodes(world)
        if nodes == 1:
            return COLLECTIVES[op](nbytes, world, self.intra)
        op = SAME_COST.get(op, op)
        g, inter = self.node_size, self.inter_ring()
        if op == "allreduce":
            return (reduce_scatter(nbytes, g, self.intra) + allreduce(nbytes / g, nodes, inter)
                    + allgather(nbytes / g, g, self.intra))
        if op == "reduce_scatter":
            return reduce_scatter(nbytes, g, self.intra) + reduce_scatter(nbytes / g, nodes, inter)
        if op == "allgather":
            return allgather(nbytes, nodes, inter) + allgather(nbytes * nodes, g, self.intra)
        raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(COLLECTIVES)}")

    def describe(self) -> str:
        nic = f", {self.nics} NICs" if self.nics > 1 else ""
        lat = (f", {self.intra.alpha * 1e6:g}/{self.inter.alpha * 1e6:g} µs"
               if self.intra.alpha or self.inter.alpha else "")
        return f"nodes of {self.node_size}, {self.intra.gbps:g} Gbit/s inside, {self.inter.gbps:g} between{nic}{lat}"


def collective(op: str, nbytes: float, world: int, link) -> float:
    """One collective's time on a flat ``Link`` (ring), or on any other link that prices its own
    collectives with ``time(op, nbytes, world)``: a two-level ``Cluster`` (hierarchical), an NCCL
    ``collectives.Topology``."""
    if isinstance(link, Link):
        return COLLECTIVES[op](nbytes, world, link)
    return link.time(SAME_COST.get(op, op), nbytes, world)


class TokenBucket:
    """A link with a token bucket (``Link.burst_bytes``): after idle time the first bytes go
    at ``beta_burst``, the rest at the sustained ``beta``, as through tc's tbf. Without a
    bucket it is the plain alpha-beta cost."""

    def __init__(self, link: Link):
        self.link = link
        self.tokens = link.burst_bytes
        self.t = 0.0

    def duration(self, op: str, nbytes: float, world: int, start: float) -> float:
        link = self.link
        if link.burst_bytes <= 0 or world == 1:
            return collective(op, nbytes, world, link)
        steps, wire = steps_and_wire(op, nbytes, world)
        if link.beta > 0:
            self.tokens = min(link.burst_bytes, self.tokens + max(0.0, start - self.t) / link.beta)
        if wire <= self.tokens:
            move = wire * link.beta_burst
            self.tokens -= wire
        else:
            move = max(wire * link.beta_burst, (wire - self.tokens) * link.beta)
            self.tokens = 0.0
        d = steps * link.alpha + move + link.host_cost(op, nbytes, world)
        self.t = start + d
        return d


COLLECTIVES = {"allreduce": allreduce, "reduce_scatter": reduce_scatter, "allgather": allgather,
               "all_to_all": all_to_all, "header": header}
SAME_COST = {"all_to_all": "reduce_scatter", "header": "allgather"}
"""dear's all-to-all of a shard codec's payloads (n bytes per rank) moves what the reduce-scatter of n bytes it
stands for does, as commlab.engine.netmodel books it: each rank sends (p-1)/p of its input (it sums nothing: its host cost
is its own). A payload all-gather's header exchange is an all-gather."""
SUMMED = ("reduce_scatter",)
"""The collectives whose result a rank sums after the transfer (``Link.gamma``)."""
