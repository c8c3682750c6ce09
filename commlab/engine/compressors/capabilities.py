"""The two records of the compressor contract (commlab/engine/compressors/base.py): what a compressor declares
about itself, ``Capabilities``, and what it is told about the bucket it serves, ``BucketContext``.

Both are frozen dataclasses, made once (a class's record when the class is defined, a bucket's context when the
bucket is built) and read on every exchange.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Tuple

import torch

from commlab.engine.compressors import graphs

Tensor = torch.Tensor


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Capabilities:
    """What a compressor promises the rest of the lab, declared once instead of probed: one record, every field
    with a default that holds for a plain single-round compressor whose payloads add up. A class sets it as one
    class attribute, ``capabilities = Capabilities(summable=False)``; a subclass refines its parent's with
    ``dataclasses.replace(Parent.capabilities, ...)``; where parameters change a field (Count Sketch's ``exact``:
    two rounds), ``__init__`` sets the instance's own record the same way. Read it as ``c.capabilities.summable``.
    Each field says who reads it; ``commlab check compressor`` holds a class to every one of them."""

    summable: bool = True
    """Payloads from several ranks may be summed element-wise: the default exchange all-reduces them and decodes
    once; otherwise it all-gathers them and every rank decodes every rank's payload. Read by the exchanges, dear
    (``shard_path``), the New run form, the performance model's properties and the conformance checks."""
    keeps_shape: bool = False
    """The payload is one tensor with one element per input element, element i standing for input element i,
    and ``decompress`` decodes any contiguous slice of it to the same slice of the output: a reduce-scatter of
    summable payloads is then a reduce-scatter of the gradients. Read by dear (``shard_path`` "sum")."""
    identity: bool = False
    """The payload is the input itself and decoding returns it (no compression): the exchange is a plain sum,
    so the communicator lands the input already divided by the world size and runs one all-reduce with nothing
    after it (``commlab.engine.comm.exchange.Exchange.prescales``); the performance model gives it no cost
    curve. Implies ``summable``, ``keeps_shape`` and ``lossless``."""
    lossless: bool = False
    """Decoding gives the input back up to the wire dtype's rounding (the identity, the casts): error feedback
    would keep nothing worth keeping. Read by the advisor's accuracy penalty, the sweeps view and the checks."""
    rounds: int = 1
    """Collective rounds per exchange (PowerSGD: 2; Count Sketch with ``exact``: 2). Read by wfbp (multi-round
    buckets advance while backward runs), the DDP hook (which refuses more than one), dear and the checks."""
    builtin_feedback: bool = False
    """The method keeps its own residual (PowerSGD, DGC, EF-signSGD): ``error_feedback`` would apply it twice,
    so ``make(..., error_feedback=True)`` refuses it. Read by ``make``, the New run form and the checks."""
    builtin_momentum: bool = False
    """The method applies momentum itself (DGC's momentum correction, Signum's buffer): run the optimizer
    without momentum. Read by the accuracy benchmark and the docs."""
    counts_steps: bool = False
    """The instance counts its calls in an int attribute ``step`` (random-k's index seed, DGC's warm-up,
    PowerSGD's ``start_iter``): a rebuild of the buckets (commlab/engine/comm/core.py ``relayout``) carries it
    over."""
    steady_payload: bool = True
    """The payload's tensor sizes depend only on the bucket's layout, not on the values nor on how many
    exchanges came before (past ``warmup_exchanges``): one exchange shows every later one's sizes, so the
    performance model drives a layout once instead of twice. False where a threshold or a schedule sets how
    much is sent (threshold, DGC)."""
    fixed_payload: bool = False
    """Every rank's payload for a bucket has the same tensor sizes, which follow from the bucket's size alone
    (top-k's k values and indices, a quantizer's codes and scales): the exchanges all-gather it without first
    exchanging its shapes, one blocking round trip less per bucket. Only where that holds on every rank for
    every value: payloads whose sizes differ between ranks would not line up (``commlab check compressor``
    exchanges ragged and spiky inputs to check it). Read by the exchange driver
    (commlab.engine.comm.exchange.Exchange) and the performance model."""
    warmup_exchanges: int = 0
    """Exchanges at the start that send the bucket uncompressed, as one plain all-reduce (PowerSGD's
    ``start_iter``). Whoever measures steady-state payloads or costs (the performance model, the tuners, the
    checks) drives this many first, or calls the class's ``skip_warmup`` where it has one."""
    shard_codec: bool = False
    """Any contiguous slice of the input may be compressed on its own, every payload of a slice of n elements
    has the same tensor sizes on every rank, and any rank decodes another rank's payload of such a slice with its
    own ctx for a slice of n elements. Then dear's reduce-scatter can be an all-to-all of per-shard payloads,
    each rank decoding the payloads of its own shard and summing them in fp32 (ZeRO++'s quantized gradients;
    ``shard_path`` "alltoall")."""
    sum_overflows: bool = False
    """A sum of payloads over ranks can overflow where no rank's payload did (half precision saturates at
    65504): the exchanges, dear's included, divide each payload by the world size before the sum, as DDP's fp16
    hook does, instead of dividing the sum."""
    graphable: bool = False
    """A CUDA graph of ``compress`` may stand in for it (``COMMLAB_GRAPHS=1``, commlab/engine/compressors/graphs.py):
    for the same input address, shape and ``elementwise`` state addresses it launches the same GPU work, with no
    host synchronisation, no branch on the data and no noise seeded from the host per call, and keeps its state
    in tensors it updates in place (new ones only through ``load_state_dict`` into ``elementwise`` attributes,
    which the graphs' key follows). A class's ``graph_safe(t)`` method, where it has one, narrows it per input."""
    takes_bucket: bool = False
    """``compress`` takes the bucket's context as a second argument, ``compress(t, bucket)``, with a default for
    use on its own: its seeds derive from the bucket's index or this process's rank (random-k, the stochastic
    quantizers, Count Sketch's hashes, PowerSGD's first Q). False: ``compress(t)``. Read by whoever calls
    ``compress`` (``BucketContext.encode``, ``ErrorFeedback``, dear's shard codecs, the checks)."""
    dtypes: Tuple[torch.dtype, ...] = _FLOATS
    """The gradient dtypes it takes (the conformance checks exchange each of them): ``decompress`` returns the
    input's dtype."""
    elementwise: Tuple[str, ...] = ()
    """Attributes that hold per-element state in the bucket's flat shape (DGC's u and v, EF-signSGD's residual,
    Signum's momentum), None until the first step. When the buckets are rebuilt (commlab/engine/comm/core.py
    ``relayout``) this state is cut per parameter and reassembled in the new buckets, so it stays with its
    parameters; CUDA graphs key on their addresses. Other state (PowerSGD's factors and padded residual, random
    generators) starts afresh in a new bucket."""

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in (bool, "bool") and not isinstance(v, bool):
                raise TypeError(f"capabilities.{f.name}: must be True or False, got {v!r}")
        for k, lo in (("rounds", 1), ("warmup_exchanges", 0)):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise TypeError(f"capabilities.{k}: must be an integer >= {lo}, got {v!r}")
        dts = self.dtypes
        if not (isinstance(dts, tuple) and dts and all(isinstance(d, torch.dtype) for d in dts)):
            raise TypeError(f"capabilities.dtypes: must be a non-empty tuple of torch dtypes, got {self.dtypes!r}")
        if not (isinstance(self.elementwise, tuple) and all(isinstance(k, str) for k in self.elementwise)):
            raise TypeError(f"capabilities.elementwise: must be a tuple of attribute names, got {self.elementwise!r}")

    def shard_path(self) -> Optional[str]:
        """How dear reduce-scatters the gradients: "sum" (one round, summable, shape kept: the payload itself is
        reduce-scattered), "alltoall" (one round, a ``shard_codec``: each shard compressed alone, the payloads
        exchanged all-to-all, decoded and summed by the shard's owner), or None (``shard_problem`` says why)."""
        if self.rounds != 1:
            return None
        if self.summable and self.keeps_shape:
            return "sum"
        if self.shard_codec:
            return "alltoall"
        return None

    def shard_problem(self) -> Optional[str]:
        """Why dear could not reduce-scatter these payloads (``shard_path`` is None), or None."""
        if self.rounds != 1:
            return f"takes {self.rounds} rounds"
        if self.shard_path() is not None:
            return None
        if not self.summable:
            return "has payloads that cannot be summed"
        return "has a payload that does not keep the gradient's shape"


