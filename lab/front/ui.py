"""What the Streamlit app's pages need from the lab, without Streamlit: who is looking, presets
(lab/presets.py), the choices of the New run form, live-run data and background sweeps. The
``commlab app`` command that serves the pages is lab.front.appserver.

Pages call these and draw the result; nothing here imports streamlit, so all
of it can be tested and used from a notebook.
"""
from __future__ import annotations

import inspect
import json
import re
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pandas as pd
import yaml

import lab
from engine import codepath
from engine.spec import (
    COMM_AVAILABLE,
    DATASETS,
    LINKS_AVAILABLE,
    SCHEDULES_AVAILABLE,
    JobSpec,
    OptimizerSpec,
    SpecError,
)
from lab.analysis.comparison import compare_runs
from lab.analysis.presets import Preset
from lab.base import procs, sandbox
from lab.base.errors import LabError
from lab.base.paths import PROCESS, SOURCE, SWEEP, SWEEP_GRID, SWEEP_LOG, SWEEPS, default_root
from lab.base.specs import load_spec
from lab.front.sweep import Sweep
from lab.rundir.store import FINAL, Run, RunError, check_id
from lab.service import owners
from lab.service.owners import User
from lab.service.queue import Lab
from lab.service.spawn import spawn_detached

REPO = SOURCE
REFRESH_S = 2.0
"""How often a live panel re-reads a run that is not final (state, progress, medians)."""
CHARTS_REFRESH_S = 20.0
"""How often the Live run page redraws its four charts while the run is not final (its progress and medians
follow every REFRESH_S; a button redraws the charts at once). Streamlit gives a chart whose figure changed a
new element, so every redraw mounts four Plotly charts afresh: about 0.6-0.8 s of the viewer's browser CPU,
at normal priority, on the cores the ranks train on. Every 4 s, a page opened at Start took a third of a
core through a run's timed steps and slowed a 60-step dear run by 9%; a 60-100-step run now trains between
two redraws (docs/explanation/presets.md, "Watching a run")."""


def runs_dir() -> Path:
    """The runs directory the app works on: $COMMLAB_RUNS, else ./runs (read at each call)."""
    return default_root()


# --------------------------------------------------------------------------- who the UI acts for

_viewer_fn = None


def set_viewer(fn) -> None:
    """Install how the UI learns who is asking: a function returning the signed-in ``User`` (the app's
    gate reads it from the session), or None when nobody is signed in. Without one (notebooks,
    scripts) the UI acts for the local user, who sees everything."""
    global _viewer_fn
    _viewer_fn = fn


def viewer() -> User:
    """The user every function below acts for and filters by; PermissionError when nobody is signed in."""
    if _viewer_fn is None:
        return owners.local_user()
    u = _viewer_fn()
    if u is None:
        raise PermissionError("not signed in")
    return u


def _visible(run: Run, user: Optional[User] = None) -> bool:
    return owners.can_see(user or viewer(), run.status())


def serve_viewers(in_server: Callable[[], bool]) -> None:
    """Called by the app's entry file: in this process, whenever ``in_server()`` is true (a thread serving a
    viewer), nothing a spec names is imported or built (engine.codepath.forbid_imports_when): specs are
    checked for their syntax, and what needs the code runs in a child with limits (lab.sandbox)."""
    codepath.forbid_imports_when(in_server)


def may_run_code(user: Optional[User] = None) -> bool:
    """Whether the viewer may use code of their own (import paths): the teacher and the local user."""
    return (user or viewer()).admin


def _admit(root, specs: list) -> Tuple[User, list, Optional[float]]:
    """The viewer, their ``specs`` as they may be queued, and the wall-time limit to give the runs (None for
    the teacher): for a student, a spec that names code or passes a per-run limit (its model's size counted
    in a child first) is refused, one line naming the field or the limit."""
    user = viewer()
    if user.admin:
        return user, specs, None
    q = owners.quotas(root)
    out = []
    for s in specs:
        owners.refuse_code(s.to_dict())
        s = owners.check_run(q, s)
        if "params" in q:
            owners.check_run(q, s, params=model_size(s, wait_s=START_WAIT_S)["params"])
        out.append(s)
    return user, out, q.get("wall_s")


