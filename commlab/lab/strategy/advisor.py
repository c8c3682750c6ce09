"""The advisor: choose the communication strategy for a model and a link, then prove it by measurement.

    commlab advise SPEC --gbps 1 [--link modeled|shaped] [--workers N] [--measure] [--out best.yaml] [--json]
    commlab advise SPEC --cluster three_continents [--workers N] ...

This module is the advice itself: ``advise`` runs the steps below and returns an ``Advice`` (the ranked
candidates, the winner, why it won, what the advice cost), ``rechoose`` and ``measure_in_session`` decide by
measurement, ``explain`` and ``format_table`` say the result. The steps' parts live beside it, one idea each,
and import nothing from here: the space in commlab.lab.strategy.space, the predictions in commlab.lab.strategy.predictions, the
trials in commlab.lab.strategy.trials, the penalty in commlab.lab.strategy.penalty.

Steps, in order:

1. A calibrated profile of the spec's model (commlab.lab.strategy.perfmodel.whatif.resolve_profile: a saved profile, a
   finished run in the index, or a short single-process run measured now) and the encode/decode cost
   curve of every candidate compressor (measured in-process, saved with the profile).
2. The strategy space the engine supports (commlab.lab.strategy.space): compressors that keep accuracy (none, the 16-bit
   casts, block-wise int8, top-k with error feedback at two ratios, PowerSGD rank 1 and 4) and two mixed
   sections (buckets under 1 MB uncompressed, the rest PowerSGD rank 4 or int8: compressor.per_bucket),
   fusion (bucket caps of 1, 4 and 25 MB, and MergeComp), comm mode wfbp, and dear (its buffer cap) for
   compressors whose payload it can reduce-scatter: summed (none, the casts) or as a shard codec's
   all-to-all (int8: dear with a compressed reduce-scatter). Compressors come from the registry's
   capabilities, not from a list of names: a section is in the dear space when ``capabilities.shard_problem()`` is None
   for every compressor it may give a buffer.
3. Each candidate's predicted iteration time (commlab.lab.strategy.perfmodel.predict on the link), times its convergence
   penalty (``penalty``: steps to the target accuracy over ``none``'s), is its predicted time to accuracy.
   MergeComp is predicted at the partition its own search would settle on when it is fed the model's
   predictions instead of measurements (commlab.engine.tuners.mergecomp.MergeCompSearch, driven by commlab.lab.strategy.predictions).
4. With ``measure``, the best-predicted candidate of each of the top ``trials`` compressors runs
   ``trial_steps`` steps through the normal launcher on the same link (commlab.lab.strategy.trials); the winner is the
   best measured iteration time x penalty.

The methods that communicate less often (commlab/engine/methods/: local SGD, post-local SGD, DiLoCo, Streaming DiLoCo,
DeMo) are candidates too (commlab.lab.strategy.space.method_space): each at its defaults, and every configuration of one that finished
runs of this model in the index used. Their predicted time is the mean step over the run (syncs amortized,
commlab/lab/strategy/perfmodel/local.py); their penalty is only ever measured (steps to accuracy against DDP's, both
runs of this model in the index) or declared (``--penalty diloco=1.2``): a method without either is listed but
never chosen, since how many more steps a method needs depends on the model, H and the optimizer far more than a
compressor's does. Methods are not tried in trials (a trial's few steps would not span a sync period), and
``strategy: auto`` does not plan them (``methods=False``).

The penalty and where it comes from: commlab.lab.strategy.penalty.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from commlab.engine.spec import SpecError
from commlab.lab.base.errors import LabError
from commlab.lab.strategy.penalty import (benchmark_cells, ddp_steps_to, evidence_words, method_penalty, penalty,
                                          strategy_cells)
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import whatif
from commlab.lab.strategy.perfmodel.calibrate import CalibrationError
from commlab.lab.strategy import totarget
from commlab.lab.strategy.predictions import (cluster_of, compute_of, link_of, network_for, network_words,
                                              predict_candidate)
from commlab.lab.strategy.space import Candidate, add_note, is_ddp, load_spec_dict, space, with_strategy
from commlab.lab.strategy.trials import (DDP_MARGIN, TRIAL_WARMUP, ddp_left_out, measured_ms, prepare_session, session_spec,
                                 session_trials, trial_picks, trial_spec, with_search_cost)

TRIALS = 3
"""Candidates tried by prediction (one per compressor); DDP is tried besides them when
commlab.lab.strategy.trials.DDP_MARGIN says."""
TRIAL_STEPS = 8
"""Timed steps per trial (after commlab.lab.strategy.trials.TRIAL_WARMUP)."""
MERGECOMP_MARGIN = 2.0
"""MergeComp is predicted for a compressor only when that compressor's best fixed layout is within this
factor of the best candidate (see ``advise``)."""
DDP_HOLD = 1.03
"""Measured, a winner must score more than this factor better than DDP, or DDP is chosen: trials of 8 steps
scatter by several percent here (the transformer at a shaped 10 Gbit/s: bf16 under dear won its trial by 1.3%
and ran 4.9% slower than DDP in the grid), so a win inside the noise goes to the safe reference. It costs at
most 3% against the true best."""


@dataclass
class Advice:
    spec: dict
    network: dict
    world: int
    candidates: List[Candidate]
    winner: Candidate
    chosen_by: str
    """"predicted" or "measured\""""
    link_source: str
    profile_source: str
    cost_s: Dict[str, float] = field(default_factory=dict)
    """the advisor's own cost: profile, predict, trials, total (wall seconds)"""
    reason: str = ""
    profile: object = None
    """the calibrated profile the predictions came from (not recorded)"""
    disturbance: Dict[str, dict] = field(default_factory=dict)
    """what other processes did to the timings the advice rests on (commlab.lab.strategy.perfmodel.calibrate.disturbance_of):
    ``profile``, the run the compute profile was calibrated from, and ``trials``, the trial session"""
    ddp_not_tried: str = ""
    """with trials: why DDP was not among them (commlab.lab.strategy.trials.ddp_left_out); "" when it was"""
    target: Optional[float] = None
    """the held-out accuracy the advice counts steps to (the user's; None: a fraction of DDP's best)"""
    ddp_steps: Optional[Tuple[int, float, str]] = None
    """DDP's steps to the target on this model, the accuracy counted to and the run
    (commlab.lab.strategy.penalty.ddp_steps_to); None without a DDP run of the model"""

    def to_target_s(self, c: Candidate, measured: bool = False) -> Optional[float]:
        """Seconds to the target: a to-target trial's measurement, else DDP's steps to it x penalty x
        iteration time (predicted, or ``measured``); None when DDP's steps are not known."""
        if c.to_target and c.to_target.get("seconds") is not None:
            return c.to_target["seconds"]
        score = c.measured_score if measured else c.predicted_score
        if score is None or not self.ddp_steps or not self.ddp_steps[0]:
            return None
        return score * self.ddp_steps[0] / 1e3

    def disturbed(self) -> List[str]:
        """One line per disturbed run the advice rests on (the trial session first); [] when none was."""
        out = []
        for what in ("trials", "profile"):
            note = cal.disturbed_note(self.disturbance.get(what))
            if note:
                out.append(("the trial session: " if what == "trials" else "the compute profile's run: ") + note)
        return out

    def ranked(self) -> List[Candidate]:
        return rank(self.candidates)

    def winner_spec(self) -> dict:
        s = with_strategy(self.spec, self.winner.strategy())
        s["network"] = dict(self.network)
        s["world_size"] = self.world
        return load_spec_dict(s)

    def as_dict(self) -> dict:
        ring = cluster_of(self.network)
        return {"network": self.network, "world": self.world, "chosen_by": self.chosen_by,
                "cluster": ring.summary() if ring is not None else None,
                "winner": self.winner.label, "reason": self.reason, "link_source": self.link_source,
                "profile_source": self.profile_source, "cost_s": self.cost_s,
                "disturbed": self.disturbed(), "disturbance": self.disturbance, "ddp_not_tried": self.ddp_not_tried,
                "target": self.target, "ddp_steps_to_target": self.ddp_steps,
                "candidates": [dict(c.as_dict(), predicted_to_target_s=self.to_target_s(c)) for c in self.ranked()],
                "strategy": self.winner.strategy()}


