"""Held-out accuracy of mixed strategies and of dear's compressed reduce-scatters against none, in a fixed step budget.

    python bench/strategy_accuracy.py [--steps 300] [--runs DIR] [--json bench/results/strategy_accuracy.json]
                                      [--md FILE]

Each cell is a real commlab run (2 ranks, gloo), with the setup of bench/compressor_accuracy.py: cnn on
digits, batch 32 per rank, SGD lr 0.05 momentum 0.9, seed 0, 300 steps. The strategies:

- none with wfbp and 25 MB buckets (the reference, DDP's setup);
- dear with the plain, the fp16 and the block-wise int8 reduce-scatter (int8 also with error feedback),
  and int8 in wfbp (all-gathered) for comparison;
- mixed buckets (compressor.per_bucket) over one bucket per tensor (layerwise; dear: a buffer per layer):
  the cnn's tensors under 64 KB (its biases, first and last weights) uncompressed, the two big weights
  PowerSGD rank 4, top-k 1% + EF, or (dear) int8; and those compressors on every bucket, to compare.

scripts/publish_evidence.py copies the file into commlab/lab/strategy/evidence.json, which the advisor reads: a strategy within a point of none's accuracy counts
penalty 1, below that it is left out; the table says so per cell.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

BASE = {"name": "stracc", "model": "cnn", "dataset": "digits", "world_size": 2, "batch_size": 32,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "seed": 0, "eval_every": 0}
SMALL_MB = 0.0625
"""64 KB: in the cnn, 6 of its 8 tensors (biases, the first and last weights) are under it."""


def _c(name, ef=False, **params):
    return {"name": name, "error_feedback": ef, "params": params}


def _mixed(rest):
    return {**rest, "per_bucket": [{"below_mb": SMALL_MB, **_c("none")}]}


WFBP = ({"name": "bucket", "cap_mb": 25}, {"mode": "wfbp"})
LAYERWISE = ({"name": "layerwise"}, {"mode": "wfbp"})
DEAR = ({"name": "bucket", "cap_mb": 25}, {"mode": "dear"})  # dear's buffers take the schedule's cap
DEAR_LAYERS = ({"name": "bucket", "cap_mb": 25}, {"mode": "dear", "layers": 1})
CELLS = {  # label -> (compressor, schedule, comm)
    "none, wfbp (reference)": (_c("none"), *WFBP),
    "dear, none": (_c("none"), *DEAR),
    "dear + fp16 reduce-scatter": (_c("fp16"), *DEAR),
    "dear + int8 reduce-scatter": (_c("int8"), *DEAR),
    "dear + int8 reduce-scatter +EF": (_c("int8", True), *DEAR),
    "int8, wfbp (all-gather)": (_c("int8"), *WFBP),
    "powersgd r4, layerwise": (_c("powersgd", rank=4), *LAYERWISE),
    "mixed: none < 64 KB, powersgd r4, layerwise": (_mixed(_c("powersgd", rank=4)), *LAYERWISE),
    "topk 1% +EF, layerwise": (_c("topk", True, ratio=0.01), *LAYERWISE),
    "mixed: none < 64 KB, topk 1% +EF, layerwise": (_mixed(_c("topk", True, ratio=0.01)), *LAYERWISE),
    "dear + int8, a buffer per layer": (_c("int8"), *DEAR_LAYERS),
    "mixed dear: none < 64 KB, int8, a buffer per layer": (_mixed(_c("int8")), *DEAR_LAYERS),
}
REFERENCE = "none, wfbp (reference)"
KEEP_POINTS = 0.01


def main(argv=None):
    from commlab.lab.rundir.launcher import launch
    from commlab.lab.strategy.perfmodel.calibrate import compressor_key
    from commlab.lab.base.specs import load_spec
    from commlab.lab.rundir.store import RunStore
    from commlab.lab.rundir.summary import summarize

    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only", default="", help="comma-separated cell numbers (1-based; default: all)")
    ap.add_argument("--runs", default=None, help="runs directory (default: a temporary one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    labels = list(CELLS)
    if args.only:
        labels = [labels[int(i) - 1] for i in args.only.split(",") if i]
        if REFERENCE not in labels:
            labels.insert(0, REFERENCE)
    store = RunStore(args.runs or tempfile.mkdtemp(prefix="commlab-stracc-"))
    cells = []
    for i, label in enumerate(labels):
        comp, sched, comm = CELLS[label]
        spec = load_spec(data={**BASE, "steps": args.steps, "name": f"stracc-{i}", "compressor": comp,
                               "schedule": sched, "comm": comm})
        run = store.create(spec)
        state = launch(run, progress=False)
        s = summarize(run.metric_rows(), run.spec_dict())
        cell = {"label": label, "key": compressor_key(spec.to_dict()["compressor"]), "comm": comm["mode"],
                "schedule": sched["name"], "state": state, "acc": s.get("final_acc"),
                "ratio": s.get("compression_ratio"), "iter_ms": s.get("iter_ms_median"), "run": run.id,
                "reference": label == REFERENCE}
        cells.append(cell)
        print(f"{label}: {cell['acc']:.2%}" if cell["acc"] is not None else f"{label}: {state}", file=sys.stderr,
              flush=True)
    base = next(c for c in cells if c["reference"])["acc"]
    rows = []
    for c in cells:
        acc = c["acc"]
        verdict = ("-" if c["reference"] or acc is None or base is None
                   else "keeps accuracy (penalty 1)" if acc >= base - KEEP_POINTS else "loses accuracy (left out)")
        rows.append([c["label"], f"{acc:.2%}" if acc is not None else c["state"],
                     f"{(acc - base) * 100:+.2f}" if acc is not None and base is not None else "-",
                     f"{c['ratio']:.1f}x" if c["ratio"] else "-", verdict])
    text = (common.markdown_table(["strategy", "accuracy", "vs none (points)", "compression", "advisor reads"], rows)
            + f"\n\ncnn on digits, 2 ranks, {args.steps} steps, batch 32 per rank, SGD lr 0.05 momentum 0.9, "
              f"seed 0; runs in {store.root}")
    print(text)
    if args.json:
        common.write_json(args.json, {"steps": args.steps, "cells": cells})
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
