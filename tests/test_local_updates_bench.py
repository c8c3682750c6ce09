"""bench/local_updates.py, the race of the methods against per-step compression: its --quick path end to end on a
modeled link (no root: the engine's alpha-beta delays on loopback), and its analysis on made-up step times."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import local_updates as lu

ROOT = Path(__file__).resolve().parents[1]


def test_quick_runs_every_variant_on_a_modeled_link_and_writes_the_table(tmp_path):
    out = tmp_path / "lu"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "local_updates.py"), "--quick", "--link", "modeled",
                        "--steps", "8", "--json", str(out.with_suffix(".json")), "--md", str(out.with_suffix(".md")),
                        "--runs", str(tmp_path / "runs")],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    (s,) = doc["settings"]
    assert (s["gbps"], s["world"], s["shaped"]) == (0.1, 2, False)
    a = s["analysis"]
    ran = set(a["variants"])
    assert {"ddp", "powersgd", *lu.METHODS} <= ran and ran <= set(lu.VARIANTS)
    assert s["best"]["label"] and s["best"]["strategy"]["method"]["name"] == "none"  # the advisor's per-step choice
    for n, r in a["variants"].items():
        assert r["steps"] == 8 and r["diverged_at"] is None, n
        assert [x[0] for x in r["acc"]] == [4, 8], n  # evaluated at the block ends
        assert r["mean_ms"] > 0 and (r["bytes_per_step"] > 0), n
    assert a["variants"]["ddp"]["vs_ddp"] in (1.0, None)
    # each method sends less per step than DDP
    assert all(a["variants"][m]["bytes_per_step"] < a["variants"]["ddp"]["bytes_per_step"] for m in lu.METHODS)
    md = out.with_suffix(".md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| variant"))
    assert [c.strip() for c in header.strip("|").split("|")] == lu.COLUMNS
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    assert len(rows) == len(a["variants"]) and "A smoke test (--quick)" in md
    assert "--quick" in md and "--link modeled" in md


def raw(times, accs, bytes_, shaped=False):
    """A worker's record for two ranks: rank 1 slower by 1 ms per step."""
    ranks = []
    for extra in (0.0, 0.001):
        ranks.append({n: {"t": [t + extra for t in times[n]], "bytes": bytes_[n], "tx": [], "acc": accs[n],
                          "diverged": None} for n in times})
    return {"ranks": ranks, "shaped": shaped}


def test_analysis_times_bytes_and_ratios_to_the_target():
    times = {"ddp": [0.5] * 16, "powersgd": [0.2] * 16, "best": [0.25] * 16,
             "local_sgd": [0.1, 0.1, 0.1, 0.5] * 4, "diloco": [0.1, 0.1, 0.1, 0.5] * 4}
    accs = {"ddp": [[8, 0.6], [16, 0.8]], "powersgd": [[8, 0.5], [16, 0.75]], "best": [[8, 0.4], [16, 0.65]],
            "local_sgd": [[8, 0.72], [16, 0.79]], "diloco": [[8, 0.5], [16, 0.71]]}
    bytes_ = {"ddp": [100] * 16, "powersgd": [10] * 16, "best": [20] * 16, "local_sgd": [0, 0, 0, 100] * 4,
              "diloco": [0, 0, 0, 100] * 4}
    a = lu.analyse(raw(times, accs, bytes_), 0.7, {})
    v = a["variants"]
    # the slower rank's times up to the first evaluation at 70%: DDP at 16 (16 x 0.501), powersgd at 16,
    # local SGD at 8 (6 x 0.101 + 2 x 0.501)
    assert v["ddp"]["time_to_target_s"] == pytest.approx(16 * 0.501)
    assert v["local_sgd"]["time_to_target_s"] == pytest.approx(6 * 0.101 + 2 * 0.501)
    assert v["local_sgd"]["bytes_to_target"] == 200 and v["local_sgd"]["steps_to_target"] == 8
    assert v["best"]["time_to_target_s"] is None  # 65%: never
    assert a["best_compressor"] == "powersgd" and a["best_method"] == "local_sgd"
    assert v["local_sgd"]["vs_ddp"] == pytest.approx(16 * 0.501 / 1.608)
    assert v["local_sgd"]["vs_best_compressor"] == pytest.approx(16 * 0.201 / 1.608)
    ver = a["verdict"]
    assert ver["vs_ddp"]["met"] and ver["vs_compressor"]["met"]  # 4.99x and 2.0x
    assert ver["accuracy"]["gap_points"] == pytest.approx(1.0) and ver["accuracy"]["met"]  # 80% vs 79%
    assert ver["any_method_pays"]
    text = lu.table(a, shaped=False)
    assert "local_sgd (best method)" in text and "powersgd (best per-step compressor)" in text
    assert "not in 16 steps" in text  # best never reached it


