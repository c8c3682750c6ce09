"""``strategy: auto``'s trials as the run's own first steps.

Before the ranks start, the lab's advisor (commlab/lab/strategy/auto.py ``plan_in_run``) writes ``auto-trials.json``
into the run directory (its fields are checked by ``commlab.engine.runfiles.read_trials``, the ranks' one reader of
their trials): the candidates it picked from its predictions, best-predicted first, each a full
spec of the run with that candidate's strategy (``spec``), the spec to go on with if it wins (``final``),
its convergence penalty and, for MergeComp, the partition the advisor's search predicted (``layout``)
and that search's predicted cost per step (``extra_ms``).

The ranks train the run's first steps under each candidate in turn, switching strategy at step
boundaries (``Stepper.switch``: communicator, tuner and, for dear's shards, optimizer rebuilt over the same
model): ``warmup`` steps, then up to ``steps`` timed ones; the first trial trains ``lead_in`` more warm-up steps
(a fresh process's first steps run slow, which would count against the best-predicted candidate). With
``runoff_within`` in the plan, every trial whose score is within that factor of the best trains again, in reverse
order, ``warmup`` + ``runoff_steps`` steps, and is scored on all its timed steps: one visit of 8 steps scatters
by 10-20% on a shared machine, and its drift (a slow start, a busy neighbour) falls on whichever trial ran then.
With ``reference_within``, the trial marked ``reference`` (DDP) joins that runoff whenever its score is within
that (wider) factor of the best: the safety reference is not lost to one slow visit (the transformer at a
shaped 10 Gbit/s: DDP's one visit 201 ms, 13% behind, against 171 ms in the grid). A candidate whose first
``abort_after`` timed steps already score ``abort_ratio`` times the best score so far stops there; with ``stop_ratio`` in the plan,
one whose fastest step so far (warm-up steps included) scores ``stop_ratio`` times the best stops at once.
Each step's time is the slower rank's (one small all-reduce per decision, outside the timed steps), so every
rank computes the same scores and the same winner: the lowest (median ms + extra_ms) x penalty, except that a
trial marked ``reference`` (DDP) wins unless the lowest beats it by more than ``hold_margin`` (``choose``). The
run then trains its remaining steps under the winner's ``final`` spec (PowerSGD's uncompressed start
shortened by the steps already trained).

The trial steps train the model like any other step: what the choice costs in the run is only the time
those steps took beyond what the winner takes per step, plus the switches. Rank 0 writes the measurements,
the decision and that cost into ``auto-result.json``, writes the winner's spec into spec.json (what the
rest of the run used), and puts one span per trial on the timeline's advisor lane. Step records of trial
steps carry ``"trial": i`` in metrics.jsonl.
"""
from __future__ import annotations

import copy
import os
import statistics
import time
from typing import List, Tuple

import torch
import torch.distributed as dist

from commlab.engine import runfiles
from commlab.engine.compressors import REGISTRY
from commlab.engine.runlog import write_json_atomic
from commlab.engine.spec import JobSpec


def runs_off(plan: dict) -> bool:
    """Whether the plan has a runoff: close trials (``runoff_within``) or the reference (``reference_within``)
    train again."""
    return plan.get("runoff_within") is not None or plan.get("reference_within") is not None


def most_steps(plan: dict) -> int:
    """The steps the trials take at most (none stopped early, every one in the runoff)."""
    n, warm = len(plan["trials"]), plan["warmup"]
    runoff = n * (warm + plan["runoff_steps"]) if runs_off(plan) else 0
    return plan.get("lead_in", 0) + n * (warm + plan["steps"]) + runoff


def shorten_start(spec: dict, done: int) -> dict:
    """``spec`` with every PowerSGD section's uncompressed start shortened by ``done`` trained steps."""
    s = copy.deepcopy(spec)
    comp = s["compressor"]
    default = next(p.default for p in REGISTRY["powersgd"].params if p.name == "start_iter")
    for part in [comp, *comp.get("per_bucket", [])]:
        if part.get("name") == "powersgd":
            params = part.setdefault("params", {})
            params["start_iter"] = max(0, int(params.get("start_iter", default)) - done)
    return s


