"""Code named by a spec: which fields name it, the syntax of an import path, and whether this process
may import it. Nothing here imports torch or the code it names.

An import path (``package.module:object``) names code that the lab would import and call: a model factory,
a data loader, a loss, a compressor class. ``torchvision:<arch>`` and ``hf:<type>`` name library models,
not code. ``code_fields`` finds every such field of a spec; commlab/room/owners.py (``refuse_code``) keeps them the
teacher's on a lab others share.

A process that serves untrusted viewers (the UI's server) calls ``forbid_imports_when`` once; from then on,
where its predicate holds, ``imports_allowed()`` is false and the spec's checks look at the syntax of what
it names (``check_path``) instead of importing it (commlab/engine/spec.py, commlab/engine/external.py). ``no_imports`` does
the same for one block of code.
"""
from __future__ import annotations

import contextlib
import contextvars
import re
from typing import Any, Callable, List, Optional, Tuple

LIBRARY_PREFIXES = ("torchvision:", "hf:")
"""Names of library models (commlab/engine/external.py): a torchvision architecture, a transformers model type."""

ZOO_KIND = {"mlp": "image", "cnn": "image", "resnet": "image", "transformer": "text"}
"""The model zoo's names (commlab/engine/models.py) and the data kind each trains on: a spec naming one is checked
here, without importing torch."""


def zoo_kind(name: str) -> str:
    """The data kind zoo model ``name`` needs; a one-line ValueError naming the allowed names otherwise."""
    if name not in ZOO_KIND:
        raise ValueError(f"model: unknown name {name!r}; allowed: {', '.join(ZOO_KIND)}, "
                         f"torchvision:<arch>, hf:<type>, package.module:factory")
    return ZOO_KIND[name]


ZOO_OPTIONS = {"mlp": ("hidden", "depth"), "cnn": (), "resnet": ("width",),
               "transformer": ("n_layer", "n_head", "n_embd")}
"""The options each zoo model's builder takes (its keyword arguments in commlab/engine/models.py), each a positive
integer up to ``MAX_ZOO_OPTION``."""
MAX_ZOO_OPTION = 65536
_ZOO_DEFAULTS = {"n_head": 4, "n_embd": 128}


def check_zoo_options(name: str, options: dict) -> None:
    """One-line ValueError (``model.<option>: ...``) for an option zoo model ``name`` does not take or a value it
    cannot build with, checked with the spec, before any rank starts (a rank met it as a TypeError)."""
    allowed = ZOO_OPTIONS[name]
    for key, value in options.items():
        if key not in allowed:
            raise ValueError(f"model.{key}: {name} takes no option {key!r}; allowed: "
                             f"{', '.join(allowed) if allowed else 'none'}")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ZOO_OPTION:
            raise ValueError(f"model.{key}: must be an integer in 1..{MAX_ZOO_OPTION}, got {value!r}")
    if name == "transformer":
        got = {**_ZOO_DEFAULTS, **options}
        if got["n_embd"] % got["n_head"]:
            raise ValueError(f"model.n_embd: must be divisible by n_head ({got['n_head']}), got {got['n_embd']}")


def is_external(name: str) -> bool:
    """Whether a model or data set ``name`` comes from outside the zoo: a library model (torchvision:, hf:) or code
    named by import path."""
    return ":" in name


def is_import_path(name: str) -> bool:
    """Whether ``name`` names code by import path (package.module:object), not a library model."""
    return ":" in name and not name.startswith(LIBRARY_PREFIXES)


CODE_KEYS = ("name", "loss")
"""Keys whose value, when it is an import path (package.module:object), names code the lab would import:
model.name, model.loss, dataset.name, compressor.name and its per_bucket rules' names, and the same key in
any section added later (a method, a user compressor)."""


def code_fields(data: Any) -> List[Tuple[str, str]]:
    """Every (field, import path) of a spec that names code, in the spec's order: a spec dict as written
    (short forms such as ``model: pkg.mod:build`` included) or ``JobSpec.to_dict()``. torchvision:<arch>
    and hf:<type> name library models, not code. The run's own ``name`` is free text, never code."""
    out: List[Tuple[str, str]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(v, str):
                    if k in CODE_KEYS and path and is_import_path(v):
                        out.append((sub, v))
                else:
                    walk(v, sub)
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    if isinstance(data, dict):
        for key, value in data.items():
            if isinstance(value, str) and key != "name" and is_import_path(value):
                out.append((f"{key}.name", value))  # the short form: model: pkg.mod:build
            elif key != "name":
                walk(value, str(key))
    return out


_NO_IMPORTS = contextvars.ContextVar("commlab_no_imports", default=False)
_forbid_when: Optional[Callable[[], bool]] = None
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
IMPORT_PATH = re.compile(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*")
ARCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""What may follow ``torchvision:`` or ``hf:`` (an architecture or a model type), checked without importing."""


def forbid_imports_when(predicate: Callable[[], bool]) -> None:
    """From now on, in this process, refuse to import what a spec names whenever ``predicate()`` is true
    (the UI's server installs one that is true in every thread serving a viewer). Replaces an earlier one."""
    global _forbid_when
    _forbid_when = predicate


@contextlib.contextmanager
def no_imports():
    """Inside this block (this thread or task), spec names are checked for their syntax only."""
    token = _NO_IMPORTS.set(True)
    try:
        yield
    finally:
        _NO_IMPORTS.reset(token)


def imports_allowed() -> bool:
    """Whether this process may import (and call) code a spec names, here and now."""
    return not _NO_IMPORTS.get() and not (_forbid_when is not None and _forbid_when())


def check_path(path: str, field: str) -> None:
    """The syntax of ``pkg.module:attr`` (identifiers only); a one-line ValueError naming ``field`` otherwise.
    Imports nothing."""
    if not isinstance(path, str) or not IMPORT_PATH.fullmatch(path):
        raise ValueError(f"{field}: {path!r} is not an import path; write package.module:function")
