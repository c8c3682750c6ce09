"""Helpers shared by the benchmarks in bench/.

A benchmark is one script that runs twice: as the *parent* (what the user
starts) it launches itself under torchrun with ``--worker``; as a *worker*
(one per rank) it times interleaved variants and rank 0 writes the raw
numbers to a JSON file that the parent reads, summarises and prints.

    parent:  launch(__file__, worker_args, nproc=2)        -> returncode
    worker:  rank, world = init_worker()
             times = run_interleaved({"ddp": step_a, "commlab": step_b}, rounds, steps, warmup)
             times = gather_max(times)                      # per iteration, the slower rank
    parent:  summary = summarize(times, baseline="ddp"); print(markdown_table(...))

``times`` is always ``{variant: [[seconds per iteration] per round]}``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from commlab.lab.base.torchrun import free_port, torchrun_argv, worker_env  # noqa: E402  (one launcher for runs and benchmarks)
Times = Dict[str, List[List[float]]]


def prog(file: str) -> str:
    """A benchmark's name in its usage and error lines: ``commlab bench NAME`` when ``commlab bench``
    started it (it sets $COMMLAB_BENCH to the name), else ``python bench/NAME.py``."""
    name = os.path.splitext(os.path.basename(file))[0]
    return f"commlab bench {name}" if os.environ.get("COMMLAB_BENCH") == name else f"python bench/{name}.py"


# ---------------------------------------------------------------- launching

def add_worker_flags(ap) -> None:
    """The hidden flags of a self-launching benchmark: ``--worker`` (this process is a rank)
    and ``--out`` (where rank 0 writes the raw numbers for the parent)."""
    import argparse
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)


def launch(script: str, args: Sequence[str], nproc: int = 2) -> int:
    """Run ``script --worker args`` on ``nproc`` ranks; the workers' output goes to ours."""
    argv = torchrun_argv([os.path.abspath(script), "--worker", *args], nproc, free_port())
    return subprocess.run(argv, env=worker_env(), cwd=REPO).returncode


