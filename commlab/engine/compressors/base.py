"""The compressor seam.

A compressor turns one bucket's flat gradient into a payload (a list of
tensors) and back. It never calls a collective. The communicator
(commlab/engine/comm/, through commlab/engine/comm/exchange.py) drives ``exchange``, a
generator that yields ``Round``s; the communicator carries out each round's
collective and sends the result back in.
Single-round compressors only implement ``compress``/``decompress`` and
inherit the default ``exchange``:

- ``summable`` payloads are all-reduced (summed) and decoded once;
- the others are all-gathered and every rank decodes every rank's payload.

Multi-round protocols (PowerSGD's two all-reduces) override ``exchange`` and
yield several rounds; they still never touch a process group.

One instance serves one bucket and owns that bucket's state (residuals,
warm-started factors, hash seeds), which ``state_dict``/``load_state_dict``
checkpoint.

A compressor declares, instead of leaving callers to probe it:

- its keyword parameters, once: ``params``, a tuple of ``Param`` (name, type,
  default, range, help). ``Compressor.__init__`` checks them and stores each as
  an attribute of the same name; the spec, the New run form and the docs'
  table read the same tuple;
- its capabilities: ``summable``, ``keeps_shape``, ``identity``, ``lossless``, ``rounds``,
  ``builtin_feedback``, ``builtin_momentum``, ``elementwise`` (per-element state), ``counts_steps``,
  ``warmup_exchanges`` (uncompressed exchanges first), ``per_tensor`` (uses the layout) and
  ``shard_codec`` (a slice compresses alone), ``graphable`` (a CUDA graph may replay its compress), and where it can, the rounds a bucket sends
  (``declared_rounds``, for the performance model). Read them from an instance where
  parameters change them (Count Sketch with ``exact`` takes two rounds).
  ``shard_path`` and ``shard_problem`` combine them into what DeAR needs, and ``shard_exchange`` is DeAR's
  exchange (``sum_overflows``: pre-divide before a sum; ``declared_shard_rounds``: its rounds, declared).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Generator, List, Optional, Tuple

import torch

from commlab.engine.compressors import graphs
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
    The last two are the rounds of a sharded exchange (``shard_exchange``).
    """
    op: str
    tensors: List[Tensor]
    parts: Optional[List[List[Tensor]]] = None


Exchange = Generator[Round, Any, Tensor]


