"""The narrow compressor contract (commlab/engine/compressors/base.py): what the base class carries, the
capabilities record, the bucket's context passed in (never written on an instance), the bytes counted by the
exchange driver, error feedback as a wrapper; and a plug-in written to the earlier contract, adapted by
commlab/engine/compressors/legacy.py, working unchanged."""
import ast
import dataclasses
import inspect
import math

import pytest
import torch

from distutil import run_world
from commlab.engine import compressors
from commlab.engine.comm.exchange import Exchange, local_collective, run_exchange
from commlab.engine.compressors import conformance, contract, make, names
from commlab.engine.compressors.base import Compressor, ErrorFeedback, Round, nbytes
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext, Capabilities
from commlab.engine.compressors.params import Param

OLD_PER_BUCKET = ("bucket", "process_rank", "layout", "last_bytes", "ef")
"""What the communicator and the factory used to write on an instance."""


# --------------------------------------------------------------------------- the base class

def _members(cls):
    skip = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__"}
    attrs, methods = [], []
    for k, v in cls.__dict__.items():
        if k in skip:
            continue
        (methods if inspect.isfunction(v) or isinstance(v, (property, classmethod, staticmethod)) else attrs).append(k)
    return attrs, methods


def test_the_base_class_carries_only_the_contract():
    """Three class attributes (21 before the contract narrowed) and ten methods (22 before): what a subclass
    writes or overrides, and nothing another part of the lab needs from it."""
    attrs, methods = _members(Compressor)
    assert attrs == ["name", "params", "capabilities"]
    assert methods == ["__init__", "__init_subclass__", "compress", "decompress", "exchange", "state_dict",
                       "load_state_dict", "describe", "__repr__"]
    for gone in OLD_PER_BUCKET + ("summable", "rounds", "encode", "encode_parts", "shard_exchange", "declared_rounds",
                                  "per_tensor", "skip_warmup", "graph_safe", "elementwise_state", "warmup_exchanges"):
        assert not hasattr(Compressor, gone), gone


def test_every_capability_is_documented_where_it_is_declared():
    """Each field of the record has a default and its own docstring (the string after it in the source), which
    says what it promises and who reads it."""
    body = ast.parse(inspect.getsource(Capabilities)).body[0].body
    docs = {a.target.id: b.value.value for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}
    fields = dataclasses.fields(Capabilities)
    assert set(docs) == {f.name for f in fields}
    assert all(len(docs[f.name]) > 80 and f.default is not dataclasses.MISSING for f in fields)


@pytest.mark.parametrize("given,said", [
    ({"summable": 1}, "capabilities.summable: must be True or False, got 1"),
    ({"rounds": 0}, "capabilities.rounds: must be an integer >= 1, got 0"),
    ({"warmup_exchanges": -1}, "capabilities.warmup_exchanges: must be an integer >= 0, got -1"),
    ({"dtypes": ()}, "capabilities.dtypes: must be a non-empty tuple of torch dtypes, got ()"),
    ({"elementwise": "m"}, "capabilities.elementwise: must be a tuple of attribute names, got 'm'")])
def test_a_bad_capability_is_one_line(given, said):
    with pytest.raises(TypeError) as e:
        Capabilities(**given)
    assert str(e.value) == said


def test_a_class_declares_capabilities_once_as_a_record():
    with pytest.raises(TypeError, match=r"capabilities must be a commlab.Capabilities record, got dict"):
        type("Loose", (Compressor,), {"capabilities": {"summable": False}})
    with pytest.raises(TypeError, match=r": declares capabilities and also summable as attributes; declare them once"):
        type("Twice", (Compressor,), {"capabilities": Capabilities(), "summable": False})
    with pytest.raises(dataclasses.FrozenInstanceError):
        make("topk").capabilities.summable = True
    c = make("countsketch", exact=True)  # parameters change it: the instance holds its own record
    assert c.capabilities.rounds == 2 and type(c).capabilities.rounds == 1


def test_the_public_surface_names_the_record_and_the_wrapper():
    import commlab
    assert commlab.Capabilities is Capabilities and commlab.ErrorFeedback is ErrorFeedback
    assert "capabilities = Capabilities(summable=False)" in Compressor.__doc__


# --------------------------------------------------------------------------- the bucket's context, the bytes

