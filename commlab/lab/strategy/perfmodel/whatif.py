"""What ``commlab predict`` and the model page do: find or make a profile, then tabulate.

Profile lookup for a spec, in order: ``--profile FILE``; ``--calibrate RUN``
(that run's timeline); a saved profile ``<runs>/.profiles/<key>.json`` for the
spec's model, data set and batch; the most recent finished run in the index
with that model, data set and batch; else a short single-process run of the
spec (20 steps, one thread, loopback) measured now. Every calibrated profile is saved
there and reused. Compressor cost curves missing from it are measured and
added.
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from commlab.engine import runfiles
from commlab.engine.cluster import PRESETS, ClusterError, resolve
from commlab.engine.codepath import is_import_path
from commlab.engine.runlog import set_aside, write_json_atomic
from commlab.engine.spec import MAX_GBPS, SpecError
from commlab.lab.base.paths import CURVES, PROFILES, SHAPED_LINK, default_root, file_in
from commlab.lab.base.specs import apply_overrides, load_spec, read_job_spec
from commlab.lab.rundir.index import runs_of
from commlab.lab.rundir.store import RunStore
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import predict as pr
from commlab.lab.strategy.perfmodel.costs import Cluster, Link
from commlab.lab.strategy.perfmodel.local import MethodResult
from commlab.lab.strategy.perfmodel.uneven import ClusterRing, at_speed

PROFILE_STEPS = 12
"""Steps of a profiling run: calibrate.SKIP_STEPS (3) warm-up, then 9 whose medians make the profile. It
is the advisor's first cost on a new model (at 20 steps, 8.6 s of gpt2's 10.8)."""


def load_for_prediction(path: Optional[str] = None, overrides=(), data: Optional[dict] = None) -> dict:
    """A validated, fully defaulted spec dict (the same checks as ``commlab run``)."""
    raw = apply_overrides(data if data is not None else read_job_spec(path), overrides)
    return load_spec(data=raw).to_dict()  # every comm mode a spec may name is one the model knows


def profile_dir(runs) -> Path:
    return Path(runs or default_root()) / PROFILES


def profile_file(runs, key: str) -> Path:
    """The saved profile of ``key`` (``calibrate.spec_key``, ``Profile.key``: a model's name and options as the
    user wrote them) in ``runs``' profiles directory: a file name made safe (commlab.lab.base.paths.file_in), never a path
    that leaves the directory."""
    return file_in(profile_dir(runs), key, ".json")


def save_shaped_link(runs, result: dict) -> Path:
    """Keep ``commlab net check`` figures (``result``) as the lab's shaped-link calibration."""
    import socket
    link = cal.link_from_net_check(result)
    link.update(source=f"commlab net check --save at {result['target_gbps']:g} Gbit/s on {socket.gethostname()}",
                measured_at=time.time(), small_mean_s=result.get("allreduce_small_mean_s"))
    path = profile_dir(runs) / SHAPED_LINK
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, link)
    return path


def saved_shaped_link(runs) -> Optional[dict]:
    """The lab's shaped-link calibration, or None when ``commlab net check --save`` never ran here."""
    path = profile_dir(runs) / SHAPED_LINK
    if not path.is_file():
        return None
    try:
        link = json.loads(path.read_text())
    except ValueError as e:
        raise SpecError("network.link", f"{path} is not a link calibration ({e}); run `commlab net check --gbps 1 "
                                        "--save` again") from None
    if not isinstance(link, dict) or any(k not in link for k in ("alpha", "beta", "nominal_gbps")):
        raise SpecError("network.link", f"{path} lacks alpha, beta or nominal_gbps; run `commlab net check "
                                        "--gbps 1 --save` again")
    return link


