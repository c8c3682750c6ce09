"""Wide-area clusters (network.cluster): the spec's presets, lists and refusals; the modeled durations of an uneven
cluster against hand-computed figures on a fake clock (slowest hop, both ends' delays, jitter drawn alike on every
rank); a slower worker's stretch in a real run's timeline; per-rank tbf rates on a shaped cluster."""
import json
import random

import pytest

import commlab
from commlab.engine import cluster
from commlab.engine.netmodel import ClusterLink, ModeledLink, from_spec, ring_allreduce_s
from commlab.engine.spec import JobSpec, SpecError
from distutil import shaped_unavailable, torchrun_own_loop

BASE = {"model": "mlp", "dataset": "digits", "steps": 2, "batch_size": 8, "eval_every": 0, "threads": 1}


def spec(world, **net):
    return JobSpec.from_dict({**BASE, "world_size": world, "network": net})


def refused(world, **net) -> str:
    with pytest.raises(SpecError) as e:
        spec(world, **net)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# -- the spec ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(cluster.PRESETS))
def test_every_preset_resolves_to_its_own_numbers_and_round_trips(name):
    entries = cluster.PRESETS[name]["workers"]
    world = 3 if len(entries) == 1 else len(entries)  # one entry: every rank alike, any world size
    s = spec(world, link="modeled", cluster=name)
    got = s.network.cluster
    assert got["preset"] == name and len(got["workers"]) == world
    for r, w in enumerate(got["workers"]):
        want = entries[0] if len(entries) == 1 else entries[r]
        assert set(w) == set(cluster.FIELDS)
        assert all(w[k] == want[k] for k in want), (r, w, want)
        assert w["speed"] == 1.0
    doc = json.loads(json.dumps(s.to_dict()))  # as spec.json holds it
    assert JobSpec.from_dict(doc) == s and JobSpec.from_checked(doc) == s
    assert cluster.workers(doc) == got["workers"] == cluster.workers(s)


def test_explicit_workers_with_counts_and_the_uniform_rate_filling_in():
    s = spec(4, link="modeled", gbps=2.0, cluster={"workers": [
        {"gbps_up": 1, "gbps_down": 5, "delay_ms": 20, "count": 3},
        {"gbps_down": 0.5, "delay_ms": 80, "jitter_ms": 4, "speed": 0.5}]})
    ws = cluster.workers(s)
    assert ws[:3] == [{"gbps_up": 1.0, "gbps_down": 5.0, "delay_ms": 20.0, "jitter_ms": 0.0, "speed": 1.0}] * 3
    assert ws[3] == {"gbps_up": 2.0, "gbps_down": 0.5, "delay_ms": 80.0, "jitter_ms": 4.0, "speed": 0.5}
    assert s.network.cluster["preset"] is None
    assert cluster.speed_of(s, 3) == 0.5 and cluster.speed_of(s, 0) == 1.0
    # one entry without count: every rank alike
    one = spec(3, link="modeled", cluster={"workers": [{"gbps_up": 1, "gbps_down": 1}]})
    assert len(cluster.workers(one)) == 3
    # the resolved form given back with its preset is accepted as it is
    s3 = spec(3, link="modeled", cluster="three_continents")
    again = spec(3, link="modeled", cluster=s3.network.cluster)
    assert again == s3
    # a preset of regions for more ranks than regions: neighbouring ranks share a region, in blocks
    s4 = spec(4, link="modeled", cluster="three_continents")
    regions = cluster.PRESETS["three_continents"]["workers"]
    assert [w["delay_ms"] for w in cluster.workers(s4)] == [regions[i]["delay_ms"] for i in (0, 0, 1, 2)]
    assert spec(4, link="modeled", cluster=s4.network.cluster) == s4
    assert [w["delay_ms"] for w in cluster.workers(spec(5, link="modeled", cluster="two_regions"))] == [15.0] * 5
    # without a cluster: no workers, speed 1
    plain = spec(2, link="modeled", gbps=1.0)
    assert cluster.workers(plain) is None and cluster.speed_of(plain, 1) == 1.0
    assert plain.network.cluster is None


