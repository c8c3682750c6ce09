"""Scale-out conventions: when RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set (torchrun,
srun in a Slurm batch script, a Kubernetes PyTorchJob), `commlab run` runs this process as that
rank of the job instead of spawning ranks. Tested with the environment set by hand."""
import json
import os
import subprocess
import sys
from pathlib import Path

from commlab.engine.runlog import read_jsonl
from commlab.lab.rundir.launcher import JobRank
from commlab.lab.base.torchrun import free_port

ROOT = Path(__file__).resolve().parents[1]


def _env(rank, world, port, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("COMMLAB_RUNS", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **extra})
    return env


def test_two_commlab_runs_join_one_job(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "joined", "model": "mlp", "dataset": "digits", "world_size": 2,
                                "steps": 8, "batch_size": 16, "eval_every": 4, "threads": 1,
                                "compressor": {"name": "topk", "ratio": 0.05, "error_feedback": True}}))
    runs, port = tmp_path / "runs", free_port()
    argv = [sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--quiet", "--runs", str(runs)]
    p1 = subprocess.Popen(argv, cwd=ROOT, env=_env(1, 2, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    p0 = subprocess.Popen(argv, cwd=ROOT, env=_env(0, 2, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    out0, _ = p0.communicate(timeout=180)
    out1, _ = p1.communicate(timeout=60)
    assert p0.returncode == 0 and p1.returncode == 0, out0 + out1
    run_id = JobRank(_env(0, 2, port)).run_id("joined")  # what both derived, without talking
    run_dir = runs / run_id
    st = json.loads((run_dir / "status.json").read_text())
    assert st["state"] == "done" and st["joined"]["world_size"] == 2, st
    steps = [m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if m["kind"] == "step"]
    assert sorted({m["rank"] for m in steps}) == [0, 1] and len(steps) == 16
    for r in (0, 1):
        assert read_jsonl(str(run_dir / f"timeline-rank{r}.jsonl"))
    assert f"run {run_id}  rank 1/2" in out1 and "status         done" in out0


def test_a_job_of_another_size_is_refused_in_one_line(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"world_size": 2}))
    p = subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--runs", str(tmp_path / "runs")],
                       cwd=ROOT, env=_env(0, 4, free_port()), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "world_size: the spec asks for 2 ranks but this job has 4 (WORLD_SIZE)" in p.stderr


def test_run_ids_come_from_the_job():
    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    assert JobRank({**base, "SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0"}).run_id("My run") == "my-run-slurm4711.0"
    assert JobRank({**base, "COMMLAB_RUN_ID": "exp-1"}).run_id("x") == "exp-1"
    assert JobRank({**base, "TORCHELASTIC_RUN_ID": "none"}).run_id("x") == JobRank(base).run_id("x")
    assert JobRank.from_env({"RANK": "0"}) is None
