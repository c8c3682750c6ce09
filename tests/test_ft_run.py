"""A fault-tolerant run through the lab, end to end: three replica groups on torchft (mlp on digits, PowerSGD, gloo,
CPU), the lab SIGKILLs replica 2 once it has logged a step (a fault of the spec), restarts it, the replica recovers
the model, optimizer and compressor state from a peer; later `commlab fault` asks the running run to kill replica 1,
which comes back the same way; the run ends done with every replica holding the same parameters.

The survivors must still be training when the restarted replica has imported torch and joined: a modeled link
(every all-reduce lasts its alpha-beta time, a sleep that leaves the CPU to the restart) paces the steps. Nothing is
timed here: the assertions are about what the run recorded."""
import importlib.util
import os
import re
import time

import pytest

import commlab
from commlab.engine import runfiles
from commlab.lab.base import procs
from commlab.lab.front import cli

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="torchft is not installed (./setup.sh installs it)")

STEPS, KILL_AT, ASK_AT, RESTART_S = 100, 3, 40, 2.0
SLOW = {"kind": "slow", "replica": 0, "step": 60, "steps": 10, "speed": 0.5}
"""Replica 0, never killed, computes at half its speed for steps 60-69 (a slow fault)."""
ASKED_SPEED, ASKED_SLOW_S = 0.25, 1.5
"""`commlab fault --slow 0` once replica 1 is killed at ASK_AT: a quarter of its speed for 1.5 s (a few steps, well
before step 60)."""
SPEC = {"name": "ft-kill", "model": "mlp", "dataset": "digits", "world_size": 3, "steps": STEPS, "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "eval_every": 0, "final_eval": False,
        "threads": 1, "comm": "sync", "schedule": "allinone",
        "compressor": {"name": "powersgd", "rank": 2, "start_iter": 2},
        "network": {"link": "modeled", "gbps": 1, "latency_us": 40000},  # a step (two all-reduces): 160 ms, 320 with 3
        "fault_tolerance": {"enabled": True, "min_replicas": 2, "join_timeout_ms": 1000, "timeout_s": 20,
                            "restart": {"max_restarts": 2, "delay_s": 0.5},
                            # restarts after RESTART_S: the survivors' next quorum forms without the killed replica
                            # (the Lighthouse waits join_timeout_ms, 1 s, for a member of the last one); forked by the
                            # warm server, a restart half a second later could join that quorum instead
                            "faults": [{"kind": "kill", "replica": 2, "step": KILL_AT, "restart_after_s": RESTART_S},
                                       SLOW]}}


