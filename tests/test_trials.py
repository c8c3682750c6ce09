"""strategy auto's trials as the run's own first steps (commlab/engine/trials.py) and the switch under them
(Stepper.switch): switching strategy keeps the training arithmetic, the trials choose by measured time
x penalty the same way on every rank, stop a clearly slower candidate early, and leave the choice in
spec.json, auto-result.json, metrics.jsonl and the timeline."""
import json

import pytest
import torch

from distutil import run_world
from commlab.engine import runfiles, trials
from commlab.engine.spec import JobSpec

BASE = {"model": "cnn", "dataset": "digits", "batch_size": 16, "steps": 12, "timeline": False,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0}}


def _spec(**over) -> dict:
    return JobSpec.from_dict({**BASE, **over}).to_dict()


def _switching(rank, world):
    """The same 12 steps: without a switch, and through wfbp -> dear -> sync -> wfbp (SGD without momentum
    keeps no state, so the arithmetic is the same; dear equals sync)."""
    from commlab.engine.trainer import Trainer
    dev = torch.device("cpu")
    ref = Trainer(JobSpec.from_dict(_spec()), None, rank, world, dev)
    sw = Trainer(JobSpec.from_dict(_spec()), None, rank, world, dev)
    modes = {3: {"mode": "dear"}, 6: {"mode": "sync"}, 9: {"mode": "wfbp"}}
    built, broadcasts = [], []
    real = torch.distributed.broadcast

    def counted(*a, **k):
        broadcasts.append(a[0].numel())
        return real(*a, **k)
    for s in range(12):
        if s in modes:
            torch.distributed.broadcast = counted
            try:  # the ranks hold the same parameters: a switch broadcasts nothing
                sw.switch(JobSpec.from_dict(_spec(comm=modes[s])))
            finally:
                torch.distributed.broadcast = real
            built.append(type(sw.dp).__name__)
        ref.train_step()
        sw.train_step()
    sw.sync_params()
    diff = max((a - b).abs().max().item() for a, b in zip(ref.model.parameters(), sw.model.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(ref.model.parameters(),
                                                             Trainer(JobSpec.from_dict(_spec()), None, rank, world,
                                                                     dev).model.parameters()))
    for t in (ref, sw):
        t.close()
    return diff, moved, built, sw.step, broadcasts


def test_switching_strategy_keeps_the_training():
    for diff, moved, built, step, broadcasts in run_world(_switching):
        assert built == ["DeAR", "Sync", "WFBP"] and step == 12
        assert broadcasts == []
        assert moved > 1e-3  # the models did train
        assert diff < 1e-5, diff


def _optimizer_kept(rank, world):
    from commlab.engine.trainer import Trainer
    momentum = {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}}
    t = Trainer(JobSpec.from_dict(_spec(**momentum)), None, rank, world, torch.device("cpu"))
    t.train_step()
    first = t.optimizer
    t.switch(JobSpec.from_dict(_spec(comm={"mode": "sync"}, **momentum)))
    same = t.optimizer is first and len(t.optimizer.state) > 0
    t.switch(JobSpec.from_dict(_spec(comm={"mode": "dear"}, **momentum)))
    fresh = t.optimizer is not first and len(t.optimizer.state) == 0
    t.train_step()
    t.close()
    return same, fresh


def test_switch_keeps_the_optimizer_where_its_parameters_stay():
    """Momentum goes on through a wfbp -> sync switch (same parameters), restarts for dear's shards."""
    for same, fresh in run_world(_optimizer_kept):
        assert same and fresh


def _plan(**over):
    """Three candidates with the same arithmetic speed but penalties that fix the order: fp16 (1.0)
    must win over none (3.0), and none at 10.0 is clearly slower than the best so far: stopped early."""
    def t(label, comp, pen, **comm):
        s = _spec(steps=40, compressor=comp, comm=comm or {"mode": "wfbp"})
        return {"label": label, "spec": s, "final": s, "penalty": pen}
    plan = {"warmup": 1, "steps": 4, "abort_after": 2, "abort_ratio": 1.25,
            "trials": [t("none x3", "none", 3.0), t("fp16", "fp16", 1.0), t("none x10", "none", 10.0)]}
    plan.update(over)
    return plan


def _run_trials(rank, world, run_dir):
    from commlab.engine.trainer import Trainer
    spec = JobSpec.from_dict(_spec(steps=40, timeline=True))
    t = Trainer(spec, run_dir, rank, world, torch.device("cpu"))
    t.train()
    t.close()
    return t.spec.compressor.name, t.step


