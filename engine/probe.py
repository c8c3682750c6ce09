"""Per-layer forward and backward spans through module and tensor hooks.

Forward: a pre-hook and a post-hook on every module that owns parameters.
Backward: a layer's backward starts when the gradient of its output exists (a
tensor hook on the output, set in the forward hook) and ends when the last of
its own parameters' gradients has been accumulated (post-accumulate-grad
hooks; once ``follow(communicator)`` is called, the communicator's own hook
per parameter tells it instead, so a parameter has one Python hook, not two). Both are host times, or CUDA events on GPU (see timeline.Clock).
Modules without parameters (activations, pooling) are folded into their
neighbours, which keeps the hook count, and so the overhead, low.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from engine.timeline import Timeline


class LayerProbe:
    def __init__(self, model: torch.nn.Module, timeline: Timeline):
        self.timeline = timeline
        self.handles = []
        self.acc_hooks: Dict[torch.nn.Parameter, list] = {}
        """param -> the gradient-landed callbacks of the layers that own it."""
        self.acc_handles = []
        self.layers: List[str] = []
        self.bwd_start: Dict[str, object] = {}
        self.bwd_left: Dict[str, int] = {}
        self.n_params: Dict[str, int] = {}
        self.active = True
        """False during evaluation, so eval passes do not show as training layers."""
        for name, mod in model.named_modules():
            own = [p for p in mod.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            name = name or type(mod).__name__
            self.layers.append(name)
            self.n_params[name] = len(own)
            self.handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self.handles.append(mod.register_forward_hook(self._post(name)))
            for p in own:
                fn = self._acc(name)
                self.acc_hooks.setdefault(p, []).append(fn)  # a tied parameter counts in each layer using it
                self.acc_handles.append(p.register_post_accumulate_grad_hook(fn))
        self.fwd_start: Dict[str, object] = {}
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

        def landed(i, p):
            for fn in at[i]:
                fn(p)
        comm.listen(landed)

    def reset(self) -> None:
        self.bwd_left = dict(self.n_params)
        self.bwd_start.clear()

    def _pre(self, name):
        def hook(mod, args):
            if self.active:
                self.fwd_start[name] = self.timeline.mark()
        return hook

    def _post(self, name):
        tl = self.timeline
        grad_out = self._grad_out(name)  # made once per layer, not once per forward
        args = {"layer": name}

        def hook(mod, a, out):
            if not self.active:
                return
            tl.span("forward", name, self.fwd_start.pop(name), tl.mark(), args)
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(grad_out)
        return hook

    def _grad_out(self, name):
        def hook(grad):
            self.bwd_start.setdefault(name, self.timeline.mark())
        return hook

    def _acc(self, name):
        tl = self.timeline
        args = {"layer": name}

        def hook(p):
            self.bwd_left[name] -= 1
            if self.bwd_left[name] == 0:
                t1 = tl.mark()
                t0 = self.bwd_start.pop(name, None)
                if t0 is not None:  # no output hook, e.g. an embedding's output unused
                    tl.span("backward", name, t0, t1, args)
        return hook

    def close(self) -> None:
        for h in self.handles + self.acc_handles:
            h.remove()
        self.handles, self.acc_handles = [], []
