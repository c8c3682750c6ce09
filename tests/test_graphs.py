"""CUDA graphs of compress (commlab/engine/compressors/graphs.py, ``COMMLAB_GRAPHS=1``).

On the CPU: the bookkeeping, with a stand-in for the graph (when a call is eager, captured or replayed; what
changes the key; eviction; a failed capture; copies). On a GPU: graphed calls held bit for bit to eager ones of
the same codec over several steps, state included, and a training run with graphs on.
"""
import contextlib
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commlab.engine import compressors
from commlab.engine.compressors import contract, fused, graphs
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext

ROOT = Path(__file__).resolve().parents[1]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GRAPHABLE = ["signsgd", "signum", "efsignsgd", "onebit", "qsgd", "terngrad", "natural"]


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: the capture runs the call (what it would record), a replay counts."""
    made = 0

    def __init__(self):
        FakeGraph.made += 1
        self.replays = 0

    def replay(self):
        self.replays += 1


@contextlib.contextmanager
def fake_capture(graph):
    yield


def counting(fn, t):
    calls = []

    def call():
        calls.append(t)
        return fn(t)
    call.calls = calls
    return call


def test_a_call_is_eager_warm_times_then_captured_then_replayed():
    g = graphs.Graphs(FakeGraph, fake_capture)
    t = torch.ones(4)
    fn = counting(lambda t: ([t * 2], "ctx"), t)
    outs = [g.call(fn, ("k",), graphs._payload) for _ in range(graphs.WARM + 4)]
    assert len(fn.calls) == graphs.WARM + 1  # eager WARM times, then once inside the capture
    assert g.captures == 1 and g.replays == 1 + 3  # the capture's own call is a replay too, then three
    assert all(o[1] == "ctx" and torch.equal(o[0][0], t * 2) for o in outs)
    # the replayed payload is the captured tensor (the graph's memory), in a list of the caller's own
    assert outs[-1][0][0] is outs[-2][0][0] and outs[-1][0] is not outs[-2][0]


def test_another_key_is_counted_on_its_own_and_the_oldest_graph_goes_first():
    g = graphs.Graphs(FakeGraph, fake_capture)
    t = torch.ones(2)
    fn = counting(lambda t: ([t], None), t)
    for k in range(graphs.MOST + 1):
        for _ in range(graphs.WARM + 1):
            g.call(fn, (k,))
    assert g.captures == graphs.MOST + 1 and len(g.graphs) == graphs.MOST
    assert (0,) not in g.graphs and (graphs.MOST,) in g.graphs
    before = len(fn.calls)
    g.call(fn, (0,))  # evicted: eager again, its count started afresh
    assert len(fn.calls) == before + 1


def test_the_key_follows_the_input_address_and_the_state_tensors():
    c = compressors.make("signum")
    x = torch.randn(100)
    k0 = graphs.key(c, x)
    c.compress(x)  # creates the momentum buffer
    k1 = graphs.key(c, x)
    assert k0 != k1 and k1 == graphs.key(c, x)
    c.load_state_dict(c.state_dict())  # loading makes new tensors: graphs of the old ones must not replay
    assert graphs.key(c, x) != k1
    assert graphs.key(c, x.clone()) != graphs.key(c, x)
    assert graphs.key(c, x.view(10, 10)) != graphs.key(c, x)
    k2 = graphs.key(c, x)
    c.momentum = 0.5  # a parameter changed under a graph: another key (the graph keeps the number it captured)
    assert graphs.key(c, x) != k2


def test_a_codec_whose_inputs_keep_moving_stops_capturing():
    g = graphs.Graphs(FakeGraph, fake_capture)
    t = torch.ones(2)
    fn = counting(lambda t: ([t], None), t)
    with pytest.warns(RuntimeWarning, match=f"{graphs.CAPTURES} captures: its inputs keep moving"):
        for k in range(graphs.CAPTURES + 3):
            for _ in range(graphs.WARM + 1):
                g.call(fn, (k,))
    assert g.captures == graphs.CAPTURES and g.problem


def test_force_overrides_the_environment_per_codec(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(fused, "enabled", lambda t: True)
    a, b, x = compressors.make("signsgd"), compressors.make("signsgd"), torch.randn(8)
    graphs.force(a, True)
    graphs.force(b, False)
    with graphs.enabled(False):
        assert graphs.wanted(a, x) and not graphs.wanted(b, x)
    with graphs.enabled(True):
        assert not graphs.wanted(b, x)
    graphs.force(b, None)
    with graphs.enabled(True):
        assert graphs.wanted(b, x)


def test_a_call_that_fails_on_its_own_is_not_a_failed_capture():
    @contextlib.contextmanager
    def failing(graph):
        yield
        raise RuntimeError("capture invalidated")

    def bad():
        raise ValueError("momentum: the loaded buffer has 3 elements, the bucket 4")
    g = graphs.Graphs(FakeGraph, failing)
    g.seen[("k",)] = graphs.WARM
    with pytest.raises(ValueError, match="loaded buffer"):
        g.call(bad, ("k",))
    assert g.problem is None


def test_a_failed_capture_is_said_once_and_leaves_the_codec_eager():
    @contextlib.contextmanager
    def failing(graph):
        yield
        raise RuntimeError("operation not permitted when stream is capturing")
    g = graphs.Graphs(FakeGraph, failing)
    t = torch.ones(2)
    fn = counting(lambda t: ([t], None), t)
    with pytest.warns(RuntimeWarning, match="vote failed, this codec stays eager.*not permitted"):
        for _ in range(graphs.WARM + 1):
            out = g.call(fn, ("vote",), graphs._payload)
    assert g.problem and "not permitted" in g.problem and torch.equal(out[0][0], t)
    for _ in range(3):
        g.call(fn, ("vote",))
    assert g.captures == 0 and len(fn.calls) == graphs.WARM + 2 + 3  # the failed capture's call, then eager again


def test_graphs_are_off_on_the_cpu_with_error_feedback_and_unless_asked(monkeypatch):
    c = compressors.make("signsgd")
    x = torch.randn(10)
    with graphs.enabled():
        assert not graphs.wanted(c, x)  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with graphs.enabled(), fused.disabled():  # the built-ins graph their fused path only
        assert not graphs.wanted(c, x)
    monkeypatch.setattr(fused, "enabled", lambda t: True)
    with graphs.enabled():
        assert graphs.wanted(c, x)
        assert not graphs.wanted(compressors.make("signsgd", error_feedback=True), x)
        assert graphs.wanted(compressors.make("qsgd"), x)  # its fused path keeps its noise's state on the GPU
        assert not graphs.wanted(compressors.make("topk"), x)
    with graphs.enabled(False):
        assert not graphs.wanted(c, x)
    monkeypatch.setenv(graphs.ENV, "yes")
    with pytest.raises(ValueError, match="COMMLAB_GRAPHS: must be 0 or 1, got 'yes'"):
        graphs.wanted(c, x)


def test_encode_goes_through_the_graphs_and_a_copied_codec_starts_without_them(monkeypatch):
    monkeypatch.setattr(graphs, "wanted", lambda codec, t: True)
    c = compressors.make("signsgd")
    c._graphs = graphs.Graphs(FakeGraph, fake_capture)
    x = torch.randn(64)
    for _ in range(graphs.WARM + 3):
        payload, ctx = DEFAULT_BUCKET.encode(c, x)
    assert c._graphs.captures == 1 and c._graphs.replays == 3
    d = copy.deepcopy(c)
    assert d._graphs is not c._graphs and not d._graphs.graphs and d._graphs.new is FakeGraph


def test_decoding_goes_through_the_graphs_keyed_by_the_payloads_addresses(monkeypatch):
    """The exchange's decoding of every rank's payloads: replayed while the gathered payloads sit at the same
    addresses, eager (and counted afresh) when they move."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    c = compressors.make("onebit")
    c._graphs = graphs.Graphs(FakeGraph, fake_capture)
    payloads = [c.compress(torch.randn(300))[0] for _ in range(2)]
    ctx = c.compress(torch.randn(300))[1]
    calls = []

    def decode_all(gathered, ctx):
        calls.append(len(gathered))
        return torch.zeros(ctx.n)
    with graphs.enabled():
        for _ in range(graphs.WARM + 2):
            graphs.decode(c, decode_all, payloads, ctx)
        assert c._graphs.captures == 1 and c._graphs.replays == 2 and calls == [2] * (graphs.WARM + 1)
        moved = [[p.clone() for p in payload] for payload in payloads]
        graphs.decode(c, decode_all, moved, ctx)
        assert c._graphs.captures == 1 and len(calls) == graphs.WARM + 2
        graphs.decode(c, decode_all, payloads[:1], ctx)  # one rank's payload: another key
        assert len(calls) == graphs.WARM + 3
    with graphs.enabled(False):
        graphs.decode(c, decode_all, payloads, ctx)
    assert len(calls) == graphs.WARM + 4 and c._graphs.replays == 2


