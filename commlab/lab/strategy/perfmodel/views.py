"""What the model page shows, as data (the page in commlab/app/views/model.py only lays it out).

- ``speedup_grid``: predicted speedup over DDP for compressors x bandwidths x workers;
- ``crossovers``: the bandwidth below which each compressor beats DDP;
- ``predicted_vs_measured``: for every finished multi-rank run in the index, its
  measured median iteration time beside the model's prediction, each run
  calibrated from its own timeline (compute; hooks taken out) with the link its
  spec names (shaped: nominal rate with the tbf's token bucket; modeled: the
  modeled link; loopback: alpha and beta fitted to its own communicate spans);
- ``properties``: the measured checklist, saved beside the profiles;
- ``sources_table``: which inputs of the predictions were measured and which assumed, with the validation
  error of each part (the "sources" of ``commlab predict``);
- ``cluster_prediction``: a profile's predicted step times over worker counts and link rates.

Which profiles a viewer may predict from, how large a student's may be, and the cache of predictions the page
keeps are commlab.lab.front.profiles'.
"""
from __future__ import annotations

import copy
import json
import re
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import List, Optional

import pandas as pd

from commlab.engine import codepath, runfiles
from commlab.engine.compressors.plan import parts
from commlab.engine.runlog import set_aside, write_json_atomic
from commlab.engine.spec import SpecError
from commlab.lab.base import sandbox
from commlab.lab.base.paths import PROPERTIES
from commlab.lab.net.netns import tbf_burst_bytes
from commlab.lab.rundir.index import runs_of
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import ondevice, properties, whatif
from commlab.lab.strategy.perfmodel import predict as pr
from commlab.lab.strategy.perfmodel.costs import Link
from commlab.lab.strategy.perfmodel.properties import yes_no
from commlab.lab.base.kept import Kept

COMPRESSORS = {
    "fp16": {"name": "fp16", "params": {}, "error_feedback": False},
    "topk 1% +EF": {"name": "topk", "params": {"ratio": 0.01}, "error_feedback": True},
    "powersgd r2": {"name": "powersgd", "params": {"rank": 2, "start_iter": 2}, "error_feedback": False},
    "signsgd": {"name": "signsgd", "params": {}, "error_feedback": False},
    "qsgd": {"name": "qsgd", "params": {}, "error_feedback": False},
}
UI_NUMELS = (1024, 16384, 262144)


def with_compressor(spec: dict, comp: dict) -> dict:
    s = copy.deepcopy(spec)
    s["compressor"] = copy.deepcopy(comp)
    return s


def speedup_grid(profile: cal.Profile, spec: dict, comps: dict, gbps: List[float], workers: List[int],
                 compute_speedup: float = 1.0) -> pd.DataFrame:
    rows = []
    for label, comp in comps.items():
        s = with_compressor(spec, comp)
        for p in workers:
            steps = pr.steps_for(profile, s, p, compute_speedup)
            for g in gbps:
                rows.append({"compressor": label, "gbps": g, "workers": p,
                             "speedup": pr.speedup(profile, s, g, p, compute_speedup, steps=steps)})
    return pd.DataFrame(rows)


def crossovers(profile: cal.Profile, spec: dict, comps: dict, workers: int, compute_speedup: float = 1.0):
    rows = []
    for label, comp in comps.items():
        s = with_compressor(spec, comp)
        g = pr.crossover_gbps(profile, s, workers, compute_speedup)
        rows.append({"compressor": label, "crossover_gbps": g,  # said from g, not searched for again
                     "answer": whatif.crossover_words(g, workers).split(": ", 1)[1]})
    return pd.DataFrame(rows)


def ensure_curves(profile: cal.Profile, comps: dict, who: Optional[str] = None) -> None:
    """A cost curve in ``profile`` for each compressor of ``comps`` (label -> compressor section) that runs
    compressor code, at the page's sizes (UI_NUMELS): measured by calibrate.measure_curves, which in the UI's
    server times them in a child (``who``'s) and keeps them, so a page load measures only what is new."""
    todo = {}
    for section in comps.values():
        for comp in parts(section):  # a mixed section: a curve per compressor it may give a bucket
            k = cal.compressor_key(comp)
            if k not in profile.compressors and k not in todo and cal.needs_curve(comp):
                todo[k] = {"compressor": comp}
    if todo:
        curves = cal.measure_curves(list(todo.values()), numels=UI_NUMELS, repeat=3, warm=2, who=who)
        profile.compressors.update(zip(todo, curves))


