"""GPU-only checks: the engine on CUDA tensors, CUDA-event timelines, NCCL. Skipped without a GPU.

One GPU runs two kinds of job: one rank over NCCL, and two ranks sharing the device, which NCCL
refuses (two ranks per device), so ``backend: auto`` picks gloo over CUDA tensors there. Two GPUs
add a two-rank NCCL run.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.runlog import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs (NCCL, one rank per GPU)")


def _run(tmp_path, *sets, spec="demo.yaml"):
    runs = tmp_path / "runs"
    args = [sys.executable, "-m", "lab.front.cli", "run", str(ROOT / "examples" / spec), "--quiet", "--runs", str(runs),
            "--set", "device=cuda", "--set", "eval_every=0"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    dirs = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")] if runs.exists() else []
    assert r.returncode == 0 and len(dirs) == 1, r.stdout + r.stderr
    run_dir = dirs[0]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "done", (run_dir / "log.txt").read_text()[-3000:]
    return run_dir, json.loads((run_dir / "resolved.json").read_text())


def _timeline_is_cuda_timed(run_dir, world):
    for rank in range(world):
        ev = read_jsonl(str(run_dir / f"timeline-rank{rank}.jsonl"))
        assert ev and all(e["dur"] >= 0 for e in ev)
        cats = {e["cat"] for e in ev}
        assert {"forward", "backward", "comm"} <= cats, cats
        # compute spans come from CUDA events resolved against one reference: each step's forward
        # lies before its backward on the host-aligned axis
        fwd = sorted(e["ts"] for e in ev if e["cat"] == "forward")
        assert fwd == sorted(fwd) and len(fwd) >= 10


def _final_loss(run_dir):
    losses = [r["loss"] for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r.get("kind") == "step"]
    assert losses and all(l == l for l in losses)  # no NaN
    return losses


@needs_gpu
def test_one_rank_nccl_with_cuda_event_timeline(tmp_path):
    run_dir, resolved = _run(tmp_path, "world_size=1", "backend=nccl", "steps=30")
    assert resolved["backend"] == "nccl" and resolved["device"].startswith("cuda")
    _timeline_is_cuda_timed(run_dir, 1)


@needs_gpu
@pytest.mark.parametrize("sets", [
    ("comm.mode=sync",),
    ("comm.mode=wfbp",),
    ("comm.mode=dear", "comm.cap_mb=1"),
    ("compressor.name=topk", "compressor.ratio=0.05", "compressor.error_feedback=true"),
    ("compressor.name=powersgd", "compressor.rank=2"),
], ids=["sync", "wfbp", "dear", "topk-ef", "powersgd"])
def test_two_ranks_share_one_gpu(tmp_path, sets):
    run_dir, resolved = _run(tmp_path, "world_size=2", "steps=40", *sets)
    expected = "gloo" if GPUS < 2 else "nccl"
    assert resolved["backend"] == expected and resolved["device"].startswith("cuda")
    _timeline_is_cuda_timed(run_dir, 2)
    losses = _final_loss(run_dir)
    assert min(losses[-10:]) < losses[0]  # it learns


@needs_gpu
def test_mergecomp_search_on_gpu(tmp_path):
    run_dir, _ = _run(tmp_path, "world_size=2", "steps=60", spec="mergecomp-topk.yaml")
    tuning = json.loads((run_dir / "tuning.json").read_text())
    assert tuning, "mergecomp wrote no tuning record"
    _timeline_is_cuda_timed(run_dir, 2)


@needs_gpu
def test_nccl_refuses_two_ranks_on_one_gpu_with_a_clear_error(tmp_path):
    if GPUS >= 2:
        pytest.skip("two GPUs: NCCL has one per rank")
    runs = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "lab.front.cli", "run", str(ROOT / "examples" / "demo.yaml"), "--quiet",
                        "--runs", str(runs), "--set", "device=cuda", "--set", "backend=nccl", "--set", "steps=5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    (run_dir,) = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")]
    said = (run_dir / "log.txt").read_text() + (run_dir / "status.json").read_text()
    assert "NCCL refuses two ranks per device" in said


@needs_two
def test_nccl_two_gpus_with_cuda_event_timeline(tmp_path):
    run_dir, resolved = _run(tmp_path, "backend=nccl", "steps=30", "schedule.name=layerwise")
    assert resolved["backend"] == "nccl"
    _timeline_is_cuda_timed(run_dir, 2)