def matching_run(spec: dict, runs):
    """The most recent finished run with the spec's model, data set and batch size that other processes did
    not disturb (status.json's ``disturbance``: a disturbed run's compute times are not results) if there is
    any, and among those a ``sync`` one if there is any: nothing runs inside its backward (in wfbp the
    synchronous header exchange of an all-gathered payload blocks backward and has no span of its own, so it
    would count as compute). ``dear`` runs are not used: their forward includes the waits for parameter
    all-gathers, which are communication, not compute. A disturbed run is used only when no other matches,
    and the profile says so (``Profile.disturbance``). A run with no step past ``cal.SKIP_STEPS`` to time, and
    an advisor's trial session (its steps are the trials', recorded in their own folders), are not used."""
    key = cal.spec_key(spec)
    found = []
    for r in reversed(runs_of(runs, state="done")):
        try:
            d = r.spec_dict()
            if r.file(runfiles.TRIALS).exists() or d.get("steps", 0) <= cal.SKIP_STEPS:
                continue
            if cal.spec_key(d) == key and d["comm"]["mode"] != "dear":
                disturbed = bool((r.status().get("disturbance") or {}).get("disturbed"))
                found.append((disturbed, d["comm"]["mode"] != "sync", len(found), r))
        except (KeyError, OSError, json.JSONDecodeError):
            continue
    return min(found, key=lambda f: f[:3])[3] if found else None


def resolve_profile(spec: dict, runs=None, profile: Optional[str] = None, calibrate: Optional[str] = None,
                    say: Callable[[str], None] = print, runner: Optional[Callable[[dict], object]] = None
                    ) -> cal.Profile:
    """``runner`` (a validated spec dict -> its finished Run) runs the profiling run when one is needed
    (``measure_profile``); without one, a spec the lab has no profile of is a CalibrationError."""
    key = cal.spec_key(spec)
    saved = profile_file(runs, key)
    if profile:
        p = load_profile_file(profile, "--profile")
        say(f"profile: {profile} ({p.source})")
    elif calibrate:
        p = cal.from_run(RunStore(runs).get(calibrate))
        say(f"profile: calibrated from run {calibrate}")
    else:
        p = known_profile(spec, runs, say)
        if p is None:
            say(f"profile: no finished {key} run in the index; measuring a {PROFILE_STEPS}-step single-process run")
            p = measure_profile(spec, runs, runner=runner)
            say(f"profile: measured from run {p.source.split()[-1]}")
    note = cal.disturbed_note(p.disturbance)
    if note:
        say(f"profile: its compute times are not results: {note}")
    if p.key() != key:
        raise SpecError("model", f"the profile is for {p.key()}, the spec is {key}")
    if ensure_curves(p, [spec], runs, kept=True):
        say("profile: measured the compressor's encode/decode cost curve")
    p.save(saved if not profile else profile)
    return p


def has_profile(spec: dict, runs=None) -> bool:
    """Whether ``known_profile`` would find one (without reading a run's timeline)."""
    return profile_file(runs, cal.spec_key(spec)).is_file() or matching_run(spec, runs) is not None


def known_profile(spec: dict, runs=None, say: Callable[[str], None] = lambda m: None) -> Optional[cal.Profile]:
    """The lab's profile of the spec's model without measuring one: the saved profile, else one calibrated
    from the latest matching finished run (``matching_run``); None when the lab has neither. A saved profile
    whose compute came from a disturbed run gives way to an undisturbed matching run (its cost curves,
    payloads and link kept)."""
    key = cal.spec_key(spec)
    saved = profile_file(runs, key)
    if saved.is_file():
        try:
            p = cal.Profile.load(saved)
        except (OSError, ValueError, TypeError, KeyError) as e:  # a cut or hand-edited file: found or measured again
            print(f"commlab: {saved}: unreadable ({type(e).__name__}: {e}); {set_aside(saved)}; the profile is "
                  "calibrated or measured again", file=sys.stderr, flush=True)
        else:
            run = matching_run(spec, runs) if (p.disturbance or {}).get("disturbed") else None
            if run is not None and not (run.status().get("disturbance") or {}).get("disturbed"):
                q = cal.from_run(run)  # the compute again, from a quiet run; what is per machine or model is kept
                q.compressors, q.payloads, q.link = p.compressors, p.payloads, p.link
                say(f"profile: {saved} came from a disturbed run ({p.source}); calibrated from run {run.id} "
                    f"instead, which was not disturbed")
                return q
            say(f"profile: reusing {saved} ({p.source})")
            return p
    run = matching_run(spec, runs)
    if run is None:
        return None
    try:
        p = cal.from_run(run)
    except cal.CalibrationError as e:  # a run whose timeline holds no timed step: measured instead, as for none
        say(f"profile: not calibrated from run {run.id}: {e}")
        return None
    say(f"profile: calibrated from run {run.id}, the latest finished {key} {run.spec_dict()['comm']['mode']} "
        f"run in the index (undisturbed runs first, then sync ones)")
    return p


