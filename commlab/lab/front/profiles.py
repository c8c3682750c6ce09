"""What a viewer of the Performance model page may read and do: the lab's own saved profiles, an upload
parsed as data, a path (the teacher's, inside the runs directory), a cluster prediction (kept per profile and
inputs, one at a time per person), and "Measure again" (the teacher's); errors as one line without the
server's paths."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

import pandas as pd

from commlab.engine.codepath import code_fields
from commlab.engine.spec import SpecError
from commlab.lab.base import sandbox
from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import CURVES, PROPERTIES, SHAPED_LINK
from commlab.room import owners, places
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import views, whatif
from commlab.lab.base.kept import Kept


def may_measure(user: owners.User) -> bool:
    """"Measure again" rewrites a file every viewer reads and takes the server's CPU: the teacher's (and
    the local user's) only."""
    return user.admin


MAX_UPLOAD = 2 << 20
"""The largest profile file accepted as an upload (a profile of a model with 10,000 tensors is ~0.5 MB)."""


MAX_TENSORS = 2_000
"""The most parameter tensors a profile from a student may list (gpt2 has 148, resnet50 161, llama-2-70b 723,
mixtral-8x7b 995). A cluster prediction's cost grows with them (one bucket each under ``schedule: layerwise``):
about 1 s of CPU at 2,000 for the page's default 5 worker counts x 2 rates, in a child with a CPU limit, with
the cost curves and payloads it measures (commlab.lab.strategy.perfmodel.views.cluster_prediction; docs/explanation/
perfmodel.md, the page)."""


NOT_PROFILES = (PROPERTIES, CURVES, SHAPED_LINK)


def lab_profiles(runs) -> Dict[str, str]:
    """The runs directory's saved profiles (``.profiles/*.json``, written by predictions and the advisor):
    a label (the file's name) -> its path relative to the runs directory."""
    d = whatif.profile_dir(runs)
    if not d.is_dir():
        return {}
    return {f.name: str(f.relative_to(Path(runs))) for f in sorted(d.glob("*.json"))
            if f.name not in NOT_PROFILES and f.is_file() and whatif.is_profile_file(str(f))}


def in_runs(runs, text: str) -> Path:
    """``text`` as a file inside the runs directory (relative to it, or absolute but inside it); a one-line
    SpecError for ``..``, a path outside it or through a link that leads outside, without the server's
    paths in it."""
    root = Path(runs).resolve()
    p = Path(text.strip())
    if ".." in p.parts:
        raise SpecError("profile", "a path inside the runs directory, without '..'")
    full = (p if p.is_absolute() else root / p).resolve()
    if full != root and root not in full.parents:
        raise SpecError("profile", "only files in the runs directory can be read here; give a path inside it")
    if not full.is_file():
        raise SpecError("profile", f"no such file in the runs directory: {p.name or text}")
    return full


def read_profile(runs, user: owners.User, name: Optional[str] = None, path: Optional[str] = None,
                 upload: Optional[tuple] = None) -> cal.Profile:
    """The profile a viewer asked for: one of ``lab_profiles`` by ``name``, a typed ``path`` (the teacher:
    inside the runs directory; the local user: anywhere), or an ``upload`` (file name, bytes), parsed as
    data only. A student's profile whose spec names code, or that is larger than their limits, is refused.
    Errors are one-line SpecErrors."""
    local = user == owners.local_user()
    if upload is not None:
        fname, data = upload
        if len(data) > MAX_UPLOAD:
            raise SpecError("profile", f"the upload is {len(data) / 2**20:.1f} MiB; at most {MAX_UPLOAD >> 20} MiB")
        prof = whatif.profile_from_text(data.decode("utf-8", "replace"), f"upload {Path(str(fname)).name}",
                                        "profile")
    elif name is not None:
        rel = lab_profiles(runs).get(name)
        if rel is None:
            raise SpecError("profile", "no such saved profile in this lab; pick one from the list")
        prof = whatif.profile_from_text((Path(runs) / rel).read_text(), name, "profile")  # no server path in errors
    elif path is not None:
        if not user.admin:
            raise SpecError("profile", "pick one of the lab's profiles or upload one")
        prof = whatif.load_profile_file(path.strip() if local else str(in_runs(runs, path)), "profile")
    else:
        raise SpecError("profile", "choose a profile")
    if not user.admin:
        _student_profile(runs, prof)
    return prof


def _student_profile(runs, prof: cal.Profile) -> None:
    """A student's profile: data they may predict from (no code, a spec whose parameters are within their
    bounds, no more parameters than their limit). Checked before anything is measured for it."""
    q = owners.quotas(runs)
    if prof.spec:
        owners.refuse_code(prof.spec)
        spec = whatif.load_for_prediction(data=prof.spec)  # a compressor's parameters within their bounds (one line)
        if "steps" in q and spec["steps"] > q["steps"]:  # a method's prediction simulates every step of its run
            raise SpecError("quota steps", f"at most {q['steps']} steps per run, asked for {spec['steps']}")
    try:
        params = sum(int(b) for _, b in prof.params) // 4
    except (TypeError, ValueError):
        raise SpecError("profile", "params must be [name, bytes] pairs") from None
    if len(prof.params) > MAX_TENSORS:
        raise SpecError("profile", f"{len(prof.params):,} parameter tensors; at most {MAX_TENSORS:,} in a student's "
                                   f"profile on this lab")
    if "params" in q and params > q["params"]:
        raise SpecError("profile", f"a model of about {params:,} parameters; at most {q['params']:,} on this lab "
                                   f"(quota params)")


PREDICTIONS = 32
"""Cluster predictions (or their one-line errors) kept in this process, least recently used first out."""
_predictions = Kept(PREDICTIONS)


def cluster_prediction(user: owners.User, prof: cal.Profile, shape: dict, workers: List[int],
                       inter_gbps: List[float], compute_speedup: float = 1.0,
                       spec: Optional[dict] = None) -> pd.DataFrame:
    """views.cluster_prediction for the page: kept per (the profile's content, the inputs), so a rerun of the page
    with the same ones costs a digest, not a prediction; one at a time per person (a second waits for the first,
    then is refused as busy). A spec that names code (the teacher's) is predicted every time: its file may have
    changed. On a kept answer the profile gets the cost curves the prediction gave it (what the sources table
    reads)."""
    want = spec or prof.spec
    if want and code_fields(want):
        return views.cluster_prediction(prof, shape, workers, inter_gbps, compute_speedup, spec=spec, who=user.name)
    key = hashlib.sha256(json.dumps([asdict(prof), spec, shape, list(workers), list(inter_gbps), compute_speedup],
                                    sort_keys=True, default=str).encode()).hexdigest()
    hit = _predictions.get(key)
    if hit is None:
        with places.person(user.name, "prediction", sandbox.WAIT_S):
            hit = _predictions.get(key)
            if hit is None:
                try:
                    hit = (views.cluster_prediction(prof, shape, workers, inter_gbps, compute_speedup, spec=spec,
                                                    who=user.name),
                           dict(prof.compressors))
                except (sandbox.Busy, sandbox.TimedOut):
                    raise  # about the server's load, not the profile: not kept as its answer
                except (SpecError, KeyError, ValueError) as e:
                    hit = (_anew(e), {})  # without its traceback, which holds the profile
                _predictions.put(key, hit)
    answer, curves = hit
    if isinstance(answer, BaseException):
        raise _anew(answer)  # a new one each time: a kept one would gather tracebacks
    prof.compressors.update(curves)
    return answer.copy()


def _anew(e: BaseException) -> BaseException:
    """The same error, new: its type and message, no traceback."""
    if isinstance(e, SpecError):
        return SpecError(e.path, e.msg)
    try:
        return type(e)(*e.args)
    except TypeError:  # a type that is not made from its args
        return (KeyError if isinstance(e, KeyError) else ValueError)(str(e))


def measure_properties(runs, user: owners.User, profile: Optional[cal.Profile] = None, names=None) -> List[dict]:
    """views.measure_properties for a viewer who may (``may_measure``); LabError for anyone else."""
    if not may_measure(user):
        raise LabError("properties: only the teacher may measure them again on a shared lab")
    return views.measure_properties(runs, profile, names)
