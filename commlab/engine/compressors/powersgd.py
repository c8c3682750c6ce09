"""PowerSGD: low-rank gradient compression with two all-reduce rounds."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from commlab.engine.compressors.base import Compressor, Round
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext, Capabilities
from commlab.engine.compressors.kernels import Scratch, out_buffer
from commlab.engine.compressors.params import Param, mix_seed, seed

Tensor = torch.Tensor


def matrix_shape(n: int) -> Tuple[int, int]:
    """(rows, cols) of the near-square matrix a flat bucket of n elements is viewed as.

    cols = ceil(sqrt(n)), rows = ceil(n / cols): at most cols - 1 padding
    zeros, all in the last row. Near-square minimises the factor sizes
    rank * (rows + cols) for a given n.
    """
    cols = max(1, math.isqrt(n - 1) + 1) if n > 1 else 1
    return -(-n // cols), cols


MAX_RANK = 1024
"""The highest rank: the power iteration's work grows with it, and the factors stop paying (rank * (rows + cols)
elements against rows * cols) long before; rank 4 usually suffices for image models (PowerSGD's tuning notes)."""
MAX_START_ITER = 10_000_000
"""The most plain exchanges first: a run has at most 10,000,000 steps (commlab/engine/spec.py JobSpec.steps)."""

_TINY = {}
"""dtype -> its smallest normal number as a 0-d tensor (cheaper per call than a Python number)."""


def orthogonalize_(p: Tensor) -> Tensor:
    """Orthonormalise the columns of p in place (modified Gram-Schmidt).

    A column with zero norm (a bucket whose gradient vanished, or a column
    that was a combination of the earlier ones) is left at zero instead of
    being divided by zero: the approximation then simply uses fewer
    directions. Rank is small, so the loop is over a handful of columns.
    """
    tiny = _TINY.get((p.dtype, p.device))
    if tiny is None:  # clamp_min_ takes a tensor bound only on the tensor's own device
        tiny = _TINY[p.dtype, p.device] = torch.tensor(torch.finfo(p.dtype).tiny, dtype=p.dtype, device=p.device)
    for i in range(p.shape[1]):
        col = p.select(1, i)
        col.div_(torch.linalg.vector_norm(col).clamp_min_(tiny))  # a zero column stays 0 / tiny = 0
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(torch.outer(col, col @ rest))
    return p


class Plan(NamedTuple):
    """How one bucket splits into compressed matrices and plain runs. A function of
    the layout's shapes, the rank and the rate alone, so every rank derives the same one."""
    mats: Tuple[Tuple[int, int, int], ...]
    """(offset, rows, cols) of each compressed tensor, viewed as (shape[0], -1), in layout order."""
    plain: Tuple[Tuple[int, int], ...]
    """(offset, numel) of the runs sent uncompressed (1-D and small tensors; neighbours merged)."""
    p_numel: int
    """Elements of all P factors together: sum of rows * rank."""
    q_numel: int
    """Elements of all Q factors together: sum of cols * rank."""
    plain_numel: int


def plan_layout(layout: Sequence[Tuple[int, Tuple[int, ...]]], n: int, rank: int,
                min_compression_rate: float) -> Optional[Plan]:
    """The per-tensor plan for a bucket of n elements, or None when the layout does not
    describe it (its sizes do not add up to n). A layout whose sizes add up but whose
    tensors do not lie back to back in order is a communicator bug: it raises."""
    sizes = [math.prod(shape) for _, shape in layout]
    if sum(sizes) != n:
        return None
    mats, plain = [], []
    expect = 0
    for (off, shape), k in zip(layout, sizes):
        if off != expect:
            raise ValueError(f"powersgd: layout tensors must tile the bucket in order; tensor {shape} "
                             f"starts at {off}, expected {expect}")
        expect += k
        if k == 0:
            continue
        rows, cols = (shape[0], k // shape[0]) if len(shape) >= 2 else (1, k)  # scalars have no shape[0]
        if len(shape) >= 2 and rank * (rows + cols) * min_compression_rate < rows * cols:
            mats.append((off, rows, cols))
        elif plain and plain[-1][0] + plain[-1][1] == off:
            plain[-1] = (plain[-1][0], plain[-1][1] + k)
        else:
            plain.append((off, k))
    return Plan(tuple(mats), tuple(plain), sum(r * rank for _, r, _ in mats),
                sum(c * rank for _, _, c in mats), sum(k for _, k in plain))


class PowerCtx(NamedTuple):
    shape: torch.Size
    numel: int
    compressed: bool


class PowerSGD(Compressor):
    """PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019), one power iteration per step.

    Per tensor, as PyTorch's ``powerSGD_hook``, when the bucket's context has a
    ``layout`` (the (offset, shape) of each parameter in the flat bucket;
    ``plan_layout``): every tensor with two or more dimensions is viewed as
    (shape[0], -1) and compressed as its own matrix M_i, if that pays
    (rank * (rows + cols) * ``min_compression_rate`` < rows * cols); 1-D
    tensors (biases, norms) and small matrices are sent as they are, in the
    first all-reduce. A concatenation of unrelated tensors has no low-rank
    structure, so this is what makes low ranks train.

    Flat, without a layout (standalone use, a bare tensor, or a layout that
    does not describe the tensor handed in): the bucket itself is viewed as one
    near-square matrix M of rows x cols (``matrix_shape``; zero padding in the
    last row). Cheap (two small collectives, two matmuls) but lossy: the
    matrix rows are not any layer's rows, and a fused bucket mixes layers.

    Steps of ``exchange``, per bucket (flat mode: one matrix, no plain part):
      0. For the first ``start_iter`` exchanges: one plain all-reduce of the
         bucket (no compression, no residual), as PyTorch's
         ``start_powerSGD_iter``; compressing the first, large and fast-changing
         gradients hurts accuracy. Buckets in which nothing would compress
         are always sent this way.
      1. Error feedback (built in): M = bucket + residual.
      2. P_i = M_i Q_i, with Q_i (cols_i x rank) warm-started from the previous
         step (random, seeded identically on every rank, the first time).
      3. Round 1: all-reduce [P_1, P_2, ..., plain values] as one tensor, then
         orthonormalise each P_i's columns: P_hat_i.
      4. Round 2: Q_i = M_i^T P_hat_i; all-reduce [Q_1, Q_2, ...] as one tensor
         and divide by the world size.
      5. Output: P_hat_i Q_i^T per tensor and the averaged plain values;
         residual = M - P_hat Q^T on compressed tensors (the local M minus the
         averaged approximation, as in the reference implementations: the
         residuals' sum over ranks is exactly what the average lost), zero on
         plain ones (they arrive exact).

    Two rounds, each a single collective, in the same order on every rank:
    which tensors compress depends on shapes only. Payload, in the input
    dtype: sum_i rank * (rows_i + cols_i) plus the plain elements, times
    ``element_size``, over both rounds.

    ``compress``/``decompress`` give the single-process view of one step, in
    flat mode always: one power iteration from the current flat Q on the
    bucket alone (no residual, no state change, ``start_iter`` ignored);
    payload [P_hat, M^T P_hat], decoded as P_hat (M^T P_hat)^T. The power
    iteration is not linear in M, so these payloads cannot be summed across
    ranks: training uses ``exchange``.

    State: the warm-start factors (``q`` flat, ``qs`` per tensor), the residual
    and the exchange count (for ``start_iter``).

    Tuning (as PyTorch's hook advises): start with rank 1 and raise it (2, 4,
    ...) until accuracy matches plain SGD; rank 4 usually suffices for image
    models. Set ``start_iter`` to about 10% of training steps. Keep
    ``warm_start`` on: with it, one power iteration per step behaves like many.
    Run the optimizer with its usual momentum.
    """
    name = "powersgd"
    # warmup_exchanges: start_iter, set per instance; compress takes the bucket for its first Q's seed
    capabilities = Capabilities(summable=True, rounds=2, builtin_feedback=True, counts_steps=True, takes_bucket=True)
    params = (Param("rank", int, 1, "rank of the approximation: factors of rank * (rows + cols) elements", lo=1,
                    hi=MAX_RANK, note=" (each rank costs a multiply-add per gradient element and step; at this "
                                      "rank only matrices wider than 4096 x 4096 compress at min_compression_rate "
                                      "2)"),
              Param("start_iter", int, 10, "exchanges sent as plain all-reduces before compression starts", lo=0,
                    hi=MAX_START_ITER, note=" (a run has at most that many steps)"),
              Param("min_compression_rate", float, 2.0, "compress a tensor only if it shrinks at least this much",
                    lo=1),
              Param("warm_start", bool, True, "start each power iteration from the previous Q"),
              seed("seeds the initial Q, the same on every rank"))

    def __init__(self, **given):
        super().__init__(**given)
        self.step = 0
        """Exchanges started so far: the first ``start_iter`` are plain all-reduces."""
        self.q: Optional[Tensor] = None
        """Flat mode's warm-start right factor [cols x rank], identical on every rank (it is all-reduced)."""
        self.qs: Optional[Tensor] = None
        """Per-tensor mode's warm-start factors: every compressed tensor's Q_i (cols_i x rank),
        flattened and concatenated in layout order, as round 2 sends them."""
        self.residual: Optional[Tensor] = None
        """Error feedback in bucket coordinates, what the approximations have not delivered yet
        (flat mode: rows * cols, zero padding at the end; per-tensor mode: the bucket's n)."""
        self._q0 = None  # (key, initial Q): a cache of derived data
        self._plan = None  # (key, Plan or None): derived from the layout, never checkpointed
        self._mc = None  # (rows, cols, n, compresses, (rank, rate)) of the last flat size
        self._pad = None  # compress's zero-padded matrix, when n is not rows * cols
        self._dense = Scratch()  # large decodes of this instance's own payload
        self._sent = None  # P of the latest compress
        if self.start_iter:  # its first start_iter exchanges are plain all-reduces
            self.capabilities = replace(type(self).capabilities, warmup_exchanges=self.start_iter)

    def skip_warmup(self) -> None:
        """Past the ``start_iter`` plain exchanges (commlab/engine/compressors/contract.py)."""
        self.step = max(self.step, self.start_iter)  # its plain exchanges keep no state but the count

    def per_tensor(self, n: int, bucket: BucketContext = DEFAULT_BUCKET) -> bool:
        """Whether a bucket of n elements is compressed per tensor: its context has a layout that describes it."""
        return self.plan(n, bucket.layout) is not None

    def declared_rounds(self, n, element_size, bucket: BucketContext = DEFAULT_BUCKET):
        """Per tensor (the bucket's layout): one all-reduce of every P factor and the plain runs, one of every Q
        factor; a bucket with no matrix worth compressing is one plain all-reduce. None in flat mode."""
        plan = self.plan(n, bucket.layout)
        if plan is None:
            return None
        if not plan.mats:
            return [("allreduce", n * element_size, 1)]
        return [("allreduce", (plan.p_numel + plan.plain_numel) * element_size, 1),
                ("allreduce", plan.q_numel * element_size, 1)]

    def compresses(self, n: int) -> bool:
        rows, cols = matrix_shape(n)
        return self.rank * (rows + cols) * self.min_compression_rate < rows * cols

    def plan(self, n: int, layout: Optional[Sequence[Tuple[int, Tuple[int, ...]]]]) -> Optional[Plan]:
        """The per-tensor plan for a bucket of n elements laid out as ``layout``, or None for flat mode."""
        if layout is None:
            return None
        key = (n, self.rank, self.min_compression_rate, tuple(layout))
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, plan_layout(layout, n, self.rank, self.min_compression_rate))
        return self._plan[1]

    def _initial_q(self, n: int, size: int, like: Tensor, bucket: int, copy: bool = True) -> Tensor:
        # the same on every rank: P = M Q is only summable if Q is shared
        key = (bucket, n, size, like.dtype, like.device, 0 if self.warm_start else self.step)
        if self._q0 is None or self._q0[0] != key:  # derived from the key, so cached, never checkpointed
            g = torch.Generator().manual_seed(mix_seed(self.seed, *key[:2], key[5]))
            self._q0 = (key, torch.randn(size, generator=g).to(dtype=like.dtype, device=like.device))
        return self._q0[1].clone() if copy else self._q0[1]

    def _q_for(self, q: Optional[Tensor], n: int, size: int, like: Tensor, bucket: int,
               copy: bool = True) -> Tensor:
        """The warm-start factor(s) ``q`` when usable, else fresh ones for bucket number ``bucket``; flat, ``size``
        elements. ``copy=False``: the caller only reads the result, so a fresh one may be the cached initial Q."""
        if (q is None or not self.warm_start or q.numel() != size
                or q.dtype != like.dtype or q.device != like.device):
            return self._initial_q(n, size, like, bucket, copy)
        return q.view(-1)

    # single-process view -------------------------------------------------
    def _matrix(self, flat: Tensor) -> Tuple[int, int, int, bool]:
        """(rows, cols, n, compresses) for a flat bucket, cached per size: they are pure Python
        arithmetic, a few µs a call."""
        n = flat.numel()
        mc = self._mc
        if mc is None or mc[2] != n or mc[4] != (self.rank, self.min_compression_rate):
            rows, cols = matrix_shape(n)
            mc = self._mc = (rows, cols, n, self.compresses(n), (self.rank, self.min_compression_rate))
        return mc[:4]

    def compress(self, t, bucket: BucketContext = DEFAULT_BUCKET):
        flat = t if t.dim() == 1 else t.reshape(-1)
        rows, cols, n, pays = self._matrix(flat)
        if not pays:
            return [flat.clone()], PowerCtx(t.shape, n, False)
        if rows * cols == n:
            m = flat.view(rows, cols)
        else:  # a kept buffer whose padding stays zero: only flat's part is ever written
            pad = self._pad
            if pad is None or pad.numel() != rows * cols or pad.dtype != t.dtype or pad.device != t.device:
                pad = self._pad = torch.zeros(rows * cols, dtype=t.dtype, device=t.device)
            pad[:n].copy_(flat)
            m = pad.view(rows, cols)
        q = self._q_for(self.q, n, cols * self.rank, t, bucket.index, copy=False).view(cols, self.rank)
        p = self._sent = orthogonalize_(m @ q)
        return [p, m.t() @ p], PowerCtx(t.shape, n, True)

    def decompress(self, payload, ctx: PowerCtx):
        """From ``Scratch.MIN`` elements up, the decoding of this instance's own latest payload is
        a buffer it reuses (rewritten by the next such call): a fresh 100 MB product costs more in
        page faults than the product itself. Other payloads decode to fresh tensors."""
        if not ctx.compressed:
            return payload[0].view(ctx.shape)
        p, q = payload
        if ctx.numel < Scratch.MIN or p is not self._sent:
            out = (p @ q.t()).view(-1)
        else:
            out = self._dense.get(p.shape[0] * q.shape[0], p.dtype, p.device)
            torch.matmul(p, q.t(), out=out.view(p.shape[0], q.shape[0]))
        if out.numel() != ctx.numel:
            out = out[:ctx.numel]
        return out if len(ctx.shape) == 1 else out.view(ctx.shape)

    # the training path ---------------------------------------------------
    def exchange(self, t, world_size, bucket: BucketContext = DEFAULT_BUCKET):
        flat = t.reshape(-1)
        n = flat.numel()
        self.step += 1
        plan = self.plan(n, bucket.layout)
        pays = bool(plan.mats) if plan is not None else self.compresses(n)
        if self.step <= self.start_iter or not pays:
            (summed,) = yield Round("allreduce", [flat])  # in place on the bucket, as the identity compressor
            return summed.div_(world_size).view(t.shape)
        if plan is not None:
            return (yield from self._exchange_tensors(t, flat, plan, world_size, bucket.index))
        return (yield from self._exchange_flat(t, flat, world_size, bucket.index))

    def _exchange_tensors(self, t: Tensor, flat: Tensor, plan: Plan, world_size: int, bucket: int):
        n, k = flat.numel(), self.rank
        r = self.residual
        if r is None or r.numel() != n or r.dtype != t.dtype or r.device != t.device:
            r = self.residual = torch.zeros(n, dtype=t.dtype, device=t.device)
        r.add_(flat)  # the residual buffer now holds M (plain runs: residual 0, so the gradient itself)
        qs = self._q_for(self.qs, n, plan.q_numel, t, bucket)

        send = torch.empty(plan.p_numel + plan.plain_numel, dtype=t.dtype, device=t.device)
        po = qo = 0
        for off, rows, cols in plan.mats:
            torch.matmul(r[off:off + rows * cols].view(rows, cols), qs[qo:qo + cols * k].view(cols, k),
                         out=send[po:po + rows * k].view(rows, k))
            po, qo = po + rows * k, qo + cols * k
        for off, size in plan.plain:
            send[po:po + size].copy_(flat[off:off + size])
            po += size

        (got,) = yield Round("allreduce", [send])
        ps = []  # P_hat_i, views of the summed round-1 tensor
        po = qo = 0
        for off, rows, cols in plan.mats:  # Q_i = M_i^T P_hat_i overwrites the warm start, no longer needed
            p = orthogonalize_(got[po:po + rows * k].view(rows, k))
            torch.matmul(r[off:off + rows * cols].view(rows, cols).t(), p, out=qs[qo:qo + cols * k].view(cols, k))
            ps.append(p)
            po, qo = po + rows * k, qo + cols * k
        self.qs = qs
        (q_sum,) = yield Round("allreduce", [qs])
        if q_sum is not qs:
            qs.copy_(q_sum)
        qs.div_(world_size)

        # written straight into the bucket: the plain values were copied out before round 1
        out = out_buffer(t)
        qo = 0
        for (off, rows, cols), p in zip(plan.mats, ps):
            o = out[off:off + rows * cols]
            torch.matmul(p, qs[qo:qo + cols * k].view(cols, k).t(), out=o.view(rows, cols))
            r[off:off + rows * cols].sub_(o)
            qo += cols * k
        for off, size in plan.plain:
            torch.div(got[po:po + size], world_size, out=out[off:off + size])
            r[off:off + size].zero_()
            po += size
        return out.view(t.shape)

    def _exchange_flat(self, t: Tensor, flat: Tensor, world_size: int, bucket: int):
        n = flat.numel()
        rows, cols = matrix_shape(n)
        full, rem = divmod(n, cols)  # full rows of the matrix, entries in the partial last row
        r = self.residual
        if r is None or r.numel() != rows * cols or r.dtype != t.dtype or r.device != t.device:
            r = self.residual = torch.zeros(rows * cols, dtype=t.dtype, device=t.device)
        r[:n].add_(flat)  # the residual buffer now holds M (padding stays zero)
        m = r.view(rows, cols)
        q = self._q_for(self.q, n, cols * self.rank, t, bucket).view(cols, self.rank)

        (p,) = yield Round("allreduce", [m @ q])
        p = orthogonalize_(p)
        q = self.q = torch.matmul(m.t(), p, out=q)  # q is ours (the warm start or a fresh copy) and no longer needed
        (q_sum,) = yield Round("allreduce", [q])
        if q_sum is not q:
            q.copy_(q_sum)
        q.div_(world_size)

        # average approximation P_hat Q^T, written straight into the bucket (no padded temporary)
        out = out_buffer(t)
        if full:
            torch.matmul(p[:full], q.t(), out=out[:full * cols].view(full, cols))
        if rem:
            torch.mv(q[:rem], p[full], out=out[full * cols:])
        r[:n].sub_(out)
        r[n:].zero_()
        return out.view(t.shape)

    # state ---------------------------------------------------------------
    def state_dict(self):
        return {**super().state_dict(), "step": self.step, "q": self.q, "qs": self.qs, "residual": self.residual}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.step = int(state.get("step", 0))
        for key in ("q", "qs", "residual"):
            setattr(self, key, None if state.get(key) is None else state[key].clone())

    def __repr__(self):
        return (f"PowerSGD(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate:g}, warm_start={self.warm_start})")
