"""The convergence penalty of a strategy: how many more steps than DDP (compressor none, no method) it needs to
reach the same accuracy, and where that number comes from, always said: ``measured`` (steps to accuracy in two
finished runs of this model in the index), ``benchmark`` (the strategy accuracy benchmark for the same compressor
section in the same comm mode, then the compressor accuracy benchmark, both shipped as
commlab/lab/strategy/evidence.json: cnn on digits, final accuracy at a fixed step budget; a compressor within
``KEEP_POINTS`` of none counts 1.0, one below it is left out), ``parts`` (a mixed section nothing measured as a
whole: the worst of its compressors' penalties), ``declared`` (the user's ``--penalty`` /
``strategy.penalties``), or ``default`` (the advisor's reasoned default here, ``declared_default``: nothing
measured, nothing declared). A method's penalty is only ever measured or declared
(``method_penalty``). The advisor (commlab.lab.strategy.advisor) multiplies each candidate's iteration time by it.

Whether a penalty is evidence for this model (``is_proven``): measured on it, declared by the user, the
reference, or a cast (it decodes to the input up to its rounding). A benchmark on another model or the
advisor's default is not: the advisor never lets a lossy candidate resting on those outrank one with
evidence (PowerSGD rank 1 kept the cnn's accuracy on digits and needed 2.7x DDP's steps on a resnet), and
``evidence_words`` says which, in words."""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

from commlab.engine.spec import SpecError
from commlab.lab.rundir.index import runs_of
from commlab.lab.strategy import evidence
from commlab.lab.strategy.perfmodel.calibrate import compressor_key, spec_key

KEEP_POINTS = 0.01
"""A compressor whose benchmark accuracy is within this of none's (absolute) keeps accuracy."""
TARGET_FRACTION = 0.97
"""Steps to accuracy: the first eval reaching this fraction of the none run's best accuracy."""
NO_METHOD = {"name": "none", "params": {}, "compressor": {}}
"""The method section of every step's gradients (spec.json's full form)."""


def comp_section(name: str, ef: bool = False, **params) -> dict:
    """A compressor section in the spec's full form (spec.json's), so a candidate compares equal to it."""
    return {"name": name, "params": params, "error_feedback": ef, "per_bucket": []}


def method_key(section: dict) -> str:
    """A method section as one string, ``name(param=value,...)``, and ``with <compressor key>`` when its
    exchanges are compressed: how the advisor's table names it and how runs of it are matched."""
    params = ",".join(f"{k}={v}" for k, v in sorted((section.get("params") or {}).items()))
    comp = section.get("compressor") or {}
    with_comp = f" with {compressor_key(comp)}" if comp and compressor_key(comp) != "none" else ""
    return f"{section['name']}{'(' + params + ')' if params else ''}{with_comp}"


def _same_comp(a: dict, b: dict) -> bool:
    return compressor_key(a) == compressor_key(b)  # name, parameters, error feedback and per-bucket rules


def steps_to(evals: List[Tuple[int, float]], target: float) -> Optional[int]:
    for step, acc in sorted(evals):
        if acc >= target:
            return step
    return None


def finished_runs(spec: dict, runs):
    """(run, its spec) of the finished runs in the index with the spec's model, data set, batch and optimizer,
    newest first."""
    key = spec_key(spec)
    for r in reversed(runs_of(runs, state="done")):
        try:
            d = r.spec_dict()
        except (OSError, json.JSONDecodeError):
            continue
        if spec_key(d) == key and d["optimizer"] == spec["optimizer"]:
            yield r, d


def eval_points(run) -> List[Tuple[int, float]]:
    return [(m["step"], m["eval_acc"]) for m in run.metric_rows() if m.get("kind") == "eval"]


def latest_evals(spec: dict, runs, comp: Optional[dict] = None, method: Optional[dict] = None,
                 world: Optional[int] = None):
    """(run, its evaluations) of the latest finished run in the index of the spec's model, data set, batch and
    optimizer with compressor ``comp`` and ``method`` (default: DDP's, none and none), and ``world`` ranks when
    given, that evaluated at least twice (once, for a run that stopped at its target: spec.stop_at_acc);
    None when there is none."""
    comp, method = comp or comp_section("none"), method or NO_METHOD
    for r, d in finished_runs(spec, runs):
        if not _same_comp(d["compressor"], comp) or method_key(d.get("method") or NO_METHOD) != method_key(method):
            continue
        if world is not None and d["world_size"] != world:
            continue
        ev = eval_points(r)
        if len(ev) >= (1 if d.get("stop_at_acc") else 2):
            return r, ev
    return None


