"""The layer probe (commlab/engine/probe.py): per-layer forward and backward spans that tile each pass
(each layer's span starts where the previous probe event ended), from one root pre-hook, one
post-hook per layer and one tensor hook per step; and its backward spans when it follows the
communicator (follow): in the first step one gradient hook per parameter, the communicator's, from
the second one gradient hook per layer, and still one backward span per layer per step, ending after
the layer's last gradient landed."""
import functools
import json
import os
import shutil
import tempfile

import torch

from distutil import run_world
from commlab.engine import schedules


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _probe_step(rank, world, follow):
    from commlab.engine.comm.wfbp import WFBP
    from commlab.engine.compressors import make
    from commlab.engine.probe import LayerProbe
    from commlab.engine.timeline import Timeline
    model = _model()
    path = os.path.join(tempfile.mkdtemp(), f"t{rank}.jsonl")
    tl = Timeline(path, rank)
    probe = LayerProbe(model, tl) if follow != "late" else None
    dp = WFBP(model, functools.partial(schedules.build, "layerwise"), lambda: make("none"), timeline=tl)
    if follow is True:
        probe.follow(dp)
    count = lambda: [len(p._post_accumulate_grad_hooks) for p in model.parameters()]  # noqa: E731
    hooks = [count()]
    landed = []
    for step in range(3):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        dp.finish()
        if probe is None:  # "late": built and following once the communicator knows the arrival order
            probe = LayerProbe(model, tl)
            probe.follow(dp)
        else:
            landed.append(dict(probe.bwd_left))
        dp.zero_grad()
        probe.reset()
        tl.flush()
        hooks.append(count())
    probe.close()
    dp.close()
    tl.close()
    with open(path) as f:
        spans = [json.loads(line) for line in f]
    shutil.rmtree(os.path.dirname(path))
    return hooks, landed, [(s["name"], s["dur"]) for s in spans if s["cat"] == "backward"]


def test_a_following_probe_adds_no_hook_and_keeps_its_backward_spans():
    for follow in (False, True, "late"):
        for hooks, landed, spans in run_world(_probe_step, follow):
            if follow != "late":
                assert hooks[0] == [2 if not follow else 1] * 4, (follow, hooks)  # the probe's own hook, or none
                assert landed == [{"0": 0, "2": 0}] * 3  # every layer's span ended, every step
            # from the second step: the communicator's landing hooks but on the last bucket (layerwise: 0.weight),
            # which keeps one (the second-backward check), and one hook per layer, the probe's
            assert sum(hooks[-1]) == 4 + 2 and sum(hooks[1]) == 6, (follow, hooks)
            want = ["0", "2"] * (3 if follow != "late" else 2)
            assert sorted(n for n, _ in spans) == sorted(want) and all(d >= 0 for _, d in spans), (follow, spans)


def test_timeline_lines_are_chrome_trace_events_across_flushes(tmp_path):
    """Timeline.flush formats each (lane, name)'s line head once and reuses it: every line still
    parses to its own span, for names JSON must escape and args of every kind, flush after flush."""
    from commlab.engine.timeline import LANES, Clock, Timeline
    path = str(tmp_path / "t.jsonl")
    clock = Clock()
    clock.wall0, clock.perf0 = 1000.0, 10.0
    tl = Timeline(path, 3, clock=clock)
    want = []
    for step in range(3):
        for lane, name, args in (("backward", 'conv "1"\\ünï', {"layer": 'conv "1"'}),
                                 ("comm", "allreduce b0", {"bucket": 0, "bytes": 1 << 20, "codec": None}),
                                 ("step", f"step {step}", None)):
            t0 = 10.0 + step + 0.25
            tl.span(lane, name, t0, t0 + 0.5, args)
            want.append({"ph": "X", "name": name, "pid": 3, "tid": LANES[lane], "cat": lane,
                         "ts": round((1000.0 + step + 0.25) * 1e6, 1), "dur": 500000.0,
                         **({"args": args} if args else {})})
        tl.flush()
    tl.close()
    with open(path) as f:
        got = [json.loads(line) for line in f]
    assert got == want


class _Recorder:
    """A timeline for the probe alone: marks are 1, 2, 3, ... in the order they are taken."""

    def __init__(self):
        self.n = 0
        self.spans = []

    def mark(self):
        self.n += 1
        return float(self.n)

    def span(self, lane, name, t0, t1, args=None):
        self.spans.append((lane, name, t0, t1, args))


