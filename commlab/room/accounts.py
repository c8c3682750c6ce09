"""Who may use an exposed lab, and for how long: the tokens, the people they belong to, and the browser
sessions a token is exchanged for.

Loopback use (``commlab app``, the CLI, notebooks) has one user, the person at the machine. When the app is
bound anywhere else (``access_mode`` is ``token``), every request needs a session, and a session needs a
token once. The tokens live in ``runs/access.json`` (mode 0600, made on first use):

    {"class_token": "...",    the teacher hands it out (the link `commlab app --host 0.0.0.0` prints at every
                              start); with it a student picks a name and gets a personal token. Kept in the
                              clear on purpose: it is shown to the whole room, admits nobody by itself (it only
                              lets a browser pick a name, at most ``max_signins`` of them) and the teacher
                              replaces it with ``commlab workshop rotate class``
     "admin_hash": "<sha256 of the admin token>",  the teacher's own token: sees and cancels every run, starts
                              sweeps; shown once, when it is made (``rotate admin`` makes a new one)
     "class_signins": 3,      names taken with the current class token (capped: settings' max_signins)
     "users": {"<sha256 of a personal token>": {"id": "...", "name": "alice", "created": t, "expires": t,
                                                "browsers": ["<sha256 of a browser id>"]}},
     "sessions": {"<sha256 of a session id>": {"id": "<person id, or 'teacher'>", "expires": t}},
     "revoked": {"alice": t}, "revoked_browsers": {"<sha256>": t}}

Tokens are exchanged for a session (``open_session``) by the server's sign-in routes (commlab/app/room/gatekeeper.py),
which hand the browser the session id in an HttpOnly cookie and take the token out of the address. The
address bar and the history never keep a token; signing out closes the session; a revoked person's
sessions end at their next request. Personal tokens, admin tokens and sessions carry only hashes here.

Time limits and caps come from ``access`` in runs/lab.json (``settings``; defaults in ``SETTINGS``)."""
from __future__ import annotations

import fcntl
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from commlab.engine.runlog import write_json_atomic
from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import ACCESS, ACCESS_LOCK, CONFIG, INDEX, make_private
from commlab.lab.rundir.index import Index
from commlab.lab.rundir.store import RunStore, lab_config
from commlab.room.owners import TEACHER, User, local_user

SESSION_COOKIE = "commlab_session"
"""The cookie that carries a browser's session id (set at sign-in by commlab/app/room/gatekeeper.py; read by commlab/app/room/access.py and,
for the page an upload is sent to, commlab/app/room/uploads.py)."""
ACCESS_ENV = "COMMLAB_ACCESS"
"""``token`` or ``off``: set by ``commlab app`` for its server (off on loopback, token elsewhere)."""
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,31}$")
RESERVED = (TEACHER, "local", "root", "admin", "class")
"""Names no student may take, besides the local user's and every name that owns runs already (``class`` and
``admin`` name the shared tokens ``commlab workshop rotate`` renews)."""

SETTINGS = {
    "personal_days": 14.0,
    "admin_days": None,
    "session_hours": 12.0,
    "max_signins": 100,
    "sessions_per_person": 5,
    "names_per_address": 10,
    "signins_per_minute": 60,
}
"""Defaults of ``access`` in runs/lab.json:

- ``personal_days``: a personal token expires this many days after it was made (``rotate`` makes a new one);
- ``admin_days``: the admin token expires this many days after it was made (None: when rotated);
- ``session_hours``: a browser session ends this many hours after sign-in, or when its token expires;
- ``max_signins``: names one class token may create (``rotate class`` starts a new count);
- ``sessions_per_person``: open sessions kept per person (their browsers); the oldest close first;
- ``names_per_address``: new names per hour from one client address (a browser takes at most 3 an hour, but a
  person can clear their cookies; behind a NAT or a proxy a whole room shares one address: raise it there);
- ``signins_per_minute``: tokens exchanged per minute from one client address (a session from a link or the
  form, or the class token's name page; each rewrites access.json), the teacher's not counted (raise it too
  where a room behind one address signs in at once)."""
MIN_CLASS_TOKEN = 16
"""The shortest class token a teacher may choose. The wrong-token limit (commlab/app/room/gatekeeper.py) refuses further wrong
guesses from an address, but a right token always signs in (so a room behind one address is never locked out):
what keeps a guesser out is the token's length. A generated one has 128 bits."""
REVOKED_BROWSERS_KEPT = 1000
"""Revoked browsers remembered (the newest); a bound on access.json's size."""