def _logged(op_log):
    def collective(op, payloads):
        mine = payloads[0]
        each = mine if op == "all_to_all" else [mine]
        op_log.append(sum(nbytes(p) for p in each))
        return local_collective(op, payloads)
    return collective


@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("name", names())
def test_an_exchange_writes_nothing_on_the_compressor_and_the_driver_counts_the_bytes(name, ef):
    """Two ranks, each with its context (bucket 4, its rank, a layout), over three steps: the compressor never
    gets the old per-bucket attributes, and ``Exchange.sent`` is what each rank put on the wire, every round."""
    if ef and make(name).capabilities.builtin_feedback:
        return
    params = {"powersgd": {"start_iter": 1}}.get(name, {})
    layout = ((0, (20, 30)), (600, (40,)))
    comps = [make(name, error_feedback=ef, **params) for _ in range(2)]
    buckets = [BucketContext(4, r, layout) for r in range(2)]
    for step in range(3):
        log = []
        exs = run_exchange(comps, [torch.randn(640) for _ in comps], 2, _logged(log), buckets=buckets)
        assert exs[0].sent == sum(log) and exs[0].sent > 0, (step, log)  # rank 0's payloads, every round
    for c in comps:
        inner = contract.unwrap(c)
        assert not set(OLD_PER_BUCKET) & set(vars(inner)), sorted(set(OLD_PER_BUCKET) & set(vars(inner)))
        assert not set(OLD_PER_BUCKET) & set(vars(c))


@pytest.mark.parametrize("name", compressors.shardable())
def test_dears_exchange_is_counted_too(name):
    comps = [make(name) for _ in range(2)]
    log = []
    exs = run_exchange(comps, [torch.randn(600) for _ in comps], 2, _logged(log), ranks=[0, 1])
    assert exs[0].sent == exs[1].sent == sum(log) > 0


def test_the_context_reaches_compress_where_a_class_takes_it():
    """A class declaring ``takes_bucket`` gets the bucket's context in ``compress`` from the exchange, error
    feedback included, and the default one on its own; one that does not is called with the tensor alone."""
    seen = []

    class Seeded(Compressor):
        capabilities = Capabilities(takes_bucket=True)

        def compress(self, t, bucket=DEFAULT_BUCKET):
            seen.append((bucket.index, bucket.rank, bucket.layout))
            return [t.clone()], None

        def decompress(self, payload, ctx):
            return payload[0]
    b = BucketContext(7, 1, [(0, (2, 3))])
    assert b.layout == ((0, (2, 3)),)  # kept as a tuple
    run_exchange([Seeded()], [torch.ones(6)], 1, local_collective, buckets=[b])
    run_exchange([ErrorFeedback(Seeded())], [torch.ones(6)], 1, local_collective, buckets=[b])
    Seeded().compress(torch.ones(6))
    assert seen == [(7, 1, ((0, (2, 3)),))] * 2 + [(0, 0, None)]


def _communicator_contexts(rank, world):
    from commlab.engine import schedules
    from commlab.engine.comm.wfbp import WFBP
    from commlab.engine.compressors.plan import Plan
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    dp = WFBP(m, lambda infos: schedules.build("layerwise", infos), Plan.of("randomk", ratio=0.5, error_feedback=True))
    for _ in range(2):
        m(torch.randn(4, 6)).sum().backward()
        dp.finish()
        dp.zero_grad()
    out = [(b.context.index, b.context.rank, b.context.layout, [tuple(p.shape) for p in b.params], b.sent,
            sorted(set(OLD_PER_BUCKET) & (set(vars(b.compressor)) | set(vars(b.compressor.inner)))))
           for b in dp.buckets]
    step_bytes = dp.step_bytes
    dp.close()
    return out, step_bytes


def test_the_communicator_hands_each_bucket_its_context_and_keeps_the_bytes():
    for rank, (buckets, step_bytes) in enumerate(run_world(_communicator_contexts)):
        assert [b[0] for b in buckets] == list(range(len(buckets))) and len(buckets) == 4
        for index, r, layout, shapes, sent, written in buckets:
            assert r == rank and [s for _, s in layout] == shapes and written == []
            assert sent == 4 * math.ceil(0.5 * sum(math.prod(s) for s in shapes))  # randomk: k fp32 values
        assert step_bytes == sum(b[4] for b in buckets)


# --------------------------------------------------------------------------- error feedback wraps

