"""The trials: a few candidates run for real on the link, and what their steps measured.

Which candidates are worth their steps (``trial_picks``: the best-predicted of each compressor ``family``, and
DDP as the safety reference), each one's spec (``trial_spec``: PowerSGD compressing at once, a MergeComp
trial at the predicted partition), the session run that holds them (``session_spec``, ``prepare_session``,
``session_trials``), and a trial's measured iteration time (``measured_ms``, with MergeComp's search cost
added by ``with_search_cost``). ``strategy: auto`` uses the same picks and costs for trials inside the run
(commlab.lab.strategy.auto).

Apart from the advice (commlab.lab.strategy.advisor), which calls these and re-chooses the winner by measurement, so
that what a trial is and how it is timed reads in one place, below the decision made from it.
"""
from __future__ import annotations

import json
import statistics
from typing import List, Optional, Tuple

from commlab.engine import runfiles
from commlab.engine.runlog import write_json_atomic
from commlab.engine.spec import JobSpec
from commlab.lab.rundir.store import Run
from commlab.lab.rundir.summary import iteration_times, warmup_steps
from commlab.lab.strategy.space import Candidate, is_ddp, load_spec_dict, start_iter, with_strategy

TRIAL_WARMUP = 2
"""Steps at the start of each trial left out of its median (allocation, lazy buffers, the first exchanges)."""
DDP_MARGIN = 1.5
"""DDP (none, 25 MB buckets, wfbp) is tried too unless its predicted score is more than this many times the
best-predicted one's: then the model's errors (tens of percent where measured) cannot make it the winner, and
its trial would be the slowest of all. Tried, it is the safety reference: the choice is never slower than DDP
as measured in the same session."""
FAMILY_MARGIN = 2.0
"""A compressor family is tried only if its best predicted score is within this many times the best one's:
the model's errors where measured are tens of percent, not 2x, and a family far behind costs its trial
steps for nothing (int8 at a shaped 0.1 Gbit/s on resnet: predicted 7x PowerSGD's time, one step of 359 ms
before STOP_RATIO (commlab.lab.strategy.auto) stopped it, a third of the trials' cost)."""


def measured_ms(run, run_steps: Optional[int] = None, skip: Optional[int] = None) -> Tuple[Optional[float], str]:
    """Median iteration time (slower rank) of a trial run after its warm-up (``skip`` steps, default
    commlab.lab.rundir.summary's rule) and PowerSGD's uncompressed start, with a note on what was counted. A MergeComp
    run's search (tuning.json's trace of measured partitions) is spread over ``run_steps`` less the
    compressor's plain start, as the prediction spreads it: the warm-up and each candidate's steps at its
    measured time, the rest at the best partition measured so far."""
    spec = run.spec_dict()
    it = iteration_times(run.metric_rows())
    if not it:
        return None, f"trial {run.id} ({run.state}) recorded no steps"
    tuning = run.file(runfiles.TUNING)
    info = json.loads(tuning.read_text()) if tuning.is_file() else {}
    if spec["schedule"]["name"] == "mergecomp" and info.get("trace"):
        sched, trace = spec["schedule"], [t["ms"] for t in info["trace"]]
        total = max((run_steps or spec["steps"]) - (start_iter(spec["compressor"]) or 0), 1)
        steps = [trace[0]] * sched["warmup_steps"]
        for t in trace:
            steps += [t] * (1 + sched["steps_per_candidate"])
        steps = steps[:total]
        steps += [min(trace)] * (total - len(steps))
        done = "finished" if "chosen" in info else "unfinished"
        return sum(steps) / len(steps), (f"measured: the search's {len(trace)} partitions ({done} in the trial), "
                                         f"spread over {total} steps")
    order = sorted(it)
    skip = warmup_steps(len(order)) if skip is None else skip
    start = start_iter(spec["compressor"])
    if start is not None:
        skip = max(skip, start + 1)
    timed = order[skip:]
    note = ""
    if len(timed) < 2:
        timed = order[warmup_steps(len(order)):]
        note = f"warm-up filled the trial; median over {len(timed)} steps including it"
    return statistics.median(it[s] for s in timed), note


SAME_FAMILY = {"bf16": "fp16"}
"""Compressors that are one family for the trials: bf16 sends fp16's bytes through the same cast, so
trying both teaches nothing a third family would not (at 10 Gbit/s, where the model sees every candidate
within a few percent, three 16-bit and plain trials crowded out PowerSGD, the grid's best)."""


def family(comp: dict) -> str:
    """The section's compressor family: its name (a mixed section's: the compressor of its large buckets),
    with ``SAME_FAMILY`` folded."""
    return SAME_FAMILY.get(comp["name"], comp["name"])


def trial_picks(ranked: List[Candidate], k: int, ddp_margin: float = DDP_MARGIN,
                family_margin: Optional[float] = None) -> List[Candidate]:
    """The candidates to try: the best-predicted one of each of the first ``k`` compressor families among the
    candidates with evidence for this model (``Candidate.proven``) in the
    ranking (``family``: PowerSGD of rank 1 or 4, alone or in a mixed section, is one family, and so are
    fp16 and bf16) that are predicted within ``family_margin`` of the best, and DDP (the safety reference)
    unless its predicted score is more than ``ddp_margin`` times the best one's. Where the model errs most is a family's cost inside a real step (two ranks and gloo on the
    same cores, multi-round exchanges holding backward: on resnet it predicts PowerSGD a third faster than it
    runs), not the choice of rank or bucket cap, so trying k families teaches more than trying one family
    k ways."""
    family_margin = FAMILY_MARGIN if family_margin is None else family_margin
    picks, seen = [], set()
    for c in ranked:
        key = family(c.compressor)
        # a trial would not span a method's period; an unproven candidate (no evidence of its steps to
        # accuracy on this model) cannot be chosen by iteration time, so its trial would teach nothing
        if c.predicted_score is None or key in seen or c.local or not c.proven:
            continue
        if picks and c.predicted_score > family_margin * picks[0].predicted_score:
            continue
        seen.add(key)
        picks.append(c)
        if len(picks) == k:
            break
    ddp = next((c for c in ranked if is_ddp(c)), None)
    if (ddp is not None and ddp not in picks and picks
            and ddp.predicted_score <= ddp_margin * picks[0].predicted_score):
        picks.append(ddp)
    return picks


