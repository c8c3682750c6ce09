"""The advisor ranks by time to the target and never lets a candidate without evidence for this model win:
the conservative rule, the evidence said in words, seconds to the target, and ``--measure``'s to-target
trials (commlab.lab.strategy.totarget), with a fake runner and once for real."""
import json
import math

import pytest

from commlab.engine.spec import SpecError
from commlab.lab.base.specs import load_spec
from commlab.lab.strategy import advisor, space, totarget
from commlab.lab.strategy import penalty as pen
from tests.test_advisor import BASE, EVIDENCE, cli, fake_profile, fake_session_runner, spec


def benchmark_says_powersgd_keeps_accuracy(monkeypatch):
    """Nothing of this model in the index; the shipped benchmark (another model) says PowerSGD keeps accuracy."""
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    cells = {("none", False): {"acc": 0.99, "steps": 300, "file": "x.json"},
             ("powersgd", False): {"acc": 0.99, "steps": 300, "file": "x.json"}}
    monkeypatch.setattr(advisor, "benchmark_cells", lambda: cells)
    monkeypatch.setattr(advisor, "strategy_cells", lambda: {})


def test_a_candidate_without_evidence_never_wins(monkeypatch):
    """On a slow link PowerSGD is predicted several times faster than anything else, and its penalty of 1
    comes from a benchmark on another model: it is listed, said to be unproven, and not chosen; the winner has
    evidence (DDP or a cast), and the reason names what was passed over and how to try it. Declared, it wins."""
    benchmark_says_powersgd_keeps_accuracy(monkeypatch)
    s = spec()
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None)
    psgd = min((c for c in adv.candidates if c.compressor["name"] == "powersgd" and c.predicted_score),
               key=lambda c: c.predicted_score)
    assert not psgd.proven and psgd.predicted_score < adv.winner.predicted_score
    assert adv.winner.proven and adv.winner.compressor["name"] in ("none", "fp16", "bf16")
    assert "not chosen though predicted faster" in adv.reason and "--measure" in adv.reason, adv.reason
    row = next(line for line in advisor.format_table(adv) if f" {psgd.label} " in line)
    assert row.endswith("unproven here: seen only on another model (a cnn on digits)"), row
    assert advisor.format_table(adv)[0].split()[-1] == "EVIDENCE"
    assert all(c["evidence"] for c in adv.as_dict()["candidates"])
    ranked = adv.ranked()
    first_unproven = next(i for i, c in enumerate(ranked) if not c.proven)
    assert all(not c.proven for c in ranked[first_unproven:])  # every one with evidence ranks above
    declared = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None, penalties={"powersgd": 1.0})
    assert declared.winner.compressor["name"] == "powersgd"


def test_a_short_trial_session_never_tries_a_candidate_without_evidence(monkeypatch, tmp_path):
    """``--measure steps`` times a step of each pick: one without evidence is not among them, so measuring it
    fastest could not make it win."""
    benchmark_says_powersgd_keeps_accuracy(monkeypatch)
    s = spec()
    runner = fake_session_runner(tmp_path, lambda i, t: 1.0 if t["compressor"]["name"] == "powersgd" else 50.0, [])
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None, measure=True, trials=3,
                         runner=runner)
    tried = [c for c in adv.candidates if c.trial_run]
    assert tried and all(c.proven for c in tried) and adv.winner.compressor["name"] != "powersgd"


class FakeRun:
    """A finished run of the index: its spec, evaluations and steps as the lab records them."""

    def __init__(self, rid, spec_, evals, ms=10.0, state="done"):
        self.id, self._spec, self.state = rid, spec_, state
        self._rows = [{"kind": "step", "step": k, "rank": r, "time_ms": ms} for k in range(max(
            (st for st, _ in evals), default=0)) for r in (0, 1)]
        self._rows += [{"kind": "eval", "step": st, "eval_acc": a} for st, a in evals]

    def spec_dict(self):
        return self._spec

    def metric_rows(self):
        return self._rows

    def status(self):
        return {}


