"""A room you can trust: no code from students, bounded students, the Performance model page, tried as an attacker
would: through AppTest sessions of a student and of the teacher on an exposed lab (COMMLAB_ACCESS=token),
and at the lab level (commlab.lab.front.ui, new_run, groups and previews as the pages call them, the queue, commlab.lab.base.sandbox).

- No student's code: a spec that names code (an import path) is refused for a student at every entry, with
  one line naming the field, and nothing it names is imported: marker files such code would write stay
  absent, and its module is not in this process's sys.modules.
- No viewer's code in the server: the teacher's own model is previewed and checked in a child process (its
  marker carries another PID), and a child that sleeps, allocates or spins is stopped at its limit with one
  line in the form. A student driving previews does not grow the server's memory.
- Bounded students: each limit refuses with its name, the defaults hold with no runs/lab.json on an exposed
  lab (not on loopback), and concurrent submits cannot pass the queued limit.
- The Performance model page reads only the lab's own files; "Measure again" is the teacher's and atomic.
"""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import types
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

pytest.importorskip("streamlit")

import commlab  # noqa: E402
from commlab.engine import codepath  # noqa: E402
from commlab.engine.spec import JobSpec, SpecError  # noqa: E402
from commlab.lab.front import groups, new_run, ui  # noqa: E402
from commlab.room import accounts, previews  # noqa: E402
from commlab.lab.base import paths, sandbox
from commlab.lab.base.specs import load_spec, typed_yaml
from commlab.room import owners, places
from commlab.lab.strategy.perfmodel import views  # noqa: E402
from commlab.room import open_lab  # noqa: E402
from commlab.lab.base.errors import LabError  # noqa: E402
from test_app import SMALL  # noqa: E402
from test_workshop import app, everything  # noqa: E402
from commlab.lab.front import profiles as viewing  # noqa: E402
from commlab.lab.base.kept import Kept  # noqa: E402

HAS_HF = importlib.util.find_spec("transformers") is not None
RSS_BOUND_MB = 200
"""How much the server's (this process's) resident memory may grow while a student drives 30 previews."""


@pytest.fixture
def room(tmp_path, monkeypatch):
    """An exposed lab with no runs/lab.json: the teacher's token and a student's (alice)."""
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setenv("COMMLAB_RUNS", str(root))
    monkeypatch.setenv(accounts.ACCESS_ENV, "token")
    access = accounts.load_access(root)
    tokens = {"admin": access["admin_token"], "alice": accounts.sign_in(root, access["class_token"], "alice")}
    yield root, tokens
    ui.set_viewer(None)
    for r in commlab.runs(runs=root):  # nothing a test queued may outlive it
        if r.state in ("queued", "running"):
            commlab.cancel(r.id, runs=root)
    for r in commlab.runs(runs=root):
        commlab.wait(r.id, runs=root, timeout=120)


