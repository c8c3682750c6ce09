"""The communicator core that every comm mode is built on (sync and wfbp in commlab/engine/comm/wfbp.py, dear in
commlab/engine/comm/dear.py).

What the core owns, for every mode alike:

- the parameters in gradient order (reverse registration order, as DDP assumes) and rank 0's
  broadcast of the initial model;
- buckets: one flat gradient buffer each (padded where the mode needs it), the parameters'
  gradients as views of it; a gradient lands there directly (autograd accumulates into the view)
  or by one copy when something replaced ``p.grad`` (``zero_grad(set_to_none=True)``);
- readiness: a post-accumulate-grad hook per parameter counts arrivals; when a bucket's last
  gradient lands the mode hears of it (``_bucket_ready``); buckets are launched strictly in
  bucket order, so every rank issues the same collectives in the same order;
- bulk landing: a bucket that cannot launch before backward ends anyway (the last one in launch
  order; every one in sync) gets no per-parameter hook from the second step on (the first step
  records the arrival order): its gradients stay where autograd put them and land in ``finish``,
  all in one pass (``_land_bulk``), with one hook on one of their parameters left to catch a
  second backward before ``finish``;
- pending collectives (``Pending``), their completion stamps and their timeline spans;
- zeroing gradients that never arrived (a parameter forward did not use);
- relayout: rebuilding the buckets at a step boundary, per-element compressor state moving with
  its parameters.

Every mode is built alike, ``Mode(model, layout, plan, *, timeline, group, link, broadcast_from_rank0)``
(commlab/engine/comm/modes.py makes one by name). A mode supplies its bucket type (``_new_bucket``), what happens
when buckets are ready (``_launch``), ``finish``, ``grads_finite`` and, where it differs, what the optimizer
steps (``optimizer_params``). The trainer and ``commlab.wrap`` use only the interface declared on
``Communicator``.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from commlab.engine.comm.collectives import Pending, group_rank, group_size
from commlab.engine.compressors import contract
from commlab.engine.compressors.base import Compressor
from commlab.engine.compressors.capabilities import BucketContext
from commlab.engine.compressors.plan import Plan
from commlab.engine.netmodel import ModeledLink
from commlab.engine.schedules import ParamInfo
from commlab.engine.timeline import Timeline

Tensor = torch.Tensor


# ---------------------------------------------------------------- buckets and gradients

def param_infos(params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> List[ParamInfo]:
    return [ParamInfo(name=n, numel=p.numel(), element_size=p.element_size(),
                      dtype=str(p.dtype).replace("torch.", ""), device=str(p.device))
            for p, n in zip(params, names)]


def land_grad(p: torch.nn.Parameter, view: Tensor, b, pos: int, scale: Optional[float] = None) -> bool:
    """Count parameter ``p``'s gradient into bucket ``b`` (slot ``pos``, buffer view ``view``), times
    ``scale`` when given. Returns True when p.grad was not the view (autograd handed a fresh tensor,
    e.g. after zero_grad(set_to_none)): the gradient was copied in (the scale fused into the copy),
    and the caller points p.grad at the view again."""
    if b.seen[pos]:
        raise RuntimeError(f"gradient of {b.names[pos]} was produced twice in one step; "
                           "call finish() after every backward (no gradient accumulation yet)")
    g = p.grad
    replaced = g is not view and g.data_ptr() != view.data_ptr()
    if replaced:
        if scale is None:
            view.copy_(g)
        else:
            torch.mul(g, scale, out=view)
    elif scale is not None:
        view.mul_(scale)
    b.seen[pos] = True
    b.pending -= 1
    return replaced


class Bucket:
    """One fused bucket: its parameters (in gradient order), their names, its compressor, and its
    gradients as one flat buffer of ``padded`` elements (``numel`` of them the parameters', the
    rest zeros: a mode that splits the buffer over ranks pads it to a multiple of the world size).
    ``views[i]`` is parameter i's gradient, at ``offsets[i]`` in ``flat``; ``context`` is what the
    compressor is told about the bucket (``BucketContext``: its index, this process's ``rank``, the layout)."""

    def __init__(self, index: int, params: List[torch.nn.Parameter], names: List[str], compressor: Compressor,
                 multiple: int = 1, rank: int = 0):
        self.index, self.params, self.names, self.compressor = index, params, names, compressor
        p0 = params[0]
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // multiple) * multiple
        self.raw_bytes = self.numel * p0.element_size()
        self.flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        self.offsets: List[int] = []
        off = 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        self.views = [self.flat[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, params)]
        self.context = BucketContext(index, rank, tuple((o, tuple(p.shape)) for o, p in zip(self.offsets, params)))
        """Passed to the compressor's exchange (and its compress, where it takes one): made once per bucket."""
        self.scale: Optional[float] = None
        """Set by the mode when gradients land multiplied by it (1/world, fused into the landing copy)."""
        self.bulk = False
        """Set by the communicator (``Communicator._rehook``): the gradients land all at once in ``finish``
        (``Communicator._land_bulk``), not one by one from per-parameter hooks during backward."""
        self.codec = compressor.describe()
        """The compressor as a spec names it (mixed strategies: it differs between buckets); the timeline's
        comm spans and layout.json carry it."""
        self.sent = 0
        """Payload bytes this rank sent for this bucket in the last step that exchanged (the exchange driver's
        count, kept here by the mode: the compressor keeps no measurement)."""
        self.reset()

    def reset(self) -> None:
        """A new step: no gradient has arrived yet."""
        self.pending = len(self.params)
        self.seen = [False] * len(self.params)
        self.ready = False

    def zero_missing(self) -> None:
        """Count the gradients that never arrived this step as zero; the bucket is then ready."""
        if not self.ready:
            for pos, seen in enumerate(self.seen):
                if not seen:
                    self.views[pos].zero_()
            self.ready = True

    def label(self) -> str:
        if len(self.names) == 1:
            return self.names[0]
        return f"{self.names[0]} .. {self.names[-1]} ({len(self.names)} tensors)"


# ---------------------------------------------------------------- the communicator

class Communicator:
    """Averages gradients over ranks with buckets; the modes subclass it.

    The interface the trainer, the stepper and ``commlab.wrap`` use:
    ``optimizer_params()`` and ``attach(optimizer)`` (what the optimizer steps), ``finish()``
    after backward, ``grads_finite()``, ``zero_grad()``, ``sync_params()`` before reading the
    model, ``relayout(layout, order)`` at a step boundary (the tuners), ``layout()``,
    ``buckets``, ``infos`` and ``order_names`` (the parameters in gradient order),
    ``ready_order``/``record_ready``/``ready_at`` (arrival profiling), ``step_bytes`` and
    ``step_raw_bytes`` of the last step, and ``close()``."""

    mode = "base"
    exchanging = True
    """False on a method's local steps (commlab/engine/methods/): gradients land in the buckets unscaled, nothing
    is sent, and ``finish`` leaves each rank's own gradient in p.grad. Changed at a step boundary only
    (``set_exchanging``)."""

    def __init__(self, model: torch.nn.Module, layout: Callable[[List[ParamInfo]], List[List[int]]],
                 plan: Union[Plan, Callable[[], Compressor]], *, timeline: Optional[Timeline] = None, group=None,
                 link: Optional[ModeledLink] = None, broadcast_from_rank0: bool = True):
        """Every mode takes these. ``layout``: the buckets, as lists of positions into the parameters in
        gradient order (a schedule, ``schedules.layout_cap``, ...); ``plan``: each bucket's compressor (a
        ``Plan``, or a factory for one compressor everywhere: ``Plan.of("int8", error_feedback=True)``);
        ``broadcast_from_rank0``: start from rank 0's parameters and buffers. A mode sets what its buckets
        need before calling this (the buckets are built at its end) and hooks the model after it."""
        self.model, self.group, self.link = model, group, link
        """``link``: a ModeledLink (network: modeled): every collective lasts at least its alpha-beta time."""
        self.plan = plan if isinstance(plan, Plan) else Plan(plan)
        """Makes each bucket's own compressor instance, by the bucket's gradient bytes (mixed strategies:
        a rule list, commlab/engine/compressors/plan.py)."""
        self.make_compressor = self.plan.default
        """A new instance of the compressor of buckets no rule takes."""
        self.world = group_size(group)
        self.rank = group_rank(group)
        self.timeline = timeline or Timeline(None, self.rank, enabled=False)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        named.reverse()  # gradients become ready roughly in reverse registration order (as DDP assumes)
        self.order_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.infos = param_infos(self.params, self.order_names)
        self._index = {p: i for i, p in enumerate(self.params)}
        if broadcast_from_rank0:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t.data, 0, group=group)
        self.buckets: List[Bucket] = []
        self.slot: Dict[torch.nn.Parameter, tuple] = {}
        """param -> (bucket, position in it)."""
        self.order: List[int] = list(range(len(self.params)))
        self._next = 0
        """The next bucket to launch: buckets launch in order."""
        self.ready_order: Optional[List[int]] = None
        """Indices into ``params`` in the order their gradients became ready in the first step."""
        self._arrivals: List[int] = []
        self._record_ready = False
        self.ready_at: List[float] = [0.0] * len(self.params)
        self._rebind = False
        self._unstamped: list = []
        """(work, Pending) of collectives without a future (gloo's reduce-scatter): stamped when polled."""
        self._listeners: List[Callable[[int, torch.nn.Parameter], None]] = []
        """Called as ``fn(index, param)`` after each gradient lands from a hook (``listen``)."""
        self._grad_hooks: list = [None] * len(self.params)
        """By index into ``params``: its landing hook, None while its bucket lands in bulk (``_rehook``)."""
        self._sentinels: list = []
        """While buckets land in bulk, one hook on one of their parameters: a second backward before
        ``finish`` is still an error."""
        self._hooks: list = []
        """Other hooks the mode keeps (dear's forward pre-hooks and optimizer hook), removed by ``close``."""
        self.step_bytes = 0
        self.step_raw_bytes = 0
        self._build(layout(self.infos), range(len(self.params)))

    # -- layout -----------------------------------------------------------
    def _new_bucket(self, index: int, params: List[torch.nn.Parameter], names: List[str],
                    compressor: Compressor) -> Bucket:
        return Bucket(index, params, names, compressor, rank=self.rank)

    def _build(self, layout: List[List[int]], order: Sequence[int]) -> None:
        """Buckets from ``layout`` (lists of positions into ``order``, itself indices into ``params``);
        every parameter's gradient becomes a view of its bucket."""
        self.buckets, self.slot = [], {}
        self._slot_at: List[tuple] = [None] * len(self.params)
        """By index into ``params``: (bucket, position), as ``slot``."""
        self.order = list(order)
        for bi, idx in enumerate(layout):
            comp = self.plan.make(sum(self.params[self.order[i]].numel() * self.params[self.order[i]].element_size()
                                      for i in idx))
            b = self._new_bucket(bi, [self.params[self.order[i]] for i in idx],
                                 [self.order_names[self.order[i]] for i in idx], comp)
            self.buckets.append(b)
            for pos, p in enumerate(b.params):
                self.slot[p] = self._slot_at[self._index[p]] = (b, pos)
        self.step_raw_bytes = sum(b.raw_bytes for b in self.buckets)
        self._next = 0
        self._bind_views()  # autograd accumulates straight into the buckets
        self._rehook()

    def relayout(self, layout: List[List[int]], order: Optional[Sequence[int]] = None) -> None:
        """Rebuild the buckets at a step boundary (after ``finish`` and ``zero_grad``).

        ``layout`` holds positions into ``order`` (indices into ``params``; default the current
        order). Every rank must call it at the same step with the same layout. The compressors'
        per-element state (error-feedback residuals, DGC's u and v, ...) belongs to parameters,
        not to bucket slots: each parameter's slice is moved from its old bucket to its new one
        (padding stays zero). A counter ``step`` (warm-up schedules) carries over; other state
        starts afresh (Capabilities.elementwise). With a mixed plan a bucket whose size crosses a rule's
        limit gets another compressor: state moves by name, so a residual (``ef.residual``) follows its
        parameters into any compressor that keeps one and is dropped where the new one keeps none."""
        order = self.order if order is None else list(order)
        if sorted(order) != list(range(len(self.params))):
            raise ValueError("relayout: order must be a permutation of the parameters")
        old: Dict[int, Dict[str, Optional[Tensor]]] = {}  # id(param) -> state name -> its slice
        step = None
        for b in self.buckets:
            state = contract.elementwise_state(b.compressor)
            if b.compressor.capabilities.counts_steps:
                step = contract.unwrap(b.compressor).step
            for p, off in zip(b.params, b.offsets):
                old[id(p)] = {k: None if t is None else t[off:off + p.numel()] for k, t in state.items()}
        self._build(layout, order)
        for b in self.buckets:
            state = {}
            for k in contract.elementwise_state(b.compressor):
                parts = [old[id(p)].get(k) for p in b.params]
                if all(t is None for t in parts):
                    state[k] = None  # nothing kept yet: the compressor starts from zero as usual
                    continue
                like = next(t for t in parts if t is not None)
                full = torch.zeros(b.padded, dtype=like.dtype, device=like.device)
                for t, p, off in zip(parts, b.params, b.offsets):
                    if t is not None:
                        full[off:off + p.numel()] = t
                state[k] = full
            contract.load_elementwise_state(b.compressor, state)
            if step is not None and b.compressor.capabilities.counts_steps:
                contract.unwrap(b.compressor).step = step

    def layout(self) -> List[List[str]]:
        return [list(b.names) for b in self.buckets]

    def _bind_views(self) -> None:
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                p.grad = view
        self._rebind = False

    def set_exchanging(self, on: bool) -> None:
        """Whether the steps from the next one on exchange gradients (a method's local steps do not). Call
        it at a step boundary, on every rank alike. A mode that cannot skip its exchange raises."""
        if not on:
            raise ValueError(f"comm.mode {self.mode}: cannot skip the gradient exchange on a method's local steps; "
                             f"use comm sync or wfbp")

    def set_world(self, world: int, rank: int) -> None:
        """This step's ranks and this process's place among them, where they change from step to step (a
        fault-tolerant run's quorum, commlab/engine/ft.py). Call it at a step boundary. A mode whose buffers
        are laid out for a fixed world raises."""
        if (world, rank) != (self.world, self.rank):
            raise ValueError(f"comm.mode {self.mode}: its buffers are laid out for a fixed world of {self.world}; "
                             f"use comm sync or wfbp")

    # -- what the optimizer steps ---------------------------------------------
    def optimizer_params(self) -> List[torch.nn.Parameter]:
        """The parameters the optimizer is built over: the model's (dear: this rank's shards)."""
        return list(self.model.parameters())

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Told the optimizer built over ``optimizer_params()`` (dear hooks its step)."""

    def sync_params(self) -> None:
        """Make the model's parameters the latest (dear completes its pending all-gathers)."""

    # -- landing hooks ------------------------------------------------------
    @property
    def record_ready(self) -> bool:
        """When True, ``ready_at`` gets each gradient's host time of arrival in the current step (every
        parameter then has its landing hook, bulk buckets included). Set it at a step boundary."""
        return self._record_ready

    @record_ready.setter
    def record_ready(self, on: bool) -> None:
        if bool(on) != self._record_ready:
            self._record_ready = bool(on)
            self._rehook()

    def _bulk_buckets(self) -> List[int]:
        """The buckets that cannot launch before backward ends, so per-parameter work during backward
        buys them nothing: the last one in launch order (it launches only once every other one has,
        i.e. at the last gradient; a mode that launches nothing in backward says all of them)."""
        return [len(self.buckets) - 1] if self.buckets else []

    def _rehook(self) -> None:
        """Give each parameter its landing hook, or none where its bucket lands in bulk: from the
        second step on (the first records ``ready_order`` from the hooks), not while ``record_ready``."""
        bulk = set(self._bulk_buckets()) if self.ready_order is not None and not self._record_ready else set()
        for b in self.buckets:
            b.bulk = b.index in bulk
        for h in self._sentinels:
            h.remove()
        self._sentinels = []
        for i, p in enumerate(self.params):
            h = self._grad_hooks[i]
            if self._slot_at[i][0].bulk:
                if h is not None:
                    h.remove()
                    self._grad_hooks[i] = None
            elif h is None:
                # bound to its index: no dict lookup keyed by a tensor in the hot path
                self._grad_hooks[i] = p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
        if bulk:  # on the bulk parameter that arrived first: a second backward reaches it soonest
            i = next(i for i in self.ready_order if self._slot_at[i][0].bulk)
            self._sentinels.append(self.params[i].register_post_accumulate_grad_hook(
                functools.partial(self._on_bulk_grad, *self._slot_at[i])))

    def _on_bulk_grad(self, b: Bucket, pos: int, p: torch.nn.Parameter) -> None:
        if b.seen[pos]:
            raise RuntimeError(f"gradient of {b.names[pos]} was produced twice in one step; "
                               "call finish() after every backward (no gradient accumulation yet)")
        b.seen[pos] = True

    def _land_bulk(self, b: Bucket) -> None:
        """Land a bulk bucket's gradients after backward, as its hooks would have one by one: a fresh
        tensor in p.grad (after ``zero_grad``) is copied in with the scale fused; a gradient autograd
        accumulated into the view itself is scaled in place; p.grad None (never arrived) counts as zero.
        ``_end_step`` points p.grad at the views again. Unlike the hooks, this cannot tell a gradient
        that did not arrive from one autograd added into the view: after ``zero_grad`` (or torch's, either
        kind) that is the same, but with no zeroing at all between steps a parameter unused this step
        keeps its last gradient, scaled again, where the hooks would zero it."""
        seen, s = b.seen, b.scale
        for pos, (p, view) in enumerate(zip(b.params, b.views)):
            g = p.grad
            if g is None:
                view.zero_()
                seen[pos] = False
                self._rebind = True
            elif g is view or g.data_ptr() == view.data_ptr():
                if s is not None:
                    view.mul_(s)
                seen[pos] = True
            else:
                if s is None:
                    view.copy_(g)
                else:
                    torch.mul(g, s, out=view)
                seen[pos] = True
                self._rebind = True
        b.pending = 0
        b.ready = True
        tl = self.timeline
        if tl.enabled:
            t = tl.now()
            tl.span("ready", f"b{b.index} ready", t, t, {"bucket": b.index})

    # -- backward side ----------------------------------------------------
    def listen(self, fn: Callable[[int, torch.nn.Parameter], None]) -> None:
        """Call ``fn(index, param)`` each time a parameter's gradient has landed in its bucket from
        this communicator's own hook (``index`` into ``params``): every parameter in the first step,
        from then on only those of buckets not landed in bulk. The layer probe learns its layers'
        arrival order from it in the first step instead of a second hook per parameter."""
        self._listeners.append(fn)

    def unlisten(self, fn: Callable[[int, torch.nn.Parameter], None]) -> None:
        """Stop calling ``fn`` (given to ``listen``; a closed communicator has dropped it already)."""
        if fn in self._listeners:
            self._listeners.remove(fn)

    def _on_grad(self, i: int, p: torch.nn.Parameter) -> None:
        if self._unstamped:
            self._poll()
        if self.ready_order is None:
            self._arrivals.append(i)
        if self._record_ready:
            self.ready_at[i] = self.timeline.now()
        b, pos = self._slot_at[i]
        view = b.views[pos]
        if land_grad(p, view, b, pos, b.scale):
            # p.grad was a fresh tensor (after zero_grad(set_to_none)): point it at the view now, so
            # autograd's tensor is freed here, mid-backward, and its memory can serve the next
            # gradient instead of being held until finish (fewer page faults per step)
            p.grad = view
            self._rebind = True
        for fn in self._listeners:
            fn(i, p)
        if b.pending == 0:
            b.ready = True
            tl = self.timeline
            if tl.enabled:
                t = tl.now()
                tl.span("ready", f"b{b.index} ready", t, t, {"bucket": b.index})
            self._bucket_ready(b)

    def _bucket_ready(self, b: Bucket) -> None:
        """A bucket's last gradient landed during backward (default: launch what is ready)."""
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the ready buckets, in bucket order, from the next one not launched yet."""
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].ready:
            self._launch(buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        raise NotImplementedError

    def _land_rest(self) -> None:
        """After backward: bulk buckets land their gradients; gradients that never arrived count as zero."""
        for b in self.buckets:
            if b.bulk:
                self._land_bulk(b)
            b.zero_missing()

    def _complete_arrivals(self) -> None:
        """After backward: every gradient lands (``_land_rest``), then everything launches."""
        self._land_rest()
        self._launch_ready()

    def _end_step(self) -> None:
        """After the exchange: the first step's arrival order, p.grad re-pointed where something
        replaced it, buckets reset for the next step."""
        if self.ready_order is None:  # the first step: the order gradients really arrived in
            seen = set(self._arrivals)
            self.ready_order = self._arrivals + [i for i in range(len(self.params)) if i not in seen]
            self._arrivals = []
            self._rehook()  # known now: buckets that launch at the end of backward anyway land in bulk
        if self._rebind:  # only after something replaced p.grad: no per-parameter loop in the common step
            self._bind_views()
        for b in self.buckets:
            b.reset()
        self._next = 0

    # -- pending collectives and their spans ------------------------------------
    def _track(self, pend: Pending, op: str, b: Bucket, nbytes: int, t_issue: float, **args) -> Pending:
        """Stamp ``pend``'s completion as it happens (a future callback, else polling) and keep its span."""
        if self.timeline.enabled:
            if not pend.works:
                pend.t_done = t_issue
            else:
                work = pend.works[-1]

                def done(_fut, pend=pend):
                    # with a modeled link the collective ends when the model says, not when loopback did
                    pend.t_done = max(self.timeline.now(), pend.deadline or 0.0)
                try:
                    work.get_future().add_done_callback(done)
                except RuntimeError:  # gloo's reduce-scatter has no future: stamped when polled
                    self._unstamped.append((work, pend))
            pend.span = (f"{op} b{b.index}", t_issue, {"bucket": b.index, "op": op, **args, "bytes": nbytes,
                                                        "codec": b.codec, "layers": b.label()})
        return pend

    def _poll(self) -> None:
        """Stamp the completion of collectives without a future (their spans end within one hook's time)."""
        if self._unstamped:
            now = self.timeline.now()
            left = []
            for work, pend in self._unstamped:
                if work.is_completed():
                    pend.t_done = max(now, pend.deadline or 0.0)
                else:
                    left.append((work, pend))
            self._unstamped = left

    def _wait(self, pend: Pending, b: Bucket, what: str):
        """Wait for ``pend`` and record its comm span and the wait; returns its result."""
        tl = self.timeline
        if not tl.enabled:
            return pend.wait()
        self._poll()
        t0 = tl.now()
        result = pend.wait()
        t1 = tl.now()
        name, t_issue, args = pend.span
        tl.span("comm", name, t_issue, pend.t_done or t1, args)
        tl.span("wait", what, t0, t1, {"bucket": b.index})
        return result

    # -- after backward ---------------------------------------------------
    def finish(self) -> None:
        """Complete every bucket's exchange (after backward)."""
        raise NotImplementedError

    def grads_finite(self) -> Tensor:
        """A 0-d bool tensor, the same on every rank: the step's gradients are finite."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Drop the gradients (p.grad = None, as torch's set_to_none). The next backward hands each
        gradient to the landing hook as a fresh tensor, which is copied into its bucket in one pass
        (with the 1/world scale fused where the mode asks; a bulk bucket's all at once, in ``finish``):
        cheaper than zeroing the buckets and letting autograd add into them. Gradients that do not
        arrive are zeroed in ``finish``, and ``finish`` points p.grad at the buckets again."""
        for p in self.params:
            p.grad = None
        self._rebind = True

    def close(self) -> None:
        """Remove the hooks and drop every collective handle. No collective here: close also runs
        when a rank fails."""
        for h in self._hooks + self._sentinels + [h for h in self._grad_hooks if h is not None]:
            h.remove()
        self._hooks, self._sentinels = [], []
        self._grad_hooks = [None] * len(self.params)
        self._listeners = []
        self._unstamped = []
