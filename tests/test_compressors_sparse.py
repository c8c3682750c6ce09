"""Sparsifiers, PowerSGD and Count Sketch: payload layouts, selection semantics, shared seeds, state.

Exchanges run without a process group: ``emulate`` plays the communicator for
several simulated ranks (one compressor instance per rank).
"""
import math

import pytest
import torch

from distutil import emulate_exchange

from commlab.engine.compressors import make
from commlab.engine.compressors.base import nbytes
from commlab.engine.compressors.capabilities import BucketContext
from commlab.engine.compressors.countsketch import median_rows
from commlab.engine.compressors.powersgd import orthogonalize_
from commlab.engine.compressors import REGISTRY as COMPRESSORS
from commlab.engine.compressors.kernels import top_indices

NAMES = ("topk", "randomk", "threshold", "dgc", "powersgd", "countsketch")
SMALL = {"topk": {"ratio": 0.2}, "randomk": {"ratio": 0.2}, "threshold": {"threshold": 0.5},
         "dgc": {"ratio": 0.2}, "powersgd": {"rank": 1, "start_iter": 0}, "countsketch": {"ratio": 0.2}}


def ref_topk_set(x, k):
    order = sorted(range(x.numel()), key=lambda i: -abs(float(x[i])))
    return set(order[:k])


# -- contracts shared by the six ----------------------------------------------