def slower_rank(times: List[float], device) -> List[float]:
    """Per step, the slowest rank's time (a collective: every rank calls it with as many times)."""
    t = torch.tensor(times, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def score(times: List[float], trial: dict) -> float:
    return (statistics.median(times) + float(trial.get("extra_ms") or 0.0)) * float(trial["penalty"])


def choose(scores: List[float], plan: dict) -> Tuple[int, bool]:
    """The winning trial (index) by its score, and whether the reference trial (DDP) held: a trial marked
    ``reference`` wins unless the lowest score beats it by more than ``hold_margin``."""
    w = min(range(len(scores)), key=scores.__getitem__)
    ref = next((j for j, t in enumerate(plan["trials"][:len(scores)]) if t.get("reference")), None)
    if ref is not None and ref != w and scores[w] * float(plan.get("hold_margin") or 1.0) > scores[ref]:
        return ref, True
    return w, False


def run(trainer, plan: dict, after_step=lambda: None) -> dict:
    """Train the trials, switch ``trainer`` to the winner, and return (rank 0 also writes) the result.
    ``after_step`` runs after every step (the trainer's evaluation schedule)."""
    tl, device = trainer.timeline, trainer.device
    warm, n, abort_after, ratio = plan["warmup"], plan["steps"], plan["abort_after"], plan["abort_ratio"]
    stop = plan.get("stop_ratio")
    out, best = [], float("inf")
    started = time.perf_counter()

    def visit(i: int, trial: dict, warm_k: int, steps: int, may_stop: bool) -> Tuple[List[float], bool, float, int]:
        """Train ``warm_k`` + up to ``steps`` steps of trial ``i``: their times (slower rank), whether it was
        stopped as clearly slower, the switch's seconds and the first step."""
        t0, spec = time.perf_counter(), JobSpec.from_checked(trial["spec"])  # checked by the lab that planned it
        if spec != trainer.spec or trial.get("layout") is not None:  # the run starts under trial 0
            trainer.switch(spec, trial.get("layout"))
        switch_s = time.perf_counter() - t0
        first, times = trainer.step, []
        for k in range(warm_k + steps):
            times.append(trainer.train_step(trial=i)["time_ms"])
            after_step()
            if not may_stop or best == float("inf"):
                continue
            if stop is not None and k + 1 < warm_k + abort_after:
                # far slower from its first step (warm-up included): its fastest step so far decides
                if score([min(slower_rank(times, device))], trial) > stop * best:
                    return slower_rank(times, device), True, switch_s, first
            if k + 1 == warm_k + abort_after and k + 1 < warm_k + steps:
                if score(slower_rank(times, device)[warm_k:], trial) > ratio * best:
                    return slower_rank(times, device), True, switch_s, first
        return slower_rank(times, device), False, switch_s, first

    for i, trial in enumerate(plan["trials"]):
        m0 = tl.mark()
        warm_k = warm + (plan.get("lead_in", 0) if i == 0 else 0)
        times, aborted, switch_s, first = visit(i, trial, warm_k, n, True)
        timed = times[warm_k:] or times  # stopped during its warm-up: its steps so far are all there is
        s = score(timed, trial)
        best = min(best, s)
        out.append({"label": trial["label"], "first_step": first, "last_step": trainer.step - 1, "times_ms": times,
                    "timed_ms": timed, "median_ms": statistics.median(timed), "score_ms": s, "aborted": aborted,
                    "switch_s": switch_s, "visits": [[first, trainer.step - 1]]})
        _lane(tl, i, trial, m0, first, trainer.step - 1, out[-1]["median_ms"], aborted)
    within, ref_within = plan.get("runoff_within"), plan.get("reference_within")

    def again(i: int) -> bool:
        if out[i]["aborted"]:
            return False
        if within is not None and out[i]["score_ms"] <= within * best:
            return True
        return (ref_within is not None and bool(plan["trials"][i].get("reference"))
                and out[i]["score_ms"] <= ref_within * best)
    runoff = [i for i in reversed(range(len(out))) if again(i)]
    if len(runoff) > 1:
        for i in runoff:  # in reverse order: the last one goes on without a switch, the first comes last
            trial, r, m0 = plan["trials"][i], out[i], tl.mark()
            times, _, switch_s, first = visit(i, trial, warm, plan["runoff_steps"], False)
            r["times_ms"] += times
            r["timed_ms"] += times[warm:]
            r["switch_s"] += switch_s
            r["visits"].append([first, trainer.step - 1])
            r["median_ms"] = statistics.median(r["timed_ms"])
            r["score_ms"] = score(r["timed_ms"], trial)
            _lane(tl, i, trial, m0, first, trainer.step - 1, r["median_ms"], False, runoff=True)
    else:
        runoff = []
    w, held = choose([r["score_ms"] for r in out], plan)
    final = shorten_start(plan["trials"][w]["final"], trainer.step)
    t0 = time.perf_counter()
    trainer.switch(JobSpec.from_checked(final))
    final_switch_s = time.perf_counter() - t0
    win_ms = out[w]["median_ms"]
    # what the trials cost the run: their steps' time beyond the winner's median per step (its own steps
    # net out to about zero), and the switches
    excess_s = sum(t - win_ms for r in out for t in r["times_ms"]) / 1e3
    switches_s = sum(r["switch_s"] for r in out) + final_switch_s
    result = {"trials": out, "winner": w, "label": out[w]["label"], "held": held, "decided_step": trainer.step,
              "trial_steps": trainer.step, "runoff": sorted(runoff), "excess_s": excess_s, "switch_s": switches_s,
              "cost_s": excess_s + switches_s, "wall_s": time.perf_counter() - started, "t": time.time()}
    waited = getattr(trainer, "waited", None)
    if waited is not None:  # the ranks measured the profile (commlab/engine/autoprofile.py) and waited for this plan
        result.update(profile_steps=waited.steps, profile_s=waited.profile_s, plan_wait_s=waited.wait_s)
    if trainer.rank == 0 and trainer.run_dir:
        write_json_atomic(os.path.join(trainer.run_dir, runfiles.AUTO_RESULT), result)
        write_json_atomic(os.path.join(trainer.run_dir, runfiles.SPEC), final)
    return result


def _lane(tl, i: int, trial: dict, m0, first: int, last: int, median_ms: float, aborted: bool,
          runoff: bool = False) -> None:
    """One span on the timeline's advisor lane for a visit of trial ``i``."""
    if tl.enabled:
        tl.span("advisor", f"trial {i}{' (runoff)' if runoff else ''}: {trial['label']}", m0, tl.mark(),
                {"trial": i, "label": trial["label"], "steps": [first, last], "median_ms": round(median_ms, 3),
                 "aborted": aborted, "runoff": runoff})
        tl.flush()
