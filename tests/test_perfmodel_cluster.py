"""The performance model and the advisor on a cluster of unequal workers (network.cluster;
commlab/lab/strategy/perfmodel/uneven.py): a collective's time as the engine's modeled cluster link holds it,
a synchronous step held by the slowest worker, a DiLoCo period of H slow steps and one sync, hand-computed; the
uniform link unchanged; ``commlab advise`` on three_continents choosing DiLoCo where per-step DDP pays the ring's
delays every step, and a per-step strategy in a datacenter; ``commlab predict``/``advise --cluster`` refusals in
one line.

The cluster of the hand computations, three workers (rates in Gbit/s, one-way delays in ms):

    rank  up    down  delay  speed
    0     1     1     10     1
    1     0.5   1     20     0.5
    2     1     0.25  40     1

Hops: 0 -> 1 at min(1, 1) = 1 Gbit/s and 10 + 20 = 30 ms; 1 -> 2 at min(0.5, 0.25) = 0.25 and 60 ms; 2 -> 0 at
min(1, 1) = 1 and 50 ms. The profile is tests/test_perfmodel_methods.py's: forward 2 ms, backward 4 ms,
optimizer 0.5 ms, B = 440,440 bytes of gradients."""
import json
import random

import pytest

from commlab.engine import cluster as engine_cluster
from commlab.engine import netmodel
from commlab.engine.spec import SpecError
from commlab.lab.front.cli import main
from commlab.lab.strategy import advisor, predictions, space
from commlab.lab.strategy import penalty as pen
from commlab.lab.strategy.perfmodel import costs
from commlab.lab.strategy.perfmodel import predict as pr
from commlab.lab.strategy.perfmodel import uneven, whatif
from tests.test_advisor import FakeRun, fake_profile
from tests.test_advisor import spec as adv_spec
from tests.test_advisor_target import FakeRun as TimedRun
from tests.test_perfmodel_methods import B, OPT, approx, profile
from tests.test_perfmodel_methods import spec as pm_spec

WORKERS = [{"gbps_up": 1.0, "gbps_down": 1.0, "delay_ms": 10.0, "jitter_ms": 0.0, "speed": 1.0},
           {"gbps_up": 0.5, "gbps_down": 1.0, "delay_ms": 20.0, "jitter_ms": 0.0, "speed": 0.5},
           {"gbps_up": 1.0, "gbps_down": 0.25, "delay_ms": 40.0, "jitter_ms": 0.0, "speed": 1.0}]


def ring():
    return uneven.ClusterRing(WORKERS)


def allreduce_b():
    """All-reduce of B on the cluster: 4 steps of B/3 bytes; the slowest hop is 1 -> 2 (0.25 Gbit/s, 60 ms)."""
    return 4 * ((B / 3) * 8 / 0.25e9 + 60e-3)


# --------------------------------------------------------------------------- a collective's time

def test_a_collective_is_its_steps_each_as_slow_as_the_slowest_hop():
    r = ring()
    # 3 MB all-reduce: 4 steps of 1 MB. Hops 8 + 30, 32 + 60, 8 + 50 ms: each step 92 ms
    assert r.time("allreduce", 3e6, 3) == approx(4 * 92e-3)
    # all-gather of 1 MB each: 2 steps of 1 MB; reduce-scatter (and all-to-all) of 3 MB: 2 steps of 1 MB
    assert r.time("allgather", 1e6, 3) == approx(2 * 92e-3)
    assert r.time("reduce_scatter", 3e6, 3) == approx(2 * 92e-3)
    assert costs.collective("all_to_all", 3e6, 3, r) == approx(2 * 92e-3)
    assert costs.collective("header", 40, 3, r) == approx(2 * (40 * 8 / 0.25e9 + 60e-3))
    # it is the engine's modeled cluster link, exactly (no jitter)
    link = netmodel.ClusterLink(WORKERS)
    for op, n in (("allreduce", 3e6), ("allreduce", 3000), ("allgather", 5e5), ("reduce_scatter", 1e4)):
        assert r.time(op, n, 3) == approx(link.duration(op, n, 3)), op
    assert r.time("allreduce", 1e6, 1) == 0.0
    with pytest.raises(ValueError, match="3 workers"):
        r.time("allreduce", 1e6, 4)
    s = r.summary()
    assert (s["slowest_link_gbps"], s["slowest_link"], s["largest_delay_ms"], s["ring_step_delay_ms"],
            s["slowest_speed"], s["slowest_rank"]) == (0.25, "1 -> 2", 40.0, 60.0, 0.5, 1)