# --------------------------------------------------------------------------- where the lab is served

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


def settings(root: os.PathLike) -> dict:
    """``access`` from runs/lab.json over SETTINGS; a bad value is a LabError naming it."""
    got = lab_config(root).get("access") or {}
    where = f"{Path(root) / CONFIG}: access"
    if not isinstance(got, dict):
        raise LabError(f"{where}: must be an object such as {{\"personal_days\": 7}}")
    out = dict(SETTINGS)
    for k, v in got.items():
        if k not in SETTINGS:
            raise LabError(f"{where}: unknown setting {k!r}; allowed: {', '.join(SETTINGS)}")
        whole = k in ("max_signins", "sessions_per_person", "names_per_address", "signins_per_minute")
        if v is None and k == "admin_days":
            out[k] = None
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (whole and v != int(v)):
            raise LabError(f"{where}.{k}: must be a positive {'integer' if whole else 'number'}"
                           f"{' or null' if k == 'admin_days' else ''}, got {v!r}")
        out[k] = int(v) if whole else float(v)
    return out


# --------------------------------------------------------------------------- the file

def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def access_path(root: os.PathLike) -> Path:
    return Path(root) / ACCESS


@contextmanager
def _locked(root: os.PathLike):
    """Held around every read-modify-write of runs/access.json. Without it two students signing in at
    the same moment each read the file, add themselves and write it back, and the later write drops the
    earlier student's token."""
    make_private(root)
    fd = os.open(Path(root) / ACCESS_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


_read_cache: Dict[str, Tuple[tuple, dict]] = {}
_CLEAR = "_admin_token_in_the_clear"
"""Set (in memory only) on a file read with the admin token itself in it, until it is written with its hash."""


def load_access(root: os.PathLike, create: bool = True) -> dict:
    """runs/access.json (a copy; parsed again only when the file changed), made with fresh tokens (mode
    0600) when missing and ``create``; ``{}`` when missing and not ``create``. The answer of the call that made
    the file also holds the admin token itself (``admin_token``): the file keeps only its hash."""
    if create and not access_path(root).exists():
        with _locked(root):
            return _load(root, create=True)
    data = _load(root, create)
    if data.pop(_CLEAR, False) and create:  # the file still has the admin token in the clear: write its hash
        with _locked(root):
            data = _load(root, create=True)
            if data.pop(_CLEAR, False):
                _save(root, data)
    return data


class DamagedAccess(LabError):
    """runs/access.json cannot be read or has an entry of the wrong shape: the teacher's to mend (it holds every
    token, so it is left where it is), not an answer about what someone typed."""


def _load(root: os.PathLike, create: bool) -> dict:
    """load_access without the lock: for callers that hold it (or only read)."""
    path = access_path(root)
    try:
        st = path.stat()
    except FileNotFoundError:
        if not create:
            return {}
        now = time.time()
        admin = secrets.token_urlsafe(24)
        data = {"class_token": secrets.token_urlsafe(16), "admin_hash": _hash(admin),
                "admin_created": now, "class_signins": 0, "users": {}, "sessions": {}}
        _save(root, data)
        return {**data, "admin_token": admin}  # the one answer that holds it: the file keeps its hash
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    hit = _read_cache.get(str(path))
    if hit is not None and hit[0] == key:
        return json.loads(json.dumps(hit[1]))  # callers change their copy
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise DamagedAccess(f"{path}: not valid JSON: {e}") from None
    _check(path, data)
    if "admin_token" in data:  # written by an older lab: kept as its hash from now on (load_access rewrites it)
        data["admin_hash"] = _hash(data.pop("admin_token"))
        data[_CLEAR] = True
    if len(_read_cache) > 64:
        _read_cache.clear()
    _read_cache[str(path)] = (key, data)
    return json.loads(json.dumps(data))


def _check(path: Path, data) -> None:
    if not isinstance(data, dict):
        raise DamagedAccess(f"{path}: must be a JSON object")
    v = data.get("class_token")
    if not isinstance(v, str) or len(v) < 8:
        raise DamagedAccess(f"{path}: class_token must be a string of at least 8 characters")
    if "admin_token" in data:  # an older lab's file: the token itself (load_access keeps its hash)
        v = data["admin_token"]
        if not isinstance(v, str) or len(v) < 8:
            raise DamagedAccess(f"{path}: admin_token must be a string of at least 8 characters")
        admin = _hash(v)
    else:
        admin = data.get("admin_hash")
        if not isinstance(admin, str) or not re.fullmatch(r"[0-9a-f]{64}", admin):
            raise DamagedAccess(f"{path}: admin_hash must be the SHA-256 of the admin token (64 hex digits); "
                                f"`commlab workshop rotate admin` writes a new one")
    if _hash(data["class_token"]) == admin:
        raise DamagedAccess(f"{path}: class_token and the admin token must differ")
    for k in ("users", "sessions", "revoked", "revoked_browsers"):
        if not isinstance(data.setdefault(k, {}), dict):
            raise DamagedAccess(f"{path}: {k} must be an object")
    for h, u in data["users"].items():  # files from before sessions: an id and a lifetime from now on
        if not isinstance(u, dict) or not isinstance(u.get("name"), str):
            raise DamagedAccess(f"{path}: users.{h[:8]}...: must be an object with a name")
        u.setdefault("id", h[:16])
        u.setdefault("browsers", [])
        if not isinstance(u["browsers"], list) or not isinstance(u.get("expires", 0), (int, float, type(None))):
            raise DamagedAccess(f"{path}: users.{h[:8]}...: browsers must be a list and expires a time")
    for h, sess in data["sessions"].items():
        if not isinstance(sess, dict) or not isinstance(sess.get("id"), str) \
                or not isinstance(sess.get("expires"), (int, float)):
            raise DamagedAccess(f"{path}: sessions.{h[:8]}...: must be an object with an id and an expiry time")
    data.setdefault("class_signins", len(data["users"]))
    data.setdefault("admin_created", path.stat().st_mtime)


def _save(root: os.PathLike, data: dict) -> None:
    now = time.time()
    data = {k: v for k, v in data.items() if k not in ("admin_token", _CLEAR)}  # never on disk: its hash is
    data["sessions"] = {h: s for h, s in data.get("sessions", {}).items() if s.get("expires", 0) > now}
    rb = data.get("revoked_browsers", {})
    if len(rb) > REVOKED_BROWSERS_KEPT:
        data["revoked_browsers"] = dict(sorted(rb.items(), key=lambda kv: kv[1])[-REVOKED_BROWSERS_KEPT:])
    path = access_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data, mode=0o600)