class Code:
    """Modules in a folder on sys.path and PYTHONPATH (as the teacher's packages would be), each appending
    its process's PID to a marker file when it is imported."""

    def __init__(self, folder, monkeypatch):
        self.dir = folder
        folder.mkdir()
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.setenv("PYTHONPATH", str(folder) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def module(self, body: str = "") -> tuple:
        """(module name, marker path) of a new module: a model factory ``build`` with ``body`` at its start."""
        name = f"m{uuid.uuid4().hex[:12]}"
        marker = self.dir / f"{name}.imported"
        lines = ["import math, os", "import torch.nn as nn", f"with open({str(marker)!r}, 'a') as f:",
                 "    f.write(f'{os.getpid()}\\n')", "", "def build(width=4, info=None):",
                 *("    " + line for line in textwrap.dedent(body).splitlines()),
                 "    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(info.input_shape), width),",
                 "                         nn.Linear(width, info.num_classes))", "", "def loss(out, y):",
                 "    return out.sum()", ""]
        (self.dir / f"{name}.py").write_text("\n".join(lines))
        return name, marker

    @staticmethod
    def pids(marker) -> list:
        return [int(x) for x in marker.read_text().split()] if marker.exists() else []


@pytest.fixture
def code(tmp_path, monkeypatch):
    return Code(tmp_path / "pkgs", monkeypatch)


def as_viewer(name: str, admin: bool = False) -> None:
    ui.set_viewer(lambda: owners.User(name, admin=admin))


def one_line(msg: str) -> str:
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


# --------------------------------------------------------------------------- 1. no student's code

def test_the_new_run_form_offers_students_no_import_path(room):
    root, tokens = room
    at = app(tokens["alice"], page="new_run")
    assert new_run.IMPORT_PATH not in at.selectbox(key="nr.model_source").options
    assert new_run.IMPORT_PATH not in at.selectbox(key="nr.dataset").options
    assert not any(s.key == "nr.comp_source" for s in at.selectbox)  # compressors from the registry only
    assert not any(t.key == "nr.comp_path" for t in at.text_input)
    assert not at.error and not at.button(key="nr.submit").disabled  # the zoo's cnn is theirs
    at = app(tokens["admin"], page="new_run")  # the teacher keeps it
    assert new_run.IMPORT_PATH in at.selectbox(key="nr.model_source").options
    assert new_run.IMPORT_PATH in at.selectbox(key="nr.dataset").options
    assert new_run.IMPORT_PATH in at.selectbox(key="nr.comp_source").options


def test_a_students_code_is_refused_at_every_entry_and_never_imported(room, code, tmp_path):
    """The attacks tried here (a model ``subprocess:getoutput`` with ``cmd: touch MARKER``, a loader
    ``os:system``), and a module of the student's own that would run at import, as a model, a loss and a
    compressor: refused by validation, by the API the pages use, and by the queue for owner alice."""
    root, _ = room
    touched = tmp_path / "touched"
    evil, marker = code.module()
    attacks = [
        ({"model": {"name": "subprocess:getoutput", "options": {"cmd": f"touch {touched}"}}}, "model.name"),
        ({"model": "mlp", "dataset": {"name": "os:system", "options": {"command": f"touch {touched}"}}},
         "dataset.name"),
        ({"model": f"{evil}:build"}, "model.name"),
        ({"model": {"name": "cnn", "loss": f"{evil}:loss"}}, "model.loss"),
        ({"model": "mlp", "compressor": {"name": f"{evil}:Topk", "ratio": 0.1}}, "compressor.name"),
    ]
    as_viewer("alice")
    for data, field in attacks:
        data = {**SMALL, **data}
        spec, err = new_run.validate(data)
        assert spec is None and err.path == field and "names code" in one_line(err.msg), (field, err)
        with pytest.raises(SpecError, match="only the teacher may run code") as e:
            new_run.submit(data)
        assert one_line(str(e.value)).startswith(f"{field}: ")
        with codepath.no_imports():  # the spec as a CLI or a script would hand it to the queue
            parsed = commlab.spec(data)
        with pytest.raises(SpecError, match=f"^{field}: .*only the teacher may run code"):
            open_lab(root, room=True).submit(parsed, wait=False, owner="alice")
    assert not touched.exists() and not marker.exists()
    assert evil not in sys.modules
    assert commlab.runs(runs=root) == []  # nothing was queued


def test_a_students_upload_on_the_model_page_cannot_name_code(room, code):
    root, tokens = room
    from test_perfmodel import tiny_profile
    evil, marker = code.module()
    profile = tiny_profile(spec={"model": {"name": f"{evil}:build"}, "dataset": "digits", "batch_size": 16})
    at = app(tokens["alice"], page="model")
    assert not any(t.key == "pm.prof.path" for t in at.text_input)  # no server path to type
    at.file_uploader(key="pm.prof.upload").upload("p.json", json.dumps(asdict(profile)).encode(),
                                                  "application/json").run()
    assert not at.exception, [e.value for e in at.exception]
    assert [one_line(e.value) for e in at.error] == [
        f"model.name: '{evil}:build' names code (an import path); only the teacher may run code on this lab: "
        f"choose one of the lab's own"]
    assert not marker.exists() and evil not in sys.modules


# --------------------------------------------------------------------------- 1. no viewer's code in the server

def test_the_teachers_model_is_previewed_and_checked_in_a_child(room, code):
    root, tokens = room
    mod, marker = code.module()
    at = app(tokens["admin"], page="new_run")
    at.selectbox(key="nr.model_source").set_value("import path").run()
    at.text_input(key="nr.model_path.import path").set_value(f"{mod}:build")
    at.text_area(key="nr.model_options.import path").set_value("width: 5").run()
    at.selectbox(key="nr.dataset").set_value("digits").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    # digits are 1x8x8 in 10 classes: 64*5+5 + 5*10+10
    assert any(c.value.startswith("385 parameters in 4 tensors") for c in at.caption), [c.value for c in at.caption]
    previews = Code.pids(marker)
    assert previews and os.getpid() not in previews  # imported, in another process
    at.number_input(key="nr.steps").set_value(2)
    at.button(key="nr.submit").click().run()  # the first-batch check before queueing: a child too
    assert not at.exception, [e.value for e in at.exception]
    run_id = at.session_state["run_id"]
    assert commlab.get(run_id, runs=root).status()["owner"] == owners.TEACHER
    assert len(Code.pids(marker)) > len(previews)
    assert os.getpid() not in Code.pids(marker) and mod not in sys.modules


LIMITED = {
    # 8 s: the child imports torch before the module, which took more than 4 s for a CUDA build of torch on a
    # loaded GPU machine (the module never started, so no child was seen)
    "sleeps": ("import time\ntime.sleep(60)", sandbox.Limits(wall_s=8, cpu_s=30, memory=2 << 30),
               "preview: took more than 8 s"),
    "allocates": ("hog = bytearray(3 << 30)", sandbox.Limits(wall_s=30, cpu_s=30, memory=2 << 30),
                  "preview: more than 2 GiB of memory"),
    "spins": ("import time\nt = time.process_time()\nwhile True:\n    pass",
              sandbox.Limits(wall_s=40, cpu_s=6, memory=2 << 30), "preview: used more than 6 s of CPU"),
}


@pytest.mark.parametrize("how", list(LIMITED))
def test_a_preview_child_is_stopped_at_its_limit(room, code, monkeypatch, how):
    root, tokens = room
    body, limits, said = LIMITED[how]
    monkeypatch.setattr(sandbox, "PREVIEW", limits)
    mod, marker = code.module(body)
    spawned = []  # the children started for this module, whether or not they got as far as importing it
    spawn = sandbox._spawn
    monkeypatch.setattr(sandbox, "_spawn", lambda task, spec, limits: (
        spawned.append(task) if mod in json.dumps(spec) else None) or spawn(task, spec, limits))
    at = app(tokens["admin"], page="new_run")
    at.selectbox(key="nr.model_source").set_value("import path").run()
    at.text_input(key="nr.model_path.import path").set_value(f"{mod}:build").run()
    assert not at.exception, [e.value for e in at.exception]
    assert [one_line(e.value) for e in at.error] == [said]
    assert at.button(key="nr.submit").disabled
    (pid,) = Code.pids(marker)
    assert pid != os.getpid()
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)
    at.run()
    assert [e.value for e in at.error] == [said]
    if how == "sleeps":  # out of time may be the machine's doing: asked again, and stopped again (on a loaded
        # machine the second child may be stopped before it imports the module: it is counted as started)
        assert len(spawned) == 2 and len(Code.pids(marker)) in (1, 2)
    else:  # the answer is kept: no second child
        assert len(spawned) == 1 and Code.pids(marker) == [pid]