def test_loopback_and_shaped_take_what_they_can_do():
    lo = spec(2, link="loopback", cluster={"workers": [{"speed": 1}, {"speed": 0.25}]})
    assert [w["speed"] for w in cluster.workers(lo)] == [1.0, 0.25]
    assert cluster.workers(lo)[0]["gbps_up"] is None
    sh = spec(2, link="shaped", cluster={"workers": [{"gbps_up": 0.1, "gbps_down": 0.4}, {"gbps_up": 1, "gbps_down": 1}]})
    assert [(w["gbps_up"], w["gbps_down"]) for w in cluster.workers(sh)] == [(0.1, 0.4), (1.0, 1.0)]


@pytest.mark.parametrize("world, net, field, words", [
    (2, {"link": "modeled", "cluster": "three_continents"}, "network.cluster:", "3 regions for world_size 2"),
    (4, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "count": 2},
                                                    {"gbps_up": 1, "gbps_down": 1}]}},
     "network.cluster.workers:", "3 workers (counts 2+1) for world_size 4"),
    (2, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1}] * 3}},
     "network.cluster.workers:", "3 workers for world_size 2"),
    (2, {"link": "modeled", "cluster": "mars"}, "network.cluster.preset:", "allowed: datacenter, two_regions"),
    (2, {"link": "modeled", "cluster": {}}, "network.cluster:", "give a preset"),
    (2, {"link": "modeled", "cluster": {"workers": []}}, "network.cluster.workers:", "non-empty list"),
    (2, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "bw": 3}]}},
     "network.cluster.workers[0].bw:", "allowed: gbps_up, gbps_down, delay_ms, jitter_ms, speed, count"),
    (2, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1}, {"gbps_up": -1, "gbps_down": 1}]}},
     "network.cluster.workers[1].gbps_up:", "[0.001, 400] (Gbit/s), got -1"),
    (2, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1}]}},
     "network.cluster.workers[0].gbps_down:", "needs each worker's rate"),
    (2, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "delay_ms": "far"}]}},
     "network.cluster.workers[0].delay_ms:", "got 'far'"),
    (2, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "jitter_ms": -2}]}},
     "network.cluster.workers[0].jitter_ms:", "[0, 10000]"),
    (2, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "speed": 2}]}},
     "network.cluster.workers[0].speed:", "slowed, not sped up"),
    (2, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "speed": 0}]}},
     "network.cluster.workers[0].speed:", "[0.01, 1]"),
    (2, {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "count": 0}]}},
     "network.cluster.workers[0].count:", "1..1024"),
    (2, {"link": "modeled", "cluster": {"preset": "two_regions", "workers": [{"gbps_up": 1, "gbps_down": 1}]}},
     "network.cluster.workers:", "give the preset or the workers"),
    (2, {"link": "modeled", "latency_us": 50, "cluster": "two_regions"}, "network.latency_us:", "delay_ms"),
    (2, {"link": "shaped", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "delay_ms": 30}]}},
     "network.cluster.workers[0].delay_ms:", "netem"),
    (2, {"link": "shaped", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "jitter_ms": 1}]}},
     "network.cluster.workers[0].jitter_ms:", "network.link modeled"),
    (2, {"link": "shaped", "cluster": "two_regions"}, "network.cluster:", "preset two_regions gives delay_ms 15"),
    (2, {"link": "loopback", "cluster": {"workers": [{"gbps_up": 1, "speed": 0.5}]}},
     "network.cluster.workers[0].gbps_up:", "loopback link has no gbps_up"),
    (2, {"link": "loopback", "cluster": "two_regions"}, "network.cluster:", "use network.link modeled"),
])
def test_refusals_name_the_field_and_what_is_allowed(world, net, field, words):
    msg = refused(world, **net)
    assert msg.startswith(field) and words in msg, msg


