"""Merge every rank's timeline into one Chrome/Perfetto trace."""
from __future__ import annotations

from typing import List

from commlab.engine.runlog import write_json_atomic
from commlab.engine.timeline import LANE_NAMES, ends_step
from commlab.lab.rundir import store
from commlab.lab.rundir.store import Run


def chrome_trace(run: Run) -> dict:
    events: List[dict] = run.timeline_events()
    ranks = sorted({e["pid"] for e in events})
    meta = []
    for r in ranks:
        meta.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for tid in sorted({e["tid"] for e in events if e["pid"] == r}):
            meta.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                         "args": {"name": LANE_NAMES.get(tid, str(tid))}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid, "args": {"sort_index": tid}})
    events.sort(key=lambda e: (e["ts"], e["pid"], e["tid"]))
    other = {"run": run.id, "spec": run.spec_dict()}
    if run.view_cut():
        steps = [e["args"]["step"] for e in events if ends_step(e) and "step" in (e.get("args") or {})]
        other["cut"] = (f"each rank's last steps that fit {store.VIEW_MB:g} MB of timeline over the ranks (steps "
                        f"{min(steps, default='-')} to {max(steps, default='-')}); `commlab trace` writes the whole run")
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


def write_trace(run: Run, path: str) -> int:
    """Write the trace whole or not at all (a failed write leaves no half file); the number of events."""
    trace = chrome_trace(run)
    write_json_atomic(path, trace, indent=None, separators=(",", ":"))
    return len(trace["traceEvents"])
