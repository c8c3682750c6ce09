"""A preset's (or a sweep's) group of runs, and the answer its runs give.

A group is a small JSON file, ``runs/groups/<id>.json``: the preset it came from and its runs by variant
label. ``evaluate`` turns the runs' own measurements into a verdict: each effect's ratio of median
iteration times against its bound, the accuracy of every variant against the reference and a useful
floor, bytes and compression as sent, the step-time breakdown, and the whole group's wall time. Nothing
here is hard-coded: a verdict line is a formatted measurement, and an effect that misses its bound is
explained from the two runs' breakdowns (which part of the step grew).

The app's results page, bench/presets.py and the tests all read verdicts from here.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from commlab.engine.runfiles import FINAL
from commlab.engine.runlog import write_json_atomic
from commlab.lab.analysis import replicas, timelines
from commlab.lab.analysis.plots import PART_LABELS, PARTS, assign_steps
from commlab.lab.analysis.presets import ACCURACY_POINTS, PRESETS, Effect, Faults, Preset
from commlab.lab.base.paths import GROUPS
from commlab.lab.rundir.disturbance import describe as describe_disturbance
from commlab.lab.rundir.store import check_id
from commlab.lab.rundir.summary import fmt_bytes, iteration_times, summarize, warmup_steps
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import predict as pr
from commlab.lab.strategy.perfmodel.costs import steps_and_wire

# --------------------------------------------------------------------------- groups on disk

def _groups_dir(root) -> Path:
    return Path(root) / GROUPS


def save_group(root, preset_key: str, runs: Dict[str, str], created: Optional[float] = None,
               values: Optional[Dict[str, int]] = None) -> str:
    """Write a group (variant label -> run id, and the preset's knob values it ran with) and return its id
    (the first run's id, which is unique)."""
    if not runs:
        raise ValueError("group: no runs")
    gid = check_id(next(iter(runs.values())))
    d = _groups_dir(root)
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(d / f"{gid}.json", {"id": gid, "preset": preset_key, "runs": runs,
                                          "created": time.time() if created is None else created,
                                          **({"values": values} if values else {})})
    return gid


def load_group(root, gid: str) -> dict:
    path = _groups_dir(root) / f"{check_id(gid)}.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KeyError(f"group: no group {gid!r} in {_groups_dir(root)}") from None
    except ValueError as e:
        raise ValueError(f"group: {path} is not valid JSON ({e})") from None


def list_groups(root) -> List[dict]:
    """Every group, newest first; an unreadable file is reported in its entry, not skipped."""
    out = []
    for p in sorted(_groups_dir(root).glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            out.append(json.loads(p.read_text()))
        except ValueError as e:
            out.append({"id": p.stem, "preset": None, "runs": {}, "error": f"{p.name}: {e}"})
    return out


def preset_of(group: dict) -> Optional[Preset]:
    return next((p for p in PRESETS if p.key == group.get("preset")), None)


# --------------------------------------------------------------------------- the verdict

@dataclass
class Variant:
    label: str
    run_id: str
    state: str
    summary: dict
    breakdown: Dict[str, float]
    """mean step-time breakdown (plots.PARTS and hidden_comm_ms), warm-up left out; {} until measured"""
    disturbance: dict
    collectives: Dict[str, int] = field(default_factory=dict)
    """collective kind -> count in the last measured step (allreduce, allgather, ...), from the timeline"""
    started: Optional[float] = None
    ended: Optional[float] = None
    mean_ms: Optional[float] = None
    """mean iteration time after warm-up (a method's syncs amortized over its local steps)"""
    exchanges: Optional[int] = None
    """steps in which rank 0 sent anything (every step for DDP; a method's syncs)"""
    acc_at: List[Tuple[float, float]] = field(default_factory=list)
    """(seconds of training, held-out accuracy) at each evaluation: the sum of the iteration times before it"""
    ft: dict = field(default_factory=dict)
    """a fault-tolerant run's faults and their cost ({} otherwise): ``kills``, ``recoveries`` (after the start),
    ``rejoin_s`` (each kill to the killed replica's next committed step), ``goodput`` (committed steps per
    second, commlab.lab.analysis.replicas.goodput)"""

    @property
    def iter_ms(self) -> Optional[float]:
        return self.summary.get("iter_ms_median")

    @property
    def acc(self) -> Optional[float]:
        return self.summary.get("final_acc")

    @property
    def final(self) -> bool:
        return self.state in FINAL


@dataclass
class EffectResult:
    effect: Effect
    ratio: Optional[float]
    passed: Optional[bool]
    """None while either run has no timing yet"""
    line: str
    why: str = ""
    """when the bound is missed: which parts of the step account for it, from the timelines"""


@dataclass
class Verdict:
    title: str
    claim: str
    variants: Dict[str, Variant]
    effects: List[EffectResult]
    accuracy: List[str]
    """one line per variant: its accuracy against the reference and the floor"""
    accuracy_ok: Optional[bool]
    lines: List[str]
    """the answer, one sentence per line, computed from the runs"""
    complete: bool
    wall_s: Optional[float]
    """from the group's creation (the click) to the last run's end"""
    disturbed: List[str]
    notes: List[str] = field(default_factory=list)
    fault_checks: List[Optional[bool]] = field(default_factory=list)
    """a plug-pulling preset's: the unprotected run failed, each faulted run finished (None while running)"""
    fault_lines: List[str] = field(default_factory=list)
    """a plug-pulling preset's lines (also in ``lines``): the failure, and each faulted run beside its twin"""

    @property
    def passed(self) -> Optional[bool]:
        if not self.complete:
            return None
        checks = [e.passed for e in self.effects] + [self.accuracy_ok] + self.fault_checks
        return all(c is not False for c in checks) and None not in checks


def _variant(label: str, run, breakdown_fn) -> Variant:
    status = run.status()
    spec = run.spec_dict()
    rows = run.metric_rows()
    s = summarize(rows, spec)
    bd = breakdown_fn(run) if s.get("steps_done", 0) > 2 else {}
    it = iteration_times(rows)
    order = sorted(it)
    timed = order[warmup_steps(len(order)):] or order
    sent = [m for m in rows if m.get("kind") == "step" and m["rank"] == 0]
    evals = sorted((m["step"], m["eval_acc"]) for m in rows if m.get("kind") == "eval")
    ft = {}
    if (spec.get("fault_tolerance") or {}).get("enabled"):
        steps = [m for m in rows if m.get("kind") == "step"]
        back = replicas.rejoins(run.ft_events(), steps)  # one entry per kill
        ft = {"kills": len(back), "recoveries": replicas.after_start(run.recoveries(), steps), "rejoin_s": back,
              "goodput": replicas.goodput(steps)}
    return Variant(label, run.id, status.get("state", "unknown"), s, bd or {},
                   status.get("disturbance") or {}, collective_counts(run) if run.state in FINAL else {},
                   status.get("started"), status.get("ended"),
                   mean_ms=statistics.fmean(it[k] for k in timed) if timed else None,
                   exchanges=sum(1 for m in sent if m.get("bytes_sent")) if sent else None,
                   acc_at=[(sum(ms for k, ms in it.items() if k < step) / 1e3, acc) for step, acc in evals], ft=ft)


def collective_counts(run) -> Dict[str, int]:
    """Which collectives one late step of the run issued, by kind (from rank 0's comm lane)."""
    tl = timelines.tail_timeline(run, 3)
    if tl.empty or "op" not in tl:
        return {}
    df = assign_steps(tl[tl["rank"] == 0])
    comm = df[(df["lane"] == "comm") & df["it"].notna()]
    if comm.empty:
        return {}
    comm = comm[comm["it"] == comm["it"].max()]
    out: Dict[str, int] = {}
    for op in comm["op"].dropna():
        out[str(op)] = out.get(str(op), 0) + 1
    return out


MEASURED = {"iteration": (lambda x: x.iter_ms, "{:.1f} ms", "per iteration"),
            "step_mean": (lambda x: x.mean_ms, "{:.1f} ms", "per step on average"),
            "exchanges": (lambda x: x.exchanges, "{:.0f}", "steps that exchanged")}
"""An effect's measure (commlab.lab.analysis.presets.MEASURES): how to read it from a variant, its format and unit."""


def _ratio(e: Effect, v: Dict[str, Variant], values: Optional[Dict[str, int]] = None) -> EffectResult:
    fast, slow = v.get(e.faster), v.get(e.slower)
    if fast is None or slow is None:
        return EffectResult(e, None, None, f"{e.text}: variant missing from the group")
    read, fmt, unit = MEASURED[e.measure]
    a, b = read(fast), read(slow)
    if not (a and b):
        return EffectResult(e, None, None, f"{e.text}: waiting for both runs' " +
                            ("timings" if e.measure != "exchanges" else "steps"))
    r = b / a
    at_least, at_most = e.bounds(values or {})
    bound = (f"target at least {at_least:g}x" if at_least is not None else "") + \
            (f"target at most {at_most:g}x" if at_most is not None else "")
    settled = fast.final and slow.final
    ok = (at_least is None or r >= at_least) and (at_most is None or r <= at_most)
    line = (f"{e.text}: {r:.2f}x ({fast.label} {fmt.format(a)} vs {slow.label} {fmt.format(b)} {unit}; "
            f"{bound})" + ("" if settled else " — so far"))
    why = "" if ok or not settled or e.measure == "exchanges" else explain(fast, slow)
    return EffectResult(e, r, ok if settled else None, line, why)


def explain(fast: Variant, slow: Variant) -> str:
    """Which parts of the step account for the difference between two variants, from their timelines."""
    a, b = fast.breakdown, slow.breakdown
    if not a or not b:
        return "no timeline to explain it from (run with timeline: true)"
    diffs = sorted(((a[k] - b[k], k) for k in PARTS), reverse=True)
    parts = ", ".join(f"{PART_LABELS[k]} {a[k]:.1f} vs {b[k]:.1f} ms" for d, k in diffs if abs(d) >= 0.5)
    return (f"per step, {fast.label} against {slow.label}: {parts or 'no part differs by 0.5 ms or more'}; "
            f"hidden (overlapped) communication {a.get('hidden_comm_ms', 0):.1f} vs "
            f"{b.get('hidden_comm_ms', 0):.1f} ms")


def _accuracy(p: Optional[Preset], v: Dict[str, Variant]):
    if p is None or not p.reference or p.reference not in v:
        return [], None
    # a plug-pulling preset holds each faulted run to its fault-free twin (what the fault cost), each twin to itself
    twin = {a: b for pair in p.faults.pairs for a, b in (pair, (pair[1], pair[1]))} if p.faults is not None else {}
    lines, ok = [], True
    for lab_, x in v.items():
        if p.faults is not None and lab_ == p.faults.unprotected:
            lines.append(f"{lab_}: not held to {p.reference} (it has no fault tolerance, so the kill ends it)")
            continue
        ref_label = twin.get(lab_, p.reference)
        ref = v.get(ref_label, v[p.reference])
        if x.acc is None:
            lines.append(f"{lab_}: no held-out accuracy yet")
            ok = None if ok is not False else ok
            continue
        floor_ok = x.acc >= p.accuracy_floor
        rel_ok = ref.acc is None or x.acc >= ref.acc - ACCURACY_POINTS
        note = []
        if not floor_ok:
            note.append(f"below the useful level {p.accuracy_floor:.0%}")
        if not rel_ok:
            note.append(f"more than {ACCURACY_POINTS * 100:.0f} points below {ref_label}")
        if x.state == "diverged":
            note.append("diverged")
        lines.append(f"{lab_}: {x.acc:.1%} held out" + (f" ({'; '.join(note)})" if note else ""))
        if note:
            ok = False
        elif not x.final and ok is True:
            ok = None
    return lines, ok


def evaluate(group: dict, store_get, breakdown_fn=None) -> Verdict:
    """The verdict of ``group`` (see ``save_group``); ``store_get(run_id)`` returns a Run (or raises),
    ``breakdown_fn(run)`` the mean step breakdown (default: timelines.run_breakdown, cached)."""
    if breakdown_fn is None:
        breakdown_fn = timelines.run_breakdown
    p = preset_of(group)
    v: Dict[str, Variant] = {}
    notes = []
    values: Dict[str, int] = {}
    if p is not None:
        try:
            values = p.values(group.get("values"))
        except ValueError as e:
            notes.append(f"the group's knob values cannot be read ({e}); the preset's defaults are used")
            values = p.values()
    for lab_, rid in group["runs"].items():
        try:
            v[lab_] = _variant(lab_, store_get(rid), breakdown_fn)
        except (OSError, ValueError, KeyError) as e:
            notes.append(f"{lab_}: run {rid} cannot be read ({e})")
    effects = [_ratio(e, v, values) for e in (p.effects if p else [])]
    acc_lines, acc_ok = _accuracy(p, v)
    complete = len(v) == len(group["runs"]) and all(x.final for x in v.values())
    ends = [x.ended for x in v.values() if x.ended]
    wall = (max(ends) - group["created"]) if complete and ends and group.get("created") else None
    disturbed = [f"{x.label}: {describe_disturbance(x.disturbance)[1].removeprefix('yes: ')}"
                 for x in v.values() if x.disturbance.get("disturbed")]
    lines = [e.line for e in effects]
    for e in effects:
        if e.why:
            lines.append(f"Why it missed: {e.why}")
    if values:
        lines.append("run with " + ", ".join(f"{k} = {x}" for k, x in values.items()))
    if p is not None and p.exchanges is not None:
        lines += _exchange_lines(v, *p.exchanges)
    lines += _traffic_lines(v)
    if p is not None and p.scaling is not None:
        lines += _scaling_lines(v, *p.scaling)
    fault_checks: List[Optional[bool]] = []
    fault_lines: List[str] = []
    if p is not None and p.faults is not None:
        fault_lines, fault_checks = _fault_lines(v, p.faults)
        lines += fault_lines
    if p is None:
        lines += _sweep_lines(v)
    expected = {p.faults.unprotected} if p is not None and p.faults is not None else set()
    failed = [x.label for x in v.values() if x.state in ("failed", "cancelled", "diverged")
              and not (x.label in expected and x.state == "failed")]
    if failed:
        notes.append(f"not a clean answer: {', '.join(failed)} did not finish ({', '.join(v[f].state for f in failed)})")
    if disturbed:
        notes.append("timings disturbed by other processes (see the flag): rerun on a quiet machine before "
                     "taking the ratios as results")
    return Verdict(p.title if p else group.get("title", group["id"]), p.claim if p else "", v, effects,
                   acc_lines, acc_ok, lines, complete, wall, disturbed, notes, fault_checks, fault_lines)


def _fault_lines(v: Dict[str, Variant], f: Faults) -> Tuple[List[str], List[Optional[bool]]]:
    """The plug pulled: whether the run without fault tolerance failed (it must), and each faulted run beside its
    fault-free twin: kills, recoveries (from whom, bytes, seconds), rejoin time, goodput and accuracy. With the
    checks: the unprotected run failed; each faulted run ended done (None while any runs)."""
    lines: List[str] = []
    checks: List[Optional[bool]] = []
    u = v.get(f.unprotected)
    if u is not None:
        if not u.final:
            checks.append(None)
            lines.append(f"{u.label}: running")
        else:
            checks.append(u.state == "failed")
            at = u.summary.get("steps_done")
            lines.append(f"{u.label}: {u.state} after {at} steps: without fault tolerance a worker's death ends "
                         f"the run, as it ends a torch DDP job" if u.state == "failed" else
                         f"{u.label}: {u.state}, but a worker was to die (its fault did not happen)")
    for faulted, clean in f.pairs:
        a, b = v.get(faulted), v.get(clean)
        if a is None or b is None:
            continue
        checks.append(None if not a.final else a.state == "done")
        if not (a.final and b.final):
            lines.append(f"{faulted}: running")
            continue
        ft = a.ft
        recs = ft.get("recoveries") or []
        line = f"{faulted}: {a.state}; {ft.get('kills', 0)} kill{'s' if ft.get('kills', 0) != 1 else ''}"
        if recs:
            line += "; " + "; ".join(f"replica {r.get('replica')} recovered from replica {r.get('from_replica')}, "
                                     f"{fmt_bytes(r.get('bytes') or 0)} in {r.get('seconds', 0):.2f} s"
                                     for r in recs)
        back = [x for x in ft.get("rejoin_s") or [] if x is not None]
        if back:
            line += f"; back in training {', '.join(f'{x:.1f} s' for x in back)} after the kill"
        ga, gb = ft.get("goodput"), b.ft.get("goodput")
        if ga and gb:
            line += (f"; {ga:.1f} committed steps/s against {gb:.1f} without the fault (goodput "
                     f"{ga / gb:.0%})")
        if a.acc is not None and b.acc is not None:
            line += (f"; {a.acc:.1%} held out against {b.acc:.1%} ({100 * (a.acc - b.acc):+.1f} points)")
        lines.append(line)
    return lines, checks


def _traffic_lines(v: Dict[str, Variant]) -> List[str]:
    out = []
    for x in v.values():
        s = x.summary
        if s.get("bytes_per_step") is None:
            continue
        coll = ", ".join(f"{n} {k}" for k, n in sorted(x.collectives.items()))
        out.append(f"{x.label}: sends {fmt_bytes(s['bytes_per_step'])} per step per rank "
                   f"(compression {s['compression_ratio']:.1f}x)" if s.get("compression_ratio") else
                   f"{x.label}: sends {fmt_bytes(s['bytes_per_step'])} per step per rank")
        if coll:
            out[-1] += f"; collectives per step: {coll}"
        if x.breakdown:
            out[-1] += (f"; exposed communication {x.breakdown.get('exposed_comm_ms', 0):.1f} ms of a "
                        f"{x.breakdown.get('step_ms', 0):.1f} ms step")
    return out


def time_to(x: Variant, acc: float) -> Optional[float]:
    """Seconds of training (the sum of iteration times) until ``x``'s first evaluation at or above ``acc``."""
    return next((t for t, a in x.acc_at if a >= acc), None)


def _exchange_lines(v: Dict[str, Variant], base: str, methods: List[str]) -> List[str]:
    """Each method against the every-step variant: how many steps exchanged and what a step sent on average,
    and the training time each took to reach the every-step variant's final accuracy (less the accuracy
    margin): the claim "the same accuracy with H times fewer exchanges, sooner on a slow link", measured."""
    b = v.get(base)
    if b is None or not b.exchanges:
        return []
    goal = b.acc - ACCURACY_POINTS if b.acc is not None else None
    tb = time_to(b, goal) if goal is not None and b.final else None
    out = []
    for name in methods:
        x = v.get(name)
        if x is None or not x.exchanges:
            continue
        line = (f"{name}: {x.exchanges} steps exchanged against {base}'s {b.exchanges} "
                f"({b.exchanges / x.exchanges:.1f}x fewer)")
        sb, sx = b.summary.get("bytes_per_step"), x.summary.get("bytes_per_step")
        if sb and sx:
            line += f", {fmt_bytes(sx)} per step amortized against {fmt_bytes(sb)} ({sb / sx:.1f}x less)"
        if goal is not None and x.final and b.final:
            tx = time_to(x, goal)
            line += (f"; {goal:.1%} held out (within {ACCURACY_POINTS * 100:.0f} points of {base}'s final) after "
                     + (f"{tx:.1f} s of training against {base}'s {tb:.1f} s ({tb / tx:.2f}x sooner)"
                        if tx and tb else f"{_s(tx)} against {base}'s {_s(tb)}"))
        out.append(line)
    return out


def _s(t: Optional[float]) -> str:
    return "never" if t is None else f"{t:.1f} s"


def _scaling_lines(v: Dict[str, Variant], summed: str, gathered: str) -> List[str]:
    """How each variant's traffic per worker grows with the number of workers, from its measured payload:
    a summable payload is all-reduced (ring: 2(p-1)/p of it per rank), the other all-gathered ((p-1) times
    it per rank). The worker count from which the summed one sends less, if any up to 1024."""
    a, b = v.get(summed), v.get(gathered)
    if a is None or b is None or not a.summary.get("bytes_per_step") or not b.summary.get("bytes_per_step"):
        return []
    na, nb = a.summary["bytes_per_step"], b.summary["bytes_per_step"]
    wire = {p: (steps_and_wire("allreduce", na, p)[1], steps_and_wire("allgather", nb, p)[1])
            for p in (2, 8, 64, 1024)}
    cross = next((p for p in range(2, 1025) if steps_and_wire("allreduce", na, p)[1]
                  < steps_and_wire("allgather", nb, p)[1]), None)
    table = ", ".join(f"{p} workers {fmt_bytes(x)} vs {fmt_bytes(y)}" for p, (x, y) in wire.items())
    return [f"traffic per rank and step as workers grow (ring formulas on the measured payloads), {a.label} "
            f"all-reduced vs {b.label} all-gathered: {table}; "
            + (f"{a.label} sends less from {cross} workers on" if cross else
               f"{a.label} sends more up to 1024 workers")]


def _sweep_lines(v: Dict[str, Variant]) -> List[str]:
    timed = sorted((x for x in v.values() if x.iter_ms), key=lambda x: x.iter_ms)
    if len(timed) < 2:
        return []
    f, s = timed[0], timed[-1]
    return [f"fastest: {f.label} ({f.iter_ms:.1f} ms per iteration), {s.iter_ms / f.iter_ms:.2f}x faster than "
            f"the slowest, {s.label} ({s.iter_ms:.1f} ms)"]


def crossover(group: dict, store_get) -> Optional[str]:
    """The performance model's crossover for a preset that declares one: calibrated on the uncompressed
    run's timeline, with the compressor's cost measured here. A sentence, or None when not applicable."""
    p = preset_of(group)
    if p is None or p.crossover is None:
        return None
    base_label, comp_label = p.crossover
    try:
        base, comp = store_get(group["runs"][base_label]), store_get(group["runs"][comp_label])
    except (KeyError, OSError, ValueError) as e:
        return f"no prediction: {e}"
    if base.state != "done" or comp.state != "done":
        return None
    spec = comp.spec_dict()
    try:
        profile = cal.from_run(base)
    except cal.CalibrationError as e:
        return f"no prediction: {e}"
    from commlab.lab.strategy.perfmodel.views import ensure_curves  # lazy: torch (the engine's exchange), for this
    try:  # what the crossover needs measured is measured in children where this process serves viewers
        ensure_curves(profile, {"c": spec["compressor"]})
        g = pr.without_driving(lambda: pr.crossover_gbps(profile, spec, spec["world_size"]))
    except (ValueError, KeyError) as e:
        return f"no prediction: {e}"
    if g is None:
        return "the performance model predicts it never pays at 2 workers (0.001-1000 Gbit/s)"
    if g >= 1e3:
        return "the performance model predicts it pays at every bandwidth up to 1000 Gbit/s"
    return f"the performance model (calibrated on {base_label}) predicts it pays below {g:.3g} Gbit/s at 2 workers"
