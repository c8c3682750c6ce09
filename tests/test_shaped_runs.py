"""Runs on shaped links leave no namespace, veth or qdisc behind: after success, a crash, a cancel.
Modeled links label themselves and slow collectives down."""
import os
import shutil
import time

import pytest

import commlab
from commlab.lab.net import netns
from commlab.lab.service.queue import Lab
from commlab.lab.base.errors import LabError  # noqa: E402

ROOT_OK = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
needs_root = pytest.mark.skipif(not ROOT_OK, reason="shaped links need root, ip and tc (network namespaces)")
SPEC = {"name": "shaped", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 6, "batch_size": 16,
        "eval_every": 0, "threads": 1, "network": {"link": "shaped", "gbps": 1.0}}


def leftovers(run):
    """This run's namespaces (their names carry the run id's last four characters), and any interface of
    the lab in the root namespace. Other clusters (another run, a benchmark) may exist at the same time."""
    tag = f"-{run.id[-4:]}-"
    return [ns for ns in netns.list_lab_namespaces() if tag in ns] + netns.root_lab_links()


@needs_root
def test_shaped_run_succeeds_and_cleans_up(tmp_path):
    run = commlab.run(SPEC, runs=tmp_path)
    assert run.state == "done", run.status()
    assert "10.250." in run.status()["cluster"]
    assert leftovers(run) == []


@needs_root
def test_shaped_run_with_crashing_worker_cleans_up(tmp_path):
    run = commlab.run(dict(SPEC, steps=20, fault={"kind": "exit", "step": 3, "rank": 1}), runs=tmp_path)
    assert run.state == "failed" and run.status()["rank"] == 1, run.status()
    assert leftovers(run) == []


@needs_root
def test_shaped_run_cancel_cleans_up(tmp_path):
    q = Lab(tmp_path, max_jobs=1)
    run = q.submit(commlab.spec(dict(SPEC, steps=100000)), wait=False)
    t0 = time.time()
    while not (run.state == "running" and run.metric_rows()) and time.time() - t0 < 90:
        time.sleep(0.2)
    assert run.metric_rows(), "the run never trained"
    q.cancel(run.id)
    assert len(leftovers(run)) == 3  # while it runs: a namespace per rank and the bridge's
    assert q.wait(run.id, timeout=60) == "cancelled"
    t0 = time.time()
    while leftovers(run) and time.time() - t0 < 20:
        time.sleep(0.2)
    assert leftovers(run) == []


def test_shaped_without_root_names_modeled(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LabError, match="modeled"):
        Lab(tmp_path).create(commlab.spec(SPEC))


def test_modeled_link_is_slower_and_labelled(tmp_path, capsys):
    from commlab.lab.front.cli import main
    spec = tmp_path / "m.yaml"
    spec.write_text("model: mlp\ndataset: digits\nsteps: 6\nbatch_size: 16\neval_every: 0\nthreads: 1\n"
                    "network: {link: modeled, gbps: 0.05}\n")
    assert main(["run", str(spec), "--quiet", "--runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "modeled (alpha-beta delays" in out
    (run,) = commlab.runs(runs=tmp_path / "runs")
    nbytes = run.summary().iloc[0]["bytes_per_step"]
    # ring all-reduce on 2 ranks moves 2 * (1/2) * n bytes over the link: at 50 Mbit/s the mlp's 1.2 MB take ~0.19 s
    predicted_ms = nbytes * 8 / 0.05e9 * 1e3
    it = run.summary().iloc[0]["iter_ms_median"]
    assert predicted_ms < it < predicted_ms + 100, (it, predicted_ms)


@needs_root
def test_a_fault_tolerant_run_on_a_shaped_link_recovers_a_killed_replica_and_cleans_up(tmp_path):
    """Fault tolerance on an emulated cluster: each replica in its own namespace, reached at its address there, the
    Lighthouse on the cluster's bridge; a killed replica is restarted in its namespace and recovers from its peer
    over the shaped link; the run ends done with one model and leaves nothing behind. ``min_replicas`` 2: the
    survivor waits in its next quorum for the restarted replica (a process of its own in its namespace, which
    imports torch first), however long a loaded machine takes to start it."""
    import importlib.util
    if importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (./setup.sh installs it)")
    spec = dict(SPEC, name="shaped-ft", steps=20, model={"name": "mlp", "hidden": 1024}, final_eval=False,
                network={"link": "shaped", "gbps": 0.2},
                fault_tolerance={"enabled": True, "min_replicas": 2, "join_timeout_ms": 1000, "timeout_s": 30,
                                 "faults": [{"kind": "kill", "replica": 1, "step": 3, "restart_after_s": 0.5}]})
    run = commlab.run(spec, runs=tmp_path)
    assert run.state == "done", (run.status(), run.log_tail(40))
    st = run.status()
    assert "10.250." in st["cluster"] and st["fault_tolerance"]["lighthouse"].startswith("http://10.250.")
    finals = {r["replica"]: r["params_sha256"] for r in run.metric_rows() if r["kind"] == "final"}
    assert sorted(finals) == [0, 1] and len(set(finals.values())) == 1, finals
    kills = [e for e in run.ft_events() if e["event"] == "kill"]
    rec = [r for r in run.recoveries() if r["replica"] == 1 and r["t"] > kills[0]["t"]]
    assert rec and rec[0]["from_replica"] == 0 and rec[0]["bytes"] > 0, run.recoveries()
    assert "10.250." in rec[0]["src_url"]  # fetched from the peer's address in the cluster
    assert leftovers(run) == []
