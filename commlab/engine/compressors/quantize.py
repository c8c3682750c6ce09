"""Quantizers: casts and per-tensor scaled codes (the sign compressors, built on the same base, are in
``commlab.engine.compressors.sign``).

Casts (``fp16``, ``bf16``) keep one value per element and are summable, so they
are all-reduced. Everything else here sends a per-tensor scale next to a few
bits per element; scales differ between ranks, so those payloads are
all-gathered and every rank decodes every rank's payload:

=========  =============================================  =============  ========================
name       payload, in order                              bytes          decodes to
=========  =============================================  =============  ========================
fp16/bf16  the tensor cast to half / bfloat16             2n             the cast value
int8       scales fp32 (ceil(n/block),); codes int8 (n,)  n + 4n/block   scale * code (per block)
int4       scales fp32 (ceil(n/block),); 4-bit codes      n/2 + 4n/block scale * code (per block)
qsgd       norm fp32 (1,); codes int8 (n,)                4 + n          norm * code / levels
           (codes int16 when levels > 127)                4 + 2n
terngrad   max|x| fp32 (1,); 2-bit codes                  4 + ceil(n/4)  max|x| * {-1, 0, 1}
natural    offset int32 (1,); sign|exponent uint8 (n,)    4 + n          +-2^e or 0
=========  =============================================  =============  ========================

Scalars go first in every payload: the all-gather ships a payload as one byte
buffer and views each piece back at its offset, and a float can only be viewed
at an offset that is a multiple of its size.

Randomised compressors (qsgd, terngrad, natural) draw from their own
``torch.Generator`` on the tensor's device, seeded from the ``seed`` parameter,
the bucket index and the rank (the bucket's context, passed to ``compress``), so every rank's
rounding noise is independent of the others'. The generator's state is part
of ``state_dict``.

Large buckets reuse per-instance work buffers (random numbers, unpacked
bits): a fresh 100 MB tensor per step costs more in page faults than the
arithmetic on it. They stay allocated between steps: about 1x (qsgd, terngrad)
to 2x (natural) the bucket's float32 size. Payloads and decoded tensors are fresh,
except the casts' (``_Cast``), which reuse one of each per instance.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, NamedTuple, Optional

import torch

from commlab.engine.compressors import bitpack, fused, graphs
from commlab.engine.compressors.base import Compressor, Round
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext, Capabilities
from commlab.engine.compressors.params import Param, mix_seed, seed

Tensor = torch.Tensor


# -- shared plumbing ------------------------------------------------------
class _Ctx(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    n: int


def _flat(t: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    x = t if t.dim() == 1 else t.reshape(-1)
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


_ZERO = torch.tensor(0.0)
"""0 as a 0-d tensor: compared against, it costs ~1 µs less per call than the number 0 (no wrapping)."""
_HALF = torch.tensor(0.5)
_ONE = torch.tensor(1)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # stochastic rounding needs more resolution than half/bfloat16 offer
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Lossy(Compressor):
    """Common parts: all-gather exchange, work buffers, decode tables."""
    capabilities = Capabilities(summable=False, fixed_payload=True)  # codes and scales: sized by n alone

    def _setup(self) -> None:
        self._bufs = {}    # role -> reusable work tensor (not state: contents are dead between calls)
        self._signs = None  # (n, device, compare target, bool buffer, its int64 words) for _pack_signs
        self._tables = {}  # (role, dtype, device) -> small constant decode table

    def graph_safe(self, t: Tensor) -> bool:
        # the fused kernels only: the eager paths keep work buffers a graph would hold on to past their life
        # (replaced when the size changes), and the random ones draw from a torch.Generator
        return self.capabilities.graphable and fused.enabled(t)

    def _work(self, role: str, n: int, dtype: torch.dtype, device: torch.device, fill=None) -> Tensor:
        """A reused buffer; ``fill`` initialises it once, for padding the callers never overwrite."""
        b = self._bufs.get(role)
        if b is None or b.numel() != n or b.dtype != dtype or b.device != device:
            b = self._bufs[role] = torch.empty(n, dtype=dtype, device=device)
            if fill is not None:
                b.fill_(fill)
        return b

    def _table(self, kind: str, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Constant (256, 8) decode tables in ``dtype``: row y holds the 8 bits of byte y, first element first.

        kind "01" holds the bits as 0/1, kind "pm" as -1/+1.
        """
        key = (kind, dtype, device)
        tab = self._tables.get(key)
        if tab is None:
            y = torch.arange(256, device=device).to(torch.uint8)
            tab = bitpack.unpack_bits(y, 2048).view(256, 8).to(dtype)
            if kind == "pm":
                tab = tab * 2 - 1
            self._tables[key] = tab
        return tab

    def _pack_signs(self, x: Tensor) -> Tensor:
        """Pack ``x >= 0`` through a reused bool buffer padded to whole bytes (no padding copy)."""
        n = x.numel()
        sb = self._signs
        if sb is None or sb[0] != n or sb[1] != x.device:
            # the buffer, the slice compared into and its word view, made once per bucket size: at
            # small sizes each view or check costs as much as a whole torch op
            buf = self._work("bits", bitpack.packed_size(n) * 8, torch.bool, x.device, fill=False)
            words = buf.view(torch.uint8).view(torch.int64) if bitpack.WORDS else None
            sb = self._signs = (n, x.device, buf if buf.numel() == n else buf[:n], buf, words)
        torch.ge(x, _ZERO, out=sb[2])
        return bitpack.pack_words(sb[4]) if sb[4] is not None else bitpack.pack_bits(sb[3])

    @staticmethod
    def _gather(tab: Tensor, packed: Tensor, ctx: _Ctx) -> Tensor:
        """Decode packed bits through a (256, 8) table: one gather, ~3x faster than unpacking and blending
        on a CPU. On a GPU, index_select of table rows was 15-30x slower than memory allows (H100: 1.9 ms
        for 25M one-bit values): there the codes are unpacked and blended elementwise (``blend``)."""
        if not packed.is_cpu:
            return blend(tab, packed, ctx)
        out = tab.index_select(0, packed.int())
        if out.numel() != ctx.n:
            out = out.view(-1)[:ctx.n]
        return out.ravel() if len(ctx.shape) == 1 else out.view(ctx.shape)  # ravel: a third of view(shape)

    def exchange(self, t: Tensor, world_size: int, bucket: BucketContext = DEFAULT_BUCKET):
        # Compressor.exchange with one copy less: decompress here always returns a fresh tensor.
        payload, ctx = bucket.encode(self, t)  # compress, with error feedback when it is on
        gathered = yield Round("allgather", payload)
        out = graphs.decode(self, self._decode_all, gathered, ctx) if fused.on(payload[-1].device, ctx.dtype) else None
        if out is not None:  # every rank's payload decoded and averaged in one kernel
            return out if len(ctx.shape) == 1 else out.view(ctx.shape)
        out = self.decompress(gathered[0], ctx)
        for p in gathered[1:]:
            out.add_(self.decompress(p, ctx))
        return out.div_(world_size)

    def _decode_all(self, gathered: List[List[Tensor]], ctx: _Ctx) -> Optional[Tensor]:
        """The mean of every rank's decoded payload, flat, through a fused kernel; None where there is none."""
        return None

    def _decoded(self, payload: List[Tensor], ctx: _Ctx) -> Optional[Tensor]:
        """``decompress`` through the fused kernel, where there is one (float32 on CUDA), else None."""
        if not fused.on(payload[-1].device, ctx.dtype):
            return None
        out = graphs.decode(self, self._decode_all, [payload], ctx)
        return out if out is None or len(ctx.shape) == 1 else out.view(ctx.shape)


