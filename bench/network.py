"""The network dimension: torch DDP, DDP + PowerSGD hook and commlab on one shaped link.

    python bench/network.py --gbps 0.1 [--variants a,b,...] [--steps 80] [--json out.json]
    python bench/network.py --gbps 0          # (or --link loopback) the same on plain loopback

One invocation per bandwidth. The parent builds ONE emulated 2-rank cluster
(``commlab.lab.net.netns.Cluster(2, gbps)``: network namespaces, veth pairs to a bridge,
tbf on both ends of every link) and starts this script with ``--worker`` in
each rank's namespace as its own torchrun node; the cluster is torn down
however the run ends. All traffic stays inside those namespaces (or on
loopback with ``--gbps 0``).

In the worker every variant is built from the same init (seed 0) with its own
model and SGD optimizer, and sees the same batches in the same order (its own
sampler, same seed). Variants share the process group and run interleaved: a
round runs a block of ``--block`` (default 1) training steps of every variant,
the order rotating by one each round, with a barrier before each block
(outside the timing), so load from elsewhere on the machine falls on all
variants alike. Every ``--eval-every`` (5) of its steps a variant is
evaluated on a fixed held-out subset (untimed). Each iteration is timed around the whole step (forward, backward,
communication, optimizer step); the slower rank's time counts.

Variants (``--variants``; default all but the rank-2 ones):

- ``compute``:          no communication (forward, backward, SGD step), each
                        rank on its own at the same time as the other, i.e.
                        single-process throughput under the same 2-core
                        contention as training. The scaling-factor denominator.
- ``ddp``:              torch DistributedDataParallel, default buckets.
- ``ddp-powersgd-r4``/``-r2``/``-r1``: DDP with torch's ``powerSGD_hook``
                        (matrix_approximation_rank 4 / 2 / 1, start_powerSGD_iter 2,
                        error feedback and warm start on) and ``bucket_cap_mb``
                        64, i.e. ONE bucket: on gloo the hook aborts or hangs
                        with several (TESTBED.md). The worker checks that only
                        bucket 0 ever reaches the hook.
- ``commlab-powersgd-r4``/``-r2``/``-r1``: commlab.engine.comm.wfbp.WFBP, schedule
                        ``--schedule`` (bucket 25 MB), compressor powersgd rank
                        4 / 2 / 1, start_iter 2 (per tensor when the compressor
                        reads the communicator's ``layout``).
- ``commlab-topk``:     the same with topk ratio 0.01 + error feedback.
- ``commlab-fp16``:     the same with fp16.
- ``commlab-none``:     the same uncompressed (not in the default set).

Time to target: the sum of a variant's measured iteration times (slower rank,
evaluation excluded) up to the first evaluation at or above ``--target``.
The best commlab configuration is the commlab variant that reaches the target
soonest (the fastest iteration if none does).

Data: ``mnist32`` (default) is the 5,000 real MNIST images bundled offline
(commlab.engine.data "mnist"), zero-padded to 32x32 and repeated over 3 channels, so
the model, its gradients and the compute per step are exactly those of the
synthetic 3x32x32 CIFAR-shaped data TESTBED.md times; ``synthetic``
(commlab.engine.data) has the same shape but its labels are a random linear function
of 3,072 Gaussian pixels that the resnet does not learn from 2,048 examples
(it stays at chance), so with it time to target is not meaningful.

Reported per variant: median ms/iteration (slower rank, first ``--skip``
steps of each variant excluded), its ratio to compute-only (and the median
of per-round ratios, each round's block against compute's block in the same
round, which is robust to load that comes and goes), scaling factor
(compute / iteration: the throughput of 2 ranks over twice that of one, for
the same per-rank batch), exposed communication (iteration - compute), time
and steps to target, speedup in time to target over DDP, payload MiB per step
(what the rank hands to collectives) and, on shaped links, wire MiB per step
(the rank's interface tx bytes over its timed steps, TCP/IP headers and ACKs
included).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

COMMLAB = {  # name -> (compressor, its parameters)
    "commlab-powersgd-r4": ("powersgd", {"rank": 4, "start_iter": 2}),
    "commlab-powersgd-r2": ("powersgd", {"rank": 2, "start_iter": 2}),
    "commlab-powersgd-r1": ("powersgd", {"rank": 1, "start_iter": 2}),
    "commlab-topk": ("topk", {"ratio": 0.01, "error_feedback": True}),
    "commlab-fp16": ("fp16", {}),
    "commlab-none": ("none", {}),
}
DDP_POWERSGD = {"ddp-powersgd-r4": 4, "ddp-powersgd-r2": 2, "ddp-powersgd-r1": 1}
VARIANTS = ("compute", "ddp", *DDP_POWERSGD, *COMMLAB)
DEFAULT_VARIANTS = ("compute", "ddp", "ddp-powersgd-r4", "ddp-powersgd-r1", "commlab-powersgd-r4",
                    "commlab-powersgd-r1", "commlab-topk", "commlab-fp16")
DDP_POWERSGD_BUCKET_MB = 64  # > the model's 10.7 MB: one bucket (gloo needs it for the hook)
START_ITER = 2

# the targets, at 0.1 Gbit on resnet
TARGET_ITER_VS_COMPUTE = 1.15
TARGET_TTA_VS_DDP = 2.5


def split_variant(name: str, default_schedule: str, default_cap: float):
    """``commlab-X[@SCHED]`` -> (base name, schedule name, its options). SCHED: allinone,
    layerwise, bucket (``--cap-mb``) or bucketN (cap N MB)."""
    base, _, sched = name.partition("@")
    sched = sched or default_schedule
    if sched.startswith("bucket"):
        cap = float(sched[len("bucket"):]) if sched != "bucket" else default_cap
        return base, "bucket", {"cap_mb": cap}
    if sched in ("allinone", "layerwise"):
        return base, sched, {}
    raise ValueError(f"--variants: unknown schedule {sched!r} in {name!r}; allowed: allinone, layerwise, "
                     f"bucket, bucketN (N MB)")


def check_variant(name: str) -> bool:
    base, sep, _ = name.partition("@")
    if sep:
        if base not in COMMLAB:
            return False
        try:
            split_variant(name, "bucket", 25.0)
        except ValueError:
            return False
        return True
    return name in VARIANTS


# ---------------------------------------------------------------- data

def load_data(name: str):
    from commlab.engine import data
    if name == "synthetic":
        return data.load("synthetic", seed=0)
    if name != "mnist32":
        raise ValueError(f"--data: {name!r}; allowed: mnist32, synthetic")
    import torch.nn.functional as F
    mn = data.load("mnist")  # already normalised with train statistics

    def to32(x):  # pad with the background value, 3 identical channels: CIFAR-shaped
        return F.pad(x, (2, 2, 2, 2), value=float(mn.train_x.min())).repeat(1, 3, 1, 1).contiguous()
    return data.ImageDataset(to32(mn.train_x), mn.train_y, to32(mn.test_x), mn.test_y, mn.info.num_classes)


# ---------------------------------------------------------------- worker side

def _tx_bytes(ifname: str) -> int:
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return 0


def _ddp_powersgd_payload(bucket, state) -> int:
    """Bytes this rank hands to the hook's all-reduces for ``bucket`` this step, as
    torch's powerSGD_hook decides it (read before the hook runs)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress
    buf = bucket.buffer()
    es = buf.element_size()
    if state.iter < state.start_powerSGD_iter:
        return buf.numel() * es
    total = 0
    for g in bucket.gradients():
        if g.dim() <= 1:
            total += g.numel()
            continue
        rows = g.shape[0]
        cols = g.numel() // rows
        rank = min(rows, cols, state.matrix_approximation_rank)
        ok = _should_compress(rows, cols, state.matrix_approximation_rank, state.min_compression_rate)[0]
        total += (rows + cols) * rank if ok else g.numel()
    return total * es