def test_strategy_auto_chooses_on_a_cluster_from_predictions_of_that_cluster(tmp_path):
    """strategy auto on a cluster of unequal workers: the advisor predicts each candidate on the cluster's own links
    (two regions 30 ms apart: a step pays the round trips), the run's first steps measure the picks, and the
    prediction of each measured one is within 25% of what it measured."""
    run = commlab.run({**BASE, "name": "auto-cluster", "world_size": 2, "steps": 30, "batch_size": 16,
                       "network": {"link": "modeled", "cluster": "two_regions"},
                       "strategy": {"mode": "auto", "trials": 1, "trial_steps": 4}}, runs=tmp_path / "runs")
    assert run.state == "done", run.log_tail()
    rec = json.loads(run.file("tuning.json").read_text())["advisor"]
    assert rec["chosen_by"] == "measured" and "two_regions" in json.dumps(rec["cluster"]), rec["cluster"]
    measured = [c for c in rec["candidates"] if c.get("measured_ms")]
    assert measured and all(abs(c["predicted_ms"] / c["measured_ms"] - 1) < 0.25 for c in measured), \
        [(c["label"], c["predicted_ms"], c["measured_ms"]) for c in measured]
    # a collective between the regions, 30 ms apart, at least (the candidates the advisor predicted: one whose
    # compressor's best fixed layout is over twice the best candidate's is not searched)
    predicted = [c for c in rec["candidates"] if c.get("predicted_ms") is not None]
    assert len(predicted) > len(rec["candidates"]) / 2 and all(c["predicted_ms"] > 30 for c in predicted)
    assert run.status()["strategy"]["chosen"] == rec["winner"]


def test_a_fault_tolerant_run_takes_a_cluster_whose_ring_is_each_quorums():
    """Under fault tolerance the ring of a step is its quorum's replica groups (``members``, set at each quorum):
    the time of a collective over members [0, 2] of three workers is that of a cluster of those two workers."""
    pytest.importorskip("torchft")
    spec = JobSpec.from_dict({**BASE, "world_size": 3, "network": {"link": "modeled", "cluster": "three_continents"},
                              "fault_tolerance": {"enabled": True}})
    workers = spec.network.cluster["workers"]
    link = from_spec(spec.network, seed=5)
    pair = ClusterLink([workers[0], workers[2]], seed=5)
    for op in ("allreduce", "allgather"):
        link.members = [0, 2]
        assert link.duration(op, 1 << 20, 2, seq=3) == pair.duration(op, 1 << 20, 2, seq=3) > 0
        link.members = None
        assert link.duration(op, 1 << 20, 3, seq=3) > link.duration(op, 1 << 20, 1, seq=3) == 0.0
        with pytest.raises(ValueError, match="this cluster's ring has 3 workers, the collective 2 ranks"):
            link.duration(op, 1 << 20, 2)


# -- the modeled link -------------------------------------------------------------------------------

UNEVEN = [  # rank: up, down (Gbit/s), one-way delay (ms)
    {"gbps_up": 1.0, "gbps_down": 1.0, "delay_ms": 10.0, "jitter_ms": 0.0, "speed": 1.0},
    {"gbps_up": 0.5, "gbps_down": 2.0, "delay_ms": 20.0, "jitter_ms": 0.0, "speed": 1.0},
    {"gbps_up": 2.0, "gbps_down": 0.25, "delay_ms": 5.0, "jitter_ms": 0.0, "speed": 1.0},
    {"gbps_up": 1.0, "gbps_down": 1.0, "delay_ms": 0.0, "jitter_ms": 0.0, "speed": 1.0},
]


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_uneven_cluster_durations_by_hand():
    """Hops 0->1: min(1, 2) = 1 Gbit/s, 10 + 20 ms; 1->2: min(0.5, 0.25) = 0.25 Gbit/s, 20 + 5 ms; 2->3: min(2, 1)
    = 1 Gbit/s, 5 + 0 ms; 3->0: 1 Gbit/s, 0 + 10 ms. A chunk of 1 MB takes 32 ms over 1->2: that hop, 57 ms, is
    every step's slowest (0->1: 8 + 30 = 38 ms)."""
    clock = FakeClock()
    link = ClusterLink(UNEVEN, seed=0, clock=clock, sleep=clock.sleep)
    assert link.hops(1e6) == pytest.approx([0.038, 0.057, 0.013, 0.018])
    n = 4_000_000  # all-reduce: 2 (p-1) = 6 steps of n/p = 1 MB
    assert link.duration("allreduce", n, 4) == pytest.approx(6 * 0.057)
    assert link.duration("reduce_scatter", n, 4) == pytest.approx(3 * 0.057)
    assert link.duration("all_to_all", n, 4) == pytest.approx(3 * 0.057)
    assert link.duration("allgather", 1_000_000, 4) == pytest.approx(3 * 0.057)  # m = 1 MB each step
    # no bytes: the largest pair of delays, 0->1's 30 ms, in each of 6 steps
    assert link.duration("allreduce", 0, 4) == pytest.approx(6 * 0.030)
    # 40 MB: the wire dominates, still over 1->2 (320 ms + 25 ms a step)
    assert link.duration("allreduce", 40_000_000, 4) == pytest.approx(6 * 0.345)
    assert link.duration("allreduce", n, 1) == 0.0
    with pytest.raises(ValueError, match="4 workers"):
        link.duration("allreduce", n, 3)
    # booked first come, first served, as the uniform link's
    d1 = link.issue("allreduce", n, 4)
    d2 = link.issue("allgather", 1_000_000, 4)
    assert d1 == pytest.approx(100.0 + 0.342) and d2 == pytest.approx(d1 + 0.171)
    assert link.hold_until(d2) == pytest.approx(0.513) and clock() == pytest.approx(d2)
    assert link.seq == 2