def blend(tab: Tensor, packed: Tensor, ctx: _Ctx) -> Tensor:
    """What ``_Lossy._gather`` decodes, without a gather: unpack the codes, then pick among the table's
    values elementwise. A (256, 8) table holds one bit per value (row 0 all zeros, row 255 all ones);
    a (256, 4) table two bits per value (rows 0, 85, 170, 255 hold codes 0, 1, 2, 3 throughout)."""
    n = ctx.n
    if tab.shape[1] == 8:
        out = torch.where(bitpack.unpack_bits(packed, n), tab[255, 0], tab[0, 0])
    else:
        c = bitpack.unpack_2bit(packed, n)
        v0, v1, v2, v3 = tab[0, 0], tab[85, 0], tab[170, 0], tab[255, 0]
        out = torch.where(c < 2, torch.where(c == 0, v0, v1), torch.where(c == 2, v2, v3))
    return out.view(ctx.shape)


class _Seeded(_Lossy):
    """A compressor that draws random numbers from a generator it owns, seeded from its ``seed`` parameter, the
    bucket's index and this process's rank (its ``compress`` takes the bucket's context)."""
    capabilities = replace(_Lossy.capabilities, takes_bucket=True)

    def _setup_rng(self) -> None:
        self._gen: Optional[torch.Generator] = None
        self._gen_state: Optional[Tensor] = None  # loaded before the device was known
        # the fused kernels' noise: (2,) int64 on the bucket's device, [base seed, calls so far], counted there
        self._fused_rng: Optional[Tensor] = None
        self._fused_loaded: Optional[List[int]] = None  # what was loaded before there was a device to put it on

    def _fused_stream(self, device: torch.device, bucket: BucketContext) -> Tensor:
        """The fused kernels' Philox state on ``device``: [base seed, calls so far], the base from the seed,
        bucket and rank as the generator's, the count advanced by each call's first kernel, in place (a CUDA
        graph of the call reads both and keeps counting). State, as the generator's state is."""
        r = self._fused_rng
        if r is None or r.device != device:
            start = (r.tolist() if r is not None else self._fused_loaded
                     or [mix_seed(self.seed, bucket.index, bucket.rank), 0])
            r = self._fused_rng = torch.tensor(start, dtype=torch.int64, device=device)
        return r

    def _generator(self, device: torch.device, bucket: BucketContext) -> torch.Generator:
        g = self._gen
        if g is None or g.device != device:
            g = torch.Generator(device=device)
            g.manual_seed(mix_seed(self.seed, bucket.index, bucket.rank))
            if self._gen_state is not None:
                g.set_state(self._gen_state)
                self._gen_state = None
            self._gen = g
        return g

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self._gen is not None:
            out["rng"] = self._gen.get_state()
        elif self._gen_state is not None:
            out["rng"] = self._gen_state
        if self._fused_rng is not None:
            out["fused_stream"] = self._fused_rng.cpu().clone()
        elif self._fused_loaded is not None:
            out["fused_stream"] = torch.tensor(self._fused_loaded, dtype=torch.int64)
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "fused_stream" in state:
            loaded = [int(v) for v in state["fused_stream"].tolist()]
            if self._fused_rng is None:
                self._fused_loaded = loaded
            else:  # in place: a CUDA graph of compress holds this tensor
                self._fused_rng.copy_(torch.tensor(loaded, dtype=torch.int64))
        rng = state.get("rng")
        if rng is None:
            return
        if self._gen is not None:
            self._gen.set_state(rng)
        else:
            self._gen_state = rng

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed})"


