"""Warm ranks (commlab.lab.base.warm): a rank forked by the warm server runs as a rank the launcher started itself
would (environment, working directory, session, log, priority, the same training), its launcher's death ends
it, its CPU counts as the run's own, and the server refuses what would not be safe and leaves when idle."""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import commlab
from distutil import stop_warm_servers, warm_servers
from commlab.lab.base import procs, warm

ROOT = Path(__file__).resolve().parent.parent
SPEC = {"model": "probe_model:build", "dataset": "digits", "world_size": 2, "steps": 4, "batch_size": 16,
        "eval_every": 0, "threads": 1}
PROBE = '''
import json, os, sys
import torch.nn as nn

def build(info=None, **kw):
    out = os.environ.get("WARM_PROBE")
    if out and "RANK" in os.environ:  # in a rank, not when the lab checks the spec
        with open(f"{out}-{os.environ['RANK']}.json", "w") as f:
            json.dump({"value": os.environ.get("WARM_PROBE_VALUE"), "cwd": os.getcwd(), "path0": sys.path[0],
                       "sid": os.getsid(0), "pid": os.getpid(), "ppid": os.getppid(), "nice": os.nice(0),
                       "stdout": os.readlink("/proc/self/fd/1"), "stdin": os.readlink("/proc/self/fd/0"),
                       "omp": os.environ.get("OMP_NUM_THREADS")}, f)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
'''


