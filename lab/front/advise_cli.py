"""``commlab advise``: its arguments and what it prints (the advisor itself is lab.strategy.advisor)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from engine.spec import SpecError
from lab.base.specs import load_spec
from lab.service.queue import Lab
from lab.strategy.advisor import LINKS, TRIAL_STEPS, TRIALS, advise, format_table, parse_penalties
from lab.strategy.perfmodel import whatif


def write_spec(spec: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def add_parser(sub, add_spec_args, runs_arg) -> None:
    p = sub.add_parser("advise", help="choose a communication strategy for a spec and a link, then prove it")
    add_spec_args(p, "job spec file (YAML or JSON); its compressor, schedule and comm are what gets chosen")
    p.add_argument("--gbps", type=float, default=None, help="link rate in Gbit/s (default: the spec's link)")
    p.add_argument("--link", choices=LINKS, default=None,
                   help="modeled (alpha-beta delays, default with --gbps) or shaped (tc on an emulated cluster)")
    p.add_argument("--workers", type=int, default=None, help="worker count (default: the spec's world_size)")
    p.add_argument("--measure", action="store_true", help="run short trials of the top candidates, choose by them")
    p.add_argument("--trials", type=int, default=TRIALS, help=f"candidates tried with --measure (default {TRIALS})")
    p.add_argument("--trial-steps", type=int, default=TRIAL_STEPS,
                   help=f"steps per trial (default {TRIAL_STEPS}; PowerSGD's uncompressed start is added)")
    p.add_argument("--penalty", action="append", default=[], metavar="COMPRESSOR=X",
                   help="declare a convergence penalty (steps to accuracy vs none), e.g. topk=1.3 (repeatable)")
    p.add_argument("--candidate", action="append", default=[], metavar="COMPRESSOR",
                   help="rank this compressor too: a name or package.module:Class, or a section in YAML such as "
                        "'{name: mypkg.codecs:ScaledSign, scale: 0.5}' (repeatable; the spec's own compressor "
                        "joins by itself when it names code)")
    p.add_argument("--top", type=int, default=12, help="rows of the table to print (default 12; 0: all)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the winner as a spec (YAML)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the whole advice as JSON")
    runs_arg(p)


def parse_candidate(text: str) -> dict:
    """``--candidate``: a compressor name or import path, or a YAML mapping (a spec's compressor section), as
    the spec takes it and in its full form; a one-line SpecError naming --candidate otherwise."""
    raw = text.strip()
    try:
        section = yaml.safe_load(raw) if raw.startswith("{") else raw
    except yaml.YAMLError as e:
        raise SpecError("--candidate", f"{text!r} is not valid YAML: {str(e).strip().splitlines()[0]}") from None
    try:
        return load_spec(data={"compressor": section}).to_dict()["compressor"]
    except SpecError as e:
        raise SpecError("--candidate", f"{text}: {e}") from None


def cmd_advise(args) -> int:
    spec = whatif.load_for_prediction(args.spec, args.overrides)
    extra = [parse_candidate(c) for c in args.candidate]
    if args.top < 0:
        raise SpecError("--top", f"must be >= 0, got {args.top}")
    adv = advise(spec, args.runs, args.gbps, args.link, args.workers, args.measure, args.trials,
                 args.trial_steps, parse_penalties(args.penalty), runner=Lab(args.runs).runner(), candidates=extra)
    net = adv.network
    print(f"advice for {spec['model']['name']} batch {spec['batch_size']}, {adv.world} workers, "
          f"{net['link']} {net['gbps']:g} Gbit/s; link: {adv.link_source}; profile: {adv.profile_source}")
    for line in format_table(adv, args.top or None):
        print(line)
    print(f"winner ({adv.chosen_by}): {adv.reason}")
    c = adv.cost_s
    print(f"advisor cost: {c['total']:.1f} s (profile and cost curves {c['profile']:.1f} s, predictions "
          f"{c['predict']:.1f} s, trials {c['trials']:.1f} s)")
    for cand in adv.ranked()[:args.top or None]:
        if cand.note:
            print(f"note: {cand.label}: {cand.note}")
    if args.out:
        print(f"wrote {write_spec(adv.winner_spec(), args.out)}")
    if args.json:
        Path(args.json).write_text(json.dumps(adv.as_dict(), indent=1))
        print(f"wrote {args.json}")
    return 0
