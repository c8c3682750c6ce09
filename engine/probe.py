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
  first) until the last of its own parameters' gradients has been accumulated
  (post-accumulate-grad hooks; once ``follow(communicator)`` is called, the
  communicator's own hook per parameter tells it instead, so a parameter has
  one Python hook, not two).

So the time of modules without parameters (activations, pooling, residual
adds, and their backward) falls into the next layer's span, as does anything
else running between two layers: the communicator's landing and launch work
in backward, dear's parameter all-gather waits in forward (also on the wait
lane). A module that owns parameters and has parameter-owning children (an
attention block with its own projection) gets what runs after its last such
child. Per step that is two root hooks, one tensor hook and one post-hook per
layer, instead of a pre- and post-hook and a tensor hook per layer. Times are
host times, or CUDA events on GPU (see timeline.Clock).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from engine.timeline import Timeline


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
        """layer -> how many of its parameters' gradients have not landed yet this step."""
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
        """Take each gradient's landing from ``comm`` (a ``core.Communicator`` over the same model)
        instead of this probe's own post-accumulate-grad hooks."""
        for h in self.acc_handles:
            h.remove()
        self.acc_handles = []
        at = [self.acc_hooks.get(p) for p in comm.params]
        if any(fns is None for fns in at):
            raise ValueError("LayerProbe.follow: the communicator averages parameters this probe does not know; "
                             "build both over the same model")
        single = [fns[0] if len(fns) == 1 else None for fns in at]

        def landed(i, p):
            fn = single[i]
            if fn is not None:
                fn(p)
            else:
                for fn in at[i]:
                    fn(p)
        comm.listen(landed)

    def reset(self) -> None:
        """Start a new step's count: called after each step's backward."""
        self.bwd_left.update(self.n_params)
        self._bwd_last = None

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
        tl = self.timeline
        args = {"layer": name}
        left = self.bwd_left  # reset() refills this dict in place

        def hook(p):
            n = left[name] = left[name] - 1
            if n == 0:
                t0 = self._bwd_last
                t1 = self._bwd_last = tl.mark()
                if t0 is not None:  # None: no gradient reached the root's output, e.g. a backward from inside
                    tl.span("backward", name, t0, t1, args)
        return hook

    def close(self) -> None:
        for h in self.handles + self.acc_handles:
            h.remove()
        self.handles, self.acc_handles = [], []
