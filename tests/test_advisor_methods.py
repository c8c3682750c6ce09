"""The advisor and the methods that communicate less often: they are in its space, predicted with their syncs
amortized, and chosen only with a penalty measured in the lab's own runs (steps to accuracy against DDP's) or
declared by the user; without one they are listed and their row says why they are not chosen."""
import pytest

from commlab.lab.strategy import advisor, space, trials
from commlab.lab.strategy import penalty as pen
from tests.test_advisor import FakeRun, fake_profile, spec


@pytest.fixture
def no_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: [])
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))  # the curves the advisor keeps (DeMo's codec) go there


def local(adv):
    return {c.method["name"]: c for c in adv.candidates if c.local}


def test_methods_are_listed_and_not_chosen_without_a_penalty(no_runs):
    s = spec()
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None)
    m = local(adv)
    assert set(m) == {"local_sgd", "post_local_sgd", "diloco", "streaming_diloco", "demo", "sparseloco", "muloco",
                      "desloc"}
    # DeMo keeps its own momentum: with SGD momentum 0.9 the spec does not take it, and its row says so; MuLoCo
    # needs optimizer muon and DES-LOC Adam's moments
    assert m["demo"].predicted_ms is None and "optimizer.momentum" in m["demo"].note
    for name in ("muloco", "desloc"):
        assert m[name].predicted_ms is None and "optimizer.name" in m[name].note, name
    for name in ("local_sgd", "post_local_sgd", "diloco", "streaming_diloco", "sparseloco"):
        c = m[name]
        assert c.predicted_ms is not None and c.penalty is None, name
        assert c.penalty_source.startswith("no runs, not chosen") and f"--penalty {name}=X" in c.penalty_source
    # on a 0.01 Gbit/s link local SGD (an average every 8 steps) is predicted several times faster than DDP,
    # and still not chosen: nothing measured how many more steps it needs
    ddp = next(c for c in adv.candidates if space.is_ddp(c))
    assert 4 * m["local_sgd"].predicted_ms < ddp.predicted_ms and not adv.winner.local
    table = advisor.format_table(adv, limit=3)
    rows = [line for line in table if "local_sgd(H=8)" in line]
    assert len(rows) == 1 and "no runs, not chosen" in rows[0] and " out " in rows[0]
    assert len(table) == 1 + 3 + 8  # the head, the top 3 and every method


def test_a_declared_penalty_lets_a_method_win(no_runs):
    s = spec()
    # codecs that cost 0.1 us per byte: every compressor spends more than local SGD's amortized average
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s, encode_per_byte=1e-7), say=lambda m: None,
                         penalties={"local_sgd": 1.5})
    assert adv.winner.method["name"] == "local_sgd" and adv.winner.penalty == 1.5
    assert "declared by the user (local_sgd=1.5)" in adv.winner.penalty_source
    best = adv.winner_spec()  # a valid spec: the method, no top-level compressor, DDP's buckets
    assert best["method"]["name"] == "local_sgd" and best["method"]["params"] == {"H": 8}
    assert best["compressor"]["name"] == "none" and best["network"]["gbps"] == 0.01
    # on a fast link the same penalty loses to DDP: the sync it saves is cheap there
    fast = advisor.advise(s, gbps=400, profile=fake_profile(s, encode_per_byte=1e-7), say=lambda m: None,
                          penalties={"local_sgd": 1.5})
    assert not fast.winner.local


def test_a_methods_penalty_is_its_steps_to_accuracy_against_ddp(monkeypatch, tmp_path):
    s = spec()
    diloco = space.with_strategy(s, {"method": {"name": "diloco", "H": 20}})
    ddp_run = FakeRun("a", s, [(49, 0.5), (99, 0.9), (149, 0.98), (199, 1.0)])
    diloco_run = FakeRun("b", diloco, [(49, 0.4), (99, 0.8), (149, 0.9), (199, 0.99)])
    other_world = FakeRun("c", space.with_strategy({**s, "world_size": 4}, {"method": {"name": "diloco", "H": 20}}),
                          [(49, 0.99), (99, 0.99)])
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: [ddp_run, diloco_run, other_world])
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    p, src = pen.method_penalty(s, diloco["method"], None)
    assert p == pytest.approx(199 / 149)  # 97% of DDP's best: DDP at 149, DiLoCo at 199
    assert src.startswith("measured") and "run b" in src and "vs DDP 149 (run a)" in src
    # the measured configuration joins the space (DiLoCo at H 20 beside the defaults), with that penalty
    assert space.measured_methods(s, "index") == [diloco["method"]]
    adv = advisor.advise(s, runs="index", gbps=0.01, profile=fake_profile(s), say=lambda m: None)
    h20 = [c for c in adv.candidates if c.local and c.method == diloco["method"]]
    assert len(h20) == 1 and h20[0].penalty == pytest.approx(199 / 149) and "H=20" in h20[0].label
    # a compressor's runs are held to DDP's without a method: the DiLoCo run is not a "none" run
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: [diloco_run])
    assert pen.penalty_from_runs(s, pen.comp_section("none"), None) is None
    assert pen.method_penalty(s, diloco["method"], None)[0] is None


def test_strategy_auto_and_trials_leave_the_methods_out(no_runs):
    s = spec()
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None, methods=False)
    assert not any(c.local for c in adv.candidates)
    declared = advisor.advise(s, gbps=0.01, profile=fake_profile(s, encode_per_byte=1e-7), say=lambda m: None,
                              penalties={"diloco": 1.0})
    assert declared.ranked()[0].local
    assert not any(c.local for c in trials.trial_picks(declared.ranked(), 3))


def test_demo_is_a_candidate_with_a_momentum_free_optimizer(no_runs):
    s = spec(optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.0})
    adv = advisor.advise(s, gbps=0.1, profile=fake_profile(s), say=lambda m: None)
    demo = local(adv)["demo"]
    assert demo.predicted_ms is not None and demo.penalty is None and not demo.note
