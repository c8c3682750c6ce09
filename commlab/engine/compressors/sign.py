"""Sign compressors: one bit per element, on the lossy base of ``commlab.engine.compressors.quantize``.

=========  =============================================  =============  ========================
name       payload, in order                              bytes          decodes to
=========  =============================================  =============  ========================
signsgd    sign bits                                      ceil(n/8)      vote in {-1, 0, 1}
efsignsgd  ||p||_1 / n fp32 (1,); sign bits               4 + ceil(n/8)  +-||p||_1 / n, averaged
signum     sign bits of the momentum                      ceil(n/8)      vote in {-1, 0, 1}
onebit     (neg mean, pos mean) fp32 (2,); bits           8 + ceil(n/8)  a mean per bit, averaged
=========  =============================================  =============  ========================

Sign bits are ``x >= 0`` (zeros count as positive), packed by
``commlab.engine.compressors.bitpack`` with element 0 in the top bit. The payloads are
all-gathered; signsgd and signum decode to the majority vote, the others to
the average of every rank's decoded payload. Large buckets keep an n-byte work
buffer (unpacked bits) per instance between steps.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

import torch

from commlab.engine.compressors import bitpack, fused, graphs
from commlab.engine.compressors.base import Round
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext
from commlab.engine.compressors.params import Param
from commlab.engine.compressors.quantize import _HALF, _ONE, _Ctx, _flat, _Lossy, _work_dtype

Tensor = torch.Tensor


class _Vote(_Lossy):
    """Majority vote over ranks' sign bits (Bernstein et al., ICLR 2019): sign of the sum of signs.

    The result is the vote itself, +-1 per element and 0 on a tie (possible
    with an even number of ranks), not divided by the world size: in signSGD
    the learning rate alone sets the step. GRACE returns +1 on a tie; 0 is
    torch.sign's answer and moves nothing when the ranks disagree evenly.
    """

    def decompress(self, payload: List[Tensor], ctx: _Ctx) -> Tensor:
        if fused.on(payload[0].device, ctx.dtype):  # one payload's vote is its own +-1
            return graphs.decode(self, self.vote, [payload[0]], ctx)
        return self._gather(self._table("pm", ctx.dtype, payload[0].device), payload[0], ctx)

    def exchange(self, t: Tensor, world_size: int, bucket: BucketContext = DEFAULT_BUCKET):
        payload, ctx = bucket.encode(self, t)  # compress, with error feedback when it is on
        gathered = yield Round("allgather", payload)
        packs = [p[0] for p in gathered]
        if fused.on(packs[0].device, ctx.dtype):  # the fused vote, replayed from a graph where one is wanted
            return graphs.decode(self, self.vote, packs, ctx)
        return self.vote(packs, ctx)

    @staticmethod
    def vote(packs: List[Tensor], ctx: _Ctx) -> Tensor:
        """sign(sum over ranks of +-1) from packed sign bits, as ctx.dtype with ctx.shape."""
        n, world = ctx.n, len(packs)
        if fused.on(packs[0].device, ctx.dtype):
            return fused.decode_bits(packs, n, fused.VOTE, (), ctx.dtype).view(ctx.shape)
        total = None
        for i in range(0, world, 255):  # a byte lane counts up to 255 ranks
            lanes = bitpack.bit_lanes(packs[i], n)
            for p in packs[i + 1:i + 255]:
                lanes += bitpack.bit_lanes(p, n)
            part = lanes.view(torch.uint8)[:n]
            total = part if total is None else total.to(torch.int32) + part
        out = total.to(ctx.dtype)  # positive votes c; the sum of signs is 2c - world
        out.sub_(world / 2).sign_()
        return out.view(ctx.shape)


class SignSGD(_Vote):
    """signSGD (Bernstein et al., ICML 2018) with majority vote (ICLR 2019).

    Payload: ``[sign bits (ceil(n/8),)]``, 1 bit per element (x >= 0 is +1),
    ceil(n/8) bytes. One payload decodes to +-1; the exchange returns the
    majority vote, +-1 and 0 on ties. The step is then the learning rate
    itself, so tune it as for signSGD, far below a plain SGD rate.
    """
    name = "signsgd"
    # on a GPU its compress is fused kernels on the input and its state, in place
    capabilities = replace(_Lossy.capabilities, graphable=True)

    def __init__(self, **given):
        super().__init__(**given)
        self._setup()

    def compress(self, t: Tensor):
        x = _flat(t)
        packed = fused.pack_signs(x) if fused.enabled(x) else self._pack_signs(x)
        return [packed], _Ctx(t.shape, t.dtype, x.numel())


class Signum(_Vote):
    """Signum (Bernstein et al., ICML 2018) with majority vote: signSGD on a momentum buffer.

    Each rank keeps ``m = momentum * m + (1 - momentum) * g`` per bucket and
    sends the signs of m; the exchange returns the majority vote (+-1, 0 on
    ties). Use a stock optimizer without momentum on top.

    Payload: ``[sign bits of m (ceil(n/8),)]``: ceil(n/8) bytes.
    State: the momentum buffer (``state_dict()["momentum"]``), zero at start.
    Every ``compress`` call advances it by one step.
    """
    name = "signum"
    # on a GPU its compress is fused kernels on the input and its state, in place; m is its momentum
    capabilities = replace(_Lossy.capabilities, graphable=True, builtin_momentum=True, elementwise=("m",))
    params = (Param("momentum", float, 0.9, "momentum of the buffer whose signs are sent", lo=0, hi=1, hi_open=True),)

    def __init__(self, **given):
        super().__init__(**given)
        self._setup()
        self.m: Optional[Tensor] = None
        """Momentum of this rank's gradient for the bucket, flat, in the gradient's dtype."""

    def compress(self, t: Tensor):
        x = _flat(t)
        self.m = _state_like(self.m, x, "momentum")
        if fused.enabled(x) and self.m.is_contiguous():
            return [fused.momentum_signs(x, self.m, self.momentum)], _Ctx(t.shape, t.dtype, x.numel())
        self.m.mul_(self.momentum).add_(x, alpha=1 - self.momentum)
        return [self._pack_signs(self.m)], _Ctx(t.shape, t.dtype, x.numel())

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.m is not None:
            out["momentum"] = self.m
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "momentum" in state:
            self.m = state["momentum"].detach().clone().reshape(-1)

    def __repr__(self) -> str:
        return f"Signum(momentum={self.momentum})"


def _state_like(buf: Optional[Tensor], x: Tensor, what: str) -> Tensor:
    """The per-bucket buffer, created as zeros, moved to x's dtype/device, checked against x's size."""
    if buf is None:
        return torch.zeros_like(x)
    if buf.numel() != x.numel():
        raise ValueError(f"{what}: the loaded buffer has {buf.numel()} elements, the bucket {x.numel()}")
    return buf if buf.dtype == x.dtype and buf.device == x.device else buf.to(x.device, x.dtype)


class EFSignSGD(_Lossy):
    """EF-signSGD (Karimireddy et al., ICML 2019): scaled sign with its own error feedback.

    Each rank compresses ``p = g + e`` to ``(||p||_1 / n) * sign(p)`` and keeps
    ``e = p - decoded`` for the next step. The residual is in gradient units
    (the paper folds the learning rate in; with a stock optimizer and a
    constant rate the two agree). Payloads are all-gathered, decoded per rank
    and averaged.

    Payload: ``[||p||_1 / n fp32 (1,), sign bits (ceil(n/8),)]``: 4 + ceil(n/8)
    bytes. Decodes to +-||p||_1 / n. State: the residual
    (``state_dict()["residual"]``), zero at start; every ``compress`` call is one step.
    """
    name = "efsignsgd"
    # on a GPU its compress is fused kernels on the input and its state, in place; the residual is its own
    capabilities = replace(_Lossy.capabilities, graphable=True, builtin_feedback=True, elementwise=("residual",))

    def __init__(self, **given):
        super().__init__(**given)
        self._setup()
        self.residual: Optional[Tensor] = None
        """What this rank's messages have dropped so far, added to the next gradient."""
        self._n = None  # (n, n as a 0-d tensor)

    def compress(self, t: Tensor):
        x = _flat(t)
        n = x.numel()
        e = self.residual = _state_like(self.residual, x, "residual")
        if fused.enabled(x) and e.is_contiguous():  # the same step, in three kernels
            return fused.ef_signs(x, e), _Ctx(t.shape, t.dtype, n)
        e.add_(x)  # e now holds p = g + e
        # keepdim: the (1,) the payload needs without a reshape; / n as a 0-d tensor, not a number
        scale = torch.linalg.vector_norm(e, 1, 0, True, dtype=_work_dtype(e.dtype)).div_(self._count(n)).float()
        payload = [scale, self._pack_signs(e)]
        ctx = _Ctx(e.shape, t.dtype, n)
        e.sub_(self.decompress(payload, ctx))  # e = p - decoded
        return payload, _Ctx(t.shape, t.dtype, n)

    def _count(self, n: int) -> Tensor:
        """n as a 0-d float64 tensor (divided by, it rounds to the dividend's dtype as the number would)."""
        c = self._n
        if c is None or c[0] != n:
            c = self._n = (n, torch.tensor(n, dtype=torch.float64))
        return c[1]

    def _decode_all(self, gathered, ctx):
        return fused.decode_bits([p[1] for p in gathered], ctx.n, fused.PM, [p[0] for p in gathered], ctx.dtype)

    def decompress(self, payload: List[Tensor], ctx: _Ctx) -> Tensor:
        out = self._decoded(payload, ctx)
        if out is not None:
            return out
        scale, packed = payload
        return self._gather(self._table("pm", ctx.dtype, packed.device) * scale.to(dtype=ctx.dtype), packed, ctx)

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.residual is not None:
            out["residual"] = self.residual
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "residual" in state:
            self.residual = state["residual"].detach().clone().reshape(-1)


