"""A fault-tolerant run through the lab, end to end: three replica groups on torchft (mlp on digits, PowerSGD, gloo,
CPU), the lab SIGKILLs replica 2 once it has logged a step, restarts it, the replica recovers the model, optimizer
and compressor state from a peer, and the run ends done with every replica holding the same parameters.

The survivors must still be training when the restarted replica has imported torch and joined: a modeled link
(every all-reduce lasts its alpha-beta time, a sleep that leaves the CPU to the restart) paces the steps. Nothing is
timed here: the assertions are about what the run recorded."""
import importlib.util

import pytest

import commlab
from commlab.engine import runfiles

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="torchft is not installed (./setup.sh installs it)")

STEPS, KILL_AT = 80, 3
SPEC = {"name": "ft-kill", "model": "mlp", "dataset": "digits", "world_size": 3, "steps": STEPS, "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "eval_every": 0, "final_eval": False,
        "threads": 1, "comm": "sync", "schedule": "allinone",
        "compressor": {"name": "powersgd", "rank": 2, "start_iter": 2},
        "network": {"link": "modeled", "gbps": 1, "latency_us": 40000},  # a step (two all-reduces): 160 ms, 320 with 3
        "fault_tolerance": {"enabled": True, "min_replicas": 2, "join_timeout_ms": 1000, "timeout_s": 20,
                            "restart": {"max_restarts": 2, "delay_s": 0.5},
                            "faults": [{"kind": "kill", "replica": 2, "step": KILL_AT, "restart_after_s": 0.5}]}}


def visits(seq, pattern):
    """Whether ``pattern`` is a subsequence of ``seq``."""
    it = iter(seq)
    return all(any(x == want for x in it) for want in pattern)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    return commlab.run(SPEC, runs=tmp_path_factory.mktemp("ft") / "runs")


def test_a_killed_replica_is_restarted_recovers_and_the_run_ends_done_with_one_model(killed_run):
    run = killed_run
    st = run.status()
    assert st["state"] == "done", (st, run.log_tail(60))
    rows = run.metric_rows()
    finals = {r["replica"]: r["params_sha256"] for r in rows if r["kind"] == "final"}
    assert sorted(finals) == [0, 1, 2] and len(set(finals.values())) == 1, finals  # the restarted one too
    steps = [r for r in rows if r["kind"] == "step"]
    assert all({"quorum_id", "participants", "committed", "replica"} <= set(r) for r in steps)
    # every replica committed every step once: the steps it trained itself plus those it recovered
    for rep in range(3):
        done = [r["step"] for r in steps if r["replica"] == rep and r["committed"]]
        assert len(done) == len(set(done)) and max(done) == STEPS - 1, rep


def test_the_kill_and_the_recovery_are_in_the_runs_records(killed_run):
    run = killed_run
    ev = run.ft_events()
    kills = [e for e in ev if e["event"] == "kill"]
    assert len(kills) == 1 and kills[0]["replica"] == 2 and kills[0]["gen"] == 0 and kills[0]["step"] >= KILL_AT
    spawns = [(e["replica"], e["gen"]) for e in ev if e["event"] == "spawn"]
    assert sorted(spawns) == [(0, 0), (1, 0), (2, 0), (2, 1)]
    assert any(e["event"] == "exit" and e["replica"] == 2 and e["gen"] == 0 and e["code"] == -9 for e in ev)
    assert [e for e in ev if e["event"] == "lighthouse"][0]["pid"] > 0
    rec = [r for r in run.recoveries() if r["replica"] == 2 and r["t"] > kills[0]["t"]]
    assert len(rec) == 1, run.recoveries()
    assert rec[0]["from_replica"] in (0, 1) and rec[0]["bytes"] > 0 and rec[0]["src_url"].startswith("http")
    assert rec[0]["step"] >= kills[0]["step"]
    # the killed replica's lines up to its death are kept, and its restart trains on from the recovered step
    mine = [r for r in run.metric_rows() if r["kind"] == "step" and r["replica"] == 2]
    assert max(r["step"] for r in mine if r["t"] <= kills[0]["t"]) >= KILL_AT
    assert min(r["step"] for r in mine if r["t"] > rec[0]["t"]) == rec[0]["step"]
    # the quorum shrank when replica 2 died and grew again when it came back: each quorum's size, in their order
    size = {r["quorum_id"]: r["participants"] for r in run.metric_rows() if r["kind"] == "step"}
    assert visits([size[q] for q in sorted(size)], [3, 2, 3]), size
    assert (run.path / runfiles.LIGHTHOUSE_LOG).exists()


def test_nothing_the_run_started_is_left_running(killed_run):
    from commlab.lab.base import procs
    started = [e["pid"] for e in killed_run.ft_events() if e["event"] in ("spawn", "lighthouse")]
    assert len(started) == 5
    for pid in started:  # gone, or the PID is another process's now
        cmd = procs.cmdline(pid) if procs.start_time(pid) is not None else ""
        assert str(killed_run.path) not in cmd and "ft_lighthouse" not in cmd, (pid, cmd)
