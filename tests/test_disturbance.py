"""Every run knows when it was disturbed: other processes' CPU from /proc, the flag, and where it shows."""
import json
import os
import resource
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import commlab
from distutil import stop_warm_servers, warm_servers
from commlab.lab.rundir import disturbance as dist
from commlab.lab.base.paths import INDEX
from commlab.lab.rundir.index import Index
from commlab.lab.service.queue import Lab
from commlab.lab.base.errors import LabError
from commlab.lab.rundir.store import RunStore
from commlab.lab.service import spawn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"name": "cpu", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 20, "batch_size": 16,
        "eval_every": 0, "threads": 1}


# --------------------------------------------------------------------------- a fake /proc

def write_proc(root: Path, busy_total, procs, cpus=2):
    """busy_total: (busy, total) jiffies spread over user/system/idle; procs: pid -> (ppid, u, s, cu, cs)."""
    busy, total = busy_total
    root.mkdir(parents=True, exist_ok=True)
    user, system = busy - busy // 3, busy // 3
    lines = [f"cpu  {user} 0 {system} {total - busy} 0 0 0 0 0 0"]
    lines += [f"cpu{i} 1 0 1 1 0 0 0 0 0 0" for i in range(cpus)]
    (root / "stat").write_text("\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n")
    for d in root.iterdir():
        if d.is_dir() and d.name.isdigit() and int(d.name) not in procs:
            (d / "stat").unlink()
            d.rmdir()
    for pid, (ppid, u, s, cu, cs) in procs.items():
        (root / str(pid)).mkdir(exist_ok=True)
        (root / str(pid) / "stat").write_text(
            f"{pid} (odd) name)) S {ppid} 1 1 0 -1 4194304 0 0 0 0 {u} {s} {cu} {cs} 20 0 1 0 777 0 0\n")


def test_parse_proc_stat_and_pid_stat(tmp_path):
    assert dist.parse_cpu_line("cpu  10 2 5 100 7 1 1 3 4 0") == (10 + 2 + 5 + 1 + 1 + 3, 22 + 100 + 7)
    with pytest.raises(ValueError, match="'cpu' line"):
        dist.parse_cpu_line("cpu0 1 2 3 4")
    p = dist.parse_pid_stat("42 (a (b) c) R 7 42 42 0 -1 0 0 0 0 0 11 4 30 2 20 0 1 0 99 0 0")
    assert p == dist.ProcStat(ppid=7, own=15, children=32)
    write_proc(tmp_path, (300, 1000), {1: (0, 1, 1, 0, 0), 10: (1, 5, 5, 0, 0)}, cpus=3)
    (tmp_path / "self").mkdir()          # not a pid
    (tmp_path / "55").mkdir()            # a process that vanished between listdir and open
    (tmp_path / "56").mkdir()
    (tmp_path / "56" / "stat").write_text("garbage")
    busy, total, cpus = dist.read_machine(str(tmp_path))
    assert (busy, total, cpus) == (300, 1000, 3)
    table = dist.scan(str(tmp_path))
    assert set(table) == {1, 10} and table[10] == dist.ProcStat(1, 10, 0)


def test_tree_counts_descendants_with_what_they_reaped():
    P = dist.ProcStat
    table = {1: P(0, 1000, 0), 100: P(1, 3, 50), 200: P(100, 5, 60), 300: P(200, 40, 0), 301: P(300, 7, 1),
             400: P(1, 500, 0), 401: P(100, 900, 0)}  # 400: someone else's; 401: another child of the supervisor
    assert dist.tree_ticks(table, [200]) == 5 + 60 + 40 + 7 + 1
    assert dist.tree_ticks(table, [200, 300, 999]) == 113  # no double count, a gone root is skipped
    assert dist.tree_ticks(table, []) == 0