def live_page(root, run_id):
    """The Live run page of ``run_id`` as the local user sees it (AppTest)."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest
    old = os.environ.get("COMMLAB_RUNS")
    os.environ["COMMLAB_RUNS"] = str(root)
    try:
        at = AppTest.from_file(str(Path(commlab.__file__).parent / "app" / "streamlit_app.py"), default_timeout=120)
        at.query_params["run"] = run_id
        return at.run().switch_page("views/live_run.py").run()
    finally:
        if old is None:
            os.environ.pop("COMMLAB_RUNS", None)
        else:
            os.environ["COMMLAB_RUNS"] = old


def ask_to_kill_replica_1(run, root, seen):
    """Once replica 2 is back (its recovery after the spec's kill) and replica 1 has logged ASK_AT: `commlab fault`.
    While it waits, the Live run page is looked at once (into ``seen``)."""
    def cmdlines():  # each replica process's command line while it runs (the warm server forks them)
        for e in run.ft_events():
            if e["event"] == "spawn" and (e["replica"], e["gen"]) not in seen.setdefault("cmdlines", {}):
                seen["cmdlines"][(e["replica"], e["gen"])] = procs.cmdline(e["pid"])
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and run.status().get("state") in ("queued", "running"):
        cmdlines()
        kill = [e for e in run.ft_events() if e["event"] == "kill"]
        if kill and "buttons" not in seen and importlib.util.find_spec("streamlit"):
            at = live_page(root, run.id)
            seen.update(buttons=[b.key for b in at.button], metrics=[m.label for m in at.metric],
                        exceptions=[e.value for e in at.exception])
        back = kill and [r for r in run.recoveries() if r["replica"] == 2 and r["t"] > kill[0]["t"]]
        mine = [r["step"] for r in run.metric_rows() if r["kind"] == "step" and r.get("replica") == 1]
        if back and mine and max(mine) >= ASK_AT:
            cmdlines()
            killed = cli.main(["fault", run.id, "--kill", "1", "--restart-after", str(RESTART_S), "--runs", str(root)])
            return killed, cli.main(["fault", run.id, "--slow", "0", "--speed", str(ASKED_SPEED), "--seconds",
                                     str(ASKED_SLOW_S), "--runs", str(root)])
        time.sleep(0.2)
    pytest.fail(f"replica 2 did not come back before the run ended: {run.status().get('state')}")


def visits(seq, pattern):
    """Whether ``pattern`` is a subsequence of ``seq``."""
    it = iter(seq)
    return all(any(x == want for x in it) for want in pattern)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft") / "runs"
    run = commlab.run(SPEC, runs=root, wait=False)
    seen = {}
    try:
        asked = ask_to_kill_replica_1(run, root, seen)
        commlab.wait(run.id, runs=root, timeout=300)
    finally:
        if commlab.get(run.id, runs=root).state in ("queued", "running"):
            commlab.cancel(run.id, runs=root)
    got = commlab.get(run.id, runs=root)
    got.asked, got.seen = asked, seen  # commlab fault's exit status; the Live page while it ran
    return got


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
    assert len(kills) == 2 and kills[0]["replica"] == 2 and kills[0]["gen"] == 0 and kills[0]["step"] >= KILL_AT
    assert "requested" not in kills[0] and kills[1]["requested"] and kills[1]["replica"] == 1 and kills[1]["by"]
    spawns = [(e["replica"], e["gen"]) for e in ev if e["event"] == "spawn"]
    assert sorted(spawns) == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1)]
    for r in (1, 2):
        assert any(e["event"] == "exit" and e["replica"] == r and e["gen"] == 0 and e["code"] == -9 for e in ev)
    (lh,) = [e for e in ev if e["event"] == "lighthouse"]
    assert lh["pid"] > 0
    # its dashboard kills replicas for anyone who reaches it: on one machine it listens on loopback only
    assert lh["argv"][lh["argv"].index("--bind") + 1].startswith("127.0.0.1:") and lh["addr"].startswith(
        "http://127.0.0.1:")
    # the restarted replica 2 recovers once before the second kill; after it, as a survivor, it may catch up by one
    # more recovery when the quorum changes under load (a step it was late for)
    rec = [r for r in run.recoveries() if r["replica"] == 2 and kills[0]["t"] < r["t"] < kills[1]["t"]]
    assert len(rec) == 1, run.recoveries()
    assert len([r for r in run.recoveries() if r["replica"] == 2 and r["t"] > kills[1]["t"]]) <= 1, run.recoveries()
    assert rec[0]["from_replica"] in (0, 1) and rec[0]["bytes"] > 0 and rec[0]["src_url"].startswith("http")
    assert rec[0]["step"] >= kills[0]["step"]
    # the killed replica's lines up to its death are kept, and its restart trains on from the recovered step
    mine = [r for r in run.metric_rows() if r["kind"] == "step" and r["replica"] == 2]
    assert max(r["step"] for r in mine if r["t"] <= kills[0]["t"]) >= KILL_AT
    assert min(r["step"] for r in mine if r["t"] > rec[0]["t"]) == rec[0]["step"]
    asked = [r for r in run.recoveries() if r["replica"] == 1 and r["t"] > kills[1]["t"]]
    assert len(asked) == 1 and asked[0]["from_replica"] in (0, 2), run.recoveries()
    # the quorum shrank at each kill and grew again at each return: each quorum's size, in their order
    size = {r["quorum_id"]: r["participants"] for r in run.metric_rows() if r["kind"] == "step"}
    assert visits([size[q] for q in sorted(size)], [3, 2, 3, 2, 3]), size
    assert (run.path / runfiles.LIGHTHOUSE_LOG).exists()


def test_a_slow_fault_stretches_that_replicas_compute_for_its_steps_only(killed_run):
    """Replica 0's step lines at steps 60-69 say speed 0.5 and the time waited (its forward and backward took
    twice what they measured); the slowdown asked for while it ran (`commlab fault --slow`) gives its lines that
    began from the time it was recorded until its seconds were up a quarter of that (the two multiply where they
    meet); every other line of the run has no slowdown; the lab killed nothing for either."""
    steps = [r for r in killed_run.metric_rows() if r["kind"] == "step"]
    window = range(SLOW["step"], SLOW["step"] + SLOW["steps"])
    slow = [r for r in steps if "speed" in r]
    assert slow and {r["replica"] for r in slow} == {0}, sorted({(r["replica"], r["step"]) for r in slow})
    assert all(r["slow_ms"] > 0 for r in slow)
    assert len([e for e in killed_run.ft_events() if e["event"] == "kill"]) == 2  # the spec's kill and the asked one
    (asked,) = [e for e in killed_run.ft_events() if e["event"] == "slow"]
    assert asked["requested"] and asked["by"] and asked["replica"] == 0 and asked["speed"] == ASKED_SPEED
    assert asked["until"] == pytest.approx(asked["t"] + ASKED_SLOW_S)

    def began(r):  # a line is written when its step ends; its speed was decided when it began
        return r["t"] - r["time_ms"] / 1e3

    def want(r):
        in_asked = asked["t"] < r["t"] and began(r) < asked["until"]
        return (SLOW["speed"] if r["step"] in window else 1.0) * (ASKED_SPEED if in_asked else 1.0)
    mine = [r for r in steps if r["replica"] == 0]
    # the edges of the asked window: a step in flight when it was recorded, or when it ran out, may go either way
    edge = [r for r in mine if began(r) - 0.05 <= asked["t"] <= r["t"] + 0.05
            or began(r) - 0.05 <= asked["until"] <= r["t"] + 0.05]
    wrong = [(r["step"], r.get("speed", 1.0), want(r)) for r in mine if r not in edge and r.get("speed", 1.0) != want(r)]
    assert not wrong, wrong
    assert {r["step"] for r in mine if r.get("speed", 1.0) in (SLOW["speed"], SLOW["speed"] * ASKED_SPEED)} >= set(window)
    assert [r for r in mine if r.get("speed") == ASKED_SPEED and r not in edge]  # the asked slowdown did slow it


def test_the_lab_worker_replicas_restarted_ones_included_are_forked_warm(killed_run):
    """With warm ranks on (the default), every replica process, the restarted replica 2 included, is the warm
    server's fork (its command line), not a process that imports torch anew."""
    from commlab.lab.base import warm
    if not warm.enabled():
        pytest.skip("COMMLAB_WARM is off here")
    lines = killed_run.seen["cmdlines"]
    assert {(0, 0), (1, 0), (2, 0), (2, 1)} <= set(lines), lines
    assert all(warm.MARK in c for c in lines.values()), lines


