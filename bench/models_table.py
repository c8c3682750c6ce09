"""Your model through the engine: iteration time of torchvision resnet18 and a 4-layer GPT-2 per comm
mode and compressor on a modeled 1 Gbit/s link, and a predicted table at scale from a saved profile.

    python bench/models_table.py [--rounds 3] [--steps 10] [--gbps 1] [--only resnet18,gpt2]
    python bench/models_table.py --predict-only      # the predicted tables from the saved profiles
    commlab bench models_table

Measured: every (model, variant) is a real 2-rank run (``commlab.run``: torchrun, gloo, one thread per
rank) on a modeled link (``network: {link: modeled, gbps: 1}``: alpha-beta delays held on loopback,
as the other benches' modeled runs; ``bench/modeled_link.py`` measures how close it comes). Variants:

    sync none            everything after backward, one 25 MB bucket schedule, no compression
    wfbp none            buckets of 25 MB as they become ready (what torch DDP does)
    mergecomp topk+EF    top-k 1% with error feedback, buckets searched online by MergeComp
    dear fp16            DeAR (reduce-scatter in backward, all-gather in the next forward), fp16

MergeComp searches its partition once, in a run of its own before the timed ones (cached in the runs
directory); the timed mergecomp runs start from that partition (tuning.json: cache hit). Rounds are
interleaved (the variants' order rotates each round). A run's figure is the median iteration time (the
slower rank) of its steps after the first 3; the table gives the median over rounds and the median of
the per-round ratios to ``wfbp none`` of the same round.

Predicted: ``commlab profile`` of each model (a single-process run, spec: top-k 1% + EF, 25 MB
buckets, wfbp) saved as bench/results/profile-<model>.json, then ``commlab predict`` of it on a
two-level cluster (nodes of 8 at 1600 Gbit/s inside, 10 and 100 Gbit/s between) for 8 to 1024 workers.

Results: bench/results/models_table.md and .json. Run it alone (it takes the whole machine).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench.common import markdown_table, prog, write_json  # noqa: E402

RESULTS = REPO / "bench" / "results"
SKIP = 3
MODELS = {
    "resnet18": {"model": "torchvision:resnet18",
                 "dataset": {"name": "synthetic", "shape": [3, 32, 32], "classes": 10, "size": 512},
                 "batch_size": 16},
    "gpt2": {"model": {"name": "hf:gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4},
             "dataset": {"name": "synthetic", "vocab": 50257, "block": 64, "size": 256},
             "batch_size": 4},
}
TOPK_EF = {"name": "topk", "ratio": 0.01, "error_feedback": True}
VARIANTS = {
    "sync none": {"comm": {"mode": "sync"}, "compressor": "none"},
    "wfbp none": {"comm": {"mode": "wfbp"}, "compressor": "none"},
    "mergecomp topk+EF": {"comm": {"mode": "wfbp"}, "compressor": TOPK_EF,
                          "schedule": {"name": "mergecomp", "warmup_steps": 1, "steps_per_candidate": 1,
                                       "max_candidates": 4}},
    "dear fp16": {"comm": {"mode": "dear"}, "compressor": "fp16"},
}
BASE = "wfbp none"
CLUSTER = "node_size=8,intra_gbps=1600"
WORKERS = "8,16,64,256,1024"


def spec_for(model: str, variant: str, steps: int, gbps: float) -> dict:
    spec = {"name": f"models-{model}-{variant.replace(' ', '-').replace('+', '')}", "world_size": 2,
            "steps": steps, "eval_every": 0, "threads": 1, "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
            "schedule": {"name": "bucket", "cap_mb": 25}, "network": {"link": "modeled", "gbps": gbps},
            **json.loads(json.dumps(MODELS[model]))}
    spec.update(json.loads(json.dumps(VARIANTS[variant])))
    return spec


SEARCH_STEPS = 14
"""Steps of the MergeComp search run before the rounds (2 + 2 per candidate, and room to spare)."""


def measure(run) -> dict:
    from commlab.lab.rundir.summary import iteration_times
    it = iteration_times(run.metric_rows())
    skip = SKIP
    if run.spec_dict()["schedule"]["name"] == "mergecomp":
        tuning = json.loads(Path(run.file("tuning.json")).read_text())
        if "tuning_steps" not in tuning:
            raise SystemExit(f"run {run.id}: MergeComp's search had not finished after {len(it)} steps")
        skip = max(skip, int(tuning["tuning_steps"]) + 1)
    timed = [ms for s, ms in sorted(it.items()) if s >= skip]
    if not timed:
        raise RuntimeError(f"run {run.id}: no steps after {skip}")
    rows = [m for m in run.metric_rows() if m.get("kind") == "step" and m["rank"] == 0]
    return {"run": run.id, "median_ms": statistics.median(timed), "timed_steps": len(timed), "skip": skip,
            "bytes_per_step": statistics.median(m["bytes_sent"] for m in rows)}


def run_measured(a, runs: Path) -> dict:
    import commlab
    models = [m for m in MODELS if m in a.only]
    names = list(VARIANTS)
    out = {m: {v: [] for v in names} for m in models}
    for model in models:  # MergeComp searches once here; the timed runs start from its cached partition
        run = commlab.run(spec_for(model, "mergecomp topk+EF", SEARCH_STEPS, a.gbps), runs=runs)
        tuning = json.loads(Path(run.file("tuning.json")).read_text()) if run.state == "done" else {}
        if tuning.get("cache") != "miss" or "tuning_steps" not in tuning:
            raise SystemExit(f"{model}: the MergeComp search run {run.id} ended {run.state}, tuning {tuning}")
        print(f"{model}: MergeComp searched {len(tuning['trace'])} candidates in {tuning['tuning_steps']} steps, "
              f"chose {tuning['chosen']}", flush=True)
    for r in range(a.rounds):
        k = r % len(names)
        for model in models:
            for variant in names[k:] + names[:k]:
                t0 = time.time()
                run = commlab.run(spec_for(model, variant, a.steps, a.gbps), runs=runs)
                if run.state != "done":
                    raise SystemExit(f"{model} {variant}: run {run.id} ended {run.state}: {run.log_tail(5)}")
                m = measure(run)
                out[model][variant].append(m)
                print(f"round {r + 1}/{a.rounds} {model:8s} {variant:18s} {m['median_ms']:8.1f} ms "
                      f"(wall {time.time() - t0:.0f} s)", flush=True)
    return out


def summarize(measured: dict) -> list:
    rows = []
    for model, per in measured.items():
        base = per[BASE]
        for variant, runs in per.items():
            ratios = [x["median_ms"] / b["median_ms"] for x, b in zip(runs, base)]
            rows.append({"model": model, "variant": variant,
                         "median_ms": statistics.median(x["median_ms"] for x in runs),
                         "ratio_to_wfbp": statistics.median(ratios),
                         "rounds_ms": [round(x["median_ms"], 1) for x in runs],
                         "mb_per_step": statistics.median(x["bytes_per_step"] for x in runs) / 2**20})
    return rows


def profile_and_predict(runs: Path, steps: int, remeasure: bool) -> dict:
    """commlab profile (when the saved profile is missing or ``remeasure``) and commlab predict."""
    from commlab.lab.front.cli import main
    tables = {}
    for model in MODELS:
        f = RESULTS / f"profile-{model}.json"
        if remeasure or not f.is_file():
            spec = {**json.loads(json.dumps(MODELS[model])), "compressor": TOPK_EF,
                    "schedule": {"name": "bucket", "cap_mb": 25}, "comm": {"mode": "wfbp"}}
            sf = runs / f"profile-{model}.json.spec.json"
            sf.write_text(json.dumps(spec))
            if main(["profile", str(sf), "-o", str(f), "--steps", str(steps), "--runs", str(runs)]) != 0:
                raise SystemExit(f"commlab profile failed for {model}")
        tables[model] = {}
        for inter in (10, 100):
            argv = ["predict", str(f.relative_to(REPO)), "--workers", WORKERS, "--cluster",
                    f"{CLUSTER},inter_gbps={inter}"]
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = main(argv)
            if rc != 0:
                raise SystemExit(f"commlab {' '.join(argv)} failed")
            tables[model][inter] = {"command": "commlab " + " ".join(argv), "output": buf.getvalue()}
            print(buf.getvalue(), end="")
    return tables


def write(a, measured, rows, tables, info) -> None:
    lines = ["# Your model through the engine: resnet18 and a 4-layer GPT-2", ""]
    if rows:
        lines += [f"`{info['command']}`, {os.cpu_count()} cores, world size 2 (gloo, one thread per rank), "
                  f"modeled {a.gbps:g} Gbit/s link, {a.steps} steps per run, {a.rounds} rounds interleaved; "
                  f"MergeComp searched once before (its own run; the timed runs start from the cached partition); "
                  f"a run's figure is its median iteration time (slower rank) after step {SKIP}; the table gives "
                  f"the median over rounds and the median of the per-round ratios to wfbp none. Wall time "
                  f"{info['wall_s']:.0f} s.", "",
                  "resnet18: torchvision, 11.18 M parameters (10 classes), synthetic 3x32x32 images, batch 16 per "
                  "rank. gpt2: transformers GPT-2 with n_layer 4, n_embd 256, n_head 4, vocabulary 50257 "
                  "(16.1 M parameters, lm_head tied to wte), synthetic tokens, block 64, batch 4 per rank.", ""]
        lines.append(markdown_table(
            ["model", "variant", "median ms", "vs wfbp none", "MB sent per step", "per round ms"],
            [(r["model"], r["variant"], f"{r['median_ms']:.1f}", f"{r['ratio_to_wfbp']:.2f}",
              f"{r['mb_per_step']:.2f}", ", ".join(f"{x:g}" for x in r["rounds_ms"])) for r in rows]))
        lines.append("")
    for model, per in tables.items():
        for inter, t in per.items():
            lines += [f"## Predicted: {model}, nodes of 8 (1600 Gbit/s inside), {inter} Gbit/s between", "",
                      f"`{t['command']}`", "", "```", t["output"].rstrip(), "```", ""]
    (RESULTS / "models_table.md").write_text("\n".join(lines))
    write_json(str(RESULTS / "models_table.json"), {"info": info, "rows": rows, "measured": measured,
                                                    "predicted": tables})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed run (default 10)")
    ap.add_argument("--gbps", type=float, default=1.0, help="the modeled link's rate (default 1)")
    ap.add_argument("--only", default=",".join(MODELS), help="models to measure (default resnet18,gpt2)")
    ap.add_argument("--predict-only", action="store_true", help="only the predicted tables (saved profiles)")
    ap.add_argument("--reprofile", action="store_true", help="measure the profiles again")
    ap.add_argument("--profile-steps", type=int, default=12)
    a = ap.parse_args(argv)
    a.only = [m.strip() for m in a.only.split(",") if m.strip()]
    bad = [m for m in a.only if m not in MODELS]
    if bad:
        ap.error(f"--only: unknown model {bad[0]!r}; allowed: {', '.join(MODELS)}")
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="commlab-models-"))
    try:
        measured, rows = {}, []
        if not a.predict_only:
            measured = run_measured(a, tmp / "runs")
            rows = summarize(measured)
            print(markdown_table(["model", "variant", "median ms", "vs wfbp none"],
                                 [(r["model"], r["variant"], f"{r['median_ms']:.1f}", f"{r['ratio_to_wfbp']:.2f}")
                                  for r in rows]))
        (tmp / "runs").mkdir(parents=True, exist_ok=True)
        tables = profile_and_predict(tmp / "runs", a.profile_steps, a.reprofile)
        info = {"command": "python bench/models_table.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "wall_s": time.time() - t0, "cores": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                             time.gmtime())}
        if a.predict_only and (RESULTS / "models_table.json").is_file():  # keep the measured part
            old = json.loads((RESULTS / "models_table.json").read_text())
            measured, rows, info = old["measured"], old["rows"], old["info"]
        write(a, measured, rows, tables, info)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {RESULTS / 'models_table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
