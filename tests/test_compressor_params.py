"""What the New run form offers for a compressor (commlab.lab.front.new_run.compressor_params): the parameters the
contract names, with defaults that the compressor accepts and that change nothing when sent."""
import pytest
import torch

from distutil import emulate_exchange
from commlab.engine.compressors import make, names
from commlab.lab.front import new_run

# DESIGN.md: "Each takes its parameters by keyword: ratio (topk, randomk, dgc), threshold (threshold),
# levels (qsgd), rank (powersgd), rows, cols and k (countsketch)"
NAMED = {"topk": {"ratio"}, "randomk": {"ratio"}, "dgc": {"ratio"}, "threshold": {"threshold"},
         "qsgd": {"levels"}, "powersgd": {"rank"}, "countsketch": {"rows", "cols", "k"}}


@pytest.mark.parametrize("name", names())
def test_the_contracts_parameters_are_offered(name):
    offered = [p.name for p in new_run.compressor_params(name)]
    assert len(offered) == len(set(offered))
    assert NAMED.get(name, set()) <= set(offered)
    if name in ("none", "fp16", "bf16"):
        assert offered == []


@pytest.mark.parametrize("name", names())
def test_offered_defaults_are_the_compressors_own(name):
    """Sending every prefilled default gives a compressor that behaves exactly like one made
    without them (so the form never changes a method by showing it)."""
    params = {p.name: p.default for p in new_run.compressor_params(name) if p.default is not None}
    for p in new_run.compressor_params(name):
        if p.default is not None:
            assert isinstance(p.default, p.type), (p.name, p.default)
    torch.manual_seed(4)
    ts = [torch.randn(400) for _ in range(2)]
    plain = [make(name) for _ in ts]
    given = [make(name, **params) for _ in ts]
    for step in range(3):
        a = emulate_exchange(plain, [t.clone() * (step + 1) for t in ts])
        b = emulate_exchange(given, [t.clone() * (step + 1) for t in ts])
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_parameter_without_a_default_says_what_unset_means():
    for name in names():
        for p in new_run.compressor_params(name):
            if p.default is None:
                assert p.unset, f"{name}.{p.name}"