def test_nothing_the_run_started_is_left_running(killed_run):
    started = [e["pid"] for e in killed_run.ft_events() if e["event"] in ("spawn", "lighthouse")]
    assert len(started) == 6
    for pid in started:  # gone, or the PID is another process's now
        cmd = procs.cmdline(pid) if procs.start_time(pid) is not None else ""
        assert str(killed_run.path) not in cmd and "ft_lighthouse" not in cmd, (pid, cmd)


def test_commlab_fault_said_what_it_did_and_refuses_in_one_line(killed_run, capsys):
    assert killed_run.asked == (0, 0)
    root = str(killed_run.path.parent)
    assert cli.main(["fault", killed_run.id, "--kill", "1", "--runs", root]) == 2
    err = capsys.readouterr().err
    assert f"RUN: {killed_run.id} is done; faults go to a running run" in err and "Traceback" not in err


class _Running:
    """A run's status as request_fault reads it: running, fault tolerant, three replica groups."""
    id = "r"

    def __init__(self, tmp_path, ft=True):
        self.path, self.ft = tmp_path, ft

    def status(self):
        return {"state": "running", **({"fault_tolerance": {"replica_groups": 3}} if self.ft else {})}

    def file(self, name):
        return self.path / name


@pytest.mark.parametrize("replica,after,ft,said", [
    (3, None, True, "--kill: a replica group in 0..2, got 3"), (-1, None, True, "--kill: a replica group in 0..2"),
    (1, -2.0, True, "--restart-after: seconds in [0, 3600]"),
    (1, None, False, "RUN: r is not fault tolerant")])
def test_a_fault_request_the_run_cannot_take_names_the_field(tmp_path, replica, after, ft, said):
    from commlab.lab.rundir.ftrun import request_fault
    with pytest.raises(ValueError, match=re.escape(said)):
        request_fault(_Running(tmp_path, ft), replica, after)
    assert not (tmp_path / runfiles.FAULT_REQUESTS).exists()
    request_fault(_Running(tmp_path), 2, 1.5, by="me")
    (line,) = (tmp_path / runfiles.FAULT_REQUESTS).read_text().splitlines()
    assert '"replica":2' in line and '"restart_after_s":1.5' in line and '"by":"me"' in line


