"""The strategy space: every strategy the advisor ranks for a spec, as ``Candidate``s.

A candidate is a compressor section, a schedule, a comm mode and a method, with the figures the advice fills
in (predicted and measured iteration time, penalty) beside them. ``space`` builds them: the compressors this
build can make and this machine can run (``compressor_space``, asked of the registry, plus the user's own
and ``--candidate`` sections), each at every bucket cap and MergeComp under wfbp, and under dear where it can
reduce-scatter every buffer (``shardable``); then the methods that communicate less often (``method_space``).

It is apart from the predictions (commlab.lab.strategy.predictions), the trials (commlab.lab.strategy.trials) and the advice
(commlab.lab.strategy.advisor) because all three read candidates and none of them decides what is in the space: this
module is the bottom of the four, and imports none of them. The small facts about a section that the others
share (``is_ddp``, ``start_iter``) live here for the same reason.
"""
from __future__ import annotations

import copy
import sys
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

from commlab.engine.codepath import is_import_path
from commlab.engine.spec import OptimizerSpec, SpecError
from commlab.lab.base.specs import load_spec
from commlab.lab.strategy.penalty import NO_METHOD, eval_points, evidence_words, finished_runs, is_proven, method_key
from commlab.lab.strategy.penalty import comp_section as _comp
from commlab.lab.strategy.perfmodel.calibrate import compressor_key

BUCKET_CAPS_MB = (25.0, 4.0, 1.0)
DEAR_CAPS_MB = (25.0, 4.0)
"""Caps tried, the usual one first: among equal scores the earlier candidate in the space wins."""
MIXED_BELOW_MB = 1.0
"""The mixed candidates' rule: buckets under this many MB go uncompressed."""
METHODS_FROM_RUNS = 6
"""Method configurations taken from the index as candidates at most (the latest distinct ones)."""


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
    """the method section (commlab/engine/methods/; full form, as spec.json holds it): none for every step's gradients"""
    excluded: str = ""
    """why the candidate is listed but neither costed nor ranked (a method the spec cannot take); "" otherwise"""
    to_target: Optional[dict] = None
    """``--measure``: its to-target trial (commlab.lab.strategy.totarget): run, seconds and steps to the
    target, whether it reached it"""

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
    def proven(self) -> bool:
        """Its penalty is evidence for this model (commlab.lab.strategy.penalty.is_proven): a candidate
        without any never outranks one with it."""
        return self.penalty is not None and is_proven(self.penalty_source)

    @property
    def local(self) -> bool:
        """True for a method that communicates less often (not every step's gradients)."""
        return self.method.get("name", "none") != "none"

    def strategy(self) -> dict:
        return {"compressor": copy.deepcopy(self.compressor), "schedule": copy.deepcopy(self.schedule),
                "comm": copy.deepcopy(self.comm), "method": copy.deepcopy(self.method)}

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(predicted_score=self.predicted_score, measured_score=self.measured_score, proven=self.proven,
                 evidence=evidence_words(self.penalty_source))
        return d


def add_note(c: Candidate, text: str) -> None:
    c.note = (c.note + "; " if c.note else "") + text


def is_ddp(c: Candidate) -> bool:
    """DDP's configuration: none, 25 MB buckets, wfbp, no method."""
    return (c.compressor["name"] == "none" and not c.compressor.get("per_bucket") and c.comm["mode"] == "wfbp"
            and c.schedule == {"name": "bucket", "cap_mb": 25.0} and not c.local)


def mixed(small: dict, rest: dict, below_mb: float = MIXED_BELOW_MB) -> dict:
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

    from commlab.engine import compressors
    from commlab.engine.compressors.plan import make_section, parts
    below = f"{MIXED_BELOW_MB:g} MB"
    wanted = [("none", _comp("none")), ("fp16", _comp("fp16")), ("bf16", _comp("bf16")), ("int8", _comp("int8")),
              ("topk 1% +EF", _comp("topk", True, ratio=0.01)), ("topk 10% +EF", _comp("topk", True, ratio=0.1)),
              ("powersgd r1", _comp("powersgd", rank=1)), ("powersgd r4", _comp("powersgd", rank=4)),
              # mixed: small buckets are latency-bound, so compressing them saves little and costs a codec
              # each; the big ones carry the bytes
              (f"mixed: none < {below}, powersgd r4", mixed(_comp("none"), _comp("powersgd", rank=4))),
              (f"mixed: none < {below}, int8", mixed(_comp("none"), _comp("int8")))]
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
    all-to-all: ``Capabilities.shard_path``)."""
    from commlab.engine.compressors.plan import make_section, parts
    return all(make_section(p).capabilities.shard_problem() is None for p in parts(c))


def own_compressor(spec: dict) -> List[dict]:
    """The spec's own compressor section when it names code (``package.module:Class``, in any part): the
    user wrote it to be tried, so it joins the space."""
    from commlab.engine.compressors.plan import parts
    c = spec["compressor"]
    return [c] if any(is_import_path(p["name"]) for p in parts(c)) else []


def start_iter(comp: dict) -> Optional[int]:
    """The uncompressed start of PowerSGD in the section (any of its parts), or None without PowerSGD."""
    from commlab.engine.compressors.plan import parts
    starts = [int(p["params"].get("start_iter", 10)) for p in parts(comp) if p["name"] == "powersgd"]
    return max(starts) if starts else None


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
    from commlab.engine import methods  # torch: only when the methods are ranked
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
    # dear steps flat shards: only an optimizer whose update is elementwise steps them as it steps the whole model
    sharded = OptimizerSpec(**(spec.get("optimizer") or {})).elementwise
    ft = bool((spec.get("fault_tolerance") or {}).get("enabled"))
    for label, c in compressor_space(own_compressor(spec) + list(extra)):
        for cap in BUCKET_CAPS_MB:
            out.append(Candidate(f"{label}, bucket {cap:g} MB, wfbp", c, {"name": "bucket", "cap_mb": cap},
                                 {"mode": "wfbp"}))
        # under fault tolerance MergeComp searches before the replicas start (commlab/lab/strategy/ftsearch.py)
        out.append(Candidate(f"{label}, mergecomp, wfbp", c, {"name": "mergecomp"}, {"mode": "wfbp"}))
        if sharded and shardable(c):
            for cap in DEAR_CAPS_MB:
                out.append(_unless_ft(ft, FT_NO_DEAR, Candidate(f"{label}, dear {cap:g} MB", c,
                                                               {"name": "bucket", "cap_mb": cap}, {"mode": "dear"})))
    return out + (method_space(spec, runs) if methods else [])


FT_NO_DEAR = "fault tolerance: dear shards the parameters over a fixed world"
"""Why a fault-tolerant run's space lists a candidate without ranking it (commlab.engine.spec refuses it there)."""


def _unless_ft(ft: bool, why: str, c: Candidate) -> Candidate:
    """``c``, listed but left out (``excluded``) under fault tolerance."""
    if ft:
        c.excluded, c.note = why, f"not in the space: {why}"
    return c


def with_strategy(spec: dict, strategy: dict) -> dict:
    """``spec`` with its compressor, schedule and comm replaced, fully defaulted again."""
    s = copy.deepcopy(spec)
    s.update(copy.deepcopy(strategy))
    if (s.get("strategy") or {}).get("mode") == "auto":  # the advisor's choice, not the user's
        s["strategy"] = {**s["strategy"], "decided": True}
    return load_spec(data=s).to_dict()


def load_spec_dict(d: dict) -> dict:
    return load_spec(data=d).to_dict()
