"""The advisor (commlab/lab/strategy/advisor.py, with space, predictions and trials): its strategy space, penalties and
their sources, ranking by predicted and measured time to accuracy, the winner written as a spec, and `commlab advise`'s one-line errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from commlab.engine import compressors
from commlab.engine.spec import SpecError
from commlab.lab.front import model_cli
from commlab.lab.strategy import advisor, auto, predictions, space, trials
from commlab.lab.strategy import penalty as pen
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import predict as pr
from commlab.lab.strategy.perfmodel import whatif
from commlab.lab.base.specs import load_spec

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "adv", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 300, "batch_size": 16,
        "eval_every": 0, "threads": 1, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}}


def spec(**kw):
    return load_spec(data={**BASE, **kw}).to_dict()


EVIDENCE = {"int8": 1.0, "topk": 1.0, "powersgd": 1.0}
"""Declared penalties: the lossy compressors have evidence, so their iteration times decide (without any, the
advisor never lets them outrank DDP or a cast: test_advisor_target.py)."""


def fake_profile(s, encode_per_byte=1e-10):
    """A profile with made-up compute (20 ms backward spread over the layers) and the same encode cost
    curve for every compressor, so the ranking follows from bytes on the link."""
    params = cal.param_list(s)
    layers = list(dict.fromkeys(n.rsplit(".", 1)[0] for n, _ in params))
    p = cal.Profile(model=s["model"]["name"], dataset=s["dataset"]["name"], batch_size=s["batch_size"],
                    source="made up in the test", params=params, forward_s=0.01, backward_s=0.02, optimizer_s=0.002,
                    layer_forward={l: 0.01 / len(layers) for l in layers},
                    layer_ready={l: 0.02 * (i + 1) / len(layers) for i, l in enumerate(layers)})
    for c in space.space(s):
        if c.compressor["name"] != "none":
            p.compressors[cal.compressor_key(c.compressor)] = {
                "encode": [1e-5, encode_per_byte], "between": [0.0, 0.0], "decode": [1e-5, encode_per_byte]}
    return p


def test_space_is_what_the_registry_can_do():
    s = spec()
    cands = space.space(s)
    names = {c.compressor["name"] for c in cands}
    assert {"none", "fp16", "topk", "powersgd"} <= names
    for c in cands:
        if c.excluded:  # a method the spec cannot take (DeMo with momentum): listed, not ranked
            continue
        comp = compressors.make(c.compressor["name"], error_feedback=c.compressor["error_feedback"],
                                **c.compressor["params"])
        if c.comm["mode"] == "dear":  # only compressors whose payload reduce-scatters
            assert comp.capabilities.shard_problem() is None, c.label
        space.with_strategy(s, c.strategy())  # every candidate is a valid spec
    assert any(c.comm["mode"] == "dear" and c.compressor["name"] == "none" for c in cands)
    assert not any(c.comm["mode"] == "dear" and c.compressor["name"] in ("topk", "powersgd") for c in cands)
    assert len({c.label for c in cands}) == len(cands)


def test_space_holds_dear_with_int8_and_mixed_candidates():
    """dear with a compressed reduce-scatter (int8, a shard codec) and mixed sections are searched; a mixed
    section goes to dear only when every compressor it may give a buffer reduce-scatters."""
    from commlab.engine.compressors.plan import parts
    s = spec()
    cands = space.space(s)
    labels = {c.label for c in cands}
    assert "int8, dear 25 MB" in labels and "fp16, dear 25 MB" in labels
    mixed = [c for c in cands if c.compressor.get("per_bucket")]
    assert {c.comm["mode"] for c in mixed} == {"wfbp", "dear"}
    for c in mixed:
        names = {p["name"] for p in parts(c.compressor)}
        assert (c.comm["mode"] == "dear") <= (names <= set(compressors.shardable())), c.label
        back = space.with_strategy(s, c.strategy())  # a valid spec that keeps its rules
        assert back["compressor"]["per_bucket"] == c.compressor["per_bucket"]
    assert any(c.label.startswith("mixed: none < 1 MB, powersgd r4") for c in mixed)
    assert not any("powersgd" in c.label and c.comm["mode"] == "dear" for c in cands)


def test_mixed_prediction_gives_each_bucket_its_own_compressor():
    """In the performance model, buckets under the rule's size send their raw bytes; the others PowerSGD's
    factors; dear with int8 sends a quarter of the bytes all-to-all."""
    from commlab.lab.strategy.perfmodel import predict as pr
    s = spec()
    prof = fake_profile(s)
    mixed = space.mixed(pen.comp_section("none"), pen.comp_section("powersgd", rank=4), below_mb=0.01)
    step = pr.build_step(prof, {**s, "compressor": mixed, "schedule": {"name": "layerwise"}}, 2)
    kinds = set()
    for b in step.buckets:
        sent = sum(r.nbytes for r in b.rounds)
        if b.raw_bytes < 0.01 * 2 ** 20:
            assert len(b.rounds) == 1 and sent == b.raw_bytes and b.encode == 0
            kinds.add("none")
        else:
            assert len(b.rounds) == 2 and sent < b.raw_bytes / 4
            kinds.add("powersgd")
    assert kinds == {"none", "powersgd"}
    # dear's rounds are what its exchange sends (driven or declared): int8's slices go all-to-all, the
    # payloads that keep the gradient's shape are reduce-scattered
    for name, op in (("int8", "all_to_all"), ("none", "reduce_scatter"), ("fp16", "reduce_scatter"),
                     ("bf16", "reduce_scatter")):
        dear = pr.build_step(prof, {**s, "compressor": pen.comp_section(name), "comm": {"mode": "dear"}}, 2)
        for b in dear.buckets:
            (r,) = b.rounds
            assert r.op == op, name
            if name == "int8":
                assert b.raw_bytes / 4 <= r.nbytes < b.raw_bytes / 3.8
            else:
                assert r.nbytes == (b.raw_bytes if name == "none" else b.raw_bytes / 2), name


def test_penalties_of_strategies_say_where_they_come_from(monkeypatch):
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    s = spec()
    strategies = {("int8", "dear"): {"acc": 0.985, "base_acc": 0.99, "steps": 300, "file": "s.json"},
                  ("fp16", "dear"): {"acc": 0.95, "base_acc": 0.99, "steps": 300, "file": "s.json"}}
    p, src = pen.penalty(s, pen.comp_section("int8"), cells=CELLS, mode="dear", strategies=strategies)
    assert p == 1.0 and src.startswith("benchmark") and "dear" in src
    p, src = pen.penalty(s, pen.comp_section("fp16"), cells=CELLS, mode="dear", strategies=strategies)
    assert p is None and "loses accuracy" in src
    # not measured in wfbp: int8's own default (lossy, nothing measured)
    p, src = pen.penalty(s, pen.comp_section("int8"), cells=CELLS, mode="wfbp", strategies=strategies)
    assert p == 1.25 and src.startswith("default")
    # a mixed section nothing measured: the worst of its parts
    mixed = space.mixed(pen.comp_section("none"), pen.comp_section("topk", True, ratio=0.01))
    p, src = pen.penalty(s, mixed, cells=CELLS, strategies={})
    assert p == 1.0 and src.startswith("parts") and "topk(ratio=0.01)+EF" in src
    mixed = space.mixed(pen.comp_section("none"), pen.comp_section("qsgd"))
    p, src = pen.penalty(s, mixed, cells=CELLS, strategies={})
    assert p == 1.25 and src.startswith("parts")
    mixed = space.mixed(pen.comp_section("none"), pen.comp_section("topk", False, ratio=0.01))
    p, src = pen.penalty(s, mixed, cells=CELLS, strategies={})
    assert p is None and src.startswith("parts") and "left out" in src
    # measured as a whole beats the parts' rule
    key = cal.compressor_key(mixed)
    p, src = pen.penalty(s, mixed, cells=CELLS, strategies={(key, "wfbp"): {"acc": 0.99, "base_acc": 0.99,
                                                                               "steps": 300, "file": "s.json"}})
    assert p == 1.0 and src.startswith("benchmark")


CELLS = {("none", False): {"acc": 0.99, "steps": 300, "file": "x.json"},
         ("topk", True): {"acc": 0.985, "steps": 300, "file": "x.json"},
         ("topk", False): {"acc": 0.90, "steps": 300, "file": "x.json"}}


def test_penalty_sources_in_order(monkeypatch):
    s = spec()
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    topk_ef = pen.comp_section("topk", True, ratio=0.01)
    p, src = pen.penalty(s, topk_ef, cells=CELLS)
    assert p == 1.0 and src.startswith("benchmark")
    p, src = pen.penalty(s, pen.comp_section("topk", False, ratio=0.01), cells=CELLS)
    assert p is None and "loses accuracy" in src
    # parameters other than the benchmark's: not the benchmark's figure
    assert pen.penalty_from_benchmark(pen.comp_section("topk", True, ratio=0.1), CELLS) is None
    p, src = pen.penalty(s, pen.comp_section("topk", True, ratio=0.1), cells=CELLS)
    assert p == 1.0 and src.startswith("default") and "1%" in src
    p, src = pen.penalty(s, pen.comp_section("qsgd"), cells=CELLS)
    assert p == 1.25 and src.startswith("default: nothing measured or declared") and "--penalty qsgd=X" in src
    p, src = pen.penalty(s, topk_ef, declared={"topk": 1.4}, cells=CELLS)
    assert p == 1.4 and "by the user" in src
    p, src = pen.penalty(s, pen.comp_section("fp16"), cells={})
    assert p == 1.0 and src.startswith("default")


class FakeRun:
    def __init__(self, rid, spec_, evals):
        self.id, self._spec, self._evals = rid, spec_, evals

    def spec_dict(self):
        return self._spec

    def metric_rows(self):
        return [{"kind": "eval", "step": s, "eval_acc": a} for s, a in self._evals]


def test_penalty_from_runs_is_steps_to_accuracy(monkeypatch):
    s = spec()
    topk = pen.comp_section("topk", True, ratio=0.01)
    none_run = FakeRun("a", s, [(49, 0.5), (99, 0.9), (149, 0.98), (199, 1.0)])
    topk_run = FakeRun("b", space.with_strategy(s, {"compressor": topk}), [(49, 0.3), (99, 0.7), (149, 0.9),
                                                                            (199, 0.98)])
    other = FakeRun("c", spec(batch_size=8), [(49, 0.99), (99, 0.99)])  # another batch: not comparable
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: [none_run, topk_run, other])
    p, src = pen.penalty_from_runs(s, topk, None)
    assert p == pytest.approx(199 / 149)  # target 97% of 1.0: none at 149, topk at 199
    assert src.startswith("measured") and "run b" in src and "run a" in src
    slow = FakeRun("d", topk_run.spec_dict(), [(49, 0.1), (99, 0.2)])
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: [none_run, slow])
    p, src = pen.penalty_from_runs(s, topk, None)
    assert p is None and "did not reach" in src
    monkeypatch.setattr(pen, "runs_of", lambda runs, **kw: [topk_run])
    assert pen.penalty_from_runs(s, topk, None) is None


def test_slow_link_picks_compression_fast_link_picks_ddp(monkeypatch):
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    s = spec()
    slow = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None, penalties=EVIDENCE)
    assert slow.winner.compressor["name"] in ("topk", "powersgd")
    assert slow.chosen_by == "predicted" and slow.cost_s["trials"] == 0
    ddp = next(c for c in slow.candidates if c.label == "none, bucket 25 MB, wfbp")
    assert slow.winner.predicted_score < ddp.predicted_score
    assert "DDP" in slow.reason and slow.winner.label in slow.reason
    # a fast link and expensive encoding: nothing beats sending the gradients as they are
    fast = advisor.advise(s, gbps=400, profile=fake_profile(s, encode_per_byte=1e-8), say=lambda m: None, penalties=EVIDENCE)
    assert fast.winner.compressor["name"] == "none"
    ranked = fast.ranked()
    for proven in (True, False):  # the candidates with evidence first, each group by predicted score
        scores = [c.predicted_score for c in ranked if c.predicted_score is not None and c.proven == proven]
        assert scores == sorted(scores)
    assert [c.proven for c in ranked if c.penalty is not None] == sorted(
        (c.proven for c in ranked if c.penalty is not None), reverse=True)


def test_left_out_compressor_never_wins(monkeypatch):
    s = spec()
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None,
                         penalties={"topk": 100, "powersgd": 100})
    assert adv.winner.compressor["name"] not in ("topk", "powersgd")


def test_mergecomp_prediction_includes_its_search(monkeypatch):
    s = spec()
    prof = fake_profile(s)
    link = predictions.link_of(prof, {"link": "modeled", "gbps": 0.05})[0]
    comp = pen.comp_section("topk", True, ratio=0.01)
    long = predictions.search_mergecomp(prof, {**s, "steps": 100000, "compressor": comp,
                                           "schedule": {"name": "mergecomp"}}, link, 2)
    short = predictions.search_mergecomp(prof, {**s, "steps": 20, "compressor": comp,
                                            "schedule": {"name": "mergecomp"}}, link, 2)
    one = pr.predict(prof, {**s, "compressor": comp, "schedule": {"name": "allinone"}}, 0.05, 2,
                            link=link).total * 1e3
    assert long[0] <= one + 1e-6  # the search tries one group first, so its best is no worse
    assert short[0] >= long[0]    # a short run pays for the search


def fake_session_runner(tmp_path, ms_of, sessions, disturbance=None):
    """A runner that 'runs' a trial session by writing each trial's metrics: ``ms_of(i, spec)`` per step;
    ``disturbance``: the session's status.json record of other processes' CPU."""
    from commlab.lab.rundir.store import Run

    def runner(sp, prepare=None):
        run = Run(tmp_path / f"session{len(sessions)}")
        run.path.mkdir()
        (run.path / "spec.json").write_text(json.dumps(sp))
        prepare(run)
        for i, d in enumerate(json.loads(run.file("trials.json").read_text())["dirs"]):
            t = json.loads((run.path / d / "spec.json").read_text())
            rows = [{"kind": "step", "step": k, "rank": r, "time_ms": ms_of(i, t)} for k in range(t["steps"])
                    for r in (0, 1)]
            (run.path / d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        run.set_status("done", **({"disturbance": disturbance} if disturbance else {}))
        sessions.append(run)
        return run
    return runner


def test_measured_trials_decide(monkeypatch, tmp_path):
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    monkeypatch.setattr(trials, "FAMILY_MARGIN", 1000.0)  # three families tried, however far apart predicted
    s = spec()
    sessions = []
    # the first tried is the slowest in reality, the second the fastest
    runner = fake_session_runner(tmp_path, lambda i, t: {0: 50.0, 1: 20.0}.get(i, 30.0), sessions)
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None, penalties=EVIDENCE, measure=True, trials=3,
                         runner=runner)
    assert len(sessions) == 1 and adv.chosen_by == "measured"  # one session holds every trial
    tried = [json.loads((sessions[0].path / d / "spec.json").read_text())
             for d in json.loads(sessions[0].file("trials.json").read_text())["dirs"]]
    assert len({t["compressor"]["name"] for t in tried[:3]}) == 3  # three compressor families
    assert all(t["network"] == {"link": "modeled", "gbps": 0.01, "latency_us": None, "cluster": None} for t in tried)
    assert all(t["steps"] == trials.TRIAL_WARMUP + advisor.TRIAL_STEPS and t["eval_every"] == 0
               and t["final_eval"] is False for t in tried)
    # PowerSGD compresses from the first trial step: the trial times its steady state
    assert all(t["compressor"]["params"]["start_iter"] == 0 for t in tried if t["compressor"]["name"] == "powersgd")
    by_run = {c.trial_run: c for c in adv.candidates if c.trial_run}
    assert adv.winner is by_run[f"{sessions[0].id}/trial-1"]  # 20 ms measured, against 50 and 30
    assert by_run[f"{sessions[0].id}/trial-0"].measured_ms == 50.0
    assert adv.winner.label in adv.reason and "measured" in adv.reason


def test_trials_hold_ddp_when_it_is_close(monkeypatch, tmp_path):
    """DDP is tried beside the top candidates when predicted within DDP_MARGIN of the best, so a choice
    measured slower than DDP cannot win; predicted far behind, it is not tried."""
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    s = spec()
    sessions = []
    ddp_ms = 10.0
    runner = fake_session_runner(
        tmp_path, lambda i, t: ddp_ms if t["compressor"]["name"] == "none" and not t["compressor"]["per_bucket"]
        and t["schedule"]["name"] == "bucket" and t["schedule"]["cap_mb"] == 25.0 and t["comm"]["mode"] == "wfbp"
        else 40.0, sessions)
    # a fast link: the candidates are close, DDP among them
    adv = advisor.advise(s, gbps=400, profile=fake_profile(s), say=lambda m: None, penalties=EVIDENCE, measure=True, trials=2,
                         runner=runner)
    assert space.is_ddp(adv.winner) and adv.chosen_by == "measured"
    tried = [c for c in adv.candidates if c.trial_run]
    assert sum(space.is_ddp(c) for c in tried) == 1
    # a slow link: DDP predicted far behind the best is not tried
    slow = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None, penalties=EVIDENCE, measure=True, trials=2,
                          runner=runner)
    ddp = next(c for c in slow.candidates if space.is_ddp(c))
    best = min(c.predicted_score for c in slow.candidates if c.predicted_score is not None)
    assert ddp.predicted_score > trials.DDP_MARGIN * best and ddp.trial_run is None
    assert len([c for c in slow.candidates if c.trial_run]) == 2


@pytest.mark.parametrize("other_ms,ddp_wins", [(9.8, True), (9.0, False)])
def test_a_measured_win_inside_the_hold_margin_goes_to_ddp(monkeypatch, tmp_path, other_ms, ddp_wins):
    """Measured 2% faster than DDP (inside DDP_HOLD, 3%) the other candidate loses to DDP, and the reason says
    why; 10% faster, it wins."""
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    s = spec()
    runner = fake_session_runner(tmp_path, lambda i, t: 10.0 if t["compressor"]["name"] == "none"
                                 and not t["compressor"]["per_bucket"] and t["schedule"]["name"] == "bucket"
                                 and t["schedule"]["cap_mb"] == 25.0 and t["comm"]["mode"] == "wfbp" else other_ms, [])
    adv = advisor.advise(s, gbps=400, profile=fake_profile(s), say=lambda m: None, penalties=EVIDENCE, measure=True, trials=2,
                         runner=runner)
    assert space.is_ddp(adv.winner) == ddp_wins and adv.chosen_by == "measured"
    assert adv.reason.startswith("DDP held") == ddp_wins, adv.reason


def test_winner_spec_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    s = spec()
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None)
    out = model_cli.write_spec(adv.winner_spec(), tmp_path / "best.yaml")
    back = load_spec(str(out)).to_dict()
    for k in ("compressor", "comm"):
        assert back[k] == {**back[k], **adv.winner.strategy()[k]}
    assert back["network"]["gbps"] == 0.01 and back["model"] == s["model"]


def test_network_for_rules():
    s = spec()
    with pytest.raises(SpecError, match="loopback"):
        predictions.network_for(s)
    assert predictions.network_for(s, 1.0) == {"link": "modeled", "gbps": 1.0, "latency_us": None}
    assert predictions.network_for(s, 1.0, "shaped")["link"] == "shaped"
    m = spec(network={"link": "modeled", "gbps": 2, "latency_us": 30})
    assert predictions.network_for(m) == m["network"]
    assert predictions.network_for(m, 5.0)["latency_us"] == 30
    with pytest.raises(SpecError, match="--gbps"):
        predictions.network_for(s, 0.0)
    with pytest.raises(SpecError, match="--penalty"):
        pen.parse_penalties(["topk"])


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("extra,needle", [
    ((), "network.link: the spec's link is loopback"),
    (("--gbps", "0"), "--gbps: must be in"),
    (("--gbps", "1", "--link", "loopback"), "--link"),
    (("--gbps", "1", "--penalty", "topk=abc"), "--penalty"),
    (("--gbps", "1", "--trials", "0"), "--trials"),
    (("--gbps", "1", "--workers", "0"), "--workers"),
])
def test_cli_bad_input_is_one_line(tmp_path, extra, needle):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(BASE))
    p = cli("advise", str(f), "--runs", str(tmp_path / "runs"), *extra, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr, p.stderr


def test_cli_measures_a_real_trial(tmp_path):
    """End to end: a profile measured now, cost curves, one real 2-rank trial on a modeled link."""
    f = tmp_path / "s.json"
    f.write_text(json.dumps({**BASE, "steps": 30}))
    p = cli("advise", str(f), "--gbps", "0.05", "--measure", "steps", "--trials", "1", "--trial-steps", "6",
            "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "best.yaml"), "--json-out",
            str(tmp_path / "adv.json"), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "winner (measured)" in p.stdout and "advisor cost" in p.stdout
    adv = json.loads((tmp_path / "adv.json").read_text())
    tried = [c for c in adv["candidates"] if c["trial_run"]]
    # the best-predicted candidate, and DDP when predicted close to it; the winner is the faster measured
    assert 1 <= len(tried) <= 2 and all(c["measured_ms"] > 0 for c in tried) and adv["winner"] in [
        c["label"] for c in tried]
    assert all(c["proven"] for c in tried)  # a trial of steps only is never of a candidate without evidence
    assert all(c["trial_run"].startswith(tried[0]["trial_run"].split("/")[0] + "/trial-") for c in tried)
    assert adv["cost_s"]["trials"] > 0 and adv["cost_s"]["total"] >= adv["cost_s"]["trials"]
    best = load_spec(str(tmp_path / "best.yaml")).to_dict()
    assert best["compressor"]["name"] == next(c for c in tried if c["label"] == adv["winner"])["compressor"]["name"]


# --------------------------------------------------------------------------- strategy: auto

AUTO_NET = {"link": "modeled", "gbps": 0.05}


@pytest.mark.parametrize("data,field", [
    ({"strategy": "auto"}, "strategy.mode"),  # loopback has no rate
    ({"strategy": "auto", "network": AUTO_NET, "compressor": "fp16"}, "strategy.mode"),
    ({"strategy": {"mode": "fixed", "trials": 2}}, "strategy.trials"),
    ({"strategy": {"mode": "auto", "trials": 0}, "network": AUTO_NET}, "strategy.trials"),
    ({"strategy": {"mode": "auto", "penalties": {"topk": "x"}}, "network": AUTO_NET}, "strategy.penalties.topk"),
    ({"strategy": {"mode": "fixed", "decided": True}}, "strategy.decided"),
    ({"strategy": {"mode": "sometimes"}}, "strategy.mode"),
])
def test_strategy_spec_errors(data, field):
    with pytest.raises(SpecError) as e:
        load_spec(data={**BASE, **data})
    assert e.value.path == field and "\n" not in str(e.value)


def test_strategy_spec_defaults_and_decided_round_trip():
    s = load_spec(data={**BASE, "strategy": "auto", "network": AUTO_NET}).to_dict()
    assert s["strategy"] == {"mode": "auto", "measure": True, "trials": 3, "trial_steps": 8, "penalties": {},
                             "decided": False}
    assert load_spec(data=BASE).to_dict()["strategy"]["mode"] == "fixed"
    chosen = space.with_strategy(s, {"compressor": pen.comp_section("fp16")})
    assert chosen["strategy"]["decided"] is True and chosen["compressor"]["name"] == "fp16"
    assert load_spec(data=chosen).to_dict() == chosen


def test_record_survives_a_tuner_writing_tuning_json(tmp_path):
    class R:
        def file(self, name):
            return tmp_path / name
    run = R()
    auto.write_record(run, {"winner": "x"})
    (tmp_path / "tuning.json").write_text(json.dumps({"schedule": "mergecomp"}))  # the engine's tuner, whole
    auto.keep_record(run, auto.read_record(run) or {"winner": "x"})
    info = json.loads((tmp_path / "tuning.json").read_text())
    assert info == {"schedule": "mergecomp", "advisor": {"winner": "x"}}


@pytest.fixture(scope="module")
def auto_root(tmp_path_factory):
    """One runs directory for the strategy auto runs below: the first pays the model's profiling run, the
    next finds the profile kept."""
    return tmp_path_factory.mktemp("auto") / "runs"


def test_strategy_auto_run_records_the_decision(auto_root):
    """A real run with strategy auto too short to hold its trials (1 + DDP if close, 2 + 4 steps each: 6 or 12
    steps against 5): a profile run, a trial session and the run itself, all in one slot."""
    import commlab
    root = auto_root
    run = commlab.run({**BASE, "steps": 5, "network": AUTO_NET,
                   "strategy": {"mode": "auto", "trials": 1, "trial_steps": 4}}, runs=root)
    assert run.state == "done", (run.status().get("error"), run.log_tail())
    spec_json = run.spec_dict()
    rec = json.loads(run.file("tuning.json").read_text())["advisor"]
    assert spec_json["strategy"]["decided"] is True and spec_json["name"] == "adv"
    assert rec["strategy"]["compressor"] == {**spec_json["compressor"]}
    assert rec["chosen_by"] == "measured" and len(rec["runs"]) == 2  # the profiling run and one trial session
    tried = [c for c in rec["candidates"] if c["trial_run"]]
    assert 1 <= len(tried) <= 2 and rec["winner"] in [c["label"] for c in tried]  # the top one, DDP if close
    assert not run.file("auto-trials.json").exists()  # (2 + 4) steps do not fit into 5
    profiled = commlab.get(rec["runs"][0], runs=root)  # timed steps only: no evaluation at its end
    assert profiled.spec_dict()["final_eval"] is False and profiled.metric_rows()
    assert not [r for r in profiled.metric_rows() if r.get("kind") == "eval"]
    assert [r for r in run.metric_rows() if r.get("kind") == "eval"]  # the run itself evaluates at its end
    session = commlab.get(rec["runs"][1], runs=root)
    assert session.state == "done" and session.status()["advisor_for"] == run.id
    trial_runs = trials.session_trials(session)
    assert [t.id for t in trial_runs] == [c["trial_run"] for c in tried] or \
        sorted(t.id for t in trial_runs) == sorted(c["trial_run"] for c in tried)
    assert all(t.spec_dict()["strategy"]["mode"] == "fixed" for t in trial_runs)
    assert run.status()["strategy"]["chosen"] == rec["winner"]
    # the trials' and the profiling run's steps are in the run's timeline, on a lane of their own
    from commlab.engine.timeline import LANES
    from commlab.lab.analysis.trace import chrome_trace
    lane = [e for e in run.timeline_events() if e.get("tid") == LANES["advisor"]]
    assert {e["args"]["run"] for e in lane} == {rec["runs"][0]} | {t.id for t in trial_runs}
    for t in trial_runs:
        assert sum(e["args"]["run"] == t.id for e in lane) == t.spec_dict()["steps"]
    first_step = min(e["ts"] for e in run.timeline_events() if e.get("cat") == "step")
    assert max(e["ts"] for e in lane) < first_step  # before the run's own steps
    names = {m["args"]["name"] for m in chrome_trace(run)["traceEvents"] if m.get("name") == "thread_name"}
    assert "advisor" in names


def test_strategy_auto_trials_in_the_run(auto_root):
    """A run with room for its trials trains them as its first steps: no trial session, the measurements
    and the choice in tuning.json, the choice in spec.json, the trial steps marked and on the timeline."""
    import commlab
    from commlab.engine.runfiles import AUTO_RESULT, TRIALS
    from commlab.engine.timeline import LANES
    root = auto_root
    # PowerSGD's declared penalty of 2 brings top-k within FAMILY_MARGIN of it (raw, top-k is predicted
    # 1.6-2.2x PowerSGD's time here, at the margin's edge), so two families are tried and run off; top-k's
    # penalty is declared too (without evidence for this model it would not be tried)
    run = commlab.run({**BASE, "steps": 30, "network": AUTO_NET, "strategy": {
        "mode": "auto", "trials": 2, "trial_steps": 4, "penalties": {"powersgd": 2.0, "topk": 1.0}}}, runs=root)
    assert run.state == "done", (run.status().get("error"), run.log_tail())
    rec = json.loads(run.file("tuning.json").read_text())["advisor"]
    res = json.loads(run.file(AUTO_RESULT).read_text())
    assert rec["chosen_by"] == "measured" and rec["winner"] == res["label"]
    # no trial session (the profile was kept from the test before, or one profiling run): the trials were
    # the run's own steps
    assert len(rec["runs"]) <= 1 and not any(commlab.get(r, runs=root).file(TRIALS).exists() for r in rec["runs"])
    tried = [c for c in rec["candidates"] if c["trial_run"]]
    assert [c["label"] for c in tried if c["label"] in {t["label"] for t in res["trials"]}] and \
        len(tried) == len(res["trials"]) >= 2
    assert all(c["trial_run"].startswith(f"{run.id} steps ") and c["measured_ms"] > 0 for c in tried)
    assert rec["cost_s"]["trials"] == pytest.approx(res["cost_s"])
    assert rec["cost_s"]["total"] == pytest.approx(rec["cost_s"]["profile"] + rec["cost_s"]["predict"]
                                                   + res["cost_s"])
    spec_json = run.spec_dict()
    assert spec_json["strategy"]["decided"] is True and spec_json["name"] == "adv"
    assert rec["strategy"]["compressor"]["name"] == spec_json["compressor"]["name"]
    assert run.status()["strategy"]["chosen"] == rec["winner"]
    steps = [m for m in run.metric_rows() if m.get("kind") == "step" and m["rank"] == 0]
    assert len(steps) == 30 and sum("trial" in m for m in steps) == res["decided_step"]
    lane = [e for e in run.timeline_events() if e.get("tid") == LANES["advisor"] and e.get("pid") == 0]
    visits = [e["args"] for e in lane if "label" in e["args"]]
    assert [v["label"] for v in visits if not v["runoff"]] == [t["label"] for t in res["trials"]]
    # the runoff (trials within 1.10x of the best train again, last first) and its steps in the record
    assert [v["trial"] for v in visits if v["runoff"]] == sorted(res["runoff"], reverse=True)
    for i, t in enumerate(res["trials"]):
        assert len(t["visits"]) == 1 + (i in res["runoff"])
        c = next(c for c in tried if c["label"] == t["label"])
        assert c["trial_run"] == f"{run.id} steps " + ", ".join(f"{a}-{b}" for a, b in t["visits"])


def test_multinode_refuses_auto(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({**BASE, "network": AUTO_NET, "strategy": "auto"}))
    p = cli("run", str(f), "--nnodes", "2", "--run-id", "x", "--master-addr", "127.0.0.1", "--runs",
            str(tmp_path / "runs"), cwd=tmp_path)
    assert p.returncode == 2 and "commlab advise" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_trial_picks_take_one_candidate_per_family():
    """fp16 and bf16 are one family (the same bytes through the same cast), as PowerSGD of any rank and a
    mixed section over PowerSGD are: three families tried are none, fp16 and PowerSGD, not both casts;
    DDP joins as the reference."""
    def cand(label, comp, ms, cap=1.0):
        c = space.Candidate(label, comp, {"name": "bucket", "cap_mb": cap}, {"mode": "wfbp"})
        c.predicted_ms, c.penalty, c.penalty_source = ms, 1.0, "declared by the user (a test's)"
        return c
    ranked = [cand("none", pen.comp_section("none"), 32.0), cand("bf16", pen.comp_section("bf16"), 32.5),
              cand("fp16", pen.comp_section("fp16"), 32.6),
              cand("mixed", space.mixed(pen.comp_section("none"), pen.comp_section("powersgd", rank=4)), 33.0),
              cand("psgd r1", pen.comp_section("powersgd", rank=1), 33.4), cand("topk", pen.comp_section("topk"), 34.0),
              cand("ddp", pen.comp_section("none"), 36.0, cap=25.0)]
    picks = trials.trial_picks(ranked, 3)
    assert [c.label for c in picks] == ["none", "bf16", "mixed", "ddp"]
    assert trials.family(pen.comp_section("bf16")) == trials.family(pen.comp_section("fp16")) != "none"


def test_shaped_links_use_the_labs_link_calibration(tmp_path):
    """A shaped link without a calibrated profile link is nominal (alpha 0) until `commlab net check --save`
    keeps a calibration in the lab; then it is that link scaled to the rate (the per-collective cost kept),
    and the source says so. A broken calibration file is a one-line error naming the field."""
    s = spec()
    prof = fake_profile(s)
    prof.link = None
    net = {"link": "shaped", "gbps": 0.1, "latency_us": None}
    nominal, why = predictions.link_of(prof, net, tmp_path)
    assert nominal.alpha == 0.0 and "commlab net check --gbps 1 --save" in why
    res = {"allreduce_world": 2, "target_gbps": 1.0, "allreduce_bytes": 1_000_000,
           "allreduce_median_s": 2 * 1e-3 + 1e6 * 8e-9, "allreduce_small_bytes": 4096,
           "allreduce_small_mean_s": 2 * 1e-3 + 4096 * 8e-9}
    path = whatif.save_shaped_link(tmp_path, res)
    assert path.parent == whatif.profile_dir(tmp_path)
    link, why = predictions.link_of(prof, net, tmp_path)
    assert link.alpha == pytest.approx(1e-3) and link.beta == pytest.approx(8e-8)  # 10x slower than at 1 Gbit/s
    assert "the lab's calibration" in why and "1000 us per ring step" in why
    assert predictions.link_of(prof, {"link": "modeled", "gbps": 0.1}, tmp_path)[0].alpha == 0.0  # modeled: exact
    path.write_text("{}")
    with pytest.raises(SpecError, match="network.link"):
        predictions.link_of(prof, net, tmp_path)


def test_more_groups_cost_more_on_a_calibrated_shaped_link(tmp_path):
    """The calibration's per-collective cost makes MergeComp's predicted search settle on no more groups
    than on the nominal link, and raises a many-bucket layout's prediction more than a one-bucket one's."""
    s = spec()
    prof = fake_profile(s)
    prof.link = None
    comp = pen.comp_section("powersgd", rank=1)
    net = {"link": "shaped", "gbps": 0.1, "latency_us": None}
    nominal = predictions.link_of(prof, net, tmp_path)[0]
    whatif.save_shaped_link(tmp_path, {"allreduce_world": 2, "target_gbps": 1.0, "allreduce_bytes": 1_000_000,
                                       "allreduce_median_s": 4e-3 + 8e-3, "allreduce_small_bytes": 4096,
                                       "allreduce_small_mean_s": 4e-3 + 4096 * 8e-9})
    calibrated = predictions.link_of(prof, net, tmp_path)[0]
    mc = {**s, "compressor": comp, "schedule": {"name": "mergecomp"}}
    assert predictions.search_mergecomp(prof, mc, calibrated, 2)[1] <= predictions.search_mergecomp(prof, mc, nominal, 2)[1]

    def ms(layout, link):
        return pr.predict(prof, {**s, "compressor": comp, "schedule": {"name": layout}}, 0.1, 2,
                                 link=link).total
    assert ms("layerwise", calibrated) - ms("layerwise", nominal) > ms("allinone", calibrated) - ms("allinone", nominal)


def test_families_predicted_far_behind_are_not_tried():
    """A family predicted more than FAMILY_MARGIN times the best's score is not tried (its steps would cost
    for nothing); DDP follows its own margin."""
    def cand(label, comp, ms, cap=1.0):
        c = space.Candidate(label, comp, {"name": "bucket", "cap_mb": cap}, {"mode": "wfbp"})
        c.predicted_ms, c.penalty, c.penalty_source = ms, 1.0, "declared by the user (a test's)"
        return c
    ranked = [cand("psgd", pen.comp_section("powersgd", rank=1), 32.0), cand("topk", pen.comp_section("topk"), 47.0),
              cand("int8", pen.comp_section("int8"), 243.0), cand("fp16", pen.comp_section("fp16"), 460.0),
              cand("ddp", pen.comp_section("none"), 900.0, cap=25.0)]
    assert [c.label for c in trials.trial_picks(ranked, 3)] == ["psgd", "topk"]
    assert [c.label for c in trials.trial_picks(ranked, 3, family_margin=10.0)] == ["psgd", "topk", "int8"]
    assert [c.label for c in trials.trial_picks(ranked, 3, ddp_margin=30.0)] == ["psgd", "topk", "ddp"]


DISTURBED = {"threshold": 0.1, "cpus": 2, "samples": 20, "seconds": 20.0, "other_cpu": 0.64, "other_cores": 1.28,
             "own_cores": 0.7, "own_cpu_s": 14.0, "peak_other_cpu": 0.9, "timed_other_cpu": 0.6, "disturbed": True,
             "final": True}
QUIET = {**DISTURBED, "other_cpu": 0.02, "other_cores": 0.04, "peak_other_cpu": 0.05, "timed_other_cpu": 0.02,
         "disturbed": False}


@pytest.mark.parametrize("record", [DISTURBED, QUIET, None])
def test_a_disturbed_trial_session_is_said_in_table_reason_and_json(monkeypatch, tmp_path, record):
    """Trials timed while other processes took 64% of the CPU: the measured winner's reason starts with "timings
    disturbed by other processes: not results", the table has a DISTURBED line, the JSON the record; a quiet
    session (or one with no figure) says nothing of it."""
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    s = spec()
    sessions, said = [], []
    runner = fake_session_runner(tmp_path, lambda i, t: 10.0 + i, sessions, disturbance=record)
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=said.append, penalties=EVIDENCE, measure=True, trials=2,
                         runner=runner)
    assert adv.chosen_by == "measured"
    doc = json.loads(json.dumps(adv.as_dict()))
    table = advisor.format_table(adv)
    if record is DISTURBED:
        assert adv.reason.startswith("timings disturbed by other processes: not results (trial session "
                                     f"{sessions[0].id}: other processes used 64% of the CPU"), adv.reason
        assert adv.winner.label in adv.reason  # the reason still says what won, after the flag
        assert table[-1].startswith(f"DISTURBED: the trial session: run {sessions[0].id} was disturbed")
        assert doc["disturbed"] and doc["disturbance"]["trials"]["disturbed"] is True
        assert doc["disturbance"]["trials"]["other_cpu"] == 0.64
        assert any("trial session" in line and "not results" in line for line in said)
    else:
        assert "disturbed" not in adv.reason and not any(line.startswith("DISTURBED") for line in table)
        assert doc["disturbed"] == []
        assert doc["disturbance"]["trials"]["disturbed"] is (False if record else None)


def test_a_profile_from_a_disturbed_run_is_said(monkeypatch):
    """Predictions whose compute came from a disturbed run say so in the reason, the table and the JSON."""
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    s = spec()
    prof = fake_profile(s)
    prof.disturbance = {"run": "r1", "disturbed": True, "other_cpu": 0.41,
                        "text": "yes: other processes used 41% of the CPU (0.82 of 2 cores) during the run"}
    adv = advisor.advise(s, gbps=0.01, profile=prof, say=lambda m: None)
    assert adv.reason.startswith("predictions from compute timed in a disturbed run, not a result (run r1: other "
                                 "processes used 41% of the CPU"), adv.reason
    assert advisor.format_table(adv)[-1].startswith("DISTURBED: the compute profile's run: run r1 was disturbed")
    assert adv.as_dict()["disturbance"]["profile"]["run"] == "r1"


def test_ddp_left_out_of_the_trials_is_said(monkeypatch, tmp_path):
    """DDP predicted more than DDP_MARGIN behind the best is not tried; the output says so and why (its row's
    note, the JSON's ddp_not_tried) and the reason compares the winner with DDP's prediction; tried, nothing is
    said."""
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    s = spec()
    runner = fake_session_runner(tmp_path, lambda i, t: 10.0 + i, [])
    slow = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None, penalties=EVIDENCE, measure=True, trials=2,
                          runner=runner)
    ddp = next(c for c in slow.candidates if space.is_ddp(c))
    assert ddp.trial_run is None
    assert slow.ddp_not_tried.startswith("DDP not tried: predicted ") and "1.5x" in slow.ddp_not_tried
    assert slow.ddp_not_tried in ddp.note and slow.as_dict()["ddp_not_tried"] == slow.ddp_not_tried
    assert "DDP not tried: predicted" in slow.reason and "the winner's prediction" in slow.reason, slow.reason
    runner = fake_session_runner(tmp_path / "fast", lambda i, t: 10.0 + i, [])
    (tmp_path / "fast").mkdir()
    fast = advisor.advise(s, gbps=400, profile=fake_profile(s), say=lambda m: None, penalties=EVIDENCE, measure=True, trials=2,
                          runner=runner)
    assert any(space.is_ddp(c) and c.trial_run for c in fast.candidates)
    assert fast.ddp_not_tried == "" and "not tried" not in fast.reason


def test_default_penalty_says_default_in_the_table(monkeypatch):
    """A lossy compressor nothing measured and nobody declared takes the advisor's 1.25: its PENALTY FROM
    says ``default``; declared by the user, ``declared by the user``."""
    monkeypatch.setattr(pen, "penalty_from_runs", lambda *a: None)
    monkeypatch.setattr(pen, "benchmark_cells", lambda: {})
    monkeypatch.setattr(pen, "strategy_cells", lambda: {})
    monkeypatch.setattr(advisor, "benchmark_cells", lambda: {})
    monkeypatch.setattr(advisor, "strategy_cells", lambda: {})
    s = spec()
    adv = advisor.advise(s, gbps=0.01, profile=fake_profile(s), say=lambda m: None, penalties={"topk": 1.3})
    int8 = next(line for line in advisor.format_table(adv) if " int8, " in line)
    assert "  default  " in int8 and " 1.25 " in int8 and int8.endswith("unproven here: a guess"), int8
    topk = next(line for line in advisor.format_table(adv) if " topk " in line)
    assert "  declared by the user (topk=1.3)  " in topk and topk.endswith("you declared it"), topk


def test_matching_run_prefers_an_undisturbed_run(tmp_path, monkeypatch):
    """Calibration takes the latest undisturbed run of the model over a later disturbed one (sync or not),
    and a profile from a disturbed run (the only one) carries its record and says so."""
    from commlab.lab.rundir.store import Run

    class R(Run):
        def __init__(self, rid, mode, record):
            super().__init__(tmp_path / rid)
            self.path.mkdir()
            self._spec = {**spec(), "comm": {"mode": mode}}
            self.set_status("done", **({"disturbance": record} if record else {}))

        def spec_dict(self):
            return self._spec
    quiet_wfbp, disturbed_sync = R("a-quiet", "wfbp", QUIET), R("b-disturbed", "sync", DISTURBED)
    monkeypatch.setattr(whatif, "runs_of", lambda runs, **kw: [quiet_wfbp, disturbed_sync])
    assert whatif.matching_run(spec(), tmp_path) is quiet_wfbp
    monkeypatch.setattr(whatif, "runs_of", lambda runs, **kw: [disturbed_sync])
    assert whatif.matching_run(spec(), tmp_path) is disturbed_sync
    d = cal.disturbance_of(disturbed_sync)
    assert d["disturbed"] is True and d["run"] == "b-disturbed" and d["other_cpu"] == 0.64
    note = cal.disturbed_note(d)
    assert note.startswith("run b-disturbed was disturbed: other processes used 64% of the CPU")
    assert note.endswith("timings disturbed by other processes: not results")
    assert cal.disturbed_note(cal.disturbance_of(quiet_wfbp)) == ""
    # the prediction's sources say it, and a saved profile keeps the record
    prof = fake_profile(spec())
    prof.disturbance = d
    from commlab.lab.strategy.perfmodel import ondevice
    compute = next(r for r in ondevice.source_rows(prof, spec()) if r["part"] == "compute")
    assert "DISTURBED: run b-disturbed was disturbed" in compute["source"]
    prof.save(tmp_path / "p.json")
    assert cal.Profile.load(tmp_path / "p.json").disturbance == d
    # a saved profile from a disturbed run gives way to a quiet run of the model, its cost curves kept
    saved = whatif.profile_dir(tmp_path) / f"{cal.spec_key(spec())}.json"
    prof.save(saved)
    monkeypatch.setattr(whatif, "runs_of", lambda runs, **kw: [quiet_wfbp, disturbed_sync])
    monkeypatch.setattr(cal, "from_run", lambda run: cal.Profile(model="mlp", dataset="digits", batch_size=16,
                                                                 source=f"run {run.id}", disturbance=cal.disturbance_of(run)))
    said = []
    again = whatif.known_profile(spec(), tmp_path, said.append)
    assert again.source == "run a-quiet" and again.compressors == prof.compressors and not again.disturbance["disturbed"]
    assert "came from a disturbed run" in said[-1]
    monkeypatch.setattr(whatif, "runs_of", lambda runs, **kw: [disturbed_sync])  # no quiet run: the saved one
    assert whatif.known_profile(spec(), tmp_path).source == prof.source
