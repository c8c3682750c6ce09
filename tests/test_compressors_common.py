"""Contracts every registered compressor keeps; a new compressor inherits these tests."""
import re
from pathlib import Path

import pytest
import torch

from commlab.engine import compressors
from commlab.engine.compressors import contract, make, names
from commlab.engine.compressors.base import ErrorFeedback
from commlab.engine.compressors.capabilities import BucketContext
from commlab.engine.compressors.params import Param
from commlab.engine.comm.exchange import local_collective, run_exchange
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


VOTES = ("signsgd", "signum")
"""Their exchange returns the majority vote of the ranks' signs (sign of the sum), not a mean."""
CAST_TOL = {"fp16": 2e-3, "bf16": 2e-2}
"""Casts sum the ranks' rounded values, the reference rounds the average once."""


def _ranks(name, ranks):
    """Fresh instances and the contexts of the given process ranks (bucket 0, no layout)."""
    return [make(name, **params_of(name)) for _ in ranks], [BucketContext(rank=r) for r in ranks]


@pytest.mark.parametrize("name", names())
def test_exchange_returns_the_average(name):
    """Three ranks' exchange against a reference built from one-rank exchanges of the same method:
    a summable (linear) payload gives what one rank makes of the average; gathered payloads give the
    average of what each rank makes of its own tensor; votes the sign of the sum of those. Stateful
    methods (momentum, residuals) run alongside for three steps. A reference made from the method
    itself cannot see a decoder that returns zeros, so the result must also point the way of the
    true average."""
    world = 3
    torch.manual_seed(1)
    comps, buckets = _ranks(name, range(world))
    summable = comps[0].capabilities.summable
    alone, alone_at = _ranks(name, [0] if summable else range(world))
    tol = CAST_TOL.get(name, 1e-5)
    for step in range(3):
        ts = [torch.randn(300) for _ in range(world)]
        mean = torch.stack(ts).mean(0)
        sent = []
        outs = emulate_exchange(comps, [t.clone() for t in ts], buckets=buckets, sent=sent)
        if summable:
            (ref,) = emulate_exchange(alone, [mean.clone()], buckets=alone_at)
        else:
            each = torch.stack([emulate_exchange([c], [t.clone()], buckets=[b])[0]
                                for c, b, t in zip(alone, alone_at, ts)])
            ref = each.sum(0).sign() if name in VOTES else each.mean(0)
        for rank, o in enumerate(outs):
            assert o.shape == ts[0].shape and o.dtype == ts[0].dtype
            torch.testing.assert_close(o, ref, rtol=tol, atol=tol, msg=lambda m: f"step {step} rank {rank}: {m}")
        if step == 0:  # before momentum and residuals carry anything over
            cos = torch.nn.functional.cosine_similarity(outs[0], mean, dim=0).item()
            assert cos > 0.05, f"the exchange's result does not follow the average (cosine {cos:.3f})"
        assert all(b > 0 for b in sent) and len(sent) == world


def test_none_is_exact():
    ts = [torch.randn(50) for _ in range(2)]
    outs = emulate_exchange([make("none"), make("none")], [t.clone() for t in ts])
    torch.testing.assert_close(outs[0], (ts[0] + ts[1]) / 2)


@pytest.mark.parametrize("name", names())
def test_unknown_parameter_is_named(name):
    with pytest.raises(ValueError, match="bogus"):
        make(name, bogus=1)


@pytest.mark.parametrize("name", [n for n in names() if not compressors.REGISTRY[n].capabilities.builtin_feedback])
def test_error_feedback_loses_nothing(name):
    """With error feedback, what was sent plus what is held back equals everything fed in."""
    torch.manual_seed(2)
    c = make(name, error_feedback=True, **params_of(name))
    assert isinstance(c, ErrorFeedback) and type(c.inner) is compressors.REGISTRY[name]
    fed = torch.zeros(200)
    sent = torch.zeros(200)
    for _ in range(5):
        g = torch.randn(200)
        fed += g
        (out,) = emulate_exchange([c], [g.clone()])
        sent += out
    torch.testing.assert_close(sent + c.residual, fed, rtol=1e-4, atol=1e-4)
    state = c.state_dict()
    assert set(state["ef"]) == {"residual"}  # where checkpoints have kept it
    c2 = make(name, error_feedback=True, **params_of(name))
    c2.load_state_dict(state)
    torch.testing.assert_close(c2.residual, c.residual)


@pytest.mark.parametrize("name", [n for n in names() if compressors.REGISTRY[n].capabilities.builtin_feedback])
def test_builtin_feedback_refuses_the_flag(name):
    with pytest.raises(ValueError, match="error_feedback"):
        make(name, error_feedback=True)


def test_unknown_name():
    with pytest.raises(ValueError, match="allowed: none"):
        make("gzip")


# -- declarations: parameters and capabilities, read instead of probed ------