def test_the_childs_memory_limit_counts_allocations_not_mapped_code(tmp_path):
    """Under the preview's limits a child may map more than its memory limit read-only (what a CUDA build of
    torch does with its libraries' code on import: every preview failed on an H100 machine under an address
    space limit), yet allocating past the limit is still a MemoryError."""
    big = tmp_path / "code.bin"
    with open(big, "wb") as f:
        f.truncate(3 << 30)  # sparse: nothing written
    probe = textwrap.dedent(f"""
        import mmap, sys
        from commlab.lab.base import sandbox
        sandbox._limit(sandbox.PREVIEW)
        with open({str(big)!r}, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        print("mapped", len(m) >> 30, flush=True)
        try:
            hog = bytearray(3 << 30)
        except MemoryError:
            print("refused", flush=True)
        """)
    r = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["mapped", "3", "refused"], r.stdout + r.stderr


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_a_student_driving_previews_does_not_grow_the_server(room):
    """30 reruns with new data set sizes (every one a data set of 60 MB and more if built here), sizes of
    10 M, and a Hugging Face model with a huge width: the server's memory grows by less than RSS_BOUND_MB."""
    root, tokens = room
    at = app(tokens["alice"], page="new_run")
    at.selectbox(key="nr.dataset").set_value("synthetic").run()
    assert not at.error, [e.value for e in at.error]
    before = rss_mb()
    for i in range(30):
        size = 10_000_000 if i % 10 == 4 else 5000 + i
        at.number_input(key="nr.ds.size").set_value(size).run()
        assert not at.exception, [e.value for e in at.exception]
        errors = [e.value for e in at.error]
        if size == 10_000_000:
            assert errors == ["quota examples: at most 100000 training examples in a synthetic data set, "
                              "asked for 10000000"]
        else:
            assert not errors, errors
    if HAS_HF:
        at.selectbox(key="nr.model_source").set_value("hf:").run()
        at.selectbox(key="nr.dataset").set_value("synthetic").run()
        at.text_area(key="nr.model_options.hf:").set_value("n_layer: 2\nn_embd: 1000000\nn_head: 4").run()
        assert not at.exception, [e.value for e in at.exception]
        assert any(e.value.startswith("quota params: at most 50,000,000 parameters, the model has ")
                   for e in at.error), [e.value for e in at.error]
    assert rss_mb() - before < RSS_BOUND_MB