def run_fake_sampler(tmp_path, threshold=0.1):
    """A supervisor (100) whose torchrun (200) has two ranks; one rank ends early, then everything is reaped.
    Other processes take 40, 10 and 0 jiffies in the three seconds; capacity is 2 CPUs x 100 jiffies/s."""
    now = [0.0]
    s = dist.Sampler(threshold, root=str(tmp_path), me=100, clock=lambda: now[0])
    steps = [  # (t, busy, total, procs, torchrun alive)
        (0.0, 1000, 5000, {100: (1, 10, 0, 50, 0), 400: (1, 0, 0, 0, 0)}, False),
        (1.0, 1000 + 87 + 40, 5200, {100: (1, 12, 0, 50, 0), 200: (100, 5, 0, 0, 0), 300: (200, 30, 10, 0, 0),
                                      301: (200, 40, 0, 0, 0), 401: (100, 999, 0, 0, 0)}, True),
        (2.0, 1127 + 65 + 10, 5400, {100: (1, 14, 0, 50, 0), 200: (100, 8, 0, 50, 10), 300: (200, 80, 0, 0, 0),
                                     401: (100, 1999, 0, 0, 0)}, True),
        (3.0, 1202 + 24, 5600, {100: (1, 16, 0, 220, 0), 401: (100, 2999, 0, 0, 0)}, False),
    ]
    alive = [False]
    s.roots = lambda: [200] if alive[0] else []
    for i, (t, busy, total, procs, up) in enumerate(steps):
        now[0], alive[0] = t, up
        write_proc(tmp_path, (busy, total), procs)
        s.start() if i == 0 else s.tick()
    return s


def test_sampler_arithmetic_on_fake_proc(tmp_path):
    s = run_fake_sampler(tmp_path)
    assert [x.own for x in s.samples] == [10, 97, 162, 186]  # a state: reaped ranks stay counted
    d = s.result(final=True)
    assert d["cpus"] == 2 and d["samples"] == 4 and d["seconds"] == 3.0
    assert d["other_cpu"] == pytest.approx(50 / 600, abs=1e-4)
    assert d["other_cores"] == pytest.approx(2 * 50 / 600, abs=1e-4)
    assert d["own_cpu_s"] == pytest.approx(176 / dist.CLK_TCK)
    assert d["peak_other_cpu"] == pytest.approx(0.2)
    assert d["disturbed"] is False and d["threshold"] == 0.1 and d["final"] is True
    assert run_fake_sampler(tmp_path / "b", threshold=0.05).result(final=True)["disturbed"] is True
    # the timed steps: [1, 2] had 10 others' jiffies of 200; [1.5, 2.5] half of that, by interpolation
    assert dist.figures(s.samples, 2, 0.1, timed=(1.0, 2.0))["timed_other_cpu"] == pytest.approx(0.05)
    f = dist.figures(s.samples, 2, 0.04, timed=(1.5, 2.5))
    assert f["timed_other_cpu"] == pytest.approx(0.025)
    assert f["disturbed"] is True  # 8% over the run beats a 4% threshold although the timed steps are below
    assert dist.figures(s.samples, 2, 0.09, timed=(0.0, 1.0))["disturbed"] is True  # the timed steps: 20%
    assert dist.figures(s.samples, 2, 0.09, timed=(1.0, 2.0))["disturbed"] is False  # 8% and 5%
    assert dist.figures(s.samples[:1], 2)["other_cpu"] is None


