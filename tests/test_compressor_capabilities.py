"""Capabilities compressors declare instead of being probed for (commlab/engine/compressors/capabilities.py,
``Capabilities``): warmup_exchanges (uncompressed exchanges first) and the optional per_tensor (compresses
tensor by tensor from the bucket's layout, commlab/engine/compressors/contract.py). The declarations are
checked against what the exchanges really do."""
import pytest
import torch

from distutil import emulate_exchange
from commlab.engine.compressors import contract, make, names
from commlab.engine.compressors.capabilities import BucketContext

N = 4096
LAYOUT = BucketContext(layout=[(0, (64, 32)), (2048, (2048,))])


def _sent(c, n=N):
    """Payload bytes of one one-rank exchange of a bucket of n random elements."""
    sent = []
    emulate_exchange([c], [torch.randn(n)], sent=sent)
    return sent[0]


@pytest.mark.parametrize("name", names())
def test_warmup_exchanges_are_the_plain_ones(name):
    """Exactly the first ``warmup_exchanges`` exchanges send the bucket as it is; the next one compresses
    (the identity compressor, which never compresses, declares none)."""
    # threshold's default 0.01 keeps 99% of N(0, 1) data, more bytes than the bucket (values and indices)
    params = {"powersgd": {"start_iter": 3}, "threshold": {"threshold": 2.0}}.get(name, {})
    c = make(name, **params)
    raw = N * 4
    warm = c.capabilities.warmup_exchanges
    assert warm == (3 if name == "powersgd" else 0)
    for _ in range(warm):
        assert _sent(c) == raw
    if name != "none":
        assert _sent(c) < raw


def test_warmup_follows_the_parameter():
    assert make("powersgd").capabilities.warmup_exchanges == 10
    assert make("powersgd", start_iter=0).capabilities.warmup_exchanges == 0
    assert type(make("powersgd")).capabilities.warmup_exchanges == 0  # the instance's own record says it


@pytest.mark.parametrize("name", names())
def test_per_tensor_is_declared_by_the_compressor_that_reads_the_layout(name):
    c = make(name)
    assert contract.per_tensor(c, N) is False  # no layout: one flat tensor
    assert contract.per_tensor(c, N, LAYOUT) is (name == "powersgd")
    assert contract.per_tensor(c, N + 1, LAYOUT) is False  # a layout that does not describe the bucket is not used


def test_per_tensor_powersgd_sends_per_tensor_factors():
    """What per_tensor promises: with the layout, the weight matrix is compressed on its own and the
    vector sent as it is; flat, the whole bucket is one near-square matrix."""
    c = make("powersgd", start_iter=0, rank=1)
    log = []
    emulate_exchange([c], [torch.randn(N)], log, buckets=[LAYOUT])
    assert log == [("allreduce", [(64 + 2048,)]), ("allreduce", [(32,)])]
    flat = make("powersgd", start_iter=0, rank=1)
    log = []
    emulate_exchange([flat], [torch.randn(N)], log)
    assert log == [("allreduce", [(64, 1)]), ("allreduce", [(64, 1)])]


@pytest.mark.parametrize("name", names())
def test_counts_steps_is_declared_by_the_compressors_that_count(name):
    """A relayout carries ``step`` over for exactly these; it must be a counter that every exchange advances."""
    c = make(name)
    assert c.capabilities.counts_steps == hasattr(c, "step")
    if c.capabilities.counts_steps:
        for i in range(3):
            assert c.step == i
            _sent(c)


def test_builtin_momentum_is_declared_where_the_method_keeps_momentum():
    """DGC (momentum correction) and Signum (a momentum buffer) apply momentum themselves: the
    compressor-accuracy bench reads this declaration to run their optimizer without momentum."""
    assert [n for n in names() if make(n).capabilities.builtin_momentum] == ["dgc", "signum"]
    from bench.compressor_accuracy import BASE, spec_for
    assert spec_for("dgc", False, 10)["optimizer"]["momentum"] == 0.0
    assert spec_for("signum", False, 10)["optimizer"] == {"name": "sgd", "lr": 0.002, "momentum": 0.0}
    assert spec_for("topk", True, 10)["optimizer"] == BASE["optimizer"]


def test_the_performance_model_skips_cost_curves_by_the_declared_identity():
    """Only an identity compressor without error feedback runs no compressor code (no cost curve);
    with error feedback, or any real compressor, the model needs the measured curve."""
    from commlab.lab.strategy.perfmodel.calibrate import needs_curve
    plain = [n for n in names() if not needs_curve({"name": n})]
    assert plain == [n for n in names() if make(n).capabilities.identity] == ["none"]
    assert not make("none", error_feedback=True).capabilities.identity  # its payload is the corrected input
    assert needs_curve({"name": "none", "error_feedback": True})
    assert needs_curve({"name": "fp16", "params": {}, "error_feedback": False})
