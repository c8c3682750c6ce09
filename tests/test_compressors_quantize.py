"""Quantizers, sign compressors and bit packing (commlab/engine/compressors/quantize.py, sign.py, bitpack.py).

Exchanges are driven by hand, without a process group: next(gen) yields the
Round, gen.send(reply) answers it, StopIteration carries the averaged tensor.
"""
import math

import numpy as np
import pytest
import torch

from commlab.engine.comm.exchange import Exchange
from commlab.engine.compressors import bitpack, make, names
from commlab.engine.compressors.base import nbytes
from commlab.engine.compressors.capabilities import BucketContext
from commlab.engine.compressors.base import Round

QUANT = ["fp16", "bf16", "qsgd", "terngrad", "natural", "signsgd", "efsignsgd", "signum", "onebit"]
SHAPES = [(1,), (7,), (13,), (3, 5), (4, 9), (1000,)]


def drive(gen, reply):
    """Run an exchange generator: answer its one Round with reply(round); return (round, result)."""
    rnd = next(gen)
    assert isinstance(rnd, Round)
    with pytest.raises(StopIteration) as stop:
        gen.send(reply(rnd))
    return rnd, stop.value.value


def gathered(payloads):
    return lambda rnd: payloads


# -- bit packing ----------------------------------------------------------
@pytest.mark.parametrize("n", list(range(0, 70)) + [1000, 1001, 4097])
def test_pack_bits_matches_numpy_and_round_trips(n):
    g = torch.Generator().manual_seed(n)
    bits = torch.rand(n, generator=g) < 0.5
    packed = bitpack.pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    np.testing.assert_array_equal(packed.numpy(), np.packbits(bits.numpy()))  # MSB first, zero padded
    assert torch.equal(bitpack.unpack_bits(packed, n), bits)


@pytest.mark.parametrize("n", list(range(0, 40)) + [1000, 1003])
def test_pack_2bit_matches_reference_and_round_trips(n):
    g = torch.Generator().manual_seed(100 + n)
    vals = torch.randint(0, 4, (n,), generator=g).to(torch.uint8)
    packed = bitpack.pack_2bit(vals)
    assert packed.numel() == math.ceil(n / 4)
    padded = np.zeros(math.ceil(n / 4) * 4, dtype=np.int64)
    padded[:n] = vals.numpy()
    ref = (padded.reshape(-1, 4) * np.array([64, 16, 4, 1])).sum(1)
    np.testing.assert_array_equal(packed.numpy(), ref)
    assert torch.equal(bitpack.unpack_2bit(packed, n), vals)


def test_pack_bits_odd_offsets_and_non_contiguous_inputs():
    bits = torch.rand(6, 37) < 0.3
    for b in (bits[:, 3:], bits.t(), bits[1:, 5:29]):
        np.testing.assert_array_equal(bitpack.pack_bits(b).cpu().numpy(), np.packbits(b.reshape(-1).cpu().numpy()))
    vals = torch.randint(0, 4, (50,)).to(torch.uint8)
    assert torch.equal(bitpack.unpack_2bit(bitpack.pack_2bit(vals[3:]), 47), vals[3:])


def test_bit_lanes_add_up_to_counts():
    packs = [torch.rand(21) < p for p in (0.2, 0.5, 0.9)]
    lanes = sum(bitpack.bit_lanes(bitpack.pack_bits(b), 21) for b in packs)
    counts = lanes.view(torch.uint8)[:21]
    assert torch.equal(counts.long(), sum(b.long() for b in packs))


def test_pack_rejects_wrong_dtypes():
    with pytest.raises(TypeError):
        bitpack.pack_bits(torch.ones(8))
    with pytest.raises(TypeError):
        bitpack.pack_2bit(torch.ones(8, dtype=torch.int32))


# -- registry, shapes, dtypes ---------------------------------------------
def test_registered_under_contract_names():
    for name in QUANT:
        assert name in names()
        assert make(name).name == name


