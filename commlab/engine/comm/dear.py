"""DeAR (Zhang et al., 2023): all-reduce decoupled into a reduce-scatter in
backward and an all-gather before the next forward. A mode on the communicator core
(commlab/engine/comm/core.py), which lands the gradients in the buffers and says when one is ready.

    dear = DeAR(model, layout_fn, Plan.of("none"))
    opt = torch.optim.Adam(dear.shard_params(), lr=1e-3)   # any stock elementwise optimizer
    dear.attach(opt)
    loss.backward()        # each buffer's reduce-scatter starts as its last gradient arrives
    dear.finish()          # wait: every rank holds the averaged gradient of ITS shard of each buffer
    opt.step()             # steps the shards (ZeRO-1 style)
    dear.zero_grad()
    model(x)               # forward pre-hooks all-gather the updated parameters, buffer by buffer

Where the step happens (either place is correct): on the shards, before the
all-gather. Every buffer's parameters live in one flat tensor padded to a
multiple of the world size; the model's parameters are views of it. Rank r
owns the r-th slice and the optimizer is built over one ``nn.Parameter`` per
buffer shard, whose ``.grad`` is the averaged shard from the reduce-scatter.
SGD (with momentum, Nesterov, weight decay), Adam and AdamW are elementwise,
so stepping the shards equals stepping the full parameters exactly, and each
rank keeps optimizer state for its shards only. Optimizers that are not
elementwise (LAMB, LARS: per-layer norms) would be wrong this way; the spec
offers sgd, adam and adamw only. Padding elements have zero gradient and stay 0.

The all-gather then gathers updated *parameters* (at their own dtype: an fp16
gather would leave ranks with different values of their own shard). It is not
started after the step but in the next forward: when buffer g's first module
starts its forward (a pre-hook), the gathers of g and g+1 are started (if not
yet) and the module waits for g only. Collectives are issued in one fixed
order on every rank: reduce-scatters in buffer order (the order gradients are
expected in backward), all-gathers in forward order.

Compressors: those whose instance declares a way to reduce-scatter
(``Capabilities.shard_path``), one for all buffers or one per buffer by size (a
``Plan``, the spec's ``compressor.per_bucket``). Each buffer's exchange is dear's
sharded exchange (commlab/engine/compressors/contract.py ``shard_exchange``, or the
compressor's own), driven through the exchange driver (commlab/engine/comm/exchange.py)
as sync and wfbp drive ``exchange``, its rounds issued by
commlab/engine/comm/collectives.py; by default:

- "sum": single-round, summable and shape-keeping (none, fp16, bf16). Each
  buffer's gradient is encoded whole (error feedback included when it is on),
  the payload is reduce-scattered as it is, and each rank decodes its shard:
  for such payloads that is the reduce-scatter of the gradients. fp16
  payloads are pre-divided by the world size, as DDP's fp16 hook does
  (``Capabilities.sum_overflows``).
- "alltoall": a ``shard_codec`` (int8, block-wise quantization). Each rank
  cuts the buffer into its world-size shards and compresses each on its own
  (``encode_parts``; error feedback over the whole buffer), sends shard j's
  payload to rank j in one all-to-all of bytes, and rank j decodes the
  payloads it received, sums them in fp32 and divides by the world size: a
  reduce-scatter whose wire carries int8 codes and per-block scales, in the
  manner of ZeRO++'s quantized gradients. The all-gather of parameters stays
  at full precision.

Before evaluation, saving, the end of training, or a relayout,
``sync_params`` completes every pending all-gather, so no one reads stale
parameters. ``finish`` completes them too (a parameter that forward never
used has no pre-hook to fetch it), so the optimizer never writes a shard
that a gather is still reading.

A parameter used in forward outside its own module's forward (e.g. a tied
weight read through another module) would be read before its buffer was
gathered. ``finish`` raises when a buffer got gradients but was never
gathered in that forward; a tie inside one already-gathered buffer is not
caught.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from commlab.engine import compressors, schedules
from commlab.engine.comm.collectives import Pending, issue, issue_allgather_into, issue_allreduce
from commlab.engine.comm.core import Bucket, Communicator
from commlab.engine.comm.exchange import Exchange
from commlab.engine.compressors.base import Compressor, Round
from commlab.engine.compressors.plan import Plan
from commlab.engine.netmodel import ModeledLink
from commlab.engine.schedules import ParamInfo
from commlab.engine.timeline import Timeline

Tensor = torch.Tensor


# ---------------------------------------------------------------- the communicator

class Buffer(Bucket):
    """One fused buffer: gradients (the core's ``flat``) and parameters (``data``) as flat tensors
    padded to a multiple of the world size, and this rank's shard of them."""

    def __init__(self, index: int, params: List[torch.nn.Parameter], names: List[str], compressor: Compressor,
                 world: int, rank: int):
        super().__init__(index, params, names, compressor, multiple=world, rank=rank)
        p0 = params[0]
        self.shard = self.padded // world
        self.lo = rank * self.shard
        self.data = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for o, p in zip(self.offsets, params):
                self.data[o:o + p.numel()].copy_(p.detach().reshape(-1))
        for o, p in zip(self.offsets, params):
            p.data = self.data[o:o + p.numel()].view_as(p)  # the model now reads this buffer
        self.shard_param = torch.nn.Parameter(self.data[self.lo:self.lo + self.shard].clone())
        self.shard_param.grad = torch.zeros_like(self.shard_param)
        self.scratch: dict = {}
        """The collectives' buffers kept between steps (the reduce-scatter's output, an all-to-all's packed
        payloads): a collective has finished with them when ``finish`` has waited."""
        self.fresh = True
        """The model's view of this buffer holds the latest parameters."""
        self.ag: Optional[Pending] = None

    def reset(self) -> None:
        super().reset()
        self.rs: Optional[Pending] = None
        """The pending round of this step's exchange."""
        self.ex: Optional[Exchange] = None
        self.via = False
        """The exchange's rounds are all-to-alls (a shard codec's)."""


class DeAR(Communicator):
    """Reduce-scatter in backward, optimizer on shards, all-gather in the next forward."""

    mode = "dear"

    def __init__(self, model: torch.nn.Module, layout: Callable[[List[ParamInfo]], List[List[int]]],
                 plan: Union[Plan, Callable[[], Compressor]], *, timeline: Optional[Timeline] = None, group=None,
                 link: Optional[ModeledLink] = None, broadcast_from_rank0: bool = True):
        plan = plan if isinstance(plan, Plan) else Plan(plan)
        problem = plan.problem(lambda c: c.capabilities.shard_problem())
        if problem:
            raise ValueError(f"compressor.name: dear reduce-scatters payloads, so it needs a single-round "
                             f"compressor that is summable and keeps the gradient's shape, or a shard codec; "
                             f"{problem}; allowed: {', '.join(compressors.shardable())}")
        self.a2a = dist.get_backend(group) == "gloo"
        """gloo's reduce_scatter is a clone plus a full all-reduce (twice the bytes of a reduce-scatter);
        there the reduce-scatter is an all-to-all of the buffer's chunks and a local sum."""
        self.optimizer = None
        super().__init__(model, layout, plan, timeline=timeline, group=group, link=link,
                         broadcast_from_rank0=broadcast_from_rank0)
        self._owners = {}  # module -> its parameters
        for mod in model.modules():
            own = [p for p in mod.parameters(recurse=False) if p.requires_grad]
            if own:
                self._owners[mod] = own
                # prepend: before other pre-hooks (the layer probe marks the pass start on the root module);
                # a wait between two layers falls in the next layer's forward span (commlab/engine/probe.py)
                self._hooks.append(mod.register_forward_pre_hook(self._pre_forward, prepend=True))
        self._map_modules()
        self._bytes = self._gather_bytes = 0
        self.step_gather_bytes = 0
        self._flag: Optional[Pending] = None

    # -- layout -----------------------------------------------------------
    def _new_bucket(self, index, params, names, compressor) -> Bucket:
        return Buffer(index, params, names, compressor, self.world, self.rank)

    def _build(self, layout: List[List[int]], order) -> None:
        order = list(order)
        if order != list(range(len(self.params))):
            raise ValueError("dear: buffers keep the gradient order (reverse registration); relayout takes no order")
        schedules.check(layout, self.infos)
        super()._build(layout, order)
        self._ag_next = len(self.buckets)  # nothing to gather: parameters are current

    def _map_modules(self) -> None:
        self._module_bufs: Dict[torch.nn.Module, List[int]] = {
            mod: sorted({self.slot[p][0].index for p in own}, reverse=True) for mod, own in self._owners.items()}

    @property
    def buffers(self) -> List[Buffer]:
        """The buckets, under the paper's name for them."""
        return self.buckets

    def shard_params(self) -> List[torch.nn.Parameter]:
        """What the optimizer steps: this rank's shard of every buffer."""
        return [b.shard_param for b in self.buckets]

    def optimizer_params(self) -> List[torch.nn.Parameter]:
        return self.shard_params()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Mark the parameters stale after every step of ``optimizer`` (built over ``shard_params()``),
        so the next forward gathers them."""
        self.optimizer = optimizer
        self._hooks.append(optimizer.register_step_post_hook(lambda *_: self._stepped()))

    def _stepped(self) -> None:
        for b in self.buckets:
            b.fresh = False
        self._ag_next = 0

    # -- forward side: all-gathers ------------------------------------------
    def _pre_forward(self, mod, args) -> None:
        self._poll()
        for g in self._module_bufs[mod]:
            if not self.buckets[g].fresh:
                self._fetch(g)

    def _fetch(self, g: int) -> None:
        """Start the gathers up to the one after ``g`` (forward order), then wait for ``g``."""
        b = self.buckets[g]
        self._gather_upto(len(self.buckets) - g)
        self._wait(b.ag, b, f"wait allgather b{g}")
        b.ag, b.fresh = None, True

    def _gather_upto(self, pos: int) -> None:
        n = len(self.buckets)
        while self._ag_next <= min(pos, n - 1):
            b = self.buckets[n - 1 - self._ag_next]
            self._ag_next += 1
            t = self.timeline.now()
            pend = issue_allgather_into(b.data, b.shard_param.detach(), self.group, self.link)
            b.ag = self._track(pend, "allgather", b, pend.nbytes, t)
            self._gather_bytes += pend.nbytes

    def sync_params(self) -> None:
        """Complete every pending all-gather: the model's parameters are the latest (before eval or save)."""
        for g in reversed(range(len(self.buckets))):
            if not self.buckets[g].fresh:
                self._fetch(g)

    # -- backward side: reduce-scatters -------------------------------------
    def _launch(self, b: Buffer) -> None:
        tl = self.timeline
        t0 = tl.now()
        b.ex = Exchange(b.compressor, b.flat, self.world, rank=self.rank, bucket=b.context)  # error feedback inside
        rnd = b.ex.start()
        b.via = rnd.op == "all_to_all"
        if tl.enabled and (b.via or rnd.tensors[0] is not b.flat):
            tl.span("compress", f"compress b{b.index}", t0, tl.now(),
                    {"bucket": b.index, **({"codec": b.codec} if b.via else {})})
        # the divergence flag: this rank's values before the sum (the payload, or a shard codec's gradient
        # as it landed)
        b.wire_sum = (b.flat if b.via else rnd.tensors[0]).sum(dtype=torch.float32)
        self._issue(b, rnd)

    def _issue(self, b: Buffer, rnd: Round) -> None:
        t = self.timeline.now()
        pend = issue(rnd, self.group, self.link, via_alltoall=self.a2a, scratch=b.scratch)
        b.rs = self._track(pend, "reduce_scatter", b, pend.nbytes, t, **({"via": "alltoall"} if b.via else {}))
        self._bytes += pend.nbytes

    def finish(self) -> None:
        """After backward: every rank holds the averaged gradient of its shards in ``shard_params()[g].grad``."""
        self._land_rest()
        for b in self.buckets:
            if not b.fresh and any(b.seen):
                raise RuntimeError(f"dear: {b.label()} got gradients but was not gathered before forward used it; "
                                   "a parameter is used outside its own module's forward (tied weights?)")
        self._launch_ready()
        # agree on divergence: a NaN/inf on any rank makes the flag NaN on all (x * 0 is 0 only for finite x)
        flag = (torch.stack([b.wire_sum for b in self.buckets]).sum() * 0).reshape(1)
        self._flag = issue_allreduce([flag], self.group, self.link)
        self.sync_params()  # gathers forward did not need (unused parameters): done before the step
        tl = self.timeline
        for b in self.buckets:  # bucket order: every rank issues any further rounds identically
            reply = self._wait(b.rs, b, f"wait reduce_scatter b{b.index}")
            t1 = tl.now()
            rnd = b.ex.send(reply)
            while rnd is not None:  # a compressor's own shard_exchange may take more rounds
                self._issue(b, rnd)
                reply = self._wait(b.rs, b, f"wait reduce_scatter b{b.index}")
                t1 = tl.now()
                rnd = b.ex.send(reply)
            g = b.ex.out
            b.sent = b.ex.sent
            b.shard_param.grad.copy_(g)
            if tl.enabled and (b.via or g is not reply[0]):
                tl.span("decompress", f"decompress b{b.index}", t1, tl.now(),
                        {"bucket": b.index, **({"codec": b.codec} if b.via else {})})
        self._end_step()
        self.step_bytes, self._bytes = self._bytes, 0
        self.step_gather_bytes, self._gather_bytes = self._gather_bytes, 0

    def grads_finite(self) -> Tensor:
        """A 0-d bool tensor, the same on every rank: every rank's local gradient (as sent) was finite.
        One 4-byte all-reduce per step, issued in ``finish`` behind the reduce-scatters."""
        return torch.isfinite(self._flag.wait()[0][0])

    # -- relayout (online tuning) ---------------------------------------------
    def relayout(self, layout: List[List[int]], order=None) -> None:
        """Rebuild the buffers at a step boundary. Pending gathers complete first; the attached
        optimizer's per-element state (momentum, Adam moments) is moved element by element to the
        new shards (one all-gather per state tensor and buffer), its scalar state (Adam's step) kept.
        The compressors' per-element state moves with its parameters (the core's relayout)."""
        self.sync_params()
        opt = self.optimizer
        per_param: Dict[int, Dict[str, tuple]] = {}  # id(param) -> key -> (elementwise, value)
        if opt is not None:
            if len(opt.param_groups) != 1:
                raise ValueError("dear: relayout needs an optimizer with one parameter group")
            for b in self.buckets:
                st = opt.state.pop(b.shard_param, {})
                for k, v in st.items():
                    if torch.is_tensor(v) and v.shape == b.shard_param.shape:
                        full = torch.empty(b.padded, dtype=v.dtype, device=v.device)
                        # not booked on a modeled link: a relayout is a pause of its own, not a step
                        issue_allgather_into(full, v.contiguous(), self.group).wait()
                        for p, off in zip(b.params, b.offsets):
                            per_param.setdefault(id(p), {})[k] = (True, full[off:off + p.numel()].clone())
                    else:  # scalar state (Adam's step): the same for every shard
                        for p in b.params:
                            per_param.setdefault(id(p), {})[k] = (False, v)
        super().relayout(layout, order)
        self._map_modules()
        if opt is None:
            return
        for b in self.buckets:
            st = {}
            for k, (elementwise, v) in per_param.get(id(b.params[0]), {}).items():
                if elementwise:
                    full = torch.zeros(b.padded, dtype=v.dtype, device=v.device)
                    for p, off in zip(b.params, b.offsets):
                        full[off:off + p.numel()] = per_param[id(p)][k][1]
                    st[k] = full[b.lo:b.lo + b.shard].clone()
                else:
                    st[k] = v.clone() if torch.is_tensor(v) else v
            if st:
                opt.state[b.shard_param] = st
        opt.param_groups[0]["params"] = self.shard_params()

    def close(self) -> None:
        """Remove the hooks and drop every collective handle, so none outlives the process group.
        No collective here: close also runs when a rank fails."""
        super().close()
        self._flag = None
        for b in self.buckets:
            b.rs = b.ag = None


# dear's buffer-cap search is a tuner (commlab/engine/tuners/capsearch.py); named here too, beside the layouts it picks
