"""Per-layer forward and backward spans that tile each pass, from few hooks.

A layer is a module that owns parameters. Each layer's span runs from the end
of the previous probe event to the end of its own, so consecutive layers'
spans touch and together cover the pass:

- forward: one forward pre-hook on the root module marks the start of the
  pass; each layer has a forward post-hook only, and its span runs from the
  previous layer's forward end (the root's start for the first) to its own
  end;
- backward: one tensor hook per step, on the root module's output (set by one
  root forward post-hook), marks when the output's gradient exists; a layer's
  span then runs from the previous layer's backward end (that arrival for the
  first) until the last of its own parameters' gradients has been accumulated.
  In the first training step every parameter's arrival is counted
  (post-accumulate-grad hooks; once ``follow(communicator)`` is called, the
  communicator's own hook per parameter tells it instead, so a parameter has
  one Python hook, not two), which shows each layer's last parameter to
  arrive; from the next step on that parameter alone has a hook, one per
  layer, and nothing per parameter (the communicator lands the gradients of
  its last bucket in bulk, without hooks: commlab/engine/comm/core.py). Should the order
  within a layer change later, its span ends at that parameter all the same.

So the time of modules without parameters (activations, pooling, residual
adds, and their backward) falls into the next layer's span, as does anything
else running between two layers: the communicator's landing and launch work
in backward (from the second step, what its hooks do on a layer's last
parameter falls into that layer's span), dear's parameter all-gather waits in
forward (also on the wait lane). A module that owns parameters and has
parameter-owning children (an attention block with its own projection) gets
what runs after its last such child. Per step that is two root hooks, one
tensor hook, one forward post-hook and one gradient hook per layer, instead
of a pre- and post-hook, a tensor hook per layer and a hook per parameter.
Times are host times, or CUDA events on GPU (see timeline.Clock).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from commlab.engine.timeline import Timeline


def _tensors(out):
    """The tensors in a module's output that autograd will send a gradient to."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


