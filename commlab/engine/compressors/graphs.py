"""CUDA graphs of a codec's compress and of its fused decoding: one replay in place of their launches.

On a GPU a small bucket's compress costs the host far more than the GPU: the fused codecs launch 1-3 Triton
kernels and a torch op or two, each launch 10-25 µs of Python and driver time, for kernels of 1-3 µs
(bench/results/gpu.md). A CUDA graph records those launches once and replays them in one driver call. With
``COMMLAB_GRAPHS=1`` (off by default: it has not yet run under the whole suite on a GPU), ``BucketContext.encode``
(what every exchange calls) replays a graph of ``compress``, and the exchanges' fused decoding (``decode``) one
of theirs, when:

- the codec declares ``Capabilities(graphable=True)`` and its ``graph_safe``, where it has one, agrees for this
  input: its compress does the same work on the GPU for the same input, state and shape (no host
  synchronisation, no noise seeded from the host per call, no branch on the data). The built-ins that declare it (the sign codecs,
  qsgd, terngrad, natural) are graphed on their fused paths only: float32 buckets where those kernels run;
- the bucket is a CUDA tensor of at most ``MAX_ELEMENTS`` (a graph keeps its outputs: memory per bucket), and
  error feedback is off (its residual update is outside compress: ``ErrorFeedback`` calls the codec's compress
  itself, never through here);
- the same call (``key``: input address, shape, strides, dtype, the addresses of the codec's ``elementwise``
  state and its parameters' values; for decoding, the payloads' addresses and shapes) has been made ``WARM``
  times before, eagerly: a bucket the engine refills in place is captured on its third step; a tensor allocated
  anew each call at another address never is.

A replay's outputs are the graph's memory: the next replay of the same call writes over them. An exchange
consumes its payload, and the engine copies the averaged bucket, before the bucket's next exchange; a caller
that keeps them across calls must copy them. A capture that fails (the class declared too much) warns once and
leaves that codec eager (``Graphs.problem``). State loaded into new tensors changes the key: the next calls
are eager again until captured anew.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections import OrderedDict
from typing import Any, Callable, List, Optional, Tuple

import torch

from commlab.engine.compressors import fused

Tensor = torch.Tensor

ENV = "COMMLAB_GRAPHS"
MAX_ELEMENTS = 1 << 25
"""The largest bucket (elements) graphed, 33.5M: a graphed call keeps its outputs (the payload, the decoded
bucket) allocated between steps, and far above this the kernels' own time dwarfs the launches'."""
WARM = 2
"""Eager calls with the same key before the capture (the first also compiles and allocates the state)."""
MOST = 8
"""Graphs kept per codec instance; the least recently replayed goes first."""
CAPTURES = 32
"""Captures per codec instance, at most: past them its inputs keep moving (a capture costs a device
synchronisation), and it stays eager, said once."""
SEEN = 64
"""Keys counted per codec instance before the count starts afresh (tensors at ever new addresses)."""


def on() -> bool:
    """Whether ``COMMLAB_GRAPHS`` asks for graphs (``1``); ``0`` or unset: no graphs."""
    way = os.environ.get(ENV, "0")
    if way not in ("0", "1"):
        raise ValueError(f"{ENV}: must be 0 or 1, got {way!r}")
    return way == "1"


def force(codec, way: Optional[bool]) -> None:
    """Graphs on (True) or off (False) for this codec instance whatever ``COMMLAB_GRAPHS`` says; None: as it
    says (a benchmark times both ways in one process)."""
    codec._graphs_on = way


def _on(codec) -> bool:
    way = codec.__dict__.get("_graphs_on")
    return on() if way is None else way


def wanted(codec, t: Tensor) -> bool:
    """Whether ``codec.compress(t)`` goes through a graph (see the module's text)."""
    return t.is_cuda and _on(codec) and _safe(codec, t) and t.numel() <= MAX_ELEMENTS and not _capturing()


def _safe(codec, t: Tensor) -> bool:
    """The codec's declared ``graphable``, narrowed by its class's ``graph_safe(t)`` where it has one."""
    own = getattr(type(codec), "graph_safe", None)
    return own(codec, t) if own is not None else codec.capabilities.graphable


def settings() -> dict:
    """What the GPU codecs' switches are in this process (a run on a GPU records them in resolved.json): the
    fused kernels' (``fused.settings``) and the graphs' (``COMMLAB_GRAPHS``)."""
    return {**fused.settings(), "graphs": os.environ.get(ENV, "0")}


def summary(codecs) -> Optional[str]:
    """One line on what the graphs of these codec instances did (a run's log says it at its end), or None where
    none of them was ever asked for a graph."""
    codecs = [c for c in codecs if c is not None]
    kept = [g for g in (c.__dict__.get("_graphs") for c in codecs) if g is not None]
    if not kept:
        return None
    line = (f"CUDA graphs: {sum(1 for g in kept if g.captures)} of {len(codecs)} codec(s) captured, "
            f"{sum(g.captures for g in kept)} capture(s), {sum(g.replays for g in kept)} replay(s)")
    problems = [g.problem for g in kept if g.problem]
    return line + (f"; {len(problems)} stayed eager, the first because {problems[0]}" if problems else "")


@functools.lru_cache(maxsize=None)
def _has_cuda() -> bool:
    return torch.cuda.is_available()  # it does not change in a process


def _capturing() -> bool:
    # a graph being captured around this call already (a user's): it records the launches itself
    return _has_cuda() and torch.cuda.is_current_stream_capturing()


def _graphs(codec) -> "Graphs":
    g = codec.__dict__.get("_graphs")
    if g is None:
        g = codec._graphs = Graphs()
    return g


def compress(codec, t: Tensor, bucket) -> Tuple[List[Tensor], Any]:
    """``codec.compress(t)`` (``compress(t, bucket)`` where its capabilities say ``takes_bucket``; ``bucket`` is
    the same at every call of one instance), replayed from a graph where ``wanted``."""
    if not wanted(codec, t):
        return codec.compress(t, bucket) if codec.capabilities.takes_bucket else codec.compress(t)
    if codec.capabilities.takes_bucket:
        return _graphs(codec).call(lambda: codec.compress(t, bucket), key(codec, t), _payload)
    return _graphs(codec).call(lambda: codec.compress(t), key(codec, t), _payload)


def decode(codec, fn: Callable, payloads: list, ctx) -> Tensor:
    """``fn(payloads, ctx)``: a graphable codec's fused decoding of one payload or every rank's (a list of
    tensors or of payloads), replayed from a graph keyed by the payload tensors' addresses and layouts. The
    result is the graph's memory, written over by the next replay of the same key: the engine copies it into
    the bucket before the bucket's next exchange."""
    if not (codec.capabilities.graphable and ctx.n <= MAX_ELEMENTS and _on(codec)):
        return fn(payloads, ctx)
    flat = [p for x in payloads for p in (x if isinstance(x, (list, tuple)) else (x,))]
    if not flat[0].is_cuda or _capturing():
        return fn(payloads, ctx)
    k = (fn.__name__, len(payloads), ctx.n, ctx.dtype, tuple(ctx.shape), _params(codec),
         tuple((p.data_ptr(), tuple(p.shape), p.dtype) for p in flat))
    return _graphs(codec).call(lambda: fn(payloads, ctx), k, _same)


def _payload(out):
    payload, ctx = out
    return list(payload), ctx


def _same(out):
    return out


def key(codec, t: Tensor) -> tuple:
    """What a graph of ``codec.compress(t)`` is valid for: the input's address and layout, the addresses of
    the codec's per-element state (None before the first call creates it) and its parameters' values (a graph
    keeps the numbers it was captured with)."""
    state = tuple(_ptr(getattr(codec, k, None)) for k in codec.capabilities.elementwise)
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, state, _params(codec))


