"""`commlab run`'s progress (commlab/lab/rundir/progress.py): start-up as its own phase, the timed steps' rate, elapsed and
ETA; rich's display on a terminal, plain lines elsewhere; colour only for the state, only on a terminal
that has it."""
import io
import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from commlab.lab.rundir.progress import RunProgress

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def steps(first, last, ms, ranks=2, slower=0.0):
    return [{"kind": "step", "step": s, "rank": r, "loss": 1.0 / (s + 1), "time_ms": ms + (slower if r else 0)}
            for s in range(first, last) for r in range(ranks)]


def test_plain_lines_when_not_a_terminal():
    out, clock = io.StringIO(), Clock()
    p = RunProgress(100, 2, console=Console(file=out, width=200), clock=clock)
    assert not p.tty
    clock.t += 4.0  # the ranks start: no step yet
    p.feed([])
    p.feed(steps(0, 1, 500.0))  # the first step, slow as first steps are
    clock.t += 1.0
    p.feed(steps(1, 10, 19.0, slower=1.0))  # the slower rank's 20 ms is the iteration time
    clock.t += 0.1
    p.feed(steps(10, 12, 19.0, slower=1.0) + [{"kind": "eval", "step": 11, "eval_acc": 0.5}])
    clock.t += 0.4
    p.feed(steps(12, 20, 19.0, slower=1.0))
    p.close("done")
    lines = out.getvalue().splitlines()
    assert lines[0] == "starting 2 rank(s) ..."
    assert lines[1] == "ranks started in 4.0 s; training 100 steps"
    # every 10 steps; 50 it/s from the timed steps (the first steps' 500 ms left out), not the wall clock
    # over start-up; the ETA at the pace since the first step: 19 steps in 1.5 s, 80 to go
    assert lines[2] == "step 10/100 (10%)  50.0 it/s  elapsed 0:05  eta 0:10  loss 0.1000"
    assert lines[3] == "step 20/100 (20%)  50.0 it/s  elapsed 0:06  eta 0:06  loss 0.0500 acc 50.00%"
    assert lines[4] == "run done after 20/100 steps in 0:06"
    assert "\x1b[" not in out.getvalue()


def test_the_last_steps_get_a_line_at_the_end():
    out, clock = io.StringIO(), Clock()
    p = RunProgress(30, 2, console=Console(file=out, width=200), clock=clock)
    p.feed(steps(0, 3, 10.0))
    p.feed(steps(3, 4, 10.0))  # then the run fails between two lines' steps
    p.close("failed")
    lines = out.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines[2:]] == ["step 3/30 (10%)", "step 4/30 (13%)",
                                                       "run failed after 4/30 steps in 0:00"]


def test_a_terminal_gets_rich_phases_and_a_coloured_state():
    out, clock = io.StringIO(), Clock()
    con = Console(file=out, force_terminal=True, color_system="standard", width=160)
    p = RunProgress(50, 2, console=con, clock=clock)
    clock.t += 3.0
    p.tick()
    start = out.getvalue()
    assert "starting 2 rank(s)" in start and "0:00:03" in start  # the start-up phase, its clock running
    p.feed(steps(0, 1, 400.0))
    clock.t += 1.0
    p.feed(steps(1, 25, 25.0))
    p.close("done")
    text = out.getvalue()
    assert "started 2 rank(s) in 3.0 s" in text and "training" in text
    assert "25/50" in text and "40.0 it/s" in text and "eta" in text
    assert "\x1b[32mrun done after 25/50 steps in 0:04\x1b[0m" in text  # green: the state, and only it