def _queue(root, specs: list, then=None) -> List[Run]:
    """Queue ``specs`` for the viewer within their quotas (``_admit``); the ``queued`` limit is checked and
    the runs are made under one lock (owners.queue_lock), so requests at the same moment cannot both pass
    it. ``then(runs)`` runs before their supervisors start (a preset records its group). Returns the runs."""
    user, specs, wall = _admit(root, specs)
    q = Lab(root)
    with owners.queue_lock(root, user.name):
        if not user.admin:
            active = sum(1 for r in q.index.query(owner=user.name) if r["state"] in ("queued", "running"))
            owners.check_queued(owners.quotas(root), user, active, len(specs))
        made = [q.create(s, owner=user.name, wall_limit_s=wall) for s in specs]
    if then is not None:
        then(made)
    for run in made:
        q.spawn_supervisor(run)
    return made


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def start_preset(preset: Preset, runs=None, values: Optional[Dict[str, int]] = None) -> str:
    """Queue every run of a preset (detached supervisors), its knobs at ``values`` (the card's sliders; the
    defaults where not given), and record them as a group (lab.results) with those values; the group's id.
    The group is written before the first run is queued, so a results page opened at once finds it.
    LabError for a value out of a knob's range."""
    from lab.analysis import results
    root = runs or runs_dir()
    created = time.time()
    cap = owners.preset_steps(root)
    try:
        vals = preset.values(values)
    except ValueError as e:
        raise LabError(f"preset {preset.key}: {e}") from None
    specs = [lab._spec(owners.scale_preset(d, cap)) for d in preset.specs(vals)]
    try:
        made = _queue(root, specs, then=lambda made: results.save_group(
            root, preset.key, {label: r.id for label, r in zip(preset.labels(), made)}, created=created,
            values=vals))
    except SpecError as e:  # e.g. no place for its model's preview in time: one line on the card, not a traceback
        raise LabError(f"preset {preset.key}: {e}") from None
    return made[0].id


def _group_visible(group: dict, root) -> bool:
    user = viewer()
    if user.admin:
        return True
    for rid in group.get("runs", {}).values():
        try:
            if not _visible(lab_get(rid, root), user):
                return False
        except (RunError, LabError):
            return False
    return bool(group.get("runs"))


def lab_get(run_id: str, root) -> Run:
    return lab.get(run_id, runs=root)


def preset_group(gid: str, runs=None) -> dict:
    """A preset's group of runs; KeyError when there is none or the viewer may not see all its runs."""
    from lab.analysis import results
    root = runs or runs_dir()
    g = results.load_group(root, gid)
    if not _group_visible(g, root):
        raise KeyError(f"group: no group {gid!r}")
    return g


def preset_groups(runs=None) -> List[dict]:
    from lab.analysis import results
    root = runs or runs_dir()
    return [g for g in results.list_groups(root) if _group_visible(g, root)]


def group_verdict(group: dict, runs=None):
    """The verdict of a preset's or a sweep's group (lab.results.evaluate), from the runs' own figures."""
    from lab.analysis import results
    root = runs or runs_dir()
    return results.evaluate(group, lambda rid: get_run_or_raise(rid, root))


def group_crossover(group: dict, runs=None) -> Optional[str]:
    """The performance model's crossover sentence for the group (once its runs are done); cached."""
    from lab.analysis import results, timelines
    root = runs or runs_dir()
    key = ("crossover", str(root), group["id"], tuple(sorted(group["runs"].values())))
    states = tuple(getattr(get_run(i, root), "state", None) for i in group["runs"].values())
    if any(s not in FINAL for s in states):
        return None
    return timelines.cached(key + states, lambda: results.crossover(group, lambda rid: get_run_or_raise(rid, root)))


