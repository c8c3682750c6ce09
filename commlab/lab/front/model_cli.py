"""The performance model's commands of ``commlab``: ``profile`` (a model's per-layer times and gradient sizes),
``predict`` (iteration time, speedup over DDP and scaling on links, clusters and devices this machine lacks) and
``advise`` (a strategy chosen for a spec and a link, and proved with short trials)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import yaml

from commlab.engine.cluster import PRESETS
from commlab.engine.runlog import write_json_atomic
from commlab.engine.spec import MAX_GBPS, SpecError
from commlab.lab.base.errors import LabError
from commlab.lab.base.specs import load_spec, load_yaml
from commlab.lab.front.cli_kit import (
    UsageError,
    add_spec_args,
    command,
    emit,
    in_file,
    json_arg,
    notes,
    numbers,
    one_of,
    out_file,
    runs_arg,
    runs_root,
    store_of,
)
from commlab.room import open_lab
from commlab.lab.strategy import advisor, penalty
from commlab.lab.strategy.advisor import TRIAL_STEPS, TRIALS
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import devices, predict, whatif
from commlab.lab.strategy.perfmodel.calibrate import CalibrationError, compressor_key, spec_key
from commlab.lab.strategy.predictions import LINKS, network_words


def add_commands(sub) -> None:
    """The performance model's parsers, in the order ``commlab --help`` lists them."""
    p = command(sub, "profile", "measure a model's per-layer forward/backward times and gradient sizes into a "
                                "profile file (for commlab predict)",
                ["commlab profile examples/demo.yaml -o cnn.json", "commlab predict cnn.json --workers 8,64"],
                "A single-process run of the spec's model, data set and batch size on this machine.")
    add_spec_args(p, "job spec file (YAML or JSON): model, data set, batch size; its compressor and comm mode "
                     "are what commlab predict PROFILE predicts")
    p.add_argument("-o", "--output", default="profile.json", metavar="FILE",
                   help="profile file to write; its folder must exist")
    p.add_argument("--steps", type=int, default=None, help="steps of the single-process profiling run (default "
                                                           "12, the lab's own; the first 3 are left out)")
    json_arg(p, "the profile")
    runs_arg(p)
    p.set_defaults(func=cmd_profile, cmd_parser=p)

    p = command(sub, "predict", "the performance model: predicted iteration time, speedup over DDP and scaling "
                                "factor", ["commlab predict examples/topk-ef.yaml --gbps 1,10 --workers 8,64",
                                           "commlab predict profile.json --device H100 --workers 8,64",
                                           "commlab predict examples/topk-ef.yaml --cluster node_size=8,"
                                           "intra_gbps=1600,inter_gbps=100 --workers 64",
                                           "commlab predict examples/demo.yaml --cluster three_continents "
                                           "--workers 3,6"],
                "Without --profile or --calibrate, the lab's profile of the model is used (a saved one, one "
                "calibrated from a finished run, or a short single-process run measured now).")
    add_spec_args(p, "a profile file (commlab profile) or a job spec file (YAML or JSON); dear is accepted")
    p.add_argument("--gbps", default=None, metavar="LIST", help="link rates in Gbit/s, comma-separated, each in "
                   f"[0.001, {MAX_GBPS:g}] (default 1,10,100,400); with --cluster: the inter-node rates")
    p.add_argument("--workers", default=None, metavar="LIST", help="worker counts, comma-separated (default "
                   "2,8,64,1024; on a cluster of unequal workers the spec's world size, or the preset's regions "
                   "when it has more)")
    p.add_argument("--cluster", metavar="PRESET|KEY=VALUE,...", default=None,
                   help=f"a cluster of unequal workers on modeled links, by its preset ({', '.join(PRESETS)}: "
                        "each worker's rates, delay, jitter and speed; without --cluster or --gbps a spec's own "
                        "network.cluster is used), or a two-level cluster with hierarchical all-reduce: "
                        "node_size=8,intra_gbps=1600,inter_gbps=100 (optional intra_us, inter_us latencies per "
                        "ring step, nics per node; without inter_gbps, --gbps gives it)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--profile", metavar="FILE", help="a saved profile (JSON)")
    g.add_argument("--calibrate", metavar="RUN", help="calibrate compute from this run's timeline")
    p.add_argument("--link", metavar="FILE", help="alpha and beta from `commlab net check --gbps X --json` output")
    p.add_argument("--compute-speedup", type=float, default=1.0, metavar="X",
                   help="compute X times faster than measured, e.g. 20 for a GPU")
    p.add_argument("--device", metavar="NAME[:PRECISION]", default=None,
                   help="predict on a GPU: V100, V100-PCIE, A100, H100, H200 or a YAML file describing one "
                        "(peak_tflops, memory_gb_s, nvlink_gb_s, ...); compute from the model's roofline on it "
                        "unless the profile was measured there, NCCL links, --gbps the NIC rate")
    json_arg(p, "the table, crossovers and sources")
    runs_arg(p)
    p.set_defaults(func=cmd_predict, cmd_parser=p)

    p = command(sub, "advise", "choose a communication strategy for a spec and a link, then prove it",
                ["commlab advise examples/demo.yaml --gbps 1 --out best.yaml",
                 "commlab advise examples/demo.yaml --gbps 0.1 --measure --target 0.9",
                 "commlab advise examples/demo.yaml --gbps 1 --json > advice.json"],
                "Ranks the strategies by predicted (with --measure, measured) time to accuracy and says why the "
                "winner won.")
    add_spec_args(p, "job spec file (YAML or JSON); its compressor, schedule and comm are what gets chosen")
    p.add_argument("--gbps", type=float, default=None, help=f"link rate in Gbit/s, in [0.001, {MAX_GBPS:g}] "
                                                                       "(default: the spec's link)")
    p.add_argument("--link", default=None, type=one_of("a link", LINKS), choices=LINKS, metavar="LINK",
                   help=f"{' or '.join(LINKS)}: modeled (alpha-beta delays, default with --gbps) or shaped "
                        "(tc on an emulated cluster)")
    p.add_argument("--workers", type=int, default=None, help="worker count (default: the spec's world_size)")
    p.add_argument("--cluster", default=None, type=one_of("a cluster preset", PRESETS), metavar="PRESET",
                   help=f"plan for a cluster of unequal workers on its modeled link: {', '.join(PRESETS)} "
                        "(each worker's rates, delay, jitter and speed; default: the spec's own network.cluster, "
                        "unless --gbps gives one rate)")
    p.add_argument("--measure", nargs="?", const="target", default=None, metavar="target|steps",
                   type=one_of("a kind of measurement", ("target", "steps")),
                   help="target (the default): run the top candidates beside DDP to the target accuracy on the "
                        "link, one run each, and choose by time to it; steps: one short session timing a step "
                        "of each (no accuracy measured)")
    p.add_argument("--target", type=float, default=None, metavar="ACC",
                   help="held-out accuracy to count steps and time to, in (0, 1] (default: 97%% of DDP's best)")
    p.add_argument("--target-steps", type=int, default=None, metavar="N",
                   help="--measure target: steps a trial may train at most (default: the spec's steps)")
    p.add_argument("--trials", type=int, default=TRIALS, help="candidates tried with --measure (besides DDP)")
    p.add_argument("--trial-steps", type=int, default=TRIAL_STEPS,
                   help="--measure steps: steps per trial (PowerSGD's uncompressed start is added)")
    p.add_argument("--penalty", action="append", default=[], metavar="COMPRESSOR=X",
                   help="declare a convergence penalty (steps to accuracy vs none), e.g. topk=1.3 (repeatable)")
    p.add_argument("--candidate", action="append", default=[], metavar="COMPRESSOR",
                   help="rank this compressor too: a name or package.module:Class, or a section in YAML such as "
                        "'{name: mypkg.codecs:ScaledSign, scale: 0.5}' (repeatable; the spec's own compressor "
                        "joins by itself when it names code)")
    p.add_argument("--top", type=int, default=12, help="rows of the table to print (0: all)")
    p.add_argument("-o", "--out", default=None, metavar="FILE", help="write the winner as a spec (YAML); its "
                                                                     "folder must exist")
    p.add_argument("--json-out", default=None, metavar="FILE", help="write the whole advice as JSON to FILE")
    json_arg(p, "the whole advice")
    runs_arg(p)
    p.set_defaults(func=cmd_advise, cmd_parser=p)