def test_a_job_another_launcher_started_counts_every_local_rank_as_its_own(tmp_path):
    """torchrun --nproc-per-node 2 ... commlab run: torchrun's agent (50) starts two `commlab run`s (100, this
    rank 0 that samples, and 300), each running its worker (200, 400). With the agent as the job's root every
    rank is the run's own; without it, rank 1 counted as another process (91% 'other' in a review)."""
    from commlab.lab.rundir.launcher import JobRank
    proc = tmp_path / "proc"
    now = [0.0]

    def sampled(job_root):
        s = dist.Sampler(0.1, root=str(proc), me=100, clock=lambda: now[0])
        s.job_root = job_root
        s.roots = lambda: [200]
        for i in range(3):
            now[0] = float(i)
            write_proc(proc, (1000 + 180 * i, 5000 + 200 * i), {
                50: (1, 2 * i, 0, 0, 0), 100: (50, 5 * i, 0, 0, 0), 200: (100, 80 * i, 0, 0, 0),
                300: (50, 5 * i, 0, 0, 0), 400: (300, 80 * i, 0, 0, 0), 900: (1, 8 * i, 0, 0, 0)})
            s.start() if i == 0 else s.tick()
        return s.result(final=True)
    joined = sampled(50)
    assert joined["other_cpu"] == pytest.approx(8 / 200, abs=1e-4)  # only 900: the job is 172 of 180 busy
    assert joined["disturbed"] is False
    alone = sampled(None)
    assert alone["other_cpu"] == pytest.approx(95 / 200, abs=1e-4) and alone["disturbed"] is True  # 2+5+80+8
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert JobRank({**env, "LOCAL_WORLD_SIZE": "2"}).local_root() == os.getppid()
    assert JobRank({**env, "LOCAL_WORLD_SIZE": "1"}).local_root() is None  # one rank per machine
    assert JobRank(env).local_root() is None


def set_nice(root: Path, pid: int, nice: int, start: int = 777) -> None:
    """Give fake process ``pid`` a nice value (field 19) and a start time (field 22)."""
    f = root / str(pid) / "stat"
    head, tail = f.read_text().rsplit(")", 1)
    fields = tail.split()
    fields[16], fields[19] = str(nice), str(start)
    f.write_text(head + ") " + " ".join(fields) + "\n")


def observer_sampler(tmp_path, runs, nice, start=777, register=True):
    """A run (torchrun 200 under supervisor 100) beside a UI server (500, with a preview child 501) that uses
    60 of 200 jiffies a second, 30% of the machine; nothing else runs. ``register``: the server is one of
    the lab's observers of ``runs``."""
    proc = tmp_path / "proc"
    now = [0.0]
    s = dist.Sampler(0.1, root=str(proc), me=100, clock=lambda: now[0], runs_root=runs)
    s.roots = lambda: [200]
    for i in range(4):
        now[0] = float(i)
        server = {500: (1, 40 * i, 0, 0, 0), 501: (500, 20 * i, 0, 0, 0)}
        write_proc(proc, (1000 + 110 * i, 5000 + 200 * i),
                   {100: (1, 10, 0, 0, 0), 200: (100, 50 * i, 0, 0, 0), **server})
        set_nice(proc, 500, nice, start=777)
        set_nice(proc, 501, nice, start=778)
        if i == 0 and register:
            (runs / dist.OBSERVERS).mkdir(parents=True, exist_ok=True)
            (runs / dist.OBSERVERS / "500.json").write_text(json.dumps({"pid": 500, "start": start}))
        s.start() if i == 0 else s.tick()
    return s.result(final=True)


def test_the_labs_niced_ui_server_does_not_disturb_a_run(tmp_path):
    d = observer_sampler(tmp_path, tmp_path / "runs", nice=dist.OBSERVER_NICE)
    assert d["disturbed"] is False and d["other_cpu"] == 0.0, d
    assert d["observer_cpu"] == pytest.approx(0.3), d  # reported apart, the preview child included
    label, text = dist.describe(d)
    assert label == "machine" and text.endswith("; the lab's niced UI server used 30%, not counted"), text


@pytest.mark.parametrize("case", ["unregistered", "not niced", "pid reused"])
def test_any_other_busy_process_still_disturbs(tmp_path, case):
    d = observer_sampler(tmp_path, tmp_path / "runs", nice=0 if case == "not niced" else 19,
                         start=12345 if case == "pid reused" else 777, register=case != "unregistered")
    assert d["disturbed"] is True and d["other_cpu"] == pytest.approx(0.3), d
    assert "observer_cpu" not in d


