"""A cut fault through the lab, end to end: three replica groups on torchft (mlp on digits, per-step sync of top-k
with error feedback, an all-gathered round, gloo, CPU); once replica 2 has logged step CUT_AT the lab stops its process for CUT_S seconds (no traffic, no heartbeat:
to its peers and the Lighthouse a cut link), the other two go on as a quorum of two, and when the cut ends replica 2
finds itself behind, recovers from a live peer and trains on with them, without a restart. Nothing is timed here:
the assertions are about what the run recorded."""
import importlib.util

import pytest

import commlab

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="torchft is not installed (./setup.sh installs it)")

# The two others notice the cut after the heartbeat timeout (about 0.7 s) and then train at the modeled link's pace,
# about 30 ms a step for two on a fast machine: at most about 110 steps during the 4 s, which leaves replica 2 some 80
# steps to rejoin in (at 120 steps, 113 were gone before it came back, and it was stopped without its final row); a
# shorter cut left a loaded machine's two others too few steps of their own during it
STEPS, CUT_AT, CUT_S = 200, 5, 4.0
SPEC = {"name": "ft-cut", "model": "mlp", "dataset": "digits", "world_size": 3, "steps": STEPS, "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "eval_every": 0, "final_eval": False,
        "threads": 1, "comm": "sync", "schedule": "allinone",
        "compressor": {"name": "topk", "ratio": 0.1, "error_feedback": True},
        "network": {"link": "modeled", "gbps": 1, "latency_us": 20000},  # a step's two all-gathers: 160 ms with 3
        "fault_tolerance": {"enabled": True, "min_replicas": 2, "join_timeout_ms": 500, "heartbeat_timeout_ms": 1000,
                            "timeout_s": 2, "restart": {"max_restarts": 0},
                            "faults": [{"kind": "cut", "replica": 2, "step": CUT_AT, "seconds": CUT_S}]}}


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    return commlab.run(SPEC, runs=tmp_path_factory.mktemp("ftcut") / "runs")


def test_the_cut_replica_goes_on_recovers_and_the_run_ends_with_one_model(cut_run):
    run = cut_run
    st = run.status()
    assert st["state"] == "done", (st, run.log_tail(60))
    ev = run.ft_events()
    cut = [e for e in ev if e["event"] == "cut"]
    back = [e for e in ev if e["event"] == "reconnect"]
    assert len(cut) == 1 and cut[0]["replica"] == 2 and cut[0]["step"] >= CUT_AT and cut[0]["seconds"] == CUT_S
    assert len(back) == 1 and back[0]["replica"] == 2 and back[0]["why"] == "the cut's time is up"
    assert back[0]["t"] - cut[0]["t"] >= CUT_S
    # no kill, no restart: the same process (generation 0) was stopped and went on
    assert not [e for e in ev if e["event"] in ("kill", "refused")]
    assert sorted((e["replica"], e["gen"]) for e in ev if e["event"] == "spawn") == [(0, 0), (1, 0), (2, 0)]
    rows = run.metric_rows()
    finals = {r["replica"]: r["params_sha256"] for r in rows if r["kind"] == "final"}
    assert sorted(finals) == [0, 1, 2] and len(set(finals.values())) == 1, finals
    # while it was cut off the two others committed steps without it; back, it recovered from one of them
    steps = [r for r in rows if r["kind"] == "step"]
    during = [r for r in steps if r["replica"] != 2 and cut[0]["t"] < r["t"] < back[0]["t"] and r["committed"]]
    sizes = [r["participants"] for r in during]  # the step in flight when the cut came may still be the three's
    assert sizes.count(2) >= 4 and sizes == sorted(sizes, reverse=True) and set(sizes) <= {2, 3}, \
        [(r["step"], r["participants"]) for r in during]
    rec = [r for r in run.recoveries() if r["replica"] == 2 and r["t"] > back[0]["t"]]
    assert rec and rec[0]["from_replica"] in (0, 1) and rec[0]["bytes"] > 0, run.recoveries()
    mine = [r["step"] for r in steps if r["replica"] == 2 and r["committed"]]
    assert max(mine) == STEPS - 1


def test_show_says_the_cut(cut_run, capsys):
    from commlab.lab.front import cli
    assert cli.main(["show", cut_run.id, "--runs", str(cut_run.path.parent)]) == 0
    out = capsys.readouterr().out
    assert "1 cut" in out, out
