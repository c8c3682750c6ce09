"""Collectives as NCCL runs them: ring and tree algorithms, three protocols, and two-level topologies.

Every cost is a pure function of (bytes, ranks, topology) -> seconds. ``n`` is the bytes of one rank's
input (all-reduce, reduce-scatter, all-to-all) or of one rank's contribution (all-gather, ``m``); ``p``
ranks, ``N`` nodes of ``g`` GPUs (``p = N g``). A collective costs a fixed latency, a latency per
algorithm step ("hop") and its bytes over the bus bandwidth ``B`` (bytes per second that one rank's
ring link carries each way) times the protocol's efficiency ``e``:

    T = base + hops * hop + wire_bytes / (e B)

Protocols (NCCL's LL, LL128 and Simple) trade latency for bandwidth: LL sends 8-byte lines of 4 bytes
of data and a 4-byte flag (no fence, lowest latency, a quarter of the bandwidth in NCCL's model of a
ring all-reduce), LL128 128-byte lines of which 120 bytes are data (0.92 of the bandwidth, on NVLink
only), Simple whole chunks with a fence per chunk (all of the bandwidth, the highest latency). The
constants below are those of NCCL's own tuning model (``src/graph/tuning.cc`` of NCCL 2.7/2.8, the
version of the V100 era; newer versions retune them), rounded as printed there:

- base latency per call (µs): ring LL 3.6, LL128 10.0, Simple 8.4; tree LL 4.4, LL128 4.4, Simple 0;
- latency per hop (µs), ring: NVLink 0.47 / 1.9 / 3.4, PCIe 1.0 / 2.5 / 5.7, network 2.7 / 4.0 / 9.6
  (LL / LL128 / Simple); tree: NVLink 0.52 / 1.2 / 28, PCIe 1.0 / 1.9 / 28, network 5.0 / 8.5 / 50;
- efficiency: ring LL 1/4 (all-reduce; 1/3 for the other ring collectives), LL128 0.92, Simple 1;
  tree: 0.9 of the ring's bus bandwidth, and of that LL 1/3.8, LL128 7/9 inside a node, 0.915 across.

NCCL picks, per call, the algorithm and protocol its model says is fastest; so does ``choose``. The
switch points (LL below a few KB to tens of KB, LL128 or Simple above; tree across many nodes for
small and medium messages, ring for large ones) follow from the constants, not from a table of sizes.
NCCL 2.7 uses trees for all-reduce only, and only across nodes (inside a node a "tree" is a chain, no
better than the ring); all-to-all is grouped point-to-point sends (Simple).

Two levels (``Topology``): nodes of ``g`` GPUs on an intra-node fabric (NVLink or PCIe, ``intra_bw``
per GPU each way), joined by ``nics`` network interfaces per node of ``nic_bw`` each. A ring across
nodes leaves and enters every node once per channel, and NCCL opens as many channels as it can use,
so its bus bandwidth is the smaller of a GPU's intra-node bandwidth and the node's aggregate network
bandwidth: ``B = min(intra_bw, nics * nic_bw)``; of its hops, ``2(N-1)`` (all-reduce) or ``N-1``
(reduce-scatter, all-gather) cross the network. ``hierarchical_allreduce`` is Horovod's and NCCL's
two-level variant (reduce-scatter inside, all-reduce of the shard across, all-gather inside).

``launch_s`` is a software overhead per call (the framework's: Horovod's negotiation cycle, a Python
hook), added to every collective; NCCL's own fixed costs are in ``base``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

US = 1e-6

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("ring", "tree")
OPS = ("allreduce", "reduce_scatter", "allgather", "alltoall")
FABRICS = ("nvlink", "pcie", "net")

BASE_US = {"ring": {"LL": 3.6, "LL128": 10.0, "Simple": 8.4}, "tree": {"LL": 4.4, "LL128": 4.4, "Simple": 0.0}}
HOP_US = {
    "ring": {"nvlink": {"LL": 0.47, "LL128": 1.9, "Simple": 3.4}, "pcie": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7},
             "net": {"LL": 2.7, "LL128": 4.0, "Simple": 9.6}},
    "tree": {"nvlink": {"LL": 0.52, "LL128": 1.2, "Simple": 28.0}, "pcie": {"LL": 1.0, "LL128": 1.9, "Simple": 28.0},
             "net": {"LL": 5.0, "LL128": 8.5, "Simple": 50.0}},
}
TREE_SHARE = 0.9
"""NCCL's model gives a tree 0.9 of the ring's bus bandwidth."""


def ring_efficiency(proto: str, op: str) -> float:
    """Fraction of the bus bandwidth a ring gets with ``proto`` (see the module docstring)."""
    if proto == "LL":
        return 1 / 4 if op == "allreduce" else 1 / 3
    return {"LL128": 0.92, "Simple": 1.0}[proto]


def tree_efficiency(proto: str, nodes: int) -> float:
    """Fraction of the ring's bus bandwidth a tree all-reduce gets with ``proto``."""
    return TREE_SHARE * {"LL": 1 / 3.8, "LL128": 7 / 9 if nodes == 1 else 0.915, "Simple": 1.0}[proto]


