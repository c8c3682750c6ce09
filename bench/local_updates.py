"""The race: communicating less often against compressing every step, to the same held-out accuracy.

    python bench/local_updates.py [--gbps 0.1,1,10] [--world 2,4] [--link shaped|modeled] [--steps 160]
                                  [--target 0.7] [--H 8] [--param diloco.outer_lr=0.5 ...] [--quick]

One job per link rate and world size (a "setting"). On a shaped link (default; root) the parent builds ONE
emulated cluster of that many ranks shaped to the rate (``commlab.lab.net.netns.Cluster``: namespaces, veth pairs, tbf
on both ends) and starts this script with ``--worker`` in each rank's namespace as its own torchrun node, as
bench/network.py does; ``--link modeled`` runs the ranks on loopback with the engine's alpha-beta delays
(``network: {link: modeled}``, no root needed). Variants, each a job spec the lab validates (commlab.engine.spec):

- ``ddp``: every step's gradients, uncompressed, 25 MB buckets overlapped with backward (the engine's
  none/bucket/wfbp, which tests/test_ddp_equivalence.py holds to torch DDP bit for bit; on a modeled link
  only the engine's communicator is delayed, so torch DDP itself cannot run there);
- ``best``: the best per-step strategy for this link and world size as the advisor predicts it
  (``commlab.lab.strategy.advisor.advise``, methods left out, ranked on predicted iteration time x penalty; its
  profile is measured once in ``--runs``), unless ``--best`` names a compressor;
- ``powersgd``: PowerSGD rank 4 (uncompressed for 2 steps), 25 MB buckets, wfbp: the lab's best at 0.1 Gbit/s in
  bench/network.py;
- ``local_sgd`` (H), ``post_local_sgd`` (a quarter of the steps synchronous, then H), ``diloco`` (H, the
  paper's outer Nesterov SGD, lr 0.7, momentum 0.9), ``streaming_diloco`` (H, 2 fragments, tau 1, alpha 0.5,
  int8 pseudo-gradients), ``demo`` (DCT chunks of 64, top 4, sign; plain SGD at ``--demo-lr``): each method
  with the spec's optimizer unless said, on top of DDP's buckets; ``--param VARIANT.KEY=VALUE`` changes any.

In the worker every variant is built from the same initialisation (seed 0) with its own model, optimizer and
sampler (the same batches in the same order) and run by the engine's ``Stepper`` (what ``commlab run`` and
``commlab.wrap`` use): the method's hooks, its exchanges through the compressors and the exchange driver.
Variants share the process group and run interleaved: a round runs a block of ``--block`` steps of every
variant, the order rotating by one each round, with a barrier before each block (outside the timing), so load
from elsewhere falls on all alike. A block ends where no exchange is in flight (the block is a multiple of
every method's period, and Streaming DiLoCo's overlap stays within one), so no variant's collective runs during
another's steps. Every ``--eval-every`` steps (a multiple of the block) a variant is evaluated on a fixed
held-out subset (untimed), reading the parameters the ranks agree on (DiLoCo's global ones, local SGD's last
average). Each step is timed around the whole of it (forward, backward, exchange, optimizer, the method's
sync); the slower rank's time counts. A variant whose gradients stop being finite stops on every rank (an
untimed one-float all-reduce after each step keeps the ranks together).

Reported per variant: time to target (the sum of its step times up to the first evaluation at or above
``--target``), bytes to target (payload bytes this rank handed to collectives up to then; on a shaped link also
the interface's transmitted bytes, headers included), steps to target, final held-out accuracy, mean step time
and bytes per step, and time-to-target ratios against DDP and against the best per-step compressor (the
faster of ``best`` and ``powersgd`` to the target). The targets are checked at 0.1 Gbit/s: the best
method reaches the target at least 3x sooner than DDP and 1.5x sooner than the best per-step compressor, with a
final accuracy within 1 point of DDP's; at 10 Gbit/s the report says whether any method pays at all.

``--quick``: the smoke test (a small CNN on the 8x8 digits, 16 steps, blocks of 4, H 4, one setting); its
results go to bench/results/local_updates-quick.{json,md} unless ``--json``/``--md`` say otherwise.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import yaml  # noqa: E402

from bench import common, network  # noqa: E402
from commlab.lab.base.errors import LabError  # noqa: E402

METHODS = ("local_sgd", "post_local_sgd", "diloco", "streaming_diloco", "demo", "sparseloco", "muloco", "desloc")
PER_STEP = ("best", "powersgd")
"""The per-step compressors: the best of them is what a method must beat by 1.5x."""
VARIANTS = ("ddp", *PER_STEP, *METHODS)
DDP_STRATEGY = {"compressor": {"name": "none"}, "schedule": {"name": "bucket", "cap_mb": 25.0},
                "comm": {"mode": "wfbp"}}
POWERSGD = {"name": "powersgd", "rank": 4, "start_iter": 2}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# the targets, at 0.1 Gbit/s
TARGET_VS_DDP = 3.0
TARGET_VS_COMPRESSOR = 1.5
TARGET_ACC_POINTS = 0.01
# the targets across three continents (--cluster three_continents): the papers' setting
WAN_TARGETS = {"vs_ddp": 10.0, "vs_compressor": 2.0, "bytes_fewer": 100.0}
WAN_TARGET_AT = "three_continents"

DATA = {  # --data -> (the spec's data set: what the lab validates and profiles, the loader here)
    "mnist32": {"name": "synthetic", "shape": [3, 32, 32], "classes": 10},
    "digits": "digits",
    "text": "text",  # the lab's text (characters, windows of 64): a small language model's task
}


# ---------------------------------------------------------------- the variants (parent side)

def method_params(name: str, args) -> dict:
    """A method's section for this race: its parameters scaled to a run of ``args.steps`` steps."""
    H = args.H
    if name == "local_sgd":
        return {"name": name, "H": H}
    if name == "post_local_sgd":
        warmup = max(args.block, round(args.steps / 4 / args.block) * args.block)
        return {"name": name, "warmup": warmup, "H": H}
    if name == "diloco":
        return {"name": name, "H": H, "outer_lr": 0.7, "outer_momentum": 0.9}
    if name == "streaming_diloco":
        return {"name": name, "H": H, "fragments": 2, "tau": 1, "alpha": 0.5, "outer_lr": 0.7,
                "outer_momentum": 0.9, "compressor": {"name": "int8"}}
    if name == "demo":
        return {"name": name, "chunk": 64, "topk": 4, "decay": 0.999, "sign": True}
    if name == "sparseloco":  # its recipe's defaults (top-k per chunk, 2-bit values, error feedback), H as the others
        return {"name": name, "H": H}
    if name == "muloco":
        return {"name": name, "H": H}
    if name == "desloc":  # the parameters every H steps, Adam's moments at its default 3 H and 6 H
        return {"name": name, "Hx": H}
    raise ValueError(f"--variants: unknown method {name!r}; allowed: {', '.join(METHODS)}")