def measured_ms(run, skip: int = cal.SKIP_STEPS) -> Optional[float]:
    start = int(run.spec_dict()["compressor"]["params"].get("start_iter", 0))
    skip = max(skip, start + 2) if start else skip
    ts = [r["time_ms"] for r in run.metric_rows() if r.get("kind") == "step" and r["step"] >= skip]
    return statistics.median(ts) if ts else None


def run_link(run, profile: cal.Profile) -> Link:
    net = run.spec_dict()["network"]
    if net["link"] == "shaped":
        return Link(0.0, 8.0 / (net["gbps"] * 1e9), tbf_burst_bytes(net["gbps"]), 0.0)
    if net["link"] == "modeled":
        return Link.from_gbps(net["gbps"], net.get("latency_us") or 0.0)
    try:
        alpha, beta = cal.link_from_run(run)
    except ValueError:  # collectives of one size only: bandwidth only
        rows = [(t, cal.steps_and_wire(op, n, run.spec_dict()["world_size"])[1])
                for op, n, t, _ in cal.service_times(run)]
        if not rows:
            raise cal.CalibrationError("no collectives in the timeline") from None
        alpha, beta = 0.0, statistics.median(t / max(w, 1) for t, w in rows)
    return Link(alpha, beta)


def run_layout(run) -> Optional[List[List[str]]]:
    """The buckets a run ended with (layout.json, rewritten by tuners), as groups of parameter names."""
    try:
        return [b["layers"] for b in json.loads(Path(run.file(runfiles.LAYOUT)).read_text())["buckets"]]
    except (OSError, ValueError, KeyError):
        return None


NEWEST = 30
"""Finished runs the Performance model page predicts against their measurement: the newest a viewer may see."""
CALIBRATED = 256
"""Runs' calibrations (``calibrated_run``) kept in this process, least recently used first out."""
_calibrations = Kept(CALIBRATED)


def calibrated_run(run) -> cal.Profile:
    """cal.from_run(run) (or its CalibrationError), kept per run and the state of its files: seconds for a long
    run, which every page load of the Performance model needs again. A copy: the caller may set its fields."""
    def calibrate():
        try:
            return cal.from_run(run)
        except cal.CalibrationError as e:
            return e
    hit = _calibrations.get_or((str(run.path), run.files_key()), calibrate)
    if isinstance(hit, cal.CalibrationError):
        raise cal.CalibrationError(*hit.args)
    return replace(hit, compressors=dict(hit.compressors), payloads=dict(hit.payloads))


