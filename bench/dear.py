"""DeAR against commlab wfbp and torch DDP: iteration time and exposed communication.

    python bench/dear.py [--links 0,1,10] [--models resnet,transformer] [--rounds 10] [--block 3] [--json out.json]

One invocation covers every link in ``--links`` (0: plain loopback; X > 0: an
emulated 2-rank cluster shaped to X Gbit/s, commlab.lab.net.netns, root). Per link the
script launches itself on 2 ranks (gloo, one thread each); per model every rank
builds identical copies (seed 0) of four variants that see the same batches:

- compute: no communication (forward, backward, SGD step), both ranks at once:
           the compute-only iteration time of the same model and batch;
- ddp:     torch DistributedDataParallel (bucket_cap_mb 25);
- wfbp:    commlab.engine.comm.wfbp.WFBP, schedule bucket 25 MB, compressor none, wfbp;
- dear:    commlab.engine.comm.dear.DeAR, compressor none, buffers at the cap found by the
           online search (CapTuner, rank 0 decides and broadcasts) run first on
           this very model and link.

Before timing, the search runs (``--tune-steps`` iterations per trial cap, the
first of each not counted) and, for comparison, every candidate cap is measured
the same way (the exhaustive grid); reported: the caps tried, the search's pick
and the grid's best, in trials and ms.

Then the variants run interleaved (``common.run_interleaved``: blocks of
``--block`` iterations, order rotating each round, barrier before each block,
the slower rank's time per iteration). SGD momentum 0.9 everywhere, including
DeAR's shard optimizer. Exposed communication = a variant's median iteration
minus compute's. The dear and wfbp variants record the engine timeline, from
which the report gives, per iteration, how long each collective was in flight
and how long the training thread waited for it (the exposed part).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

VARIANTS = ("compute", "ddp", "wfbp", "dear")
DATA = {"resnet": "synthetic", "transformer": "text"}
TARGET_EXPOSED = 0.60  # dear's exposed communication <= 60% of DDP's
TARGET_SPEEDUP = 1.15  # and DDP's iteration >= 1.15x dear's, on at least one model and link


# ---------------------------------------------------------------- worker side

def _timed_steps(step, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def build(model_name: str, batch: int, rank: int, world: int, tmpdir: str):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commlab.engine import compressors, data, models, schedules
    from commlab.engine.comm import dear
    from commlab.engine.tuners import capsearch
    from commlab.engine.comm.wfbp import WFBP
    from commlab.engine.compressors.plan import Plan
    from commlab.engine.timeline import Timeline

    ds = data.load(DATA[model_name], seed=0)
    sampler = data.ShardSampler(ds.size("train"), batch, rank, world, seed=0)
    batches = [ds.batch("train", next(sampler)) for _ in range(8)]

    def fresh():
        torch.manual_seed(0)
        return models.build(model_name, ds.info)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def plain(net, opt):
        it = itertools.cycle(batches)

        def step():
            x, y = next(it)
            opt.zero_grad()
            loss = models.loss_fn(net(x), y)
            loss.backward()
            opt.step()
            loss.item()
        return step

    def engine_step(model, comm, opt, tl):
        """commlab.engine.trainer.Trainer.train_step's communicator calls, divergence check included."""
        it = itertools.cycle(batches)

        def step():
            x, y = next(it)
            loss = models.loss_fn(model(x), y)
            loss.backward()
            comm.finish()
            finite = comm.grads_finite()
            opt.step()
            comm.zero_grad()
            loss.item()
            bool(finite)
            tl.flush()
        return step

    m_c = fresh()
    m_ddp = fresh()
    ddp = DDP(m_ddp, bucket_cap_mb=25)
    m_w = fresh()
    tl_w = Timeline(os.path.join(tmpdir, f"wfbp-{model_name}-{rank}.jsonl"), rank)
    dp = WFBP(m_w, functools.partial(schedules.build, "bucket", cap_mb=25.0),
              lambda: compressors.make("none"), timeline=tl_w)
    m_d = fresh()
    total = sum(p.numel() * p.element_size() for p in m_d.parameters())
    caps = capsearch.cap_candidates(total)
    tl_d = Timeline(os.path.join(tmpdir, f"dear-{model_name}-{rank}.jsonl"), rank)
    d = dear.DeAR(m_d, functools.partial(schedules.layout_cap, cap_mb=caps[-1]), Plan.of("none"), timeline=tl_d)
    opt_d = sgd(d.shard_params())
    d.attach(opt_d)
    tl_d.enabled = False  # the search and the grid are not in the timeline
    steps = {"compute": plain(m_c, sgd(m_c.parameters())), "ddp": plain(ddp, sgd(ddp.parameters())),
             "wfbp": engine_step(m_w, dp, sgd(m_w.parameters()), tl_w), "dear": engine_step(m_d, d, opt_d, tl_d)}
    info = {"params": sum(p.numel() for p in m_c.parameters()), "grad_mb": total / 2 ** 20, "caps": caps}
    return steps, d, tl_d, tl_w, dp, info