def sweep_group(sweep_id: str, runs=None) -> dict:
    """A sweep's cells that have a run, as a group for the results view (no preset: no declared effect;
    the verdict ranks the cells by iteration time)."""
    sw = load_sweep(sweep_id, runs)  # the teacher's only
    saved = sw._load().get("runs", {})
    cells = {c["key"]: saved[c["key"]] for c in sw.cells if saved.get(c["key"])}
    if not cells:
        raise KeyError(f"sweep {sweep_id!r} has no runs yet")
    return {"id": sw.id, "preset": None, "title": f"sweep {sw.name}", "runs": cells, "created": None}


def get_run_or_raise(run_id: str, runs=None) -> Run:
    """The run, if the viewer may see it; RunError (the same as for a missing run) otherwise."""
    root = runs or runs_dir()
    try:
        run = lab_get(run_id, root)
    except (RunError, LabError):
        if viewer().admin:
            raise
        run = None  # a student gets the same answer, without the machine's paths
    if run is None or not _visible(run):
        raise RunError(f"no run {run_id!r}")
    return run


# --------------------------------------------------------------------------- the New run form

def compressor_params(name: str) -> list:
    """A compressor's keyword parameters as its class declares them (engine.compressors.Param: name,
    type, default or None with what unset means, range, one-line help)."""
    from engine.compressors import REGISTRY
    return list(REGISTRY[name].params)


def compressor_info(name: str) -> dict:
    """What a compressor declares it can do, read from an instance at its default parameters."""
    from engine import compressors
    c = compressors.make(name)
    return {"summable": c.summable, "keeps_shape": c.keeps_shape, "lossless": c.lossless, "rounds": c.rounds,
            "builtin_feedback": c.builtin_feedback, "elementwise": c.elementwise,
            "doc": (inspect.getdoc(type(c)) or "").split("\n\n")[0]}


def choices() -> dict:
    """Every choice the form offers, from the engine's registries and the spec's Literal types."""
    import typing

    from engine import compressors, models
    datasets = DATASETS
    cuda = cuda_available()
    return {
        "models": models.NAMES,
        "datasets": datasets,
        "optimizers": typing.get_args(typing.get_type_hints(OptimizerSpec)["name"]),
        "compressors": compressors.names(),
        "schedules": SCHEDULES_AVAILABLE,
        "comm": COMM_AVAILABLE,
        "links": LINKS_AVAILABLE,
        "devices": ("auto", "cpu", "cuda") if cuda else ("cpu",),
        "backends": ("auto", "gloo", "nccl") if cuda else ("gloo",),
        "cuda": cuda,
    }


def compressors_for(mode: str) -> List[str]:
    """The compressors a comm mode accepts: dear reduce-scatters the payload itself, so only the
    single-round, summable ones whose payload keeps the gradient's shape (engine.compressors.shardable);
    the other modes take every compressor."""
    from engine import compressors
    return list(compressors.shardable()) if mode == "dear" else list(compressors.names())


MODEL_SOURCES = ("zoo", "torchvision:", "hf:", "import path")
"""Where the form's model comes from: the built-in zoo, a torchvision classifier, a Hugging Face
causal LM built from its config, or package.module:factory from the user's code."""
IMPORT_PATH = "import path"


COMPRESSOR_SOURCES = ("registry", IMPORT_PATH)
"""Where the form's compressor comes from: the registry (the built-ins and anything registered), or
package.module:Class, a subclass of commlab.Compressor from the user's code."""


def compressor_sources() -> List[str]:
    """COMPRESSOR_SOURCES the viewer may choose: a student is offered the registry only."""
    return [s for s in COMPRESSOR_SOURCES if s != IMPORT_PATH or may_run_code()]


def model_sources() -> List[str]:
    """MODEL_SOURCES the viewer may choose: a student is not offered an import path."""
    return [m for m in MODEL_SOURCES if m != IMPORT_PATH or may_run_code()]


