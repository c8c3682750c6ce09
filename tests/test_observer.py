"""Watching a run must not slow it down (README, "Watching a run"; bench/observer.py measures it).

- The live panel reads only what was appended to a run's files since its last refresh, and computes
  each step's breakdown once (commlab.lab.analysis.live), with the same figures as plots.step_breakdown.
- `commlab app` runs its Streamlit server niced, and the runs and sweeps the server starts are started
  by the app's own process at normal priority (commlab.lab.service.spawn).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import commlab
from commlab.lab.analysis import live, plots
from commlab.lab.base import procs
from commlab.lab.service.spawn import APP_NICE, ENV, Spawner
from commlab.lab.rundir.store import RunStore
from distutil import stop_process
from commlab.lab.analysis import timelines

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"model": "mlp", "dataset": "digits", "steps": 5, "batch_size": 16, "eval_every": 0, "threads": 1}


# --------------------------------------------------------------------------- a run's files, written by hand

def step_lines(rank: int, step: int, t0: float) -> list:
    """One step of one rank as the engine flushes it: layer spans, a comm span reaching into the next
    step, a wait, then the step's forward/backward/optimizer/step spans (step last)."""
    ts = t0 + step * 10_000.0 + rank * 7.0
    ev = [("forward", 1, ts + 0, 3000, {"layer": "fc1"}), ("forward", 1, ts + 3000, 1000, {"layer": "fc2"}),
          ("backward", 2, ts + 4000, 2500, {"layer": "fc2"}), ("compress", 3, ts + 5000, 300, {"bucket": 0}),
          ("comm", 4, ts + 5400, 6000 if step % 3 == 0 else 2000, {"bucket": 0, "bytes": 4096}),
          ("wait", 5, ts + 7000, 800 + 100 * step, {"bucket": 0}),
          ("forward", 1, ts, 4000, {"step": step}), ("backward", 2, ts + 4000, 2500, {"step": step}),
          ("optimizer", 7, ts + 8000, 500, {"step": step}), ("step", 0, ts, 9000, {"step": step})]
    return [json.dumps({"ph": "X", "name": f"step {step}" if lane == "step" else lane, "pid": rank, "tid": tid,
                        "cat": lane, "ts": t, "dur": d, "args": a}, separators=(",", ":")) + "\n"
            for lane, tid, t, d, a in ev]


def bytes_read(lr) -> int:
    """Every byte a LiveRun has read from its metrics and timeline files."""
    return lr.metrics_tail.bytes_read + sum(r.tail.bytes_read for r in lr.ranks.values())


def metric_line(rank: int, step: int) -> str:
    return json.dumps({"kind": "step", "step": step, "rank": rank, "loss": 1.0 / (step + 1), "time_ms": 9.0,
                       "bytes_sent": 4096, "bytes_raw": 4096, "t": 1000.0 + step}) + "\n"


@pytest.fixture
def fake_run(tmp_path):
    """A run directory in the store (state running, owned by this process) and a writer of its steps."""
    runs = tmp_path / "runs"
    spec = commlab.spec({**SMALL, "steps": 100})
    run = RunStore(runs).create(spec)
    run.set_status("running", supervisor=procs.identity())

    def write(steps, ranks=(0, 1)):
        n = 0
        for s in steps:
            for r in ranks:
                lines = step_lines(r, s, 1e6)
                with open(run.file(f"timeline-rank{r}.jsonl"), "a") as f:
                    f.write("".join(lines))
                with open(run.file("metrics.jsonl"), "a") as f:
                    f.write(metric_line(r, s))
                n += sum(len(x) for x in lines) + len(metric_line(r, s))
        return n
    return runs, run, write


def test_live_run_reads_only_what_was_appended(fake_run):
    runs, run, write = fake_run
    n0 = write(range(0, 10))
    lr = live.LiveRun(run)
    lr.refresh()
    assert bytes_read(lr) == n0
    assert lr.progress() == (10, 100) and len(lr.metric_rows()) == 20
    lr.refresh()
    assert bytes_read(lr) == n0  # nothing new: nothing read
    n1 = write(range(10, 13))
    lr.refresh()
    assert bytes_read(lr) == n0 + n1  # only the appended bytes
    assert lr.progress() == (13, 100) and len(lr.metrics()) == 26
    # a torn last line is not parsed until its end arrives, and is read once
    path = run.file("metrics.jsonl")
    line = metric_line(0, 13)
    with open(path, "a") as f:
        f.write(line[:10])
    lr.refresh()
    assert len(lr.metric_rows()) == 26
    with open(path, "a") as f:
        f.write(line[10:])
    lr.refresh()
    assert len(lr.metric_rows()) == 27 and lr.metric_rows()[-1]["step"] == 13
    assert bytes_read(lr) == n0 + n1 + len(line)
    # a file replaced (a run directory made again) is read from its start
    os.replace(path, path.with_suffix(".old"))
    with open(path, "w") as f:
        f.write(metric_line(0, 0))
    lr.refresh()
    assert [m["step"] for m in lr.metric_rows()] == [0]


