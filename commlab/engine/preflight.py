"""Build a spec's model once, outside any process group, before ranks start.

``check(spec)`` runs one forward pass and the loss on a two-example batch of the
training split, so a model and a data set that do not fit each other fail with
one line in the launching process instead of a traceback in every rank.
``describe(spec)`` gives the parameter count and the gradient's size (what one
uncompressed all-reduce moves per step), for the UI before a run starts.

Both build what the spec names, so neither runs in a process that serves viewers
(commlab.engine.codepath.imports_allowed): there they run in a child with limits (commlab/lab/base/sandbox.py).
"""
from __future__ import annotations

import dataclasses

import torch

from commlab.engine import codepath, external, models
from commlab.engine.external import _first_line
from commlab.engine.spec import JobSpec, SpecError
from commlab.engine.trainer import load_data

DESCRIBE_EXAMPLES = 64
"""``describe`` builds a synthetic data set of this many examples: the model's size depends on the data's
shape, classes and vocabulary, never on how many examples there are."""


def _here(what: str) -> None:
    if not codepath.imports_allowed():
        raise RuntimeError(f"preflight.{what} builds what a spec names; this process serves viewers, so it "
                           f"runs in a child process (commlab.lab.base.sandbox)")


def build(spec: JobSpec, meta: bool = False):
    """(data set, model) on the CPU, seeded as the ranks seed them. Errors are SpecErrors. With ``meta`` the
    model's parameters have shapes but no storage (torch's meta device): its size without its memory."""
    _here("build")
    torch.manual_seed(spec.seed)
    try:
        ds = load_data(spec)
    except ValueError as e:
        raise _spec_error(e, "dataset") from None
    try:
        if meta:
            with torch.device("meta"):
                model = models.build(spec.model.name, ds.info, **spec.model.options)
        else:
            model = models.build(spec.model.name, ds.info, **spec.model.options)
    except ValueError as e:
        raise _spec_error(e, "model") from None
    return ds, model


def sized(spec: JobSpec):
    """The spec's model for counting, not training: built on a small data set of the same shape and, for the
    lab's own builders (the zoo, torchvision, transformers), on the meta device, so a model of a billion
    parameters is counted without a byte of its weights. A user's factory is built for real (its code may
    do anything with its tensors)."""
    if spec.dataset.name == "synthetic":
        spec = dataclasses.replace(spec, dataset=dataclasses.replace(spec.dataset, size=DESCRIBE_EXAMPLES))
    return build(spec, meta=not codepath.is_import_path(spec.model.name))[1]


def describe(spec: JobSpec) -> dict:
    """The model's size (``describe_model``), counted on ``sized``."""
    return describe_model(sized(spec))


def parameters(spec: JobSpec) -> list:
    """[name, bytes] of the model's trainable parameters in registration order, counted on ``sized``."""
    return [[n, p.numel() * p.element_size()] for n, p in sized(spec).named_parameters() if p.requires_grad]


def check(spec: JobSpec) -> dict:
    """Build the model and push one small training batch through it and the loss."""
    ds, model = build(spec)
    n = min(2, spec.batch_size, ds.size("train"))
    try:
        x, y = ds.batch("train", torch.arange(n))
    except Exception as e:  # the user's data set, any failure
        raise SpecError("dataset", f"{spec.dataset.name}: reading the first batch failed: "
                                   f"{type(e).__name__}: {_first_line(e)}") from None
    try:
        out = model(x)
    except Exception as e:
        raise SpecError("model", f"{spec.model.name} does not take the first batch of {spec.dataset.name} "
                                 f"(x {tuple(x.shape)} {x.dtype}): {type(e).__name__}: {_first_line(e)}") from None
    try:
        loss = models.make_loss(spec.model.loss)(out, y)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise TypeError(f"the loss is {type(loss).__name__} {getattr(loss, 'shape', '')}, not a scalar tensor")
        loss.backward()
    except Exception as e:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise SpecError("model.loss" if spec.model.loss else "model",
                        f"the loss does not fit {spec.model.name}'s output {shape} and labels "
                        f"{tuple(y.shape)} {y.dtype}: {type(e).__name__}: {_first_line(e)}") from None
    check_method(spec, model)
    return describe_model(model)


def check_method(spec: JobSpec, model) -> None:
    """The spec's method against the model's trainable tensors (more fragments than tensors, ...)."""
    m = spec.method.build()
    if m is None:
        return
    try:
        m.check_model([p.numel() * p.element_size() for p in model.parameters() if p.requires_grad])
    except ValueError as e:
        where, _, msg = str(e).partition(": ")
        raise SpecError(f"method.{where}", msg) from None


def describe_model(model) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    return {"params": sum(p.numel() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params),
            "tensors": len(params), "tied": external.tied_parameters(model)}


def _spec_error(e: ValueError, default: str) -> SpecError:
    head, sep, msg = str(e).partition(": ")
    if sep and head.split(".")[0] in ("model", "dataset"):
        return SpecError(head, msg)
    return SpecError(default, str(e))