def rank(cands: List[Candidate]) -> List[Candidate]:
    """Candidates whose penalty is evidence for this model first (``Candidate.proven``: measured on it,
    declared, the reference or a cast), then the unproven (a benchmark on another model, the advisor's
    default); within each, measured candidates first (by measured score), then the rest by predicted score;
    left-out last. A lossy candidate without evidence never outranks one with it."""
    inf = float("inf")
    return sorted(cands, key=lambda c: (c.penalty is None, not c.proven, c.measured_score is None,
                                        c.measured_score or inf,
                                        c.predicted_score if c.predicted_score is not None else inf))


def keep_curves(spec: dict, runs=None) -> Tuple[int, float]:
    """Measure the cost curves of every compressor in ``spec``'s strategy space that this machine has not
    measured yet and keep them for the machine (``commlab.lab.base.paths.CURVES``), as the first advice on a machine does;
    returns how many were measured and the seconds it took."""
    t = time.perf_counter()
    scratch = cal.Profile(model=spec["model"]["name"], dataset=spec["dataset"]["name"], batch_size=spec["batch_size"])
    n = whatif.ensure_curves(scratch, [{**spec, **c.strategy()} for c in space(spec, runs=runs) if not c.excluded],
                             runs, kept=True)
    return n, time.perf_counter() - t