def _same(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a) and bool(b) and hmac.compare_digest(str(a).encode(), str(b).encode())


def _plausible(secret) -> bool:
    return isinstance(secret, str) and 0 < len(secret) <= 200


def _expired(t: Optional[float], now: float) -> bool:
    return t is not None and t <= now


# --------------------------------------------------------------------------- tokens

def _admin_expires(root, data: dict) -> Optional[float]:
    days = settings(root)["admin_days"]
    return None if days is None else data.get("admin_created", 0) + days * 86400


def _person(root, data: dict, token: str, now: float) -> Optional[Tuple[str, User]]:
    """(person id, User) of a valid personal or admin token."""
    if _same(_hash(token), data["admin_hash"]):
        return (TEACHER, User(TEACHER, admin=True)) if not _expired(_admin_expires(root, data), now) else None
    u = data["users"].get(_hash(token))
    if u is None or _expired(_expires(root, u), now):
        return None
    return u["id"], User(u["name"])


def _expires(root, u: dict) -> float:
    return u.get("expires") or u.get("created", 0) + settings(root)["personal_days"] * 86400


def check_token(root: os.PathLike, token: Optional[str]) -> Optional[User]:
    """The user a valid (not expired, not revoked) personal or admin token belongs to; None otherwise,
    the class token included."""
    if not _plausible(token):
        return None
    got = _person(root, load_access(root), token, time.time())
    return got[1] if got else None


def is_class_token(root: os.PathLike, token: Optional[str]) -> bool:
    return _plausible(token) and _same(token, load_access(root)["class_token"])


def reserved_names(root: os.PathLike) -> set:
    """Lower-cased names no student may take: RESERVED, the local user's, and every owner of a run in the
    index (the CLI's runs belong to the user who started them, who may not be the server's user)."""
    names = {*RESERVED, local_user().name}
    if (Path(root) / INDEX).exists():
        names |= Index(RunStore(root)).owners()
    return {n.lower() for n in names}