def dataset_sources(model: str) -> List[str]:
    """``datasets_for(model)``, and an import-path loader for a viewer who may run code."""
    return datasets_for(model) + ([IMPORT_PATH] if may_run_code() else [])


def model_name(source: str, text: str) -> str:
    """The spec's model.name from the form's source choice and name field."""
    text = text.strip()
    return text if source in ("zoo", "import path") else source + text


def datasets_for(model: str) -> List[str]:
    """The shipped data sets a model can train on (synthetic includes token data for language models);
    a model from outside the zoo can also take an import-path loader."""
    from engine import models
    try:
        need = models.kind(model)
    except ValueError:
        return list(choices()["datasets"])
    out = [d for d in choices()["datasets"]
           if d == "synthetic" or need is None or need == ("text" if d == "text" else "image")]
    if model.startswith("torchvision:"):
        out = ["synthetic"]  # 3-channel images; digits and mnist have one
    return out


def parse_options(text: str) -> Tuple[dict, Optional[str]]:
    """A YAML mapping typed in the form (model or loader options): (options, error line)."""
    if not text.strip():
        return {}, None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return {}, f"not valid YAML: {str(e).strip().splitlines()[0]}"
    if not isinstance(data, dict):
        return {}, f"must be a mapping such as {{n_layer: 4}}, got {data!r}"
    return data, None


PREVIEWS = 64
"""Model sizes (or the one-line error of their preview) kept in this process, least recently used first out."""
_previews: "OrderedDict[str, object]" = OrderedDict()
_previews_lock = threading.Lock()
_asking: Dict[str, threading.Lock] = {}
"""One lock per model whose size a child is counting now: everyone else asking for it waits for that answer
(a room pressing the same preset's Start at once starts one child, not one each)."""
START_WAIT_S = 60.0
"""How long a Start or a submit waits for a place for its model's preview (the form's own previews wait
sandbox.WAIT_S): a click in a rush waits its turn instead of failing."""


def model_size(spec: JobSpec, wait_s: Optional[float] = None) -> dict:
    """Parameter count and gradient bytes of the spec's model: {params, grad_bytes, tensors, tied}, counted
    in a child process with limits (lab.sandbox, task describe), never in this one, once per model and data
    set (the last PREVIEWS answers are kept); a compressor named by import path is checked there too (its
    class's declared parameters, and dear's needs). Raises SpecError as the spec would, or with the limit
    the child hit ("preview: took more than 30 s")."""
    d = spec.to_dict()
    data = dict(d["dataset"])
    if data["name"] == "synthetic":
        data["size"] = None  # how many examples plays no part in the model's size (engine.preflight.sized)
    want = {"model": d["model"], "dataset": data, "seed": 0}
    if codepath.code_fields({"compressor": d["compressor"]}):  # the teacher's compressor class: its parameters, in the child
        want.update(compressor=d["compressor"], comm=d["comm"])
    key = json.dumps(want, sort_keys=True)
    who = viewer().name
    hit = _preview(key)
    if hit is None:
        with _previews_lock:
            asking = _asking.setdefault(key, threading.Lock())
        if not asking.acquire(timeout=sandbox.PREVIEW.wall_s + (sandbox.WAIT_S if wait_s is None else wait_s)):
            raise SpecError("preview", "another viewer's preview of this model is still running; try again in a moment")
        try:  # the key's lock first, then the person's: every thread takes them in this order
            with sandbox.person(who):  # one child per person at a time; a second request waits, then finds the answer
                hit = _preview(key) or _run_preview(key, who, wait_s)
        finally:
            with _previews_lock:
                asking.release()
                if _asking.get(key) is asking:  # those already waiting hold it; the dict stays small
                    del _asking[key]
    if isinstance(hit, SpecError):
        raise SpecError(hit.path, hit.msg)
    return hit


