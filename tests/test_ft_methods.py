"""Local SGD, post-local SGD, DiLoCo, Streaming DiLoCo and the other methods on torchft through the lab, end to end (mlp on digits, gloo,
CPU): without faults a fault-tolerant run trains to the very parameters of the same spec without fault tolerance;
with a kill, the killed DiLoCo replica is restarted, recovers in its peers' sync (model, inner optimizer, global
parameters, outer momentum and the lab's step) and the run ends done with one model.

In the kill run a modeled link paces the syncs (every all-reduce lasts its alpha-beta time, a sleep that leaves the
CPU to the restart), so the survivors are still training when the restarted replica has imported torch and joined.
Nothing is timed here: the assertions are about what the runs recorded."""
import importlib.util

import pytest

import commlab

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="torchft is not installed (./setup.sh installs it)")

BASE = {"model": "mlp", "dataset": "digits", "world_size": 3, "steps": 12, "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "eval_every": 0, "final_eval": False,
        "threads": 1, "comm": "sync", "schedule": "allinone"}
FT = {"enabled": True, "min_replicas": 3, "join_timeout_ms": 5000, "timeout_s": 20}


def finals(run):
    st = run.status()
    assert st["state"] == "done", (st, run.log_tail(60))
    return {r.get("replica", r["rank"]): r["params_sha256"] for r in run.metric_rows() if r["kind"] == "final"}


@pytest.mark.parametrize("method", [
    {"name": "diloco", "H": 4, "outer_lr": 0.7, "outer_momentum": 0.9},
    {"name": "diloco", "H": 4, "overlap": "delayed"},
    {"name": "diloco", "H": 4, "overlap": "eager"},
    {"name": "local_sgd", "H": 3},
    {"name": "post_local_sgd", "H": 3, "warmup": 3},
    {"name": "streaming_diloco", "H": 4, "fragments": 2, "tau": 1},
    {"name": "muloco", "H": 4},
    {"name": "demo", "topk": 8},
    {"name": "sparseloco", "H": 4, "chunk": 64, "k": 8},
    {"name": "desloc", "Hx": 4, "Hu": 3, "Hv": 6},
    {"name": "none", "compressor": {"name": "topk", "ratio": 0.1, "error_feedback": True}},
], ids=lambda m: (m["name"] if m["name"] != "none" else "topk-ef") + (f"-{m['overlap']}" if "overlap" in m else ""))
def test_without_faults_a_fault_tolerant_run_trains_to_the_same_parameters_exactly(method, tmp_path):
    """Exact: the replicas start alike (the first quorum's recovery), the syncs sum the same tensors over gloo in the
    same order, and the batches are those of the same steps. The run without fault tolerance records rank 0's
    parameters: replica 0's are the same; where the last step is a sync of the whole model, so are the others'
    (Streaming DiLoCo's fragment 0 has had local steps since its last sync, and alpha 0.5 mixes in local ones;
    DiLoCo's eager outer step keeps each rank's global copy its own, with its own fresh pseudo-gradient in it)."""
    method = dict(method)
    per_step = {"compressor": method.pop("compressor")} if method["name"] == "none" else {}  # every step's, top-k
    if method["name"] == "muloco":  # Muon inside (and AdamW for the biases); a narrow mlp: bf16 on a CPU is slow
        per_step.update(optimizer={"name": "muon", "lr": 0.02}, model={"name": "mlp", "hidden": 64})
    if method["name"] == "demo":  # its own momentum, its exchange in every step's quorum
        per_step["optimizer"] = {"name": "sgd", "lr": 0.001}
    if method["name"] == "desloc":  # Adam's moments averaged on periods of their own
        per_step["optimizer"] = {"name": "adam", "lr": 0.001}
    plain = finals(commlab.run({**BASE, "name": "plain", "method": method, **per_step}, runs=tmp_path / "runs"))
    ft = commlab.run({**BASE, "name": "ft", "method": method, "fault_tolerance": FT, **per_step},
                     runs=tmp_path / "runs")
    got = finals(ft)
    assert sorted(got) == [0, 1, 2] and got[0] == plain[0], (plain, got)
    if method["name"] != "streaming_diloco" and method.get("overlap") != "eager":
        assert len(set(got.values())) == 1, got
    rows = [r for r in ft.metric_rows() if r["kind"] == "step"]
    # every replica trained every step once, and every sync committed with the three
    for rep in range(3):
        assert [r["step"] for r in rows if r["replica"] == rep] == list(range(BASE["steps"])), rep
    if "compressor" in per_step:
        assert all(r["committed"] is True and r["participants"] == 3 for r in rows)
        return
    syncs = [r for r in rows if "sync_bytes" in r]
    assert syncs and all(r["committed"] is True and r["participants"] == 3 for r in syncs if "committed" in r)


