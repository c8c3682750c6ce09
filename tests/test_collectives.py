"""NCCL-style collective costs (commlab/lab/strategy/perfmodel/collectives.py) against values worked out by hand."""
import math

import pytest

from commlab.lab.strategy.perfmodel import collectives as nc
from commlab.lab.strategy.perfmodel import costs
from commlab.lab.strategy.perfmodel.iteration import Bucket, Round, Step, iteration_time


def switch_point(topo: nc.Topology, op: str, world: int, lo: float = 1.0, hi: float = 1 << 31):
    """The smallest size (bytes, to 1%) from which NCCL's choice differs from its choice at ``lo``;
    None if it never changes up to ``hi``."""
    first = topo.choose(op, lo, world)[:2]
    if topo.choose(op, hi, world)[:2] == first:
        return None
    a, b = lo, hi
    while b / a > 1.01:
        m = math.sqrt(a * b)
        a, b = (m, b) if topo.choose(op, m, world)[:2] == first else (a, m)
    return b

US = 1e-6


def approx(x, rel=1e-9):
    return pytest.approx(x, rel=rel, abs=1e-15)


def test_ring_formulas_by_hand():
    # 4 ranks, 1 GB/s, 1 µs per hop, 5 µs per call
    # all-reduce 1 MB: 5 + 2*3*1 = 11 µs, plus 2*3/4 * 1e6 B / 1e9 B/s = 1.5 ms
    assert nc.ring_allreduce(1e6, 4, 1e9, 1 * US, 5 * US) == approx(11e-6 + 1.5e-3)
    # reduce-scatter 1 MB: 5 + 3 = 8 µs, plus 3/4 * 1e6 / 1e9 = 0.75 ms
    assert nc.ring_reduce_scatter(1e6, 4, 1e9, 1 * US, 5 * US) == approx(8e-6 + 0.75e-3)
    # all-gather of 100 KB from each: 5 + 3 = 8 µs, plus 3 * 1e5 / 1e9 = 0.3 ms
    assert nc.ring_allgather(1e5, 4, 1e9, 1 * US, 5 * US) == approx(8e-6 + 0.3e-3)
    # the LL protocol's quarter of the bandwidth: 1.5 ms becomes 6 ms
    assert nc.ring_allreduce(1e6, 4, 1e9, 0.0, eff=0.25) == approx(6e-3)
    assert nc.ring_allreduce(1e6, 1, 1e9, 1 * US, 5 * US) == 0.0


def test_tree_and_all_to_all_by_hand():
    # 4 nodes of 8: depth = 7 * 1 µs inside + ceil(log2 4) = 2 * 5 µs across = 17 µs, twice = 34 µs;
    # bandwidth 2 * 1e6 / (0.9 * 10e9) = 222.22 µs
    assert nc.tree_allreduce(1e6, 8, 4, 10e9, 1 * US, 5 * US, 0.0, 0.9) == approx(34e-6 + 2e6 / 9e9)
    # one node: a chain of 8, 2 * 7 µs
    assert nc.tree_allreduce(1e6, 8, 1, 10e9, 1 * US, 5 * US) == approx(14e-6 + 2e6 / 10e9)
    # all-to-all of 1.6 MB among 16 on one fabric: 15 hops of 2 µs + 15/16 * 1.6e6 / 1e9 = 1.5 ms
    assert nc.alltoall(1.6e6, 16, 1e9, 2 * US) == approx(30e-6 + 1.5e-3)
    # two nodes of 8, 16 MB each: inside 7/16 * 16e6 / 100e9 = 70 µs; leaving the node 8 ranks *
    # 8/16 * 16e6 = 64 MB over 25 GB/s = 2.56 ms: the network decides; + 15 hops of 1 µs
    assert nc.alltoall_two_level(16e6, 8, 2, 100e9, 25e9, 1 * US) == approx(15e-6 + 2.56e-3)


