"""A method's exchanges: flat groups of parameters, and one compressor exchange driven through the lab's
driver (``commlab.engine.comm.exchange.Exchange``, one collective per round from ``commlab.engine.comm.collectives``),
with spans on the method's own timeline lanes.

A ``Transfer`` can be started in one step and finished in a later one (Streaming DiLoCo overlaps a
fragment's all-reduce with inner steps): between the two, its collective is in flight. Every rank starts
and finishes transfers in the same order, as the communicator issues buckets in the same order.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from commlab.engine.comm.collectives import Pending, issue
from commlab.engine.comm.exchange import Exchange
from commlab.engine.compressors.base import Compressor, Round, round_bytes
from commlab.engine.compressors.capabilities import BucketContext
from commlab.engine.methods.base import Context

Tensor = torch.Tensor


class Group:
    """Parameters of one dtype and device, laid end to end in one flat buffer (``flat``); ``index`` are
    their positions in ``Context.params``. A compressor serves one group and keeps its state; ``context``
    is what it is told about the group (``BucketContext``: its number ``bucket``, this process's ``rank``, the
    layout)."""

    def __init__(self, params: List[torch.nn.Parameter], index: List[int], label: str,
                 compressor: Optional[Compressor] = None, pad_to: int = 1, bucket: int = 0, rank: int = 0):
        self.params, self.index, self.label = params, index, label
        self.sizes = [p.numel() for p in params]
        self.padded = [-(-n // pad_to) * pad_to for n in self.sizes]
        """Each tensor's length in ``flat``: its size rounded up to ``pad_to`` (DeMo's chunks)."""
        self.offsets = [sum(self.padded[:i]) for i in range(len(params))]
        p0 = params[0]
        self.flat = torch.zeros(sum(self.padded), dtype=p0.dtype, device=p0.device)
        self.compressor = compressor
        self.context = BucketContext(bucket, rank, tuple((o, tuple(p.shape)) for o, p in zip(self.offsets, params)))

    @property
    def raw_bytes(self) -> int:
        return sum(self.sizes) * self.flat.element_size()

    def views(self, flat: Tensor) -> List[Tensor]:
        """``flat`` (laid out as ``self.flat``) cut into one view per parameter, shaped like it."""
        return [flat[o:o + n].view_as(p) for o, n, p in zip(self.offsets, self.sizes, self.params)]

    def gather(self, tensors: Sequence[Tensor]) -> Tensor:
        """Copy ``tensors`` (one per parameter) into ``flat``; returns it."""
        for v, t in zip(self.views(self.flat), tensors):
            v.copy_(t)
        return self.flat


def groups(ctx: Context, members: Sequence[int], label: str, make: Optional[callable] = None,
           pad_to: int = 1, first_bucket: int = 0) -> List[Group]:
    """The parameters at ``members`` (indices into ctx.params) split by dtype and device, in order; each
    group gets a compressor from ``make(raw_bytes)`` when given, numbered from ``first_bucket`` (seeds
    that ranks share derive from it)."""
    by: Dict[tuple, List[int]] = {}
    for i in members:
        p = ctx.params[i]
        by.setdefault((p.dtype, p.device), []).append(i)
    out = []
    for k, idx in enumerate(by.values()):
        ps = [ctx.params[i] for i in idx]
        name = label if len(by) == 1 else f"{label}.{k}"
        comp = make(sum(p.numel() * p.element_size() for p in ps)) if make is not None else None
        out.append(Group(ps, idx, name, comp, pad_to, first_bucket + k, ctx.rank))
    return out


class Transfer:
    """One exchange of a group's flat tensor: ``start()`` encodes it and issues the first round,
    ``finish()`` waits, runs any later rounds and decodes; ``out`` is then the average over ranks.
    Spans go to the ``lane`` of the timeline: encode, the collective (issue to completion), the wait
    and the decode, each with the group's label and ``args`` (step, fragment, bytes, codec)."""

    def __init__(self, ctx: Context, group: Group, compressor: Compressor, t: Tensor, lane: str, step: int,
                 args: Optional[dict] = None):
        self.ctx, self.group, self.compressor, self.t, self.lane, self.step = ctx, group, compressor, t, lane, step
        self.args = {"step": step, "codec": compressor.describe(), "raw_bytes": group.raw_bytes, **(args or {})}
        self.ex: Optional[Exchange] = None
        self.pend: Optional[Pending] = None
        self.op = ""
        self.sent = 0
        """Payload bytes this rank sent, over every round."""
        self.counted = 0
        """Of ``sent``, the bytes already booked to a step (``fresh_bytes``)."""
        self.t_issue = 0.0
        self.t_done: Optional[float] = None
        self.out: Optional[Tensor] = None

    @property
    def timeline(self):
        return self.ctx.timeline

    def _now(self) -> float:
        return self.timeline.now() if self.timeline is not None else 0.0

    def _span(self, what: str, t0: float, t1: float, **extra) -> None:
        if self.timeline is not None:
            self.timeline.span(self.lane, f"{what} {self.group.label}", t0, t1, {**self.args, **extra})

    def start(self) -> "Transfer":
        t0 = self._now()
        self.ex = Exchange(self.compressor, self.t, self.ctx.world, bucket=self.group.context)
        rnd = self.ex.start()
        self._span("encode", t0, self._now())
        self._issue(rnd)
        return self

    def _issue(self, rnd: Round) -> None:
        self.op = rnd.op
        self.t_issue = self._now()
        self.t_done = None
        tl = self.timeline
        now = tl.now if tl is not None and tl.enabled else None
        self.pend = issue(rnd, self.ctx.group, self.ctx.link, now=now)
        self.sent += round_bytes(rnd)
        if now is not None and self.pend.works:
            def done(_fut, pend=self.pend):
                if pend is self.pend:  # a later round's completion is stamped by its own callback
                    self.t_done = max(tl.now(), pend.deadline or 0.0)
            try:
                self.pend.works[-1].get_future().add_done_callback(done)
            except RuntimeError:  # a work without a future: stamped when waited for
                pass
        self.ctx.on_issue(self.step)

    def finish(self) -> Tensor:
        while True:
            t0 = self._now()
            result = self.pend.wait()
            t1 = self._now()
            self._span(self.op, self.t_issue, self.t_done or t1, round=self.ex.rounds, bytes=self.sent)
            self._span("wait", t0, t1)
            rnd = self.ex.send(result)
            if rnd is None:
                self._span("decode", t1, self._now())
                self.out = self.ex.out
                self.pend = None
                return self.out
            self._span("encode", t1, self._now(), round=self.ex.rounds)
            self._issue(rnd)

    def fresh_bytes(self) -> int:
        """Bytes sent since the last call: what the current step sent of this transfer (a multi-round
        compressor's later rounds go out in the step that finishes it)."""
        n, self.counted = self.sent - self.counted, self.sent
        return n

    def drain(self) -> None:
        """Wait for the round in flight and drop it (the end of training: every rank drains alike)."""
        if self.pend is not None:
            self.pend.wait()
            self.pend = None

    def run(self) -> Tensor:
        """Start and finish at once (a blocking sync)."""
        return self.start().finish()
