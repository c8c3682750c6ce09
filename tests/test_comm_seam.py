"""The compressor seam carries all-reduced, all-gathered (ragged, even empty) and multi-round payloads."""
import functools
import inspect

import pytest
import torch
import torch.distributed as dist

from distutil import run_world
from commlab.engine import schedules
from commlab.engine.comm import modes
from commlab.engine.comm.modes import MODES
from commlab.engine.comm.collectives import (issue_all_to_all, issue_allgather, issue_allgather_into, issue_reduce_scatter,
                                     pack_offsets)
from commlab.engine.comm.exchange import local_collective
from commlab.engine.compressors.base import Compressor, Round
from commlab.engine.compressors.capabilities import Capabilities


class GatherIdentity(Compressor):
    """Not summable: every rank decodes every rank's full payload."""
    name = "gather-identity"
    capabilities = Capabilities(summable=False)

    def compress(self, t):
        return [t.clone()], None

    def decompress(self, payload, ctx):
        return payload[0]


class PositiveOnly(Compressor):
    """Ragged payload: indices and values of the positive entries (empty if none)."""
    name = "positive-only"
    capabilities = Capabilities(summable=False)

    def compress(self, t):
        idx = (t > 0).nonzero().flatten()
        return [idx, t[idx]], (t.numel(), t.dtype, t.shape)

    def decompress(self, payload, ctx):
        n, dtype, shape = ctx
        out = torch.zeros(n, dtype=dtype)
        out[payload[0]] = payload[1]
        return out.view(shape)


class ScaledTwoRound(Compressor):
    """Two all-reduce rounds, like PowerSGD: first a shared scale, then the scaled tensor."""
    name = "two-round"
    capabilities = Capabilities(rounds=2)

    def exchange(self, t, world_size, bucket):
        (amax,) = yield Round("allreduce", [t.abs().max().reshape(1)])
        scale = amax.clamp_min(1e-12)
        (summed,) = yield Round("allreduce", [t / scale])
        return summed.mul_(scale).div_(world_size)


def _all_cases(rank, world, cases):
    return [_grads(rank, world, *c) for c in cases]


def _grads(rank, world, comp_name, sched, mode, positive_on_rank0_only):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    ref = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(100 + rank)
    x = torch.randn(4, 6)

    def loss_of(m):
        out = m(x)
        # positive-only: rank 1 has all-zero gradients, so its payloads are empty
        return out.sum() * (0.0 if positive_on_rank0_only and rank == 1 else 1.0)

    # reference: plain backward and a hand-written average
    ref_model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p, r in zip(ref_model.parameters(), ref):
            p.copy_(r)
    loss_of(ref_model).backward()
    expect = []
    for p in ref_model.parameters():
        g = p.grad.clone()
        if comp_name == "positive-only":
            g = g.clamp_min(0)
        dist.all_reduce(g)
        expect.append(g / world)
    comp = {"gather-identity": GatherIdentity, "positive-only": PositiveOnly, "two-round": ScaledTwoRound}[comp_name]
    dp = MODES[mode](model, functools.partial(schedules.build, sched), comp)
    for _ in range(2):  # twice: state from step 1 must not leak into step 2
        loss_of(model).backward()
        dp.finish()
        got = [p.grad.clone() for p in model.parameters()]
        dp.zero_grad()
    sizes = [b.sent for b in dp.buckets]
    return got, expect, sizes


def test_seam_averages_like_allreduce():
    cases = [(comp, sched, mode, comp == "positive-only")
             for comp in ("gather-identity", "positive-only", "two-round")
             for sched, mode in (("layerwise", "wfbp"), ("allinone", "sync"), ("layerwise", "sync"))]
    res = run_world(_all_cases, cases)  # one process group for every case: spawning costs seconds
    for i, case in enumerate(cases):
        for rank in range(2):
            got, expect, sizes = res[rank][i]
            for g, e in zip(got, expect):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} rank {rank}: {m}")
        if case[0] == "positive-only":
            assert max(res[1][i][2]) == 0 and max(res[0][i][2]) > 0, case  # empty payloads on rank 1


def _ragged_allgather(rank, world):
    mine = [torch.arange(rank * 3, dtype=torch.int64), torch.full((2, rank + 1), float(rank)),
            torch.full((rank + 3,), 7, dtype=torch.uint8), torch.tensor([float(rank)], dtype=torch.float64)]
    return issue_allgather(mine).wait()


def test_allgather_ragged_shapes_and_dtypes():
    res = run_world(_ragged_allgather)
    for out in res:
        assert out[0][0].numel() == 0 and out[1][0].tolist() == [0, 1, 2]
        assert out[0][1].shape == (2, 1) and out[1][1].shape == (2, 2) and out[1][1].dtype == torch.float32
        assert out[1][1].eq(1.0).all()
        # a 1-byte-per-element tensor before an 8-byte one: offsets stay aligned
        assert out[0][2].tolist() == [7, 7, 7] and out[1][2].numel() == 4
        assert out[0][3].item() == 0.0 and out[1][3].item() == 1.0 and out[1][3].dtype == torch.float64


