"""Your own training loop (commlab.wrap) launched by plain torchrun: examples/own_loop.py at world
size 2 lands in the runs directory like any run (spec, status, metrics, per-rank timelines), which
`commlab show` and `commlab trace` read; with compressor none it matches torch DDP."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commlab.engine.runlog import read_jsonl
from distutil import OWN_LOOP_DDP_STEPS, torchrun_own_loop, torchrun_script

ROOT = Path(__file__).resolve().parents[1]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)


SPECS = {
    "wfbp-topk-ef": {"compressor": {"name": "topk", "ratio": 0.05, "error_feedback": True}, "comm": "wfbp",
                     "schedule": "layerwise"},
    "mergecomp": {"compressor": {"name": "topk", "ratio": 0.05}, "comm": "wfbp",
                  "schedule": {"name": "mergecomp", "warmup_steps": 1, "steps_per_candidate": 2, "max_candidates": 3}},
    "dear-fp16": {"compressor": "fp16", "comm": "dear", "schedule": {"cap_mb": 0.01}},
}


@pytest.mark.parametrize("name", list(SPECS))
def test_own_loop_lands_in_the_runs_directory(tmp_path, name):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": f"own-{name}", "steps": 24, **SPECS[name]}))
    runs = tmp_path / "runs"
    p = torchrun_own_loop(tmp_path, "--spec", spec, "--runs", runs, "--steps", 24)
    assert p.returncode == 0, p.stdout[-3000:]
    (run_dir,) = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")]
    st = json.loads((run_dir / "status.json").read_text())
    assert st["state"] == "done" and st["own_loop"]["model"] == "Net" and st["own_loop"]["world_size"] == 2
    saved = json.loads((run_dir / "spec.json").read_text())
    c = SPECS[name]["compressor"]
    assert saved["world_size"] == 2 and saved["compressor"]["name"] == (c["name"] if isinstance(c, dict) else c)
    rows = read_jsonl(str(run_dir / "metrics.jsonl"))
    steps = [m for m in rows if m["kind"] == "step"]
    assert sorted({m["rank"] for m in steps}) == [0, 1] and len(steps) == 48
    assert all(m["time_ms"] > 0 and m["bytes_sent"] > 0 and m["loss"] > 0 for m in steps)
    assert [m["eval_acc"] for m in rows if m["kind"] == "eval"][0] > 0.2  # it trains
    for r in (0, 1):
        names = {e["name"] for e in read_jsonl(str(run_dir / f"timeline-rank{r}.jsonl"))}
        assert {"forward", "backward", "optimizer", "step 0"} <= names
        if name == "dear-fp16":
            assert any(n.startswith("reduce_scatter") for n in names) and any(n.startswith("allgather") for n in names)
    assert (run_dir / "layout.json").is_file()
    if name == "mergecomp":
        tuning = json.loads((run_dir / "tuning.json").read_text())
        assert tuning["schedule"] == "mergecomp" and tuning["trace"]
    if name == "dear-fp16":
        assert len(json.loads((run_dir / "layout.json").read_text())["buckets"]) > 1
    show = cli("show", run_dir.name, "--runs", runs)
    assert show.returncode == 0 and "status         done" in show.stdout and "own loop" in show.stdout, show.stdout
    trace = cli("trace", run_dir.name, "--runs", runs, "-o", tmp_path / "trace.json")
    assert trace.returncode == 0, trace.stdout
    events = json.loads((tmp_path / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert {e.get("pid") for e in events if e.get("ph") == "X"} == {0, 1}


@pytest.mark.parametrize("comm", ["wfbp", "sync"])
def test_own_loop_without_compression_matches_torch_ddp(tmp_path, comm, own_loop_ddp):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"compressor": "none", "comm": comm, "schedule": {"name": "bucket", "cap_mb": 0.02}}))
    steps = OWN_LOOP_DDP_STEPS
    ours = torchrun_own_loop(tmp_path, "--spec", spec, "--runs", tmp_path / "runs", "--steps", steps,
                             "--save", tmp_path / "ours")
    assert ours.returncode == 0, ours.stdout[-3000:]
    ref = own_loop_ddp  # the script with --ddp --steps OWN_LOOP_DDP_STEPS, run once for the suite (tests/conftest.py)
    assert ref.returncode == 0, ref.stdout[-3000:]
    torch.manual_seed(0)
    init = dict(_example().Net().named_parameters())  # the script's initial parameters
    for r in (0, 1):
        a, b = torch.load(tmp_path / f"ours.rank{r}"), torch.load(f"{ref.save}.rank{r}")
        assert max((a[n] - init[n]).abs().max() for n in a) > 1e-3  # they trained: the comparison means something
        for n in a:
            torch.testing.assert_close(a[n], b[n], atol=1e-6, rtol=0, msg=f"rank {r} {n} differs from DDP")


def _example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("own_loop_example", ROOT / "examples" / "own_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_rank_that_raises_fails_the_run_naming_it(tmp_path):
    runs = tmp_path / "runs"
    p = torchrun_own_loop(tmp_path, "--runs", runs, "--steps", 20, "--fail-step", 5)
    assert p.returncode != 0
    (run_dir,) = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")]
    st = json.loads((run_dir / "status.json").read_text())
    assert st["state"] == "failed" and st["rank"] == 1 and "injected failure at step 5" in st["error"], st


def test_dear_refuses_an_optimizer_over_full_parameters(tmp_path):
    """One line saying why and what to pass instead; nothing is created, the world of one is left."""
    code = (
        "import torch, commlab, torch.distributed as dist\n"
        "m = torch.nn.Linear(4, 2)\n"
        "try:\n"
        "    commlab.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), {'comm': 'dear'}, runs='runs')\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
        "print('initialized', dist.is_initialized())\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert "ERR optimizer: comm.mode dear steps this rank's parameter shards" in p.stdout, p.stdout
    assert "lambda params" in p.stdout and "initialized False" in p.stdout
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


TWO_WRAPS = '''
import sys
import torch
import torch.distributed as dist
import commlab

before = sys.excepthook
for i, spec in enumerate([{"name": "first", "compressor": "none"}, {"name": "second", "compressor": "fp16"}]):
    torch.manual_seed(i)
    model = torch.nn.Linear(4, 2)
    with commlab.wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.1), {**spec, "steps": 3}, runs=sys.argv[1]) as comm:
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            comm.step(loss=loss)
    print(f"rank {comm.rank} wrap {i} {comm.run_id} initialized {dist.is_initialized()} hook {sys.excepthook is before}",
          flush=True)
'''


def test_two_wraps_in_one_job_each_record_their_run(tmp_path):
    """A script that wraps two trainings in a row under torchrun (as a sweep in one job does): the second
    wrap joins a fresh process group on the same rendezvous store instead of waiting for peers on the first
    one's stale keys; each run ends done with both ranks' steps, and the process is left as it was found."""
    script = tmp_path / "two_wraps.py"
    script.write_text(TWO_WRAPS)
    runs = tmp_path / "runs"
    p = torchrun_script(tmp_path, script, runs, timeout=120, env={"COMMLAB_TIMEOUT_S": "30"})
    assert p.returncode == 0, p.stdout[-3000:]
    for r in (0, 1):
        assert f"rank {r} wrap 1 " in p.stdout and f"rank {r} wrap 0 " in p.stdout
    # each wrap destroyed the group it created and gave back the excepthook torch's init had wrapped
    assert "initialized True" not in p.stdout and "hook False" not in p.stdout
    dirs = sorted((d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")),
                  key=lambda d: json.loads((d / "spec.json").read_text())["name"])
    assert [json.loads((d / "spec.json").read_text())["name"] for d in dirs] == ["first", "second"]
    for d in dirs:
        assert json.loads((d / "status.json").read_text())["state"] == "done"
        steps = [m for m in read_jsonl(str(d / "metrics.jsonl")) if m["kind"] == "step"]
        assert sorted((m["rank"], m["step"]) for m in steps) == [(r, s) for r in (0, 1) for s in range(3)]


NO_LOSS = '''
import sys
import torch
import commlab

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
with commlab.wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.1), {"name": "noloss"}, runs=sys.argv[1]) as comm:
    for _ in range(3):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        comm.step()
print(f"rank {comm.rank} ended", flush=True)
'''


def test_a_loop_that_steps_without_loss_ends_done(tmp_path):
    """comm.step() without loss= (it is optional): the run ends done, its summary says the loss was not
    recorded, and `commlab show` and `commlab runs` read it."""
    script = tmp_path / "no_loss.py"
    script.write_text(NO_LOSS)
    runs = tmp_path / "runs"
    p = torchrun_script(tmp_path, script, runs, timeout=120, env={"COMMLAB_TIMEOUT_S": "30"})
    assert p.returncode == 0 and "Traceback" not in p.stdout, p.stdout[-3000:]
    assert "rank 0 ended" in p.stdout and "rank 1 ended" in p.stdout
    (run_dir,) = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    show = cli("show", run_dir.name, "--runs", runs)
    assert show.returncode == 0 and "status         done" in show.stdout, show.stdout
    assert "final loss     not recorded" in show.stdout and "steps          3/3" in show.stdout, show.stdout
    doc = json.loads(cli("show", run_dir.name, "--runs", runs, "--json").stdout)
    assert doc["summary"]["final_loss"] is None and doc["summary"]["steps_done"] == 3
    listed = cli("runs", "--runs", runs)
    assert listed.returncode == 0 and [ln.split()[1] for ln in listed.stdout.splitlines()
                                       if ln.startswith(run_dir.name)] == ["done"], listed.stdout


def _left_without_loss(runs, state):
    """A run directory as a loop that stepped without loss= left it before the summary took such runs: steps
    logged with "loss": null; its index row still running (the summary failed at the final status, after
    status.json was written); status.json ``state``, with a supervisor process that is gone."""
    from commlab.engine import runfiles
    from commlab.engine.spec import JobSpec
    from commlab.lab.base import procs
    from commlab.lab.rundir.store import RunStore
    from commlab.lab.service.queue import Lab
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE, text=True)
    lab = Lab(runs)
    run = lab.create(JobSpec.from_dict({"name": "noloss", "world_size": 2}))
    run.set_status("running", supervisor={"pid": int(gone.stdout), "start": 1},
                   own_loop={"script": "old.py", "model": "Linear", "params": 10, "optimizer": "SGD",
                             "world_size": 2, "host": "h"})
    with open(run.path / runfiles.METRICS, "a") as f:
        for s in range(3):
            for r in (0, 1):
                f.write(json.dumps({"kind": "step", "step": s, "rank": r, "loss": None, "time_ms": 2.0,
                                    "forward_ms": 0.5, "backward_ms": 0.5, "finish_ms": 0.5, "optimizer_ms": 0.5,
                                    "bytes_sent": 40, "bytes_raw": 40, "t": 1000.0 + s}) + "\n")
    if state != "running":
        RunStore(runs).get(run.id).set_status(state, returncode=0)  # status.json only: the index missed it
    assert procs.alive(run.status()["supervisor"]) is False
    return run


@pytest.mark.parametrize("state", ["running", "done"])
def test_a_run_left_by_a_loop_without_loss_shows_and_lists(tmp_path, state):
    """`commlab show` reads such a run; `commlab runs` finds a running one's process gone and marks it failed
    as stale, and lists a done one as done (its index row is written again from status.json)."""
    runs = tmp_path / "runs"
    run = _left_without_loss(runs, state)
    show = cli("show", run.id, "--runs", runs)
    assert show.returncode == 0 and "Traceback" not in show.stdout, show.stdout
    assert "final loss     not recorded" in show.stdout and f"status         {state}" in show.stdout
    listed = cli("runs", "--runs", runs)
    assert listed.returncode == 0 and "Traceback" not in listed.stdout, listed.stdout
    want = "failed" if state == "running" else "done"
    assert [ln.split()[1] for ln in listed.stdout.splitlines() if ln.startswith(run.id)] == [want], listed.stdout
    assert json.loads((run.path / "status.json").read_text())["state"] == want


def test_a_loss_that_is_not_one_number_is_refused_in_one_line(tmp_path):
    """comm.step(loss=...) takes a one-element tensor, a number or None; anything else is refused before the
    step, in one line naming loss."""
    code = (
        "import torch, commlab\n"
        "m = torch.nn.Linear(4, 2)\n"
        "with commlab.wrap(m, lambda ps: torch.optim.SGD(ps, lr=0.1), {}, runs='runs') as comm:\n"
        "    for bad in ('0.5', m(torch.ones(3, 4))):\n"
        "        try:\n"
        "            comm.step(loss=bad)\n"
        "        except TypeError as e:\n"
        "            print('ERR', e)\n"
        "    print('steps', comm.stepper.step)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert "ERR loss: expected a one-element tensor, a number or None, got str" in p.stdout, p.stdout
    assert "ERR loss: expected a one-element tensor, a number or None, got a tensor of 6 elements" in p.stdout
    assert "steps 0" in p.stdout and p.returncode == 0, p.stdout
