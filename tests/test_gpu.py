"""GPU-only checks: NCCL, CUDA-event timelines. Skipped on machines without two GPUs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.runlog import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")


def test_nccl_run_with_cuda_event_timeline(tmp_path):
    runs = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "lab.cli", "run", str(ROOT / "examples" / "demo.yaml"), "--quiet",
                        "--runs", str(runs), "--set", "device=cuda", "--set", "backend=nccl", "--set", "steps=30",
                        "--set", "schedule.name=layerwise"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (run_dir,) = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    ev = read_jsonl(str(run_dir / "timeline-rank0.jsonl"))
    assert ev and all(e["dur"] >= 0 for e in ev)
    assert {e["cat"] for e in ev} >= {"forward", "backward", "comm"}