@pytest.mark.parametrize("name", names())
def test_declared_parameters_are_what_the_constructor_takes(name):
    cls = compressors.REGISTRY[name]
    c = make(name)
    for p in cls.params:
        assert isinstance(p, Param) and p.help and "\n" not in p.help
        assert getattr(c, p.name) == p.default, f"{name}.{p.name} is not stored as declared"
    with pytest.raises(ValueError) as e:
        make(name, colour=1)
    msg = str(e.value)
    assert msg.startswith("colour: ") and "\n" not in msg
    if cls.params:
        assert msg.endswith("allowed: " + ", ".join(p.name for p in cls.params))
    else:
        assert "takes no parameters" in msg


@pytest.mark.parametrize("name,p", [(n, p) for n in names() for p in compressors.REGISTRY[n].params],
                         ids=lambda x: getattr(x, "name", x))
def test_declared_ranges_are_enforced(name, p):
    """Values just outside a declared bound, and of the wrong type, are refused naming the parameter."""
    bad = ["x"]
    if p.type is not bool:
        bad.append(True)
        if p.lo is not None:
            bad.append(p.lo if p.lo_open else (p.lo - 1 if p.type is int else p.lo - 1e-3))
        if p.hi is not None:
            bad.append(p.hi if p.hi_open else (p.hi + 1 if p.type is int else p.hi + 1e-3))
    for v in bad:
        with pytest.raises(ValueError, match=rf"^{p.name}: must be "):
            make(name, **{p.name: v})


def _readme_rows():
    """The compressor table of the docs (docs/reference/compressors.md), name -> its parameters cell."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "compressors.md").read_text()
    start = text.index("| name | parameters (default) |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = line.split("|")
        for n in cells[1].replace("`", "").split(","):
            rows[n.strip()] = cells[2]
    return rows


def _shown(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def test_readme_table_lists_every_declared_parameter():
    rows = _readme_rows()
    assert set(rows) == set(names())
    for name in names():
        row = rows[name]
        declared = compressors.REGISTRY[name].params
        for p in declared:
            want = f"`{p.name}`" if p.default is None else f"`{p.name}` ({_shown(p.default)})"
            assert want in row, f"docs/reference/compressors.md's {name} row lacks {want}"
        listed = set(re.findall(r"`(\w+)`", row))
        assert listed == {p.name for p in declared}, f"docs/reference/compressors.md's {name} row lists {listed}"


@pytest.mark.parametrize("name,params", [(n, params_of(n)) for n in names()] + [("countsketch", {"exact": True})])
def test_declared_rounds_and_summable_match_the_exchange(name, params):
    torch.manual_seed(3)
    comps = [make(name, **params) for _ in range(2)]
    log = []
    emulate_exchange(comps, [torch.randn(600) for _ in comps], log)
    c = comps[0].capabilities
    assert len(log) == c.rounds
    assert {op for op, _ in log} == {"allreduce" if c.summable else "allgather"}


@pytest.mark.parametrize("name", [n for n in names() if make(n).capabilities.keeps_shape])
def test_keeps_shape_payloads_decode_slice_by_slice(name):
    """What dear relies on: one payload element per input element, and a slice decodes to the same slice."""
    torch.manual_seed(4)
    t = torch.randn(96)
    c = make(name)
    payload, ctx = c.compress(t.clone())
    assert len(payload) == 1 and payload[0].numel() == t.numel()
    whole = c.decompress([payload[0].clone()], ctx).reshape(-1)
    for a, b in ((0, 32), (32, 64), (64, 96)):
        torch.testing.assert_close(c.decompress([payload[0][a:b].clone()], ctx).reshape(-1), whole[a:b])


@pytest.mark.parametrize("name", [n for n in names() if make(n).capabilities.shard_codec])
def test_shard_codecs_encode_slices_alone_and_decode_them_anywhere(name):
    """What dear's all-to-all relies on: a slice's payload sizes depend only on its length, and another
    instance (another rank) decodes it with its own ctx for a slice of that length."""
    torch.manual_seed(6)
    a, b = make(name), make(name)
    x, y = torch.randn(300) * 5, torch.randn(300)
    parts = contract.encode_parts(a, x.clone(), 3)
    mine = contract.encode_parts(b, y.clone(), 3)
    assert len(parts) == 3
    for (pa, _), (pb, cb) in zip(parts, mine):
        assert [(t.dtype, t.shape) for t in pa] == [(t.dtype, t.shape) for t in pb]
    for j, (pa, ca) in enumerate(parts):
        torch.testing.assert_close(b.decompress(pa, mine[j][1]), a.decompress(pa, ca))
        assert (b.decompress(pa, mine[j][1]) - x[100 * j:100 * (j + 1)]).abs().max() < 0.5
    with pytest.raises(ValueError, match="do not split into 7 equal parts"):
        contract.encode_parts(a, x, 7)
    with pytest.raises(ValueError, match="not a shard codec"):
        contract.encode_parts(make("topk"), x, 3)


@pytest.mark.parametrize("name", names())
def test_lossless_means_only_wire_rounding(name):
    torch.manual_seed(5)
    # heavy-tailed, as gradients are: on Gaussian data int8's 255 levels per block of 256 lose only 0.6%,
    # yet a value far below its block's largest is lost entirely, which error feedback would keep
    t = torch.randn(512) * torch.exp(torch.randn(512))
    c = make(name, **params_of(name))
    out = c.decompress(*c.compress(t.clone()))
    err = (torch.linalg.vector_norm(out - t) / torch.linalg.vector_norm(t)).item()
    if c.capabilities.lossless:
        assert err < 4e-3  # bfloat16's 8-bit mantissa: relative rounding below 2^-8
    else:
        assert err > 1e-2, f"{name} loses almost nothing: declare it lossless?"


def test_dear_takes_exactly_the_shardable_compressors():
    """shard_problem reads the instance's capabilities: one round, summable, shape kept; parameters can change
    the answer."""
    def problem(name, **params):
        return make(name, **params).capabilities.shard_problem()
    assert compressors.shardable() == ("none", "fp16", "bf16", "int8")
    assert [make(n).capabilities.shard_path() for n in compressors.shardable()] == ["sum", "sum", "sum", "alltoall"]
    assert problem("int8", error_feedback=True) is None
    assert problem("countsketch") == "has a payload that does not keep the gradient's shape"
    assert problem("countsketch", exact=True) == "takes 2 rounds"
    assert problem("randomk") == "has a payload that does not keep the gradient's shape"
    assert problem("topk") == "has payloads that cannot be summed"
    assert problem("fp16", error_feedback=True) is None
    assert make("topk").capabilities.shard_problem() == problem("topk")  # the instance says the same


def test_inputs_are_made_on_the_test_device(compressor_test_device):
    """COMMLAB_TEST_DEVICE (tests/conftest.py) moves this module's tensors; the compressors see real torch."""
    assert torch.randn(3).device.type == torch.device(compressor_test_device or "cpu").type
    x = torch.randn(5)
    assert make("fp16").decompress(*make("fp16").compress(x)).device == x.device


