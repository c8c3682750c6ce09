"""End to end through the CLI: real torchrun jobs, run directories, exit codes, traces."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commlab.engine.runlog import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
BASE = {"name": "t", "model": "cnn", "dataset": "digits", "world_size": 2, "steps": 12, "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "eval_every": 6, "threads": 1}


def commlab(*args, runs, timeout=240):
    env = dict(os.environ, COMMLAB_RUNS=str(runs))
    return subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def write_spec(tmp_path, **over):
    spec = json.loads(json.dumps(BASE))
    spec.update(over)
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(spec))
    return p


def only_run(runs):
    dirs = [d for d in Path(runs).iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert len(dirs) == 1, dirs
    return dirs[0]


@pytest.fixture(scope="module")
def wfbp_run(tmp_path_factory):
    """One layer-wise wfbp run shared by the checks below (a real 2-rank job)."""
    tmp = tmp_path_factory.mktemp("wfbp")
    runs = tmp / "runs"
    spec = write_spec(tmp, schedule={"name": "layerwise"}, comm={"mode": "wfbp"})
    r = commlab("run", str(spec), "--quiet", runs=runs)
    return r, only_run(runs), runs


def test_run_succeeds_and_prints_summary(wfbp_run):
    r, run_dir, _ = wfbp_run
    assert r.returncode == 0, r.stdout + r.stderr
    assert run_dir.name in r.stdout and "iteration" in r.stdout and "accuracy" in r.stdout
    st = json.loads((run_dir / "status.json").read_text())
    assert st["state"] == "done" and st["ended"] >= st["started"]
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["compressor"] == {"name": "none", "error_feedback": False, "params": {},
                                  "per_bucket": []}  # fully defaulted
    m = read_jsonl(str(run_dir / "metrics.jsonl"))
    steps = [x for x in m if x["kind"] == "step"]
    assert sorted((x["step"], x["rank"]) for x in steps) == [(s, r) for s in range(12) for r in range(2)]
    assert all(x["bytes_sent"] == x["bytes_raw"] > 0 for x in steps)
    evals = [x for x in m if x["kind"] == "eval"]
    assert [e["step"] for e in evals] == [6, 12] and all(0 <= e["eval_acc"] <= 1 for e in evals)
    assert "rank 0" in (run_dir / "log.txt").read_text()


def test_timeline_well_formed(wfbp_run):
    _, run_dir, _ = wfbp_run
    layout = json.loads((run_dir / "layout.json").read_text())
    nb = len(layout["buckets"])
    assert nb == layout["tensors"] == 8  # layerwise
    for rank in range(2):
        ev = read_jsonl(str(run_dir / f"timeline-rank{rank}.jsonl"))
        assert ev and all(e["ph"] == "X" and e["pid"] == rank for e in ev)
        assert all(e["dur"] >= 0 for e in ev), [e for e in ev if e["dur"] < 0][:3]
        steps = sorted((e for e in ev if e["cat"] == "step"), key=lambda e: e["ts"])
        assert len(steps) == 12
        comm = [e for e in ev if e["cat"] == "comm"]
        # every bucket has a communicate span in every step
        for s in steps:
            inside = {e["args"]["bucket"] for e in comm if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]}
            assert inside == set(range(nb)), (s["name"], inside)
        # per-layer forward and backward spans exist for each layer with parameters
        layers = {e["name"] for e in ev if e["cat"] == "forward" and "layer" in e.get("args", {})}
        assert len(layers) == 4
        assert {e["name"] for e in ev if e["cat"] == "backward" and "layer" in e.get("args", {})} == layers
        # wfbp: some communication runs while backward is still going
        backward = [e for e in ev if e["cat"] == "backward" and e["name"] == "backward"]
        overlapping = sum(1 for c in comm for b in backward if b["ts"] < c["ts"] < b["ts"] + b["dur"])
        assert overlapping >= len(steps), overlapping


def test_runs_show_and_trace(wfbp_run, tmp_path):
    _, run_dir, runs = wfbp_run
    r = commlab("runs", runs=runs)
    assert r.returncode == 0 and run_dir.name in r.stdout and "done" in r.stdout
    r = commlab("show", run_dir.name, runs=runs)
    assert r.returncode == 0 and "layerwise" in r.stdout and "wfbp" in r.stdout
    out = tmp_path / "trace.json"
    r = commlab("trace", run_dir.name, "-o", str(out), runs=runs)
    assert r.returncode == 0, r.stderr
    trace = json.loads(out.read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"forward", "backward", "comm", "optimizer"} <= names


@pytest.mark.parametrize("run_id", ["../etc", "/etc/passwd", "..", "a/../../b", "nope-404"])
def test_show_bad_run_ids(wfbp_run, run_id):
    _, _, runs = wfbp_run
    r = commlab("show", run_id, runs=runs)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("over,field", [
    ({"compressor": {"name": "zip"}}, "compressor.name"),
    ({"steps": 0}, "steps"),
    ({"model": "transformer"}, "model.name"),
    ({"optimizer": {"name": "sgd", "lr": -1}}, "optimizer.lr"),
    ({"colour": "red"}, "colour"),
    ({"comm": {"mode": "smoke"}}, "comm.mode"),
])
def test_bad_spec_exits_2_with_one_line(tmp_path, over, field):
    spec = write_spec(tmp_path, **over)
    runs = tmp_path / "runs"
    r = commlab("run", str(spec), runs=runs, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], r.stderr
    assert not runs.exists() or not any(runs.iterdir())  # nothing started


def test_bad_arguments_exit_2(tmp_path):
    r = commlab("run", runs=tmp_path, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    r = commlab("run", str(tmp_path / "missing.yaml"), runs=tmp_path, timeout=60)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_failing_worker_marks_run_failed_and_keeps_metrics(tmp_path):
    spec = write_spec(tmp_path, steps=30, eval_every=0, fault={"kind": "raise", "step": 5, "rank": 1})
    runs = tmp_path / "runs"
    r = commlab("run", str(spec), "--quiet", runs=runs)
    assert r.returncode == 1, r.stdout + r.stderr
    run_dir = only_run(runs)
    st = json.loads((run_dir / "status.json").read_text())
    assert st["state"] == "failed" and st["rank"] == 1 and "injected fault at step 5" in st["error"]
    m = read_jsonl(str(run_dir / "metrics.jsonl"))
    assert {(x["step"], x["rank"]) for x in m if x["rank"] == 1} == {(s, 1) for s in range(5)}
    assert "Traceback" in (run_dir / "error-rank1.json").read_text()


def test_demo_cnn_digits_reaches_95_percent(tmp_path):
    """The README's demo spec, world size 2: held-out accuracy of at least 95% in a short run."""
    runs = tmp_path / "runs"
    r = commlab("run", str(ROOT / "examples" / "demo.yaml"), "--quiet", "--set", "steps=150",
                "--set", "eval_every=0", runs=runs)
    assert r.returncode == 0, r.stdout + r.stderr
    evals = [m for m in read_jsonl(str(only_run(runs) / "metrics.jsonl")) if m["kind"] == "eval"]
    assert evals[-1]["step"] == 150 and evals[-1]["eval_acc"] >= 0.95, evals


