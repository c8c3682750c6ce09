"""Methods that communicate less often: what ranks exchange, and when (local SGD, post-local SGD,
DiLoCo, Streaming DiLoCo, DeMo, SparseLoCo, MuLoCo, DES-LOC), on one documented base class
(commlab/engine/methods/base.py).

    from commlab.engine.methods import make, names, register, resolve
    m = make("diloco", H=50, outer_lr=0.7)      # checked parameters: ValueError("H: ...") otherwise
    resolve("mypkg.mine:MyMethod")              # a user's Method subclass, by import path

A user's method subclasses ``commlab.engine.methods.base.Method`` in its own module and is named in a spec by
import path (``method: {name: pkg.module:Class, ...}``), checked when the spec is checked; or it is added
to the registry by name with ``register(cls)``, as the built-ins are. ``none`` is the default: every
step's gradients through the communicator, no method object at all.
"""
from __future__ import annotations

from typing import Dict, Type

from commlab.engine.codepath import is_import_path
from commlab.engine.external import import_object
from commlab.engine.methods.base import Method
from commlab.engine.methods.demo import DeMo
from commlab.engine.methods.desloc import DESLOC
from commlab.engine.methods.diloco import DiLoCo
from commlab.engine.methods.local_sgd import LocalSGD
from commlab.engine.methods.muloco import MuLoCo
from commlab.engine.methods.post_local_sgd import PostLocalSGD
from commlab.engine.methods.sparseloco import SparseLoCo
from commlab.engine.methods.streaming_diloco import StreamingDiLoCo

NONE = "none"
REGISTRY: Dict[str, Type[Method]] = {}


def register(cls: Type[Method]) -> Type[Method]:
    """Add a Method subclass to the registry under ``cls.name`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Method)) or cls is Method:
        raise TypeError(f"register: expected a subclass of commlab.engine.methods.base.Method, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name or cls.name == NONE or ":" in cls.name:
        raise ValueError(f"register: {cls.__name__}.name must be a new plain name, got {cls.name!r}")
    if REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"register: a method named {cls.name!r} exists already ({REGISTRY[cls.name].__name__})")
    REGISTRY[cls.name] = cls
    return cls


for _cls in (LocalSGD, PostLocalSGD, DiLoCo, StreamingDiLoCo, DeMo, SparseLoCo, MuLoCo, DESLOC):
    register(_cls)


def names() -> tuple:
    """The registered names, ``none`` first."""
    return (NONE,) + tuple(REGISTRY)


def resolve(name: str) -> Type[Method]:
    """The class a spec's ``method.name`` names: a registered name or ``pkg.module:Class``. ValueError
    ``name: <problem>`` otherwise (``none`` has no class)."""
    if is_import_path(name):
        cls = import_object(name, "name")
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise ValueError(f"name: {name!r} is not a subclass of commlab.engine.methods.base.Method")
        return cls
    if name not in REGISTRY:
        raise ValueError(f"name: unknown method {name!r}; allowed: {', '.join(names())}, pkg.module:Class")
    return REGISTRY[name]


def make(name: str, **params) -> Method:
    """A new instance, its parameters checked (ValueError ``<param>: <problem>``)."""
    return resolve(name)(**params)