def test_a_run_says_what_its_graphs_did_and_records_the_switches(monkeypatch):
    a, b, c = (compressors.make("signsgd") for _ in range(3))
    assert graphs.summary([a, b, c]) is None  # never asked: nothing to say
    a._graphs = graphs.Graphs(FakeGraph, fake_capture)
    b._graphs = graphs.Graphs(FakeGraph, fake_capture)
    t = torch.ones(2)
    for _ in range(graphs.WARM + 3):
        a._graphs.call(lambda: ([t], None), ("k",))
    b._graphs.problem = "RuntimeError: operation not permitted when stream is capturing"
    assert graphs.summary([a, b, c, None]) == (
        "CUDA graphs: 1 of 3 codec(s) captured, 1 capture(s), 3 replay(s); 1 stayed eager, the first because "
        "RuntimeError: operation not permitted when stream is capturing")
    wrapped = compressors.make("onebit", error_feedback=True)  # its decoding's graphs are the inner codec's
    wrapped.inner._graphs = a._graphs
    assert graphs.summary([contract.unwrap(wrapped)]) == "CUDA graphs: 1 of 1 codec(s) captured, 1 capture(s), " \
                                                         "3 replay(s)"
    monkeypatch.setenv("COMMLAB_FUSED", "0")
    monkeypatch.delenv("COMMLAB_FUSED_LAUNCH", raising=False)
    with graphs.enabled():
        assert graphs.settings() == {"fused": "0", "fused_launch": "direct", "graphs": "1"}