def ddp_left_out(ranked: List[Candidate], picks: List[Candidate], ddp_margin: float = DDP_MARGIN) -> str:
    """Why DDP (none, 25 MB buckets, wfbp) is not among ``picks`` (``trial_picks``'), in words for the
    advice's output; "" when it is tried or not in the space."""
    ddp = next((c for c in ranked if is_ddp(c)), None)
    if ddp is None or ddp in picks:
        return ""
    if ddp.predicted_score is None or not picks:
        return "DDP not tried: it has no predicted score to compare"
    ratio = ddp.predicted_score / picks[0].predicted_score
    return (f"DDP not tried: predicted {ratio:.2f}x the best-predicted candidate's time to accuracy, more than "
            f"the {ddp_margin:g}x within which it is (commlab.lab.strategy.trials.DDP_MARGIN): the model's errors where "
            f"measured are tens of percent, so it could not win, and its trial would be the slowest; the winner "
            f"is compared with DDP's prediction, not its measurement")


def compressing_at_once(cand: Candidate) -> dict:
    """The candidate's strategy with PowerSGD compressing from its first exchange (its plain start is the
    same all-reduce DDP does; a trial times the steady state, as the predictions do)."""
    strat = cand.strategy()
    for part in [strat["compressor"], *strat["compressor"].get("per_bucket", [])]:
        if part["name"] == "powersgd":
            part["params"] = {**part["params"], "start_iter": 0}
    return strat


def trial_spec(spec: dict, cand: Candidate, steps: int) -> dict:
    """One trial: ``TRIAL_WARMUP`` + ``steps`` steps of the candidate, no evaluation, PowerSGD compressing
    from its first exchange."""
    s = with_strategy({**spec, "strategy": {"mode": "fixed"}}, compressing_at_once(cand))
    s.update(name=f"advise trial: {cand.label}", steps=TRIAL_WARMUP + steps, eval_every=0, final_eval=False)
    return load_spec_dict(s)


def session_spec(specs: List[dict]) -> dict:
    """The run that holds a trial session: the first trial's spec (its link and world size start the
    ranks), named for the session, its steps the session's total."""
    return load_spec_dict({**specs[0], "name": f"advise trials: {len(specs)} candidates",
                           "steps": sum(s["steps"] for s in specs)})


def prepare_session(run, specs: List[dict], cands: List[Candidate], profile) -> List[str]:
    """Write the trials into ``run``'s directory before its ranks start: trial-<i>/spec.json each and
    trials.json (commlab.engine.worker runs them in turn). A MergeComp trial starts at the partition the
    advisor's search predicted (seeded into the session's MergeComp cache), since its own search takes
    longer than a trial; the search's cost is added from the prediction (``trial_score``)."""
    from commlab.engine.tuners.mergecomp import cache_key, write_cache
    dirs = []
    for i, (s, c) in enumerate(zip(specs, cands)):
        d = run.path / runfiles.TRIAL_DIR.format(i=i)
        d.mkdir()
        write_json_atomic(d / runfiles.SPEC, s)
        dirs.append(d.name)
        if c.schedule["name"] == "mergecomp" and c.layout_cuts is not None:
            problem = write_cache(str(run.path), cache_key(JobSpec.from_checked(s)),
                                  {"order": [n for n, _ in profile.params], "cuts": c.layout_cuts,
                                   "ms": c.steady_ms, "run": "advisor prediction"})
            if problem:
                raise RuntimeError(f"advisor: trial session {run.id}: {problem}")
    write_json_atomic(run.path / runfiles.TRIALS, {"dirs": dirs})
    return dirs


def session_trials(run) -> List[object]:
    """The trials of a finished session run, as runs of their own (id ``<session>/trial-<i>``), read through the
    run directory's one trials reader (commlab.engine.runfiles.read_trials, as the session's ranks read them)."""
    out = []
    found = runfiles.read_trials(str(run.path))
    for d in found.session if found else []:
        t = Run(run.path / d)
        t.id = f"{run.id}/{d}"
        out.append(t)
    return out


def search_extra_ms(c: Candidate) -> float:
    """MergeComp: its search's predicted cost per step over the run (a trial runs at the predicted
    partition, since the search itself takes longer than a trial); 0 otherwise."""
    if c.schedule["name"] == "mergecomp" and c.steady_ms is not None and c.predicted_ms is not None:
        return c.predicted_ms - c.steady_ms
    return 0.0


def with_search_cost(c: Candidate, ms: float) -> Tuple[float, str]:
    extra = search_extra_ms(c)
    if c.schedule["name"] != "mergecomp" or c.steady_ms is None:
        return ms, ""
    return ms + extra, (f"trial at the predicted partition ({c.layout_groups} groups), its search's predicted "
                        f"cost added ({extra:+.1f} ms per step)")
