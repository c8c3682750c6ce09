"""The method seam: what ranks exchange, and when, around a stock optimizer's step.

A method decides, step by step, whether the communicator's gradient exchange runs, and what else the
ranks exchange: parameters every H steps (local SGD), pseudo-gradients (DiLoCo), fragments of them in
turn (Streaming DiLoCo), or compressed momentum (DeMo). The trainer and ``commlab.wrap`` call its hooks
around each iteration (commlab/engine/stepper.py):

    exchange = method.begin(step)       # before forward: does the gradient exchange run this step?
    forward, backward                   # wfbp sends buckets during backward only when it does
    communicator.finish()               # the averaged gradients, or this rank's own on a local step
    method.after_backward(step)         # DeMo: exchange momentum components, set p.grad
    optimizer.step(); zero_grad()       # the spec's (or the user's) torch.optim optimizer
    method.after_optimizer_step(step)   # periodic syncs: average, outer step, fragments in flight

A subclass overrides what it needs:

- ``params``: its keyword parameters, declared once (``Param``: type, default, range, one line of help).
  ``Method.__init__`` checks them and stores each as an attribute; the spec reports a bad one as
  ``method.<param>: <problem>``.
- ``check_job(job)`` and ``check_model(tensor_bytes)``: checks that need the rest of the spec or the
  model (raise ``ValueError("<field>: <problem>")``).
- ``setup(ctx)``: once, after the communicator has broadcast rank 0's parameters (ctx: ``Context``).
- ``before_step(step) -> bool``: True when the communicator's gradient exchange runs in this step
  (default: False, every step local). Decided before forward, because wfbp sends during backward.
- ``after_backward(step)``, ``after_optimizer_step(step)``: the method's own exchanges, through
  ``commlab.engine.methods.transfer`` (the lab's exchange driver, compressors and timeline lanes).
- ``exchanges_at(step)`` and ``schedule(tensor_bytes, steps)``: pure descriptions of which steps send
  what, for the spec's fault checks, tests and the performance model (commlab/lab/strategy/perfmodel/local.py), with
  ``parts(tensor_bytes)`` (which tensors each fragment holds) and, for a method that brings its own codec
  (DeMo, SparseLoCo), ``codec()`` and ``codec_numel(n)`` (what the model times).
- ``global_params()``: the parameters every rank agrees on (what evaluation reads), or None.
- ``state_dict()``/``load_state_dict()``: what a checkpoint keeps (step counts, outer momentum,
  residuals), and what a replica that recovers under fault tolerance takes from its source.

Under fault tolerance (``ctx.quorum``, a ``Quorum``) a method's inner steps are local and join no quorum; each
sync joins one before its exchange (``join``) and is applied only if it commits (``commit``). A method that does so
says ``fault_tolerant = True`` (every built-in one; a user's method too, once its syncs do); fault tolerance refuses
the others.

Exchanges never apply optimizer updates by hand where a stock optimizer fits: DiLoCo's outer step is a
``torch.optim.SGD`` with Nesterov momentum over the global parameters.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from commlab.engine.compressors.base import Compressor
from commlab.engine.compressors.params import Param, take
from commlab.engine.compressors.plan import Plan
from commlab.engine.netmodel import ModeledLink
from commlab.engine.timeline import Timeline

Tensor = torch.Tensor


class Event(NamedTuple):
    """One exchange in a method's schedule (``Method.schedule``)."""
    step: int
    """The step (0-based) in which it is issued."""
    kind: str
    """"gradients": the communicator's per-step exchange (the spec's compressor applies);
    "params": parameters averaged uncompressed; "pseudo": pseudo-gradients (method.compressor, or the method's own
    codec, applies);
    "components": DeMo's sparse momentum components (bytes exact); "moments": the optimizer's state averaged
    uncompressed (DES-LOC's Adam moments, one event per moment)."""
    bytes: int
    """Bytes of what is exchanged before any compression (per rank)."""
    overlap: int
    """Inner steps the exchange overlaps before it is needed (Streaming DiLoCo's tau, DiLoCo's H under overlap);
    0: blocking."""
    fragment: int = 0
    """Which fragment of the parameters (Streaming DiLoCo); 0 otherwise."""


