"""The lab as a workshop server: who owns a run, who sees it, and how much each may ask. Who may sign
in, and their tokens and sessions, are lab.accounts'.

Loopback use (``commlab app``, the CLI, notebooks) has one user, the person at the machine: the local
user, who sees and controls everything. A run records its owner and whether it is shared in status.json
(``owner``, ``shared``) and in the index. A student sees their own runs and the shared ones, and cancels or
shares only their own; the teacher and the local user see and cancel all. Runs made before owners existed
belong to the local user.

Per-user limits bound what a student may ask for (``quotas`` in runs/lab.json; without it the safe
defaults of ``DEFAULT_QUOTAS``), and code named by import path is the teacher's only (``refuse_code``):

    {"quotas": {"queued": 3, "steps": 2000, "world_size": 2, "wall_s": 600}}
"""
from __future__ import annotations

import dataclasses
import fcntl
import getpass
import hashlib
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from engine.codepath import code_fields
from engine.spec import SpecError
from lab.base.errors import LabError
from lab.base.paths import CONFIG
from lab.rundir.store import lab_config

TEACHER = "teacher"
"""The owner name of runs the teacher starts from the UI with the admin token."""


@dataclass(frozen=True)
class User:
    name: str
    admin: bool = False

    def __str__(self) -> str:
        return f"{self.name} ({'teacher' if self.admin else 'student'})"


def local_user() -> User:
    """The person at the machine: the CLI's, the notebooks' and loopback UI's user; sees everything."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = "local"
    return User(name, admin=True)


# --------------------------------------------------------------------------- who sees what

def owner_of(status_or_row: dict) -> str:
    """A run's owner from its status or index row; runs from before owners belong to the local user."""
    return status_or_row.get("owner") or local_user().name


def can_see(user: User, status_or_row: dict) -> bool:
    return user.admin or owner_of(status_or_row) == user.name or bool(status_or_row.get("shared"))


def can_control(user: User, status_or_row: dict) -> bool:
    """Cancel it, share it: its owner and the teacher."""
    return user.admin or owner_of(status_or_row) == user.name


# --------------------------------------------------------------------------- what a student may run

QUOTA_KEYS = {"queued": "queued or running runs at once", "steps": "steps per run",
              "world_size": "ranks per run", "batch_size": "examples per batch per rank",
              "examples": "training examples of a synthetic data set",
              "data_mb": "MB of data per rank (data set, a batch, and a batch's logits for token data)",
              "threads": "torch threads per rank", "params": "parameters of the model",
              "wall_s": "seconds of running per run"}
DEFAULT_QUOTAS = {"queued": 4, "steps": 2000, "world_size": 4, "batch_size": 256, "examples": 100_000,
                  "data_mb": 1024, "threads": 2, "params": 50_000_000, "wall_s": 900}
"""A student's limits on an exposed lab (``commlab app --host ...``) unless runs/lab.json's ``quotas`` says
otherwise; the teacher (admin token) and the local user (the CLI, notebooks, the UI on loopback) have none.

- ``queued`` 4: runs queued or running at once (the largest preset queues 4 at one click);
- ``steps`` 2000 and ``world_size`` 4: per run;
- ``batch_size`` 256: examples per batch per rank;
- ``examples`` 100000: the size of a synthetic data set;
- ``data_mb`` 1024: the MB a rank's data takes, estimated from the spec (``data_mb``): the data set, one
  batch of inputs, and for token data one batch of logits (batch x context length x vocabulary);
- ``threads`` 2: torch threads per rank (``threads: 0``, one per core, becomes this many);
- ``params`` 50000000: parameters of the model, counted in a child process before the run is queued;
- ``wall_s`` 900: a run still going after that many seconds of running is cancelled by its supervisor,
  with the limit named in its error.

A key in lab.json replaces its default (``{"quotas": {"queued": 4}}`` keeps the other defaults); ``null``
lifts that limit. A refusal is one line naming the limit: ``quota batch_size: at most 256 ...``."""
QUOTA_FIELDS = {"steps": "steps", "world_size": "world_size", "batch_size": "batch_size",
                "examples": "dataset.size", "data_mb": "dataset", "threads": "threads", "params": "model.name"}
"""The spec field each per-run limit is about (the New run form shows a refusal under it)."""


class QuotaError(LabError):
    """A request over a limit: ``key`` (a QUOTA_KEYS key) and ``field`` (the spec field it is about, or None)."""

    def __init__(self, key: str, msg: str):
        self.key, self.field = key, QUOTA_FIELDS.get(key)
        super().__init__(f"quota {key}: {msg}")


