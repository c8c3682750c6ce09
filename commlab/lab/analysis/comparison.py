"""Comparison tables over runs: the figures a sweep or the Compare page shows.

- iteration time: median over steps of the slower rank's time (warm-up left out);
- throughput: samples per second over all ranks;
- scaling factor: throughput at world size N over N times the single-process
  throughput of the same model, data set and per-rank batch (a world-size-1
  run among the runs compared, which a sweep adds by itself);
- time to target: wall time from the start of training (the first step) to
  the first evaluation that reaches ``target_acc``;
- other CPU: the share of the machine other processes used during the run,
  and whether that marks the run ``disturbed`` (commlab.lab.rundir.disturbance); a disturbed
  run's timings are not results.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

from commlab.lab.rundir.summary import summarize, what_ran

Key = Tuple[str, str, int, str]


def _key(spec: dict) -> Key:
    return (spec["model"]["name"], spec["dataset"]["name"], spec["batch_size"], spec.get("device", "auto"))


def time_to_target(metrics: list, target: float) -> Optional[float]:
    steps = [m for m in metrics if m.get("kind") == "step" and "t" in m]
    if not steps:
        return None
    first = min(steps, key=lambda m: m["t"])
    start = first["t"] - first["time_ms"] / 1e3
    for e in sorted((m for m in metrics if m.get("kind") == "eval"), key=lambda m: m["t"]):
        if e["eval_acc"] >= target:
            return e["t"] - start
    return None


def describe(spec: dict) -> str:
    c = spec["compressor"]
    params = ",".join(f"{k}={v}" for k, v in sorted(c.get("params", {}).items()))
    return f"{c['name']}{'(' + params + ')' if params else ''}{'+EF' if c.get('error_feedback') else ''}"


def compare_runs(runs: Iterable, target_acc: Optional[float] = None, baseline: Optional[Dict[Key, float]] = None):
    """One row per run (a pandas DataFrame indexed by run id)."""
    import pandas as pd
    rows, single = [], dict(baseline or {})
    loaded = []
    for run in runs:
        spec = run.spec_dict()
        metrics = run.metric_rows()
        s = summarize(metrics, spec)
        loaded.append((run, spec, metrics, s))
        if spec["world_size"] == 1 and s.get("throughput") and run.state == "done":
            single.setdefault(_key(spec), s["throughput"])
    for run, spec, metrics, s in loaded:
        base = single.get(_key(spec))
        thr = s.get("throughput")
        dist = run.status().get("disturbance") or {}
        row = {
            "run": run.id, "name": spec["name"], "state": run.state, "model": spec["model"]["name"],
            "dataset": spec["dataset"]["name"], "world_size": spec["world_size"], "compressor": describe(spec),
            "schedule": spec["schedule"]["name"], "comm": spec["comm"]["mode"], "link": spec["network"]["link"],
            "iter_ms": s.get("iter_ms_median"), "throughput": thr,
            "scaling_factor": (thr / (spec["world_size"] * base)) if thr and base else None,
            "bytes_per_step": s.get("bytes_per_step"), "compression_ratio": s.get("compression_ratio"),
            "final_acc": s.get("final_acc"), "final_loss": s.get("final_loss"),
            "other_cpu": dist.get("other_cpu"), "disturbed": dist.get("disturbed"),
        }
        if target_acc is not None:
            row["time_to_target_s"] = time_to_target(metrics, target_acc)
        rows.append(row)
    df = pd.DataFrame(rows)
    return df.set_index("run") if len(df) else df


def describe_setup(spec: dict, status: Optional[dict] = None) -> str:
    """One line: model on dataset (an own loop's model, from the run's ``status``: its spec's model and data
    set are defaults its script never used), world size, compressor, schedule, comm, link."""
    net = spec["network"]
    link = net["link"] + (f" {net['gbps']:g} Gbit/s" if net.get("gbps") else "")
    return (f"{what_ran(spec, status)}, {spec['world_size']} ranks, {describe(spec)}, "
            f"{spec['schedule']['name']}, {spec['comm']['mode']}, {link}")
