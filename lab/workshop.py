"""The lab as a workshop server: who may use it, who owns a run, who sees it, and how much each may ask.

Loopback use (``commlab app``, the CLI, notebooks) has one user, the person at the machine: the local
user, who sees and controls everything. When the app is bound anywhere else, every request needs a token
(``access_mode``). The tokens live in ``runs/access.json`` (mode 0600, made on first use):

    {"class_token": "...",   the teacher hands it out (the link `commlab app --host 0.0.0.0` prints);
                             with it a student picks a name and gets a personal token
     "admin_token": "...",   the teacher's own: sees and cancels every run, starts sweeps
     "users": {"<sha256 of a personal token>": {"name": "alice", "created": 1700000000.0}}}

The teacher may write either token into the file (or pass ``--token`` to ``commlab app``) instead of
using the generated ones. Personal tokens are stored only as hashes; the class and admin tokens in the
clear (the teacher reads them there).

A run records its owner and whether it is shared in status.json (``owner``, ``shared``) and in the
index. A student sees their own runs and the shared ones, and cancels or shares only their own; the
teacher and the local user see and cancel all. Runs made before owners existed belong to the local
user.

Per-user limits (``quotas`` in runs/lab.json, all optional) bound what a student may ask for:

    {"quotas": {"queued": 3, "steps": 2000, "world_size": 2, "wall_s": 600}}

``queued``: runs a student may have queued or running at once; ``steps`` and ``world_size``: per run;
``wall_s``: a run of theirs still going after that many seconds of running is cancelled by its
supervisor, with the limit named in its error.
"""
from __future__ import annotations

import fcntl
import getpass
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from engine.runlog import write_json_atomic
from lab.store import CONFIG, LabError, lab_config

ACCESS_FILE = "access.json"
ACCESS_ENV = "COMMLAB_ACCESS"
"""``token`` or ``off``: set by ``commlab app`` for its server (off on loopback, token elsewhere)."""
TEACHER = "teacher"
"""The owner name of runs the teacher starts from the UI with the admin token."""
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,31}$")
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


def is_loopback(host: Optional[str]) -> bool:
    """Whether binding ``host`` keeps the server on this machine. None or "" (every interface) is not."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def access_mode(address: Optional[str], env: Optional[str] = None) -> str:
    """``token`` (sign-in required) or ``off``. An explicit address that is not loopback always needs a
    token; an unset address (Streamlit then binds every interface) needs one unless ``commlab app``
    (or a test) said ``off`` in $COMMLAB_ACCESS."""
    env = os.environ.get(ACCESS_ENV) if env is None else env
    if address and not is_loopback(address):
        return "token"
    if address and is_loopback(address):
        return "off"
    if env not in (None, "", "token", "off"):
        raise LabError(f"{ACCESS_ENV}: must be 'token' or 'off', got {env!r}")
    return env or "token"


# --------------------------------------------------------------------------- tokens

def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def access_path(root: os.PathLike) -> Path:
    return Path(root) / ACCESS_FILE


@contextmanager
def _access_lock(root: os.PathLike):
    """Held around every read-modify-write of runs/access.json. Without it two students signing in at
    the same moment each read the file, add themselves and write it back, and the later write drops the
    earlier student's token: their next request gets the sign-in prompt."""
    Path(root).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(root) / ".access.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def load_access(root: os.PathLike, create: bool = True) -> dict:
    """runs/access.json, made with fresh tokens (mode 0600) when missing and ``create``."""
    if create and not access_path(root).exists():
        with _access_lock(root):
            return _load(root, create=True)
    return _load(root, create)


def _load(root: os.PathLike, create: bool) -> dict:
    """load_access without the lock: for callers that hold it (or only read)."""
    path = access_path(root)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if not create:
            return {}
        data = {"class_token": secrets.token_urlsafe(16), "admin_token": secrets.token_urlsafe(24), "users": {}}
        _save_access(root, data)
        return data
    except ValueError as e:
        raise LabError(f"{path}: not valid JSON: {e}") from None
    for k in ("class_token", "admin_token"):
        v = data.get(k)
        if not isinstance(v, str) or len(v) < 8:
            raise LabError(f"{path}: {k} must be a string of at least 8 characters")
    if data["class_token"] == data["admin_token"]:
        raise LabError(f"{path}: class_token and admin_token must differ")
    if not isinstance(data.setdefault("users", {}), dict):
        raise LabError(f"{path}: users must be an object")
    return data