def test_equal_workers_are_the_uniform_link_with_alpha_twice_the_delay():
    for p in (2, 3, 8):
        same = [{"gbps_up": 2.5, "gbps_down": 2.5, "delay_ms": 0.015, "jitter_ms": 0.0}] * p
        link, uniform = ClusterLink(same), ModeledLink(2.5, 30.0)  # alpha = 2 x 15 us
        for op in ("allreduce", "allgather", "reduce_scatter", "all_to_all"):
            assert link.duration(op, 12_345_678, p) == pytest.approx(uniform.duration(op, 12_345_678, p), rel=1e-12)
    # and the uniform link is what it always was
    assert ModeledLink(1.0, 100).duration("allreduce", 125_000_000, 4) == pytest.approx(1.5 + 6e-4)
    assert ModeledLink(1.0, 100).duration("allreduce", 125_000_000, 4) == ring_allreduce_s(125_000_000, 4, 1.0, 100)


def test_jitter_is_drawn_alike_by_every_rank_and_again_on_a_rerun():
    """Two workers, 10 and 30 ms away with 2 and 6 ms of jitter; an all-gather of two ranks is one step of two
    hops, each ``wire + max(0, d_i + d_j + u j_i + v j_j)`` with u, v from the run's seed and the collective's
    number, and the step is the slower hop."""
    ws = [{"gbps_up": 1.0, "gbps_down": 0.5, "delay_ms": 10.0, "jitter_ms": 2.0},
          {"gbps_up": 0.1, "gbps_down": 1.0, "delay_ms": 30.0, "jitter_ms": 6.0}]
    m = 250_000  # 2 Mbit: 2 ms over 0->1 (min(1, 1) Gbit/s), 20 ms over 1->0 (min(0.1, 0.5))
    seed = 7

    def by_hand(seq):
        rng = random.Random(seed * 1_000_003 + seq)
        h01 = 0.002 + max(0.0, 0.040 + rng.uniform(-1, 1) * 0.002 + rng.uniform(-1, 1) * 0.006)
        h10 = 0.020 + max(0.0, 0.040 + rng.uniform(-1, 1) * 0.006 + rng.uniform(-1, 1) * 0.002)
        return max(h01, h10)
    rank0, rank1 = ClusterLink(ws, seed), ClusterLink(ws, seed)  # each rank builds its own from the spec
    got0 = [rank0.issue("allgather", m, 2, t_issue=0.0) for _ in range(6)]
    got1 = [rank1.issue("allgather", m, 2, t_issue=0.0) for _ in range(6)]
    assert got0 == got1  # exactly, not approximately
    durations = [b - a for a, b in zip([0.0] + got0, got0)]
    assert durations == pytest.approx([by_hand(k) for k in range(6)], rel=1e-12)
    assert len(set(round(d, 12) for d in durations)) == 6  # drawn anew for every collective
    assert all(0.020 + 0.032 - 1e-12 <= d <= 0.020 + 0.048 + 1e-12 for d in durations)  # 40 ms +- (2 + 6) ms
    again = ClusterLink(ws, seed)
    assert [again.duration("allgather", m, 2, k) for k in range(6)] == pytest.approx(durations, rel=1e-12)
    other = ClusterLink(ws, seed + 1)
    assert [other.duration("allgather", m, 2, k) for k in range(6)] != pytest.approx(durations, rel=1e-12)