def test_equal_workers_are_the_uniform_link_with_twice_the_delay():
    w = [{"gbps_up": 2.0, "gbps_down": 2.0, "delay_ms": 0.5, "jitter_ms": 0.0, "speed": 1.0}] * 4
    flat = costs.Link.from_gbps(2.0, 1000.0)  # alpha = 2 x 0.5 ms
    for op, n in (("allreduce", 1e6), ("allgather", 1e4), ("reduce_scatter", 8e5), ("header", 160)):
        assert costs.collective(op, n, 4, uneven.ClusterRing(w)) == pytest.approx(costs.collective(op, n, 4, flat),
                                                                                 rel=1e-12), op


def test_jitter_costs_each_steps_expected_slowest_hop():
    """Two workers at 1 Gbit/s, 10 ms each way and 3 ms of jitter: both hops take wire + 20 ms + 3 ms (u + v),
    u, v uniform in [-1, 1]. The expected maximum of two such sums is 20 ms + 3 ms x 7/15 (E|sum of four
    uniforms in [-1, 1]| = 14/15, and E max(X, Y) = E|X - Y| / 2 for independent symmetric X, Y), not their
    mean (20 ms): an all-reduce of 2 MB is 2 steps of 8 + 21.4 ms."""
    w = [{"gbps_up": 1.0, "gbps_down": 1.0, "delay_ms": 10.0, "jitter_ms": 3.0, "speed": 1.0}] * 2
    assert uneven.ClusterRing(w).time("allreduce", 2e6, 2) == pytest.approx(2 * (8e-3 + 20e-3 + 3e-3 * 7 / 15),
                                                                            rel=1e-9)
    # against the engine's own draws on a preset (many collectives, each its own seed): the mean of what the
    # modeled link holds collectives to is the model's time
    three = engine_cluster.resolve("three_continents", 3, "modeled")["workers"]
    link, r = netmodel.ClusterLink(three), uneven.ClusterRing(three)
    draws = [link.duration("allreduce", 1e5, 3, seq) for seq in range(3000)]
    assert r.time("allreduce", 1e5, 3) == pytest.approx(sum(draws) / len(draws), rel=2e-3)
    no_jitter = uneven.ClusterRing([dict(x, jitter_ms=0.0) for x in three]).time("allreduce", 1e5, 3)
    assert no_jitter < r.time("allreduce", 1e5, 3) < no_jitter + 4 * 6e-3  # at most both ends' jitter per step


def test_sum_cdf_is_the_trapezoid():
    rng = random.Random(0)
    xs = [0.3 * rng.uniform(-1, 1) + 0.7 * rng.uniform(-1, 1) for _ in range(20000)]
    for s in (-0.9, -0.5, 0.0, 0.2, 0.6, 0.95):
        assert uneven.sum_cdf(s, 0.3, 0.7) == pytest.approx(sum(x <= s for x in xs) / len(xs), abs=0.01), s
    assert uneven.sum_cdf(0.0, 0.0, 0.0) == 1.0 and uneven.sum_cdf(0.5, 0.0, 1.0) == pytest.approx(0.75)


# --------------------------------------------------------------------------- the slowest worker

