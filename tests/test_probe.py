"""The layer probe's backward spans when it follows the communicator (engine/probe.py follow):
one gradient hook per parameter, the communicator's, and still one backward span per layer
per step, ending after the layer's last gradient landed."""
import functools
import json
import os
import tempfile

import torch

from distutil import run_world
from engine import schedules


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _probe_step(rank, world, follow):
    from engine.comm import DataParallel
    from engine.compressors import make
    from engine.probe import LayerProbe
    from engine.timeline import Timeline
    model = _model()
    path = os.path.join(tempfile.mkdtemp(), f"t{rank}.jsonl")
    tl = Timeline(path, rank)
    probe = LayerProbe(model, tl)
    dp = DataParallel(model, functools.partial(schedules.build, "layerwise"), lambda: make("none"),
                      mode="wfbp", timeline=tl)
    if follow:
        probe.follow(dp)
    hooks = [len(p._post_accumulate_grad_hooks) for p in model.parameters()]
    landed = []
    for step in range(2):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        dp.finish()
        landed.append(dict(probe.bwd_left))
        dp.zero_grad()
        probe.reset()
        tl.flush()
    probe.close()
    dp.close()
    tl.close()
    with open(path) as f:
        spans = [json.loads(line) for line in f]
    return hooks, landed, [(s["name"], s["dur"]) for s in spans if s["cat"] == "backward"]


def test_a_following_probe_adds_no_hook_and_keeps_its_backward_spans():
    for follow in (False, True):
        for hooks, landed, spans in run_world(_probe_step, follow):
            assert hooks == [2 if not follow else 1] * 4, (follow, hooks)  # the probe's own hook, or none
            assert landed == [{"0": 0, "2": 0}] * 2  # every layer's parameters were counted, every step
            assert sorted(n for n, _ in spans) == ["0", "0", "2", "2"] and all(d >= 0 for _, d in spans)


def test_timeline_lines_are_chrome_trace_events_across_flushes():
    """Timeline.flush formats each (lane, name)'s line head once and reuses it: every line still
    parses to its own span, for names JSON must escape and args of every kind, flush after flush."""
    from engine.timeline import LANES, Clock, Timeline
    path = os.path.join(tempfile.mkdtemp(), "t.jsonl")
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
