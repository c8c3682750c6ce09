"""Tuners: objects fed measurements that choose bucket layouts, run by one driver.

- ``driver``: the loop every tuner shares (``Tuning``: propose, report, decide on rank 0,
  broadcast, relayout) and the ``Tuner`` base class a new tuner subclasses, in one file.
- ``mergecomp``: MergeComp's online search of the split points of the gradient buffer.
- ``layerfusion``: LayerFusion's layout from measured ready times and a fitted per-call cost.
- ``capsearch``: dear's buffer-cap search (``comm.tune``).

The searches themselves (``MergeCompSearch``, ``LayerFusionTuner``, ``CapTuner``) are pure: no
collectives, no clocks, so they are tested on fake timings.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

from commlab.engine.tuners.capsearch import CapSearch
from commlab.engine.tuners.driver import Tuner, Tuning
from commlab.engine.tuners.layerfusion import LayerFusion
from commlab.engine.tuners.mergecomp import MergeComp

TUNERS: Dict[str, Type[Tuner]] = {t.name: t for t in (MergeComp, LayerFusion, CapSearch)}


def tuner_name(spec) -> Optional[str]:
    """The tuner a spec asks for, or None."""
    if spec.comm.mode == "dear":
        return CapSearch.name if spec.comm.tune else None
    return spec.schedule.name if spec.schedule.name in TUNERS else None


def steps_to_decide(spec) -> Optional[int]:
    """At most how many steps the tuner ``spec`` asks for searches before it decides (after the compressor's
    warm-up exchanges), or None: no tuner, or one whose search has no bound known in advance."""
    name = tuner_name(spec)
    return None if name is None else TUNERS[name].steps_to_decide(spec)


def start(spec, comm, run_dir: Optional[str], timeline, group=None, on_layout=None, log=None) -> Optional[Tuning]:
    """The driver of the tuner ``spec`` asks for (on every rank alike), or None when nothing is tuned.
    Collective: rank 0 may apply a first layout at once (a cached partition, a first trial cap)."""
    name = tuner_name(spec)
    if name is None:
        return None
    return Tuning(TUNERS[name](spec, comm, run_dir), comm, run_dir, timeline, group, on_layout, log)

