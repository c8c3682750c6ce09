"""``strategy: auto``: the advisor (commlab/lab/strategy/advisor.py) run for a queued run in its slot, and its record.

The run's supervisor calls ``resolve_auto`` before any rank starts. With ``measure`` and room in the run, the
picks become the run's own first steps (``plan_in_run`` writes commlab/engine/trials.py's plan; after the run
``keep_record`` folds the ranks' measurements in, ``fold_in_run``); else a trial session runs before it, or
the prediction decides, and the choice is written into spec.json at once. The record lives in tuning.json
under ``RECORD_KEY``. The constants of the trials in the run (``TRIAL_LEAD_IN``, the runoff, abort and stop
rules) are here, in the plan that carries them to the ranks (``plan_shape``).
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Callable, Dict, List, Optional

from commlab.engine import runfiles
from commlab.engine.runfiles import FINAL
from commlab.engine.runlog import read_jsonl, write_json_atomic
from commlab.engine.timeline import LANES
from commlab.lab.base import procs
from commlab.lab.base.errors import LabError
from commlab.lab.base.specs import load_spec
from commlab.lab.rundir.launcher import launch
from commlab.lab.rundir.store import strategy_note
from commlab.lab.strategy.advisor import DDP_HOLD, Advice, advise, explain, measure_in_session
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import whatif
from commlab.lab.strategy.space import Candidate, add_note, is_ddp, with_strategy
from commlab.lab.strategy.trials import (TRIAL_WARMUP, compressing_at_once, search_extra_ms, session_trials, trial_picks,
                                 with_search_cost)

RECORD_KEY = "advisor"
"""tuning.json's key for the advisor's record (an engine tuner of the chosen strategy writes the rest)."""
PROFILE_STEPS = 8
"""Dry steps the run's ranks take to profile the model when the lab has no profile of it (commlab/engine/autoprofile.py):
the first SKIP_STEPS (3) are left out of the medians, the other 5 on each rank are the profile."""
PLAN_TIMEOUT_S = 600
"""How long the ranks wait for the plan after their profile steps before they fail the run."""
TRIAL_LEAD_IN = 3
"""Trials in the run: more warm-up steps before the first trial. A fresh process's first steps run slow (the
best-predicted candidate, tried first, measured 10-75% above its later pace on the shaped-link benchmark)."""
RUNOFF_WITHIN = 1.10
"""Trials in the run: every trial scoring within ``RUNOFF_WITHIN`` of the best trains its timed steps again,
in reverse order, and is scored on all its timed steps (one visit's median scattered by 15% from the same
configuration's steady pace; close calls were decided by that scatter). Their cost to the run is small: they
train at close to the winner's pace."""
ABORT_AFTER = 3
ABORT_RATIO = 1.25
"""Trials in the run: a candidate whose first ``ABORT_AFTER`` timed steps score more than ``ABORT_RATIO`` times
the best trial's so far stops there (its remaining steps would only cost the run time)."""
STOP_RATIO = 3.0
"""Trials in the run: a candidate stops at once, warm-up steps included, when even its fastest step so far scores
more than ``STOP_RATIO`` times the best trial's (on a 0.1 Gbit/s link int8's 5 steps at 5x PowerSGD's pace were
most of the trials' cost). Generous: a new communicator's first steps ran up to 1.8x its median here."""
REFERENCE_WITHIN = 1.25
"""In-run trials: DDP, when tried, trains again in the runoff whenever its score is within this factor of the
best (the close candidates' factor is RUNOFF_WITHIN): the hold (commlab.lab.strategy.advisor.DDP_HOLD) compares against
DDP, so DDP is measured as often as the candidates it is held against. Up to ABORT_RATIO, where a trial counts as
clearly slower."""


def plan_shape(n: int, trial_steps: int, lead_in: int = TRIAL_LEAD_IN) -> dict:
    """The step counts of a plan of ``n`` trials (what ``commlab.engine.trials.most_steps`` reads)."""
    return {"warmup": TRIAL_WARMUP, "steps": trial_steps, "lead_in": lead_in, "abort_after": ABORT_AFTER,
            "abort_ratio": ABORT_RATIO, "stop_ratio": STOP_RATIO, "hold_margin": DDP_HOLD,
            "runoff_within": RUNOFF_WITHIN, "reference_within": REFERENCE_WITHIN, "runoff_steps": trial_steps,
            "trials": [None] * n}


def plan_in_run(adv: Advice, picks: List[Candidate], trial_steps: int, lead_in: int = TRIAL_LEAD_IN) -> dict:
    """strategy auto's trials as the run's own first steps (commlab/engine/trials.py reads this plan): per pick,
    best-predicted first, the run's spec with its strategy (PowerSGD compressing at once), the spec the run
    goes on with if it wins, its penalty and, for MergeComp, the predicted partition and its search's
    predicted cost per step. ``lead_in``: 0 once the ranks have warmed up in their profile steps."""
    base = {**adv.spec, "network": dict(adv.network), "world_size": adv.world}
    order = [n for n, _ in adv.profile.params] if adv.profile is not None else None
    trials = []
    for c in picks:
        t = {"label": c.label, "spec": with_strategy(base, compressing_at_once(c)),
             "final": with_strategy(base, c.strategy()), "penalty": c.penalty, "extra_ms": search_extra_ms(c)}
        if c.schedule["name"] == "mergecomp" and c.layout_cuts is not None and order is not None:
            t["layout"] = {"order": order, "cuts": c.layout_cuts}
        if is_ddp(c):
            t["reference"] = True  # DDP holds unless beaten by more than hold_margin
        trials.append(t)
    return {**plan_shape(len(trials), trial_steps, lead_in), "trials": trials}


def fold_in_run(run, record: dict) -> dict:
    """The record of an in-run choice with the ranks' measurements (commlab/engine/trials.py's auto-result.json)
    folded in: each trial's measured median (MergeComp's predicted search cost added, as ``with_search_cost``
    does), the winner, the reason, and the trials' cost to the run. The record as it was when the run
    ended before choosing."""
    path = run.file(runfiles.AUTO_RESULT)
    if not path.is_file():
        return record
    res = json.loads(path.read_text())
    names = {f.name for f in dataclasses.fields(Candidate)}
    cands = [Candidate(**{k: v for k, v in c.items() if k in names}) for c in record["candidates"]]
    by_label = {c.label: c for c in cands}
    for r in res["trials"]:
        c = by_label[r["label"]]
        steps = visited_steps(r)
        c.trial_run = f"{run.id} steps {steps}"
        c.measured_ms, more = with_search_cost(c, r["median_ms"])
        add_note(c, "; ".join(x for x in (f"trained as the run's steps {steps}"
                                          + (", stopped early: clearly slower" if r["aborted"] else ""), more) if x))
    cost = dict(record["cost_s"])
    if "plan_wait_s" in res:
        # the ranks profiled the model, then waited while the supervisor built the profile, measured cost
        # curves (``supervisor_profile``) and predicted: what the run lost is their own clock's
        share = min(cost.get("supervisor_profile", 0.0), res["plan_wait_s"])
        cost.update(profile=res["profile_s"] + share, predict=res["plan_wait_s"] - share)
    cost.update(trials=res["cost_s"], total=cost["profile"] + cost["predict"] + res["cost_s"])
    adv = Advice(spec=record.get("spec") or run.spec_dict(), network=record["network"], world=record["world"],
                 candidates=cands, winner=by_label[res["label"]], chosen_by="measured",
                 link_source=record["link_source"], profile_source=record["profile_source"], cost_s=cost)
    adv.reason = explain(adv)
    out = {**record, **adv.as_dict(), "trials_in_run": {k: res[k] for k in ("decided_step", "excess_s", "switch_s",
                                                                           "wall_s", "winner")}}
    out["strategy"] = by_label[res["label"]].strategy()
    return out


def visited_steps(trial: dict) -> str:
    """A trial's steps in the run, as "10-19" or, after a runoff, "10-19, 40-49"."""
    visits = trial.get("visits") or [[trial["first_step"], trial["last_step"]]]
    return ", ".join(f"{a}-{b}" for a, b in visits)


def resolve_auto(lab, run, should_cancel: Callable[[], bool] = lambda: False,
                 say: Callable[[str], None] = print) -> Advice:
    """``strategy: auto``: run the advisor for ``run`` (queued, its supervisor holding a slot), its profile
    run launched directly in that slot. With ``measure``, the trials are the run's own first steps when the
    run has room for them (``plan_in_run``; spec.json then keeps strategy auto until the ranks have chosen),
    else a trial session before it; otherwise the prediction decides. The choice goes into spec.json
    (strategy.decided), the candidates, trials and decision into tuning.json."""
    from commlab.engine import trials as engine_trials
    spec = run.spec_dict()
    st = spec["strategy"]
    # a fault-tolerant run's replicas neither profile nor try candidates in the run: its profiling run and its
    # trial session run before it, without fault tolerance (they measure a step's compute and exchanges)
    ft = spec["fault_tolerance"]["enabled"]
    if st["measure"] and not ft and profile_in_run(spec, lab.root):
        start_profile_in_run(lab, run, say)
        return None
    trials = []

    def runner(s: dict, prepare=None):
        if should_cancel():
            raise LabError("cancelled while the advisor ran its trials")
        # its owner's and under its limits, as the run it advises
        t = lab.store.create(load_spec(data={**s, "fault_tolerance": {"enabled": False}} if ft else s),
                             **run.inherited())
        if prepare is not None:
            prepare(t)
        t.mark_queued(supervisor=procs.identity(), advisor_for=run.id)
        trials.append(t.id)
        launch(t, progress=False, should_cancel=should_cancel)
        return t

    # methods=False: auto plans no method (commlab.engine.spec refuses one)
    adv = advise(spec, runs=lab.root, measure=False, trials=st["trials"], trial_steps=st["trial_steps"],
                 penalties=st["penalties"], runner=runner, say=say, methods=False)
    if st["measure"]:
        picks = trial_picks(adv.ranked(), st["trials"])
        plan = plan_in_run(adv, picks, st["trial_steps"])
        if not ft and engine_trials.most_steps(plan) < spec["steps"]:
            write_json_atomic(run.file(runfiles.AUTO_TRIALS), plan)
            say(f"advisor: {len(picks)} trials as the run's first steps ({TRIAL_WARMUP} + up to "
                f"{st['trial_steps']} steps each): " + "; ".join(c.label for c in picks))
            record = {**adv.as_dict(), "chosen_by": "pending: trials in the run", "runs": trials,
                      "planned_at": time.time()}
            write_record(run, record)
            trial_timeline(run, [lab.store.get(t) for t in trials], {})  # a profiling run, if one ran
            run.note(strategy=strategy_note(None, "trials in the run", adv.cost_s["total"]))
            return adv
        t2 = time.perf_counter()
        measure_in_session(adv, picks, st["trial_steps"], runner, say)
        adv.cost_s.update(trials=time.perf_counter() - t2)
        adv.cost_s["total"] = adv.cost_s["profile"] + adv.cost_s["predict"] + adv.cost_s["trials"]
        adv.reason = explain(adv)
    chosen = adv.winner_spec()
    chosen["name"] = spec["name"]
    write_json_atomic(run.file(runfiles.SPEC), load_spec(data=chosen).to_dict())
    record = {**adv.as_dict(), "runs": trials, "decided_at": time.time()}
    write_record(run, record)
    parts = []
    for t in (lab.store.get(t) for t in trials):  # the profiling run, the trial session's trials
        parts += session_trials(t) if t.file(runfiles.TRIALS).is_file() and t.state == "done" else [t]
    trial_timeline(run, parts, {c.trial_run: c.label for c in adv.candidates})
    run.note(strategy=strategy_note(adv.winner.label, adv.chosen_by, adv.cost_s["total"]))
    return adv




def profile_in_run(spec: dict, runs) -> bool:
    """Whether the run's ranks profile the model themselves: the lab has no profile of it and the run has
    room for the most trials the advisor may pick (``trials`` families and DDP) as its own steps."""
    from commlab.engine import trials as engine_trials
    st = spec["strategy"]
    room = engine_trials.most_steps(plan_shape(st["trials"] + 1, st["trial_steps"], lead_in=0)) < spec["steps"]
    return room and not whatif.has_profile(spec, runs)


def start_profile_in_run(lab, run, say: Callable[[str], None]) -> threading.Thread:
    """Ask the ranks for profile steps (commlab/engine/autoprofile.py) and advise in a thread of the supervisor once
    they are done (``plan_after_profile``); the ranks start meanwhile, so the profile pays no start-up of
    its own."""
    write_json_atomic(run.file(runfiles.AUTO_PENDING), {"profile_steps": PROFILE_STEPS, "timeout_s": PLAN_TIMEOUT_S})
    write_record(run, {"chosen_by": "pending: profile and trials in the run", "runs": [],
                       "requested_at": time.time()})
    run.note(strategy=strategy_note(None, "profile and trials in the run", None))
    say(f"advisor: no profile of the model in the lab; the run's ranks measure it in {PROFILE_STEPS} dry steps "
        "(no exchange, no update), then train the advisor's trials as the run's first steps")
    t = threading.Thread(target=plan_after_profile, args=(lab, run, say), name=f"advisor {run.id}", daemon=True)
    t.start()
    return t


def plan_after_profile(lab, run, say: Callable[[str], None], poll_s: float = 0.005) -> Optional[Advice]:
    """In the supervisor, while the ranks wait: the profile from their dry steps (kept in the lab for the
    next advice), the advisor's predictions, and the trial plan the ranks go on with. Any failure is written
    to ``auto-failed.json``, which makes the ranks fail the run with it; a run that ends before its profile
    steps are done ends this too. Returns the advice, None when there was none."""
    from commlab.engine import trials as engine_trials
    try:
        spec = run.spec_dict()
        st = spec["strategy"]
        done, k = run.file(runfiles.AUTO_PROFILED), 0
        while not done.is_file():
            k += 1
            if k % 40 == 0 and run.state in FINAL:
                return None
            time.sleep(poll_s)
        t0 = time.perf_counter()
        info = json.loads(done.read_text())
        n = int(info["steps"])
        events = [e for p in sorted(run.path.glob(runfiles.PROFILE_TIMELINES)) for e in read_jsonl(str(p))]
        prof = cal.from_events(spec, events, f"run {run.id} (its ranks' {n} dry profile steps)",
                               skip=min(cal.SKIP_STEPS, n - 2), params=info.get("params"))
        prof.machine = whatif.machine_info(run, n)
        built_s = time.perf_counter() - t0
        adv = advise(spec, runs=lab.root, measure=False, trials=st["trials"], trial_steps=st["trial_steps"],
                     penalties=st["penalties"], profile=prof, say=say, methods=False)
        prof.save(whatif.profile_file(lab.root, prof.key()))  # with its cost curves and payloads
        picks = trial_picks(adv.ranked(), st["trials"])
        # no lead-in: the dry steps took the fresh process's slow first steps (after them, the first trial's
        # first steps ran at its later pace: 50, 46, 48 ms against a median of 48 on resnet)
        plan = plan_in_run(adv, picks, st["trial_steps"], lead_in=0)
        if engine_trials.most_steps(plan) >= spec["steps"]:
            raise LabError(f"the trials take up to {engine_trials.most_steps(plan)} steps; the run has "
                           f"{spec['steps']}")
        # the ranks' dry steps and their wait are folded in from their own clock after the run (fold_in_run)
        adv.cost_s.update(profile=info["wall_s"] + built_s + adv.cost_s["profile"],
                          supervisor_profile=built_s + adv.cost_s["profile"])
        adv.cost_s["total"] = adv.cost_s["profile"] + adv.cost_s["predict"]
        record = {**adv.as_dict(), "chosen_by": "pending: trials in the run", "runs": [],
                  "profile_in_run": info, "planned_at": time.time()}
        write_json_atomic(run.file(runfiles.AUTO_ADVICE), record)
        write_record(run, record)
        write_json_atomic(run.file(runfiles.AUTO_TRIALS), plan)  # the ranks go on
        run.note(strategy=strategy_note(None, "trials in the run", adv.cost_s["total"]))
        say(f"advisor: profiled in the run ({info['wall_s']:.2f} s); {len(picks)} trials as the run's first steps: "
            + "; ".join(c.label for c in picks))
        return adv
    except BaseException as e:
        msg = f"{type(e).__name__}: {e}".splitlines()[0]
        write_json_atomic(run.file(runfiles.AUTO_FAILED), {"error": msg, "t": time.time()})
        say(f"advisor: failed after the profile steps: {msg}")
        return None


def trial_timeline(run, trials, labels: Dict[str, str]) -> int:
    """Append the advisor's runs (the profiling run, the trials) to ``run``'s timeline-rank0.jsonl before its
    ranks start: each one's step spans (rank 0) on a lane of their own, so the run's trace shows what the
    choice cost and when. The engine's timeline opens the file for appending; the lab's step and lane
    readers skip the lane. Returns the spans written."""
    lines = []
    for t in trials:
        what = labels.get(t.id, "profile")
        for e in t.timeline_events():
            if e.get("pid") == 0 and e.get("tid") == LANES["step"]:
                step = (e.get("args") or {}).get("step")
                lines.append(json.dumps({"ph": "X", "name": f"{what}: step {step}", "pid": 0,
                                         "tid": LANES["advisor"], "cat": "advisor", "ts": e["ts"], "dur": e["dur"],
                                         "args": {"run": t.id, "step": step, "trial": what}}))
    if lines:
        with open(run.file(runfiles.TIMELINE.format(rank=0)), "a") as f:
            f.write("\n".join(lines) + "\n")
    return len(lines)


def write_record(run, record: dict) -> None:
    """Put the advisor's record into tuning.json, keeping whatever else is there."""
    path = run.file(runfiles.TUNING)
    info = json.loads(path.read_text()) if path.is_file() else {}
    info[RECORD_KEY] = record
    write_json_atomic(path, info)


def keep_record(run, record: Optional[dict]) -> None:
    """After the run: an engine tuner (mergecomp, layerfusion) writes tuning.json whole; put the
    advisor's record back if it was replaced. Trials in the run: their measurements and the decision
    are folded in (``fold_in_run``) and the run's status says what was chosen."""
    if record is None:
        return
    path = run.file(runfiles.TUNING)
    info = json.loads(path.read_text()) if path.is_file() else {}
    current = info.get(RECORD_KEY) or record
    if str(current.get("chosen_by", "")).startswith("pending: profile") and run.file(runfiles.AUTO_ADVICE).is_file():
        current = json.loads(run.file(runfiles.AUTO_ADVICE).read_text())  # planned in the run (plan_after_profile)
    if str(current.get("chosen_by", "")).startswith("pending"):
        folded = fold_in_run(run, current)
        if folded is not current:
            write_record(run, folded)
            run.note(strategy=strategy_note(folded["winner"], "measured in the run", folded["cost_s"]["total"]))
            return
    if RECORD_KEY not in info:
        write_record(run, current)


def read_record(run) -> Optional[dict]:
    path = run.file(runfiles.TUNING)
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(RECORD_KEY)