def link_file(path: str) -> dict:
    """A profile link from a saved ``commlab net check --json`` output."""
    try:
        return cal.link_from_net_check(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise SpecError("--link", f"no such file: {path}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError("--link", f"{path} is not `commlab net check --json` output ({type(e).__name__}: {e})") from None


def measure_profile(spec: dict, runs=None, steps: int = PROFILE_STEPS,
                    runner: Optional[Callable[[dict], object]] = None) -> cal.Profile:
    """A single-process ``sync`` run of the spec's model, data and batch (compressor none, one
    thread, as every rank of a 2-rank run on this 2-core machine runs; on a GPU its compute spans
    are CUDA events), calibrated from its timeline; ``machine`` says where. ``runner`` (a spec dict -> its
    finished Run) starts the run: through the queue (``commlab.lab.service.queue.Lab(runs).runner()``), or inside a
    slot the caller holds already (the advisor's, strategy auto's)."""
    s = copy.deepcopy(spec)
    s.update(name=f"profile {cal.spec_key(spec)}", world_size=1, steps=steps, eval_every=0, final_eval=False,
             threads=1, network={"link": "loopback"}, comm={"mode": "sync"},
             compressor={"name": "none", "params": {}, "error_feedback": False})
    if "strategy" in s:  # the profiling run itself is fixed: none, sync
        s["strategy"] = {"mode": "fixed"}
    if runner is None:
        raise cal.CalibrationError(f"no profile of {cal.spec_key(spec)} in the lab: measuring one needs runner= "
                                   "(commlab.lab.service.queue.Lab(runs).runner())")
    run = runner(s)
    if run.state != "done":
        why = run.status().get("error") or (run.log_tail(1).strip() or "no error recorded").splitlines()[-1]
        raise cal.CalibrationError(f"the profiling run {run.id} ended {run.state}: {why}")
    p = cal.from_run(run, skip=min(cal.SKIP_STEPS, steps - 2))
    p.machine = machine_info(run, steps)
    return p


def machine_info(run, steps: int) -> dict:
    """Where a profiling run measured: this host, its CPU, the rank's device, torch and threads
    (from the run's resolved.json), the parameters' dtypes, the clock of the compute spans."""
    import os
    import platform
    res = json.loads(Path(run.file(runfiles.RESOLVED)).read_text())
    info = {"host": platform.node(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "device": res.get("device"), "torch": res.get("torch"), "threads": res.get("threads"),
            "dtype": ",".join(cal.param_dtypes(run.spec_dict())), "steps": steps,
            "clock": "CUDA events" if str(res.get("device", "")).startswith("cuda") else "host clock"}
    if info["clock"] == "CUDA events":
        import torch
        info["gpu"] = torch.cuda.get_device_name(torch.device(res["device"]))
    return info


def profile_spec(spec: dict, runs=None, steps: int = PROFILE_STEPS,
                 runner: Optional[Callable[[dict], object]] = None) -> cal.Profile:
    """What ``commlab profile`` writes: the measured profile, the spec it was taken for (what
    ``commlab predict PROFILE`` predicts) and the cost curve of the spec's compressor. ``runner`` as in
    ``measure_profile``."""
    p = measure_profile(spec, runs, steps, runner=runner)
    p.spec = copy.deepcopy(spec)
    ensure_curves(p, [spec])
    return p


PROFILE_FIELDS = ("model", "dataset", "batch_size", "params", "forward_s", "backward_s")


def is_profile_file(path: str) -> bool:
    """Whether ``path`` holds a profile (JSON with fields no job spec has) rather than a job spec."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and any(k in d for k in ("params", "forward_s", "backward_s"))


def load_profile_file(path: str, field: str = "PROFILE") -> cal.Profile:
    """A profile file, or a one-line SpecError naming ``field`` and what is wrong with it."""
    f = Path(path)
    if not f.is_file():
        raise SpecError(field, f"no such file: {path}")
    return profile_from_text(f.read_text(), str(path), field)


MAX_DEPTH = 32
"""How deeply a profile's JSON may nest (a profile's own nest a job spec and its sections: fewer than ten levels)."""


def _depth(v, limit: int = MAX_DEPTH + 1) -> int:
    """How deeply ``v`` nests lists and mappings, counted no further than ``limit``."""
    level, todo = 0, [v]
    while todo and level < limit:
        todo = [x for c in todo for x in (c.values() if isinstance(c, dict) else c if isinstance(c, list) else ())
                if isinstance(x, (dict, list))]
        level += 1
    return level


def profile_from_text(text: str, where: str, field: str = "PROFILE") -> cal.Profile:
    """A profile from a file's text (``where`` names it in errors: a path, an upload)."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise SpecError(field, f"{where} is not JSON ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise SpecError(field, f"{where} is not a profile (nested too deeply)") from None
    if _depth(d) > MAX_DEPTH:  # deeper than any profile: what later copies it (asdict, a cache key) would recurse
        raise SpecError(field, f"{where} is not a profile (nested more than {MAX_DEPTH} levels)")
    if not isinstance(d, dict) or any(k not in d for k in PROFILE_FIELDS):
        raise SpecError(field, f"{where} is not a profile (needs {', '.join(PROFILE_FIELDS)}; "
                               f"write one with `commlab profile SPEC -o FILE`)")
    problem = profile_problem(d)
    if problem:
        raise SpecError(field, f"{where}: {problem}")
    d["params"] = [tuple(x) for x in d["params"]]
    try:
        return cal.Profile(**d)
    except TypeError as e:
        raise SpecError(field, f"{where}: {str(e).splitlines()[0]}") from None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def profile_problem(d: dict) -> Optional[str]:
    """What makes a profile's fields (JSON, maybe typed by anyone) unfit to predict from, in one line; None
    when they are fit: the predictions then only do arithmetic on numbers of the right kinds."""
    for k in ("model", "dataset"):
        if not isinstance(d[k], str):
            return f"{k} must be a string"
    if not isinstance(d.get("source", ""), str):
        return "source must be a string"
    if isinstance(d["batch_size"], bool) or not isinstance(d["batch_size"], int) or d["batch_size"] < 1:
        return "batch_size must be a positive integer"
    for k in ("forward_s", "backward_s", "optimizer_s", "overlap_slowdown"):
        if k in d and not _number(d[k]):
            return f"{k} must be a number of seconds (>= 0)"
    ps = d["params"]
    if not isinstance(ps, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
                                           and isinstance(p[1], int) and not isinstance(p[1], bool) and p[1] > 0
                                           for p in ps):
        return "params must be [name, bytes] pairs with bytes a positive integer"
    for k in ("layer_forward", "layer_ready", "layer_backward"):
        if k in d and not (isinstance(d[k], dict) and all(_number(v) for v in d[k].values())):
            return f"{k} must map layer names to seconds"
    for k in ("model_options", "machine", "compressors", "payloads"):
        if k in d and not isinstance(d[k], dict):
            return f"{k} must be a mapping"
    for key, curve in d.get("compressors", {}).items():
        if not isinstance(curve, dict) or not all(
                isinstance(curve.get(s), list) and len(curve[s]) == 2 and all(map(_number, curve[s]))
                for s in ("encode", "between", "decode") + (("decode_more",) if "decode_more" in curve else ())):
            return (f"compressors.{key} must hold encode, between and decode (and optionally decode_more) as "
                    "[fixed s, s per byte]")
        if not all(isinstance(curve.get(s, ""), str) for s in ("source", "kind", "code")):
            return f"compressors.{key}: its source, kind and code must be strings"
    for key, rounds in d.get("payloads", {}).items():
        if not isinstance(rounds, list) or not all(isinstance(r, list) and len(r) == 3 and isinstance(r[0], str)
                                                   and _number(r[1]) and _number(r[2]) for r in rounds):
            return f"payloads.{key} must be a list of [op, bytes, tensors]"
    link = d.get("link")
    if link is not None and not (isinstance(link, dict) and all(_number(link.get(k)) for k in
                                                                ("alpha", "beta", "nominal_gbps"))):
        return "link must hold alpha, beta and nominal_gbps as numbers"
    if link is not None and not isinstance(link.get("source", ""), str):
        return "link.source must be a string"
    dist = d.get("disturbance", {})
    if not isinstance(dist, dict) or (dist.get("disturbed") and not all(isinstance(dist.get(k), str)
                                                                        for k in ("run", "text"))):
        return "disturbance must be a mapping (a disturbed one with its run and text as strings)"
    if d.get("spec") is not None and not isinstance(d["spec"], dict):
        return "spec must be a mapping (a job spec)"
    return None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; elsewhere platform.processor())."""
    import platform
    cpu = ""
    if Path("/proc/cpuinfo").is_file():
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    return cpu or platform.processor()


def machine_key() -> str:
    """Where cost curves are measured (in this process, on the CPU, one thread): host, CPU and torch."""
    import platform

    import torch
    return f"{platform.node()}|{cpu_name()}|torch {torch.__version__}"


def machine_curves(runs) -> dict:
    """This machine's kept curves (compressor key -> curve); {} when there are none. The file is a cache: one
    that cannot be read is kept aside and said (``read_curves``), and its curves are measured again."""
    path = profile_dir(runs) / CURVES
    if not path.exists():
        return {}
    with _locked(path):
        return dict(read_curves(path).get(machine_key(), {}))


def keep_machine_curves(runs, curves: dict) -> None:
    """Add ``curves`` to this machine's, under an flock so that two advisers at once keep both."""
    path = profile_dir(runs) / CURVES
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        every = read_curves(path)
        every[machine_key()] = {**every.get(machine_key(), {}), **curves}
        write_json_atomic(path, every)


def read_curves(path: Path) -> dict:
    """Every machine's kept curves ({} when there is no file). A file that cannot be read, or is not
    {machine: {compressor key: curve}}, would fail every later prediction: it is moved aside (kept for a
    look), said on stderr, and taken as empty. Call it holding the file's lock."""
    try:
        every = json.loads(path.read_text())
        if not isinstance(every, dict) or not all(isinstance(m, dict) and all(map(_is_curve, m.values()))
                                                  for m in every.values()):
            raise ValueError("not {machine: {compressor: cost curve}}")
        return every
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        print(f"commlab: {path}: unreadable ({type(e).__name__}: {e}); {set_aside(path)}; the curves are "
              "measured again", file=sys.stderr, flush=True)
        return {}


def _is_curve(c) -> bool:
    """A cost curve as calibrate.measure_compressor makes it: fixed and per-byte cost for each stage."""
    return isinstance(c, dict) and all(
        isinstance(c.get(k), list) and len(c[k]) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in c[k])
        for k in ("encode", "between", "decode"))


