"""The performance model checked three ways, one table each.

    python bench/model_validation.py --table c                        # pure computation, ~10 s
    python bench/model_validation.py --table a --run-shaped [--gbps 1,10] [--ranks 2] [--iters 10]
                                     [--ops allreduce,...] [--sizes 4096,...]   # root, about 15 minutes
    python bench/model_validation.py --table b --run-shaped [--steps 60] [--only 1,4,topk]
    python bench/model_validation.py --table d                        # this CPU, ~1 min
    python bench/model_validation.py --table e                        # profiles measured on a GPU, ~30 s
    python bench/model_validation.py --table all [--run-shaped] [--json F] [--md F]

Each run keeps the tables it did not run from the --json file it writes (default
bench/results/model_validation.json); table (b)'s rows are bench/perfmodel.py's own files
(bench/results/perfmodel.json, .md). After measuring, `python scripts/publish_validation.py` copies the
errors into the package data that `commlab predict` and the Performance model page quote.

(a) Collectives on shaped links: every collective the engine issues (OPS: all-reduce; all-gather of a
    payload, after its synchronous header exchange; dear's all-gather of parameters; dear's reduce-scatter,
    an all-to-all of chunks and a local sum on gloo; the all-to-all alone), at 1 KB .. 64 MB, predicted by
    commlab.lab.strategy.perfmodel.costs with a link calibrated apart from these calls (the sustained rate from all-reduces of
    ~0.4 s of wire; the unshaped path's, for the token bucket's burst, from 48 MiB all-to-alls; the per-step latency
    and each collective's fixed cost from calls of 2 KiB; the host's sum per byte; the tbf's bucket, replayed over
    the back-to-back calls) against the median of ``--iters`` timed calls (40 at least up to 1 MiB) on a shaped
    cluster; geomean and max relative error, and each point's 25% quantile, mean and share of stalled calls.
    Needs root and a quiet machine: only with ``--run-shaped``; without it the predicted column is printed
    with the command to measure.
(b) End to end: the configurations of bench/perfmodel.py (25), predicted vs measured on shaped links;
    with ``--run-shaped`` it runs that benchmark (root, minutes), else lists the configurations.
(c) MergeComp's published scaling factors (bench/data/mergecomp_v100.json, read off the authors'
    figures) against predictions from the V100 device profile (bench/mergecomp_model.py): three
    variants, from datasheet links only to one published point per codec; errors in points.
(d) This CPU's per-layer profile against its own roofline, the efficiencies fitted (``--table d``,
    about a minute, no root): the efficiency factors where they can be measured.
(e) Steps and layers measured on a GPU (``commlab profile`` of torchvision ResNet-50 and ResNet-101, batch 64,
    on an H100: bench/data/h100/, from ``scripts/gpu_check.sh profiles``) against the roofline of the same
    model on that device: with the efficiency a device without its own figure borrows (A100's, from a
    published throughput), with the efficiency solved from the other model's measured step (held out), and
    fitted per layer. Pure computation here (~30 s).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KiB, 4 KiB, ..., 64 MiB
OPS = ("allreduce", "allgather", "allgather_params", "reduce_scatter", "alltoall")
"""What the engine issues: all-reduce (commlab.engine.comm.collectives.issue_allreduce); all-gather of a payload
after its synchronous header exchange (issue_allgather); dear's all-gather of parameters into one tensor
(no header); dear's reduce-scatter on gloo, an all-to-all of the buffer's chunks and a local sum; the
all-to-all alone (dear's shard codecs send their packed payloads with it)."""
MODEL_OP = {"allreduce": "allreduce", "allgather": "allgather", "allgather_params": "allgather",
            "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all"}
"""The model's collective for each: an all-to-all moves what a ring reduce-scatter does, (p-1)/p of the
buffer in p-1 steps, and sums nothing; the gathers take one rank's share (``bytes`` / p of the gathered result)."""


# --------------------------------------------------------------------------- (a) collectives

def worker(argv=None) -> int:
    """One rank of a measurement (a torchrun node in its namespace): ``iters`` timed calls of ``op`` on
    ``bytes`` of fp32 after two warm-up calls, as the engine issues them; rank 0 writes the times."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from commlab.engine.comm import collectives
    from commlab.engine.comm.collectives import issue_allgather, issue_allgather_into, issue_allreduce, issue_reduce_scatter
    from commlab.engine.runlog import write_json_atomic
    ap = argparse.ArgumentParser(prog="model_validation worker")
    ap.add_argument("--op", choices=OPS, required=True)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--gap", type=float, default=0.0, help="seconds of idle time before each timed call")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        world = dist.get_world_size()
        n = max(a.bytes // 4, world)
        n -= n % world
        t = torch.ones(n)
        got = torch.empty_like(t)
        share = t[:n // world].clone()
        scratch: dict = {}

        def call():
            if a.op == "allreduce":
                issue_allreduce([t]).wait()
            elif a.op == "allgather":  # every rank's payload: bytes / world each, as the model's per-rank m
                issue_allgather([share]).wait()
            elif a.op == "allgather_params":
                issue_allgather_into(got, share).wait()
            elif a.op == "alltoall":  # as issue_all_to_all sends its packed buffer (chunked on gloo)
                for w in collectives._all_to_all_works(got, t, None):
                    w.wait()
            else:  # dear on gloo: an all-to-all of the chunks, then the sum of what arrived
                issue_reduce_scatter(t, via_alltoall=True, scratch=scratch).wait()
        for _ in range(2):
            call()
        dist.barrier()
        times = []
        for _ in range(a.iters):
            if a.gap > 0:
                time.sleep(a.gap)
            elif a.gap < 0:  # busy: the CPU kept awake through the gap, as compute would
                end = time.perf_counter() - a.gap
                while time.perf_counter() < end:
                    pass
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        if dist.get_rank() == 0:
            write_json_atomic(a.out, {"op": a.op, "nbytes": n * 4, "world": world, "times": times})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def measure(cluster, op: str, nbytes: int, iters: int, timeout: float = 180.0, gap: float = 0.0) -> dict:
    """Run ``worker`` on every rank of ``cluster`` (commlab.lab.net.netns.Cluster) and return rank 0's times."""
    from commlab.lab.base.procs import stop
    from commlab.lab.base.torchrun import worker_env
    from commlab.lab.net.netns import rank_argv
    port = 20000 + secrets.randbelow(20000)
    with tempfile.TemporaryDirectory(prefix="clab-mv-") as tmp:
        out = os.path.join(tmp, "out.json")
        procs, logs = [], []
        try:
            for i in range(cluster.n):
                argv, env = rank_argv(cluster, i, [os.path.abspath(__file__), "worker", "--op", op, "--bytes",
                                                   str(nbytes), "--iters", str(iters), "--gap", str(gap),
                                                   "--out", out], port)
                logs.append(open(os.path.join(tmp, f"r{i}.log"), "wb"))
                procs.append(subprocess.Popen(argv, env={**worker_env(), **env}, stdout=logs[-1],
                                              stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.1)
        finally:
            stop(procs)
            for f in logs:
                f.close()
        if not os.path.exists(out):
            text = open(os.path.join(tmp, "r0.log"), errors="replace").read()
            said = [ln for ln in text.splitlines() if "Error" in ln and not ln.strip().startswith("error_file")]
            tail = " | ".join(said[:3]) or text[-600:]  # the worker's own error, not torchrun's summary of it
            raise RuntimeError(f"{op} {nbytes} B: no result ({tail})")
        with open(out) as f:
            return json.load(f)


def predict_collective(op: str, nbytes: int, world: int, link, iters: int) -> float:
    """The model's median of ``iters`` back-to-back calls after two warm-up calls, as ``worker`` times
    them (the token bucket drains across them). ``nbytes``: the all-reduce's or all-to-all's buffer, the
    gathered result of an all-gather (each rank contributes ``nbytes / world``)."""
    from commlab.lab.strategy.perfmodel import costs
    wire = costs.TokenBucket(link)
    mop = MODEL_OP[op]
    size = nbytes / world if mop == "allgather" else nbytes
    t, times = 0.0, []
    for _ in range(iters + 2):
        d = 0.0
        if op == "allgather":  # the engine's payload all-gather: its header first, synchronously
            d = wire.duration("header", costs.HEADER_BYTES_PER_TENSOR, world, t)
        d += wire.duration(mop, size, world, t + d)
        times.append(d)
        t += d
    return statistics.median(times[2:])


SMALL = 1 << 20
"""(a) sizes up to this many bytes get at least ``SMALL_ITERS`` timed calls: their median is otherwise a coin toss
between gloo's two modes on this host (below)."""
SMALL_ITERS = 40
FIXED_BYTES = 2048
"""(a) the per-step latency and each collective's fixed cost come from calls of this size (not one of the validated
sizes), back to back: the all-to-all's (one step, and unimodal here: median 0.20-0.26 ms) gives the latency, each
other collective's median beyond its steps and bytes its fixed cost. gloo's small calls stall about 4 ms in some
of them on this host (a woken thread waiting for the scheduler's next tick), the all-reduce's most (30-46%), which
put a latency calibrated from all-reduces anywhere in 0.24-1.92 ms."""
RATE_BYTES = 48 << 20
"""(a) the unshaped path's speed (a burst's) comes from all-to-alls of this size (not a validated size): the wire
alone, where an all-reduce's also carries its sums. The shaped link's sustained rate comes from
``calibrate.measure_link``'s all-reduces of about 0.4 s of wire (the tbf's rate to within 1% at 1 Gbit/s over four
runs, where 48 MiB all-to-alls on the shaped link came out 2-6% slower than the validated all-to-alls beside them)."""
RATE_ITERS = 7
GAMMA_BYTES = 16 << 20
STALL_S = 2e-3


def measure_gamma(nbytes: int = GAMMA_BYTES, reps: int = 9) -> float:
    """Seconds per byte of one out-of-place fp32 sum of ``nbytes`` on this CPU, one thread (the median): the
    host's sum of an all-reduce or of dear's reduce-scatter on gloo (``Link.gamma``)."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    out = torch.empty_like(a)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / nbytes


def path_rate(cluster, ranks: int) -> float:
    """Seconds per byte of the unshaped ``cluster`` (what a shaped link's token bucket lets a burst through at):
    the median of ``RATE_ITERS`` back-to-back all-to-alls of ``RATE_BYTES`` after two warm-up calls over the bytes
    each rank sends (its latency, under 1% of such a call, left in)."""
    from commlab.lab.strategy.perfmodel.costs import steps_and_wire
    t = statistics.median(measure(cluster, "alltoall", RATE_BYTES, RATE_ITERS)["times"])
    return t / steps_and_wire("all_to_all", RATE_BYTES, ranks)[1]


FAST_QUANTILE = 0.25
"""(a) the fixed costs come from this quantile of the calibrating calls, not their median: a call the host did not
hold up. On this VM a woken gloo thread sometimes waits ~4 ms on one virtual CPU while the other is idle (seen with
``perf sched timehist``: the thread runnable, the CPU's running task drawing no samples, i.e. the virtual CPU not
running), in 5-45% of calls, so the median of a collective's small calls falls in either mode from one launch to
the next; the model prices the call itself. Each point is also compared at this quantile."""


def geomean(errs) -> float:
    return math.exp(statistics.mean(math.log(max(e, 1e-6)) for e in errs))


FIXED_LAUNCHES = 3
"""(a) launches of each calibrating collective: the same 40 calls of 2 KiB give a 25% quantile up to three times
apart from one launch to the next on this host (0.08-0.25 ms for the all-to-all)."""


def quantile(xs, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fixed_costs(cluster, ranks: int, beta_burst: float, gamma: float) -> dict:
    """The per-step latency and each collective's fixed cost on ``cluster``, from ``SMALL_ITERS`` back-to-back
    calls of ``FIXED_BYTES`` per collective in each of ``FIXED_LAUNCHES`` launches (the median over launches of
    their ``FAST_QUANTILE``; their wire time at the burst's speed taken off)."""
    from commlab.lab.strategy.perfmodel import costs
    per_launch = {op: [] for op in OPS}
    for _ in range(FIXED_LAUNCHES):  # interleaved rounds: a launch's stall regime falls on one value of each op
        for op in OPS:
            per_launch[op].append(quantile(measure(cluster, op, FIXED_BYTES, SMALL_ITERS)["times"], FAST_QUANTILE))
    fast = {op: statistics.median(v) for op, v in per_launch.items()}
    steps, wire = costs.steps_and_wire("all_to_all", FIXED_BYTES, ranks)
    alpha = max(0.0, fast["alltoall"] - wire * beta_burst) / steps
    bare = costs.Link(alpha, beta_burst, 0.0, 0.0, gamma)

    def beyond(t, op, n):  # what a call of ``op`` took beyond its steps, bytes and sum
        return max(0.0, t - costs.collective(op, n, ranks, bare))
    fixed = {"all_to_all": 0.0, "allreduce": beyond(fast["allreduce"], "allreduce", FIXED_BYTES),
             "allgather": beyond(fast["allgather_params"], "allgather", FIXED_BYTES / ranks),
             "reduce_scatter": beyond(fast["reduce_scatter"], "reduce_scatter", FIXED_BYTES)}
    with_ag = costs.Link(alpha, beta_burst, 0.0, 0.0, gamma, (("allgather", fixed["allgather"]),))
    pair = costs.allgather_var([FIXED_BYTES / ranks], ranks, with_ag)  # the header's all-gather and the payload's
    fixed["header"] = max(0.0, fast["allgather"] - pair)
    return {"alpha": alpha, "fixed": fixed, "fast_s": fast, "per_launch_s": per_launch}


def table_a(gbps, ranks: int, iters: int, run: bool, ops=OPS, sizes=SIZES) -> dict:
    """Every op in ``ops`` at every size in ``sizes`` on a shaped cluster of ``ranks`` at each rate, against
    the model with the link calibrated apart from these calls: the burst's speed from all-to-alls on the unshaped
    emulated path (``path_rate``), the sustained rate from long all-reduces (``calibrate.measure_link``), the tbf's
    token bucket, the per-step latency and each collective's fixed cost from calls of ``FIXED_BYTES``
    (``fixed_costs``), and the host's sum per byte (``measure_gamma``). Each point: the median of ``iters`` calls (``SMALL_ITERS`` at least up to
    ``SMALL`` bytes), with their ``FAST_QUANTILE``, their mean and the share of calls that stalled (over
    ``STALL_S`` beyond the median) kept beside it."""
    from commlab.lab.strategy.perfmodel import calibrate as cal
    from commlab.lab.strategy.perfmodel.costs import Link
    rows, links, path = [], {}, None
    gamma = measure_gamma() if run else 0.0
    if run:
        from commlab.lab.net.netns import Cluster
        with Cluster(ranks, None, tag="path") as c:
            path = {"beta": path_rate(c, ranks), "source": f"all-to-alls of {RATE_BYTES} B, unshaped"}
    for g in gbps:
        with contextlib.ExitStack() as stack:
            cluster = None
            if run:
                beta = cal.measure_link(g, n_ranks=ranks)["beta"]
                cluster = stack.enter_context(Cluster(ranks, g, tag="mv"))
                fc = fixed_costs(cluster, ranks, path["beta"], gamma)
                link = Link(fc["alpha"], beta, cluster.burst_bytes, path["beta"], gamma,
                            tuple(sorted(fc["fixed"].items())))
                links[g] = {"alpha": fc["alpha"], "beta": beta, "burst_bytes": cluster.burst_bytes,
                            "beta_burst": path["beta"], "gamma": gamma, "fixed": fc["fixed"],
                            "fixed_from": f"median over {FIXED_LAUNCHES} launches of the {FAST_QUANTILE:.0%} quantile of "
                                          f"{SMALL_ITERS} calls of {FIXED_BYTES} B",
                            f"p{int(FAST_QUANTILE * 100)}_s": fc["fast_s"], "per_launch_s": fc["per_launch_s"],
                            "beta_from": "calibrate.measure_link: all-reduces of about 0.4 s of wire (64 MiB at most)"}
            else:
                link = Link.from_gbps(g)
            for op in ops:
                for n in sizes:
                    k = max(iters, SMALL_ITERS) if n <= SMALL else iters
                    pred = predict_collective(op, n, ranks, link, k)
                    row = {"gbps": g, "op": op, "bytes": n, "predicted_ms": pred * 1e3}
                    if cluster is not None:
                        times = measure(cluster, op, n, k)["times"]
                        meas, fast = statistics.median(times), quantile(times, FAST_QUANTILE)
                        row.update(measured_ms=meas * 1e3, error=pred / meas - 1, calls=k,
                                   fast_ms=fast * 1e3, error_fast=pred / fast - 1,
                                   mean_ms=statistics.mean(times) * 1e3,
                                   stalled=sum(t > meas + STALL_S for t in times) / k)
                    rows.append(row)
                    print(f"(a) {g:g} Gbit/s {op:14s} {n:>9d} B  predicted {pred * 1e3:9.3f} ms"
                          + (f"  measured {row['measured_ms']:9.3f} ms  {row['error']:+.1%}" if 'error' in row else ""),
                          flush=True)
    errs = [abs(r["error"]) for r in rows if "error" in r]
    fast = [abs(r["error_fast"]) for r in rows if "error_fast" in r]
    summary = ({"geomean_abs_error": geomean(errs), "max_abs_error": max(errs), "points": len(errs),
                "quantile": FAST_QUANTILE, "geomean_abs_error_at_quantile": geomean(fast),
                "max_abs_error_at_quantile": max(fast)} if errs else
               {"note": "not measured: rerun with --run-shaped as root on a quiet machine"})
    return {"rows": rows, "summary": summary, "ranks": ranks, "iters": iters, "links": links, "path": path}


# --------------------------------------------------------------------------- (b) end to end

def table_b(steps: int, only: str, run: bool, out_json: str, out_md: str) -> dict:
    from bench import perfmodel
    chosen = perfmodel.chosen(only)
    if not run:
        cmd = f"python bench/perfmodel.py --steps {steps}" + (f" --only {only}" if only else "")
        return {"configs": [{"config": i, "label": perfmodel.label(c)} for i, c in chosen],
                "summary": {"note": f"not run: `{cmd}` as root, or this table with --run-shaped"}}
    argv = ["--steps", str(steps), "--json", out_json, "--md", out_md] + (["--only", only] if only else [])
    rc = perfmodel.main(argv)
    if rc:
        raise RuntimeError(f"bench/perfmodel.py exited {rc}")
    with open(out_json) as f:
        got = json.load(f)
    return {"configs": got["rows"], "summary": got["summary"]}


# --------------------------------------------------------------------------- (c) MergeComp

def table_c() -> dict:
    from bench import mergecomp_model
    return mergecomp_model.table_c()


# --------------------------------------------------------------------------- (d) this CPU's roofline

def table_d(models=("mlp", "cnn", "resnet"), batch: int = 32, runs: str = "") -> dict:
    """This CPU's own per-layer profile (the lab's 12-step single-process profiling run) against the
    roofline of the same model on this CPU (peak and bandwidth measured by commlab.lab.strategy.perfmodel.roofline.measure_cpu),
    with the efficiencies fitted per model (commlab.lab.strategy.perfmodel.roofline.fit_layers): what the efficiency factors
    mean where they can be measured. Runs here, about a minute."""
    from commlab.lab.service.queue import Lab
    from commlab.lab.strategy.perfmodel import roofline, whatif
    runs = runs or tempfile.mkdtemp(prefix="clab-mv-d-")
    cpu = roofline.measure_cpu()
    out = {"cpu": {"matmul_gflops": cpu.flops["fp32"] / 1e9, "copy_gb_s": cpu.mem_bw / 1e9,
                   "shortest_op_us": cpu.kernel_s * 1e6}, "models": {}}
    for m in models:
        spec = whatif.load_for_prediction(data={"model": m, "batch_size": batch})
        prof = whatif.measure_profile(spec, runs, runner=Lab(runs).runner())
        fit = roofline.fit_layers(roofline.count_spec(spec), prof, cpu)
        errs = [abs(r["modeled_s"] / r["measured_s"] - 1) for r in fit["rows"]]
        meas, mod = sum(r["measured_s"] for r in fit["rows"]), sum(r["modeled_s"] for r in fit["rows"])
        out["models"][m] = {"compute_eff": fit["compute_eff"], "memory_eff": fit["memory_eff"],
                            "op_us": fit["op_s"] * 1e6, "layers": len(errs), "median_abs_error": statistics.median(errs),
                            "max_abs_error": max(errs), "step_error": mod / meas - 1, "rows": fit["rows"]}
        print(f"(d) {m}: e_c {fit['compute_eff']:.3g}, e_m {fit['memory_eff']:.3g}, {fit['op_s'] * 1e6:.1f} µs per "
              f"operator; per layer median {statistics.median(errs):.0%}, max {max(errs):.0%}; step "
              f"{mod / meas - 1:+.0%}", flush=True)
    return out


# --------------------------------------------------------------------------- (e) a GPU's roofline

GPU_PROFILES = ("bench/data/h100/profile-resnet50-b64.json", "bench/data/h100/profile-resnet101-b64.json")
"""Profiles measured on a lent GPU (scripts/gpu_check.sh profiles): each names its GPU, model and batch."""


def table_e(paths=GPU_PROFILES, borrowed_from: str = "A100") -> dict:
    """Each profile's measured step (forward + backward + optimizer, CUDA events) and layers (forward + backward)
    against the roofline of its model on its GPU, in the device's default precision: (1) with ``borrowed_from``'s
    efficiency, (2) with the efficiency solved from the other profiles' measured steps (the model itself held
    out), (3) with the efficiencies fitted to its own layers (commlab.lab.strategy.perfmodel.roofline.fit_layers)."""
    from commlab.lab.strategy.perfmodel import calibrate as cal
    from commlab.lab.strategy.perfmodel import devices, roofline
    loaded = []
    for path in paths:
        p = cal.Profile.load(path)
        dev = devices.identify((p.machine or {}).get("gpu") or "")
        if dev is None:
            raise SystemExit(f"(e) {path}: not measured on a GPU of the device table ({p.machine})")
        loaded.append((path, p, dev, roofline.count_spec(p.spec)))
    rows = []
    for path, p, dev, c in loaded:
        prec = dev.default_precision
        step = p.forward_s + p.backward_s + p.optimizer_s
        borrowed = devices.get(borrowed_from).efficiency(prec)
        others = [roofline.solve_compute_eff(c2, d2, prec, c2.batch / (p2.forward_s + p2.backward_s + p2.optimizer_s))
                  for q, p2, d2, c2 in loaded if q != path and d2.name == dev.name]
        held = statistics.median(others) if others else None

        def layer_errors(eff):
            price = roofline.pricer(dev, prec, eff)
            return [abs(sum(price(o) for o in c.forward[k] + c.backward.get(k, []))
                        / (p.layer_forward[k] + p.layer_backward[k]) - 1)
                    for k in c.forward if k in p.layer_forward and k in p.layer_backward]

        row = {"profile": path, "gpu": p.machine["gpu"], "device": dev.name, "precision": prec, "model": p.model,
               "batch": p.batch_size, "measured_ms": step * 1e3, "forward_ms": p.forward_s * 1e3,
               "backward_ms": p.backward_s * 1e3, "samples_per_s": p.batch_size / step,
               "solved_eff": roofline.solve_compute_eff(c, dev, prec, p.batch_size / step)}
        for name, eff in (("borrowed", borrowed), ("held_out", held)):
            if eff is None:
                continue
            pred = roofline.step_seconds(c, dev, prec, eff)["total"]
            errs = layer_errors(eff)
            row[name] = {"eff": eff, "predicted_ms": pred * 1e3, "step_error": pred / step - 1,
                         "layer_median_abs_error": statistics.median(errs), "layer_max_abs_error": max(errs),
                         "layers": len(errs)}
        fit = roofline.fit_layers(c, p, dev, prec)
        errs = [abs(r["modeled_s"] / r["measured_s"] - 1) for r in fit["rows"]]
        row["fitted"] = {"compute_eff": fit["compute_eff"], "memory_eff": fit["memory_eff"], "op_us": fit["op_s"] * 1e6,
                         "layer_median_abs_error": statistics.median(errs), "layer_max_abs_error": max(errs),
                         "step_error": sum(r["modeled_s"] for r in fit["rows"]) / sum(r["measured_s"] for r in fit["rows"]) - 1}
        rows.append(row)
        print(f"(e) {p.model} on {dev.name}: measured {step * 1e3:.2f} ms; {borrowed_from}'s efficiency "
              f"{row['borrowed']['step_error']:+.1%}" + (f"; held out {row['held_out']['step_error']:+.1%}"
                                                          if "held_out" in row else ""), flush=True)
    return {"borrowed_from": borrowed_from, "rows": rows}


# --------------------------------------------------------------------------- output

def markdown(res: dict) -> str:
    out = []
    if "a" in res:
        a = res["a"]
        q = f"p{int(a['summary'].get('quantile', FAST_QUANTILE) * 100)}"
        head = ["Gbit/s", "collective", "bytes", "predicted ms", "measured ms (median)", "error", f"measured {q}",
                f"error at {q}", "mean ms", "stalled"]

        def cell(r, k, fmt):
            return format(r[k], fmt) if k in r else ""
        rows = [[f"{r['gbps']:g}", r["op"], r["bytes"], f"{r['predicted_ms']:.3f}", cell(r, "measured_ms", ".3f"),
                 cell(r, "error", "+.1%"), cell(r, "fast_ms", ".3f"), cell(r, "error_fast", "+.1%"),
                 cell(r, "mean_ms", ".3f"), cell(r, "stalled", ".0%")] for r in a["rows"]]
        out += ["### (a) collectives on shaped links", "", common.markdown_table(head, rows), "",
                json.dumps(a["summary"]), ""]
    if "b" in res:
        b = res["b"]
        out += ["### (b) end to end (bench/perfmodel.py)", ""]
        out += [f"- {c['config']} {c['label']}" + (f": {c['error']:+.1%}" if "error" in c else "") for c in b["configs"]]
        out += ["", json.dumps(b["summary"]), ""]
    if "c" in res:
        c = res["c"]
        variants = ("datasheet", "fp32-calibrated", "published-calibrated")
        head = ["model", "GPUs", "link", "compressor", "schedule", "published %"] + [f"{v} %" for v in variants]
        rows = []
        for r in c["rows"]:
            rows.append([r["model"], r["gpus"], r["link"], r["compressor"], r["schedule"], f"{r['scaling_pct']:.1f}"]
                        + [f"{r[v]:.1f} ({r[v + '_error']:+.1f}){'*' if r[v + '_calibration'] else ''}"
                           for v in variants])
        out += ["### (c) MergeComp, 8 x V100: scaling factor, published vs predicted (error in points; * a "
                "calibration point of that variant)", "", common.markdown_table(head, rows), ""]
        out += [f"- {k}: median {v['median_abs_points']} points, mean {v['mean_abs_points']}, max "
                f"{v['max_abs_points']}, within 5 points {v['within_5_points']} of {v['n']}"
                for k, v in c["summary"].items()]
        out += ["", f"bus bandwidth (GB/s): {json.dumps(c['bus_gb_s'])}; codec cost scales: "
                    f"{json.dumps(c['codec_scale'])}; per call {c['per_call_ms']} ms; one GPU's step "
                    f"(ms): {json.dumps(c['compute_1gpu_ms'])}", ""]
    if "d" in res:
        d = res["d"]
        head = ["model", "compute eff", "memory eff", "µs per op", "layers", "median error", "max error", "step"]
        rows = [[m, f"{v['compute_eff']:.3g}", f"{v['memory_eff']:.3g}", f"{v['op_us']:.1f}", v["layers"],
                 f"{v['median_abs_error']:.0%}", f"{v['max_abs_error']:.0%}", f"{v['step_error']:+.0%}"]
                for m, v in d["models"].items()]
        out += ["### (d) this CPU: per-layer profile vs its roofline", "", json.dumps(d["cpu"]), "",
                common.markdown_table(head, rows), ""]
    if "e" in res:
        e = res["e"]
        head = ["model", "GPU", "batch", "measured ms", f"{e['borrowed_from']}'s efficiency: predicted ms",
                "step error", "layers: median / max error", "held out: efficiency", "predicted ms", "step error",
                "layers: median / max error", "fitted per layer: e_c / e_m / µs per op", "median / max error"]
        rows = []
        for r in e["rows"]:
            b, h, f = r["borrowed"], r.get("held_out"), r["fitted"]
            rows.append([r["model"], f"{r['device']} {r['precision']}", r["batch"], f"{r['measured_ms']:.2f}",
                         f"{b['predicted_ms']:.2f}", f"{b['step_error']:+.1%}",
                         f"{b['layer_median_abs_error']:.0%} / {b['layer_max_abs_error']:.0%}",
                         f"{h['eff']:.3f}" if h else "", f"{h['predicted_ms']:.2f}" if h else "",
                         f"{h['step_error']:+.1%}" if h else "",
                         f"{h['layer_median_abs_error']:.0%} / {h['layer_max_abs_error']:.0%}" if h else "",
                         f"{f['compute_eff']:.3f} / {f['memory_eff']:.2f} / {f['op_us']:.1f}",
                         f"{f['layer_median_abs_error']:.0%} / {f['layer_max_abs_error']:.0%}"])
        out += ["### (e) a GPU: measured steps and layers vs the device's roofline", "",
                common.markdown_table(head, rows), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0],
                                 epilog="(a) and (b) need root and a quiet machine; (c) runs anywhere")
    ap.add_argument("--table", default="c", help="a, b, c, d, e, several (cde) or all (default c)")
    ap.add_argument("--run-shaped", action="store_true", help="measure on shaped links (root; (a) and (b))")
    ap.add_argument("--gbps", default="1,10", help="(a) link rates, Gbit/s (default 1,10)")
    ap.add_argument("--ranks", type=int, default=2, help="(a) ranks (default 2)")
    ap.add_argument("--iters", type=int, default=10, help="(a) timed calls per size (default 10)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"(a) collectives (default all: {','.join(OPS)})")
    ap.add_argument("--sizes", default="", help="(a) bytes, comma-separated (default 1 KiB .. 64 MiB, x4)")
    ap.add_argument("--steps", type=int, default=60, help="(b) steps per configuration (default 60)")
    ap.add_argument("--only", default="", help="(b) config numbers or names, as bench/perfmodel.py --only")
    ap.add_argument("--json", default="bench/results/model_validation.json")
    ap.add_argument("--md", default="bench/results/model_validation.md")
    a = ap.parse_args(argv)
    try:
        gbps = [float(x) for x in a.gbps.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--gbps must be comma-separated numbers, got {a.gbps!r}")
    if not gbps or not all(0.001 <= g <= 400 for g in gbps):
        ap.error(f"--gbps must be in [0.001, 400], got {a.gbps!r}")
    ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    if not ops or set(ops) - set(OPS):
        ap.error(f"--ops must be names of {', '.join(OPS)}, got {a.ops!r}")
    try:
        sizes = [int(x) for x in a.sizes.split(",") if x.strip()] or SIZES
    except ValueError:
        ap.error(f"--sizes must be comma-separated byte counts, got {a.sizes!r}")
    if not all(64 <= n <= 1 << 30 for n in sizes):
        ap.error(f"--sizes must be in [64, 2**30] bytes, got {a.sizes!r}")
    if not 2 <= a.ranks <= 64 or a.iters < 1 or a.steps < 5:
        ap.error("--ranks must be 2..64, --iters >= 1, --steps >= 5")
    res = {}
    tables = "abcde" if a.table == "all" else a.table
    if not tables or set(tables) - set("abcde"):
        ap.error(f"--table must be letters of abcde or all, got {a.table!r}")
    if "a" in tables:
        res["a"] = table_a(gbps, a.ranks, a.iters, a.run_shaped, ops, sizes)
    if "b" in tables:
        res["b"] = table_b(a.steps, a.only, a.run_shaped, "bench/results/perfmodel.json", "bench/results/perfmodel.md")
    if "c" in tables:
        res["c"] = table_c()
    if "d" in tables:
        res["d"] = table_d()
    if "e" in tables:
        res["e"] = table_e()
    kept = {}
    if os.path.isfile(a.json):  # the tables not run this time stay as they were measured
        kept = {k: v for k, v in common.read_json(a.json).items() if k not in res}
    res = {k: v for k, v in sorted({**kept, **res}.items())}
    common.write_json(a.json, res)
    md = markdown(res)
    os.makedirs(os.path.dirname(a.md) or ".", exist_ok=True)
    with open(a.md, "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
