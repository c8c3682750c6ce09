"""sync and wfbp: all-reduce (or all-gather) of each bucket's compressed gradient, on the core.

Usage inside a training step (the optimizer is any stock torch.optim one):

    dp = WFBP(model, schedule_fn, Plan.of("topk", ratio=0.01))     # or Sync(...), the same arguments
    loss.backward()          # in wfbp, ready buckets are already being sent
    dp.finish()              # wait, decode, leave averaged gradients in p.grad
    optimizer.step()

The core (commlab/engine/comm/core.py) keeps the buckets, lands the gradients and says when a bucket is
ready; these modes run each bucket's compressor exchange (commlab/engine/comm/exchange.py): in wfbp it starts
as the bucket becomes ready, in sync all of them start in ``finish``.

Collectives are only ever issued from the training thread and in bucket
order, on every rank alike: bucket i+1 is never launched before bucket i, and
later rounds of multi-round compressors are issued in ``finish`` in bucket
order too. Ranks therefore agree on the order of collectives even when
gradients become ready in a different order, which gloo and NCCL require.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from commlab.engine.comm.collectives import issue
from commlab.engine.comm.core import Bucket, Communicator
from commlab.engine.comm.exchange import Exchange
from commlab.engine.compressors.base import Compressor, Round

Tensor = torch.Tensor


class ExchangeBucket(Bucket):
    """A bucket whose whole gradient is exchanged (compressed, a collective per round, decoded)."""

    multi = False
    """Its compressor takes several rounds (``Capabilities.rounds``), set by the mode when it makes the bucket."""

    def reset(self) -> None:
        super().reset()
        self.ex: Optional[Exchange] = None
        self.done = False
        self.handle = None
        self.op = ""


class WFBP(Communicator):
    """Average gradients over ranks with a fusion schedule and a compressor per bucket, each bucket's
    exchange started as soon as its gradients are ready, overlapped with the rest of backward."""

    mode = "wfbp"

    def _new_bucket(self, index, params, names, compressor) -> Bucket:
        b = ExchangeBucket(index, params, names, compressor, rank=self.rank)
        b.scale = self._scale(compressor)
        b.multi = compressor.capabilities.rounds > 1
        return b

    def _scale(self, compressor: Compressor) -> Optional[float]:
        """1/world where the gradients are divided as they land, before the all-reduce (as DDP does); None
        on a method's local steps, which keep each rank's own gradient."""
        return 1.0 / self.world if self.exchanging and Exchange.prescales(compressor) else None

    def set_exchanging(self, on: bool) -> None:
        """Whether this step's gradients are exchanged (commlab.engine.methods: off on a method's local steps)."""
        on = bool(on)
        if on != self.exchanging:
            self.exchanging = on
            for b in self.buckets:
                b.scale = self._scale(b.compressor)

    def set_world(self, world: int, rank: int) -> None:
        """This step's world (the 1/world of the buckets whose gradients land pre-divided follows it); the
        bucket contexts keep the rank they were built with (a stable one: fault tolerance's replica id)."""
        self.world = world
        for b in self.buckets:
            b.scale = self._scale(b.compressor)

    def _build(self, layout, order) -> None:
        super()._build(layout, order)
        self._multi: List[ExchangeBucket] = []
        """Launched buckets of multi-round compressors, in launch order (``_advance_multi``)."""

    # -- backward side ----------------------------------------------------
    def _bucket_ready(self, b: Bucket) -> None:
        if self.exchanging:  # a local step sends nothing
            self._launch_ready()

    def _advance_multi(self) -> None:
        """Multi-round exchanges (PowerSGD) advance one round each time a later bucket launches, so their
        follow-up rounds and decoding overlap the rest of backward instead of all landing in finish().
        Where this happens depends only on the bucket sequence, so every rank issues the same collectives
        in the same order. Only launched multi-round buckets are visited (kept in launch order), not every
        earlier bucket: layer-wise schedules launch dozens per step."""
        if self._multi:
            for m in self._multi:
                if not m.done:
                    self._advance(m)
            self._multi = [m for m in self._multi if not m.done]

    def _launch(self, b: ExchangeBucket) -> None:
        self._advance_multi()
        if b.multi:
            self._multi.append(b)
        tl = self.timeline
        t0 = tl.now()
        b.ex = Exchange(b.compressor, b.flat, self.world, prescaled=b.scale is not None, bucket=b.context)
        rnd = b.ex.start()
        if tl.enabled:
            tl.span("compress", f"compress b{b.index}", t0, tl.now(), {"bucket": b.index})
        self._issue(b, rnd)

    def _issue(self, b: ExchangeBucket, rnd: Round) -> None:
        tl = self.timeline
        t_issue = tl.now()
        b.op = rnd.op
        b.handle = issue(rnd, self.group, self.link, now=tl.now if tl.enabled else None)
        if b.handle.header_span is not None:
            # the header exchange blocks the training thread until the other ranks reach this bucket: a wait
            h0, h1 = b.handle.header_span
            tl.span("wait", f"header b{b.index}", h0, h1, {"bucket": b.index, "op": "allgather header"})
        self._track(b.handle, rnd.op, b, sum(t.numel() * t.element_size() for t in rnd.tensors), t_issue,
                    round=b.ex.rounds)

    # -- after backward ---------------------------------------------------
    def _advance(self, b: ExchangeBucket) -> bool:
        """Wait for ``b``'s current round, then issue its next one or decode its result.
        Returns True while the bucket has rounds left."""
        tl = self.timeline
        result = self._wait(b.handle, b, f"wait b{b.index}")
        t1 = tl.now()
        rnd = b.ex.send(result)
        if rnd is None:
            out = b.ex.out
            if out is not b.flat and out.data_ptr() != b.flat.data_ptr():
                b.flat.copy_(out.reshape(-1))
            if tl.enabled:
                tl.span("decompress", f"decompress b{b.index}", t1, tl.now(), {"bucket": b.index})
            b.done = True
            return False
        if tl.enabled:
            tl.span("compress", f"compress b{b.index} r{b.ex.rounds}", t1, tl.now(), {"bucket": b.index})
        self._issue(b, rnd)
        return True

    def finish(self) -> None:
        """Complete every bucket's exchange and leave averaged gradients in p.grad (on a local step: land
        this rank's own gradients, send nothing)."""
        if not self.exchanging:
            self._land_rest()
            self.step_bytes = 0
            self._end_step()
            return
        self._complete_arrivals()
        active = [b for b in self.buckets if not b.done]
        while active:  # bucket order: every rank issues follow-up rounds identically
            active = [b for b in active if self._advance(b)]
        total = 0
        for b in self.buckets:
            b.sent = b.ex.sent
            total += b.sent
        self.step_bytes = total
        self._end_step()
        self._multi = []

    def grads_finite(self) -> Tensor:
        """A 0-d bool tensor: every averaged gradient is finite. The buffers are identical on
        all ranks after ``finish``, so all ranks reach the same answer without a collective.
        It is a tensor so that the caller reads it at a sync point it has anyway (on GPU,
        reading it here would stall the stream every step)."""
        total = sum(b.flat.sum(dtype=torch.float32) for b in self.buckets)  # inf when it overflows: diverged too
        return torch.isfinite(torch.as_tensor(total))


class Sync(WFBP):
    """As wfbp, but every bucket's exchange starts after backward, in ``finish``."""

    mode = "sync"

    def _bulk_buckets(self) -> List[int]:
        return list(range(len(self.buckets)))  # nothing launches before finish: every bucket lands in bulk there

    def _bucket_ready(self, b: Bucket) -> None:
        pass  # launched in finish

    def _advance_multi(self) -> None:
        pass  # every bucket launches in finish, whose loop advances the rounds in bucket order