class Variant:
    """One model + optimizer + sampler, stepped one iteration at a time."""

    def __init__(self, name, model, net, opt, sampler, ds, kind, dp=None):
        self.name, self.model, self.net, self.opt = name, model, net, opt
        self.sampler, self.ds, self.kind, self.dp = sampler, ds, kind, dp
        self.payload = 0  # bytes of the last step
        self.steps = 0

    def step(self):
        """One training iteration; returns (total, forward+backward) seconds."""
        from commlab.engine import models
        x, y = self.ds.batch("train", next(self.sampler))
        t0 = time.perf_counter()
        if self.kind == "commlab":
            loss = models.loss_fn(self.model(x), y)
            loss.backward()
            t1 = time.perf_counter()
            self.dp.finish()
            self.opt.step()
            self.dp.zero_grad()
            self.payload = self.dp.step_bytes
        else:
            self.opt.zero_grad()
            loss = models.loss_fn(self.net(x), y)
            loss.backward()
            t1 = time.perf_counter()
            self.opt.step()
        loss.item()
        t2 = time.perf_counter()
        self.steps += 1
        return t2 - t0, t1 - t0


def build_variants(names, args, rank, world):
    import functools

    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commlab.engine import compressors, data, models, schedules
    from commlab.engine.comm.wfbp import WFBP
    from commlab.engine.compressors import contract

    ds = load_data(args.data)
    raw = None
    out = {}
    for name in names:  # same order on every rank: DDP and WFBP broadcast at construction
        torch.manual_seed(0)
        m = models.build("resnet", ds.info)
        raw = raw or sum(p.numel() * p.element_size() for p in m.parameters())
        opt = torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9)
        sampler = data.ShardSampler(ds.size("train"), args.batch, rank, world, seed=0)
        if name == "compute":
            v = Variant(name, m, m, opt, sampler, ds, "compute")
        elif name == "ddp":
            v = Variant(name, m, DDP(m), opt, sampler, ds, "ddp")
            v.payload = raw
        elif name in DDP_POWERSGD:
            net = DDP(m, bucket_cap_mb=DDP_POWERSGD_BUCKET_MB)
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=DDP_POWERSGD[name],
                                       start_powerSGD_iter=START_ITER, use_error_feedback=True,
                                       warm_start=True, random_seed=args.psgd_seed)
            v = Variant(name, m, net, opt, sampler, ds, "ddp")
            v.buckets_seen = set()

            def hook(st, bucket, v=v):
                v.buckets_seen.add(bucket.index())
                if bucket.index() == 0:
                    v.payload = 0
                v.payload += _ddp_powersgd_payload(bucket, st)
                return psgd.powerSGD_hook(st, bucket)
            net.register_comm_hook(state, hook)
        elif name.partition("@")[0] in COMMLAB:
            base, sched, opts = split_variant(name, args.schedule, args.cap_mb)
            comp, params = COMMLAB[base]
            if comp == "powersgd":
                params = {**params, "seed": args.psgd_seed}
            schedule = functools.partial(schedules.build, sched, **opts)
            dp = WFBP(m, schedule, lambda comp=comp, params=params: compressors.make(comp, **params))
            v = Variant(name, m, m, opt, sampler, ds, "commlab", dp)
            v.buckets = [b.raw_bytes for b in dp.buckets]
            v.schedule = (sched, opts)
            v.per_tensor = [contract.per_tensor(b.compressor, b.flat.numel(), b.context) for b in dp.buckets]
        else:
            raise ValueError(f"--variants: unknown {name!r}; allowed: {', '.join(VARIANTS)}")
        out[name] = v
    return out, ds, raw