@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("name", compressors.shardable())
def test_shard_exchange_gives_each_rank_its_shard_of_the_average(name, ef):
    """dear's exchange, three ranks simulated in one process through the exchange driver: rank r ends with
    its shard of the average, in the input's dtype. A payload that keeps the shape ("sum") is
    reduce-scattered and gives exactly the slice the whole exchange gives; a shard codec ("alltoall")
    gives the average of every rank's round trip of that slice alone. Both follow the true average and
    say what they sent."""
    world, n = 3, 300
    torch.manual_seed(7)
    ts = [torch.randn(n) for _ in range(world)]
    comps = [make(name, error_feedback=ef) for _ in range(world)]
    ops = []

    def collective(op, payloads):
        ops.append(op)
        return local_collective(op, payloads)
    exs = run_exchange(comps, [t.clone() for t in ts], world, collective, ranks=range(world))
    got = [ex.out for ex in exs]
    s = n // world
    assert all(g.shape == (s,) and g.dtype == ts[0].dtype for g in got)
    if comps[0].capabilities.shard_path() == "sum":
        assert ops == ["reduce_scatter"]
        whole = emulate_exchange([make(name, error_feedback=ef) for _ in range(world)], [t.clone() for t in ts])[0]
        torch.testing.assert_close(torch.cat(got), whole, rtol=0, atol=0)
    else:
        assert ops == ["all_to_all"]
        alone = make(name)
        for r, g in enumerate(got):
            ref = sum(alone.decompress(*alone.compress(t[r * s:(r + 1) * s].clone())) for t in ts) / world
            torch.testing.assert_close(g, ref)
    assert (torch.cat(got) - torch.stack(ts).mean(0)).abs().max() < 0.05
    assert all(ex.sent > 0 for ex in exs)


def test_shard_exchange_refuses_what_dear_cannot_take():
    with pytest.raises(ValueError, match="^dear: topk has payloads that cannot be summed$"):
        run_exchange([make("topk")], [torch.randn(8)], 2, local_collective, ranks=[0])


@pytest.mark.parametrize("name", compressors.shardable())
def test_declared_shard_rounds_are_the_driven_ones(name):
    """What the performance model reads instead of driving dear's exchange: one rank alone sends the
    declared rounds (or the compressor declares none and is driven)."""
    for n in (1, 257, 1000):
        c = make(name)
        declared = contract.declared_shard_rounds(c, n, 4)
        sent = []

        def collective(op, payloads):
            (mine,) = payloads
            each = mine if op == "all_to_all" else [mine]
            sent.append((op, sum(x.numel() * x.element_size() for p in each for x in p), len(each[0])))
            return local_collective(op, payloads)
        run_exchange([c], [torch.randn(n)], 1, collective, ranks=[0])
        assert declared in (None, sent), (n, declared, sent)
        assert sent[0][0] == ("reduce_scatter" if c.capabilities.shard_path() == "sum" else "all_to_all")
    assert contract.declared_shard_rounds(make("int8"), 1000, 4) == [("all_to_all", 4 * 4 + 1000, 2)]