def test_no_colour_where_the_terminal_has_none(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    out = io.StringIO()
    p = RunProgress(5, 2, console=Console(file=out, force_terminal=True, width=160), clock=Clock())
    p.feed(steps(0, 5, 10.0))
    p.close("failed")
    assert "run failed after 5/5 steps" in out.getvalue() and "\x1b[31m" not in out.getvalue()


SPEC = {"name": "progress", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 20, "batch_size": 16,
        "eval_every": 0, "threads": 1}


def test_commlab_run_on_a_pseudo_terminal_and_on_a_pipe(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    argv = [sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--runs", str(tmp_path / "runs")]
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160"}
    env.pop("NO_COLOR", None)
    main, sub = pty.openpty()
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=sub, stdout=sub, stderr=sub, close_fds=True)
    os.close(sub)
    got = b""
    while True:
        r, _, _ = select.select([main], [], [], 120)
        if not r:
            break
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        got += chunk
    assert p.wait(timeout=60) == 0, got.decode(errors="replace")
    os.close(main)
    text = got.decode(errors="replace")
    assert "starting 2 rank(s)" in text and "started 2 rank(s) in" in text and "it/s" in text, text
    assert "20/20" in text and "run done after 20/20 steps" in text and "\x1b[32m" in text, text
    piped = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert "\x1b[" not in piped.stderr
    assert piped.stderr.splitlines()[:2] == ["starting 2 rank(s) ..."] + [
        ln for ln in piped.stderr.splitlines() if ln.startswith("ranks started in")][:1]
    assert "step 20/20 (100%)" in piped.stderr and "run done after 20/20 steps" in piped.stderr


def test_the_final_evaluation_is_said_when_the_last_step_is_in():
    """spec.final_eval: the ranks evaluate after the last step (a language model's held-out text took 14 s
    that printed nothing); the progress says so once, and only while no final eval line is in."""
    out, clock = io.StringIO(), Clock()
    p = RunProgress(4, 2, console=Console(file=out, width=200), clock=clock, final_eval=True)
    p.feed(steps(0, 3, 10.0))
    assert "final evaluation" not in out.getvalue()
    p.feed(steps(3, 4, 10.0))
    p.feed([])
    p.feed([{"kind": "eval", "step": 4, "rank": 0, "eval_acc": 0.25}])
    p.close("done")
    lines = out.getvalue().splitlines()
    assert lines[-3:] == ["step 4/4 (100%)  100.0 it/s  elapsed 0:00  eta 0:00  loss 0.2500", "final evaluation ...",
                          "run done after 4/4 steps in 0:00"]
    quiet = io.StringIO()
    p = RunProgress(4, 2, console=Console(file=quiet, width=200), clock=clock, final_eval=False)
    p.feed(steps(0, 4, 10.0))
    p.close("done")
    assert "final evaluation" not in quiet.getvalue()


def test_the_last_line_counts_the_steps_the_summary_counts():
    """Ctrl-C: rank 1 had logged step 400 when rank 0 had logged 395; the last line and the summary
    (steps_done: any rank's steps) both say 401."""
    from commlab.lab.rundir.summary import summarize
    out, clock = io.StringIO(), Clock()
    p = RunProgress(2000, 2, console=Console(file=out, width=200), clock=clock)
    lines = steps(0, 396, 10.0) + [dict(m, rank=1) for m in steps(396, 401, 10.0, ranks=1)]
    for m in lines:
        m.update(bytes_sent=1, bytes_raw=1)
    p.feed(lines)
    p.close("cancelled")
    assert out.getvalue().splitlines()[-1].startswith("run cancelled after 401/2000 steps")
    assert summarize(lines, {"steps": 2000, "world_size": 2, "batch_size": 16})["steps_done"] == 401


def test_one_process_is_said_to_send_nothing():
    """A world of one (a sweep's baseline, a plain `python script.py` own loop) sends nothing: its bytes per step
    are 0 and its summary says so, with the payload its compressor made (what a second rank would get)."""
    from commlab.lab.rundir.summary import format_summary, summarize
    lines = steps(0, 10, 10.0, ranks=1)
    for m in lines:
        m.update(bytes_sent=500, bytes_raw=1000)
    alone = summarize(lines, {"steps": 10, "world_size": 1, "batch_size": 16})
    assert alone["bytes_per_step"] == 0 and alone["payload_per_step"] == 500 and alone["compression_ratio"] == 2.0
    assert "bytes/step     none sent: one process (its payload 500 B per step, compression 2.0x)" in \
        format_summary(alone)
    two = summarize([dict(m, bytes_sent=500, bytes_raw=1000) for m in steps(0, 10, 10.0)],
                    {"steps": 10, "world_size": 2, "batch_size": 16})
    assert two["bytes_per_step"] == 500 and "payload_per_step" not in two


def test_steps_without_loss_summarise_without_it():
    """An own loop's comm.step() without loss= logs "loss": null: no final loss, said as not recorded; where
    only some steps have one, the final loss is the last of those (a step's missing key counts as none)."""
    from commlab.lab.rundir.summary import format_summary, summarize
    lines = steps(0, 4, 10.0)
    for m in lines:
        m.update(loss=None, bytes_sent=1, bytes_raw=1)
    none = summarize(lines, {"steps": 4, "world_size": 2, "batch_size": 16})
    assert none["final_loss"] is None and none["loss_recorded"] is False and none["steps_done"] == 4
    assert "final loss     not recorded (comm.step() was given no loss)" in format_summary(none)
    lines[2].update(loss=1.5)
    lines[3].update(loss=2.5)  # step 1, both ranks
    del lines[-1]["loss"]
    some = summarize(lines, {"steps": 4, "world_size": 2, "batch_size": 16})
    assert some["final_loss"] == 2.0 and "loss_recorded" not in some
    assert "final loss     2.0000" in format_summary(some)