# --------------------------------------------------------------------------- the formulas, one per algorithm

def ring_allreduce(n: float, p: int, bw: float, hop: float, base: float = 0.0, eff: float = 1.0) -> float:
    """Ring all-reduce (a reduce-scatter then an all-gather): ``2(p-1)`` hops, each rank sending
    ``2(p-1)/p n`` bytes:  ``T = base + 2(p-1) hop + 2(p-1)/p * n / (eff bw)``; 0 for one rank."""
    if p <= 1:
        return 0.0
    return base + 2 * (p - 1) * hop + 2 * (p - 1) / p * n / (eff * bw)


def ring_reduce_scatter(n: float, p: int, bw: float, hop: float, base: float = 0.0, eff: float = 1.0) -> float:
    """Ring reduce-scatter of ``n`` bytes per rank (each keeps n/p):
    ``T = base + (p-1) hop + (p-1)/p * n / (eff bw)``; 0 for one rank."""
    if p <= 1:
        return 0.0
    return base + (p - 1) * hop + (p - 1) / p * n / (eff * bw)


def ring_allgather(m: float, p: int, bw: float, hop: float, base: float = 0.0, eff: float = 1.0) -> float:
    """Ring all-gather, every rank contributing ``m`` bytes (p m in all):
    ``T = base + (p-1) hop + (p-1) m / (eff bw)``; 0 for one rank."""
    if p <= 1:
        return 0.0
    return base + (p - 1) * hop + (p - 1) * m / (eff * bw)


def tree_allreduce(n: float, g: int, nodes: int, bw: float, hop_intra: float, hop_inter: float,
                   base: float = 0.0, eff: float = 1.0) -> float:
    """Tree all-reduce (NCCL's double binary tree across nodes, a chain of the g GPUs inside each):
    a reduce up the tree and a broadcast down it, pipelined, so every byte crosses a rank's link twice
    and the latency is the tree's depth, twice:
    ``T = base + 2((g-1) hop_intra + ceil(log2 N) hop_inter) + 2 n / (eff bw)``; 0 for one rank."""
    if g * nodes <= 1:
        return 0.0
    depth = (g - 1) * hop_intra + math.ceil(math.log2(nodes)) * hop_inter if nodes > 1 else (g - 1) * hop_intra
    return base + 2 * depth + 2 * n / (eff * bw)


def alltoall(n: float, p: int, bw: float, hop: float, base: float = 0.0, eff: float = 1.0) -> float:
    """All-to-all as pairwise exchanges: each rank sends ``n/p`` to each of the ``p-1`` others,
    one peer per step: ``T = base + (p-1) hop + (p-1)/p * n / (eff bw)``; 0 for one rank."""
    if p <= 1:
        return 0.0
    return base + (p - 1) * hop + (p - 1) / p * n / (eff * bw)