def advise(spec: dict, runs=None, gbps: Optional[float] = None, link: Optional[str] = None,
           workers: Optional[int] = None, measure: bool = False, trials: int = TRIALS,
           trial_steps: int = TRIAL_STEPS, penalties: Optional[Dict[str, float]] = None,
           runner: Optional[Callable[[dict], object]] = None, profile=None,
           say: Callable[[str], None] = print, candidates: List[dict] = (), methods: bool = True,
           target: Optional[float] = None, to_target: bool = False, target_steps: Optional[int] = None,
           cluster: Optional[str] = None) -> Advice:
    """Rank the strategy space for ``spec`` (a fully defaulted spec dict) on a link; see the module docstring.
    ``candidates``: more compressor sections (full form, checked) to rank beside the built-in space;
    ``methods``: rank the methods that communicate less often too (``method_space``); ``target``: the
    held-out accuracy steps are counted to (default: a fraction of DDP's best); with ``measure``,
    ``to_target`` runs the to-target trials (commlab.lab.strategy.totarget, at most ``target_steps`` steps
    each) instead of the iteration-time session; ``cluster``: a cluster preset to plan for (``--cluster``;
    commlab.lab.strategy.predictions.network_for says where a cluster comes from otherwise)."""
    if target is not None and not 0 < target <= 1:
        raise SpecError("--target", f"must be a held-out accuracy in (0, 1], got {target}")
    if workers is not None and not 1 <= workers <= 1024:
        raise SpecError("--workers", f"must be in 1..1024, got {workers}")
    if not 1 <= trials <= 20:
        raise SpecError("--trials", f"must be in 1..20, got {trials}")
    if not 4 <= trial_steps <= 1000:
        raise SpecError("--trial-steps", f"must be in 4..1000, got {trial_steps}")
    world = workers or spec["world_size"]
    net = network_for(spec, gbps, link, cluster, world)
    t0 = time.perf_counter()
    cands = space(spec, candidates, runs, methods)
    run_trial = runner
    if measure and run_trial is None:
        raise LabError("advise: measuring the close candidates needs runner= (commlab.lab.service.queue.Lab(runs).runner())")
    try:
        prof = profile or whatif.resolve_profile(spec, runs, say=say, runner=run_trial)
        if whatif.ensure_curves(prof, [{**spec, **c.strategy()} for c in cands if not c.excluded], runs, kept=True):
            say("advisor: measured the candidates' encode/decode cost curves")
            if profile is None:
                prof.save(whatif.profile_file(runs, prof.key()))
    except CalibrationError as e:
        raise LabError(str(e)) from None
    t1 = time.perf_counter()
    known = len(prof.payloads)
    lk, link_source = link_of(prof, net, runs)
    pprof = compute_of(prof, net)  # on a cluster, the slowest worker's compute
    set_penalties(spec, cands, runs, penalties, target)
    # MergeComp's search is predicted (dozens of layouts each) only for compressors whose best fixed layout
    # is within MERGECOMP_MARGIN of the best candidate: a fusion search does not make up a larger gap
    for c in cands:
        if c.schedule["name"] != "mergecomp" and not c.excluded:
            predict_candidate(pprof, spec, c, lk, world)
    fixed = [c.predicted_score for c in cands if c.predicted_score is not None]
    for c in cands:
        if c.schedule["name"] != "mergecomp" or c.penalty is None:
            continue
        mine = [o.predicted_score for o in cands if o.compressor == c.compressor and o.predicted_score is not None]
        if fixed and mine and min(mine) > MERGECOMP_MARGIN * min(fixed):
            c.note = (f"not predicted: its compressor's best fixed layout is {min(mine) / min(fixed):.2f}x the best "
                      f"candidate's (more than {MERGECOMP_MARGIN:g}x)")
            continue
        predict_candidate(pprof, spec, c, lk, world)
    if profile is None and len(prof.payloads) > known:  # the payloads driven here, for the next prediction
        prof.save(whatif.profile_file(runs, prof.key()))
    t2 = time.perf_counter()
    ranked = rank(cands)
    if ranked[0].predicted_score is None:
        raise LabError("advisor: no candidate could be ranked (every compressor was left out)")
    adv = Advice(spec=spec, network=net, world=world, candidates=cands, winner=ranked[0], chosen_by="predicted",
                 link_source=link_source, profile_source=prof.source,
                 cost_s={"profile": t1 - t0, "predict": t2 - t1, "trials": 0.0, "total": t2 - t0}, profile=prof,
                 target=target, ddp_steps=ddp_steps_to(spec, runs, target) if runs is not None else None)
    if prof.disturbance:
        adv.disturbance["profile"] = prof.disturbance
    if measure and to_target:
        totarget.measure(adv, trials, run_trial, say, lambda: assign_penalties(adv, runs, penalties), totarget.HOLD,
                         target_steps)
        adv.cost_s.update(trials=time.perf_counter() - t2, total=time.perf_counter() - t0)
    elif measure:
        measure_in_session(adv, trial_picks(ranked, trials), trial_steps, run_trial, say)
        adv.cost_s.update(trials=time.perf_counter() - t2, total=time.perf_counter() - t0)
        for c in cands:
            if c.local and c.predicted_score is not None:
                add_note(c, f"not tried: {trial_steps} trial steps do not span its sync period, and a measured "
                            "choice is made among the tried")
    adv.reason = explain(adv)
    return adv


