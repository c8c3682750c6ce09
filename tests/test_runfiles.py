"""The run directory's protocol (commlab/engine/runfiles.py): every file defined once with writers and readers that
exist, the docs page generated from it and naming no file it lacks, status.json written only through Run's
transitions with the protocol's fields, the one JSON-lines reader (runlog.JsonlTail) and the one trials reader."""
import ast
import importlib
import json
import os
import re
from pathlib import Path

import pytest

import commlab
from commlab.engine import runfiles, runlog
from commlab.engine.runfiles import STATUS_FIELDS, State
from commlab.engine.runlog import JsonlTail, read_jsonl
from commlab.engine.timeline import ends_step

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "run-directory.md"


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module of the package, or a name in one (a class's member too)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_writer_and_reader_the_protocol_names_exists():
    assert len(runfiles.FILES) >= 25
    for f in runfiles.FILES.values():
        named = re.findall(r"commlab(?:\.\w+)+", f.writer) + list(f.readers)
        assert named and (f.readers or f.format == "text"), f.name  # only a log may be for people alone
        for dotted in named:
            assert resolves(dotted), f"{f.name}: {dotted} is not in the code"
        assert f.holds and f.when and f.format in runfiles.FORMATS


def test_the_resolver_finds_a_missing_name():
    assert resolves("commlab.lab.rundir.store.Run.status") and resolves("commlab.engine.runlog.JsonlTail")
    assert not resolves("commlab.lab.rundir.store.Run.nothing") and not resolves("commlab.lab.nothing.at_all")


def test_every_file_is_still_bound_to_its_name():
    """Each file's constant holds its name (a later constant of the same name, a state, once took one's place)."""
    bound = {v for k, v in vars(runfiles).items() if k.isupper() and isinstance(v, str)}
    assert set(runfiles.FILES) <= bound, set(runfiles.FILES) - bound
    assert runfiles.DIVERGED == "diverged-rank{rank}.json" and State.DIVERGED == "diverged"
    assert runfiles.TIMELINES == "timeline-rank*.jsonl" and runfiles.ERRORS == "error-rank*.json"


def test_a_file_name_is_found_by_its_pattern():
    assert runfiles.find("timeline-rank12.jsonl").name == runfiles.TIMELINE
    assert runfiles.find("status.json").name == runfiles.STATUS
    assert runfiles.find("trial-3").name == runfiles.TRIAL_DIR
    assert runfiles.find("timeline-rankx.jsonl") is None and runfiles.find("notes.json") is None
    assert runfiles.FILES[runfiles.TIMELINE].shown == "timeline-rank<r>.jsonl"
    assert runfiles.FILES[runfiles.NODE_LOG].shown == "log-node<pid>.txt"


# -- the docs page ---------------------------------------------------------------------------------------------

def hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_page_is_generated_from_the_protocol_with_every_file_state_and_field():
    pytest.importorskip("mkdocs")
    text = PAGE.read_text()
    assert "<!-- generated: run-files -->" in text and "<!-- generated: run-status -->" in text
    h = hooks()
    files, status = h.run_files_reference(), h.run_status_reference()
    rows = [ln for ln in files.splitlines() if ln.startswith("| `")]
    assert len(rows) == len(runfiles.FILES)
    for f, row in zip(runfiles.FILES.values(), rows):
        assert row.startswith(f"| `{f.shown}`"), (f.name, row)
        assert all(f"`{r}`" in row for r in f.readers)
    for s in runfiles.STATES:
        assert f"| `{s}` |" in status
    for name in STATUS_FIELDS:
        assert f"| `{name}` |" in status


def named_files(text: str):
    """Backticked names in ``text`` that look like a run directory's file (``error-rank1.json``, ``log.txt``)."""
    spans = re.findall(r"`([^`\n]+)`", text)
    return {n for span in spans for n in re.findall(r"(?<![\w/])([\w.<>-]+\.(?:jsonl|json|txt|lock|request))\b", span)}


def test_the_page_names_no_run_file_the_protocol_lacks():
    """The page's own words (before the runs directory's section, which lists the lab's files in the runs root,
    commlab/lab/base/paths.py) name only files the protocol defines; the check can fail."""
    text = PAGE.read_text().split("## The runs directory")[0]
    names = named_files(text)
    assert {"log.txt", "status.json", "error-rank1.json", ".status.lock"} <= names

    def known(name):
        return runfiles.find(re.sub(r"<\w+>", "0", name)) is not None
    assert [n for n in sorted(names) if not known(n)] == []
    assert not known("notes-rank<r>.json")


# -- status.json: only the transitions write it ----------------------------------------------------------------

def status_writes(path: Path):
    """(line, method) of each call of set_status or update_status in a file."""
    tree = ast.parse(path.read_text())
    return [(n.lineno, n.func.attr) for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr in ("set_status", "update_status")]


def test_the_product_writes_status_only_through_the_transitions():
    store = ROOT / "commlab" / "lab" / "rundir" / "store.py"
    files = [p for p in (ROOT / "commlab").rglob("*.py") if p != store] + sorted((ROOT / "bench").glob("*.py"))
    bad = [f"{p.relative_to(ROOT)}:{line}: {m}" for p in files for line, m in status_writes(p)]
    assert bad == []
    assert {m for _, m in status_writes(store)} == {"set_status", "update_status"}  # the transitions' own writes


@pytest.fixture
def run(tmp_path):
    from commlab.lab.rundir.store import Run
    (tmp_path / "r").mkdir()
    changes = []
    r = Run(tmp_path / "r", on_change=lambda run: changes.append(run.state))
    r.changes = changes
    return r


def test_the_transitions_write_their_fields_and_refuse_others(run):
    st = run.mark_queued(owner="ana", rank_limit_mb=512, rank_limit_from="runs/lab.json rank_mb", sweep=None)
    assert st["state"] == "queued" and st["owner"] == "ana" and "sweep" not in st and st["created"]
    st = run.mark_running(torchruns=[{"pid": 1, "start": 2}, {"pid": 3, "start": 4}], argv=["x"], nodes=2)
    assert st["torchrun"] == {"pid": 1, "start": 2} and len(st["torchruns"]) == 2 and st["nodes"] == 2
    assert st["started"] >= st["created"]
    with pytest.raises(ValueError, match="'cores' is not a status field"):
        run.mark_running(cores=4)
    with pytest.raises(ValueError, match="'colour' is not a status field"):
        run._transition(State.DONE, None, colour="green")
    run.note(strategy={"chosen": None, "by": "trials in the run", "cost_s": 1.5}, disturbance=None)
    assert run.status()["strategy"]["by"] == "trials in the run" and "disturbance" not in run.status()
    st = run.mark_failed("RuntimeError: boom", rank=1, returncode=1, disturbance={"other_cpu": 0.1})
    assert (st["state"], st["rank"], st["error"], st["disturbance"]) == ("failed", 1, "RuntimeError: boom",
                                                                         {"other_cpu": 0.1})
    assert st["ended"] and "cause" not in st
    # another process ended it first: a cancel only from an unfinished state leaves it alone
    st = run.mark_cancelled("cancelled (no live launcher)", only_from=runfiles.UNFINISHED)
    assert st["state"] == "failed" and st["error"] == "RuntimeError: boom"
    assert run.changes == ["queued", "running", "failed"]  # note changes no state: the index waits


def test_a_transition_that_changes_nothing_writes_nothing(run):
    me = {"pid": os.getpid(), "start": 1}
    run.mark_queued(owner="ana", supervisor=me)
    path = run.file(runfiles.STATUS)
    before = (path.stat().st_ino, path.read_text())
    run.mark_queued(supervisor=me)  # the supervisor the run was made with
    assert (path.stat().st_ino, path.read_text()) == before and run.changes == ["queued"]
    run.mark_queued(supervisor={"pid": 7, "start": 8})
    assert path.stat().st_ino != before[0] and run.changes == ["queued", "queued"]


def test_every_transition_writes_a_state_the_protocol_has(run):
    for mark, kw in ((run.mark_done, {}), (run.mark_diverged, {"rank": 1, "step": 7, "error": "nan", "returncode": 3}),
                     (run.mark_cancelled, {"error": "x"})):
        assert mark(**kw)["state"] in runfiles.FINAL
    assert set(runfiles.STATES) == set(runfiles.STATE_MEANS) and set(runfiles.FINAL) < set(runfiles.STATES)


# -- the one JSON-lines reader -----------------------------------------------------------------------------------

def line(obj) -> str:
    return json.dumps(obj) + "\n"


def test_the_tail_reads_what_was_appended_once_and_waits_for_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == [] and not tail.restarted  # no file yet
    path.write_text(line({"step": 0}) + "not json\n\n" + line({"step": 1}))
    assert tail.read() == [{"step": 0}, {"step": 1}]
    assert tail.read() == [] and tail.bytes_read == path.stat().st_size
    whole = line({"step": 2})
    with open(path, "a") as f:
        f.write(whole[:5])
    assert tail.read() == []  # torn: it waits for its end
    with open(path, "a") as f:
        f.write(whole[5:])
    assert tail.read() == [{"step": 2}] and tail.bytes_read == path.stat().st_size


def test_the_tail_starts_again_on_a_replaced_or_cut_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(line({"a": 1}) + line({"a": 2}))
    tail = JsonlTail(path)
    assert len(tail.read()) == 2
    os.replace(path, tmp_path / "old")
    path.write_text(line({"a": 9}) + line({"a": 10}) + line({"a": 11}))
    assert tail.read() == [{"a": 9}, {"a": 10}, {"a": 11}] and tail.restarted
    path.write_text(line({"b": 1}))  # same file, cut shorter
    assert tail.read() == [{"b": 1}] and tail.restarted
    assert tail.read() == [] and not tail.restarted


def test_a_final_read_keeps_a_whole_last_object_and_skips_a_torn_one(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(line({"a": 1}) + json.dumps({"a": 2}))  # killed before its newline: the object is whole
    assert JsonlTail(path).read() == [{"a": 1}]
    assert JsonlTail(path).read(final=True) == read_jsonl(path) == [{"a": 1}, {"a": 2}]
    path.write_text(line({"a": 1}) + '{"a": ')
    assert read_jsonl(path) == [{"a": 1}]
    path.write_bytes(line({"a": 1}).encode() + b'{"s": "\xc3' + b"\n" + line({"a": 3}).encode())  # torn UTF-8
    assert read_jsonl(path) == [{"a": 1}, {"a": 3}]
    assert read_jsonl(tmp_path / "none.jsonl") == []


def step_events(step: int):
    return [{"pid": 0, "tid": 1, "name": "forward", "ts": step, "dur": 1},
            {"pid": 0, "tid": 0, "name": f"step {step}", "ts": step, "dur": 2, "args": {"step": step}}]


def test_a_late_tail_reads_only_the_last_steps(tmp_path):
    path = tmp_path / "timeline-rank0.jsonl"
    path.write_text("".join(line(e) for s in range(2000) for e in step_events(s)))
    tail = JsonlTail.last(path, 3, ends_step, chunk=1024)
    events = tail.read(final=True)
    steps = [e["args"]["step"] for e in events if ends_step(e)]
    assert len(steps) > 3 and steps[-1] == 1999 and steps == list(range(steps[0], 2000))
    assert tail.bytes_read < path.stat().st_size / 10
    short = tmp_path / "short.jsonl"
    short.write_text("".join(line(e) for s in range(2) for e in step_events(s)))
    assert JsonlTail.last(short, 3, ends_step).offset == 0  # no more than that: the whole file
    assert JsonlTail.last(tmp_path / "none.jsonl", 3, ends_step).read() == []
    assert runlog.CHUNK > 1024


def test_a_late_tail_with_a_byte_bound_reads_the_last_whole_steps_that_fit(tmp_path):
    path = tmp_path / "timeline-rank0.jsonl"
    path.write_text("".join(line(e) for s in range(2000) for e in step_events(s)))
    tail = JsonlTail.last(path, None, ends_step, chunk=1024, max_bytes=10_000)
    events = tail.read(final=True)
    steps = [e["args"]["step"] for e in events if ends_step(e)]
    assert 10 < len(steps) < 200 and steps == list(range(steps[0], 2000))
    assert events[0]["name"] == "forward" and events == [e for s in steps for e in step_events(s)]  # whole steps
    assert tail.bytes_read <= 10_000
    few = JsonlTail.last(path, 3, ends_step, max_bytes=10_000).read(final=True)  # fewer steps than fit
    assert [e["args"]["step"] for e in few if ends_step(e)][-4:] == [1996, 1997, 1998, 1999]
    assert JsonlTail.last(path, None, ends_step, max_bytes=10).read(final=True) == []  # no whole step fits
    whole = JsonlTail.last(path, None, ends_step, max_bytes=path.stat().st_size + 1).read(final=True)
    assert len(whole) == 4000


# -- the one trials reader ---------------------------------------------------------------------------------------

def test_trials_are_read_through_one_reader(tmp_path):
    assert runfiles.read_trials(str(tmp_path)) is None and runfiles.read_trials(None) is None
    (tmp_path / runfiles.TRIALS).write_text(json.dumps({"dirs": ["trial-0", "trial-1"]}))
    found = runfiles.read_trials(str(tmp_path))
    assert found.session == ["trial-0", "trial-1"] and found.plan is None
    plan = {"trials": [{"label": "a", "spec": {}, "final": {}, "penalty": 1.0}], "warmup": 1, "steps": 2,
            "abort_after": 1, "abort_ratio": 1.5}
    (tmp_path / runfiles.AUTO_TRIALS).write_text(json.dumps(plan))
    with pytest.raises(ValueError, match="holds both trials.json and auto-trials.json"):
        runfiles.read_trials(str(tmp_path))
    (tmp_path / runfiles.TRIALS).unlink()
    found = runfiles.read_trials(str(tmp_path))
    assert found.plan == plan and found.session == []
    (tmp_path / runfiles.AUTO_TRIALS).unlink()
    for bad in ({"dirs": []}, {"dirs": ["../x"]}, {"nodirs": 1}, ["trial-0"]):
        (tmp_path / runfiles.TRIALS).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"trials.json: dirs must be a non-empty list of subdirectory names"):
            runfiles.read_trials(str(tmp_path))


def test_a_session_runs_trials_read_by_the_same_reader(tmp_path):
    from commlab.lab.rundir.store import Run
    from commlab.lab.strategy.trials import session_trials
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / runfiles.TRIALS).write_text(json.dumps({"dirs": ["trial-0", "trial-1"]}))
    got = session_trials(Run(tmp_path / "s"))
    assert [t.id for t in got] == ["s/trial-0", "s/trial-1"]
    assert session_trials(Run(tmp_path)) == []  # not a session