def parse_params(items) -> Dict[str, dict]:
    """``--param VARIANT.KEY=VALUE`` (repeatable) -> {variant: {key: value}}; ``lr`` sets the variant's
    learning rate, any other key its method's parameter (or, for ``best`` and ``powersgd``, its compressor's)."""
    out: Dict[str, dict] = {}
    for item in items or ():
        lhs, eq, raw = item.partition("=")
        var, dot, key = lhs.partition(".")
        if not eq or not dot or var not in VARIANTS or not key:
            raise ValueError(f"--param: expected VARIANT.KEY=VALUE with VARIANT one of {', '.join(VARIANTS)}, "
                             f"got {item!r}")
        out.setdefault(var, {})[key] = yaml.safe_load(raw)
    return out


def cluster_section(name: str, world: int, slow: Optional[str]) -> dict:
    """``network.cluster`` for a preset at ``world`` ranks, with ``--slow RANK:SPEED`` making one worker's compute
    slower (the preset's workers resolved by commlab.engine.cluster, then that worker's speed set)."""
    from commlab.engine import cluster
    ws = cluster.resolve(name, world, "modeled")["workers"]
    if slow:
        r, _, v = slow.partition(":")
        try:
            rank, speed = int(r), float(v)
        except ValueError:
            raise ValueError(f"--slow: expected RANK:SPEED, e.g. 3:0.5, got {slow!r}") from None
        if not 0 <= rank < world:
            raise ValueError(f"--slow: rank must be in 0..{world - 1}, got {rank}")
        ws[rank] = {**ws[rank], "speed": speed}
    return {"workers": ws}


def optimizer_of(args) -> dict:
    if args.opt == "adamw":
        return {"name": "adamw", "lr": args.lr}
    return {"name": "sgd", "lr": args.lr, "momentum": 0.9}


def base_spec(args, gbps: Optional[float], world: int, cluster: Optional[str] = None) -> dict:
    if cluster:
        net = {"link": "modeled", "cluster": cluster_section(cluster, world, args.slow)}
    else:
        net = {"link": args.link, "gbps": gbps}
    return {"name": "local-updates", "model": args.model, "dataset": DATA[args.data], "world_size": world,
            "steps": args.steps, "batch_size": args.batch, "seed": 0,
            "optimizer": optimizer_of(args), "network": net, "eval_every": 0,
            "threads": 1, **copy.deepcopy(DDP_STRATEGY)}


def bottleneck(net: dict) -> dict:
    """A cluster's worst link as one uniform link (its slowest rate, its two largest delays a hop apart): what the
    advisor plans the per-step strategy for."""
    ws = net["cluster"]["workers"]
    d = sorted((w["delay_ms"] for w in ws), reverse=True)
    return {"link": "modeled", "gbps": min(min(w["gbps_up"], w["gbps_down"]) for w in ws),
            "latency_us": 1e3 * (d[0] + (d[1] if len(d) > 1 else 0.0))}


def advise_best(base: dict, args, root: str, log) -> dict:
    """The advisor's predicted best per-step strategy for this link and world size (methods left out)."""
    from commlab.lab.base.specs import load_spec
    from commlab.lab.service.queue import Lab
    from commlab.lab.strategy import advisor
    if base["network"].get("cluster"):  # the advisor plans for one link: the cluster's worst
        base = {**base, "network": bottleneck(base["network"])}
    spec = load_spec(data=base).to_dict()
    adv = advisor.advise(spec, runs=root, say=log, methods=False, runner=Lab(root).runner())
    return {"label": adv.winner.label, "strategy": adv.winner.strategy(), "reason": adv.reason,
            "predicted_ms": adv.winner.predicted_ms, "penalty": adv.winner.penalty,
            "penalty_from": adv.winner.penalty_source.split(":")[0], "link_source": adv.link_source}