@pytest.mark.parametrize("replica,after,seconds,speed,said", [
    (3, None, 5.0, None, "--cut: a replica group in 0..2, got 3"),
    (1, None, 0.0, None, "--seconds: a cut's length in (0, 3600]"),
    (1, None, 1e5, None, "--seconds: a cut's length"), (1, 2.0, 5.0, None, "--restart-after: only a kill is restarted"),
    (3, None, 5.0, 0.5, "--slow: a replica group in 0..2, got 3"),
    (1, None, 5.0, 1.0, "--speed: a share of its speed in [0.01, 1), got 1"),
    (1, None, 5.0, 0.001, "--speed: a share of its speed"),
    (1, None, 0.0, 0.5, "--seconds: a slowdown's length in (0, 3600]"),
    (1, 2.0, 5.0, 0.5, "--restart-after: only a kill is restarted; a slowed replica")])
def test_a_cut_or_slow_request_the_run_cannot_take_names_the_field(tmp_path, replica, after, seconds, speed, said):
    from commlab.lab.rundir.ftrun import request_fault
    with pytest.raises(ValueError, match=re.escape(said)):
        request_fault(_Running(tmp_path), replica, after, seconds=seconds, speed=speed)
    assert not (tmp_path / runfiles.FAULT_REQUESTS).exists()
    ok = speed if speed is not None and 0.01 <= speed < 1 else None
    request_fault(_Running(tmp_path), 1, by="me", seconds=2.5, speed=ok)
    (line,) = (tmp_path / runfiles.FAULT_REQUESTS).read_text().splitlines()
    kind = "cut" if ok is None else "slow"
    assert f'"kind":"{kind}"' in line and '"seconds":2.5' in line and '"replica":1' in line


def test_the_supervisor_writes_the_slowdowns_asked_for_and_a_rank_reads_its_own(tmp_path):
    """A slowdown asked for while the run goes on: recorded as a slow event and written to slowdowns.json, where
    each replica group's Stepper reads its own (commlab.engine.runfiles.read_slowdown); a later one for the same
    replica replaces it; a bad speed is refused with why; a damaged file reads as no slowdown."""
    import json

    from commlab.lab.rundir.ftrun import FtJob
    quiet = {**SPEC, "fault_tolerance": {**SPEC["fault_tolerance"], "faults": []}}
    job = FtJob(_Running(tmp_path), commlab.spec(quiet), log=None)
    try:
        lines = [{"kind": "slow", "replica": 2, "seconds": 30, "speed": 0.5, "by": "teacher"},
                 {"kind": "slow", "replica": 1, "seconds": 30, "speed": 1.5},
                 {"kind": "slow", "replica": 2, "seconds": 60, "speed": 0.25}]
        (tmp_path / runfiles.FAULT_REQUESTS).write_text("".join(json.dumps(x) + "\n" for x in lines))
        job.poll()
    finally:
        job.events.close()
    ev = [json.loads(x) for x in (tmp_path / runfiles.FT_EVENTS).read_text().splitlines()]
    assert [e["event"] for e in ev] == ["slow", "refused", "slow"], ev
    assert ev[0]["by"] == "teacher" and ev[0]["requested"] and "speed: a share of its speed in [0.01, 1)" in ev[1]["why"]
    speed, until = runfiles.read_slowdown(str(tmp_path), 2)
    assert speed == 0.25 and until == ev[2]["until"] and until == pytest.approx(ev[2]["t"] + 60)
    assert runfiles.read_slowdown(str(tmp_path), 1) is None and runfiles.read_slowdown(str(tmp_path), 0) is None
    (tmp_path / runfiles.SLOWDOWNS).write_text('{"2": {"speed": "fast"')
    assert runfiles.read_slowdown(str(tmp_path), 2) is None


def _proc_state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _settled_state(pid: int, stopped: bool) -> str:
    """The state once a signal sent to the process has landed (a stop or a continue is delivered when the kernel
    next schedules it, so the first look can still see it running or stopped): waits at most 10 s."""
    import time
    for _ in range(200):
        state = _proc_state(pid)
        if (state == "T") == stopped:
            return state
        time.sleep(0.05)
    return state


