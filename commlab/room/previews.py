"""Model sizes for the pages, counted in a child process with limits (commlab.lab.base.sandbox), never in the server:
a spec's model may be anyone's code, and building it costs memory and time. Answers (and the one-line errors
of models that cannot be built) are kept per model and data set, shared by every viewer, and a room asking
for the same model at once starts one child.
"""
from __future__ import annotations

import json
import threading
from typing import Dict, Optional

from commlab.engine import codepath
from commlab.engine.spec import JobSpec, SpecError
from commlab.lab.base import sandbox
from commlab.room import places
from commlab.lab.base.kept import Kept

PREVIEWS = 64
"""Model sizes (or the one-line error of their preview) kept in this process, least recently used first out."""
_previews = Kept(PREVIEWS)
_asking_lock = threading.Lock()
_asking: Dict[str, threading.Lock] = {}
"""One lock per model whose size a child is counting now: everyone else asking for it waits for that answer
(a room pressing the same preset's Start at once starts one child, not one each)."""


def model_size(spec: JobSpec, who, wait_s: Optional[float] = None) -> dict:
    """Parameter count and gradient bytes of the spec's model: {params, grad_bytes, tensors, tied}, counted
    in a child process with limits (commlab.lab.base.sandbox, task describe), never in this one, once per model and data
    set (the last PREVIEWS answers are kept); a compressor named by import path is checked there too (its
    class's declared parameters, and dear's needs). Raises SpecError as the spec would, or with the limit
    the child hit ("preview: took more than 30 s"), or with why no child was started for it now (no free
    place, the person's budget spent). ``who`` is the person asking (a user, commlab.room.owners.User, or a
    name, which has a student's budget): one child per person at a time (commlab.room.places.person), places handed out
    fairly and each person's child time bounded (commlab.room.places.Places)."""
    d = spec.to_dict()
    data = dict(d["dataset"])
    if data["name"] == "synthetic":
        data["size"] = None  # how many examples plays no part in the model's size (commlab.engine.preflight.sized)
    want = {"model": d["model"], "dataset": data, "seed": 0}
    if codepath.code_fields({"compressor": d["compressor"]}):  # the teacher's compressor class: its parameters, in the child
        want.update(compressor=d["compressor"], comm=d["comm"])
    key = json.dumps(want, sort_keys=True)
    hit = _previews.get(key)
    if hit is None:
        with _asking_lock:
            asking = _asking.setdefault(key, threading.Lock())
        if not asking.acquire(timeout=sandbox.PREVIEW.wall_s + (sandbox.WAIT_S if wait_s is None else wait_s)):
            raise SpecError("preview", "another viewer's preview of this model is still running; try again in a moment")
        try:  # the key's lock first, then the person's: every thread takes them in this order
            with places.person(who):  # one child per person at a time; a second request waits, then finds the answer
                hit = _previews.get(key) or _run_preview(key, who, wait_s)
        finally:
            with _asking_lock:
                asking.release()
                if _asking.get(key) is asking:  # those already waiting hold it; the dict stays small
                    del _asking[key]
    if isinstance(hit, SpecError):
        raise SpecError(hit.path, hit.msg)
    return hit


def _run_preview(key: str, who, wait_s: Optional[float] = None):
    """The child's answer for ``key`` (a size, or the SpecError it gave), kept; no free place for a child, or
    no answer in time, is not an answer about the spec (asked again next time)."""
    try:
        hit = sandbox.run("describe", json.loads(key), sandbox.PREVIEW, who=who, wait_s=wait_s)
    except (sandbox.Busy, sandbox.TimedOut) as e:
        raise SpecError(e.path, e.msg) from None
    except sandbox.SandboxError as e:
        hit = SpecError(e.path, e.msg)
    return _previews.put(key, hit)