@pytest.mark.parametrize("name", QUANT)
def test_round_trip_keeps_shape_dtype_device(name):
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for shape in SHAPES:
            c = make(name)
            t = torch.randn(shape).to(dtype)
            payload, ctx = c.compress(t)
            out = c.decompress(payload, ctx)
            assert out.shape == t.shape and out.dtype == t.dtype and out.device == t.device, (dtype, shape)
            assert torch.isfinite(out.float()).all()
            for p in payload:
                assert p.device == t.device


@pytest.mark.parametrize("name", QUANT)
def test_non_contiguous_input(name):
    t = torch.randn(6, 11).t()
    c = make(name)
    out = c.decompress(*c.compress(t))
    assert out.shape == (11, 6)
    ref = make(name)
    assert torch.equal(out, ref.decompress(*ref.compress(t.contiguous())))


def expected_bytes(name, n):
    """Payload bytes from each class's stated layout, written out independently."""
    return {
        "fp16": 2 * n, "bf16": 2 * n,
        "qsgd": 4 + n,                        # fp32 norm + int8 codes (levels 127)
        "terngrad": 4 + math.ceil(n / 4),     # fp32 scale + 2-bit codes
        "natural": 4 + n,                     # int32 offset + one byte per element
        "signsgd": math.ceil(n / 8),
        "efsignsgd": 4 + math.ceil(n / 8),    # fp32 scale + sign bits
        "signum": math.ceil(n / 8),
        "onebit": 8 + math.ceil(n / 8),       # two fp32 means + bits
    }[name]


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 13, 64, 1000, 1001])
def test_payload_bytes(name, n):
    c = make(name)
    payload, _ = c.compress(torch.randn(n))
    assert nbytes(payload) == expected_bytes(name, n)
    # the exchange driver counts what it sends
    ex = Exchange(make(name), torch.randn(n), 2)
    rnd = ex.start()
    assert ex.sent == nbytes(rnd.tensors) == expected_bytes(name, n)


def test_qsgd_wide_levels_use_int16():
    c = make("qsgd", levels=128)
    payload, _ = c.compress(torch.randn(100))
    assert payload[1].dtype == torch.int16 and nbytes(payload) == 4 + 2 * 100
    assert make("qsgd", levels=127).compress(torch.randn(3))[0][1].dtype == torch.int8


# -- deterministic semantics ----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_casts_equal_torch_casts(dtype):
    t = torch.randn(257, dtype=dtype) * 100
    for name, wire in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        c = make(name)
        payload, ctx = c.compress(t)
        assert payload[0].dtype == wire and c.capabilities.summable and c.capabilities.keeps_shape
        assert torch.equal(c.decompress(payload, ctx), t.to(wire).to(dtype))


def test_casts_pass_non_float_tensors_through():
    t = torch.arange(10)
    for name in ("fp16", "bf16"):
        c = make(name)
        payload, ctx = c.compress(t)
        assert payload[0] is t and c.decompress(payload, ctx) is t


def test_fp16_exchange_prescales_so_sums_do_not_overflow():
    world = 4
    t = torch.full((5,), 60000.0)  # each rank fits in half; the plain half sum of four would be inf
    c = make("fp16")
    rnd, out = drive(c.exchange(t, world), lambda rnd: [rnd.tensors[0] * world])
    assert rnd.op == "allreduce" and rnd.tensors[0].dtype == torch.float16
    assert torch.equal(rnd.tensors[0].float(), (t / world).half().float())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, t, rtol=1e-3, atol=0)
    assert torch.equal(t, torch.full((5,), 60000.0))  # the caller's tensor is untouched


def test_bf16_exchange_sums_then_divides():
    t = torch.randn(9)
    c = make("bf16")
    rnd, out = drive(c.exchange(t, 3), lambda rnd: [rnd.tensors[0] * 3])
    assert rnd.op == "allreduce"
    torch.testing.assert_close(out, t.bfloat16().float(), rtol=1e-2, atol=1e-2)


def signs(x):
    return torch.where(x >= 0, 1.0, -1.0)


