"""The compressor seam.

A compressor turns one bucket's flat gradient into a payload (a list of tensors) and back. It never calls a
collective. The communicator (commlab/engine/comm/, through commlab/engine/comm/exchange.py) drives
``exchange``, a generator that yields ``Round``s; the communicator carries out each round's collective and sends
the result back in. Single-round compressors only implement ``compress``/``decompress`` and inherit the default
``exchange``:

- ``summable`` payloads are all-reduced (summed) and decoded once;
- the others are all-gathered and every rank decodes every rank's payload.

Multi-round protocols (PowerSGD's two all-reduces) override ``exchange`` and yield several rounds; they still
never touch a process group.

The contract is narrow. A class gives ``compress``, ``decompress`` and its declared ``params``, and, where the
defaults do not hold, one ``Capabilities`` record (what the exchanges, dear, the performance model and CUDA graphs
read: each field says who). Everything that differs from bucket to bucket is passed in, never written onto the
instance: the ``BucketContext`` (which bucket, this process's rank, the layout) reaches ``exchange`` and, where
the class declares ``takes_bucket``, ``compress``; both records are in commlab/engine/compressors/capabilities.py.
The bytes an exchange put on the wire are counted by the exchange driver
(``commlab.engine.comm.exchange.Exchange.sent``). Error feedback is ``ErrorFeedback``, a compressor that wraps
another and keeps the residual. The hooks a few compressors add for the performance model and dear
(``declared_rounds``, ``per_tensor``, ``skip_warmup``, ``graph_safe``, ``shard_exchange``) are optional methods,
asked for through commlab/engine/compressors/contract.py, which also holds dear's sharded exchange.

One instance serves one bucket and owns that bucket's state (residuals, warm-started factors, hash seeds), which
``state_dict``/``load_state_dict`` checkpoint. A class written to the earlier contract (capabilities as class
attributes, ``self.bucket``, ``self.layout``, ``self.ef``, ``self.encode``) keeps working through
commlab/engine/compressors/legacy.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Generator, List, Optional, Tuple

import torch

from commlab.engine.compressors import legacy
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext, Capabilities
from commlab.engine.compressors.params import Param, take

Tensor = torch.Tensor


@dataclass
class Round:
    """One collective the communicator must run for a compressor.

    op: "allreduce" sums ``tensors`` over ranks (the reply is the list of
        summed tensors, same shapes); "allgather" collects every rank's list
        (the reply is a list with one payload list per rank; sizes may differ
        between ranks and a payload may be empty); "reduce_scatter" sums
        ``tensors``, one flat tensor whose numel is a multiple of the world
        size, and rank r gets chunk r of the sum (the reply is [that chunk]);
        "all_to_all" sends ``parts[j]`` to rank j (``tensors`` is empty; every
        part has the same tensor sizes, on every rank) and the reply is
        [the payload from rank 0, the payload from rank 1, ...].
    The last two are the rounds of a sharded exchange (dear's: commlab/engine/compressors/contract.py).
    """
    op: str
    tensors: List[Tensor]
    parts: Optional[List[List[Tensor]]] = None
    alike: bool = False
    """Set by the exchange driver (commlab.engine.comm.exchange.Exchange), not by a compressor: the round is an
    all-gather of a compressor that declares ``fixed_payload``, so every rank's payload has this rank's tensor
    sizes and the all-gather needs no exchange of shapes before it."""


Exchange = Generator[Round, Any, Tensor]


def nbytes(tensors: List[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def round_bytes(rnd: Round) -> int:
    """The payload bytes this rank puts on the wire for ``rnd`` (an all-to-all: every destination's part)."""
    if rnd.parts is None:
        return nbytes(rnd.tensors)
    return sum(nbytes(p) for p in rnd.parts)


class Compressor:
    """The base class of every compressor, built-in or yours. Subclass it in your own file, name the class
    in a spec by import path, and check it like the built-ins:

        compressor: {name: mypkg.codecs:ScaledSign, scale: 1.0}      # a job spec
        commlab check compressor mypkg.codecs:ScaledSign --param scale=0.5

    The minimum: ``compress``, ``decompress`` and the declared ``params``, plus a ``Capabilities`` record where its
    defaults do not hold (``summable=False`` unless the sum of several ranks' payloads decodes to the sum of what
    they stand for). For example, signs and one mean magnitude:

        import torch
        from commlab import Capabilities, Compressor, Param

        class ScaledSign(Compressor):
            # each element's sign and the bucket's mean magnitude: about a quarter of fp32's bytes
            capabilities = Capabilities(summable=False)  # magnitudes differ by rank: all-gathered, decoded per rank
            params = (Param("scale", float, 1.0, "multiplies the decoded magnitude", lo=0, lo_open=True),)

            def compress(self, t):             # t: one bucket's gradient, any float dtype
                mag = t.abs().mean().reshape(1) if t.numel() else t.new_zeros(1)
                return [torch.sign(t).to(torch.int8), mag], (t.shape, t.dtype)

            def decompress(self, payload, ctx):
                signs, mag = payload
                shape, dtype = ctx
                return (signs.to(dtype) * (mag.to(dtype) * self.scale)).view(shape)

    ``compress(t) -> (payload, ctx)``: the payload is a list of tensors (what crosses the wire), ``ctx`` stays
    on this rank; ``decompress(payload, ctx)`` returns a tensor of ``t``'s shape, dtype and device, and must
    decode another rank's payload with this rank's ``ctx`` (so keep rank-specific values in the payload).
    Never call a collective: the exchange driver (commlab/engine/comm/exchange.py) does, from the ``Round`` s that
    ``exchange`` yields, and counts the bytes each round sends. Each declared ``Param`` is checked by ``__init__``
    and stored as an attribute of the same name (``self.scale``); the spec, the New run form and ``--param`` read
    the same declaration.

    What the rest of the lab needs to know (all-gathered or summed, shardable for dear, graphable, warm-up
    exchanges, per-element state, ...) is the ``Capabilities`` record; each field documents who reads it. Which
    bucket an instance serves, this process's rank and the bucket's layout are a ``BucketContext`` passed in:
    to ``exchange(t, world_size, bucket)`` and, with ``Capabilities(takes_bucket=True)``, to ``compress(t, bucket)``
    (seeds shared by every rank derive from ``bucket.index``). State that must survive a checkpoint goes in
    ``state_dict``/``load_state_dict``. Several rounds per step (PowerSGD): override ``exchange``, get the
    payload with ``bucket.encode(self, t)`` (error feedback inside), then yield each ``Round`` and receive its
    result. A few optional methods serve the performance model and dear where a class can say more
    (``declared_rounds``, ``per_tensor``, ``skip_warmup``, ``graph_safe``, ``shard_exchange``:
    commlab/engine/compressors/contract.py).

    ``error_feedback: true`` wraps any compressor that does not declare ``builtin_feedback`` in ``ErrorFeedback``.
    Without a ``name`` of its own a subclass is named by its import path (``mypkg.codecs:ScaledSign``);
    ``commlab.engine.compressors.register`` (``commlab.register_compressor``) files it under a short name as the
    built-ins are. ``commlab check compressor`` (commlab/engine/compressors/conformance.py) holds a class to every
    one of these promises, at two and three simulated ranks.
    """
    name = "base"
    params: Tuple[Param, ...] = ()
    """The keyword parameters, declared once (commlab/engine/compressors/params.py)."""
    capabilities: Capabilities = Capabilities()
    """What the class promises (``Capabilities``); an instance whose parameters change it holds its own."""

    def __init__(self, **given):
        checked = take(self.name, self.params, given)
        for k, v in checked.items():
            setattr(self, k, v)
        self.given = {k: checked[k] for k in given}
        """The parameters given explicitly, as checked (what ``describe`` names)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:  # what a spec calls it when it is not registered under a short name
            cls.name = f"{cls.__module__}:{cls.__qualname__}"
        problem = declaration_problem(cls)
        if problem:
            raise TypeError(f"{cls.name}: {problem}")
        legacy.adapt(cls)  # a class written to the earlier contract keeps working

    def compress(self, t: Tensor) -> tuple[List[Tensor], Any]:
        """``(payload, ctx)`` for ``t``: the tensors that cross the wire and what stays on this rank to decode them
        (``compress(t, bucket)`` in a class that declares ``Capabilities(takes_bucket=True)``)."""
        raise NotImplementedError

    def decompress(self, payload: List[Tensor], ctx: Any) -> Tensor:
        """What ``payload`` (this rank's, another rank's, or a sum of them where ``summable``) stands for, in
        ``t``'s shape, dtype and device, decoded with this rank's ``ctx``."""
        raise NotImplementedError

    def exchange(self, t: Tensor, world_size: int, bucket: BucketContext = DEFAULT_BUCKET) -> Exchange:
        """Average ``t`` over ranks through compressed collectives.

        Yields Rounds, receives their results, returns the averaged tensor (same shape, dtype and device as
        ``t``; it may be ``t`` itself). ``bucket``: the bucket this instance serves (``BucketContext``); its
        ``encode`` compresses, with error feedback where it is on.
        """
        payload, ctx = bucket.encode(self, t)
        if self.capabilities.summable:
            summed = yield Round("allreduce", payload)
            out = self.decompress(summed, ctx)
            return out.div_(world_size)
        gathered = yield Round("allgather", payload)
        out = self.decompress(gathered[0], ctx).clone()
        for p in gathered[1:]:
            out.add_(self.decompress(p, ctx))
        return out.div_(world_size)

    # state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """This bucket's state; subclasses with state of their own extend it."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Load what ``state_dict`` gave; subclasses with state of their own extend it."""

    def describe(self) -> str:
        """The instance as a spec names it: ``name(param=value,...)`` with the parameters given explicitly (the
        key commlab.lab.strategy.perfmodel.calibrate.compressor_key gives a spec's compressor section; error
        feedback adds ``+EF``)."""
        ps = ",".join(f"{k}={v}" for k, v in sorted(self.given.items()))
        return f"{self.name}{'(' + ps + ')' if ps else ''}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


RESERVED = ("error_feedback", "name", "params", "per_bucket", "below_mb")
"""Keys of a spec's compressor section that are not the compressor's parameters."""


def declaration_problem(cls) -> Optional[str]:
    """What is wrong with a class's declaration, or None (checked when a subclass is defined)."""
    ps = cls.params
    if not isinstance(ps, tuple) or not all(isinstance(p, Param) for p in ps):
        return "params must be a tuple of commlab.engine.compressors.params.Param (commlab.Param)"
    seen = [p.name for p in ps]
    dup = next((n for n in seen if seen.count(n) > 1), None)
    if dup:
        return f"params declares {dup!r} twice"
    clash = next((n for n in seen if n in RESERVED), None)
    if clash:
        return f"params may not declare {clash!r}: a spec's compressor section uses that key itself"
    caps = cls.__dict__.get("capabilities")
    if caps is not None and not isinstance(caps, Capabilities) and not hasattr(caps, "__get__"):
        return (f"capabilities must be a commlab.Capabilities record, got {type(caps).__name__}: "
                f"capabilities = Capabilities(summable=False, ...)")
    return None


class ErrorFeedback(Compressor):
    """Error feedback around another compressor (Seide et al. 2014; Karimireddy et al. 2019).

        c = ErrorFeedback(make("topk", ratio=0.01))     # what make("topk", ratio=0.01, error_feedback=True) gives

    Before compressing, add what earlier steps dropped: c = g + e. After compressing, keep what this step drops:
    e = c - decode(compress(c)). The residual is this wrapper's state, per bucket, in the bucket's flat shape
    (``residual``), checkpointed under ``"ef"`` beside the inner compressor's own state. The wrapper is itself a
    compressor: the communicator drives it as any other, and it runs the inner compressor's own exchange with a
    ``BucketContext`` whose ``feedback`` is this wrapper, so ``encode`` there corrects the input and keeps the
    residual. Its capabilities are the inner compressor's, except that it is no ``identity`` (the payload is the
    corrected input) and not ``graphable`` (the residual's update is outside ``compress``). Reading any other
    attribute falls through to the inner compressor (``c.ratio``, ``c.step``); setting one does not."""

    def __init__(self, inner: Compressor):
        if not isinstance(inner, Compressor) or isinstance(inner, ErrorFeedback):
            raise ValueError(f"error_feedback: wraps one compressor instance, got {type(inner).__name__}")
        caps = inner.capabilities
        if caps.builtin_feedback:
            raise ValueError(f"error_feedback: {inner.name} keeps its own residual already; leave error_feedback off")
        self.inner = inner
        """The compressor whose input is corrected."""
        self.name = inner.name
        self.capabilities = replace(caps, identity=False, graphable=False)
        self.residual: Optional[Tensor] = None
        """What compression has dropped so far; None until the first step."""
        self._takes = caps.takes_bucket
        self._given: Optional[BucketContext] = None  # the last context handed in, and the one handed on (``fed``)
        self._fed: Optional[BucketContext] = None

    def __getattr__(self, name: str):
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def fed(self, bucket: BucketContext) -> BucketContext:
        """``bucket`` with this wrapper as its ``feedback``: the context the inner compressor is driven with (made
        once per bucket: the communicator hands in the same context every step)."""
        if bucket is not self._given:
            self._given, self._fed = bucket, replace(bucket, feedback=self)
        return self._fed

    def add(self, t: Tensor) -> Tensor:
        """The corrected input, t plus the residual (a new tensor: ``t`` itself is never changed)."""
        if self.residual is None or self.residual.shape != t.shape:
            return t.clone()
        return t + self.residual

    def update(self, corrected: Tensor, decoded: Tensor) -> None:
        """Keep what this step dropped: the corrected input minus what its payload decodes to."""
        self.residual = corrected - decoded.reshape(corrected.shape).to(corrected.dtype)

    def encode(self, t: Tensor, bucket: BucketContext = DEFAULT_BUCKET) -> tuple:
        """The inner compressor's payload and ctx for ``t`` plus the residual; the residual becomes what that
        payload, decoded here before any collective touches it, does not carry."""
        corrected = self.add(t)
        inner = self.inner
        payload, ctx = inner.compress(corrected, bucket) if self._takes else inner.compress(corrected)
        self.update(corrected, inner.decompress(payload, ctx))
        return payload, ctx

    def compress(self, t: Tensor, bucket: BucketContext = DEFAULT_BUCKET) -> tuple:
        return self.encode(t, bucket)

    def decompress(self, payload: List[Tensor], ctx: Any) -> Tensor:
        return self.inner.decompress(payload, ctx)

    def exchange(self, t: Tensor, world_size: int, bucket: BucketContext = DEFAULT_BUCKET) -> Exchange:
        return self.inner.exchange(t, world_size, self._fed if bucket is self._given else self.fed(bucket))

    def state_dict(self) -> dict:
        return {"ef": {"residual": self.residual}, **self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "ef" in state:
            self.residual = state["ef"].get("residual")
        self.inner.load_state_dict(state)

    def describe(self) -> str:
        return f"{self.inner.describe()}+EF"

    def __repr__(self) -> str:
        return f"{self.inner!r} +EF"