def alltoall_two_level(n: float, g: int, nodes: int, intra_bw: float, node_net_bw: float, hop: float,
                       base: float = 0.0) -> float:
    """All-to-all across ``nodes`` nodes of ``g`` GPUs: each rank sends ``n/p`` to each other rank;
    ``(g-1)/p n`` stays inside the node (its own intra link), ``(p-g)/p n`` leaves it, and the node's
    g ranks share its network bandwidth ``node_net_bw`` (nics * nic_bw) for that. The two parts move
    at once, so the slower decides:
    ``T = base + (p-1) hop + max((g-1)/p n / intra_bw, g (p-g)/p n / node_net_bw)``."""
    p = g * nodes
    if p <= 1:
        return 0.0
    return base + (p - 1) * hop + max((g - 1) / p * n / intra_bw, g * (p - g) / p * n / node_net_bw)


def hierarchical_allreduce(n: float, g: int, nodes: int, intra_bw: float, nic_bw: float, nics: int,
                           hop_intra: float, hop_inter: float, base: float = 0.0) -> float:
    """Two-level all-reduce: ring reduce-scatter inside the node, ring all-reduce of the ``n/g`` shard
    across the ``N`` nodes (the node's g rings at once, sharing its ``nics`` NICs: each gets
    ``nic_bw * min(nics, g) / g``), ring all-gather inside:
    ``T = base + 2(g-1) hop_i + 2(g-1)/g n / B_i + 2(N-1) hop_e + 2(N-1)/N (n/g) / (nic_bw min(nics,g)/g)``."""
    if g * nodes <= 1:
        return 0.0
    per_ring = nic_bw * min(nics, g) / g
    return (base + ring_reduce_scatter(n, g, intra_bw, hop_intra) + ring_allreduce(n / g, nodes, per_ring, hop_inter)
            + ring_allgather(n / g, g, intra_bw, hop_intra))


# --------------------------------------------------------------------------- a topology, and NCCL's choice