@dataclass
class Context:
    """What a method works on, handed to ``setup`` by the stepper."""
    params: List[torch.nn.Parameter]
    """The trainable parameters, in registration order (what the optimizer steps)."""
    names: List[str]
    world: int
    rank: int
    group: Any = None
    link: Optional[ModeledLink] = None
    """The modeled link (network: modeled) the gradient exchange books too, or None."""
    timeline: Optional[Timeline] = None
    plan: Optional[Plan] = None
    """Makes the compressor of each of the method's exchanges (method.compressor; none by default)."""
    on_issue: Callable[[int], None] = field(default=lambda step: None)
    """Called with the step after each of the method's collectives is issued (fault injection at a sync)."""
    quorum: Optional["Quorum"] = None
    """Fault tolerance (commlab/engine/ft.py): each sync joins a quorum and is applied only when it commits; None
    otherwise. ``world`` and ``rank`` are then the quorum's, set at each ``join``."""
    optimizer: Optional[torch.optim.Optimizer] = None
    """The optimizer that steps ``params`` (the spec's or the user's), for a method that exchanges its state
    (DES-LOC averages Adam's moments); None where the caller has none to give."""


class Quorum:
    """What a method's syncs ask of fault tolerance (the Stepper answers it, commlab/engine/stepper.py). A sync
    calls ``join`` before its first collective and ``commit`` once, after its last one and before it changes
    anything; between the two, nothing else joins a quorum (one sync at a time)."""

    def join(self, step: int) -> int:
        """Join the quorum of the sync at ``step``. A replica that is behind recovers here: its model, optimizer
        and the method's state (``state_dict``) become its source's, as the source joined this sync; the
        returned step is then the source's, and the sync to run is the one of that step."""
        raise NotImplementedError

    def commit(self) -> bool:
        """Whether the sync commits (every participant's exchange went through, enough took part)."""
        raise NotImplementedError