def _params(codec) -> tuple:
    return tuple(getattr(codec, p.name, None) for p in getattr(codec, "params", ()))


def _ptr(x) -> Optional[int]:
    return x.data_ptr() if isinstance(x, torch.Tensor) else None


class _Recorded:
    __slots__ = ("graph", "out")

    def __init__(self, graph, out):
        self.graph, self.out = graph, out


class Graphs:
    """One codec instance's graphs (of its compress and its decoding), by key. ``new``/``capture`` make and record
    a graph (``torch.cuda.CUDAGraph`` and ``_capture`` unless given: the tests stand in for them on a CPU)."""

    def __init__(self, new: Callable = None, capture: Callable = None):
        self.new = new or torch.cuda.CUDAGraph
        self.capture = capture or _capture
        self.seen: dict = {}
        self.graphs: OrderedDict = OrderedDict()
        self.problem: Optional[str] = None
        """Why this codec's capture failed (then it stays eager), or None."""
        self.captures = 0
        self.replays = 0

    def __deepcopy__(self, memo):  # a copied codec starts without graphs: they hold the original's memory
        return Graphs(self.new, self.capture)

    def __reduce__(self):
        return (Graphs, ())

    def call(self, fn: Callable, k: tuple, unpack: Callable = _same):
        """``fn()``, eager, captured or replayed for key ``k``; ``unpack`` turns the recorded result into what the
        caller gets (each call its own list around the graph's tensors)."""
        rec = self.graphs.get(k)
        if rec is not None:
            self.graphs.move_to_end(k)
            rec.graph.replay()
            self.replays += 1
            return unpack(rec.out)
        if self.problem is not None:
            return fn()
        count = self.seen.get(k, 0)
        if count >= WARM and self.captures >= CAPTURES:
            self.problem = f"{self.captures} captures: its inputs keep moving to new addresses"
            warnings.warn(f"COMMLAB_GRAPHS: {self.problem}; this codec stays eager", RuntimeWarning, stacklevel=3)
            return fn()
        if count < WARM:
            if len(self.seen) >= SEEN:
                self.seen.clear()
            self.seen[k] = count + 1
            return fn()
        graph = self.new()
        try:
            with self.capture(graph):
                out = fn()
        except Exception as e:  # noqa: BLE001 - a capture that fails where the call itself runs: said once
            out = fn()  # the call's own error (bad input), raised as it is, leaves the graphs as they were
            self.problem = f"{type(e).__name__}: {e}"
            warnings.warn(f"COMMLAB_GRAPHS: capturing a call of {k[0] if isinstance(k[0], str) else 'compress'} "
                          f"failed, this codec stays eager ({self.problem})", RuntimeWarning, stacklevel=3)
            return unpack(out)
        self.seen.pop(k, None)
        self.graphs[k] = _Recorded(graph, out)
        self.captures += 1
        while len(self.graphs) > MOST:
            self.graphs.popitem(last=False)
        graph.replay()  # the capture recorded the call without running it: this call's result
        self.replays += 1
        return unpack(out)


_streams: dict = {}  # device index -> the side stream graphs are captured on


@contextlib.contextmanager
def _capture(graph):
    """``torch.cuda.graph(graph)`` without its garbage collection and ``empty_cache`` (a capture mid-training
    must not hand the allocator's cache back), and with ``thread_local`` errors: another thread's CUDA calls
    (a collective's, in the engine) go on during the capture."""
    torch.cuda.synchronize()
    index = torch.cuda.current_device()
    side = _streams.get(index)
    if side is None:
        side = _streams[index] = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)


def enabled(way: bool = True):
    """Inside: ``COMMLAB_GRAPHS`` set to ``1`` (or ``0``), as before afterwards."""
    return fused.scoped_env(ENV, "1" if way else "0")
