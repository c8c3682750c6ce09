"""The advisor: choose the communication strategy for a model and a link, then prove it by measurement.

    commlab advise SPEC --gbps 1 [--link modeled|shaped] [--workers N] [--measure] [--out best.yaml] [--json]

Steps, in order:

1. A calibrated profile of the spec's model (lab.perfmodel.whatif.resolve_profile: a saved profile, a
   finished run in the index, or a short single-process run measured now) and the encode/decode cost
   curve of every candidate compressor (measured in-process, saved with the profile).
2. The strategy space the engine supports (``space``): compressors that keep accuracy (none, the 16-bit
   casts, block-wise int8, top-k with error feedback at two ratios, PowerSGD rank 1 and 4) and two mixed
   sections (buckets under 1 MB uncompressed, the rest PowerSGD rank 4 or int8: compressor.per_bucket),
   fusion (bucket caps of 1, 4 and 25 MB, and MergeComp), comm mode wfbp, and dear (its buffer cap) for
   compressors whose payload it can reduce-scatter: summed (none, the casts) or as a shard codec's
   all-to-all (int8: dear with a compressed reduce-scatter). Compressors come from the registry's
   capabilities, not from a list of names: a section is in the dear space when ``shard_problem()`` is None
   for every compressor it may give a buffer.
3. Each candidate's predicted iteration time (lab.perfmodel.predict on the link), times its convergence
   penalty (``penalty``: steps to the target accuracy over ``none``'s), is its predicted time to accuracy.
   MergeComp is predicted at the partition its own search would settle on when it is fed the model's
   predictions instead of measurements (engine.tuners.mergecomp.MergeCompSearch, driven here).
4. With ``measure``, the best-predicted candidate of each of the top ``trials`` compressors runs
   ``trial_steps`` steps through the normal launcher on the same link; the winner is the best measured
   iteration time x penalty.

The methods that communicate less often (engine/methods/: local SGD, post-local SGD, DiLoCo, Streaming DiLoCo,
DeMo) are candidates too (``method_space``): each at its defaults, and every configuration of one that finished
runs of this model in the index used. Their predicted time is the mean step over the run (syncs amortized,
lab/strategy/perfmodel/local.py); their penalty is only ever measured (steps to accuracy against DDP's, both
runs of this model in the index) or declared (``--penalty diloco=1.2``): a method without either is listed but
never chosen, since how many more steps a method needs depends on the model, H and the optimizer far more than a
compressor's does. Methods are not tried in trials (a trial's few steps would not span a sync period), and
``strategy: auto`` does not plan them (``methods=False``).

The penalty and where it comes from: lab.strategy.penalty.
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from engine import runfiles
from engine.codepath import is_import_path
from engine.runlog import write_json_atomic
from engine.schedules import ParamInfo
from engine.spec import JobSpec, SpecError
from lab.base.errors import LabError
from lab.base.specs import load_spec
from lab.rundir.store import Run
from lab.rundir.summary import iteration_times, warmup_steps
from lab.strategy.penalty import (NO_METHOD, benchmark_cells, eval_points, finished_runs, method_key, method_penalty,
                                  penalty, strategy_cells)
from lab.strategy.penalty import comp_section as _comp
from lab.strategy.perfmodel import calibrate as cal
from lab.strategy.perfmodel import predict as pr
from lab.strategy.perfmodel import whatif
from lab.strategy.perfmodel.calibrate import CalibrationError, compressor_key
from lab.strategy.perfmodel.costs import Link

BUCKET_CAPS_MB = (25.0, 4.0, 1.0)
DEAR_CAPS_MB = (25.0, 4.0)
"""Caps tried, the usual one first: among equal scores the earlier candidate in the space wins."""
MERGECOMP_MARGIN = 2.0
"""MergeComp is predicted for a compressor only when that compressor's best fixed layout is within this
factor of the best candidate (see ``advise``)."""
MIXED_BELOW_MB = 1.0
"""The mixed candidates' rule: buckets under this many MB go uncompressed."""
TRIAL_STEPS = 8
"""Timed steps per trial (after ``TRIAL_WARMUP``)."""
TRIAL_WARMUP = 2
"""Steps at the start of each trial left out of its median (allocation, lazy buffers, the first exchanges)."""
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
TRIALS = 3
"""Candidates tried by prediction (one per compressor); DDP is tried besides them when ``DDP_MARGIN`` says."""
DDP_MARGIN = 1.5
"""DDP (none, 25 MB buckets, wfbp) is tried too unless its predicted score is more than this many times the
best-predicted one's: then the model's errors (tens of percent where measured) cannot make it the winner, and
its trial would be the slowest of all. Tried, it is the safety reference: the choice is never slower than DDP
as measured in the same session."""
FAMILY_MARGIN = 2.0
"""A compressor family is tried only if its best predicted score is within this many times the best one's:
the model's errors where measured are tens of percent, not 2x, and a family far behind costs its trial
steps for nothing (int8 at a shaped 0.1 Gbit/s on resnet: predicted 7x PowerSGD's time, one step of 359 ms
before STOP_RATIO stopped it, a third of the trials' cost)."""
REFERENCE_WITHIN = 1.25
"""In-run trials: DDP, when tried, trains again in the runoff whenever its score is within this factor of the
best (the close candidates' factor is RUNOFF_WITHIN): the hold below compares against DDP, so DDP is measured
as often as the candidates it is held against. Up to ABORT_RATIO, where a trial counts as clearly slower."""
DDP_HOLD = 1.03
"""Measured, a winner must score more than this factor better than DDP, or DDP is chosen: trials of 8 steps
scatter by several percent here (the transformer at a shaped 10 Gbit/s: bf16 under dear won its trial by 1.3%
and ran 4.9% slower than DDP in the grid), so a win inside the noise goes to the safe reference. It costs at
most 3% against the true best."""
LINKS = ("modeled", "shaped")
METHODS_FROM_RUNS = 6
"""Method configurations taken from the index as candidates at most (the latest distinct ones)."""