def test_children_are_bounded_per_person_and_per_server(code, monkeypatch):
    """One child per person at a time (a second waits for the first), at most MAX_CHILDREN in the server (one
    more waits WAIT_S, then is refused with a message)."""
    mod, marker = code.module("import time\nopen(__file__ + '.spans', 'a').write(f'{time.time()} ')\n"
                              "time.sleep(2)\nopen(__file__ + '.spans', 'a').write(f'{time.time()}\\n')")
    spec = {"model": f"{mod}:build", "dataset": "digits"}
    spans = code.dir / f"{mod}.py.spans"
    got = {}

    def ask(key, who):
        try:
            got[key] = sandbox.run("describe", spec, sandbox.PREVIEW, who=who)["params"]
        except sandbox.SandboxError as e:
            got[key] = str(e)
    same = [threading.Thread(target=ask, args=(k, "alice")) for k in ("a1", "a2")]
    for t in same:
        t.start()
    for t in same:
        t.join()
    assert got["a1"] == got["a2"] == 64 * 4 + 4 + 4 * 10 + 10
    (s1, e1), (s2, e2) = sorted(tuple(map(float, line.split())) for line in spans.read_text().splitlines())
    assert e1 <= s2  # alice's second child started after her first ended
    monkeypatch.setattr(sandbox, "MAX_CHILDREN", 1)
    monkeypatch.setattr(sandbox, "SERVER", threading.BoundedSemaphore(1))
    monkeypatch.setattr(sandbox, "WAIT_S", 0.5)
    two = [threading.Thread(target=ask, args=(w, w)) for w in ("bob", "carol")]
    for t in two:
        t.start()
    for t in two:
        t.join()
    assert sorted(map(str, got.values()))[-1] == ("preview: all 1 of the server's places for previews and "
                                                 "checks are taken; try again in a moment"), got
    assert 64 * 4 + 54 in (got["bob"], got["carol"])


def test_a_room_asking_for_one_models_size_at_once_starts_one_child(room, monkeypatch):
    """Twelve students press Start on the same preset in the same second: one child counts the model (the rest
    wait for its answer), though the server has a single place for children and refuses after 0.5 s."""
    monkeypatch.setattr(previews, "_previews", Kept(previews.PREVIEWS))
    monkeypatch.setattr(sandbox, "SERVER", threading.BoundedSemaphore(1))
    monkeypatch.setattr(sandbox, "WAIT_S", 0.5)
    spawned = []
    real = sandbox._spawn
    monkeypatch.setattr(sandbox, "_spawn", lambda *a: spawned.append(a[0]) or real(*a))
    who = threading.local()
    ui.set_viewer(lambda: owners.User(who.name))
    spec = commlab.spec({"model": "mlp", "dataset": "digits"})
    got = {}

    def ask(name):
        who.name = name
        try:
            got[name] = previews.model_size(spec, name, wait_s=0.5)["params"]
        except SpecError as e:
            got[name] = str(e)
    room_ = [threading.Thread(target=ask, args=(f"s{k}",)) for k in range(12)]
    for t in room_:
        t.start()
    for t in room_:
        t.join()
    assert spawned == ["describe"], spawned
    assert len(set(got.values())) == 1 and isinstance(got["s0"], int), got
    assert previews._asking == {}  # nothing kept per model once it is answered


def test_a_preset_that_cannot_be_checked_now_is_one_line_on_its_card(room, monkeypatch):
    from commlab.lab.analysis.presets import PRESETS

    def busy(spec, who, wait_s=0):
        raise SpecError("preview", "all 2 of the server's places for previews and checks are taken; try again")
    monkeypatch.setattr(previews, "model_size", busy)
    ui.set_viewer(lambda: owners.User("alice"))
    with pytest.raises(LabError, match=r"^preset [a-z-]+: preview: all 2 of the server's places"):
        groups.start_preset(PRESETS[0], runs=room[0])
    assert commlab.runs(runs=room[0]) == []  # nothing queued


# --------------------------------------------------------------------------- 2. bounded students

LIMITS = [
    ({"batch_size": 512}, "batch_size", "quota batch_size: at most 256 examples per batch per rank, asked for 512"),
    ({"steps": 5000}, "steps", "quota steps: at most 2000 steps per run, asked for 5000"),
    ({"world_size": 8}, "world_size", "quota world_size: at most 4 ranks per run, asked for 8"),
    ({"threads": 8}, "threads", "quota threads: at most 2 torch threads per rank, asked for 8"),
    ({"model": "cnn", "dataset": {"name": "synthetic", "size": 200_000}}, "dataset.size",
     "quota examples: at most 100000 training examples in a synthetic data set, asked for 200000"),
    ({"model": "cnn", "dataset": {"name": "synthetic", "shape": [3, 256, 256]}}, "dataset", "quota data_mb: "),
    ({"model": "transformer", "dataset": {"name": "synthetic", "vocab": 1_000_000, "block": 512}}, "dataset",
     "quota data_mb: "),
    ({"model": {"name": "resnet", "width": 512}}, "model.name", "quota params: at most 50,000,000 parameters"),
    # few parameters in many tensors: the timeline, the live view and the predictions grow with the tensors
    ({"model": {"name": "mlp", "depth": 1000, "hidden": 4}}, "model.name",
     "quota tensors: at most 2,000 parameter tensors, the model has 2,002"),
]