@contextlib.contextmanager
def _locked(path: Path):
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def ensure_curves(profile: cal.Profile, specs, runs=None, kept: bool = False, who: Optional[str] = None) -> int:
    """Give ``profile`` a cost curve for every compressor the specs use that runs compressor code. With
    ``kept``, curves this machine already measured (``CURVES`` in ``runs``' profiles directory) are taken
    from there, and new ones are kept there. A compressor named by import path (the user's code) is never
    kept for the machine, and its curve in the profile is measured again when its file has changed since
    (``calibrate.code_stamp``). What is missing is measured in one go by ``calibrate.measure_curves`` (in a
    child with limits where this process serves viewers, ``who`` among them). Returns how many curves were
    measured (0: none)."""
    from commlab.engine.compressors.plan import parts
    machine = machine_curves(runs) if kept else {}
    todo: Dict[str, tuple] = {}  # key -> (item for measure_curves, what it is: machine, mine or a code stamp)
    for s in specs:
        m = pr.method_of(s)
        if m is not None and m.codec() is not None:  # a method's own codec (DeMo's): timed like a compressor
            k, mine = pr.codec_key(m), is_import_path(s["method"]["name"])
            if k not in profile.compressors and not mine and k in machine:
                profile.compressors[k] = machine[k]
            elif k not in profile.compressors:
                todo.setdefault(k, ({"method": s["method"]}, MINE if mine else MACHINE))
        sections = list(parts(s["compressor"]))
        if m is not None and m.takes_compressor and s["method"].get("compressor"):
            sections += parts(s["method"]["compressor"])  # the pseudo-gradients' compressor
        for c in sections:  # a mixed section: a curve per compressor it may give a bucket
            k = cal.compressor_key(c)
            if not cal.needs_curve(c):
                continue
            stamp = cal.code_stamp(c)
            have = profile.compressors.get(k)
            if have is not None and have.get("code", "") == stamp:
                continue
            if not stamp and k in machine:
                profile.compressors[k] = machine[k]
                continue
            todo.setdefault(k, ({"compressor": c}, stamp or MACHINE))
    measured = {}
    curves = cal.measure_curves([item for item, _ in todo.values()], who=who) if todo else []
    for (k, (_, what)), curve in zip(todo.items(), curves):
        if what == MACHINE:
            profile.compressors[k] = machine[k] = measured[k] = curve
        elif what == MINE:  # the user's code: kept with the profile only
            profile.compressors[k] = curve
        else:  # code named by import path: the curve carries its file's stamp
            profile.compressors[k] = {**curve, "code": what}
    if kept and measured:
        keep_machine_curves(runs, measured)
    return len(curves)


