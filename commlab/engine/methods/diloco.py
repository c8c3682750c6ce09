"""DiLoCo: H inner steps of any optimizer on each rank, then an outer step on the averaged
pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023). Every rank
keeps the global parameters of the last outer step. Steps:

1. inner: H steps of the spec's optimizer (the paper's AdamW; any torch.optim here) on the rank's own
   gradients, no gradient exchange; the inner optimizer's state stays on the rank across outer steps;
2. after every H-th step, the pseudo-gradient (global parameters - local parameters) is averaged over
   ranks, through ``method.compressor`` (none by default; top-k with error feedback, or int4/int8/qsgd, give
   sparse and low-bit outer updates by configuration; SparseLoCo is commlab/engine/methods/sparseloco.py);
3. outer: a stock ``torch.optim.SGD`` with Nesterov momentum (outer_lr, outer_momentum) steps the global
   parameters with the averaged pseudo-gradient as their gradient; every rank continues from them.

With H = 1, outer_lr = 1 and outer_momentum = 0 the outer step sets the global parameters to the
average of the ranks' parameters: local SGD, hence synchronous training for SGD (tests/test_methods.py).
The paper's setting is H = 500, outer_lr = 0.7, outer_momentum = 0.9 (Nesterov) with AdamW inside; the
default H here (50) suits the lab's short runs. Bytes: the model's pseudo-gradient once per H steps.

The same class runs Streaming DiLoCo (commlab/engine/methods/streaming_diloco.py): ``fragments`` contiguous
parts of the parameters, each synced every H steps at staggered steps, its all-reduce issued ``tau``
steps before its outer step is applied, and the fragment then mixed with the local parameters by
``alpha``. DiLoCo is the case of one fragment, tau 0 and alpha 0.

``overlap`` (Kale et al., "Eager updates for overlapped communication and computation in DiLoCo", 2025): with
``delayed`` a sync's all-reduce is issued and left in flight during the next H inner steps; at the next sync of
the same fragment it is waited for, the new one issued, and the outer step takes the older average (one sync
late; the first sync steps nothing). With ``eager`` each rank steps with that older average plus (its fresh
pseudo-gradient - its previous one) / world: its own fresh part stands in for the part not yet averaged (the
first sync: fresh / world), so the ranks' global copies differ by their own terms. Two flat buffers per group
take turns, so a new pseudo-gradient never lands where the one in flight is being reduced. ``none`` keeps the
blocking sync. Needs tau 0 (Streaming DiLoCo's own overlap); under fault tolerance, one fragment (one sync in
flight at a time: ``_overlapped`` says how its quorum and commit fall).

Against torchft's ``DiLoCo`` (torchft/local_sgd.py): the same pseudo-gradient (global - local), the
outer optimizer over the global copy and the fragment schedule (issue at H/F - tau, apply tau steps
later, mix by alpha). Differences: the global copy stays on the parameters' device (torchft keeps it in
pinned CPU memory), one outer optimizer serves every fragment (the same momentum buffers per tensor),
compression is any compressor of the lab through its exchange driver rather than torchft's quantized
all-reduce.

Under fault tolerance (``ctx.quorum``) it uses torchft's Manager as torchft's ``DiLoCo`` does: a sync joins the
quorum before its pseudo-gradient's all-reduce is issued and asks should_commit when it is applied (tau steps
later), one sync at a time; a sync that commits takes the outer step, one that does not puts the fragment back
to its global parameters (the local steps since its last sync are dropped, as torchft restores its
``original_parameters``) and leaves the global parameters, the outer momentum, ``syncs`` and each group
compressor's state (error feedback's residual) as they were. A replica that recovers takes ``state_dict()`` (global
parameters, outer optimizer, syncs, and what the replicas share of the compressors' state: not the residuals, each
rank's own, which start from zero) beside the model and inner optimizer, as torchft registers each fragment's ``original_parameters`` and outer optimizer. Which
fragment a sync carries follows the lab's step, which a recovery sets to the source's (torchft's follows the
Manager's step, its commits).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from commlab.engine.compressors.base import Compressor
from commlab.engine.compressors.basic import NoneCompressor
from commlab.engine.compressors.params import Param
from commlab.engine.methods.base import Context, Event, Method, cloned, without_residuals
from commlab.engine.methods.transfer import Group, Transfer, groups

Tensor = torch.Tensor


def split_even(tensor_bytes: Sequence[int], parts: int) -> List[List[int]]:
    """Tensor indices cut into ``parts`` contiguous, non-empty runs of about equal bytes (Streaming
    DiLoCo's fragments, sequential pattern). Needs ``parts <= len(tensor_bytes)``."""
    n = len(tensor_bytes)
    if not 1 <= parts <= n:
        raise ValueError(f"fragments: must be in 1..{n} (one tensor at least per fragment), got {parts}")
    total = sum(tensor_bytes)
    cum, acc = [], 0
    for b in tensor_bytes:
        acc += b
        cum.append(acc)
    cuts = [0]
    for k in range(1, parts):
        i = next((i + 1 for i, c in enumerate(cum) if c >= total * k / parts), n)
        cuts.append(min(max(i, cuts[-1] + 1), n - (parts - k)))
    cuts.append(n)
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


OVERLAP = Param("overlap", str, "none", "none: the outer all-reduce blocks; delayed: it overlaps the next H inner "
                "steps and its outer step comes one sync late; eager: the same, with this rank's fresh "
                "pseudo-gradient standing in for its part of the average", choices=("none", "delayed", "eager"))
"""DiLoCo's overlap of the outer all-reduce with the next inner steps (Kale et al., 2025)."""


class DiLoCo(Method):
    name = "diloco"
    fault_tolerant = True
    params = (
        Param("H", int, 50, "inner steps between two outer steps", lo=1, hi=1_000_000),
        Param("outer_lr", float, 0.7, "the outer SGD's learning rate on the averaged pseudo-gradient",
              lo=0, hi=10, lo_open=True),
        Param("outer_momentum", float, 0.9, "the outer SGD's momentum (Nesterov when nesterov is on)",
              lo=0, hi=1, hi_open=True),
        Param("nesterov", bool, True, "Nesterov momentum in the outer step (as the paper)"),
        OVERLAP,
    )
    takes_compressor = True
    fragments = 1
    """Parts of the parameters synced in turn (Streaming DiLoCo declares it as a parameter)."""
    tau = 0
    """Steps a fragment's all-reduce overlaps before its outer step is applied."""
    alpha = 0.0
    """The weight of the local parameters when a fragment is mixed with its new global ones (0: replaced)."""

    def __init__(self, **given):
        super().__init__(**given)
        if self.fragments > self.H:
            raise ValueError(f"fragments: must be at most H ({self.H}): each fragment syncs at a step of its own, "
                             f"got {self.fragments}")
        if self.tau >= self.H:
            raise ValueError(f"tau: must be below H ({self.H}): a fragment's sync is applied before it is issued "
                             f"again, got {self.tau}")
        if self.overlap != "none" and self.tau:
            raise ValueError(f"overlap: {self.overlap} needs tau 0 (its all-reduce overlaps the H inner steps up to "
                             f"the fragment's next sync), got tau {self.tau}")

    def check_model(self, tensor_bytes: Sequence[int]) -> None:
        if self.fragments > len(tensor_bytes):
            raise ValueError(f"fragments: must be at most the model's {len(tensor_bytes)} parameter tensors "
                             f"(a fragment holds whole tensors), got {self.fragments}")

    # -- the schedule (pure) ----------------------------------------------------
    def _due(self, f: int) -> int:
        """Fragment f's outer step comes after steps n (counted from 1) with n = due (mod H)."""
        return self.H * (f + 1) // self.fragments

    def issues(self, step: int, f: int) -> bool:
        """True when fragment ``f``'s all-reduce is issued in ``step`` (0-based)."""
        return (step + 1 - (self._due(f) - self.tau)) % self.H == 0

    def exchanges_at(self, step: int) -> bool:
        """Whether some fragment issues in ``step``, in constant time (not one test per fragment: a spec's check asks
        this of up to thousands of steps, and fragments may number H). Fragment f = k - 1 issues where
        step + 1 + tau = due (mod H), with due = floor(H k / F): due 0 (mod H) is the last fragment's (k = F), and
        a residue r in 1..H-1 is one fragment's exactly when k = ceil(r F / H) < F has floor(H k / F) = r."""
        h, n = self.H, self.fragments
        r = (step + 1 + self.tau) % h
        if r == 0:
            return True
        k = -(-r * n // h)
        return k < n and k * h < (r + 1) * n

    def parts(self, tensor_bytes: Sequence[int]) -> List[List[int]]:
        return split_even(tensor_bytes, self.fragments)

    def schedule(self, tensor_bytes: Sequence[int], steps: int, element_size: int = 4) -> List[Event]:
        parts = self.parts(tensor_bytes)
        sizes = [sum(tensor_bytes[i] for i in part) for part in parts]
        wait = self.H if self.overlap != "none" else self.tau  # steps until the sync's result is used
        return [Event(s, "pseudo", sizes[f], wait, f) for s in range(steps) for f in range(self.fragments)
                if self.issues(s, f)]

    # -- the run -------------------------------------------------------------------
    def compressors(self, ctx: Context) -> Callable[[int], Compressor]:
        """What makes the compressor of each group of the pseudo-gradients, from its bytes: ``method.compressor``
        (the plan), none without one. A subclass with a codec of its own (SparseLoCo) gives that instead."""
        return ctx.plan.make if ctx.plan is not None else (lambda nbytes: NoneCompressor())

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        if self.overlap != "none" and ctx.quorum is not None and self.fragments > 1:
            raise ValueError(f"overlap: {self.overlap} under fault tolerance keeps one sync in flight at a time; "
                             f"{self.fragments} fragments would overlap theirs")
        tensor_bytes = [p.numel() * p.element_size() for p in ctx.params]
        make = self.compressors(ctx)
        self.parts: List[List[Group]] = []
        first = 0
        for f, members in enumerate(split_even(tensor_bytes, self.fragments)):
            gs = groups(ctx, members, f"f{f}" if self.fragments > 1 else "model", make, first_bucket=first)
            first += len(gs)
            self.parts.append(gs)
        self.glob = [p.detach().clone() for p in ctx.params]
        """The global parameters of each fragment's last outer step: alike on every rank."""
        mom = self.outer_momentum
        self.outer = torch.optim.SGD(self.glob, lr=self.outer_lr, momentum=mom, nesterov=self.nesterov and mom > 0)
        self.inflight: List[Tuple[int, int, List[Transfer]]] = []
        """(step of the outer step, fragment, its transfers), in issue order."""
        self.syncs = 0
        self.spare: List[List[Tensor]] = [[torch.zeros_like(g.flat) for g in gs] if self.overlap != "none" else []
                                          for gs in self.parts]
        """overlap: a second flat buffer per group, so a new sync's pseudo-gradient never lands in the buffer of
        the one still in flight; the two take turns."""
        self.codec_before: Dict[int, list] = {}
        """Fault tolerance: each fragment's group compressors' state as its sync in flight was issued (error
        feedback's residual, SparseLoCo's), put back when that sync does not commit."""
        self.turn = [0] * self.fragments
        self.own: List[Optional[List[Tensor]]] = [None] * self.fragments
        """overlap eager: this rank's own pseudo-gradient of each fragment's last sync (what its part of the average
        will be when that average arrives), None before the first."""
        self.pending: List[Optional[List[Tensor]]] = [None] * self.fragments
        """overlap under fault tolerance: each group's pseudo-gradient of a fragment's sync, computed (and the outer
        step taken) before the sync's quorum is joined and its all-reduce issued. A replica that recovers in that
        quorum takes its source's (``state_dict``) and issues it, as a recovery in a blocking sync computes the
        source's pseudo-gradient from the source's parameters."""

    def after_optimizer_step(self, step: int) -> None:
        q = self.ctx.quorum
        if self.overlap != "none":
            issued = [f for f in range(self.fragments) if self.issues(step, f)]
            for f in issued:
                self._overlapped(step, f, q)
            applied = []
        elif q is None:
            issued = self._issue_at(step)
            applied = self._apply_due(step)
        else:  # fault tolerance: one sync at a time, its quorum from its issue to its commit at its apply
            applied = self._apply_due(step, q)  # issued tau steps ago
            issued = []
            if self.exchanges_at(step):
                step = q.join(step)  # a replica that is behind recovers here, to its source's step
                issued = self._issue_at(step)
                applied += self._apply_due(step, q)  # tau 0: at once
        if issued:
            self.step_log["sync_bytes"] = self.step_bytes
            if self.fragments > 1:
                self.step_log["fragment"] = issued[0] if len(issued) == 1 else issued
        if applied and self.fragments > 1:
            self.step_log["applied"] = applied if len(applied) > 1 else applied[0]

    def _issue_at(self, step: int) -> List[int]:
        issued = [f for f in range(self.fragments) if self.issues(step, f)]
        for f in issued:
            self._issue(step, f)
        return issued

    def _apply_due(self, step: int, q=None) -> List[int]:
        due = [x for x in self.inflight if x[0] == step]
        if due:
            self.inflight = [x for x in self.inflight if x[0] != step]
            for _, f, transfers in due:
                self._apply(f, transfers, q)
        return [f for _, f, _ in due]

    def _issue(self, step: int, f: int) -> None:
        """Issue fragment f's sync: its pseudo-gradient's all-reduce."""
        self._start(step, f, self._pseudo(f))

    @torch.no_grad()
    def _pseudo(self, f: int) -> List[Tensor]:
        """Fragment f's pseudo-gradient (global - local), one flat buffer per group (under overlap, the spare one
        every other sync)."""
        turn = self.turn[f]
        self.turn[f] ^= 1
        bufs = []
        for k, g in enumerate(self.parts[f]):
            buf = self.spare[f][k] if self.spare[f] and turn else g.flat
            for v, i, p in zip(g.views(buf), g.index, g.params):
                torch.sub(self.glob[i], p.detach(), out=v)
            bufs.append(buf)
        return bufs

    def _start(self, step: int, f: int, bufs: List[Tensor]) -> None:
        """Start fragment f's sync of ``bufs``; its average is used ``tau`` steps later (H under overlap)."""
        transfers = []
        if self.ctx.quorum is not None:  # what a sync that does not commit puts back
            self.codec_before[f] = [cloned(g.compressor.state_dict()) if g.compressor is not None else None
                                    for g in self.parts[f]]
        for g, buf in zip(self.parts[f], bufs):
            lane = "fragment" if self.tau else "outer"
            tr = Transfer(self.ctx, g, g.compressor, buf, lane, step, {"fragment": f, "sync": self.syncs}).start()
            self.step_bytes += tr.fresh_bytes()
            transfers.append(tr)
        self.syncs += 1
        self.inflight.append((step + (self.H if self.overlap != "none" else self.tau), f, transfers))

    @torch.no_grad()
    def _overlapped(self, step: int, f: int, q=None) -> None:
        """overlap delayed or eager, at fragment f's sync: wait for its previous sync's average (issued H steps ago,
        in flight since), compute this one's pseudo-gradient, step the global parameters with the previous average
        (delayed) or with it corrected by this rank's fresh pseudo-gradient (eager):
        previous average + (fresh - this rank's previous pseudo-gradient) / world, the fresh one standing in for
        this rank's part until the new average arrives, then issue the fresh one's all-reduce. The first sync has
        no average yet: delayed steps nothing; eager steps with fresh / world.

        Under fault tolerance (``q``) one sync is in flight at a time, from its quorum to its commit at the next
        sync: the previous average is used only if its sync commits (else its compressors' state is put back and
        nothing is stepped with it), and the new sync's quorum is joined after the outer step, so a replica that
        recovers there takes the stepped global parameters and the pending pseudo-gradient (``pending``)."""
        if q is not None and self.pending[f] is not None:
            # recovered at this step's start into its source's sync: the outer step is in the recovered state;
            # issue what the source issues
            bufs, self.pending[f] = self.pending[f], None
            self._start(q.join(step), f, bufs)
            return
        prev = [x for x in self.inflight if x[1] == f]
        self.inflight = [x for x in self.inflight if x[1] != f]
        avgs = None
        if prev:
            avgs = []
            for tr in prev[0][2]:
                avgs.append(tr.finish())
                self.step_bytes += tr.fresh_bytes()  # later rounds of a multi-round compressor
            if q is not None and not q.commit():  # the sync did not happen: nothing to step with
                self.syncs -= 1
                for g, st in zip(self.parts[f], self.codec_before.pop(f, [None] * len(self.parts[f]))):
                    if st is not None:
                        g.compressor.load_state_dict(st)
                avgs = None
        bufs = self._pseudo(f)
        grads = avgs
        if self.overlap == "eager":
            w = self.ctx.world
            fresh = [b.clone() for b in bufs]  # the exchange may write into a buffer while it is in flight
            grads = [x.div(w) for x in fresh]
            if avgs is not None and self.own[f] is not None:  # the last sync's average, this rank's part replaced
                grads = [d.add_(a).sub_(o.div(w)) for d, a, o in zip(grads, avgs, self.own[f])]
            self.own[f] = fresh
        if grads is None:  # delayed, first sync: nothing has arrived, no outer step
            self._mix(f)
        else:
            self._step(f, grads)
        if q is not None:
            self.pending[f] = bufs  # a recovery in the quorum below copies its source's into them
            step = q.join(step)
            self.pending[f] = None
        self._start(step, f, bufs)

    @torch.no_grad()
    def _apply(self, f: int, transfers: List[Transfer], q=None) -> None:
        avgs = []
        for tr in transfers:
            avgs.append(tr.finish())
            self.step_bytes += tr.fresh_bytes()  # later rounds of a multi-round compressor
        if q is not None and not q.commit():
            # fault tolerance: the sync did not happen; the fragment goes back to its global parameters (the
            # local steps since its last sync are dropped, as torchft's DiLoCo does)
            self.syncs -= 1
            for g, st in zip(self.parts[f], self.codec_before.pop(f, [None] * len(self.parts[f]))):
                for i, p in zip(g.index, g.params):
                    p.copy_(self.glob[i])
                if st is not None:  # the compressor's state as if the sync had never been tried
                    g.compressor.load_state_dict(st)
            return
        self._step(f, avgs)

    @torch.no_grad()
    def _step(self, f: int, avgs: List[Tensor]) -> None:
        """The outer step of fragment f with ``avgs`` (one flat tensor per group) as its global parameters'
        gradient, then the local fragment mixed with (alpha 0: set to) its new global parameters."""
        for g, avg in zip(self.parts[f], avgs):
            for i, v in zip(g.index, g.views(avg)):
                self.glob[i].grad = v
        self.outer.step()
        for g in self.parts[f]:
            for i in g.index:
                self.glob[i].grad = None
        self._mix(f)

    @torch.no_grad()
    def _mix(self, f: int) -> None:
        """The local fragment f mixed with its global parameters: alpha * local + (1 - alpha) * global."""
        for g in self.parts[f]:
            for i, p in zip(g.index, g.params):
                if self.alpha:
                    p.mul_(self.alpha).add_(self.glob[i], alpha=1 - self.alpha)  # keep part of the local steps
                else:
                    p.copy_(self.glob[i])

    def global_params(self) -> Optional[List[Tensor]]:
        return self.glob

    def state_dict(self) -> dict:
        """The syncs so far, the global parameters, the outer optimizer, and what the replicas share of each group
        compressor's state (its residual, each rank's own, left out: a replica that takes this state starts its
        own from zero)."""
        codecs = [without_residuals(g.compressor.state_dict()) if g.compressor is not None else {}
                  for gs in self.parts for g in gs]
        extra = {}
        if self.overlap != "none":  # a sync about to be issued, and eager's own part of the one it follows
            extra["pending"] = [None if b is None else [t.clone() for t in b] for b in self.pending]
            extra["own"] = [None if o is None else [t.clone() for t in o] for o in self.own]
        return {"syncs": self.syncs, "global": [t.clone() for t in self.glob], "outer": self.outer.state_dict(),
                **({"codecs": codecs} if any(codecs) else {}), **extra}

    def load_state_dict(self, state: dict) -> None:
        self.syncs = state["syncs"]
        with torch.no_grad():
            for t, s in zip(self.glob, state["global"]):
                t.copy_(s)
            for f, got in enumerate(state.get("pending", [])):
                if got is None:
                    continue
                if self.pending[f] is None:  # a restarted replica, recovering at its step's start
                    self.pending[f] = [t.clone() for t in got]
                else:  # in the sync's quorum: the buffers about to be issued
                    for b, t in zip(self.pending[f], got):
                        b.copy_(t)
            for f, got in enumerate(state.get("own", [])):
                self.own[f] = None if got is None else [t.clone() for t in got]
        self.outer.load_state_dict(state["outer"])
        groups = [g for gs in self.parts for g in gs]
        for g, st in zip(groups, state.get("codecs", [])):
            if g.compressor is not None and st:
                g.compressor.load_state_dict(st)

    def drain(self) -> None:
        for _, _, transfers in self.inflight:
            for tr in transfers:
                tr.drain()
        self.inflight = []

    def close(self) -> None:
        self.inflight = []
