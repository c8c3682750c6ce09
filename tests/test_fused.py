"""The fused kernels (commlab/engine/compressors/fused.py) held to the eager codecs they stand in for.

They run where Triton runs: on a CUDA GPU, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1 COMMLAB_FUSED=interpret``, with triton installed: how they were written on a machine
without a GPU). Elsewhere the module is skipped, and the eager codecs it compares with are the ones every
other test runs. The deterministic codecs must give the eager payload bit for bit (up to a sign at a float
rounding tie) and its decoding; the random ones the eager payload's layout, scalars and decoding, unbiased
codes, noise that differs by rank and call and is restored with the state.
"""
import contextlib
import copy

import pytest
import torch

from commlab.engine import compressors
from commlab.engine.compressors import contract, fused
from commlab.engine.compressors.capabilities import BucketContext
from commlab.engine.compressors.quantize import _Ctx
from commlab.engine.compressors.sign import _Vote

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fused.on(DEVICE, torch.float32),
                                reason="the fused kernels need Triton on a CUDA GPU (or TRITON_INTERPRET=1 "
                                       "COMMLAB_FUSED=interpret)")
SIZES = [1, 7, 1001, 4096, 70001]


def randn(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(DEVICE)


BUCKETS = {}
"""By id of an instance ``make`` made: the context the communicator would give it (bucket 3, its rank)."""


def make(name, rank=0, **params):
    c = compressors.make(name, **params)
    BUCKETS[id(c)] = BucketContext(3, rank)
    return c


def compress(c, x):
    """``c.compress(x)`` with the context ``make`` gave ``c``."""
    return contract.compress(c, x, BUCKETS[id(c)])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["signsgd", "signum", "efsignsgd", "onebit"])
def test_deterministic_codecs_send_and_decode_what_the_eager_ones_do(name, n):
    """Three steps (the stateful ones carry momentum or residual between them): the same bits, the same
    scalars (to float rounding: the fused sums are per block), the same decoding and the same state."""
    fast, slow = make(name), make(name)
    for step in range(3):
        x = randn(n, seed=step)
        pf, ctx = compress(fast, x.clone())
        with fused.disabled():
            ps, ctx_s = compress(slow, x.clone())
        assert [p.dtype for p in pf] == [p.dtype for p in ps] and [p.shape for p in pf] == [p.shape for p in ps]
        assert torch.equal(pf[-1], ps[-1]), f"{name}: the bits differ at step {step}"
        for a, b in zip(pf[:-1], ps[:-1]):  # sums of up to 70K floats in another order: ~1e-5 relative
            torch.testing.assert_close(a, b, rtol=3e-5, atol=1e-7)
        out_f = fast.decompress(pf, ctx)
        with fused.disabled():
            out_s = slow.decompress(ps, ctx_s)
        assert out_f.shape == x.shape and out_f.dtype == x.dtype
        torch.testing.assert_close(out_f, out_s, rtol=3e-5, atol=1e-7)
        for key, v in slow.state_dict().items():  # the residual carries the scale's rounding
            torch.testing.assert_close(fast.state_dict()[key], v, rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "onebit", "qsgd", "terngrad", "natural"])
def test_every_ranks_payload_decodes_in_one_kernel_as_the_eager_loop_does(name, world):
    """The payloads of ``world`` ranks (made by the eager codecs, as another rank may) decoded together: the
    vote, or the mean of the decoded payloads, as the eager exchange computes it."""
    n = 5003
    payloads = []
    with fused.disabled():
        for r in range(world):
            payload, ctx = compress(make(name, rank=r), randn(n, seed=10 + r))
            payloads.append(payload)
        c = make(name)
        if isinstance(c, _Vote):
            want = _Vote.vote([p[0] for p in payloads], ctx)
        else:
            want = sum(c.decompress(p, ctx) for p in payloads) / world
    got = _Vote.vote([p[0] for p in payloads], ctx) if isinstance(c, _Vote) else c._decode_all(payloads, ctx)
    torch.testing.assert_close(got.view(-1), want.view(-1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name,params,scale", [("qsgd", {}, 1), ("qsgd", {"levels": 300}, 1), ("terngrad", {}, 1),
                                               ("natural", {}, 0.1), ("natural", {}, 2.0 ** 20)])