def test_trials_choose_by_time_x_penalty_and_stop_a_clear_loser(tmp_path):
    (tmp_path / runfiles.AUTO_TRIALS).write_text(json.dumps(_plan()))
    for comp, step in run_world(_run_trials, str(tmp_path)):
        assert comp == "fp16" and step == 40
    res = json.loads((tmp_path / runfiles.AUTO_RESULT).read_text())
    assert res["winner"] == 1 and res["label"] == "fp16"
    first, second, third = res["trials"]
    assert (first["first_step"], first["last_step"]) == (0, 4) and not first["aborted"]
    assert (second["first_step"], second["last_step"]) == (5, 9) and not second["aborted"]
    assert third["aborted"] and (third["first_step"], third["last_step"]) == (10, 12)  # 1 warm-up + 2 timed
    assert res["decided_step"] == 13 == res["trial_steps"]
    assert abs(first["score_ms"] - 3 * first["median_ms"]) < 1e-9
    # the rest of the run trained under the choice, which spec.json now holds
    assert json.loads((tmp_path / "spec.json").read_text())["compressor"]["name"] == "fp16"
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if m.get("kind") == "step" and m["rank"] == 0]
    assert [m.get("trial") for m in steps[:13]] == [0] * 5 + [1] * 5 + [2] * 3
    assert all("trial" not in m for m in steps[13:]) and len(steps) == 40
    from commlab.lab.rundir.summary import summarize
    assert summarize([json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()])[
        "trial_steps"] == 13
    lane = [json.loads(x) for x in (tmp_path / "timeline-rank0.jsonl").read_text().splitlines()]
    lane = [e for e in lane if e.get("cat") == "advisor"]
    assert [e["args"]["label"] for e in lane] == ["none x3", "fp16", "none x10"]
    assert [e["args"]["aborted"] for e in lane] == [False, False, True]


def test_a_far_slower_trial_stops_at_its_first_step(tmp_path):
    """stop_ratio: none at penalty 10 scores ~10x fp16's best from its very first (warm-up) step: with a stop
    ratio of 5 it trains that one step only, where abort_after alone let it train 1 + 2."""
    plan = _plan(stop_ratio=5.0, hold_margin=1.0)
    plan["trials"][0]["reference"] = True  # none x3: beaten by fp16 (1.0) by far more than the margin
    (tmp_path / runfiles.AUTO_TRIALS).write_text(json.dumps(plan))
    for comp, step in run_world(_run_trials, str(tmp_path)):
        assert comp == "fp16" and step == 40
    res = json.loads((tmp_path / runfiles.AUTO_RESULT).read_text())
    assert res["held"] is False
    first, second, third = res["trials"]
    assert not first["aborted"] and not second["aborted"]  # no best yet for the first; fp16 is the best
    assert third["aborted"] and (third["first_step"], third["last_step"]) == (10, 10)
    assert res["winner"] == 1 and res["trial_steps"] == 11


def test_a_runoff_measures_the_close_trials_again_in_reverse_order(tmp_path):
    """lead_in: the first trial warms up 2 steps more. runoff_within (100: every trial not stopped): fp16 and
    none x3 train again, fp16 (the later one) first, and are scored on all their timed steps; none x10,
    stopped early, does not come back."""
    plan = _plan(lead_in=2, runoff_within=100.0, runoff_steps=3)
    (tmp_path / runfiles.AUTO_TRIALS).write_text(json.dumps(plan))
    for comp, step in run_world(_run_trials, str(tmp_path)):
        assert comp == "fp16" and step == 40
    res = json.loads((tmp_path / runfiles.AUTO_RESULT).read_text())
    first, second, third = res["trials"]
    assert first["visits"] == [[0, 6], [19, 22]]  # 2 lead-in + 1 warm-up + 4 timed; then 1 + 3
    assert second["visits"] == [[7, 11], [15, 18]]
    assert third["aborted"] and third["visits"] == [[12, 14]]
    assert res["runoff"] == [0, 1] and res["decided_step"] == 23 and res["winner"] == 1
    assert len(first["timed_ms"]) == 4 + 3 and len(first["times_ms"]) == 7 + 4
    assert len(second["timed_ms"]) == 4 + 3 and len(second["times_ms"]) == 5 + 4
    assert first["median_ms"] == pytest.approx(sorted(first["timed_ms"])[3])
    assert first["score_ms"] == pytest.approx(3 * first["median_ms"])
    # the timed steps are the visits' steps after their warm-ups, in metrics.jsonl too
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    tags = [m.get("trial") for m in steps if m.get("kind") == "step" and m["rank"] == 0][:23]
    assert tags == [0] * 7 + [1] * 5 + [2] * 3 + [1] * 4 + [0] * 4
    lane = [json.loads(x) for x in (tmp_path / "timeline-rank0.jsonl").read_text().splitlines()]
    lane = [e["args"] for e in lane if e.get("cat") == "advisor"]
    assert [(v["trial"], v["runoff"]) for v in lane] == [(0, False), (1, False), (2, False), (1, True), (0, True)]
    assert trials.most_steps(plan) == 2 + 3 * 5 + 3 * 4