def test_hierarchical_allreduce_by_hand_and_as_costs_cluster():
    # nodes of 4, 2 nodes, 8 MB, intra 10 GB/s, one 1 GB/s NIC, no latency:
    # reduce-scatter inside 3/4 * 8e6 / 10e9 = 0.6 ms; the 2 MB shard across 2 nodes on a quarter of the
    # NIC (4 rings share it): 2 * 1/2 * 2e6 / 0.25e9 = 8 ms; all-gather inside 3 * 2e6 / 10e9 = 0.6 ms
    t = nc.hierarchical_allreduce(8e6, 4, 2, 10e9, 1e9, 1, 0.0, 0.0)
    assert t == approx(9.2e-3)
    # the same as the two-level cluster that commlab predict --cluster already used
    cl = costs.Cluster(4, costs.Link.from_gbps(80), costs.Link.from_gbps(8), nics=1)
    assert cl.time("allreduce", 8e6, 8) == approx(t)


NV8 = nc.Topology(gpus_per_node=8, intra_bw=100e9, nic_bw=12.5e9, nics=8, intra="nvlink")


def test_protocol_switch_points_inside_an_nvlink_node():
    # 8 GPUs, 100 GB/s, all-reduce: 14 hops; wire bytes w = 2 * 7/8 n = 1.75 n
    # LL:     3.6 + 14 * 0.47 = 10.18 µs + w / 25e9    (a quarter of 100 GB/s)
    # LL128: 10.0 + 14 * 1.9  = 36.6 µs  + w / 92e9    (0.92)
    # Simple: 8.4 + 14 * 3.4  = 56.0 µs  + w / 100e9
    c = NV8.candidates("allreduce", 1000, 8)
    assert set(c) == {("ring", "LL"), ("ring", "LL128"), ("ring", "Simple")}  # one node: no tree
    assert c[("ring", "LL")] == approx(10.18e-6 + 1750 / 25e9)
    assert c[("ring", "Simple")] == approx(56.0e-6 + 1750 / 100e9)
    assert NV8.choose("allreduce", 1000, 8)[:2] == ("ring", "LL")
    # LL = LL128 where w (1/25e9 - 1/92e9) = 26.42 µs: w = 906,955 B, n = w / 1.75 = 518,260 B
    ll_to_ll128 = 26.42e-6 / (1 / 25e9 - 1 / 92e9) / 1.75
    assert ll_to_ll128 == pytest.approx(518260, rel=1e-4)
    assert switch_point(NV8, "allreduce", 8) == pytest.approx(ll_to_ll128, rel=0.011)
    assert NV8.choose("allreduce", 2 * ll_to_ll128, 8)[:2] == ("ring", "LL128")
    # LL128 = Simple where w (1/92e9 - 1/100e9) = 19.4 µs: w = 22.31 MB, n = 12.75 MB
    ll128_to_simple = 19.4e-6 / (1 / 92e9 - 1 / 100e9) / 1.75
    assert ll128_to_simple == pytest.approx(12.75e6, rel=1e-3)
    assert switch_point(NV8, "allreduce", 8, lo=2 * ll_to_ll128) == pytest.approx(ll128_to_simple, rel=0.011)
    assert NV8.choose("allreduce", 64e6, 8)[:2] == ("ring", "Simple")


def test_tree_for_small_messages_ring_for_large_across_nodes():
    # 4 nodes of 8 (32 ranks), 8 NICs of 100 Gbit per node: bus bandwidth min(100, 8 * 12.5) = 100 GB/s
    # ring LL latency: 3.6 + 56 hops * 0.47 inside + 6 hops * 2.7 across = 46.12 µs
    # tree LL latency: 4.4 + 2 * (7 * 0.52 + 2 * 5.0) = 31.68 µs, bandwidth 0.9/3.8 of 100 GB/s
    c = NV8.candidates("allreduce", 1000, 32)
    assert c[("ring", "LL")] == approx(46.12e-6 + 2 * 31 / 32 * 1000 / 25e9)
    assert c[("tree", "LL")] == approx(31.68e-6 + 2 * 1000 / (100e9 * 0.9 / 3.8))
    assert NV8.choose("allreduce", 1000, 32)[:2] == ("tree", "LL")
    # 256 MB: ring Simple 8.4 + 56 * 3.4 + 6 * 9.6 = 256.4 µs + 2 * 31/32 * 256e6 / 100e9 = 4.96 ms;
    # tree Simple 2 * (7 * 28 + 2 * 50) = 592 µs + 2 * 256e6 / 90e9 = 5.689 ms; ring LL128 5.532 ms
    n = 256e6
    assert NV8.choose("allreduce", n, 32) == ("ring", "Simple", approx(256.4e-6 + 2 * 31 / 32 * n / 100e9))
    assert NV8.candidates("allreduce", n, 32)[("tree", "Simple")] == approx(592e-6 + 2 * n / 90e9)