def quotas(root: os.PathLike) -> dict:
    """A student's limits: DEFAULT_QUOTAS with runs/lab.json's ``quotas`` over them (a null lifts one);
    a bad value is a LabError naming it."""
    q = lab_config(root).get("quotas") or {}
    where = f"{Path(root) / CONFIG}: quotas"
    if not isinstance(q, dict):
        raise LabError(f"{where}: must be an object such as {{\"queued\": 3, \"steps\": 2000}}")
    for k, v in q.items():
        if k not in QUOTA_KEYS:
            raise LabError(f"{where}: unknown limit {k!r}; allowed: {', '.join(QUOTA_KEYS)}")
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (k != "wall_s" and v != int(v)):
            raise LabError(f"{where}.{k}: must be a positive {'number' if k == 'wall_s' else 'integer'} or null "
                           f"(no limit), got {v!r}")
    return {k: v for k, v in {**DEFAULT_QUOTAS, **q}.items() if v is not None}


def is_student(owner: Optional[str]) -> bool:
    """Whether a run owned by ``owner`` is a student's: anyone but the teacher and the local user (None: the
    local user)."""
    return owner is not None and owner.lower() not in (TEACHER, local_user().name.lower(), "local")


def refuse_code(spec: dict) -> None:
    """SpecError naming the first field of ``spec`` (a spec dict, as written or fully defaulted) that names
    code by import path (engine.spec.code_fields): on a lab others share, only the teacher runs code."""
    found = code_fields(spec)
    if found:
        field, path = found[0]
        raise SpecError(field, f"{path!r} names code (an import path); only the teacher may run code on this "
                               f"lab: choose one of the lab's own")


TEXT_VOCAB = 110
"""A little over the distinct characters of the shipped text data set (pydoc's topics: 103)."""
TEXT_BYTES = 8 * 500_000
"""Its tokens (465 k characters, int64)."""
SHIPPED_BYTES = {"digits": 1797 * 64 * 4, "mnist": 70_000 * 784 * 4}
SHIPPED_EXAMPLE = {"digits": 64 * 4, "mnist": 784 * 4}


def data_mb(spec) -> float:
    """About how many MB a rank's data takes for ``spec`` (a JobSpec): a synthetic data set (float32 images
    made and normalised, or int64 token streams), a shipped one, one batch of inputs, and for token data one
    batch of logits with their gradient and softmax (batch x context length x vocabulary, float32, x3)."""
    d = spec.dataset
    b = spec.batch_size
    if d.kind == "text":
        block = d.block or 64
        vocab = d.vocab or TEXT_VOCAB
        tokens = (d.size or 2048) * 1.25 * 8 * 3 if d.name == "synthetic" else TEXT_BYTES
        return (tokens + b * block * 8 + b * block * vocab * 4 * 3) / 2**20
    if d.name == "synthetic":
        per = math.prod(d.shape or (3, 32, 32)) * 4
        return ((d.size or 2048) * 1.25 * per * 2 + b * per) / 2**20
    return (SHIPPED_BYTES.get(d.name, 0) + b * SHIPPED_EXAMPLE.get(d.name, 0)) / 2**20


