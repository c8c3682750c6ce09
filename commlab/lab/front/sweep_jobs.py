"""Sweeps started from the Sweeps page: the grid written under runs/sweeps/<id>/ and run by a detached
``commlab sweep`` process (commlab.lab.front.sweep), followed while it runs, its cells' table read back without
writing, and a sweep shown as a group on the results page. The teacher's only on a workshop server.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pandas as pd
import yaml

from commlab.engine.runfiles import FINAL
from commlab.lab.analysis.comparison import compare_runs
from commlab.lab.base import procs
from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import PROCESS, SOURCE, SWEEP, SWEEP_GRID, SWEEP_LOG, SWEEPS
from commlab.lab.base.specs import load_yaml
from commlab.lab.front.sweep import Sweep
from commlab.lab.front.ui import get_run, runs_dir, viewer
from commlab.lab.rundir.store import check_id
from commlab.room import open_lab
from commlab.lab.service.spawn import spawn_detached


def sweep_group(sweep_id: str, runs=None) -> dict:
    """A sweep's cells that have a run, as a group for the results view (no preset: no declared effect;
    the verdict ranks the cells by iteration time)."""
    sw = load_sweep(sweep_id, runs)  # the teacher's only
    saved = sw._load().get("runs", {})
    cells = {c["key"]: saved[c["key"]] for c in sw.cells if saved.get(c["key"])}
    if not cells:
        raise KeyError(f"sweep {sweep_id!r} has no runs yet")
    return {"id": sw.id, "preset": None, "title": f"sweep {sw.name}", "runs": cells, "created": None}


def sweep_data(name: str, base: dict, grid: dict, target_acc: Optional[float] = None,
               baseline: bool = True) -> dict:
    d = {"name": name, "base": base, "grid": grid, "baseline": baseline}
    if target_acc:
        d["target_acc"] = target_acc
    return d


def make_sweep(data: dict, runs=None):
    """A validated Sweep (raises SpecError naming the bad field or grid cell)."""
    return Sweep(open_lab(runs or runs_dir(), room=True), data=data)


def sweep_argv(grid_file: Path, runs: Path) -> List[str]:
    return [sys.executable, "-m", "commlab.lab.front.cli", "sweep", str(grid_file), "--runs", str(runs)]


def start_sweep(data: dict, runs=None) -> str:
    """Write the grid under runs/sweeps/<id>/grid.yaml and run it in a detached
    ``commlab sweep`` process (it outlives the app session, not the app). Returns the sweep id.
    The teacher's only on a workshop server."""
    _teacher_only("sweeps")
    runs = Path(runs or runs_dir()).resolve()
    sw = make_sweep(data, runs)
    if sweep_running(sw.dir):
        raise LabError(f"sweep {sw.id} is running already")
    sw.dir.mkdir(parents=True, exist_ok=True)
    grid_file = sw.dir / SWEEP_GRID
    grid_file.write_text(yaml.safe_dump(data, sort_keys=False))
    pid = spawn_detached(sweep_argv(grid_file, runs), sw.dir / SWEEP_LOG, cwd=SOURCE, kind="sweep")  # normal priority
    (sw.dir / PROCESS).write_text(json.dumps(procs.identity(pid)))
    return sw.id


def sweep_running(sweep_dir: Path) -> bool:
    try:
        return procs.alive(json.loads((Path(sweep_dir) / PROCESS).read_text()))
    except (OSError, ValueError):
        return False


def _teacher_only(what: str) -> None:
    if not viewer().admin:
        raise LabError(f"{what}: only the teacher may use sweeps on a workshop server")


def list_sweeps(runs=None) -> List[str]:
    if not viewer().admin:
        return []
    root = Path(runs or runs_dir()) / SWEEPS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if (p / SWEEP_GRID).is_file() or (p / SWEEP).is_file()]
    return [p.name for p in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)]


def load_sweep(sweep_id: str, runs=None):
    """The Sweep of a directory under runs/sweeps/, rebuilt from its grid file (or sweep.json)."""
    _teacher_only("sweeps")
    root = Path(runs or runs_dir())
    d = root / SWEEPS / check_id(sweep_id)
    if (d / SWEEP_GRID).is_file():
        return make_sweep(load_yaml((d / SWEEP_GRID).read_text()), root)
    saved = json.loads((d / SWEEP).read_text())
    data = {k: saved[k] for k in ("name", "base", "grid") if k in saved}
    if saved.get("target_acc") is not None:
        data["target_acc"] = saved["target_acc"]
    for baseline in (True, False):  # sweep.json does not keep the flag; the id tells which it was
        sw = make_sweep({**data, "baseline": baseline}, root)
        if sw.id == sweep_id:
            return sw
    return sw


def sweep_status(sw) -> dict:
    """Cells, how many are in each state, the run of each cell, and whether its process lives."""
    saved = sw._load().get("runs", {})
    states: Dict[str, int] = {}
    cells = []
    for c in sw.cells:
        rid = saved.get(c["key"])
        run = get_run(rid, sw.lab.root) if rid else None
        state = run.state if run else "not started"
        states[state] = states.get(state, 0) + 1
        cells.append({"cell": c["key"], "baseline": bool(c.get("baseline")), "run": rid, "state": state})
    return {"id": sw.id, "cells": pd.DataFrame(cells), "states": states, "total": len(sw.cells),
            "finished": sum(n for s, n in states.items() if s in FINAL), "running": sweep_running(sw.dir)}


def sweep_table(sw) -> pd.DataFrame:
    """The comparison table of a sweep's cells that have a run, with ``cell`` and ``baseline``
    columns (read only: unlike ``Sweep.table`` it writes no files)."""
    saved = sw._load().get("runs", {})
    present = []
    for c in sw.cells:
        run = get_run(saved[c["key"]], sw.lab.root) if saved.get(c["key"]) else None
        if run is not None:
            present.append((c, run))
    df = compare_runs([r for _, r in present], target_acc=sw.target)
    if len(df):
        df.insert(0, "cell", [c["key"] for c, _ in present])
        df.insert(1, "baseline", [bool(c.get("baseline")) for c, _ in present])
    return df


def sweep_log(sw, n: int = 30) -> str:
    try:
        with open(Path(sw.dir) / SWEEP_LOG, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except FileNotFoundError:
        return ""
