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


def from_cuts(params: Sequence[ParamInfo], cuts: Sequence[int]) -> Buckets:
    """Contiguous groups that end before each cut: ``cuts`` are positions 0 < c < n in
    increasing order (a group never spans a dtype/device change, which adds a cut)."""
    n = len(params)
    cuts = sorted(set(int(c) for c in cuts))
    if any(not 0 < c < n for c in cuts):
        raise ValueError(f"cuts: every cut must be in 1..{n - 1}, got {cuts}")
    kind = [run[0] for run in _split_kind(params)][1:]
    bounds = [0] + sorted(set(cuts) | set(kind)) + [n]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def balanced_cuts(params: Sequence[ParamInfo], k: int) -> List[int]:
    """Cuts for ``k`` contiguous groups of roughly equal bytes (fewer if there are fewer tensors):
    a group closes once it reaches its share of the bytes still left."""
    n = len(params)
    k = max(1, min(k, n))
    cuts: List[int] = []
    left = sum(p.nbytes for p in params)
    size, groups_left = 0, k
    for i, p in enumerate(params):
        size += p.nbytes
        rest = n - i - 1
        if groups_left > 1 and rest >= groups_left - 1 and (size >= left / groups_left or rest == groups_left - 1):
            cuts.append(i + 1)
            left -= size
            size, groups_left = 0, groups_left - 1
    return cuts


@dataclass(frozen=True)
class CallCost:
    """The fitted cost of one bucket's exchange, split by where it runs.

    ``fixed + per_byte * raw bytes`` seconds on the channel: the collective (its
    latency alpha, and beta times the payload, which is the compression ratio
    times the raw bytes). ``compute_fixed + compute_per_byte * raw bytes`` on the
    training thread: compress and decode, which in ``wfbp`` run in the gradient
    hooks and so delay the rest of backward."""
    fixed: float
    per_byte: float
    compute_fixed: float = 0.0
    compute_per_byte: float = 0.0

    def __call__(self, nbytes: float) -> float:
        return self.fixed + self.per_byte * nbytes

    def compute(self, nbytes: float) -> float:
        return self.compute_fixed + self.compute_per_byte * nbytes

    @property
    def per_call(self) -> float:
        """What one more call costs regardless of its size."""
        return self.fixed + self.compute_fixed


def simulate(params: Sequence[ParamInfo], buckets: Buckets, ready: Sequence[float], cost: CallCost) -> float:
    """When the last bucket's exchange ends. ``ready`` is each position's gradient ready time
    (seconds from the start of backward, without any compression in between). A bucket is
    compressed on the training thread once its last gradient is ready, which delays every
    later gradient by that time; its collective then runs on one channel, after the
    previous one has ended."""
    free = shift = 0.0
    for b in buckets:
        nbytes = sum(params[i].nbytes for i in b)
        compressed = max(ready[i] for i in b) + shift + cost.compute(nbytes)
        shift += cost.compute(nbytes)
        free = max(free, compressed) + cost(nbytes)
    return free


def layerfusion(params: Sequence[ParamInfo], ready: Optional[Sequence[float]] = None,
                cost: Optional[CallCost] = None) -> Buckets:
    """LayerFusion's merge rule (Sketch-Fusion SGD, Dai et al. 2024), as reconstructed here.

    The paper states the idea (fuse layers from measured backward times and a
    fitted alpha-beta cost, no hyperparameters) but not its exact rule; this is
    our reconstruction. Walk the gradients in ready order (last layer first).
    The open bucket ends at the current gradient; the next gradient joins it
    unless sending the open bucket alone (1) starts its collective earlier and
    (2) saves more than the extra call's fixed costs (the collective's latency
    and the compressor's per-call cost, which also delays the rest of backward).
    (2) is judged end to end by the cost model (``simulate``: one channel for
    collectives, compression on the training thread): closing here must end
    the exchanges sooner than keeping the bucket open, with the rest merged,
    and sooner than closing it at any later gradient instead (a one-cut
    look-ahead: without it the walk closes a bucket one gradient before a
    burst ends). So the rule is never worse than one bucket under the model,
    and has no hyperparameter.

    Without a profile (``ready``/``cost`` None) it falls back to one bucket per
    dtype/device run, as all gradients are then taken to be ready at once.
    """
    if ready is None or cost is None:
        return allinone(params)
    if len(ready) != len(params):
        raise ValueError(f"ready: one time per parameter expected ({len(params)}), got {len(ready)}")
    runs = _split_kind(params)
    out: Buckets = []
    for r, run in enumerate(runs):
        later = runs[r + 1:]
        start = 0
        for j in range(1, len(run)):
            if ready[run[j]] <= ready[run[j - 1]]:  # ready no later: sending alone would not start earlier
                continue

            def end_if_cut_at(k):  # the open bucket closes before run[k] (k = len(run): never), the rest merged
                head = out + [run[start:k]]
                return simulate(params, head + ([run[k:]] if k < len(run) else []) + later, ready, cost)
            here = end_if_cut_at(j)
            if here < end_if_cut_at(len(run)) and all(here <= end_if_cut_at(k) for k in range(j + 1, len(run))):
                out.append(run[start:j])
                start = j
        out.append(run[start:])
    return out


SCHEDULES: Dict[str, Callable[..., Buckets]] = {
    "layerwise": layerwise,
    "allinone": allinone,
    "bucket": bucket,
    # the tuned schedules start from one bucket; their tuners (commlab/engine/tuners/) relayout later
    "mergecomp": lambda params, **_: allinone(params),
    "layerfusion": layerfusion,
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


# --------------------------------------------------------------------------- DeAR's buffer layouts

def layout_cap(params: Sequence[ParamInfo], cap_mb: float) -> List[List[int]]:
    """Buffers closed at a byte cap (the bucket schedule, first buffer capped small as in DDP)."""
    return build("bucket", params, cap_mb=cap_mb)


def layer_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def layout_layers(params: Sequence[ParamInfo], layers: int) -> List[List[int]]:
    """Buffers of ``layers`` nearby layers each (a layer: the tensors of one module,
    e.g. a weight and its bias), never mixing dtypes or devices."""
    if layers < 1:
        raise ValueError(f"layers: must be >= 1, got {layers}")
    out: List[List[int]] = []
    for run in _split_kind(params):
        cur: List[int] = []
        seen: List[str] = []
        for i in run:
            lay = layer_of(params[i].name)
            if lay not in seen[-1:]:
                if len(seen) == layers:
                    out.append(cur)
                    cur, seen = [], []
                seen.append(lay)
            cur.append(i)
        if cur:
            out.append(cur)
    check(out, params)
    return out
