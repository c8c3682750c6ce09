"""strategy auto without a profile: the run's ranks measure it in dry steps and wait for the advisor's plan
(commlab/engine/autoprofile.py, commlab/lab/strategy/auto.py ``profile_in_run``), and cost curves kept per machine (commlab/lab/strategy/perfmodel/whatif.py)."""
import json

import pytest
import torch
from torch import nn

from commlab.engine import autoprofile, models, runfiles
from commlab.engine.runlog import read_jsonl
from commlab.engine.spec import JobSpec
from commlab.engine.timeline import Timeline
from commlab.engine.trainer import load_data
from commlab.lab.strategy import auto
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import whatif
from commlab.lab.base.specs import load_spec

BASE = {"name": "ap", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 30, "batch_size": 16,
        "eval_every": 0, "threads": 1, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "network": {"link": "modeled", "gbps": 0.05}}


def _spec(**kw) -> JobSpec:
    return JobSpec.from_dict(load_spec(data={**BASE, **kw}).to_dict())


def test_dry_steps_leave_the_run_untouched_and_make_a_profile(tmp_path):
    """Parameters, BatchNorm statistics and the random state are as before the dry steps, no gradient is
    left, and their spans calibrate a profile with every layer."""
    torch.manual_seed(0)
    spec = _spec()
    ds = load_data(spec)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5),
                          nn.Linear(32, 10))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    tl = Timeline(str(tmp_path / "profile-timeline-rank0.jsonl"), 0)
    t0, t1 = autoprofile.dry_steps(spec, model, ds, models.make_loss(None), tl, 0, 1, torch.device("cpu"), 5)
    tl.close()
    assert t1 > t0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before
                                                                    if not torch.equal(before[k], after[k])]
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    ev = read_jsonl(str(tmp_path / "profile-timeline-rank0.jsonl"))
    for cat in ("forward", "backward", "optimizer"):
        assert sorted(e["args"]["step"] for e in ev if e["cat"] == cat and "step" in e["args"]) == list(range(5))
    params = autoprofile.param_list(model)
    prof = cal.from_events(spec.to_dict(), ev, "dry steps", skip=2, params=params)
    assert set(prof.layer_forward) == set(prof.layer_ready) == {"1", "2", "5"}  # the layers owning parameters
    assert prof.forward_s > 0 and prof.backward_s > 0 and prof.optimizer_s > 0
    assert prof.params == [tuple(p) for p in params]


def test_the_ranks_parameter_list_is_the_labs():
    spec = _spec(model="cnn")
    model = models.build("cnn", load_data(spec).info)
    assert [tuple(p) for p in autoprofile.param_list(model)] == cal.param_list(spec.to_dict())


def test_wait_plan_returns_on_the_plan_and_raises_on_failure_or_silence(tmp_path):
    (tmp_path / runfiles.AUTO_TRIALS).write_text("{}")
    autoprofile.wait_plan(str(tmp_path), 1.0)
    (tmp_path / runfiles.AUTO_TRIALS).unlink()
    with pytest.raises(RuntimeError, match="no trial plan"):
        autoprofile.wait_plan(str(tmp_path), 0.05)
    (tmp_path / runfiles.AUTO_FAILED).write_text(json.dumps({"error": "LabError: boom"}))
    with pytest.raises(RuntimeError, match="strategy auto: LabError: boom"):
        autoprofile.wait_plan(str(tmp_path), 1.0)


@pytest.mark.parametrize("req, field", [({"profile_steps": 0, "timeout_s": 5}, "profile_steps"),
                                        ({"profile_steps": 8}, "timeout_s"),
                                        ({"profile_steps": True, "timeout_s": 5}, "profile_steps")])
def test_a_bad_request_names_its_field(tmp_path, req, field):
    (tmp_path / runfiles.AUTO_PENDING).write_text(json.dumps(req))
    with pytest.raises(ValueError, match=field):
        autoprofile.pending(str(tmp_path))
    assert autoprofile.pending(str(tmp_path / "nowhere")) is None


def test_profile_in_run_needs_room_and_no_profile(tmp_path):
    s = load_spec(data={**BASE, "steps": 40, "strategy": {"mode": "auto", "trials": 2, "trial_steps": 4}}).to_dict()
    assert auto.profile_in_run(s, tmp_path)  # 3 picks at most, 2 visits of 2 + 4 steps each: 36 < 40
    assert not auto.profile_in_run({**s, "steps": 36}, tmp_path)
    cal.Profile(model="mlp", dataset="digits", batch_size=16).save(whatif.profile_dir(tmp_path) / "mlp-digits-b16.json")
    assert not auto.profile_in_run(s, tmp_path)