# -- the run's path: admit, queue, launch, follow, finish ------------------------------------------------------

def test_a_run_goes_queued_running_done_in_one_status_write_each(tmp_path, monkeypatch):
    """``commlab run``'s path writes status.json once per state: the run is made with its owner and supervisor,
    the supervisor taking it changes nothing, the launcher marks it running, and the final state carries the
    disturbance figures. The index follows each write."""
    from commlab.lab.base import procs
    from commlab.lab.service.queue import Lab
    from test_lab import SMALL
    seen = []
    real = Lab._changed
    monkeypatch.setattr(Lab, "_changed", lambda self, run: seen.append(run.status()) or real(self, run))
    lab = Lab(tmp_path)
    run = lab.create(commlab.spec(SMALL), supervisor=procs.identity())
    assert lab.supervise(run) == "done", run.log_tail()
    assert [s["state"] for s in seen] == ["queued", "running", "done"]
    assert seen[0]["supervisor"] == procs.identity() and seen[0]["owner"]
    assert seen[-1]["disturbance"]["final"] is True and seen[-1]["returncode"] == 0
    assert lab.index.query()[0]["state"] == "done"


def test_a_long_jsonl_is_read_as_one_array_and_a_torn_line_still_only_drops_itself():
    """runlog._parse reads many lines as one JSON array (fast), and anything that is not one whole object per
    line (a torn line, a line that is not an object) falls back to reading each line alone: the same rows."""
    from commlab.engine import runlog
    rows = [{"k": i, "s": "x" * (i % 7)} for i in range(200)]
    lines = [json.dumps(r).encode() for r in rows]
    assert runlog._parse(lines) == rows
    torn = lines[:100] + [lines[100][:9]] + lines[101:]  # a killed writer's torn line in the middle
    assert runlog._parse(torn) == rows[:100] + rows[101:]
    halves = lines[:50] + [b'{"k": [1', b'2]}'] + lines[50:]  # two fragments that make one object when joined
    assert runlog._parse(halves) == rows
    assert runlog._parse(lines + [b"7"]) == rows + [7]  # a line that is not an object: kept, as alone
