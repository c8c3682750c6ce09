"""Any single-round commlab compressor as a torch DDP communication hook.

    from commlab.engine.comm.hooks import ddp_hook
    state, hook = ddp_hook("topk", ratio=0.01, error_feedback=True)
    ddp_model.register_comm_hook(state, hook)

The name is any the registry resolves (commlab.engine.compressors.resolve): a built-in, a registered name,
``package.module:Class``, or a ``commlab.Compressor`` subclass itself.

The hook compresses DDP's bucket, starts the collective the compressor asks
for (all-reduce when payloads are summable, all-gather otherwise), and decodes
in the future's continuation, copying the average back into the bucket, as
PyTorch's default hooks do. Multi-round compressors (PowerSGD, Count Sketch
with ``exact``: read from the instance, since parameters can change it) are
refused when the hook is made, because a follow-up collective would be issued
from the communication thread, in an order ranks need not agree on; use them
through the engine, or DDP's own PowerSGD hook with a single bucket.
"""

from typing import Dict, Tuple

import torch
import torch.distributed as dist

from commlab.engine import compressors
from commlab.engine.comm.collectives import issue
from commlab.engine.comm.exchange import Exchange
from commlab.engine.compressors.capabilities import BucketContext


class HookState:
    """One compressor per DDP bucket, keyed by the bucket's index.

    DDP rebuilds its buckets after the first iteration (from the order
    gradients arrived in), so a bucket index can change size once; its
    compressor, and any residual it keeps, is then started afresh.
    """

    def __init__(self, name: str, error_feedback: bool = False, process_group=None, **params):
        probe = compressors.make(name, error_feedback=error_feedback, **params)
        rounds = probe.capabilities.rounds
        if rounds > 1:
            given = f" ({', '.join(f'{k}={v!r}' for k, v in params.items())})" if params else ""
            raise ValueError(f"name: {probe.name}{given} takes several rounds ({rounds}) and cannot run as a "
                             "DDP hook; use the engine")
        self.name, self.error_feedback, self.params = name, error_feedback, params
        self.process_group = process_group
        self.per_bucket: Dict[int, compressors.Compressor] = {}
        self.sizes: Dict[int, int] = {}
        self._slots: Dict[int, Tuple[compressors.Compressor, BucketContext]] = {}
        """By DDP bucket index: its compressor and the context it is driven with (its index, this rank)."""
        self.bytes_sent = 0
        """Payload bytes this rank has sent through the hook so far."""

    def slot(self, index: int, numel: int) -> Tuple[compressors.Compressor, BucketContext]:
        """The compressor of DDP bucket ``index`` (a fresh one when the bucket's size changed) and its context."""
        if self.sizes.get(index) != numel:
            c = compressors.make(self.name, error_feedback=self.error_feedback, **self.params)
            self.per_bucket[index], self.sizes[index] = c, numel
            self._slots[index] = (c, BucketContext(index, dist.get_rank(self.process_group)))
        return self._slots[index]

    def compressor(self, index: int, numel: int) -> compressors.Compressor:
        return self.slot(index, numel)[0]

    def state_dict(self) -> dict:
        return {i: c.state_dict() for i, c in self.per_bucket.items()}


def _hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    group = state.process_group
    world = dist.get_world_size(group)
    c, context = state.slot(bucket.index(), buf.numel())
    ex = Exchange(c, buf, world, bucket=context)
    pending = issue(ex.start(), group)
    state.bytes_sent += ex.sent

    def finish(fut):
        for w in pending.works[:-1]:
            w.wait()
        if ex.send(pending.finish()) is not None:
            raise RuntimeError(f"compressor {state.name} needs more than one round; it cannot run as a DDP hook")
        if ex.out.data_ptr() != buf.data_ptr():
            buf.copy_(ex.out.reshape(buf.shape))
        return buf

    return pending.works[-1].get_future().then(finish)


def ddp_hook(name: str, error_feedback: bool = False, process_group=None, **params):
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``."""
    return HookState(name, error_feedback, process_group, **params), _hook
