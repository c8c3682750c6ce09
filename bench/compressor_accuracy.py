"""Held-out accuracy of every compressor, with and without error feedback, in a fixed step budget.

    python bench/compressor_accuracy.py [--steps 300] [--only topk,dgc] [--runs DIR] [--json out.json]

Each cell is a real commlab run (2 ranks, gloo): cnn on digits, batch 32 per
rank, SGD lr 0.05 momentum 0.9, schedule `bucket` 25 MB, comm `wfbp`, seed 0,
the compressor at its default parameters (top-k, random-k, DGC at 1%). The
runs land in the runs directory like any other, so `commlab show` and
`commlab trace` work on them. Compressors that keep their own residual
(PowerSGD, DGC, EF-signSGD) have no separate "+EF" run. Some methods need
another learning rate to train at all; those overrides are printed in the
table, never hidden.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

BASE = {"name": "acc", "model": "cnn", "dataset": "digits", "world_size": 2, "batch_size": 32,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "seed": 0,
        "schedule": {"name": "bucket", "cap_mb": 25}, "comm": {"mode": "wfbp"}, "eval_every": 0}

# Per-method learning rates that differ from BASE, each with its reason.
OVERRIDES = {
    # Signum's majority vote decodes to +-1 per element, so the learning rate alone sets the step size.
    "signum": {"optimizer": {"name": "sgd", "lr": 0.002}},
    "signsgd": {"optimizer": {"name": "sgd", "lr": 0.002}},
}


def overrides(name: str) -> dict:
    """The settings of ``name``'s runs that differ from BASE. A compressor that declares
    ``builtin_momentum`` (DGC's momentum correction, Signum's buffer) applies momentum itself,
    so the optimizer runs without it; otherwise SGD momentum would be applied twice."""
    from commlab.engine import compressors
    opt = dict(BASE["optimizer"], **OVERRIDES.get(name, {}).get("optimizer", {}))
    if compressors.REGISTRY[name].capabilities.builtin_momentum:
        opt["momentum"] = 0.0
    return {"optimizer": opt} if opt != BASE["optimizer"] else {}


def spec_for(name: str, ef: bool, steps: int) -> dict:
    spec = dict(BASE, steps=steps, name=f"acc-{name}{'-ef' if ef else ''}")
    spec.update(overrides(name))
    spec["compressor"] = {"name": name, "error_feedback": ef}
    return spec


def main(argv=None):
    from commlab.engine import compressors
    from commlab.lab.rundir.launcher import launch
    from commlab.lab.base.specs import load_spec
    from commlab.lab.rundir.store import RunStore
    from commlab.lab.rundir.summary import summarize

    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only", default="", help="comma-separated compressor names (default: all)")
    ap.add_argument("--runs", default=None, help="runs directory (default: a temporary one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(compressors.names())
    store = RunStore(args.runs or tempfile.mkdtemp(prefix="commlab-acc-"))
    cells = []
    for name in names:
        caps = compressors.REGISTRY[name].capabilities
        variants = [False] if caps.builtin_feedback or caps.identity else [False, True]  # EF on the identity: the same run
        for ef in variants:
            spec = load_spec(data=spec_for(name, ef, args.steps))
            run = store.create(spec)
            state = launch(run, progress=False)
            s = summarize(run.metric_rows(), run.spec_dict())
            cell = {"compressor": name, "ef": ef, "state": state, "acc": s.get("final_acc"),
                    "ratio": s.get("compression_ratio"), "iter_ms": s.get("iter_ms_median"), "run": run.id,
                    "override": overrides(name) or None}
            cells.append(cell)
            acc = f"{cell['acc']:.2%}" if cell["acc"] is not None else state
            print(f"{name}{' +EF' if ef else ''}: {acc}", file=sys.stderr, flush=True)
    by = {(c["compressor"], c["ef"]): c for c in cells}
    rows = []
    for name in names:
        plain, ef = by.get((name, False)), by.get((name, True))
        note = ", ".join(f"{k}: {v}" for k, v in overrides(name).items())
        builtin = compressors.REGISTRY[name].capabilities.builtin_feedback
        rows.append([name, _acc(plain), _acc(ef) if ef else ("built in" if builtin else "-"),
                     f"{plain['ratio']:.1f}x" if plain and plain["ratio"] else "-", note])
    print(common.markdown_table(["compressor", "accuracy", "accuracy +EF", "compression", "note"], rows))
    print(f"\ncnn on digits, 2 ranks, {args.steps} steps, batch 32 per rank; runs in {store.root}")
    if args.json:
        common.write_json(args.json, {"steps": args.steps, "cells": cells})


def _acc(c):
    if not c:
        return "-"
    return f"{c['acc']:.2%}" if c["acc"] is not None else c["state"]


if __name__ == "__main__":
    main()
