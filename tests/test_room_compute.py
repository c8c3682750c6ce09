"""What a viewer of an exposed lab may make the server compute, and where the lab writes files named from what
they typed, tried as a student would on a workshop server (AppTest sessions of a student and of the teacher, and
the functions the pages call):

- Bounded parameters: every declared parameter of every registered compressor and method that sizes memory or
  work has an upper bound (a table walks the registries); a Count Sketch upload asking for a table of 50 M
  columns is refused with one line naming ``cols`` before anything is timed; the bounds refuse no example, preset
  or shipped spec.
- Nothing a viewer configures is timed in the server's process: the cost curve of a viewer's compressor is timed in
  a child (commlab.lab.base.sandbox, task ``curves``), what it measured is kept, and a page load does not measure again;
  the command line still times in its own process.
- File names from a user's text (commlab.lab.base.paths.safe_name, file_in): a model option holding ``/../../../x`` leads
  the teacher's advisor to write nothing outside the runs directory.
"""
import importlib.util
import json
import os
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

pytest.importorskip("streamlit")

import commlab  # noqa: E402
from commlab.engine import codepath, compressors, methods  # noqa: E402
from commlab.engine.compressors import countsketch  # noqa: E402
from commlab.engine.spec import SpecError  # noqa: E402
from commlab.lab.base import paths, sandbox  # noqa: E402
from commlab.lab.base.specs import load_spec  # noqa: E402
from commlab.lab.front import profiles as viewing  # noqa: E402
from commlab.room import owners  # noqa: E402
from commlab.room import open_lab  # noqa: E402
from commlab.lab.strategy.perfmodel import calibrate as cal  # noqa: E402
from commlab.lab.strategy.perfmodel import predict, whatif  # noqa: E402
from commlab.room import places  # noqa: E402
from commlab.lab.base.kept import Kept  # noqa: E402
from test_app import ENTRY, SMALL  # noqa: E402
from test_perfmodel import tiny_profile  # noqa: E402
from test_safe_room import as_viewer, one_line, profiles, room  # noqa: E402,F401  (fixtures)
from test_workshop import app  # noqa: E402
from distutil import counted  # noqa: E402

HAS_HF = importlib.util.find_spec("transformers") is not None
ROOT = Path(__file__).resolve().parents[1]
MLP = {"model": "mlp", "dataset": "digits", "batch_size": 16}


@pytest.fixture
def timed(monkeypatch):
    """Every way a compressor is timed or driven in this process, and every child started, recorded: in this
    process each one fails (the page shows it as an exception); children run as they would."""
    got = {"here": [], "children": []}

    def here(name):
        def refuse(*a, **k):
            got["here"].append(name)
            raise AssertionError(f"{name} ran in the server's process")
        return refuse
    for name in ("measure_compressor", "_measure_compressor", "drive"):
        monkeypatch.setattr(cal, name, here(name))
    spawn = sandbox._spawn

    def child(task, spec, limits):
        got["children"].append(task)
        return spawn(task, spec, limits)
    monkeypatch.setattr(sandbox, "_spawn", child)
    monkeypatch.setattr(cal, "_CURVES", Kept(cal.CURVES_KEPT), raising=False)  # nothing kept from before the test
    monkeypatch.setattr(viewing, "_predictions", Kept(viewing.PREDICTIONS))
    return got


def upload(at, name: str, profile) -> None:
    at.file_uploader(key="pm.prof.upload").upload(name, json.dumps(asdict(profile)).encode(), "application/json").run()
    assert not at.exception, [e.value for e in at.exception]


# --------------------------------------------------------------------------- bounded parameters

def test_a_countsketch_upload_with_a_huge_table_is_refused_before_anything_is_timed(profiles, timed):
    """The 270-byte profile: a Count Sketch of 50 M columns (about 5 GB of tables at 5 rows) is one line naming
    cols, for a student at upload and for the teacher at prediction; nothing was timed, driven or started."""
    root, tokens, _ = profiles
    huge = tiny_profile(spec={**MLP, "compressor": {"name": "countsketch", "cols": 50_000_000}})
    said = ("compressor: cols: must be at most 16777216 (the table and its work buffers take about 20 bytes a "
            "cell, rows x cols cells), got 50000000")
    at = app(tokens["alice"], page="model")
    upload(at, "huge.json", huge)
    assert [one_line(e.value) for e in at.error] == [said]
    assert not at.dataframe
    with pytest.raises(SpecError) as e:  # the teacher's profile is read as it is, and refused when predicted
        viewing.cluster_prediction(owners.User(owners.TEACHER, admin=True), huge,
                                   {"node_size": 8, "intra_gbps": 1600.0, "nics": 1}, [8], [10.0])
    assert one_line(str(e.value)) == said
    assert timed == {"here": [], "children": []}


