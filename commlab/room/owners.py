"""The lab as a workshop server: who owns a run, who sees it, and how much each may ask. Who may sign
in, and their tokens and sessions, are commlab.room.accounts'.

Loopback use (``commlab app``, the CLI, notebooks) has one user, the person at the machine: the local
user, who sees and controls everything. A run records its owner and whether it is shared in status.json
(``owner``, ``shared``) and in the index. A student sees their own runs and the shared ones, and cancels or
shares only their own; the teacher and the local user see and cancel all. Runs made before owners existed
belong to the local user.

Per-user limits bound what a student may ask for (``quotas`` in runs/lab.json; without it the safe
defaults of ``DEFAULT_QUOTAS``), and code named by import path is the teacher's only (``refuse_code``):

    {"quotas": {"queued": 3, "steps": 2000, "world_size": 2, "wall_s": 600, "rank_mb": 1536}}

A student's run is bounded in memory too: each of its ranks runs under an OS limit of ``rank_mb`` MB of
data (RLIMIT_DATA, set by the launcher before the rank starts: commlab.lab.base.procs.limit_data), and a rank that
passes it ends the run ``failed`` with the limit named. ``rank_mb`` at the top of runs/lab.json bounds
every run's ranks, the teacher's and the local user's too (``every_rank_mb``).
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

from commlab.engine.codepath import code_fields
from commlab.engine.spec import SpecError
from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import CONFIG
from commlab.lab.rundir.store import lab_config

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
              "tensors": "parameter tensors of the model",
              "wall_s": "seconds of running per run", "rank_mb": "MB of memory (data) per rank",
              "runs": "runs a student has in the lab, of every state",
              "disk_mb": "MB a run's directory may grow to: its supervisor cancels it past them",
              "free_mb": "MB the runs directory's disk keeps free: no student's run is queued or goes on below it"}
RANK_MB = 2048
"""The ``rank_mb`` default on a machine with the memory for it (``machine_rank_mb``)."""
DEFAULT_QUOTAS = {"queued": 4, "steps": 2000, "world_size": 4, "batch_size": 256, "examples": 100_000,
                  "data_mb": 1024, "threads": 2, "params": 50_000_000, "tensors": 2000, "wall_s": 900, "rank_mb": RANK_MB,
                  "runs": 200, "disk_mb": 1024, "free_mb": 2048}
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
- ``tensors`` 2000: its parameter tensors, counted there too: a run's timeline, its live view and the performance
  model's predictions grow with them (one bucket per tensor under layer-wise; a transformer of 1,700 tiny layers
  is 20,000 tensors in under a million parameters);
- ``wall_s`` 900: a run still going after that many seconds of running is cancelled by its supervisor,
  with the limit named in its error;
- ``rank_mb`` 2048, or less on a machine without the memory for it (``machine_rank_mb``): the MB of data
  (RLIMIT_DATA: heap and private writable mappings, so every tensor; not the libraries' code) each rank
  may use. A rank of a small run takes about 300 MB (torch imported: 290 MB), so 2048 leaves a rank the
  ``data_mb`` quota's 1024 MB of data and some 700 MB of model, gradients and activations. What the
  students' runs can hold at once is ``max_jobs`` x ``world_size`` x ``rank_mb``: 1 x 4 x 2048 = 8 GiB on
  a 2-core machine (``max_jobs`` is one per two cores), 8 x 4 x 2048 = 64 GiB on a 16-core one; the
  default is therefore lowered to 3/4 of the machine's memory over ``max_jobs`` x ``world_size`` when that
  is less (not below 512 MB, under which no rank starts: lower ``max_jobs`` or ``world_size`` instead);
- ``runs`` 200: runs a student has in the lab, whatever their state (each finished run frees its place in the
  queue, so ``queued`` alone bounds nothing on disk; a run's directory grows with steps x ranks x layers:
  about 1 KB per step and rank for the mlp, some MB for a 2000-step run of a larger model);
- ``disk_mb`` 1024: the MB a run's directory may grow to while it runs (its timeline grows with steps x ranks x
  buckets: a model of 2,000 tensors under layer-wise writes about 1.6 MB per step and rank); its supervisor looks every
  2 s and cancels the run past it, with the limit named in its error;
- ``free_mb`` 2048: no student's run is queued while the disk that holds the runs directory has less free,
  whoever filled it (the teacher's runs and the machine's other files keep their room), and a running one is
  cancelled when the free space falls under it (a run queued while there was room may start after others
  took it).

A key in lab.json replaces its default (``{"quotas": {"queued": 4}}`` keeps the other defaults); ``null``
lifts that limit. A refusal is one line naming the limit: ``quota batch_size: at most 256 ...``."""
QUOTA_FIELDS = {"steps": "steps", "world_size": "world_size", "batch_size": "batch_size",
                "examples": "dataset.size", "data_mb": "dataset", "threads": "threads", "params": "model.name",
                "tensors": "model.name",
                "rank_mb": "batch_size"}