def _preview(key: str):
    with _previews_lock:
        hit = _previews.get(key)
        if hit is not None:
            _previews.move_to_end(key)
        return hit


def _run_preview(key: str, who: str, wait_s: Optional[float] = None):
    """The child's answer for ``key`` (a size, or the SpecError it gave), kept; no free place for a child, or
    no answer in time, is not an answer about the spec (asked again next time)."""
    try:
        hit = sandbox.run("describe", json.loads(key), sandbox.PREVIEW, who=who, wait_s=wait_s)
    except (sandbox.Busy, sandbox.TimedOut) as e:
        raise SpecError(e.path, e.msg) from None
    except sandbox.SandboxError as e:
        hit = SpecError(e.path, e.msg)
    with _previews_lock:
        _previews[key] = hit
        while len(_previews) > PREVIEWS:
            _previews.popitem(last=False)
    return hit


def validate(data: dict) -> Tuple[Optional[JobSpec], Optional[SpecError]]:
    """The validated spec, or the SpecError (``e.path``, ``e.msg``) that names the bad field. For a student:
    a field that names code is refused before anything else (and nothing is imported: the syntax is checked),
    and so is a spec over a per-run limit (lab.workshop.quotas), under the field it is about."""
    try:
        spec = _parse(data)
        if not may_run_code():
            owners.check_run(owners.quotas(runs_dir()), spec)
        return spec, None
    except SpecError as e:
        return None, e
    except owners.QuotaError as e:
        return None, SpecError(e.field or "quota", str(e))


def _parse(data: dict) -> JobSpec:
    """The viewer's spec dict, validated. A student's is refused if it names code (before it is parsed), and
    is parsed without importing anything, whatever process this is."""
    if may_run_code():
        return load_spec(data=data)
    owners.refuse_code(data)
    with codepath.no_imports():
        return load_spec(data=data)


def form_check(data: dict) -> Tuple[Optional[JobSpec], Optional[SpecError], Optional[dict]]:
    """What the New run form shows: (spec, None, model size) when ``data`` may be queued by the viewer, else
    (None, the error naming its field, None). The size comes from ``model_size`` (a child process); a
    student's model over the ``params`` limit is refused here, before any click."""
    spec, err = validate(data)
    if err is not None:
        return None, err, None
    try:
        size = model_size(spec)
        if not may_run_code():
            owners.check_run(owners.quotas(runs_dir()), spec, params=size["params"])
    except SpecError as e:
        return None, e, None
    except owners.QuotaError as e:
        return None, SpecError(e.field or "quota", str(e)), None
    return spec, None, size


def error_field(path: str, fields, msg: str = "") -> Optional[str]:
    """The form field an error belongs to: the longest field that is the error's path or a
    prefix of it ("optimizer.lr" -> "optimizer.lr", "dataset.size" -> "dataset"), or a field
    under it ("model" -> "model.name"). Compressor errors carry the parameter in the message
    ("compressor": "ratio: must be ...") and go to "compressor.params" or
    "compressor.error_feedback". None when no field fits."""
    fields = list(fields)
    if path == "compressor":
        param = msg.split(":", 1)[0].strip()
        want = "compressor.error_feedback" if param == "error_feedback" else "compressor.params"
        if want in fields:
            return want
    if path in fields:
        return path
    best = None
    for f in fields:
        if path.startswith(f + ".") and (best is None or len(f) > len(best)):
            best = f
    if best:
        return best
    for f in fields:
        if f.startswith(path + "."):
            return f
    return None


def parse_value(text: str):
    """A typed parameter value from a text box (YAML scalar); '' means unset."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def submit(data: dict, runs=None) -> Run:
    """Queue a run from a form's spec dict for the viewer (within their quotas); returns at once. A
    student's spec that names code is refused before it is even parsed."""
    return _queue(runs or runs_dir(), [_parse(data)])[0]