@dataclass(frozen=True)
class Topology:
    """Nodes of ``gpus_per_node`` GPUs on an ``intra`` fabric ("nvlink" or "pcie", ``intra_bw`` bytes/s
    per GPU each way), joined by ``nics`` NICs per node of ``nic_bw`` bytes/s each way.

    A world of at most one node uses the intra fabric alone; a larger one must fill whole nodes.
    ``hierarchical`` makes all-reduce two-level (Horovod's hierarchical all-reduce) instead of NCCL's
    ring or tree over all ranks. ``launch_s`` is added to every call (the framework's own overhead)."""
    gpus_per_node: int
    intra_bw: float
    nic_bw: float
    nics: int = 1
    intra: str = "nvlink"
    launch_s: float = 0.0
    hierarchical: bool = False
    protocols: Tuple[str, ...] = PROTOCOLS

    burst_bytes = 0.0  # no token bucket (commlab.lab.strategy.perfmodel.iteration reads this of any link)

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.nics < 1:
            raise ValueError(f"nics must be >= 1, got {self.nics}")
        if self.intra not in ("nvlink", "pcie"):
            raise ValueError(f"intra must be nvlink or pcie, got {self.intra!r}")
        if not (self.intra_bw > 0 and self.nic_bw > 0):
            raise ValueError("intra_bw and nic_bw must be > 0 (bytes per second)")
        bad = [p for p in self.protocols if p not in PROTOCOLS]
        if bad or not self.protocols:
            raise ValueError(f"protocols: {bad or '(none)'}; allowed: {', '.join(PROTOCOLS)}")

    def nodes(self, world: int) -> int:
        if world <= self.gpus_per_node:
            return 1
        if world % self.gpus_per_node:
            raise ValueError(f"workers: {world} does not fill whole nodes of {self.gpus_per_node}; "
                             f"use a multiple of {self.gpus_per_node}")
        return world // self.gpus_per_node

    def enabled(self, proto: str, nodes: int) -> bool:
        # NCCL enables LL128 by default only where the GPUs talk over NVLink
        return proto in self.protocols and (proto != "LL128" or (self.intra == "nvlink"))

    def candidates(self, op: str, nbytes: float, world: int) -> Dict[Tuple[str, str], float]:
        """Seconds of ``op`` for every (algorithm, protocol) NCCL would consider."""
        if op not in OPS:
            raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(OPS)}")
        nodes = self.nodes(world)
        g = min(world, self.gpus_per_node)
        bw = self.intra_bw if nodes == 1 else min(self.intra_bw, self.nics * self.nic_bw)
        out = {}
        for proto in PROTOCOLS:
            if not self.enabled(proto, nodes):
                continue
            hi, he = HOP_US["ring"][self.intra][proto] * US, HOP_US["ring"]["net"][proto] * US
            base = BASE_US["ring"][proto] * US
            eff = ring_efficiency(proto, op)
            if op == "allreduce":
                steps, inter = 2 * (world - 1), 2 * (nodes - 1)
                # the ring's hops: the network ones at the network's latency, the rest at the fabric's
                hop = ((steps - inter) * hi + inter * he) / steps if steps else 0.0
                out[("ring", proto)] = ring_allreduce(nbytes, world, bw, hop, base, eff)
                if nodes > 1:
                    out[("tree", proto)] = tree_allreduce(
                        nbytes, g, nodes, bw, HOP_US["tree"][self.intra][proto] * US,
                        HOP_US["tree"]["net"][proto] * US, BASE_US["tree"][proto] * US, tree_efficiency(proto, nodes))
            elif op in ("reduce_scatter", "allgather"):
                steps, inter = world - 1, nodes - 1
                hop = ((steps - inter) * hi + inter * he) / steps if steps else 0.0
                f = ring_reduce_scatter if op == "reduce_scatter" else ring_allgather
                out[("ring", proto)] = f(nbytes, world, bw, hop, base, eff)
        if op == "alltoall":  # grouped point-to-point sends, Simple protocol
            hop = (HOP_US["ring"]["net" if nodes > 1 else self.intra]["Simple"]) * US
            base = BASE_US["ring"]["Simple"] * US
            out[("p2p", "Simple")] = (alltoall(nbytes, world, self.intra_bw, hop, base) if nodes == 1 else
                                      alltoall_two_level(nbytes, g, nodes, self.intra_bw, self.nics * self.nic_bw,
                                                         hop, base))
        return out

    def choose(self, op: str, nbytes: float, world: int) -> Tuple[str, str, float]:
        """(algorithm, protocol, seconds) NCCL's model would pick: the fastest candidate (``hierarchical``:
        the two-level all-reduce, Simple)."""
        if world <= 1:
            return ("none", "none", 0.0)
        if op == "allreduce" and self.hierarchical and self.nodes(world) > 1:
            nodes, g = self.nodes(world), self.gpus_per_node
            t = hierarchical_allreduce(nbytes, g, nodes, self.intra_bw, self.nic_bw, self.nics,
                                       HOP_US["ring"][self.intra]["Simple"] * US, HOP_US["ring"]["net"]["Simple"] * US,
                                       BASE_US["ring"]["Simple"] * US)
            return ("hierarchical", "Simple", t + self.launch_s)
        (alg, proto), t = min(self.candidates(op, nbytes, world).items(), key=lambda kv: kv[1])
        return alg, proto, t + self.launch_s

    def time(self, op: str, nbytes: float, world: int) -> float:
        """Seconds of one ``op`` of ``nbytes`` (per rank) over ``world`` ranks, as NCCL would run it."""
        return self.choose(op, nbytes, world)[2]

    def describe(self) -> str:
        nodes = f", NICs {self.nics} x {self.nic_bw * 8 / 1e9:g} Gbit/s per node"
        over = f", +{self.launch_s * 1e6:g} µs per call" if self.launch_s else ""
        return (f"NCCL model: nodes of {self.gpus_per_node} on {self.intra} ({self.intra_bw / 1e9:g} GB/s per GPU)"
                f"{nodes}{', hierarchical all-reduce' if self.hierarchical else ''}{over}")


