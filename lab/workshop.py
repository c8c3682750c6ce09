"""The lab as a workshop server: who owns a run, who sees it, and how much each may ask. Who may sign
in, and their tokens and sessions, are lab.accounts'.

Loopback use (``commlab app``, the CLI, notebooks) has one user, the person at the machine: the local
user, who sees and controls everything. A run records its owner and whether it is shared in status.json
(``owner``, ``shared``) and in the index. A student sees their own runs and the shared ones, and cancels or
shares only their own; the teacher and the local user see and cancel all. Runs made before owners existed
belong to the local user.

Per-user limits (``quotas`` in runs/lab.json, all optional) bound what a student may ask for:

    {"quotas": {"queued": 3, "steps": 2000, "world_size": 2, "wall_s": 600}}

``queued``: runs a student may have queued or running at once; ``steps`` and ``world_size``: per run;
``wall_s``: a run of theirs still going after that many seconds of running is cancelled by its
supervisor, with the limit named in its error.
"""
from __future__ import annotations

import getpass
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from lab.store import CONFIG, LabError, lab_config

QUOTA_KEYS = {"queued": "queued or running runs at once", "steps": "steps per run",
              "world_size": "ranks per run", "wall_s": "seconds of running per run"}


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


# --------------------------------------------------------------------------- quotas

def quotas(root: os.PathLike) -> dict:
    """``quotas`` from runs/lab.json (``{}`` when unset); a bad value is a LabError naming it."""
    q = lab_config(root).get("quotas") or {}
    where = f"{Path(root) / CONFIG}: quotas"
    if not isinstance(q, dict):
        raise LabError(f"{where}: must be an object such as {{\"queued\": 3, \"steps\": 2000}}")
    for k, v in q.items():
        if k not in QUOTA_KEYS:
            raise LabError(f"{where}: unknown limit {k!r}; allowed: {', '.join(QUOTA_KEYS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (k != "wall_s" and v != int(v)):
            raise LabError(f"{where}.{k}: must be a positive {'number' if k == 'wall_s' else 'integer'}, got {v!r}")
    return q


def check_quota(root: os.PathLike, user: User, specs: Iterable, active: int) -> None:
    """Raise LabError (one line naming the limit) when ``user`` (a student) asking for ``specs`` (JobSpecs),
    with ``active`` runs queued or running already, goes over a limit. The teacher has none."""
    if user.admin:
        return
    q = quotas(root)
    specs = list(specs)
    if "queued" in q and active + len(specs) > q["queued"]:
        raise LabError(f"quota queued: {user.name} may have {q['queued']} runs queued or running at once; "
                       f"{active} are, and this asks for {len(specs)} more")
    for s in specs:
        if "steps" in q and s.steps > q["steps"]:
            raise LabError(f"quota steps: at most {q['steps']} steps per run, asked for {s.steps}")
        if "world_size" in q and s.world_size > q["world_size"]:
            raise LabError(f"quota world_size: at most {q['world_size']} ranks per run, asked for {s.world_size}")


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
