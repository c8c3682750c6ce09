"""Building blocks the compressors share: how many entries a ratio keeps, where a decoded average goes,
reusable work buffers, and a fast exact top-k selection."""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional

import torch

Tensor = torch.Tensor


def count_of(ratio: float, n: int) -> int:
    """k = max(1, ceil(ratio * n)), with ratio read as the decimal it was written as
    (0.07 * 100 is 7.000000000000001 in floating point; we want 7)."""
    return max(1, min(n, math.ceil(Fraction(repr(ratio)) * n)))


def out_buffer(t: Tensor) -> Tensor:
    """A flat tensor to decode the average into: ``t``'s own storage when possible."""
    return t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype, device=t.device)


class Scratch:
    """A reusable work buffer for large buckets (fresh 100 MB tensors cost page faults on every call)."""
    MIN = 1 << 16  # below this, allocation is cheaper than keeping memory around

    def __init__(self):
        self.buf: Optional[Tensor] = None

    def get(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The buffer, (re)made for n elements of ``dtype`` on ``device``; its contents are stale."""
        b = self.buf
        if b is None or b.numel() != n or b.dtype != dtype or b.device != device:
            b = self.buf = torch.empty(n, dtype=dtype, device=device)
        return b

    def abs(self, x: Tensor) -> Tensor:
        if x.numel() < self.MIN:
            return x.abs()
        return torch.abs(x, out=self.get(x.numel(), x.dtype, x.device))


# -- selection ---------------------------------------------------------------

SAMPLE_MIN = 1 << 16
"""Buckets at least this large select through a sampled threshold instead of one full topk."""


def top_indices(a: Tensor, k: int, gen: torch.Generator, exact: bool = True) -> Tensor:
    """int64 indices of (up to) the k largest entries of the 1-D non-negative tensor ``a``.

    ``torch.topk`` over tens of millions of elements with k in the hundreds of
    thousands is slow (about 0.9 s at 25M, k = 250K, one thread). Instead:
    estimate a threshold from a random sample, chosen three standard deviations
    on the generous side, so that almost surely at least k entries pass it;
    keep the entries above it (one compare and one nonzero over ``a``); run
    topk only on those ~1.1 k candidates. Every entry left out is below every
    candidate, so the result is the exact top-k. If the sample was unlucky
    (fewer than k candidates), ``exact`` falls back to a full topk and
    otherwise returns the candidates (fewer than k, as DGC allows).
    """
    n = a.numel()
    if k >= n:
        return torch.arange(n, device=a.device)
    if n < SAMPLE_MIN or 8 * k > n or not a.is_cpu:
        # small buckets or dense selections: one topk is cheapest; on a GPU torch.topk's radix select
        # beats the sample, compare, nonzero (a host sync) and second topk of the path below
        return torch.topk(a, k, sorted=False).indices
    s = min(n, max(4096, n // 100))
    sample = a[torch.randint(n, (s,), generator=gen).to(a.device)]
    q = k / n
    j = min(s, math.ceil(s * q + 3.0 * math.sqrt(s * q)) + 1)
    thr = torch.topk(sample, j, sorted=False).values.min()
    cand = torch.ge(a, thr).nonzero().view(-1)
    if cand.numel() > k:
        vals = a[cand]
        if cand.numel() > 2 * k:
            # many ties at the threshold (typically exact zeros): everything above it, then ties
            above = vals > thr
            n_above = int(above.sum())
            if n_above <= k:
                return torch.cat([cand[above], cand[~above][:k - n_above]])
        return cand[torch.topk(vals, k, sorted=False).indices]
    if cand.numel() == k or not exact:
        return cand
    return torch.topk(a, k, sorted=False).indices