def test_observer_registration_follows_a_real_process(tmp_path):
    assert dist.OBSERVER_NICE == spawn.APP_NICE  # what the server runs at is what is not counted
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=lambda: os.nice(dist.OBSERVER_NICE))
    try:
        path = dist.register_observer(tmp_path, p.pid)
        assert json.loads(path.read_text()) == {"pid": p.pid, "start": dist.start_time(p.pid)}
        assert dist.observers(tmp_path) == [p.pid]
        (tmp_path / dist.OBSERVERS / "77.json").write_text("not json")  # unreadable: names no process
        assert dist.observers(tmp_path) == [p.pid]
    finally:
        p.kill()
        p.wait()
    assert dist.observers(tmp_path) == []  # ended: its file names no running process
    dist.unregister_observer(tmp_path, p.pid)
    dist.unregister_observer(tmp_path, p.pid)  # twice: nothing left to undo
    assert not (tmp_path / dist.OBSERVERS / f"{p.pid}.json").exists()


def test_timed_window_matches_the_summary_median():
    metrics = [{"kind": "step", "step": k, "rank": r, "t": 100.0 + k + 0.1 * r, "time_ms": 500.0}
               for k in range(20) for r in range(2)] + [{"kind": "eval", "t": 200.0}]
    # 20 steps: the first two are warm-up; step 2 started 0.5 s before its end
    assert dist.timed_window(metrics) == pytest.approx((101.5, 119.1))
    assert dist.timed_window([{"kind": "eval", "t": 1.0}]) is None


def test_sampler_writes_while_the_run_goes_on(tmp_path):
    write_proc(tmp_path, (0, 0), {100: (1, 0, 0, 0, 0)})
    now, seen = [0.0], []
    s = dist.Sampler(root=str(tmp_path), me=100, clock=lambda: now[0], on_update=seen.append)
    s.start()
    for k in range(1, 12):
        now[0] = k * 1.0
        write_proc(tmp_path, (50 * k, 200 * k), {100: (1, 0, 0, 0, 0)})
        s.tick()
    assert len(seen) == 2 and all(d["final"] is False for d in seen)
    assert seen[0]["other_cpu"] == pytest.approx(0.25) and seen[0]["disturbed"] is True
    assert s.result(True)["sample_ms"] >= 0


def test_no_proc_means_no_figure(tmp_path):
    s = dist.Sampler(root=str(tmp_path / "missing"))
    s.start()
    d = s.finish()
    assert d["other_cpu"] is None and d["disturbed"] is None
    assert dist.describe(d) == ("machine", "not measured (no CPU figure for this run)")
    assert dist.mark(d) == "-"


def test_words():
    d = {"other_cpu": 0.37, "other_cores": 0.74, "cpus": 2, "threshold": 0.1, "disturbed": True, "final": True,
         "peak_other_cpu": 0.9, "timed_other_cpu": 0.41}
    label, text = dist.describe(d)
    assert label == "disturbed" and text == ("yes: other processes used 37% of the CPU (0.74 of 2 cores) during the "
                                             "run, 41% during the timed steps, peak 90% over 1 s (threshold 10%)")
    q = dict(d, other_cpu=0.004, other_cores=0.008, disturbed=False, final=False, timed_other_cpu=None,
             peak_other_cpu=None)
    assert dist.describe(q) == ("machine", "quiet: other processes used <1% of the CPU (0.01 of 2 cores) during "
                                           "the run so far (threshold 10%)")
    assert dist.mark(d) == "37% disturbed" and dist.mark(q) == "<1%"


def test_threshold_from_lab_json(tmp_path):
    assert dist.threshold(tmp_path) == dist.DEFAULT_THRESHOLD == 0.1
    (tmp_path / "lab.json").write_text(json.dumps({"max_jobs": 1, "disturbance_threshold": 0.25}))
    assert dist.threshold(tmp_path) == 0.25
    for bad in ("10%", 0, 1.5, True):
        (tmp_path / "lab.json").write_text(json.dumps({"disturbance_threshold": bad}))
        with pytest.raises(LabError, match=r"disturbance_threshold must be a fraction of the machine in \(0, 1\]"):
            dist.threshold(tmp_path)


