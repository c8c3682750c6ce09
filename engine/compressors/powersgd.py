"""PowerSGD: low-rank gradient compression with two all-reduce rounds."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from engine.compressors.base import Compressor, Round
from engine.compressors.sparsify import (check_bool, check_int, check_real, mix_seed, out_buffer,
                                         reject_unknown)

Tensor = torch.Tensor


def matrix_shape(n: int) -> Tuple[int, int]:
    """(rows, cols) of the near-square matrix a flat bucket of n elements is viewed as.

    cols = ceil(sqrt(n)), rows = ceil(n / cols): at most cols - 1 padding
    zeros, all in the last row. Near-square minimises the factor sizes
    rank * (rows + cols) for a given n.
    """
    cols = max(1, math.isqrt(n - 1) + 1) if n > 1 else 1
    return -(-n // cols), cols


def orthogonalize_(p: Tensor) -> Tensor:
    """Orthonormalise the columns of p in place (modified Gram-Schmidt).

    A column with zero norm (a bucket whose gradient vanished, or a column
    that was a combination of the earlier ones) is left at zero instead of
    being divided by zero: the approximation then simply uses fewer
    directions. Rank is small, so the loop is over a handful of columns.
    """
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[1]):
        col = p[:, i]
        col.div_(torch.linalg.vector_norm(col).clamp_min_(tiny))  # a zero column stays 0 / tiny = 0
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(torch.outer(col, col @ rest))
    return p


class PowerCtx(NamedTuple):
    shape: torch.Size
    numel: int
    compressed: bool


class PowerSGD(Compressor):
    """PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019), one power iteration per step.

    PyTorch's ``powerSGD_hook`` compresses each tensor with two or more
    dimensions separately. Here the communicator hands one flat bucket (the
    unit that fusion schedules produce), so the bucket itself is viewed as a
    near-square matrix M of rows x cols (``matrix_shape``; zero padding in the
    last row). The matrix rows are therefore not the layer's own rows: even a
    layer-wise bucket holding one (out, in) weight is reshaped to near-square
    unless out ~= in, and a fused bucket mixes layers in one matrix. Some
    low-rank structure of individual layers is lost (error feedback recovers
    it over steps); in exchange, one bucket costs two small collectives and
    two matmuls however many layers it fuses.

    Steps of ``exchange``, per bucket:
      0. For the first ``start_iter`` exchanges: one plain all-reduce of the
         bucket (no compression, no residual), as PyTorch's
         ``start_powerSGD_iter``; compressing the first, large and fast-changing
         gradients hurts accuracy. Buckets too small to gain at least
         ``min_compression_rate`` (rows * cols vs rank * (rows + cols)) are
         always sent this way.
      1. Error feedback (built in): M = bucket + residual.
      2. P = M Q, with Q (cols x rank) warm-started from the previous step
         (random, seeded identically on every rank, the first time).
      3. All-reduce P (sum), then orthonormalise its columns: P_hat.
      4. Q = M^T P_hat; all-reduce Q and divide by the world size.
      5. Output: the average approximation P_hat Q^T; residual = M - P_hat Q^T
         (the local M minus the averaged approximation, as in the reference
         implementations; the residuals' sum over ranks is exactly what the
         average lost).

    Payload: round 1 P [rows x rank], round 2 Q [cols x rank], both in the
    input dtype: rank * (rows + cols) * element_size bytes per step (about
    2 * rank * sqrt(n) elements). Both rounds are all-reduced (summable).
    ``last_bytes`` counts both rounds.

    ``compress``/``decompress`` give the single-process view of one step: one
    power iteration from the current Q on the bucket alone (no residual, no
    state change, ``start_iter`` ignored); payload [P_hat, M^T P_hat], decoded
    as P_hat (M^T P_hat)^T. The power iteration is not linear in M, so these
    payloads cannot be summed across ranks: training uses ``exchange``.

    State: the warm-start Q, the residual (rows * cols elements, padded) and
    the exchange count (for ``start_iter``).

    Tuning (as PyTorch's hook advises): start with rank 1 and raise it (2, 4,
    ...) until accuracy matches plain SGD; rank 4 usually suffices for image
    models. Set ``start_iter`` to about 10% of training steps. Keep
    ``warm_start`` on: with it, one power iteration per step behaves like many.
    Run the optimizer with its usual momentum.
    """
    name = "powersgd"
    summable = True
    rounds = 2
    builtin_feedback = True

    def __init__(self, *, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 warm_start: bool = True, seed: int = 0, **unknown):
        reject_unknown(self.name, unknown, ("rank", "start_iter", "min_compression_rate", "warm_start", "seed"))
        self.rank = check_int("rank", rank, 1)
        self.start_iter = check_int("start_iter", start_iter, 0)
        self.min_compression_rate = check_real("min_compression_rate", min_compression_rate, 1.0, lo_open=False)
        self.warm_start = check_bool("warm_start", warm_start)
        self.seed = check_int("seed", seed, 0)
        self.step = 0
        """Exchanges started so far: the first ``start_iter`` are plain all-reduces."""
        self.q: Optional[Tensor] = None
        """Warm-start right factor [cols x rank], identical on every rank (it is all-reduced)."""
        self.residual: Optional[Tensor] = None
        """Error feedback [rows * cols], what the approximations have not delivered yet."""
        self._q0 = None  # (key, initial Q): a cache of derived data

    def compresses(self, n: int) -> bool:
        rows, cols = matrix_shape(n)
        return self.rank * (rows + cols) * self.min_compression_rate < rows * cols

    def _initial_q(self, n: int, cols: int, like: Tensor) -> Tensor:
        # the same on every rank: P = M Q is only summable if Q is shared
        key = (self.bucket, n, like.dtype, like.device, 0 if self.warm_start else self.step)
        if self._q0 is None or self._q0[0] != key:  # derived from the key, so cached, never checkpointed
            g = torch.Generator().manual_seed(mix_seed(self.seed, *key[:2], key[4]))
            self._q0 = (key, torch.randn(cols, self.rank, generator=g).to(dtype=like.dtype, device=like.device))
        return self._q0[1].clone()

    def _q_for(self, n: int, cols: int, like: Tensor) -> Tensor:
        q = self.q
        if (q is None or not self.warm_start or q.shape != (cols, self.rank)
                or q.dtype != like.dtype or q.device != like.device):
            q = self._initial_q(n, cols, like)
        return q

    # single-process view -------------------------------------------------
    def compress(self, t):
        flat = t.reshape(-1)
        n = flat.numel()
        if not self.compresses(n):
            return [flat.clone()], PowerCtx(t.shape, n, False)
        rows, cols = matrix_shape(n)
        if rows * cols == n:
            m = flat.view(rows, cols)
        else:
            m = torch.zeros(rows * cols, dtype=t.dtype, device=t.device)
            m[:n] = flat
            m = m.view(rows, cols)
        p = orthogonalize_(m @ self._q_for(n, cols, t))
        return [p, m.t() @ p], PowerCtx(t.shape, n, True)

    def decompress(self, payload, ctx: PowerCtx):
        if not ctx.compressed:
            return payload[0].view(ctx.shape)
        p, q = payload
        return (p @ q.t()).view(-1)[:ctx.numel].view(ctx.shape)

    # the training path ---------------------------------------------------
    def exchange(self, t, world_size):
        flat = t.reshape(-1)
        n = flat.numel()
        es = flat.element_size()
        self.step += 1
        if self.step <= self.start_iter or not self.compresses(n):
            self.last_bytes = n * es
            (summed,) = yield Round("allreduce", [flat])  # in place on the bucket, as the identity compressor
            return summed.div_(world_size).view(t.shape)

        rows, cols = matrix_shape(n)
        full, rem = divmod(n, cols)  # full rows of the matrix, entries in the partial last row
        r = self.residual
        if r is None or r.numel() != rows * cols or r.dtype != t.dtype or r.device != t.device:
            r = self.residual = torch.zeros(rows * cols, dtype=t.dtype, device=t.device)
        r[:n].add_(flat)  # the residual buffer now holds M (padding stays zero)
        m = r.view(rows, cols)
        q = self._q_for(n, cols, t)

        (p,) = yield Round("allreduce", [m @ q])
        p = orthogonalize_(p)
        q = self.q = torch.matmul(m.t(), p, out=q if q is self.q else None)
        (q_sum,) = yield Round("allreduce", [q])
        if q_sum is not q:
            q.copy_(q_sum)
        q.div_(world_size)
        self.last_bytes = (p.numel() + q.numel()) * es

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
        return {**super().state_dict(), "step": self.step, "q": self.q, "residual": self.residual}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.step = int(state.get("step", 0))
        self.q = None if state.get("q") is None else state["q"].clone()
        self.residual = None if state.get("residual") is None else state["residual"].clone()

    def __repr__(self):
        return (f"PowerSGD(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate:g}, warm_start={self.warm_start})")