def test_the_graphable_codecs_are_the_ones_without_host_randomness():
    declared = {n for n in compressors.names() if compressors.resolve(n).capabilities.graphable}
    assert declared == set(GRAPHABLE)


# ----------------------------------------------------------------------------------- on a GPU

def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", GRAPHABLE)
def test_graphed_compress_is_the_eager_one_bit_for_bit(name, dtype):
    """Ten steps of one bucket refilled in place, graphed against another instance eager (the random codecs'
    noise is keyed by seed, bucket, rank and call count: two instances draw the same), the state loaded midway."""
    steps = 10
    graphed, eager = compressors.make(name), compressors.make(name)
    bucket = torch.empty(4099, device="cuda", dtype=dtype)  # refilled in place, as the engine's buckets are
    g = torch.Generator().manual_seed(1)
    with graphs.enabled():
        for step in range(steps):
            bucket.copy_(torch.randn(4099, generator=g))
            pa, ca = DEFAULT_BUCKET.encode(graphed, bucket)
            pb, cb = eager.compress(bucket.clone())
            assert _equal(pa, pb), (name, step)
            assert torch.equal(graphed.decompress(pa, ca), eager.decompress(pb, cb))
            if step == 4:  # new state tensors: eager again, then captured anew
                graphed.load_state_dict(eager.state_dict())
    rec = graphed.__dict__.get("_graphs")
    if dtype != torch.float32:  # the eager path (its work buffers, its torch.Generator): never graphed
        assert rec is None
        return
    assert rec.problem is None, rec.problem
    # compress, stateless: captured at the third call, replayed from then on; with state: the first call makes
    # it (a key of its own), captured at the fourth, and again at the eighth after the load. Its payload then
    # sits at the graph's addresses, so its decoding is captured too
    compress_keys = [k for k in rec.graphs if not isinstance(k[0], str)]
    assert len(compress_keys) == (2 if graphed.capabilities.elementwise else 1)
    assert any(isinstance(k[0], str) for k in rec.graphs), "the decoding was never graphed"
    for k in graphed.capabilities.elementwise:
        assert torch.equal(getattr(graphed, k), getattr(eager, k))