MACHINE, MINE = "machine", "mine"
"""What a curve ensure_curves measured is: kept for the machine, or the user's method's (kept with the profile)."""


CLUSTER_KEYS = {"node_size": (int, 1, 4096), "intra_gbps": (float, 0.001, 100000),
                "inter_gbps": (float, 0.001, MAX_GBPS), "intra_us": (float, 0.0, 1e6), "inter_us": (float, 0.0, 1e6),
                "nics": (int, 1, 64)}


def parse_cluster(text: str, required=None) -> dict:
    """``node_size=8,intra_gbps=1600,inter_gbps=100[,intra_us=..,inter_us=..,nics=..]`` -> a dict of
    those keys; node_size and intra_gbps are required (inter_gbps may come from --gbps) unless
    ``required`` names others (with --device, none: the device has its own)."""
    required = ("node_size", "intra_gbps") if required is None else required
    out = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in CLUSTER_KEYS:
            raise SpecError("--cluster", f"expected KEY=VALUE with KEY one of {', '.join(CLUSTER_KEYS)}, got {item!r}")
        kind, lo, hi = CLUSTER_KEYS[key]
        try:
            val = kind(raw)
        except ValueError:
            val = None
        if val is None or not lo <= val <= hi:
            raise SpecError("--cluster", f"{key} must be {'an integer' if kind is int else 'a number'} in "
                                         f"[{lo:g}, {hi:g}], got {raw!r}")
        out[key] = val
    missing = [k for k in required if k not in out]
    if missing:
        raise SpecError("--cluster", f"needs {' and '.join(missing)} (e.g. node_size=8,intra_gbps=1600,inter_gbps=100)")
    return out


