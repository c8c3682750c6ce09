"""Parameter checks and seed mixing shared by every compressor.

Each check returns the value or raises ``ValueError("<param>: <problem>")``:
one line that starts with the parameter's name, as the spec's errors do.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple


def reject_unknown(name: str, params: dict, allowed: Tuple[str, ...]) -> None:
    if params:
        bad = sorted(params)[0]
        raise ValueError(f"{bad}: not a parameter of {name}; allowed: {', '.join(allowed)}")


def check_ratio(param: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError(f"{param}: must be in (0, 1], got {v!r}")
    return float(v)


def check_int(param: str, v, lo: int, hi: Optional[int] = None, why: str = "") -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{param}: must be an integer >= {lo}, got {v!r}")
    if hi is not None and v > hi:
        raise ValueError(f"{param}: must be at most {hi}{why}, got {v!r}")
    return v


def check_real(param: str, v, lo: float, lo_open: bool = True, hi: float = math.inf, hi_open: bool = True) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"{param}: must be a number in {interval}, got {v!r}")
    return float(v)


def check_bool(param: str, v) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{param}: must be true or false, got {v!r}")
    return v


def reject_params(name: str, params: dict) -> None:
    """For compressors without parameters."""
    if params:
        raise ValueError(f"{sorted(params)[0]}: {name} takes no parameters")


def take(name: str, params: dict, defaults: dict) -> dict:
    """``defaults`` updated with ``params``; an unknown key is an error naming it."""
    reject_unknown(name, {k: v for k, v in params.items() if k not in defaults}, tuple(defaults))
    return {**defaults, **params}


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
