"""Models and data sets from outside the zoo, named in the spec by prefix or import path:

    torchvision:<arch>     a torchvision classifier, randomly initialised (weights=None)
    hf:<model_type>        a Hugging Face transformers causal LM built from its config
                           (AutoConfig.for_model(model_type, **options)), randomly initialised
    pkg.module:factory     any importable callable returning an nn.Module; options are passed
                           as keywords, plus ``info`` (the data set's DataInfo) if it takes one
    pkg.module:loader      (a data set) returns (train, held_out): indexable, sized, items (x, y)

Nothing is downloaded: torchvision gets ``weights=None`` and transformers builds from a config
with the hub switched off. torchvision and transformers are optional (the ``models`` extra); a
name that needs a missing package is refused with a one-line message, like any unknown name.

A process that serves untrusted viewers (the UI's server) never imports what a spec names
(commlab.engine.codepath.imports_allowed): there a spec's names are checked for their syntax only
(``check_import``, ``check_model``) and ``import_object`` refuses. The checks that need the code
run in a child process with limits (commlab/lab/base/sandbox.py).
"""
from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from commlab.engine.codepath import ARCH, LIBRARY_PREFIXES, check_path, imports_allowed

TORCHVISION, HF = LIBRARY_PREFIXES


def check_import(path: str, field: str) -> None:
    """An import path's syntax and, where this process may import (``imports_allowed``), the object it names."""
    check_path(path, field)
    if imports_allowed():
        import_object(path, field)