def predicted_vs_measured(runs, curves: Optional[dict] = None, only=None, who: Optional[str] = None) -> pd.DataFrame:
    """One row per finished multi-rank run (of those in ``only``, run ids, when given: the page's newest NEWEST):
    measured and predicted iteration time (ms), or the reason it could not be predicted. Each run's calibration is
    kept (``calibrated_run``). What the predictions need measured (the runs' compressors' curves, payloads only
    driving tells) is measured for all runs at once, in children where this process serves viewers (``who``'s),
    and kept: the page's next load measures nothing. No place for a child now, or a child out of time, is raised
    (sandbox.Busy, sandbox.TimedOut): about the server's load, not an answer about the runs."""
    rows, todo, sections = [], [], {}
    curves = {} if curves is None else curves
    only = None if only is None else set(only)
    done = [run for run in runs_of(runs, state="done") if only is None or run.id in only]
    for run in done:
        spec = run.spec_dict()
        row = {"run": run.id, "name": spec.get("name", ""), "compressor": spec["compressor"]["name"],
               "schedule": spec["schedule"]["name"], "comm": spec["comm"]["mode"],
               "link": spec["network"]["link"] + (f" {spec['network'].get('gbps'):g}G"
                                                  if spec["network"].get("gbps") else ""),
               "world": spec["world_size"], "measured_ms": None, "predicted_ms": None, "note": ""}
        rows.append(row)
        try:
            if spec["world_size"] < 2:
                raise cal.CalibrationError("one rank: nothing to communicate")
            row["measured_ms"] = measured_ms(run)
            prof = calibrated_run(run)
            prof.compressors = curves  # one dict for every run: each compressor is timed once
            for comp in parts(spec["compressor"]):
                cal.needs_curve(comp)  # a section its compressor refuses: this run's note, not the others'
            todo.append((row, prof, spec, run_link(run, prof), run_layout(run)))
            sections[run.id] = spec["compressor"]
        except (cal.CalibrationError, ValueError, KeyError, OSError) as e:
            row["note"] = one_line(e)[:120]

    def predict_all():
        for row, prof, spec, link, layout in todo:
            row["predicted_ms"], row["note"] = None, ""
            try:
                row["predicted_ms"] = pr.predict(prof, spec, link.gbps if link.beta else 1.0, spec["world_size"],
                                                 link=link, layout=layout).total * 1e3
            except (sandbox.Busy, sandbox.TimedOut):
                raise
            except (cal.CalibrationError, ValueError, KeyError, OSError) as e:
                row["note"] = one_line(e)[:120]
    try:
        if todo:
            ensure_curves(todo[0][1], sections, who)  # into ``curves``, which every run's profile holds
        pr.without_driving(predict_all, who)
    except (sandbox.Busy, sandbox.TimedOut):
        raise  # about the server's load now, not about the runs: not their answer (a page keeps what it gets)
    except ValueError as e:  # a child's limit: said on every run it leaves unpredicted
        for row, *_ in todo:
            row["predicted_ms"], row["note"] = None, one_line(e)[:120]
    return pd.DataFrame(rows)


def cluster_prediction(profile: cal.Profile, shape: dict, workers: List[int], inter_gbps: List[float],
                       compute_speedup: float = 1.0, spec: Optional[dict] = None,
                       who: Optional[str] = None) -> pd.DataFrame:
    """``commlab predict PROFILE --cluster ...`` as a table: per workers x inter-node rate, DDP's and
    the spec's (default: the profile's own) iteration time, speedup and scaling factors.
    Bad shapes and worker counts are one-line SpecErrors, said before anything is computed.

    Where this process serves viewers (commlab.engine.codepath.forbid_imports_when) the profile and the spec are a
    viewer's: the prediction, with the cost curves and payloads it measures, runs in a child with limits
    (commlab.lab.strategy.perfmodel.child, task ``predict``, limits calibrate.PREDICT; ``who``'s one at a time), and
    ``profile`` gets the curves and payloads it measured (what the sources table reads). Elsewhere it runs here."""
    spec = spec or profile.spec
    if not spec:
        raise SpecError("profile", "it records no spec (not written by commlab profile)")
    spec = whatif.load_for_prediction(data=spec)  # the compressor's and method's parameters within their bounds
    whatif.check_workers(shape, workers, "workers")
    if not codepath.imports_allowed():
        got = sandbox.run("predict", {"profile": asdict(profile), "spec": spec, "shape": shape,
                                      "workers": list(workers), "inter_gbps": list(inter_gbps),
                                      "compute_speedup": compute_speedup}, cal.PREDICT, who=who)
        profile.compressors.update(got["compressors"])
        profile.payloads.update(got["payloads"])
        rows = got["rows"]
    else:
        rows = whatif.cluster_rows(profile, spec, shape, workers, inter_gbps, compute_speedup)
    return pd.DataFrame(rows).rename(columns={"gbps": "inter_gbps"})


def sources_table(profile: cal.Profile, spec: dict, comps: Optional[dict] = None, link: str = "",
                  cluster: bool = False) -> pd.DataFrame:
    """What the page's predictions rest on, as ``commlab predict`` prints it (ondevice.source_rows): compute,
    the link (``link``: how the page sets it, when not the profile's own) and each compressor of ``comps``
    (default: the spec's own), each measured, modeled or assumed, with the validation error of that part of
    the model."""
    spec = whatif.load_for_prediction(data=spec)  # the compressor sections in full, as the curves are keyed
    comps = comps or {"spec": spec["compressor"]}
    rows, seen = [], set()
    for comp in comps.values():
        for r in ondevice.source_rows(profile, with_compressor(spec, comp), link=link, cluster=cluster):
            if r["part"] not in seen:
                seen.add(r["part"])
                rows.append(r)
    return pd.DataFrame(rows, columns=["part", "kind", "source", "validated"])