def test_opening_finished_or_queued_runs_does_not_make_a_followed_running_run_read_again(fake_run, monkeypatch):
    """The followed runs are one list for the whole server: a student who opens finished runs one after another,
    or a class watching its queued runs, pushed the runs others follow out of it, and each page following a big
    running run then read its files again from their ends on every refresh. A run that had ended, or that no
    page asked for in IDLE_S, goes first, then the one holding the fewest bytes read (a queued run holds none)."""
    runs, run, write = fake_run
    write(range(0, 10))
    monkeypatch.setattr(live, "_LIVE", live.OrderedDict())
    lr = live.live_run(run)
    ended = []
    for _ in range(3 * live.MAX_LIVE):
        other = RunStore(runs).create(commlab.spec(SMALL))
        other.mark_cancelled("finished")
        ended.append(live.live_run(other))
    queued = [live.live_run(RunStore(runs).create(commlab.spec(SMALL))) for _ in range(3 * live.MAX_LIVE)]
    assert live.live_run(run) is lr and bytes_read(lr) == bytes_read(live.live_run(run))  # kept: nothing read again
    assert len(live._LIVE) == live.MAX_LIVE and all(x.ended for x in ended) and not any(x.ended for x in queued)
    for _ in range(live.MAX_LIVE):  # runs going on that hold more than it: it goes
        other = RunStore(runs).create(commlab.spec(SMALL))
        other.set_status("running", supervisor=procs.identity())
        for s in range(20):
            for r in (0, 1):
                with open(other.file(f"timeline-rank{r}.jsonl"), "a") as f:
                    f.write("".join(step_lines(r, s, 1e6)))
        live.live_run(other)
    assert len(live._LIVE) == live.MAX_LIVE and lr not in live._LIVE.values()
    for x in live._LIVE.values():  # nobody follows those any more: they hold their place no longer
        x.used -= live.IDLE_S + 1
    small = RunStore(runs).create(commlab.spec(SMALL))
    small.set_status("running", supervisor=procs.identity())
    a, b = live.live_run(run), live.live_run(small)  # two pages following runs that hold less than each of them
    for _ in range(3):
        assert live.live_run(run) is a and live.live_run(small) is b


def test_live_breakdown_is_step_breakdown_computed_once_per_step(fake_run, monkeypatch):
    runs, run, write = fake_run
    write(range(0, 8))
    lr = live.LiveRun(run)
    lr.refresh()
    calls = []
    real = live.breakdown_rows
    monkeypatch.setattr(live, "breakdown_rows", lambda ev: calls.append(len(ev)) or real(ev))
    bd = lr.breakdown()
    # the last step waits for its successor (a span of step k can be written with step k+1)
    assert sorted(set(bd["step"])) == list(range(7))
    full = plots.step_breakdown(run.timeline()).sort_values(["rank", "step"], ignore_index=True)
    want = full[full["step"] < 7].reset_index(drop=True)
    assert np.allclose(bd[live.BREAKDOWN_COLUMNS].to_numpy(float), want[live.BREAKDOWN_COLUMNS].to_numpy(float))
    assert bd["exposed_comm_ms"].gt(0).any() and bd["hidden_comm_ms"].gt(0).any()
    n = len(calls)
    lr.refresh()
    lr.breakdown()
    assert len(calls) == n  # nothing new: nothing recomputed
    write(range(8, 10))
    lr.refresh()
    bd = lr.breakdown(steps=5)
    assert sorted(set(bd["step"])) == [4, 5, 6, 7, 8]
    assert sum(calls[n:]) < sum(len(step_lines(0, 0, 0)) for _ in range(2 * 5))  # only the new steps' events
    final = lr.breakdown(final=True)
    full = plots.step_breakdown(run.timeline()).sort_values(["rank", "step"], ignore_index=True)
    assert np.allclose(final[live.BREAKDOWN_COLUMNS].to_numpy(float), full[live.BREAKDOWN_COLUMNS].to_numpy(float))
    # the timeline of the last steps is the end of the full timeline
    tl = lr.timeline(2)
    assert set(tl["step"].dropna().astype(int)) == {8, 9}
    assert tl["start_us"].max() == run.timeline()["start_us"].max()