# -- casts ----------------------------------------------------------------
class _Cast(Compressor):
    """A cast to ``wire`` and back. The payload, and its decoding when ``decompress`` is given
    this instance's own latest payload, are per-instance buffers that the next ``compress``
    rewrites (copy them to keep them); any other payload decodes to a fresh tensor. A cast is
    one pass over memory, and a fresh 100 MB output's page faults cost five times the cast
    itself; at 1K elements a ``copy_`` into a kept buffer costs half of an allocating cast.
    Input already in the wire dtype is its own payload, and decoding a payload already in the
    input dtype returns it, as ``Tensor.to`` does."""
    capabilities = Capabilities(summable=True, keeps_shape=True, lossless=True)
    wire: torch.dtype = torch.float16

    def __init__(self, **given):
        super().__init__(**given)
        self._sent: Optional[Tensor] = None  # the payload buffer
        self._got: Optional[Tensor] = None  # the decoded buffer

    def compress(self, t: Tensor):
        dtype = t.dtype
        if not dtype.is_floating_point:  # integer and bool tensors pass through, as in horovod
            return [t], None
        if dtype == self.wire:
            return [t], dtype
        w = self._sent
        if w is None or w.shape != t.shape or w.device != t.device:
            w = self._sent = torch.empty(t.shape, dtype=self.wire, device=t.device)
        return [w.copy_(t)], dtype

    def decompress(self, payload: List[Tensor], ctx) -> Tensor:
        p = payload[0]
        if ctx is None or ctx == p.dtype:
            return p
        if p is not self._sent:  # someone else's payload (a sum, a slice, a received one): a fresh tensor
            return p.to(dtype=ctx)
        o = self._got
        if o is None or o.shape != p.shape or o.dtype != ctx or o.device != p.device:
            o = self._got = torch.empty(p.shape, dtype=ctx, device=p.device)
        return o.copy_(p)

    def exchange(self, t: Tensor, world_size: int, bucket: BucketContext = DEFAULT_BUCKET):
        # Compressor.exchange, decoding straight into the bucket: its values are in the payload now
        if not t.is_floating_point():
            return (yield from Compressor.exchange(self, t, world_size, bucket))
        payload, ctx = bucket.encode(self, t)  # compress, with error feedback when it is on
        h = payload[0]
        pre = self.capabilities.sum_overflows
        if pre:
            h = h / world_size if h is t else h.div_(world_size)  # never scale the caller's own tensor
        (s,) = yield Round("allreduce", [h])
        out = t.copy_(s) if s.dtype != t.dtype and t.is_contiguous() else self.decompress([s], ctx)
        return out if pre else out.div_(world_size)