def cluster_at(shape: dict, inter_gbps: float) -> Cluster:
    """The two-level cluster of ``shape`` (parse_cluster) with its inter-node link at ``inter_gbps``."""
    return Cluster(shape["node_size"], Link.from_gbps(shape["intra_gbps"], shape.get("intra_us", 0.0)),
                   Link.from_gbps(inter_gbps, shape.get("inter_us", 0.0)), shape.get("nics", 1))


def check_workers(shape: dict, workers: List[int], field: str = "--workers") -> None:
    for p in workers:
        try:
            cluster_at(shape, 1.0).nodes(p)
        except ValueError as e:
            raise SpecError(field, str(e).split(": ", 1)[1]) from None


def link_maker(profile: cal.Profile, shape: Optional[dict]) -> Callable[[float], object]:
    """Rate (Gbit/s) -> the link a prediction uses: the profile's (calibrated or nominal) flat link,
    or the two-level cluster with its inter-node link at that rate."""
    if shape is None:
        return profile.link_at
    return lambda g: cluster_at(shape, g)


def table(profile: cal.Profile, spec: dict, gbps: List[float], workers: List[int],
          compute_speedup: float = 1.0, cluster: Optional[dict] = None,
          links: Optional[Callable[[float], object]] = None) -> List[dict]:
    """One row per workers x rate: DDP's and the spec's predicted iteration time, the speedup
    over DDP, and the scaling factor of each (one worker's time, compute only, over p workers':
    1.0 is linear scaling with the batch per worker fixed). ``links`` (rate -> link) replaces the
    profile's or the cluster's links (commlab.lab.strategy.perfmodel.ondevice.link_maker)."""
    rows = []
    base = pr.ddp_spec(spec)
    links = links or link_maker(profile, cluster)
    one = pr.predict(profile, spec, 1.0, 1, compute_speedup).total
    for p in workers:
        steps = [pr.step_of(profile, s, p, compute_speedup) for s in (spec, base)]  # the same at every rate
        for g in gbps:
            rows.append(_row(profile, spec, base, p, g, links(g), compute_speedup, one, steps))
    return rows


