"""DeAR (Zhang et al., 2023): all-reduce decoupled into a reduce-scatter in
backward and an all-gather before the next forward. A mode on the communicator core
(engine/core.py), which lands the gradients in the buffers and says when one is ready.

    dear = DeAR(model, layout_fn, Plan.of("none"))
    opt = torch.optim.Adam(dear.shard_params(), lr=1e-3)   # any stock elementwise optimizer
    dear.attach(opt)
    loss.backward()        # each buffer's reduce-scatter starts as its last gradient arrives
    dear.finish()          # wait: every rank holds the averaged gradient of ITS shard of each buffer
    opt.step()             # steps the shards (ZeRO-1 style)
    dear.zero_grad()
    model(x)               # forward pre-hooks all-gather the updated parameters, buffer by buffer

Where the step happens (the issue lets us choose): on the shards, before the
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
(``Compressor.shard_path``), one for all buffers or one per buffer by size (a
``Plan``, the spec's ``compressor.per_bucket``):

- "sum": single-round, summable and shape-keeping (none, fp16, bf16). Each
  buffer's gradient is encoded whole (error feedback included when it is on),
  the payload is reduce-scattered as it is, and each rank decodes its shard:
  for such payloads that is the reduce-scatter of the gradients. fp16
  payloads are pre-divided by the world size, as DDP's fp16 hook does.
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

from engine import compressors, schedules
from engine.comm.collectives import Pending, book
from engine.comm.core import Bucket, Communicator
from engine.compressors.base import Compressor
from engine.compressors.base import nbytes as payload_bytes
from engine.compressors.plan import Plan
from engine.netmodel import ModeledLink
from engine.schedules import ParamInfo
from engine.timeline import Timeline

Tensor = torch.Tensor

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def pack_layout(payload: List[Tensor]) -> tuple:
    """[(dtype, shape, byte offset, bytes)] of a payload's tensors packed into one byte buffer, each at
    an 8-byte aligned offset (so it can be viewed back as its dtype), and the buffer's size."""
    out, off = [], 0
    for t in payload:
        n = t.numel() * t.element_size()
        out.append((t.dtype, tuple(t.shape), off, n))
        off += -(-n // 8) * 8
    return out, off


# ---------------------------------------------------------------- the communicator

class Buffer(Bucket):
    """One fused buffer: gradients (the core's ``flat``) and parameters (``data``) as flat tensors
    padded to a multiple of the world size, and this rank's shard of them."""

    def __init__(self, index: int, params: List[torch.nn.Parameter], names: List[str], compressor: Compressor,
                 world: int, rank: int):
        super().__init__(index, params, names, compressor, multiple=world)
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
        self.rs_out: Optional[Tensor] = None
        self.path = compressor.shard_path()
        """"sum" or "alltoall" (``Compressor.shard_path``)."""
        self.send: Optional[Tensor] = None
        """alltoall: the packed payloads of this rank's shards, kept between steps (the all-to-all has
        finished reading it when ``finish`` has waited)."""
        self.fresh = True
        """The model's view of this buffer holds the latest parameters."""
        self.ag: Optional[Pending] = None

    def reset(self) -> None:
        super().reset()
        self.rs: Optional[Pending] = None
        self.prediv = False
        self.ctx = None
        self.parts: Optional[List[tuple]] = None
        """alltoall: (dtype, shape, byte offset, bytes) of each tensor of one shard's payload."""


class DeAR(Communicator):
    """Reduce-scatter in backward, optimizer on shards, all-gather in the next forward."""

    mode = "dear"

    def __init__(self, model: torch.nn.Module, layout: Callable[[List[ParamInfo]], List[List[int]]],
                 plan: Union[Plan, Callable[[], Compressor]], *, timeline: Optional[Timeline] = None, group=None,
                 link: Optional[ModeledLink] = None, broadcast_from_rank0: bool = True):
        plan = plan if isinstance(plan, Plan) else Plan(plan)
        problem = plan.problem(lambda c: c.shard_problem())
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
                # a wait between two layers falls in the next layer's forward span (engine/probe.py)
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
            src = b.shard_param.detach()
            nbytes = src.numel() * src.element_size()
            deadline = book(self.link, "allgather", nbytes, self.group)
            t = self.timeline.now()
            work = _all_gather(b.data, src, group=self.group, async_op=True)
            b.ag = self._track(Pending([work], lambda: [None], self.link, deadline), "allgather", b, nbytes, t)
            self._gather_bytes += nbytes

    def sync_params(self) -> None:
        """Complete every pending all-gather: the model's parameters are the latest (before eval or save)."""
        for g in reversed(range(len(self.buckets))):
            if not self.buckets[g].fresh:
                self._fetch(g)

    # -- backward side: reduce-scatters -------------------------------------
    def _launch(self, b: Buffer) -> None:
        if b.path == "alltoall":
            return self._launch_parts(b)
        tl = self.timeline
        t0 = tl.now()
        payload, b.ctx = b.compressor.encode(b.flat)  # compress, with error feedback when it is on
        if len(payload) != 1 or payload[0].numel() != b.padded:
            raise RuntimeError(f"dear: {b.compressor.name} declares keeps_shape but sent {len(payload)} tensors "
                               f"of {[t.numel() for t in payload]} elements for a buffer of {b.padded}")
        wire = payload[0]
        if wire.dtype == torch.float16:
            # half sums can overflow where no rank's value did: pre-divide, as DDP's fp16 hook does
            wire = wire.div_(self.world) if wire is not b.flat else wire / self.world
            b.prediv = True
        n_out = b.padded if self.a2a else b.shard
        if b.rs_out is None or b.rs_out.dtype != wire.dtype:
            b.rs_out = torch.empty(n_out, dtype=wire.dtype, device=wire.device)
        if wire is not b.flat and tl.enabled:
            tl.span("compress", f"compress b{b.index}", t0, tl.now(), {"bucket": b.index})
        b.wire_sum = wire.sum(dtype=torch.float32)  # for the divergence flag (local values, before the sum)
        nbytes = wire.numel() * wire.element_size()
        deadline = book(self.link, "reduce_scatter", nbytes, self.group)
        t = tl.now()
        if self.a2a:  # chunk j to rank j; the sum over ranks happens in finish
            work = dist.all_to_all_single(b.rs_out, wire, group=self.group, async_op=True)
        else:
            work = _reduce_scatter(b.rs_out, wire, group=self.group, async_op=True)
        out = b.rs_out
        b.rs = self._track(Pending([work], lambda: [out], self.link, deadline), "reduce_scatter", b, nbytes, t)
        self._bytes += nbytes

    def _launch_parts(self, b: Buffer) -> None:
        """A shard codec's reduce-scatter: each shard compressed on its own, shard j's payload to rank j
        in one all-to-all of bytes; ``finish`` decodes and sums the payloads of this rank's shard."""
        tl = self.timeline
        t0 = tl.now()
        parts = b.compressor.encode_parts(b.flat, self.world)  # error feedback over the whole buffer
        b.ctx = parts[self.rank][1]  # a shard's ctx: it decodes every rank's payload of this shard
        b.parts, size = pack_layout(parts[0][0])
        for payload, _ in parts[1:]:
            if pack_layout(payload)[1] != size:
                raise RuntimeError(f"dear: {b.codec} declares shard_codec but its shards' payloads differ in size")
        send = b.send
        if send is None or send.numel() != self.world * size:  # kept: the alignment gaps stay zero
            send = b.send = torch.zeros(self.world * size, dtype=torch.uint8, device=b.flat.device)
        for j, (payload, _) in enumerate(parts):
            for t, (_, _, off, n) in zip(payload, b.parts):
                if n:
                    send[j * size + off:j * size + off + n] = t.contiguous().view(-1).view(torch.uint8)
        if b.rs_out is None or b.rs_out.numel() != send.numel() or b.rs_out.dtype != torch.uint8:
            b.rs_out = torch.empty_like(send)
        if tl.enabled:
            tl.span("compress", f"compress b{b.index}", t0, tl.now(), {"bucket": b.index, "codec": b.codec})
        b.wire_sum = b.flat.sum(dtype=torch.float32)  # the divergence flag: this rank's gradient as it landed
        b.compressor.last_bytes = sum(payload_bytes(p) for p, _ in parts)
        nbytes = send.numel()
        deadline = book(self.link, "reduce_scatter", nbytes, self.group)
        t = tl.now()
        work = dist.all_to_all_single(b.rs_out, send, group=self.group, async_op=True)
        out = b.rs_out
        b.rs = self._track(Pending([work], lambda: [out], self.link, deadline), "reduce_scatter", b, nbytes, t,
                           via="alltoall")
        self._bytes += nbytes

    def _sum_parts(self, b: Buffer, recv: Tensor) -> Tensor:
        """The average of this rank's shard from every rank's payload of it (fp32 sum, then / world)."""
        size = recv.numel() // self.world
        acc = torch.zeros(b.shard, dtype=torch.float32, device=recv.device)
        for j in range(self.world):
            base = j * size
            payload = [recv[base + off:base + off + n].view(dt).view(shape) for dt, shape, off, n in b.parts]
            acc.add_(b.compressor.decompress(payload, b.ctx).reshape(-1).float())
        return acc.div_(self.world)

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
        deadline = book(self.link, "allreduce", 4, self.group)
        self._flag = Pending([dist.all_reduce(flag, group=self.group, async_op=True)], lambda: [flag],
                             self.link, deadline)
        self.sync_params()  # gathers forward did not need (unused parameters): done before the step
        tl = self.timeline
        for b in self.buckets:
            out = self._wait(b.rs, b, f"wait reduce_scatter b{b.index}")[0]
            t1 = tl.now()
            if b.path == "alltoall":
                b.shard_param.grad.copy_(self._sum_parts(b, out))
                if tl.enabled:
                    tl.span("decompress", f"decompress b{b.index}", t1, tl.now(), {"bucket": b.index,
                                                                                   "codec": b.codec})
                continue
            if self.a2a:
                out = out.view(self.world, b.shard).sum(0)
            g = b.compressor.decompress([out], b.ctx)
            if not b.prediv:
                g = g.div_(self.world) if g is out else g / self.world
            b.shard_param.grad.copy_(g)
            if g is not out and tl.enabled:
                tl.span("decompress", f"decompress b{b.index}", t1, tl.now(), {"bucket": b.index})
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
                        _all_gather(full, v.contiguous(), group=self.group)
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


# dear's buffer-cap search is a tuner (engine/tuners/capsearch.py); named here too, beside the layouts it picks