class FP16(_Cast):
    """Cast to IEEE half precision (horovod's and DDP's fp16 compression). Payload: the half tensor, 2 bytes/element.

    Decodes to the cast value in the input dtype. Overflow: half saturates at
    65504, and gloo and NCCL sum in half, so a sum over ranks can overflow
    where no single rank did (``sum_overflows``). Like DDP's ``fp16_compress_hook``, ``exchange``
    (and dear's ``shard_exchange``) divides each rank's half payload by the world size before the sum,
    so the sum stays within the inputs' range; the price is that values below
    about 6e-8 * world_size flush to zero. Callers that reduce fp16 payloads
    themselves should pre-divide the same way.
    """
    name = "fp16"
    wire = torch.float16
    capabilities = replace(_Cast.capabilities, sum_overflows=True)


class BF16(_Cast):
    """Cast to bfloat16. Payload: the bfloat16 tensor, 2 bytes/element; decodes to the cast value.

    bfloat16 has float32's exponent range, so sums over ranks do not overflow
    and the default all-reduce-then-divide is kept; it has an 8-bit mantissa,
    so each partial sum of the reduction rounds to about 3 significant digits.
    """
    name = "bf16"
    wire = torch.bfloat16


# -- block-wise int8 -------------------------------------------------------
class Int8(_Lossy):
    """Block-wise int8 quantization, the codec of ZeRO++'s quantized gradients (Wang et al., 2023).

    The flat input is cut into blocks of ``block`` elements (the last one may be shorter); each
    block sends one fp32 scale, its largest magnitude / 127, and each element the int8 code
    ``round(x / scale)`` (nearest, deterministic). Payload: ``[scales fp32 (ceil(n/block),),
    codes int8 (n,)]``, n + 4 ceil(n/block) bytes (3.9x smaller than fp32 at the default block).
    Decodes to ``code * scale``: each element is off by at most half its block's scale, so a
    value far below its block's largest one is lost (error feedback keeps it).

    Scales differ between ranks, so in sync and wfbp the payloads are all-gathered. It is a
    ``shard_codec``: a slice quantizes on its own, with payload sizes fixed by its length, so in
    dear each rank quantizes its shards separately, exchanges them all-to-all and dequantizes and
    sums (fp32) only the shard it owns.

    block (default 256): elements per scale; smaller blocks follow local magnitudes more closely
    at 4 bytes per block.
    """
    name = "int8"
    capabilities = replace(_Lossy.capabilities, shard_codec=True)
    params = (Param("block", int, 256, "elements per quantization block (one fp32 scale each)", lo=1,
                    hi=1 << 24, note=" (a block this long spans a 64 MB bucket of fp32 with one scale)"),)

    def __init__(self, **given):
        super().__init__(**given)
        self._setup()

    def compress(self, t: Tensor):
        n = t.numel()
        scales, codes = _block_codes(self, t, 127)
        codes = codes.to(torch.int8).view(-1)
        return [scales.float(), codes[:n] if n % self.block else codes], _Ctx(t.shape, t.dtype, n)

    def declared_rounds(self, n, element_size, bucket=DEFAULT_BUCKET):
        """One all-gather of ceil(n / block) fp32 scales and n int8 codes, whatever the input's dtype."""
        return [("allgather", 4 * -(-n // self.block) + n, 2)]

    def decompress(self, payload: List[Tensor], ctx: _Ctx) -> Tensor:
        scales, codes = payload
        return _scaled_blocks(codes.to(dtype=ctx.dtype), scales, self.block, ctx)

    def __repr__(self) -> str:
        return f"Int8(block={self.block})"


def _block_codes(comp, t: Tensor, levels: int):
    """Block-wise symmetric quantization shared by int8 and int4: ``t`` flat in its work dtype, cut into blocks of
    ``comp.block`` (the tail padded with zeros in the compressor's kept ``pad`` buffer), each block's scale its
    largest magnitude / ``levels``; returns (scales, codes as rounded floats in [-levels, levels], shape
    (blocks, block)). An all-zero block codes to 0."""
    x = _flat(t, _work_dtype(t.dtype))
    n, B = x.numel(), comp.block
    nb = -(-n // B)
    if n % B:  # a padded copy: the tail block's padding stays zero
        w = comp._work("pad", nb * B, x.dtype, x.device, fill=0.0)
        w[:n].copy_(x)
        w[n:].zero_()
    else:
        w = x
    blocks = w.view(nb, B)
    scales = blocks.abs().amax(1).div_(float(levels))
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    return scales, (blocks * inv.unsqueeze(1)).round_().clamp_(-levels, levels)


def _scaled_blocks(out: Tensor, scales: Tensor, B: int, ctx: _Ctx) -> Tensor:
    """Decoded codes ``out`` (flat, ctx's dtype) times their block's scale, in place (the last block may be short),
    in ctx's shape: what int8's and int4's decompress share."""
    n = ctx.n
    full = n // B
    if full:
        out[:full * B].view(full, B).mul_(scales[:full].to(ctx.dtype).unsqueeze(1))
    if n > full * B:
        out[full * B:].mul_(scales[full].to(ctx.dtype))
    return out if len(ctx.shape) == 1 else out.view(ctx.shape)


# -- block-wise int4 -------------------------------------------------------
class Int4(_Lossy):
    """Block-wise 4-bit quantization, two codes per byte: the lab's codec for Streaming DiLoCo's low-bit
    outer updates (Douillard et al., 2025, send pseudo-gradients in 4 bits).

    As ``int8`` with 15 levels: the flat input is cut into blocks of ``block`` elements (the last one may be
    shorter); each block sends one fp32 scale, its largest magnitude / 7, and each element the code
    ``round(x / scale)`` in -7..7 (nearest, deterministic), stored as the nibble code + 8 and packed two per
    byte, the first element in the high nibble (commlab/engine/compressors/bitpack.py). Payload: ``[scales fp32
    (ceil(n/block),), nibbles uint8 (ceil(n/2),)]``: ceil(n/2) + 4 ceil(n/block) bytes, 7.5x smaller than fp32
    at the default block. Decodes to ``code * scale``: each element is off by at most half its block's scale
    (a fourteenth of its block's largest magnitude); error feedback keeps what is lost.

    The paper's 4 bits are a float (E3M0: a sign and a 3-bit exponent, powers of two); these are a uniform
    code with a scale per block, which spends its levels evenly up to the block's largest value instead of
    logarithmically.

    block (default 128): elements per scale.
    """
    name = "int4"
    params = (Param("block", int, 128, "elements per quantization block (one fp32 scale each)", lo=1,
                    hi=1 << 24, note=" (a block this long spans a 64 MB bucket of fp32 with one scale)"),)
    LEVELS = 7
    """Codes run from -LEVELS to LEVELS: 15 of the 16 nibbles (the nibble 0 is never sent)."""

    def __init__(self, **given):
        super().__init__(**given)
        self._setup()

    def compress(self, t: Tensor):
        n = t.numel()
        scales, codes = _block_codes(self, t, self.LEVELS)
        codes = codes.add_(8).to(torch.uint8).view(-1)[:n]
        return [scales.float(), bitpack.pack_4bit(codes)], _Ctx(t.shape, t.dtype, n)

    def declared_rounds(self, n, element_size, bucket=DEFAULT_BUCKET):
        """One all-gather of ceil(n / block) fp32 scales and ceil(n / 2) bytes of codes, whatever the dtype."""
        return [("allgather", 4 * -(-n // self.block) + bitpack.packed_size(n, 2), 2)]

    def decompress(self, payload: List[Tensor], ctx: _Ctx) -> Tensor:
        scales, packed = payload
        return _scaled_blocks(bitpack.unpack_4bit(packed, ctx.n).to(dtype=ctx.dtype).sub_(8), scales, self.block, ctx)

    def __repr__(self) -> str:
        return f"Int4(block={self.block})"


# -- stochastic quantizers ------------------------------------------------
class QSGD(_Seeded):
    """QSGD (Alistarh et al., NeurIPS 2017), one bucket per tensor, 2-norm scaling.

    Each element is scaled to ``v = x / ||x||_2 * levels`` (so |v| <= levels)
    and rounded stochastically to one of its two neighbouring integers,
    ``floor(v + U[0,1))``, which is unbiased and for negative v the same
    distribution as the paper's ``sign(x) * round(|v|)``.

    Payload: ``[norm fp32 (1,), codes (n,)]`` with codes int8 when
    ``levels <= 127``, else int16: 4 + n or 4 + 2n bytes. Decodes to
    ``norm * code / levels``.

    levels (default 127): quantisation levels per sign. 127 is the most an
    int8 code holds, so fewer levels would not save bytes here, only add
    variance (GRACE's helper defaults to 256, which needs int16). The variance
    bound is min(n / levels^2, sqrt(n) / levels) * ||x||^2.
    seed (default 0): seeds this bucket's generator together with the bucket index.
    """
    name = "qsgd"
    capabilities = replace(_Seeded.capabilities, graphable=True)  # where its fused kernels run (graph_safe)
    params = (Param("levels", int, 127, "quantisation levels per sign (int8 codes up to 127)", lo=1, hi=32767,
                    note=" (codes are int16)"),
              seed("seeds this bucket's rounding noise, with the bucket index and rank"))

    def __init__(self, **given):
        super().__init__(**given)
        self._setup()
        self._setup_rng()
        self.code_dtype = torch.int8 if self.levels <= 127 else torch.int16
        self._min_norm = torch.finfo(torch.float32).tiny * self.levels

    def compress(self, t: Tensor, bucket: BucketContext = DEFAULT_BUCKET):
        x = _flat(t, _work_dtype(t.dtype))
        if fused.enabled(x):
            payload = fused.qsgd_codes(x, self._fused_stream(x.device, bucket), self.levels, self._min_norm,
                                       self.code_dtype)
            return payload, _Ctx(t.shape, t.dtype, x.numel())
        g = self._generator(x.device, bucket)
        # The norm sent is a hair larger than the true one (2^-20), so |x| / norm * levels stays
        # below levels after float rounding and the code never leaves [-levels, levels]; it is
        # clamped away from zero so that norm / levels stays a normal float. Both sides derive
        # the step from the norm as sent, so decoding is still unbiased.
        norm = torch.linalg.vector_norm(x).float().mul_(1 + 2 ** -20).clamp_(min=self._min_norm).reshape(1)
        step = norm.to(dtype=x.dtype) / self.levels
        v = self._work("u", x.numel(), x.dtype, x.device).uniform_(generator=g)
        v.addcdiv_(x, step).floor_()
        return [norm, v.to(dtype=self.code_dtype)], _Ctx(t.shape, t.dtype, x.numel())

    def _decode_all(self, gathered, ctx):
        return fused.qsgd_decode_all([p[0] for p in gathered], [p[1] for p in gathered], ctx.n, self.levels,
                                     ctx.dtype)

    def decompress(self, payload: List[Tensor], ctx: _Ctx) -> Tensor:
        out = self._decoded(payload, ctx)
        if out is not None:
            return out
        norm, codes = payload
        out = codes.to(dtype=ctx.dtype)  # cast, then scale in place: a mixed int*float multiply is 2x slower
        out.mul_(norm.to(dtype=ctx.dtype) / self.levels)
        return out if len(ctx.shape) == 1 else out.view(ctx.shape)

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, seed={self.seed})"


class TernGrad(_Seeded):
    """TernGrad (Wen et al., NeurIPS 2017), per-tensor scale, without the paper's optional clipping.

    With ``s = max|x|``, each element becomes ``s * sign(x) * b`` where
    ``b ~ Bernoulli(|x| / s)``: unbiased. It is drawn as ``floor(x/s + U[1,2))``,
    which lands on {0, 1, 2} = ternary value + 1, the 2-bit code.

    Payload: ``[s fp32 (1,), codes packed 4 per byte (ceil(n/4),)]``:
    4 + ceil(n/4) bytes. Decodes to ``s * {-1, 0, +1}`` (code 3, which only
    float rounding at |x| = s can produce, also decodes to +s).

    seed (default 0): seeds this bucket's generator together with the bucket index.
    """
    name = "terngrad"
    capabilities = replace(_Seeded.capabilities, graphable=True)  # where its fused kernels run (graph_safe)
    params = (seed("seeds this bucket's rounding noise, with the bucket index and rank"),)

    def __init__(self, **given):
        super().__init__(**given)
        self._setup()
        self._setup_rng()

    def compress(self, t: Tensor, bucket: BucketContext = DEFAULT_BUCKET):
        x = _flat(t, _work_dtype(t.dtype))
        n = x.numel()
        if fused.enabled(x):
            return fused.tern_codes(x, self._fused_stream(x.device, bucket), _TINY32), _Ctx(t.shape, t.dtype, n)
        g = self._generator(x.device, bucket)
        lo, hi = torch.aminmax(x) if n else (x.new_zeros(()), x.new_zeros(()))  # an empty bucket: no extremes
        # kept a normal float, so that an all-zero tensor divides cleanly (and codes 1 = zero)
        s = torch.maximum(hi, -lo).float().clamp_min_(_TINY32_T if x.is_cpu else _TINY32).reshape(1)
        v = self._work("u", n, x.dtype, x.device).uniform_(1, 2, generator=g)
        v.addcdiv_(x, s.to(dtype=x.dtype))  # divide by the scale as sent, so decoding matches
        codes = self._work("codes", bitpack.packed_size(n, 4) * 4, torch.uint8, x.device, fill=1)
        codes[:n].copy_(v)  # float -> uint8 truncates, which is floor here: v >= 0
        return [s, bitpack.pack_2bit(codes)], _Ctx(t.shape, t.dtype, n)

    def _decode_all(self, gathered, ctx):
        return fused.tern_decode_all([p[0] for p in gathered], [p[1] for p in gathered], ctx.n, ctx.dtype)

    def decompress(self, payload: List[Tensor], ctx: _Ctx) -> Tensor:
        out = self._decoded(payload, ctx)
        if out is not None:
            return out
        s, packed = payload
        tab = self._tables.get(("tern", ctx.dtype, packed.device))
        if tab is None:  # row y: the four ternary values in byte y
            y = torch.arange(256, device=packed.device).to(torch.uint8)
            vals = bitpack.unpack_2bit(y, 1024).view(256, 4).clamp(max=2).to(ctx.dtype) - 1
            tab = self._tables[("tern", ctx.dtype, packed.device)] = vals
        return self._gather(tab * s.to(dtype=ctx.dtype), packed, ctx)


_TINY32 = torch.finfo(torch.float32).tiny
_KEEP = 1 << 16
"""From this many elements, work tensors that nothing returned points into are kept between calls."""
_TINY32_T = torch.tensor(_TINY32)

# IEEE layouts natural compression works in: (same-size int, mantissa bits, exponent bits)
_IEEE = {torch.float32: (torch.int32, 23, 8), torch.float64: (torch.int64, 52, 11)}


_CONSTS = {}


def _int_consts(mb: int, eb: int):
    """((1 << mb) - 1, mb, eb, 128, (1 << eb) - 1, 0) as 0-d int64 tensors, made once per format.
    Combined with an int32 tensor they act as the same Python ints would (no type promotion)."""
    k = _CONSTS.get((mb, eb))
    if k is None:
        k = _CONSTS[(mb, eb)] = tuple(torch.tensor(v) for v in ((1 << mb) - 1, mb, eb, 128, (1 << eb) - 1, 0))
    return k


class Natural(_Seeded):
    """Natural compression (Horváth et al., 2019): round |x| to a neighbouring power of two, unbiased.

    |x| = 2^e (1 + m) with m in [0, 1) rounds up to 2^(e+1) with probability m,
    else down to 2^e. This is done on the float's bits: adding a uniform
    random integer below the mantissa's unit carries into the exponent field
    with exactly that probability (subnormals round to 0 or the smallest
    normal the same way). float32 and smaller work in float32, float64 in float64.

    Payload: ``[offset int32 (1,), codes uint8 (n,)]``: 4 + n bytes. A code is
    ``sign << 7 | k``: k = 0 is zero (zeros are kept) and k in 1..127 is the
    exponent field ``offset + k`` of the float format worked in. The offset
    is 0 whenever max|x| < 1, so for float32 gradients the code holds the
    exponent field itself. Larger values shift it so the largest fits (float64
    always does); magnitudes below 2^(E - 125), where 2^E <= max|x| < 2^(E+1),
    then round between 0 and 2^(E - 125), still unbiased. Decodes to +-2^e or
    0. (A float32 max|x| >= 2^127 may round up to inf.) Reading the offset
    is a host sync per call in the eager path; float32 buckets on a GPU take fused kernels that find it there
    (commlab/engine/compressors/fused.py).

    seed (default 0): seeds this bucket's generator together with the bucket index.
    """
    name = "natural"
    params = (seed("seeds this bucket's rounding noise, with the bucket index and rank"),)
    # where its fused kernels run (graph_safe): they find the offset on the GPU
    capabilities = replace(_Seeded.capabilities, graphable=True)

    def __init__(self, **given):
        super().__init__(**given)
        self._setup()
        self._setup_rng()

    def _random_bits(self, n: int, itype: torch.dtype, g: torch.Generator, device) -> Tensor:
        # one int64 draw carries 63 random bits: enough for two float32 mantissas
        words = n if itype == torch.int64 else -(-n // 2)
        w = self._work("rand", words, torch.int64, device).random_(generator=g)
        return w if itype == torch.int64 else w.view(torch.int32)[:n]

    def compress(self, t: Tensor, bucket: BucketContext = DEFAULT_BUCKET):
        x = _flat(t, _work_dtype(t.dtype))
        n = x.numel()
        if fused.enabled(x):
            return fused.natural_codes(x, self._fused_stream(x.device, bucket)), _Ctx(t.shape, t.dtype, n)
        itype, mb, eb = _IEEE[x.dtype]
        g = self._generator(x.device, bucket)
        xi = x.view(itype)
        lo, hi = torch.aminmax(x) if n else (x.new_zeros(()), x.new_zeros(()))  # an empty bucket: no extremes
        top = int(torch.maximum(hi, -lo).view(itype)) >> mb  # exponent field of max|x|
        offset = max(top + 1 - 127, 0)  # the largest rounded field is top + 1; k must stay <= 127
        small = self._find_small(xi, offset, mb, eb) if offset else None

        r = self._random_bits(n, itype, g, x.device)
        k = _int_consts(mb, eb)  # the numbers below as 0-d tensors: ~1 µs less per operation
        r &= k[0]  # (1 << mb) - 1
        r += xi  # the carry into the exponent field is the stochastic round up
        if eb != 8:  # float64: an 11-bit field, worked on in int64
            return self._codes_wide(x, r, offset, small, g, k, mb), _Ctx(t.shape, t.dtype, n)
        neg = torch.lt(r, k[5], out=self._work("neg", n, torch.bool, x.device))  # the sign bit, kept as 0/1 bytes
        r >>= k[1]  # mb; sign-extended, so the low byte is the rounded exponent field for either sign
        codes = r.byte()  # the rest works on bytes, a quarter of the memory traffic
        if offset:
            codes.clamp_(min=offset).sub_(offset)  # field - offset, at least 0, without wrapping around
            if small is not None:
                # 0 < |x| < v1, the smallest codable value: code 0 or 1 with P(1) = |x| / v1
                v1 = torch.tensor((offset + 1) << mb, dtype=itype, device=x.device).view(x.dtype)
                p = x[small].abs() / v1
                u = torch.rand(small.numel(), generator=g, dtype=x.dtype, device=x.device)
                codes[small] = (u < p).byte()
        codes.add_(neg.view(torch.uint8), alpha=128)  # sign << 7 | k: k <= 127, so + is |
        return [torch.tensor([offset], dtype=torch.int32, device=x.device), codes], _Ctx(t.shape, t.dtype, n)

    def _codes_wide(self, x: Tensor, r: Tensor, offset: int, small: Optional[Tensor], g, k, mb: int) -> list:
        """The payload for a format whose exponent field does not fit a byte, from r = random bits + x's bits."""
        itype = r.dtype
        r >>= k[1]  # mb; sign-extended: the rounded field, minus 2^eb for negative x
        sign = torch.bitwise_right_shift(r, k[2], out=self._work("sign", r.numel(), itype, x.device))  # eb
        sign &= k[3]  # 128: -1 (negative) or 0 -> the code's top bit
        r &= k[4]  # (1 << eb) - 1
        if offset:
            r -= offset
            r.clamp_(min=0)
            if small is not None:
                # 0 < |x| < v1, the smallest codable value: code 0 or 1 with P(1) = |x| / v1
                v1 = torch.tensor((offset + 1) << mb, dtype=itype, device=x.device).view(x.dtype)
                p = x[small].abs() / v1
                u = torch.rand(small.numel(), generator=g, dtype=x.dtype, device=x.device)
                r[small] = (u < p).to(itype)
        r |= sign
        return [torch.tensor([offset], dtype=torch.int32, device=x.device), r.byte()]

    def _find_small(self, xi: Tensor, offset: int, mb: int, eb: int) -> Optional[Tensor]:
        """Indices of the x with 0 < |x| < v1 = 2^(offset + 1 - bias), or None if there are none."""
        lim = (offset + 1) << mb  # v1 as bits
        mask = (1 << (mb + eb)) - 1
        a = torch.bitwise_and(xi, mask, out=self._work("sign", xi.numel(), xi.dtype, xi.device))
        a -= 1
        a &= mask  # |x| bits - 1, with zeros wrapped to the top: one min finds the smallest nonzero
        if int(a.min()) >= lim - 1:
            return None
        return (a < lim - 1).nonzero().squeeze(1)

    def _decode_all(self, gathered, ctx):
        return fused.natural_decode_all([p[0] for p in gathered], [p[1] for p in gathered], ctx.n, ctx.dtype)

    def decompress(self, payload: List[Tensor], ctx: _Ctx) -> Tensor:
        out = self._decoded(payload, ctx)
        if out is not None:
            return out
        offset, codes = payload
        n = codes.numel()
        # the int32 indices go to a kept buffer when large (nothing returned points into it)
        idx = codes.int() if n < _KEEP else self._work("idx", n, torch.int32, codes.device).copy_(codes)
        out = self._values(int(offset), ctx.dtype, codes.device).index_select(0, idx)
        return out if len(ctx.shape) == 1 else out.view(ctx.shape)

    def _values(self, offset: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The 256 code values for one offset, cached: the offset rarely changes between steps."""
        key = ("nat", offset, dtype, device)
        tab = self._tables.get(key)
        if tab is None:
            wdt = _work_dtype(dtype)
            itype, mb, eb = _IEEE[wdt]
            k = torch.arange(256, dtype=itype, device=device)
            mag = k & 127
            bits = (mag + offset) << mb
            bits = torch.where(k >= 128, bits | -(1 << (mb + eb)), bits)  # the sign bit, as a signed int
            tab = torch.where(mag > 0, bits, torch.zeros_like(bits)).view(wdt).to(dtype)
            self._tables = {kk: v for kk, v in self._tables.items() if kk[0] != "nat"}  # keep one
            self._tables[key] = tab
        return tab