def tune(d, step, caps, tune_steps, rank, grid: bool):
    """The online search as the trainer runs it (rank 0 decides, broadcasts), then the grid."""
    import torch
    import torch.distributed as dist

    from commlab.engine import schedules
    from commlab.engine.tuners import capsearch
    tuner = capsearch.CapTuner(caps)
    cap = tuner.propose()
    trials = []
    while True:
        d.relayout(schedules.layout_cap(d.infos, cap))
        ts = _timed_steps(step, tune_steps)[1:]
        decision = torch.zeros(2, dtype=torch.float64)
        if rank == 0:
            tuner.report(cap, ts)
            nxt = tuner.propose()
            decision[0], decision[1] = (nxt, 0.0) if nxt is not None else (tuner.best, 1.0)
        dist.broadcast(decision, 0)
        trials.append((cap, 1e3 * statistics.median(ts)))
        cap = float(decision[0])
        if decision[1]:
            break
    out = {"trials": trials, "best_cap": cap}
    if grid:
        g = []
        for c in caps:
            d.relayout(schedules.layout_cap(d.infos, c))
            g.append((c, 1e3 * statistics.median(_timed_steps(step, tune_steps)[1:])))
        out["grid"] = g
    d.relayout(schedules.layout_cap(d.infos, cap))
    out["buffers"] = len(d.buffers)
    return out


def timeline_stats(path: str, steps: int) -> dict:
    """Per iteration: ms each kind of collective was in flight, and ms the training thread waited for it."""
    tot: dict = {}
    if not os.path.exists(path):
        return tot
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e["cat"] == "comm":
                key = "inflight " + e["name"].split(" ")[0]
            elif e["cat"] == "wait":
                key = "wait " + (e["name"].split(" ")[1] if e["name"].count(" ") >= 2 else "allreduce")
            else:
                continue
            tot[key] = tot.get(key, 0.0) + e["dur"] / 1e3
    return {k: v / max(steps, 1) for k, v in sorted(tot.items())}


def worker(args) -> None:
    import torch.distributed as dist
    rank, world = common.init_worker()
    tmpdir = tempfile.mkdtemp(prefix="commlab-dear-")
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if rank == 0 else None
    out = {"world_size": world, "ifname": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "models": {}}
    try:
        for name in args.models.split(","):
            t0 = time.time()
            steps, d, tl_d, tl_w, dp, info = build(name, args.batch, rank, world, tmpdir)
            for _ in range(2):
                steps["dear"]()
            search = tune(d, steps["dear"], info["caps"], args.tune_steps, rank, args.grid)
            if log:
                log(f"[{name}] search {search['trials']} -> {search['best_cap']} MB; grid {search.get('grid')}")
            tl_d.enabled = True
            times = common.run_interleaved(steps, args.rounds, args.block, args.warmup, dist.barrier, log)
            n = args.rounds * args.block + args.warmup
            stats = {"dear": timeline_stats(os.path.join(tmpdir, f"dear-{name}-{rank}.jsonl"), n),
                     "wfbp": timeline_stats(os.path.join(tmpdir, f"wfbp-{name}-{rank}.jsonl"), n)}
            d.close()
            dp.close()
            tl_d.close()
            tl_w.close()
            everyone = [None] * world
            dist.all_gather_object(everyone, stats)
            out["models"][name] = {"info": info, "search": search, "times_s": common.gather_max(times),
                                   "timeline": everyone, "wall_s": time.time() - t0}
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    if rank == 0:
        common.write_json(args.out, out)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- parent side

def analyse(raw: dict) -> dict:
    res = {}
    for model, r in raw["models"].items():
        s = common.summarize(r["times_s"], baseline="ddp")
        comp = s["compute"]["median_ms"]
        v = {n: {"median_ms": s[n]["median_ms"], "exposed_ms": s[n]["median_ms"] - comp,
                 "ddp_over": s["ddp"]["median_ms"] / s[n]["median_ms"],
                 "round_ratio_vs_ddp": s[n]["round_ratio"]} for n in VARIANTS}
        ddp_exp = v["ddp"]["exposed_ms"]
        de = v["dear"]
        de["exposed_vs_ddp"] = de["exposed_ms"] / ddp_exp if ddp_exp > 0 else None
        met = de["exposed_vs_ddp"] is not None and de["exposed_vs_ddp"] <= TARGET_EXPOSED \
            and de["ddp_over"] >= TARGET_SPEEDUP
        sr = r["search"]
        grid_best = min(sr["grid"], key=lambda x: x[1]) if sr.get("grid") else None
        picked = dict(sr["grid"]).get(sr["best_cap"]) if sr.get("grid") else None
        res[model] = {"variants": v, "met": met, "search": sr, "grid_best": grid_best,
                      "search_pick_grid_ms": picked, "timeline": r["timeline"], "info": r["info"]}
    return res