STEPS, H, KILL_AT = 64, 4, 5
KILL = {**BASE, "name": "ft-diloco-kill", "steps": STEPS,
        "method": {"name": "diloco", "H": H, "outer_lr": 0.7, "outer_momentum": 0.9},
        # a cluster of three alike, 150 ms from the core (300 ms apart): a sync's ring over the quorum's workers,
        # 1.2 s with 3, 0.6 s with 2
        "network": {"link": "modeled", "cluster": {"workers": [{"gbps_up": 1, "gbps_down": 1, "delay_ms": 150}]}},
        "fault_tolerance": {"enabled": True, "min_replicas": 2, "join_timeout_ms": 1000, "timeout_s": 20,
                            "restart": {"max_restarts": 2, "delay_s": 0.5},
                            # restarted after 2 s: the survivors' next sync forms its quorum without it (the
                            # Lighthouse waits join_timeout_ms, 1 s, for a member of the last quorum); a restart
                            # forked by the warm server is back within a second and would join that sync instead
                            "faults": [{"kind": "kill", "replica": 2, "step": KILL_AT, "restart_after_s": 2.0}]}}


def visits(seq, pattern):
    it = iter(seq)
    return all(any(x == want for x in it) for want in pattern)


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_a_killed_diloco_replica_is_restarted_recovers_in_a_sync_and_the_run_ends_done_with_one_model(tmp_path,
                                                                                                     overlap):
    """With overlap delayed the sync it recovers in is one whose outer step its source has taken (with the average
    of the sync before) and whose pseudo-gradient is about to be issued: it takes both and issues its source's."""
    run = commlab.run({**KILL, "method": {**KILL["method"], "overlap": overlap}}, runs=tmp_path / "runs")
    got = finals(run)
    assert sorted(got) == [0, 1, 2] and len(set(got.values())) == 1, got  # the restarted one too
    ev = run.ft_events()
    kills = [e for e in ev if e["event"] == "kill"]
    assert len(kills) == 1 and kills[0]["replica"] == 2 and kills[0]["step"] >= KILL_AT
    assert sorted((e["replica"], e["gen"]) for e in ev if e["event"] == "spawn") == [(0, 0), (1, 0), (2, 0), (2, 1)]
    rec = [r for r in run.recoveries() if r["replica"] == 2 and r["t"] > kills[0]["t"]]
    assert len(rec) == 1, run.recoveries()
    # it recovered in a sync: the lab's step is a sync's (the last of a period), past the kill
    assert rec[0]["from_replica"] in (0, 1) and rec[0]["bytes"] > 0
    assert rec[0]["lab_step"] > kills[0]["step"] and (rec[0]["lab_step"] + 1) % H == 0
    rows = [r for r in run.metric_rows() if r["kind"] == "step"]
    after = [r for r in rows if r["replica"] == 2 and r["t"] > rec[0]["t"]]
    assert after[0]["step"] == rec[0]["lab_step"] and after[0]["recovered"] is True
    # the sync it recovered in commits there, or (delayed) at the next sync, where its average is used
    assert next(r for r in after if "committed" in r)["committed"] is True
    assert ("committed" in after[0]) == (overlap == "none")
    assert [r["step"] for r in after] == list(range(rec[0]["lab_step"], STEPS))  # and trains on to the end
    size = {r["quorum_id"]: r["participants"] for r in rows if r.get("quorum_id") is not None}
    assert visits([size[q] for q in sorted(size)], [3, 2, 3]), size
