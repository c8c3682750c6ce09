"""PowerSGD per tensor: with the bucket's layout it compresses each matrix on its own, as PyTorch's hook.

Exchanges run without a process group (``emulate_exchange``), one compressor
per simulated rank, each with its rank's ``BucketContext`` carrying the layout;
the last test trains through the engine at world size 2.
"""
import functools
import math

import pytest
import torch

from distutil import emulate_exchange, run_world

from commlab.engine import compressors, data, models, schedules
from commlab.engine.comm.wfbp import WFBP
from commlab.engine.compressors import make
from commlab.engine.compressors.capabilities import BucketContext
from commlab.engine.compressors.powersgd import matrix_shape, plan_layout

# a conv weight, its bias, a linear weight, its bias, a matrix too small to pay at rank 2, a scalar
SHAPES = [(16, 3, 3, 3), (16,), (30, 20), (30,), (2, 3), ()]
R = 2
MATS = [(16, 27), (30, 20)]  # the two that compress at rank 2: (rows, cols) as (shape[0], -1)
PLAIN = 16 + 30 + 6 + 1


def layout_of(shapes):
    out, off = [], 0
    for s in shapes:
        out.append((off, tuple(s)))
        off += math.prod(s)
    return out, off


LAYOUT, N = layout_of(SHAPES)


def made(n_ranks=2, **params):
    return [make("powersgd", **{"rank": R, "start_iter": 0, **params}) for _ in range(n_ranks)]


def exchange(comps, ts, log=None, sent=None, layout=LAYOUT):
    """One exchange of ``comps`` (rank r's context: bucket 0, rank r, ``layout``), as emulate_exchange."""
    buckets = [BucketContext(0, r, layout) for r in range(len(comps))]
    return emulate_exchange(comps, ts, log, buckets=buckets, sent=sent)


def pieces(flat):
    return [flat[off:off + math.prod(s)].view(s) for off, s in LAYOUT]


def low_rank_buckets(bases, n_ranks, dtype=torch.float64):
    """One bucket per rank: every matrix in a shared rank-R row/column space (so the average
    is rank R as well), every vector and the small matrix arbitrary."""
    out = []
    for _ in range(n_ranks):
        parts = []
        for s in SHAPES:
            if math.prod(s) in (16 * 27, 30 * 20):
                u, v = bases[s]
                parts.append((u @ torch.randn(R, R, dtype=dtype) @ v.t()).reshape(-1))
            else:
                parts.append(torch.randn(s, dtype=dtype).reshape(-1))
        out.append(torch.cat(parts))
    return out


def test_plan_follows_shapes_and_rate():
    plan = plan_layout(LAYOUT, N, R, 2.0)
    assert [(rows, cols) for _, rows, cols in plan.mats] == MATS
    # the bias, small matrix and scalar sit between/after the matrices: merged runs of plain elements
    assert plan.plain == ((16 * 27, 16), (16 * 27 + 16 + 600, 30 + 6 + 1))
    assert (plan.p_numel, plan.q_numel, plan.plain_numel) == ((16 + 30) * R, (27 + 20) * R, PLAIN)
    # rank 11 at rate 1 no longer pays for the conv (11 * 43 >= 432) but still for the linear (11 * 50 < 600)
    assert [(r, c) for _, r, c in plan_layout(LAYOUT, N, 11, 1.0).mats] == [(30, 20)]
    assert plan_layout(LAYOUT, N + 1, R, 2.0) is None  # a layout for another bucket: flat mode
    with pytest.raises(ValueError, match="tile"):
        plan_layout([(0, (4, 4)), (20, (4,))], 20, R, 2.0)


