"""Fusion schedules: layerwise vs bucket vs mergecomp vs layerfusion, per compressor.

    .venv/bin/python bench/fusion.py                  # loopback
    .venv/bin/python bench/fusion.py --gbps 1         # one emulated 1 Gbit cluster (root)

One invocation runs, on ``resnet`` at world size 2, every compressor (top-k 1% +
EF, DGC 1%, EF-signSGD, QSGD) with every schedule (``layerwise``, ``bucket``
25 MB, ``mergecomp``, ``layerfusion``), plus a compute-only variant (no
communication; the single-process reference of the scaling factor). It does so
at each per-rank batch of ``--batches``: the default 32 (about 260 ms of CPU
compute) and 4 (about 40 ms: the per-call costs then weigh as they do on a GPU).

Within a batch setting all variants are stepped one iteration at a time in a
rotating order, so load on the machine hits them alike. ``mergecomp`` and
``layerfusion`` tune inside their first steps exactly as in a run
(commlab/engine/tuners/ driver, each variant with its own run directory, so the
search trace lands in its ``tuning.json``); those steps train and count in the
time to target, but the iteration-time median is taken over the steps after
tuning ended.

Reported per variant: median ms/iteration (slower rank), the ratio to
layerwise, the scaling factor (compute-only ms / ms: throughput of 2 ranks over
twice one rank's, same per-rank batch), steps and measured seconds (sum of
iteration times, evaluation excluded) to the target accuracy, the best held-out
accuracy, and for the tuned schedules the buckets chosen and steps spent tuning.

Data: the bundled MNIST images padded to 3x32x32 (bench/network.py ``mnist32``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

COMPRESSORS = {  # name -> (compressor, parameters, SGD momentum: DGC keeps its own)
    "topk": ("topk", {"ratio": 0.01, "error_feedback": True}, 0.9),
    "dgc": ("dgc", {"ratio": 0.01}, 0.0),
    "efsignsgd": ("efsignsgd", {}, 0.9),
    "qsgd": ("qsgd", {}, 0.9),
}
SCHEDULES = ("layerwise", "bucket", "mergecomp", "layerfusion")
TARGET_SPEEDUP = 2.0  # mergecomp vs layerwise per iteration at the small batch, for >= 2 compressors


def _csv(s, cast=str):
    return [cast(x) for x in s.split(",") if x]


class Variant:
    def __init__(self, name, comp, sched, trainer_parts):
        self.name, self.comp, self.sched = name, comp, sched
        self.model, self.opt, self.dp, self.tuning, self.sampler, self.tl = trainer_parts
        self.steps = 0
        self.tuned_at = 0 if self.tuning is None or self.tuning.done else None  # step count when tuning ended

    def step(self, ds):
        from commlab.engine import models
        x, y = ds.batch("train", next(self.sampler))
        t0 = self.tl.now()
        loss = models.loss_fn(self.model(x), y)
        tb = self.tl.now()
        loss.backward()
        if self.dp is not None:
            self.dp.finish()
        self.opt.step()
        if self.dp is not None:
            self.dp.zero_grad()
        else:
            self.opt.zero_grad()
        loss.item()
        dt = self.tl.now() - t0
        self.steps += 1
        if self.tuning is not None and not self.tuning.done:
            self.tuning.after_step(dt, tb)
            if self.tuning.done:
                self.tuned_at = self.steps
        return dt


def build(args, batch, rank, world, root, ds):
    import functools

    import torch
    from commlab.engine import compressors, data, models
    from commlab.engine.comm.wfbp import WFBP
    from commlab.engine.spec import JobSpec
    from commlab.engine.timeline import Timeline
    from commlab.engine.stepper import schedule_fn
    from commlab.engine import tuners
    net = {"link": "shaped", "gbps": args.gbps} if args.gbps else {"link": "loopback"}
    search = {"warmup_steps": args.warmup, "steps_per_candidate": args.per_candidate,
              "max_groups": args.max_groups, "max_candidates": args.candidates, "retune": True}
    out = {}
    names = ["compute"] + [f"{c}/{s}" for c in args.compressors for s in args.schedules]
    for name in names:  # same order on every rank: WFBP broadcasts at construction
        torch.manual_seed(0)
        m = models.build("resnet", ds.info)
        tl = Timeline(None, rank, enabled=False)
        sampler = data.ShardSampler(ds.size("train"), batch, rank, world, seed=0)
        if name == "compute":
            opt = torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9)
            out[name] = Variant(name, None, None, (m, opt, None, None, sampler, tl))
            continue
        cname, sname = name.split("/")
        comp, params, momentum = COMPRESSORS[cname]
        opts = {"cap_mb": 25.0} if sname == "bucket" else {}
        sched = {"name": sname, **opts, **(search if sname == "mergecomp" else {}),
                 **({"profile_steps": args.profile_steps} if sname == "layerfusion" else {})}
        spec = JobSpec.from_dict({"name": name, "model": "resnet", "dataset": "mnist", "batch_size": batch,
                                  "optimizer": {"name": "sgd", "lr": args.lr, "momentum": momentum},
                                  "compressor": {"name": comp, **params}, "schedule": sched,
                                  "network": net, "comm": "wfbp"})
        dp = WFBP(m, schedule_fn(spec), functools.partial(compressors.make, comp, **params), timeline=tl)
        opt = torch.optim.SGD(m.parameters(), lr=args.lr, momentum=momentum)
        tuning = None
        if sname in ("mergecomp", "layerfusion"):
            run_dir = os.path.join(root, f"b{batch}-{cname}-{sname}")
            if rank == 0:
                os.makedirs(run_dir, exist_ok=True)
            tuning = tuners.start(spec, dp, run_dir, tl)
        out[name] = Variant(name, cname, sname, (m, opt, dp, tuning, sampler, tl))
    return out


def run_setting(args, batch, steps, eval_every, rank, world, root, ds, eval_idx, say):
    import torch.distributed as dist
    from bench.network import evaluate
    variants = build(args, batch, rank, world, root, ds)
    names = list(variants)
    rec = {n: {"t": [], "acc": []} for n in names}
    t_start = time.time()
    for r in range(steps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            v = variants[name]
            dist.barrier()
            rec[name]["t"].append(v.step(ds))
            if name != "compute" and (v.steps % eval_every == 0 or v.steps == steps):
                rec[name]["acc"].append((v.steps, evaluate(v, ds, eval_idx, rank, world)))
        if (r + 1) % 10 == 0 or r + 1 == steps:
            say(f"[b{batch}] step {r + 1}/{steps} ({time.time() - t_start:.0f} s): " + ", ".join(
                f"{n} {1e3 * statistics.median(rec[n]['t'][-10:]):.0f}" for n in names))
    info = {}
    for n, v in variants.items():
        info[n] = {"tuned_at": v.tuned_at, "buckets": len(v.dp.buckets) if v.dp else 0,
                   "tuning": v.tuning.info if v.tuning is not None and rank == 0 else None}
        if v.dp is not None:
            v.dp.close()
    return rec, info, time.time() - t_start


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from bench.network import load_data
    rank, world = common.init_worker(1)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if rank == 0 else (lambda s: None)
    ds = load_data("mnist32")
    g = torch.Generator().manual_seed(1)
    eval_idx = torch.randperm(ds.size("test"), generator=g)[:min(args.eval_size, ds.size("test"))]
    out = {"world_size": world, "ifname": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "settings": []}
    for batch, steps, every in zip(args.batches, args.steps, args.eval_every):
        rec, info, wall = run_setting(args, batch, steps, every, rank, world, args.root, ds, eval_idx, say)
        everyone = [None] * world
        dist.all_gather_object(everyone, rec)
        out["settings"].append({"batch": batch, "steps": steps, "eval_every": every, "ranks": everyone,
                                "info": info, "wall_s": wall})
    if rank == 0:
        common.write_json(args.out, out)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- parent side

def analyse(setting: dict, target: float, skip: int) -> dict:
    ranks, info = setting["ranks"], setting["info"]
    res = {}
    for n in ranks[0]:
        t = [max(ts) for ts in zip(*(r[n]["t"] for r in ranks))]  # per iteration, the slower rank
        start = max(skip, info[n]["tuned_at"] or 0) if info[n]["tuned_at"] is not None else None
        body = t[start:] if start is not None and t[start:] else None
        acc = ranks[0][n]["acc"]
        reach = next(((s, a) for s, a in acc if a >= target), None)
        res[n] = {"median_ms": 1e3 * statistics.median(body) if body else None, "timed_steps": len(body or []),
                  "steps_to_target": reach[0] if reach else None,
                  "time_to_target_s": sum(t[:reach[0]]) if reach else None,
                  "best_acc": max((a for _, a in acc), default=None), "acc": acc,
                  "tuned_at": info[n]["tuned_at"], "buckets": info[n]["buckets"], "tuning": info[n]["tuning"],
                  "iter_s": t}
    comp = res["compute"]["median_ms"]
    for n, r in res.items():
        if r["median_ms"]:
            r["scaling"] = comp / r["median_ms"]
            lw = res.get(n.split("/")[0] + "/layerwise")
            if lw and lw["median_ms"]:
                r["speedup_vs_layerwise"] = lw["median_ms"] / r["median_ms"]
    return res


def _f(x, fmt, none="—"):
    return none if x is None else format(x, fmt)


def report(setting: dict, res: dict, args, target: float, link: str) -> str:
    b = setting["batch"]
    head = ["compressor", "schedule", "buckets", "ms/iter (median)", "speedup vs layerwise", "scaling factor",
            f"steps to {target:.0%}", f"time to {target:.0%} s", "best acc", "tuning steps"]
    rows = [["compute only", "—", "—", f"{res['compute']['median_ms']:.1f}", "—", "1.00", "—", "—", "—", "—"]]
    for n, r in res.items():
        if n == "compute":
            continue
        c, s = n.split("/")
        rows.append([c, f"**{s}**" if s == "mergecomp" else s, r["buckets"], _f(r["median_ms"], ".1f"),
                     _f(r.get("speedup_vs_layerwise"), ".2f"), _f(r.get("scaling"), ".2f"),
                     _f(r["steps_to_target"], "d", f"not in {setting['steps']}"),
                     _f(r["time_to_target_s"], ".1f"), _f(r["best_acc"], ".3f"),
                     "—" if s in ("layerwise", "bucket") else _f(r["tuned_at"], "d", "not done")])
    lines = [f"### resnet, {link}, world 2, per-rank batch {b}", "", common.markdown_table(head, rows), ""]
    met = [n.split("/")[0] for n, r in res.items() if n.endswith("/mergecomp")
           and (r.get("speedup_vs_layerwise") or 0) >= TARGET_SPEEDUP]
    lines.append(f"- {setting['steps']} steps per variant, all interleaved one step at a time (rotating order, "
                 f"barrier before each step); medians over the steps after tuning and after the first {args.skip}; "
                 f"slower rank per step; eval every {setting['eval_every']} steps on {args.eval_size} held-out "
                 f"images; this setting took {setting['wall_s'] / 60:.1f} min")
    lines.append(f"- mergecomp >= {TARGET_SPEEDUP:g}x faster per iteration than layerwise for: "
                 f"{', '.join(met) or 'none'} ({len(met)} of {len(args.compressors)} compressors)")
    for n, r in res.items():
        tu = r["tuning"]
        if not tu:
            continue
        if n.endswith("/mergecomp"):
            trace = ", ".join(f"{t['groups']}g {t['ms']:.0f}" for t in tu.get("trace", []))
            lines.append(f"- {n}: chose cuts {tu.get('chosen', {}).get('cuts')} ({r['buckets']} groups); "
                         f"search trace (groups, ms): {trace}")
        else:
            cost = tu.get("cost", {})
            lines.append(f"- {n}: fitted collective {_f(cost.get('fixed_ms'), '.2f')} ms + "
                         f"{_f(cost.get('per_mb_ms'), '.2f')} ms/MiB, compressor "
                         f"{_f(cost.get('compute_fixed_ms'), '.2f')} ms + {_f(cost.get('compute_per_mb_ms'), '.2f')} "
                         f"ms/MiB per call, {r['buckets']} buckets")
    return "\n".join(lines)


def breakdown(run_dir: str, rank: int = 0) -> dict:
    """Where a run's steps went, from its timeline and metrics (medians over the steps after
    tuning): forward, backward (in wfbp it includes the compress calls made in the
    gradient hooks), of which compress, the wait after backward (finish), optimizer,
    and the number and total duration of collectives."""
    tuned = 0
    tpath = os.path.join(run_dir, "tuning.json")
    if os.path.exists(tpath):
        tuned = common.read_json(tpath).get("tuning_steps", 0)
    with open(os.path.join(run_dir, f"timeline-rank{rank}.jsonl")) as f:
        ev = [json.loads(x) for x in f]
    steps = sorted((e for e in ev if e["cat"] == "step" and e["args"]["step"] >= tuned + 1), key=lambda e: e["ts"])
    rows = {k: [] for k in ("step", "forward", "backward", "compress_in_backward", "after_backward", "optimizer",
                            "collectives", "comm_total")}

    def inside(e, a, b):
        return a <= e["ts"] < b
    for st in steps:
        a, b = st["ts"], st["ts"] + st["dur"]
        mine = [e for e in ev if inside(e, a, b)]
        bw = next(e for e in mine if e["cat"] == "backward" and e["name"] == "backward")
        fw = next(e for e in mine if e["cat"] == "forward" and e["name"] == "forward")
        opt = next(e for e in mine if e["cat"] == "optimizer" and e["name"] == "optimizer")
        comp = sum(e["dur"] for e in mine if e["cat"] == "compress" and inside(e, bw["ts"], bw["ts"] + bw["dur"]))
        comm = [e for e in mine if e["cat"] == "comm"]
        for k, v in (("step", st["dur"]), ("forward", fw["dur"]), ("backward", bw["dur"]),
                     ("compress_in_backward", comp), ("after_backward", opt["ts"] - (bw["ts"] + bw["dur"])),
                     ("optimizer", opt["dur"]), ("collectives", len(comm)),
                     ("comm_total", sum(e["dur"] for e in comm))):
            rows[k].append(v / (1 if k == "collectives" else 1e3))
    return {k: statistics.median(v) for k, v in rows.items() if v} | {"steps": len(steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", type=float, default=0.0, help="shaped link rate in Gbit/s (root); 0 = loopback")
    ap.add_argument("--compressors", default=",".join(COMPRESSORS), help=f"from {', '.join(COMPRESSORS)}")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"from {', '.join(SCHEDULES)}")
    ap.add_argument("--batches", default="32,4", help="per-rank batch of each setting")
    ap.add_argument("--steps", default="50,160", help="steps per variant, per setting")
    ap.add_argument("--eval-every", default="10,20", help="evaluation cadence, per setting")
    ap.add_argument("--targets", default="0.7,0.7", help="target held-out accuracy, per setting")
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--skip", type=int, default=3, help="first steps of each variant left out of the medians")
    ap.add_argument("--warmup", type=int, default=2, help="mergecomp warmup_steps")
    ap.add_argument("--per-candidate", type=int, default=3, help="mergecomp steps_per_candidate")
    ap.add_argument("--candidates", type=int, default=8, help="mergecomp max_candidates")
    ap.add_argument("--max-groups", type=int, default=8, help="mergecomp max_groups")
    ap.add_argument("--profile-steps", type=int, default=3, help="layerfusion profile_steps")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", help="save raw data and summaries here")
    ap.add_argument("--md", help="save the tables here")
    ap.add_argument("--breakdown", nargs="+", metavar="RUN_DIR",
                    help="only print where the steps of these run directories went (timeline medians) and exit")
    ap.add_argument("--root", help=argparse.SUPPRESS)
    common.add_worker_flags(ap)
    args = ap.parse_args(argv)
    args.compressors, args.schedules = _csv(args.compressors), _csv(args.schedules)
    args.batches, args.steps, args.eval_every = _csv(args.batches, int), _csv(args.steps, int), _csv(args.eval_every, int)
    targets = _csv(args.targets, float)
    if args.breakdown:
        rows = []
        for d in args.breakdown:
            r = breakdown(d)
            rows.append([os.path.basename(d.rstrip("/"))] + [f"{r[k]:.1f}" for k in (
                "step", "forward", "backward", "compress_in_backward", "after_backward", "optimizer")]
                + [f"{r['collectives']:.0f}", f"{r['comm_total']:.1f}", r["steps"]])
        print(common.markdown_table(["run", "step ms", "forward", "backward", "compress in backward",
                                     "after backward", "optimizer", "collectives", "sum of comm spans ms",
                                     "steps"], rows))
        return 0
    if args.worker:
        worker(args)
        return 0
    bad = [c for c in args.compressors if c not in COMPRESSORS] + [s for s in args.schedules if s not in SCHEDULES]
    if bad:
        ap.error(f"unknown compressor or schedule {bad[0]!r}")
    if not len(args.batches) == len(args.steps) == len(args.eval_every) == len(targets):
        ap.error("--batches, --steps, --eval-every and --targets need one value per setting")
    link = f"{args.gbps:g} Gbit/s shaped" if args.gbps else "loopback"
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="commlab-fusion-") as d:
        out = os.path.join(d, "raw.json")
        fwd = ["--compressors", ",".join(args.compressors), "--schedules", ",".join(args.schedules),
               "--batches", ",".join(map(str, args.batches)), "--steps", ",".join(map(str, args.steps)),
               "--eval-every", ",".join(map(str, args.eval_every)), "--eval-size", str(args.eval_size),
               "--lr", str(args.lr), "--warmup", str(args.warmup), "--per-candidate", str(args.per_candidate),
               "--candidates", str(args.candidates), "--max-groups", str(args.max_groups),
               "--profile-steps", str(args.profile_steps), "--gbps", str(args.gbps), "--root", d, "--out", out]
        job = common.run_job(__file__, fwd, out, args.gbps, "fusion", args.timeout, tag="fusb")
        if job is None:
            return 1
        raw, cluster = job
    texts, summaries = [], []
    for setting, target in zip(raw["settings"], targets):
        res = analyse(setting, target, args.skip)
        summaries.append(res)
        texts.append(report(setting, res, args, target, link))
    cmd = "bench/fusion.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    text = f"Command: `.venv/bin/python {cmd.strip()}` (total {(time.time() - t0) / 60:.1f} min)\n\n" \
        + "\n\n".join(texts)
    if cluster:
        text += f"\n- cluster: {cluster['describe']}"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    if args.json:
        common.write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
                                      "summaries": summaries, **raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