def test_the_supervisor_cuts_a_replica_off_and_lets_it_go_on(tmp_path):
    """A cut asked for while the run goes on: the supervisor stops that replica's process (SIGSTOP to its session),
    refuses a second cut of it and a cut of bad length with why, and lets it go on (SIGCONT) once the time is up."""
    import json
    import subprocess
    import sys
    import time

    from commlab.lab.rundir.ftrun import FtJob
    quiet = {**SPEC, "fault_tolerance": {**SPEC["fault_tolerance"], "faults": []}}
    job = FtJob(_Running(tmp_path), commlab.spec(quiet), log=None)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        job.live = {1: (child, 0)}
        lines = [{"kind": "cut", "replica": 1, "seconds": 0.5, "by": "teacher"}, {"kind": "cut", "replica": 1,
                                                                                 "seconds": 3},
                 {"kind": "cut", "replica": 1, "seconds": -1}]
        (tmp_path / runfiles.FAULT_REQUESTS).write_text("".join(json.dumps(x) + "\n" for x in lines))
        job.poll()
        assert _settled_state(child.pid, stopped=True) == "T" and 1 in job.cut
        time.sleep(0.6)
        job.poll()
        assert _settled_state(child.pid, stopped=False) != "T" and child.poll() is None and not job.cut
    finally:
        child.kill()
        child.wait()
        job.events.close()
    ev = [json.loads(x) for x in (tmp_path / runfiles.FT_EVENTS).read_text().splitlines()]
    assert [e["event"] for e in ev] == ["cut", "refused", "refused", "reconnect"], ev
    assert ev[0]["requested"] and ev[0]["by"] == "teacher" and ev[0]["seconds"] == 0.5 and ev[0]["pid"] == child.pid
    assert ev[1]["why"] == "replica 1 is cut off already" and "a cut's length in (0, 3600]" in ev[2]["why"]
    assert ev[3]["why"] == "the cut's time is up"


def test_a_hung_replica_stays_stopped_until_a_kill_and_training_over_stops_it(tmp_path):
    """A hang fault of the spec: once the replica has logged its step the supervisor stops its process for good
    (SIGSTOP, no time limit: a poll later it is still stopped), a kill asked for then kills it (and would restart
    it); a replica hung when training ends is let go and stopped at once, not waited for."""
    import json
    import subprocess
    import sys

    from commlab.lab.rundir.ftrun import FtJob
    hang = {**SPEC, "fault_tolerance": {**SPEC["fault_tolerance"], "faults": [
        {"kind": "hang", "replica": 1, "step": 5}, {"kind": "hang", "replica": 2, "step": 5}]}}
    job = FtJob(_Running(tmp_path), commlab.spec(hang), log=None)
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
            for _ in range(2)]
    try:
        job.live = {1: (kids[0], 0), 2: (kids[1], 0)}
        job.spawned = {1: 0.0, 2: 0.0}
        job.feed([{"kind": "step", "replica": r, "step": 5, "t": 1.0} for r in (1, 2)])
        assert all(_settled_state(k.pid, stopped=True) == "T" for k in kids)
        job.poll()
        assert _proc_state(kids[0].pid) == "T" and {1, 2} <= set(job.cut)  # no end to it
        (tmp_path / runfiles.FAULT_REQUESTS).write_text(json.dumps({"kind": "kill", "replica": 1, "by": "t"}) + "\n")
        job.poll()
        assert kids[0].wait(10) == -9 and 1 not in job.cut
        job.feed([{"kind": "final", "replica": 0, "step": 99, "t": 2.0}])  # training is over
        assert kids[1].wait(10) is not None and not job.cut
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
                k.wait()
        job.events.close()
    ev = [json.loads(x) for x in (tmp_path / runfiles.FT_EVENTS).read_text().splitlines()]
    assert [(e["event"], e.get("replica")) for e in ev if e["event"] != "exit"] == [  # an exit: when it is seen
        ("hang", 1), ("hang", 2), ("kill", 1), ("reconnect", 2), ("stop", 2)], ev
    assert ev[0]["step"] == 5 and ev[-1]["why"] == "training is over: it hung"