class LayerProbe:
    def __init__(self, model: torch.nn.Module, timeline: Timeline):
        self.timeline = timeline
        self.handles = []
        self.acc_hooks: Dict[torch.nn.Parameter, list] = {}
        """param -> the gradient-landed callbacks of the layers that own it."""
        self.acc_handles = []
        self.layers: List[str] = []
        self.n_params: Dict[str, int] = {}
        self.bwd_left: Dict[str, int] = {}
        """layer -> how many of its parameters' gradients have not landed yet this step (0 once its span
        ended; from the second step only its last parameter counts, so it drops from n_params to 0)."""
        self.own: Dict[str, List[torch.nn.Parameter]] = {}
        self.last: Dict[str, torch.nn.Parameter] = {}
        """layer -> the parameter whose gradient completed it in the first step (``_per_layer``)."""
        self.per_layer = False
        """True from the second step: one gradient hook per layer, on its ``last`` parameter."""
        self._comm = None
        self._landed = None
        """The communicator followed in the first step and the listener given to it."""
        self.active = True
        """False during evaluation, so eval passes do not show as training layers."""
        self._fwd_last = None
        """The end of the previous forward event this pass (a mark), None outside a training forward."""
        self._bwd_last = None
        """The end of the previous backward event this step, None until the root output's gradient exists."""
        self.handles.append(model.register_forward_pre_hook(self._root_pre))
        for name, mod in model.named_modules():
            own = [p for p in mod.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            name = name or type(mod).__name__
            self.layers.append(name)
            self.n_params[name] = len(own)
            self.own[name] = own
            self.handles.append(mod.register_forward_hook(self._post(name)))
            for p in own:
                fn = self._acc(name)
                self.acc_hooks.setdefault(p, []).append(fn)  # a tied parameter counts in each layer using it
                self.acc_handles.append(p.register_post_accumulate_grad_hook(fn))
        # registered after the layers' post-hooks: the root's own layer span (if it owns parameters) ends first
        self.handles.append(model.register_forward_hook(self._root_post))
        self._root_grad_hook = self._root_grad
        self.reset()

    def follow(self, comm) -> None:
        """Take each gradient's landing in the first step from ``comm`` (a ``core.Communicator`` over
        the same model) instead of this probe's own post-accumulate-grad hooks. After the first step
        (one hook per layer, its own) there is nothing to follow: a communicator built later (a
        strategy switch) is left alone."""
        if self.per_layer:
            return
        at = [self.acc_hooks.get(p) for p in comm.params]
        if any(fns is None for fns in at):
            raise ValueError("LayerProbe.follow: the communicator averages parameters this probe does not know; "
                             "build both over the same model")
        if comm.ready_order is not None:  # past its first step: its arrival order shows each layer's last
            rank = {id(comm.params[i]): k for k, i in enumerate(comm.ready_order)}
            self.last = {name: max(own, key=lambda p: rank.get(id(p), -1)) for name, own in self.own.items()}
            self._per_layer()
            return
        self._unfollow()
        for h in self.acc_handles:
            h.remove()
        self.acc_handles = []
        single = [fns[0] if len(fns) == 1 else None for fns in at]

        def landed(i, p):
            fn = single[i]
            if fn is not None:
                fn(p)
            else:
                for fn in at[i]:
                    fn(p)
        comm.listen(landed)
        self._comm, self._landed = comm, landed

    def _unfollow(self) -> None:
        if self._comm is not None:
            self._comm.unlisten(self._landed)
        self._comm = self._landed = None

    def reset(self) -> None:
        """Start a new step's count: called after each step's backward. After the first step that
        completed a layer, the per-parameter count gives way to one hook per layer."""
        if not self.per_layer and self.last:
            self._per_layer()
        self.bwd_left.update(self.n_params)
        self._bwd_last = None

    def _per_layer(self) -> None:
        """One gradient hook per layer, on the parameter that completed it in the first step (a layer
        not completed then, a parameter of it unused: its first parameter), instead of one per parameter."""
        self._unfollow()
        for h in self.acc_handles:
            h.remove()
        self.acc_handles = [self.last.get(name, self.own[name][0]).register_post_accumulate_grad_hook(
            self._ends(name)) for name in self.layers]
        self.per_layer = True

    def _root_pre(self, mod, args):
        self._fwd_last = self.timeline.mark() if self.active else None

    def _root_post(self, mod, args, out):
        self._fwd_last = None
        if self.active and torch.is_grad_enabled():
            self._bwd_last = None  # this forward's backward has not begun
            for t in _tensors(out):
                t.register_hook(self._root_grad_hook)

    def _root_grad(self, grad):
        if self._bwd_last is None:  # the first of the outputs' gradients
            self._bwd_last = self.timeline.mark()

    def _post(self, name):
        tl = self.timeline
        args = {"layer": name}

        def hook(mod, a, out):
            t0 = self._fwd_last
            if t0 is None:  # not active, or called outside the root module's forward
                return
            t1 = self._fwd_last = tl.mark()
            tl.span("forward", name, t0, t1, args)
        return hook

    def _acc(self, name):
        """The first step's count: the layer's span ends when its last parameter's gradient lands."""
        tl = self.timeline
        args = {"layer": name}
        left = self.bwd_left  # reset() refills this dict in place
        last = self.last

        def hook(p):
            n = left[name] = left[name] - 1
            if n == 0:
                last[name] = p
                t0 = self._bwd_last
                t1 = self._bwd_last = tl.mark()
                if t0 is not None:  # None: no gradient reached the root's output, e.g. a backward from inside
                    tl.span("backward", name, t0, t1, args)
        return hook

    def _ends(self, name):
        """From the second step: the layer's span ends when its ``last`` parameter's gradient lands."""
        tl = self.timeline
        args = {"layer": name}
        left = self.bwd_left

        def hook(p):
            left[name] = 0
            t0 = self._bwd_last
            t1 = self._bwd_last = tl.mark()
            if t0 is not None:
                tl.span("backward", name, t0, t1, args)
        return hook

    def close(self) -> None:
        self._unfollow()
        for h in self.handles + self.acc_handles:
            h.remove()
        self.handles, self.acc_handles = [], []