def test_cost_curves_are_kept_per_machine(tmp_path, monkeypatch):
    s = load_spec(data={**BASE, "compressor": "fp16"}).to_dict()
    first = cal.Profile(model="mlp", dataset="digits", batch_size=16)
    assert whatif.ensure_curves(first, [s], tmp_path, kept=True)  # measured, and kept for the machine
    key = cal.compressor_key(s["compressor"])
    kept = json.loads((whatif.profile_dir(tmp_path) / whatif.CURVES).read_text())
    assert kept[whatif.machine_key()][key] == first.compressors[key]

    def no(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(cal, "measure_compressor", no)
    other = cal.Profile(model="cnn", dataset="digits", batch_size=32)  # another model, the same machine
    assert not whatif.ensure_curves(other, [s], tmp_path, kept=True)
    assert other.compressors[key] == first.compressors[key]
    with pytest.raises(AssertionError, match="measured again"):  # not kept: measured for this profile
        whatif.ensure_curves(cal.Profile(model="cnn", dataset="digits", batch_size=32), [s], tmp_path)
    (whatif.profile_dir(tmp_path) / whatif.CURVES).write_text("not json")  # a cache: unreadable means measure
    assert whatif.machine_curves(tmp_path) == {}


def test_strategy_auto_profiles_in_the_run(tmp_path):
    """No profile in the lab: the run's ranks measure it (no profiling run of its own), the advisor plans in
    the supervisor while they wait, and the trials and the choice follow as in any in-run choice."""
    import commlab
    from commlab.engine.timeline import LANES
    root = tmp_path / "runs"
    run = commlab.run({**BASE, "strategy": {"mode": "auto", "trials": 1, "trial_steps": 4}}, runs=root)
    assert run.state == "done", run.log_tail()
    assert [r.id for r in commlab.runs(runs=root)] == [run.id]  # no profiling run
    info = json.loads(run.file(runfiles.AUTO_PROFILED).read_text())
    assert info["steps"] == auto.PROFILE_STEPS and info["wall_s"] > 0
    saved = cal.Profile.load(whatif.profile_dir(root) / "mlp-digits-b16.json")
    assert run.id in saved.source and saved.compressors and saved.params == cal.param_list(run.spec_dict())
    rec = json.loads(run.file("tuning.json").read_text())["advisor"]
    res = json.loads(run.file(runfiles.AUTO_RESULT).read_text())
    assert rec["chosen_by"] == "measured" and rec["winner"] == res["label"]
    assert rec["profile_source"] == saved.source
    c = rec["cost_s"]
    assert c["profile"] >= res["profile_s"] > 0 and c["predict"] >= 0
    assert c["profile"] + c["predict"] == pytest.approx(res["profile_s"] + res["plan_wait_s"])
    assert c["total"] == pytest.approx(c["profile"] + c["predict"] + res["cost_s"])
    plan = json.loads(run.file(runfiles.AUTO_TRIALS).read_text())
    assert plan["lead_in"] == 0
    steps = [m for m in run.metric_rows() if m.get("kind") == "step" and m["rank"] == 0]
    assert [m["step"] for m in steps] == list(range(30))  # the dry steps are none of the run's steps
    lane = sorted((e for e in run.timeline_events() if e.get("tid") == LANES["advisor"] and e["pid"] == 0),
                  key=lambda e: e["ts"])
    assert lane[0]["name"].startswith("profile: ") and lane[1]["name"].startswith("waiting")
    assert lane[2]["name"].startswith("trial 0")
    assert run.status()["strategy"]["chosen"] == rec["winner"]


def test_a_failing_advisor_fails_the_run_after_the_profile(tmp_path, monkeypatch):
    import commlab
    from commlab.lab.base.errors import LabError

    def boom(*a, **k):
        raise LabError("advisor: boom")
    monkeypatch.setattr(auto, "advise", boom)
    run = commlab.run({**BASE, "strategy": {"mode": "auto", "trials": 1, "trial_steps": 4}}, runs=tmp_path / "runs")
    assert run.state == "failed"
    assert "strategy auto: LabError: advisor: boom" in run.status()["error"]
    assert run.file(runfiles.AUTO_PROFILED).is_file() and not run.file(runfiles.AUTO_TRIALS).exists()