def test_commlab_fault_says_which_flags_go_together(tmp_path, capsys):
    for argv, said in ((["--cut", "1"], "--seconds: how long the replica is cut off (--cut needs it)"),
                       (["--kill", "1", "--seconds", "3"], "--seconds: only a cut (--cut) or a slowdown (--slow)"),
                       (["--slow", "1", "--seconds", "3"], "--speed: --slow needs --speed (the share of its speed)"),
                       (["--slow", "1", "--speed", "0.5"], "--seconds: --slow needs --speed"),
                       (["--cut", "1", "--seconds", "3", "--speed", "0.5"], "--speed: only a slowdown (--slow)")):
        assert cli.main(["fault", "nosuchrun", *argv, "--runs", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err


def test_show_and_the_live_page_tell_each_replica_group(killed_run, capsys):
    root = str(killed_run.path.parent)
    assert cli.main(["show", killed_run.id, "--runs", root]) == 0
    out = capsys.readouterr().out
    assert "replicas       3 replica groups: " in out and "; 2 kills" in out, out
    # the two kills' recoveries, and a survivor that fell behind may have caught up by one more
    assert "quorum         2 to 3 replica groups over " in out, out
    assert int(re.search(r"; (\d+) recoveries after the start", out).group(1)) >= 2, out
    pytest.importorskip("streamlit")
    seen = killed_run.seen  # while it ran: a replica metric each, and the plug for the local user
    assert not seen["exceptions"] and {"live.cancel", "live.plug", "live.cut", "live.slow"} <= set(seen["buttons"]), seen
    assert {f"replica {r}" for r in range(3)} <= set(seen["metrics"]), seen
    at = live_page(root, killed_run.id)
    assert not at.exception, [e.value for e in at.exception]
    assert not {"live.plug", "live.cut", "live.slow"} & {b.key for b in at.button}  # it has ended
    shown = {m.label: m.value for m in at.metric}
    assert {f"replica {r}" for r in range(3)} <= set(shown) and all(
        shown[f"replica {r}"] in ("finished", "stopped") for r in range(3)), shown
    assert any("3 replica groups" in c.value and "2 kills" in c.value for c in at.caption)


def test_on_the_live_page_only_the_teacher_pulls_a_plug(tmp_path):
    """ui.pull_plug (the Live run page's button): a student is refused before anything is written; the teacher's
    request reaches the run, which must be running and fault tolerant."""
    from commlab.lab.base.errors import LabError
    from commlab.lab.front import ui
    from commlab.lab.service.queue import Lab
    from commlab.room import owners
    short = {**SPEC, "steps": 4, "fault_tolerance": {**SPEC["fault_tolerance"], "faults": []}}
    run = Lab(tmp_path).create(commlab.spec(short))  # queued: nothing runs
    try:
        ui.set_viewer(lambda: owners.User("bob"))
        assert not ui.may_pull_plugs()
        with pytest.raises(LabError, match="only the teacher may kill a worker of a run; bob may not"):
            ui.pull_plug(run.id, 1, runs=tmp_path)
        with pytest.raises(LabError, match="only the teacher may cut off a worker of a run; bob may not"):
            ui.pull_plug(run.id, 1, runs=tmp_path, seconds=5)
        with pytest.raises(LabError, match="only the teacher may slow down a worker of a run; bob may not"):
            ui.pull_plug(run.id, 1, runs=tmp_path, seconds=5, speed=0.5)
        ui.set_viewer(lambda: owners.User(owners.TEACHER, admin=True))
        with pytest.raises(LabError, match=f"fault: RUN: {run.id} is queued; faults go to a running run"):
            ui.pull_plug(run.id, 1, runs=tmp_path)
    finally:
        ui.set_viewer(None)
    assert not (run.path / runfiles.FAULT_REQUESTS).exists()


def test_the_supervisor_refuses_a_damaged_request_and_kills_for_a_good_one(tmp_path):
    """FtJob reads fault-requests.jsonl as it polls: a line that is not a kill of a replica, a restart delay that is
    not a number of seconds in range, or a replica not running is refused with why (the supervisor goes on); a good
    one SIGKILLs that replica's process (here a child of this test's own) and schedules its restart."""
    import json
    import signal
    import subprocess
    import sys

    from commlab.lab.rundir.ftrun import FtJob
    job = FtJob(_Running(tmp_path), commlab.spec(SPEC), log=None)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        job.live = {1: (child, 0)}
        lines = [{"kind": "kill", "replica": 1, "restart_after_s": "soon"},
                 {"kind": "kill", "replica": 1, "restart_after_s": 1e9}, {"kind": "kill", "replica": True},
                 {"kind": "hang", "replica": 1}, {"kind": "kill", "replica": 2},
                 {"kind": "kill", "replica": 1, "restart_after_s": 2, "by": "teacher"}]
        (tmp_path / runfiles.FAULT_REQUESTS).write_text("".join(json.dumps(x) + "\n" for x in lines) + "{torn")
        job._asked()
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        job.events.close()
    ev = [json.loads(x) for x in (tmp_path / runfiles.FT_EVENTS).read_text().splitlines()]
    assert [e["event"] for e in ev] == ["refused"] * 5 + ["kill"], ev
    assert "restart_after_s: seconds in [0, 3600] or null, got 'soon'" in ev[0]["why"]
    assert "got 1000000000.0" in ev[1]["why"] and "not a kill, a cut or a slowdown of a replica in 0..2" in ev[2]["why"]
    assert "replica 2 is not running now" in ev[4]["why"]
    assert ev[5]["replica"] == 1 and ev[5]["pid"] == child.pid and ev[5]["by"] == "teacher" and job.killed == {1: 2}


def test_a_restart_with_no_peer_left_is_stopped_when_training_is_over(tmp_path):
    """A replica trains to the last step (exits 0) while another's restarted process has logged no step yet: that
    one has nobody left to recover from and would train alone from the start, so the supervisor stops it at once;
    one that has logged a step is left to finish its last step."""
    import json
    import subprocess
    import sys
    import time

    from commlab.lab.rundir.ftrun import FtJob
    quiet = {**SPEC, "fault_tolerance": {**SPEC["fault_tolerance"], "faults": []}}
    job = FtJob(_Running(tmp_path), commlab.spec(quiet), log=None)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    late, busy = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
                  for _ in range(2))  # sessions of their own, as the lab starts replicas
    try:
        job.live = {0: (done, 0), 1: (late, 1), 2: (busy, 0)}
        t0 = time.time()
        job.spawned = {0: t0 - 10, 1: t0, 2: t0 - 10}
        job.feed([{"kind": "step", "replica": 0, "step": 99, "t": t0 + 1},
                  {"kind": "step", "replica": 1, "step": 40, "t": t0 - 5},  # its killed process's, before the restart
                  {"kind": "step", "replica": 2, "step": 98, "t": t0 + 1}])
        done.wait(30)
        job.poll()
        assert late.wait(30) != 0 and busy.poll() is None
    finally:
        for p in (late, busy):
            if p.poll() is None:
                p.kill()
                p.wait()
        job.events.close()
    ev = [json.loads(x) for x in (tmp_path / runfiles.FT_EVENTS).read_text().splitlines()]
    assert [(e["event"], e.get("replica")) for e in ev][:2] == [("exit", 0), ("stop", 1)], ev
    assert ev[1]["why"] == "training is over: nothing to rejoin" and ev[1]["gen"] == 1
    assert not job.due and job.verdict() is None  # no restart of it; the busy one still runs


def test_strategy_auto_chooses_before_the_replicas_start_and_the_run_goes_on_past_a_kill(tmp_path):
    """strategy auto under fault tolerance: the advisor's profiling run (without fault tolerance) runs first, its
    choice goes into spec.json (not dear, which the space lists without ranking), and the replicas train that choice
    through a kill to one model."""
    from commlab.lab.strategy.auto import read_record
    from commlab.lab.strategy.space import FT_NO_DEAR
    root = tmp_path / "runs"
    spec = {"name": "ft-auto", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 40, "batch_size": 16,
            "eval_every": 0, "final_eval": False, "threads": 1, "strategy": {"mode": "auto", "measure": False},
            "network": {"link": "modeled", "gbps": 1, "latency_us": 40000},
            "fault_tolerance": {"enabled": True, "min_replicas": 1, "join_timeout_ms": 1000, "timeout_s": 20,
                                "faults": [{"kind": "kill", "replica": 1, "step": 3, "restart_after_s": RESTART_S}]}}
    run = commlab.run(spec, runs=root)
    assert run.state == "done", run.log_tail(60)
    chosen = run.spec_dict()
    assert chosen["strategy"]["decided"] and chosen["fault_tolerance"]["enabled"]
    assert chosen["comm"]["mode"] != "dear"  # MergeComp may win: its search then runs before the replicas
    assert (run.path / runfiles.PARTITION).is_file() == (chosen["schedule"]["name"] == "mergecomp")
    record = read_record(run)
    assert record["chosen_by"] == "predicted"
    assert [c for c in record["candidates"] if c["excluded"] == FT_NO_DEAR]
    helpers = [commlab.get(r, runs=root) for r in record["runs"]]
    assert helpers and all(not h.spec_dict()["fault_tolerance"]["enabled"] for h in helpers)
    assert [e for e in run.ft_events() if e["event"] == "kill"] and run.recoveries()
    finals = {r["replica"]: r["params_sha256"] for r in run.metric_rows() if r["kind"] == "final"}
    assert sorted(finals) == [0, 1] and len(set(finals.values())) == 1, finals


def test_a_tuning_schedule_searches_before_the_replicas_start_and_every_replica_trains_its_partition(tmp_path):
    """MergeComp under fault tolerance: the lab searches in a run of the same spec without fault tolerance before the
    replicas start; every replica, the one killed and restarted too, trains the partition it chose (one model at the
    end); a second run of the same setting takes MergeComp's cache without a search; LayerFusion searches the same
    way."""
    import json
    root = tmp_path / "runs"
    spec = {"name": "ft-mergecomp", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 30,
            "batch_size": 16, "eval_every": 0, "final_eval": False, "threads": 1,
            "compressor": {"name": "topk", "ratio": 0.1, "error_feedback": True},
            "schedule": {"name": "mergecomp", "warmup_steps": 1, "steps_per_candidate": 1, "max_candidates": 3},
            "network": {"link": "modeled", "gbps": 1, "latency_us": 40000},
            "fault_tolerance": {"enabled": True, "min_replicas": 1, "join_timeout_ms": 1000, "timeout_s": 20,
                                "faults": [{"kind": "kill", "replica": 1, "step": 3, "restart_after_s": RESTART_S}]}}

    def searched(run, schedule):
        part = json.loads((run.path / runfiles.PARTITION).read_text())
        assert part["schedule"] == schedule
        bounds = [0, *part["cuts"], len(part["order"])]
        buckets = [part["order"][a:b] for a, b in zip(bounds, bounds[1:])]
        layout = json.loads((run.path / runfiles.LAYOUT).read_text())
        assert [b["layers"] for b in layout["buckets"]] == buckets  # the replicas' buckets are the partition's
        tuning = json.loads((run.path / runfiles.TUNING).read_text())
        assert tuning["schedule"] == schedule and tuning["layout"] == buckets
        return part, tuning

    run = commlab.run(spec, runs=root)
    assert run.state == "done", run.log_tail(60)
    part, tuning = searched(run, "mergecomp")
    search = commlab.get(part["from"], runs=root)
    assert tuning["searched_in"] == search.id and tuning["cache"] == "miss" and tuning["trace"]
    assert search.state == "done" and search.status()["tuning_for"] == run.id
    assert search.status()["owner"] == run.status()["owner"]  # its owner's, under its limits (Run.inherited)
    assert not search.spec_dict()["fault_tolerance"]["enabled"] and search.spec_dict()["steps"] == 1 + 1 + 2 * 2
    assert [e for e in run.ft_events() if e["event"] == "kill"] and run.recoveries()
    finals = {r["replica"]: r["params_sha256"] for r in run.metric_rows() if r["kind"] == "final"}
    assert sorted(finals) == [0, 1] and len(set(finals.values())) == 1, finals

    quiet = {**spec["fault_tolerance"], "faults": []}
    again = commlab.run({**spec, "name": "ft-mergecomp-again", "steps": 10, "fault_tolerance": quiet}, runs=root)
    assert again.state == "done", again.log_tail(60)
    part2, tuning2 = searched(again, "mergecomp")
    assert part2["from"] == "cache" and tuning2["cache"] == "hit" and tuning2["cached_from"] == search.id
    assert (part2["order"], part2["cuts"]) == (part["order"], part["cuts"])
    statuses = [json.loads(f.read_text()) for f in root.glob(f"*/{runfiles.STATUS}")]
    assert len(statuses) == 3 and not [st for st in statuses if st.get("tuning_for") == again.id]

    lf = commlab.run({**spec, "name": "ft-layerfusion", "steps": 10, "schedule": "layerfusion",
                      "fault_tolerance": quiet}, runs=root)
    assert lf.state == "done", lf.log_tail(60)
    part3, tuning3 = searched(lf, "layerfusion")
    assert commlab.get(part3["from"], runs=root).status()["tuning_for"] == lf.id and tuning3["cost"]
