"""The New run form's side in the lab, without Streamlit: the choices it offers (from the engine's registries
and the spec's types, less what a student may not use), the checks it shows under each field (the spec, the
viewer's quotas, the model's size counted in a child), and the submit that queues the run for the viewer.
"""
from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

import yaml

from commlab.engine import codepath
from commlab.engine.spec import (
    COMM_AVAILABLE,
    DATASETS,
    LINKS_AVAILABLE,
    SCHEDULES_AVAILABLE,
    JobSpec,
    OptimizerSpec,
    SpecError,
)
from commlab.lab.base.specs import load_spec, typed_yaml
from commlab.room import previews
from commlab.lab.front.ui import may_run_code, queue_runs, runs_dir, viewer
from commlab.lab.rundir.store import Run
from commlab.room import owners


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def compressor_params(name: str) -> list:
    """A compressor's keyword parameters as its class declares them (commlab.engine.compressors.params.Param: name,
    type, default or None with what unset means, range, one-line help)."""
    from commlab.engine.compressors import REGISTRY
    return list(REGISTRY[name].params)


def compressor_info(name: str) -> dict:
    """What a compressor declares it can do (its ``Capabilities``), read from an instance at its default parameters."""
    from commlab.engine import compressors
    c = compressors.make(name)
    k = c.capabilities
    return {"summable": k.summable, "keeps_shape": k.keeps_shape, "lossless": k.lossless, "rounds": k.rounds,
            "builtin_feedback": k.builtin_feedback, "elementwise": k.elementwise,
            "doc": (inspect.getdoc(type(c)) or "").split("\n\n")[0]}


def choices() -> dict:
    """Every choice the form offers, from the engine's registries and the spec's Literal types."""
    import typing

    from commlab.engine import compressors, models
    datasets = DATASETS
    cuda = cuda_available()
    return {
        "models": models.NAMES,
        "datasets": datasets,
        "optimizers": typing.get_args(typing.get_type_hints(OptimizerSpec)["name"]),
        "decays": typing.get_args(typing.get_type_hints(OptimizerSpec)["decay"]),
        "compressors": compressors.names(),
        "schedules": SCHEDULES_AVAILABLE,
        "comm": COMM_AVAILABLE,
        "links": LINKS_AVAILABLE,
        "devices": ("auto", "cpu", "cuda") if cuda else ("cpu",),
        "backends": ("auto", "gloo", "nccl") if cuda else ("gloo",),
        "cuda": cuda,
    }


def compressors_for(mode: str) -> List[str]:
    """The compressors a comm mode accepts: dear reduce-scatters the payload itself, so only the
    single-round, summable ones whose payload keeps the gradient's shape (commlab.engine.compressors.shardable);
    the other modes take every compressor."""
    from commlab.engine import compressors
    return list(compressors.shardable()) if mode == "dear" else list(compressors.names())


MODEL_SOURCES = ("zoo", "torchvision:", "hf:", "import path")
"""Where the form's model comes from: the built-in zoo, a torchvision classifier, a Hugging Face
causal LM built from its config, or package.module:factory from the user's code."""
IMPORT_PATH = "import path"


COMPRESSOR_SOURCES = ("registry", IMPORT_PATH)
"""Where the form's compressor comes from: the registry (the built-ins and anything registered), or
package.module:Class, a subclass of commlab.Compressor from the user's code."""


def compressor_sources() -> List[str]:
    """COMPRESSOR_SOURCES the viewer may choose: a student is offered the registry only."""
    return [s for s in COMPRESSOR_SOURCES if s != IMPORT_PATH or may_run_code()]


def model_sources() -> List[str]:
    """MODEL_SOURCES the viewer may choose: a student is not offered an import path."""
    return [m for m in MODEL_SOURCES if m != IMPORT_PATH or may_run_code()]


def dataset_sources(model: str) -> List[str]:
    """``datasets_for(model)``, and an import-path loader for a viewer who may run code."""
    return datasets_for(model) + ([IMPORT_PATH] if may_run_code() else [])


def model_name(source: str, text: str) -> str:
    """The spec's model.name from the form's source choice and name field."""
    text = text.strip()
    return text if source in ("zoo", "import path") else source + text