def check_run(q: dict, spec, params: Optional[int] = None):
    """``spec`` (a JobSpec) within the per-run limits ``q`` (``quotas``): the spec to queue (``threads: 0``
    becomes the limit when one thread per core would pass it), or a QuotaError naming the first limit it
    passes. ``params``: the model's parameter count, when known."""
    d = spec.dataset
    for key, asked, what in (("steps", spec.steps, "steps per run"), ("world_size", spec.world_size, "ranks per run"),
                             ("batch_size", spec.batch_size, "examples per batch per rank"),
                             ("threads", spec.threads, "torch threads per rank"),
                             ("examples", (d.size or 2048) if d.name == "synthetic" else 0,
                              "training examples in a synthetic data set")):
        if key in q and asked > q[key]:
            raise QuotaError(key, f"at most {q[key]} {what}, asked for {asked}")
    if "data_mb" in q and data_mb(spec) > q["data_mb"]:
        raise QuotaError("data_mb", f"at most {q['data_mb']} MB of data per rank; this asks for about "
                                    f"{data_mb(spec):,.0f} MB (data set, batch {spec.batch_size} and, for token "
                                    f"data, its logits)")
    if params is not None and "params" in q and params > q["params"]:
        raise QuotaError("params", f"at most {q['params']:,} parameters, the model has {params:,}")
    if "threads" in q and spec.threads == 0 and max(1, (os.cpu_count() or 1) // spec.world_size) > q["threads"]:
        spec = dataclasses.replace(spec, threads=int(q["threads"]))
    return spec


def check_queued(q: dict, user: User, active: int, more: int) -> None:
    """QuotaError when ``user``, with ``active`` runs queued or running, asks for ``more``."""
    if "queued" in q and active + more > q["queued"]:
        raise QuotaError("queued", f"{user.name} may have {q['queued']} runs queued or running at once; "
                                   f"{active} are, and this asks for {more} more")


def check_quota(root: os.PathLike, user: User, specs: Iterable, active: int) -> None:
    """Raise QuotaError (a LabError, one line naming the limit) when ``user`` (a student) asking for ``specs``
    (JobSpecs), with ``active`` runs queued or running already, goes over a limit. The teacher has none."""
    if user.admin:
        return
    q = quotas(root)
    specs = list(specs)
    check_queued(q, user, active, len(specs))
    for s in specs:
        check_run(q, s)


@contextmanager
def queue_lock(root: os.PathLike, name: str):
    """Held while ``name``'s queued runs are counted and their new runs queued: two requests of theirs at the
    same moment would otherwise both count the same runs and both pass the ``queued`` limit."""
    d = Path(root) / ".locks"
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / f"queue-{hashlib.sha256(name.encode()).hexdigest()[:24]}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def preset_steps(root: os.PathLike) -> Optional[int]:
    """``preset_steps`` from runs/lab.json: the most steps a preset's run takes when started from the UI
    (a teacher scales the one-click experiments down to a slow machine or a crowded room); None when unset."""
    v = lab_config(root).get("preset_steps")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise LabError(f"{Path(root) / CONFIG}: preset_steps must be a positive integer, got {v!r}")
    return v


def scale_preset(spec: dict, steps: Optional[int]) -> dict:
    """A preset run's spec with at most ``steps`` steps (evaluation at most every ``steps``)."""
    if steps is None or spec.get("steps", steps) <= steps:
        return spec
    out = {**spec, "steps": steps}
    if out.get("eval_every"):
        out["eval_every"] = min(out["eval_every"], steps)
    return out


# --------------------------------------------------------------------------- the fair queue

def fair_order(rows: List[dict], running: Iterable[dict] = (), received: Optional[dict] = None,
               typical: Optional[float] = None, now: Optional[float] = None) -> List[str]:
    """Queued run ids in the order the queue serves them: fair by run time. The owner who has had the
    least run time goes first; each run the order hands out charges its owner ``typical`` seconds (the
    median length of the lab's finished runs; 1 when none has finished, which makes the order plain
    round-robin), so one owner's queued runs take turns with everyone else's. ``received``: owner ->
    seconds of their finished runs (``run_time``); a running run charges its owner what it has run so
    far, at least ``typical`` (a user with a run going waits behind users with none). Ties go to the
    owner whose next run is older. Counting turns instead of seconds evened out the number of runs
    each student got, not their time: on the workshop bench one student's share held a 35.6 s run
    against a 28.7 s mean share (109% off)."""
    import heapq
    now = time.time() if now is None else now
    typical = typical or 1.0
    charged = dict(received or {})
    for r in running:
        o = owner_of(r)
        ran = now - r["started"] if r.get("started") is not None else 0.0
        charged[o] = charged.get(o, 0.0) + max(ran, typical)
    mine: dict = {}
    for r in sorted(rows, key=lambda r: (r.get("created") or 0, r["id"])):
        mine.setdefault(owner_of(r), []).append(r)
    heads = [(charged.get(o, 0.0), rs[0].get("created") or 0, rs[0]["id"], o) for o, rs in mine.items()]
    heapq.heapify(heads)
    out = []
    while heads:
        t, _, rid, o = heapq.heappop(heads)
        out.append(rid)
        rest = mine[o]
        rest.pop(0)
        if rest:
            heapq.heappush(heads, (t + typical, rest[0].get("created") or 0, rest[0]["id"], o))
    return out


def run_time(rows: Iterable[dict]) -> dict:
    """owner -> seconds of run time in their finished runs (started and ended), from index rows."""
    out: dict = {}
    for r in rows:
        if r.get("started") is not None and r.get("ended") is not None:
            o = owner_of(r)
            out[o] = out.get(o, 0.0) + max(0.0, r["ended"] - r["started"])
    return out


def typical_run(rows: Iterable[dict]) -> Optional[float]:
    """The median length of the finished runs among ``rows`` (what fair_order charges a queued run);
    None when none has finished."""
    xs = sorted(r["ended"] - r["started"] for r in rows
               if r.get("started") is not None and r.get("ended") is not None)
    return xs[len(xs) // 2] if xs else None