def test_allgather_header_exchange_is_a_wait_span(tmp_path):
    """An all-gathered payload whose sizes follow its values (threshold) has its shapes exchanged first,
    synchronously, which blocks the training thread: the timeline shows it in the wait lane (so breakdowns and
    calibration do not count it as compute), once per bucket and step. Top-k declares ``fixed_payload``: no
    header at all."""
    runs = tmp_path / "runs"
    spec = write_spec(tmp_path, steps=4, eval_every=0, schedule={"name": "layerwise"}, comm={"mode": "wfbp"},
                      compressor={"name": "threshold", "threshold": 0.001})
    r = commlab("run", str(spec), "--quiet", runs=runs)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = only_run(runs)
    nb = len(json.loads((run_dir / "layout.json").read_text())["buckets"])
    ev = read_jsonl(str(run_dir / "timeline-rank0.jsonl"))
    headers = [e for e in ev if e["cat"] == "wait" and e["name"].startswith("header b")]
    assert len(headers) == 4 * nb
    assert {e["args"]["bucket"] for e in headers} == set(range(nb))
    import commlab as api
    topk = api.run({**json.loads(spec.read_text()), "compressor": {"name": "topk", "ratio": 0.1}},
                   runs=tmp_path / "topk")
    assert topk.state == "done", topk.log_tail()
    ev = read_jsonl(str(topk.path / "timeline-rank0.jsonl"))
    assert not [e for e in ev if e["name"].startswith("header b")]
    assert len([e for e in ev if e["cat"] == "comm" and "allgather" in e["name"]]) >= 4 * nb, \
        sorted({(e["cat"], e["name"].split(" ")[0]) for e in ev})
