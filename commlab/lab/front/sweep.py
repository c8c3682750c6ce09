"""Sweeps: a base spec times lists of values, run through the queue, compared in one table.

    name: compressors-x-schedules
    base: examples/demo.yaml          # a spec file, or the spec inline as a mapping
    grid:                             # dotted fields -> lists of values; the product is run
      compressor.name: [none, fp16, topk]
      schedule.name: [layerwise, bucket]
    target_acc: 0.95                  # optional: adds time to target accuracy
    baseline: true                    # add world-size-1 runs, for the scaling factor (default true)

Every cell is validated before anything starts (at most MAX_CELLS of them); cells are queued as the lab's
slots free up (``AHEAD`` beyond them). The sweep's state lives in
``runs/sweeps/<sweep-id>/sweep.json`` (cell -> run id); running the same grid
again resumes it: cells whose run is done are skipped, the rest run again.
The table is printed and saved as ``table.csv`` and ``table.md`` there.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import yaml

from commlab.engine.runfiles import FINAL
from commlab.engine.runlog import write_json_atomic
from commlab.engine.spec import SpecError
from commlab.lab.analysis.comparison import compare_runs
from commlab.lab.base.paths import SWEEP, SWEEP_CSV, SWEEP_MD, SWEEPS, file_in
from commlab.lab.base.specs import apply_overrides, load_spec, read_spec_file
from commlab.lab.rundir.store import RunError, slug
from commlab.lab.service.queue import Lab, too_many_ranks

SWEEP_KEYS = ("name", "base", "grid", "target_acc", "baseline")
MAX_CELLS = 1000
"""Cells a grid may have: each is a run, and the cells are checked (and kept) before the first starts."""
AHEAD = 2
"""Runs a sweep keeps queued beyond the lab's slots (``max_jobs``): each queued run has a supervisor process
waiting for its place, so a sweep submits its next cell as one ends, not all of its cells at once."""


class Sweep:
    def __init__(self, lab: Lab, grid_file: Optional[str] = None, data: Optional[dict] = None):
        if data is None:
            data = read_spec_file(grid_file, "GRID")
        if not isinstance(data, dict):
            raise SpecError("GRID", "a sweep file must be a mapping with base and grid")
        unknown = sorted(set(data) - set(SWEEP_KEYS))
        if unknown:
            raise SpecError(unknown[0], f"unknown sweep field; allowed: {', '.join(SWEEP_KEYS)}")
        base = data.get("base", {})
        if isinstance(base, str):
            where = Path(grid_file).parent if grid_file else Path(".")
            path = Path(base) if Path(base).is_file() else where / base
            base = read_spec_file(str(path), "base")
        if not isinstance(base, dict):
            raise SpecError("base", "must be a spec file name or a spec mapping")
        grid = data.get("grid") or {}
        if not isinstance(grid, dict) or not grid:
            raise SpecError("grid", "must map dotted spec fields to lists of values, e.g. {compressor.name: [none, topk]}")
        for k, v in grid.items():
            if not isinstance(v, list) or not v:
                raise SpecError(f"grid.{k}", f"must be a non-empty list of values, got {v!r}")
        size = 1
        for v in grid.values():
            size *= len(v)
            if size > MAX_CELLS:
                raise SpecError("grid", f"more than {MAX_CELLS} cells (the product of its lists' lengths, "
                                        f"{' x '.join(str(len(x)) for x in grid.values())}); a sweep runs at most "
                                        f"{MAX_CELLS}")
        target = data.get("target_acc")
        if target is not None and (not isinstance(target, (int, float)) or not 0 < target <= 1):
            raise SpecError("target_acc", f"must be a number in (0, 1], got {target!r}")
        self.lab, self.base, self.grid, self.target = lab, base, grid, target
        self.baseline = data.get("baseline", True)
        if not isinstance(self.baseline, bool):
            raise SpecError("baseline", f"must be true or false, got {self.baseline!r}")
        self.name = str(data.get("name") or "sweep")
        digest = hashlib.sha1(json.dumps([base, grid, self.baseline], sort_keys=True, default=str).encode()).hexdigest()
        self.id = f"{slug(self.name)}-{digest[:8]}"
        self.dir = file_in(Path(lab.root) / SWEEPS, self.id)
        self.cells = self._cells()

    def _cells(self) -> List[dict]:
        """Each cell: its key, its overrides and its validated spec. Raises on the first bad cell."""
        keys = list(self.grid)
        cells = []
        for values in itertools.product(*(self.grid[k] for k in keys)):
            overrides = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                         for k, v in zip(keys, values)]
            label = ", ".join(f"{k}={v}" for k, v in zip(keys, values))
            try:
                spec = load_spec(data=self.base, overrides=overrides)
            except SpecError as e:
                raise SpecError(f"grid cell ({label}): {e.path}", e.msg) from None
            problem = too_many_ranks(self.lab.root, spec.world_size)  # before any cell is queued
            if problem:
                raise SpecError(f"grid cell ({label}): world_size", problem)
            cells.append({"key": label, "values": dict(zip(keys, values)), "spec": spec})
        if self.baseline:
            seen = {}
            for c in cells:
                s = c["spec"]
                k = (s.model.name, s.dataset.name, s.batch_size, s.device)
                if k not in seen and s.world_size > 1:
                    d = apply_overrides(s.to_dict(), ["world_size=1", "compressor={name: none}", "comm.mode=sync",
                                                      "fault={kind: none}"])
                    d["name"] = f"{s.name}-single"
                    seen[k] = {"key": f"single process: {s.model.name}/{s.dataset.name}/batch {s.batch_size}",
                               "values": {}, "spec": load_spec(data=d), "baseline": True}
            cells.extend(seen.values())
        return cells

    # -- state ------------------------------------------------------------
    def _load(self) -> dict:
        try:
            with open(self.dir / SWEEP) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _save(self, runs: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.dir / SWEEP, {"id": self.id, "name": self.name, "grid": self.grid,
                                                    "base": self.base, "target_acc": self.target, "runs": runs},
                          default=str)

    # -- running ----------------------------------------------------------
    def run(self, out=None, poll_s: float = 0.5):
        """Run every cell not yet done, through the queue, and return the comparison table."""
        out = out or sys.stderr
        runs = self._load().get("runs", {})
        todo = []
        for c in self.cells:
            rid = runs.get(c["key"])
            if rid:
                try:
                    if self.lab.store.get(rid).state == "done":
                        continue
                except RunError:
                    pass
            todo.append(c)
        skipped = len(self.cells) - len(todo)
        print(f"sweep {self.id}: {len(self.cells)} runs, {skipped} already done, "
              f"{len(todo)} to run ({self.lab.max_jobs} at a time)", file=out, flush=True)
        started, waiting = [], list(todo)
        try:
            last = None
            while True:
                states = [r.state for r in started]
                while waiting and sum(s not in FINAL for s in states) < self.lab.max_jobs + AHEAD:
                    cell = waiting.pop(0)
                    run = self.lab.submit(cell["spec"], wait=False, sweep=self.id)
                    runs[cell["key"]] = run.id
                    started.append(run)
                    states.append(run.state)
                    self._save(runs)
                counts = {s: states.count(s) for s in ("queued", "running")}
                done = sum(s in FINAL for s in states)
                line = f"sweep {self.id}: {done}/{len(todo)} finished, {counts['running']} running, " \
                       f"{counts['queued']} queued" + (f", {len(waiting)} not yet queued" if waiting else "")
                if line != last:
                    print(line, file=out, flush=True)
                    last = line
                if done == len(todo):
                    break
                if any(s in ("queued", "running") for s in states):
                    self.lab.recover_stale()
                time.sleep(poll_s)
        except KeyboardInterrupt:
            for r in started:
                self.lab.cancel(r.id)
            print(f"sweep {self.id}: interrupted; its unfinished runs were cancelled. Run it again to resume.",
                  file=out, flush=True)
            raise
        self._save(runs)
        return self.table(runs)

    def table(self, runs: Optional[dict] = None):
        runs = runs or self._load().get("runs", {})
        present = []
        for c in self.cells:
            rid = runs.get(c["key"])
            if not rid:
                continue
            try:
                present.append((c, self.lab.store.get(rid)))
            except RunError:
                continue
        df = compare_runs([r for _, r in present], target_acc=self.target)
        if len(df):
            cell_of = {r.id: c["key"] for c, r in present}
            df.insert(0, "cell", [cell_of[i] for i in df.index])
            self.dir.mkdir(parents=True, exist_ok=True)
            df.to_csv(self.dir / SWEEP_CSV)
            (self.dir / SWEEP_MD).write_text(markdown(df))
        return df


def markdown(df) -> str:
    cols = ["cell", "state", "iter_ms", "throughput", "scaling_factor", "bytes_per_step", "compression_ratio",
            "final_acc"] + (["time_to_target_s"] if "time_to_target_s" in df.columns else []) + \
        (["other_cpu"] if "other_cpu" in df.columns else [])
    fmt = {"iter_ms": "{:.1f}", "throughput": "{:.0f}", "scaling_factor": "{:.2f}", "bytes_per_step": "{:.0f}",
           "compression_ratio": "{:.1f}", "final_acc": "{:.2%}", "time_to_target_s": "{:.1f}",
           "other_cpu": "{:.0%}"}
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        cells = []
        for c in cols:
            v = row.get(c)
            cell = "-" if v is None or (isinstance(v, float) and v != v) else fmt.get(c, "{}").format(v)
            disturbed = c == "other_cpu" and row.get("disturbed") == True  # noqa: E712 (None, NaN: not measured)
            cells.append(cell + (" disturbed" if disturbed else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