def test_a_synchronous_step_waits_for_the_slowest_worker():
    """sync, one 25 MB bucket after backward: rank 1 computes at half speed, so forward and backward take
    12 ms; then the all-reduce of B on the cluster; then the optimizer step (at the machine's pace)."""
    rows = whatif.cluster_table(profile(), pm_spec(), {3: ring()})
    (row,) = rows
    assert row["spec_ms"] * 1e-3 == approx((2e-3 + 4e-3) / 0.5 + allreduce_b() + OPT)
    assert row["workers"] == 3 and row["gbps"] == 0.25 and row["cluster"]["slowest_speed"] == 0.5
    # DDP (wfbp) here is the same: its one bucket is ready when backward ends
    assert row["ddp_ms"] == pytest.approx(row["spec_ms"], rel=1e-12)
    # the profile itself is untouched; at speed 1 it is the profile
    p = profile()
    assert uneven.at_speed(p, 1.0) is p and uneven.at_speed(p, 0.5).forward_s == 4e-3 and p.forward_s == 2e-3


def test_a_diloco_period_is_h_slow_steps_and_one_sync():
    """H = 4: four inner steps at the slowest worker's pace (12 ms forward and backward, 0.5 ms optimizer),
    then the all-reduce of the pseudo-gradient (B) and the outer step: (4 x 12.5 ms + X + 0.5 ms) / 4."""
    (row,) = whatif.cluster_table(profile(), pm_spec("diloco", H=4), {3: ring()})
    y = (2e-3 + 4e-3) / 0.5 + OPT
    assert row["spec_ms"] * 1e-3 == approx((4 * y + allreduce_b() + OPT) / 4)
    assert row["syncs"] == 2 and row["bytes_per_sync"] == B
    # per step, DDP pays the ring's 4 x 60 ms of delays; DiLoCo pays them once per 4 steps
    assert row["ddp_ms"] * 1e-3 - y > 4 * 60e-3
    assert row["spec_ms"] * 1e-3 - y < 4 * 60e-3 / 4 + allreduce_b() / 4 + OPT


def test_the_uniform_link_predicts_what_it_did():
    """No cluster: the network and the profile the advice uses are today's, and a cluster of equal workers
    at speed 1 predicts what the uniform link of alpha = 2 x delay does."""
    s = adv_spec()
    net = predictions.network_for(s, 1.0)
    assert net == {"link": "modeled", "gbps": 1.0, "latency_us": None}
    p = profile()
    assert predictions.compute_of(p, net) is p and predictions.cluster_of(net) is None
    equal = [{"gbps_up": 1.0, "gbps_down": 1.0, "delay_ms": 0.05, "jitter_ms": 0.0, "speed": 1.0}] * 2
    for sp in (pm_spec(), pm_spec("diloco", H=4), pm_spec("local_sgd", H=2)):
        a = pr.predict(p, sp, 1.0, 2, link=uneven.ClusterRing(equal)).total
        b = pr.predict(p, sp, 1.0, 2, link=costs.Link.from_gbps(1.0, 100.0)).total
        assert a == pytest.approx(b, rel=1e-12)


# --------------------------------------------------------------------------- the advice on a cluster

@pytest.fixture
def no_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: [])
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))


def advise(s, **kw):
    return advisor.advise(s, profile=fake_profile(s), say=lambda m: None, **kw)


def test_three_continents_choose_diloco_with_its_penalty_and_a_datacenter_does_not(no_runs):
    s = adv_spec(world_size=3)
    adv = advise(s, cluster="three_continents", penalties={"diloco": 1.3})
    assert adv.winner.method["name"] == "diloco" and adv.winner.penalty == 1.3
    ddp = next(c for c in adv.candidates if space.is_ddp(c))
    # DDP pays the ring's 4 steps of 85-90 ms of delays (and the slowest hop's wire) for every bucket of every step
    assert ddp.predicted_ms > 4 * 90
    assert adv.winner.predicted_score < ddp.predicted_score / 10
    doc = adv.as_dict()
    assert doc["cluster"]["preset"] == "three_continents" and doc["cluster"]["slowest_link_gbps"] == 0.1
    assert doc["cluster"]["largest_delay_ms"] == 60.0 and doc["cluster"]["slowest_speed"] == 1.0
    assert doc["network"]["link"] == "modeled" and len(doc["network"]["cluster"]["workers"]) == 3
    assert "cluster three_continents" in adv.link_source
    best = adv.winner_spec()  # a valid spec on the cluster's modeled link
    assert best["network"]["cluster"]["preset"] == "three_continents" and best["method"]["name"] == "diloco"
    # without a penalty DiLoCo is listed, predicted far faster, and never chosen
    bare = advise(s, cluster="three_continents")
    assert not bare.winner.local and all(c.penalty is None for c in bare.candidates if c.local)
    # in a datacenter the same penalty loses: a per-step strategy (DDP's bytes or a cast) wins
    dc = advise(s, cluster="datacenter", penalties={"diloco": 1.3})
    assert not dc.winner.local and dc.winner.compressor["name"] in ("none", "fp16", "bf16"), dc.winner.label