def test_each_limit_refuses_with_its_name_by_default_on_an_exposed_lab(room):
    root, _ = room
    assert not (root / "lab.json").exists()
    for data, field, said in LIMITS:
        d = {**SMALL, **data}
        as_viewer("alice")
        spec, err, size = new_run.form_check(d)
        assert spec is None and err.path == field and one_line(err.msg).startswith(said), (data, err)
        with pytest.raises(owners.QuotaError, match="^" + said.replace("(", r"\(").split(" at most")[0]):
            new_run.submit(d)
        for viewer in (lambda: owners.User(owners.TEACHER, admin=True), None):  # the teacher; loopback
            ui.set_viewer(viewer)
            spec, err, size = new_run.form_check(d)
            assert err is None and size["params"] > 0, (data, err)
    assert commlab.runs(runs=root) == []


def test_a_students_run_gets_the_default_wall_time_and_at_most_two_threads(room, monkeypatch):
    root, _ = room
    monkeypatch.setattr(owners.os, "cpu_count", lambda: 16)  # one thread per core would be 8 per rank
    as_viewer("alice")
    run = new_run.submit(dict(SMALL, threads=0, steps=3))
    assert run.status()["wall_limit_s"] == owners.DEFAULT_QUOTAS["wall_s"] == 900
    assert run.spec_dict()["threads"] == 2
    as_viewer(owners.TEACHER, admin=True)
    run = new_run.submit(dict(SMALL, threads=0, steps=3))
    assert "wall_limit_s" not in run.status() and run.spec_dict()["threads"] == 0


def test_defaults_are_not_for_loopback(room, monkeypatch):
    """The same request through the New run form: refused for a student on an exposed lab, not on loopback."""
    root, tokens = room
    at = app(tokens["alice"], page="new_run")
    at.number_input(key="nr.batch_size").set_value(512).run()
    assert [e.value for e in at.error] == ["quota batch_size: at most 256 examples per batch per rank, asked for 512"]
    assert at.button(key="nr.submit").disabled
    monkeypatch.setenv(accounts.ACCESS_ENV, "off")
    at = app(page="new_run")
    at.number_input(key="nr.batch_size").set_value(512).run()
    assert not at.error and not at.button(key="nr.submit").disabled


def test_a_student_keeps_a_bounded_number_of_runs_and_the_disk_keeps_room(room, monkeypatch):
    """Each finished run frees its place in the queue, not its room on disk: the runs a student has in the lab
    are bounded (quotas.runs), and no student's run is queued while the runs' disk is nearly full."""
    import shutil
    root, _ = room
    (root / "lab.json").write_text(json.dumps({"quotas": {"runs": 2}}))
    q = open_lab(root, room=True)
    for _ in range(2):
        q.create(commlab.spec(SMALL), owner="alice")  # two of alice's, of any state
    as_viewer("alice")
    with pytest.raises(owners.QuotaError, match=r"^quota runs: alice may have 2 runs in this lab, of every state; "
                                                r"2 are there, and this asks for 1 more"):
        new_run.submit(SMALL)
    as_viewer("bob")
    usage = shutil.disk_usage(root)
    monkeypatch.setattr(ui.shutil, "disk_usage", lambda path: usage._replace(free=1000 * 2**20))
    with pytest.raises(owners.QuotaError, match=r"^quota free_mb: the disk of the runs directory has 1000 MB free, "
                                                r"under the 2048 MB kept free; ask the teacher$"):
        new_run.submit(SMALL)
    assert sorted(owners.owner_of(r.status()) for r in commlab.runs(runs=root)) == ["alice", "alice"]
    as_viewer(owners.TEACHER, admin=True)  # the teacher's runs are not held back
    assert new_run.submit(dict(SMALL, steps=1)).status()["owner"] == owners.TEACHER


def test_concurrent_submits_cannot_pass_the_queued_limit(room):
    root, _ = room
    (root / "lab.json").write_text(json.dumps({"quotas": {"queued": 2}}))
    as_viewer("alice")
    start = threading.Barrier(8)
    got = []

    def submit():
        start.wait()
        try:
            got.append(new_run.submit(SMALL).id)
        except LabError as e:
            got.append(str(e))
    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = [g for g in got if not g.startswith("quota")]
    assert len(made) == 2, got
    assert sorted(set(got) - set(made)) == [
        "quota queued: alice may have 2 runs queued or running at once; 2 are, and this asks for 1 more"]
    assert sorted(r.id for r in commlab.runs(runs=root)) == sorted(made)


def alias_bomb(levels: int) -> str:
    """YAML of a few hundred bytes whose last list holds 9**levels strings, all by reference (aliases)."""
    return "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, levels + 1))