def test_a_late_reader_starts_near_the_end(fake_run):
    runs, run, write = fake_run
    write(range(0, 1000))
    lr = live.LiveRun(run, keep=16)
    lr.refresh()
    size = sum(p.stat().st_size for p in run.timeline_files())
    assert bytes_read(lr) - run.file("metrics.jsonl").stat().st_size < size / 4
    assert len(lr.timeline(16)[lambda d: d["lane"] == "step"]) == 32  # 16 steps of two ranks
    assert sorted(set(lr.breakdown(final=True)["step"]))[-1] == 999


def test_live_panel_refresh_reads_only_new_bytes(fake_run, monkeypatch):
    """The Live run page's panel (AppTest: the script runs in this process) reads a running run's files
    incrementally: a refresh after a few more steps reads those steps' bytes and no more."""
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest
    runs, run, write = fake_run
    monkeypatch.setenv("COMMLAB_RUNS", str(runs))
    live._LIVE.clear()
    write(range(0, 30))
    at = AppTest.from_file(str(ROOT / "commlab" / "app" / "streamlit_app.py"), default_timeout=120)
    at.query_params["run"] = run.id
    at.run().switch_page("views/live_run.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.get("plotly_chart")) == 5  # the four charts and the explanation's critical path
    (lr,) = live._LIVE.values()
    before = bytes_read(lr)
    assert before == sum(p.stat().st_size for p in run.path.glob("*.jsonl"))
    added = write(range(30, 33))
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert bytes_read(lr) - before == added
    assert lr.progress() == (33, 100)


# --------------------------------------------------------------------------- priorities

def nice_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def children_of(pid: int) -> list:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except OSError:
                continue
    return out


NICED_CHILD = textwrap.dedent("""
    import os, sys
    os.nice({nice})
    from commlab.lab.service.spawn import spawn_detached
    print(spawn_detached([sys.executable, "-c", "import time; time.sleep(60)"], {log!r}), flush=True)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_niced_process_gets_its_children_started_at_normal_priority(tmp_path):
    log = tmp_path / "child.log"
    base = nice_of(os.getpid())
    want = min(base + APP_NICE, 19)
    started = []
    with Spawner() as sp:
        try:
            for env, expect in (({ENV: sp.address}, base), ({}, want)):  # through the spawner, then without it
                e = {k: v for k, v in os.environ.items() if k != ENV}
                out = subprocess.run([sys.executable, "-c", NICED_CHILD.format(nice=APP_NICE, log=str(log))],
                                     env={**e, **env, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT), check=True,
                                     capture_output=True, text=True, timeout=60)
                pid = int(out.stdout.split()[-1])
                started.append(pid)
                assert nice_of(pid) == expect
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                assert ENV.encode() not in environ  # its own children it starts itself
            assert started[0] in sp.started and started[1] not in sp.started
        finally:
            for pid in started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_app_server_is_niced_and_the_runs_it_starts_are_not(tmp_path):
    """`commlab app` (commlab.lab.front.appserver.app_main): its Streamlit server runs APP_NICE levels lower, its session's
    scheduling group too; a run queued from
    inside the server (as the New run form and presets do: commlab.run(wait=False)) gets a supervisor at the
    app's normal priority, started by the app's process."""
    runs = tmp_path / "runs"
    port = free_port()
    code = f"import sys; from commlab.lab.front.appserver import app_main; sys.exit(app_main({port}, {str(runs)!r}, demo=False))"
    app = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_id = None
    try:
        t0 = time.time()
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                    break
            except OSError:
                assert app.poll() is None and time.time() - t0 < 90, "the UI did not come up"
                time.sleep(0.3)
        (server,) = children_of(app.pid)
        assert nice_of(server) == min(nice_of(app.pid) + APP_NICE, 19)
        assert all(nice_of(int(t)) == nice_of(server) for t in os.listdir(f"/proc/{server}/task"))
        # a session of its own, whose scheduling group is niced as well: with autogroups a nice value only
        # ranks processes within their session, and every run has its own (commlab/lab/service/spawn.py)
        assert os.getsid(server) == server != os.getsid(app.pid)
        if Path("/proc/sys/kernel/sched_autogroup_enabled").exists():
            assert Path(f"/proc/{server}/autogroup").read_text().split()[-1] == str(APP_NICE)
        environ = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{server}/environ").read_bytes().split(b"\0") if kv)
        # what the server's pages do to queue a run, in a process with the server's priority and environment
        env = {k.decode(): v.decode() for k, v in environ.items()}
        submit = ("import os, commlab; os.nice(%d); r = commlab.run(%r, wait=False, runs=%r); "
                  "print(r.id, r.status()['supervisor']['pid'], flush=True)" % (APP_NICE, SMALL, str(runs)))
        out = subprocess.run([sys.executable, "-c", submit], env=env, cwd=str(ROOT), capture_output=True,
                             text=True, timeout=120, check=True)
        run_id, sup = out.stdout.split()
        sup = int(sup)
        if procs.start_time(sup) is not None:  # a tiny run may be over already
            assert nice_of(sup) == nice_of(app.pid)
            assert int(Path(f"/proc/{sup}/stat").read_text().rsplit(")", 1)[1].split()[1]) == app.pid
        assert commlab.wait(run_id, runs=runs, timeout=240) == "done"
    finally:
        if run_id and commlab.get(run_id, runs=runs).state not in ("done", "failed", "cancelled", "diverged"):
            commlab.cancel(run_id, runs=runs)
            commlab.wait(run_id, runs=runs, timeout=60)
        stop_process(app, signal.SIGINT, timeout=30, group=True)


def test_run_breakdown_of_a_running_run_reads_incrementally(fake_run):
    """commlab.lab.analysis.timelines.run_breakdown (the results page's per-run breakdown) follows a running run through
    commlab.lab.analysis.live: the same mean as plots.step_breakdown over the same steps, and a second call reads nothing
    new."""
    from commlab.lab.rundir.summary import warmup_steps
    runs, run, write = fake_run
    live._LIVE.clear()
    write(range(0, 20))
    got = timelines.run_breakdown(run)
    full = plots.step_breakdown(run.timeline())
    steps = full[full["step"] < 19]  # the last step waits for its successor's events
    want = plots.mean_breakdown(steps, skip=warmup_steps(20))
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k]) for k in want)
    (lr,) = live._LIVE.values()
    n = bytes_read(lr)
    assert timelines.run_breakdown(run) == got and bytes_read(lr) == n


def test_app_server_skips_the_full_gc_after_every_rerun_and_the_file_polling():
    """Streamlit's defaults: gc.collect(2) after every script run (fragment refreshes included) and polling
    every imported source file; each cost a refreshing page's server more than the page's own work."""
    from commlab.lab.front import appserver
    argv = appserver.app_argv(8600)
    opts = dict(zip(argv[5::2], argv[6::2]))
    assert opts["--runner.postScriptGC"] == "false" and opts["--server.fileWatcherType"] == "none"


# --------------------------------------------------------------------------- bench/observer.py

def test_observer_bench_reads_the_cpu_of_the_timed_steps_apart(monkeypatch):
    """The CPU trace interpolates between samples, so the observer's CPU over the timed steps alone is read
    apart from the page's first render at Start; the report shows it beside the whole run's."""
    from bench import observer
    tr = observer.CpuTrace.__new__(observer.CpuTrace)
    tr.samples = [(0.0, {"server": 0.0, "browser": 0.0}), (10.0, {"server": 1.0, "browser": 4.0}),
                  (20.0, {"server": 1.5, "browser": 4.5})]
    assert tr.at(5.0, "browser") == pytest.approx(2.0) and tr.at(99.0, "server") == 1.5
    assert tr.between(10.0, 20.0, "browser") == pytest.approx(0.5)  # the first render (4 s) is not in it
    monkeypatch.setattr(observer, "others", lambda r: 0.0)
    runs = [dict(mode="dear", round=1, watched=w, iter_ms=ms, observer_cpu_pct=cpu, observer_cpu_timed_pct=timed,
                 page_updates=4, page_max_gap_s=2.0, charts_max_gap_s=8.0)
            for w, ms, cpu, timed in ((False, 100.0, 1.0, None), (True, 102.0, 24.0, 11.0))]
    table, summary = observer.report(runs, ["dear"])
    assert summary["dear"]["median_ratio"] == pytest.approx(1.02) and summary["dear"]["observer_cpu_pct_timed"] == 11.0
    assert "| dear | 100.0 | 102.0 | 1.020 | **1.020** | 24% (1%) | 11% |" in table


def test_observer_bench_opens_the_page_at_start_unless_told(capsys):
    from bench import observer
    with pytest.raises(SystemExit):
        observer.main(["--help"])
    out = capsys.readouterr().out
    assert "--open-before" in out and "default: at Start" in out.replace("\n", " ").replace("  ", " ")
