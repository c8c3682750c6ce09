"""What the rest of the engine asks of a compressor beyond ``compress``, ``decompress`` and ``exchange``, in one
place: the optional methods a class may define where it can say more, with the default where it does not; the
per-element state a relayout moves; and dear's sharded exchange.

The optional methods (none is on ``commlab.Compressor``; a class defines the ones it has):

- ``declared_rounds(n, element_size, bucket)``: (op, payload bytes, tensors) of each round one steady exchange of
  a bucket of ``n`` elements sends, declared without running it (the performance model; the tests hold every
  declaration to the driven rounds). Default: None, the exchange is driven to find out.
- ``declared_shard_rounds(n, element_size, bucket)``: the same for dear's sharded exchange. Default: the one round
  of ``declared_rounds``, as a reduce-scatter ("sum") or an all-to-all ("alltoall").
- ``per_tensor(n, bucket)``: True when the instance compresses a bucket tensor by tensor from ``bucket.layout``
  (PowerSGD), so its payload depends on the layout, not the size alone. Default: False.
- ``skip_warmup()``: go straight to the steady state, as if the ``warmup_exchanges`` plain exchanges had been
  sent. Default: nothing to skip; a class that declares warm-up exchanges without it is driven through them.
- ``graph_safe(t)``: narrows ``Capabilities.graphable`` per input (commlab/engine/compressors/graphs.py).
- ``shard_exchange(t, world_size, rank, bucket)``: dear's exchange, in place of ``shard_exchange`` below.

Each function here takes a compressor as the lab holds it, ``ErrorFeedback`` included: the wrapper's optional
methods are its inner compressor's, called with the context that carries the feedback.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from commlab.engine.compressors.base import Compressor, ErrorFeedback, Exchange, Round
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext

Tensor = torch.Tensor
Rounds = Optional[List[Tuple[str, int, int]]]


def unwrap(c: Compressor) -> Compressor:
    """The compressor itself: ``c``, or the one its error feedback wraps."""
    return c.inner if isinstance(c, ErrorFeedback) else c


def _split(c: Compressor, bucket: BucketContext) -> Tuple[Compressor, BucketContext]:
    """The inner compressor and the context it is driven with (its feedback set where ``c`` wraps it)."""
    if isinstance(c, ErrorFeedback):
        return c.inner, c.fed(bucket)
    return c, bucket


def compress(c: Compressor, t: Tensor, bucket: BucketContext = DEFAULT_BUCKET) -> tuple:
    """``c.compress(t)``, given ``bucket`` where ``c`` takes it (``Capabilities.takes_bucket``)."""
    return c.compress(t, bucket) if c.capabilities.takes_bucket else c.compress(t)


def declared_rounds(c: Compressor, n: int, element_size: int, bucket: BucketContext = DEFAULT_BUCKET) -> Rounds:
    """``c``'s own ``declared_rounds`` (the module's text), or None."""
    own = getattr(unwrap(c), "declared_rounds", None)
    return own(n, element_size, bucket) if own is not None else None


def declared_shard_rounds(c: Compressor, n: int, element_size: int,
                          bucket: BucketContext = DEFAULT_BUCKET) -> Rounds:
    """The rounds of dear's exchange of a buffer of ``n`` elements on one rank: ``c``'s own
    ``declared_shard_rounds``, else the one round ``declared_rounds`` declares, as the op "reduce_scatter"
    ("sum") or "all_to_all" ("alltoall") with the same bytes and tensors; None where that does not tell."""
    inner = unwrap(c)
    own = getattr(inner, "declared_shard_rounds", None)
    if own is not None:
        return own(n, element_size, bucket)
    path = inner.capabilities.shard_path()
    rounds = declared_rounds(inner, n, element_size, bucket) if path is not None else None
    if rounds is None or len(rounds) != 1:
        return None
    (_, size, k), = rounds
    return [("reduce_scatter" if path == "sum" else "all_to_all", size, k)]


def per_tensor(c: Compressor, n: int, bucket: BucketContext = DEFAULT_BUCKET) -> bool:
    """Whether ``c`` compresses a bucket of ``n`` elements tensor by tensor from ``bucket.layout``."""
    own = getattr(unwrap(c), "per_tensor", None)
    return bool(own(n, bucket)) if own is not None else False


def skip_warmup(c: Compressor) -> None:
    """Put ``c`` past its warm-up exchanges without sending them (its own ``skip_warmup``). A class that declares
    ``warmup_exchanges`` without one raises NotImplementedError: whoever needs the steady state drives them."""
    inner = unwrap(c)
    own = getattr(inner, "skip_warmup", None)
    if own is not None:
        own()
    elif inner.capabilities.warmup_exchanges:
        raise NotImplementedError(f"{inner.name}: declares warm-up exchanges but not how to skip them")


# --------------------------------------------------------------------------- per-element state

def elementwise_state(c: Compressor) -> Dict[str, Optional[Tensor]]:
    """The per-element state by name, in the bucket's flat shape (``Capabilities.elementwise``; the error
    feedback's residual as ``ef.residual``): what a relayout cuts per parameter and moves."""
    inner = unwrap(c)
    out = {"ef.residual": c.residual} if inner is not c else {}
    out.update({k: getattr(inner, k) for k in inner.capabilities.elementwise})
    return out


