"""Contracts every registered compressor keeps; a new compressor inherits these tests."""
import pytest
import torch

from engine import compressors
from engine.compressors import ErrorFeedback, make, names
from distutil import emulate_exchange

# parameters that make each method do real work on small test tensors
PARAMS = {"topk": {"ratio": 0.1}, "randomk": {"ratio": 0.1}, "dgc": {"ratio": 0.1},
          "threshold": {"threshold": 0.5}, "powersgd": {"rank": 2, "start_iter": 0}}


def params_of(name):
    return dict(PARAMS.get(name, {}))


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("shape", [(1,), (37,), (8, 13), (3, 4, 5)])
def test_round_trip_shape_dtype_device(name, shape):
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        t = torch.randn(shape, dtype=dtype)
        c = make(name, **params_of(name))
        payload, ctx = c.compress(t.clone())
        assert isinstance(payload, list) and all(isinstance(p, torch.Tensor) for p in payload)
        out = c.decompress(payload, ctx)
        assert out.shape == t.shape and out.dtype == t.dtype and out.device == t.device


@pytest.mark.parametrize("name", names())
def test_exchange_returns_average_shape(name):
    torch.manual_seed(1)
    ts = [torch.randn(300) for _ in range(3)]
    comps = [make(name, **params_of(name)) for _ in ts]
    for step in range(3):
        outs = emulate_exchange(comps, [t.clone() for t in ts])
        for o in outs:
            assert o.shape == ts[0].shape and o.dtype == ts[0].dtype and torch.isfinite(o).all()
        # every rank decodes the same average
        for o in outs[1:]:
            torch.testing.assert_close(o, outs[0])
        assert all(c.last_bytes > 0 for c in comps)


def test_none_is_exact():
    ts = [torch.randn(50) for _ in range(2)]
    outs = emulate_exchange([make("none"), make("none")], [t.clone() for t in ts])
    torch.testing.assert_close(outs[0], (ts[0] + ts[1]) / 2)


@pytest.mark.parametrize("name", names())
def test_unknown_parameter_is_named(name):
    with pytest.raises(ValueError, match="bogus"):
        make(name, bogus=1)


@pytest.mark.parametrize("name", [n for n in names() if not compressors.REGISTRY[n].builtin_feedback])
def test_error_feedback_loses_nothing(name):
    """With error feedback, what was sent plus what is held back equals everything fed in."""
    torch.manual_seed(2)
    c = make(name, error_feedback=True, **params_of(name))
    assert isinstance(c.ef, ErrorFeedback)
    fed = torch.zeros(200)
    sent = torch.zeros(200)
    for _ in range(5):
        g = torch.randn(200)
        fed += g
        (out,) = emulate_exchange([c], [g.clone()])
        sent += out
    torch.testing.assert_close(sent + c.ef.residual, fed, rtol=1e-4, atol=1e-4)
    state = c.state_dict()
    c2 = make(name, error_feedback=True, **params_of(name))
    c2.load_state_dict(state)
    torch.testing.assert_close(c2.ef.residual, c.ef.residual)


@pytest.mark.parametrize("name", [n for n in names() if compressors.REGISTRY[n].builtin_feedback])
def test_builtin_feedback_refuses_the_flag(name):
    with pytest.raises(ValueError, match="error_feedback"):
        make(name, error_feedback=True)


def test_unknown_name():
    with pytest.raises(ValueError, match="allowed: none"):
        make("gzip")
