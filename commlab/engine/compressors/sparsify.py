"""Sparsifiers: top-k, chunked top-k with 2-bit values, random-k, threshold, DGC.

A sparse payload is a pair (values in the input dtype, indices). Indices are
int32 whenever the bucket has fewer than 2**31 elements: half of GRACE's
int64 cost, so top-k at ratio r sends r * n * (element_size + 4) bytes.
Sparse payloads differ in their indices from rank to rank, so they are not
summable: they are all-gathered, and every rank adds every rank's values into
one dense buffer (``index_add_``, no per-rank dense tensors).

Payload order: the tensor with the wider elements comes first (values then
int32 indices for fp32/fp64, indices first for fp16/bf16), so that the
communicator's byte packing keeps each tensor aligned for ``view(dtype)``.

Exchanges write the average into the bucket ``t`` itself when ``t`` is
contiguous (the base contract allows returning ``t``; the identity
compressor's in-place all-reduce does the same). That avoids a fresh dense
allocation per step, which dominates at tens of millions of elements.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from commlab.engine.compressors import bitpack
from commlab.engine.compressors.base import Compressor, Round
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext, Capabilities
from commlab.engine.compressors.kernels import Scratch, count_of, out_buffer, top_indices
from commlab.engine.compressors.params import Param, mix_seed, ratio, seed

Tensor = torch.Tensor


# -- sparse payloads ---------------------------------------------------------


class SparseCtx(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    numel: int
    values_first: bool


class SparseCompressor(Compressor):
    """Shared encode/decode for (values, indices) payloads; subclasses pick the indices.

    From ``Scratch.MIN`` elements up, ``decompress`` of this instance's own latest payload
    returns a dense buffer the instance reuses (zeroing a kept 100 MB buffer costs a tenth of a
    fresh one's page faults), rewritten by the next such call; copy it to keep it. Other
    payloads decode to fresh tensors."""
    capabilities = Capabilities(summable=False)

    def __init__(self, **given):
        super().__init__(**given)
        self._scratch = Scratch()
        self._dense = Scratch()  # large decodes of this instance's own payload
        self._sent: Optional[Tensor] = None  # the indices of the latest payload
        # local sampling only (threshold estimates); ranks need not agree on it
        self._gen = torch.Generator().manual_seed(0)

    def select(self, flat: Tensor) -> Tuple[Tensor, Tensor]:
        """(values, int64 indices) to send for the flat bucket."""
        raise NotImplementedError

    def compress(self, t: Tensor) -> tuple[List[Tensor], Any]:
        flat = t if t.dim() == 1 else t.reshape(-1)  # a reshape costs as much as a small op
        n = flat.numel()
        values, idx = self.select(flat)
        idx = idx.int() if n < 2 ** 31 else idx  # int32 indices below 2**31 elements
        self._sent = idx
        if values.element_size() >= idx.element_size():  # the wider elements first, for alignment
            return [values, idx], SparseCtx(t.shape, t.dtype, t.device, n, True)
        return [idx, values], SparseCtx(t.shape, t.dtype, t.device, n, False)

    @staticmethod
    def _pair(payload: List[Tensor], ctx: SparseCtx) -> Tuple[Tensor, Tensor]:
        return (payload[0], payload[1]) if ctx.values_first else (payload[1], payload[0])

    def decompress(self, payload: List[Tensor], ctx: SparseCtx) -> Tensor:
        values, idx = (payload[0], payload[1]) if ctx.values_first else (payload[1], payload[0])
        if ctx.numel < Scratch.MIN or idx is not self._sent:
            out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=ctx.device)
        else:
            out = self._dense.get(ctx.numel, ctx.dtype, ctx.device).zero_()
        out.index_add_(0, idx, values)
        return out if len(ctx.shape) == 1 else out.view(ctx.shape)

    def exchange(self, t: Tensor, world_size: int, bucket: BucketContext = DEFAULT_BUCKET):
        payload, ctx = bucket.encode(self, t)
        gathered = yield Round("allgather", payload)
        out = out_buffer(t).zero_()  # t's values are no longer needed: the payload holds copies
        for p in gathered:
            values, idx = self._pair(p, ctx)
            out.index_add_(0, idx, values, alpha=1.0 / world_size)
        return out.view(t.shape)


# -- top-k -------------------------------------------------------------------


class TopK(SparseCompressor):
    """Top-k sparsification (Aji & Heafield 2017; Stich et al. 2018, "Sparsified SGD with memory").

    Steps:
      1. k = max(1, ceil(ratio * n)) for the flat bucket of n elements.
      2. Keep exactly the k entries of largest magnitude (ties broken arbitrarily).
         Large buckets pre-filter with a sampled threshold (see ``top_indices``),
         which returns the same set as a full topk, about 7x faster at 25M.
      3. Every rank decodes all ranks' (values, indices) into one dense average.

    Payload: values [k] in the input dtype and indices [k] int32 (int64 from
    2**31 elements): k * (element_size + 4) bytes. Not summable (all-gathered).

    Tuning: ratio 0.01 to 0.001 is the usual range. Without error feedback most
    of the gradient is lost for good, so turn ``error_feedback`` on below ~0.1.
    All-gather traffic grows with the world size (each rank receives
    (world - 1) payloads), so at large worlds a summable method can win.
    """
    name = "topk"
    capabilities = replace(SparseCompressor.capabilities, fixed_payload=True)  # k values and k indices
    params = (ratio(0.01, "fraction of the bucket's entries sent, k = ceil(ratio * n)"),)

    def __init__(self, **given):
        super().__init__(**given)
        self._k = (0, 0)  # (n, k): computing k through Fraction costs a few µs

    def k_for(self, n: int) -> int:
        if self._k[0] != n:
            self._k = (n, count_of(self.ratio, n))
        return self._k[1]

    def declared_rounds(self, n, element_size, bucket=DEFAULT_BUCKET):
        """One all-gather of k values and k indices (int32 below 2**31 elements, as ``compress`` sends)."""
        return [("allgather", self.k_for(n) * (element_size + (4 if n < 2 ** 31 else 8)), 2)]

    def select(self, flat):
        idx = top_indices(self._scratch.abs(flat), self.k_for(flat.numel()), self._gen)
        return flat.index_select(0, idx), idx  # index_select: a third of advanced indexing's fixed cost

    def __repr__(self):
        return f"TopK(ratio={self.ratio:g})"


# -- chunked top-k with 2-bit values -------------------------------------------


class ChunkCtx(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    n: int


class TopK2Bit(Compressor):
    """Chunked top-k whose kept values travel in 2 bits: SparseLoCo's codec for pseudo-gradients (Sarfi et al.,
    2025, "Communication Efficient LLM Pre-training with SparseLoCo").

    Steps, on the flat bucket of n elements:
      1. Cut it into chunks of ``chunk`` elements (the last may be shorter). Each full chunk keeps its ``k``
         entries of largest magnitude; a last chunk of r elements keeps ceil(k * r / chunk), at least 1, so
         every chunk sends the same share, k / chunk.
      2. Each chunk's scale s is the largest magnitude it keeps; each kept value v is sent as the nearest of
         the four levels (-s, -s/3, s/3, s): the 2-bit code round(1.5 v / s + 1.5), packed four per byte.
      3. Positions travel as int16 offsets within their chunk.
      4. Every rank decodes every rank's payload into one dense average (all-gathered: positions differ).

    Payload: ``[scales fp32 (chunks,), positions int16 (K,), codes uint8 (ceil(K/4),)]`` for K kept entries:
    4 chunks + 2 K + ceil(K / 4) bytes, about 148 bytes per 4096 fp32 elements at the defaults (0.9%).

    The 2-bit code loses the kept values' magnitudes within each chunk: run it with error feedback (the
    ``sparseloco`` method wraps it in an error feedback whose residual decays by its ``beta``). Where the
    paper quantizes the kept values with levels set from their spread, here the levels are uniform up to the
    chunk's largest kept magnitude; the paper chunks each tensor (2-D tensors in tiles), here the flat bucket
    is chunked as it is, so a chunk may span two tensors.
    """
    name = "topk_2bit"
    capabilities = Capabilities(summable=False, fixed_payload=True)
    params = (Param("chunk", int, 4096, "elements per chunk; each keeps its own top k", lo=1, hi=32768,
                    note=" (positions within a chunk travel as int16)"),
              Param("k", int, 64, "entries kept per chunk (k / chunk of the bucket)", lo=1, hi=32768,
                    note=" (at most chunk)"))
    LEVELS = (-1.0, -1.0 / 3, 1.0 / 3, 1.0)
    """What the codes 0..3 decode to, times the chunk's scale."""

    def __init__(self, **given):
        super().__init__(**given)
        if self.k > self.chunk:
            raise ValueError(f"k: must be at most chunk ({self.chunk}), got {self.k}")
        self._plan = None  # (n, device, chunk of each kept entry, start of that chunk), per bucket size
        self._levels = {}  # (dtype, device) -> the four levels

    def counts(self, n: int) -> tuple:
        """(full chunks, length of the last short chunk, entries it keeps, chunks, entries kept) for n elements."""
        C = self.chunk
        full, r = divmod(n, C)
        kt = -(-self.k * r // C) if r else 0
        return full, r, kt, full + (1 if r else 0), full * self.k + kt

    def _chunks(self, n: int, device) -> tuple:
        p = self._plan
        if p is None or p[0] != n or p[1] != device:
            full, r, kt, nc, K = self.counts(n)
            of = torch.arange(nc, device=device).repeat_interleave(
                torch.tensor([self.k] * full + ([kt] if r else []), dtype=torch.int64, device=device))
            p = self._plan = (n, device, of, of * self.chunk)
        return p[2], p[3]

    def declared_rounds(self, n, element_size, bucket=DEFAULT_BUCKET):
        """One all-gather: a fp32 scale per chunk, an int16 position and a 2-bit code per kept entry."""
        _, _, _, nc, K = self.counts(n)
        return [("allgather", 4 * nc + 2 * K + -(-K // 4), 3)]

    def compress(self, t: Tensor):
        x = t.reshape(-1)
        x = x if x.dtype in (torch.float32, torch.float64) else x.float()
        n, C = x.numel(), self.chunk
        full, r, kt, nc, K = self.counts(n)
        vals, idx = [], []
        if full:
            X = x[:full * C].view(full, C)
            i = X.abs().topk(self.k, dim=1).indices
            vals.append(X.gather(1, i))
            idx.append(i)
        if r:
            T = x[full * C:]
            i = T.abs().topk(kt).indices
            vals.append(T[i].view(1, kt))
            idx.append(i.view(1, kt))
        scales = [v.abs().amax(1) for v in vals]
        codes = [(v * torch.where(s > 0, 1.5 / s, torch.zeros_like(s)).unsqueeze(1)).add_(1.5).round_().clamp_(0, 3)
                 for v, s in zip(vals, scales)]
        cat = (lambda ts, dt: torch.cat([a.reshape(-1) for a in ts]).to(dt) if ts
               else torch.zeros(0, dtype=dt, device=t.device))
        payload = [cat(scales, torch.float32), cat(idx, torch.int16),
                   bitpack.pack_2bit(cat(codes, torch.uint8))]
        return payload, ChunkCtx(t.shape, t.dtype, n)

    def _values(self, payload: List[Tensor], ctx: ChunkCtx) -> Tuple[Tensor, Tensor]:
        """(positions int64, decoded values fp32) of one payload."""
        scales, idx, packed = payload
        of, start = self._chunks(ctx.n, idx.device)
        key = idx.device
        lv = self._levels.get(key)
        if lv is None:
            lv = self._levels[key] = torch.tensor(self.LEVELS, dtype=torch.float32, device=idx.device)
        codes = bitpack.unpack_2bit(packed, idx.numel()).long()
        return start + idx.long(), lv[codes] * scales[of]

    def decompress(self, payload: List[Tensor], ctx: ChunkCtx) -> Tensor:
        pos, v = self._values(payload, ctx)
        out = torch.zeros(ctx.n, dtype=ctx.dtype, device=pos.device)
        out[pos] = v.to(ctx.dtype)
        return out if len(ctx.shape) == 1 else out.view(ctx.shape)

    def exchange(self, t: Tensor, world_size: int, bucket: BucketContext = DEFAULT_BUCKET):
        payload, ctx = bucket.encode(self, t)
        gathered = yield Round("allgather", payload)
        acc = torch.zeros(ctx.n, dtype=torch.float32, device=t.device)  # summed in fp32, whatever t's dtype
        for p in gathered:
            pos, v = self._values(p, ctx)
            acc.index_add_(0, pos, v)
        return acc.div_(world_size).to(ctx.dtype).view(t.shape)

    def __repr__(self):
        return f"TopK2Bit(chunk={self.chunk}, k={self.k})"


# -- random-k ----------------------------------------------------------------


class RandomKCtx(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    numel: int
    idx: Tensor
    scale: Optional[Tensor]  # per-kept-entry factor (stratum sizes) when unbiased, else None


class RandomK(Compressor):
    """Random-k sparsification with indices shared by all ranks (Stich et al. 2018; Wangni et al. 2018).

    Steps:
      1. k = max(1, ceil(ratio * n)). Split the flat bucket into k contiguous
         strata of nearly equal size (floor(n/k) or ceil(n/k)).
      2. Seed a generator from (seed, bucket index, step count of this
         instance): every rank draws the same indices at the same step, and
         the draw changes from step to step.
      3. Draw one uniform index inside each stratum (one ``randint`` of k
         values plus a remainder; GRACE's ``randperm(n)`` costs 281 µs at 1K).
      4. Send the k values. Since the indices agree, payloads are summable:
         one all-reduce of k values; the decoder regenerates nothing, it keeps
         the indices in ``ctx``.

    Stratified sampling, not a uniform k-subset: the k indices are distinct
    and spread evenly over the bucket (every layer fused into a bucket gets its
    share), but two neighbours in one stratum are never sent together. Each
    entry is still kept with probability 1/(its stratum's size) ~= k/n.

    ``unbiased=True`` multiplies each kept value by its stratum size, which
    makes the decoded tensor an unbiased estimate of the input (E[out] = t,
    exactly, for any n and k), at the price of variance (n/k - 1) * |t|^2. The
    default (False) sends the plain values, which is what error feedback wants
    (Stich et al.); without error feedback only ~k/n of the gradient arrives.

    Payload: values [k] in the input dtype, k * element_size bytes. Summable.

    Tuning: use it with ``error_feedback`` on, ratio 0.01 to 0.1. Top-k keeps
    more energy per byte; random-k wins where all-reduce beats all-gather
    (large worlds) and where topk's selection cost matters.
    """
    name = "randomk"
    capabilities = Capabilities(summable=True, counts_steps=True, takes_bucket=True)  # the draw: from the bucket
    params = (ratio(0.01, "fraction of the bucket's entries sent, k = ceil(ratio * n)"),
              seed("seeds the index draw, with the bucket index and step: the same on every rank"),
              Param("unbiased", bool, False, "scale kept values by n/k, an unbiased estimate with more variance"))

    def __init__(self, **given):
        super().__init__(**given)
        self.step = 0
        """Compress calls so far; part of the index seed, so it is checkpointed."""
        self._gen = torch.Generator()
        self._strata = None  # (n, k, start [k] int64, size [k] int64, size as float [k] or None)

    def strata(self, n: int):
        if self._strata is None or self._strata[0] != n:
            if not n:  # an empty bucket: no strata, nothing sent
                none = torch.zeros(0, dtype=torch.int64)
                self._strata = (0, 0, none, none, none.to(torch.float64))
                return self._strata
            k = count_of(self.ratio, n)
            edges = torch.arange(k + 1, dtype=torch.int64).mul_(n).div_(k, rounding_mode="floor")
            start, size = edges[:-1], edges[1:] - edges[:-1]
            self._strata = (n, k, start, size, size.to(torch.float64))
        return self._strata

    def indices(self, n: int, step: int, bucket: int = 0) -> Tensor:
        """int64 indices (sorted, distinct) for bucket number ``bucket`` of n elements at ``step``."""
        _, k, start, size, _ = self.strata(n)
        self._gen.manual_seed(mix_seed(self.seed, bucket, step))
        # 2**62 >> stratum sizes, so the modulo bias is below 2**-40
        return torch.randint(1 << 62, (k,), generator=self._gen).remainder_(size).add_(start)

    def compress(self, t, bucket: BucketContext = DEFAULT_BUCKET):
        flat = t.reshape(-1)
        n = flat.numel()
        idx = self.indices(n, self.step, bucket.index).to(flat.device)
        self.step += 1
        scale = self.strata(n)[4].to(dtype=t.dtype, device=t.device) if self.unbiased else None
        return [flat[idx]], RandomKCtx(t.shape, t.dtype, t.device, n, idx, scale)

    def decompress(self, payload, ctx: RandomKCtx):
        out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=ctx.device)
        values = payload[0] if ctx.scale is None else payload[0] * ctx.scale
        out[ctx.idx] = values
        return out.view(ctx.shape)

    def exchange(self, t, world_size, bucket: BucketContext = DEFAULT_BUCKET):
        payload, ctx = bucket.encode(self, t)
        (summed,) = yield Round("allreduce", payload)
        values = summed / world_size if ctx.scale is None else summed * (ctx.scale / world_size)
        out = out_buffer(t).zero_()
        out[ctx.idx] = values
        return out.view(t.shape)

    def state_dict(self):
        return {**super().state_dict(), "step": self.step}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.step = int(state.get("step", 0))

    def __repr__(self):
        return f"RandomK(ratio={self.ratio:g}, seed={self.seed}, unbiased={self.unbiased})"


# -- threshold ---------------------------------------------------------------


class Threshold(SparseCompressor):
    """Threshold sparsification (Strom 2015, "Scalable distributed DNN training using commodity GPU cloud computing").

    Steps:
      1. Keep every entry with |x| >= threshold (none, some or all of them).
      2. Every rank decodes all ranks' (values, indices) into one dense average.

    Payload: values [m] in the input dtype and int32 indices [m], where m is
    the number of entries at or above the threshold: m * (element_size + 4)
    bytes, varying from step to step and rank to rank, possibly 0. Not summable.

    Tuning: there is no fixed compression ratio; gradients shrink as training
    converges, so the payload shrinks too. Pick the threshold from a measured
    gradient quantile (e.g. the 99th percentile of |g| early in training), and
    use ``error_feedback`` so small entries accumulate until they cross it
    (Strom's original method does exactly that). Cheaper than top-k: one
    compare and one nonzero, no selection.
    """
    name = "threshold"
    capabilities = replace(SparseCompressor.capabilities, steady_payload=False)  # how much is sent follows the values
    params = (Param("threshold", float, 0.01, "send every entry with |x| >= threshold", lo=0, lo_open=True),)

    def __init__(self, **given):
        super().__init__(**given)
        # A 0-d operand costs half what a Python number does (no scalar wrapping per call); as
        # a wrapped number would, it is compared in the input's dtype.
        self._at = torch.tensor(self.threshold, dtype=torch.float64)
        self._mask = Scratch()

    def select(self, flat):
        a = self._scratch.abs(flat)
        if a.numel() < Scratch.MIN:
            idx = torch.ge(a, self._at).nonzero().view(-1)
        else:
            idx = torch.ge(a, self._at, out=self._mask.get(a.numel(), torch.bool, a.device)).nonzero().view(-1)
        return flat.index_select(0, idx), idx

    def __repr__(self):
        return f"Threshold(threshold={self.threshold:g})"


# -- DGC ---------------------------------------------------------------------


class DGC(SparseCompressor):
    """Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018).

    Steps, per bucket and step, on the local gradient g:
      1. Local gradient clipping (optional): scale g so that ||g|| <= clip.
      2. Momentum correction: u = momentum * u + g; v = v + u. The velocity u
         is accumulated, not the raw gradient, so sparse updates still follow
         momentum SGD.
      3. Density for this step: ``ratio`` after warm-up; during the first
         ``warmup_steps`` calls it falls exponentially from 0.25 to ``ratio``:
         0.25 * (ratio / 0.25) ** (step / warmup_steps). With warmup_steps = 4
         and ratio 0.001 that is 25%, 6.3%, 1.6%, 0.4%, 0.1%: the paper's
         schedule over its 4 warm-up epochs (25%, 6.25%, 1.5625%, 0.4%, 0.1%)
         to within 2%, one call per step instead of one value per epoch.
      4. k = max(1, ceil(density * n)). Threshold from a random sample of |v|
         (1% of the entries, at least 4096) set so that about k entries pass
         (plus three standard deviations of slack); keep the entries above it
         and, if more than k passed, the top k of those. If the sample was
         unlucky, fewer than k entries are sent (no full sort ever). Buckets
         under 65536 entries run an exact top-k instead.
      5. Send v at those positions, then momentum factor masking: u and v are
         zeroed there. The rest keeps accumulating.

    The momentum lives here: run the optimizer WITHOUT momentum (plain SGD,
    momentum=0), or momentum is applied twice. Error feedback is built in
    (v is the residual), so ``error_feedback`` must stay off.

    ``clip`` is applied to this bucket's local gradient as given. The paper
    clips with the global threshold scaled by N ** -0.5 for N workers: pass
    that value.

    Payload: values [k] in the input dtype and int32 indices [k]:
    k * (element_size + 4) bytes. Not summable (all-gathered).

    State: u, v (the bucket's shape) and the step count for the warm-up.

    Tuning: the paper uses ratio 0.001 with 4 warm-up epochs; 0.01 is a safer
    start for short runs. Set warmup_steps to a few hundred iterations when
    training from scratch, since the first steps move the weights most.
    """
    name = "dgc"
    # how much is sent follows the values and the warm-up schedule; u and v are its residual and momentum
    capabilities = replace(SparseCompressor.capabilities, steady_payload=False, builtin_feedback=True,
                           builtin_momentum=True, counts_steps=True, elementwise=("u", "v"))
    params = (ratio(0.01, "fraction of entries sent after warm-up"),
              Param("momentum", float, 0.9, "momentum correction (run the optimizer without momentum)",
                    lo=0, hi=1, hi_open=True),
              Param("clip", float, None, "clip this bucket's local gradient to this 2-norm", lo=0, lo_open=True,
                    unset="no clipping"),
              Param("warmup_steps", int, 0, "steps over which the density falls from 25% to ratio", lo=0,
                    hi=10_000_000, note=" (a run has at most that many steps, commlab/engine/spec.py)"))

    def __init__(self, **given):
        super().__init__(**given)
        self.u: Optional[Tensor] = None
        """Velocity (momentum-corrected gradient), zeroed where sent."""
        self.v: Optional[Tensor] = None
        """Accumulated velocity not sent yet: DGC's residual."""
        self.step = 0
        """Compress calls so far; drives the warm-up schedule."""
        self._k = (None, 0, 0)  # (density, n, k)

    def density(self, step: Optional[int] = None) -> float:
        """Fraction of entries sent at ``step`` (default: the next step)."""
        step = self.step if step is None else step
        if step >= self.warmup_steps:
            return self.ratio
        start = max(0.25, self.ratio)
        return start * (self.ratio / start) ** (step / self.warmup_steps)

    def select(self, flat):
        n = flat.numel()
        if self.u is None:
            self.u = torch.zeros_like(flat)
            self.v = torch.zeros_like(flat)
        elif self.u.numel() != n:
            raise ValueError(f"dgc: this instance serves a bucket of {self.u.numel()} elements, got {n}")
        u, v = self.u, self.v
        u.mul_(self.momentum)
        if self.clip is not None:
            norm = float(torch.linalg.vector_norm(flat))
            u.add_(flat, alpha=min(1.0, self.clip / norm) if norm > 0 else 1.0)
        else:
            u.add_(flat)
        v.add_(u)
        density = self.density()
        if self._k[:2] != (density, n):  # Fraction arithmetic costs a few µs: once per schedule value
            self._k = (density, n, count_of(density, n))
        k = self._k[2]
        idx = top_indices(self._scratch.abs(v), k, self._gen, exact=False)
        values = v[idx]
        u.index_fill_(0, idx, 0)  # momentum factor masking
        v.index_fill_(0, idx, 0)
        self.step += 1
        return values, idx

    def state_dict(self):
        return {**super().state_dict(), "u": self.u, "v": self.v, "step": self.step}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.u = None if state.get("u") is None else state["u"].clone()
        self.v = None if state.get("v") is None else state["v"].clone()
        self.step = int(state.get("step", 0))

    def __repr__(self):
        return (f"DGC(ratio={self.ratio:g}, momentum={self.momentum:g}, clip={self.clip}, "
                f"warmup_steps={self.warmup_steps})")


# PowerSGD and Count Sketch import the helpers above, so they are imported last.