def target_of(ddp_evals: List[Tuple[int, float]], target: Optional[float] = None) -> float:
    """The accuracy steps are counted to: ``target`` when DDP's evaluations reached it, else
    ``TARGET_FRACTION`` of DDP's best."""
    if target is not None and steps_to(ddp_evals, target) is not None:
        return target
    return TARGET_FRACTION * max(a for _, a in ddp_evals)


def ddp_steps_to(spec: dict, runs, target: Optional[float] = None) -> Optional[Tuple[int, float, str]]:
    """DDP's steps to the target on this model, from its latest finished run in the index that evaluated:
    (steps, the accuracy counted to, the run's id); None without such a run. The advisor turns a candidate's
    iteration time x penalty into seconds to the target with it."""
    found = latest_evals(spec, runs)
    if found is None:
        return None
    run, ev = found
    goal = target_of(ev, target)
    return steps_to(ev, goal), goal, run.id


def penalty_from_runs(spec: dict, comp: dict, runs, method: Optional[dict] = None, target: Optional[float] = None
                      ) -> Optional[Tuple[Optional[float], str]]:
    """Steps to accuracy of ``comp`` (with ``method``, a method section; default none) over DDP's (compressor
    none, no method), from the latest finished runs in the index with the spec's model, data set, batch and
    optimizer that evaluated at least twice (once, for a run that stopped at its target: spec.stop_at_acc);
    a method's runs, and the DDP run it is held to, also have the spec's world size (how far ranks drift
    apart between syncs depends on it). The accuracy is ``target`` when DDP's run reached it, else
    ``TARGET_FRACTION`` of DDP's best. None when there is no such pair."""
    method = method or NO_METHOD
    world = spec["world_size"] if method["name"] != "none" else None
    base, mine = latest_evals(spec, runs, world=world), latest_evals(spec, runs, comp, method, world)
    if base is None or mine is None:
        return None
    (rb, eb), (rm, em) = base, mine
    target = target_of(eb, target)
    sb, sm = steps_to(eb, target), steps_to(em, target)
    if sm is None:
        return None, (f"measured: did not reach {target:.1%} in {max(s for s, _ in em) + 1} steps (run {rm.id}; "
                      f"DDP reached it at step {sb}, run {rb.id})")
    return max(sm, 1) / max(sb, 1), f"measured: steps to {target:.1%}, {sm} (run {rm.id}) vs DDP {sb} (run {rb.id})"


PROVEN = ("the reference", "measured", "declared", "default: a cast", "default: the reference", "parts:")
"""Penalty sources that are evidence for this model (``is_proven``); "parts:" is a mixed section all of whose
parts are (one that is not says ``parts, unproven:``)."""


def is_proven(source: str) -> bool:
    """True when a penalty's source is evidence for this model: measured on it, declared, the reference or a
    cast. A benchmark on another model and the advisor's default are not."""
    return source.startswith(PROVEN)


EVIDENCE_WORDS = (  # (source prefixes, words), the first that matches; the order matters ("measured: did not")
    (("the reference", "default: the reference"), "DDP itself"),
    (("measured: did not reach",), "measured on this model: never reached the target"),
    (("measured",), "measured on this model (runs in the index)"),
    (("declared",), "you declared it"),
    (("default: a cast",), "a cast: as many steps as DDP"),
    (("no runs",), "none yet: never run on this model"),
    (("parts:",), "its parts measured or exact on this model"),
    (("parts, unproven",), "unproven here: a part never run on this model"),
    (("benchmark", "default: top-k", "default: PowerSGD"), "unproven here: seen only on another model (a cnn on digits)"),
)


def evidence_words(source: str) -> str:
    """What a penalty rests on, in words a newcomer reads: the table's EVIDENCE column."""
    return next((words for prefixes, words in EVIDENCE_WORDS if source.startswith(prefixes)),
                "unproven here: a guess")


