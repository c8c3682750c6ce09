"""Lab orchestration: queue limit, fault handling, stale launchers, the index, bad input, divergence."""
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import commlab
from commlab.lab.base import procs
from commlab.lab.front.cli import main as cli
from commlab.lab.service.queue import Lab
from commlab.lab.rundir.store import RunError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"name": "q", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 5, "batch_size": 16,
         "eval_every": 0, "threads": 1}
LONG = dict(SMALL, name="long", steps=100000)


def wait_for(pred, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def job_processes(run):
    """Every recorded process of a run that is still alive (ranks, torchrun, supervisor)."""
    st = run.status()
    idents = run.worker_pids() + [st.get("torchrun"), st.get("supervisor")]
    return [i for i in idents if procs.alive(i)]


def test_queue_limit_holds_and_all_finish(tmp_path):
    q = Lab(tmp_path, max_jobs=2)
    runs = [q.submit(commlab.spec(dict(SMALL, seed=i)), wait=False) for i in range(4)]  # two waves of the limit
    peak = 0
    t0 = time.time()
    while time.time() - t0 < 240:
        states = [r.state for r in runs]
        peak = max(peak, states.count("running"))
        if all(s in ("done", "failed", "cancelled") for s in states):
            break
        time.sleep(0.05)
    assert [r.state for r in runs] == ["done"] * 4
    # also from the recorded times: at no moment were more than two jobs between start and end
    spans = [(r.status()["started"], r.status()["ended"]) for r in runs]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    level = top = 0
    for _, d in events:
        level += d
        top = max(top, level)
    assert peak <= 2 and top <= 2, (peak, top)
    assert top == 2  # and the limit was used


def test_kill9_of_a_rank_fails_naming_it_and_leaves_nothing(tmp_path):
    """The launcher starts both ranks itself (no torchrun on one machine); one killed with SIGKILL fails the
    run naming it, the other is stopped."""
    q = Lab(tmp_path, max_jobs=1)
    run = q.submit(commlab.spec(LONG), wait=False)
    wait_for(lambda: len(run.worker_pids()) == 2 and run.state == "running"
             and any(m["kind"] == "step" for m in run.metric_rows()), 60, "the run to train")
    st = run.status()
    assert "torch.distributed.run" not in st["argv"] and len(st["torchruns"]) == 2, st
    assert {p["pid"] for p in run.worker_pids()} == {p["pid"] for p in st["torchruns"]}
    victim = next(p for p in run.worker_pids() if p["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    # a hang guard, not a timing: far below the 300 s collective timeout, so a run that only failed
    # when the survivor's collective timed out would not pass
    wait_for(lambda: run.state == "failed", 120, "status failed")
    st = run.status()
    assert st["rank"] == 1 and "SIGKILL" in st["error"], st
    wait_for(lambda: not job_processes(run), 10, "every process of the job to end")
    assert run.metric_rows(), "metrics logged before the kill are kept"


def test_one_rank_runs_without_torchrun_and_its_kill9_is_named(tmp_path):
    """A one-rank run starts its worker directly (torchrun would import torch first, only to start one
    process): it trains like any run; killed with SIGKILL it fails naming rank 0 and the signal."""
    q = Lab(tmp_path, max_jobs=1)
    done = q.submit(commlab.spec(dict(SMALL, world_size=1)), wait=True)
    assert done.state == "done", done.log_tail()
    assert "torch.distributed.run" not in done.status()["argv"] and "commlab.engine.worker" in done.status()["argv"]
    assert len([m for m in done.metric_rows() if m["kind"] == "step"]) == 5
    run = q.submit(commlab.spec(dict(LONG, world_size=1)), wait=False)
    wait_for(lambda: len(run.worker_pids()) == 1 and run.state == "running"
             and any(m["kind"] == "step" for m in run.metric_rows()), 60, "the run to train")
    os.kill(run.worker_pids()[0]["pid"], signal.SIGKILL)
    wait_for(lambda: run.state == "failed", 60, "status failed")
    st = run.status()
    assert st["rank"] == 0 and "SIGKILL" in st["error"], st
    wait_for(lambda: not job_processes(run), 10, "every process of the job to end")


def test_killed_launcher_is_marked_stale_and_stops_its_job(tmp_path):
    spec = tmp_path / "long.json"
    spec.write_text(json.dumps(LONG))
    runs = tmp_path / "runs"
    p = subprocess.Popen([sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--quiet", "--runs", str(runs)],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    q = Lab(runs)
    run = wait_for(lambda: next(iter(q.store.list()), None), 30, "the run directory")
    wait_for(lambda: run.state == "running" and run.metric_rows(), 60, "training to start")
    p.kill()  # SIGKILL: the launcher gets no chance to clean up
    p.wait()
    wait_for(lambda: not job_processes(run), 15, "the job to stop with its launcher")
    assert run.state == "running"  # nobody was left to say otherwise
    assert q.recover_stale() == [run.id]
    assert run.state == "failed" and "stale" in run.status()["error"]
    assert run.metric_rows()  # everything logged before stays readable
    r = subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "show", run.id, "--runs", str(runs)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "failed" in r.stdout


def test_cancel_in_every_state(tmp_path):
    q = Lab(tmp_path, max_jobs=1)
    running = q.submit(commlab.spec(LONG), wait=False)
    queued = q.submit(commlab.spec(dict(LONG, seed=1)), wait=False)
    wait_for(lambda: running.state == "running" and running.worker_pids(), 60, "the first run to start")
    assert queued.state == "queued"
    q.cancel(queued.id)
    assert q.wait(queued.id, timeout=15) == "cancelled"
    q.cancel(running.id)
    assert q.wait(running.id, timeout=30) == "cancelled"
    wait_for(lambda: not job_processes(running), 15, "the cancelled job's processes to end")
    assert q.cancel(running.id) == "cancelled"  # cancelling a finished run changes nothing


def test_nan_loss_gives_diverged(tmp_path):
    run = commlab.run(dict(SMALL, steps=20, fault={"kind": "nan", "step": 7, "rank": 1}), runs=tmp_path)
    st = run.status()
    assert st["state"] == "diverged" and st["step"] == 7, st
    assert "diverged at step 7" in st["error"]


def test_index_rebuilds_from_directories(tmp_path):
    q = Lab(tmp_path)
    a = commlab.run(SMALL, runs=tmp_path)
    b = commlab.run(dict(SMALL, fault={"kind": "raise", "step": 2, "rank": 0}), runs=tmp_path)
    before = {r["id"]: (r["state"], r["iter_ms"]) for r in q.index.query()}
    assert before[a.id][0] == "done" and before[b.id][0] == "failed"
    for suffix in ("", "-wal", "-shm"):
        Path(str(q.index.path) + suffix).unlink(missing_ok=True)
    assert q.reindex() == 2
    after = {r["id"]: (r["state"], r["iter_ms"]) for r in q.index.query()}
    assert after == before
    q.index.path.write_bytes(b"this is not a database")  # damaged: rebuilt on first use
    assert {r["id"] for r in q.index.query()} == {a.id, b.id}
    importlib.import_module("commlab.lab.front.sweep")  # importing the lab's modules must not shadow the commlab.compare function
    df = commlab.compare(commlab.runs(runs=tmp_path))
    assert list(df.index) == [a.id, b.id] and df.loc[a.id, "state"] == "done"
    assert not a.metrics().empty and not a.timeline().empty and a.summary().loc[a.id, "state"] == "done"


MALFORMED = [
    "[1, 2", "just a string", "42", "- a\n- b", "model: [1]", "steps: many", "steps: -1", "steps: 0",
    "batch_size: 0", "world_size: 0", "world_size: 2.5", "seed: -3", "model: vgg", "dataset: imagenet",
    "optimizer: {name: lbfgs}", "optimizer: {lr: 0}", "optimizer: {name: adam, momentum: 0.9}",
    "compressor: {name: topk, ratio: 2}", "compressor: {name: topk, ratio: 0}", "compressor: {name: qsgd, levels: 0}",
    "compressor: {name: powersgd, rank: 0}", "compressor: {name: efsignsgd, error_feedback: true}",
    "schedule: {name: bucket, cap_mb: -1}", "comm: {mode: teleport}", "network: {link: carrier-pigeon}",
    "model: transformer\ndataset: digits", "eval_every: -1", "timeline: maybe", "backend: nccl\ndevice: cpu",
    "unknown_field: 1",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_specs_get_one_line_and_change_nothing(tmp_path, capsys, text):
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    runs = tmp_path / "runs"
    assert cli(["run", str(spec), "--runs", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("commlab: error:"), err
    assert not runs.exists()


HOSTILE = ["../x", "../../etc/passwd", "/etc/passwd", "..", ".", "a/b", "a\\b", "~root", "x" * 300, "-rf",
           "run\x00id", " spaced", "%2e%2e%2f"]


@pytest.mark.parametrize("run_id", HOSTILE[:10] + HOSTILE[10:])
@pytest.mark.parametrize("cmd", ["show", "trace", "cancel"])
def test_hostile_run_ids_are_refused(tmp_path, capsys, run_id, cmd):
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "spec.json").write_text("{}")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    argv = [cmd, "--runs", str(runs), "--", run_id] + (["-o", str(tmp_path / "t.json")] if cmd == "trace" else [])
    if cmd == "trace":
        argv = [cmd, "--runs", str(runs), "-o", str(tmp_path / "t.json"), "--", run_id]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    with pytest.raises(RunError):
        Lab(runs).store.get(run_id)


def test_wait_leaves_the_index_agreeing_with_the_final_state(tmp_path):
    """A supervisor writes status.json, then the index; between the two, wait() may already see the final
    state. After wait returns, commlab.runs(state=...) holds the run (a race the form test once lost)."""
    from commlab.lab.rundir.store import RunStore
    from commlab.lab.base.specs import load_spec
    lab_ = Lab(tmp_path)
    run = lab_.create(load_spec(data={"name": "idx", "model": "mlp", "dataset": "digits", "steps": 1}))
    bare = RunStore(tmp_path).get(run.id)  # no on_change: status.json moves, the index does not
    bare.set_status("done")
    assert run.id not in {r["id"] for r in lab_.index.query(state="done")}
    assert lab_.wait(run.id, timeout=5) == "done"
    assert run.id in {r.id for r in commlab.runs(runs=tmp_path, state="done")}


def test_a_row_left_behind_its_final_status_is_written_again(tmp_path):
    """A process that died between status.json and the index left its run listed as running: the next listing
    (commlab.runs, `commlab runs`: each recovers stale runs first) writes the row again from the directory."""
    from commlab.lab.rundir.store import RunStore
    from commlab.lab.base.specs import load_spec
    lab_ = Lab(tmp_path)
    run = lab_.create(load_spec(data={"name": "idx", "model": "mlp", "dataset": "digits", "steps": 1}))
    run.set_status("running")
    RunStore(tmp_path).get(run.id).set_status("done")  # status.json only
    assert lab_.index.states()[run.id] == "running"
    assert run.id in {r.id for r in commlab.runs(runs=tmp_path, state="done")}
    assert lab_.index.states()[run.id] == "done"


CPU_VERSION = "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n"


def test_the_default_queue_length_reads_the_torch_build_without_importing_torch():
    """A detached supervisor asks for the default number of jobs: on a CPU build of torch it does not import
    torch for it (three seconds of CPU on a small machine); a CUDA or ROCm build, or a version file it cannot
    read, leaves the answer to torch."""
    from commlab.lab.service.queue import gpu_build
    assert gpu_build(CPU_VERSION) is False
    assert gpu_build(CPU_VERSION.replace("cuda: Optional[str] = None", "cuda: Optional[str] = '12.8'")) is True
    assert gpu_build("__version__ = '2.5.0'\ncuda = None\nhip = '6.2.4'\n") is True
    assert gpu_build("__version__ = '2.5.0'\n") is True
    if gpu_build():
        pytest.skip("this torch is built for a GPU: the default asks torch")
    code = ("import sys; from commlab.lab.service.queue import default_max_jobs; n = default_max_jobs(); "
            "print(n, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == [str(max(1, (os.cpu_count() or 1) // 2)), "False"], out


def test_a_run_made_for_another_takes_its_owner_and_limits(tmp_path):
    """A trial, profiling or search run that the lab makes for a run (strategy auto's, a tuning schedule's under
    fault tolerance) is that run's owner's and under its limits: in a room, a student's memory per rank and wall
    time bound it as they bound the run itself."""
    from commlab.lab.base.specs import load_spec
    from commlab.lab.rundir.store import RunStore
    store = RunStore(tmp_path)
    spec = load_spec(data={"model": "mlp", "dataset": "digits", "steps": 5})
    run = store.create(spec, owner="alice", rank_limit_mb=300, rank_limit_from="quota", wall_limit_s=60.0)
    assert run.inherited() == {"owner": "alice", "rank_limit_mb": 300, "rank_limit_from": "quota",
                               "wall_limit_s": 60.0}
    helper = store.create(spec, **run.inherited())
    st = helper.status()
    assert (st["owner"], st["rank_limit_mb"], st["wall_limit_s"]) == ("alice", 300, 60.0)
    assert store.create(spec, owner="bob").inherited() == {"owner": "bob"}


def test_the_api_names_a_bad_filter_or_spec_instead_of_answering_nothing(tmp_path):
    """``commlab.runs(state="bogus")`` was an empty list, and ``commlab.run(42)`` looked for a file named 42."""
    from commlab.engine.spec import SpecError
    with pytest.raises(ValueError, match=r"^state: 'bogus' is not a state; allowed: queued, running, done, failed, "
                                         r"cancelled, diverged$"):
        commlab.runs(runs=tmp_path, state="bogus")
    with pytest.raises(ValueError, match="^colour: not a filter; allowed: "):
        commlab.runs(runs=tmp_path, colour="red")
    assert commlab.runs(runs=tmp_path, state="done") == []
    with pytest.raises(SpecError, match=r"^spec: a file path, a mapping of fields or a JobSpec, got int$"):
        commlab.run(42, runs=tmp_path)
    assert commlab.spec(ROOT / "examples" / "demo.yaml").name == "demo-cnn-digits"  # a Path is a path


def test_a_logs_tail_is_read_from_its_end(tmp_path):
    run = Lab(tmp_path).create(commlab.spec({"model": "mlp", "dataset": "digits", "steps": 1}))
    run.file("log.txt").write_text("".join(f"line {i} {'x' * 60}\n" for i in range(40_000)))  # 2.6 MB
    assert run.log_tail(3) == "".join(f"line {i} {'x' * 60}\n" for i in range(39_997, 40_000))
    assert run.log_tail(3, max_bytes=100) == f"line 39999 {'x' * 60}\n"  # what fits, whole lines only
    run.file("log.txt").write_text("one\ntwo")
    assert run.log_tail(5) == "one\ntwo" and Lab(tmp_path).create(commlab.spec(
        {"model": "mlp", "dataset": "digits", "steps": 1})).log_tail() == ""