def test_registry_holds_all_six():
    assert set(NAMES) <= set(COMPRESSORS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1,), (2,), (37,), (8, 13), (3, 4, 5), (1001,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_shape_dtype(name, shape, dtype):
    torch.manual_seed(0)
    t = torch.randn(shape, dtype=dtype)
    c = make(name, **SMALL[name])
    payload, ctx = c.compress(t.clone())
    out = c.decompress(payload, ctx)
    assert out.shape == t.shape and out.dtype == dtype and out.device == t.device
    assert torch.isfinite(out).all()
    (ex,) = emulate_exchange([make(name, **SMALL[name])], [t.clone()])
    assert ex.shape == t.shape and ex.dtype == dtype


@pytest.mark.parametrize("name", ("topk", "threshold", "dgc"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sparse_payload_keeps_alignment(name, dtype):
    """The communicator packs payload tensors back to back as bytes and views each one back:
    every tensor's byte offset must be a multiple of its element size (odd k on purpose)."""
    t = torch.randn(11, dtype=torch.float32).to(dtype)  # k = ceil(0.2 * 11) = 3
    params = {"threshold": 0.3} if name == "threshold" else {"ratio": 0.2}
    c = make(name, **params)
    payload, ctx = c.compress(t)
    off = 0
    for x in payload:
        assert off % x.element_size() == 0, [(y.dtype, y.numel()) for y in payload]
        off += x.numel() * x.element_size()
    blob = torch.cat([x.reshape(-1).view(torch.uint8) for x in payload])
    back, off = [], 0
    for x in payload:
        size = x.numel() * x.element_size()
        back.append(blob[off:off + size].view(x.dtype))
        off += size
    torch.testing.assert_close(c.decompress(back, ctx), c.decompress(payload, ctx))


@pytest.mark.parametrize("name", ("topk", "threshold", "dgc", "randomk", "countsketch"))
def test_exchange_writes_average_into_bucket(name):
    torch.manual_seed(3)
    ts = [torch.randn(500) for _ in range(3)]
    params = dict(SMALL[name])
    comps = [make(name, **params) for _ in ts]
    refs = [make(name, **params) for _ in ts]
    expect = sum(r.decompress(*r.compress(t.clone())) for r, t in zip(refs, ts)) / 3
    if name == "countsketch":  # linear: the decode of the summed table, not the sum of decodes
        tables = [r.sketch(t) for r, t in zip(refs, ts)]
        idx, vals = refs[0].heavy(sum(tables), 500)
        expect = torch.zeros(500)
        expect[idx] = vals / 3
    bufs = [t.clone() for t in ts]
    outs = emulate_exchange(comps, bufs)
    for o, b in zip(outs, bufs):
        torch.testing.assert_close(o, expect)
        assert o.data_ptr() == b.data_ptr()  # no fresh dense tensor per step


# -- top-k ---------------------------------------------------------------------

@pytest.mark.parametrize("n,ratio,k", [(1000, 0.05, 50), (7, 0.01, 1), (100, 0.07, 7), (10, 1.0, 10), (3, 0.5, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_keeps_exactly_k_largest(n, ratio, k, dtype):
    torch.manual_seed(n)
    x = torch.randn(n, dtype=dtype)
    c = make("topk", ratio=ratio)
    payload, ctx = c.compress(x)
    assert nbytes(payload) == k * (x.element_size() + 4)
    out = c.decompress(payload, ctx)
    kept = set(torch.nonzero(out).view(-1).tolist())
    assert kept == ref_topk_set(x, k)
    assert torch.equal(out[list(kept)], x[list(kept)])


def test_topk_large_bucket_sampled_path_is_exact():
    """Above the sampling size the selection goes through a sampled threshold; the set must not change."""
    torch.manual_seed(4)
    n, k = 300_000, 3000
    for x in (torch.randn(n), torch.randn(n).pow(3), torch.rand(n)):
        c = make("topk", ratio=0.01)
        out = c.decompress(*c.compress(x))
        got = torch.nonzero(out).view(-1)
        assert got.numel() == k
        want = torch.topk(x.abs(), k).indices
        assert torch.equal(got.sort().values, want.sort().values)
    # ties at zero: only 10 entries are nonzero, the threshold estimate is 0
    a = torch.zeros(n)
    a[torch.arange(10) * 777] = torch.arange(1.0, 11.0)
    idx = top_indices(a, 2000, torch.Generator().manual_seed(0))
    assert idx.numel() == 2000 and set((torch.arange(10) * 777).tolist()) <= set(idx.tolist())


def test_topk_exchange_bytes_and_average():
    torch.manual_seed(5)
    ts = [torch.randn(400, dtype=torch.float64) for _ in range(2)]
    comps = [make("topk", ratio=0.1) for _ in ts]
    log, sent = [], []
    outs = emulate_exchange(comps, [t.clone() for t in ts], log, sent=sent)
    assert log == [("allgather", [(40,), (40,)])]
    assert sent == [40 * (8 + 4)] * 2
    expect = torch.zeros(400, dtype=torch.float64)
    for t in ts:
        keep = list(ref_topk_set(t, 40))
        expect[keep] += t[keep] / 2
    torch.testing.assert_close(outs[0], expect)


# -- random-k --------------------------------------------------------------------

def test_randomk_indices_shared_by_ranks_and_fresh_each_step():
    a, b = make("randomk", ratio=0.05), make("randomk", ratio=0.05)
    other_bucket = make("randomk", ratio=0.05)
    bucket1 = BucketContext(index=1)
    other_seed = make("randomk", ratio=0.05, seed=7)
    x = torch.randn(1000)
    seen = []
    for _ in range(3):
        ia, ib = a.compress(x)[1].idx, b.compress(x, BucketContext(rank=3))[1].idx  # another rank: the same draw
        assert torch.equal(ia, ib)
        assert not torch.equal(ia, other_bucket.compress(x, bucket1)[1].idx)
        assert not torch.equal(ia, other_seed.compress(x)[1].idx)
        seen.append(ia)
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


@pytest.mark.parametrize("n,ratio", [(1000, 0.01), (997, 0.1), (5, 0.5), (1, 0.01)])
def test_randomk_draws_one_distinct_index_per_stratum(n, ratio):
    k = max(1, math.ceil(round(ratio * n, 9)))
    c = make("randomk", ratio=ratio)
    for _ in range(20):
        payload, ctx = c.compress(torch.randn(n))
        idx = ctx.idx.tolist()
        assert len(idx) == k == len(set(idx)) and nbytes(payload) == k * 4
        # stratum j is [floor(j n / k), floor((j + 1) n / k))
        assert all(j * n // k <= i < (j + 1) * n // k for j, i in enumerate(idx))


def _mean_of_draws(c, x, draws):
    total = torch.zeros_like(x)
    for _ in range(draws):
        total += c.decompress(*c.compress(x))
    return total / draws


def test_randomk_unbiased_mean_within_variance_tolerance():
    """E[out] = x when unbiased; each coordinate's sample mean is within 5 standard errors, and the
    standardised errors have unit variance (which checks the variance formula (size - 1) * x^2 too)."""
    torch.manual_seed(6)
    n, ratio, draws = 997, 0.1, 3000
    k = 100
    size = torch.tensor([(j + 1) * n // k - j * n // k for j in range(k)], dtype=torch.float64)
    size_of = torch.repeat_interleave(size, size.long())  # stratum size of every coordinate
    x = torch.randn(n, dtype=torch.float64)
    std_err = x.abs() * (size_of - 1).sqrt() / math.sqrt(draws)
    z = (_mean_of_draws(make("randomk", ratio=ratio, unbiased=True), x, draws) - x) / std_err
    assert z.abs().max() < 5
    assert 0.8 < z.pow(2).mean() < 1.2
    # the default (biased) variant fails the same check: the test can fail
    zb = (_mean_of_draws(make("randomk", ratio=ratio), x, 300) - x) / std_err
    assert zb.abs().max() > 5


def test_randomk_is_summable_and_averages_shared_entries():
    torch.manual_seed(7)
    ts = [torch.randn(300) for _ in range(3)]
    comps = [make("randomk", ratio=0.1, unbiased=True) for _ in ts]
    probe = make("randomk", ratio=0.1)
    idx = probe.indices(300, 0)
    log, sent = [], []
    outs = emulate_exchange(comps, [t.clone() for t in ts], log, sent=sent)
    assert log == [("allreduce", [(30,)])] and sent[0] == 30 * 4
    expect = torch.zeros(300)
    expect[idx] = (ts[0] + ts[1] + ts[2])[idx] / 3 * 10  # strata of exactly 10: scale n / k
    torch.testing.assert_close(outs[1], expect)


def test_randomk_step_is_checkpointed():
    a = make("randomk", ratio=0.1)
    for _ in range(4):
        a.compress(torch.randn(100))
    b = make("randomk", ratio=0.1)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.compress(torch.randn(100))[1].idx, b.compress(torch.randn(100))[1].idx)


# -- threshold ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_threshold_keeps_exactly_entries_at_or_above(dtype):
    x = torch.tensor([0.5, -0.5, 0.49, -0.7, 0.0, 2.0, -0.2], dtype=dtype)
    c = make("threshold", threshold=0.5)
    payload, ctx = c.compress(x)
    out = c.decompress(payload, ctx)
    assert torch.equal(out, torch.tensor([0.5, -0.5, 0, -0.7, 0, 2.0, 0], dtype=dtype))
    assert nbytes(payload) == 4 * (x.element_size() + 4)


def test_threshold_payload_can_be_empty():
    c = make("threshold", threshold=10.0)
    x = torch.randn(3, 5)
    payload, ctx = c.compress(x)
    assert nbytes(payload) == 0 and all(p.numel() == 0 for p in payload)
    assert torch.equal(c.decompress(payload, ctx), torch.zeros(3, 5))
    # one rank has nothing to send, the other has two entries
    ts = [torch.full((6,), 0.1), torch.tensor([0.0, 12.0, 0.0, -20.0, 0.0, 0.0])]
    comps = [make("threshold", threshold=10.0) for _ in ts]
    sent = []
    outs = emulate_exchange(comps, [t.clone() for t in ts], sent=sent)
    assert sent == [0, 2 * 8]
    torch.testing.assert_close(outs[0], torch.tensor([0.0, 6.0, 0.0, -10.0, 0.0, 0.0]))


# -- DGC ---------------------------------------------------------------------------

def test_dgc_warmup_density_schedule():
    c = make("dgc", ratio=0.001, warmup_steps=4)
    got = [c.density(s) for s in range(7)]
    # the paper's warm-up: 75%, 93.75%, 98.4375%, 99.6%, 99.9% sparsity (one value per epoch)
    paper = [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001, 0.001]
    for g, p in zip(got, paper):
        assert abs(g - p) <= 0.02 * p
    assert got[0] == 0.25 and got[4] == 0.001
    assert all(a > b for a, b in zip(got[:4], got[1:5]))
    # entries actually sent follow the schedule
    c = make("dgc", ratio=0.01, warmup_steps=3)
    sent = [c.compress(torch.randn(1000))[0][1].numel() for _ in range(5)]
    want = [math.ceil(0.25 * (0.04 ** (s / 3)) * 1000 - 1e-9) for s in range(3)] + [10, 10]
    assert sent == want
    assert make("dgc", ratio=0.5, warmup_steps=3).density(0) == 0.5


def test_dgc_momentum_correction_and_factor_masking():
    torch.manual_seed(8)
    n, m, k = 60, 0.9, 6
    c = make("dgc", ratio=0.1, momentum=m)
    u = torch.zeros(n, dtype=torch.float64)
    v = torch.zeros(n, dtype=torch.float64)
    for step in range(4):
        g = torch.randn(n, dtype=torch.float64)
        payload, ctx = c.compress(g)
        u = m * u + g
        v = v + u
        keep = list(ref_topk_set(v, k))
        expect = torch.zeros(n, dtype=torch.float64)
        expect[keep] = v[keep]
        torch.testing.assert_close(c.decompress(payload, ctx), expect)
        assert nbytes(payload) == k * (8 + 4)
        u[keep] = 0
        v[keep] = 0
        assert torch.all(c.u[keep] == 0) and torch.all(c.v[keep] == 0)
        torch.testing.assert_close(c.u, u)
        torch.testing.assert_close(c.v, v)


def test_dgc_clip_bounds_the_local_gradient():
    c = make("dgc", ratio=0.5, momentum=0.0, clip=0.5)
    g = torch.randn(100) * 10
    c.compress(g)
    # with momentum 0, sent + kept = the clipped gradient
    total = c.u + c.decompress(*make("dgc", ratio=0.5, momentum=0.0, clip=0.5).compress(g))
    assert abs(float(total.norm()) - 0.5) < 1e-5
    torch.testing.assert_close(total, g * (0.5 / g.norm()))


def test_dgc_state_dict_round_trip():
    torch.manual_seed(9)
    a = make("dgc", ratio=0.05, warmup_steps=5)
    for _ in range(3):
        a.compress(torch.randn(200))
    b = make("dgc", ratio=0.05, warmup_steps=5)
    b.load_state_dict(a.state_dict())
    assert b.step == 3
    g = torch.randn(200)
    pa, pb = a.compress(g.clone())[0], b.compress(g.clone())[0]
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    a.u.add_(1.0)  # loaded state is a copy, not shared
    assert not torch.equal(a.u, b.u)


def test_dgc_large_bucket_sends_about_k():
    torch.manual_seed(10)
    c = make("dgc", ratio=0.01, momentum=0.0)
    payload, _ = c.compress(torch.randn(200_000))
    assert 1800 <= payload[1].numel() <= 2000  # sampled threshold, capped at k by top-k


# -- PowerSGD -------------------------------------------------------------------

def _shape(n):
    cols = math.ceil(math.sqrt(n))
    return math.ceil(n / cols), cols


def test_powersgd_reproduces_low_rank_bucket_with_two_ranks():
    torch.manual_seed(11)
    rows, cols, r = 48, 49, 2  # n = 2352: ceil(sqrt) = 49, 2352 / 49 = 48, no padding
    assert _shape(rows * cols) == (rows, cols)
    u, v = torch.randn(rows, r), torch.randn(cols, r)
    comps = [make("powersgd", rank=r, start_iter=0) for _ in range(2)]
    for step in range(2):
        ms = [u @ torch.randn(r, r) @ v.t() for _ in comps]  # both ranks: same column/row space
        avg = (ms[0] + ms[1]) / 2
        outs = emulate_exchange(comps, [m.reshape(-1).clone() for m in ms])
        for o in outs:
            err = float((o.view(rows, cols) - avg).norm() / avg.norm())
            assert err < 1e-4, (step, err)
    # at a lower rank it cannot be exact: the test can fail
    c1 = [make("powersgd", rank=1, start_iter=0) for _ in range(2)]
    ms = [u @ torch.randn(r, r) @ v.t() for _ in c1]
    outs = emulate_exchange(c1, [m.reshape(-1).clone() for m in ms])
    assert float((outs[0].view(rows, cols) - (ms[0] + ms[1]) / 2).norm() / ((ms[0] + ms[1]) / 2).norm()) > 1e-2


def test_powersgd_rounds_and_bytes():
    n, r = 1000, 2
    rows, cols = _shape(n)  # 32 x 32, 24 zeros of padding
    comps = [make("powersgd", rank=r, start_iter=2) for _ in range(2)]
    for step in range(4):
        log, sent = [], []
        ts = [torch.randn(n) for _ in comps]
        outs = emulate_exchange(comps, [t.clone() for t in ts], log, sent=sent)
        if step < 2:
            assert log == [("allreduce", [(n,)])]
            assert sent[0] == n * 4
            torch.testing.assert_close(outs[0], (ts[0] + ts[1]) / 2)
        else:
            assert log == [("allreduce", [(rows, r)]), ("allreduce", [(cols, r)])]
            assert sent[0] == r * (rows + cols) * 4


def test_powersgd_small_buckets_go_uncompressed():
    for n, rank, rate in [(4, 1, 1.0), (10, 1, 2.0), (100, 5, 1.0), (100, 3, 2.0)]:
        rows, cols = _shape(n)
        assert rank * (rows + cols) * rate >= rows * cols
        log, sent = [], []
        c = make("powersgd", rank=rank, start_iter=0, min_compression_rate=rate)
        t = torch.randn(n)
        (out,) = emulate_exchange([c], [t.clone()], log, sent=sent)
        assert log == [("allreduce", [(n,)])] and sent == [n * 4]
        torch.testing.assert_close(out, t)


def test_powersgd_error_feedback_loses_nothing():
    torch.manual_seed(12)
    c = make("powersgd", rank=1, start_iter=0)
    fed, sent = torch.zeros(777, dtype=torch.float64), torch.zeros(777, dtype=torch.float64)
    for _ in range(6):
        g = torch.randn(777, dtype=torch.float64)
        fed += g
        (out,) = emulate_exchange([c], [g.clone()])
        sent += out
    torch.testing.assert_close(sent + c.residual[:777], fed)
    assert torch.all(c.residual[777:] == 0)  # padding never accumulates
    assert float(c.residual.norm()) > 1e-3  # rank 1 of random data is lossy: the check has teeth


def test_powersgd_warm_start_improves_over_steps():
    """Feeding the same full-rank matrix repeatedly, the warm-started Q converges to its top singular vector."""
    torch.manual_seed(13)
    rows, cols = 40, 40
    m = torch.randn(rows, cols, dtype=torch.float64)
    best = torch.linalg.svdvals(m)
    c = make("powersgd", rank=1, start_iter=0)
    for _ in range(30):
        c.residual = None  # measure the approximation alone, without error feedback
        (out,) = emulate_exchange([c], [m.reshape(-1).clone()])
    err = float((out.view(rows, cols) - m).norm())
    optimal = float(best[1:].pow(2).sum().sqrt())  # Eckart-Young: best rank-1 error
    assert err < 1.01 * optimal


def test_powersgd_state_dict_round_trip():
    torch.manual_seed(14)
    a = make("powersgd", rank=2, start_iter=1)
    for _ in range(3):
        emulate_exchange([a], [torch.randn(900)])
    b = make("powersgd", rank=2, start_iter=1)
    b.load_state_dict(a.state_dict())
    g = torch.randn(900)
    (oa,), (ob,) = emulate_exchange([a], [g.clone()]), emulate_exchange([b], [g.clone()])
    torch.testing.assert_close(oa, ob)


def test_powersgd_single_process_view_and_shared_q():
    torch.manual_seed(15)
    rows, cols = _shape(2000)  # 45 x 45, padded
    m = torch.randn(rows, 3) @ torch.randn(3, cols)
    flat = m.reshape(-1)[:2000].clone()
    c = make("powersgd", rank=3)
    payload, ctx = c.compress(flat)
    assert [tuple(p.shape) for p in payload] == [(rows, 3), (cols, 3)]
    # padding breaks exact low rank only in the last row; the full rows are reproduced
    out = c.decompress(payload, ctx)
    assert out.shape == flat.shape
    torch.testing.assert_close(payload[0].t() @ payload[0], torch.eye(3), atol=1e-5, rtol=0)
    # the initial Q depends on the seed and bucket only: ranks agree
    a, b, other = make("powersgd", rank=2), make("powersgd", rank=2), make("powersgd", rank=2)
    x = torch.randn(1000)
    assert torch.equal(a.compress(x)[0][0], b.compress(x, BucketContext(rank=1))[0][0])
    assert not torch.equal(a.compress(x)[0][0], other.compress(x, BucketContext(index=3))[0][0])


def test_orthogonalize_handles_zero_columns():
    p = torch.randn(20, 3)
    p[:, 1] = 0
    orthogonalize_(p)
    assert torch.isfinite(p).all() and torch.all(p[:, 1] == 0)
    q = p[:, [0, 2]]
    torch.testing.assert_close(q.t() @ q, torch.eye(2), atol=1e-5, rtol=0)
    c = make("powersgd", rank=2, start_iter=0)
    (out,) = emulate_exchange([c], [torch.zeros(1000)])
    assert torch.all(out == 0)


# -- Count Sketch -------------------------------------------------------------------

def _sparse(n, nnz, seed):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU, then moved: the same x on every device
    x = torch.zeros(n, dtype=torch.float64, device="cpu")
    idx = torch.randperm(n, generator=g)[:nnz]
    x[idx] = (torch.rand(nnz, generator=g, dtype=torch.float64) + 0.5) * torch.where(
        torch.rand(nnz, generator=g) < 0.5, -1.0, 1.0).double()
    here = torch.empty(0).device  # the tests' device (COMMLAB_TEST_DEVICE, tests/conftest.py)
    return x.to(here), idx.to(here)


def test_countsketch_recovers_heavy_hitters_exactly():
    x, idx = _sparse(100_000, 20, 16)
    c = make("countsketch", rows=5, cols=2000, k=20)
    payload, ctx = c.compress(x)
    assert [tuple(p.shape) for p in payload] == [(5, 2000)] and nbytes(payload) == 5 * 2000 * 8
    out = c.decompress(payload, ctx)
    assert set(torch.nonzero(out).view(-1).tolist()) == set(idx.tolist())
    torch.testing.assert_close(out, x)


def test_countsketch_exchange_averages_heavy_hitters():
    (a, _), (b, _) = _sparse(100_000, 10, 17), _sparse(100_000, 10, 18)
    comps = [make("countsketch", rows=5, cols=2000, k=20) for _ in range(2)]
    log = []
    outs = emulate_exchange(comps, [a.clone(), b.clone()], log)
    assert log == [("allreduce", [(5, 2000)])]
    torch.testing.assert_close(outs[0], (a + b) / 2)
    torch.testing.assert_close(outs[1], (a + b) / 2)


def test_countsketch_is_linear():
    torch.manual_seed(19)
    c = make("countsketch", rows=3, cols=50, k=5)
    a, b = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    torch.testing.assert_close(c.sketch(a) + c.sketch(b), c.sketch(a + b))
    torch.testing.assert_close(c.sketch(2.5 * a), 2.5 * c.sketch(a))
    assert c.sketch(a).abs().sum() > 0


def test_countsketch_hashes_shared_by_seed_and_bucket():
    x = torch.randn(5000)
    a, b = make("countsketch", k=10), make("countsketch", k=10)
    other_bucket, other_seed = make("countsketch", k=10), make("countsketch", k=10, seed=1)
    # same hashes, same table (to float rounding: a GPU's scatter-add sums in no fixed order)
    assert torch.allclose(a.sketch(x), b.sketch(x), rtol=0, atol=1e-4)
    assert not torch.allclose(a.sketch(x), other_bucket.sketch(x, 2), rtol=0, atol=1e-4)
    assert torch.equal(other_bucket.compress(x, BucketContext(index=2))[0][0], other_bucket.sketch(x, 2))
    assert not torch.allclose(a.sketch(x), other_seed.sketch(x), rtol=0, atol=1e-4)
    # signs and buckets are balanced: no sign bias, every bucket used
    slot = a.plan(5000, x.device).slot
    cols = a.plan(5000, x.device).cols
    assert cols == 40 and slot.min() >= 0 and slot.max() < 2 * cols
    assert 0.45 < float((slot >= cols).double().mean()) < 0.55
    assert torch.bincount((slot % cols).long().view(-1), minlength=cols).min() > 0


def test_countsketch_default_size_and_exact_second_round():
    c = make("countsketch")  # ratio 0.01: k = 100 at n = 10000; cols = 4k = 400
    payload, _ = c.compress(torch.randn(10_000))
    assert nbytes(payload) == 5 * 400 * 4
    tiny = make("countsketch")
    assert tiny.compress(torch.randn(12))[0][0].shape == (5, 2)  # capped: never more cells than elements
    # exact: the indices the one-round decode picks, but the true average values there
    torch.manual_seed(20)
    ts = [torch.randn(3000) * 0.01 for _ in range(2)]
    for t in ts:
        t[:30] += 5.0
    comps = [make("countsketch", rows=5, cols=1000, k=30, exact=True) for _ in ts]
    log, sent = [], []
    outs = emulate_exchange(comps, [t.clone() for t in ts], log, sent=sent)
    assert log == [("allreduce", [(5, 1000)]), ("allreduce", [(30,)])]
    assert sent[0] == (5 * 1000 + 30) * 4
    one_round = make("countsketch", rows=5, cols=1000, k=30)
    idx, estimates = one_round.heavy(one_round.sketch(ts[0]) + one_round.sketch(ts[1]), 3000)
    avg = (ts[0] + ts[1]) / 2
    expect = torch.zeros(3000)
    expect[idx] = avg[idx]
    torch.testing.assert_close(outs[0], expect)
    assert not torch.allclose(estimates / 2, avg[idx])  # the estimates alone are not exact here


@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 6, 11])
def test_median_rows(r):
    g = torch.randn(r, 257, dtype=torch.float64)
    s = g.sort(dim=0).values
    want = s[r // 2] if r % 2 else (s[r // 2 - 1] + s[r // 2]) / 2
    torch.testing.assert_close(median_rows(g), want)


# -- parameters --------------------------------------------------------------------

BAD = [
    ("topk", {"ratio": 0}, "ratio"), ("topk", {"ratio": 1.5}, "ratio"), ("topk", {"ratio": "0.1"}, "ratio"),
    ("topk", {"ratio": True}, "ratio"),
    ("randomk", {"ratio": -0.1}, "ratio"), ("randomk", {"seed": -1}, "seed"), ("randomk", {"unbiased": 1}, "unbiased"),
    ("threshold", {"threshold": 0}, "threshold"), ("threshold", {"threshold": -1.0}, "threshold"),
    ("threshold", {"threshold": float("nan")}, "threshold"),
    ("dgc", {"ratio": 2}, "ratio"), ("dgc", {"momentum": 1.0}, "momentum"), ("dgc", {"momentum": -0.1}, "momentum"),
    ("dgc", {"clip": 0}, "clip"), ("dgc", {"warmup_steps": -1}, "warmup_steps"),
    ("dgc", {"warmup_steps": 2.5}, "warmup_steps"),
    ("powersgd", {"rank": 0}, "rank"), ("powersgd", {"rank": 1.0}, "rank"), ("powersgd", {"start_iter": -1}, "start_iter"),
    ("powersgd", {"min_compression_rate": 0.5}, "min_compression_rate"), ("powersgd", {"warm_start": 1}, "warm_start"),
    ("countsketch", {"rows": 0}, "rows"), ("countsketch", {"cols": 0}, "cols"), ("countsketch", {"k": 0}, "k"),
    ("countsketch", {"ratio": 1.5}, "ratio"), ("countsketch", {"k": 5, "ratio": 0.1}, "ratio"),
    ("countsketch", {"exact": "yes"}, "exact"),
]


@pytest.mark.parametrize("name,params,param", BAD)
def test_bad_params_name_the_param(name, params, param):
    with pytest.raises(ValueError, match=rf"^{param}: "):
        make(name, **params)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_param_is_named(name):
    with pytest.raises(ValueError, match=r"^colour: not a parameter of"):
        make(name, colour=3)


@pytest.mark.parametrize("name", ("dgc", "powersgd"))
def test_builtin_feedback_methods_refuse_the_flag(name):
    with pytest.raises(ValueError, match="error_feedback"):
        make(name, error_feedback=True)


def test_countsketch_exact_with_error_feedback_keeps_exact_residual():
    torch.manual_seed(21)
    c = make("countsketch", rows=3, cols=40, k=10, exact=True, error_feedback=True)
    fed, sent = torch.zeros(400), torch.zeros(400)
    for _ in range(4):
        g = torch.randn(400)
        fed += g
        (out,) = emulate_exchange([c], [g.clone()])
        sent += out
        # what was sent is the corrected bucket itself at the chosen entries
        assert torch.all(c.residual[out != 0] == 0)
    torch.testing.assert_close(sent + c.residual, fed)



def _block_slots(plan, n):
    """The wide-table hash written out per element, as the narrow tables store it (the oracle)."""
    i = torch.arange(n)
    blk = i // plan.cols
    shift = torch.tensor(plan.shift)
    minus = (torch.tensor(plan.sign) < 0).long()
    return (i % plan.cols + shift[:, blk]) % plan.cols + plan.cols * minus[:, blk]


@pytest.mark.parametrize("rows", [5, 3, 4])
def test_countsketch_wide_tables_rotate_blocks(monkeypatch, rows):
    # wide tables hash whole blocks of cols coordinates (a rotation and a sign per block and row) and
    # sketch and decode by contiguous slices: compare with index_add / index_select over the same hash
    import commlab.engine.compressors.countsketch as cs
    monkeypatch.setattr(cs, "SLICES_FROM", 1000)
    monkeypatch.setattr(cs, "PIECE", 700)  # pieces that do not divide the blocks
    torch.manual_seed(21)
    n, cols = 50_003, 3000
    x = torch.randn(n, dtype=torch.float64)
    heavy = torch.randperm(n)[:15]
    x[heavy] += 40.0
    c = make("countsketch", rows=rows, cols=cols, k=15)
    plan = c.plan(n, x.device)
    assert plan.slot is None and len(plan.shift) == rows and len(plan.shift[0]) == -(-n // cols)
    slot = _block_slots(plan, n)
    wide = torch.zeros(rows, 2 * cols, dtype=x.dtype)
    for r in range(rows):
        wide[r].index_add_(0, slot[r], x)
    want = wide[:, :cols] - wide[:, cols:]
    table = c.sketch(x)
    torch.testing.assert_close(table, want)
    signed = torch.cat([table, -table], dim=1)
    per_row = torch.stack([signed[r][slot[r]] for r in range(rows)])
    torch.testing.assert_close(c.estimate(table, n), median_rows(per_row))
    if rows == 5:  # with fewer rows, two collisions make false positives likely (with random slots too)
        out = c.decompress([table], c.compress(x)[1])
        assert set(torch.nonzero(out).view(-1).tolist()) == set(heavy.tolist())
    other = make("countsketch", rows=rows, cols=cols, k=15, seed=1)
    assert not torch.equal(other.sketch(x), table)
    assert 0.3 < float(slot.ge(cols).double().mean()) < 0.7  # both signs drawn