def test_a_students_profile_keeps_to_their_steps(profiles, timed):
    """A method's prediction simulates every step of its run (100,000 local SGD steps took 26 s of CPU): a
    student's profile whose spec asks for more steps than their quota is refused as a run would be."""
    root, tokens, _ = profiles
    long = tiny_profile(spec={**MLP, "steps": 100_000, "method": {"name": "local_sgd", "H": 1}})
    at = app(tokens["alice"], page="model")
    upload(at, "long.json", long)
    assert [one_line(e.value) for e in at.error] == ["quota steps: at most 2000 steps per run, asked for 100000"]
    assert not at.dataframe and timed == {"here": [], "children": []}


def test_a_table_of_more_cells_than_the_bound_is_refused_naming_cols():
    rows = 5
    cols = countsketch.MAX_CELLS // rows + 1
    assert cols <= countsketch.MAX_COLS  # each bound alone would pass: the product is refused
    with pytest.raises(ValueError) as e:
        compressors.make("countsketch", rows=rows, cols=cols)
    assert one_line(str(e.value)) == (f"cols: rows x cols must be at most {countsketch.MAX_CELLS} cells (about "
                                      f"{countsketch.CELL_BYTES} bytes of memory each), got {rows} x {cols}")
    compressors.make("countsketch", rows=4, cols=countsketch.MAX_CELLS // 4)  # at the bound: allowed


NOT_SIZING = {
    ("threshold", "threshold"): "a higher threshold sends fewer entries; at most the bucket's",
    ("dgc", "clip"): "a norm the gradient is clipped to; it allocates nothing",
    ("powersgd", "min_compression_rate"): "a higher rate compresses fewer tensors; the rest are sent as they are",
}
"""Float parameters without an upper bound, and why none is needed: none sizes memory or work."""


def declared():
    for kind, registry in (("compressor", compressors.REGISTRY), ("method", methods.REGISTRY)):
        for name, cls in registry.items():
            for p in cls.params:
                yield kind, name, p


@pytest.mark.parametrize("kind,name,p", list(declared()), ids=lambda x: getattr(x, "name", x))
def test_every_declared_parameter_is_bounded_or_sizes_nothing(kind, name, p):
    """Every int parameter of every registered compressor and method has an upper bound (a compressor's says
    why); a float either has one or is listed in NOT_SIZING with the reason it needs none. The bound is what
    the parameter refuses above it, in one line naming it."""
    if p.type is bool:
        return
    if p.type is str:  # a choice: bounded by its choices
        assert p.choices, f"{kind} {name}: {p.name} lists no choices"
        with pytest.raises(ValueError, match=rf"^{p.name}: must be one of "):
            (compressors.make if kind == "compressor" else methods.make)(name, **{p.name: "x" * 10_000})
        return
    if p.type is float and p.hi is None:
        assert (name, p.name) in NOT_SIZING, f"{kind} {name}: {p.name} has no upper bound"
        return
    assert p.hi is not None, f"{kind} {name}: {p.name} has no upper bound"
    if p.type is int and kind == "compressor":
        assert p.note.startswith(" (") and p.note.endswith(")"), f"{name}: {p.name}'s bound says not why"
    over = p.hi + 1 if p.type is int else p.hi + 1e-3
    make = compressors.make if kind == "compressor" else methods.make
    with pytest.raises(ValueError, match=rf"^{p.name}: must be "):
        make(name, **{p.name: over})


def test_the_reference_lists_every_bound():
    """docs/reference/compressors.md's table of upper bounds is the declarations': every int parameter but the
    seeds (said once), its bound and its reason; the Count Sketch cells and the seeds' bound in the text."""
    text = (ROOT / "docs" / "reference" / "compressors.md").read_text()
    table = text[text.index("| compressor | parameter | at most | why |"):].split("\n\n")[0]
    want = [f"| {name} | {p.name} | {int(p.hi):,} | {p.note.strip()[1:-1]} |" for kind, name, p in declared()
            if kind == "compressor" and p.type is int and p.name != "seed"]
    assert table.splitlines()[2:] == want
    assert f"`rows` x `cols` <= {countsketch.MAX_CELLS:,}" in text
    assert "every `seed` is at most 2^63 - 1" in text
    assert {p.hi for _, _, p in declared() if p.name == "seed"} == {2 ** 63 - 1}


def shipped_specs():
    """Every spec the lab ships: the examples, the presets' variants, the page's compressors."""
    from commlab.lab.analysis.presets import PRESETS
    from commlab.lab.strategy.perfmodel import views
    for f in sorted((ROOT / "examples").glob("*.yaml")):
        data = yaml.safe_load(f.read_text())
        if isinstance(data, dict) and "grid" not in data and "apiVersion" not in data:
            yield f.name, data
    for p in PRESETS:
        for s in p.specs():
            yield s["name"], s
    for label, comp in views.COMPRESSORS.items():
        yield label, {**MLP, "compressor": comp}


def test_the_bounds_refuse_nothing_the_lab_ships():
    """Every int parameter is bounded (the table above, in one), and no bound refuses an example, a preset's
    variant or one of the Performance model page's compressors."""
    unbounded = [f"{name}.{p.name}" for _, name, p in declared() if p.type is int and p.hi is None]
    assert unbounded == []
    with codepath.no_imports():  # the syntax of the example that names a package of its own
        for name, data in shipped_specs():
            try:
                load_spec(data=data)
            except SpecError as e:
                pytest.fail(f"{name}: {e}")


# --------------------------------------------------------------------------- timed in a child, kept

@pytest.mark.parametrize("comp", [{"name": "countsketch", "rows": 3, "cols": 2000}, {"name": "qsgd", "levels": 15}])
def test_a_viewers_compressor_is_timed_in_a_child(profiles, timed, comp):
    """A student's uploaded profile names a compressor the page has no curve for (Count Sketch declares its
    payload; QSGD's is driven): its curve and payload are measured by a sandbox child, with the prediction,
    not here; the page shows the prediction and the curve."""
    root, tokens, _ = profiles
    mine = tiny_profile(spec={**MLP, "compressor": comp}, compressors={})
    at = app(tokens["alice"], page="model")
    upload(at, "mine.json", mine)
    assert not at.error, [e.value for e in at.error]
    assert at.dataframe  # the sources and the prediction
    assert timed["children"] == ["predict"] and timed["here"] == []
    key = cal.compressor_key(load_spec(data=mine.spec).to_dict()["compressor"])
    ((_, curves),) = viewing._predictions.values()  # what the child measured, kept with the prediction
    assert curves[key]["sizes"] == [n * 4 for n in cal.CURVE_NUMELS]
    at.run()  # kept: no child again
    assert timed["children"] == ["predict"]


def test_page_loads_do_not_time_the_runs_compressors_again_nor_predict_a_point_seen_before(room, timed, monkeypatch):
    """The page predicts every finished run a viewer may see: their compressors (and the page's five) are timed
    once, in children; a rerun of the page, and the teacher's visit, time nothing. What it predicts from the runs
    (the speedup grid, the crossovers, every finished run's prediction) is kept per point of its sliders: a page
    opened again, or a slider moved back, calibrates and predicts nothing. A person's second page asking while
    their first predicts waits, then is told they are busy: one line, no traceback, nothing predicted for it."""
    root, tokens = room
    run = open_lab(root, room=True).submit(commlab.spec(dict(SMALL, compressor="signum")), wait=True, owner="alice")
    assert run.state == "done", run.log_tail()
    at = app(tokens["alice"], page="model")
    assert not at.error, [e.value for e in at.error]
    first = list(timed["children"])
    assert 1 <= first.count("curves") <= 2 and "rounds" in first  # signum's payload is driven, in a child
    assert timed["here"] == []
    per_run = [d.value for d in at.dataframe if "predicted_ms" in d.value.columns]
    assert per_run and per_run[0]["predicted_ms"].notna().all(), per_run
    at.run()
    assert not at.error and timed["children"] == first
    at = app(tokens["admin"], page="model")
    assert not at.error and timed["children"] == first
    assert timed["here"] == []

    calls = {"from_run": 0, "speedup": 0}
    monkeypatch.setattr(cal, "from_run", counted(calls, "from_run", cal.from_run))
    monkeypatch.setattr(predict, "speedup", counted(calls, "speedup", predict.speedup))
    at = app(tokens["alice"], page="model")
    assert not at.exception and calls == {"from_run": 0, "speedup": 0}  # the page again: every answer kept
    at.select_slider(key="pm.gbps").set_value(0.1).run()
    assert calls["from_run"] == 0 and calls["speedup"] > 0  # a new point: its grid, from the kept profile
    made = dict(calls)
    at.select_slider(key="pm.gbps").set_value(1.0).run()
    assert calls == made and not at.exception  # a point seen before
    monkeypatch.setattr(sandbox, "WAIT_S", 0.2)
    with places.person("alice", "prediction"):  # alice's other page, predicting
        t = threading.Thread(target=lambda: at.select_slider(key="pm.gbps").set_value(10.0).run())
        t.start()
        t.join(60)
    assert not at.exception, [e.value for e in at.exception]
    assert [w.value for w in at.warning] == ["prediction: your previous one is still running; try again in a moment"]
    assert calls == made and timed["children"] == first and timed["here"] == []


def test_a_view_in_the_server_reads_at_most_view_mb_of_a_runs_timelines(tmp_path, monkeypatch):
    """A run's timelines can be gigabytes (a model of 2,000 tensors under layer-wise writes about 1.6 MB per step
    and rank): a thread serving a viewer reads at most VIEW_MB of them, each rank's last whole steps (the
    calibration, the explanation, the trace download, the live page's kept steps), and says so; the command
    line and the API read the whole run."""
    from commlab.engine.timeline import ends_step
    from commlab.lab.analysis import live, trace
    from commlab.lab.rundir import store
    run = open_lab(tmp_path).create(commlab.spec(SMALL))

    def line(rank, s):  # one step of one rank: three layers' forward spans, then its step span
        return "".join(json.dumps({"ph": "X", "name": name, "pid": rank, "tid": tid, "cat": cat, "ts": s * 100.0,
                                   "dur": 1.0, "args": {"step": s}}) + "\n"
                       for name, tid, cat in [("l0", 1, "forward"), ("l1", 1, "forward"), ("l2", 1, "forward"),
                                              (f"step {s}", 0, "step")])
    for rank in range(2):
        (run.path / f"timeline-rank{rank}.jsonl").write_text("".join(line(rank, s) for s in range(3000)))
    size = sum(p.stat().st_size for p in run.timeline_files())
    monkeypatch.setattr(store, "VIEW_MB", 0.25)
    cap = int(0.25 * 2**20)
    assert size > 4 * cap
    assert len(run.timeline_events()) == 2 * 3000 * 4 and not run.view_cut()  # not serving: whole
    monkeypatch.setattr(store, "_bounded_when", lambda: True)
    assert run.view_cut()
    events = run.timeline_events()
    for rank in range(2):
        mine = [e for e in events if e["pid"] == rank]
        steps = [e["args"]["step"] for e in mine if ends_step(e)]
        assert steps[-1] == 2999 and steps == list(range(steps[0], 3000)) and len(mine) == 4 * len(steps)
    assert 0.8 * cap < len(json.dumps(events)) < 1.1 * cap  # about VIEW_MB, no more
    few = run.timeline_events(last_steps=5)  # at least the steps asked for, within the bound too
    assert len(few) >= 2 * 4 * 5 and len(json.dumps(few)) < 1.1 * cap
    got = trace.chrome_trace(run)
    assert got["otherData"]["cut"].startswith("each rank's last steps that fit 0.25 MB of timeline over the ranks "
                                              "(steps ")
    monkeypatch.setattr(store, "VIEW_MB", 0.02)  # the live page's kept steps: fewer than KEEP_STEPS fit in it
    small = int(0.02 * 2**20)
    followed = live.LiveRun(run).refresh()
    kept = [len(r.steps) for r in followed.ranks.values()]
    assert 10 < min(kept) and max(kept) < live.KEEP_STEPS and sum(sum(r.sizes) for r in followed.ranks.values()) <= small
    assert followed.has_steps(min(kept)) and not followed.has_steps(max(kept) + 1)  # the rest: read from the files
    for rank in range(2):  # the run goes on: what the page keeps stays within the bound
        with open(run.path / f"timeline-rank{rank}.jsonl", "a") as f:
            f.write("".join(line(rank, s) for s in range(3000, 4000)))
    followed.refresh()
    assert sum(sum(r.sizes) for r in followed.ranks.values()) <= small
    assert followed.ranks["timeline-rank1.jsonl"].steps[-1][-1]["args"]["step"] == 3999
    # the Live page zoomed to a step: where the server reads only the last steps, it says why an older one is empty
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.query_params["run"] = run.id
    at.run().switch_page("views/live_run.py").run()
    at.number_input(key="live.step").set_value(5).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("an older step shows no spans here" in c.value for c in at.caption), [c.value for c in at.caption]


def test_the_compare_page_takes_at_most_max_runs(room):
    """Every run compared costs its breakdown and explanation on every rerun, and its part of the report: a
    student who may see hundreds of runs compares at most MAX_RUNS at once, also when they came from another
    page's list."""
    from commlab.app import compare_view
    root, tokens = room
    lab = open_lab(root, room=True)
    made = [lab.create(commlab.spec(SMALL), owner="alice") for _ in range(compare_view.MAX_RUNS + 2)]
    for r in made:
        r.mark_cancelled("made for the test")
    at = app(tokens["alice"])
    at.session_state["compare_ids"] = [r.id for r in made]  # as a page that opens Compare with a list sets it
    at.switch_page("views/compare.py").run()
    assert not at.exception, [e.value for e in at.exception]
    picker = at.multiselect(key="cmp.runs")
    assert picker.proto.max_selections == compare_view.MAX_RUNS == 8
    assert picker.value == [r.id for r in made][-compare_view.MAX_RUNS:]
    assert len(at.dataframe[0].value) == compare_view.MAX_RUNS


def test_the_pages_look_for_dead_supervisors_at_most_every_few_seconds(tmp_path, monkeypatch):
    """Looking for runs whose supervisor died reads every run's status (a second for thousands of runs): the
    pages' lists do it at most every RECOVER_EVERY_S per runs directory, however many pages load meanwhile."""
    from commlab.lab.front import ui
    from commlab.lab.service.queue import Lab
    looked, now = [], [1000.0]
    monkeypatch.setattr(Lab, "recover_stale", lambda self: looked.append(self.root) or [])
    monkeypatch.setattr(ui.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(ui, "_recovered", {})
    for _ in range(5):
        ui.list_runs(tmp_path)
    assert len(looked) == 1
    now[0] += ui.RECOVER_EVERY_S
    ui.list_runs(tmp_path)
    ui.list_runs(tmp_path / "other")
    assert looked == [tmp_path, tmp_path, tmp_path / "other"]


def test_a_busy_server_is_not_kept_as_the_profiles_answer(profiles, monkeypatch):
    """No place for a child now is said as it is, and the next request predicts: a moment's load is not the
    profile's kept answer."""
    monkeypatch.setattr(viewing, "_predictions", Kept(viewing.PREDICTIONS))
    real, calls = sandbox.run, []

    def busy_once(*a, **k):
        calls.append(a[0])
        if len(calls) == 1:
            raise sandbox.Busy("cost curve", "all 2 of the server's places for previews and checks are taken; "
                                             "try again in a moment")
        return real(*a, **k)
    monkeypatch.setattr(sandbox, "run", busy_once)
    prof = tiny_profile(spec={**MLP, "compressor": "signsgd"}, compressors={})
    args = ({"node_size": 8, "intra_gbps": 1600.0, "nics": 1}, [8], [10.0])
    alice = owners.User("alice")
    with codepath.no_imports():  # as in the server
        with pytest.raises(sandbox.Busy):
            viewing.cluster_prediction(alice, prof, *args)
        assert not viewing.cluster_prediction(alice, prof, *args).empty
    assert calls == ["predict", "predict"]


def test_the_command_line_times_in_its_own_process(monkeypatch):
    """Where this process may import code (the CLI, the advisor's process) nothing is started: curves are timed
    here, and not kept in the process (the machine's curves file is the command line's cache)."""
    monkeypatch.setattr(sandbox, "_spawn", lambda *a: pytest.fail("started a child"))
    monkeypatch.setattr(cal, "_CURVES", Kept(cal.CURVES_KEPT), raising=False)
    items = [{"compressor": {"name": "signsgd", "params": {}, "error_feedback": False}},
             {"method": {"name": "demo", "params": {"chunk": 16, "topk": 2}}}]
    curves = cal.measure_curves(items, numels=(1024, 4096), repeat=1, warm=1)
    assert len(curves) == 2 and all(c["source"].startswith("measured in-process") for c in curves)
    assert not cal._CURVES


# --------------------------------------------------------------------------- names from a user's text

@pytest.mark.parametrize("text", ["..", ".", "/", "a/b", "/../../../x", "a\\b", "..\\..\\x", "a\0b", "", "\n",
                                  ".hidden", "x" * 300, "é" * 200, "名" * 100, "\udc80x",
                                  "a~0123456789abcdef"])
def test_safe_name_is_one_plain_name(text):
    name = paths.safe_name(text)
    assert name and "/" not in name and "\\" not in name and "\0" not in name and name.isprintable()
    assert not name.startswith(".") and len(name.encode()) <= paths.NAME_BYTES
    if name != text:
        assert len(name) >= 17 and name[-17] == "~" and all(c in "0123456789abcdef" for c in name[-16:])


def test_safe_name_keeps_safe_names_and_distinct_texts_apart():
    for text in ("cnn-digits-b32", "resnet(width=64)-synthetic-b64", "hf:gpt2(n_embd=8,n_head=2)-text-b16",
                 "modèle", "x" * paths.NAME_BYTES):
        assert paths.safe_name(text) == text  # the names the lab wrote before stay theirs
    texts = ["a/b", "a\\b", "a\0b", "a_b", "a\nb", "../x", "_x", ".x", "x" * 300, "x" * 301,
             "a_b~" + paths.safe_name("a/b")[-16:]]
    assert len({paths.safe_name(t) for t in texts}) == len(texts)


def test_file_in_stays_in_its_folder(tmp_path):
    d = tmp_path / "profiles"
    d.mkdir()
    assert paths.file_in(d, "/../../x", ".json").parent == d
    (d / "out.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(paths.OutsideFolder) as e:
        paths.file_in(d, "out", ".json")
    assert one_line(str(e.value)) == "out.json: a link in profiles that leads outside it; not used"
    assert str(tmp_path) not in str(e.value)


@pytest.mark.skipif(not HAS_HF, reason="needs transformers")
def test_a_model_option_holding_a_path_writes_nothing_outside_the_runs(tmp_path, monkeypatch):
    """A student's hf: model with an option ``/../../../escaped/x`` finishes a run; the teacher's advisor on it
    (what the Advisor page's job runs) saves and reads the model's profile inside runs/.profiles/ under a safe
    name, and writes nothing outside the runs directory."""
    from commlab.lab.strategy import advisor
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setenv("COMMLAB_RUNS", str(root))
    spec = commlab.spec({"model": {"name": "hf:gpt2", "options": {"n_layer": 1, "n_embd": 8, "n_head": 2,
                                                                "note": "/../../../escaped/x"}},
                      "dataset": {"name": "text", "block": 16}, "steps": 5, "batch_size": 4, "eval_every": 0,
                      "final_eval": False, "threads": 1, "world_size": 1})
    run = open_lab(root, room=True).submit(spec, wait=True, owner="alice")
    assert run.state == "done", run.log_tail()

    def outside():
        return sorted(str(p) for p in tmp_path.rglob("*") if root not in p.parents and p != root)
    before = outside()
    adv = advisor.advise(run.spec_dict(), runs=root, gbps=1.0, workers=4, say=lambda m: None)
    assert adv.winner is not None
    assert outside() == before
    saved = whatif.profile_file(root, cal.spec_key(run.spec_dict()))
    assert saved.parent == root / paths.PROFILES and saved.is_file() and "/" not in saved.name
    assert [p for p in (root / paths.PROFILES).iterdir() if p.is_dir()] == []
    assert whatif.known_profile(run.spec_dict(), root).key() == cal.spec_key(run.spec_dict())  # read back