def cmd_profile(args) -> int:
    if args.steps is None:
        args.steps = whatif.PROFILE_STEPS
    if not 5 <= args.steps <= 10000:
        raise UsageError(f"--steps: must be in 5..10000, got {args.steps}")
    out_file("--output", args.output)
    spec = load_spec(args.spec, args.overrides).to_dict()
    say = notes(args)
    print(f"profile: {spec['model']['name']} on {spec['dataset']['name']}, batch {spec['batch_size']}: a "
          f"{args.steps}-step single-process run", file=say, flush=True)
    try:
        prof = whatif.profile_spec(spec, runs_root(args), args.steps, runner=open_lab(runs_root(args)).runner())
    except CalibrationError as e:
        raise LabError(str(e)) from None
    prof.save(args.output)
    if args.json:
        emit({"output": args.output, "profile": dataclasses.asdict(prof)})
        return 0
    m = prof.machine
    print(f"measured on {m.get('host')} ({m.get('gpu') or m.get('cpu')}), {m.get('device')}, torch {m.get('torch')}, "
          f"{m.get('threads')} thread(s), {m.get('dtype')}, {m.get('clock')}, from {prof.source}")
    grad = sum(b for _, b in prof.params)
    print(f"forward {prof.forward_s * 1e3:.2f} ms, backward {prof.backward_s * 1e3:.2f} ms, optimizer "
          f"{prof.optimizer_s * 1e3:.2f} ms per step; {len(prof.params)} tensors, {grad / 2**20:.2f} MiB of gradients")
    slow = sorted(prof.layer_backward.items(), key=lambda kv: -kv[1])[:5]
    if slow:
        print("slowest layers in backward: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in slow))
    note = cal.disturbed_note(prof.disturbance)
    if note:
        print(f"DISTURBED: {note}")
    print(f"wrote {args.output} (commlab predict {args.output})")
    return 0


def cmd_predict(args) -> int:
    from commlab.lab.strategy.perfmodel import ondevice  # the roofline loads torch: not for commlab --help
    say = notes(args)

    def info(line: str) -> None:
        print(line, file=say, flush=True)
    workers = numbers("--workers", args.workers, int, 1, 100000) if args.workers else None
    if not 0.001 <= args.compute_speedup <= 10000:
        raise UsageError(f"--compute-speedup: must be in [0.001, 10000], got {args.compute_speedup}")
    preset = cluster_preset(args)
    # with --device, the device gives the node's size and fabric: --cluster may change any of them
    shape = (whatif.parse_cluster(args.cluster, required=() if args.device else None)
             if args.cluster and preset is None else None)
    if workers is None and (shape or args.device or args.gbps or args.link):  # no cluster of unequal workers
        workers = numbers("--workers", WORKERS, int, 1, 100000)
    if shape and "inter_gbps" in shape:
        if args.gbps is not None:
            raise UsageError("--gbps and --cluster inter_gbps both give the inter-node rate; give one")
        gbps = [shape["inter_gbps"]]
    else:
        gbps = numbers("--gbps", args.gbps or "1,10,100,400", float, 0.001, MAX_GBPS)
    dev = None
    if args.device:
        if args.compute_speedup != 1.0 or args.link:
            raise UsageError("--device models the device's compute and links; "
                             "--compute-speedup and --link are for a measured profile")
        try:
            dev, precision = devices.parse(args.device)
        except ValueError as e:
            raise UsageError(str(e)) from None
        for p in workers:
            try:
                ondevice.topology(dev, 1.0, shape).nodes(p)
            except ValueError as e:
                raise SpecError("--workers", str(e).split(": ", 1)[1]) from None
    elif shape:
        whatif.check_workers(shape, workers)
    if args.link and (shape or preset):
        raise UsageError("--link calibrates a flat link; --cluster gives its own links")
    link_cal = whatif.link_file(in_file("--link", args.link)) if args.link else None  # read before any profiling run
    if args.profile:
        in_file("--profile", args.profile)
    if whatif.is_profile_file(args.spec):
        if args.profile or args.calibrate:
            raise UsageError("PROFILE is a profile already; --profile and --calibrate are for a SPEC")
        prof = whatif.load_profile_file(args.spec)
        if not prof.spec:
            raise SpecError("PROFILE", f"{args.spec} records no spec (not written by commlab profile); use "
                                       f"commlab predict SPEC --profile {args.spec}")
        spec = whatif.load_for_prediction(data=prof.spec, overrides=args.overrides)
        if prof.key() != spec_key(spec):
            raise SpecError("--set", f"the profile is for {prof.key()}, the spec is now {spec_key(spec)}")
        m = prof.machine
        rings = cluster_rings_for(args, spec, preset, workers)
        info(f"profile: {args.spec} ({prof.source}" + (f", {m.get('device')} on {m.get('host')}, torch "
                                                      f"{m.get('torch')}" if m else "") + ")")
        if whatif.ensure_curves(prof, [spec]):
            prof.save(args.spec)
            info(f"profile: measured the compressor's encode/decode cost curve, added to {args.spec}")
    else:
        spec = whatif.load_for_prediction(args.spec, args.overrides)
        rings = cluster_rings_for(args, spec, preset, workers)  # refused before anything is measured
        if args.calibrate:
            store_of(args).get(args.calibrate)  # a missing run is said before anything is measured
        try:
            prof = whatif.resolve_profile(spec, runs_root(args), args.profile, args.calibrate, say=info,
                                          runner=open_lab(runs_root(args)).runner())
        except CalibrationError as e:
            raise LabError(str(e)) from None
    if link_cal is not None:
        prof.link = link_cal
    if workers is None and not rings:  # the spec gives no cluster either: the flat link's table
        workers = numbers("--workers", WORKERS, int, 1, 100000)
    links = node_size = None
    if dev is not None and spec["method"]["name"] != "none" and predict.method_of(spec).codec() is not None:
        raise SpecError("--device", f"method {spec['method']['name']} brings its own codec, whose cost on a GPU "
                                    "is not modeled; predict it without --device")
    if dev is not None:
        prof = ondevice.device_profile(prof, spec, dev, precision, say=info)
        links, node_size = ondevice.link_maker(dev, shape), ondevice.topology(dev, gbps[0], shape).gpus_per_node
        link = ondevice.topology(dev, gbps[0], shape).describe().replace(
            f"x {gbps[0] * dev.link_eff:g} Gbit/s", "x the GBIT/S column")
    elif rings:
        link = "modeled " + "; ".join(r.describe() for r in rings.values())
    elif shape:
        link = "two-level cluster, hierarchical all-reduce: " + whatif.cluster_at(shape, gbps[0]).describe()
        if "inter_gbps" not in shape:
            link = link.replace(f", {gbps[0]:g} between", ", the GBIT/S column between")
    else:
        link = (f"calibrated at {prof.link['nominal_gbps']:g} Gbit/s and scaled" if prof.link
                else "nominal alpha-beta (alpha 0, beta 8/rate; no link calibrated)")
    c, meth = spec["compressor"], spec["method"]
    setup = (f"{spec['model']['name']} batch {spec['batch_size']}, {c['name']}{' +EF' if c['error_feedback'] else ''}"
             f", {spec['schedule']['name']}, {spec['comm']['mode']}"
             + (f", method {method_label(meth)} (SPEC ms: the mean step over the run's {spec['steps']} steps, its syncs "
                f"amortized)" if meth["name"] != "none" else "")
             + f"; vs DDP (none, bucket 25 MB, wfbp); link: {link}; "
             + (f"device {dev.name} {precision}" if dev else f"compute x{args.compute_speedup:g}"))
    rows = (whatif.cluster_table(prof, spec, rings, args.compute_speedup) if rings else
            whatif.table(prof, spec, gbps, workers, args.compute_speedup, cluster=shape, links=links))
    pen, pen_source = penalty.spec_penalty(spec, runs_root(args))
    whatif.with_penalty(rows, pen, penalty.is_proven(pen_source))
    to_target = ("TO TARGET: SPEEDUP / the strategy's convergence penalty "
                 + (f"{pen:g} ({penalty.evidence_words(pen_source)}: {pen_source})" if pen else
                    f"(none known: {pen_source})")
                 + ("" if not pen or penalty.is_proven(pen_source) else "; '?': not evidence for this model"))
    if rings:
        crossovers = [f"{r['workers']} workers: none on a cluster (its links are its own, no rate to vary): "
                      f"{r['speedup']:.2f}x DDP on them" for r in rows]
        workers = list(rings)
    else:
        crossovers = [whatif.crossover_line(prof, spec, p, args.compute_speedup, cluster=shape, links=links,
                                            node_size=node_size) for p in workers]
    sources = ondevice.sources(prof, spec, dev, precision if dev else "", args.compute_speedup,
                               link=CLUSTER_SOURCE if rings else "", cluster=bool(shape))
    rate = "cluster" if rings else "inter-node" if shape or dev else "flat"
    if args.json:
        emit({"setup": setup, "rate": rate, "rows": rows,
              "penalty": {"value": pen, "source": pen_source, "evidence": penalty.evidence_words(pen_source),
                          "proven": bool(pen) and penalty.is_proven(pen_source)},
              "crossover": dict(zip(map(str, workers), crossovers)), "sources": list(sources)})
        return 0
    print("spec: " + setup)
    for line in whatif.format_table(rows, {"cluster": "SLOWEST GBIT/S", "flat": "GBIT/S"}.get(rate, "INTER GBIT/S")):
        print(line)
    print(to_target)
    for line in crossovers:
        print(("crossover (inter-node rate): " if shape or dev else "crossover: ") + line)
    print("sources:")
    for line in sources:
        print("  " + line)
    return 0


WORKERS = "2,8,64,1024"
"""``commlab predict --workers``'s default on a flat or two-level link."""
CLUSTER_SOURCE = ("each worker's rates, delay and jitter (commlab.engine.cluster), a ring step as slow as its "
                  "slowest hop (jitter: its expected maximum), compute the slowest worker's (commlab.lab.strategy."
                  "perfmodel.uneven); as the engine's modeled cluster link")


def cluster_preset(args) -> Optional[str]:
    """``commlab predict --cluster``'s preset when it names one (no ``=``: not a two-level cluster), checked
    against what goes with it; None otherwise."""
    text = args.cluster
    if not text or "=" in text:
        return None
    if text not in PRESETS:
        raise UsageError(f"--cluster: {text!r} is not a cluster preset; allowed: {', '.join(PRESETS)}, or KEY=VALUE,... "
                         "of a two-level cluster (node_size=8,intra_gbps=1600,inter_gbps=100)")
    if args.gbps is not None:
        raise UsageError("--cluster: a preset gives each worker's rate; give --cluster or --gbps, not both")
    if args.device:
        raise UsageError("--cluster: a preset's workers are on modeled links; --device models NCCL's links, with "
                         "--cluster KEY=VALUE,... for its nodes")
    return text


def cluster_rings_for(args, spec: dict, preset, workers):
    """The rings ``commlab predict`` predicts on, worker count -> ClusterRing (commlab.lab.strategy.perfmodel.uneven):
    the preset's (``--cluster PRESET``), else the spec's own ``network.cluster`` when no option gives a rate, a
    link or a device and the cluster has rates (not on loopback); None for the flat or two-level links. Without
    ``--workers``: the spec's world size, or the preset's regions when it has more."""
    net = spec["network"]
    if preset is not None:
        section = {"preset": preset}
    elif (net.get("cluster") and net["link"] != "loopback" and not (args.gbps or args.cluster or args.device
                                                                     or args.link)):
        section = net["cluster"]
    else:
        return None
    if workers is None:
        regions = len(PRESETS[section["preset"]]["workers"]) if section.get("preset") else 1
        workers = [max(spec["world_size"], regions)]
    return whatif.cluster_rings(section, workers, "--cluster" if preset is not None else "--workers")


def method_label(section: dict) -> str:
    """A spec's method section in one phrase: ``diloco(H=50,outer_lr=0.7,...)`` and its compressor, if any."""
    ps = ",".join(f"{k}={v}" for k, v in (section.get("params") or {}).items())
    comp = section.get("compressor") or {}
    return (f"{section['name']}({ps})" + (f" with {compressor_key(comp)}" if comp and comp["name"] != "none" else ""))


def parse_candidate(text: str) -> dict:
    """``--candidate``: a compressor name or import path, or a YAML mapping (a spec's compressor section), in
    the full form the spec gives it; a one-line SpecError naming --candidate otherwise."""
    raw = text.strip()
    try:
        section = load_yaml(raw) if raw.startswith("{") else raw
    except yaml.YAMLError as e:
        raise SpecError("--candidate", f"{text!r} is not valid YAML: {str(e).strip().splitlines()[0]}") from None
    try:
        return load_spec(data={"compressor": section}).to_dict()["compressor"]
    except SpecError as e:
        raise SpecError("--candidate", f"{text}: {e}") from None


def write_spec(spec: dict, path) -> Path:
    """The winner of an advice as a spec file (YAML); its folder must exist (``out_file`` checked it)."""
    path = Path(path)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def cmd_advise(args) -> int:
    for option in ("out", "json_out"):
        if getattr(args, option):
            out_file("--" + option.replace("_", "-"), getattr(args, option))
    spec = whatif.load_for_prediction(args.spec, args.overrides)
    extra = [parse_candidate(c) for c in args.candidate]
    if args.top < 0:
        raise SpecError("--top", f"must be >= 0, got {args.top}")
    say = notes(args)
    if args.target_steps is not None and args.measure != "target":
        raise UsageError("--target-steps: only with --measure target (the to-target trials)")
    adv = advisor.advise(spec, runs_root(args), args.gbps, args.link, args.workers, bool(args.measure), args.trials,
                         args.trial_steps, penalty.parse_penalties(args.penalty),
                         runner=open_lab(runs_root(args)).runner(), candidates=extra,
                         say=lambda line: print(line, file=say, flush=True), target=args.target,
                         to_target=args.measure == "target", target_steps=args.target_steps,
                         **({"cluster": args.cluster} if args.cluster else {}))
    print(f"advice for {spec['model']['name']} batch {spec['batch_size']}, {adv.world} workers, "
          f"{network_words(adv.network)}; link: {adv.link_source}; profile: {adv.profile_source}", file=say)
    for line in advisor.format_table(adv, args.top or None):
        print(line, file=say)
    print(f"winner ({adv.chosen_by}): {adv.reason}", file=say)
    c = adv.cost_s
    print(f"advisor cost: {c['total']:.1f} s (profile and cost curves {c['profile']:.1f} s, predictions "
          f"{c['predict']:.1f} s, trials {c['trials']:.1f} s)", file=say)
    for i, cand in enumerate(adv.ranked(), 1):  # the rows format_table shows: the top ones and every method
        if cand.note and (not args.top or i <= args.top or cand.local):
            print(f"note: {cand.label}: {cand.note}", file=say)
    if args.out:
        print(f"wrote {write_spec(adv.winner_spec(), args.out)}", file=say)
    if args.json_out:
        write_json_atomic(args.json_out, adv.as_dict())
        print(f"wrote {args.json_out}", file=say)
    if args.json:
        emit(adv.as_dict())
    return 0