def test_error_feedback_wraps_a_compressor_and_keeps_the_checkpoint_layout():
    c = make("randomk", ratio=0.1, error_feedback=True)
    assert isinstance(c, ErrorFeedback) and isinstance(c.inner, compressors.REGISTRY["randomk"])
    assert (c.name, c.describe(), repr(c)) == ("randomk", "randomk(ratio=0.1)+EF",
                                             "RandomK(ratio=0.1, seed=0, unbiased=False) +EF")
    assert c.ratio == 0.1 and c.capabilities == c.inner.capabilities  # reads fall through
    for _ in range(3):
        run_exchange([c], [torch.randn(100)], 1, local_collective)
    state = c.state_dict()
    assert set(state) == {"ef", "step"} and state["step"] == 3 and state["ef"]["residual"].shape == (100,)
    d = make("randomk", ratio=0.1, error_feedback=True)
    d.load_state_dict(state)  # a checkpoint of the earlier layout: {"ef": {"residual": ...}, "step": ...}
    assert d.step == 3 and torch.equal(d.residual, c.residual)
    x = torch.randn(100)
    a, b = (run_exchange([k], [x.clone()], 1, local_collective)[0].out for k in (c, d))
    assert torch.equal(a, b)


def test_error_feedback_refusals_are_one_line():
    with pytest.raises(ValueError, match="^error_feedback: powersgd keeps its own residual already; leave "
                                         "error_feedback off$"):
        ErrorFeedback(make("powersgd"))
    with pytest.raises(ValueError, match="^error_feedback: wraps one compressor instance, got ErrorFeedback$"):
        ErrorFeedback(make("topk", error_feedback=True))
    assert not make("none", error_feedback=True).capabilities.identity  # the payload is the corrected input
    assert not Exchange.prescales(make("none", error_feedback=True)) and Exchange.prescales(make("none"))


# --------------------------------------------------------------------------- a plug-in written the old way

class OldScaledSign(Compressor):
    """The example of the earlier guide, as written then: capabilities as class attributes."""
    summable = False
    shard_codec = True
    params = (Param("scale", float, 1.0, "multiplies the decoded magnitude", lo=0, lo_open=True),)

    def compress(self, t):
        mag = t.abs().mean().reshape(1) if t.numel() else t.new_zeros(1)
        return [torch.sign(t).to(torch.int8), mag], (t.shape, t.dtype)

    def decompress(self, payload, ctx):
        signs, mag = payload
        shape, dtype = ctx
        return (signs.to(dtype) * (mag.to(dtype) * self.scale)).view(shape)


class OldTwoRounds(Compressor):
    """Everything the earlier contract offered: capabilities set by parameters in ``__init__`` and as a
    property, its own ``exchange(t, world_size)`` calling ``self.encode`` (error feedback inside) and reading
    ``self.ef``, ``self.layout``, ``self.bucket`` and ``self.process_rank``, setting ``self.last_bytes``, an
    old-signature ``declared_rounds`` and ``per_tensor``, and ``state_dict`` through ``super()``."""
    summable = True
    keeps_shape = True
    counts_steps = True
    params = (Param("exact", bool, True, "a second round"), Param("warm", int, 0, "plain exchanges first", lo=0))

    def __init__(self, **given):
        super().__init__(**given)
        self.rounds = 2 if self.exact else 1
        self.step = 0
        self.seen = []

    @property
    def warmup_exchanges(self):
        return self.warm

    def skip_warmup(self):
        self.step = max(self.step, self.warm)

    def compress(self, t):
        self.seen.append(("compress", self.bucket, self.process_rank, self.layout, self.ef is not None))
        return [t.half()], t.dtype

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)

    def exchange(self, t, world_size):
        self.step += 1
        payload, ctx = self.encode(t)
        self.last_bytes = nbytes(payload)
        (summed,) = yield Round("allreduce", payload)
        if self.exact:
            (summed,) = yield Round("allreduce", [summed])  # an echo round, to be counted
            self.last_bytes *= 2
        return self.decompress([summed], ctx).div_(world_size * (world_size if self.exact else 1))

    def declared_rounds(self, n, element_size):
        return [("allreduce", 2 * n, 1)] * (2 if self.exact else 1) if self.layout else None

    def per_tensor(self, n):
        return self.layout is not None

    def state_dict(self):
        return {**super().state_dict(), "step": self.step}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.step = int(state.get("step", 0))