class Method:
    """Base class of the methods. ``name`` is what a spec writes (``method: {name: ...}``); a user's
    method subclasses this in its own module and is named by import path (``pkg.module:Class``)."""

    name = "base"
    params: Tuple[Param, ...] = ()
    """The keyword parameters, declared once (commlab/engine/compressors/params.py)."""
    takes_compressor = False
    """True when ``method.compressor`` compresses this method's exchanges (pseudo-gradients)."""
    exchanges_gradients = False
    """True when some steps run the communicator's gradient exchange (post-local SGD's warm-up): then
    the spec's top-level compressor applies on those steps."""
    exchanges_every_step = False
    """True when the method's own exchange runs inside every step, after the backward pass (DeMo's): under fault
    tolerance each step then joins a quorum and the optimizer steps only when it commits, as a per-step exchange."""
    fault_tolerant = False
    """True when the method runs under fault tolerance: each of its syncs calls ``ctx.quorum.join`` before its first
    collective and applies its result only when ``ctx.quorum.commit()`` (or, with ``exchanges_every_step``, its
    exchange is the step's, and the step commits); ``state_dict`` holds what a replica that recovers must take. A
    spec with ``fault_tolerance.enabled`` and a method without it is refused."""
    NOT_FAULT_TOLERANT = "does not say its syncs join fault tolerance's quorum (Method.fault_tolerant)"
    """The refusal of a method without ``fault_tolerant`` under fault tolerance, after its name (the spec's, a
    rank's)."""
    checks_model = False
    """True when ``check_model`` needs the model's tensor sizes (the lab builds it before any rank starts)."""

    def __init__(self, **given):
        checked = take(self.name, self.params, given)
        for k, v in checked.items():
            setattr(self, k, v)
        self.given = {k: checked[k] for k in given}
        self.step_bytes = 0
        """Bytes this rank sent in the method's exchanges during the current step."""
        self.step_log: Dict[str, Any] = {}
        """Fields the current step's metrics line gets (``sync_bytes``, ``fragment``, ...)."""
        self.ctx: Optional[Context] = None

    # -- checks --------------------------------------------------------------
    def values(self) -> Dict[str, Any]:
        """Every declared parameter's value (what spec.json records)."""
        return {p.name: getattr(self, p.name) for p in self.params}

    def check_job(self, job: Dict[str, Any]) -> None:
        """Raise ``ValueError("<spec field>: <problem>")`` when the rest of the spec does not fit this method.
        ``job`` holds the spec's sections as plain dicts (optimizer, compressor, comm, ...)."""

    def check_model(self, tensor_bytes: Sequence[int]) -> None:
        """Raise ``ValueError("<param>: <problem>")`` when the parameters do not fit a model whose trainable
        tensors have these byte sizes (registration order)."""

    # -- the step ------------------------------------------------------------
    def setup(self, ctx: Context) -> None:
        self.ctx = ctx
        self.check_model([p.numel() * p.element_size() for p in ctx.params])

    def begin(self, step: int) -> bool:
        """A new step (the stepper calls it; subclasses override ``before_step``): clears the step's
        bytes and log, then asks ``before_step``."""
        self.step_bytes = 0
        self.step_log = {}
        return bool(self.before_step(step))

    def before_step(self, step: int) -> bool:
        """True when the communicator's gradient exchange runs in ``step``."""
        return False

    def after_backward(self, step: int) -> None:
        """After the communicator's finish, before the optimizer steps (p.grad may be replaced in place)."""

    def after_optimizer_step(self, step: int) -> None:
        """After the optimizer stepped and gradients were zeroed: periodic syncs."""

    def exchanges_at(self, step: int) -> bool:
        """True when the method issues an exchange of its own in ``step`` (pure)."""
        return False

    def schedule(self, tensor_bytes: Sequence[int], steps: int, element_size: int = 4) -> List[Event]:
        """The exchanges of ``steps`` steps of a model whose trainable tensors have these byte sizes,
        in issue order (pure: no tensors, no collectives)."""
        return []

    def parts(self, tensor_bytes: Sequence[int]) -> List[List[int]]:
        """The tensors (indices in registration order) that each fragment of the method's exchanges holds,
        fragment by fragment (``Event.fragment``): one part of every tensor unless the method syncs the
        parameters in fragments (Streaming DiLoCo)."""
        return [list(range(len(tensor_bytes)))]

    def codec(self) -> Optional[Compressor]:
        """A fresh instance of the codec of the method's own exchanges when the method brings its own
        (DeMo's DCT top-k), for the performance model to time; None when ``method.compressor`` (or nothing)
        compresses them."""
        return None

    def codec_numel(self, numel: int) -> int:
        """The length of the flat tensor the method hands its codec for ``numel`` elements (DeMo pads each
        tensor to whole chunks)."""
        return numel

    # -- what the ranks agree on ----------------------------------------------
    def global_params(self) -> Optional[List[Tensor]]:
        """Parameters every rank holds alike (one per ``ctx.params``), which evaluation reads instead of the
        local ones; None when the local parameters are those (or there is nothing better)."""
        return None

    @contextlib.contextmanager
    def evaluating(self):
        """Within this block the model holds ``global_params()``; its own parameters come back after."""
        glob = self.global_params() if self.ctx is not None else None
        if glob is None:
            yield
            return
        saved = [p.detach().clone() for p in self.ctx.params]
        with torch.no_grad():
            for p, g in zip(self.ctx.params, glob):
                p.copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.ctx.params, saved):
                    p.copy_(s)

    # -- state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def drain(self) -> None:
        """At the end of training, on every rank alike: wait for exchanges still in flight (their results
        are dropped: no step is left to apply them)."""

    def close(self) -> None:
        """Drop pending exchanges (no collective here: close also runs when a rank fails)."""

    def describe(self) -> str:
        ps = ",".join(f"{k}={v}" for k, v in sorted(self.given.items()))
        return f"{self.name}{'(' + ps + ')' if ps else ''}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.values().items())})"


def periodic(step: int, every: int, start: int = 0) -> bool:
    """True at the last step of each period of ``every`` steps counted from ``start`` (0-based steps)."""
    return step >= start and (step - start + 1) % every == 0


def without_residuals(state):
    """A compressor's state_dict with every ``residual`` left out (set to None): error feedback's and PowerSGD's,
    each replica's own under fault tolerance (a recovery hands over the rest)."""
    if isinstance(state, dict):
        return {k: None if k == "residual" else without_residuals(v) for k, v in state.items()}
    return state


def cloned(state):
    """A state_dict with every tensor copied: a snapshot the next step cannot change."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cloned(v) for v in state)
    return state
