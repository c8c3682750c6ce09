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

With ``--hta DIR`` (a checkout of Holistic Trace Analysis, the peer; never vendored: ``git clone
https://github.com/facebookresearch/HolisticTraceAnalysis /tmp/hta``, default ``/tmp/hta`` when it exists), the
same is done on the GPU traces of its test data (a 128-GPU job's sample, ``<hta>/tests/data/trace_filter``, and an
A100 DDP job, ``<hta>/tests/data/nccl_parser_config``): HTA's temporal breakdown and communication-computation overlap
beside the lab's (``commlab.lab.analysis.kineto``: its frame without copies, which HTA counts as non-compute, and
with them), each figure side by side, and the time each takes (HTA: loading the traces and both analyses; the
lab: reading them, the breakdown and the explanation), interleaved. Set ``HTA_DISABLE_NS_ROUNDING=1`` for HTA's
figures without its rounding to whole microseconds.
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
    ap.add_argument("--hta", default=None, help="a checkout of HolisticTraceAnalysis (default /tmp/hta if there)")
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
    hta_dir = Path(args.hta) if args.hta else (Path("/tmp/hta") if Path("/tmp/hta/tests/data").is_dir() else None)
    if hta_dir is not None:
        more, agreement = against_hta(hta_dir, args.rounds)
        text += "\n\n" + "\n".join(more)
        print("\n".join(more))
        out.with_suffix(".md").write_text(text + "\n")
        doc = json.loads(out.with_suffix(".json").read_text())
        doc["hta"] = agreement
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    else:
        print("no HTA checkout (--hta DIR, or /tmp/hta): the comparison with HTA is skipped")
    return 0 if cold < TARGET_S else 1


HTA_TRACES = {"128-GPU job, two ranks sampled": ("tests", "data", "trace_filter"),
              "A100 DDP job, one rank": ("tests", "data", "nccl_parser_config")}
"""Folders of HTA's checkout: its own test data."""


def against_hta(root: Path, rounds: int):
    """HTA's figures and the lab's on HTA's own GPU traces, and the time each takes; (markdown lines, dict)."""
    import logging
    logging.disable(logging.INFO)  # HTA logs every parse at INFO
    from hta.trace_analysis import TraceAnalysis

    from commlab.lab.analysis import kineto
    lines, out = [], {}
    for label, parts in HTA_TRACES.items():
        rel = "<hta>/" + "/".join(parts)
        d = root.joinpath(*parts)
        if not d.is_dir():
            lines.append(f"{label}: {d} is missing, skipped")
            continue

        def hta_side():
            ta = TraceAnalysis(trace_dir=str(d), include_last_profiler_step=True)
            return (ta.get_temporal_breakdown(visualize=False).set_index("rank"),
                    ta.get_comm_comp_overlap(visualize=False).set_index("rank"))

        def lab_side():
            frame = kineto.read_trace(d)
            return frame, explain.explain_frame(frame, {"world_size": int(frame["rank"].nunique())},
                                                skip_warmup=False)
        times = {"HTA": [], "lab": []}
        for r in range(rounds):
            for k in (("HTA", "lab") if r % 2 == 0 else ("lab", "HTA")):
                t0 = time.perf_counter()
                got = hta_side() if k == "HTA" else lab_side()
                times[k].append(time.perf_counter() - t0)
                if k == "HTA":
                    tb, hov = got
                else:
                    frame = got[0]
        nc = frame[frame["kind"].ne("memory")] if "kind" in frame else frame
        lab = kineto.breakdown(frame).groupby("rank").sum()
        lab_nc = kineto.breakdown(nc).groupby("rank").sum()
        ov, ov_nc = kineto.comm_overlap(frame).set_index("rank"), kineto.comm_overlap(nc).set_index("rank")
        lines += [f"{label} (`{rel}`):", "", "| rank | figure | HTA | lab | lab without copies |", "|---|---|---:|---:|---:|"]
        rows = []
        for rank in tb.index:
            h = tb.loc[rank]
            figs = [("kernel time (ms)", h["kernel_time(us)"] / 1e3, lab.loc[rank, "step_ms"], lab_nc.loc[rank, "step_ms"]),
                    ("idle (ms)", h["idle_time(us)"] / 1e3, lab.loc[rank, "other_ms"], lab_nc.loc[rank, "other_ms"]),
                    ("compute (ms)", h["compute_time(us)"] / 1e3, lab.loc[rank, "compute_ms"], lab_nc.loc[rank, "compute_ms"]),
                    ("comm-compute overlap (%)", hov.loc[rank, "comp_comm_overlap_pctg"], 100 * ov.loc[rank, "overlap"],
                     100 * ov_nc.loc[rank, "overlap"])]
            for name, a, b, c in figs:
                lines.append(f"| {rank} | {name} | {a:.3f} | {b:.3f} | {c:.3f} |")
                rows.append({"rank": int(rank), "figure": name, "hta": float(a), "lab": float(b), "lab_no_copies": float(c)})
        med = {k: statistics.median(v) for k, v in times.items()}
        lines += ["", f"time, median of {rounds} interleaved rounds: HTA {med['HTA']:.2f} s "
                      f"({min(times['HTA']):.2f}..{max(times['HTA']):.2f}), lab {med['lab']:.2f} s "
                      f"({min(times['lab']):.2f}..{max(times['lab']):.2f}); lab / HTA {med['lab'] / med['HTA']:.2f}", ""]
        out[rel] = {"figures": rows, "times": times}
    return lines, out


if __name__ == "__main__":
    sys.exit(main())