def import_object(path: str, field: str):
    """``pkg.module:attr`` -> the object; a one-line ValueError naming ``field`` otherwise. Refused in a
    process that serves viewers (commlab.engine.codepath.forbid_imports_when): nothing a viewer names is imported
    there."""
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"{field}: {path!r} is not an import path; write package.module:function")
    if not imports_allowed():
        raise ValueError(f"{field}: {path!r} is not imported in this process, which serves the lab's viewers; "
                         f"code is checked in a child process (commlab.lab.base.sandbox)")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise ValueError(f"{field}: cannot import {mod_name!r} ({type(e).__name__}: {_first_line(e)}); "
                         f"is it on PYTHONPATH?") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}: module {mod_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{field}: {path!r} is not callable")
    return obj


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else ""


# ---------------------------------------------------------------- optional packages

_TV_SHIM = None
"""The torch.library.Library holding torchvision's operator names when its C++ extension cannot
load (kept alive here: a Library removes its definitions when it is collected)."""
_TV_REGISTERED = re.compile(r'"torchvision::(\w+)"')


def import_torchvision():
    """``import torchvision``, also where its C++ extension (``_C.so``) cannot load into this torch.

    The only torchvision 0.28 wheel this machine's index has is the CUDA build; its ``_C.so`` does
    not load into the CPU torch 2.13, and torchvision then fails while importing: it registers fake
    (shape) kernels for its C++ operators unconditionally, and ``torchvision::nms`` does not exist.
    In that case the operator names that torchvision's ``_meta_registrations.py`` and
    ``_autograd_registrations.py`` refer to are defined first, with a generic schema and no kernel,
    and the import goes through. The models (classifiers: convolutions, pooling, linear layers) are
    pure torch and work; the detection operators (``nms``, ``roi_align``, ``deform_conv2d``, ...)
    stay unavailable and raise if called. Said once per process on stderr (the run's log.txt).
    """
    global _TV_SHIM
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'torchvision'")
    pkg = Path(list(spec.submodule_search_locations)[0])
    why = _load_extension(pkg)
    if why is not None and _TV_SHIM is None:
        names = set()
        for f in ("_meta_registrations.py", "_autograd_registrations.py"):
            if (pkg / f).is_file():
                names.update(_TV_REGISTERED.findall((pkg / f).read_text()))
        lib = torch.library.Library("torchvision", "DEF")
        for name in sorted(names):
            if not hasattr(torch.ops.torchvision, name):
                lib.define(f"{name}(Tensor[] args) -> Tensor")
        _TV_SHIM = lib
        if os.environ.get("RANK", "0") == "0":
            # one short line (every torchvision: command says it): the error's kind, not its library path
            ops = sorted(n for n in names if not n.startswith("_"))
            print(f"[commlab] torchvision: its C++ extension does not load into torch {torch.__version__} "
                  f"({why.split(':', 1)[0]}); its models work, its {len(ops)} C++ operators ({', '.join(ops[:2])}, "
                  f"...) raise if called", file=sys.stderr, flush=True)
    import torchvision
    return torchvision


def _load_extension(pkg: Path) -> Optional[str]:
    """None when torchvision's ``_C`` extension in ``pkg`` loads into this torch, else why not."""
    libs = [p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in pkg.glob(f"_C{suffix}")]
    if not libs:
        return "no _C extension in the package"
    try:
        torch.ops.load_library(str(libs[0]))
        return None
    except (OSError, ImportError, RuntimeError) as e:
        return f"{type(e).__name__}: {_first_line(e)[:120]}"


def _torchvision():
    try:
        import_torchvision()
        import torchvision.models as tvm
    except Exception as e:  # a torchvision built for another torch fails with RuntimeError, not ImportError
        raise ValueError(f"model: torchvision is not usable here ({type(e).__name__}: {_first_line(e)}); "
                         f"install the models extra (./setup.sh)") from None
    return tvm


def _transformers():
    # from_config never fetches anything; these make sure no other path of the library does either
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        if importlib.util.find_spec("torchvision") is not None:
            import_torchvision()  # transformers imports torchvision whenever it is installed
        import transformers
    except Exception as e:
        raise ValueError(f"model: transformers is not usable here ({type(e).__name__}: {_first_line(e)}); "
                         f"install the models extra (./setup.sh)") from None
    transformers.logging.set_verbosity_error()
    return transformers


def available(prefix: str) -> bool:
    """Whether the optional package behind ``torchvision:`` or ``hf:`` imports (for the UI and tests)."""
    try:
        (_torchvision if prefix == TORCHVISION else _transformers)()
        return True
    except ValueError:
        return False


def _unknown(field: str, what: str, name: str, allowed) -> ValueError:
    near = difflib.get_close_matches(name, list(allowed), n=3)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    return ValueError(f"{field}: unknown {what} {name!r}{hint}")


def torchvision_archs() -> list:
    return sorted(_torchvision().list_models(module=_torchvision()))


def hf_causal_types() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    _transformers()
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# ---------------------------------------------------------------- models

def model_kind(name: str) -> Optional[str]:
    """The data kind an external model needs: "image", "text", or None (a user factory: its
    first batch decides)."""
    if name.startswith(TORCHVISION):
        return "image"
    if name.startswith(HF):
        return "text"
    return None


def check_model(name: str) -> None:
    """Refuse unknown architectures and import failures with one line (spec time; builds nothing). Where
    this process may not import (``imports_allowed``), only the name's syntax is checked: not even
    torchvision or transformers are loaded for it."""
    if not imports_allowed():
        if name.startswith((TORCHVISION, HF)):
            arch = name.partition(":")[2]
            if not ARCH.fullmatch(arch):
                raise ValueError(f"model.name: {arch!r} is not an architecture name (letters, digits, '_', '-', "
                                 f"'.')")
        else:
            check_path(name, "model.name")
        return
    if name.startswith(TORCHVISION):
        arch = name[len(TORCHVISION):]
        if arch not in torchvision_archs():
            raise _unknown("model.name", "torchvision classifier", arch, torchvision_archs())
    elif name.startswith(HF):
        mtype = name[len(HF):]
        _transformers()
        from transformers import CONFIG_MAPPING
        if mtype not in CONFIG_MAPPING:
            raise _unknown("model.name", "Hugging Face model type", mtype, hf_causal_types())
        if mtype not in hf_causal_types():
            raise ValueError(f"model.name: hf:{mtype} has no causal-LM head; "
                             f"e.g. {', '.join(t for t in ('gpt2', 'llama', 'gpt_neox', 'opt') if t in hf_causal_types())}")
    else:
        import_object(name, "model.name")


def build_model(name: str, info, **options) -> nn.Module:
    if name.startswith(TORCHVISION):
        arch = name[len(TORCHVISION):]
        check_model(name)
        if info.kind != "image" or info.input_shape[0] != 3:
            raise ValueError(f"model: {name} takes 3-channel images, the data set gives {info.kind} "
                             f"{tuple(info.input_shape)}; use dataset {{name: synthetic, shape: [3, 64, 64]}}")
        opts = {"num_classes": info.num_classes, **options}
        try:
            return _torchvision().get_model(arch, weights=None, **opts)
        except (TypeError, ValueError) as e:
            raise ValueError(f"model.options: {name}: {_first_line(e)}") from None
    if name.startswith(HF):
        check_model(name)
        return HFCausalLM.from_type(name[len(HF):], info, **options)
    factory = import_object(name, "model.name")
    kw = dict(options)
    if "info" in inspect.signature(factory).parameters:
        kw["info"] = info
    try:
        model = factory(**kw)
    except TypeError as e:
        raise ValueError(f"model.options: {name}: {_first_line(e)}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.name: {name} returned {type(model).__name__}, not a torch.nn.Module")
    return model


class HFCausalLM(nn.Module):
    """A transformers causal LM that takes token ids and returns (B, T, vocab) logits, as the zoo's
    GPT does, so the trainer's next-token loss and accuracy apply unchanged. The wrapper owns no
    parameters, so per-layer hooks see the library's own leaf modules."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @classmethod
    def from_type(cls, model_type: str, info, **options) -> "HFCausalLM":
        if info.kind != "text":
            raise ValueError(f"model: hf:{model_type} is a causal LM and needs token data (dataset text, or "
                             f"synthetic with vocab), got {info.kind}")
        tr = _transformers()
        opts = dict(options)
        opts.setdefault("vocab_size", info.num_classes)
        try:
            cfg = tr.AutoConfig.for_model(model_type, **opts)
        except (TypeError, ValueError) as e:
            raise ValueError(f"model.options: hf:{model_type}: {_first_line(e)}") from None
        if cfg.vocab_size < info.num_classes:
            raise ValueError(f"model.vocab_size: {cfg.vocab_size} is below the data set's vocabulary "
                             f"{info.num_classes}")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the default ids may lie past a small vocab
            v = getattr(cfg, key, None)
            if isinstance(v, int) and v >= cfg.vocab_size and key not in options:
                setattr(cfg, key, None)
        return cls(tr.AutoModelForCausalLM.from_config(cfg))

    def forward(self, idx):
        return self.model(input_ids=idx, use_cache=False).logits


def tied_parameters(model: nn.Module) -> list:
    """Names of modules that share a parameter with an earlier module (tied weights)."""
    seen, tied = {}, []
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen and seen[id(p)] != mname:
                tied.append(f"{mname}.{pname} = {seen[id(p)]}")
            seen.setdefault(id(p), mname)
    return tied