def test_from_spec_builds_the_cluster_link_with_the_runs_seed():
    s = spec(3, link="modeled", cluster="three_continents")
    link = from_spec(s.network, s.seed)
    assert isinstance(link, ClusterLink) and link.seed == s.seed and link.up == [0.5, 0.5, 0.1]
    assert link.delay_s == pytest.approx([0.025, 0.030, 0.060])
    assert from_spec(spec(2, link="loopback", cluster={"workers": [{"speed": 0.5}]}).network) is None
    assert type(from_spec(spec(2, link="modeled", gbps=1.0).network)) is ModeledLink


def _jittered_allreduces(rank, world, workers, seed):
    import torch
    from commlab.engine.comm.collectives import issue_allreduce
    clock = FakeClock()
    link = ClusterLink(workers, seed, clock=clock, sleep=clock.sleep)
    out = []
    for i in range(4):
        t = torch.full((1000,), float(rank))  # 4000 bytes
        t0 = clock()
        (summed,) = issue_allreduce([t], link=link).wait()
        out.append((clock() - t0, summed[0].item()))
    return out


def test_two_ranks_hold_their_collectives_to_the_same_jittered_times():
    from distutil import run_world
    ws = cluster.workers(spec(2, link="modeled", cluster="two_regions"))
    r0, r1 = run_world(_jittered_allreduces, ws, 3)
    assert r0 == r1  # the same durations on both ranks, to the bit
    assert [v for _, v in r0] == [1.0] * 4
    link = ClusterLink(ws, 3)
    assert [d for d, _ in r0] == pytest.approx([link.duration("allreduce", 4000, 2, k) for k in range(4)], rel=1e-9)


# -- a slower worker, in a real run ---------------------------------------------------------------------

def test_a_slower_worker_stretches_its_compute_and_the_timeline_shows_it(tmp_path):
    net = {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "delay_ms": 1},
                                                      {"gbps_up": 1, "gbps_down": 1, "delay_ms": 1, "speed": 0.5}]}}
    run = commlab.run({**BASE, "name": "slow", "world_size": 2, "steps": 4, "network": net}, runs=tmp_path)
    assert run.state == "done", run.status()
    doc = json.loads(run.file("spec.json").read_text())
    assert [w["speed"] for w in cluster.workers(doc)] == [1.0, 0.5]
    slow = [e for e in run.timeline_events() if e.get("cat") == "slow"]
    assert slow and {e["pid"] for e in slow} == {1}, "only rank 1 is slow"
    assert {e["args"]["step"] for e in slow} == {0, 1, 2, 3}
    assert {e["name"].split()[1] for e in slow} == {"forward", "backward"}
    for e in slow:  # speed 0.5: it waits (1/0.5 - 1) = 1 x what the phase took, never less
        assert e["dur"] >= e["args"]["measured_ms"] * 1e3 - 1.0, e
        assert e["dur"] <= e["args"]["measured_ms"] * 1e3 + 500e3, e
    rows = [r for r in run.metric_rows() if r.get("kind") == "step"]
    r1 = [r for r in rows if r["rank"] == 1]
    assert all(r["speed"] == 0.5 and r["slow_ms"] > 0 for r in r1)
    assert all("slow_ms" not in r for r in rows if r["rank"] == 0)
    for r in r1:  # the stretch counts as the slow worker's forward and backward time
        waited = sum(e["dur"] for e in slow if e["args"]["step"] == r["step"]) / 1e3
        assert r["slow_ms"] == pytest.approx(waited, abs=0.01)
        assert r["forward_ms"] + r["backward_ms"] >= waited


# -- shaped links (root, ip and tc) ------------------------------------------------------------------

_WHY_NOT = shaped_unavailable()
needs_root = pytest.mark.skipif(_WHY_NOT is not None, reason=f"shaped links unavailable: {_WHY_NOT}")


