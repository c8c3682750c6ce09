"""The run index: one SQLite table (WAL) beside the run directories.

The directories are the source of truth; the index is a cache of their
status, spec and headline figures for listing, filtering and comparing. It is
refreshed whenever a run changes state, and ``reindex`` rebuilds it from the
directories, which also repairs a lost or damaged index file.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Dict, List, Optional

from lab.store import Run, RunStore
from lab.summary import summarize

INDEX_FILE = "index.sqlite"
COLUMNS = ("id", "state", "name", "created", "started", "ended", "model", "dataset", "world_size", "compressor",
           "error_feedback", "schedule", "comm", "link", "steps", "sweep", "error", "iter_ms", "throughput",
           "final_acc", "final_loss", "bytes_per_step", "compression_ratio", "spec", "summary", "other_cpu",
           "disturbed", "owner", "shared")
INSERT = f"INSERT OR REPLACE INTO runs ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
FILTERS = ("state", "model", "dataset", "compressor", "schedule", "comm", "link", "sweep", "name", "owner")


class Index:
    def __init__(self, store: RunStore):
        self.store = store
        self.path = Path(store.root) / INDEX_FILE

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.path, timeout=30)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA busy_timeout=30000")
        cols = ", ".join(f"{c} {'TEXT PRIMARY KEY' if c == 'id' else ''}" for c in COLUMNS)
        con.execute(f"CREATE TABLE IF NOT EXISTS runs ({cols})")
        missing = [c for c in COLUMNS if c not in {r[1] for r in con.execute("PRAGMA table_info(runs)")}]
        if missing:  # an index from an older commlab: add the columns and refill every row from the directories
            with con:
                for c in missing:
                    try:
                        con.execute(f"ALTER TABLE runs ADD COLUMN {c}")
                    except sqlite3.OperationalError:  # another process added it meanwhile
                        pass
                rows = [r for r in (self.row_of(run) for run in self.store.list()) if r]
                con.executemany(INSERT, [[r[c] for c in COLUMNS] for r in rows])
        return con

    def _with(self, fn):
        """Run fn(con) in a transaction; a damaged index file is rebuilt from the directories once."""
        try:
            return self._once(fn)
        except sqlite3.DatabaseError:
            self.reindex()
            return self._once(fn)

    def _once(self, fn):
        con = self._connect()
        try:
            with con:
                return fn(con)
        finally:
            con.close()

    @staticmethod
    def row_of(run: Run) -> Optional[dict]:
        try:
            spec = run.spec_dict()
        except (OSError, ValueError):
            return None
        st = run.status()
        s = summarize(run.metric_rows(), spec)
        c = spec.get("compressor", {})
        d = st.get("disturbance") or {}
        return {
            "id": run.id, "state": st.get("state", "unknown"), "name": spec.get("name"),
            "created": st.get("created"), "started": st.get("started"), "ended": st.get("ended"),
            "model": spec.get("model", {}).get("name"), "dataset": spec.get("dataset", {}).get("name"),
            "world_size": spec.get("world_size"), "compressor": c.get("name"),
            "error_feedback": int(bool(c.get("error_feedback"))), "schedule": spec.get("schedule", {}).get("name"),
            "comm": spec.get("comm", {}).get("mode"), "link": spec.get("network", {}).get("link"),
            "steps": spec.get("steps"), "sweep": st.get("sweep"), "error": st.get("error"),
            "iter_ms": s.get("iter_ms_median"), "throughput": s.get("throughput"), "final_acc": s.get("final_acc"),
            "final_loss": s.get("final_loss"), "bytes_per_step": s.get("bytes_per_step"),
            "compression_ratio": s.get("compression_ratio"), "spec": json.dumps(spec), "summary": json.dumps(s),
            "other_cpu": d.get("other_cpu"), "disturbed": None if d.get("disturbed") is None else int(d["disturbed"]),
            "owner": st.get("owner"), "shared": int(bool(st.get("shared"))),
        }

    def update(self, run: Run) -> None:
        row = self.row_of(run)
        if row is None:
            return
        self._with(lambda con: con.execute(INSERT, [row[c] for c in COLUMNS]))

    def remove(self, run_id: str) -> None:
        self._with(lambda con: con.execute("DELETE FROM runs WHERE id = ?", (run_id,)))

    def query(self, **filters) -> List[dict]:
        """Rows (dicts), oldest first. Filters are exact matches on FILTERS columns."""
        bad = sorted(set(filters) - set(FILTERS))
        if bad:
            raise ValueError(f"{bad[0]}: not a filter; allowed: {', '.join(FILTERS)}")
        where = [(k, v) for k, v in filters.items() if v is not None]
        sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(f"{k} = ?" for k, _ in where) if where else "")
        sql += " ORDER BY created, id"

        def fetch(con):
            con.row_factory = sqlite3.Row
            return [dict(r) for r in con.execute(sql, [v for _, v in where])]
        return self._with(fetch)

    def reindex(self) -> int:
        """Rebuild the index from the run directories; returns the number of runs indexed."""
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(self.path) + suffix)
            if p.exists():
                p.unlink()
        rows = [r for r in (self.row_of(run) for run in self.store.list()) if r]
        self._once(lambda con: con.executemany(INSERT, [[r[c] for c in COLUMNS] for r in rows]))
        return len(rows)

    def states(self) -> Dict[str, str]:
        return {r["id"]: r["state"] for r in self.query()}
