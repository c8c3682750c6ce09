"""The run store: one directory per run, which is the run's whole state.

    runs/<run-id>/spec.json            validated, fully defaulted spec
                  status.json          queued | running | done | failed | cancelled, times, error,
                                       disturbance (other processes' CPU during the run)
                  metrics.jsonl        one object per line (kind step or eval)
                  timeline-rank<r>.jsonl  Chrome trace events
                  log.txt              the workers' output
                  layout.json          the bucket layout (rank 0)
                  error-rank<r>.json   written by a rank that failed

Run ids from users are checked against a strict pattern, and every path is
resolved inside the runs directory, so nothing reads or writes outside it.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import List, Optional

from engine.runlog import read_jsonl
from engine.spec import JobSpec

STATES = ("queued", "running", "done", "failed", "cancelled", "diverged")
FINAL = ("done", "failed", "cancelled", "diverged")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class LabError(ValueError):
    """A user error the CLI reports in one line with exit status 2."""


class RunError(LabError):
    """A bad run id or a missing run; the message is one line."""


def default_root() -> Path:
    return Path(os.environ.get("COMMLAB_RUNS") or "runs")


def slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
    return s[:40] or "run"


def check_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID.match(run_id) or ".." in run_id:
        raise RunError(f"run id {run_id!r} is not valid: use letters, digits, '.', '_' and '-' only")
    return run_id


class Run:
    def __init__(self, path: Path, on_change=None):
        self.path = Path(path)
        self.id = self.path.name
        self.on_change = on_change
        """Called with the run after every status change (the store keeps its index current)."""

    def file(self, name: str) -> Path:
        return self.path / name

    # -- spec and status --------------------------------------------------
    def spec_dict(self) -> dict:
        with open(self.file("spec.json")) as f:
            return json.load(f)

    def spec(self) -> JobSpec:
        return JobSpec.from_dict(self.spec_dict())

    def status(self) -> dict:
        try:
            with open(self.file("status.json")) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {"state": "unknown"}

    @property
    def state(self) -> str:
        return self.status().get("state", "unknown")

    def set_status(self, state: str, **fields) -> dict:
        if state not in STATES:
            raise ValueError(f"state: {state!r} not in {STATES}")
        st = self.status()
        if st.get("state") == "unknown":
            st = {}
        st.update(fields)
        st["state"] = state
        st.setdefault("created", time.time())
        if state == "running":
            st.setdefault("started", time.time())
        if state in FINAL:
            st["ended"] = time.time()
        _write_json_atomic(self.file("status.json"), st)
        if self.on_change:
            self.on_change(self)
        return st

    def update_status(self, **fields) -> None:
        """Set fields of status.json without changing the state or the index (figures written while a
        run goes on; the index picks them up at the next state change)."""
        st = self.status()
        if st.get("state") == "unknown":
            return
        st.update(fields)
        _write_json_atomic(self.file("status.json"), st)

    def cancel_requested(self) -> bool:
        return self.file("cancel.request").exists()

    def read_all(self, pattern: str) -> List[dict]:
        """Every JSON file of the run matching ``pattern`` (unreadable ones skipped)."""
        out = []
        for p in sorted(self.path.glob(pattern)):
            try:
                with open(p) as f:
                    out.append(json.load(f))
            except (OSError, json.JSONDecodeError):
                continue
        return out

    def worker_pids(self) -> List[dict]:
        """The ranks' process identities, as each worker recorded them at start."""
        return self.read_all("pid-rank*.json")

    # -- logs -------------------------------------------------------------
    def metric_rows(self) -> List[dict]:
        return read_jsonl(str(self.file("metrics.jsonl")))

    def timeline_files(self) -> List[Path]:
        return sorted(self.path.glob("timeline-rank*.jsonl"), key=lambda p: int(re.findall(r"\d+", p.name)[-1]))

    def timeline_events(self) -> List[dict]:
        out = []
        for p in self.timeline_files():
            out.extend(read_jsonl(str(p)))
        return out

    # -- as data frames (the Python API) -----------------------------------
    def metrics(self, kind: str = "step"):
        """Metrics lines of one kind ("step" or "eval") as a DataFrame."""
        import pandas as pd
        rows = [m for m in self.metric_rows() if m.get("kind") == kind]
        return pd.DataFrame(rows)

    def timeline(self):
        """Timeline spans of all ranks as a DataFrame: rank, lane, name, start_us, dur_us, and their args."""
        import pandas as pd
        from engine.timeline import LANE_NAMES
        rows = []
        for e in self.timeline_events():
            rows.append({"rank": e["pid"], "lane": LANE_NAMES.get(e["tid"], str(e["tid"])), "name": e["name"],
                         "start_us": e["ts"], "dur_us": e["dur"], **(e.get("args") or {})})
        return pd.DataFrame(rows)

    def summary(self):
        """Headline figures and status as a one-row DataFrame."""
        import pandas as pd
        from lab.summary import summarize
        st = self.status()
        row = {"run": self.id, "state": st.get("state"), **summarize(self.metric_rows(), self.spec_dict())}
        return pd.DataFrame([row]).set_index("run")

    def errors(self) -> List[dict]:
        return sorted(self.read_all("error-rank*.json"), key=lambda e: e.get("time", 0))

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.file("log.txt"), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except FileNotFoundError:
            return ""

    def __repr__(self) -> str:
        return f"Run({self.id!r}, {self.state})"


class RunStore:
    def __init__(self, root: Optional[os.PathLike] = None, on_change=None):
        self.root = Path(root) if root else default_root()
        self.on_change = on_change

    def create(self, spec: JobSpec, run_id: Optional[str] = None) -> Run:
        """A new run directory, queued. ``run_id`` names it (multi-node runs agree on a name)."""
        self.root.mkdir(parents=True, exist_ok=True)
        if run_id is not None:
            check_id(run_id)
            path = self.root / run_id
            try:
                path.mkdir()
            except FileExistsError:
                raise RunError(f"run {run_id!r} exists already in {self.root}") from None
        else:
            for _ in range(100):
                path = self.root / f"{time.strftime('%Y%m%d-%H%M%S')}-{slug(spec.name)}-{secrets.token_hex(2)}"
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    continue
            else:
                raise RuntimeError("could not allocate a run id")
        run = Run(path, self.on_change)
        _write_json_atomic(run.file("spec.json"), spec.to_dict())
        run.set_status("queued", created=time.time())
        return run

    def get(self, run_id: str) -> Run:
        check_id(run_id)
        root = self.root.resolve()
        path = (root / run_id).resolve()
        if path.parent != root:
            raise RunError(f"run id {run_id!r} is not inside the runs directory")
        if not (path / "spec.json").is_file():
            raise RunError(f"no run {run_id!r} in {self.root}")
        return Run(path, self.on_change)

    def list(self) -> List[Run]:
        if not self.root.is_dir():
            return []
        runs = [Run(p, self.on_change) for p in self.root.iterdir() if p.is_dir() and RUN_ID.match(p.name)
                and (p / "spec.json").is_file()]
        return sorted(runs, key=lambda r: r.id)


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