def spec_yaml(spec: JobSpec) -> str:
    return yaml.safe_dump(spec.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------- runs: lists and live data

def index_rows(runs=None, **filters) -> List[dict]:
    """The index's rows (state, model, compressor, ... per run) the viewer may see, oldest first."""
    user = viewer()
    return [r for r in Lab(runs or runs_dir()).index.query(**filters) if owners.can_see(user, r)]


def list_runs(runs=None, **filters) -> List[Run]:
    """The runs the viewer may see (their own and shared ones; all for the teacher), oldest first."""
    q = Lab(runs or runs_dir())
    q.recover_stale()
    user = viewer()
    return [q.store.get(r["id"]) for r in q.index.query(**filters) if owners.can_see(user, r)]


def get_run(run_id: str, runs=None) -> Optional[Run]:
    """The run, or None when there is none, the id is not valid, or the viewer may not see it."""
    try:
        return get_run_or_raise(run_id, runs)
    except (RunError, LabError):
        return None


def can_control(run: Run) -> bool:
    """Whether the viewer may cancel or share ``run`` (its owner, or the teacher)."""
    return owners.can_control(viewer(), run.status())


def cancel(run_id: str, runs=None) -> str:
    """Ask a run of the viewer's (any run for the teacher) to stop; LabError for anyone else's."""
    run = get_run_or_raise(run_id, runs)
    if not can_control(run):
        raise LabError(f"cancel: run {run_id} belongs to {owners.owner_of(run.status())}; "
                       "only its owner or the teacher may cancel it")
    return lab.cancel(run_id, runs=runs or runs_dir())


def share(run_id: str, shared: bool = True, runs=None) -> bool:
    """Show a run of the viewer's to the whole class (or stop showing it); LabError for anyone else's."""
    root = runs or runs_dir()
    run = get_run_or_raise(run_id, root)
    if not can_control(run):
        raise LabError(f"share: run {run_id} belongs to {owners.owner_of(run.status())}; "
                       "only its owner or the teacher may share it")
    run.update_status(shared=bool(shared))
    Lab(root).index.update(run)
    return bool(shared)


def owner(run: Run) -> str:
    return owners.owner_of(run.status())


MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~<>$:&])")


def md(text) -> str:
    """User text (a run's name, an id from the address, an error that quotes them) for a Markdown element
    (st.markdown, st.caption, st.error, a page link's label), shown as typed: every Markdown, HTML and
    Streamlit directive character is escaped, so no link, image, tag or formatting comes from it."""
    return MD_SPECIAL.sub(r"\\\1", str(text))


def run_label(run: Run, state: bool = True) -> str:
    """"<name>  [<state>]  <id>" (the name is left out when the id already carries it), and "  · <owner>"
    when the run is someone else's."""
    try:
        name = run.spec_dict().get("name", "")
    except (OSError, ValueError):
        name = ""
    st_ = run.status()
    tag = f"  [{st_.get('state', 'unknown')}]" if state else ""
    who = owners.owner_of(st_)
    mine = "" if who == viewer().name else f"  · {who}" + (" (shared)" if st_.get("shared") else "")
    return (f"{run.id}{tag}" if not name or name in run.id else f"{name}{tag}  {run.id}") + mine


# --------------------------------------------------------------------------- sweeps in the background

def sweep_data(name: str, base: dict, grid: dict, target_acc: Optional[float] = None,
               baseline: bool = True) -> dict:
    d = {"name": name, "base": base, "grid": grid, "baseline": baseline}
    if target_acc:
        d["target_acc"] = target_acc
    return d


def make_sweep(data: dict, runs=None):
    """A validated Sweep (raises SpecError naming the bad field or grid cell)."""
    return Sweep(Lab(runs or runs_dir()), data=data)


def sweep_argv(grid_file: Path, runs: Path) -> List[str]:
    return [sys.executable, "-m", "lab.front.cli", "sweep", str(grid_file), "--runs", str(runs)]


