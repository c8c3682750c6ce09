"""Large CPU buffers for collectives, reused once nothing refers to them any more.

A fresh CPU tensor of many MB costs page faults on its first write: on the 2-core machine of
docs/benchmarks/model-validation.md, 2-4 GB/s against 30 GB/s once touched, so a payload all-gather of 64 MB
at 10 Gbit/s spent as long allocating its send and receive buffers as sending. CUDA's caching allocator
already reuses device memory; torch's CPU allocator returns large blocks to the system.

``take`` hands out a view of a kept block only when no tensor other than the pool's own refers to the block's
storage: every view a caller made (a payload unpacked from a receive buffer, a decoded gradient that is a view
of it, the tensors an in-flight collective holds) keeps the storage's use count up, so a block a caller still
holds is never handed out twice. Without torch's use count (a private API), or with ``COMMLAB_BUFFER_POOL=0`` in
the environment (to compare; a run's ranks set it from the spec's ``engine: {buffer_pool}``), nothing is reused. The
switch is read each time a buffer is asked for, so a rank that sets it after importing this module is obeyed.
"""
from __future__ import annotations

import os
import threading
from typing import Dict, List, Tuple

import torch

Tensor = torch.Tensor

MIN_BYTES = 1 << 20
"""Blocks smaller than this are allocated fresh: the C allocator reuses small ones itself."""
POOL_BYTES = 512 << 20
"""At most this many bytes kept per process: free blocks of the sizes least recently asked for go first, and a block
that finds no room is allocated fresh and not kept."""
PER_KEY = 2
"""At most this many blocks of one size and dtype: one in use, one that gloo's thread lets go of a moment after the
collective was waited for (a block in use stays with its holder; past this, fresh ones are not kept)."""

_use_count = getattr(torch._C, "_storage_Use_Count", None)
ENV = "COMMLAB_BUFFER_POOL"
"""``0`` in the environment: no block is reused (commlab.engine.spec.EngineSpec.buffer_pool sets it in a rank)."""
_pool: Dict[Tuple[int, torch.dtype], List[Tensor]] = {}
_kept_bytes = 0
_lock = threading.Lock()  # a block is checked free and viewed under it: two threads never get the same one


def _free(block: Tensor) -> bool:
    # the block's own reference and the temporary storage object made to ask: nothing else
    return _use_count(block.untyped_storage()._cdata) <= 2


def take(numel: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> Tensor:
    """A flat tensor of ``numel`` elements of ``dtype`` on ``device``, its contents undefined (zeros when
    ``zero``): a free kept block's view on the CPU, else a new tensor (kept for later when there is room)."""
    global _kept_bytes
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or _use_count is None or os.environ.get(ENV, "1") == "0":
        return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
    key = (numel, dtype)
    with _lock:
        blocks = _pool.pop(key, [])
        _pool[key] = blocks  # the most recently used size last: the first to let go of is the oldest
        view = next((b.view(-1) for b in blocks if _free(b)), None)
        if view is None:
            block = (torch.zeros if zero else torch.empty)(numel, dtype=dtype)
            if len(blocks) >= PER_KEY or nbytes > POOL_BYTES:
                return block
            _make_room(POOL_BYTES - nbytes, keep=key)
            if _kept_bytes + nbytes > POOL_BYTES:  # the rest is in use
                return block
            blocks.append(block)
            _kept_bytes += nbytes
            return block.view(-1)
    return view.zero_() if zero else view


def _make_room(limit: int, keep) -> None:
    """Let go of free blocks, the least recently used sizes first, until at most ``limit`` bytes are kept (a size
    that is not asked for again, such as a payload whose length changes every step, does not stay); the size
    ``keep`` is the one being asked for."""
    global _kept_bytes
    for key in list(_pool):
        if _kept_bytes <= limit:
            return
        if key == keep:
            continue
        blocks = _pool[key]
        for b in [b for b in blocks if _free(b)]:
            blocks.remove(b)
            _kept_bytes -= b.numel() * b.element_size()
            if _kept_bytes <= limit:
                break
        if not blocks:
            del _pool[key]


def clear() -> None:
    """Forget every kept block (tests; their memory goes once no view of them is left)."""
    global _kept_bytes
    with _lock:
        _pool.clear()
        _kept_bytes = 0