def test_old_index_gains_the_columns(tmp_path):
    store = RunStore(tmp_path)
    run = store.create(commlab.spec(SPEC))
    run.set_status("done", disturbance={"other_cpu": 0.3, "disturbed": True, "threshold": 0.1})
    old_cols = [c for c in Index(store).row_of(run) if c not in ("other_cpu", "disturbed")]
    (tmp_path / INDEX).unlink(missing_ok=True)
    con = sqlite3.connect(tmp_path / INDEX)
    cols = ", ".join(f"{c} {'TEXT PRIMARY KEY' if c == 'id' else ''}" for c in old_cols)  # as commlab made it
    con.execute(f"CREATE TABLE runs ({cols})")
    con.execute("INSERT INTO runs (id, state) VALUES (?, 'done')", (run.id,))
    con.commit()
    con.close()
    rows = Index(store).query()
    assert [(r["id"], r["other_cpu"], r["disturbed"]) for r in rows] == [(run.id, 0.3, 1)]


# --------------------------------------------------------------------------- real runs

def cli(*args, runs, timeout=300, env=None):
    env = dict(env or os.environ, COMMLAB_RUNS=str(runs))
    return subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def real_run(tmp_path, runs, env=None):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = cli("run", str(spec), "--quiet", runs=runs, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = RunStore(runs).list()
    cli_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return r, run, cli_cpu


@pytest.fixture(scope="module")
def busy_run(tmp_path_factory):
    """A real 2-rank run while a busy loop we start burns a core."""
    tmp = tmp_path_factory.mktemp("busy")
    runs = tmp / "runs"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        r, run, _ = real_run(tmp, runs)
    finally:
        busy.kill()
        busy.wait()
    return r, run, runs


def test_busy_neighbour_marks_the_run_disturbed(busy_run):
    r, run, runs = busy_run
    d = run.status()["disturbance"]
    assert d["final"] is True and d["disturbed"] is True, d
    assert d["other_cpu"] > d["threshold"] == 0.1 and d["other_cores"] > 0.2, d
    assert d["timed_other_cpu"] > 0.1, d
    assert "disturbed      yes: other processes used" in r.stdout  # commlab run's summary
    show = cli("show", run.id, runs=runs)
    assert show.returncode == 0 and f"disturbed      yes: other processes used {d['other_cpu']:.0%} of the CPU" \
        in show.stdout, show.stdout
    listing = cli("runs", runs=runs)
    assert "OTHER CPU" in listing.stdout and f"{d['other_cpu']:.0%} disturbed" in listing.stdout, listing.stdout
    (row,) = Lab(runs).index.query()
    assert row["disturbed"] == 1 and row["other_cpu"] == pytest.approx(d["other_cpu"])
    table = commlab.compare([run])
    assert bool(table.loc[run.id, "disturbed"]) is True and table.loc[run.id, "other_cpu"] == d["other_cpu"]


def test_the_ui_warns_about_a_disturbed_run(busy_run, monkeypatch):
    AppTest = pytest.importorskip("streamlit.testing.v1").AppTest
    _, run, runs = busy_run
    monkeypatch.setenv("COMMLAB_RUNS", str(runs))
    d = run.status()["disturbance"]
    at = AppTest.from_file(str(ROOT / "commlab" / "app" / "streamlit_app.py"), default_timeout=120)
    at.query_params["run"] = run.id
    at.run().switch_page("views/live_run.py").run()
    assert not at.exception, [e.value for e in at.exception]
    warned = [w.value for w in at.warning]
    assert any(w.startswith(f"Disturbed run: other processes used {d['other_cpu']:.0%} of the CPU") for w in warned), \
        warned
    at.switch_page("views/compare.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(w.startswith("Disturbed (other processes used the CPU") for w in (x.value for x in at.warning))
    table = at.dataframe[0].value
    assert bool(table.loc[run.id, "disturbed"]) is True and table.loc[run.id, "other_cpu"] == d["other_cpu"]


@pytest.mark.parametrize("ranks", ["warm", "cold"])
def test_every_run_has_the_figure_and_counts_its_own_cpu(tmp_path, ranks):
    """Cold ranks are the CLI's children (their CPU is in its rusage); warm ones are a warm server's of this
    test's own, whose reaped children's CPU is theirs."""
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "lab.json").write_text(json.dumps({"disturbance_threshold": 0.5}))
    t = tmp_path / "t"
    t.mkdir()
    env = dict(os.environ, TMPDIR=str(t), COMMLAB_WARM="1" if ranks == "warm" else "0")
    if ranks == "warm":  # torch imported first, `commlab run` checks its spec itself, not in a child of the server
        site = tmp_path / "site"  # whose reaped children are then the ranks alone
        site.mkdir()
        (site / "sitecustomize.py").write_text("import torch\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    try:
        r, run, cli_cpu = real_run(tmp_path, runs, env)
        if ranks == "warm":
            (server,) = warm_servers(t)
            deadline = time.time() + 10
            while any(p.ppid == server for p in dist.scan().values()) and time.time() < deadline:
                time.sleep(0.1)  # the ranks are reaped once the launcher has read their end
            ranks_cpu = dist.scan()[server].children / os.sysconf("SC_CLK_TCK")
            cli_cpu += ranks_cpu
    finally:
        stop_warm_servers(t)
    d = run.status()["disturbance"]
    assert d["final"] is True and d["threshold"] == 0.5 and d["samples"] >= 2, d
    assert 0 <= d["other_cpu"] <= 1 and isinstance(d["disturbed"], bool) and d["cpus"] == os.cpu_count(), d
    assert d["disturbed"] == (max(d["other_cpu"], d.get("timed_other_cpu") or 0) > 0.5)
    # the ranks count as the run's own, and never more than the whole `commlab run` used; cold, they are most
    # of it (the rest is the CLI's start-up before the job); warm, they start without importing torch, and
    # the CLI's start-up is most of it: then all of the ranks' CPU counts
    assert d["own_cpu_s"] <= 1.05 * cli_cpu + 0.1, (d, cli_cpu)
    if ranks == "cold":
        assert 0.5 * cli_cpu < d["own_cpu_s"], (d, cli_cpu)
    else:
        assert 0.9 * ranks_cpu <= d["own_cpu_s"] and ranks_cpu > 0.1, (d, ranks_cpu)
    label = "disturbed      yes" if d["disturbed"] else "machine        quiet"
    assert label in cli("show", run.id, runs=runs).stdout
    assert d["sample_ms"] < 50, d  # a sample reads /proc/stat and one stat file per process


def test_a_killed_supervisor_leaves_the_figure_so_far(tmp_path):
    runs = tmp_path / "runs"
    spec = tmp_path / "long.json"
    spec.write_text(json.dumps(dict(SPEC, steps=100000)))
    p = subprocess.Popen([sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--quiet", "--runs", str(runs)],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while time.time() - t0 < 90:
            listed = RunStore(runs).list()
            if listed and listed[0].status().get("disturbance"):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("no disturbance figure in status.json after 90 s")
    finally:
        p.kill()
        p.wait()
    (run,) = RunStore(runs).list()
    q = Lab(runs)
    assert q.recover_stale() == [run.id]  # it also stops the ranks the killed supervisor left
    d = run.status()["disturbance"]
    assert d["final"] is False and d["other_cpu"] is not None, d
    assert "during the run so far" in cli("show", run.id, runs=runs).stdout
    (row,) = q.index.query()
    assert row["other_cpu"] == d["other_cpu"]