def test_typed_yaml_cannot_grow_in_the_server(room):
    """An alias bomb typed in the New run form's model options is refused as it is parsed, under the field; the
    same structure handed to the spec (a script, a file) is refused before anything copies it."""
    root, tokens = room
    bomb = alias_bomb(7)  # 300 bytes, 43 million strings once expanded
    at = app(tokens["alice"], page="new_run")
    at.selectbox(key="nr.model_source").set_value("torchvision:").run()
    at.text_area(key="nr.model_options.torchvision:").set_value(bomb).run()
    assert not at.exception, [e.value for e in at.exception]
    assert "model.options: not valid YAML: aliases (*name) are not accepted here (line 2, column 10)" in [
        one_line(e.value) for e in at.error]
    assert new_run.parse_value(bomb) == bomb.strip()  # a parameter's box: kept as text, refused by its field
    nested = yaml.safe_load(alias_bomb(6))  # what yaml.safe_load builds: 531,441 strings, 6 lists
    with pytest.raises(SpecError, match=r"^spec: too large: a spec holds at most 100000 values"):
        load_spec(data={**SMALL, "model": {"name": "mlp", "options": nested}})
    with pytest.raises(SpecError, match="^spec: too large"):
        JobSpec.from_dict({**SMALL, "model": {"name": "mlp", "options": nested}})
    with pytest.raises(SpecError, match="^name: at most 200 characters, got 5000$"):
        load_spec(data={**SMALL, "name": "n" * 5000})
    with pytest.raises(ValueError, match="^at most 4096 characters, got 5000$"):
        typed_yaml("x" * 5000)


def test_a_students_log_whose_last_lines_begin_inside_a_traceback_shows_none_of_it(tmp_path, monkeypatch):
    """The last lines of a log may begin below a traceback's first line (the other rank's lines followed it): its
    frames are known as such and left out for a student, as a whole traceback is."""
    log = tmp_path / "log.txt"
    log.write_text("".join(f"line {i}\n" for i in range(40)) + "Traceback (most recent call last):\n"
                   '  File "/srv/lab/commlab/engine/trainer.py", line 188, in _maybe_fault\n'
                   '    raise RuntimeError("injected fault at step 1")\n'
                   "RuntimeError: injected fault at step 1\n"
                   "[rank 1] the peer is gone: /srv/lab/runs/x\n")

    class Run:
        def log_tail(self, n):
            return "".join(log.read_text().splitlines(keepends=True)[-n:])

    monkeypatch.setattr(ui, "viewer", lambda: types.SimpleNamespace(admin=False))
    assert ui.shown_log(Run(), n=4).splitlines() == ["(a traceback, left out)",
                                                      "RuntimeError: injected fault at step 1",
                                                      "[rank 1] the peer is gone: .../x"]
    assert "(a traceback, left out)" in ui.shown_log(Run(), n=6) and "/srv" not in ui.shown_log(Run(), n=6)


def test_a_students_failed_run_shows_no_traceback_and_no_machine_path(room):
    """A student's run that fails shows its one-line error and its log's last lines without the traceback's
    frames or the machine's folders; the teacher sees the log as it is. An image too small for the model is
    refused when the spec is checked, not by a traceback from the ranks."""
    root, tokens = room
    run = open_lab(root, room=True).submit(commlab.spec(dict(SMALL, fault={"kind": "raise", "step": 1})), wait=True, owner="alice")
    # the whole log: the other rank's own lines (gloo's on the lost peer) may follow the traceback's
    assert run.state == "failed" and "Traceback" in run.log_tail(400) and str(paths.SOURCE) in run.log_tail(400)
    at = app(tokens["alice"], page="live_run", run=run.id)
    shown = "\n".join(c.value for c in at.code)
    assert "injected fault at step 1" in shown and "(a traceback, left out)" in shown
    assert "Traceback" not in shown and str(paths.SOURCE) not in everything(at)
    at = app(tokens["admin"], page="live_run", run=run.id)
    assert str(paths.SOURCE) in "\n".join(c.value for c in at.code)  # the frames, with the machine's folders
    as_viewer("alice")
    spec, err = new_run.validate(dict(SMALL, model="cnn", dataset={"name": "synthetic", "shape": [3, 1, 1]}))
    assert spec is None and (err.path, err.msg) == ("dataset.shape", "cnn takes images of at least 2x2, got 1x1")


# --------------------------------------------------------------------------- 4. the Performance model page

@pytest.fixture
def profiles(room, tmp_path):
    """A saved profile of the lab, a link to /etc/passwd among the saved profiles, and one outside the runs."""
    from test_perfmodel import tiny_profile
    root, tokens = room
    (root / ".profiles").mkdir()
    tiny_profile(spec={"model": "mlp", "dataset": "digits", "batch_size": 16}).save(root / ".profiles" / "mlp.json")
    (root / ".profiles" / "passwd.json").symlink_to("/etc/passwd")
    tiny_profile().save(tmp_path / "outside.json")
    return root, tokens, tmp_path / "outside.json"


