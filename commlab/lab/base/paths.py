"""Where the lab's own files are: the source tree it runs from (``SOURCE``: the workers' PYTHONPATH, the app's
entry, the shipped examples and notebooks) and the runs directory every command defaults to."""
from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

from commlab.lab.base.errors import LabError

SOURCE = Path(__file__).resolve().parents[3]
"""The folder that holds the commlab package (a checkout, or site-packages for a wheel): the workers' PYTHONPATH."""


def default_root() -> Path:
    """The runs directory: $COMMLAB_RUNS, else ./runs."""
    return Path(os.environ.get("COMMLAB_RUNS") or "runs")


NAME_BYTES = 150
"""The longest name ``safe_name`` gives, in bytes of UTF-8: a file system takes 255, and writers add a suffix
(``.json``) and a temporary name's prefix and suffix (commlab.engine.runlog.write_json_atomic: about 40 more)."""
_CHANGED = re.compile(r"~[0-9a-f]{16}\Z")
"""How a name ``safe_name`` changed ends: ``~`` and 16 hex digits of the text's SHA-256."""


def not_a_file(path: str, what: str = "a file") -> str:
    """Why ``path`` cannot be read as an input file (``give WHAT``), or "" when it can: a folder, something that
    is not a regular file (a device or a pipe, which read could hang on or never finish: /dev/zero), or nothing."""
    p = Path(path)
    if p.is_dir():
        return f"{path} is a directory; give {what}"
    if p.exists() and not p.is_file():
        return f"{path} is not a regular file (a device, a pipe or a socket); give {what}"
    return "" if p.is_file() else f"no such file: {path}"


def safe_name(text: str) -> str:
    """``text`` (a model's key with its options, a run's or a sweep's name: anything a user typed) as one file
    name: no path separator (``/``, ``\\``), NUL or other unprintable character (each becomes ``_``), no leading
    dot (so never ``.`` or ``..`` nor a hidden file), never empty, at most NAME_BYTES bytes of UTF-8. A text that
    is such a name already is returned as it is (the names the lab wrote before stay theirs); one that had to
    change ends with ``~`` and 16 hex digits of its SHA-256, so two texts never share a name (a text that
    ends like that is changed too)."""
    text = str(text)
    name = "".join("_" if c in "/\\" or not c.isprintable() else c for c in text).lstrip(".")
    if name == text and name and len(name.encode()) <= NAME_BYTES and not _CHANGED.search(name):
        return name
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    head = name.encode()[:NAME_BYTES - 17].decode("utf-8", "ignore")  # whole characters only
    return f"{head}~{digest}"


class OutsideFolder(LabError):
    """A file the lab would read or write, named from a user's text, that resolves outside its folder (a link
    there leading elsewhere)."""


def file_in(folder, text: str, suffix: str = "") -> Path:
    """The path of the file (or folder) named ``safe_name(text) + suffix`` in ``folder``, where every name built
    from a user's text becomes a path: it never holds a separator or ``..``, and it is refused (OutsideFolder,
    one line) when it resolves outside ``folder``, through a link. ``suffix`` is the lab's own (``.json``)."""
    folder = Path(folder)
    path = folder / (safe_name(text) + suffix)
    if path.resolve().parent != folder.resolve():
        raise OutsideFolder(f"{path.name}: a link in {folder.name or folder} that leads outside it; not used")
    return path


# The lab's own names in the runs root (what is inside one run's directory: commlab/engine/runfiles.py).
CONFIG = "lab.json"
"""The runs directory's settings (max_jobs, quotas, access...; commlab/lab/rundir/store.py reads it)."""
INDEX = "index.sqlite"
"""The SQLite index of runs (commlab/lab/rundir/index.py), with its -wal, -shm, .lock and .corrupt-* beside it."""
SLOTS = ".slots"
"""One lock file per run slot, ``<k>.lock`` (commlab/lab/service/queue.py)."""
OBSERVERS = ".observers"
"""``<pid>.json`` per process that watches the runs (the UI), for the disturbance check."""
ACCESS = "access.json"
"""An exposed lab's accounts (commlab/room/accounts.py), changed under ACCESS_LOCK."""
ACCESS_LOCK = ".access.lock"
GROUPS = "groups"
"""``<gid>.json`` per saved group of runs (commlab/lab/analysis/results.py)."""

SWEEPS = "sweeps"
"""``sweeps/<id>/``: one sweep's grid, its cells' runs, its tables and its log (commlab/lab/front/sweep.py)."""
SWEEP = "sweep.json"
SWEEP_GRID = "grid.yaml"
SWEEP_CSV = "table.csv"
SWEEP_MD = "table.md"
SWEEP_LOG = "sweep.log"
PROCESS = "process.json"
"""A background job's process identity (a sweep's, an advice job's)."""

PROFILES = ".profiles"
"""Model profiles, ``<key>.json``, and what the machine measured once for the performance model."""
SHAPED_LINK = "link-shaped.json"
"""The lab's calibration of its shaped links (``commlab net check --save``): a shaped link's per-collective
cost (gloo over veth pairs and a token bucket, 1-3 ms here) is what a nominal alpha-beta link leaves out,
and it decides how many buckets and rounds pay."""
CURVES = "compressor-curves.json"
"""The compressors' encode/decode cost curves measured on this machine, per machine: a curve is a property
of the CPU and torch, not of a model, so a model's first advice takes the curves another model's advice
measured instead of measuring them again."""
PROPERTIES = "properties.json"

ADVICE_JOBS = ".advice"
"""``.advice/<id>/``: one advise job started from the UI (commlab/lab/front/advice_jobs.py)."""
ADVICE_SPEC = "spec.json"
ADVICE_REQUEST = "request.json"
ADVICE = "advice.json"
ADVICE_BEST = "best.yaml"
ADVICE_LOG = "advise.log"
ADVICE_GROUP = "group.json"



PRIVATE_MODE = 0o700
"""The runs directory's mode: its owner's alone. Every run's spec, log, metrics and timelines (a student's
private runs on a workshop server included) and the lab's access file sit below it, so no other account on
the machine reads them, whatever the modes of the files inside."""


def make_private(folder: os.PathLike, narrow: bool = False) -> bool:
    """``folder`` made (with its parents) with PRIVATE_MODE when missing; with ``narrow``, an existing one this
    user owns is narrowed to it too, unless it is a folder others share (world-writable or sticky, as /tmp is:
    its mode is not the lab's to change). Whether its mode changed."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_MODE)
    if not narrow:
        return False
    st = path.stat()
    shared = st.st_mode & (stat.S_IWOTH | stat.S_ISVTX)
    if st.st_uid != os.geteuid() or shared or st.st_mode & 0o777 == PRIVATE_MODE:
        return False
    os.chmod(path, PRIVATE_MODE)
    return True
