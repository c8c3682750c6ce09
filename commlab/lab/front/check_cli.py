"""``commlab check compressor NAME``: the conformance checks every built-in passes, then the compressor's cost
curve beside the built-ins' and where it would pay for a model.

    commlab check compressor mypkg.codecs:ScaledSign --param scale=0.5 --model resnet --gbps 0.1,1,10

The checks are commlab.engine.compressors.conformance (simulated ranks, no process group); the costs and the
predictions are commlab.lab.strategy.payoff on the model's profile (a saved one, a finished run of that model in the
index, or a short single-process run measured now through the lab's queue). Exit status: 0 when every
check passes, 1 when one fails, 2 for a name that does not resolve or parameters its declaration refuses.
"""
from __future__ import annotations

import json
import sys
from typing import List

import yaml

from commlab.engine.spec import SpecError
from commlab.lab.base.specs import load_spec, load_yaml
from commlab.lab.front.cli_kit import numbers
from commlab.room import open_lab
from commlab.lab.strategy import payoff
from commlab.lab.strategy.perfmodel import whatif


def add_arguments(q) -> None:
    """The arguments of ``commlab check compressor`` (the parser itself is commlab.lab.front.cli's)."""
    q.add_argument("name", metavar="NAME", help="a registered compressor name, or package.module:Class on PYTHONPATH")
    q.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter the class declares, e.g. --param ratio=0.05 (repeatable; YAML values)")
    q.add_argument("--error-feedback", action="store_true", help="predict it with error feedback on")
    q.add_argument("--model", default="resnet", help="the model it would train: one of the zoo's, on a shipped "
                                                     "data set it takes")
    q.add_argument("--batch-size", type=int, default=32, help="per rank")
    q.add_argument("--profile", default=None, metavar="FILE", help="a profile file (commlab profile) instead")
    q.add_argument("--gbps", default=",".join(f"{g:g}" for g in payoff.GBPS), help="link rates in Gbit/s")
    q.add_argument("--workers", default=",".join(map(str, payoff.WORKERS)), help="worker counts")
    q.add_argument("--device", default="cpu", help="where the checks' tensors live: cpu, or cuda / cuda:N on a GPU "
                   "(the costs and payoff are measured on the CPU either way)")
    q.add_argument("--checks-only", action="store_true", help="the conformance checks alone (no costs, no model)")


def parse_params(items) -> dict:
    out = {}
    for item in items or ():
        key, eq, raw = str(item).partition("=")
        key = key.strip()
        if not eq or not key:
            raise SpecError("--param", f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError:
            out[key] = raw
    return out


def check_device(text: str):
    """--device as a torch device that exists here, or one line naming the flag."""
    import torch
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise SpecError("--device", f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise SpecError("--device", f"expected cpu, cuda or cuda:N, got {text!r}")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (dev.index or 0) >= have:
        raise SpecError("--device", f"{text} is not on this machine ({have} CUDA device(s))")
    return dev


def model_spec(model: str, batch_size: int) -> dict:
    """The spec the profile is for: a zoo model on a data set it trains on, uncompressed."""
    from commlab.engine import models  # torch: only for this command, not for `commlab --help`
    if model not in models.NAMES:
        raise SpecError("--model", f"unknown model {model!r}; allowed: {', '.join(models.NAMES)} (or --profile FILE)")
    dataset = "text" if models.kind(model) == "text" else "digits"
    return load_spec(data={"name": f"check {model}", "model": model, "dataset": dataset,
                           "batch_size": batch_size}).to_dict()


def cmd_check(args) -> int:
    from commlab.engine.compressors import conformance  # torch: only for this command, not for `commlab --help`
    params = parse_params(args.param)
    section = payoff.section(args.name, params, args.error_feedback)
    spec = None
    if not args.checks_only:  # bad arguments fail before anything is measured
        gbps = numbers("--gbps", args.gbps, float, 0.001, 400)
        workers = numbers("--workers", args.workers, int, 2, 1024)
        if args.profile is None:
            spec = model_spec(args.model, args.batch_size)
    try:  # the name and parameters as a spec would take them: one line naming the field
        load_spec(data={"compressor": {"name": args.name, "error_feedback": args.error_feedback, "params": params}})
    except SpecError as e:
        raise SpecError("--param" if e.path == "compressor" else "NAME", e.msg) from None
    out = sys.stderr if args.json else sys.stdout

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    results = conformance.check(args.name, params, device=check_device(args.device))
    ok = conformance.passed(results)
    report = {"compressor": args.name, "params": params, "passed": ok, "checks": [r.as_dict() for r in results]}
    if not args.json:
        print(f"checks of {args.name}{'(' + ', '.join(f'{k}={v}' for k, v in params.items()) + ')' if params else ''}")
        for line in conformance.table(results):
            print(line)
        n = conformance.summary(results)
        print(f"{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} not applicable")
    if ok and not args.checks_only:
        report.update(_payoff(args, section, spec, gbps, workers, say))
    elif not ok and not args.checks_only:
        say("costs and payoff: not measured until every check passes")
    if args.json:
        print(json.dumps(report, indent=1))
    return 0 if ok else 1


def _payoff(args, section: dict, spec, gbps: List[float], workers: List[int], say) -> dict:
    lab = open_lab(args.runs)
    if args.profile:
        prof = whatif.load_profile_file(args.profile, "--profile")
        spec = prof.spec or model_spec(prof.model, prof.batch_size)
    else:
        prof = whatif.resolve_profile(spec, args.runs, say=say, runner=lab.runner())
    others = payoff.builtin_sections()
    say(f"measuring cost curves ({payoff.label_of(section)} now; the built-ins' where this machine has none)")
    payoff.ensure(prof, section, others, args.runs)
    costs = payoff.cost_table(prof, section, others)
    grid = payoff.payoff_grid(prof, spec, section, others, gbps, workers)
    lines = payoff.verdict(grid)
    if not args.json:
        print("\ncost per exchange, measured here (one thread, fp32):")
        for line in payoff.format_costs(costs):
            print(line)
        print(f"\npredicted ms per step for {prof.key()} ({prof.source}), 25 MB buckets, wfbp, modeled link:")
        for line in payoff.format_grid(grid):
            print(line)
        print("\nwhere it pays (iteration time only; accuracy is not predicted):")
        for line in lines:
            print(f"  {line}")
    return {"profile": prof.key(), "costs": costs, "grid": grid, "verdict": lines}