def nbytes(tensors: List[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Compressor:
    """The base class of every compressor, built-in or yours. Subclass it in your own file, name the class
    in a spec by import path, and check it like the built-ins:

        compressor: {name: mypkg.codecs:ScaledSign, scale: 1.0}      # a job spec
        commlab check compressor mypkg.codecs:ScaledSign --param scale=0.5

    The minimum: ``compress`` and ``decompress``, and ``summable = False`` unless the sum of several ranks'
    payloads decodes to the sum of what they stand for. For example, signs and one mean magnitude:

        import torch
        from commlab import Compressor, Param

        class ScaledSign(Compressor):
            # each element's sign and the bucket's mean magnitude: about a quarter of fp32's bytes
            summable = False                   # magnitudes differ by rank: all-gathered, decoded per rank
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
    ``exchange`` yields. Each declared ``Param`` is checked by ``__init__`` and stored as an attribute of the
    same name (``self.scale``); the spec, the New run form and ``--param`` read the same declaration.

    Declare what holds instead of leaving callers to probe (each attribute below says what it promises):
    ``summable``, ``keeps_shape`` (dear sums the payload as it would the gradient), ``lossless``, ``identity``,
    ``rounds``, ``builtin_feedback``, ``builtin_momentum``, ``elementwise``, ``counts_steps``,
    ``steady_payload``, ``shard_codec``, ``dtypes``; ``shard_path``/``shard_problem`` say what dear can do
    with it. State that must survive a checkpoint goes in ``state_dict``/``load_state_dict`` (extend them,
    calling ``super()``: the error-feedback residual is there). Several rounds per step (PowerSGD):
    override ``exchange``, yielding each ``Round`` and receiving its result.

    ``error_feedback: true`` wraps any compressor that does not declare ``builtin_feedback``. Without a
    ``name`` of its own a subclass is named by its import path (``mypkg.codecs:ScaledSign``);
    ``commlab.engine.compressors.register`` (``commlab.register_compressor``) files it under a short name as the
    built-ins are. ``commlab check compressor`` (commlab/engine/compressors/conformance.py) holds a class to every
    one of these promises, at two and three simulated ranks.
    """
    name = "base"
    params: Tuple[Param, ...] = ()
    """The keyword parameters, declared once (commlab/engine/compressors/params.py)."""
    summable = True
    """True when payloads from several ranks may be summed element-wise."""
    keeps_shape = False
    """True when the payload is one tensor with one element per input element, element i standing
    for input element i, and ``decompress`` decodes any contiguous slice of it to the same slice of
    the output. Then a reduce-scatter of summable payloads is a reduce-scatter of the gradients."""
    identity = False
    """True when the payload is the input itself and decoding returns the payload (no compression):
    the exchange is a plain sum, so the caller may land the input already divided by the world
    size and run one all-reduce with nothing after it (``commlab.engine.comm.exchange.Exchange``, prescaled)."""
    lossless = False
    """True when decoding gives the input back up to the wire dtype's rounding (the identity and
    the casts): error feedback would have nothing worth keeping."""
    bucket = 0
    """Index of the bucket this instance serves, set by the communicator. Seeds that
    must agree across ranks (random-k indices, sketch hashes) derive from it."""
    process_rank = 0
    """This process's rank, set by the communicator (``rank`` is PowerSGD's parameter). Private random streams (stochastic
    rounding) mix it in; draws that every rank must share (random-k) must not."""
    layout: Optional[List[Tuple[int, Tuple[int, ...]]]] = None
    """(offset, shape) of each parameter tensor in the flat bucket, set by the communicator;
    compressors that exploit tensor structure use it."""
    last_bytes = 0
    """Payload bytes this rank sent in its last exchange."""
    rounds = 1
    """Collective rounds per exchange (PowerSGD: 2). Parameters may change it (Count Sketch with
    ``exact``: 2), so read it from an instance."""
    builtin_feedback = False
    """True when the method keeps its own residual (PowerSGD, DGC, EF-signSGD),
    so the generic error-feedback flag would apply it twice."""
    builtin_momentum = False
    """True when the method applies momentum itself (DGC's momentum correction, Signum's buffer):
    run the optimizer without momentum, or momentum is applied twice."""
    counts_steps = False
    """True when the instance counts its calls in an int attribute ``step`` (random-k's index seed,
    DGC's warm-up, PowerSGD's ``start_iter``): state a rebuild of the buckets carries over."""
    steady_payload = True
    """True when the payload's tensor sizes depend only on the bucket's layout, not on the values nor on
    how many exchanges came before (past ``warmup_exchanges``): one exchange shows every later one's
    sizes, so the performance model drives a layout once instead of twice. False where a threshold or a
    schedule sets how much is sent (threshold, DGC)."""
    shard_codec = False
    """True when any contiguous slice of the input may be compressed on its own, every payload of a
    slice of n elements has the same tensor sizes on every rank, and any rank decodes another rank's
    payload of such a slice with its own ctx for a slice of n elements. Then DeAR's reduce-scatter
    can be an all-to-all of per-shard payloads, each rank decoding the payloads of its own shard and
    summing them in fp32 (ZeRO++'s quantized gradients; ``shard_path`` "alltoall")."""
    sum_overflows = False
    """True when a sum of payloads over ranks can overflow where no rank's payload did (half precision
    saturates at 65504): the exchanges divide each payload by the world size before the sum, as DDP's
    fp16 hook does, instead of dividing the sum."""
    ef: Optional["ErrorFeedback"] = None
    """Error-feedback memory, set by ``make(..., error_feedback=True)``."""
    graphable = False
    """True when a CUDA graph of ``compress`` may stand in for it (``COMMLAB_GRAPHS=1``,
    commlab/engine/compressors/graphs.py): for the same input address, shape and ``elementwise`` state addresses it
    launches the same GPU work, with no host synchronisation, no branch on the data and no noise seeded from
    the host per call, and keeps its state in tensors it updates in place (new ones only through
    ``load_state_dict`` into ``elementwise`` attributes, which the graphs' key follows). ``graph_safe``
    narrows it per input."""

    dtypes: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    """The gradient dtypes it takes (the conformance checks exchange each of them): ``decompress`` returns
    the input's dtype."""

    elementwise: Tuple[str, ...] = ()
    """Attributes that hold per-element state in the bucket's flat shape (DGC's u and v,
    EF-signSGD's residual, Signum's momentum), None until the first step. When the
    buckets are rebuilt (commlab/engine/comm/core.py ``relayout``) this state is cut per parameter and
    reassembled in the new buckets, so it stays with its parameters. Other state (PowerSGD's
    factors and padded residual, random generators) starts afresh in a new bucket."""

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

    @property
    def warmup_exchanges(self) -> int:
        """Exchanges at the start that send the bucket uncompressed, as one plain all-reduce
        (PowerSGD's ``start_iter``). Whoever measures steady-state payloads or costs drives
        this many exchanges first."""
        return 0

    def skip_warmup(self) -> None:
        """Go straight to the steady state, as if the ``warmup_exchanges`` plain exchanges had been
        sent (the performance model drives a fresh instance to read its steady-state payload)."""
        if self.warmup_exchanges:
            raise NotImplementedError(f"{self.name}: declares warm-up exchanges but not how to skip them")

    def declared_rounds(self, n: int, element_size: int) -> Optional[List[Tuple[str, int, int]]]:
        """(op, payload bytes, tensors) of each round one steady exchange of a bucket of ``n`` elements
        of ``element_size`` bytes sends (laid out as ``layout`` says, where set), declared without running
        it; None (the default) where only driving the exchange tells. The performance model uses it where
        given, instead of driving the exchange (top-k's selection over millions of values was most of a
        prediction's cost); tests hold every declaration to the driven rounds."""
        return None

    def declared_shard_rounds(self, n: int, element_size: int) -> Optional[List[Tuple[str, int, int]]]:
        """As ``declared_rounds``, for the sharded exchange (``shard_exchange``) of a buffer of ``n`` elements
        on one rank: by default its one round from ``declared_rounds``, the op "reduce_scatter" ("sum") or
        "all_to_all" ("alltoall") with the same bytes and tensors; None where that does not tell. A
        compressor that overrides ``shard_exchange`` declares its own or None."""
        path = self.shard_path()
        rounds = self.declared_rounds(n, element_size) if path is not None else None
        if rounds is None or len(rounds) != 1:
            return None
        (_, size, k), = rounds
        return [("reduce_scatter" if path == "sum" else "all_to_all", size, k)]

    def per_tensor(self, n: int) -> bool:
        """True when this instance compresses a bucket of n elements tensor by tensor, from
        the ``layout`` the communicator set (PowerSGD), False when it treats it as one flat tensor."""
        return False

    def shard_path(self) -> Optional[str]:
        """How DeAR reduce-scatters this instance's gradients: "sum" (one round, summable, shape kept:
        the payload itself is reduce-scattered), "alltoall" (one round, a ``shard_codec``: each shard
        compressed alone, the payloads exchanged all-to-all, decoded and summed by the shard's owner),
        or None (``shard_problem`` says why)."""
        if self.rounds != 1:
            return None
        if self.summable and self.keeps_shape:
            return "sum"
        if self.shard_codec:
            return "alltoall"
        return None

    def shard_problem(self) -> Optional[str]:
        """Why DeAR could not reduce-scatter this instance's payloads (``shard_path`` is None), or None."""
        if self.rounds != 1:
            return f"takes {self.rounds} rounds"
        if self.shard_path() is not None:
            return None
        if not self.summable:
            return "has payloads that cannot be summed"
        return "has a payload that does not keep the gradient's shape"

    def elementwise_state(self) -> Dict[str, Optional[Tensor]]:
        """The per-element state by name (the error-feedback residual as ``ef.residual``)."""
        out = {"ef.residual": self.ef.residual} if self.ef is not None else {}
        out.update({k: getattr(self, k) for k in self.elementwise})
        return out

    def load_elementwise_state(self, state: Dict[str, Optional[Tensor]]) -> None:
        for k, v in state.items():
            if k == "ef.residual":
                if self.ef is not None:
                    self.ef.residual = v
            elif k in self.elementwise:
                setattr(self, k, v)

    def encode(self, t: Tensor) -> tuple[List[Tensor], Any]:
        """``compress`` with error feedback applied when it is on. Exchanges call this."""
        if self.ef is None:
            return graphs.compress(self, t)  # compress, replayed from a CUDA graph where one is wanted
        corrected = self.ef.add(t)
        payload, ctx = self.compress(corrected)
        # what this rank's payload stands for, decoded locally before any collective touches it
        self.ef.update(corrected, self.decompress(payload, ctx))
        return payload, ctx

    def encode_parts(self, t: Tensor, parts: int) -> List[tuple]:
        """A ``shard_codec``'s encode for DeAR: the flat ``t`` (numel a multiple of ``parts``) cut into
        ``parts`` equal slices, each compressed on its own; [(payload, ctx)] per slice. Error feedback,
        when on, covers the whole of ``t``: the residual keeps ``t``'s shape, as in ``encode``."""
        if not self.shard_codec:
            raise ValueError(f"{self.name}: not a shard codec; its slices cannot be compressed on their own")
        if t.numel() % parts:
            raise ValueError(f"encode_parts: {t.numel()} elements do not split into {parts} equal parts")
        x = t if self.ef is None else self.ef.add(t)
        out = [self.compress(s) for s in x.reshape(parts, -1)]
        if self.ef is not None:
            self.ef.update(x, torch.cat([self.decompress(p, c).reshape(-1) for p, c in out]))
        return out

    def graph_safe(self, t: Tensor) -> bool:
        """Whether ``compress(t)`` may be replayed from a CUDA graph (``graphable``, for this input)."""
        return self.graphable

    def compress(self, t: Tensor) -> tuple[List[Tensor], Any]:
        raise NotImplementedError

    def decompress(self, payload: List[Tensor], ctx: Any) -> Tensor:
        raise NotImplementedError

    def exchange(self, t: Tensor, world_size: int) -> Exchange:
        """Average ``t`` over ranks through compressed collectives.

        Yields Rounds, receives their results, returns the averaged tensor
        (same shape, dtype and device as ``t``; it may be ``t`` itself).
        ``self.last_bytes`` is set to the payload bytes this rank sent.
        """
        payload, ctx = self.encode(t)
        self.last_bytes = nbytes(payload)
        if self.summable:
            summed = yield Round("allreduce", payload)
            out = self.decompress(summed, ctx)
            return out.div_(world_size)
        gathered = yield Round("allgather", payload)
        out = self.decompress(gathered[0], ctx).clone()
        for p in gathered[1:]:
            out.add_(self.decompress(p, ctx))
        return out.div_(world_size)

    def shard_exchange(self, t: Tensor, world_size: int, rank: int) -> Exchange:
        """DeAR's exchange: ``t`` (flat, its numel a multiple of ``world_size``) averaged over ranks, this
        rank ending with its shard, elements ``[rank * s, (rank + 1) * s)`` of the average, s = numel /
        world_size, in ``t``'s dtype. Yields Rounds as ``exchange`` does, of the ops "reduce_scatter" and
        "all_to_all"; ``self.last_bytes`` is set to the payload bytes this rank sent. Which way depends
        on ``shard_path``:

        - "sum": the payload of the whole ``t`` (error feedback included) is reduce-scattered as it is
          and this rank decodes its chunk of the sum with the whole buffer's ctx (``keeps_shape``);
          divided by the world size before the sum where ``sum_overflows``, else after decoding;
        - "alltoall": ``encode_parts`` cuts ``t`` into one slice per rank, each compressed on its own
          (a ``shard_codec``); slice j's payload goes to rank j in one all-to-all, and this rank
          decodes the payloads of its own slice, sums them in fp32 and divides by the world size.

        A compressor may override it (several rounds, another way to shard); ``shard_path`` and
        ``shard_problem`` still say whether DeAR takes it."""
        path = self.shard_path()
        if path == "sum":
            payload, ctx = self.encode(t)
            if len(payload) != 1 or payload[0].numel() != t.numel():
                raise RuntimeError(f"dear: {self.name} declares keeps_shape but sent {len(payload)} tensors "
                                   f"of {[x.numel() for x in payload]} elements for a buffer of {t.numel()}")
            wire = payload[0]
            if self.sum_overflows:
                wire = wire / world_size if wire is t else wire.div_(world_size)  # never scale the caller's t
            self.last_bytes = nbytes([wire])
            (shard,) = yield Round("reduce_scatter", [wire])
            out = self.decompress([shard], ctx)
            if not self.sum_overflows:
                out = out.div_(world_size) if out is shard else out / world_size
            return out
        if path == "alltoall":
            parts = self.encode_parts(t, world_size)
            layout = [[(x.dtype, x.shape) for x in p] for p, _ in parts]
            if any(s != layout[0] for s in layout[1:]):
                raise RuntimeError(f"dear: {self.describe()} declares shard_codec but its shards' payloads "
                                   "differ in size")
            self.last_bytes = sum(nbytes(p) for p, _ in parts)
            got = yield Round("all_to_all", [], parts=[p for p, _ in parts])
            ctx = parts[rank][1]  # a slice's ctx decodes every rank's payload of that slice
            acc = torch.zeros(t.numel() // world_size, dtype=torch.float32, device=t.device)
            for p in got:
                acc.add_(self.decompress(p, ctx).reshape(-1).float())
            return acc.div_(world_size).to(t.dtype)
        raise ValueError(f"dear: {self.name} {self.shard_problem()}")

    # state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """This bucket's state; subclasses with their own state extend it."""
        return {"ef": self.ef.state_dict()} if self.ef is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.ef is not None and "ef" in state:
            self.ef.load_state_dict(state["ef"])

    def describe(self) -> str:
        """The instance as a spec names it: ``name(param=value,...)+EF`` with the parameters given
        explicitly (the key commlab.lab.strategy.perfmodel.calibrate.compressor_key gives a spec's compressor section)."""
        ps = ",".join(f"{k}={v}" for k, v in sorted(self.given.items()))
        return f"{self.name}{'(' + ps + ')' if ps else ''}{'+EF' if self.ef is not None else ''}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(){' +EF' if self.ef is not None else ''}"


RESERVED = ("error_feedback", "name", "params", "per_bucket", "below_mb")
"""Keys of a spec's compressor section that are not the compressor's parameters."""


def declaration_problem(cls) -> Optional[str]:
    """What is wrong with a class's declared parameters, or None (checked when a subclass is defined)."""
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
    return None


class ErrorFeedback:
    """Error-feedback memory (Seide et al. 2014; Karimireddy et al. 2019).

    Before compressing, add what earlier steps dropped: c = g + e. After
    compressing, keep what this step drops: e = c - decode(compress(c)).
    The residual is per bucket and has the bucket's flat shape.
    """

    def __init__(self):
        self.residual: Optional[Tensor] = None
        """What compression has dropped so far; None until the first step."""

    def add(self, t: Tensor) -> Tensor:
        if self.residual is None or self.residual.shape != t.shape:
            return t.clone()
        return t + self.residual

    def update(self, corrected: Tensor, decoded: Tensor) -> None:
        self.residual = corrected - decoded.reshape(corrected.shape).to(corrected.dtype)

    def state_dict(self) -> dict:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        self.residual = state.get("residual")