def test_a_measured_diloco_penalty_wins_on_three_continents(monkeypatch, tmp_path):
    s = adv_spec(world_size=3)
    diloco = space.with_strategy(s, {"method": {"name": "diloco", "H": 20}})
    runs = [FakeRun("a", s, [(49, 0.5), (99, 0.9), (149, 0.98), (199, 1.0)]),
            FakeRun("b", diloco, [(49, 0.4), (99, 0.8), (149, 0.9), (199, 0.99)])]
    monkeypatch.setattr(pen, "runs_of", lambda r, **kw: runs)
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    adv = advise(s, runs="index", cluster="three_continents")
    assert adv.winner.method == diloco["method"] and adv.winner.penalty == pytest.approx(199 / 149)
    assert adv.winner.penalty_source.startswith("measured")
    assert not advise(s, runs="index", cluster="datacenter").winner.local


def test_the_spec_s_own_cluster_is_planned_for(no_runs):
    s = adv_spec(world_size=4, network={"link": "modeled", "cluster": "two_regions"})
    net = predictions.network_for(s)
    assert net["cluster"]["preset"] == "two_regions" and len(net["cluster"]["workers"]) == 4
    assert predictions.network_for(s, world=6)["cluster"]["workers"][5]["delay_ms"] == 15.0
    # --gbps plans for one rate, as before
    assert predictions.network_for(s, 1.0) == {"link": "modeled", "gbps": 1.0, "latency_us": None}
    # a list of workers plans only for as many
    listed = adv_spec(world_size=2, network={"link": "modeled", "cluster": {"workers": [
        {"gbps_up": 1, "gbps_down": 1, "delay_ms": 5}, {"gbps_up": 1, "gbps_down": 1, "delay_ms": 5, "speed": 0.5}]}})
    net = predictions.network_for(listed)
    assert net["cluster"]["preset"] is None and predictions.cluster_of(net).slowest_speed == 0.5
    with pytest.raises(SpecError, match="lists 2 workers, not 3") as e:
        predictions.network_for(listed, world=3)
    assert e.value.path == "--workers"
    shaped = adv_spec(world_size=2, network={"link": "shaped", "gbps": 1, "cluster": {"workers": [{"speed": 1}]}})
    with pytest.raises(SpecError, match="--link modeled") as e:
        predictions.network_for(shaped)
    assert e.value.path == "network.cluster"


def test_to_target_trials_run_on_the_cluster_s_modeled_link(no_runs, monkeypatch):
    """``--measure target`` on three_continents: every trial is a run of the spec on the cluster's modeled
    link; DiLoCo needs more steps than DDP to the target, and still gets there far sooner."""
    store = []
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: list(store))
    s = adv_spec(world_size=3, steps=200, eval_every=10)

    def runner(sp, prepare=None):
        name = sp["method"]["name"]
        rate, ms = {"none": (0.01, 800.0), "diloco": (0.007, 12.0)}.get(name, (0.002, 400.0))
        evals, k = [], 0
        while k < sp["steps"]:
            k = min(k + sp["eval_every"], sp["steps"])
            evals.append((k, min(0.9, rate * k)))
            if sp["stop_at_acc"] and evals[-1][1] >= sp["stop_at_acc"]:
                break
        run = TimedRun(f"r{len(store)}", sp, evals, ms)
        store.append(run)
        return run
    adv = advise(s, runs="index", cluster="three_continents", measure=True, to_target=True, trials=2,
                 runner=runner)
    assert store and all(r.spec_dict()["network"]["link"] == "modeled"
                         and r.spec_dict()["network"]["cluster"]["preset"] == "three_continents"
                         and len(r.spec_dict()["network"]["cluster"]["workers"]) == 3 for r in store)
    assert adv.chosen_by == "measured to target" and adv.winner.method["name"] == "diloco", adv.reason
    assert json.loads(json.dumps(adv.as_dict()))["cluster"]["preset"] == "three_continents"