def test_low_rank_matrices_exact_and_vectors_exact_with_two_ranks():
    torch.manual_seed(21)
    bases = {s: (torch.randn(s[0], R, dtype=torch.float64), torch.randn(math.prod(s[1:]), R, dtype=torch.float64))
             for s in SHAPES if math.prod(s) in (16 * 27, 30 * 20)}
    comps = made()
    for step in range(2):
        ts = low_rank_buckets(bases, 2)
        avg = (ts[0] + ts[1]) / 2
        outs = exchange(comps, [t.clone() for t in ts])
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)  # every rank decodes the same average
        for (off, s), got, want in zip(LAYOUT, pieces(outs[0]), pieces(avg)):
            if len(s) >= 2 and math.prod(s) > 6:
                err = float((got - want).norm() / want.norm())
                assert err < 1e-10, (step, s, err)
            else:  # sent as they are: bit-exact, and nothing held back
                assert torch.equal(got, want), (step, s)
                assert torch.all(comps[0].residual[off:off + math.prod(s)] == 0)
    # at rank 1 the rank-2 matrices cannot be exact: the check has teeth
    c1 = made(rank=1)
    ts = low_rank_buckets(bases, 2)
    outs = exchange(c1, [t.clone() for t in ts])
    got, want = pieces(outs[0])[2], pieces((ts[0] + ts[1]) / 2)[2]
    assert float((got - want).norm() / want.norm()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_rounds_one_tensor_each_and_bytes(dtype):
    comps = made(start_iter=1)
    first = (16 + 30) * R + PLAIN  # every P_i, then the plain values
    second = (27 + 20) * R  # every Q_i
    es = torch.empty(0, dtype=dtype).element_size()
    for step in range(3):
        log, sent = [], []
        ts = [torch.randn(N, dtype=dtype) for _ in comps]
        exchange(comps, ts, log, sent)
        if step == 0:  # start_iter: one plain all-reduce
            assert log == [("allreduce", [(N,)])] and sent[0] == N * es
        else:
            assert log == [("allreduce", [(first,)]), ("allreduce", [(second,)])]
            assert sent[0] == (first + second) * es
            assert first + second < N / 3


def test_nothing_to_compress_is_one_plain_round():
    c = make("powersgd", rank=1, start_iter=0)
    layout, n = layout_of([(10,), (3, 2), (7,)])
    t = torch.randn(n)
    log, sent = [], []
    (out,) = exchange([c], [t.clone()], log, sent, layout)
    assert log == [("allreduce", [(n,)])] and sent == [n * 4]
    torch.testing.assert_close(out, t)


def test_error_feedback_loses_nothing():
    torch.manual_seed(22)
    (c,) = made(1, rank=1)
    fed, sent = torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    for _ in range(5):
        g = torch.randn(N, dtype=torch.float64)
        fed += g
        (out,) = exchange([c], [g.clone()])
        sent += out
    assert c.residual.shape == (N,)  # bucket coordinates, no padding
    torch.testing.assert_close(sent + c.residual, fed)
    assert float(c.residual.norm()) > 1e-3  # rank 1 of random matrices is lossy


def test_state_dict_round_trip_carries_the_factors():
    torch.manual_seed(23)
    (a,) = made(1, start_iter=1)
    for _ in range(3):
        exchange([a], [torch.randn(N)])
    state = a.state_dict()
    assert state["qs"].numel() == (27 + 20) * R and state["residual"].shape == (N,) and state["step"] == 3
    (b,) = made(1, start_iter=1)
    b.load_state_dict(state)
    (fresh,) = made(1, start_iter=1)
    fresh.step = 3
    g = torch.randn(N)
    (oa,), (ob,), (of,) = (exchange([c], [g.clone()]) for c in (a, b, fresh))
    torch.testing.assert_close(oa, ob, rtol=0, atol=0)
    assert not torch.equal(oa, of)  # the warm start and residual matter, so the check has teeth


def test_without_a_matching_layout_the_bucket_is_one_flat_matrix():
    torch.manual_seed(24)
    rows, cols = matrix_shape(N)
    ts = [torch.randn(N) for _ in range(2)]
    outs = {}
    for name, layout in (("none", None), ("other bucket", layout_of([(N + 5,)])[0])):
        comps = made()
        log = []
        outs[name] = exchange(comps, [t.clone() for t in ts], log, layout=layout)[0]
        assert log == [("allreduce", [(rows, R)]), ("allreduce", [(cols, R)])]
        assert comps[0].qs is None and comps[0].residual.numel() == rows * cols
    torch.testing.assert_close(outs["none"], outs["other bucket"], rtol=0, atol=0)


# -- through the engine, world size 2 ------------------------------------------------

STEPS = 100


def _train(rank, world, steps):
    ds = data.load("digits", seed=0)
    torch.manual_seed(0)
    model = models.build("cnn", ds.info)
    dp = WFBP(model, functools.partial(schedules.build, "bucket", cap_mb=25),
              lambda: compressors.make("powersgd", rank=1))
    (b,) = dp.buckets  # one bucket for the whole model: the case a flat matrix cannot learn
    layout = [(o, tuple(s)) for o, s in b.context.layout]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = data.ShardSampler(ds.size("train"), 32, rank, world, seed=0)
    for _ in range(steps):
        x, y = ds.batch("train", next(sampler))
        models.loss_fn(model(x), y).backward()
        dp.finish()
        opt.step()
        dp.zero_grad()
    sent = dp.step_bytes
    dp.close()
    right = 0
    with torch.no_grad():
        for idx in data.eval_batches(ds.size("test"), 256, 0, 1):
            x, y = ds.batch("test", idx)
            right += models.correct(model(x), y)[0]
    shapes = [tuple(p.shape) for p in b.params]
    return right / ds.size("test"), layout, shapes, sent, [p.detach().clone() for p in model.parameters()]


def test_cnn_one_bucket_rank1_learns_digits():
    """Flat PowerSGD at rank 1 stays at chance here (10% after 300 steps); per tensor it learns."""
    res = run_world(_train, STEPS)
    acc, layout, shapes, sent, params = res[0]
    offsets = [0]
    for s in shapes[:-1]:
        offsets.append(offsets[-1] + math.prod(s))
    assert layout == list(zip(offsets, shapes))  # the communicator describes the bucket as it is
    plan = plan_layout(layout, sum(math.prod(s) for s in shapes), 1, 2.0)
    assert sent == (plan.p_numel + plan.plain_numel + plan.q_numel) * 4
    assert acc > 0.8, acc  # measured 0.93 (chance is 0.1)
    for a, b in zip(params, res[1][4]):
        torch.testing.assert_close(a, b)  # ranks applied the same update