def test_a_method_that_loses_accuracy_misses_the_target_and_the_report_says_so():
    times = {"ddp": [0.5] * 8, "local_sgd": [0.1] * 8}
    accs = {"ddp": [[8, 0.9]], "local_sgd": [[8, 0.85]]}
    a = lu.analyse(raw(times, accs, {"ddp": [1] * 8, "local_sgd": [0] * 8}), 0.7, {"ddp": "DDP"})
    assert a["verdict"]["accuracy"]["met"] is False and a["verdict"]["vs_compressor"]["value"] is None
    setting = {"analysis": a, "gbps": 0.1, "world": 2, "shaped": False, "model": "m", "best": None, "notes": [],
               "steps": 8, "block": 8, "eval_every": 8, "eval_size": 10, "wall_s": 60.0, "cluster": None}
    text = lu.report_setting(setting)
    assert "5.0 points below DDP's (target: at most 1 below: MISSED)" in text
    assert "no per-step compressor reached the target" in text
    fast = lu.report_setting({**setting, "gbps": 10.0})
    assert "does any method pay at 10 Gbit/s? yes: local_sgd" in fast and "would miss" in fast


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(ValueError, match="--param: expected VARIANT.KEY=VALUE"):
        lu.parse_params(["diloco=3"])
    assert lu.parse_params(["diloco.H=16", "demo.lr=0.003"]) == {"diloco": {"H": 16}, "demo": {"lr": 0.003}}
    for argv, needle in ((["--variants", "ddp,nope"], "--variants: unknown nope"),
                         (["--variants", "local_sgd"], "ddp is the reference"),
                         (["--block", "6", "--H", "4"], "--block: must be a multiple of --H"),
                         (["--gbps", "0"], "--gbps")):
        with pytest.raises(SystemExit) as e:
            lu.main(argv + ["--link", "modeled"])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_block_that_cuts_an_exchange_in_flight_is_refused():
    """Streaming DiLoCo's fragment issued at the last step of a block would be in flight during the next
    variant's block: refused before anything runs."""
    import argparse
    args = argparse.Namespace(block=8, H=8, steps=16, eval_every=8, model="cnn", data="digits", batch=16, lr=0.05,
                              link="modeled", demo_lr=0.001, opt="sgd", slow=None, muon_lr=0.02, adam_lr=0.002)
    base = lu.base_spec(args, 0.1, 2)
    vs = lu.variant_specs(["ddp", "streaming_diloco"], base, None,
                          {"streaming_diloco": {"tau": 4, "fragments": 2}}, args)["variants"]
    with pytest.raises(ValueError, match="--block: streaming_diloco's exchange issued at step 7"):
        lu.check_blocks(vs, args)
    ok = lu.variant_specs(["ddp", "streaming_diloco"], base, None, {}, args)["variants"]
    lu.check_blocks(ok, args)  # tau 1 of H 8 in 2 fragments: every fragment lands within its block