def init_worker(threads: int = 1):
    """Join the gloo process group torchrun set up; one intra-op thread per rank."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


# ---------------------------------------------------------------- timing

def run_interleaved(steps: Dict[str, Callable[[], None]], rounds: int, block: int, warmup: int = 3,
                    sync: Optional[Callable[[], None]] = None, log: Optional[Callable[[str], None]] = None) -> Times:
    """Time every variant in blocks of ``block`` iterations, ``rounds`` times.

    The order of the variants rotates by one each round, so no variant always
    runs right after the same neighbour. ``warmup`` untimed iterations of each
    variant come first. ``sync`` (a barrier) runs before each block, outside
    the timing, so ranks start every block together.
    """
    import time
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    times: Times = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if sync:
                sync()
            fn, out = steps[name], []
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            times[name].append(out)
        if log:
            log(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {1e3 * statistics.median(times[n][-1]):.1f}" for n in names) + " ms")
    return times


def gather_max(times: Times) -> Times:
    """Per iteration, the slowest rank's time (collective: call on every rank, after timing)."""
    import torch.distributed as dist
    everyone: List[Optional[Times]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    return {n: [[max(ts) for ts in zip(*(t[n][r] for t in everyone))] for r in range(len(times[n]))]
            for n in times}


# ---------------------------------------------------------------- summarising

def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread_ms(seconds: Sequence[float]) -> dict:
    """The median and the spread (min-max) of a variant's timed rounds, in ms."""
    return {"median_ms": median(seconds) * 1e3, "min_ms": min(seconds) * 1e3, "max_ms": max(seconds) * 1e3}


def spread_cell(d: dict) -> str:
    """A ``spread_ms`` entry as a table cell: median (min-max)."""
    return f"{d['median_ms']:.1f} ({d['min_ms']:.1f}-{d['max_ms']:.1f})"


def summarize(times: Times, baseline: str) -> Dict[str, dict]:
    """Per variant: median ms/iteration over all rounds, its ratio to the
    baseline's median, and the median of per-round ratios (each round's
    block median over the baseline's block median in the same round)."""
    base_all = median([t for blk in times[baseline] for t in blk])
    out = {}
    for name, blocks in times.items():
        flat = [t for blk in blocks for t in blk]
        per_round = [median(b) / median(bb) for b, bb in zip(blocks, times[baseline])]
        out[name] = {"median_ms": 1e3 * median(flat), "ratio": median(flat) / base_all,
                     "round_ratio": median(per_round), "round_ratios": per_round,
                     "iterations": len(flat)}
    return out


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """Cells are printed with str(); format numbers before passing them."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def write_out(out: str, res, md: str) -> None:
    """``--out OUT``: the results to OUT.json, their tables to OUT.md, and the tables printed."""
    write_json(out + ".json", res)
    with open(out + ".md", "w") as f:
        f.write(md)
    print(md)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- shaped links

def launch_cluster(script: str, args: Sequence[str], gbps: float, n: int = 2,
                   timeout_s: Optional[float] = None, tag: str = "bench") -> tuple:
    """Run ``script --worker args`` on ``n`` ranks of ONE emulated cluster shaped to ``gbps``
    (commlab.lab.net.netns.Cluster; root, Linux): each rank its own torchrun node inside its
    namespace, the workers' output going to ours. The cluster is torn down
    however this ends; the jobs are stopped (by their process groups) on a
    timeout or when one node fails. Returns ``(returncode, cluster_info)``."""
    import time
    from commlab.lab.base.procs import stop
    from commlab.lab.net.netns import Cluster, rank_argv
    entry = [os.path.abspath(script), "--worker", *args]
    with Cluster(n, gbps, tag=tag) as c:
        info = {"describe": c.describe(), "gbps": gbps, "burst_bytes": c.burst_bytes, "qdiscs": c.qdiscs()}
        port = free_port()
        procs = []
        try:
            for i in range(n):
                argv, upd = rank_argv(c, i, entry, port)
                procs.append(subprocess.Popen(argv, env={**worker_env(), **upd}, cwd=REPO,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    time.sleep(1.0)  # let the others report their own errors first
                    break
                if deadline is not None and time.monotonic() > deadline:
                    print(f"launch_cluster: timed out after {timeout_s:g} s; stopping the job", file=sys.stderr)
                    break
                time.sleep(0.2)
        finally:
            stop(procs)
        codes = [p.returncode for p in procs]
    rc = next((c for c in codes if c), 0)
    return (rc if rc is not None else 1), info


def run_per_rate(script: str, args: Sequence[str], rates: Sequence[float], tag: str):
    """``run_job`` of ``script --worker args --out RAW`` at every rate in ``rates`` (0: loopback), one after the
    other; yields ``(gbps, raw)``, and stops after printing the failing rate's line (the caller sees fewer)."""
    import tempfile
    for gbps in rates:
        name = f"{gbps:g} Gbit/s" if gbps else "loopback"
        with tempfile.TemporaryDirectory(prefix=f"clab-{tag}-") as tmp:
            out = os.path.join(tmp, "raw.json")
            got = run_job(script, [*args, "--out", out], out, gbps, name, timeout_s=900, tag=tag)
        if got is None:
            return
        yield gbps, got[0]
        print(f"{name}: done", flush=True)


def run_job(script: str, args: Sequence[str], out: str, gbps: Optional[float], name: str,
            timeout_s: Optional[float] = None, tag: str = "bench"):
    """Run ``script --worker args`` on two ranks, on one emulated cluster shaped to ``gbps`` (root) or on
    loopback when ``gbps`` is falsy, and read the JSON the workers wrote to ``out``.
    Returns ``(raw, cluster)`` (cluster: the shaped cluster's facts, or None), or None after printing a
    one-line failure naming ``name``."""
    if gbps:
        rc, cluster = launch_cluster(script, args, gbps, n=2, timeout_s=timeout_s, tag=tag)
    else:
        rc, cluster = launch(script, args, nproc=2), None
    if rc != 0 or not os.path.exists(out):
        print(f"{name}: the torchrun job failed (exit {rc})", file=sys.stderr)
        return None
    return read_json(out), cluster