def variant_specs(names: List[str], base: dict, best: Optional[dict], params: Dict[str, dict], args) -> dict:
    """label -> {"spec": a validated, fully defaulted spec dict, "what": one line on what it is}. A per-step
    variant whose strategy is DDP's, or the other per-step variant's, is left out with a note."""
    from commlab.lab.base.specs import load_spec
    from commlab.lab.strategy.perfmodel.calibrate import compressor_key
    out, notes = {}, []
    for name in names:
        d = copy.deepcopy(base)
        own = dict(params.get(name, {}))
        if "lr" in own:
            d["optimizer"]["lr"] = own.pop("lr")
        if name == "best":
            if best is None:
                continue
            d.update(copy.deepcopy(best["strategy"]))
            if own:
                d["compressor"] = {**d["compressor"], "params": {**d["compressor"]["params"], **own}}
            what = f"the advisor's choice: {best['label']}"
        elif name == "powersgd":
            d["compressor"] = {**POWERSGD, **own}
            what = f"PowerSGD rank {d['compressor']['rank']}, bucket 25 MB, wfbp"
        elif name in METHODS:
            d["method"] = {**method_params(name, args), **own}
            if name == "demo":
                d["optimizer"] = {"name": "sgd", "lr": own_lr(params, name, args.demo_lr), "momentum": 0.0}
            if name == "muloco":  # Muon on the matrices (its usual rate), AdamW on the rest at the race's rate
                d["optimizer"] = {"name": "muon", "lr": own_lr(params, name, args.muon_lr),
                                  "adamw_lr": args.lr if args.opt == "adamw" else args.adam_lr}
            if name == "desloc" and d["optimizer"]["name"] not in ("adam", "adamw"):  # it syncs Adam's moments
                d["optimizer"] = {"name": "adamw", "lr": own_lr(params, name, args.adam_lr)}
            what = None
        else:
            what = "every step's gradients: none, bucket 25 MB, wfbp"
        full = load_spec(data={**d, "name": f"local-updates {name}"}).to_dict()
        if what is None:
            m = full["method"]
            ps = ", ".join(f"{k} {v}" for k, v in m["params"].items())
            comp = m.get("compressor") or {}
            what = (f"{ps}" + (f", pseudo-gradients in {compressor_key(comp)}" if comp and comp["name"] != "none"
                               else "") + f"; {full['optimizer']['name']} lr {full['optimizer']['lr']:g}")
        strat = {k: full[k] for k in ("compressor", "schedule", "comm", "method")}
        twin = next((k for k, v in out.items() if {x: v["spec"][x] for x in strat} == strat), None)
        if twin is not None and name in PER_STEP:
            notes.append(f"{name} is {twin}'s configuration ({what}): not run twice")
            continue
        out[name] = {"spec": full, "what": what}
    return {"variants": out, "notes": notes}


def own_lr(params: Dict[str, dict], name: str, default: float) -> float:
    return float(params.get(name, {}).get("lr", default))


