"""Muon for the weight matrices, AdamW for everything else: the spec's ``optimizer: {name: muon}``.

``torch.optim.Muon`` (Jordan et al., 2024; the orthogonalized momentum update by Newton-Schulz iterations) takes
2-D parameters only, and the usual recipe leaves the rest to AdamW. Which parameter goes where:

- **Muon**: every 2-D parameter, except the weights of ``torch.nn.Embedding`` modules (``exclude``): the hidden
  layers' matrices (``nn.Linear`` weights, the output head's when it is a ``Linear`` of its own);
- **AdamW**: every other parameter: biases and norm scales and shifts (1-D), convolution kernels (3-D and 4-D:
  ``torch.optim.Muon`` refuses them, and they are not flattened here), scalars (0-D), and the embedding tables
  (2-D, but looked up row by row rather than multiplied as a matrix; a head tied to the embedding is that same
  tensor, so AdamW steps it too).

``MuonAdamW`` is one ``torch.optim.Optimizer`` over both: the stepper, ``commlab.wrap``, DiLoCo's inner steps,
fault tolerance's recovery and a checkpoint see one object with ``step``, ``zero_grad``, ``param_groups``,
``state``, ``state_dict`` and ``load_state_dict``. The two stock optimizers that step keep no state of their
own: their parameter groups are this object's groups (the same dicts: Muon's group first, then AdamW's) and
their ``state`` is this object's, so the base class's ``state_dict`` and ``load_state_dict`` cover both, and a
learning-rate scheduler that writes ``group["lr"]`` reaches them. After ``load_state_dict`` (which makes new
groups and a new state) they are pointed at the new ones again.
"""
from __future__ import annotations

from typing import Iterable, List, Sequence

import torch

from commlab.engine.spec import MUON_ADAMW_LR, MUON_MOMENTUM

Tensor = torch.Tensor


def split(params: Iterable[Tensor], exclude: Sequence[Tensor] = ()) -> tuple:
    """(the parameters Muon steps, the parameters AdamW steps), each in the order given: 2-D tensors not in
    ``exclude`` to Muon, the rest to AdamW."""
    skip = {id(p) for p in exclude}
    muon: List[Tensor] = []
    adamw: List[Tensor] = []
    for p in params:
        (muon if p.ndim == 2 and id(p) not in skip else adamw).append(p)
    return muon, adamw


def embeddings(model: torch.nn.Module) -> List[Tensor]:
    """The weights of the model's ``torch.nn.Embedding`` modules (what ``split`` leaves to AdamW although 2-D)."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the 2-D parameters (``lr``, ``momentum``, Nesterov, ``weight_decay`` decoupled)
    and ``torch.optim.AdamW`` over the others (``adamw_lr``, ``betas``, the same ``weight_decay``); see the
    module's docstring for which is which. Either part may be empty (a model without matrices is AdamW alone)."""

    def __init__(self, params: Iterable[Tensor], lr: float = 0.02, momentum: float = MUON_MOMENTUM,
                 weight_decay: float = 0.0, adamw_lr: float = MUON_ADAMW_LR, betas=(0.9, 0.999),
                 exclude: Sequence[Tensor] = ()):
        params = list(params)
        matrices, rest = split(params, exclude)
        self.parts: List[torch.optim.Optimizer] = []
        """The stock optimizers that step, Muon's first; they share this object's groups and state."""
        if matrices:
            self.parts.append(torch.optim.Muon(matrices, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                               nesterov=True))
        if rest:
            self.parts.append(torch.optim.AdamW(rest, lr=adamw_lr, betas=tuple(betas), weight_decay=weight_decay))
        super().__init__(params, {})
        self.param_groups = [g for o in self.parts for g in o.param_groups]
        self._share()

    def _share(self) -> None:
        """Point each stock optimizer at this object's groups (its own slice of them, the same dicts) and state."""
        at = 0
        for o in self.parts:
            n = len(o.param_groups)
            o.param_groups = self.param_groups[at:at + n]
            o.state = self.state
            at += n

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.parts:
            o.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()

    def describe(self) -> str:
        """Which parameters each part steps, by count, for a log line."""
        sizes = [sum(len(g["params"]) for g in o.param_groups) for o in self.parts]
        return ", ".join(f"{type(o).__name__}: {n} tensors" for o, n in zip(self.parts, sizes))