def load_elementwise_state(c: Compressor, state: Dict[str, Optional[Tensor]]) -> None:
    """Set what ``elementwise_state`` gave (a name the compressor does not keep is dropped)."""
    inner = unwrap(c)
    for k, v in state.items():
        if k == "ef.residual":
            if inner is not c:
                c.residual = v
        elif k in inner.capabilities.elementwise:
            setattr(inner, k, v)


# --------------------------------------------------------------------------- dear

def encode_parts(c: Compressor, t: Tensor, parts: int, bucket: BucketContext = DEFAULT_BUCKET) -> List[tuple]:
    """A ``shard_codec``'s encode for dear: the flat ``t`` (numel a multiple of ``parts``) cut into ``parts``
    equal slices, each compressed on its own; [(payload, ctx)] per slice. Error feedback, where it wraps ``c``,
    covers the whole of ``t``: the residual keeps ``t``'s shape, as in a whole exchange."""
    inner, bucket = _split(c, bucket)
    if not inner.capabilities.shard_codec:
        raise ValueError(f"{inner.name}: not a shard codec; its slices cannot be compressed on their own")
    if t.numel() % parts:
        raise ValueError(f"encode_parts: {t.numel()} elements do not split into {parts} equal parts")
    fb = bucket.feedback
    x = t if fb is None else fb.add(t)
    out = [compress(inner, s, bucket) for s in x.reshape(parts, -1)]
    if fb is not None:
        fb.update(x, torch.cat([inner.decompress(p, ctx).reshape(-1) for p, ctx in out]))
    return out


def shard_exchange(c: Compressor, t: Tensor, world_size: int, rank: int,
                   bucket: BucketContext = DEFAULT_BUCKET) -> Exchange:
    """dear's exchange: ``t`` (flat, its numel a multiple of ``world_size``) averaged over ranks, this rank ending
    with its shard, elements ``[rank * s, (rank + 1) * s)`` of the average, s = numel / world_size, in ``t``'s
    dtype. ``c``'s own ``shard_exchange`` where it has one; else, by ``Capabilities.shard_path``:

    - "sum": the payload of the whole ``t`` (error feedback included) is reduce-scattered as it is and this
      rank decodes its chunk of the sum with the whole buffer's ctx (``keeps_shape``); divided by the world size
      before the sum where ``sum_overflows``, else after decoding;
    - "alltoall": ``encode_parts`` cuts ``t`` into one slice per rank, each compressed on its own (a
      ``shard_codec``); slice j's payload goes to rank j in one all-to-all, and this rank decodes the payloads
      of its own slice, sums them in fp32 and divides by the world size.

    A generator of Rounds ("reduce_scatter", "all_to_all"), as ``exchange`` is; ``capabilities.shard_problem()``
    says whether dear takes ``c`` at all."""
    inner, bucket = _split(c, bucket)
    own = getattr(inner, "shard_exchange", None)
    if own is not None:
        return own(t, world_size, rank, bucket)
    return _shard_exchange(inner, t, world_size, rank, bucket)


def _shard_exchange(c: Compressor, t: Tensor, world_size: int, rank: int, bucket: BucketContext) -> Exchange:
    caps = c.capabilities
    path = caps.shard_path()
    if path == "sum":
        payload, ctx = bucket.encode(c, t)
        if len(payload) != 1 or payload[0].numel() != t.numel():
            raise RuntimeError(f"dear: {c.name} declares keeps_shape but sent {len(payload)} tensors "
                               f"of {[x.numel() for x in payload]} elements for a buffer of {t.numel()}")
        wire = payload[0]
        if caps.sum_overflows:
            wire = wire / world_size if wire is t else wire.div_(world_size)  # never scale the caller's t
        (shard,) = yield Round("reduce_scatter", [wire])
        out = c.decompress([shard], ctx)
        if not caps.sum_overflows:
            out = out.div_(world_size) if out is shard else out / world_size
        return out
    if path == "alltoall":
        parts = encode_parts(c, t, world_size, bucket)
        layout = [[(x.dtype, x.shape) for x in p] for p, _ in parts]
        if any(s != layout[0] for s in layout[1:]):
            raise RuntimeError(f"dear: {c.describe()} declares shard_codec but its shards' payloads differ in size")
        got = yield Round("all_to_all", [], parts=[p for p, _ in parts])
        ctx = parts[rank][1]  # a slice's ctx decodes every rank's payload of that slice
        acc = torch.zeros(t.numel() // world_size, dtype=torch.float32, device=t.device)
        for p in got:
            acc.add_(c.decompress(p, ctx).reshape(-1).float())
        return acc.div_(world_size).to(t.dtype)
    raise ValueError(f"dear: {c.name} {caps.shard_problem()}")
