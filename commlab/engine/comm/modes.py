"""The comm modes by name (a spec's ``comm.mode``), every one built with the same arguments:

    dp = make("wfbp", model, layout, Plan.of("topk", ratio=0.01), timeline=tl, group=group, link=link)

``layout`` gives the buckets (a schedule for sync and wfbp, dear's buffers by cap or by layers), ``plan``
each bucket's compressor (commlab/engine/compressors/plan.py)."""
from __future__ import annotations

from typing import Callable, Dict, List, Type, Union

import torch

from commlab.engine.comm.core import Communicator
from commlab.engine.comm.dear import DeAR
from commlab.engine.comm.wfbp import WFBP, Sync
from commlab.engine.compressors.base import Compressor
from commlab.engine.compressors.plan import Plan
from commlab.engine.schedules import ParamInfo
from commlab.engine.spec import COMM_AVAILABLE

_BY_MODE = {cls.mode: cls for cls in (Sync, WFBP, DeAR)}
MODES: Dict[str, Type[Communicator]] = {mode: _BY_MODE[mode] for mode in COMM_AVAILABLE}
"""Each comm mode a spec may name (commlab.engine.spec.COMM_AVAILABLE, the one list of them) -> the class that
implements it (its ``mode``); a name without a class fails here, at import."""


def make(mode: str, model: torch.nn.Module, layout: Callable[[List[ParamInfo]], List[List[int]]],
         plan: Union[Plan, Callable[[], Compressor]], **kw) -> Communicator:
    """The communicator of comm mode ``mode``; ``kw``: timeline, group, link, broadcast_from_rank0."""
    if mode not in MODES:
        raise ValueError(f"comm.mode: {mode!r} is not a comm mode; allowed: {', '.join(MODES)}")
    return MODES[mode](model, layout, plan, **kw)
