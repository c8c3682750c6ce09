"""How long explaining a run takes (commlab.lab.analysis.explain), beside the lab's own step breakdown of the
same steps.

    python bench/explain_speed.py [--steps 1000] [--rounds 5] [--runs DIR] [--out bench/results/explain_speed]

Makes one real run (mlp on digits, two ranks, one thread each, top-k 1% with wfbp, no evaluation; about a
minute here) unless ``--runs`` holds one of ``--steps`` steps already, then times, in interleaved rounds:

- ``read``: reading the run's timeline files into a frame (``Run.timeline()``);
- ``explain``: the explanation of every step after the warm-up from that frame (critical path, collectives'
  split, stragglers, sentences: ``explain_frame``);
- ``explain cold``: both, as ``commlab explain RUN`` does;
- ``breakdown``: the lab's per-step breakdown of the same frame (``plots.step_breakdown``), for scale.

Reported: the median seconds with the spread (min..max) over the rounds, and whether a run of that many steps is
explained in under 2 s (cold).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import commlab  # noqa: E402
from commlab.lab.analysis import explain, plots  # noqa: E402
from commlab.lab.rundir.store import RunStore  # noqa: E402

TARGET_S = 2.0


def the_run(root: Path, steps: int):
    for run in RunStore(root).list():
        if run.state == "done" and run.spec_dict().get("steps") == steps and run.spec_dict().get("name") == "explain-bench":
            return run
    print(f"making a {steps}-step run in {root} ...", flush=True)
    spec = {"name": "explain-bench", "model": "mlp", "dataset": "digits", "steps": steps, "world_size": 2,
            "threads": 1, "eval_every": 0, "batch_size": 32, "compressor": {"name": "topk", "ratio": 0.01},
            "comm": {"mode": "wfbp"}}
    run = commlab.run(spec, runs=root)
    if run.state != "done":
        raise SystemExit(f"explain_speed: the run ended {run.state}: {run.status().get('error')}")
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", default=None, help="a runs directory to find or make the run in (default: a temporary one)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "explain_speed"))
    args = ap.parse_args(argv)
    root = Path(args.runs) if args.runs else Path(tempfile.mkdtemp(prefix="explain-bench-"))
    run = the_run(root, args.steps)
    spec = run.spec_dict()
    variants = {
        "read": lambda: run.timeline(),
        "explain": None,
        "explain cold": lambda: explain.explain_frame(run.timeline(), spec),
        "breakdown": None,
    }
    frame = run.timeline()
    variants["explain"] = lambda: explain.explain_frame(frame, spec)
    variants["breakdown"] = lambda: plots.step_breakdown(frame)
    times = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for k in order:
            t0 = time.perf_counter()
            variants[k]()
            times[k].append(time.perf_counter() - t0)
    ex = explain.explain_frame(frame, spec)
    rows = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for k, v in times.items()}
    steps_explained = ex.steps[1] - ex.steps[0] + 1
    spans = len(frame)
    lines = [f"run {run.id}: {args.steps} steps, 2 ranks, {spans} spans; {steps_explained} steps explained "
             f"(after the warm-up); {args.rounds} interleaved rounds", "",
             "| what | median s | spread (min..max) |", "|---|---|---|"]
    for k, v in rows.items():
        lines.append(f"| {k} | {v['median_s']:.3f} | {v['min_s']:.3f}..{v['max_s']:.3f} |")
    cold = rows["explain cold"]["median_s"]
    lines += ["", f"explained cold in {cold:.2f} s: {'under' if cold < TARGET_S else 'NOT under'} the {TARGET_S:g} s "
                  f"target; the explanation's first sentence: {ex.sentences[0]}"]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"run": run.id, "steps": args.steps, "spans": spans,
                                                    "steps_explained": steps_explained, "rounds": args.rounds,
                                                    "times": times, "summary": rows, "target_s": TARGET_S,
                                                    "cpu_count": os.cpu_count()}, indent=1) + "\n")
    return 0 if cold < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
