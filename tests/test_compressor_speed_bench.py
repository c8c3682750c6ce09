"""bench/compressor_speed.py: its figures are the ones it measured, its verdicts follow the GPU targets.
(No timing is asserted: the bench runs once on tiny sizes and its bookkeeping is checked.)"""
import json

import pytest
import torch

from bench import compressor_speed as cs


def test_cpu_run_writes_figures_for_every_compressor_and_size(tmp_path):
    out = tmp_path / "speed"
    cs.main(["--sizes", "1000,200000", "--repeat", "1", "--only", "fp16,topk,powersgd", "--grace", "none",
             "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["results"]) == {"fp16", "topk", "powersgd"}
    for name, per in data["results"].items():
        assert set(per) == {"1000", "200000"}
        for n, r in per.items():
            assert r["seconds"] > 0 and r["gbps"] == pytest.approx(int(n) * 4 / r["seconds"] / 1e9)
            assert r["moved_gbps"] == pytest.approx((int(n) * 4 + r["payload_bytes"]) / r["seconds"] / 1e9)
    assert data["results"]["fp16"]["200000"]["payload_bytes"] == 200000 * 2  # half of the input's bytes
    assert data["results"]["topk"]["200000"]["ratio"] > 10
    md = out.with_suffix(".md").read_text()
    assert "| fp16 |" in md and "GRACE: not asked for" in md


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit, match="--only: unknown compressor 'nope'"):
        cs.main(["--only", "nope", "--grace", "none"])
    with pytest.raises(SystemExit, match="--device"):
        cs.main(["--device", "tpu", "--grace", "none"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="sees no GPU"):
            cs.main(["--device", "cuda", "--grace", "none"])


def test_judge_applies_each_gpu_target():
    peak = 1e12
    res = {
        "fp16": {1000: {"seconds": 20e-6}, 25_000_000: {"seconds": 1e-3, "moved_gbps": 300.0, "speedup": 4.0}},
        "signsgd": {1000: {"seconds": 45e-6}, 25_000_000: {"seconds": 1e-3, "moved_gbps": 200.0, "speedup": 2.0}},
        "topk": {1000: {"seconds": 10e-6}, 25_000_000: {"seconds": 1e-3, "moved_gbps": 10.0}},  # no GRACE figure
    }
    v = cs.judge(res, [1000, 25_000_000], peak)
    assert {(r[0], r[3]) for r in v["fixed_us"]} == {("fp16", True), ("signsgd", False), ("topk", True)}
    assert {(r[0], r[3]) for r in v["vs_grace"]} == {("fp16", True), ("signsgd", False)}
    # topk is not an elementwise codec: no bandwidth target; 30% and 20% of 1 TB/s against 25%
    assert {(r[0], r[3]) for r in v["bandwidth"]} == {("fp16", True), ("signsgd", False)}
    lines = cs.verdict_lines(v)
    assert any("2/3 met: missed signsgd at 1K (45.0 µs)" in l for l in lines)


def test_a_graphed_variant_is_judged_as_its_own_row():
    res = {"signsgd": {1000: {"seconds": 45e-6, "graphed": {"seconds": 25e-6}, "grace": {"seconds": 50e-6}, "speedup": 1.1},
                       1_000_000: {"seconds": 80e-6, "speedup": 0.9, "moved_gbps": 1.0, "ratio": 32.0, "grace": {"seconds": 72e-6},
                                   "graphed": {"seconds": 20e-6, "speedup": 3.6}}}}
    res["signsgd"][25_000_000] = {"seconds": 1e-3, "moved_gbps": 103.0, "payload_bytes": 3_125_000,
                                  "graphed": {"seconds": 0.4e-3}}
    v = cs.judge(res, [1000, 1_000_000, 25_000_000], 1e12)
    # 103 MB in 1 ms is 10.3% of 1 TB/s; in 0.4 ms 25.8%
    assert [(r[0], round(r[2], 3), r[3]) for r in v["bandwidth"]] == [("signsgd", 0.103, False),
                                                                      ("signsgd graphed", 0.258, True)]
    assert {(r[0], r[3]) for r in v["fixed_us"]} == {("signsgd", False), ("signsgd graphed", True)}
    assert {(r[0], r[3]) for r in v["vs_grace"]} == {("signsgd", False), ("signsgd graphed", True)}
    md = cs.table(res, [1000, 1_000_000], True, 1e12, True)
    assert "| 1K graphed µs |" in md and "| 25.0 |" in md and "| 200.00 |" in md  # 4 MB in 20 µs