def test_this_models_runs_are_evidence_and_give_seconds_to_the_target(monkeypatch):
    """A DDP run and a PowerSGD run of this model in the index: PowerSGD's penalty is measured (its steps to
    the user's target over DDP's), it has evidence, and the table says each candidate's seconds to the
    target from DDP's steps."""
    s = spec()
    psgd = pen.comp_section("powersgd", rank=1)
    ddp_run = FakeRun("d", s, [(20, 0.5), (40, 0.8), (60, 0.9)])
    psgd_run = FakeRun("p", space.with_strategy(s, {"compressor": psgd}), [(20, 0.4), (40, 0.6), (60, 0.8)])
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: [ddp_run, psgd_run])
    adv = advisor.advise(s, runs="index", gbps=0.01, profile=fake_profile(s), say=lambda m: None, target=0.8)
    c = next(c for c in adv.candidates if c.compressor == psgd and c.predicted_score)
    assert c.proven and c.penalty == pytest.approx(60 / 40) and "run p" in c.penalty_source
    assert adv.ddp_steps == (40, 0.8, "d")
    assert adv.to_target_s(c) == pytest.approx(c.predicted_score * 40 / 1e3)
    assert any(line.startswith("TO TARGET: to 80.0% held out, DDP's 40 steps (run d)")
               for line in advisor.format_table(adv))
    with pytest.raises(SpecError, match="--target"):
        advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None, target=1.5)


def curve_runner(store, curves):
    """A runner whose runs follow ``curves``: compressor name -> (accuracy at step k, ms per step); a run
    stops at its spec's stop_at_acc as the engine does, or at its steps."""
    def runner(sp, prepare=None):
        acc, ms = curves[sp["compressor"]["name"]]
        evals, k = [], 0
        while k < sp["steps"]:
            k = min(k + sp["eval_every"], sp["steps"])
            evals.append((k, acc(k)))
            if sp["stop_at_acc"] and evals[-1][1] >= sp["stop_at_acc"]:
                break
        run = FakeRun(f"r{len(store)}", sp, evals, ms)
        store.append(run)
        return run
    return runner


def test_to_target_trials_choose_by_time_to_the_target(monkeypatch):
    """``--measure`` (to target): DDP runs first, its whole budget (no target given: 97% of its best); each
    other pick stops at the target or at the steps its prediction allows in 1.5x DDP's time. The fastest to
    the target wins, though a benchmark said nothing of it on this model; one that reaches the target later
    loses; one that never does is out and says so; the runs are the model's evidence afterwards."""
    store = []
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: list(store))
    monkeypatch.setattr(advisor, "benchmark_cells", lambda: {})
    monkeypatch.setattr(advisor, "strategy_cells", lambda: {})
    s = spec(steps=200, eval_every=10)
    ramp = (lambda rate: lambda k: min(0.9, rate * k))
    curves = {"none": (ramp(0.01), 100.0), "fp16": (ramp(0.01), 90.0), "bf16": (ramp(0.01), 90.0),
              "powersgd": (ramp(0.01), 30.0),    # as many steps as DDP, a third of the time each
              "topk": (ramp(0.003), 20.0),       # the fastest step, but it never gets there in its cap
              "int8": (ramp(0.01), 95.0)}
    said = []
    adv = advisor.advise(s, runs="index", gbps=0.01, profile=fake_profile(s), say=said.append, measure=True,
                         trials=3, to_target=True, methods=False, runner=curve_runner(store, curves))
    first = store[0].spec_dict()
    assert space.is_ddp(next(c for c in adv.candidates if c.trial_run == store[0].id))
    assert first["steps"] == 200 and first["stop_at_acc"] == 0 and first["eval_every"] == 10
    assert adv.target == pytest.approx(0.97 * 0.9)
    assert all(r.spec_dict()["stop_at_acc"] == pytest.approx(adv.target) for r in store[1:])
    # DDP, the best with evidence (a cast) and three families, and the next in line for each that missed
    misses = sum(not c.to_target["reached"] for c in adv.candidates if c.to_target)
    assert 5 <= len(store) and len(store) - 5 <= min(misses, totarget.MORE_AFTER_MISS)
    assert adv.chosen_by == "measured to target" and adv.winner.compressor["name"] == "powersgd"
    ddp = next(c for c in adv.candidates if space.is_ddp(c))
    assert ddp.to_target["seconds"] == pytest.approx(90 * 0.1)  # 0.873 first reached at step 90
    assert adv.winner.to_target["seconds"] == pytest.approx(90 * 0.03)
    assert "reached 87.3% held out soonest" in adv.reason and "3.33x sooner than DDP" in adv.reason, adv.reason
    missed = [c for c in adv.candidates if c.to_target and not c.to_target["reached"]]
    for c in missed:
        assert c.penalty is None and "did not reach" in c.penalty_source
        # capped at what its predicted step allows in 1.5x DDP's time (past that it could not have won)
        cap = math.ceil(totarget.STOP_FACTOR * 9.0e3 / c.predicted_ms / 10) * 10
        assert c.to_target["trained"] == c.to_target["cap"] == min(200, max(20, cap))
    assert adv.winner.proven and "measured" in adv.winner.penalty_source
    doc = json.loads(json.dumps(adv.as_dict()))
    assert doc["chosen_by"] == "measured to target" and any(c["to_target"] for c in doc["candidates"])
    assert any(line.startswith("advisor: DDP reached 87.3% at step 90") for line in said)
    # the next advice, predicted only, reads the trials as this model's runs: PowerSGD has evidence now
    again = advisor.advise(s, runs="index", gbps=0.01, profile=fake_profile(s), say=lambda m: None, methods=False)
    assert again.winner.compressor["name"] == "powersgd" and again.winner.proven