def test_a_student_reads_only_the_labs_profiles(profiles):
    root, tokens, outside = profiles
    at = app(tokens["alice"], page="model")
    assert at.selectbox(key="pm.prof.saved").options == ["none", "mlp.json"]  # not the link to /etc/passwd
    assert not any(t.key == "pm.prof.path" for t in at.text_input)
    at.selectbox(key="pm.prof.saved").set_value("mlp.json").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.dataframe  # the prediction
    at.file_uploader(key="pm.prof.upload").upload("passwd.json", open("/etc/passwd", "rb").read()).run()
    assert [one_line(e.value) for e in at.error] == [
        "profile: upload passwd.json is not JSON (Expecting value: line 1 column 1 (char 0))"]
    text = everything(at)
    assert "root:" not in text and str(root) not in text and "/etc" not in text
    from test_perfmodel import tiny_profile
    good = asdict(tiny_profile(spec={"model": "mlp", "dataset": "digits", "batch_size": 16}))
    for bad, said in (({"forward_s": "x"}, "forward_s must be a number of seconds (>= 0)"),
                      ({"params": [["w", 1e300]]}, "params must be [name, bytes] pairs with bytes a positive integer"),
                      ({"params": [["w", 4 * 10**12]]}, None)):  # a trillion parameters: over alice's limit
        at.file_uploader(key="pm.prof.upload").set_value(
            ("bad.json", json.dumps({**good, **bad}).encode(), "application/json")).run()
        assert not at.exception, [e.value for e in at.exception]
        assert [one_line(e.value) for e in at.error] == [
            f"profile: upload bad.json: {said}" if said else
            "profile: a model of about 1,000,000,000,000 parameters; at most 50,000,000 on this lab (quota params)"]
    alice = owners.User("alice")
    for kw in ({"path": "/etc/passwd"}, {"path": str(outside)}, {"name": "../../../etc/passwd"},
               {"name": "passwd.json"}, {"upload": ("big.json", b" " * (viewing.MAX_UPLOAD + 1))}):
        with pytest.raises(SpecError) as e:
            viewing.read_profile(root, alice, **kw)
        assert "root:" not in str(e.value) and "/etc" not in one_line(str(e.value)), kw


def test_the_teacher_reads_only_inside_the_runs_directory(profiles):
    root, tokens, outside = profiles
    at = app(tokens["admin"], page="model")
    for path, said in (("/etc/passwd", "profile: only files in the runs directory can be read here; give a path "
                                       "inside it"),
                       (str(outside), "profile: only files in the runs directory can be read here; give a path "
                                      "inside it"),
                       ("../../etc/passwd", "profile: a path inside the runs directory, without '..'"),
                       (".profiles/passwd.json", "profile: only files in the runs directory can be read here; "
                                                 "give a path inside it")):  # a link that leads outside
        at.text_input(key="pm.prof.path").set_value(path).run()
        assert [e.value for e in at.error] == [said], path
        assert "root:" not in everything(at)
    at.text_input(key="pm.prof.path").set_value(".profiles/mlp.json").run()
    assert not at.error and at.dataframe, [e.value for e in at.error]
    at.text_input(key="pm.prof.path").set_value(str(root / ".profiles" / "mlp.json")).run()
    assert not at.error


def test_a_students_profile_lists_at_most_max_tensors(profiles):
    """A cluster prediction costs the server's CPU in proportion to the tensors (one bucket each under
    layerwise): a student's profile with more than MAX_TENSORS is refused with one line naming the limit."""
    from test_perfmodel import tiny_profile
    root, tokens, _ = profiles
    assert viewing.MAX_TENSORS <= 2_000  # what the page's cost was measured at (about 1 s here, predicted in the server)
    mlp = {"model": "mlp", "dataset": "digits", "batch_size": 16, "schedule": {"name": "layerwise"}}

    def wide(n):
        return json.dumps(asdict(tiny_profile(spec=mlp, params=[(f"l{i}.weight", 4) for i in range(n)]))).encode()
    at = app(tokens["alice"], page="model")
    at.file_uploader(key="pm.prof.upload").upload("wide.json", wide(viewing.MAX_TENSORS + 1), "application/json").run()
    assert not at.exception, [e.value for e in at.exception]
    assert [one_line(e.value) for e in at.error] == [
        f"profile: {viewing.MAX_TENSORS + 1:,} parameter tensors; at most {viewing.MAX_TENSORS:,} in a student's "
        f"profile on this lab"]
    assert not at.dataframe  # nothing predicted
    alice, teacher = owners.User("alice"), owners.User(owners.TEACHER, admin=True)
    assert len(viewing.read_profile(root, alice, upload=("w.json", wide(viewing.MAX_TENSORS))).params) \
        == viewing.MAX_TENSORS
    assert len(viewing.read_profile(root, teacher, upload=("w.json", wide(viewing.MAX_TENSORS + 1))).params) \
        == viewing.MAX_TENSORS + 1  # the teacher's profiles are not bound by it


@pytest.fixture
def counted(monkeypatch):
    """views.cluster_prediction counted, with no prediction kept from before the test."""
    monkeypatch.setattr(viewing, "_predictions", Kept(viewing.PREDICTIONS))
    calls, real = [], views.cluster_prediction

    def count(*a, **kw):
        calls.append(a[2:])
        return real(*a, **kw)
    monkeypatch.setattr(views, "cluster_prediction", count)
    return calls


