"""What the timeline costs the training thread per step: Timeline.span plus the step's flush.

    python bench/timeline_cost.py [--model resnet] [--blocks 20] [--steps 100]

One process, no ranks, no model compute: per step it records what a training step with the timeline on
records on this model (commlab/engine/probe.py's forward and backward span per layer, the ones commlab.engine.stepper
and the communicator add: forward, backward, optimizer, step, one bucket's ready and all-reduce) and
flushes it to a temp file, as commlab.engine.stepper does at every step end. Reported: the median over
``--blocks`` blocks of ``--steps`` steps, in us per step and per event. The repository root is
appended to sys.path, so PYTHONPATH=<another checkout> measures that checkout's timeline instead.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="commlab bench timeline_cost" if os.environ.get("COMMLAB_BENCH") == "timeline_cost" else None,
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet", help="an commlab.engine.models name: its parameter-owning modules")
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100, help="steps per block")
    args = ap.parse_args(argv)
    from commlab.engine import data, models
    from commlab.engine.timeline import Timeline
    info = (data.load("text") if models.kind(args.model) == "text" else data.load("synthetic", seed=0)).info
    model = models.build(args.model, info)
    layers = [n or type(m).__name__ for n, m in model.named_modules() if any(True for _ in m.parameters(False))]
    layer_args = [{"layer": n} for n in layers]
    with tempfile.TemporaryDirectory(prefix="commlab-bench-") as d:
        tl = Timeline(os.path.join(d, "t.jsonl"), 0)

        def step(s):
            t = time.perf_counter()
            for lane in ("forward", "backward"):
                for n, a in zip(layers, layer_args):
                    tl.span(lane, n, t, t + 1e-4, a)
            tl.span("ready", "b0 ready", t, t, {"bucket": 0})
            tl.span("comm", "allreduce b0", t, t + 1e-3, {"bucket": 0, "bytes": 11_000_000, "codec": "none"})
            for lane in ("forward", "backward", "optimizer"):
                tl.span(lane, lane, t, t + 1e-2, {"step": s})
            tl.span("step", f"step {s}", t, t + 1e-2, {"step": s})
            tl.flush()

        for s in range(args.steps):  # warm-up: heads and args formatted once
            step(s)
        per_step = []
        for b in range(args.blocks):
            t0 = time.perf_counter()
            for s in range(args.steps):
                step(s)
            per_step.append((time.perf_counter() - t0) / args.steps * 1e6)
        tl.close()
    events = 2 * len(layers) + 6
    us = statistics.median(per_step)
    print(f"{args.model}: {len(layers)} layers, {events} events per step: {us:.1f} us per step, "
          f"{us / events:.2f} us per event (median of {args.blocks} blocks of {args.steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