def test_ddp_holds_when_the_best_trial_is_within_the_margin(monkeypatch):
    store = []
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: list(store))
    s = spec(steps=100, eval_every=10)
    same = (lambda k: min(0.9, 0.01 * k))
    curves = {n: (same, 100.0) for n in ("none", "fp16", "bf16", "int8", "topk")}
    curves["powersgd"] = (same, 98.5)
    adv = advisor.advise(s, runs="index", gbps=400, profile=fake_profile(s), say=lambda m: None, measure=True,
                         trials=2, to_target=True, methods=False, runner=curve_runner(store, curves),
                         penalties=EVIDENCE, target=0.5)
    assert space.is_ddp(adv.winner) and adv.reason.startswith("DDP") and adv.target == 0.5
    assert store[0].spec_dict()["stop_at_acc"] == 0.5  # a target given: DDP stops there too


@pytest.mark.parametrize("extra,needle", [
    (("--target", "1.5"), "--target: must be a held-out accuracy"),
    (("--target-steps", "50"), "--target-steps: only with --measure target"),
    (("--measure", "often"), "--measure"),
])
def test_cli_bad_target_input_is_one_line(tmp_path, extra, needle):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(BASE))
    p = cli("advise", str(f), "--gbps", "1", "--runs", str(tmp_path / "runs"), *extra, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr, p.stderr


@pytest.mark.parametrize("data,field", [({"stop_at_acc": 1.5, "eval_every": 5}, "stop_at_acc"),
                                        ({"stop_at_acc": 0.5, "eval_every": 0}, "stop_at_acc")])
def test_stop_at_acc_spec_errors(data, field):
    with pytest.raises(SpecError) as e:
        load_spec(data={**BASE, **data})
    assert e.value.path == field


def test_cli_measures_time_to_target_for_real(tmp_path):
    """End to end on a modeled link: a profile measured now, DDP to the target and one other pick stopping at
    it, both real 2-rank runs that stay in the index; the winner's spec written; the run stopped at its
    target ends done, its summary says so."""
    from commlab.lab.rundir.store import RunStore
    from commlab.lab.rundir.summary import format_summary, summarize
    f = tmp_path / "s.json"
    f.write_text(json.dumps({**BASE, "steps": 60, "eval_every": 5}))
    runs = tmp_path / "runs"
    p = cli("advise", str(f), "--gbps", "0.05", "--measure", "--trials", "1", "--target", "0.5",
            "--target-steps", "60", "--runs", str(runs), "--out", str(tmp_path / "best.yaml"), "--json-out",
            str(tmp_path / "adv.json"), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "winner (measured to target)" in p.stdout and "to-target trials" in p.stdout, p.stdout
    adv = json.loads((tmp_path / "adv.json").read_text())
    tried = [c for c in adv["candidates"] if c["to_target"]]
    # DDP, the safe pick when one is predicted faster than DDP, one family, and the next after a miss
    assert 2 <= len(tried) <= 3 + totarget.MORE_AFTER_MISS and adv["target"] == 0.5
    for c in tried:
        r = RunStore(runs).get(c["trial_run"])
        assert r.state == "done" and r.spec_dict()["stop_at_acc"] == 0.5
        if c["to_target"]["reached"]:
            got = summarize(r.metric_rows(), r.spec_dict())
            assert got["stopped_at_target"] == 0.5 and got["steps_done"] < 60
            assert "(stopped at its target, 50.0% held out)" in format_summary(got)[0]
            assert c["to_target"]["seconds"] > 0
    assert adv["winner"] in [c["label"] for c in tried if c["to_target"]["reached"]]
    assert load_spec(str(tmp_path / "best.yaml")).to_dict()["stop_at_acc"] == 0  # the winner trains on


def test_to_target_picks_take_methods_and_per_step_families_in_turn():
    """DDP first; then the best of each family, per-step families and methods alternating (the kind predicted
    faster first); a candidate without evidence is ranked by its iteration time alone and is a family of its
    own section, one with evidence by its time x penalty; per-step candidates left out for losing accuracy are
    not tried."""
    def cand(label, comp, ms, pen_=1.0, source="benchmark: x", method=None):
        c = space.Candidate(label, comp, {"name": "bucket", "cap_mb": 1.0}, {"mode": "wfbp"})
        c.predicted_ms, c.penalty, c.penalty_source = ms, pen_, source
        if method:
            c.method = {"name": method, "params": {}, "compressor": {}}
        return c
    ddp = cand("ddp", pen.comp_section("none"), 100.0, source="the reference")
    ddp.schedule = {"name": "bucket", "cap_mb": 25.0}
    cands = [ddp, cand("psgd r1", pen.comp_section("powersgd", rank=1), 20.0),
             cand("psgd r4", pen.comp_section("powersgd", rank=4), 25.0),
             cand("fp16", pen.comp_section("fp16"), 50.0, source="default: a cast"),
             cand("topk declared slow", pen.comp_section("topk", True, ratio=0.01), 15.0, 5.0, "declared by the user"),
             cand("lossy", pen.comp_section("int8"), 1.0, None, "benchmark: loses accuracy"),
             cand("diloco", pen.comp_section("none"), 5.0, None, "no runs", "diloco"),
             cand("sdiloco", pen.comp_section("none"), 6.0, None, "no runs", "streaming_diloco")]
    got = [c.label for c in totarget.picks(cands, 4)]
    # fp16 (evidence, predicted faster than DDP) first; PowerSGD r1 and r4 are two trials: without evidence,
    # one's steps say nothing of the other's
    # DiLoCo and Streaming DiLoCo are one family of methods (the better-predicted one is tried)
    assert got == ["ddp", "fp16", "diloco", "psgd r1", "psgd r4", "topk declared slow"]
    assert [c.label for c in totarget.picks(cands, 1)] == ["ddp", "fp16", "diloco"]
    ddp.predicted_ms = 40.0  # DDP predicted faster than fp16: no safe pick ahead of the others
    assert [c.label for c in totarget.picks(cands, 2)] == ["ddp", "diloco", "psgd r1"]


def test_a_run_evaluates_every_eval_every_steps_and_stops_at_its_target(tmp_path):
    """Without stop_at_acc a run evaluates every eval_every steps and at its end; with one it ends done at the
    first evaluation that reaches it, without a second evaluation of the same step."""
    import commlab
    base = {**BASE, "steps": 12, "eval_every": 4, "world_size": 2}
    plain = commlab.run(base, runs=tmp_path / "runs")
    assert plain.state == "done"
    assert [m["step"] for m in plain.metric_rows() if m.get("kind") == "eval"] == [4, 8, 12]
    stopped = commlab.run({**base, "stop_at_acc": 0.01}, runs=tmp_path / "runs")
    assert stopped.state == "done"
    assert [m["step"] for m in stopped.metric_rows() if m.get("kind") == "eval"] == [4]
    assert max(m["step"] for m in stopped.metric_rows() if m.get("kind") == "step") == 3
