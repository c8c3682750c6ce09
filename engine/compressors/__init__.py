"""Compressor registry.

    from engine.compressors import make, names
    c = make("none")                     # one instance per bucket
    payload, ctx = c.compress(t)
    t2 = c.decompress(payload, ctx)

Every compressor class takes its parameters as keyword arguments and checks
them in ``__init__``, raising ``ValueError("<param>: <problem>")``.
"""
from __future__ import annotations

from typing import Dict, Type

from engine.compressors.base import Compressor, Round, nbytes
from engine.compressors.basic import NoneCompressor

REGISTRY: Dict[str, Type[Compressor]] = {
    "none": NoneCompressor,
}


def names() -> tuple:
    return tuple(REGISTRY)


def make(name: str, error_feedback: bool = False, **params) -> Compressor:
    if name not in REGISTRY:
        raise ValueError(f"name: unknown compressor {name!r}; allowed: {', '.join(REGISTRY)}")
    if error_feedback:
        raise ValueError("error_feedback: not available yet (the compressor library is a separate issue)")
    return REGISTRY[name](**params)


def check(name: str, **params) -> None:
    """Raise ValueError if ``make(name, **params)`` would."""
    make(name, **params)


__all__ = ["Compressor", "Round", "nbytes", "make", "names", "check", "REGISTRY"]
