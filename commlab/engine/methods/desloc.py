"""DES-LOC (desynced low communication): Adam on each rank, its parameters and its two moments each averaged
over ranks on a period of their own.

Iacob et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training Foundation Models" (2025).
Local SGD averages the parameters only, and applied to Adam it leaves each rank's moments to drift apart (or
resets them); Local Adam averages the moments with the parameters, tripling the bytes. DES-LOC gives each its
own period. Steps, on each rank:

1. forward and backward on the rank's batch; the communicator lands the gradient but sends nothing;
2. the spec's Adam or AdamW steps on the rank's own gradient and its own moments;
3. after every Hx-th step the parameters are averaged over ranks, after every Hu-th step the first moment
   (``exp_avg``), after every Hv-th step the second moment (``exp_avg_sq``): each an uncompressed all-reduce
   of the model's size, through the lab's exchange driver (lane "outer").

The moments change more slowly than the parameters (their half-lives in steps are ln 0.5 / ln beta: about 7 for
beta1 = 0.9, 693 for beta2 = 0.999), so their periods can be longer: the paper recommends Hu = 3 Hx and
Hv = 6 Hx, which are the defaults here; Hx defaults to 16 for the lab's short runs. The paper claims that
this communicates about half of what Local Adam does, with the same loss, and far less than data parallel
Adam (170 times less in its largest setting), and that unlike keeping the moments local it converges with a
guarantee (the second moment has to be synced, however rarely).

Follows the paper in the three independent periods and in averaging the optimizer's own state in place (a
stock ``torch.optim.Adam``/``AdamW``: its ``exp_avg`` and ``exp_avg_sq``, with its bias correction by its own
step count, which every rank shares). Differs in where an average lands: after the H-th optimizer step (0-based
steps H-1, 2H-1, ..., as local SGD here), where the paper's pseudo-code averages a state before the step that
reads it (the same sequence, counted one step apart); the paper clips each gradient before the moments take it,
which the lab leaves to the model (no clipping here); and periods need not divide each other.

Under fault tolerance (``ctx.quorum``) the averages due after a step are one sync: it joins a quorum before its
first all-reduce and is applied only when it commits, as local SGD's. One that does not commit changes no moment
(each replica keeps its own, as between two of their averages) and, where the parameters were due, puts them back
to their last average, from which the replicas go on alike. A replica that recovers takes the model, Adam's state
(its moments and step count), ``syncs`` and ``synced`` from its source. A parameter that got no gradient on some rank
has no moments there: that rank sends zeros for it and keeps no moment it did not have.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from commlab.engine.compressors.basic import NoneCompressor
from commlab.engine.compressors.params import Param
from commlab.engine.methods.base import Context, Event, Method, periodic
from commlab.engine.methods.transfer import Group, Transfer, groups

Tensor = torch.Tensor
MOMENTS = (("exp_avg", "Hu"), ("exp_avg_sq", "Hv"))
"""Adam's state that DES-LOC averages (torch.optim.Adam's key), each with the parameter naming its period."""
ADAPTIVE = ("adam", "adamw")
"""The spec's optimizers that keep both moments."""