@pytest.mark.parametrize("n", [1, 5, 8, 13, 100])
def test_signsgd_decodes_to_plus_minus_one(n):
    t = torch.randn(n)
    t[0] = 0.0  # zero counts as positive
    c = make("signsgd")
    out = c.decompress(*c.compress(t))
    assert torch.equal(out, signs(t))


def test_signsgd_majority_vote_over_three_ranks():
    ranks = [torch.tensor([1., 1., -1., -1., 2., -3., 0.5, -.5, 1., -1., 1., 1., -1.]),
             torch.tensor([1., -1., 1., -1., -2., -3., 0.5, .5, -1., 1., 1., -1., -1.]),
             torch.tensor([-1., -1., -1., 1., 2., 3., -.5, .5, -1., 1., 1., 1., 1.])]
    payloads = [make("signsgd").compress(r)[0] for r in ranks]
    rnd, out = drive(make("signsgd").exchange(ranks[0], 3), gathered(payloads))
    assert rnd.op == "allgather"
    want = torch.tensor([1., -1., -1., -1., 1., -1., 1., 1., -1., 1., 1., 1., -1.])
    assert torch.equal(out, want)
    assert torch.equal(out, torch.sign(sum(signs(r) for r in ranks)))


def test_vote_ties_give_zero_and_keep_dtype():
    a = torch.tensor([1., -1., 1., -1., 1., 1., 1., 1., 1.], dtype=torch.float64)
    b = torch.tensor([-1., 1., 1., -1., -1., 1., 1., 1., 1.], dtype=torch.float64)
    payloads = [make("signsgd").compress(r)[0] for r in (a, b)]
    _, out = drive(make("signsgd").exchange(a.view(3, 3), 2), gathered(payloads))
    assert out.dtype == torch.float64 and out.shape == (3, 3)
    assert torch.equal(out.view(-1), torch.tensor([0., 0., 1., -1., 0., 1., 1., 1., 1.], dtype=torch.float64))


def test_vote_with_many_ranks():
    g = torch.Generator().manual_seed(3)
    ranks = [torch.randn(37, generator=g) for _ in range(300)]  # past the 255 a byte lane can count
    payloads = [make("signsgd").compress(r)[0] for r in ranks]
    _, out = drive(make("signsgd").exchange(ranks[0], 300), gathered(payloads))
    assert torch.equal(out, torch.sign(sum(signs(r) for r in ranks)))


def test_signum_momentum_state_and_vote():
    beta = 0.5
    c = make("signum", momentum=beta)
    g1, g2 = torch.tensor([1., -2., 3., 0.1]), torch.tensor([-3., 1., -1., -1.])
    c.compress(g1)
    payload, ctx = c.compress(g2)
    m = beta * (1 - beta) * g1 + (1 - beta) * g2  # zero start
    torch.testing.assert_close(c.state_dict()["momentum"], m)
    assert torch.equal(c.decompress(payload, ctx), signs(m))
    # checkpoint, restore into a fresh instance, and both continue alike
    d = make("signum", momentum=beta)
    d.load_state_dict(c.state_dict())
    g3 = torch.tensor([0.3, 0.3, -4., 2.])
    assert torch.equal(c.compress(g3)[0][0], d.compress(g3)[0][0])
    assert d.state_dict()["momentum"] is not c.state_dict()["momentum"]
    # another instance keeps its own buffer
    e = make("signum", momentum=beta)
    e.compress(torch.ones(4))
    torch.testing.assert_close(e.state_dict()["momentum"], torch.full((4,), 1 - beta))
    # the exchange is a majority vote of momentum signs
    _, out = drive(make("signum", momentum=beta).exchange(g1, 1), lambda rnd: [rnd.tensors])
    assert torch.equal(out, signs(g1))


def test_signum_rejects_mismatched_state():
    c = make("signum")
    c.load_state_dict({"momentum": torch.zeros(3)})
    with pytest.raises(ValueError, match="^momentum:"):
        c.compress(torch.ones(4))