"""The spec field each per-run limit is about (the New run form shows a refusal under it)."""


class QuotaError(LabError):
    """A request over a limit: ``key`` (a QUOTA_KEYS key) and ``field`` (the spec field it is about, or None)."""

    def __init__(self, key: str, msg: str):
        self.key, self.field = key, QUOTA_FIELDS.get(key)
        super().__init__(f"quota {key}: {msg}")


def quotas(root: os.PathLike) -> dict:
    """A student's limits: DEFAULT_QUOTAS with runs/lab.json's ``quotas`` over them (a null lifts one);
    a bad value is a LabError naming it. ``rank_mb`` left to its default is what the machine can hold
    (``machine_rank_mb``)."""
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
    out = {k: v for k, v in {**DEFAULT_QUOTAS, **q}.items() if v is not None}
    if "rank_mb" not in q:
        out["rank_mb"] = machine_rank_mb(slots(root), out.get("world_size", DEFAULT_QUOTAS["world_size"]))
    return out


RANK_FLOOR_MB = 512
"""The least default ``rank_mb``: a rank of a small run takes about 300 MB (torch imported: 290 MB)."""


def memory_mb() -> int:
    """This machine's memory in MB, or its cgroup's limit when that is less (a container)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            v = Path(f).read_text().strip()
        except OSError:
            continue
        if v.isdigit():
            total = min(total, int(v))
    return total >> 20


def slots(root: os.PathLike) -> int:
    """How many runs the queue runs at once (commlab.lab.service.queue's ``max_jobs``: $COMMLAB_MAX_JOBS, runs/lab.json,
    else one per two cores); without torch, so on a GPU box (one per GPU) this is at least as many."""
    v = os.environ.get("COMMLAB_MAX_JOBS")
    if v and v.isdigit() and int(v) > 0:
        return int(v)
    v = lab_config(root).get("max_jobs")
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    return max(1, (os.cpu_count() or 1) // 2)


def machine_rank_mb(jobs: int, world_size: int, memory: Optional[int] = None) -> int:
    """The default ``rank_mb``: RANK_MB, or 3/4 of the machine's memory (``memory`` MB) over ``jobs`` runs of
    ``world_size`` ranks when that is less (in steps of 64 MB, at least RANK_FLOOR_MB)."""
    memory = memory_mb() if memory is None else memory
    fit = int(memory * 3 / 4 / max(1, jobs * world_size)) // 64 * 64
    return max(RANK_FLOOR_MB, min(RANK_MB, fit))


def every_rank_mb(root: os.PathLike) -> Optional[int]:
    """``rank_mb`` at the top of runs/lab.json: every run's limit per rank, the teacher's and the local user's
    too (None: none); a bad value is a LabError naming it."""
    v = lab_config(root).get("rank_mb")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise LabError(f"{Path(root) / CONFIG}: rank_mb must be a positive integer or null (no limit), got {v!r}")
    return v


def rank_limit(root: os.PathLike, owner: Optional[str]) -> Optional[tuple]:
    """(MB, where it is set) of the memory limit on each rank of a run owned by ``owner``: a student's
    ``rank_mb`` quota, and runs/lab.json's ``rank_mb`` for everyone, whichever is less; None: no limit."""
    limits = []
    if is_student(owner) and "rank_mb" in quotas(root):
        limits.append((int(quotas(root)["rank_mb"]), "runs/lab.json quotas.rank_mb"))
    everyone = every_rank_mb(root)
    if everyone is not None:
        limits.append((everyone, "runs/lab.json rank_mb"))
    return min(limits) if limits else None


def disk_limits(root: os.PathLike, owner: Optional[str]) -> dict:
    """The disk limits a run of ``owner`` runs under (Run.mark_queued's ``disk_limit_mb`` and ``free_limit_mb``,
    which the launcher applies): a student's ``disk_mb`` and ``free_mb`` quotas; none for anyone else."""
    if not is_student(owner):
        return {}
    q = quotas(root)
    return {"disk_limit_mb": q.get("disk_mb"), "free_limit_mb": q.get("free_mb")}


def is_student(owner: Optional[str]) -> bool:
    """Whether a run owned by ``owner`` is a student's: anyone but the teacher and the local user (None: the
    local user)."""
    return owner is not None and owner.lower() not in (TEACHER, local_user().name.lower(), "local")


def refuse_code(spec: dict) -> None:
    """SpecError naming the first field of ``spec`` (a spec dict, as written or fully defaulted) that names
    code by import path (commlab.engine.codepath.code_fields): on a lab others share, only the teacher runs code."""
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