# --------------------------------------------------------------------------- the commands

def test_predict_and_advise_on_a_preset(tmp_path, capsys, no_runs):
    s = adv_spec(world_size=3)
    prof = fake_profile(s)
    prof.spec = s
    f = tmp_path / "prof.json"
    prof.save(f)
    assert main(["predict", str(f), "--cluster", "three_continents", "--workers", "3,6", "--set", "method.name=diloco",
                 "--runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "SLOWEST GBIT/S" in out and "cluster three_continents, 3 workers: slowest link 0.1 Gbit/s" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith(("3 ", "6 "))]
    assert [r[:2] for r in rows] == [["3", "0.1"], ["6", "0.1"]]
    assert all(float(r[4].rstrip("x")) > 10 for r in rows)  # DiLoCo's mean step against DDP's
    assert main(["predict", str(f), "--cluster", "three_continents", "--json", "--runs", str(tmp_path / "runs")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rate"] == "cluster" and doc["rows"][0]["workers"] == 3
    assert doc["rows"][0]["cluster"]["ring_step_delay_ms"] == 90.0
    # a spec's own cluster, without --cluster: its world size (not the flat table's 2,8,64,1024); --gbps sets it aside
    own = adv_spec(world_size=3, network={"link": "modeled", "cluster": "three_continents"})
    prof.spec = own
    prof.save(f)
    assert main(["predict", str(f), "--json", "--runs", str(tmp_path / "runs")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rate"] == "cluster" and [r["workers"] for r in doc["rows"]] == [3]
    assert doc["rows"][0]["cluster"]["preset"] == "three_continents"
    assert main(["predict", str(f), "--json", "--gbps", "1", "--runs", str(tmp_path / "runs")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rate"] == "flat" and [r["workers"] for r in doc["rows"]] == [2, 8, 64, 1024]


@pytest.mark.parametrize("argv,needle", [
    (["predict", "{prof}", "--cluster", "mars"], "--cluster: 'mars' is not a cluster preset; allowed: datacenter, "
                                                 "two_regions, three_continents, home_broadband, or KEY=VALUE"),
    (["predict", "{prof}", "--cluster", "three_continents", "--workers", "2"],
     "--cluster: preset three_continents has 3 regions, a worker in each at least; give --workers 3 or more"),
    (["predict", "{prof}", "--cluster", "datacenter", "--gbps", "1"], "--cluster: a preset gives each worker's rate"),
    (["predict", "{prof}", "--cluster", "datacenter", "--device", "H100"], "--cluster: a preset's workers are on "
                                                                           "modeled links"),
    (["advise", "{spec}", "--cluster", "mars"], "--cluster: 'mars' is not a cluster preset; allowed: datacenter, "
                                                "two_regions, three_continents, home_broadband"),
    (["advise", "{spec}", "--cluster", "two_regions", "--gbps", "1"], "--cluster: a cluster gives each worker's "
                                                                      "rate; give --cluster or --gbps, not both"),
    (["advise", "{spec}", "--cluster", "three_continents"], "--cluster: preset three_continents has 3 regions"),
    (["advise", "{spec}", "--cluster", "two_regions", "--link", "shaped"], "--cluster: a cluster is planned on its "
                                                                           "modeled link"),
])
def test_cluster_refusals_are_one_line(tmp_path, capsys, argv, needle):
    s = adv_spec()
    prof = fake_profile(s)
    prof.spec = s
    prof.save(tmp_path / "prof.json")
    (tmp_path / "spec.json").write_text(json.dumps({k: v for k, v in s.items()}))
    argv = [a.replace("{prof}", str(tmp_path / "prof.json")).replace("{spec}", str(tmp_path / "spec.json"))
            for a in argv] + ["--runs", str(tmp_path / "runs")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("commlab: error: ") and needle in err[0], err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing measured