def _row(profile: cal.Profile, spec: dict, base: dict, p: int, g: float, link, compute_speedup: float, one: float,
         steps: list) -> dict:
    """One row of ``table``: ``spec`` and DDP (``base``) on ``link`` at ``p`` workers (``g``: the rate said)."""
    t = pr.predict(profile, spec, g, p, compute_speedup, link=link, step=steps[0])
    d = pr.predict(profile, base, g, p, compute_speedup, link=link, step=steps[1])
    row = {"workers": p, "gbps": g, "ddp_ms": d.total * 1e3, "spec_ms": t.total * 1e3,
           "speedup": d.total / t.total, "ddp_scaling": one / d.total, "scaling": one / t.total,
           "exposed_comm_ms": t.exposed_comm * 1e3, "encode_decode_ms": t.encode_decode * 1e3}
    if isinstance(t, MethodResult):  # a method: its syncs amortized over the run, and its traffic
        row.update(syncs=t.syncs, steps=t.steps, bytes_per_step=t.bytes_per_step,
                   bytes_per_sync=t.bytes_per_sync, step_ms={k: v * 1e3 for k, v in t.step_s.items()})
    return row


def resolve_cluster(section: dict, world: int, field: str = "--cluster") -> dict:
    """A cluster of unequal workers (``section``: ``{preset}``, spec.json's ``{preset, workers}`` or
    ``{workers}``) resolved for ``world`` ranks on a modeled link (commlab.engine.cluster.resolve): a preset for
    any world size of at least its regions, a list of workers only for as many as it lists; a one-line
    SpecError naming ``field`` (the preset's option) or ``--workers`` otherwise."""
    preset = section.get("preset")
    if preset:
        if preset not in PRESETS:
            raise SpecError(field, f"{preset!r} is not a cluster preset; allowed: {', '.join(PRESETS)}")
        regions = len(PRESETS[preset]["workers"])
        if regions > 1 and world < regions:
            raise SpecError(field, f"preset {preset} has {regions} regions, a worker in each at least; give "
                                   f"--workers {regions} or more, not {world}")
        one = {"preset": preset}
    elif len(section["workers"]) != world:
        raise SpecError("--workers", f"the spec's network.cluster lists {len(section['workers'])} workers, not "
                                     f"{world}; give --workers {len(section['workers'])} or --cluster PRESET")
    else:
        one = {"workers": section["workers"]}
    try:
        return resolve(one, world, "modeled")
    except ClusterError as e:
        raise SpecError(field if preset else e.path, e.msg) from None


def cluster_rings(section: dict, workers: List[int], field: str = "--cluster") -> Dict[int, ClusterRing]:
    """The ring of a cluster of unequal workers (``section`` as ``resolve_cluster`` takes it) at each worker
    count."""
    out = {}
    for p in workers:
        resolved = resolve_cluster(section, p, field)
        out[p] = ClusterRing(resolved["workers"], resolved["preset"])
    return out


def cluster_table(profile: cal.Profile, spec: dict, rings: Dict[int, ClusterRing],
                  compute_speedup: float = 1.0) -> List[dict]:
    """``table`` on a cluster of unequal workers, one row per worker count (``rings``: count -> its ring,
    ``cluster_rings``): the cluster's links (commlab.lab.strategy.perfmodel.uneven), the slowest worker's
    compute, the slowest link's rate as the row's rate and the cluster's summary beside it. The scaling factors
    are against one worker at the profile's own speed."""
    rows = []
    base = pr.ddp_spec(spec)
    one = pr.predict(profile, spec, 1.0, 1, compute_speedup).total
    for p, ring in rings.items():
        slow = at_speed(profile, ring.slowest_speed)
        steps = [pr.step_of(slow, s, p, compute_speedup) for s in (spec, base)]
        rows.append(dict(_row(slow, spec, base, p, ring.gbps, ring, compute_speedup, one, steps),
                         cluster=ring.summary()))
    return rows


def cluster_rows(profile: cal.Profile, spec: dict, shape: dict, workers: List[int], inter_gbps: List[float],
                 compute_speedup: float = 1.0) -> List[dict]:
    """``table`` on the two-level cluster ``shape`` for a checked spec, with the cost curves it needs measured
    first (commlab.lab.strategy.perfmodel.views.cluster_prediction: the page's cluster prediction)."""
    ensure_curves(profile, [spec])
    return table(profile, spec, inter_gbps, workers, compute_speedup, cluster=shape)