def test_the_reference_trial_runs_off_within_its_own_factor(tmp_path):
    """reference_within: the reference (none x3, ~3x fp16's score) trains again with the best although only the
    best is within runoff_within (1.0); without it nothing runs off (a runoff of one trial is none)."""
    plan = _plan(runoff_within=1.0, reference_within=100.0, runoff_steps=3, hold_margin=1.0)
    plan["trials"][0]["reference"] = True
    (tmp_path / runfiles.AUTO_TRIALS).write_text(json.dumps(plan))
    for comp, step in run_world(_run_trials, str(tmp_path)):
        assert comp == "fp16" and step == 40
    res = json.loads((tmp_path / runfiles.AUTO_RESULT).read_text())
    first, second, third = res["trials"]
    assert res["runoff"] == [0, 1] and len(first["visits"]) == 2 and len(second["visits"]) == 2
    assert third["aborted"] and len(third["visits"]) == 1
    assert res["winner"] == 1 and res["held"] is False
    assert trials.most_steps(plan) == trials.most_steps({**plan, "reference_within": None, "runoff_within": 1.0})
    del plan["reference_within"]
    (tmp_path / runfiles.AUTO_TRIALS).write_text(json.dumps(plan))
    run_world(_run_trials, str(tmp_path))
    res = json.loads((tmp_path / runfiles.AUTO_RESULT).read_text())
    assert res["runoff"] == [] and all(len(t["visits"]) == 1 for t in res["trials"])


def test_the_reference_trial_holds_inside_its_margin():
    """A trial marked reference (DDP) wins unless the lowest score beats it by more than hold_margin."""
    plan = {"trials": [{"reference": True}, {}, {}], "hold_margin": 1.03}
    assert trials.choose([10.0, 9.8, 12.0], plan) == (0, True)  # 2% better: inside the margin
    assert trials.choose([10.0, 9.0, 12.0], plan) == (1, False)  # 10% better: a real win
    assert trials.choose([9.0, 9.5, 12.0], plan) == (0, False)  # the reference is the lowest anyway
    assert trials.choose([10.0, 9.8], {"trials": plan["trials"]}) == (1, False)  # no margin given: lowest
    assert trials.choose([10.0, 9.8], {"trials": [{}, {}]}) == (1, False)  # no reference


def test_trials_shorten_powersgd_start_by_the_steps_trained():
    s = _spec(compressor={"name": "powersgd", "params": {"rank": 1, "start_iter": 12},
                          "per_bucket": [{"below_mb": 1.0, "name": "powersgd", "params": {"rank": 2}}]})
    out = trials.shorten_start(s, 5)
    assert out["compressor"]["params"]["start_iter"] == 7
    assert out["compressor"]["per_bucket"][0]["params"]["start_iter"] == 5  # from its default, 10
    assert trials.shorten_start(s, 50)["compressor"]["params"]["start_iter"] == 0
    assert s["compressor"]["params"]["start_iter"] == 12  # the input is left alone


@pytest.mark.parametrize("change,problem", [
    ({"trials": []}, "trials must be a non-empty list"),
    ({"steps": 0}, "steps must be an integer >= 1"),
    ({"abort_ratio": 0.5}, "abort_ratio must be a number >= 1"),
    ({"stop_ratio": 1.1}, r"stop_ratio must be a number >= abort_ratio \(1.25\)"),
    ({"hold_margin": 0.9}, "hold_margin must be a number >= 1"),
    ({"lead_in": -1}, "lead_in must be an integer >= 0"),
    ({"runoff_within": 0.5, "runoff_steps": 4}, "runoff_within must be a number >= 1"),
    ({"runoff_within": 1.1}, "runoff_within needs runoff_steps"),
    ({"runoff_within": 1.1, "runoff_steps": 0}, "runoff_steps must be an integer >= 1"),
    ({"reference_within": 0.9, "runoff_steps": 4}, "reference_within must be a number >= 1"),
    ({"reference_within": 1.25}, "reference_within needs runoff_steps"),
])
def test_a_bad_trial_plan_is_refused(tmp_path, change, problem):
    (tmp_path / runfiles.AUTO_TRIALS).write_text(json.dumps(_plan(**change)))
    with pytest.raises(ValueError, match=problem):
        runfiles.read_trials(str(tmp_path))


def test_a_trial_without_penalty_is_refused(tmp_path):
    plan = _plan()
    del plan["trials"][1]["penalty"]
    (tmp_path / runfiles.AUTO_TRIALS).write_text(json.dumps(plan))
    with pytest.raises(ValueError, match=r"trials\[1\] lacks penalty"):
        runfiles.read_trials(str(tmp_path))


def test_trials_that_fill_the_run_are_refused(tmp_path):
    (tmp_path / runfiles.AUTO_TRIALS).write_text(json.dumps(_plan()))
    from commlab.engine.trainer import Trainer
    with pytest.raises(ValueError, match="steps must be more"):
        Trainer(JobSpec.from_dict(_spec(steps=15)), str(tmp_path), 0, 1, torch.device("cpu"))
