"""Every collective the engine issues: the four a compressor's round may ask for (all-reduce, all-gather,
reduce-scatter, all-to-all; a payload's tensors packed into one byte buffer where they must be, at
``pack_offsets``), and dear's all-gathers of parameters. Each is booked on the modeled link and returned as
a ``Pending`` that the mode waits on when it needs the result."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from commlab.engine.comm import buffers
from commlab.engine.compressors.base import Round
from commlab.engine.netmodel import ModeledLink

Tensor = torch.Tensor

OPS = ("allreduce", "allgather", "reduce_scatter", "all_to_all")
"""The collectives a ``Round`` may ask for."""

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Group:
    """A process group the engine reaches through methods of its own instead of ``torch.distributed``'s functions:
    a fault-tolerant replica group (commlab/engine/ft.py), whose members, rank and size change from step to step and
    whose failed collectives are reported to torchft's Manager instead of raised. ``size``, ``rank`` and ``backend``
    are this step's; ``all_reduce`` starts a sum in place and ``all_gather`` a gather into a list, each returning a
    work handle (``wait()``, ``get_future()``); ``failed`` says whether a collective of this step has failed (its
    results then hold anything and the step is dropped). Reduce-scatter and all-to-all (dear's shards) are not
    offered: a round that needs one fails in one line (``_plain``)."""

    def size(self) -> int:
        raise NotImplementedError

    def rank(self) -> int:
        raise NotImplementedError

    def backend(self) -> str:
        raise NotImplementedError

    def all_reduce(self, t: Tensor):
        raise NotImplementedError

    def all_gather(self, outs: List[Tensor], t: Tensor):
        """Start gathering every member's ``t`` into ``outs`` (one tensor per member, in rank order)."""
        raise NotImplementedError

    def failed(self) -> bool:
        return False


def group_size(group) -> int:
    """The ranks of ``group`` (a ``Group``'s this step, else ``torch.distributed``'s; None: the world)."""
    return group.size() if isinstance(group, Group) else dist.get_world_size(group)


def group_rank(group) -> int:
    return group.rank() if isinstance(group, Group) else dist.get_rank(group)


def group_backend(group) -> str:
    return group.backend() if isinstance(group, Group) else dist.get_backend(group)


def _all_reduce(t: Tensor, group):
    """Start the sum of ``t`` over ``group`` in place; its work handle."""
    if isinstance(group, Group):
        return group.all_reduce(t)
    return dist.all_reduce(t, group=group, async_op=True)


def _all_gather_list(outs: List[Tensor], t: Tensor, group):
    """Start gathering every rank's ``t`` into ``outs`` (one per rank); its work handle."""
    if isinstance(group, Group):
        return group.all_gather(outs, t)
    return dist.all_gather(outs, t, group=group, async_op=True)


def _failed(group) -> bool:
    """Whether a collective of this step on ``group`` has failed (a ``Group``'s say; torch's raise instead)."""
    return isinstance(group, Group) and group.failed()


def _plain(group, op: str):
    """``group`` itself, for a collective that a ``Group`` does not offer: that is a one-line error."""
    if isinstance(group, Group):
        raise RuntimeError(f"{op} on a {type(group).__name__} is not supported (fault tolerance runs compressors "
                           "whose rounds are all-reduces and all-gathers)")
    return group


class Pending:
    """An issued collective: its work handles and how to read the result.

    With a modeled link, ``deadline`` is when the model says the collective completes (host
    clock); ``wait`` returns no earlier than that. ``t_done`` is stamped when it completes
    (``Communicator._track``); ``span`` is its timeline span (name, issue time, args). ``nbytes``: the
    bytes this rank put on the wire (what the modeled link booked)."""

    def __init__(self, works, finish: Callable[[], list], link: Optional[ModeledLink] = None,
                 deadline: Optional[float] = None, nbytes: int = 0):
        self.works = works
        self.finish = finish
        self.nbytes = nbytes
        self.t_done: Optional[float] = None
        self.link = link
        self.deadline = deadline
        self.span: Optional[tuple] = None
        self.header_span: Optional[tuple] = None
        """all-gather only: (start, end) of the synchronous header exchange, when a clock was given."""

    def wait(self):
        for w in self.works:
            w.wait()
        if self.link is not None and self.deadline is not None:
            self.link.hold_until(self.deadline)
        return self.finish()


P2P_CHUNK = 2 << 20
"""Bytes per message of a chunked exchange (``_exchange``)."""


def _chunked(t: Tensor, group) -> bool:
    """Whether an all-to-all or a two-rank all-gather of ``t`` goes as chunked point-to-point messages.

    On gloo (CPU tensors), one large message each way between the same two ranks goes one direction after the
    other: an all-to-all of 64 MiB between two ranks (32 MiB each way) took 547 ms on a shaped 1 Gbit/s link as one
    collective and 288 ms as 2 MiB messages posted together, near what one direction alone takes; 43 against 30 ms
    at 10 Gbit/s (bench/gloo_exchange.py, docs/benchmarks/gloo-exchange.md). gloo's all-reduce (a ring in
    pieces) does not have it."""
    return (t.device.type == "cpu" and t.numel() * t.element_size() > P2P_CHUNK
            and group_backend(group) == dist.Backend.GLOO)


def _exchange(sends: dict, recvs: dict, group) -> list:
    """Post, all at once, the send of ``sends[j]`` to rank j of ``group`` and the receive of ``recvs[j]`` from it
    (flat contiguous tensors), each cut into messages of at most ``P2P_CHUNK`` bytes; the works to wait on.
    Both ranks post their messages in the same order, and gloo matches a peer's messages in order."""
    works = []
    for j in sorted(set(sends) | set(recvs)):
        peer = j if group is None else dist.get_global_rank(group, j)
        s, r = sends.get(j), recvs.get(j)
        ref = s if s is not None else r
        step = max(1, P2P_CHUNK // ref.element_size())
        for k in range(0, ref.numel(), step):
            if s is not None:
                works.append(dist.isend(s[k:k + step], peer, group=group))
            if r is not None:
                works.append(dist.irecv(r[k:k + step], peer, group=group))
    return works


def _all_to_all_works(out: Tensor, send: Tensor, group) -> list:
    """``all_to_all_single(out, send)`` of flat tensors in equal chunks, chunked on gloo (``_chunked``)."""
    if not _chunked(send, group):
        return [dist.all_to_all_single(out, send, group=group, async_op=True)]
    world, me = dist.get_world_size(group), dist.get_rank(group)
    size = send.numel() // world
    part = lambda t, j: t[j * size:(j + 1) * size]  # noqa: E731
    part(out, me).copy_(part(send, me))
    others = [j for j in range(world) if j != me]
    return _exchange({j: part(send, j) for j in others}, {j: part(out, j) for j in others}, group)


def _pair_chunked(send: Tensor, group) -> bool:
    """Whether an all-gather of ``send`` goes as chunked messages: between two gloo ranks (``_chunked``; with more
    ranks gloo's ring sends and receives over different pairs of ranks)."""
    return not isinstance(group, Group) and dist.get_world_size(group) == 2 and _chunked(send, group)


def _gather_pair(recv: List[Tensor], send: Tensor, group) -> list:
    """``all_gather(recv, send)`` between two ranks, as ``_exchange``'s chunked messages."""
    me = dist.get_rank(group)
    recv[me].copy_(send)
    return _exchange({1 - me: send}, {1 - me: recv[1 - me]}, group)


def book(link: Optional[ModeledLink], op: str, nbytes: int, group) -> Optional[float]:
    """The modeled completion time of a collective issued now (None without a modeled link)."""
    if link is None:
        return None
    return link.issue(op, nbytes, group_size(group))


def issue_allreduce(tensors: List[Tensor], group=None, link: Optional[ModeledLink] = None) -> Pending:
    """Start an asynchronous sum of ``tensors`` over ranks (one collective when dtypes agree).
    With a modeled ``link``, waiting on it takes at least the link's ring all-reduce time."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    deadline = book(link, "allreduce", nbytes, group)
    if len(tensors) == 1:
        t = tensors[0]
        return Pending([_all_reduce(t, group)], lambda: [t], link, deadline, nbytes)
    if len({(t.dtype, t.device) for t in tensors}) == 1:
        # one collective for the whole payload: per-call latency dominates small tensors
        flat = torch.cat([t.reshape(-1) for t in tensors])
        work = _all_reduce(flat, group)

        def split():
            out, off = [], 0
            for t in tensors:
                out.append(flat[off:off + t.numel()].view_as(t))
                off += t.numel()
            return out
        return Pending([work], split, link, deadline, nbytes)
    works = [_all_reduce(t, group) for t in tensors]
    return Pending(works, lambda: list(tensors), link, deadline, nbytes)


def issue_allgather(tensors: List[Tensor], group=None, link: Optional[ModeledLink] = None,
                    now: Optional[Callable[[], float]] = None, alike: bool = False) -> Pending:
    """All-gather payloads whose sizes may differ between ranks.

    Every tensor is sent as raw bytes in one padded buffer, each at its
    ``pack_offsets`` offset (so it can be viewed back as its dtype). A small
    header (the shape of every tensor) is exchanged first, synchronously: it
    is a few bytes and keeps the data exchange a single asynchronous collective.
    ``alike`` (a steady payload, ``Round.alike``): every rank's tensors have this
    rank's shapes, and no header is exchanged.
    With a modeled ``link`` both exchanges take at least the link's ring
    all-gather time, the data one for the padded size every rank sends.

    On a ``Group`` whose step has failed (a peer lost in the header's or the data's exchange), every rank's payload
    reads as this rank's own: the results of a step that will not commit only need to decompress.
    """
    world = group_size(group)
    device = tensors[0].device if tensors else torch.device("cpu")
    header_span = None
    if alike:
        all_shapes = [[tuple(t.shape) for t in tensors]] * world
    else:
        all_shapes, header_span = _exchange_shapes(tensors, world, device, group, link, now)
    dtypes = [t.dtype for t in tensors]
    esize = [t.element_size() for t in tensors]
    packed = [pack_offsets([math.prod(s) * e for s, e in zip(shapes, esize)]) for shapes in all_shapes]
    offsets = [offs for offs, _ in packed]
    cap = max(max(total for _, total in packed), 1)
    send = buffers.take(cap, torch.uint8, device, zero=True)
    for t, off in zip(tensors, offsets[group_rank(group)]):
        n = t.numel() * t.element_size()
        if n:
            send[off:off + n] = t.contiguous().view(-1).view(torch.uint8)
    whole = buffers.take(world * cap, torch.uint8, device)  # the payloads returned are views of it
    recv = [whole[r * cap:(r + 1) * cap] for r in range(world)]
    deadline = book(link, "allgather", cap, group)
    works = (_gather_pair(recv, send, group) if _pair_chunked(send, group)
             else [_all_gather_list(recv, send, group)])

    def unpack():
        if _failed(group):
            return [list(tensors)] * world
        out = []
        for r in range(world):
            payload = []
            for shape, dt, e, off in zip(all_shapes[r], dtypes, esize, offsets[r]):
                n = math.prod(shape) * e
                payload.append(recv[r][off:off + n].view(dt).view(shape))
            out.append(payload)
        return out
    pend = Pending(works, unpack, link, deadline, cap)
    pend.header_span = header_span
    return pend


def _exchange_shapes(tensors: List[Tensor], world: int, device, group, link, now):
    """Every rank's payload shapes, exchanged synchronously (a header of 5 int64 per tensor: ndim and up to 4
    dims); with ``now``, the (start, end) of the exchange for its timeline span, else None."""
    header = torch.zeros(len(tensors), 5, dtype=torch.int64, device=device)
    for i, t in enumerate(tensors):
        if t.dim() > 4:
            raise ValueError("all-gathered payload tensors may have at most 4 dimensions")
        header[i, 0] = t.dim()
        header[i, 1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    headers = [torch.empty_like(header) for _ in range(world)]
    header_deadline = book(link, "allgather", header.numel() * header.element_size(), group)
    t_header = now() if now else None
    _all_gather_list(headers, header, group).wait()
    if _failed(group):
        headers = [header] * world
    if header_deadline is not None:
        link.hold_until(header_deadline)

    def shapes_of(h):
        h = h.tolist()
        return [tuple(row[1:1 + row[0]]) for row in h]
    return [shapes_of(h) for h in headers], ((t_header, now()) if now else None)


def issue_reduce_scatter(t: Tensor, group=None, link: Optional[ModeledLink] = None, via_alltoall: bool = False,
                         scratch: Optional[dict] = None) -> Pending:
    """Start the sum over ranks of the flat ``t`` (its numel a multiple of the world size), rank r keeping
    chunk r of it. ``via_alltoall`` (gloo, whose reduce-scatter is a clone plus a whole all-reduce: twice the
    bytes): an all-to-all of the chunks instead, summed when waited for. ``scratch``: a dict the caller keeps
    between calls, where the output buffer is kept."""
    group = _plain(group, "reduce-scatter")
    world = dist.get_world_size(group)
    nbytes = t.numel() * t.element_size()
    deadline = book(link, "reduce_scatter", nbytes, group)
    out = _kept(scratch, "reduce_scatter", t.numel() if via_alltoall else t.numel() // world, t.dtype, t.device)
    if via_alltoall:  # chunk j to rank j; the sum over ranks when the result is read
        works = _all_to_all_works(out, t.view(-1), group)

        def summed():
            if not out.is_floating_point():  # an integer sum widens to int64, as it always did
                return [out.view(world, -1).sum(0)]
            total = buffers.take(out.numel() // world, out.dtype, out.device)
            return [torch.sum(out.view(world, -1), 0, out=total)]
        return Pending(works, summed, link, deadline, nbytes)
    work = _reduce_scatter(out, t, group=group, async_op=True)
    return Pending([work], lambda: [out], link, deadline, nbytes)


def issue_all_to_all(parts: List[List[Tensor]], group=None, link: Optional[ModeledLink] = None,
                     scratch: Optional[dict] = None) -> Pending:
    """Send ``parts[j]`` (a payload: a list of tensors) to rank j, in one all-to-all of bytes: every
    destination's payload packed at ``pack_offsets`` into one send buffer (kept in ``scratch`` between
    calls; the alignment gaps stay zero). Every rank's payloads have the tensor sizes of this rank's
    ``parts[0]`` (the shard codec contract), which is how the received bytes are read back. The result:
    [the payload from rank 0, the payload from rank 1, ...], views of a receive buffer kept in ``scratch``."""
    group = _plain(group, "all-to-all")
    world = dist.get_world_size(group)
    like = parts[0]
    sizes = [x.numel() * x.element_size() for x in like]
    offs, size = pack_offsets(sizes)
    device = like[0].device if like else torch.device("cpu")
    send = _kept(scratch, "send", world * size, torch.uint8, device, zero=True)
    for j, payload in enumerate(parts):
        for x, off, n in zip(payload, offs, sizes):
            if n:
                send[j * size + off:j * size + off + n] = x.contiguous().view(-1).view(torch.uint8)
    recv = _kept(scratch, "recv", world * size, torch.uint8, device)
    deadline = book(link, "all_to_all", send.numel(), group)
    works = _all_to_all_works(recv, send, group)

    def unpack():
        return [[recv[j * size + off:j * size + off + n].view(x.dtype).view(x.shape)
                 for x, off, n in zip(like, offs, sizes)] for j in range(world)]
    return Pending(works, unpack, link, deadline, send.numel())


def issue_allgather_into(out: Tensor, shard: Tensor, group=None, link: Optional[ModeledLink] = None) -> Pending:
    """Start gathering every rank's ``shard`` into the flat ``out`` (rank r's at ``r * shard.numel()``):
    dear's all-gathers of parameters, in the next forward and at a relayout."""
    group = _plain(group, "all-gather")
    nbytes = shard.numel() * shard.element_size()
    deadline = book(link, "allgather", nbytes, group)
    works = (_gather_pair(list(out.view(2, -1)), shard.view(-1), group) if _pair_chunked(shard, group)
             else [_all_gather(out, shard, group=group, async_op=True)])
    return Pending(works, lambda: [out], link, deadline, nbytes)