def cluster_here(data: dict) -> dict:
    """The sandbox's ``predict`` task (commlab.lab.base.sandbox): ``cluster_rows`` of a profile and spec sent as JSON, with
    the curves and payloads the profile got on the way."""
    d = dict(data["profile"])
    d["params"] = [tuple(p) for p in d.get("params", [])]
    profile = cal.Profile(**d)
    had = (dict(profile.compressors), set(profile.payloads))
    rows = cluster_rows(profile, data["spec"], data["shape"], [int(p) for p in data["workers"]],
                        [float(g) for g in data["inter_gbps"]], float(data["compute_speedup"]))
    return {"rows": rows,  # and what the profile got (the caller has the rest; the answer's size is bounded)
            "compressors": {k: v for k, v in profile.compressors.items() if had[0].get(k) is not v},
            "payloads": {k: v for k, v in profile.payloads.items() if k not in had[1]}}


def with_penalty(rows: List[dict], pen: Optional[float], proven: bool) -> List[dict]:
    """Each row's speedup to the target: its iteration speedup over DDP divided by the strategy's convergence
    penalty (commlab.lab.strategy.penalty.spec_penalty); None where the penalty is unknown, flagged
    ``to_target_proven`` False where it is not evidence for this model."""
    for r in rows:
        r["to_target_speedup"] = r["speedup"] / pen if pen else None
        r["to_target_proven"] = bool(pen) and proven
    return rows


def format_table(rows: List[dict], rate: str = "GBIT/S") -> List[str]:
    head = ("WORKERS", rate, "DDP ms", "SPEC ms", "SPEEDUP", "TO TARGET", "DDP SCALING", "SCALING", "EXPOSED COMM ms",
            "ENC+DEC ms")

    def to_target(r):
        v = r.get("to_target_speedup")
        return "-" if v is None else f"{v:.2f}x" + ("" if r.get("to_target_proven") else "?")
    cells = [head] + [(str(r["workers"]), f"{r['gbps']:g}", f"{r['ddp_ms']:.2f}", f"{r['spec_ms']:.2f}",
                       f"{r['speedup']:.2f}x", to_target(r), f"{r['ddp_scaling']:.2f}", f"{r['scaling']:.2f}",
                       f"{r['exposed_comm_ms']:.2f}", f"{r['encode_decode_ms']:.2f}")
                      for r in rows]
    if rows and all("syncs" in r for r in rows):
        head += ("SYNC STEP ms", "MiB/STEP", "MiB/SYNC")
        cells = [head] + [c + (f"{r['step_ms'].get('sync', 0.0):.2f}", f"{r['bytes_per_step'] / 2**20:.3f}",
                               f"{r['bytes_per_sync'] / 2**20:.3f}") for c, r in zip(cells[1:], rows)]
    w = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return ["  ".join(c.rjust(wi) for c, wi in zip(row, w)) for row in cells]


def crossover_line(profile: cal.Profile, spec: dict, workers: int, compute_speedup: float = 1.0,
                   cluster: Optional[dict] = None, links: Optional[Callable[[float], object]] = None,
                   node_size: Optional[int] = None) -> str:
    links = links or link_maker(profile, cluster)
    node_size = node_size or (cluster["node_size"] if cluster else None)
    if node_size and workers <= node_size:
        x = pr.speedup(profile, spec, 1.0, workers, compute_speedup, links=links)
        return f"{workers} workers: one node, the inter-node rate plays no part ({x:.2f}x DDP at any rate)"
    return crossover_words(pr.crossover_gbps(profile, spec, workers, compute_speedup, links=links), workers)


def crossover_words(g: Optional[float], workers: int) -> str:
    """``predict.crossover_gbps``'s answer ``g`` at ``workers``, in words."""
    if g is None:
        return f"{workers} workers: compression does not beat DDP at any bandwidth in 0.001..1000 Gbit/s"
    if g >= 1e3:
        return f"{workers} workers: it beats DDP at every bandwidth up to 1000 Gbit/s"
    return f"{workers} workers: it beats DDP below {g:.3g} Gbit/s"