Layout = Tuple[Tuple[int, Tuple[int, ...]], ...]


@dataclass(frozen=True, eq=False)
class BucketContext:
    """Which bucket a compressor instance serves, passed in by whoever drives it (the communicator builds one per
    bucket, the DDP hook one per DDP bucket, the performance model and the checks their own) to ``exchange``,
    to dear's ``shard_exchange`` and, where ``Capabilities.takes_bucket`` says so, to ``compress``. The same
    object comes back at every step of a bucket; ``DEFAULT_BUCKET`` stands for a compressor used on its own."""

    index: int = 0
    """The bucket's index: seeds that every rank must share (random-k's indices, sketch hashes, PowerSGD's first
    Q) derive from it."""
    rank: int = 0
    """This process's rank: private random streams (stochastic rounding) mix it in; draws every rank must share
    must not."""
    layout: Optional[Layout] = None
    """(offset, shape) of each parameter tensor in the flat bucket, in order; None: one flat tensor. Compressors
    that exploit tensor structure (PowerSGD, per tensor) read it."""
    feedback: Optional["ErrorFeedback"] = None
    """The error feedback wrapped around the compressor, set by ``ErrorFeedback`` on the context it hands the
    compressor it wraps: ``encode`` applies it."""

    def __post_init__(self):
        if self.layout is not None and not isinstance(self.layout, tuple):
            object.__setattr__(self, "layout", tuple((int(o), tuple(s)) for o, s in self.layout))

    def encode(self, codec, t: Tensor) -> tuple:
        """``codec``'s payload and ctx for ``t``: ``compress`` (given this context where the codec
        ``takes_bucket``), with error feedback applied where it wraps the codec, replayed from a CUDA graph where
        one is wanted (commlab/engine/compressors/graphs.py). Exchanges call this instead of ``compress``."""
        fb = self.feedback
        if fb is not None:
            return fb.encode(t, self)
        return graphs.compress(codec, t, self)


DEFAULT_BUCKET = BucketContext()
"""Bucket 0 of rank 0, no layout, no error feedback: a compressor used on its own."""