def check_name(name: str, reserved: Optional[set] = None) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise LabError(f"name: {name!r} is not allowed: a letter, then up to 31 letters, digits, '.', '_' or '-'")
    if name.lower() in (reserved if reserved is not None else {n.lower() for n in (*RESERVED, local_user().name)}):
        raise LabError(f"name: {name!r} is reserved; pick another")
    return name


def sign_in(root: os.PathLike, class_token: str, name: str, browser: Optional[str] = None) -> str:
    """A new personal token for student ``name``, given the class token (from ``browser``, the id the
    sign-in page's cookie gives each browser). Refused: a name taken (its owner signs in with their own
    link), reserved or revoked; a revoked browser; more than ``max_signins`` names with this class token."""
    check_name(name, set())  # its form first: the owners of runs are read only for a name that could be one
    reserved = reserved_names(root)
    with _locked(root):
        data = _load(root, create=True)
        if not _plausible(class_token) or not _same(class_token, data["class_token"]):
            raise LabError("token: not the class token")
        if name.lower() in {n.lower() for n in data["revoked"]}:
            raise LabError(f"name: {name!r} was revoked by the teacher; ask them")
        if any(u["name"].lower() == name.lower() for u in data["users"].values()):
            raise LabError(f"name: {name!r} is taken; if it is yours, open the personal link you got at sign-in")
        check_name(name, reserved)
        if browser and _hash(browser) in data["revoked_browsers"]:
            raise LabError("sign-in: refused for this browser: its person was revoked by the teacher; ask them")
        cap = settings(root)["max_signins"]
        if data["class_signins"] >= cap:
            raise LabError(f"sign-in: this class token has made {cap} names already (access.max_signins); "
                           f"ask the teacher")
        token = secrets.token_urlsafe(18)
        now = time.time()
        data["users"][_hash(token)] = {"id": secrets.token_hex(8), "name": name, "created": now,
                                       "expires": now + settings(root)["personal_days"] * 86400,
                                       "browsers": [_hash(browser)] if browser else []}
        data["class_signins"] += 1
        _save(root, data)
        return token


# --------------------------------------------------------------------------- sessions

def open_session(root: os.PathLike, token: Optional[str], browser: Optional[str] = None) -> Optional[Tuple[str, User]]:
    """Exchange a valid personal or admin token for a new session: (session id, user); None for any other
    token. The session ends after ``session_hours``, when the token expires, is rotated or revoked, or at
    sign-out; a person keeps at most ``sessions_per_person`` (the oldest close)."""
    if not _plausible(token):
        return None
    cfg = settings(root)
    with _locked(root):
        data = _load(root, create=True)
        now = time.time()
        got = _person(root, data, token, now)
        if got is None:
            return None
        pid, user = got
        ends = now + cfg["session_hours"] * 3600
        limit = _admin_expires(root, data) if user.admin else _expires(root, data["users"][_hash(token)])
        if limit is not None:
            ends = min(ends, limit)
        if browser and not user.admin:
            u = data["users"][_hash(token)]
            u["browsers"] = [b for b in u.get("browsers", []) if b != _hash(browser)][-3:] + [_hash(browser)]
        mine = sorted((s["expires"], h) for h, s in data["sessions"].items() if s["id"] == pid)
        for _, h in mine[:max(0, len(mine) - cfg["sessions_per_person"] + 1)]:
            data["sessions"].pop(h)
        sid = secrets.token_urlsafe(32)
        data["sessions"][_hash(sid)] = {"id": pid, "expires": ends}
        _save(root, data)
        return sid, user


def session_user(root: os.PathLike, sid: Optional[str]) -> Optional[User]:
    """The user of an open session; None when there is none, it ended, or its person was revoked. Reads
    runs/access.json again only when it changed."""
    if not _plausible(sid):
        return None
    data = load_access(root, create=False)
    if not data:
        return None
    s = data["sessions"].get(_hash(sid))
    now = time.time()
    if s is None or s["expires"] <= now:
        return None
    if s["id"] == TEACHER:
        return None if _expired(_admin_expires(root, data), now) else User(TEACHER, admin=True)
    for u in data["users"].values():
        if u["id"] == s["id"]:
            return None if _expired(_expires(root, u), now) else User(u["name"])
    return None


