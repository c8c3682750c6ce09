"""Presets' groups, as the pages start and show them: a preset's runs queued for the viewer in one click (its
knobs at the card's values, scaled to the room's step cap) and recorded as a group (commlab.lab.analysis.results), and
the groups the viewer may see (all of whose runs they may see), with their verdict and crossover.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

from commlab import api
from commlab.engine.runfiles import FINAL
from commlab.engine.spec import SpecError
from commlab.lab.analysis import results, timelines
from commlab.lab.analysis.presets import Preset
from commlab.lab.base.errors import LabError
from commlab.lab.front.ui import (get_run, get_run_or_raise, lab_get, queue_runs, runs_dir, viewer, visible,
                                  visible_ids)
from commlab.lab.rundir.store import RunError
from commlab.room import owners


def start_preset(preset: Preset, runs=None, values: Optional[Dict[str, int]] = None) -> str:
    """Queue every run of a preset (detached supervisors), its knobs at ``values`` (the card's sliders; the
    defaults where not given), and record them as a group (commlab.lab.analysis.results) with those values; the group's id.
    The group is written before the first run is queued, so a results page opened at once finds it.
    LabError for a value out of a knob's range."""
    root = runs or runs_dir()
    created = time.time()
    cap = owners.preset_steps(root)
    try:
        vals = preset.values(values)
    except ValueError as e:
        raise LabError(f"preset {preset.key}: {e}") from None
    specs = [api.spec(owners.scale_preset(d, cap)) for d in preset.specs(vals)]
    try:
        made = queue_runs(root, specs, then=lambda made: results.save_group(
            root, preset.key, {label: r.id for label, r in zip(preset.labels(), made)}, created=created,
            values=vals))
    except SpecError as e:  # e.g. no place for its model's preview in time: one line on the card, not a traceback
        raise LabError(f"preset {preset.key}: {e}") from None
    return made[0].id


def _group_visible(group: dict, root) -> bool:
    user = viewer()
    if user.admin:
        return True
    for rid in group.get("runs", {}).values():
        try:
            if not visible(lab_get(rid, root), user):
                return False
        except (RunError, LabError):
            return False
    return bool(group.get("runs"))


def preset_group(gid: str, runs=None) -> dict:
    """A preset's group of runs; KeyError when there is none or the viewer may not see all its runs (for a
    student the same line whatever the reason: no path of the machine, no hint which ids exist)."""
    root = runs or runs_dir()
    try:
        g = results.load_group(root, gid)
    except (KeyError, ValueError, RunError, LabError):
        if viewer().admin:
            raise
        g = None
    if g is None or not _group_visible(g, root):
        raise KeyError(f"group: no group {gid!r}")
    return g


def preset_groups(runs=None) -> List[dict]:
    """The groups the viewer may see (all of whose runs they may see), newest first. Who may see each run is read
    from the run index at once (one query), not from every run's status: the Results page lists them on every
    load, and a room holds thousands of others' runs."""
    root = runs or runs_dir()
    found = results.list_groups(root)
    if viewer().admin:
        return found
    seen = visible_ids(root)
    return [g for g in found if g.get("runs") and all(rid in seen for rid in g["runs"].values())]


def group_verdict(group: dict, runs=None):
    """The verdict of a preset's or a sweep's group (commlab.lab.analysis.results.evaluate), from the runs' own figures."""
    root = runs or runs_dir()
    return results.evaluate(group, lambda rid: get_run_or_raise(rid, root))


def group_crossover(group: dict, runs=None) -> Optional[str]:
    """The performance model's crossover sentence for the group (once its runs are done); cached."""
    root = runs or runs_dir()
    key = ("crossover", str(root), group["id"], tuple(sorted(group["runs"].values())))
    states = tuple(getattr(get_run(i, root), "state", None) for i in group["runs"].values())
    if any(s not in FINAL for s in states):
        return None
    return timelines.cached(key + states, lambda: results.crossover(group, lambda rid: get_run_or_raise(rid, root)))