class DESLOC(Method):
    name = "desloc"
    fault_tolerant = True
    params = (
        Param("Hx", int, 16, "steps between two averages of the parameters", lo=1, hi=1_000_000),
        Param("Hu", int, None, "steps between two averages of Adam's first moment (exp_avg)", lo=1, hi=1_000_000,
              unset="3 Hx (the paper's recommendation)"),
        Param("Hv", int, None, "steps between two averages of Adam's second moment (exp_avg_sq)", lo=1,
              hi=1_000_000, unset="6 Hx (the paper's recommendation)"),
    )

    def __init__(self, **given):
        super().__init__(**given)
        if self.Hu is None:
            self.Hu = 3 * self.Hx
        if self.Hv is None:
            self.Hv = 6 * self.Hx

    def check_job(self, job: dict) -> None:
        name = (job.get("optimizer") or {}).get("name")
        if name not in ADAPTIVE:
            raise ValueError(f"optimizer.name: desloc averages Adam's two moments (exp_avg, exp_avg_sq); use "
                             f"{' or '.join(ADAPTIVE)}, got {name}")

    # -- the schedule (pure) ----------------------------------------------------
    def due(self, step: int) -> List[str]:
        """What is averaged after ``step`` (0-based), in issue order: "params", "exp_avg", "exp_avg_sq"."""
        out = ["params"] if periodic(step, self.Hx) else []
        return out + [key for key, period in MOMENTS if periodic(step, getattr(self, period))]

    def exchanges_at(self, step: int) -> bool:
        return bool(self.due(step))

    def schedule(self, tensor_bytes: Sequence[int], steps: int, element_size: int = 4) -> List[Event]:
        total = sum(tensor_bytes)  # a moment has its parameter's dtype, hence its bytes
        return [Event(s, "params" if what == "params" else "moments", total, 0)
                for s in range(steps) for what in self.due(s)]

    # -- the run -------------------------------------------------------------------
    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        opt = ctx.optimizer
        if opt is None or any("betas" not in g for g in opt.param_groups):
            raise ValueError(f"optimizer: desloc averages Adam's moments; got "
                             f"{type(opt).__name__ if opt is not None else 'no optimizer'}")
        everything = range(len(ctx.params))
        self.groups: Dict[str, List[Group]] = {what: groups(ctx, everything, what)
                                               for what in ("params",) + tuple(k for k, _ in MOMENTS)}
        """One flat buffer per dtype and device for each of the three exchanges."""
        self.comps = {what: [NoneCompressor() for _ in gs] for what, gs in self.groups.items()}
        self.syncs = {what: 0 for what in self.groups}
        """How many averages of each have been applied (what a checkpoint and a recovery keep)."""
        self.synced = [p.detach().clone() for p in ctx.params]
        """The parameters of the last average: what every rank agrees on (evaluation reads them)."""

    def _tensors(self, what: str, params: List[torch.nn.Parameter]) -> List[Optional[Tensor]]:
        if what == "params":
            return [p.detach() for p in params]
        state = self.ctx.optimizer.state
        return [state[p].get(what) if p in state else None for p in params]

    @torch.no_grad()
    def after_optimizer_step(self, step: int) -> None:
        if not self.due(step):
            return
        q = self.ctx.quorum
        if q is not None:  # fault tolerance: a replica that is behind recovers here, to its source's step
            step = q.join(step)
        due = self.due(step)
        started = []
        for what in due:  # every transfer in flight at once, in the same order on every rank
            for g, c in zip(self.groups[what], self.comps[what]):
                ts = self._tensors(what, g.params)
                flat = g.gather([t if t is not None else torch.zeros_like(p) for t, p in zip(ts, g.params)])
                started.append((what, g, ts, Transfer(self.ctx, g, c, flat, "outer", step,
                                                      {"sync": self.syncs[what], "what": what}).start()))
        avgs = []
        for what, g, ts, tr in started:
            avgs.append(tr.finish())
            self.step_bytes += tr.sent
        ok = q is None or q.commit()
        self.step_log["sync_bytes"] = self.step_bytes
        self.step_log["synced"] = due if ok else []
        if not ok:
            if "params" in due:  # back to the last average; the moments stay this replica's own
                for p, s in zip(self.ctx.params, self.synced):
                    p.copy_(s)
            return
        for (_, g, ts, _), avg in zip(started, avgs):
            for t, v in zip(ts, g.views(avg)):
                if t is not None:
                    t.copy_(v)
        for what in due:
            self.syncs[what] += 1
        if "params" in due:
            self.synced = [p.detach().clone() for p in self.ctx.params]

    def global_params(self) -> Optional[List[Tensor]]:
        return self.synced

    def state_dict(self) -> dict:
        return {"syncs": dict(self.syncs), "synced": [t.clone() for t in self.synced]}

    def load_state_dict(self, state: dict) -> None:
        self.syncs = dict(state["syncs"])
        self.synced = [s.to(p.device).clone() for s, p in zip(state["synced"], self.ctx.params)]