def test_a_rerun_of_the_model_page_does_not_predict_again(profiles, counted):
    root, tokens, _ = profiles
    at = app(tokens["alice"], page="model")
    at.selectbox(key="pm.prof.saved").set_value("mlp.json").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert len(counted) == 1
    shown = [d.value for d in at.dataframe]  # the sources and the table
    at.run()  # a rerun: the same profile and inputs
    assert len(counted) == 1
    assert all(a.equals(b) for a, b in zip(shown, [d.value for d in at.dataframe])) and len(shown) == len(at.dataframe)
    at = app(tokens["admin"], page="model")  # another viewer, the same profile and inputs: kept for the lab
    at.selectbox(key="pm.prof.saved").set_value("mlp.json").run()
    assert len(counted) == 1 and shown[-1].equals(at.dataframe[-1].value)
    at.multiselect(key="pm.cl.workers").set_value([8, 16]).run()  # other inputs: predicted
    assert not at.error and len(counted) == 2 and counted[-1][0] == [8, 16]
    at.multiselect(key="pm.cl.workers").set_value([8, 16, 64, 256, 1024]).run()
    assert len(counted) == 2


def test_a_kept_prediction_is_the_same_as_a_fresh_one(profiles, counted):
    from test_perfmodel import tiny_profile
    root, tokens, _ = profiles
    alice = owners.User("alice")
    shape = {"node_size": 8, "intra_gbps": 1600.0, "nics": 1}
    spec = {"model": "mlp", "dataset": "digits", "batch_size": 16, "compressor": "fp16"}
    args = (shape, [8, 64], [10.0, 100.0], 2.0)
    want = views.cluster_prediction(tiny_profile(spec=spec), *args)
    first, again = tiny_profile(spec=spec), tiny_profile(spec=spec)
    assert viewing.cluster_prediction(alice, first, *args).equals(want)
    assert viewing.cluster_prediction(alice, again, *args).equals(want) and len(counted) == 2  # the second kept
    assert again.compressors == first.compressors  # what the sources table reads, as a fresh prediction left it
    other = tiny_profile(spec=spec, forward_s=1.0)  # another profile's content: predicted
    assert not viewing.cluster_prediction(alice, other, *args).equals(want) and len(counted) == 3
    with pytest.raises(SpecError, match="^workers: ") as e:  # errors are kept too, raised anew each time
        viewing.cluster_prediction(alice, tiny_profile(spec=spec), shape, [12], [10.0])
    with pytest.raises(SpecError, match="^workers: ") as e2:
        viewing.cluster_prediction(alice, tiny_profile(spec=spec), shape, [12], [10.0])
    assert len(counted) == 4 and e.value is not e2.value
    for _ in range(viewing.PREDICTIONS + 1):  # bounded: the oldest go first
        viewing.cluster_prediction(alice, tiny_profile(spec=spec, forward_s=2.0 + len(counted)), *args)
    assert len(viewing._predictions) == viewing.PREDICTIONS


def test_a_person_predicts_one_at_a_time(profiles, counted, monkeypatch):
    from test_perfmodel import tiny_profile
    monkeypatch.setattr(sandbox, "WAIT_S", 0.1)
    holding, done = threading.Event(), threading.Event()

    def hold():  # alice's prediction in another tab, still running
        with places.person("alice"):
            holding.set()
            done.wait(30)
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert holding.wait(30)
        with pytest.raises(sandbox.Busy) as e:  # a ValueError: the page shows it as one line
            viewing.cluster_prediction(owners.User("alice"), tiny_profile(spec={"model": "mlp", "dataset": "digits",
                                                                                   "batch_size": 16}),
                                       {"node_size": 8, "intra_gbps": 1600.0, "nics": 1}, [8], [10.0])
        assert str(e.value) == "prediction: your previous one is still running; try again in a moment"
        assert counted == []
    finally:
        done.set()
        t.join()


def test_measure_again_is_the_teachers_and_writes_atomically(room, monkeypatch):
    from commlab.lab.strategy.perfmodel import properties
    root, tokens = room
    run = open_lab(root, room=True).submit(commlab.spec(SMALL), wait=True, owner="alice")  # a finished run alice may calibrate from
    assert run.state == "done", run.log_tail()
    real = properties.checklist
    monkeypatch.setattr(properties, "checklist", lambda names, profile, numels: real(["fp16"], profile, numels))
    at = app(tokens["alice"], page="model")
    assert not any(b.key == "pm.props" for b in at.button)  # a student cannot rewrite the shared file
    with pytest.raises(LabError, match="only the teacher may measure them again"):
        viewing.measure_properties(root, owners.User("alice"), None)
    f = views.properties_file(root)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("[]")
    before = f.stat().st_ino
    at = app(tokens["admin"], page="model")
    at.button(key="pm.props").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [r["compressor"] for r in json.loads(f.read_text())] == ["fp16"]
    assert f.stat().st_ino != before  # a new file renamed over the old one, never rewritten in place
    assert not [p for p in f.parent.iterdir() if p.name.startswith(f.name) and p != f]  # no temporary left