def check_blocks(variants: dict, args) -> None:
    """A block must end where no exchange is in flight and evaluations fall on block ends: every method's
    sync period divides the block, and no overlapped exchange crosses a block's end."""
    from commlab.engine import methods
    from commlab.lab.strategy.perfmodel.calibrate import param_list
    if args.eval_every % args.block:
        raise ValueError(f"--eval-every: must be a multiple of --block ({args.block}), got {args.eval_every}")
    if args.steps % args.block:
        raise ValueError(f"--steps: must be a multiple of --block ({args.block}), got {args.steps}")
    for label, v in variants.items():
        sec = v["spec"]["method"]
        if sec["name"] == "none":
            continue
        tensor_bytes = [b for _, b in reversed(param_list(v["spec"]))]
        m = methods.make(sec["name"], **sec["params"])
        cross = [e for e in m.schedule(tensor_bytes, args.steps) if e.step // args.block
                 != (e.step + e.overlap) // args.block]
        if cross:
            e = cross[0]
            raise ValueError(f"--block: {label}'s exchange issued at step {e.step} is in flight for {e.overlap} "
                             f"steps, past the end of a block of {args.block}; use a block that is a multiple of "
                             f"its H with tau below H / fragments")


# ---------------------------------------------------------------- the worker

def load_data(name: str):
    from commlab.engine import data
    if name in ("digits", "text"):
        return data.load(name)
    return network.load_data(name)  # the shaped-link race's own data: the same images


class Runner:
    """One variant on this rank: its model, sampler and the engine's Stepper."""

    def __init__(self, label: str, spec_dict: dict, ds, rank: int, world: int):
        import torch

        from commlab.engine import data, models
        from commlab.engine.spec import JobSpec
        from commlab.engine.stepper import Stepper
        self.label = label
        spec = JobSpec.from_dict(spec_dict)
        torch.manual_seed(spec.seed)
        self.model = models.build(spec.model.name, ds.info, **spec.model.options)
        self.stepper = Stepper(spec, self.model, None, rank, torch.device("cpu"))
        self.sampler = data.ShardSampler(ds.size("train"), spec.batch_size, rank, world, seed=spec.seed)
        self.ds, self.world = ds, world
        self.steps = 0
        self.diverged: Optional[int] = None

    def step(self):
        """One training step; (seconds, payload bytes sent, finite)."""
        from commlab.engine import models
        from commlab.engine.stepper import Diverged
        x, y = self.ds.batch("train", next(self.sampler))
        tl = self.stepper.timeline
        t = time.perf_counter()
        t0, m0 = tl.now(), tl.mark()
        loss = models.loss_fn(self.model(x), y)
        t1, m1 = tl.now(), tl.mark()
        loss.backward()
        t2, m2 = tl.now(), tl.mark()
        try:
            rec = self.stepper.step_after_backward(loss, t0, t1, t2, m0, m1, m2)
        except Diverged:  # raised after the step's collectives: the ranks are still in step
            return time.perf_counter() - t, 0, False
        self.steps += 1
        return time.perf_counter() - t, rec["bytes_sent"], True

    def evaluate(self, eval_idx) -> float:
        """Held-out accuracy of the parameters every rank agrees on (every rank scores its share)."""
        import torch
        import torch.distributed as dist

        from commlab.engine import data, models
        c = k = 0
        self.model.eval()
        with torch.no_grad(), self.stepper.evaluating():
            for part in data.eval_batches(len(eval_idx), 256, dist.get_rank(), self.world):
                x, y = self.ds.batch("test", eval_idx[part])
                a, b = models.correct(self.model(x), y)
                c, k = c + a, k + b
        self.model.train()
        tot = torch.tensor([c, k], dtype=torch.float64)
        dist.all_reduce(tot)
        return float(tot[0] / max(tot[1], 1))


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    rank, world = common.init_worker(1)
    plan = common.read_json(args.plan)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if rank == 0 else (lambda s: None)
    ds = load_data(plan["data"])
    runners = {label: Runner(label, v["spec"], ds, rank, world) for label, v in plan["variants"].items()}
    g = torch.Generator().manual_seed(1)
    n_eval = min(plan["eval_size"], ds.size("test"))
    eval_idx = torch.randperm(ds.size("test"), generator=g)[:n_eval]
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    shaped = ifname != "lo"
    steps, block, every = plan["steps"], plan["block"], plan["eval_every"]
    rec = {n: {"t": [], "bytes": [], "tx": [], "acc": [], "diverged": None} for n in runners}
    names = list(runners)
    t_start = time.time()
    say(f"[local_updates] {world} ranks on {ifname}, {len(names)} variants x {steps // block} rounds x {block} "
        f"steps, eval on {n_eval} held-out examples every {every} steps")
    for r in range(steps // block):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            v = runners[name]
            if v.diverged is not None:
                continue
            dist.barrier()
            tx0 = _tx_bytes(ifname) if shaped else 0
            for _ in range(block):
                dt, nbytes, finite = v.step()
                ok = torch.tensor([1.0 if finite else 0.0])
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # untimed: every rank stops a diverged variant together
                if ok.item() < 1:
                    v.diverged = v.steps
                    rec[name]["diverged"] = v.steps
                    say(f"[local_updates] {name} diverged at step {v.steps}; it stops here")
                    break
                rec[name]["t"].append(dt)
                rec[name]["bytes"].append(nbytes)
            if shaped:
                rec[name]["tx"].append([_tx_bytes(ifname) - tx0, block])
            if v.diverged is None and (v.steps % every == 0 or v.steps == steps):
                rec[name]["acc"].append([v.steps, v.evaluate(eval_idx)])
        if rank == 0 and (r + 1) % max(1, (steps // block) // 10) == 0:
            say(f"[local_updates] round {r + 1}/{steps // block}: " + ", ".join(
                f"{n} {rec[n]['acc'][-1][1]:.3f}" for n in names if rec[n]["acc"]))
    for v in runners.values():
        v.stepper.drain()
    everyone = [None] * world
    dist.all_gather_object(everyone, rec)
    if rank == 0:
        common.write_json(args.out, {"world_size": world, "ifname": ifname, "shaped": shaped, "eval_size": n_eval,
                                     "ranks": everyone, "wall_s": time.time() - t_start})
    dist.barrier()
    for v in runners.values():
        v.stepper.close()
    dist.destroy_process_group()


def _tx_bytes(ifname: str) -> int:
    """Bytes the interface transmitted so far (headers included)."""
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


# ---------------------------------------------------------------- analysis (parent side)

def analyse(raw: dict, target: float, what: Dict[str, str], wan: bool = False) -> dict:
    """Per variant: time, bytes and steps to ``target``, final accuracy, means; ratios against DDP and the
    best per-step compressor; the best method and the targets."""
    ranks = raw["ranks"]
    res = {}
    for n in ranks[0]:
        t = [max(ts) for ts in zip(*(r[n]["t"] for r in ranks))]  # per step, the slower rank
        b = ranks[0][n]["bytes"]
        acc = ranks[0][n]["acc"]
        reach = next((s for s, a in acc if a >= target), None)
        tx = None
        if raw["shaped"]:  # per rank, the blocks up to the target (a block's bytes, all of it)
            def upto(r, k):
                return sum(x for x, _ in r[n]["tx"][:math.ceil(k / max(1, r[n]["tx"][0][1]))]) if r[n]["tx"] else 0
            tx = max(upto(r, reach if reach is not None else len(t)) for r in ranks)
        res[n] = {"what": what.get(n, ""), "steps": len(t), "diverged_at": ranks[0][n]["diverged"], "acc": acc,
                  "final_acc": acc[-1][1] if acc else None, "steps_to_target": reach,
                  "time_to_target_s": sum(t[:reach]) if reach is not None else None,
                  "bytes_to_target": sum(b[:reach]) if reach is not None else None,
                  "wire_bytes": tx, "wire_to_target": reach is not None,
                  "mean_ms": 1e3 * sum(t) / len(t) if t else None,
                  "bytes_per_step": sum(b) / len(b) if b else None, "total_s": sum(t), "iter_s": t,
                  "step_bytes": b}
    ddp = res.get("ddp", {}).get("time_to_target_s")
    comp = {n: res[n]["time_to_target_s"] for n in PER_STEP if res.get(n, {}).get("time_to_target_s")}
    best_comp = min(comp, key=comp.get) if comp else None
    for n, r in res.items():
        tt = r["time_to_target_s"]
        r["vs_ddp"] = ddp / tt if ddp and tt else None
        r["vs_best_compressor"] = comp[best_comp] / tt if best_comp and tt else None
    reached = {n: res[n]["time_to_target_s"] for n in METHODS if res.get(n, {}).get("time_to_target_s")}
    best = min(reached, key=reached.get) if reached else None
    return {"variants": res, "best_method": best, "best_compressor": best_comp, "target_acc": target,
            "verdict": verdict(res, best, wan)}


def retarget(s: dict, target: float) -> dict:
    """A saved setting analysed again at another held-out ``target`` (``--rereport FILE --target X``): the
    per-step times, bytes and evaluations it kept are all that is needed. A result saved before per-step bytes
    were kept counts each variant's bytes as its mean per step times the steps (exact for a method whose sync
    period divides the evaluation period); the setting then says so in ``bytes_note``."""
    a = s["analysis"]
    raw = {"shaped": s["shaped"], "ranks": [{n: {"t": r["iter_s"], "acc": r["acc"], "diverged": r["diverged_at"],
                                                  "tx": [], "bytes": r.get("step_bytes") or
                                                  [r["bytes_per_step"] or 0] * len(r["iter_s"])}
                                              for n, r in a["variants"].items()}]}
    out = dict(s, analysis=analyse(raw, target, {n: r["what"] for n, r in a["variants"].items()},
                                   wan=bool(s.get("wide_area"))))
    if any("step_bytes" not in r for r in a["variants"].values()):
        out["bytes_note"] = "bytes to the target counted as each variant's mean bytes per step times its steps"
    return out


def verdict(res: dict, best: Optional[str], wan: bool = False) -> dict:
    """The targets for the best method: >= 3x DDP's pace to the target, >= 1.5x the best per-step
    compressor's, final accuracy within 1 point of DDP's; and whether any method pays against DDP at all."""
    out = {"any_method_pays": any(((res.get(n) or {}).get("vs_ddp") or 0) > 1 for n in METHODS)}
    if best is None:
        return out
    b, ddp = res[best], res.get("ddp", {})
    t_ddp, t_comp = (WAN_TARGETS["vs_ddp"], WAN_TARGETS["vs_compressor"]) if wan else (TARGET_VS_DDP,
                                                                                      TARGET_VS_COMPRESSOR)
    if wan:
        fewer = (ddp["bytes_to_target"] / b["bytes_to_target"] if ddp.get("bytes_to_target") and b["bytes_to_target"]
                 else None)
        out["bytes_fewer"] = {"value": fewer, "target": WAN_TARGETS["bytes_fewer"],
                              "met": bool(fewer and fewer >= WAN_TARGETS["bytes_fewer"])}
    gap = (ddp.get("final_acc") - b["final_acc"]) if ddp.get("final_acc") is not None and b["final_acc"] is not None \
        else None
    out.update(vs_ddp={"value": b["vs_ddp"], "target": t_ddp, "met": bool(b["vs_ddp"] and b["vs_ddp"] >= t_ddp)},
               vs_compressor={"value": b["vs_best_compressor"], "target": t_comp,
                              "met": bool(b["vs_best_compressor"] and b["vs_best_compressor"] >= t_comp)},
               accuracy={"gap_points": None if gap is None else 100 * gap, "target_points": 100 * TARGET_ACC_POINTS,
                         "met": gap is not None and gap <= TARGET_ACC_POINTS + 1e-9})  # 0.80 - 0.79 > 0.01
    return out


COLUMNS = ["variant", "configuration", "time to target s", "bytes to target MiB", "steps to target",
           "final acc", "vs DDP", "vs best per-step compressor", "ms/step (mean)", "MiB/step (mean)"]
"""The table's columns (one table per setting); on a shaped link "wire MiB to target" follows the bytes."""


def _f(x, fmt: str, none: str = "—") -> str:
    return none if x is None else format(x, fmt)


def table(a: dict, shaped: bool) -> str:
    head = list(COLUMNS)
    if shaped:
        head.insert(4, "wire MiB to target")
    rows = []
    for n, r in a["variants"].items():
        label = n + (" (best method)" if n == a["best_method"] else "") + \
            (" (best per-step compressor)" if n == a["best_compressor"] else "")
        not_reached = (f"diverged at step {r['diverged_at']}" if r["diverged_at"] is not None
                       else f"not in {r['steps']} steps")
        row = [label, r["what"], _f(r["time_to_target_s"], ".1f", not_reached),
               _f(r["bytes_to_target"] and r["bytes_to_target"] / 2**20, ".2f", "—"),
               _f(r["steps_to_target"], "d", "—"), _f(r["final_acc"], ".3f"),
               _f(r["vs_ddp"], ".2f") + ("x" if r["vs_ddp"] else ""),
               _f(r["vs_best_compressor"], ".2f") + ("x" if r["vs_best_compressor"] else ""),
               _f(r["mean_ms"], ".0f"), _f(r["bytes_per_step"] and r["bytes_per_step"] / 2**20, ".3f", "0")]
        if shaped:
            row.insert(4, _f(r["wire_bytes"] and r["wire_bytes"] / 2**20, ".2f", "—") if r["wire_to_target"]
                       else "—")
        rows.append(row)
    return common.markdown_table(head, rows)


def report_setting(s: dict) -> str:
    a, gbps, world = s["analysis"], s["gbps"], s["world"]
    wide = s.get("wide_area")
    link = (f"cluster {wide['preset']} (modeled: {wide['text']})" if wide else
            f"{gbps:g} Gbit/s {'shaped (tbf)' if s['shaped'] else 'modeled (alpha-beta delays)'}")
    lines = [f"### {s['model']}, {link}, {world} ranks, target {a['target_acc']:.0%} held out", "",
             table(a, s["shaped"]), ""]
    if s.get("best"):
        b = s["best"]
        lines.append(f"- the advisor's predicted best per-step strategy here: {b['label']} (predicted "
                     f"{_f(b['predicted_ms'], '.1f')} ms per step, penalty {_f(b['penalty'], 'g', 'out')} from "
                     f"{b['penalty_from']}" + (f"; link: {b['link_source']}" if b.get("link_source") else "") + ")")
    for note in s.get("notes", []) + ([s["bytes_note"]] if s.get("bytes_note") else []):
        lines.append(f"- {note}")
    v, best = a["verdict"], a["best_method"]
    at = (wide["preset"] == WAN_TARGET_AT) if wide else gbps == 0.1
    where = f"the targets hold {'across three continents' if wide else 'at 0.1 Gbit/s'}"
    met, missed = ("met", "MISSED") if at else ("would meet", "would miss")
    if best is None:
        lines.append("- no method reached the target" + ("" if at else f" ({where})"))
    else:
        parts = [f"{v['vs_ddp']['value']:.2f}x sooner than DDP (target >= {v['vs_ddp']['target']:g}: "
                 f"{met if v['vs_ddp']['met'] else missed})" if v["vs_ddp"]["value"] else
                 "DDP did not reach the target: no ratio",
                 f"{v['vs_compressor']['value']:.2f}x sooner than the best per-step compressor "
                 f"({a['best_compressor']}) (target >= {v['vs_compressor']['target']:g}: "
                 f"{met if v['vs_compressor']['met'] else missed})" if v["vs_compressor"]["value"] else
                 "no per-step compressor reached the target: no ratio",
                 (f"final accuracy {abs(v['accuracy']['gap_points']):.1f} points "
                  f"{'below' if v['accuracy']['gap_points'] > 0 else 'above'} DDP's (target: at most "
                  f"{v['accuracy']['target_points']:g} below: {met if v['accuracy']['met'] else missed})"
                  if v["accuracy"]["gap_points"] is not None else "final accuracy: no DDP figure")]
        if v.get("bytes_fewer"):
            f = v["bytes_fewer"]
            parts.append(f"{f['value']:.0f}x fewer bytes to the target than DDP (target >= {f['target']:g}: "
                         f"{met if f['met'] else missed})" if f["value"] else "bytes: no DDP figure")
        lines.append(f"- best method: {best}: " + "; ".join(parts) + ("" if at else f" ({where})"))
    if gbps is not None and gbps >= 10:
        lines.append(f"- does any method pay at {gbps:g} Gbit/s? "
                     + ("yes: " + ", ".join(f"{n} {a['variants'][n]['vs_ddp']:.2f}x" for n in METHODS
                                            if (a["variants"].get(n) or {}).get("vs_ddp") and
                                            a["variants"][n]["vs_ddp"] > 1)
                        if v["any_method_pays"] else "no: none reaches the target sooner than DDP"))
    lines.append(f"- {s['steps']} steps per variant in blocks of {s['block']} (order rotating, barrier before each "
                 f"block), evaluated every {s['eval_every']} steps on {s['eval_size']} held-out examples; the "
                 f"setting took {s['wall_s'] / 60:.1f} min" + (f"; cluster: {s['cluster']['describe']}"
                                                               if s.get("cluster") else ""))
    return "\n".join(lines)


def report(settings: List[dict], args) -> str:
    head = [f"## Communicating less often against compressing every step: {args.model} on {args.data}",
            "", f"`{command_line(args)}`", ""]
    if args.quick:
        head += ["A smoke test (--quick): a small model for a few steps, not the race; its figures answer no "
                 "target.", ""]
    return "\n".join(head + [report_setting(s) + "\n" for s in settings])


def command_line(args) -> str:
    parts = ["python bench/local_updates.py"]
    if args.quick:
        parts.append("--quick")
    where = [f"--cluster {args.cluster}"] + ([f"--slow {args.slow}"] if args.slow else []) if args.cluster else \
        [f"--gbps {args.gbps}", f"--link {args.link}"]
    parts += where + [f"--world {args.world}", f"--model {args.model}", f"--data {args.data}", f"--opt {args.opt}",
                      f"--lr {args.lr:g}", f"--steps {args.steps}", f"--block {args.block}",
                      f"--eval-every {args.eval_every}", f"--target {args.target:g}", f"--H {args.H}"]
    parts += [f"--param {p}" for p in args.param]
    return " ".join(parts)


# ---------------------------------------------------------------- main

QUICK = {"model": "cnn", "data": "digits", "steps": 16, "block": 4, "eval_every": 4, "H": 4, "gbps": "0.1",
         "world": "2", "target": 0.5, "eval_size": 256, "lr": 0.05}


def one_setting(args, gbps: Optional[float], world: int, root: str, params: Dict[str, dict], log,
                preset: Optional[str] = None) -> Optional[dict]:
    """One job: every variant on ``world`` ranks, on a link of ``gbps`` or on the modeled cluster ``preset``."""
    base = base_spec(args, gbps, world, preset)
    names = [n for n in args.variants.split(",") if n]
    best = None
    if "best" in names:
        if args.best:
            best = {"label": f"{args.best} (given with --best)", "strategy": {**copy.deepcopy(DDP_STRATEGY),
                                                                               "compressor": yaml.safe_load(args.best)},
                    "predicted_ms": None, "penalty": None, "penalty_from": "--best"}
        else:
            best = advise_best(base, args, root, log)
    vs = variant_specs(names, base, best, params, args)
    check_blocks(vs["variants"], args)
    plan = {"variants": vs["variants"], "data": args.data, "steps": args.steps, "block": args.block,
            "eval_every": args.eval_every, "eval_size": args.eval_size}
    with tempfile.TemporaryDirectory(prefix="commlab-local-updates-") as d:
        plan_path, out = os.path.join(d, "plan.json"), os.path.join(d, "raw.json")
        common.write_json(plan_path, plan)
        fwd = ["--plan", plan_path, "--out", out]
        t0 = time.time()
        if args.link == "shaped" and not preset:
            rc, cluster = common.launch_cluster(__file__, fwd, gbps, n=world, timeout_s=args.timeout, tag="lupd")
        else:
            rc, cluster = common.launch(__file__, fwd, nproc=world), None
        if rc != 0 or not os.path.exists(out):
            where = f"on cluster {preset}" if preset else f"at {gbps:g} Gbit/s"
            print(f"local_updates: the torchrun job {where}, {world} ranks failed (exit {rc})", file=sys.stderr)
            return None
        raw = common.read_json(out)
    a = analyse(raw, args.target, {k: v["what"] for k, v in vs["variants"].items()}, wan=bool(preset))
    wide = None
    if preset:
        from commlab.lab.front.run_cli import cluster_text
        wide = {"preset": preset, "workers": base["network"]["cluster"]["workers"],
                "text": cluster_text({"preset": preset, **base["network"]["cluster"]}), "slow": args.slow}
    return {"gbps": gbps, "world": world, "wide_area": wide, "model": args.model, "shaped": raw["shaped"], "best": best,
            "notes": vs["notes"], "analysis": a, "steps": args.steps, "block": args.block,
            "eval_every": args.eval_every, "eval_size": raw["eval_size"], "wall_s": time.time() - t0,
            "cluster": cluster, "specs": {k: v["spec"] for k, v in vs["variants"].items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", default="0.1,1,10", help="link rates in Gbit/s, comma-separated (default 0.1,1,10)")
    ap.add_argument("--cluster", default=None, metavar="PRESET[,PRESET]",
                    help="wide-area settings instead of --gbps: network.cluster presets on modeled links (each "
                         "worker its own rate, delay and jitter; commlab.engine.cluster)")
    ap.add_argument("--slow", default=None, metavar="RANK:SPEED",
                    help="with --cluster: one worker's compute slower, e.g. 3:0.5 (half as fast)")
    ap.add_argument("--opt", default="sgd", choices=("sgd", "adamw"),
                    help="every variant's optimizer (sgd: momentum 0.9) at --lr, but DeMo's, MuLoCo's (muon) and "
                         "DES-LOC's (adamw at --adam-lr when --opt is sgd)")
    ap.add_argument("--muon-lr", type=float, default=0.02, help="MuLoCo's Muon learning rate")
    ap.add_argument("--adam-lr", type=float, default=0.002,
                    help="AdamW's rate where a variant needs Adam and --opt is sgd (DES-LOC; MuLoCo's AdamW part)")
    ap.add_argument("--world", default="2,4", help="world sizes, comma-separated (default 2,4)")
    ap.add_argument("--link", default="shaped", choices=("shaped", "modeled"),
                    help="shaped: tc on an emulated cluster (root); modeled: alpha-beta delays on loopback")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from: {', '.join(VARIANTS)}")
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--data", default="mnist32", choices=tuple(DATA))
    ap.add_argument("--steps", type=int, default=160, help="training steps per variant (a multiple of --block)")
    ap.add_argument("--block", type=int, default=8, help="steps per variant per round (a multiple of every H)")
    ap.add_argument("--eval-every", type=int, default=8, help="evaluate every N steps (a multiple of --block)")
    ap.add_argument("--eval-size", type=int, default=512, help="held-out examples per evaluation")
    ap.add_argument("--target", type=float, default=0.7, help="target held-out accuracy, the same for all")
    ap.add_argument("--H", type=int, default=8, help="steps between syncs of the methods (a divisor of --block)")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9) of every variant but DeMo")
    ap.add_argument("--demo-lr", type=float, default=0.001, help="DeMo's learning rate (plain SGD on sign updates)")
    ap.add_argument("--param", action="append", default=[], metavar="VARIANT.KEY=VALUE",
                    help="change a variant's parameter, e.g. diloco.H=16, diloco.outer_lr=0.5, demo.lr=0.003 "
                         "(repeatable)")
    ap.add_argument("--best", default=None, metavar="SECTION",
                    help="the 'best' variant's compressor, e.g. '{name: powersgd, rank: 2}', instead of the advisor's")
    ap.add_argument("--quick", action="store_true", help="a smoke test: " + ", ".join(f"{k} {v}" for k, v in
                                                                                      QUICK.items()))
    ap.add_argument("--runs", default=None, help="runs directory for the advisor's profile (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds before a setting's job is stopped")
    ap.add_argument("--json", default=None, help="default bench/results/local_updates.json (-quick.json with --quick)")
    ap.add_argument("--md", default=None, help="default bench/results/local_updates.md (-quick.md with --quick)")
    ap.add_argument("--rereport", default=None, metavar="JSON",
                    help="analyse a saved result again at --target (nothing runs) and write --json/--md")
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    common.add_worker_flags(ap)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        # leave as a commlab rank does (commlab.engine.worker): torch's and gloo's static destructors at interpreter
        # exit sometimes abort ("terminate called without an active exception") after all work is done,
        # which failed a finished job (seen once in the suite); every result is written and closed by now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.quick:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                 if a.startswith("--")}
        for k, v in QUICK.items():
            if k not in given:
                setattr(args, k, v)
    stem = os.path.join(RESULTS, "local_updates" + ("-quick" if args.quick else ""))
    args.json, args.md = args.json or stem + ".json", args.md or stem + ".md"
    if args.rereport:
        saved = common.read_json(args.rereport)
        for k, v in saved["args"].items():  # the saved run's settings, but the target asked for now
            if k not in ("target", "json", "md", "rereport"):
                setattr(args, k, v)
        settings = [retarget(s, args.target) for s in saved["settings"]]
        save(settings, args, time.time() - saved.get("wall_s", 0.0))
        for s in settings:
            print(report_setting(s) + "\n")
        print(f"wrote {args.md} and {args.json}")
        return 0
    try:
        params = parse_params(args.param)
        rates = [float(g) for g in str(args.gbps).split(",") if g]
        worlds = [int(w) for w in str(args.world).split(",") if w]
    except ValueError as e:
        ap.error(str(e) if str(e).startswith("--") else f"--gbps/--world: {e}")
    bad = [n for n in args.variants.split(",") if n and n not in VARIANTS]
    if bad or "ddp" not in args.variants.split(","):
        ap.error(f"--variants: {'unknown ' + ', '.join(bad) if bad else 'ddp is the reference and must be in'}; "
                 f"allowed: {', '.join(VARIANTS)}")
    if not rates or any(not 0.001 <= g <= 400 for g in rates):
        ap.error(f"--gbps: rates in [0.001, 400], got {args.gbps}")
    from commlab.engine.cluster import PRESETS
    clusters = [c for c in (args.cluster or "").split(",") if c]
    if any(c not in PRESETS for c in clusters):
        ap.error(f"--cluster: presets from {', '.join(PRESETS)}, got {args.cluster}")
    if args.slow and not clusters:
        ap.error("--slow: only with --cluster")
    if not worlds or any(not 2 <= w <= 16 for w in worlds):
        ap.error(f"--world: sizes in 2..16, got {args.world}")
    if not 0 < args.target <= 1 or min(args.steps, args.block, args.eval_every, args.H) < 1:
        ap.error("--target must be in (0, 1]; --steps, --block, --eval-every and --H must be >= 1")
    if args.block % args.H:
        ap.error(f"--block: must be a multiple of --H ({args.H}), got {args.block}")
    root = args.runs or tempfile.mkdtemp(prefix="commlab-local-updates-runs-")

    def log(m):
        print(m, file=sys.stderr, flush=True)
    settings, t0 = [], time.time()
    where = [(None, c) for c in clusters] if clusters else [(g, None) for g in rates]
    for world in worlds:
        for g, c in where:
            try:
                s = one_setting(args, g, world, root, params, log, c)
            except (ValueError, LabError) as e:  # a spec the lab refuses, a block that cuts an exchange, the
                ap.error(str(e))                 # advisor's profiling run failing: one line
            if s is None:
                return 1
            settings.append(s)
            save(settings, args, t0)
            print(report_setting(s) + "\n", flush=True)
    save(settings, args, t0)
    print(f"wrote {args.md} and {args.json}")
    return 0


def save(settings: List[dict], args, t0: float) -> None:
    """The results so far, each file replaced whole (a run stopped between settings keeps the earlier ones)."""
    from commlab.engine.runlog import write_json_atomic
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json_atomic(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "plan")},
                                  "settings": settings, "wall_s": time.time() - t0})
    tmp = f"{args.md}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(report(settings, args) + "\n")
    os.replace(tmp, args.md)


if __name__ == "__main__":
    sys.exit(main())