RANK_BASE_MB = 256
"""Less than what any rank takes before its data and model (torch imported: 290 MB measured)."""
KEPT_CHANNELS = {"cnn": 32 + 64}
"""Channels at full resolution that a zoo model keeps for its backward pass, at the least: the cnn's two
ReLUs' outputs (32 and 64 channels; its second conv and max pool read them back); resnet's stem keeps its
conv's and its ReLU's (2 x width, ``widths``)."""


def activations_mb(spec) -> float:
    """At least how many MB the activations of one batch take in a zoo image model (cnn, resnet): the
    full-resolution feature maps its backward pass keeps, float32; 0 for other models and data. A lower
    bound, not an estimate: what the ranks really take is more (the conv outputs, the gradients)."""
    d = spec.dataset
    name = spec.model.name
    if d.kind == "text" or d.name != "synthetic" or not d.shape or len(d.shape) != 3:
        return 0.0
    if name == "resnet":
        width = (spec.model.options or {}).get("width", 32)
        channels = 2 * width if isinstance(width, int) and not isinstance(width, bool) else 0
    else:
        channels = KEPT_CHANNELS.get(name, 0)
    return channels * d.shape[1] * d.shape[2] * spec.batch_size * 4 / 2**20


def check_run(q: dict, spec, params: Optional[int] = None, tensors: Optional[int] = None):
    """``spec`` (a JobSpec) within the per-run limits ``q`` (``quotas``): the spec to queue (``threads: 0``
    becomes the limit when one thread per core would pass it), or a QuotaError naming the first limit it
    passes. ``params`` and ``tensors``: the model's parameter and tensor counts, when known."""
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
    need = RANK_BASE_MB + data_mb(spec) + activations_mb(spec)
    if "rank_mb" in q and activations_mb(spec) and need > q["rank_mb"]:
        shape = "x".join(str(n) for n in spec.dataset.shape)
        raise QuotaError("rank_mb", f"at most {q['rank_mb']} MB per rank; a batch of {spec.batch_size} images "
                                    f"{shape} through {spec.model.name} needs at least {need:,.0f} MB (its "
                                    f"activations alone {activations_mb(spec):,.0f} MB): make the batch or the "
                                    f"images smaller")
    if params is not None and "params" in q and params > q["params"]:
        raise QuotaError("params", f"at most {q['params']:,} parameters, the model has {params:,}")
    if tensors is not None and "tensors" in q and tensors > q["tensors"]:
        raise QuotaError("tensors", f"at most {q['tensors']:,} parameter tensors, the model has {tensors:,}")
    if "threads" in q and spec.threads == 0 and max(1, (os.cpu_count() or 1) // spec.world_size) > q["threads"]:
        spec = dataclasses.replace(spec, threads=int(q["threads"]))
    return spec


def check_kept(q: dict, user: User, kept: int, more: int, free_mb: float) -> None:
    """QuotaError when ``user``, with ``kept`` runs in the lab, asks for ``more``, or when the runs' disk has
    ``free_mb`` left, under the ``free_mb`` floor."""
    if "runs" in q and kept + more > q["runs"]:
        raise QuotaError("runs", f"{user.name} may have {q['runs']} runs in this lab, of every state; {kept} are "
                                 f"there, and this asks for {more} more (the teacher removes old runs, or raises "
                                 f"quotas.runs)")
    if "free_mb" in q and free_mb < q["free_mb"]:
        raise QuotaError("free_mb", f"the disk of the runs directory has {free_mb:.0f} MB free, under the "
                                    f"{q['free_mb']} MB kept free; ask the teacher")


def check_queued(q: dict, user: User, active: int, more: int) -> None:
    """QuotaError when ``user``, with ``active`` runs queued or running, asks for ``more``."""
    if "queued" in q and active + more > q["queued"]:
        raise QuotaError("queued", f"{user.name} may have {q['queued']} runs queued or running at once; "
                                   f"{active} are, and this asks for {more} more")


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
    """A preset run's spec with at most ``steps`` steps (evaluation at most every ``steps``); a fault's step (a
    plug-pulling preset's) moves with them, to the same fraction of the run."""
    if steps is None or spec.get("steps", steps) <= steps:
        return spec
    was = spec["steps"]
    out = {**spec, "steps": steps}
    if out.get("eval_every"):
        out["eval_every"] = min(out["eval_every"], steps)

    def moved(f: dict) -> dict:
        return {**f, "step": min(f["step"] * steps // was, steps - 1)} if "step" in f else f
    if isinstance(out.get("fault"), dict):
        out["fault"] = moved(out["fault"])
    ft = out.get("fault_tolerance")
    if isinstance(ft, dict) and ft.get("faults"):
        out["fault_tolerance"] = {**ft, "faults": [moved(f) if isinstance(f, dict) else f for f in ft["faults"]]}
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
