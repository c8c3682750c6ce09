"""The compressor registry: every compressor by name, the built-ins and yours through one door.

    from commlab.engine.compressors import make, names
    c = make("none")                     # one instance per bucket
    payload, ctx = c.compress(t)
    t2 = c.decompress(payload, ctx)

A name is either registered (``register``: the built-ins fill the registry the way a user's package can)
or an import path, ``package.module:Class``, naming a subclass of ``Compressor`` (commlab/engine/compressors/base.py,
``commlab.Compressor``) that is imported when it is first asked for (``resolve``), as models and data sets
are (commlab/engine/external.py). Every compressor class declares its keyword parameters once (``cls.params``, a
tuple of ``Param``) and its capabilities once (``cls.capabilities``, a ``Capabilities`` record); ``__init__``
checks the parameters against the declaration, raising ``ValueError("<param>: <problem>")``.
"""
from __future__ import annotations

import re
from typing import Dict, Optional, Tuple, Type, Union

from commlab.engine import codepath, external
from commlab.engine.compressors.base import Compressor, ErrorFeedback
from commlab.engine.compressors.capabilities import Capabilities
from commlab.engine.compressors.basic import NoneCompressor
from commlab.engine.compressors.countsketch import CountSketch
from commlab.engine.compressors.powersgd import PowerSGD
from commlab.engine.compressors.quantize import BF16, FP16, QSGD, Int4, Int8, Natural, TernGrad
from commlab.engine.compressors.sign import EFSignSGD, OneBit, SignSGD, Signum
from commlab.engine.compressors.sparsify import DGC, RandomK, Threshold, TopK, TopK2Bit

REGISTRY: Dict[str, Type[Compressor]] = {}
"""Registered name -> class, in the order they were registered (the built-ins first, as DESIGN.md lists them)."""
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
"""A registered name: no ':' (that is an import path's)."""


def register(cls: Optional[Type[Compressor]] = None, name: Optional[str] = None):
    """File ``cls`` under ``name`` (default: ``cls.name``), so a spec may say ``compressor: {name: NAME}``.
    Usable as a decorator, ``@register`` or ``@register(name="mine")``. A class without a ``name`` of its own
    takes ``name``; one that has a name is filed under it. Registering another class under a taken name is a
    ValueError; registering the same class again (a module reloaded) replaces it. Returns the class."""
    if cls is None:
        return lambda c: register(c, name)
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise ValueError(f"register: {cls!r} is not a Compressor subclass")
    own = cls.name if "name" in cls.__dict__ and not codepath.is_import_path(cls.name) else None
    key = name or own
    if key is None:
        raise ValueError(f"register: {cls.__name__} has no name; give one: register({cls.__name__}, "
                         f"name=...) or set name = ... in the class")
    if own is not None and key != own:
        raise ValueError(f"name: {cls.__name__} is named {own!r}; register it under that name")
    if not NAME.fullmatch(key):
        raise ValueError(f"name: {key!r} is not a compressor name (a letter, then letters, digits, '_', '-', '.'; "
                         f"an import path names a class without registering it)")
    old = REGISTRY.get(key)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"name: {key!r} is registered already, for {old.__module__}:{old.__qualname__}")
    cls.name = key
    REGISTRY[key] = cls
    return cls


def resolve(name: Union[str, Type[Compressor]], field: str = "name") -> Type[Compressor]:
    """The class a name stands for: a registered name, or ``package.module:Class`` imported (where this
    process may import code: commlab.engine.codepath.imports_allowed). A one-line ValueError starting with
    ``field`` otherwise. A Compressor subclass itself is returned as it is."""
    if isinstance(name, type) and issubclass(name, Compressor):
        return name
    if isinstance(name, str) and name in REGISTRY:
        return REGISTRY[name]
    if isinstance(name, str) and codepath.is_import_path(name):
        codepath.check_path(name, field)
        obj = external.import_object(name, field)
        if not (isinstance(obj, type) and issubclass(obj, Compressor)):
            raise ValueError(f"{field}: {name!r} is not a Compressor subclass (subclass commlab.Compressor)")
        return obj
    raise ValueError(f"{field}: unknown compressor {name!r}; allowed: {', '.join(REGISTRY)}, or "
                     f"package.module:Class")


def importable(name, field: str = "name"):
    """``name`` as another process (a rank) can resolve it: a built-in's name or an import path as it is; a name
    registered in this process for a class of the user's, that class's ``package.module:Class`` (the ranks do
    not run the code that registered it). A one-line ValueError for a class defined in a script (``__main__``),
    which no other process can import."""
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None or cls.__module__.startswith("commlab.engine."):
        return name
    if cls.__module__ == "__main__":
        raise ValueError(f"{field}: {name!r} was registered by a script (__main__), which the ranks cannot import; "
                         f"move {cls.__qualname__} into a module on PYTHONPATH and register it there, or name it "
                         f"package.module:{cls.__qualname__}")
    return f"{cls.__module__}:{cls.__qualname__}"


def names() -> tuple:
    """The registered names: the built-ins, then any a package registered in this process."""
    return tuple(REGISTRY)


def make(name: Union[str, Type[Compressor]], error_feedback: bool = False, **params) -> Compressor:
    """A new instance for one bucket. ``error_feedback`` wraps it in ``ErrorFeedback``, for any compressor
    whose method does not keep a residual of its own (``Capabilities.builtin_feedback``)."""
    cls = resolve(name)
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback: must be true or false, got {error_feedback!r}")
    try:
        c = cls(**params)
    except ValueError:
        raise
    except Exception as e:  # a user's constructor may fail in any way: one line, naming the class
        raise ValueError(f"name: {cls.name}({', '.join(f'{k}={v!r}' for k, v in params.items())}) failed: "
                         f"{type(e).__name__}: {_first_line(e)}") from None
    return ErrorFeedback(c) if error_feedback else c


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def check(name: str, error_feedback: bool = False, **params) -> None:
    """Raise ValueError if ``make(name, error_feedback, **params)`` would."""
    make(name, error_feedback=error_feedback, **params)


def shardable() -> Tuple[str, ...]:
    """The registered compressors whose payloads, at their default parameters, reduce-scatter as the
    gradients would (``Capabilities.shard_problem``): the ones DeAR takes."""
    return tuple(n for n in REGISTRY if make(n).capabilities.shard_problem() is None)


for _cls in (NoneCompressor, FP16, BF16, Int8, TopK, RandomK, Threshold, DGC, QSGD, TernGrad, SignSGD, EFSignSGD,
             Signum, OneBit, Natural, PowerSGD, CountSketch):  # DESIGN.md's order (int8, added for dear, after the casts)
    register(_cls)
for _cls in (Int4, TopK2Bit):  # the low-bit codecs of the methods' pseudo-gradients (Streaming DiLoCo, SparseLoCo)
    register(_cls)

__all__ = ["make", "names", "check", "shardable", "register", "resolve", "REGISTRY", "Capabilities", "ErrorFeedback"]