def test_onebit_decodes_to_the_two_means():
    t = torch.tensor([[3., -1., 0., 2.], [-5., 4., -2., 1.], [0.5, -0.5, 7., -9.]])
    c = make("onebit")
    payload, ctx = c.compress(t)
    pos, neg = t[t >= 0], t[t < 0]
    torch.testing.assert_close(payload[0], torch.tensor([neg.mean(), pos.mean()]))
    want = torch.where(t >= 0, pos.mean(), neg.mean())
    torch.testing.assert_close(c.decompress(payload, ctx), want)
    assert c.state_dict() == {}


def test_onebit_one_sided_tensor():
    t = torch.tensor([1., 2., 0., 5., 3., 3., 3., 3., 3.], dtype=torch.float64)
    c = make("onebit")
    out = c.decompress(*c.compress(t))
    torch.testing.assert_close(out, torch.full_like(t, t.mean().item()))


def test_efsignsgd_residual_and_scale():
    c = make("efsignsgd")
    x1 = torch.tensor([0.5, -2., 1., -0.25, 3., 0., -1., 0.75, 2.])
    payload, ctx = c.compress(x1)
    decoded = c.decompress(payload, ctx)
    scale = x1.abs().mean()
    torch.testing.assert_close(payload[0], scale.reshape(1))
    torch.testing.assert_close(decoded, scale * signs(x1))
    torch.testing.assert_close(c.state_dict()["residual"], x1 - decoded)
    # the next step compresses gradient + residual
    x2 = torch.tensor([1., 1., -1., -1., 0.5, -0.5, 0., 2., -2.])
    p = x2 + (x1 - decoded)
    payload2, ctx2 = c.compress(x2)
    torch.testing.assert_close(c.decompress(payload2, ctx2), p.abs().mean() * signs(p))
    # checkpoint round trip
    d = make("efsignsgd")
    d.load_state_dict(c.state_dict())
    x3 = torch.randn(9)
    assert all(torch.equal(a, b) for a, b in zip(c.compress(x3)[0], d.compress(x3)[0]))


def test_efsignsgd_exchange_averages_rank_decodes():
    ranks = [torch.randn(11) for _ in range(3)]
    comps = [make("efsignsgd") for _ in range(3)]
    sent = [c.compress(r) for c, r in zip(comps, ranks)]
    payloads = [p for p, _ in sent]
    want = sum(comps[0].decompress(p, ctx) for p, ctx in sent) / 3
    mine = make("efsignsgd")
    rnd, out = drive(mine.exchange(ranks[0], 3), gathered(payloads))
    assert rnd.op == "allgather" and not mine.capabilities.summable
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "natural", "onebit"])
def test_gathered_exchange_averages_rank_decodes(name):
    ranks = [torch.randn(3, 7) for _ in range(3)]
    comps = [make(name) for _ in range(3)]
    sent = [c.compress(r) for c, r in zip(comps, ranks)]
    want = sum(c.decompress(p, ctx) for c, (p, ctx) in zip(comps, sent)) / 3
    rnd, out = drive(make(name).exchange(ranks[0], 3), gathered([p for p, _ in sent]))
    assert rnd.op == "allgather"
    torch.testing.assert_close(out, want)


def test_terngrad_values():
    t = torch.tensor([0.5, -2., 1., -0.25, 4., 0., -1.])
    c = make("terngrad")
    for _ in range(20):
        payload, ctx = c.compress(t)
        out = c.decompress(payload, ctx)
        assert payload[0].item() == 4.0
        assert set(out.tolist()) <= {-4.0, 0.0, 4.0}
        assert (out * t >= 0).all()  # never the opposite sign
        assert out[4] == 4.0 and out[5] == 0.0  # the max is kept, zero stays zero
    zero = torch.zeros(9)
    assert torch.equal(c.decompress(*c.compress(zero)), zero)


def test_qsgd_codes_stay_in_range():
    levels = 127  # int8's maximum: an overflow would wrap to -128
    c = make("qsgd", levels=levels)
    t = torch.tensor([1e-3, 5., -1e-3, -2e-4])  # nearly all of the norm in one element
    for _ in range(300):
        payload, ctx = c.compress(t)
        codes = payload[1]
        assert codes.abs().max() <= levels and codes[1] > 0
        out = c.decompress(payload, ctx)
        assert (out * t >= 0).all() and out[1] > 0
    zero = torch.zeros(5)
    assert torch.equal(c.decompress(*c.compress(zero)), zero)


