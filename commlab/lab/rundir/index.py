"""The run index: one SQLite table (WAL) beside the run directories.

The directories are the source of truth; the index is a cache of their status, spec and headline figures
for listing, filtering and comparing. It is refreshed whenever a run changes state, and ``reindex``
rebuilds it from the directories.

Errors are told apart, because only one kind is the file's fault:

- damaged (SQLite says "file is not a database" or "malformed", or ``PRAGMA quick_check`` fails): the index
  is rebuilt once, and the damaged file is kept as ``index.sqlite.corrupt-<time>-<pid>`` (with its -wal
  and -shm), which is said on stderr;
- busy ("database is locked"): tried again with backoff for ``lock_wait_s``, then a ``RunIndexError``;
- anything else (a full disk, an I/O error, a read-only directory): a ``RunIndexError`` at once.

Only the first changes the file. A rebuild never empties the live file: it fills a new file beside it
from the directories, then, holding the swap lock (``index.sqlite.lock``) exclusively, writes again the
runs that changed meanwhile and renames the new file over the old. Every operation connects afresh while
it holds that lock shared, so no process has the old file open across a swap and its next write lands
in the new one. A rebuild that fails leaves the old file where it was and says why.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from commlab.engine import runfiles
from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import INDEX, make_private
from commlab.lab.rundir.store import Run, RunStore
from commlab.lab.rundir.summary import summarize

SIDECARS = ("-wal", "-shm")
"""SQLite's files beside a database in WAL mode. They belong to that one file: a new file must never meet
an old one's (SQLite would replay the old log into it), so they move or go with the file they belong to."""
LOCK_WAIT_S = 30.0
"""How long an operation waits for a busy index (another process's write, a rebuild's swap) before it
reports it."""
CLOCK_SLACK_S = 2.0
"""A file's time can lag the clock by a tick: runs whose files changed up to this long before a rebuild
read the directories are written again at its swap."""
COLUMNS = ("id", "state", "name", "created", "started", "ended", "model", "dataset", "world_size", "compressor",
           "error_feedback", "schedule", "comm", "link", "steps", "sweep", "error", "iter_ms", "throughput",
           "final_acc", "final_loss", "bytes_per_step", "compression_ratio", "spec", "summary", "other_cpu",
           "disturbed", "owner", "shared")
INSERT = f"INSERT OR REPLACE INTO runs ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
FILTERS = ("state", "model", "dataset", "compressor", "schedule", "comm", "link", "sweep", "name", "owner")


OWED_WAIT_S = 0.2
"""How long a read waits to write the rows it finds owed (Index.update) before reading without them."""


class RunIndexError(LabError):
    """The index cannot be used now: busy, a full disk, an I/O error, a rebuild that failed. The message
    is one line naming the file and the cause; the file was left as it was."""


class _Damaged(Exception):
    """The live file is damaged: why, and its identity (os.stat) when found, so that a rebuild swaps out
    that file only and not one another process has rebuilt since."""

    def __init__(self, why: str, found: os.stat_result):
        super().__init__(why)
        self.why, self.found = why, found


def _says_damaged(e: sqlite3.DatabaseError) -> bool:
    """SQLITE_NOTADB and SQLITE_CORRUPT, by their messages (the error codes are Python 3.11+)."""
    msg = str(e).lower()
    return "not a database" in msg or "malformed" in msg


def _busy(e: sqlite3.DatabaseError) -> bool:
    """SQLITE_BUSY and SQLITE_LOCKED: another connection holds the lock; waiting may help."""
    msg = str(e).lower()
    return isinstance(e, sqlite3.OperationalError) and ("locked" in msg or "busy" in msg)