# --------------------------------------------------------------------------- candidates

@dataclass
class Candidate:
    label: str
    compressor: dict
    schedule: dict
    comm: dict
    predicted_ms: Optional[float] = None
    penalty: Optional[float] = None
    """steps to accuracy relative to none (1.0: as fast); None: left out for losing accuracy"""
    penalty_source: str = ""
    measured_ms: Optional[float] = None
    trial_run: Optional[str] = None
    note: str = ""
    layout_groups: Optional[int] = None
    """MergeComp: the number of groups of the partition predicted best"""
    layout_cuts: Optional[List[int]] = None
    """MergeComp: that partition's cuts (over the profile's parameters, in its order)"""
    steady_ms: Optional[float] = None
    """MergeComp: the predicted step time at that partition, the search not counted"""
    method: dict = field(default_factory=lambda: copy.deepcopy(NO_METHOD))
    """the method section (engine/methods/; full form, as spec.json holds it): none for every step's gradients"""
    excluded: str = ""
    """why the candidate is listed but neither costed nor ranked (a method the spec cannot take); "" otherwise"""

    @property
    def predicted_score(self) -> Optional[float]:
        if self.predicted_ms is None or self.penalty is None:
            return None
        return self.predicted_ms * self.penalty

    @property
    def measured_score(self) -> Optional[float]:
        if self.measured_ms is None or self.penalty is None:
            return None
        return self.measured_ms * self.penalty

    @property
    def local(self) -> bool:
        """True for a method that communicates less often (not every step's gradients)."""
        return self.method.get("name", "none") != "none"

    def strategy(self) -> dict:
        return {"compressor": copy.deepcopy(self.compressor), "schedule": copy.deepcopy(self.schedule),
                "comm": copy.deepcopy(self.comm), "method": copy.deepcopy(self.method)}

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(predicted_score=self.predicted_score, measured_score=self.measured_score)
        return d