def test_a_wide_area_setting_is_a_checked_cluster_spec_with_the_papers_targets():
    """--cluster three_continents --slow 3:0.5 at 4 ranks: every variant a spec the lab accepts on the modeled
    cluster (rank 3 at half speed, the preset's links), MuLoCo with Muon and DES-LOC with AdamW; the advisor plans
    the per-step strategy for the cluster's worst link; the verdict holds the method to 10x DDP, 2x the best
    per-step compressor and 100x fewer bytes, and says so."""
    import argparse

    from commlab.engine import cluster
    args = argparse.Namespace(block=8, H=8, steps=16, eval_every=8, model="transformer", data="text", batch=8,
                              lr=0.002, link="shaped", demo_lr=0.001, opt="adamw", slow="3:0.5", muon_lr=0.02,
                              adam_lr=0.002)
    base = lu.base_spec(args, None, 4, "three_continents")
    ws = base["network"]["cluster"]["workers"]
    preset = cluster.resolve("three_continents", 4, "modeled")["workers"]
    assert base["network"]["link"] == "modeled" and [w["speed"] for w in ws] == [1.0, 1.0, 1.0, 0.5]
    assert [w["gbps_up"] for w in ws] == [w["gbps_up"] for w in preset]
    vs = lu.variant_specs(["ddp", "diloco", "sparseloco", "muloco", "desloc"], base, None, {}, args)["variants"]
    assert vs["muloco"]["spec"]["optimizer"]["name"] == "muon" and vs["desloc"]["spec"]["optimizer"]["name"] == "adamw"
    assert all(v["spec"]["network"]["cluster"]["workers"] == ws for v in vs.values())
    lu.check_blocks(vs, args)
    worst = lu.bottleneck(base["network"])
    assert worst["gbps"] == min(min(w["gbps_up"], w["gbps_down"]) for w in ws)
    d = sorted((w["delay_ms"] for w in ws), reverse=True)
    assert worst["latency_us"] == 1e3 * (d[0] + d[1])
    with pytest.raises(ValueError, match="--slow: rank must be in 0..3"):
        lu.cluster_section("three_continents", 4, "4:0.5")
    with pytest.raises(ValueError, match="--slow: expected RANK:SPEED"):
        lu.cluster_section("three_continents", 4, "fast")
    # the targets across three continents: 12x DDP and 3x the compressor, but only 50x fewer bytes
    times = {"ddp": [1.2] * 8, "powersgd": [0.3] * 8, "diloco": [0.1] * 8}
    accs = {"ddp": [[8, 0.5]], "powersgd": [[8, 0.5]], "diloco": [[8, 0.5]]}
    bytes_ = {"ddp": [100] * 8, "powersgd": [10] * 8, "diloco": [2] * 8}
    a = lu.analyse(raw(times, accs, bytes_), 0.4, {}, wan=True)
    v = a["verdict"]
    assert v["vs_ddp"]["target"] == 10 and v["vs_ddp"]["met"] and v["vs_compressor"]["target"] == 2
    assert v["bytes_fewer"]["value"] == pytest.approx(50) and not v["bytes_fewer"]["met"]
    setting = {"analysis": a, "gbps": None, "world": 4, "shaped": False, "model": "m", "best": None, "notes": [],
               "steps": 8, "block": 8, "eval_every": 8, "eval_size": 10, "wall_s": 60.0, "cluster": None,
               "wide_area": {"preset": "three_continents", "text": "cluster three_continents of 4 workers"}}
    text = lu.report_setting(setting)
    assert "cluster three_continents" in text and "(target >= 10: met)" in text
    assert "50x fewer bytes to the target than DDP (target >= 100: MISSED)" in text


def test_a_saved_result_is_analysed_again_at_another_target():
    """--rereport FILE --target X: the saved per-step times, bytes and evaluations give what analysing the run
    at X would have given (the ratios, the best method), and the report says the new target."""
    times = {"ddp": [0.5] * 16, "powersgd": [0.2] * 16, "diloco": [0.1, 0.1, 0.1, 0.5] * 4}
    accs = {"ddp": [[8, 0.6], [16, 0.8]], "powersgd": [[8, 0.5], [16, 0.75]], "diloco": [[8, 0.72], [16, 0.79]]}
    bytes_ = {"ddp": [100] * 16, "powersgd": [10] * 16, "diloco": [0, 0, 0, 100] * 4}
    r = raw(times, accs, bytes_)
    saved = {"analysis": lu.analyse(r, 0.7, {}), "gbps": 0.1, "world": 2, "shaped": False}
    again = lu.retarget(saved, 0.55)["analysis"]
    direct = lu.analyse(r, 0.55, {})
    for n in times:
        for k in ("time_to_target_s", "bytes_to_target", "steps_to_target", "vs_ddp", "vs_best_compressor"):
            assert again["variants"][n][k] == direct["variants"][n][k], (n, k)
    assert again["best_method"] == direct["best_method"] == "diloco" and again["target_acc"] == 0.55
    assert saved["analysis"]["variants"]["ddp"]["steps_to_target"] == 16  # at 0.7: a different answer
    assert "bytes_note" not in lu.retarget(saved, 0.55)