def _check(con: sqlite3.Connection) -> Optional[str]:
    """``PRAGMA quick_check`` on ``con``'s file: None when it is sound, else what is wrong. Errors other
    than damage are raised."""
    try:
        found = [r[0] for r in con.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as e:
        if _says_damaged(e):
            return str(e)
        raise
    return None if found == ["ok"] else f"quick_check: {'; '.join(found[:3])}"


def _same_file(path: Path, found: os.stat_result) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (found.st_dev, found.st_ino)


def _unused(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2``, ... if it is taken: a file kept aside is never written over."""
    k, found = 0, path
    while found.exists() or any(_side(found, s).exists() for s in SIDECARS):
        k += 1
        found = _side(path, f"-{k}")
    return found


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _side(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _move_all(moves) -> None:
    """Rename each (src, dst) in order, all or none: on a failure the ones done are renamed back."""
    done = []
    try:
        for src, dst in moves:
            os.replace(src, dst)
            done.append((src, dst))
    except OSError:
        for src, dst in reversed(done):
            os.replace(dst, src)
        raise


class Index:
    def __init__(self, store: RunStore, lock_wait_s: float = LOCK_WAIT_S):
        self.store = store
        self.path = Path(store.root) / INDEX
        self.lock_path = _side(self.path, ".lock")
        self.lock_wait_s = lock_wait_s

    # -- connections ------------------------------------------------------
    def _prepare(self, con: sqlite3.Connection) -> None:
        con.execute("PRAGMA journal_mode=WAL")
        cols = ", ".join(f"{c} {'TEXT PRIMARY KEY' if c == 'id' else ''}" for c in COLUMNS)
        con.execute(f"CREATE TABLE IF NOT EXISTS runs ({cols})")
        have = {r[1] for r in con.execute("PRAGMA table_info(runs)")}
        missing = [c for c in COLUMNS if c not in have]
        if missing:  # an index from an older commlab: add the columns and refill every row from the directories
            with con:
                for c in missing:
                    try:
                        con.execute(f"ALTER TABLE runs ADD COLUMN {c}")
                    except sqlite3.OperationalError as e:
                        if "duplicate column" not in str(e):
                            raise  # only "another process added it meanwhile" is expected here
                con.executemany(INSERT, self._values(self._rows()))

    def _run(self, path: Path, fn, wait_s: float):
        """fn(con) in one transaction on the database at ``path``, with SQLite's busy wait ``wait_s``."""
        con = sqlite3.connect(path, timeout=wait_s)
        try:
            self._prepare(con)
            with con:
                return fn(con)
        finally:
            con.close()

    @contextlib.contextmanager
    def _swap_lock(self, kind: int, deadline: float):
        """Hold ``index.sqlite.lock``: shared around every connection, exclusive around a rebuild's swap.
        flock is released by the kernel when a holder dies, so a killed process never blocks the index."""
        make_private(self.path.parent)
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # another user's lock file: a read-only descriptor locks all the same
            fd = os.open(self.lock_path, os.O_RDONLY)
        try:
            pause = 0.005
            while True:
                try:
                    fcntl.flock(fd, kind | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        what = "a rebuild is swapping it" if kind == fcntl.LOCK_SH else "other processes are using it"
                        raise RunIndexError(f"{self.path}: locked ({what}; {self.lock_path.name} was held for "
                                            f"{self.lock_wait_s:g} s); nothing was changed, try again") from None
                    time.sleep(pause)
                    pause = min(2 * pause, 0.1)
            yield
        finally:
            os.close(fd)

    def _live(self, fn, wait_s: Optional[float] = None):
        """fn(con) on the live file, holding the swap lock shared. A busy index is tried again with
        backoff until ``wait_s`` (default ``lock_wait_s``) has passed, then reported; a damaged one raises
        ``_Damaged``."""
        wait_s = self.lock_wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        pause = 0.02
        while True:
            try:
                with self._swap_lock(fcntl.LOCK_SH, deadline):
                    return self._live_once(fn, max(0.0, deadline - time.monotonic()))
            except sqlite3.OperationalError as e:
                if not _busy(e):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RunIndexError(f"{self.path}: locked by another process ({e}) for {wait_s:g} s; "
                                        "nothing was changed, try again") from None
                time.sleep(min(pause, left))
                pause = min(2 * pause, 1.0)

    def _live_once(self, fn, wait_s: float):
        con = sqlite3.connect(self.path, timeout=wait_s)
        try:
            found = os.stat(self.path)  # stable while the swap lock is held: the file this connection uses
            try:
                self._prepare(con)
                with con:
                    return fn(con)
            except sqlite3.DatabaseError as e:
                why = self._damage(con, e)
                if why:
                    raise _Damaged(why, found) from e
                raise
        finally:
            con.close()

    @staticmethod
    def _damage(con: sqlite3.Connection, e: sqlite3.DatabaseError) -> Optional[str]:
        """Why the file is damaged, or None when ``e`` is not the file's fault. An error SQLite does not
        name (a bare DatabaseError) is settled by ``PRAGMA quick_check``."""
        if _says_damaged(e):
            return str(e)
        if type(e) is not sqlite3.DatabaseError:
            return None
        try:
            return _check(con)
        except sqlite3.DatabaseError:
            return None  # the check could not run either: ``e`` is reported as it is

    def _with(self, fn, wait_s: Optional[float] = None):
        """Run fn(con) in a transaction; a damaged index file is set aside and rebuilt once (see above)."""
        try:
            if not self.path.exists():  # deleted, or never made: filled from the directories, not left empty
                self._rebuild()
            try:
                return self._live(fn, wait_s)
            except _Damaged as d:
                damaged = d
            self._rebuild(damaged)
            return self._live(fn, wait_s)
        except _Damaged as d:
            raise RunIndexError(f"{self.path}: damaged again right after its rebuild ({d.why})") from None
        except (sqlite3.DatabaseError, OSError) as e:
            raise RunIndexError(f"{self.path}: {e} ({type(e).__name__}); the file was left as it is") from None

    # -- rows ---------------------------------------------------------------
    @staticmethod
    def row_of(run: Run) -> Optional[dict]:
        try:
            spec = run.spec_dict()
        except (OSError, ValueError):
            return None
        st = run.status()
        s = summarize(run.metric_rows(), spec, st)
        own = st.get("own_loop") or {}  # commlab.wrap: the model and data are its script's, the steps it took
        c = spec.get("compressor", {})
        d = st.get("disturbance") or {}
        return {
            "id": run.id, "state": st.get("state", "unknown"), "name": spec.get("name"),
            "created": st.get("created"), "started": st.get("started"), "ended": st.get("ended"),
            "model": own.get("model") or spec.get("model", {}).get("name"),
            "dataset": "own loop" if own else spec.get("dataset", {}).get("name"),
            "world_size": spec.get("world_size"), "compressor": c.get("name"),
            "error_feedback": int(bool(c.get("error_feedback"))), "schedule": spec.get("schedule", {}).get("name"),
            "comm": spec.get("comm", {}).get("mode"), "link": spec.get("network", {}).get("link"),
            "steps": s.get("steps"), "sweep": st.get("sweep"), "error": st.get("error"),
            "iter_ms": s.get("iter_ms_median"), "throughput": s.get("throughput"), "final_acc": s.get("final_acc"),
            "final_loss": s.get("final_loss"), "bytes_per_step": s.get("bytes_per_step"),
            "compression_ratio": s.get("compression_ratio"), "spec": json.dumps(spec), "summary": json.dumps(s),
            "other_cpu": d.get("other_cpu"), "disturbed": None if d.get("disturbed") is None else int(d["disturbed"]),
            "owner": st.get("owner"), "shared": int(bool(st.get("shared"))),
        }

    def _rows(self) -> List[dict]:
        """Every run's row, read from the directories."""
        return [r for r in (self.row_of(run) for run in self.store.list()) if r]

    @staticmethod
    def _values(rows: List[dict]) -> list:
        return [[r[c] for c in COLUMNS] for r in rows]

    def update(self, run: Run) -> None:
        """Write the run's row. An update the index cannot take (locked too long, a full disk) is owed: the
        run's id goes into ``index.sqlite.owed`` and the next query writes it from the run's directory
        first, so a supervisor that carries on past the error leaves no row behind for good."""
        row = self.row_of(run)
        if row is None:
            return
        try:
            self._with(lambda con: con.execute(INSERT, [row[c] for c in COLUMNS]))
        except RunIndexError:
            with open(self.owed_path, "a") as f:
                f.write(run.id + "\n")
            raise

    @property
    def owed_path(self) -> Path:
        return self.path.with_name(self.path.name + ".owed")

    def _pay_owed(self) -> None:
        """Write the rows of updates that failed earlier (``update``), from the runs' directories."""
        try:
            ids = self.owed_path.read_text().split()
        except FileNotFoundError:
            return
        rows = [r for r in (self.row_of(run) for run in self.store.list() if run.id in set(ids)) if r]
        try:  # briefly: a read must not wait on a writer's lock for a debt
            self._with(lambda con: con.executemany(INSERT, self._values(rows)), wait_s=OWED_WAIT_S)
        except RunIndexError:
            return  # still owed; the read goes on
        self.owed_path.unlink(missing_ok=True)

    def remove(self, run_id: str) -> None:
        self._with(lambda con: con.execute("DELETE FROM runs WHERE id = ?", (run_id,)))

    def query(self, **filters) -> List[dict]:
        """Rows (dicts), oldest first. Filters are exact matches on FILTERS columns."""
        bad = sorted(set(filters) - set(FILTERS))
        if bad:
            raise ValueError(f"{bad[0]}: not a filter; allowed: {', '.join(FILTERS)}")
        if filters.get("state") is not None and filters["state"] not in runfiles.STATES:  # else an empty list, silently
            raise ValueError(f"state: {filters['state']!r} is not a state; allowed: {', '.join(runfiles.STATES)}")
        where = [(k, v) for k, v in filters.items() if v is not None]
        sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(f"{k} = ?" for k, _ in where) if where else "")
        sql += " ORDER BY created, id"

        def fetch(con):
            con.row_factory = sqlite3.Row
            return [dict(r) for r in con.execute(sql, [v for _, v in where])]
        self._pay_owed()
        return self._with(fetch)

    def states(self) -> Dict[str, str]:
        return {r["id"]: r["state"] for r in self.query()}

    def who_sees(self) -> Dict[str, dict]:
        """Each run's owner and whether it is shared, by id (their columns only: what deciding who may see a
        run needs, without every run's figures)."""
        rows = self._with(lambda con: con.execute("SELECT id, owner, shared FROM runs").fetchall())
        return {i: {"owner": o, "shared": sh} for i, o, sh in rows}

    def owners(self) -> set:
        """The names that own runs (their column only)."""
        rows = self._with(lambda con: con.execute("SELECT DISTINCT owner FROM runs WHERE owner IS NOT NULL")
                          .fetchall())
        return {r[0] for r in rows if r[0]}

    def unfinished(self) -> set:
        """The ids of the runs the index lists as queued or running (their rows only, not their figures)."""
        rows = self._with(lambda con: con.execute("SELECT id FROM runs WHERE state IN ('queued', 'running')")
                          .fetchall())
        return {r[0] for r in rows}

    # -- rebuilding ---------------------------------------------------------
    def reindex(self) -> int:
        """Rebuild the index from the run directories; returns the number of runs indexed. The old file is
        replaced whole; a damaged one is kept aside."""
        return self._rebuild()

    def _rebuild(self, damaged: Optional[_Damaged] = None) -> int:
        """Fill a new file from the directories and swap it in for the live one. With ``damaged`` (what an
        operation found), the swap is skipped when another process has swapped in a new file since."""
        since = time.time() - CLOCK_SLACK_S
        try:
            make_private(self.path.parent)
            fd, name = tempfile.mkstemp(dir=self.path.parent, prefix=f".{INDEX}.", suffix=".new")
            os.close(fd)
        except OSError as e:
            raise self._rebuild_failed(damaged, e) from None
        new = Path(name)
        try:
            n = self._fill(new, self._rows())
            with self._swap_lock(fcntl.LOCK_EX, time.monotonic() + self.lock_wait_s):
                if damaged is not None and self.path.exists() and not _same_file(self.path, damaged.found):
                    return n  # another process has rebuilt it meanwhile
                n = self._catch_up(new, since)
                why = damaged.why if damaged and _same_file(self.path, damaged.found) else self._quick_check()
                stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
                aside = _unused(self.path.with_name(f"{INDEX}.corrupt-{stamp}"))
                if why:
                    moves = [(self.path, aside)] + [(_side(self.path, s), _side(aside, s)) for s in SIDECARS
                                                    if _side(self.path, s).exists()]
                else:  # sound or absent: its log is superseded, and must not meet the new file
                    moves = []
                    for s in SIDECARS:
                        _side(self.path, s).unlink(missing_ok=True)
                _move_all(moves + [(new, self.path)])
        except RunIndexError:
            raise
        except Exception as e:
            raise self._rebuild_failed(damaged, e) from e
        finally:
            for p in [new] + [_side(new, s) for s in SIDECARS + ("-journal",)]:
                p.unlink(missing_ok=True)
        if why:
            print(f"commlab: {self.path}: damaged ({why}); kept as {aside.name}, and rebuilt from the run "
                  f"directories ({n} runs)", file=sys.stderr, flush=True)
        return n

    def _rebuild_failed(self, damaged: Optional[_Damaged], e: BaseException) -> RunIndexError:
        left = f"it is damaged ({damaged.why}) and was left where it is" if damaged else "it was left as it was"
        return RunIndexError(f"{self.path}: could not be rebuilt from the run directories "
                             f"({type(e).__name__}: {e}); {left}")

    def _fill(self, path: Path, rows: List[dict]) -> int:
        self._run(path, lambda con: con.executemany(INSERT, self._values(rows)), self.lock_wait_s)
        return len(rows)

    def _catch_up(self, path: Path, since: float) -> int:
        """In the new file at ``path``, write again the runs whose files changed since ``since`` (a writer
        may have put them into the old file only) and drop the runs that are gone; returns how many it
        holds. Called with the swap lock held exclusively, so no write can slip past it."""
        runs = self.store.list()
        changed = [run for run in runs
                   if max(_mtime(run.file(runfiles.STATUS)), _mtime(run.file(runfiles.SPEC))) >= since]
        rows = [r for r in (self.row_of(run) for run in changed) if r]
        ids = {run.id for run in runs}

        def catch_up(con):
            con.executemany(INSERT, self._values(rows))
            gone = [(i,) for (i,) in con.execute("SELECT id FROM runs") if i not in ids]
            con.executemany("DELETE FROM runs WHERE id = ?", gone)
            return con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        return self._run(path, catch_up, self.lock_wait_s)

    def _quick_check(self) -> Optional[str]:
        """Why the live file is damaged, or None when it is sound or absent. The swap lock must be held."""
        if not self.path.exists():
            return None
        con = sqlite3.connect(self.path, timeout=self.lock_wait_s)
        try:
            return _check(con)
        finally:
            con.close()


def runs_of(root, **filters) -> List[Run]:
    """The runs in ``root``'s index, oldest first, filtered as ``Index.query`` (what ``commlab.runs`` gives, without
    first settling runs whose supervisor died)."""
    store = RunStore(root)
    return [store.get(r["id"]) for r in Index(store).query(**filters)]
