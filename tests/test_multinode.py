"""Scale-out: the same spec across machines with torchrun's multi-node rendezvous,
tested on one machine as two nodes sharing one runs directory (the README's recipe)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commlab.engine.runlog import read_jsonl
from commlab.lab.base.torchrun import free_port

ROOT = Path(__file__).resolve().parents[1]


def two_nodes(spec, runs, run_id: str, timeout: float = 180, extra=(), cwd=ROOT):
    """`commlab run SPEC --nnodes 2` (and ``extra``) as node 1 then node 0 on this machine, sharing ``runs``: each
    node's (exit code, output), and the master port."""
    port = free_port()
    node = [sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--quiet", "--runs", str(runs),
            "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--run-id", run_id, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p1 = subprocess.Popen(node + ["--node-rank", "1"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)
    p0 = subprocess.Popen(node + ["--node-rank", "0"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)
    out0, _ = p0.communicate(timeout=timeout)
    out1, _ = p1.communicate(timeout=60)
    return (p0.returncode, out0), (p1.returncode, out1), port


def test_two_nodes_share_one_run(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "two-nodes", "model": "mlp", "dataset": "digits", "world_size": 2,
                                "steps": 8, "batch_size": 16, "eval_every": 4, "threads": 1,
                                # both "nodes" are this machine: on one GPU NCCL would refuse them
                                "device": "cpu"}))
    runs = tmp_path / "shared-runs"
    (code0, out0), (code1, out1), _ = two_nodes(spec, runs, "two-nodes-1")
    assert code0 == 0 and code1 == 0, out0 + out1
    run_dir = runs / "two-nodes-1"
    st = json.loads((run_dir / "status.json").read_text())
    assert st["state"] == "done" and st["nodes"] == 2
    steps = [m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if m["kind"] == "step"]
    assert sorted({m["rank"] for m in steps}) == [0, 1] and len(steps) == 16
    assert "node 1/2" in out1 and "done" in out0


OWN_LOOP = """
import torch
import commlab

torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
with commlab.wrap(model, opt) as loop:
    for step in loop.steps():
        g = torch.Generator().manual_seed(1000 * step + loop.rank)
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), (x.sum(1) > 0).long())
        loss.backward()
        loop.step(loss=loss)
"""
"""Your own loop, as the replica groups of a fault-tolerant run run it (``commlab run --script``)."""


@pytest.mark.parametrize("trainer", ["lab", "script"])
def test_a_fault_tolerant_run_over_two_nodes_restarts_a_killed_replica_on_its_own_node(tmp_path, trainer):
    """Fault tolerance across machines, tested as two nodes of one replica group each sharing one runs directory:
    node 0 starts the Lighthouse on the master address and port and its replica, node 1 its own; the spec's kill
    of replica 1 is executed, and the replica restarted, by node 1, and it recovers from replica 0 over the
    Lighthouse's quorum. The run ends done with one model; node 0 owns the status. Once with the lab's trainer,
    once with your own loop (``--script``, given to both nodes; node 0 writes it into the run)."""
    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (./setup.sh installs it)")
    extra, cwd = (), ROOT
    if trainer == "script":
        (tmp_path / "train.py").write_text(OWN_LOOP)
        extra, cwd = ("--script", "train.py"), tmp_path
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({
        "name": "ft-two-nodes", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 40, "batch_size": 16,
        "eval_every": 0, "final_eval": False, "threads": 1, "device": "cpu",
        "network": {"link": "modeled", "gbps": 1, "latency_us": 50000},  # paces the steps while the restart starts
        "fault_tolerance": {"enabled": True, "min_replicas": 2, "join_timeout_ms": 1000, "timeout_s": 20,
                            "restart": {"max_restarts": 1, "delay_s": 0.5},
                            "faults": [{"kind": "kill", "replica": 1, "step": 3}]}}))
    runs = tmp_path / "shared-runs"
    (code0, out0), (code1, out1), port = two_nodes(spec, runs, "ft-two-nodes-1", timeout=240, extra=extra, cwd=cwd)
    run_dir = runs / "ft-two-nodes-1"
    assert code0 == 0 and code1 == 0, out0 + out1 + (run_dir / "log.txt").read_text()[-3000:]
    st = json.loads((run_dir / "status.json").read_text())
    assert st["state"] == "done" and st["fault_tolerance"]["lighthouse"] == f"http://127.0.0.1:{port}"
    rows = read_jsonl(str(run_dir / "metrics.jsonl"))
    finals = {r["replica"]: r["params_sha256"] for r in rows if r["kind"] == "final"}
    assert sorted(finals) == [0, 1] and len(set(finals.values())) == 1, finals
    ev = read_jsonl(str(run_dir / "ft-events.jsonl"))
    assert [(e["replica"], e["node"]) for e in ev if e["event"] == "kill"] == [(1, 1)]
    assert {(e["replica"], e["node"]) for e in ev if e["event"] == "spawn"} == {(0, 0), (1, 1)}
    assert sorted((e["replica"], e["gen"]) for e in ev if e["event"] == "spawn") == [(0, 0), (1, 0), (1, 1)]
    assert len([e for e in ev if e["event"] == "lighthouse"]) == 1  # node 0's only
    rec = [r for r in read_jsonl(str(run_dir / "recoveries.jsonl")) if r["replica"] == 1 and r["step"] > 0]
    assert rec and rec[0]["from_replica"] == 0, rec
    assert "node 1/2" in out1 and "done" in out0
    if trainer == "script":
        assert st["fault_tolerance"]["script"] == {"argv": ["train.py"], "cwd": str(tmp_path)}
        assert {r["replica"] for r in rows if r["kind"] == "step"} == {0, 1}


def test_a_searched_schedule_under_fault_tolerance_is_refused_across_nodes_in_one_line(tmp_path, capsys):
    """MergeComp's search before a fault-tolerant run's replicas is one machine's run: across nodes the refusal
    names the field, before any run is made."""
    from commlab.lab.front import cli
    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (./setup.sh installs it)")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": "mlp", "dataset": "digits", "world_size": 2, "steps": 10,
                                "schedule": "mergecomp", "fault_tolerance": {"enabled": True}}))
    assert cli.main(["run", str(spec), "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                     "--run-id", "x", "--runs", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "schedule.name: mergecomp under fault tolerance is searched before the replicas start" in err, err
    assert "Traceback" not in err and not (tmp_path / "runs" / "x").exists()
