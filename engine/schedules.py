"""Fusion schedules: pure functions from parameters to buckets.

A schedule gets the parameters in the order their gradients are expected to
be ready (reverse registration order until measured otherwise) and returns a
list of buckets, each a list of positions into that list. It runs no
collective and touches no tensor data, so it is tested with fake parameters.

Every schedule keeps the order: buckets are contiguous runs of the input, and
together they cover it exactly once. A bucket never mixes dtypes or devices,
because it becomes one flat buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

MB = 2 ** 20
FIRST_BUCKET_MB = 1.0
"""The first bucket is capped small, as in DDP, so the first collective starts early in backward."""


@dataclass(frozen=True)
class ParamInfo:
    name: str
    numel: int
    element_size: int
    dtype: str = "float32"
    device: str = "cpu"
    backward_s: Optional[float] = None
    """Measured time from the start of backward to this gradient being ready, where known."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


Buckets = List[List[int]]


def _split_kind(params: Sequence[ParamInfo]) -> Buckets:
    """Contiguous runs of one dtype and device: the hard constraint on any bucket."""
    runs: Buckets = []
    for i, p in enumerate(params):
        if runs and (params[runs[-1][-1]].dtype, params[runs[-1][-1]].device) == (p.dtype, p.device):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def layerwise(params: Sequence[ParamInfo]) -> Buckets:
    """One bucket per parameter tensor."""
    return [[i] for i in range(len(params))]


def allinone(params: Sequence[ParamInfo]) -> Buckets:
    """The whole model as one bucket (one per dtype/device run)."""
    return _split_kind(params)


def bucket(params: Sequence[ParamInfo], cap_mb: float = 25.0,
           first_cap_mb: Optional[float] = FIRST_BUCKET_MB) -> Buckets:
    """Fixed byte cap, as DDP and Horovod do: a bucket closes as soon as it
    holds at least the cap. The first bucket uses ``min(first_cap_mb, cap_mb)``."""
    if cap_mb <= 0:
        raise ValueError(f"cap_mb: must be > 0, got {cap_mb}")
    out: Buckets = []
    for run in _split_kind(params):
        cur: List[int] = []
        size = 0
        for i in run:
            cur.append(i)
            size += params[i].nbytes
            cap = cap_mb if out or first_cap_mb is None else min(cap_mb, first_cap_mb)
            if size >= cap * MB:
                out.append(cur)
                cur, size = [], 0
        if cur:
            out.append(cur)
    return out


SCHEDULES: Dict[str, Callable[..., Buckets]] = {
    "layerwise": layerwise,
    "allinone": allinone,
    "bucket": bucket,
}


def build(name: str, params: Sequence[ParamInfo], **options) -> Buckets:
    if name not in SCHEDULES:
        raise ValueError(f"schedule.name: unknown schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
    buckets = SCHEDULES[name](params, **options)
    check(buckets, params)
    return buckets


def check(buckets: Buckets, params: Sequence[ParamInfo]) -> None:
    """The contract every schedule keeps; fails loudly if broken."""
    flat = [i for b in buckets for i in b]
    if flat != list(range(len(params))):
        raise AssertionError(f"buckets must be contiguous and cover every parameter once, got {buckets}")
    for b in buckets:
        if not b:
            raise AssertionError("empty bucket")
        kinds = {(params[i].dtype, params[i].device) for i in b}
        if len(kinds) != 1:
            raise AssertionError(f"bucket {b} mixes dtypes/devices {kinds}")