def properties_file(runs) -> Path:
    return whatif.profile_dir(runs) / PROPERTIES


def load_properties(runs) -> Optional[List[dict]]:
    """The measured checklist, or None when it was never measured. A file that cannot be read, or is not a
    list of rows, is moved aside (kept for a look) and said on stderr, and taken as never measured."""
    f = properties_file(runs)
    try:
        rows = json.loads(f.read_text())
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError("not a list of rows")
        return rows
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        print(f"commlab: {f}: unreadable ({type(e).__name__}: {e}); {set_aside(f)}; measure it again",
              file=sys.stderr, flush=True)
        return None


def measure_properties(runs, profile: Optional[cal.Profile] = None, names=None) -> List[dict]:
    """Measure the checklist and keep it (written atomically: a reader never sees half of it). Who may ask
    for it on a shared lab is commlab.lab.front.profiles.may_measure's to say."""
    rows = properties.checklist(names, profile, numels=UI_NUMELS)
    f = properties_file(runs)
    f.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(f, rows)
    return rows



def calibrated(run, who: Optional[str] = None) -> tuple:
    """(profile calibrated from ``run``'s timeline with the measured compressors' curves, its spec); a
    one-line CalibrationError, without the server's paths, for whatever it lacks."""
    try:
        spec = run.spec_dict()
        prof = cal.from_run(run, skip=min(cal.SKIP_STEPS, max(0, spec["steps"] - 2)))
        ensure_curves(prof, COMPRESSORS, who)
        # the payloads the page's grid and crossovers need for these compressors on this model: driven once, in
        # a child where this process serves viewers, and kept with the profile
        pr.without_driving(lambda: _tried(prof, spec), who)
        return prof, spec
    except (cal.CalibrationError, OSError, ValueError, KeyError, TypeError) as e:
        raise cal.CalibrationError(one_line(e)) from None


def _tried(prof: cal.Profile, spec: dict) -> None:
    """Predict ``spec`` with each of the page's compressors once; what fails is the page's to say where it predicts."""
    for comp in COMPRESSORS.values():
        try:
            pr.predict(prof, with_compressor(spec, comp), 1.0, 2)
        except (ValueError, KeyError):
            pass


def properties_table(rows: List[dict]) -> pd.DataFrame:
    out = []
    for r in rows:
        acc = r.get("accuracy")
        out.append({
            "compressor": r["compressor"],
            "all-reduce compatible": yes_no(r["allreduce_compatible"]) + f" ({r['rounds']} round"
                                     + ("s" if r["rounds"] > 1 else "") + ")",
            "linear (sum of payloads)": "n/a" if r["linear"] is None else yes_no(r["linear"]),
            "compression ratio": f"{r['ratio']:.1f}x",
            "encode+decode fixed µs": f"{r['encode_us_fixed'] + r['decode_us_fixed']:.0f}",
            "encode+decode µs/MB": f"{r['encode_us_per_mb'] + r['decode_us_per_mb']:.0f}",
            "overhead / compute": f"{r['overhead_vs_compute']:.0%}" if r.get("overhead_vs_compute") is not None
            else "no profile",
            "fusion saves": f"{r['fusion_saving']:.0%}",
            "accuracy neutral": yes_no(r["accuracy_neutral"]) + (f" ({acc:.1%} vs {r['accuracy_baseline']:.1%})"
                                                                  if acc is not None and r.get("accuracy_baseline")
                                                                  else ""),
        })
    return pd.DataFrame(out)


_PATHS = re.compile(r"(?:/[^\s'\":,;()]+)+")


def one_line(e: BaseException) -> str:
    """An error as one line for any viewer: its first line, with file system paths cut to their last part."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _PATHS.sub(lambda m: Path(m.group(0)).name or "/", text)