def test_natural_gives_neighbouring_powers_of_two():
    t = torch.tensor([0., 1., -1., 0.75, -3., 2.5e-3, 0.5, -0.125, 1e-30, 1e-40])
    c = make("natural")
    exact = torch.tensor([True, True, True, False, False, False, True, True, False, False])
    for _ in range(20):
        out = c.decompress(*c.compress(t))
        assert torch.equal(out[exact], t[exact])  # powers of two and zero are kept as they are
        a = t.abs().double()
        lo = torch.exp2(torch.floor(torch.log2(a)))
        ok = (out.abs().double() == lo) | (out.abs().double() == 2 * lo) | (t == 0)
        ok[-1] |= out[-1].abs().item() in (0.0, 2.0 ** -126)  # a subnormal rounds to 0 or the smallest normal
        assert ok.all()
        assert (torch.sign(out) * torch.sign(t) >= 0).all()


# -- unbiasedness ---------------------------------------------------------
DRAWS = 2000


def draws(name, t, **params):
    c = make(name, **params)
    return torch.stack([c.decompress(*c.compress(t)).double() for _ in range(DRAWS)])


def assert_unbiased(samples, t, var):
    """Mean of the draws within 5 standard errors of t (var: per-element variance of one draw)."""
    se = (var / DRAWS).sqrt()
    err = (samples.mean(0) - t.double()).abs()
    slack = 1e-5 * t.double().abs()  # float32 rounding of the decoded values, per element
    assert (err <= 5 * se + slack).all(), (err / se.clamp(min=1e-30)).max()