def evaluate(v, ds, eval_idx, rank, world, collective=True):
    """Held-out accuracy on ``eval_idx`` (every rank scores its share; counts summed)."""
    import torch
    import torch.distributed as dist
    from commlab.engine import data, models
    m = v.model
    m.eval()
    c = k = 0
    n = len(eval_idx)
    with torch.no_grad():
        for part in data.eval_batches(n, 256, rank, world):
            x, y = ds.batch("test", eval_idx[part])
            a, b = models.correct(m(x), y)
            c, k = c + a, k + b
    m.train()
    tot = torch.tensor([c, k], dtype=torch.float64)
    if collective:
        dist.all_reduce(tot)
    return float(tot[0] / max(tot[1], 1))


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    rank, world = common.init_worker(1)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if rank == 0 else (lambda s: None)
    names = args.variants.split(",")
    variants, ds, raw = build_variants(names, args, rank, world)
    g = torch.Generator().manual_seed(1)
    n_eval = min(args.eval_size, ds.size("test"))
    eval_idx = torch.randperm(ds.size("test"), generator=g)[:n_eval]
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    shaped = ifname != "lo"
    rounds = math.ceil(args.steps / args.block)
    rec = {n: {"t": [], "fb": [], "payload": [], "tx": [], "acc": []} for n in names}
    t_start = time.time()
    say(f"[network] {world} ranks on {ifname}, {len(names)} variants x {rounds} rounds x {args.block} steps, "
        f"{raw / 2**20:.1f} MiB gradient, eval on {n_eval} held-out images every {args.eval_every} steps")
    every = max(1, args.eval_every // args.block)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            v = variants[name]
            n = min(args.block, args.steps - v.steps)
            if n <= 0:
                continue
            dist.barrier()
            tx0 = _tx_bytes(ifname) if shaped else 0
            for _ in range(n):
                t, fb = v.step()
                rec[name]["t"].append(t)
                rec[name]["fb"].append(fb)
                rec[name]["payload"].append(v.payload)
            if shaped:
                rec[name]["tx"].append([_tx_bytes(ifname) - tx0, n])
            if name == "compute":  # rank-local models: no collective evaluation
                continue
            if v.steps % args.eval_every == 0 or v.steps == args.steps:
                acc = evaluate(v, ds, eval_idx, rank, world)
                rec[name]["acc"].append((v.steps, acc))
        if (r + 1) % every == 0 or r + 1 == rounds:
            w = args.block * every
            say(f"round {r + 1}/{rounds} ({time.time() - t_start:.0f} s): " + ", ".join(
                f"{n} {1e3 * sorted(rec[n]['t'][-w:])[len(rec[n]['t'][-w:]) // 2]:.0f}ms"
                + (f"/{rec[n]['acc'][-1][1]:.2f}" if rec[n]["acc"] else "") for n in names))
    info = {}
    for name, v in variants.items():
        info[name] = {}
        if hasattr(v, "buckets_seen"):
            info[name]["ddp_buckets_seen"] = sorted(v.buckets_seen)
        if hasattr(v, "buckets"):
            info[name]["commlab_bucket_bytes"] = v.buckets
            info[name]["per_tensor"] = v.per_tensor
            info[name]["schedule"] = v.schedule
    everyone = [None] * world
    dist.all_gather_object(everyone, rec)
    if rank == 0:
        out = {"world_size": world, "ifname": ifname, "shaped": shaped, "grad_bytes": raw, "eval_size": n_eval,
               "info": info, "ranks": everyone, "wall_s": time.time() - t_start}
        common.write_json(args.out, out)
    dist.barrier()
    for v in variants.values():
        if v.dp is not None:
            v.dp.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------- parent side

def analyse(raw: dict, target: float, skip: int, gbps: float, block: int = 1, window: int = 5) -> dict:
    """Per variant: medians over the slower rank, time/steps to target, bytes; the best commlab config."""
    ranks = raw["ranks"]
    names = list(ranks[0])
    res = {}
    for n in names:
        t = [max(ts) for ts in zip(*(r[n]["t"] for r in ranks))]  # per iteration, the slower rank
        fb = [max(ts) for ts in zip(*(r[n]["fb"] for r in ranks))]
        rest = [max(a - b for a, b in zip(ts, fs)) for ts, fs in zip(zip(*(r[n]["t"] for r in ranks)),
                                                                    zip(*(r[n]["fb"] for r in ranks)))]
        body = t[skip:] or t
        acc = ranks[0][n]["acc"]
        reach = next(((s, a) for s, a in acc if a >= target), None)
        payload = [p for p in ranks[0][n]["payload"][skip:]] or [0]
        # wire bytes per step: the median over blocks (blocks with skipped steps left out), the busier rank
        tx = None
        if raw["shaped"]:
            tx = []
            for r in ranks:
                blocks, first = [], 0
                for b, k in r[n]["tx"]:
                    if first >= skip:
                        blocks.append(b / k)
                    first += k
                tx.append(common.median(blocks or [b / k for b, k in r[n]["tx"]]))
        res[n] = {"median_ms": 1e3 * common.median(body), "fwd_bwd_median_ms": 1e3 * common.median(fb[skip:] or fb),
                  "after_bwd_median_ms": 1e3 * common.median(rest[skip:] or rest),
                  "steps": len(t), "iter_s": t,
                  "acc": acc, "final_acc": acc[-1][1] if acc else None,
                  "best_acc": max((a for _, a in acc), default=None),
                  "steps_to_target": reach[0] if reach else None,
                  "time_to_target_s": sum(t[:reach[0]]) if reach else None,
                  "time_to_target_at_median_s": reach[0] * common.median(body) if reach else None,
                  "payload_mib": common.median(payload) / 2**20,
                  "wire_mib": max(tx) / 2**20 if tx else None}
    comp = res.get("compute")
    for n, r in res.items():
        if comp:
            # per round: this variant's block median over compute's in the same round (same load on the machine)
            ratios = [common.median(r["iter_s"][i:i + block]) / common.median(comp["iter_s"][i:i + block])
                      for i in range(0, min(len(r["iter_s"]), len(comp["iter_s"])), block) if i >= skip]
            r["round_ratio_vs_compute"] = common.median(ratios) if ratios else None
            r["vs_compute"] = r["median_ms"] / comp["median_ms"]
            r["scaling"] = comp["median_ms"] / r["median_ms"]
            r["exposed_ms"] = r["median_ms"] - comp["median_ms"]
        ddp = res.get("ddp")
        if ddp and ddp["time_to_target_s"] and r["time_to_target_s"]:
            r["tta_speedup_vs_ddp"] = ddp["time_to_target_s"] / r["time_to_target_s"]
            r["tta_at_median_speedup_vs_ddp"] = ddp["time_to_target_at_median_s"] / r["time_to_target_at_median_s"]
    if comp and res.get("ddp", {}).get("steps_to_target"):
        comp["ideal_time_to_target_s"] = comp["median_ms"] / 1e3 * res["ddp"]["steps_to_target"]
    cl = [n for n in names if n.startswith("commlab-")]
    reached = [n for n in cl if res[n]["time_to_target_s"] is not None]
    best = min(reached, key=lambda n: res[n]["time_to_target_s"]) if reached else (
        min(cl, key=lambda n: res[n]["median_ms"]) if cl else None)
    verdict = {}
    if best:
        b = res[best]
        if comp:
            verdict["iter_vs_compute"] = {"value": b["vs_compute"], "target": TARGET_ITER_VS_COMPUTE,
                                          "per_round": b["round_ratio_vs_compute"],
                                          "met": b["vs_compute"] <= TARGET_ITER_VS_COMPUTE}
        if "ddp" in res:
            sp = b.get("tta_speedup_vs_ddp")
            verdict["tta_vs_ddp"] = {"value": sp, "target": TARGET_TTA_VS_DDP,
                                     "met": bool(sp and sp >= TARGET_TTA_VS_DDP)}
        ps = [n for n in names if n in DDP_POWERSGD]
        if ps:
            pt = [res[n]["time_to_target_s"] for n in ps if res[n]["time_to_target_s"] is not None]
            bt = b["time_to_target_s"]
            pm = [res[n]["time_to_target_at_median_s"] for n in ps if res[n]["time_to_target_at_median_s"]]
            bm = b["time_to_target_at_median_s"]
            verdict["tta_vs_ddp_powersgd"] = {"value": (min(pt) / bt) if (pt and bt) else None,
                                              "at_median_met": bool(bm is not None and (not pm or bm < min(pm))),
                                              "best_ddp_powersgd_s": min(pt) if pt else None,
                                              "met": bool(bt is not None and (not pt or bt < min(pt)))}
    # other targets: is the verdict an artefact of the one chosen?
    other = {}
    if best and "ddp" in res:
        for tgt in sorted({0.5, 0.6, 0.7, 0.8, target}):
            def tta(n):
                reach = next((s for s, a in res[n]["acc"] if a >= tgt), None)
                return sum(res[n]["iter_s"][:reach]) if reach else None
            d, c = tta("ddp"), tta(best)
            other[f"{tgt:g}"] = {"ddp_s": d, "best_s": c, "speedup": (d / c) if (d and c) else None}
    # quiet machine? the compute-only blocks are the canary (they have no network to vary)
    quiet = None
    if comp:
        blk = []
        for i in range(0, len(comp["iter_s"]), window):
            b = comp["iter_s"][i:i + window]
            blk.append(common.median(b))
        quiet = {"window_steps": window, "block_median_ms_min": 1e3 * min(blk), "block_median_ms_max": 1e3 * max(blk),
                 "disturbed_blocks": sum(x > 1.2 * min(blk) for x in blk), "blocks": len(blk)}
    return {"variants": res, "best_commlab": best, "verdict": verdict, "target_acc": target, "gbps": gbps,
            "other_targets": other, "quiet": quiet}


def _f(x, fmt, none="—"):
    return none if x is None else format(x, fmt)


def report(a: dict, raw: dict, args) -> str:
    res, best = a["variants"], a["best_commlab"]
    link = f"{a['gbps']:g} Gbit/s shaped (tbf)" if a["gbps"] else "loopback (unshaped)"
    head = ["variant", "ms/iter (median)", "fwd+bwd / after ms", "x compute (per-round median)", "scaling factor",
            "exposed comm ms",
            f"time to {a['target_acc']:.0%} s: measured (steps x median)", "steps to target",
            "time-to-target speedup vs DDP: measured (at median)",
            "payload MiB/step"] + (["wire MiB/step"] if raw["shaped"] else []) + ["best acc"]
    rows = []
    for n, r in res.items():
        label = n
        if n in DDP_POWERSGD:
            label += f" (1 bucket, {DDP_POWERSGD_BUCKET_MB} MB cap)"
        if n == best:
            label = f"**{label}** (best commlab)"
        tta = _f(r["time_to_target_s"], ".1f")
        if r["time_to_target_s"] is not None:
            tta += f" ({r['time_to_target_at_median_s']:.1f})"
        if n == "compute" and r.get("ideal_time_to_target_s"):
            tta = f"({r['ideal_time_to_target_s']:.1f} ideal)"
        rows.append([label, f"{r['median_ms']:.0f}",
                     f"{r['fwd_bwd_median_ms']:.0f} / {r['after_bwd_median_ms']:.0f}",
                     _f(r.get("vs_compute"), ".2f") + (f" ({r['round_ratio_vs_compute']:.2f})"
                                                       if n != "compute" and r.get("round_ratio_vs_compute") else ""),
                     _f(r.get("scaling"), ".2f"),
                     _f(r.get("exposed_ms"), ".0f"), tta,
                     "—" if n == "compute" else _f(r["steps_to_target"], "d", f"not in {r['steps']}"),
                     _f(r.get("tta_speedup_vs_ddp"), ".2f") + (f" ({r['tta_at_median_speedup_vs_ddp']:.2f})"
                                                               if r.get("tta_speedup_vs_ddp") else ""),
                     "0" if n == "compute" else f"{r['payload_mib']:.3f}"]
                    + ([_f(r["wire_mib"], ".3f")] if raw["shaped"] else [])
                    + [_f(r["best_acc"], ".3f")])
    lines = [f"### resnet (2.8M params, {raw['grad_bytes'] / 2**20:.1f} MiB gradient), {link}, world 2, "
             f"per-rank batch {args.batch}, data {args.data}",
             "", common.markdown_table(head, rows), ""]
    notes = [f"- target accuracy {a['target_acc']:.0%} on {raw['eval_size']} held-out images, evaluated every "
             f"{args.eval_every} steps of each variant; {args.steps} steps per variant, interleaved in blocks of "
             f"{args.block} (order rotating, barrier before each block); medians skip each variant's first "
             f"{args.skip} steps; slower rank per iteration; "
             f"the run took {raw['wall_s'] / 60:.1f} min",
             f"- DDP + PowerSGD hook: bucket_cap_mb={DDP_POWERSGD_BUCKET_MB}, one bucket (gloo needs it), "
             f"start_powerSGD_iter={START_ITER}, error feedback and warm start on; "
             + ("; ".join(f"{n} saw bucket(s) {raw['info'][n].get('ddp_buckets_seen')}"
                          for n in res if n in DDP_POWERSGD) or "not run"),
             f"- commlab: WFBP (comm.mode wfbp), schedule {args.schedule}"
             + (f" {args.cap_mb:g} MB" if args.schedule == "bucket" else "") + " unless the name says @schedule"
             + "; " + "; ".join(f"{n}: {len(raw['info'][n]['commlab_bucket_bytes'])} buckets"
                                + (", PowerSGD per tensor" if all(raw["info"][n]["per_tensor"]) else
                                   (", PowerSGD flat (no layout)" if "powersgd" in n else ""))
                                for n in res if n.partition("@")[0] in COMMLAB)]
    v = a["verdict"]
    if best and v:
        b = res[best]
        parts = []
        at_target_link = a["gbps"] == 0.1
        met, missed = ("met", "MISSED") if at_target_link else ("would meet", "would miss")
        if "iter_vs_compute" in v:
            x = v["iter_vs_compute"]
            parts.append(f"iteration {x['value']:.2f}x compute (per-round median {_f(x['per_round'], '.2f')}x) "
                         f"(target <= {x['target']}: "
                         f"{met if x['met'] else missed})")
        if "tta_vs_ddp" in v:
            x = v["tta_vs_ddp"]
            parts.append(f"time to target {_f(x['value'], '.2f', 'n/a ')}x sooner than DDP "
                         f"({_f(b.get('tta_at_median_speedup_vs_ddp'), '.2f', 'n/a ')}x at median pace) (target >= "
                         f"{x['target']}: {met if x['met'] else missed})")
        if "tta_vs_ddp_powersgd" in v:
            x = v["tta_vs_ddp_powersgd"]
            parts.append(f"{_f(b['time_to_target_s'], '.1f', 'n/a')} s vs best DDP+PowerSGD "
                         f"{_f(x['best_ddp_powersgd_s'], '.1f', 'n/a')} s "
                         f"({'sooner: ' + met if x['met'] else 'NOT sooner: ' + missed}; at median pace "
                         f"{'sooner' if x['at_median_met'] else 'not sooner'})")
        notes.append(f"- best commlab configuration: {best}: " + "; ".join(parts)
                     + ("" if at_target_link else " (the targets hold at 0.1 Gbit only)"))
    if a.get("other_targets"):
        notes.append(f"- {best} vs DDP at other targets (measured time to target): " + "; ".join(
            f"{k}: {_f(o['best_s'], '.1f', 'not reached ')} s vs {_f(o['ddp_s'], '.1f', 'not reached ')} s = "
            f"{_f(o['speedup'], '.2f', 'n/a ')}x" for k, o in a["other_targets"].items()))
    q = a.get("quiet")
    if q:
        notes.append(f"- machine check: compute-only medians per {q['window_steps']} steps "
                     f"{q['block_median_ms_min']:.0f}-{q['block_median_ms_max']:.0f} ms; {q['disturbed_blocks']} of "
                     f"{q['blocks']} windows > 1.2x the "
                     f"fastest" + (" (other load on the machine during the run: sums of iteration times, i.e. "
                                   "time to target, are inflated for whichever variants ran then; medians less so)"
                                   if q["disturbed_blocks"] else " (quiet)"))
    return "\n".join(lines + notes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", type=float, default=0.1, help="link rate in Gbit/s; 0 = plain loopback")
    ap.add_argument("--link", choices=("shaped", "loopback"), default="shaped")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, from: {', '.join(VARIANTS)}; a commlab variant may name its schedule: "
                         f"commlab-X@allinone, @layerwise, @bucketN (N MB cap)")
    ap.add_argument("--steps", type=int, default=80, help="training steps per variant")
    ap.add_argument("--block", type=int, default=1, help="steps per variant per round (the interleaving grain)")
    ap.add_argument("--eval-every", type=int, default=5, help="evaluate each variant every N of its steps")
    ap.add_argument("--skip", type=int, default=3, help="first steps of each variant left out of the medians")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    ap.add_argument("--data", default="mnist32", choices=("mnist32", "synthetic"))
    ap.add_argument("--target", type=float, default=0.7, help="target held-out accuracy")
    ap.add_argument("--eval-size", type=int, default=512, help="held-out images per evaluation")
    ap.add_argument("--psgd-seed", type=int, default=0,
                    help="seed of PowerSGD's initial random factors (torch hook and commlab alike)")
    ap.add_argument("--schedule", default="bucket", choices=("bucket", "allinone"), help="commlab's fusion schedule")
    ap.add_argument("--cap-mb", type=float, default=25.0, help="bucket cap for --schedule bucket")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before the job is stopped")
    ap.add_argument("--json", help="save the raw per-iteration data and the summary here")
    common.add_worker_flags(ap)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = [n for n in args.variants.split(",") if n]
    bad = [n for n in names if not check_variant(n)]
    if bad or not names:
        ap.error(f"--variants: unknown {', '.join(bad) or '(none)'}; allowed: {', '.join(VARIANTS)}")
    if min(args.steps, args.block, args.eval_every) < 1:
        ap.error("--steps, --block and --eval-every must be >= 1")
    if args.gbps < 0:
        ap.error("--gbps must be >= 0")
    shaped = args.link == "shaped" and args.gbps > 0
    gbps = args.gbps if shaped else 0.0
    with tempfile.TemporaryDirectory(prefix="commlab-bench-") as d:
        out = os.path.join(d, "raw.json")
        fwd = ["--variants", ",".join(names), "--steps", str(args.steps), "--block", str(args.block),
               "--eval-every", str(args.eval_every),
               "--batch", str(args.batch), "--lr", str(args.lr), "--data", args.data,
               "--eval-size", str(args.eval_size), "--psgd-seed", str(args.psgd_seed),
               "--schedule", args.schedule, "--cap-mb", str(args.cap_mb),
               "--out", out]
        t0 = time.time()
        job = common.run_job(__file__, fwd, out, args.gbps if shaped else None, "network", args.timeout, tag="netb")
        if job is None:
            return 1
        raw, cluster = job
    raw["cluster"] = cluster
    a = analyse(raw, args.target, args.skip, gbps, args.block, max(args.block, args.eval_every))
    text = report(a, raw, args)
    print(text)
    if cluster:
        print(f"- cluster: {cluster['describe']}; total {time.time() - t0:.0f} s including setup and teardown")
    if args.json:
        common.write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
                                      "summary": {k: v for k, v in a.items()}, "table": text, **raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