def set_penalties(spec: dict, cands: List[Candidate], runs, declared: Optional[Dict[str, float]] = None,
                  target: Optional[float] = None) -> None:
    """Every candidate's penalty and its source (commlab.lab.strategy.penalty), one lookup per compressor
    section and comm mode."""
    cells, strategies = benchmark_cells(), strategy_cells()
    pens: Dict[Tuple[str, str], Tuple[Optional[float], str]] = {}
    for c in cands:
        if c.excluded:  # listed, neither costed nor ranked
            continue
        if c.local:
            c.penalty, c.penalty_source = method_penalty(spec, c.method, runs, declared, target)
            continue
        k = (json.dumps(c.compressor, sort_keys=True), c.comm["mode"])
        if k not in pens:
            pens[k] = penalty(spec, c.compressor, runs, declared, cells, c.comm["mode"], strategies, target)
        c.penalty, c.penalty_source = pens[k]


def assign_penalties(adv: "Advice", runs, declared: Optional[Dict[str, float]] = None) -> None:
    """``set_penalties`` again, at the advice's target (after to-target trials added runs to the index)."""
    set_penalties(adv.spec, adv.candidates, runs, declared, adv.target)


def measure_in_session(adv: "Advice", picks: List[Candidate], trial_steps: int, run_trial, say) -> None:
    """``--measure`` apart from any run: one trial session (a run of its own) of ``picks``; their measured
    figures go into the candidates, and the winner is re-chosen by measurement. Why DDP is not among the picks
    (``ddp_not_tried``) and what other processes did to the session (``disturbance["trials"]``) are recorded
    with them."""
    net, world, prof = adv.network, adv.world, adv.profile
    adv.ddp_not_tried = ddp_left_out(rank(adv.candidates), picks)
    if adv.ddp_not_tried:
        add_note(next(c for c in adv.candidates if is_ddp(c)), adv.ddp_not_tried)
    specs = [trial_spec({**adv.spec, "network": net, "world_size": world}, c, trial_steps) for c in picks]
    say(f"advisor: one session of {len(picks)} trials, {TRIAL_WARMUP} + {trial_steps} steps each, "
        f"{network_words(net)}: " + "; ".join(c.label for c in picks))
    session = run_trial(session_spec(specs), prepare=lambda r: prepare_session(r, specs, picks, prof))
    adv.disturbance["trials"] = cal.disturbance_of(session)
    note = cal.disturbed_note(adv.disturbance["trials"])
    if note:
        say(f"advisor: the trial session {note}")
    if session.state != "done":
        for c in picks:
            add_note(c, f"trial session {session.id} ended {session.state}")
    else:
        for c, t in zip(picks, session_trials(session)):
            c.trial_run = t.id
            ms, extra = measured_ms(t, skip=TRIAL_WARMUP)
            if ms is not None:
                ms, more = with_search_cost(c, ms)
                extra = "; ".join(x for x in (extra, more) if x)
            c.measured_ms = ms
            if extra:
                add_note(c, extra)
    rechoose(adv)


