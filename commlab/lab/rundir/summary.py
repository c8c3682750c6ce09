"""Headline figures of a run, computed from its metrics lines."""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from commlab.engine.runfiles import FINAL


def warmup_steps(n: int) -> int:
    """Steps left out of timing medians: the first few carry allocation and lazy init."""
    return min(max(2, n // 10), max(n - 1, 0))


def iteration_times(metrics: List[dict]) -> Dict[int, float]:
    """Per step, the slower rank's iteration time in ms (the step is over when every rank is)."""
    per: Dict[int, float] = {}
    for m in metrics:
        if m.get("kind") == "step":
            per[m["step"]] = max(per.get(m["step"], 0.0), m["time_ms"])
    return per


def what_ran(spec: dict, status: Optional[dict] = None) -> str:
    """The model and its data: "mlp on digits", or for an own loop (commlab.wrap; status.json's ``own_loop``,
    whose spec's model and data set are defaults its script never used) "own loop (Net, 1,234 parameters)"."""
    own = (status or {}).get("own_loop")
    if own:
        return f"own loop ({own.get('model')}, {own.get('params', 0):,} parameters)"
    return f"{spec['model']['name']} on {spec['dataset']['name']}"


def summarize(metrics: List[dict], spec: Optional[dict] = None, status: Optional[dict] = None) -> dict:
    """The headline figures. With the run's ``status``: an own loop's (commlab.wrap; status.json's
    ``own_loop``) steps are the ones it took (its spec's ``steps`` is a default its script never read;
    unknown, None, while it runs), and ``own_loop`` is set (its script evaluates on data the lab cannot
    call held out)."""
    steps = [m for m in metrics if m.get("kind") == "step"]
    evals = [m for m in metrics if m.get("kind") == "eval"]
    out: dict = {"steps_done": 0}
    if spec:
        out["steps"] = spec.get("steps")
    own = bool(status and status.get("own_loop"))
    if own:
        out["own_loop"] = True
        out["steps"] = None
    if not steps:
        if own and status.get("state") in FINAL:
            out["steps"] = 0
        return out
    it = iteration_times(metrics)
    # strategy auto's trials (commlab/engine/trials.py) ran other strategies: the run's figures are its choice's
    trial = {m["step"] for m in steps if "trial" in m}
    order = sorted(s for s in it if s not in trial) or sorted(it)
    timed = order[warmup_steps(len(order)):] or order
    med = statistics.median(it[s] for s in timed)
    world = spec.get("world_size", 1) if spec else max(m["rank"] for m in steps) + 1
    batch = spec.get("batch_size") if spec else None
    last = max(m["step"] for m in steps)
    # an own loop's comm.step() may be given no loss (logged as null): the final loss is the last step's
    # that has one, and a run with none at all has no final loss, said as not recorded
    losses = [m for m in steps if _number(m.get("loss"))]
    at = max((m["step"] for m in losses), default=None)
    last_losses = [m["loss"] for m in losses if m["step"] == at]
    rank0 = [m for m in steps if m["rank"] == 0 and m["step"] not in trial] or [m for m in steps if m["rank"] == 0] \
        or steps
    sent = statistics.median(m["bytes_sent"] for m in rank0)
    raw = statistics.median(m["bytes_raw"] for m in rank0)
    method = next((m["method"] for m in rank0 if "method" in m), None)
    if method is not None:
        # a method sends nothing on local steps and a whole sync on others: per step means amortized
        sent = statistics.fmean(m["bytes_sent"] for m in rank0)
        syncs = [m["sync_bytes"] for m in rank0 if "sync_bytes" in m]
        out.update({"method": method, "syncs": len(syncs),
                    "bytes_per_sync": statistics.median(syncs) if syncs else None,
                    "iter_ms_mean": statistics.fmean(it[s] for s in timed)})
    out.update({
        "steps_done": last + 1,
        "iter_ms_median": med,
        # a method's sync steps are rare and long: its throughput is the amortized (mean) iteration's
        "throughput": (world * batch) / (out.get("iter_ms_mean", med) / 1e3) if batch and med > 0 else None,
        "final_loss": sum(last_losses) / len(last_losses) if last_losses else None,
        "bytes_per_step": sent if world > 1 else 0,  # one process has no one to send to
        "compression_ratio": (raw / sent) if sent else None,
        "wall_s": (max(m["t"] for m in metrics) - min(m["t"] for m in steps)) if "t" in steps[0] else None,
    })
    if not last_losses:
        out["loss_recorded"] = False
    if world == 1:
        out["payload_per_step"] = sent  # what the compressor made, which a second rank would have been sent
    if own and status.get("state") in FINAL:
        out["steps"] = last + 1
    if trial and len(order) < len(it):
        out["trial_steps"] = len(trial)
    if evals:
        out["final_acc"] = evals[-1]["eval_acc"]
        out["best_acc"] = max(e["eval_acc"] for e in evals)
        out["final_eval_loss"] = evals[-1]["eval_loss"]
        goal = (spec or {}).get("stop_at_acc") or 0
        if goal and evals[-1]["eval_acc"] >= goal:  # spec.stop_at_acc: it ended at its target
            out["stopped_at_target"] = goal
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GB"


def format_summary(s: dict) -> List[str]:
    def f(key, fmt):
        v = s.get(key)
        return fmt.format(v) if v is not None else "-"
    amortized = " amortized" if "method" in s else ""  # a method's local steps send nothing: a mean
    total = s.get("steps")
    # an own loop's evaluation is its script's, on data the lab cannot call held out
    held_out = "" if s.get("own_loop") else " held out"
    lines = [
        f"steps          {s.get('steps_done', 0)}" + (f"/{total}" if total is not None else
                                                      " (own loop: its script decides how many)"
                                                      if s.get("own_loop") else "/?")
        + (f" (stopped at its target, {s['stopped_at_target']:.1%} held out)" if s.get("stopped_at_target") else ""),
        f"iteration      {f('iter_ms_median', '{:.1f}')} ms (median, slower rank)",
        f"throughput     {f('throughput', '{:.0f}')} samples/s",
        f"final loss     {f('final_loss', '{:.4f}')}" if s.get("loss_recorded", True) else
        "final loss     not recorded (comm.step() was given no loss)",
        f"accuracy       {f('final_acc', '{:.2%}')}{held_out} (best {f('best_acc', '{:.2%}')})",
        f"bytes/step     {fmt_bytes(s.get('bytes_per_step'))} per rank (compression {f('compression_ratio', '{:.1f}')}x)"
        f"{amortized}" if "payload_per_step" not in s else
        f"bytes/step     none sent: one process (its payload {fmt_bytes(s['payload_per_step'])} per step, "
        f"compression {f('compression_ratio', '{:.1f}')}x)",
    ]
    if "method" in s:
        lines.append(f"syncs          {s['syncs']} of {s['method']}, {fmt_bytes(s.get('bytes_per_sync'))} per sync per "
                     f"rank; iteration {f('iter_ms_mean', '{:.1f}')} ms amortized (mean)")
    return lines
