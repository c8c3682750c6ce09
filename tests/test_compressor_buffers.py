"""Reused buffers (commlab/engine/compressors): casts keep their payload and decoded tensor, sparse
compressors and PowerSGD their large decodes. A kept buffer must never carry an earlier
call's values into a later result, and exchanges decode into the bucket itself."""
import pytest
import torch

from distutil import emulate_exchange
from commlab.engine.compressors import make
from commlab.engine.compressors.powersgd import matrix_shape
from commlab.engine.compressors.kernels import Scratch

LARGE = Scratch.MIN + 1001
"""Above the size from which decodes go into a kept buffer; not a multiple of anything."""


@pytest.mark.parametrize("name,wire", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("n", [1000, LARGE])
def test_cast_buffers_hold_the_latest_call(name, wire, n):
    c = make(name)
    torch.manual_seed(0)
    for step in range(3):
        x = torch.randn(n) * (step + 1)
        payload, ctx = c.compress(x)
        assert payload[0].dtype == wire and torch.equal(payload[0], x.to(wire))
        assert torch.equal(c.decompress(payload, ctx), x.to(wire).float())
    # a payload that is not the instance's own buffer, of another shape, decodes too
    y = torch.randn(3, 7, dtype=torch.float64)
    out = c.decompress([y.to(wire)], torch.float64)
    assert out.shape == (3, 7) and out.dtype == torch.float64 and torch.equal(out, y.to(wire).double())


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_exchange_decodes_into_the_bucket(name):
    torch.manual_seed(1)
    ts = [torch.randn(500) for _ in range(2)]
    wire = torch.float16 if name == "fp16" else torch.bfloat16
    bufs = [t.clone() for t in ts]
    outs = emulate_exchange([make(name), make(name)], bufs)
    if name == "fp16":  # pre-divided in half, summed in half
        want = ((ts[0].to(wire) / 2) + (ts[1].to(wire) / 2)).float()
    else:
        want = (ts[0].to(wire) + ts[1].to(wire)).float() / 2
    for o, b in zip(outs, bufs):
        assert o.data_ptr() == b.data_ptr()
        torch.testing.assert_close(o, want, rtol=0, atol=0)


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.01}), ("threshold", {"threshold": 2.0}),
                                         ("dgc", {"ratio": 0.01})])
def test_large_sparse_decode_forgets_the_previous_one(name, params):
    """The kept dense buffer is zeroed before each decode: entries set by the last call are gone."""
    c = make(name, **params)
    torch.manual_seed(2)
    for step in range(3):
        x = torch.randn(LARGE)
        payload, ctx = c.compress(x)
        values, idx = payload if payload[0].is_floating_point() else payload[::-1]
        want = torch.zeros(LARGE)
        want[idx.long()] = values
        assert torch.equal(c.decompress(payload, ctx), want)
    # a payload with no entries at all decodes to zeros, whatever the buffer held
    empty = [torch.zeros(0), torch.zeros(0, dtype=torch.int32)]
    assert not c.decompress(empty, ctx).any()


def test_large_powersgd_decode_is_the_product_of_the_latest_factors():
    c = make("powersgd", rank=2)
    rows, cols = matrix_shape(LARGE)
    assert rows * cols > LARGE  # padded: the decode is cut to the bucket's size
    torch.manual_seed(3)
    for step in range(3):
        x = torch.randn(LARGE)
        payload, ctx = c.compress(x)
        p, q = payload
        want = (p @ q.t()).reshape(-1)[:LARGE]
        torch.testing.assert_close(c.decompress(payload, ctx), want, rtol=0, atol=0)
    # the padded matrix compress keeps: its padding stays zero, so a bucket of zeros gives zero factors
    payload, ctx = c.compress(torch.zeros(LARGE))
    assert not c.decompress(payload, ctx).any()


@pytest.mark.parametrize("name,n", [("fp16", 1000), ("bf16", LARGE), ("topk", LARGE), ("powersgd", LARGE)])
def test_other_payloads_decode_to_fresh_tensors(name, n):
    """Only the instance's own latest payload decodes into its kept buffer: decoding a sum of payloads
    (the performance model's linearity check) must not overwrite a decode the caller still holds."""
    c = make(name)
    torch.manual_seed(5)
    payload, ctx = c.compress(torch.randn(n))
    own = c.decompress(payload, ctx)
    kept = own.clone()
    other = c.decompress([p.clone() for p in payload], ctx)
    assert other.data_ptr() != own.data_ptr()
    assert torch.equal(own, kept) and torch.equal(other, kept)