def datasets_for(model: str) -> List[str]:
    """The shipped data sets a model can train on (synthetic includes token data for language models);
    a model from outside the zoo can also take an import-path loader."""
    from commlab.engine import models
    try:
        need = models.kind(model)
    except ValueError:
        return list(choices()["datasets"])
    out = [d for d in choices()["datasets"]
           if d == "synthetic" or need is None or need == ("text" if d == "text" else "image")]
    if model.startswith("torchvision:"):
        out = ["synthetic"]  # 3-channel images; digits and mnist have one
    return out


def parse_options(text: str) -> Tuple[dict, Optional[str]]:
    """A YAML mapping typed in the form (model or loader options): (options, error line). Bounded: at most
    commlab.lab.base.specs.MAX_TYPED characters and no aliases (what it builds is never larger than the text)."""
    if not text.strip():
        return {}, None
    try:
        data = typed_yaml(text)
    except ValueError as e:
        return {}, str(e)
    if not isinstance(data, dict):
        return {}, f"must be a mapping such as {{n_layer: 4}}, got {data!r}"
    return data, None


def validate(data: dict) -> Tuple[Optional[JobSpec], Optional[SpecError]]:
    """The validated spec, or the SpecError (``e.path``, ``e.msg``) that names the bad field. For a student:
    a field that names code is refused before anything else (and nothing is imported: the syntax is checked),
    and so is a spec over a per-run limit (commlab.room.owners.quotas), under the field it is about."""
    try:
        spec = _parse(data)
        if not may_run_code():
            owners.check_run(owners.quotas(runs_dir()), spec)
        return spec, None
    except SpecError as e:
        return None, e
    except owners.QuotaError as e:
        return None, SpecError(e.field or "quota", str(e))


def _parse(data: dict) -> JobSpec:
    """The viewer's spec dict, validated. A student's is refused if it names code (before it is parsed), and
    is parsed without importing anything, whatever process this is."""
    if may_run_code():
        return load_spec(data=data)
    owners.refuse_code(data)
    with codepath.no_imports():
        return load_spec(data=data)


def form_check(data: dict) -> Tuple[Optional[JobSpec], Optional[SpecError], Optional[dict]]:
    """What the New run form shows: (spec, None, model size) when ``data`` may be queued by the viewer, else
    (None, the error naming its field, None). The size comes from ``previews.model_size`` (a child process); a
    student's model over the ``params`` limit is refused here, before any click."""
    spec, err = validate(data)
    if err is not None:
        return None, err, None
    try:
        size = previews.model_size(spec, viewer())
        if not may_run_code():
            owners.check_run(owners.quotas(runs_dir()), spec, params=size["params"], tensors=size["tensors"])
    except SpecError as e:
        return None, e, None
    except owners.QuotaError as e:
        return None, SpecError(e.field or "quota", str(e)), None
    return spec, None, size


def error_field(path: str, fields, msg: str = "") -> Optional[str]:
    """The form field an error belongs to: the longest field that is the error's path or a
    prefix of it ("optimizer.lr" -> "optimizer.lr", "dataset.size" -> "dataset"), or a field
    under it ("model" -> "model.name"). Compressor errors carry the parameter in the message
    ("compressor": "ratio: must be ...") and go to "compressor.params" or
    "compressor.error_feedback". None when no field fits."""
    fields = list(fields)
    if path == "compressor":
        param = msg.split(":", 1)[0].strip()
        want = "compressor.error_feedback" if param == "error_feedback" else "compressor.params"
        if want in fields:
            return want
    if path in fields:
        return path
    best = None
    for f in fields:
        if path.startswith(f + ".") and (best is None or len(f) > len(best)):
            best = f
    if best:
        return best
    for f in fields:
        if f.startswith(path + "."):
            return f
    return None


def parse_value(text: str):
    """A typed parameter value from a text box (YAML, as ``typed_yaml`` bounds it); '' means unset. Text that
    is not valid YAML, too long or uses aliases is kept as the string it is: the spec's check then names the
    field it does not fit."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        return typed_yaml(text)
    except ValueError:
        return text


def submit(data: dict, runs=None) -> Run:
    """Queue a run from a form's spec dict for the viewer (within their quotas); returns at once. A
    student's spec that names code is refused before it is even parsed."""
    return queue_runs(runs or runs_dir(), [_parse(data)])[0]


def spec_yaml(spec: JobSpec) -> str:
    return yaml.safe_dump(spec.to_dict(), sort_keys=False)