def test_every_mode_is_made_by_name_with_the_same_arguments():
    """modes.make builds any comm mode from one argument list, and names the field and the allowed values
    for a mode it does not know (before anything joins a process group)."""
    shapes = {name: list(inspect.signature(cls.__init__).parameters) for name, cls in MODES.items()}
    assert list(MODES) == ["sync", "wfbp", "dear"]
    assert all(s == ["self", "model", "layout", "plan", "timeline", "group", "link", "broadcast_from_rank0"]
               for s in shapes.values()), shapes
    with pytest.raises(ValueError, match=r"^comm\.mode: 'ring' is not a comm mode; allowed: sync, wfbp, dear$"):
        modes.make("ring", torch.nn.Linear(2, 2), lambda infos: [[0, 1]], lambda: None)


def test_local_collectives_reduce_scatter_and_all_to_all_as_ranks_would():
    """The driver's in-process collectives for dear's rounds: rank j gets chunk j of the sum, and every
    rank's part j; copies, as from a real collective."""
    a, b = torch.arange(4.0), 10 * torch.arange(4.0)
    (ra,), (rb,) = local_collective("reduce_scatter", [[a], [b]])
    assert ra.tolist() == [0.0, 11.0] and rb.tolist() == [22.0, 33.0]

    def part(i, j):
        return [torch.full((2,), 10.0 * i + j), torch.tensor([i, j], dtype=torch.int8)]
    sent = [[part(i, j) for j in range(2)] for i in range(2)]
    got = local_collective("all_to_all", sent)
    for j in range(2):
        assert [[x.tolist() for x in p] for p in got[j]] == [[x.tolist() for x in part(i, j)] for i in range(2)]
        assert all(x is not y for p, q in zip(got[j], (sent[0][j], sent[1][j])) for x, y in zip(p, q))
    with pytest.raises(ValueError, match="allowed: allreduce, allgather, reduce_scatter, all_to_all$"):
        local_collective("broadcast", [[a]])


def test_packed_payloads_start_at_8_byte_offsets():
    assert pack_offsets([3, 8, 0, 9, 1]) == ([0, 8, 16, 16, 32], 40)
    assert pack_offsets([]) == ([], 0)


def _all_to_all(rank, world):
    """Each rank sends rank j a payload of an fp32 and an int8 tensor (sizes that leave alignment gaps)."""
    parts = [[torch.full((3,), float(10 * rank + j)), torch.full((5,), rank - j, dtype=torch.int8)]
             for j in range(world)]
    scratch = {}
    first = issue_all_to_all(parts, scratch=scratch)
    got = [[x.clone() for x in p] for p in first.wait()]
    send = scratch["send"]
    again = [[x.clone() for x in p] for p in issue_all_to_all(parts, scratch=scratch).wait()]
    return got, first.nbytes, scratch["send"] is send and [[x.tolist() for x in p] for p in again] == \
        [[x.tolist() for x in p] for p in got]


def test_all_to_all_of_payloads_over_a_process_group():
    for rank, (got, nbytes, reused) in enumerate(run_world(_all_to_all)):
        assert reused  # the second call packs into the same send buffer and reads back the same payloads
        assert nbytes == 2 * (16 + 8)  # per destination: 12 bytes at 0 (padded to 16), 5 at 16 (to 24)
        for i, (f, c) in enumerate(got):
            assert f.dtype == torch.float32 and f.tolist() == [10.0 * i + rank] * 3
            assert c.dtype == torch.int8 and c.tolist() == [i - rank] * 5


def _chunked_exchanges(rank, world):
    """The all-to-alls (of payloads, and dear's reduce-scatter) and the two-rank all-gathers, cut into gloo
    point-to-point messages of 64 bytes, against the same calls as one collective; two in flight at once."""
    from commlab.engine.comm import collectives as C
    old = C.P2P_CHUNK
    parts = [[torch.arange(100, dtype=torch.float32) + 1000 * rank + j, torch.full((37,), rank - j, dtype=torch.int8)]
             for j in range(world)]
    t = torch.arange(world * 50, dtype=torch.float32) * (rank + 1)
    mine = [torch.arange(40 + rank, dtype=torch.float64), torch.full((3, rank + 2), float(rank))]
    shard = torch.full((60,), float(rank + 1))

    def run():
        a2a = issue_all_to_all(parts, scratch={})
        rs = issue_reduce_scatter(t, via_alltoall=True, scratch={})  # in flight with the all-to-all
        res = {"works": len(a2a.works), "a2a": [[x.tolist() for x in p] for p in a2a.wait()],
               "rs": rs.wait()[0].tolist()}
        if world == 2:
            res["ag"] = [[x.tolist() for x in p] for p in issue_allgather(mine).wait()]
            out = torch.empty(120)
            res["into"] = issue_allgather_into(out, shard).wait()[0].tolist()
        return res
    try:
        C.P2P_CHUNK = 64
        chunked = run()
        C.P2P_CHUNK = 1 << 40
        whole = run()
    finally:
        C.P2P_CHUNK = old
    return chunked, whole


@pytest.mark.parametrize("world", [2, 3])
def test_chunked_exchanges_give_what_one_collective_gives(world):
    for rank, (chunked, whole) in enumerate(run_world(_chunked_exchanges, world=world)):
        assert chunked["works"] > 2 and whole["works"] == 1, "the chunked path was not taken, or the whole one was"
        for key in whole:
            if key != "works":
                assert chunked[key] == whole[key], (rank, key)
        assert whole["rs"] == [sum(r + 1 for r in range(world)) * x for x in range(rank * 50, rank * 50 + 50)]
        if world == 2:
            assert whole["into"] == [1.0] * 60 + [2.0] * 60