class _Block(torch.nn.Module):
    """A layer (its own gain) with a layer inside it."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(4))
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, h):
        return self.inner(h) * self.gain


class _Tied(torch.nn.Module):
    """Parameterless modules between layers, a layer nested in a layer, and a tied weight."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)
        self.block = _Block()
        self.act = torch.nn.Tanh()
        self.head = torch.nn.Linear(4, 7)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        h = self.act(self.block(h)) + h
        return self.head(h)


def _tiles(spans, lane):
    got = [s for s in spans if s[0] == lane]
    assert got, lane
    for a, b in zip(got, got[1:]):
        assert b[2] == a[3], (lane, a, b)  # each span starts where the previous one ended
    assert all(s[3] > s[2] for s in got), got
    return got


def test_layer_spans_tile_forward_and_backward():
    from commlab.engine.probe import LayerProbe
    torch.manual_seed(0)
    model = _Tied()
    rec = _Recorder()
    probe = LayerProbe(model, rec)
    assert probe.layers == ["emb", "block", "block.inner", "head"]
    # per step: one root pre-hook, one post-hook per layer and the root post-hook; no per-layer pre-hook
    assert len(model._forward_pre_hooks) == 1 and not model.block._forward_pre_hooks
    assert [len(m._forward_hooks) for m in (model.emb, model.block, model.block.inner, model.head)] == [1] * 4
    x = torch.randint(0, 7, (5, 2))
    for step in range(3):
        # a hook per parameter and layer using it in the first step, then one per layer (the tied weight: two)
        assert sum(len(p._post_accumulate_grad_hooks) for p in model.parameters()) == (6 if step == 0 else 4)
        rec.spans.clear()
        start = rec.n + 1  # the root pre-hook's mark
        out = model(x)
        fwd = _tiles(rec.spans, "forward")
        assert [s[1] for s in fwd] == ["emb", "block.inner", "block", "head"]  # the child ends first
        assert fwd[0][2] == start and fwd[-1][3] == rec.n  # from the root's start to the last layer's end
        assert all(s[4] == {"layer": s[1]} for s in fwd)
        end = rec.n
        out.square().sum().backward()
        bwd = _tiles(rec.spans, "backward")
        assert bwd[0][2] == end + 1  # starts at the root output's gradient, the first mark after forward
        # the tied weight lands last (both uses summed), so the embedding ends the pass; every layer, once
        assert sorted(s[1] for s in bwd) == sorted(probe.layers) and bwd[-1][3] == rec.n
        assert probe.bwd_left == {"emb": 0, "block": 0, "block.inner": 0, "head": 0}
        model.zero_grad()
        probe.reset()
    # evaluation passes leave no span and take no mark; a no-grad forward hooks no gradient
    probe.active = False
    rec.spans.clear()
    n = rec.n
    with torch.no_grad():
        model(x)
    assert rec.spans == [] and rec.n == n
    probe.active = True
    with torch.no_grad():
        model(x)
    assert len(_tiles(rec.spans, "forward")) == 4
    probe.close()
    assert not model._forward_pre_hooks and not model._forward_hooks and not model.head._forward_hooks


def test_timeline_args_passed_again_are_written_as_they_are_at_each_flush(tmp_path):
    """Timeline.flush encodes an args dict passed again (the probe's, every step) once: a dict changed in
    place since, or one holding a list changed in place, is written with its new content."""
    from commlab.engine.timeline import Timeline
    path = str(tmp_path / "t.jsonl")
    tl = Timeline(path, 0)
    same, nested = {"layer": "fc"}, {"buckets": [0]}
    for step in range(3):
        tl.span("backward", "fc", 1.0, 2.0, same)
        tl.span("comm", "c", 1.0, 2.0, nested)
        tl.flush()
        same["layer"] = f"fc{step}"
        nested["buckets"].append(step + 1)
    tl.close()
    with open(path) as f:
        got = [json.loads(line)["args"] for line in f]
    assert got == [{"layer": "fc"}, {"buckets": [0]}, {"layer": "fc0"}, {"buckets": [0, 1]},
                   {"layer": "fc1"}, {"buckets": [0, 1, 2]}]
