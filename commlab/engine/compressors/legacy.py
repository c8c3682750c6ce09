"""Compressors written to the earlier contract keep working.

Before ``Capabilities`` and ``BucketContext`` (commlab/engine/compressors/capabilities.py), a class declared its
capabilities as class attributes (``summable = False``, ``rounds = 2``, a ``warmup_exchanges`` property, or values
set on the instance in ``__init__``), read ``self.bucket``, ``self.process_rank``, ``self.layout`` and ``self.ef``
(set on it by the communicator and the factory), called ``self.encode(t)`` in its own ``exchange(t, world_size)``,
set ``self.last_bytes``, and took ``(n, element_size)`` in ``declared_rounds``. ``adapt`` (run by
``Compressor.__init_subclass__`` for every subclass) recognises such a class and, for that class alone:

- reads those attributes into its ``capabilities`` record, per instance, once its ``__init__`` has run (a class
  that also declares ``capabilities`` itself is refused: one declaration);
- passes the bucket's context in through the old names: before each ``compress``, ``exchange`` and the other
  hooks, ``bucket``, ``process_rank``, ``layout`` and ``ef`` (the ``ErrorFeedback`` wrapping it, or None) are set
  from the ``BucketContext`` the call was given, and ``encode(t)`` applies that context's error feedback;
- takes the old hook signatures: ``exchange(t, world_size)``, ``shard_exchange(t, world_size, rank)``,
  ``declared_rounds(n, element_size)``, ``declared_shard_rounds(n, element_size)``, ``per_tensor(n)``;
- gives ``last_bytes`` a class default so that setting it still works (the exchange driver counts the bytes now).

The built-ins and ``ErrorFeedback`` are written to the current contract and pass through unchanged. A class is
read the old way when it sets any of those capability attributes itself, defines one of those hooks with its old
signature, reads one of the old per-bucket names in its own methods without declaring ``capabilities``, or
subclasses such a class. Overrides of ``shard_path``, ``shard_problem``, ``encode_parts`` and
``elementwise_state`` are no longer consulted: the capabilities record and commlab/engine/compressors/contract.py
say those.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import fields, replace
from types import CodeType, FunctionType

from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext, Capabilities

OLD = tuple(f.name for f in fields(Capabilities) if f.name != "takes_bucket")
"""The capabilities the earlier contract declared as attributes of the class or instance."""
PER_BUCKET = ("bucket", "process_rank", "last_bytes", "ef")
"""Attributes the communicator and the factory used to set on an instance (``layout`` too, but a context's
``bucket.layout`` reads the same name)."""
HOOKS = {"exchange": 2, "shard_exchange": 3, "declared_rounds": 2, "declared_shard_rounds": 2, "per_tensor": 1}
"""Hooks whose old signature lacked the bucket: how many arguments they took after ``self``."""


def adapt(cls) -> None:
    """Make ``cls`` work under the current contract if it is written to the earlier one (the module's text)."""
    own = cls.__dict__
    olds = [k for k in OLD if k in own]
    hooks = [k for k, n in HOOKS.items() if isinstance(own.get(k), FunctionType) and _positional(own[k]) == n]
    declared = "capabilities" in own
    if olds and declared:
        raise TypeError(f"{cls.name}: declares capabilities and also {', '.join(olds)} as attributes; declare them "
                        f"once, in capabilities = Capabilities(...)")
    if not (getattr(cls, "_legacy", False) or olds or hooks or (not declared and _reads_per_bucket(cls))):
        return
    cls._legacy = True
    start = _start(cls)
    defaults = [(k, getattr(start, k)) for k in OLD] + [("bucket", 0), ("process_rank", 0), ("layout", None),
                                                        ("last_bytes", 0), ("ef", None)]
    for k, v in defaults:  # what the earlier base class had, for code that reads it off the instance
        if not any(k in b.__dict__ for b in cls.__mro__):
            setattr(cls, k, v)
    if not declared:
        cls.capabilities = _Capabilities()
    if not any("encode" in b.__dict__ for b in cls.__mro__):
        cls.encode = _encode
    if isinstance(own.get("compress"), FunctionType):
        cls.compress = _with_bucket(own["compress"], 1)
        if declared and not own["capabilities"].takes_bucket:  # so that callers hand it the context to bind
            cls.capabilities = replace(own["capabilities"], takes_bucket=True)
    for k in hooks:
        setattr(cls, k, _with_bucket(own[k], HOOKS[k]))


def bind(obj, bucket: BucketContext) -> None:
    """Set the old per-bucket attributes of ``obj`` from ``bucket``."""
    obj.bucket, obj.process_rank, obj.layout = bucket.index, bucket.rank, bucket.layout
    obj.ef = bucket.feedback
    obj._legacy_bucket = bucket


def _encode(self, t):
    """The earlier ``Compressor.encode``: ``compress`` with the bucket's error feedback applied, where on."""
    return self.__dict__.get("_legacy_bucket", DEFAULT_BUCKET).encode(self, t)


def _with_bucket(fn, args: int):
    """``fn`` (taking ``args`` arguments after ``self``) as a method that also takes the bucket's context last,
    setting the old per-bucket attributes from it when it is given."""
    @functools.wraps(fn)
    def method(self, *a, bucket=None):
        if len(a) > args:
            a, bucket = a[:args], a[args]
        if bucket is not None:
            bind(self, bucket)
        return fn(self, *a)
    method._legacy_of = fn
    return method


class _Capabilities:
    """An old-style class's ``capabilities``: its attributes read into a record. On the class, its class
    attributes (a property there counts as its parent's value); on an instance, once after ``__init__``, what
    the instance says (a property evaluated, a value its ``__init__`` set), kept on the instance from then on."""

    def __get__(self, obj, cls):
        caps = _record(cls, obj)
        if obj is not None:
            obj.__dict__["capabilities"] = caps
        return caps


def _start(cls) -> Capabilities:
    """The record of the nearest ancestor that declares one (the base class's defaults at least)."""
    for b in cls.__mro__:
        v = b.__dict__.get("capabilities")
        if isinstance(v, Capabilities):
            return v
    return Capabilities()


def _record(cls, obj) -> Capabilities:
    start = _start(cls)
    changes = {"takes_bucket": start.takes_bucket or hasattr(cls.compress, "_legacy_of")}
    for k in OLD:
        if obj is None:
            owner = next((b for b in cls.__mro__ if k in b.__dict__), None)
            if owner is None or _is_property(owner.__dict__[k]):
                continue
            v = owner.__dict__[k]
        else:
            try:
                v = getattr(obj, k)
            except AttributeError:
                continue
        changes[k] = tuple(v) if k in ("dtypes", "elementwise") and isinstance(v, list) else v
    try:
        return replace(start, **changes)
    except TypeError as e:
        raise TypeError(f"{cls.name}: {e}") from None


def _is_property(v) -> bool:
    return isinstance(v, property) or (hasattr(v, "__get__") and not isinstance(v, FunctionType)
                                       and not isinstance(v, (int, float, bool, tuple, list, str)))


def _positional(fn) -> int:
    """Positional parameters of ``fn`` after ``self`` (None where it takes ``*args``)."""
    try:
        ps = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return -1
    if any(p.kind == p.VAR_POSITIONAL for p in ps):
        return -1
    return sum(1 for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _reads_per_bucket(cls) -> bool:
    """Whether a method the class defines reads one of the old per-bucket attributes (``self.bucket``, ...)."""
    def names(code: CodeType):
        yield from code.co_names
        for c in code.co_consts:
            if isinstance(c, CodeType):
                yield from names(c)
    for v in cls.__dict__.values():
        fn = v.fget if isinstance(v, property) else v
        if isinstance(fn, FunctionType) and any(n in PER_BUCKET for n in names(fn.__code__)):
            return True
    return False