def benchmark_cells(results: Optional[List[dict]] = None) -> Dict[Tuple[str, bool], dict]:
    """(compressor, error feedback) -> cell of the compressor accuracy benchmark (commlab.lab.strategy.evidence; a later
    result's cells replace an earlier one's)."""
    cells = {}
    for data in evidence.compressor_results() if results is None else results:
        for c in data.get("cells", []):
            if c.get("acc") is not None:
                cells[(c["compressor"], bool(c["ef"]))] = dict(c, steps=data.get("steps"), file=data["file"])
    return cells


def penalty_from_benchmark(comp: dict, cells) -> Optional[Tuple[Optional[float], str]]:
    """From the accuracy benchmark (compressors at their default parameters only)."""
    from commlab.engine import compressors
    if comp["name"] not in compressors.names():  # the user's code: the benchmark never ran it
        return None
    defaults = {p.name: p.default for p in compressors.REGISTRY[comp["name"]].params}
    if any(defaults.get(k) != v for k, v in (comp.get("params") or {}).items()):
        return None
    mine, base = cells.get((comp["name"], bool(comp.get("error_feedback")))), cells.get(("none", False))
    if mine is None or base is None:
        return None
    return _verdict(mine["acc"], base["acc"], f"{mine['file']}, cnn on digits, {mine['steps']} steps")


def _verdict(acc: float, base: float, where: str) -> Tuple[Optional[float], str]:
    """A benchmark's final accuracy against none's: penalty 1 within ``KEEP_POINTS``, else left out."""
    if acc >= base - KEEP_POINTS:
        return 1.0, (f"benchmark: {acc:.1%} vs none {base:.1%} at the same steps ({where}); "
                     f"steps-to-accuracy ratio not measured, taken as 1")
    return None, f"benchmark: {acc:.1%} vs none {base:.1%} ({where}): loses accuracy, left out"


def strategy_cells(data: Optional[dict] = None) -> Dict[Tuple[str, str], dict]:
    """(compressor key, comm mode) -> cell of the strategy accuracy benchmark (commlab.lab.strategy.evidence), each with
    none's accuracy (wfbp) from the same result."""
    data = evidence.strategy_results() if data is None else data
    if not data:
        return {}
    base = next((c for c in data.get("cells", []) if c.get("reference")), None)
    out = {}
    for c in data.get("cells", []):
        if c.get("acc") is not None and base is not None and base.get("acc") is not None:
            out[(c["key"], c["comm"])] = dict(c, base_acc=base["acc"], steps=data.get("steps"), file=data["file"])
    return out


def penalty_from_strategy_bench(comp: dict, mode: str, cells) -> Optional[Tuple[Optional[float], str]]:
    """From bench/strategy_accuracy.py: the same compressor section in the same comm mode."""
    mine = cells.get((compressor_key(comp), mode))
    if mine is None:
        return None
    return _verdict(mine["acc"], mine["base_acc"],
                    f"{mine['file']}, cnn on digits, {mine['steps']} steps, {mode}")


def declared_default(comp: dict, cells) -> Tuple[float, str]:
    """The advisor's own default penalty, with its reason, where nothing was measured and nobody declared one:
    source ``default`` (the table's PENALTY FROM column), not ``declared``, which is only the user's."""
    name = comp["name"]
    if name == "none":
        return 1.0, "default: the reference"
    from commlab.engine import compressors
    if compressors.make(name).capabilities.lossless:
        return 1.0, "default: a cast that decodes to the input up to its rounding"
    p = comp.get("params") or {}
    if name == "topk" and comp.get("error_feedback"):
        ref = cells.get(("topk", True))
        if ref and p.get("ratio", 0) >= 0.01 and ref["acc"] >= cells.get(("none", False), ref)["acc"] - KEEP_POINTS:
            return 1.0, "default: top-k +EF at 1% kept accuracy in the benchmark; a larger ratio keeps more"
    if name == "powersgd":
        ref = cells.get(("powersgd", False))
        if ref and p.get("rank", 1) >= 1 and ref["acc"] >= cells.get(("none", False), ref)["acc"] - KEEP_POINTS:
            return 1.0, "default: PowerSGD rank 1 kept accuracy in the benchmark; a higher rank keeps more"
    return 1.25, ("default: nothing measured or declared; a lossy compressor assumed to need 25% more steps "
                  f"(declare one: --penalty {name}=X)")