def test_random_codecs_keep_the_eager_layout_and_are_unbiased(name, params, scale):
    """natural at 0.1: max|x| < 1, no offset; at 2^20 an offset, and values below its smallest code (a few set
    to 1e-37 here) code 0 or 1 with the probability that keeps them unbiased."""
    n = 1001
    x = randn(n, seed=1) * scale
    if scale > 1:
        x[:5] = torch.tensor([1e-37, -2e-37, 3e-38, 1e-30, -1e-33])
    c = make(name, **params)
    payload, ctx = compress(c, x)
    with fused.disabled():
        ref, _ = compress(make(name, **params), x)
    assert [(p.dtype, p.shape) for p in payload] == [(p.dtype, p.shape) for p in ref]
    # the scalar sent: max|x| and natural's offset exactly; the norm to float rounding (summed in another order)
    torch.testing.assert_close(payload[0], ref[0], rtol=1e-6 if name == "qsgd" else 0, atol=0)
    if name == "qsgd":
        assert payload[1].abs().max().item() <= c.levels
    elif name == "natural":
        assert (payload[0].item() > 0) == (scale > 1)
    else:
        from commlab.engine.compressors import bitpack
        assert bitpack.unpack_2bit(payload[1], n).max().item() <= 3
    with fused.disabled():
        torch.testing.assert_close(c.decompress(payload, ctx), make(name, **params).decompress(payload, ctx))
    draws = 300
    mean = sum(c.decompress(*compress(c, x)) for _ in range(draws)) / draws
    if name == "natural":  # each value rounds between its two powers of two: off by at most |x| (v1 below it)
        v1 = 2.0 ** (payload[0].item() + 1 - 127)
        bound = torch.maximum(x.abs(), torch.full_like(x, v1))
        assert ((mean - x).abs() / bound).max().item() < 5 * 0.5 / draws ** 0.5
        return
    spread = (x.abs().max() if name == "terngrad" else torch.linalg.vector_norm(x) / c.levels).item()
    # each draw is off by at most one step; the mean of 300 by far less (5 sigma of a uniform step: 0.29 each)
    assert (mean - x).abs().max().item() < 5 * 0.5 * spread / draws ** 0.5


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "natural"])
def test_random_codecs_noise_differs_by_rank_and_call_and_comes_back_with_the_state(name):
    x = randn(4099, seed=2)
    a, b = make(name, rank=0), make(name, rank=1)
    first = compress(a, x)[0][1].clone()
    assert not torch.equal(first, compress(b, x)[0][1])  # another rank, other noise
    state = copy.deepcopy(a.state_dict())
    second = compress(a, x)[0][1].clone()
    assert not torch.equal(first, second)  # another call, other noise
    again = make(name, rank=0)
    again.load_state_dict(state)
    assert torch.equal(compress(again, x)[0][1], second)  # the state brings the noise back


def test_non_float32_and_strided_inputs_take_the_eager_path():
    """fp16 and a strided 1-D tensor: not fused (the kernels read contiguous float32), and still right."""
    assert not fused.enabled(randn(64, 0).half()) and not fused.enabled(randn(64, 0)[::2])
    assert not fused.enabled(randn(0, 0))
    x = randn(128, 0)[::2]
    (bits,), ctx = compress(make("signsgd"), x)
    torch.testing.assert_close(make("signsgd").decompress([bits], ctx), torch.where(x >= 0, 1.0, -1.0))


def test_gpus_before_ampere_keep_the_eager_path(monkeypatch):
    """Triton supports compute capability 8.0 and later in full: an older GPU is never given the kernels."""
    for capability, want in (((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(fused, "_capable", {})
        monkeypatch.setattr(fused, "_first_run", lambda index: True)  # the kernels' first run: its own test
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert fused.on(torch.device("cuda", 0), torch.float32) is want, capability


def test_off_means_off(monkeypatch):
    monkeypatch.setenv("COMMLAB_FUSED", "0")
    assert not fused.on(DEVICE, torch.float32)
    ctx = _Ctx(torch.Size([5]), torch.float32, 5)
    assert ctx.n == 5


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "natural"])
def test_random_codecs_count_their_calls_on_the_device_and_load_the_count_in_place(name):
    """The base seed and the count that key each call's noise live on the bucket's device, the count advanced by
    the kernels (a CUDA graph of the call keeps drawing new noise); loading state writes both into the same tensor
    (a graph holds it)."""
    c, x = make(name), randn(5000, seed=3)
    compress(c, x)
    compress(c, x)
    rng = c._fused_rng
    assert rng.device == x.device and rng[1].item() == 2
    state = copy.deepcopy(c.state_dict())
    assert state["fused_stream"].tolist()[1] == 2
    third = compress(c, x)[0][1].clone()
    c.load_state_dict(state)
    assert c._fused_rng is rng and rng[1].item() == 2
    assert torch.equal(compress(c, x)[0][1], third)
    other = make(name, rank=1)  # another rank's state: its base seed too, into the same tensor
    compress(other, x)
    c.load_state_dict(other.state_dict())
    assert c._fused_rng is rng and torch.equal(compress(c, x)[0][1], compress(other, x)[0][1])


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "natural", "onebit", "efsignsgd"])
def test_a_nan_in_the_bucket_reaches_the_decoded_average(name):
    """The trainer stops a run whose averaged gradients are not finite: the fused kernels keep a NaN as the eager
    codecs do (a GPU's max drops NaN unless told not to)."""
    x = randn(5000, seed=4)
    x[7::250] = float("nan")  # 20 of them: natural decodes each to inf or 0, all 0 with odds 2^-20
    c = make(name)
    out = c.decompress(*compress(c, x))
    assert not torch.isfinite(out.sum()), name


def test_natural_codes_values_below_the_smallest_code_as_the_eager_codec_does():
    """max|x| = 2^126 puts the offset at 127: the smallest code is 2, and 0.5 and -1.5 code 0 or +-2 with the
    probability that keeps them unbiased; 3 rounds to 2 or 4. The same values and means as the eager codec."""
    x = torch.tensor([2.0 ** 126, 0.5, -1.5, 3.0, 0.0] * 2000).to(DEVICE)
    got = {}
    for way in ("fused", "eager"):
        with (fused.disabled() if way == "eager" else contextlib.nullcontext()):
            c = make("natural")
            assert compress(c, x)[0][0].item() == 127
            got[way] = torch.stack([c.decompress(*compress(c, x)) for _ in range(20)])
    for v, values in ((0.5, {0.0, 2.0}), (-1.5, {-2.0, 0.0}), (3.0, {2.0, 4.0}), (0.0, {0.0})):
        for way, outs in got.items():
            sel = outs[:, x == v]
            assert set(sel.unique().tolist()) == values, (way, v)
            # 40,000 draws of a two-valued variable at most 2 apart: 5 sigma is under 0.025
            assert abs(sel.mean().item() - v) < 0.025, (way, v)