def report(link: str, a: dict) -> str:
    rows = []
    for model, r in a.items():
        for n in VARIANTS:
            x = r["variants"][n]
            rows.append([model, n, f"{x['median_ms']:.1f}", "—" if n == "compute" else f"{x['exposed_ms']:.1f}",
                         f"{x['ddp_over']:.2f}", f"{x['round_ratio_vs_ddp']:.3f}"])
    out = [f"### {link}", "", common.markdown_table(
        ["model", "variant", "median ms/iter", "exposed comm ms", "DDP time / this", "per-round ratio vs DDP"],
        rows), ""]
    for model, r in a.items():
        de, sr = r["variants"]["dear"], r["search"]
        ev = "n/a (DDP exposes nothing)" if de["exposed_vs_ddp"] is None else f"{de['exposed_vs_ddp']:.2f}"
        out.append(f"- {model} ({r['info']['params'] / 1e6:.2f}M params, {r['info']['grad_mb']:.1f} MiB): dear exposed "
                   f"comm / DDP's = {ev} (target <= {TARGET_EXPOSED}); DDP iteration / dear's = {de['ddp_over']:.2f} "
                   f"(target >= {TARGET_SPEEDUP}): {'both met' if r['met'] else 'not both met'}")
        tri = ", ".join(f"{c:g} MB {ms:.0f} ms" for c, ms in sr["trials"])
        line = f"  - cap search: {len(sr['trials'])} trials ({tri}) -> {sr['best_cap']:g} MB, {sr['buffers']} buffers"
        if r["grid_best"]:
            line += (f"; grid of {len(sr['grid'])} caps: best {r['grid_best'][0]:g} MB at {r['grid_best'][1]:.0f} ms, "
                     f"the search's pick measured {r['search_pick_grid_ms']:.0f} ms in the grid pass")
        out.append(line)
        for n in ("dear", "wfbp"):
            st = r["timeline"][0].get(n, {})
            out.append(f"  - {n} timeline, rank 0, ms per iteration: " +
                       ", ".join(f"{k} {v:.1f}" for k, v in st.items()))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="0,1,10", help="comma-separated Gbit/s; 0 = plain loopback")
    ap.add_argument("--models", default="resnet,transformer")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=3, help="timed iterations per variant per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--tune-steps", type=int, default=4, help="iterations per trial cap (first not counted)")
    ap.add_argument("--no-grid", dest="grid", action="store_false", help="skip the exhaustive grid of caps")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", help="save raw times and the summary here")
    common.add_worker_flags(ap)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    links = [float(x) for x in args.links.split(",") if x]
    results, texts = {}, []
    t_all = time.time()
    for gbps in links:
        with tempfile.TemporaryDirectory(prefix="commlab-dear-") as d:
            out = os.path.join(d, "raw.json")
            fwd = ["--models", args.models, "--rounds", str(args.rounds), "--block", str(args.block),
                   "--warmup", str(args.warmup), "--batch", str(args.batch), "--tune-steps", str(args.tune_steps),
                   "--out", out] + ([] if args.grid else ["--no-grid"])
            t0 = time.time()
            job = common.run_job(__file__, fwd, out, gbps, f"dear (link {gbps:g})", args.timeout, tag="dear")
            if job is None:
                return 1
            raw, cluster = job
        link = f"{gbps:g} Gbit/s shaped (tbf)" if gbps else "loopback (unshaped)"
        a = analyse(raw)
        text = report(link, a) + f"\n- wall time {time.time() - t0:.0f} s"
        print(text + "\n", flush=True)
        texts.append(text)
        results[f"{gbps:g}"] = {"summary": a, "raw": raw, "cluster": cluster}
    met = [f"{m} @ {k} Gbit" for k, r in results.items() for m, x in r["summary"].items() if x["met"]]
    final = (f"targets (exposed <= {TARGET_EXPOSED} x DDP's and >= {TARGET_SPEEDUP}x faster, on one model and link): "
             + (f"met on {', '.join(met)}" if met else "NOT met on any model and link")
             + f"; total {time.time() - t_all:.0f} s")
    print(final)
    if args.json:
        common.write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
                                      "results": results, "text": "\n\n".join(texts + [final])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