class OneBit(_Lossy):
    """1-bit SGD (Seide et al., Interspeech 2014), per tensor, stateless.

    One bit per element (x >= 0) and two reconstruction values: the mean of
    the entries with the bit set and the mean of the others (0 for an empty
    group). The paper pairs it with error feedback; here that is the generic
    ``error_feedback: true`` wrapper, so this class keeps no state.

    Payload: ``[(neg mean, pos mean) fp32 (2,), bits (ceil(n/8),)]``:
    8 + ceil(n/8) bytes. Decodes to pos mean where the bit is set, else neg
    mean; ranks' decodes are averaged.
    """
    name = "onebit"
    # on a GPU its compress is fused kernels on the input and its state, in place
    capabilities = replace(_Lossy.capabilities, graphable=True)

    def __init__(self, **given):
        super().__init__(**given)
        self._setup()
        self._n = None  # (n, n as a 0-d int64 tensor)

    def compress(self, t: Tensor):
        x = _flat(t)
        n = x.numel()
        if fused.enabled(x):
            return fused.onebit(x), _Ctx(t.shape, t.dtype, n)
        packed = self._pack_signs(x)
        # the buffer _pack_signs filled; counting bytes is cheaper than summing bools
        npos = torch.count_nonzero(self._bufs["bits"])
        wd = _work_dtype(x.dtype)
        total = x.sum(dtype=wd)
        # sum over x >= 0 from |x|'s sum: no masked copy of x (zeros add nothing to either side)
        pos = torch.linalg.vector_norm(x, 1, dtype=wd).add_(total).mul_(_HALF)  # * 0.5 is / 2 exactly
        sums = torch.stack([total - pos, pos])
        nt = self._n
        if nt is None or nt[0] != n:
            nt = self._n = (n, torch.tensor(n))
        # an empty group's mean is 0 / 1 (a 0-d bound must be on the tensor's device: the number elsewhere)
        counts = torch.stack([nt[1] - npos, npos]).clamp_min_(_ONE if npos.is_cpu else 1)
        return [sums.div_(counts).float(), packed], _Ctx(t.shape, t.dtype, n)

    def _decode_all(self, gathered, ctx):
        return fused.decode_bits([p[1] for p in gathered], ctx.n, fused.LOHI, [p[0] for p in gathered], ctx.dtype)

    def decompress(self, payload: List[Tensor], ctx: _Ctx) -> Tensor:
        out = self._decoded(payload, ctx)
        if out is not None:
            return out
        means, packed = payload
        m0, m1 = means.to(dtype=ctx.dtype).unbind()
        tab = torch.addcmul(m0, self._table("01", ctx.dtype, packed.device), m1 - m0)
        return self._gather(tab, packed, ctx)
