"""Scale-out: the same spec across machines with torchrun's multi-node rendezvous,
tested on one machine as two nodes sharing one runs directory (the README's recipe)."""
import json
import subprocess
import sys
from pathlib import Path

from commlab.engine.runlog import read_jsonl
from commlab.lab.base.torchrun import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_two_nodes_share_one_run(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "two-nodes", "model": "mlp", "dataset": "digits", "world_size": 2,
                                "steps": 8, "batch_size": 16, "eval_every": 4, "threads": 1,
                                # both "nodes" are this machine: on one GPU NCCL would refuse them
                                "device": "cpu"}))
    runs, port = tmp_path / "shared-runs", free_port()
    node = [sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--quiet", "--runs", str(runs), "--nnodes", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--run-id", "two-nodes-1"]
    p1 = subprocess.Popen(node + ["--node-rank", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    p0 = subprocess.Popen(node + ["--node-rank", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    out0, _ = p0.communicate(timeout=180)
    out1, _ = p1.communicate(timeout=60)
    assert p0.returncode == 0 and p1.returncode == 0, out0 + out1
    run_dir = runs / "two-nodes-1"
    st = json.loads((run_dir / "status.json").read_text())
    assert st["state"] == "done" and st["nodes"] == 2
    steps = [m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if m["kind"] == "step"]
    assert sorted({m["rank"] for m in steps}) == [0, 1] and len(steps) == 16
    assert "node 1/2" in out1 and "done" in out0