@needs_gpu
@pytest.mark.parametrize("name", GRAPHABLE)
def test_a_graphed_exchange_of_two_ranks_is_the_eager_one(name):
    """The exchange as the engine drives it, two ranks' payloads gathered into buffers that stay put (as the
    engine's pooled all-gather buffers do): compress and the decoding of both payloads replayed from graphs,
    the average bit for bit the eager codecs'."""
    n = 3001
    mine, theirs = compressors.make(name), compressors.make(name)
    rank1 = BucketContext(rank=1)
    ref_mine, ref_theirs = copy.deepcopy(mine), copy.deepcopy(theirs)
    bucket = torch.empty(n, device="cuda")
    held = None  # the gathered payloads' buffers, filled in place each step
    g = torch.Generator().manual_seed(2)
    for step in range(8):
        bucket.copy_(torch.randn(n, generator=g))
        other = torch.randn(n, generator=g).cuda()
        with graphs.enabled():
            ex = mine.exchange(bucket, 2)
            rnd = next(ex)
            sent = [rnd.tensors, contract.compress(theirs, other, rank1)[0]]
            if held is None:
                held = [[p.clone() for p in payload] for payload in sent]
            for buf, payload in zip(held, sent):
                for b, p in zip(buf, payload):
                    b.copy_(p)
            try:
                ex.send(held)
            except StopIteration as stop:
                got = stop.value.clone()
        ex = ref_mine.exchange(bucket.clone(), 2)
        rnd = next(ex)
        try:
            ex.send([rnd.tensors, contract.compress(ref_theirs, other, rank1)[0]])
        except StopIteration as stop:
            want = stop.value
        assert torch.equal(got, want), (name, step)
    rec = mine._graphs
    assert rec.problem is None and any(isinstance(k[0], str) for k in rec.graphs), rec.graphs.keys()


@needs_gpu
def test_a_new_address_each_call_is_never_captured():
    c = compressors.make("signsgd")
    keep = []
    with graphs.enabled():
        for _ in range(6):
            keep.append(torch.randn(1000, device="cuda"))
            DEFAULT_BUCKET.encode(c, keep[-1])
    assert c._graphs.captures == 0


@needs_gpu
@pytest.mark.parametrize("mode", ["wfbp", "sync"])
@pytest.mark.parametrize("name", GRAPHABLE)
def test_a_run_with_graphs_trains_as_the_eager_run(tmp_path, name, mode):
    losses = {}
    for way in ("0", "1"):
        runs = tmp_path / way
        r = subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "run", str(ROOT / "examples" / "demo.yaml"), "--quiet",
                            "--runs", str(runs), "--set", "device=cuda", "--set", "eval_every=0", "--set", "world_size=2",
                            "--set", "steps=30", "--set", "model=mlp", "--set", f"compressor.name={name}",
                            "--set", "optimizer.lr=0.01", "--set", "optimizer.momentum=0",
                            "--set", f"comm.mode={mode}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, graphs.ENV: way})
        assert r.returncode == 0, r.stdout + r.stderr
        run_dir = next(d for d in runs.iterdir() if d.is_dir() and not d.name.startswith("."))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        losses[way] = [row["loss"] for row in rows if row.get("kind") == "step" and row["rank"] == 0]
        resolved = json.loads((run_dir / "resolved.json").read_text())
        assert resolved["gpu_codecs"]["graphs"] == way
        said = re.search(r"CUDA graphs: (\d+) of (\d+) codec\(s\) captured", (run_dir / "log.txt").read_text())
        if way == "1":  # the graphs were taken, not just allowed
            assert said and int(said.group(1)) >= 1, (run_dir / "log.txt").read_text()[-2000:]
        else:
            assert said is None
    assert len(losses["1"]) == 30 and min(losses["1"][-10:]) < losses["1"][0]
    # the same kernels on the same data: where the model's own kernels are deterministic, the same losses
    assert losses["1"] == pytest.approx(losses["0"], rel=1e-5)
