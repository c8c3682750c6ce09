"""Your own training loop on fault tolerance, end to end: `commlab run SPEC --script 'train.py ARGS'` starts the
Lighthouse and one process per replica group running the script, whose loop calls `commlab.wrap` and trains the
steps `loop.steps()` gives; the lab SIGKILLs replica 2 once it has logged a step (a fault of the spec), restarts it,
and the restarted script recovers the model and optimizer from a live peer and trains on. The run ends done with
every replica holding the same parameters. Nothing is timed here: the assertions are about what the run recorded."""
import importlib.util
import json
import os

import pytest

from commlab.engine import runfiles
from commlab.lab.front import cli
from commlab.lab.rundir.store import RunStore

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="torchft is not installed (./setup.sh installs it)")

STEPS, KILL_AT = 60, 3
SPEC = {"name": "own-ft", "world_size": 3, "steps": STEPS, "threads": 1, "comm": "sync", "schedule": "allinone",
        "compressor": {"name": "topk", "ratio": 0.25, "error_feedback": True},
        "network": {"link": "modeled", "gbps": 1, "latency_us": 50000},  # paces the steps while the restart starts
        "fault_tolerance": {"enabled": True, "min_replicas": 2, "join_timeout_ms": 1000, "timeout_s": 20,
                            "restart": {"max_restarts": 2, "delay_s": 0.5},
                            "faults": [{"kind": "kill", "replica": 2, "step": KILL_AT, "restart_after_s": 0.5}]}}

SCRIPT = '''
import sys
import torch
import commlab

torch.set_num_threads(1)
torch.manual_seed(int(sys.argv[1]))  # the first quorum's recovery gives every replica the same start anyway
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
with commlab.wrap(model, opt) as loop:
    for step in loop.steps():  # the batch by the step: a step that did not commit is trained again on it
        g = torch.Generator().manual_seed(1000 * step + loop.rank)
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), (x.sum(1) > 0).long())
        loss.backward()
        loop.step(loss=loss)
'''


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ownft")
    (tmp / "train.py").write_text(SCRIPT)
    (tmp / "spec.json").write_text(json.dumps(SPEC))
    root = tmp / "runs"
    old = os.getcwd()
    os.chdir(tmp)  # the script's path as a user gives it, relative to where commlab run is started
    try:
        code = cli.main(["run", "spec.json", "--script", "train.py 7", "--runs", str(root), "--quiet"])
    finally:
        os.chdir(old)
    (run,) = RunStore(root).list()
    return code, run, tmp


def test_a_killed_replica_of_your_own_loop_is_restarted_recovers_and_the_run_ends_with_one_model(script_run):
    code, run, tmp = script_run
    st = run.status()
    assert code == 0 and st["state"] == "done", (code, st, run.log_tail(60))
    assert st["fault_tolerance"]["script"] == {"argv": ["train.py", "7"], "cwd": str(tmp)}
    assert json.loads((run.path / runfiles.SCRIPT).read_text()) == st["fault_tolerance"]["script"]
    rows = run.metric_rows()
    finals = {r["replica"]: r["params_sha256"] for r in rows if r["kind"] == "final"}
    assert sorted(finals) == [0, 1, 2] and len(set(finals.values())) == 1, finals  # the restarted one too
    steps = [r for r in rows if r["kind"] == "step"]
    for rep in range(3):
        done = [r["step"] for r in steps if r["replica"] == rep and r["committed"]]
        assert len(done) == len(set(done)) and max(done) == STEPS - 1, rep
    ev = run.ft_events()
    (kill,) = [e for e in ev if e["event"] == "kill"]
    assert kill["replica"] == 2 and kill["step"] >= KILL_AT
    assert sorted((e["replica"], e["gen"]) for e in ev if e["event"] == "spawn") == [(0, 0), (1, 0), (2, 0), (2, 1)]
    rec = [r for r in run.recoveries() if r["replica"] == 2 and r["t"] > kill["t"]]
    assert rec and rec[0]["from_replica"] in (0, 1) and rec[0]["bytes"] > 0, run.recoveries()
    # the restarted script trained on from the step it recovered, not from 0
    mine = [r["step"] for r in steps if r["replica"] == 2 and r["t"] > rec[0]["t"]]
    assert min(mine) == rec[0]["step"] > 0


@pytest.mark.parametrize("spec,script,said", [
    ({**SPEC, "fault_tolerance": {"enabled": False}}, "train.py", "--script: runs your own loop as the replica "
                                                                  "groups of a fault-tolerant run"),
    (SPEC, "nosuch.py 1", "--script: nosuch.py is not a file"),
    (SPEC, "'train.py", "--script: No closing quotation"),
    ({**SPEC, "schedule": "mergecomp"}, "train.py", "--script: schedule mergecomp under fault tolerance is searched "
                                                    "before the replicas start, on the spec's model")])
def test_a_script_the_lab_cannot_run_is_refused_in_one_line(tmp_path, capsys, spec, script, said):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert cli.main(["run", "spec.json", "--script", script, "--runs", str(tmp_path / "runs")]) == 2
    finally:
        os.chdir(old)
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists() or not RunStore(tmp_path / "runs").list()


def test_wrap_refuses_a_fault_tolerant_spec_outside_the_labs_replicas_in_one_line(monkeypatch):
    import torch

    import commlab
    from commlab.engine.spec import SpecError
    model = torch.nn.Linear(2, 2)
    with pytest.raises(SpecError, match=r"commlab run SPEC --script 'train.py ARGS'") as e:
        commlab.wrap(model, None, {"fault_tolerance": {"enabled": True}})
    assert "\n" not in str(e.value)
    monkeypatch.setenv("COMMLAB_FT_RUN_DIR", "/nowhere")
    monkeypatch.delenv("COMMLAB_FT_LIGHTHOUSE", raising=False)
    with pytest.raises(RuntimeError, match=r"\$COMMLAB_FT_RUN_DIR is set but \$COMMLAB_FT_LIGHTHOUSE or \$RANK"):
        commlab.wrap(model, None, SPEC)