def issue(rnd: Round, group=None, link: Optional[ModeledLink] = None, now: Optional[Callable[[], float]] = None,
          *, via_alltoall: bool = False, scratch: Optional[dict] = None) -> Pending:
    """Start the collective a compressor's round asks for. ``now``: a clock for the all-gather's header
    span; ``via_alltoall`` and ``scratch``: as ``issue_reduce_scatter`` (and ``issue_all_to_all``) take them."""
    if rnd.op == "allreduce":
        return issue_allreduce(rnd.tensors, group, link)
    if rnd.op == "allgather":
        return issue_allgather(rnd.tensors, group, link, now, alike=rnd.alike)
    if rnd.op == "reduce_scatter":
        (t,) = rnd.tensors
        return issue_reduce_scatter(t, group, link, via_alltoall, scratch)
    if rnd.op == "all_to_all":
        return issue_all_to_all(rnd.parts, group, link, scratch)
    raise ValueError(f"a compressor asked for an unknown collective {rnd.op!r}; allowed: {', '.join(OPS)}")


def pack_offsets(sizes: Sequence[int]) -> Tuple[List[int], int]:
    """The byte offset of each of ``sizes`` (bytes) packed one after the other into one buffer, each
    8-byte aligned (so it can be viewed back as its dtype), and the packed size."""
    out, off = [], 0
    for n in sizes:
        out.append(off)
        off += -(-n // 8) * 8
    return out, off


def _kept(scratch: Optional[dict], key: str, numel: int, dtype, device, zero: bool = False) -> Tensor:
    """``scratch[key]`` when it is a buffer of ``numel`` elements of ``dtype`` on ``device``, else a new one
    kept there (zeroed when ``zero``)."""
    buf = None if scratch is None else scratch.get(key)
    if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
        buf = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
        if scratch is not None:
            scratch[key] = buf
    return buf