def _mixed(small: dict, rest: dict, below_mb: float = MIXED_BELOW_MB) -> dict:
    """A mixed compressor section: buckets under ``below_mb`` get ``small``, the others ``rest``."""
    rule = {"below_mb": float(below_mb), "name": small["name"], "error_feedback": small["error_feedback"],
            "params": dict(small["params"])}
    return {**rest, "per_bucket": [rule]}


def compressor_space(extra: List[dict] = ()) -> List[Tuple[str, dict]]:
    """(label, compressor section) of the compressors the advisor considers, each checked against the
    registry (a compressor this build cannot make, or cannot run on this machine, is left out), then the
    ``extra`` sections (full form: the user's candidates, labelled by their key) that are not among them
    already. Mixed sections (compressor.per_bucket) are checked part by part."""
    import torch

    from engine import compressors
    from engine.compressors.plan import make_section, parts
    below = f"{MIXED_BELOW_MB:g} MB"
    wanted = [("none", _comp("none")), ("fp16", _comp("fp16")), ("bf16", _comp("bf16")), ("int8", _comp("int8")),
              ("topk 1% +EF", _comp("topk", True, ratio=0.01)), ("topk 10% +EF", _comp("topk", True, ratio=0.1)),
              ("powersgd r1", _comp("powersgd", rank=1)), ("powersgd r4", _comp("powersgd", rank=4)),
              # mixed: small buckets are latency-bound, so compressing them saves little and costs a codec
              # each; the big ones carry the bytes
              (f"mixed: none < {below}, powersgd r4", _mixed(_comp("none"), _comp("powersgd", rank=4))),
              (f"mixed: none < {below}, int8", _mixed(_comp("none"), _comp("int8")))]
    wanted = [(label, c) for label, c in wanted if all(p["name"] in compressors.names() for p in parts(c))]
    keys = {compressor_key(c) for _, c in wanted}
    for c in extra:
        if compressor_key(c) not in keys:
            keys.add(compressor_key(c))
            wanted.append((compressor_key(c), c))
    out = []
    mine = {compressor_key(c) for c in extra}
    for label, c in wanted:
        try:  # "if supported": one round trip on a small tensor, as a rank would run it
            for part in parts(c):
                comp = make_section(part)
                payload, ctx = comp.compress(torch.ones(64))
                comp.decompress(payload, ctx)
        except (RuntimeError, TypeError) as e:  # a dtype the machine lacks: said, not hidden
            print(f"advisor: leaving out {label}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        except Exception as e:  # the user's code may fail in any way: said, and left out
            if label not in mine:
                raise
            print(f"advisor: leaving out {label}: {type(e).__name__}: {e} (commlab check compressor "
                  f"{c['name']} says more)")
            continue
        out.append((label, c))
    return out


def shardable(c: dict) -> bool:
    """dear can reduce-scatter every compressor the section may give a buffer (summed, or a shard codec's
    all-to-all: ``Compressor.shard_path``)."""
    from engine.compressors.plan import make_section, parts
    return all(make_section(p).shard_problem() is None for p in parts(c))


def own_compressor(spec: dict) -> List[dict]:
    """The spec's own compressor section when it names code (``package.module:Class``, in any part): the
    user wrote it to be tried, so it joins the space."""
    from engine.compressors.plan import parts
    c = spec["compressor"]
    return [c] if any(is_import_path(p["name"]) for p in parts(c)) else []


def measured_methods(spec: dict, runs, limit: int = METHODS_FROM_RUNS) -> List[dict]:
    """The method sections of the latest finished runs in the index with the spec's model, data set, batch,
    optimizer and world size that evaluated at least twice (what ``penalty_from_runs`` can measure), newest
    first, at most ``limit`` distinct ones."""
    out, seen = [], set()
    for r, d in finished_runs(spec, runs):
        m = d.get("method") or NO_METHOD
        if m["name"] == "none" or method_key(m) in seen or d["world_size"] != spec["world_size"]:
            continue
        if len(eval_points(r)) >= 2:
            seen.add(method_key(m))
            out.append(m)
            if len(out) == limit:
                break
    return out


def method_space(spec: dict, runs=None) -> List[Candidate]:
    """The methods as candidates: every registered method at its defaults, then the configurations measured in
    ``runs``' index (``measured_methods``; none without ``runs``), each with DDP's buckets and wfbp (post-local
    SGD's warm-up steps use them) and no top-level compressor. A method the spec cannot take (DeMo with a
    momentum optimizer) is listed with the reason, unranked."""
    from engine import methods  # torch: only when the methods are ranked
    strat = {"compressor": _comp("none"), "schedule": {"name": "bucket", "cap_mb": 25.0}, "comm": {"mode": "wfbp"}}
    out, seen = [], set()
    for sec in [{"name": n} for n in methods.names()[1:]] + (measured_methods(spec, runs) if runs else []):
        try:
            full = load_spec(data={**spec, **strat, "method": sec, "strategy": {"mode": "fixed"}}).to_dict()["method"]
        except SpecError as e:
            out.append(Candidate(f"{sec['name']}, bucket 25 MB, wfbp", strat["compressor"], strat["schedule"],
                                 strat["comm"], method={"name": sec["name"], "params": {}, "compressor": {}},
                                 penalty_source="not in the space: the spec does not take it",
                                 note=f"not in the space: {e}", excluded=str(e)))
            continue
        if method_key(full) not in seen:
            seen.add(method_key(full))
            out.append(Candidate(f"{method_key(full)}, bucket 25 MB, wfbp", copy.deepcopy(strat["compressor"]),
                                 dict(strat["schedule"]), dict(strat["comm"]), method=full))
    return out


def space(spec: dict, extra: List[dict] = (), runs=None, methods: bool = True) -> List[Candidate]:
    """Every strategy the advisor ranks, for a fully defaulted spec dict: the built-in space, the spec's own
    compressor when it names code, the ``extra`` compressor sections (``commlab advise --candidate``) and, with
    ``methods``, the methods that communicate less often (``method_space``, from ``runs``' index)."""
    out = []
    for label, c in compressor_space(own_compressor(spec) + list(extra)):
        for cap in BUCKET_CAPS_MB:
            out.append(Candidate(f"{label}, bucket {cap:g} MB, wfbp", c, {"name": "bucket", "cap_mb": cap},
                                 {"mode": "wfbp"}))
        out.append(Candidate(f"{label}, mergecomp, wfbp", c, {"name": "mergecomp"}, {"mode": "wfbp"}))
        if shardable(c):
            for cap in DEAR_CAPS_MB:
                out.append(Candidate(f"{label}, dear {cap:g} MB", c, {"name": "bucket", "cap_mb": 25.0},
                                     {"mode": "dear", "cap_mb": cap}))
    return out + (method_space(spec, runs) if methods else [])


def with_strategy(spec: dict, strategy: dict) -> dict:
    """``spec`` with its compressor, schedule and comm replaced, fully defaulted again."""
    s = copy.deepcopy(spec)
    s.update(copy.deepcopy(strategy))
    if (s.get("strategy") or {}).get("mode") == "auto":  # the advisor's choice, not the user's
        s["strategy"] = {**s["strategy"], "decided": True}
    return load_spec(data=s).to_dict()


# --------------------------------------------------------------------------- prediction

def network_for(spec: dict, gbps: Optional[float] = None, link: Optional[str] = None) -> dict:
    """The network section the advice is for: the spec's shaped or modeled link, or ``link`` at ``gbps``."""
    net = dict(spec["network"])
    if link is not None and link not in LINKS:
        raise SpecError("--link", f"must be one of {', '.join(LINKS)}, got {link!r}")
    if gbps is not None and not 0.001 <= gbps <= 400:
        raise SpecError("--gbps", f"must be in [0.001, 400], got {gbps:g}")
    if gbps is None and link is None:
        if net["link"] == "loopback":
            raise SpecError("network.link", "the spec's link is loopback, which has no rate to plan for; give "
                                            "--gbps X (a modeled link) or a spec with a modeled or shaped link")
        return net
    kind = link or (net["link"] if net["link"] != "loopback" else "modeled")
    rate = gbps if gbps is not None else net.get("gbps")
    if rate is None:
        raise SpecError("--gbps", f"a {kind} link needs a rate; give --gbps X")
    out = {"link": kind, "gbps": float(rate), "latency_us": None}
    if kind == "modeled":
        out["latency_us"] = net.get("latency_us") if net["link"] == "modeled" else None
    return out


def link_of(profile, net: dict, runs=None):
    """The link the predictions use, and what it is: a modeled link is the engine's alpha-beta exactly; a
    shaped one is the profile's calibrated link, else the lab's (``commlab net check --save``), scaled to
    the rate; nominal when neither is calibrated."""
    if net["link"] == "modeled":
        return Link.from_gbps(net["gbps"], net.get("latency_us") or 0.0), "modeled: the engine's alpha-beta delays"
    if profile.link:
        return profile.link_at(net["gbps"]), f"shaped: calibrated at {profile.link['nominal_gbps']:g} Gbit/s, scaled"
    lab_link = whatif.saved_shaped_link(runs)
    if lab_link:
        return cal.link_scaled(lab_link, net["gbps"]), (f"shaped: the lab's calibration ({lab_link['source']}; {lab_link['alpha'] * 1e6:.0f} us "
                        "per ring step), scaled")
    return Link.from_gbps(net["gbps"]), ("shaped: nominal alpha-beta (no link calibrated; `commlab net check "
                                         "--gbps 1 --save` measures one)")


def predict_candidate(profile, spec: dict, cand: Candidate, link, world: int) -> None:
    s = {**spec, **cand.strategy()}
    if cand.local:
        try:
            cand.predicted_ms = pr.predict(profile, s, link.gbps, world, link=link).total * 1e3
        except SpecError as e:  # the model does not fit the method's parameters (more fragments than tensors)
            add_note(cand, f"not predicted: {e}")
        return
    if cand.schedule["name"] == "mergecomp":
        cuts_ms, groups, cuts, steady = search_mergecomp(profile, s, link, world)
        cand.predicted_ms, cand.layout_groups, cand.layout_cuts, cand.steady_ms = cuts_ms, groups, cuts, steady
        cand.note = (f"predicted over {spec['steps']} steps: its search (fed the model's times) settles on "
                     f"{groups} groups; the run searches by measurement")
        return
    cand.predicted_ms = pr.predict(profile, s, link.gbps, world, link=link).total * 1e3


def search_mergecomp(profile, spec: dict, link, world: int) -> Tuple[float, int, List[int], float]:
    """Drive MergeComp's own search (a pure object) with predicted instead of measured step times.
    Returns the mean predicted step time over the spec's steps after the compressor's plain start (which
    the engine's tuner does not time, and which no other prediction counts either), the search included
    (its warm-up and every candidate's 1 + steps_per_candidate steps, as engine.tuners runs them), the
    groups and cuts of the partition it settles on, and its predicted step time."""
    from engine.tuners.mergecomp import MergeCompSearch
    infos = [ParamInfo(name=n, numel=b // 4, element_size=4, dtype="float32", device="cpu")
             for n, b in profile.params]
    sched = spec["schedule"]
    search = MergeCompSearch(infos, max_groups=sched.get("max_groups") or 8,
                             max_candidates=sched.get("max_candidates") or 24)
    cuts = search.next_candidate()
    while cuts is not None:
        layout = [[profile.params[i][0] for i in g] for g in search.layout(cuts)]
        search.report(pr.predict(profile, spec, link.gbps, world, link=link, layout=layout).total)
        cuts = search.next_candidate()
    best_cuts, best = search.best
    per = 1 + (sched.get("steps_per_candidate") or 5)
    steps = [search.trace[0][1]] * (sched.get("warmup_steps") or 2)
    for _, t in search.trace:
        steps += [t] * per
    total = max(spec["steps"] - (start_iter(spec["compressor"]) or 0), 1)
    steps = steps[:total]
    steps += [best] * (total - len(steps))
    return 1e3 * sum(steps) / len(steps), len(best_cuts) + 1, list(best_cuts), 1e3 * best


# --------------------------------------------------------------------------- trials

def measured_ms(run, run_steps: Optional[int] = None, skip: Optional[int] = None) -> Tuple[Optional[float], str]:
    """Median iteration time (slower rank) of a trial run after its warm-up (``skip`` steps, default
    lab.summary's rule) and PowerSGD's uncompressed start, with a note on what was counted. A MergeComp
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


def is_ddp(c: Candidate) -> bool:
    """DDP's configuration: none, 25 MB buckets, wfbp, no method."""
    return (c.compressor["name"] == "none" and not c.compressor.get("per_bucket") and c.comm["mode"] == "wfbp"
            and c.schedule == {"name": "bucket", "cap_mb": 25.0} and not c.local)


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
    """The candidates to try: the best-predicted one of each of the first ``k`` compressor families in the
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
        if c.predicted_score is None or key in seen or c.local:  # a trial would not span a method's period
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


def start_iter(comp: dict) -> Optional[int]:
    """The uncompressed start of PowerSGD in the section (any of its parts), or None without PowerSGD."""
    from engine.compressors.plan import parts
    starts = [int(p["params"].get("start_iter", 10)) for p in parts(comp) if p["name"] == "powersgd"]
    return max(starts) if starts else None


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
    trials.json (engine.worker runs them in turn). A MergeComp trial starts at the partition the
    advisor's search predicted (seeded into the session's MergeComp cache), since its own search takes
    longer than a trial; the search's cost is added from the prediction (``trial_score``)."""
    from engine.tuners.mergecomp import cache_key, write_cache
    dirs = []
    for i, (s, c) in enumerate(zip(specs, cands)):
        d = run.path / runfiles.TRIAL_DIR.format(i=i)
        d.mkdir()
        write_json_atomic(d / runfiles.SPEC, s)
        dirs.append(d.name)
        if c.schedule["name"] == "mergecomp" and c.layout_cuts is not None:
            problem = write_cache(str(run.path), cache_key(JobSpec.from_dict(s)),
                                  {"order": [n for n, _ in profile.params], "cuts": c.layout_cuts,
                                   "ms": c.steady_ms, "run": "advisor prediction"})
            if problem:
                raise RuntimeError(f"advisor: trial session {run.id}: {problem}")
    write_json_atomic(run.path / runfiles.TRIALS, {"dirs": dirs})
    return dirs


def session_trials(run) -> List[object]:
    """The trials of a finished session run, as runs of their own (id ``<session>/trial-<i>``)."""
    out = []
    for d in json.loads(run.file(runfiles.TRIALS).read_text())["dirs"]:
        t = Run(run.path / d)
        t.id = f"{run.id}/{d}"
        out.append(t)
    return out


def load_spec_dict(d: dict) -> dict:
    return load_spec(data=d).to_dict()


# --------------------------------------------------------------------------- advice

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

    def ranked(self) -> List[Candidate]:
        return rank(self.candidates)

    def winner_spec(self) -> dict:
        s = with_strategy(self.spec, self.winner.strategy())
        s["network"] = dict(self.network)
        s["world_size"] = self.world
        return load_spec_dict(s)

    def as_dict(self) -> dict:
        return {"network": self.network, "world": self.world, "chosen_by": self.chosen_by,
                "winner": self.winner.label, "reason": self.reason, "link_source": self.link_source,
                "profile_source": self.profile_source, "cost_s": self.cost_s,
                "candidates": [c.as_dict() for c in self.ranked()], "strategy": self.winner.strategy()}


def rank(cands: List[Candidate]) -> List[Candidate]:
    """Measured candidates first (by measured score), then the rest by predicted score; left-out last."""
    inf = float("inf")
    return sorted(cands, key=lambda c: (c.measured_score is None, c.measured_score or inf,
                                        c.predicted_score if c.predicted_score is not None else inf))


def keep_curves(spec: dict, runs=None) -> Tuple[int, float]:
    """Measure the cost curves of every compressor in ``spec``'s strategy space that this machine has not
    measured yet and keep them for the machine (``lab.base.paths.CURVES``), as the first advice on a machine does;
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
           say: Callable[[str], None] = print, candidates: List[dict] = (), methods: bool = True) -> Advice:
    """Rank the strategy space for ``spec`` (a fully defaulted spec dict) on a link; see the module docstring.
    ``candidates``: more compressor sections (full form, checked) to rank beside the built-in space;
    ``methods``: rank the methods that communicate less often too (``method_space``)."""
    if workers is not None and not 1 <= workers <= 1024:
        raise SpecError("--workers", f"must be in 1..1024, got {workers}")
    if not 1 <= trials <= 20:
        raise SpecError("--trials", f"must be in 1..20, got {trials}")
    if not 4 <= trial_steps <= 1000:
        raise SpecError("--trial-steps", f"must be in 4..1000, got {trial_steps}")
    net = network_for(spec, gbps, link)
    world = workers or spec["world_size"]
    t0 = time.perf_counter()
    cands = space(spec, candidates, runs, methods)
    run_trial = runner
    if measure and run_trial is None:
        raise LabError("advise: measuring the close candidates needs runner= (lab.service.queue.Lab(runs).runner())")
    try:
        prof = profile or whatif.resolve_profile(spec, runs, say=say, runner=run_trial)
        if whatif.ensure_curves(prof, [{**spec, **c.strategy()} for c in cands if not c.excluded], runs, kept=True):
            say("advisor: measured the candidates' encode/decode cost curves")
            if profile is None:
                prof.save(whatif.profile_dir(runs) / f"{prof.key()}.json")
    except CalibrationError as e:
        raise LabError(str(e)) from None
    t1 = time.perf_counter()
    known = len(prof.payloads)
    lk, link_source = link_of(prof, net, runs)
    cells, strategies = benchmark_cells(), strategy_cells()
    pens: Dict[Tuple[str, str], Tuple[Optional[float], str]] = {}
    for c in cands:
        if c.local:
            if not c.excluded:
                c.penalty, c.penalty_source = method_penalty(spec, c.method, runs, penalties)
            continue
        k = (json.dumps(c.compressor, sort_keys=True), c.comm["mode"])
        if k not in pens:
            pens[k] = penalty(spec, c.compressor, runs, penalties, cells, c.comm["mode"], strategies)
        c.penalty, c.penalty_source = pens[k]
    # MergeComp's search is predicted (dozens of layouts each) only for compressors whose best fixed layout
    # is within MERGECOMP_MARGIN of the best candidate: a fusion search does not make up a larger gap
    for c in cands:
        if c.schedule["name"] != "mergecomp" and not c.excluded:
            predict_candidate(prof, spec, c, lk, world)
    fixed = [c.predicted_score for c in cands if c.predicted_score is not None]
    for c in cands:
        if c.schedule["name"] != "mergecomp" or c.penalty is None:
            continue
        mine = [o.predicted_score for o in cands if o.compressor == c.compressor and o.predicted_score is not None]
        if fixed and mine and min(mine) > MERGECOMP_MARGIN * min(fixed):
            c.note = (f"not predicted: its compressor's best fixed layout is {min(mine) / min(fixed):.2f}x the best "
                      f"candidate's (more than {MERGECOMP_MARGIN:g}x)")
            continue
        predict_candidate(prof, spec, c, lk, world)
    if profile is None and len(prof.payloads) > known:  # the payloads driven here, for the next prediction
        prof.save(whatif.profile_dir(runs) / f"{prof.key()}.json")
    t2 = time.perf_counter()
    ranked = rank(cands)
    if ranked[0].predicted_score is None:
        raise LabError("advisor: no candidate could be ranked (every compressor was left out)")
    adv = Advice(spec=spec, network=net, world=world, candidates=cands, winner=ranked[0], chosen_by="predicted",
                 link_source=link_source, profile_source=prof.source,
                 cost_s={"profile": t1 - t0, "predict": t2 - t1, "trials": 0.0, "total": t2 - t0}, profile=prof)
    if measure:
        measure_in_session(adv, trial_picks(ranked, trials), trial_steps, run_trial, say)
        adv.cost_s.update(trials=time.perf_counter() - t2, total=time.perf_counter() - t0)
        for c in cands:
            if c.local and c.predicted_score is not None:
                add_note(c, f"not tried: {trial_steps} trial steps do not span its sync period, and a measured "
                            "choice is made among the tried")
    adv.reason = explain(adv)
    return adv


def measure_in_session(adv: "Advice", picks: List[Candidate], trial_steps: int, run_trial, say) -> None:
    """``--measure`` apart from any run: one trial session (a run of its own) of ``picks``; their measured
    figures go into the candidates, and the winner is re-chosen by measurement."""
    net, world, prof = adv.network, adv.world, adv.profile
    specs = [trial_spec({**adv.spec, "network": net, "world_size": world}, c, trial_steps) for c in picks]
    say(f"advisor: one session of {len(picks)} trials, {TRIAL_WARMUP} + {trial_steps} steps each, "
        f"{net['link']} {net['gbps']:g} Gbit/s: " + "; ".join(c.label for c in picks))
    session = run_trial(session_spec(specs), prepare=lambda r: prepare_session(r, specs, picks, prof))
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


def add_note(c: Candidate, text: str) -> None:
    c.note = (c.note + "; " if c.note else "") + text


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


def rechoose(adv: "Advice") -> None:
    """The winner by measurement where any candidate was measured; DDP, when measured, unless the best
    measured beats it by more than ``DDP_HOLD``."""
    from engine.trials import choose  # the rule the in-run trials use
    ranked = rank(adv.candidates)
    adv.winner = ranked[0]
    measured = [c for c in ranked if c.measured_score is not None]
    if measured:
        adv.chosen_by = "measured"
        w, _ = choose([c.measured_score for c in measured],
                      {"trials": [{"reference": is_ddp(c)} for c in measured], "hold_margin": DDP_HOLD})
        adv.winner = measured[w]


def explain(adv: Advice) -> str:
    """Why the winner won, in one or two sentences, against DDP's configuration and the runner-up."""
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
             f"{w.penalty:g}, {w.penalty_source.split(':')[0]})"]
    if ddp is not None and ddp is not w and getattr(ddp, key) is not None:
        parts.append(f"{getattr(ddp, key) / getattr(w, key):.2f}x DDP's ({ddp.label}: {getattr(ddp, key):.1f} ms)")
    rest = [c for c in r if c is not w and getattr(c, key) is not None]
    if rest:
        parts.append(f"runner-up {rest[0].label} at {getattr(rest[0], key):.1f} ms")
    return "; ".join(parts)


def format_table(adv: Advice, limit: Optional[int] = None) -> List[str]:
    """The ranking, the first ``limit`` rows (all without one), and the methods below them: a method without
    a penalty is never chosen, and its row says why."""
    head = ("#", "CANDIDATE", "PRED ms", "PENALTY", "PRED x PEN", "MEAS ms", "MEAS x PEN", "PENALTY FROM")
    rows = [head]
    ranked = adv.ranked()
    shown = [(i, c) for i, c in enumerate(ranked, 1) if not limit or i <= limit or c.local]
    for i, c in shown:
        f = (lambda v: f"{v:.1f}" if v is not None else "-")
        rows.append((str(i), c.label, f(c.predicted_ms), f"{c.penalty:g}" if c.penalty is not None else "out",
                     f(c.predicted_score), f(c.measured_ms), f(c.measured_score), c.penalty_source.split(":")[0]))
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(wi) if i in (1, 7) else c.rjust(wi) for i, (c, wi) in enumerate(zip(r, w))).rstrip()
            for r in rows]