def rechoose(adv: "Advice") -> None:
    """The winner by measurement where any candidate was measured; DDP, when measured, unless the best
    measured beats it by more than ``DDP_HOLD``."""
    from commlab.engine.trials import choose  # the rule the in-run trials use
    ranked = rank(adv.candidates)
    adv.winner = ranked[0]
    measured = [c for c in ranked if c.measured_score is not None and c.proven]
    if measured:
        adv.chosen_by = "measured"
        w, _ = choose([c.measured_score for c in measured],
                      {"trials": [{"reference": is_ddp(c)} for c in measured], "hold_margin": DDP_HOLD})
        adv.winner = measured[w]


def disturbed_flag(adv: Advice) -> str:
    """The words that go first in the reason when a run the advice rests on was disturbed: a measured winner
    from a disturbed trial session is not a result, nor a prediction from a disturbed run's compute; ""
    otherwise."""
    out = []
    trials = adv.disturbance.get("trials")
    if adv.chosen_by == "measured" and cal.disturbed_note(trials):
        out.append(f"{cal.NOT_RESULTS} (trial session {trials['run']}: {short_text(trials)})")
    prof = adv.disturbance.get("profile")
    if cal.disturbed_note(prof):
        out.append(f"predictions from compute timed in a disturbed run, not a result (run {prof['run']}: "
                   f"{short_text(prof)})")
    return "; ".join(out)


def short_text(d: dict) -> str:
    text = d.get("text", "")
    return text[len("yes: "):] if text.startswith("yes: ") else text


def explain(adv: Advice) -> str:
    """Why the winner won, in one or two sentences, against DDP's configuration (measured when it was tried;
    else its prediction, and why it was not tried) and the runner-up; first, when the trial session or the run
    the profile came from was disturbed by other processes, that its timings are not results
    (``disturbed_flag``)."""
    flag = disturbed_flag(adv)
    return f"{flag}; {_explain(adv)}" if flag else _explain(adv)


def _explain_to_target(adv: Advice) -> str:
    """The winner of to-target trials, in their own figures: seconds and steps to the target against DDP's."""
    w, goal = adv.winner, adv.target
    done = sorted((c for c in adv.candidates if c.to_target and c.to_target["seconds"] is not None),
                  key=lambda c: c.to_target["seconds"])
    ddp = next((c for c in adv.candidates if is_ddp(c) and c.to_target), None)

    def said(c):
        return f"{c.to_target['seconds']:.1f} s, {c.to_target['steps']} steps"
    if is_ddp(w):
        low = done[0] if done else w
        if low is not w:
            return (f"DDP held: reached {goal:.1%} held out in {said(w)}; the best trial, {low.label} ({said(low)}), "
                    f"beats it by {w.to_target['seconds'] / low.to_target['seconds'] - 1:.1%}, less than the "
                    f"{totarget.HOLD - 1:.0%} a to-target win must have over DDP (one run each scatters by 10-20%)")
        return f"DDP reached {goal:.1%} held out first ({said(w)}) in the to-target trials on this link"
    parts = [f"{w.label} reached {goal:.1%} held out soonest in the to-target trials on this link ({said(w)})"]
    if ddp is not None and ddp.to_target["seconds"]:
        parts.append(f"{ddp.to_target['seconds'] / w.to_target['seconds']:.2f}x sooner than DDP ({said(ddp)})")
    rest = [c for c in done if c is not w and not is_ddp(c)]
    if rest:
        parts.append(f"runner-up {rest[0].label} ({said(rest[0])})")
    missed = [c.label for c in adv.candidates if c.to_target and not c.to_target["reached"]]
    if missed:
        parts.append("did not reach it within their trials: " + ", ".join(missed))
    return "; ".join(parts)