def test_the_node_network_bounds_a_ring_across_nodes():
    # one 100 Gbit NIC per node: the ring's bus bandwidth is 12.5 GB/s, not NVLink's 100
    one_nic = nc.Topology(8, 100e9, 12.5e9, nics=1)
    n = 64e6
    simple = one_nic.candidates("reduce_scatter", n, 16)[("ring", "Simple")]
    # 15 hops: 14 inside at 3.4 µs, 1 across at 9.6 µs; 8.4 µs base; 15/16 * 64e6 / 12.5e9
    assert simple == approx(8.4e-6 + 14 * 3.4e-6 + 9.6e-6 + 15 / 16 * n / 12.5e9)
    # hierarchical all-reduce: the 8 rings of a node share its one NIC
    h = nc.Topology(8, 100e9, 12.5e9, nics=1, hierarchical=True)
    alg, proto, t = h.choose("allreduce", n, 16)
    assert (alg, proto) == ("hierarchical", "Simple")
    assert t == approx(8.4e-6 + nc.ring_reduce_scatter(n, 8, 100e9, 3.4e-6)
                       + nc.ring_allreduce(n / 8, 2, 12.5e9 / 8, 9.6e-6) + nc.ring_allgather(n / 8, 8, 100e9, 3.4e-6))


def test_pcie_has_no_ll128_and_the_framework_overhead_adds_per_call():
    pcie = nc.Topology(8, 12e9, 12.5e9, intra="pcie", launch_s=50e-6)
    c = pcie.candidates("allgather", 4096, 4)
    assert set(c) == {("ring", "LL"), ("ring", "Simple")}
    # LL on PCIe, all-gather of 4 KB among 4: 3.6 + 3 * 1.0 µs + 3 * 4096 / (12e9 / 3); + 50 µs
    assert pcie.time("allgather", 4096, 4) == approx(3.6e-6 + 3e-6 + 3 * 4096 / 4e9 + 50e-6)


def test_bad_topologies_and_worlds_are_one_line_errors():
    with pytest.raises(ValueError, match="gpus_per_node"):
        nc.Topology(0, 1e9, 1e9)
    with pytest.raises(ValueError, match="intra must be"):
        nc.Topology(8, 1e9, 1e9, intra="infiniband")
    with pytest.raises(ValueError, match="does not fill whole nodes"):
        NV8.time("allreduce", 1e6, 12)
    with pytest.raises(ValueError, match="unknown collective"):
        NV8.time("broadcast", 1e6, 8)
    assert NV8.time("allreduce", 1e6, 1) == 0.0


def test_the_step_simulation_runs_on_a_topology():
    # one bucket of 64 MB ready at the end of a 10 ms backward, sync: the step is compute + the collective
    step = Step(forward=0.005, backward=0.010, optimizer=0.001,
                buckets=[Bucket(ready=0.010, encode=0.0, rounds=[Round("allreduce", 64e6)], raw_bytes=64e6)])
    r = iteration_time(step, NV8, 8, "sync")
    assert r.total == approx(0.016 + NV8.time("allreduce", 64e6, 8))
    assert costs.collective("allgather", 1e6, 8, NV8) == NV8.time("allgather", 1e6, 8)
