"""A tuning schedule under fault tolerance: its search runs before the replicas start.

MergeComp and LayerFusion choose the buckets from timings (each candidate partition's steps; the gradients' ready
times and a fitted per-call cost). Replicas that searched each on their own would choose different buckets, whose
exchanges could not meet, and a replica restarted after a kill would search again in the middle of the run. So under
fault tolerance the run's supervisor searches first, in a run of the same spec without fault tolerance (the same
world size, model, compressor and link; its steps train nothing the run keeps), and every replica, a restarted one
too, builds its buckets from the partition that run chose: partition.json, read by commlab.engine.stepper. MergeComp's
cache beside the runs is read first, as a run without fault tolerance reads it: a partition chosen before for the
same setting is taken without a search (``schedule.retune: true`` searches again).

The search run is a run of its own in the runs list (``tuning_for`` in its status names the run it serves); the run's
tuning.json holds what it measured and chose, and ``searched_in`` (its id) or ``cache: hit``.
"""
from __future__ import annotations

import itertools
import json
from typing import Callable, Optional

from commlab.engine import runfiles
from commlab.engine.runlog import write_json_atomic
from commlab.lab.base.specs import load_spec
from commlab.lab.base import procs
from commlab.lab.base.errors import LabError
from commlab.lab.rundir.launcher import launch

TUNED = ("mergecomp", "layerfusion")
"""The schedules whose buckets come from a search."""


def needs_search(spec) -> bool:
    """A fault-tolerant run under a tuning schedule: its partition is chosen before the replicas start."""
    return spec.fault_tolerance.enabled and spec.schedule.name in TUNED


def choose_partition(lab, run, say: Callable[[str], None] = lambda m: None,
                     should_cancel: Callable[[], bool] = lambda: False) -> Optional[dict]:
    """Write ``run``'s partition.json (and its search into tuning.json) when ``needs_search``; returns what it wrote,
    or None for any other run. A search that does not end done, or ends undecided, is a LabError naming it."""
    spec = run.spec()
    if not needs_search(spec):
        return None
    # lazy: the tuners import torch, which a supervisor of any other run never needs
    from commlab.engine.tuners import mergecomp, steps_to_decide
    name = spec.schedule.name
    if name == "mergecomp" and not spec.schedule.retune:
        try:
            hit = mergecomp.read_cache(str(lab.root), mergecomp.cache_key(spec))
        except mergecomp.CacheCorrupt as e:
            say(f"mergecomp cache: {e}; searching afresh")
            hit = None
        if hit is not None and hit.get("order") and isinstance(hit.get("cuts"), list):
            buckets = _buckets(hit["order"], hit["cuts"])
            say(f"schedule mergecomp: the cached partition ({len(buckets)} groups, chosen in {hit.get('run')})")
            return _write(run, name, hit["order"], hit["cuts"], "cache",
                          {"schedule": name, "cache": "hit", "cached_from": hit.get("run"), "trace": [],
                           "chosen": {"cuts": hit["cuts"], "ms": hit.get("ms")}, "layout": buckets})
    d = run.spec_dict()
    warm = int(d["compressor"].get("start_iter") or 0)  # PowerSGD's plain all-reduces come before any window
    steps = steps_to_decide(spec) + warm
    search = lab.store.create(load_spec(data={**d, "name": f"{d['name']}: {name} search", "steps": steps,
                                              "eval_every": 0, "final_eval": False,
                                              "fault_tolerance": {"enabled": False}}), **run.inherited())
    search.mark_queued(supervisor=procs.identity(), tuning_for=run.id)
    say(f"schedule {name}: searching the buckets before the replicas start ({steps} steps, run {search.id})")
    state = launch(search, progress=False, should_cancel=should_cancel)
    if state != runfiles.State.DONE:
        raise LabError(f"schedule.name: the {name} search before the replicas (run {search.id}) ended {state}: "
                       f"{search.status().get('error') or 'see its log'}")
    path = search.file(runfiles.TUNING)
    info = json.loads(path.read_text()) if path.is_file() else {}
    if "tuning_steps" not in info or not info.get("layout"):
        raise LabError(f"schedule.name: the {name} search (run {search.id}) did not decide in {steps} steps")
    layout = info["layout"]
    order = [n for b in layout for n in b]
    cuts = list(itertools.accumulate(len(b) for b in layout))[:-1]
    return _write(run, name, order, cuts, search.id, {**info, "searched_in": search.id})


def _buckets(order, cuts) -> list:
    bounds = [0, *cuts, len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


def _write(run, name: str, order: list, cuts: list, source: str, info: dict) -> dict:
    part = {"schedule": name, "order": order, "cuts": cuts, "from": source}
    write_json_atomic(run.file(runfiles.PARTITION), part)
    path = run.file(runfiles.TUNING)  # beside strategy auto's record, if the advisor chose this schedule
    write_json_atomic(path, {**(json.loads(path.read_text()) if path.is_file() else {}), **info})
    return part