def _explain(adv: Advice) -> str:
    if adv.chosen_by == "measured to target":
        return _explain_to_target(adv)
    r = adv.ranked()
    w = adv.winner
    key = "measured_score" if adv.chosen_by == "measured" else "predicted_score"
    what = "measured" if adv.chosen_by == "measured" else "predicted"
    ddp = next((c for c in adv.candidates if is_ddp(c)), None)
    low = min((c for c in adv.candidates if getattr(c, key) is not None), key=lambda c: getattr(c, key), default=w)
    if adv.chosen_by == "measured" and low is not w and is_ddp(w):
        return (f"DDP held: the best measured, {low.label} at {low.measured_score:.1f} ms per step-equivalent, "
                f"beats DDP's {w.measured_score:.1f} ms by {w.measured_score / low.measured_score - 1:.1%}, less "
                f"than the {DDP_HOLD - 1:.0%} a measured win must have over DDP")
    parts = [f"{w.label} has the lowest {what} time to accuracy, {getattr(w, key):.1f} ms per step-equivalent "
             f"(iteration {w.measured_ms if adv.chosen_by == 'measured' else w.predicted_ms:.1f} ms x penalty "
             f"{w.penalty:g}, {evidence_words(w.penalty_source)})"]
    secs = adv.to_target_s(w, adv.chosen_by == "measured")
    if secs is not None:
        parts[0] += f", about {secs:.0f} s to {adv.ddp_steps[1]:.1%} held out"
    if ddp is not None and ddp is not w and getattr(ddp, key) is not None:
        parts.append(f"{getattr(ddp, key) / getattr(w, key):.2f}x DDP's ({ddp.label}: {getattr(ddp, key):.1f} ms)")
    elif (ddp is not None and ddp is not w and adv.chosen_by == "measured" and ddp.predicted_score is not None
          and w.predicted_score):
        tried = "not tried" if adv.ddp_not_tried else "tried, no measurement"
        rule = f", more than the {DDP_MARGIN:g}x DDP is tried within" if adv.ddp_not_tried else ""
        parts.append(f"DDP {tried}: predicted {ddp.predicted_score:.1f} ms per step-equivalent, "
                     f"{ddp.predicted_score / w.predicted_score:.2f}x the winner's prediction{rule}")
    rest = [c for c in r if c is not w and getattr(c, key) is not None and c.proven]
    if rest:
        parts.append(f"runner-up {rest[0].label} at {getattr(rest[0], key):.1f} ms")
    faster = [c for c in r if not c.proven and c.predicted_score is not None and w.predicted_score is not None
              and c.predicted_score < w.predicted_score]
    if faster:
        f = min(faster, key=lambda c: c.predicted_score)
        parts.append(f"not chosen though predicted faster: {f.label} ({f.predicted_score:.1f} ms per step-equivalent "
                     f"if it needed {f.penalty:g}x DDP's steps), {evidence_words(f.penalty_source)}; "
                     f"--measure tries it to the target beside DDP")
    return "; ".join(parts)


def format_table(adv: Advice, limit: Optional[int] = None) -> List[str]:
    """The ranking, the first ``limit`` rows (all without one), and the methods below them: a method without
    a penalty is never chosen, and its row says why; under it, a ``DISTURBED:`` line for each run the advice
    rests on that other processes disturbed (``Advice.disturbed``)."""
    head = ("#", "CANDIDATE", "PRED ms", "PENALTY", "PRED x PEN", "MEAS ms", "MEAS x PEN", "TO TARGET s",
            "PENALTY FROM", "EVIDENCE")
    rows = [head]
    ranked = adv.ranked()
    shown = [(i, c) for i, c in enumerate(ranked, 1) if not limit or i <= limit or c.local]
    for i, c in shown:
        f = (lambda v: f"{v:.1f}" if v is not None else "-")
        secs = adv.to_target_s(c, c.measured_score is not None)
        rows.append((str(i), c.label, f(c.predicted_ms), f"{c.penalty:g}" if c.penalty is not None else "out",
                     f(c.predicted_score), f(c.measured_ms), f(c.measured_score), f(secs),
                     c.penalty_source.split(":")[0], evidence_words(c.penalty_source)))
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(wi) if i in (1, 8, 9) else c.rjust(wi) for i, (c, wi) in enumerate(zip(r, w))).rstrip()
             for r in rows]
    if adv.ddp_steps:
        steps, acc, run = adv.ddp_steps
        lines.append(f"TO TARGET: to {acc:.1%} held out, DDP's {steps} steps (run {run}) x penalty x iteration time"
                     + ("; a to-target trial's own measurement where it ran one" if any(c.to_target for c in ranked)
                        else ""))
    return lines + [f"DISTURBED: {line}" for line in adv.disturbed()]