def method_penalty(spec: dict, method: dict, runs=None, declared: Optional[Dict[str, float]] = None,
                   target: Optional[float] = None) -> Tuple[Optional[float], str]:
    """(penalty, source) for a method section: the user's declared value (by its name or ``method_key``), else
    its steps to accuracy against DDP's from runs in the index; else None: listed, never chosen."""
    for k in (method_key(method), method["name"]):
        if declared and k in declared:
            return float(declared[k]), f"declared by the user ({k}={declared[k]:g})"
    found = penalty_from_runs(spec, comp_section("none"), runs, method, target)
    if found is not None:
        return found
    return None, (f"no runs, not chosen: no finished run of {method_key(method)} beside a DDP run of this model "
                  f"(world {spec['world_size']}) in the index to measure its steps to accuracy; run both, or "
                  f"declare one: --penalty {method['name']}=X")


def penalty(spec: dict, comp: dict, runs=None, declared: Optional[Dict[str, float]] = None,
            cells=None, mode: str = "wfbp", strategies=None, target: Optional[float] = None
            ) -> Tuple[Optional[float], str]:
    """(penalty, source) for the compressor section ``comp`` in comm ``mode`` on the spec's model: the user's
    declared value first, then runs in the index, then the strategy benchmark (mixed sections, dear with a
    compressed reduce-scatter), then the accuracy benchmark, then the advisor's default. A mixed
    section nothing measured takes the worst of its parts' penalties (source ``parts``). A method's penalty
    is ``method_penalty``'s."""
    key = compressor_key(comp)
    for k in (key, comp["name"]):
        if declared and k in declared:
            return float(declared[k]), f"declared by the user ({k}={declared[k]:g})"
    rules = comp.get("per_bucket") or []
    if comp["name"] == "none" and not rules:
        return 1.0, "the reference"
    found = penalty_from_runs(spec, comp, runs, None, target)
    if found is not None:
        return found
    strategies = strategy_cells() if strategies is None else strategies
    found = penalty_from_strategy_bench(comp, mode, strategies)
    if found is not None:
        return found
    cells = benchmark_cells() if cells is None else cells
    if rules:
        from commlab.engine.compressors.plan import parts
        each = [(compressor_key(p), penalty(spec, p, runs, declared, cells, mode, strategies, target))
                for p in parts(comp)]
        if any(p is None for _, (p, _) in each):
            k, (_, why) = next(e for e in each if e[1][0] is None)
            return None, f"parts: {k} is left out ({why.split(':')[0]})"
        k, (worst, why) = max(reversed(each), key=lambda e: e[1][0])  # ties: the section's own compressor
        unproven = [k for k, (_, w) in each if not is_proven(w)]
        return worst, (f"parts{', unproven' if unproven else ''}: the worst of its compressors' penalties, {k}'s "
                       f"({why.split(':')[0]})" + (f"; not shown on this model: {', '.join(unproven)}"
                                                   if unproven else ""))
    return penalty_from_benchmark(comp, cells) or declared_default(comp, cells)


def spec_penalty(spec: dict, runs=None, target: Optional[float] = None) -> Tuple[Optional[float], str]:
    """(penalty, source) of a spec's own strategy: its method's (``method_penalty``) or its compressor's in its
    comm mode (``penalty``). What the performance model's what-if table divides its speedup by."""
    if (spec.get("method") or NO_METHOD)["name"] != "none":
        return method_penalty(spec, spec["method"], runs, None, target)
    return penalty(spec, spec["compressor"], runs, None, None, spec["comm"]["mode"], None, target)


def parse_penalties(items) -> Dict[str, float]:
    """``--penalty topk=1.2`` (a compressor or method name, or a key as the advisor's table prints it) into a
    dict."""
    out = {}
    for item in items or ():
        name, sep, value = str(item).partition("=")
        try:
            v = float(value)
        except ValueError:
            v = None
        if not sep or not name or v is None or not 0.1 <= v <= 100:
            raise SpecError("--penalty", f"expected COMPRESSOR=X with X in [0.1, 100], got {item!r}")
        out[name.strip()] = v
    return out