def random_input(n=64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * scale
    t[::9] = 0.0
    return t


def test_qsgd_unbiased():
    t = random_input()
    levels = 4  # few levels: large rounding steps, a bias would show
    samples = draws("qsgd", t, levels=levels)
    step = t.double().norm() / levels
    frac = t.double().abs() / step - torch.floor(t.double().abs() / step)
    assert_unbiased(samples, t, step ** 2 * frac * (1 - frac))
    # the variance is the theoretical one too, not just the mean
    torch.testing.assert_close(samples.var(0).sum(), (step ** 2 * frac * (1 - frac)).sum(), rtol=0.1, atol=0)


def test_terngrad_unbiased():
    t = random_input(seed=1)
    samples = draws("terngrad", t)
    s = t.double().abs().max()
    var = s * t.double().abs() - t.double() ** 2
    assert_unbiased(samples, t, var)
    torch.testing.assert_close(samples.var(0).sum(), var.sum(), rtol=0.1, atol=0)


def natural_variance(t, floor=0.0):
    a = t.double().abs()
    lo = torch.exp2(torch.floor(torch.log2(a)))
    lo = torch.where(a < floor, torch.zeros_like(a), lo)
    hi = torch.where(a < floor, torch.full_like(a, floor), 2 * lo)
    return torch.where(a > 0, (a - lo) * (hi - a), torch.zeros_like(a))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_natural_unbiased(dtype):
    t = random_input(seed=2, scale=0.1).to(dtype)  # max|x| < 1: the code holds the exponent itself
    assert_unbiased(draws("natural", t), t, natural_variance(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_natural_unbiased_over_a_huge_range(dtype):
    # max|x| = 1.5 * 2^100: codes reach down to 2^(100 - 125); smaller values round between 0 and that
    floor = 2.0 ** -25
    t = torch.tensor([1.5 * 2.0 ** 100, 0.3 * floor, -0.7 * floor, 0.9 * floor, 1.2 * floor, 3 * floor,
                      0.5, -1e3, 1e-20, 0.0], dtype=dtype)
    assert_unbiased(draws("natural", t), t, natural_variance(t, floor))


# -- randomness and state -------------------------------------------------
@pytest.mark.parametrize("name", ["qsgd", "terngrad", "natural"])
def test_seeded_streams(name):
    t = torch.randn(200)
    a, b = make(name, seed=7), make(name, seed=7)
    pa, pb = a.compress(t)[0], b.compress(t)[0]
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))  # reproducible
    other, rank1 = make(name, seed=7), make(name, seed=7)
    assert not torch.equal(other.compress(t, BucketContext(index=1))[0][1], pa[1])  # each bucket has its own stream
    assert not torch.equal(rank1.compress(t, BucketContext(rank=1))[0][1], pa[1])  # and each rank
    assert not torch.equal(make(name, seed=8).compress(t)[0][1], pa[1])
    # the generator's state is checkpointed: a restored instance draws what the original draws next
    restored = make(name, seed=123)
    restored.load_state_dict(a.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(a.compress(t)[0], restored.compress(t)[0]))


def test_decompress_returns_fresh_tensors():
    t = torch.randn(50)
    for name in ["qsgd", "terngrad", "natural", "signsgd", "efsignsgd", "onebit"]:
        c = make(name)
        payload, ctx = c.compress(t)
        first = c.decompress(payload, ctx)
        keep = first.clone()
        c.decompress(payload, ctx).add_(1)
        c.compress(torch.randn(50))  # work buffers are reused; results must not be
        assert torch.equal(first, keep), name


# -- parameters -----------------------------------------------------------
@pytest.mark.parametrize("name, params, field", [
    ("qsgd", {"levels": 0}, "levels"),
    ("qsgd", {"levels": 1.5}, "levels"),
    ("qsgd", {"levels": True}, "levels"),
    ("qsgd", {"levels": 40000}, "levels"),
    ("qsgd", {"seed": -1}, "seed"),
    ("qsgd", {"ratio": 0.1}, "ratio"),
    ("terngrad", {"levels": 3}, "levels"),
    ("natural", {"seed": "x"}, "seed"),
    ("signum", {"momentum": 1.0}, "momentum"),
    ("signum", {"momentum": -0.1}, "momentum"),
    ("signum", {"momentum": "high"}, "momentum"),
    ("signsgd", {"momentum": 0.9}, "momentum"),
    ("efsignsgd", {"lr": 0.1}, "lr"),
    ("onebit", {"seed": 0}, "seed"),
    ("fp16", {"levels": 8}, "levels"),
    ("bf16", {"x": 1}, "x"),
])
def test_bad_params_name_the_field(name, params, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        make(name, **params)


def test_qsgd_message_format():
    with pytest.raises(ValueError) as e:
        make("qsgd", levels=0)
    assert str(e.value) == "levels: must be an integer >= 1, got 0"


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "signum", "onebit", "terngrad"])
@pytest.mark.parametrize("shape", [(1,), (37,), (8, 13), (1001,)])
def test_elementwise_blend_decodes_as_the_table_gather(name, shape, monkeypatch):
    """The eager GPU decode (quantize.blend) gives the CPU table gather's values bit for bit (the eager path:
    on a GPU, float32 takes the fused kernels of tests/test_fused.py unless COMMLAB_FUSED=0)."""
    from commlab.engine.compressors import quantize
    monkeypatch.setenv("COMMLAB_FUSED", "0")
    torch.manual_seed(3)
    c = make(name)
    t = torch.randn(shape)
    payload, ctx = c.compress(t.clone())
    gathered = c.decompress(payload, ctx)  # CPU: the table gather
    tab = c._tables[next(k for k in c._tables if k[-1] == gathered.device)]
    packed = payload[-1] if name != "terngrad" else payload[1]
    assert tab.shape[0] == 256
    scale = {"terngrad": payload[0].to(ctx.dtype)}.get(name)
    if name == "onebit":
        m0, m1 = payload[0].to(ctx.dtype).unbind()
        tab = torch.addcmul(m0, tab, m1 - m0)
    elif name == "efsignsgd":
        tab = tab * payload[0].to(ctx.dtype)
    elif scale is not None:
        tab = tab * scale
    assert torch.equal(quantize.blend(tab, packed, ctx), gathered)
