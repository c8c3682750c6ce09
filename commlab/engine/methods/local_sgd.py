"""Local SGD (periodic model averaging): every rank steps its own optimizer on its own gradients, and
every H steps the ranks average their parameters.

Stich, "Local SGD converges fast and communicates little" (ICLR 2019); Lin et al., "Don't use large
mini-batches, use local SGD" (ICLR 2020). Steps, for each rank:

1. forward and backward on the rank's batch; the communicator lands the gradient but sends nothing;
2. the optimizer steps on the rank's own gradient (its momentum and moments stay local);
3. after every H-th step, the parameters are averaged over ranks (one all-reduce of the model).

With H = 1 and an optimizer linear in the gradient (SGD, with momentum and weight decay) this is
synchronous training: the average of the ranks' momentum buffers follows the synchronous buffer's
recursion (tests/test_methods.py holds it to the sync mode). Bytes: the model once per H steps.

Follows PyTorch's ``PeriodicModelAverager`` (torch.distributed.algorithms.model_averaging): parameters
averaged in one flat buffer divided by the world size, beside a stock optimizer. Differs in two ways:
the all-reduce goes through the lab's exchange driver and timeline (lane "outer"), not
``model_averaging.utils.average_parameters``; and the averages come after every H-th step (0-based steps
H-1, 2H-1, ...), where PyTorch's averager averages after steps 0, H, 2H, ... (its counter starts at the first
call). torchft's ``LocalSGD`` syncs after every ``sync_every`` optimizer steps, as here, a tensor at a time.

Under fault tolerance (``ctx.quorum``) each average joins a quorum and is applied only when it commits, as
torchft's ``LocalSGD`` does (quorum before the all-reduce, should_commit after it). A sync that does not commit
puts the parameters back to the last average (``synced``), where torchft's keeps the local ones: the replicas
then go on from parameters they agree on. A replica that recovers takes ``syncs`` and ``synced`` too.
The average is uncompressed; a compressed one is DiLoCo with outer_lr 1 and outer_momentum 0 (the
average of pseudo-gradients), which takes ``method.compressor``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from commlab.engine.compressors.basic import NoneCompressor
from commlab.engine.compressors.params import Param
from commlab.engine.methods.base import Context, Event, Method, periodic
from commlab.engine.methods.transfer import Group, Transfer, groups

Tensor = torch.Tensor


class LocalSGD(Method):
    name = "local_sgd"
    fault_tolerant = True
    params = (Param("H", int, 8, "steps between two averages of the parameters", lo=1, hi=1_000_000),)
    warmup = 0
    """Steps of synchronous training first (post-local SGD declares it as a parameter)."""

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        self.groups: List[Group] = groups(ctx, range(len(ctx.params)), "params")
        self.comps = [NoneCompressor() for _ in self.groups]
        self.synced: List[Tensor] = []
        """The parameters of the last average: what every rank agrees on (evaluation reads them)."""
        self.syncs = 0
        if self.warmup == 0:
            self._snapshot()

    def _snapshot(self) -> None:
        self.synced = [p.detach().clone() for p in self.ctx.params]

    def before_step(self, step: int) -> bool:
        return step < self.warmup

    def exchanges_at(self, step: int) -> bool:
        return periodic(step, self.H, self.warmup)

    def after_optimizer_step(self, step: int) -> None:
        if step == self.warmup - 1:
            self._snapshot()  # the end of the synchronous phase: every rank holds these parameters
        if not self.exchanges_at(step):
            return
        q = self.ctx.quorum
        if q is not None:  # fault tolerance: a replica that is behind recovers here, to its source's step
            step = q.join(step)
        outs = []
        for g, c in zip(self.groups, self.comps):
            flat = g.gather([p.detach() for p in g.params])
            outs.append((g, Transfer(self.ctx, g, c, flat, "outer", step, {"sync": self.syncs}).start()))
        avgs = []
        for g, tr in outs:
            avgs.append(g.views(tr.finish()))
            self.step_bytes += tr.sent
        self.step_log["sync_bytes"] = self.step_bytes
        with torch.no_grad():
            if q is not None and not q.commit():
                for p, s in zip(self.ctx.params, self.synced):  # back to the last average
                    p.copy_(s)
                return
            for (g, _), vs in zip(outs, avgs):
                for p, v in zip(g.params, vs):
                    p.copy_(v)
        self.syncs += 1
        self._snapshot()

    def global_params(self) -> Optional[List[Tensor]]:
        return self.synced or None

    def schedule(self, tensor_bytes: Sequence[int], steps: int, element_size: int = 4) -> List[Event]:
        total = sum(tensor_bytes)
        return [Event(s, "gradients" if s < self.warmup else "params", total, 0) for s in range(steps)
                if s < self.warmup or self.exchanges_at(s)]

    def state_dict(self) -> dict:
        return {"syncs": self.syncs, "synced": [t.clone() for t in self.synced]}

    def load_state_dict(self, state: dict) -> None:
        self.syncs = state["syncs"]
        self.synced = [s.to(p.device).clone() for s, p in zip(state["synced"], self.ctx.params)]
