"""Every collective the engine issues: all-reduce and all-gather of a round's payload (a payload's tensors
packed into one buffer where they must be), each booked on the modeled link and returned as a ``Pending``
that the mode waits on when it needs the result."""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from engine.compressors.base import Round
from engine.netmodel import ModeledLink

Tensor = torch.Tensor


class Pending:
    """An issued collective: its work handles and how to read the result.

    With a modeled link, ``deadline`` is when the model says the collective completes (host
    clock); ``wait`` returns no earlier than that. ``t_done`` is stamped when it completes
    (``Communicator._track``); ``span`` is its timeline span (name, issue time, args)."""

    def __init__(self, works, finish: Callable[[], list], link: Optional[ModeledLink] = None,
                 deadline: Optional[float] = None):
        self.works = works
        self.finish = finish
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


def book(link: Optional[ModeledLink], op: str, nbytes: int, group) -> Optional[float]:
    """The modeled completion time of a collective issued now (None without a modeled link)."""
    if link is None:
        return None
    return link.issue(op, nbytes, dist.get_world_size(group))


def issue_allreduce(tensors: List[Tensor], group=None, link: Optional[ModeledLink] = None) -> Pending:
    """Start an asynchronous sum of ``tensors`` over ranks (one collective when dtypes agree).
    With a modeled ``link``, waiting on it takes at least the link's ring all-reduce time."""
    deadline = book(link, "allreduce", sum(t.numel() * t.element_size() for t in tensors), group)
    if len(tensors) == 1:
        t = tensors[0]
        return Pending([dist.all_reduce(t, group=group, async_op=True)], lambda: [t], link, deadline)
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
        return Pending([work], split, link, deadline)
    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    return Pending(works, lambda: list(tensors), link, deadline)


def issue_allgather(tensors: List[Tensor], group=None, link: Optional[ModeledLink] = None,
                    now: Optional[Callable[[], float]] = None) -> Pending:
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
    header_deadline = book(link, "allgather", header.numel() * header.element_size(), group)
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
    deadline = book(link, "allgather", cap, group)
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
    pend = Pending([work], unpack, link, deadline)
    pend.header_span = header_span
    return pend


def issue(rnd: Round, group=None, link: Optional[ModeledLink] = None,
          now: Optional[Callable[[], float]] = None) -> Pending:
    """Start the collective a compressor's round asks for."""
    if rnd.op == "allreduce":
        return issue_allreduce(rnd.tensors, group, link)
    if rnd.op == "allgather":
        return issue_allgather(rnd.tensors, group, link, now)
    raise ValueError(f"a compressor asked for an unknown collective {rnd.op!r}; allowed: allreduce, allgather")


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
