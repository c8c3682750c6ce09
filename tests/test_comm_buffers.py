"""The reused CPU buffers of the collectives (commlab/engine/comm/buffers.py): a block comes back only once nothing views
it, and the engine's payload all-gather and gloo reduce-scatter, which take their buffers there, never hand a caller
bytes another call overwrites."""
import time

import pytest
import torch

from commlab.engine.comm import buffers
from distutil import run_world


def kept_bytes() -> int:
    """Bytes the pool holds (its own running count)."""
    return buffers._kept_bytes

BIG = buffers.MIN_BYTES // 4  # float32 elements of a pooled block


@pytest.fixture(autouse=True)
def fresh_pool():
    buffers.clear()
    yield
    buffers.clear()


def test_a_block_comes_back_only_when_nothing_views_it():
    cpu = torch.device("cpu")
    a = buffers.take(BIG, torch.float32, cpu)
    ptr = a.data_ptr()
    held = a[10:20].view(2, 5)  # what a caller keeps: a view of a view
    del a
    b = buffers.take(BIG, torch.float32, cpu)
    assert b.data_ptr() != ptr, "a block still viewed was handed out again"
    del held, b
    c = buffers.take(BIG, torch.float32, cpu)
    assert c.data_ptr() == ptr, "a free block was not reused"
    assert kept_bytes() == 2 * BIG * 4


def test_zeroed_on_request_when_reused():
    cpu = torch.device("cpu")
    a = buffers.take(BIG, torch.float32, cpu)
    a.fill_(7.0)
    del a
    b = buffers.take(BIG, torch.float32, cpu, zero=True)
    assert not b.any()


def test_small_blocks_and_a_full_pool_are_not_kept(monkeypatch):
    cpu = torch.device("cpu")
    small = buffers.take(16, torch.float32, cpu)
    ptr = small.data_ptr()
    assert kept_bytes() == 0
    del small
    monkeypatch.setattr(buffers, "POOL_BYTES", BIG * 4)
    a = buffers.take(BIG, torch.float32, cpu)
    b = buffers.take(BIG, torch.float32, cpu)  # over the budget: fresh, not kept
    assert kept_bytes() == BIG * 4 and a.data_ptr() != b.data_ptr() != ptr
    monkeypatch.setattr(buffers, "PER_KEY", 1)
    monkeypatch.setattr(buffers, "POOL_BYTES", 1 << 40)
    c = buffers.take(BIG, torch.float32, cpu)  # a is still held and the key holds one block already
    assert kept_bytes() == BIG * 4 and c.data_ptr() != a.data_ptr()


def test_sizes_not_asked_for_again_make_room_for_new_ones(monkeypatch):
    """A payload whose length changes every step asks for a new size each time: the free blocks of the sizes least
    recently asked for go, so the pool stays within its budget and keeps the sizes in use."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(buffers, "POOL_BYTES", 2 * BIG * 4)
    held = buffers.take(BIG, torch.float32, cpu)
    for extra in range(1, 6):  # sizes BIG + 1, BIG + 2, ...: each asked once, then dropped
        buffers.take(BIG + extra, torch.float32, cpu)
        assert kept_bytes() <= 2 * BIG * 4
    assert (BIG, torch.float32) in buffers._pool, "a block in use was let go of"
    assert (BIG + 5, torch.float32) in buffers._pool and (BIG + 1, torch.float32) not in buffers._pool
    assert kept_bytes() == sum(b.numel() * 4 for bs in buffers._pool.values() for b in bs)
    del held


def _payloads_survive_the_next_call(rank, world):
    from commlab.engine.comm import buffers as pool
    from commlab.engine.comm.collectives import issue_allgather, issue_reduce_scatter
    pool.clear()
    n = pool.MIN_BYTES // 4 + 3  # pooled, and padded in the send buffer
    first = issue_allgather([torch.full((n,), float(rank + 1))]).wait()
    second = issue_allgather([torch.full((n,), float(10 * (rank + 1)))]).wait()  # while first's views are held
    kept = [p[0].clone() for p in first]
    ptr = first[0][0].data_ptr()
    del first
    for _ in range(200):  # gloo's thread lets go of a finished work's tensors a moment after wait() returns
        if all(pool._free(b) for blocks in pool._pool.values() for b in blocks if b.data_ptr() == ptr):
            break
        time.sleep(0.005)
    third = issue_allgather([torch.full((n,), float(100 * (rank + 1)))]).wait()
    t = torch.arange(2 * n, dtype=torch.float32) * (rank + 1)
    rs1 = issue_reduce_scatter(t, via_alltoall=True, scratch={}).wait()[0]
    rs2 = issue_reduce_scatter(t * 2, via_alltoall=True, scratch={}).wait()[0]
    return {"first": [x[:3].tolist() + [float(x.sum())] for x in kept],
            "second": [p[0][:3].tolist() for p in second], "third": [p[0][:3].tolist() for p in third],
            "reused": third[0][0].data_ptr() == ptr, "rs": (rs1[:2].tolist(), rs2[:2].tolist()),
            "rs_apart": rs1.data_ptr() != rs2.data_ptr()}


def test_payloads_a_caller_holds_are_not_overwritten_by_the_next_call():
    for rank, r in enumerate(run_world(_payloads_survive_the_next_call)):
        n = buffers.MIN_BYTES // 4 + 3
        assert r["first"] == [[1.0] * 3 + [1.0 * n], [2.0] * 3 + [2.0 * n]], rank
        assert r["second"] == [[10.0] * 3, [20.0] * 3] and r["third"] == [[100.0] * 3, [200.0] * 3], rank
        assert r["reused"], "the receive buffer was not reused once its payloads were dropped"
        lo = rank * n  # rank r keeps chunk r of the sum over ranks of t * (rank + 1): 3 * t
        assert r["rs"] == ([3.0 * lo, 3.0 * (lo + 1)], [6.0 * lo, 6.0 * (lo + 1)]) and r["rs_apart"], rank
