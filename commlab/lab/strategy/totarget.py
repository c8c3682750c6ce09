"""To-target trials: ``commlab advise --measure`` proves what the advice claims, the time to a held-out
accuracy against DDP's on the same link, not only the time of a step.

``picks`` chooses what to try: DDP (the reference the target and every ratio are counted against), then the
best-predicted candidate of each of the first ``k`` families, ranked by predicted iteration time x penalty
where the penalty is evidence for this model and by predicted iteration time alone where it is not (a
candidate without evidence is exactly what the trial is for; a method is a family of its own), per-step
families and methods taken in turn; before them, the best candidate with evidence when it is predicted faster
than DDP (its steps are known: its trial measures the safe choice). ``measure``
runs them one after another through the lab's queue as ordinary runs of the spec on the advice's link (the
same seed, so the same initialisation and the same batches in the same order), each evaluating every
``eval_every`` steps (the spec's; a twentieth of the steps when it has none):

1. DDP first, ``target_steps`` steps (the spec's steps by default), stopping at the user's target when there is
   one; without one, the target is ``TARGET_FRACTION`` of DDP's best (commlab.lab.strategy.penalty), as a
   measured penalty counts it.
2. Every other pick stops at the target (``stop_at_acc``) or after the steps its predicted iteration time
   allows in ``STOP_FACTOR`` times DDP's time to the target: past that it could not win, and its trial would
   only cost.

A trial's time to the target is the sum of its iteration times (the slower rank's) up to the first
evaluation at or above the target, evaluations left out, as bench/local_updates.py counts it. The runs stay
in the index: they are the model's own evidence the next advice reads (a measured penalty), and every
candidate's penalty is read again from them. The winner is the trial with the lowest time to the target;
DDP holds unless the best beats it by more than ``HOLD`` (10%).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional

from commlab.engine.spec import SpecError
from commlab.lab.base.errors import LabError
from commlab.lab.rundir.summary import iteration_times
from commlab.lab.strategy.penalty import TARGET_FRACTION, eval_points, is_proven, steps_to
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel.calibrate import compressor_key
from commlab.lab.strategy.predictions import network_words
from commlab.lab.strategy.space import Candidate, add_note, is_ddp, load_spec_dict, with_strategy
from commlab.lab.strategy.trials import family

STOP_FACTOR = 1.5
"""A candidate's trial is capped at the steps its predicted iteration time allows in this many times DDP's
measured time to the target (the model's step-time errors where measured are tens of percent)."""
HOLD = 1.10
"""A to-target trial must reach the target this much sooner than DDP's trial to win; else DDP holds. One run each,
one after another, scatters by 10-20% on a shared machine: the race of bench/advisor.py measured DDP's time to 70%
at 59.3 s in its trial and 54.4 s in the grid at 0.1 Gbit/s, 21.3 and 26.0 s at 1 Gbit/s, 20.4 and 17.6 s at 10, so
a closer win is not one (the timing session's 3% is for medians of many steps)."""
MIN_EVALS = 2
"""A capped trial still gets at least this many evaluations."""


def family_of(c: Candidate) -> str:
    """What one to-target trial speaks for: a method; a compressor family for a candidate with evidence (its
    steps are known, its rank or bucket cap changes only its step time, which the prediction has); the exact
    compressor section for one without (PowerSGD rank 1 missing the target says nothing of rank 4)."""
    if c.local:
        return f"method:{METHOD_FAMILY.get(c.method['name'], c.method['name'])}"
    return family(c.compressor) if c.proven else compressor_key(c.compressor)


METHOD_FAMILY = {"streaming_diloco": "diloco", "post_local_sgd": "local_sgd"}
"""Methods one trial speaks for together: Streaming DiLoCo is DiLoCo with its sync split in fragments, post-local
SGD local SGD after a synchronous start."""
MORE_AFTER_MISS = 2
"""Trials past ``k`` that ``measure`` may run when picks miss the target: the next family in line takes a missed
one's place (PowerSGD rank 1 missing says nothing of rank 4), at most this many times."""


def picks(cands: List[Candidate], k: Optional[int] = None) -> List[Candidate]:
    """DDP, then the best-predicted candidate of each family other than DDP's own configuration, in the order
    they are tried (the first ``k`` after DDP and the safe pick, or all; see the module docstring)."""
    ddp, safe, rest = line_of(cands)
    return [c for c in (ddp, safe) if c is not None] + rest[:k]


def line_of(cands: List[Candidate]):
    """(DDP, the safe pick or None, the other families in the order they are tried)."""
    def optimistic(c: Candidate) -> float:
        return c.predicted_ms * (c.penalty if c.proven else 1.0)
    ddp = next((c for c in cands if is_ddp(c)), None)
    best: dict = {}  # family -> its best-predicted candidate
    for c in sorted((c for c in cands if c.predicted_ms is not None and not c.excluded and not is_ddp(c)
                     and (c.penalty is not None or c.local)), key=optimistic):
        best.setdefault(family_of(c), c)
    # the best candidate with evidence goes first when predicted faster than DDP: its steps are known, so its
    # trial is the safe choice's measurement, whatever the unproven ones do
    safe = next((c for c in best.values() if c.proven and not c.local and ddp is not None
                 and ddp.predicted_score is not None and c.predicted_score < ddp.predicted_score), None)
    if safe is not None:
        del best[family_of(safe)]
    # per-step families and methods alternate, the better-predicted kind first: a method's amortized step
    # is predicted far below any per-step one's, and how many steps it needs is what is least known
    kinds = [[c for c in best.values() if not c.local], [c for c in best.values() if c.local]]
    kinds.sort(key=lambda cs: optimistic(cs[0]) if cs else float("inf"))
    mixed = [c for pair in zip(*kinds) for c in pair] + kinds[0][len(kinds[1]):] + kinds[1][len(kinds[0]):]
    return ddp, safe, mixed


def trial_spec(base: dict, c: Candidate, steps: int, every: int, stop_at: float) -> dict:
    s = with_strategy({**base, "strategy": {"mode": "fixed"}}, c.strategy())
    s.update(name=f"advise to target: {c.label}"[:120], steps=steps, eval_every=every, final_eval=True,
             stop_at_acc=stop_at)
    return load_spec_dict(s)


def reached(run, target: float) -> dict:
    """What a finished trial run measured against ``target``: steps and seconds (the sum of the slower
    rank's iteration times up to the first evaluation at or above it; None when it never got there), its
    median iteration time, its last accuracy, and the run's id."""
    rows = run.metric_rows()
    it = iteration_times(rows)
    ev = eval_points(run)
    at = steps_to(ev, target)
    secs = sum(ms for s, ms in it.items() if s < at) / 1e3 if at is not None else None
    order = sorted(it)
    timed = order[2:] or order
    med = sorted(it[s] for s in timed)[len(timed) // 2] if timed else None
    return {"run": run.id, "state": run.state, "steps": at, "seconds": secs, "reached": at is not None,
            "median_ms": med, "last_acc": ev[-1][1] if ev else None, "trained": len(it)}


def measure(adv, k: int, runner: Callable, say: Callable[[str], None], reprice: Callable[[], None],
            hold: float, target_steps: Optional[int] = None) -> None:
    """Run the to-target trials of ``picks(adv.candidates, k)`` and choose by them (module docstring).
    ``reprice`` sets every candidate's penalty again (the trials are runs of the model now); ``hold``: how
    much faster than DDP the best must be to win."""
    base = {**adv.spec, "network": dict(adv.network), "world_size": adv.world}
    steps = target_steps or base["steps"]
    if not 2 <= steps <= 100_000:
        raise SpecError("--target-steps", f"must be in 2..100000, got {steps}")
    every = base["eval_every"] or max(1, steps // 20)
    ddp, safe, rest = line_of(adv.candidates)
    if ddp is None:
        raise LabError("advise --measure: DDP's configuration is not in the space to count the target from")
    line = [c for c in (ddp, safe) if c is not None] + rest
    fixed = 2 if safe is not None else 1
    first = line[:fixed + k]
    say(f"advisor: to-target trials on {network_words(adv.network)}, one run each, up to "
        f"{steps} steps, evaluated every {every}: " + "; ".join(c.label for c in first)
        + (f" (the next in line when one misses the target, up to {MORE_AFTER_MISS} more)" if len(line) > len(first)
           else ""))
    run = runner(trial_spec(base, ddp, steps, every, adv.target or 0.0))
    evals = eval_points(run) if run.state == "done" else []
    if not evals:
        add_note(ddp, f"to-target trial {run.id} ended {run.state} without an evaluation: nothing was measured")
        return
    goal = adv.target if adv.target is not None and steps_to(evals, adv.target) is not None else \
        TARGET_FRACTION * max(a for _, a in evals)
    if adv.target is not None and goal != adv.target:
        say(f"advisor: DDP did not reach {adv.target:.1%} in {steps} steps; counting to {goal:.1%} "
            f"({TARGET_FRACTION:.0%} of its best) instead")
    ddp.to_target = reached(run, goal)
    ddp_s = ddp.to_target["seconds"]
    say(f"advisor: DDP reached {goal:.1%} at step {ddp.to_target['steps']} in {ddp_s:.1f} s (run {run.id})")
    tried, missed = [ddp], 0
    for c in line[1:]:
        if len(tried) >= fixed + k + min(missed, MORE_AFTER_MISS):
            break
        tried.append(c)
        ms = max(c.predicted_ms or 1.0, 1.0)
        cap = math.ceil(STOP_FACTOR * ddp_s * 1e3 / ms / every) * every
        n = max(MIN_EVALS * every, min(steps, cap))
        r = runner(trial_spec(base, c, n, every, goal))
        c.to_target = dict(reached(r, goal), cap=n)
        c.trial_run = r.id
        got = c.to_target
        say(f"advisor: {c.label}: " + (f"{goal:.1%} at step {got['steps']} in {got['seconds']:.1f} s" if got["reached"]
                                       else f"did not reach {goal:.1%} in {got['trained']} steps ({r.state})"))
        if cal.disturbed_note(cal.disturbance_of(r)):
            add_note(c, f"its to-target trial {r.id} {cal.disturbed_note(cal.disturbance_of(r))}")
        missed += not got["reached"]
    ddp.trial_run = run.id
    adv.target = goal
    adv.ddp_steps = (ddp.to_target["steps"], goal, run.id)
    reprice()  # the trials are runs of this model now: evidence
    for c in tried:
        if c.to_target.get("median_ms") is not None:
            c.measured_ms = c.to_target["median_ms"]
        if not c.to_target["reached"]:
            c.penalty, c.penalty_source = None, (
                f"measured: did not reach {goal:.1%} in its to-target trial ({c.to_target['trained']} steps, "
                f"run {c.to_target['run']}; capped at {STOP_FACTOR:g}x DDP's time to it)")
    choose(adv, tried, hold)


def choose(adv, tried: List[Candidate], hold: float) -> None:
    """The trial with the lowest time to the target wins; DDP holds unless it is beaten by more than ``hold``.
    A trial that reached the target but whose penalty is not evidence (the index could not pair it) still
    counts: its own run is the evidence."""
    done = [c for c in tried if c.to_target and c.to_target["seconds"] is not None]
    if not done:
        return
    best = min(done, key=lambda c: c.to_target["seconds"])
    ddp = next((c for c in done if is_ddp(c)), None)
    adv.chosen_by = "measured to target"
    adv.winner = ddp if ddp is not None and best.to_target["seconds"] * hold > ddp.to_target["seconds"] else best
    for c in done:
        if not is_proven(c.penalty_source):
            add_note(c, "its penalty could not be paired with DDP's run in the index; its trial decided")