class OldReadsTheBucket(Compressor):
    """Declares nothing old, but reads ``self.bucket`` as the earlier contract allowed."""

    def compress(self, t):
        return [t + 0 * self.bucket], None

    def decompress(self, payload, ctx):
        return payload[0]


def test_old_capability_attributes_are_read_into_the_record():
    k = OldScaledSign.capabilities
    assert (k.summable, k.shard_codec, k.takes_bucket) == (False, True, True)
    c = OldTwoRounds(exact=True, warm=2)
    assert (c.capabilities.rounds, c.capabilities.warmup_exchanges, c.capabilities.keeps_shape) == (2, 2, True)
    assert OldTwoRounds(exact=False).capabilities.rounds == 1
    assert OldTwoRounds.capabilities.rounds == 1  # the class: what its class attributes say
    assert make(OldReadsTheBucket).capabilities.takes_bucket  # so that the context reaches it


def test_an_old_plug_in_passes_the_checks_and_runs_in_dear():
    results = conformance.check(OldScaledSign, {"scale": 0.5})
    assert {r.status for r in results} == {"PASS"}, "\n".join(r.line() for r in results)
    results = conformance.check(OldReadsTheBucket)
    assert conformance.passed(results), "\n".join(r.line() for r in results if not r.ok)


def test_an_old_exchange_gets_its_context_through_the_old_names_with_error_feedback():
    layout = ((0, (4, 5)), (20, (3,)))
    comps = [make(OldTwoRounds, error_feedback=True) for _ in range(2)]
    buckets = [BucketContext(3, r, layout) for r in range(2)]
    xs = [torch.randn(23) for _ in range(2)]
    log = []
    exs = run_exchange(comps, [x.clone() for x in xs], 2, _logged(log), buckets=buckets)
    assert exs[0].sent == sum(log) == 2 * 2 * 23  # two rounds of fp16
    torch.testing.assert_close(exs[0].out, (xs[0] + xs[1]) / 2, rtol=2e-3, atol=2e-3)
    for r, c in enumerate(comps):
        inner = c.inner
        assert inner.seen == [("compress", 3, r, layout, True)] and inner.ef is c and inner.step == 1
        assert c.residual is not None and c.residual.abs().max() < 1e-2  # what fp16 dropped
    assert contract.declared_rounds(comps[0], 23, 4, buckets[0]) == [("allreduce", 46, 1)] * 2
    assert contract.declared_rounds(comps[0], 23, 4) is None and contract.per_tensor(comps[0], 23, buckets[0])
    contract.skip_warmup(comps[0])
    state = comps[0].state_dict()
    assert set(state) == {"ef", "step"} and state["step"] == 1


class KeepsTheLargeOnes(Compressor):
    """Sends the entries above 1 in magnitude: how many follows the values, yet it claims ``fixed_payload``."""
    capabilities = Capabilities(summable=False, fixed_payload=True)

    def compress(self, t):
        flat = t.reshape(-1)
        idx = (flat.abs() > 1).nonzero().view(-1)
        return [flat[idx], idx], (t.shape, flat.numel())

    def decompress(self, payload, ctx):
        out = torch.zeros(ctx[1], dtype=payload[0].dtype)
        out[payload[1]] = payload[0]
        return out.view(ctx[0])


def test_fixed_payload_is_checked_and_spares_the_all_gather_its_shapes():
    """A compressor whose payload sizes follow its values fails ``commlab check compressor`` when it claims
    ``fixed_payload`` (its all-gathers would not line up across ranks); top-k's claim holds, and its exchange
    driver marks its all-gathers alike, which issue_allgather then sends without the exchange of shapes."""
    (decl,) = [r for r in conformance.check(KeepsTheLargeOnes) if r.check == "declaration"]
    assert decl.status == "FAIL" and "declares fixed_payload, but in round 1 the ranks' payload sizes differ" \
        in decl.reason, decl.line()
    (decl,) = [r for r in conformance.check("topk", {"ratio": 0.1}) if r.check == "declaration"]
    assert decl.status == "PASS" and "payload sizes fixed on every rank" in decl.reason, decl.line()
    assert not make("threshold").capabilities.fixed_payload and not make("dgc").capabilities.fixed_payload
    for name, alike in (("topk", True), ("qsgd", True), ("threshold", False)):
        ex = Exchange(make(name), torch.randn(64), 2)
        assert ex.start().alike is alike, name
