"""bench/advisor.py: which cells run again before the grid's best is named, and what its report states."""
from bench import advisor as ab


def test_finalists_are_the_choice_ddp_and_the_cells_near_the_best():
    timed = {ab.DDP: [100.0, 104.0], "fp16": [50.0, 70.0], "int8": [54.0, 56.0], "topk": [56.0, 60.0],
             "dear": [80.0, 81.0], "out": [10.0, 10.0], ab.CHOICE: [90.0, 90.0]}
    pen = {k: (1.0, "benchmark") for k in timed}
    pen["topk"] = (1.05, "benchmark")  # 58 x 1.05 = 60.9: more than 1.1 x 55 = 60.5
    pen["out"] = (None, "no accuracy")  # a compressor without a penalty is never the grid's best
    # best grid score: int8 55 (fp16's median 60 is within 1.1 x 55; topk's 60.9 is not)
    assert ab.finalists_of(timed, pen) == [ab.DDP, "fp16", "int8", ab.CHOICE]


def test_the_choice_never_sets_the_bar():
    timed = {ab.DDP: [100.0], "fp16": [60.0], ab.CHOICE: [30.0]}
    pen = {k: (1.0, "benchmark") for k in timed}
    assert ab.finalists_of(timed, pen) == [ab.DDP, "fp16", ab.CHOICE]


def _setting(rounds, same=None, pen=None):
    pen = pen or {}
    rows = {k: {"rounds_ms": v, "penalty": pen.get(k, 1.0), "penalty_from": "benchmark"} for k, v in rounds.items()}
    return {"rows": rows, "choice_same_as": same, "advisor_cost_s": {"total": 1.0}}


def test_settle_names_the_best_and_the_choices_ratios_per_round():
    r = ab.settle(_setting({ab.DDP: [100.0, 110.0], "fp16": [50.0, 60.0], ab.CHOICE: [55.0, 55.0]},
                           pen={"fp16": 1.2}))
    assert r["best"] == "fp16"  # 55 x 1.2 = 66 is still below DDP's 105
    assert r["choice_vs_best"] == (55 / 60 + 55 / 72) / 2
    assert r["choice_vs_ddp"] == (0.55 + 0.5) / 2
    assert r["run300_s"] == 300 * 55 / 1e3 and r["cost_share"] == 1.0 / r["run300_s"]


def test_a_choice_that_is_a_grid_cell_is_one_configuration_measured_twice():
    """The choice is DDP's configuration: the two cells' rounds are averaged per round and stand for both, so
    the choice is DDP (ratio 1) rather than its measurement's noise (here 1.09); the rounds stay as measured."""
    rounds = {ab.DDP: [100.0, 104.0, 98.0], "fp16": [99.0, 120.0], ab.CHOICE: [109.0, 113.0, 107.0]}
    r = ab.settle(_setting(rounds, same=ab.DDP))
    assert r["choice_vs_ddp"] == 1.0 and r["rows"][ab.CHOICE]["iter_ms"] == r["rows"][ab.DDP]["iter_ms"] == 104.5
    assert r["rows"][ab.CHOICE]["rounds_ms"] == [109.0, 113.0, 107.0] and r["rows"][ab.CHOICE]["pooled_with"] == ab.DDP
    assert ab.one_configuration([1.0, 3.0, 7.0], [3.0]) == [2.0, 3.0, 7.0]
    assert ab.one_configuration([3.0], [1.0, 3.0, 7.0]) == [2.0, 3.0, 7.0]


def test_the_report_states_the_link_calibration_apart():
    import argparse
    args = argparse.Namespace(rounds=2, steps=14, trials=3, final_rounds=2,
                              link_calibration={"gbps": 1.0, "seconds": 14.2, "alpha_s": 1.07e-3, "beta": 8.3e-9,
                                                "small_mean_s": 2.18e-3, "path": "x"})
    text = ab.report([], args)
    assert "`commlab net check --gbps 1 --save`, 14.2 s" in text and "1070 us per ring step" in text
    assert "in no setting's advisor cost" in text
    assert "net check" not in ab.report([], argparse.Namespace(rounds=1, steps=14, trials=0, final_rounds=0))


def test_the_curve_calibration_keeps_every_candidates_curve_once(tmp_path):
    import argparse
    from commlab.lab.strategy import advisor
    from commlab.lab.strategy.perfmodel import whatif
    from commlab.lab.strategy.space import load_spec_dict
    from commlab.lab.rundir.store import RunStore
    store = RunStore(tmp_path / "runs")
    first = ab.calibrate_curves(store, lambda m: None)
    kept = whatif.machine_curves(store.root)
    assert first["measured"] == len(kept) >= 5 and first["seconds"] > 0
    spec = load_spec_dict(ab.base_spec("resnet", "modeled", 1.0, ab.RUN_STEPS))
    assert advisor.keep_curves(spec, store.root)[0] == 0  # every candidate's curve is the machine's now
    assert ab.calibrate_curves(store, lambda m: None)["measured"] == 0
    text = ab.report([], argparse.Namespace(rounds=1, steps=14, trials=3, final_rounds=0, curve_calibration=first))
    assert f"{first['measured']} curves" in text and "in no setting's advisor cost" in text


def test_time_to_accuracy_is_the_iteration_times_before_the_first_eval_at_the_target():
    class Run:
        def metric_rows(self):
            steps = [{"kind": "step", "step": s, "rank": r, "time_ms": 100.0 + r} for s in range(30) for r in (0, 1)]
            evals = [{"kind": "eval", "step": 10, "eval_acc": 0.5}, {"kind": "eval", "step": 20, "eval_acc": 0.92},
                     {"kind": "eval", "step": 30, "eval_acc": 0.95}]
            return steps + evals
    assert ab.time_to_accuracy(Run(), 0.9) == (20 * 0.101, 20)  # 20 steps done, the slower rank's 101 ms each
    assert ab.time_to_accuracy(Run(), 0.99) == (None, None)


def test_settle_and_report_the_choices_time_to_accuracy_against_the_grids_best():
    import argparse
    s = _setting({ab.DDP: [100.0, 100.0], "fp16": [50.0, 50.0], ab.CHOICE: [60.0, 60.0]})
    for k, t in ((ab.DDP, [30.0, 32.0]), ("fp16", [20.0, None]), (ab.CHOICE, [12.0, 14.0])):
        s["rows"][k].update(rounds_tta_s=t, predicted_ms=None)
    s.update(model="resnet", link="modeled", gbps=0.1, choice="x", target=0.9,
             advisor_cost_s={"total": 1.0, "profile": 0.5, "predict": 0.5, "trials": 0.0})
    r = ab.settle(s)
    assert r["tta_best"] == "fp16" and r["rows"]["fp16"]["tta_s"] == 20.0  # the median of the rounds that reached it
    assert r["choice_tta_vs_best"] == 13.0 / 20.0
    text = ab.report([r], argparse.Namespace(rounds=2, steps=300, trials=0, final_rounds=0))
    assert "time to 90% s (measured)" in text and "20.0 (1 of 2 rounds)" in text
    assert "the grid's best by time to accuracy fp16 20.0 s: 0.650x its time" in text
    s.pop("target")
    for v in s["rows"].values():
        v.pop("rounds_tta_s")
    assert "not measured in this run" in ab.report([ab.settle(s)], argparse.Namespace(rounds=1, steps=14, trials=0,
                                                                                   final_rounds=0))