@pytest.fixture
def private(tmp_path, monkeypatch, forget_modules):
    """A warm server of this test's own (its directory under tmp_path), stopped at the end; the probe model
    importable by the ranks (PYTHONPATH) and here (the spec check)."""
    forget_modules("probe_model")
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe_model.py").write_text(textwrap.dedent(PROBE))
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.setenv("PYTHONPATH", str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = tmp_path / "t"
    t.mkdir()
    monkeypatch.setenv("TMPDIR", str(t))
    monkeypatch.setattr(tempfile, "tempdir", str(t))
    monkeypatch.delenv(warm.ENV, raising=False)
    yield tmp_path
    stop_warm_servers(t)


def probes(prefix: Path):
    return [json.loads(Path(f"{prefix}-{r}.json").read_text()) for r in (0, 1)]


def losses(run):
    return [(m["step"], m["rank"], m["loss"]) for m in sorted(run.metric_rows(), key=lambda m: (m["step"], m["rank"]))
            if m["kind"] == "step"]


def test_a_warm_rank_runs_as_a_rank_started_by_the_launcher(private, monkeypatch):
    tmp = private
    monkeypatch.setenv("WARM_PROBE_VALUE", "from-the-launcher")
    seen = {}
    for mode in ("warm", "cold"):
        monkeypatch.setenv(warm.ENV, "1" if mode == "warm" else "0")
        monkeypatch.setenv("WARM_PROBE", str(tmp / mode))
        run = commlab.run({**SPEC, "name": mode}, runs=tmp / "runs")
        assert run.state == "done", run.log_tail()
        seen[mode] = (probes(tmp / mode), run)
    (server,) = warm_servers(tmp / "t")
    for mode, (ranks, run) in seen.items():
        for p in ranks:
            assert p["value"] == "from-the-launcher" and p["omp"] == "1"
            assert p["cwd"] == os.getcwd() and p["path0"] == os.getcwd()
            assert p["sid"] == p["pid"], "each rank in a session of its own"
            assert p["nice"] == os.nice(0) and p["stdin"] == "/dev/null"
            assert p["stdout"] == str(run.file("log.txt"))
            # warm: forked by the server; cold: a child of this process, which supervised the run
            assert p["ppid"] == (server if mode == "warm" else os.getpid()), (mode, p)
        assert {p["pid"] for p in ranks} == {i["pid"] for i in run.status()["torchruns"]}
    assert losses(seen["warm"][1]) == losses(seen["cold"][1])  # the same training, bit for bit
    assert seen["warm"][1].log_tail().count("[commlab] rank 0:") == 1


def test_a_relative_runs_directory_works_warm(private, monkeypatch):
    """``commlab predict`` with its default runs directory (``./runs``, relative) made a profiling run whose warm
    ranks failed at once with an empty log: the server opened the relative log path from its own working
    directory ("/"). The launcher's directory is the one that counts."""
    tmp = private
    monkeypatch.chdir(tmp)
    monkeypatch.setenv(warm.ENV, "1")
    monkeypatch.setenv("WARM_PROBE", str(tmp / "rel"))
    run = commlab.run({**SPEC, "name": "relative"}, runs="runs")
    assert run.state == "done", (run.status().get("error"), run.log_tail())
    assert warm_servers(tmp / "t"), "the ranks were not the warm server's"
    assert all(p["stdout"] == str((tmp / "runs" / run.id / "log.txt").resolve()) for p in probes(tmp / "rel"))


def test_a_niced_launcher_gets_niced_warm_ranks(private, monkeypatch):
    """The server runs at its starter's priority; a launcher at a lower one gets its ranks lowered to it."""
    tmp = private
    spec = tmp / "spec.json"
    spec.write_text(json.dumps(SPEC))
    env = dict(os.environ)
    for name, nice in (("first", 0), ("niced", 5)):
        env["WARM_PROBE"] = str(tmp / name)
        r = subprocess.run(["nice", "-n", str(nice), sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec),
                            "--quiet", "--runs", str(tmp / "runs")], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    (server,) = warm_servers(tmp / "t")
    assert [p["nice"] for p in probes(tmp / "first")] == [os.nice(0)] * 2
    assert [p["nice"] for p in probes(tmp / "niced")] == [os.nice(0) + 5] * 2
    assert {p["ppid"] for p in probes(tmp / "niced")} == {server}


def test_a_killed_launcher_ends_its_warm_ranks(private):
    tmp = private
    spec = tmp / "long.json"
    spec.write_text(json.dumps({**SPEC, "model": "mlp", "steps": 100000}))
    p = subprocess.Popen([sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--quiet", "--runs",
                          str(tmp / "runs")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        run = None
        while time.time() < deadline:
            run = next(iter(commlab.runs(runs=tmp / "runs")), None)
            if run and run.state == "running" and run.metric_rows() and len(run.worker_pids()) == 2:
                break
            time.sleep(0.2)
        ranks = run.worker_pids()
        assert {procs.cmdline(r["pid"]).split(" -m ")[1].split()[0] for r in ranks} == {warm.MARK}
    finally:
        p.kill()  # SIGKILL: the launcher says nothing; its connections to the server close
        p.wait()
    deadline = time.time() + 15
    while any(procs.alive(r) for r in ranks) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(procs.alive(r) for r in ranks)
    assert warm_servers(tmp / "t"), "the server itself goes on"


def test_the_server_leaves_when_idle(private, monkeypatch):
    tmp = private
    monkeypatch.setenv("COMMLAB_WARM_IDLE_S", "1")
    run = commlab.run({**SPEC, "model": "mlp"}, runs=tmp / "runs")
    assert run.state == "done", run.log_tail()
    (server,) = warm_servers(tmp / "t")
    deadline = time.time() + 30
    while procs.start_time(server) is not None and time.time() < deadline:
        [p.poll() for p in warm._started]  # reap it (this process started it)
        time.sleep(0.2)
    assert not warm_servers(tmp / "t") and not list((tmp / "t").glob("commlab-warm-*/*.sock"))


def test_a_directory_others_may_enter_is_refused(private, capfd):
    d = Path(tempfile.gettempdir()) / f"commlab-warm-{os.getuid()}"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    assert warm.ready() is None
    assert "not a private directory" in capfd.readouterr().err
    assert not list(d.iterdir())


def test_off_means_every_rank_is_the_launchers(private, monkeypatch):
    monkeypatch.setenv(warm.ENV, "0")
    assert warm.ready() is None and not list(Path(tempfile.gettempdir()).glob("commlab-warm-*"))


SCRIPT_PROBE = '''
import json, os, sys
print(json.dumps({"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "path0": sys.path[0],
                  "torch_before": "torch" in sys.modules, "value": os.environ.get("WARM_PROBE_VALUE"),
                  "sid": os.getsid(0), "pid": os.getpid()}))
sys.exit(3)
'''


def test_a_script_runs_warm_as_python_would_run_it(private):
    """A fault-tolerant run of your own script asks the server for ``python SCRIPT ARGS``: the fork runs it as
    ``__main__`` from the given folder, with its argv as given and its own folder first on sys.path, in a session
    of its own, its output in the log and its exit code back; torch is already imported."""
    tmp = private
    (tmp / "mine").mkdir()
    (tmp / "mine" / "train.py").write_text(SCRIPT_PROBE)
    log = tmp / "log.txt"
    server = warm.ready()
    assert server is not None
    env = {**os.environ, "WARM_PROBE_VALUE": "given"}
    (rank,) = warm.start(server, [([sys.executable, "mine/train.py", "--seed", "7"], env)], str(log), cwd=str(tmp))
    assert rank.wait(60) == 3
    got = json.loads(log.read_text().strip().splitlines()[-1])
    assert got["argv"] == ["mine/train.py", "--seed", "7"] and got["name"] == "__main__"
    assert got["cwd"] == str(tmp) and got["path0"] == str((tmp / "mine").resolve())
    assert got["torch_before"] is True and got["value"] == "given" and got["sid"] == got["pid"] == rank.pid


LIMITED_PROBE = '''
import json, os, resource, sys
import torch.nn as nn

def build(info=None, **kw):
    out = {"ppid": os.getppid(), "torch_before": "torch" in sys.modules,
           "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0], "data": resource.getrlimit(resource.RLIMIT_DATA)[0]}
    if os.environ.get("ASK_WARM"):  # the spec's code asks the user's warm server for a process of its own
        from commlab.lab.base import warm
        try:
            warm._ask(warm.ready(), {"script": [os.environ["ASK_WARM"]], "env": dict(os.environ), "cwd": "/",
                                     "log": os.devnull, "memory": None})
            out["asked"] = "started"
        except OSError as e:
            out["asked"] = str(e)
    if os.environ.get("COMMLAB_SPAWNER"):  # and the app's spawner (commlab.lab.service.spawn)
        from commlab.lab.service import spawn
        try:
            spawn._ask(os.environ["COMMLAB_SPAWNER"], {"argv": [sys.executable, "-c", "pass"], "log": os.devnull})
            out["spawner"] = "started"
        except OSError as e:
            out["spawner"] = str(e)
    with open(os.environ["LIMITED_PROBE"], "w") as f:
        json.dump(out, f)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
'''


def test_a_preview_child_is_forked_warm_under_its_limits(private, monkeypatch):
    """A child of commlab.lab.base.sandbox (a model's preview) is forked by the warm server, torch already imported,
    and runs the spec's code under the same limits as a child started as a process."""
    from commlab.lab.base import sandbox
    (private / "src" / "limited_model.py").write_text(LIMITED_PROBE)
    out = private / "probe.json"
    monkeypatch.setenv("LIMITED_PROBE", str(out))
    got = sandbox.run("describe", {"model": "limited_model:build", "dataset": "digits"})
    assert got["params"] == 64 * 10 + 10
    seen = json.loads(out.read_text())
    assert procs.cmdline(seen["ppid"]).split()[2:3] == [warm.MARK] and seen["torch_before"] is True
    assert seen["nproc"] == 0 and seen["data"] == sandbox.PREVIEW.memory


def test_a_limited_child_cannot_ask_the_warm_server_or_the_apps_spawner_for_a_process(private, monkeypatch):
    """The spec's code in a preview child may not start processes (RLIMIT_NPROC 0); the warm server and the app's
    spawner, which could start one for it, refuse a caller under that limit."""
    from commlab.lab.base import sandbox
    from commlab.lab.service.spawn import Spawner
    (private / "src" / "limited_model.py").write_text(LIMITED_PROBE)
    out = private / "probe.json"
    (private / "escape.py").write_text("print('out of the limits')\n")
    monkeypatch.setenv("LIMITED_PROBE", str(out))
    monkeypatch.setenv("ASK_WARM", str(private / "escape.py"))
    with Spawner() as sp:
        monkeypatch.setenv("COMMLAB_SPAWNER", sp.address)
        sandbox.run("describe", {"model": "limited_model:build", "dataset": "digits"})
        assert sp.started == []
    got = json.loads(out.read_text())
    refused = "ValueError: the caller may not start processes (a limited child): neither may it ask for one"
    assert got["asked"] == refused and got["spawner"] == refused


def test_a_niced_caller_never_starts_the_server_the_runs_use(private):
    """The UI's server runs niced: with no warm server at normal priority, the one its previews start runs at its
    priority under another name, and a launcher at normal priority (a run's ranks) starts its own rather than be
    refused by that one; once that one runs, the niced caller uses it too (its forks niced to it)."""
    def nice(pid):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])

    def niced_ready():
        code = "import os; os.nice(4); from commlab.lab.base import warm; print(warm.ready())"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
    first = niced_ready()
    assert [nice(p) for p in warm_servers(private / "t")] == [os.nice(0) + 4]
    mine = warm.ready()
    assert str(mine) != first and sorted(nice(p) for p in warm_servers(private / "t")) == [os.nice(0), os.nice(0) + 4]
    (private / "ok.py").write_text("print('forked')\n")
    (rank,) = warm.start(mine, [([sys.executable, "ok.py"], dict(os.environ))], os.devnull, cwd=str(private))
    assert rank.wait(60) == 0
    assert niced_ready() == str(mine)