def start_sweep(data: dict, runs=None) -> str:
    """Write the grid under runs/sweeps/<id>/grid.yaml and run it in a detached
    ``commlab sweep`` process (it outlives the app session, not the app). Returns the sweep id.
    The teacher's only on a workshop server."""
    _teacher_only("sweeps")
    runs = Path(runs or runs_dir()).resolve()
    sw = make_sweep(data, runs)
    if sweep_running(sw.dir):
        raise LabError(f"sweep {sw.id} is running already")
    sw.dir.mkdir(parents=True, exist_ok=True)
    grid_file = sw.dir / SWEEP_GRID
    grid_file.write_text(yaml.safe_dump(data, sort_keys=False))
    pid = spawn_detached(sweep_argv(grid_file, runs), sw.dir / SWEEP_LOG, cwd=REPO, kind="sweep")  # normal priority
    (sw.dir / PROCESS).write_text(json.dumps(procs.identity(pid)))
    return sw.id


def sweep_running(sweep_dir: Path) -> bool:
    try:
        return procs.alive(json.loads((Path(sweep_dir) / PROCESS).read_text()))
    except (OSError, ValueError):
        return False


def _teacher_only(what: str) -> None:
    if not viewer().admin:
        raise LabError(f"{what}: only the teacher may use sweeps on a workshop server")


def list_sweeps(runs=None) -> List[str]:
    if not viewer().admin:
        return []
    root = Path(runs or runs_dir()) / SWEEPS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if (p / SWEEP_GRID).is_file() or (p / SWEEP).is_file()]
    return [p.name for p in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)]


def load_sweep(sweep_id: str, runs=None):
    """The Sweep of a directory under runs/sweeps/, rebuilt from its grid file (or sweep.json)."""
    _teacher_only("sweeps")
    root = Path(runs or runs_dir())
    d = root / SWEEPS / check_id(sweep_id)
    if (d / SWEEP_GRID).is_file():
        return make_sweep(yaml.safe_load((d / SWEEP_GRID).read_text()), root)
    saved = json.loads((d / SWEEP).read_text())
    data = {k: saved[k] for k in ("name", "base", "grid") if k in saved}
    if saved.get("target_acc") is not None:
        data["target_acc"] = saved["target_acc"]
    for baseline in (True, False):  # sweep.json does not keep the flag; the id tells which it was
        sw = make_sweep({**data, "baseline": baseline}, root)
        if sw.id == sweep_id:
            return sw
    return sw


def sweep_status(sw) -> dict:
    """Cells, how many are in each state, the run of each cell, and whether its process lives."""
    saved = sw._load().get("runs", {})
    states: Dict[str, int] = {}
    cells = []
    for c in sw.cells:
        rid = saved.get(c["key"])
        run = get_run(rid, sw.lab.root) if rid else None
        state = run.state if run else "not started"
        states[state] = states.get(state, 0) + 1
        cells.append({"cell": c["key"], "baseline": bool(c.get("baseline")), "run": rid, "state": state})
    return {"id": sw.id, "cells": pd.DataFrame(cells), "states": states, "total": len(sw.cells),
            "finished": sum(n for s, n in states.items() if s in FINAL), "running": sweep_running(sw.dir)}


def sweep_table(sw) -> pd.DataFrame:
    """The comparison table of a sweep's cells that have a run, with ``cell`` and ``baseline``
    columns (read only: unlike ``Sweep.table`` it writes no files)."""
    saved = sw._load().get("runs", {})
    present = []
    for c in sw.cells:
        run = get_run(saved[c["key"]], sw.lab.root) if saved.get(c["key"]) else None
        if run is not None:
            present.append((c, run))
    df = compare_runs([r for _, r in present], target_acc=sw.target)
    if len(df):
        df.insert(0, "cell", [c["key"] for c, _ in present])
        df.insert(1, "baseline", [bool(c.get("baseline")) for c, _ in present])
    return df


def sweep_log(sw, n: int = 30) -> str:
    try:
        with open(Path(sw.dir) / SWEEP_LOG, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except FileNotFoundError:
        return ""
