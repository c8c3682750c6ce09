"""Declared compressor parameters, their checks, and seed mixing.

Every compressor class declares its keyword parameters once, as a tuple of
``Param`` (``Compressor.params``). That declaration is what the constructor
checks (``take``), what the job spec validates, what the New run form builds
its inputs from, and what the docs' compressor table lists (docs/reference/compressors.md).

A failed check raises ``ValueError("<param>: <problem>")``: one line that
starts with the parameter's name, as the spec's errors do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class Param:
    """One keyword parameter of a compressor."""
    name: str
    type: type
    """bool, int, float (an integer is accepted for a float and stored as a float) or str (one of ``choices``)."""
    default: Any
    """The value when the parameter is not given; None: it has no default value, see ``unset``."""
    help: str
    """One line on what it does, for the form and the docs."""
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    """Bounds of int and float parameters; open bounds exclude the bound itself."""
    unset: str = ""
    """What leaving it out means when there is no default (worked out from the bucket, off, ...)."""
    note: str = ""
    """Why the upper bound is there, appended to its error message."""
    choices: Tuple[str, ...] = ()
    """The values a str parameter takes (a str parameter must list them: a choice is bounded by them)."""

    def __post_init__(self):
        if self.type not in (bool, int, float, str):
            raise TypeError(f"{self.name}: parameter type must be bool, int, float or str, not {self.type}")
        if (self.type is str) != bool(self.choices):
            raise TypeError(f"{self.name}: a str parameter, and only one, lists its choices")
        if self.type is int and self.lo is None:
            raise TypeError(f"{self.name}: an int parameter needs a lower bound")
        if self.default is None and not self.unset:
            raise TypeError(f"{self.name}: a parameter without a default must say what unset means")
        if self.default is not None:
            self.check(self.default)  # a declaration whose default fails its own check is a bug

    def allowed(self) -> str:
        """The allowed values in words: 'true or false', 'an integer >= 1', 'in (0, 1]'."""
        if self.type is bool:
            return "true or false"
        if self.type is str:
            return "one of " + ", ".join(self.choices)
        if self.type is int:
            lo = f"an integer >= {int(self.lo)}"
            return lo if self.hi is None else f"{lo} and at most {int(self.hi)}"
        lo = -math.inf if self.lo is None else self.lo
        hi = math.inf if self.hi is None else self.hi
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        return f"in {left}{lo:g}, {hi:g}{right}"

    def check(self, v) -> Any:
        """The value as stored (floats as float), or ValueError naming the parameter."""
        if v is None and self.default is None:
            return None
        if self.type is bool:
            if not isinstance(v, bool):
                raise ValueError(f"{self.name}: must be true or false, got {v!r}")
            return v
        if self.type is str:
            if v not in self.choices:
                raise ValueError(f"{self.name}: must be {self.allowed()}, got {v!r}")
            return v
        if self.type is int:
            if isinstance(v, bool) or not isinstance(v, int) or v < self.lo:
                raise ValueError(f"{self.name}: must be an integer >= {int(self.lo)}, got {v!r}")
            if self.hi is not None and v > self.hi:
                raise ValueError(f"{self.name}: must be at most {int(self.hi)}{self.note}, got {v!r}")
            return v
        lo = -math.inf if self.lo is None else self.lo
        hi = math.inf if self.hi is None else self.hi
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (v > lo if self.lo_open else v >= lo) and (v < hi if self.hi_open else v <= hi)
        if not ok:
            raise ValueError(f"{self.name}: must be {self.allowed()}{self.note}, got {v!r}")
        return float(v)


def ratio(default: Optional[float], help: str, unset: str = "") -> Param:
    """A fraction of the bucket's elements, in (0, 1]."""
    return Param("ratio", float, default, help, lo=0, hi=1, lo_open=True, unset=unset)


SEED_MAX = (1 << 63) - 1
"""The largest seed: mix_seed folds every part into 64 bits and gives 63, so a larger one adds nothing."""


def seed(help: str) -> Param:
    return Param("seed", int, 0, help, lo=0, hi=SEED_MAX, note=" (a 63-bit generator seed)")


def take(owner: str, declared: Tuple[Param, ...], given: Dict[str, Any]) -> Dict[str, Any]:
    """Every declared parameter's checked value, from ``given`` or its default; an unknown
    keyword is an error that names it and lists the allowed ones."""
    known = {p.name for p in declared}
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        if not declared:
            raise ValueError(f"{unknown[0]}: {owner} takes no parameters")
        raise ValueError(f"{unknown[0]}: not a parameter of {owner}; allowed: {', '.join(p.name for p in declared)}")
    return {p.name: p.check(given[p.name]) if p.name in given else p.default for p in declared}


_M64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit generator seed from several integers (splitmix64 folding).
    Ranks that pass the same parts get the same seed, in any process."""
    h = 0
    for p in parts:
        z = (h ^ (int(p) & _M64)) + 0x9E3779B97F4A7C15 & _M64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _M64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M64
        h = z ^ (z >> 31)
    return h >> 1