@needs_root
def test_a_shaped_cluster_of_unequal_rates_carries_each_ranks_own():
    from commlab.lab.net.netcheck import measure_tcp
    from commlab.lab.net.netns import Cluster
    with Cluster(2, None, tag="uneq", rates=[(0.1, 0.4), (0.4, 0.4)]) as c:
        q = c.qdiscs()
        rank0, rank1 = (q[f"{c.namespaces[i]}/{c.ifnames[i]}"] for i in (0, 1))
        b0, b1 = (q[f"{c.bridge_ns}/{c.bridge_ifnames[i]}"] for i in (0, 1))
        assert "tbf" in rank0 and "rate 100Mbit" in rank0, rank0  # rank 0 sends at 0.1
        assert "rate 400Mbit" in b0 and "rate 400Mbit" in rank1 and "rate 400Mbit" in b1, q
        assert "r0 0.1 up/0.4 down" in c.describe()
        up0 = measure_tcp(c, 0, 1, seconds=1.0, port=5311)["gbps"]  # 0 -> 1: rank 0's 0.1 up
        up1 = measure_tcp(c, 1, 0, seconds=1.0, port=5312)["gbps"]  # 1 -> 0: min(0.4 up, 0.4 down)
        assert up0 < 0.15 and up1 > 0.25, (up0, up1)


@needs_root
def test_a_shaped_run_on_a_cluster_of_unequal_rates(tmp_path):
    net = {"link": "shaped", "cluster": {"workers": [{"gbps_up": 0.2, "gbps_down": 1.0},
                                                     {"gbps_up": 1.0, "gbps_down": 0.5, "speed": 0.5}]}}
    run = commlab.run({**BASE, "name": "uneq", "world_size": 2, "steps": 3, "network": net}, runs=tmp_path)
    assert run.state == "done", run.status()
    assert "r0 0.2 up/1 down, r1 1 up/0.5 down" in run.status()["cluster"]
    assert any(e.get("cat") == "slow" and e["pid"] == 1 for e in run.timeline_events())


def test_a_slower_worker_in_an_own_loop(tmp_path):
    """commlab.wrap: each forward call of the model and the backward before ``step()`` stretched on rank 1."""
    from commlab.engine.runlog import read_jsonl
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "own-slow", "steps": 4, "network": {
        "link": "loopback", "cluster": {"workers": [{"speed": 1}, {"speed": 0.5}]}}}))
    p = torchrun_own_loop(tmp_path, "--spec", spec, "--runs", tmp_path / "runs", "--steps", 4)
    assert p.returncode == 0, p.stdout[-3000:]
    (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if d.is_dir() and not d.name.startswith(".")]
    slow = [e for r in (0, 1) for e in read_jsonl(str(run_dir / f"timeline-rank{r}.jsonl")) if e.get("cat") == "slow"]
    assert {e["pid"] for e in slow} == {1}
    assert {e["name"].split()[1] for e in slow} == {"forward", "backward"}
    assert all(e["dur"] >= e["args"]["measured_ms"] * 1e3 - 1.0 for e in slow)
    steps = [m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if m["kind"] == "step" and m["rank"] == 1]
    assert len(steps) == 4 and all(m["speed"] == 0.5 and m["slow_ms"] > 0 for m in steps)


def test_commlab_show_and_the_advice_read_a_cluster():
    from commlab.lab.front.run_cli import cluster_text, link_text
    from commlab.lab.strategy.predictions import network_for
    doc = spec(3, link="modeled", cluster="three_continents").to_dict()
    assert link_text(doc["network"]) == "modeled three_continents"
    assert cluster_text(doc["network"]["cluster"]) == ("cluster three_continents of 3 workers (0.1-0.5 Gbit/s up, "
                                                       "0.2-0.5 Gbit/s down, 25-60 ms, 1 speed)")
    net = network_for(doc)  # the advice plans for the spec's own cluster (tests/test_perfmodel_cluster.py)
    assert net["link"] == "modeled" and net["cluster"] == doc["network"]["cluster"]
    assert network_for(doc, gbps=1.0)["gbps"] == 1.0  # one rate for every rank, the cluster set aside