def _save_access(root: os.PathLike, data: dict) -> None:
    path = access_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data, mode=0o600)


def set_class_token(root: os.PathLike, token: str) -> dict:
    """The teacher's own class token (``commlab app --token``)."""
    if not isinstance(token, str) or len(token) < 8 or not re.fullmatch(r"[A-Za-z0-9_.~-]+", token):
        raise LabError("--token: must be at least 8 characters of letters, digits, '-', '_', '.', '~' "
                       "(it goes into a link)")
    with _access_lock(root):
        return _set_class_token(root, token)


def _set_class_token(root: os.PathLike, token: str) -> dict:
    data = _load(root, create=True)
    if token == data["admin_token"]:
        raise LabError("--token: must differ from the admin token")
    data["class_token"] = token
    _save_access(root, data)
    return data


def _same(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a) and bool(b) and hmac.compare_digest(str(a).encode(), str(b).encode())


def check_token(root: os.PathLike, token: Optional[str]) -> Optional[User]:
    """The user a personal or admin token belongs to; None for the class token, a wrong one or none."""
    if not token or not isinstance(token, str) or len(token) > 200:
        return None
    data = load_access(root)
    if _same(token, data["admin_token"]):
        return User(TEACHER, admin=True)
    entry = data["users"].get(_hash(token))
    return User(entry["name"]) if entry else None


def is_class_token(root: os.PathLike, token: Optional[str]) -> bool:
    return _same(token, load_access(root)["class_token"])


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise LabError(f"name: {name!r} is not allowed: a letter, then up to 31 letters, digits, '.', '_' or '-'")
    if name.lower() in (TEACHER, local_user().name.lower(), "local"):
        raise LabError(f"name: {name!r} is reserved; pick another")
    return name


def sign_in(root: os.PathLike, class_token: str, name: str) -> str:
    """A new personal token for student ``name``, given the class token. A name already taken is refused
    (its owner signs in again with their own link)."""
    with _access_lock(root):
        return _sign_in(root, class_token, name)


def _sign_in(root: os.PathLike, class_token: str, name: str) -> str:
    data = _load(root, create=True)
    if not _same(class_token, data["class_token"]):
        raise LabError("token: not the class token")
    check_name(name)
    if name.lower() in {n.lower() for n in data.get("revoked", {})}:
        raise LabError(f"name: {name!r} was revoked by the teacher; ask them")
    if any(u.get("name", "").lower() == name.lower() for u in data["users"].values()):
        raise LabError(f"name: {name!r} is taken; if it is yours, open the personal link you got at sign-in")
    token = secrets.token_urlsafe(18)
    data["users"][_hash(token)] = {"name": name, "created": time.time()}
    _save_access(root, data)
    return token


def users(root: os.PathLike) -> List[str]:
    return sorted(u["name"] for u in load_access(root, create=False).get("users", {}).values())


def revoke(root: os.PathLike, name: str) -> int:
    """Invalidate student ``name``'s personal token: their open pages get the sign-in prompt at their next
    request, a download they start is refused, and the name cannot be taken again (it stays the owner of
    their runs, which keep going; ``commlab cancel`` stops them). The number of tokens removed; LabError
    when no student has that name."""
    with _access_lock(root):
        return _revoke(root, name)


def _revoke(root: os.PathLike, name: str) -> int:
    data = _load(root, create=False)
    if not data:
        raise LabError(f"name: no students in {access_path(root)}")
    gone = [h for h, u in data["users"].items() if u.get("name", "").lower() == str(name).lower()]
    if not gone:
        known = ", ".join(sorted(u.get("name", "?") for u in data["users"].values())) or "none"
        raise LabError(f"name: no student {name!r}; signed in: {known}")
    for h in gone:
        data["users"].pop(h)
    data.setdefault("revoked", {})[str(name)] = time.time()
    _save_access(root, data)
    return len(gone)


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