def close_session(root: os.PathLike, sid: Optional[str]) -> bool:
    """End a session (sign-out); whether there was one."""
    if not _plausible(sid):
        return False
    with _locked(root):
        data = _load(root, create=False)
        if not data or data["sessions"].pop(_hash(sid), None) is None:
            return False
        _save(root, data)
        return True


# --------------------------------------------------------------------------- the teacher's controls

def users(root: os.PathLike) -> List[str]:
    return sorted(u["name"] for u in load_access(root, create=False).get("users", {}).values())


def people(root: os.PathLike) -> List[dict]:
    """Each student: name, created, expires, open sessions (for ``commlab workshop users``)."""
    data = load_access(root, create=False)
    if not data:
        return []
    now = time.time()
    out = []
    for u in data["users"].values():
        n = sum(1 for s in data["sessions"].values() if s["id"] == u["id"] and s["expires"] > now)
        out.append({"name": u["name"], "created": u.get("created"), "expires": _expires(root, u), "sessions": n})
    return sorted(out, key=lambda p: p["name"])


def _student(data: dict, name: str, path: Path) -> List[str]:
    gone = [h for h, u in data["users"].items() if u["name"].lower() == str(name).lower()]
    if not gone:
        known = ", ".join(sorted(u["name"] for u in data["users"].values())) or "none"
        raise LabError(f"name: no student {name!r}; signed in: {known}")
    return gone


def revoke(root: os.PathLike, name: str) -> int:
    """Revoke the person who signed in as ``name``: their personal token and every session end (open pages
    get the sign-in page at their next request; a download they start is refused), the name cannot be
    taken again, and the browsers they signed in from cannot take another name with the class token
    (``rotate class`` as well, for someone who clears their browser). Their runs keep going under the
    name (``commlab cancel`` stops them). The number of tokens removed; LabError when no student has it."""
    with _locked(root):
        data = _load(root, create=False)
        if not data:
            raise LabError(f"name: no students in {access_path(root)}")
        gone = _student(data, name, access_path(root))
        now = time.time()
        for h in gone:
            u = data["users"].pop(h)
            data["sessions"] = {k: s for k, s in data["sessions"].items() if s["id"] != u["id"]}
            for b in u.get("browsers", []):
                data["revoked_browsers"][b] = now
        data["revoked"][str(name)] = now
        _save(root, data)
        return len(gone)


def rotate(root: os.PathLike, who: str) -> str:
    """A new token for ``who``: ``class`` (students who signed in keep their tokens; the name count starts
    again), ``admin`` (the teacher's sessions end), or a student's name (their sessions end; a fresh
    lifetime). Returns the new token."""
    with _locked(root):
        data = _load(root, create=True)
        new = secrets.token_urlsafe(24 if who == "admin" else 18)
        now = time.time()
        if who == "class":
            data["class_token"], data["class_signins"] = new, 0
        elif who == "admin":
            data["admin_hash"], data["admin_created"] = _hash(new), now
            data["sessions"] = {k: s for k, s in data["sessions"].items() if s["id"] != TEACHER}
        else:
            [h] = _student(data, who, access_path(root))[:1]
            u = data["users"].pop(h)
            u.update(created=now, expires=now + settings(root)["personal_days"] * 86400)
            data["users"][_hash(new)] = u
            data["sessions"] = {k: s for k, s in data["sessions"].items() if s["id"] != u["id"]}
        _save(root, data)
        return new


def set_class_token(root: os.PathLike, token: str) -> dict:
    """The teacher's own class token (``commlab app --token``): at least MIN_CLASS_TOKEN characters."""
    if not isinstance(token, str) or len(token) < MIN_CLASS_TOKEN or not re.fullmatch(r"[A-Za-z0-9_.~-]+", token):
        raise LabError(f"--token: must be at least {MIN_CLASS_TOKEN} characters of letters, digits, '-', '_', '.', "
                       f"'~' (it goes into a link, and must be hard to guess)")
    with _locked(root):
        data = _load(root, create=True)
        if _same(_hash(token), data["admin_hash"]):
            raise LabError("--token: must differ from the admin token")
        if token != data["class_token"]:
            data["class_token"], data["class_signins"] = token, 0
            _save(root, data)
        return data
