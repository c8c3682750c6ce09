"""The data-parallel communicator: buckets, compressed exchanges, sync and wfbp.

Usage inside a training step (the optimizer is any stock torch.optim one):

    dp = DataParallel(model, buckets_fn, make_compressor, mode="wfbp")
    loss.backward()          # in wfbp, ready buckets are already being sent
    dp.finish()              # wait, decode, leave averaged gradients in p.grad
    optimizer.step()

Each bucket owns a flat buffer. A parameter's gradient lands there either
directly (p.grad is a view of the buffer and autograd accumulates into it) or
by one copy in its post-accumulate-grad hook, if something replaced p.grad
(``zero_grad(set_to_none=True)`` does). After ``finish`` p.grad is the view.

Collectives are only ever issued from the training thread and in bucket
order, on every rank alike: bucket i+1 is never launched before bucket i, and
later rounds of multi-round compressors are issued in ``finish`` in bucket
order too. Ranks therefore agree on the order of collectives even when
gradients become ready in a different order, which gloo and NCCL require.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from engine.compressors.base import Compressor, Round
from engine.netmodel import ModeledLink
from engine.schedules import ParamInfo
from engine.timeline import Timeline

Tensor = torch.Tensor


def param_infos(params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> List[ParamInfo]:
    return [ParamInfo(name=n, numel=p.numel(), element_size=p.element_size(),
                      dtype=str(p.dtype).replace("torch.", ""), device=str(p.device))
            for p, n in zip(params, names)]


class Bucket:
    def __init__(self, index: int, params: List[torch.nn.Parameter], names: List[str], compressor: Compressor):
        self.index = index
        self.params = params
        self.names = names
        self.compressor = compressor
        p0 = params[0]
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total, dtype=p0.dtype, device=p0.device)
        self.views: List[Tensor] = []
        off = 0
        for p in params:
            self.views.append(self.flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        self.raw_bytes = total * p0.element_size()
        self.reset()

    def reset(self) -> None:
        self.pending = len(self.params)
        self.seen = [False] * len(self.params)
        self.ready = False
        self.launched = False
        self.gen = None
        self.done = False
        self.round: Optional[Round] = None
        self.handle = None
        self.t_issue = 0.0
        self.bytes_sent = 0
        self.rounds = 0

    def label(self) -> str:
        if len(self.names) == 1:
            return self.names[0]
        return f"{self.names[0]} .. {self.names[-1]} ({len(self.names)} tensors)"


def land_grad(p: torch.nn.Parameter, view: Tensor, b, pos: int) -> bool:
    """Count parameter ``p``'s gradient into bucket ``b`` (slot ``pos``, buffer view ``view``).
    Returns True when p.grad was not the view (something replaced it, e.g. zero_grad(set_to_none)):
    the gradient was copied in, and the caller points p.grad at the view again."""
    replaced = p.grad is not view and p.grad.data_ptr() != view.data_ptr()
    if replaced:
        view.copy_(p.grad)
    if b.seen[pos]:
        raise RuntimeError(f"gradient of {b.names[pos]} was produced twice in one step; "
                           "call finish() after every backward (no gradient accumulation yet)")
    b.seen[pos] = True
    b.pending -= 1
    return replaced


class _Pending:
    """An issued collective: its work handles and how to read the result.

    With a modeled link, ``deadline`` is when the model says the collective
    completes (host clock); ``wait`` returns no earlier than that."""

    def __init__(self, works, finish: Callable[[], list], link: Optional[ModeledLink] = None,
                 deadline: Optional[float] = None):
        self.works = works
        self.finish = finish
        self.t_done = None
        self.link = link
        self.deadline = deadline

    def wait(self):
        for w in self.works:
            w.wait()
        if self.link is not None and self.deadline is not None:
            self.link.hold_until(self.deadline)
        return self.finish()


def _book(link: Optional[ModeledLink], op: str, nbytes: int, group) -> Optional[float]:
    """The modeled completion time of a collective issued now (None without a modeled link)."""
    if link is None:
        return None
    return link.issue(op, nbytes, dist.get_world_size(group))


def issue_allreduce(tensors: List[Tensor], group=None, link: Optional[ModeledLink] = None) -> _Pending:
    """Start an asynchronous sum of ``tensors`` over ranks (one collective when dtypes agree).
    With a modeled ``link``, waiting on it takes at least the link's ring all-reduce time."""
    deadline = _book(link, "allreduce", sum(t.numel() * t.element_size() for t in tensors), group)
    if len(tensors) == 1:
        t = tensors[0]
        return _Pending([dist.all_reduce(t, group=group, async_op=True)], lambda: [t], link, deadline)
    if len({(t.dtype, t.device) for t in tensors}) == 1:
        # one collective for the whole payload: per-call latency dominates small tensors
        flat = torch.cat([t.reshape(-1) for t in tensors])
        work = dist.all_reduce(flat, group=group, async_op=True)

        def split():
            out, off = [], 0
            for t in tensors:
                out.append(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
            return out
        return _Pending([work], split, link, deadline)
    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    return _Pending(works, lambda: list(tensors), link, deadline)


def issue_allgather(tensors: List[Tensor], group=None, link: Optional[ModeledLink] = None,
                    now: Optional[Callable[[], float]] = None) -> _Pending:
    """All-gather payloads whose sizes may differ between ranks.

    Every tensor is sent as raw bytes in one padded buffer, each starting at
    an 8-byte aligned offset (so it can be viewed back as its dtype). A small
    header (the shape of every tensor) is exchanged first, synchronously: it
    is a few bytes and keeps the data exchange a single asynchronous collective.
    With a modeled ``link`` both exchanges take at least the link's ring
    all-gather time, the data one for the padded size every rank sends.
    """
    world = dist.get_world_size(group)
    device = tensors[0].device if tensors else torch.device("cpu")
    k = len(tensors)
    header = torch.zeros(k, 5, dtype=torch.int64, device=device)  # ndim + up to 4 dims
    for i, t in enumerate(tensors):
        if t.dim() > 4:
            raise ValueError("all-gathered payload tensors may have at most 4 dimensions")
        header[i, 0] = t.dim()
        header[i, 1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    headers = [torch.empty_like(header) for _ in range(world)]
    header_deadline = _book(link, "allgather", header.numel() * header.element_size(), group)
    t_header = now() if now else None
    dist.all_gather(headers, header, group=group)
    if header_deadline is not None:
        link.hold_until(header_deadline)
    header_span = (t_header, now()) if now else None
    dtypes = [t.dtype for t in tensors]
    esize = [t.element_size() for t in tensors]

    def shapes_of(h):
        h = h.tolist()
        return [tuple(row[1:1 + row[0]]) for row in h]
    all_shapes = [shapes_of(h) for h in headers]
    offsets = [_offsets(shapes, esize) for shapes in all_shapes]
    cap = max(max(o[-1] for o in offsets), 1)
    send = torch.zeros(cap, dtype=torch.uint8, device=device)
    for t, off in zip(tensors, offsets[dist.get_rank(group)]):
        n = t.numel() * t.element_size()
        if n:
            send[off:off + n] = t.contiguous().view(-1).view(torch.uint8)
    recv = [torch.empty(cap, dtype=torch.uint8, device=device) for _ in range(world)]
    deadline = _book(link, "allgather", cap, group)
    work = dist.all_gather(recv, send, group=group, async_op=True)

    def unpack():
        out = []
        for r in range(world):
            payload = []
            for shape, dt, e, off in zip(all_shapes[r], dtypes, esize, offsets[r]):
                n = _numel(shape) * e
                payload.append(recv[r][off:off + n].view(dt).view(shape))
            out.append(payload)
        return out
    pend = _Pending([work], unpack, link, deadline)
    pend.header_span = header_span
    """(start, end) of the synchronous header exchange, on ``now``'s clock, when ``now`` was given."""
    return pend


class DataParallel:
    """Average gradients over ranks with a fusion schedule, a compressor per bucket and a comm mode."""

    def __init__(self, model: torch.nn.Module,
                 schedule: Callable[[List[ParamInfo]], List[List[int]]],
                 make_compressor: Callable[[], Compressor],
                 mode: str = "wfbp",
                 timeline: Optional[Timeline] = None,
                 group=None,
                 broadcast_from_rank0: bool = True,
                 link: Optional[ModeledLink] = None):
        if mode not in ("sync", "wfbp"):
            raise ValueError(f"comm.mode: {mode!r} is not supported by DataParallel; allowed: sync, wfbp")
        self.model = model
        self.mode = mode
        self.group = group
        self.link = link
        """A ModeledLink (network: modeled): every collective lasts at least its alpha-beta time."""
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeline = timeline or Timeline(None, self.rank, enabled=False)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # gradients become ready roughly in reverse registration order (as DDP assumes)
        named.reverse()
        self.order_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.infos = param_infos(self.params, self.order_names)
        self.make_compressor = make_compressor
        self.buckets: List[Bucket] = []
        self.slot = {}  # param -> (bucket, position)
        self._build(schedule(self.infos), list(range(len(self.params))))
        if broadcast_from_rank0:
            with torch.no_grad():
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t.data, 0, group=group)
        self._next = 0
        self._multi: List[Bucket] = []
        """Launched buckets of multi-round compressors, in launch order (wfbp advances them)."""
        self._index = {p: i for i, p in enumerate(self.params)}
        self.ready_order: Optional[List[int]] = None
        """Indices into ``params`` in the order their gradients became ready in the first step."""
        self._arrivals: List[int] = []
        self.record_ready = False
        """When True, ``ready_at`` gets each gradient's host time of arrival in the current step."""
        self.ready_at: List[float] = [0.0] * len(self.params)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._rebind = False
        self._bind_views()  # autograd accumulates straight into the buckets from the first step
        self.step_bytes = 0
        self.step_raw_bytes = 0

    def _build(self, layout: List[List[int]], order: List[int]) -> None:
        """Buckets from ``layout`` (lists of positions into ``order``, itself indices into ``params``)."""
        self.buckets, self.slot = [], {}
        self.order = list(order)
        for bi, idx in enumerate(layout):
            comp = self.make_compressor()
            comp.bucket, comp.process_rank = bi, self.rank
            ps = [self.params[order[i]] for i in idx]
            b = Bucket(bi, ps, [self.order_names[order[i]] for i in idx], comp)
            comp.layout = [(v.storage_offset() - b.flat.storage_offset(), tuple(v.shape)) for v in b.views]
            self.buckets.append(b)
            for pos, p in enumerate(ps):
                self.slot[p] = (b, pos)

    def relayout(self, layout: List[List[int]], order: Optional[List[int]] = None) -> None:
        """Rebuild the buckets at a step boundary (after ``finish`` and ``zero_grad``).

        ``layout`` holds positions into ``order`` (indices into ``params``; default the
        current order). Every rank must call it at the same step with the same layout.
        The compressors' per-element state (error-feedback residuals, DGC's u and v, ...)
        belongs to parameters, not to bucket slots: each parameter's slice is moved
        from its old bucket to its new one. A counter ``step`` (warm-up schedules)
        carries over; other state starts afresh (Compressor.elementwise)."""
        order = self.order if order is None else list(order)
        if sorted(order) != list(range(len(self.params))):
            raise ValueError("relayout: order must be a permutation of the parameters")
        old = {}  # param -> {state name: its slice or None}
        step = None
        for b in self.buckets:
            state = b.compressor.elementwise_state()
            step = getattr(b.compressor, "step", step)
            for p, v in zip(b.params, b.views):
                off = v.storage_offset() - b.flat.storage_offset()
                old[p] = {k: (None if t is None else t[off:off + p.numel()]) for k, t in state.items()}
        self._build(layout, order)
        for b in self.buckets:
            state = {}
            for k in b.compressor.elementwise_state():
                parts = [old[p].get(k) for p in b.params]
                if all(t is None for t in parts):
                    state[k] = None  # nothing kept yet: the compressor starts from zero as usual
                else:
                    state[k] = torch.cat([torch.zeros_like(b.views[i]).reshape(-1) if t is None else t
                                          for i, t in enumerate(parts)])
            b.compressor.load_elementwise_state(state)
            if step is not None and hasattr(b.compressor, "step"):
                b.compressor.step = step
        self._next, self._multi = 0, []
        self._bind_views()

    # -- backward side ----------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self.ready_order is None:
            self._arrivals.append(self._index[p])
        if self.record_ready:
            self.ready_at[self._index[p]] = self.timeline.now()
        b, pos = self.slot[p]
        if land_grad(p, b.views[pos], b, pos):
            self._rebind = True  # p.grad was replaced (zero_grad(set_to_none)): point it at the view again
        if b.pending == 0:
            b.ready = True
            t = self.timeline.now()
            self.timeline.span("ready", f"b{b.index} ready", t, t, {"bucket": b.index})
            if self.mode == "wfbp":
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            if self.mode == "wfbp":
                # Multi-round exchanges (PowerSGD) advance one round each time a later bucket
                # launches, so their follow-up rounds and decoding overlap the rest of backward
                # instead of all landing in finish(). Where this happens depends only on the
                # bucket sequence, so every rank issues the same collectives in the same order.
                # Only launched multi-round buckets are visited (kept in launch order), not every
                # earlier bucket: layer-wise schedules launch dozens per step.
                for b in self._multi:
                    if not b.done:
                        self._advance(b)
                self._multi = [b for b in self._multi if not b.done]
            if self.buckets[self._next].compressor.rounds > 1:
                self._multi.append(self.buckets[self._next])
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, b: Bucket) -> None:
        t0 = self.timeline.now()
        b.launched = True
        b.gen = b.compressor.exchange(b.flat, self.world)
        rnd = next(b.gen)
        self.timeline.span("compress", f"compress b{b.index}", t0, self.timeline.now(), {"bucket": b.index})
        self._issue(b, rnd)

    def _issue(self, b: Bucket, rnd: Round) -> None:
        b.round = rnd
        b.rounds += 1
        b.t_issue = self.timeline.now()
        if rnd.op == "allreduce":
            b.handle = issue_allreduce(rnd.tensors, self.group, self.link)
        elif rnd.op == "allgather":
            b.handle = issue_allgather(rnd.tensors, self.group, self.link, now=self.timeline.now)
            # the header exchange blocks the training thread until the other ranks reach this bucket: a wait
            h0, h1 = b.handle.header_span
            self.timeline.span("wait", f"header b{b.index}", h0, h1, {"bucket": b.index, "op": "allgather header"})
        else:
            raise ValueError(f"compressor {b.compressor.name} asked for an unknown collective {rnd.op!r}")
        pend, args = b.handle, {"bucket": b.index, "op": rnd.op, "round": b.rounds,
                                "bytes": sum(t.numel() * t.element_size() for t in rnd.tensors),
                                "layers": b.label()}
        t_issue = b.t_issue

        def done(_fut, pend=pend):
            # with a modeled link the collective ends when the model says, not when loopback did
            pend.t_done = max(self.timeline.now(), pend.deadline or 0.0)
        if pend.works:
            pend.works[-1].get_future().add_done_callback(done)
        else:
            pend.t_done = t_issue
        pend.span = (f"{rnd.op} b{b.index}", t_issue, args)

    # -- after backward ---------------------------------------------------
    def _advance(self, b: Bucket) -> bool:
        """Wait for ``b``'s current round, then issue its next one or decode its result.
        Returns True while the bucket has rounds left."""
        tl = self.timeline
        t0 = tl.now()
        result = b.handle.wait()
        t1 = tl.now()
        name, t_issue, args = b.handle.span
        tl.span("comm", name, t_issue, b.handle.t_done or t1, args)
        tl.span("wait", f"wait b{b.index}", t0, t1, {"bucket": b.index})
        try:
            rnd = b.gen.send(result)
        except StopIteration as stop:
            out = stop.value
            if out is not b.flat and out.data_ptr() != b.flat.data_ptr():
                b.flat.copy_(out.reshape(-1))
            tl.span("decompress", f"decompress b{b.index}", t1, tl.now(), {"bucket": b.index})
            b.done = True
            return False
        tl.span("compress", f"compress b{b.index} r{b.rounds + 1}", t1, tl.now(), {"bucket": b.index})
        self._issue(b, rnd)
        return True

    def finish(self) -> None:
        """Complete every bucket's exchange and leave averaged gradients in p.grad."""
        for b in self.buckets:
            if not b.ready:  # parameters that got no gradient this step count as zero
                for pos, p in enumerate(b.params):
                    if not b.seen[pos]:
                        b.views[pos].zero_()
                b.ready = True
        self._launch_ready()
        active = [b for b in self.buckets if not b.done]
        while active:  # bucket order: every rank issues follow-up rounds identically
            active = [b for b in active if self._advance(b)]
        self.step_bytes = sum(getattr(b.compressor, "last_bytes", 0) for b in self.buckets)
        self.step_raw_bytes = sum(b.raw_bytes for b in self.buckets)
        if self.ready_order is None:  # the first step: the order gradients really arrived in
            seen = set(self._arrivals)
            self.ready_order = self._arrivals + [i for i in range(len(self.params)) if i not in seen]
        if self._rebind:  # only after something replaced p.grad: no per-parameter loop in the common step
            self._bind_views()
        for b in self.buckets:
            b.reset()
        self._next = 0
        self._multi = []

    def grads_finite(self) -> Tensor:
        """A 0-d bool tensor: every averaged gradient is finite. The buffers are identical on
        all ranks after ``finish``, so all ranks reach the same answer without a collective.
        It is a tensor so that the caller reads it at a sync point it has anyway (on GPU,
        reading it here would stall the stream every step)."""
        total = sum(b.flat.sum(dtype=torch.float32) for b in self.buckets)  # inf when it overflows: diverged too
        return torch.isfinite(torch.as_tensor(total))

    def zero_grad(self) -> None:
        """Zero gradients in place (one memset per bucket); p.grad stays a view."""
        for b in self.buckets:
            b.flat.zero_()

    def _bind_views(self) -> None:
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                p.grad = view
        self._rebind = False

    def layout(self) -> List[List[str]]:
        return [list(b.names) for b in self.buckets]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def time_exchange(dp: DataParallel, numel: int, dtype, device) -> tuple:
    """``(total, compute)`` seconds of one whole exchange of a bucket of ``numel`` elements with
    a fresh compressor, run synchronously: all of it, and the part spent in the compressor
    (compress and decode, on this thread). Collective: every rank calls it with the same
    arguments (LayerFusion's calibration)."""
    import time
    comp = dp.make_compressor()
    comp.bucket, comp.process_rank, comp.layout = 0, dp.rank, [(0, (numel,))]
    g = torch.Generator().manual_seed(numel)
    t = torch.randn(numel, generator=g).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if t.is_cuda else (lambda *_: None)
    dist.barrier(group=dp.group)
    t0 = time.perf_counter()
    gen = comp.exchange(t, dp.world)
    compute, reply = 0.0, None
    while True:
        c0 = time.perf_counter()
        try:
            rnd = next(gen) if reply is None else gen.send(reply)
        except StopIteration:
            sync(t.device)
            compute += time.perf_counter() - c0
            break
        sync(t.device)
        compute += time.perf_counter() - c0
        op = issue_allreduce if rnd.op == "allreduce" else issue_allgather
        reply = op(rnd.tensors, dp.group, dp.link).wait()
    return time.perf_counter() - t0, compute


def _offsets(shapes, esize) -> List[int]:
    """Byte offset of each tensor in the packed buffer (8-byte aligned), then the total."""
    out, off = [], 0
    for shape, e in zip(shapes, esize):
        out.append(off)
        off += -(-(_numel(shape) * e) // 8) * 8
    return out + [off]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
