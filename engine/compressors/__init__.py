"""Compressor registry.

    from engine.compressors import make, names
    c = make("none")                     # one instance per bucket
    payload, ctx = c.compress(t)
    t2 = c.decompress(payload, ctx)

Every compressor class declares its keyword parameters once (``cls.params``, a
tuple of ``Param``) and its capabilities as attributes (engine/compressors/base.py);
``__init__`` checks the parameters against the declaration, raising
``ValueError("<param>: <problem>")``.
"""
from __future__ import annotations

from typing import Dict, Tuple, Type

from engine.compressors import quantize, sparsify
from engine.compressors.base import Compressor, ErrorFeedback
from engine.compressors.basic import NoneCompressor
from engine.compressors.countsketch import CountSketch
from engine.compressors.powersgd import PowerSGD

# One registry, in the order DESIGN.md lists the names (int8, added for dear's quantized reduce-scatter,
# after the casts); families live in their own modules.
ORDER = ("none", "fp16", "bf16", "int8", "topk", "randomk", "threshold", "dgc", "qsgd", "terngrad", "signsgd",
         "efsignsgd", "signum", "onebit", "natural", "powersgd", "countsketch")
_ALL: Dict[str, Type[Compressor]] = {"none": NoneCompressor, **quantize.COMPRESSORS, **sparsify.COMPRESSORS,
                                     "powersgd": PowerSGD, "countsketch": CountSketch}
REGISTRY: Dict[str, Type[Compressor]] = {n: _ALL[n] for n in ORDER if n in _ALL}


def names() -> tuple:
    return tuple(REGISTRY)


def make(name: str, error_feedback: bool = False, **params) -> Compressor:
    """A new instance for one bucket. ``error_feedback`` wraps any compressor
    whose method does not keep a residual of its own."""
    if name not in REGISTRY:
        raise ValueError(f"name: unknown compressor {name!r}; allowed: {', '.join(REGISTRY)}")
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback: must be true or false, got {error_feedback!r}")
    c = REGISTRY[name](**params)
    if error_feedback:
        if c.builtin_feedback:
            raise ValueError(f"error_feedback: {name} keeps its own residual already; leave error_feedback off")
        c.ef = ErrorFeedback()
    return c


def check(name: str, error_feedback: bool = False, **params) -> None:
    """Raise ValueError if ``make(name, error_feedback, **params)`` would."""
    make(name, error_feedback=error_feedback, **params)


def shardable() -> Tuple[str, ...]:
    """The compressors whose payloads, at their default parameters, reduce-scatter as the gradients
    would (``Compressor.shard_problem``): the ones DeAR takes."""
    return tuple(n for n in REGISTRY if make(n).shard_problem() is None)


__all__ = ["make", "names", "check", "shardable", "REGISTRY"]
