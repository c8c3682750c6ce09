"""commlab's compressors against GRACE's, side by side in one process.

    python bench/grace_compare.py [--grace DIR] [--sizes 1000,25000000] [--repeat 7]
                                  [--only fp16,topk] [--out bench/results/grace_compare]

GRACE (sands-lab/grace, the research peer) is not part of this repository and
is never vendored. The benchmark imports its PyTorch compressors from a
checkout you point it at: ``--grace DIR``, else ``$GRACE_DIR``, else
``/tmp/grace``. Without one it says so, skips GRACE and times commlab alone.
To get one (outside the repository)::

    git clone https://github.com/sands-lab/grace /tmp/grace

GRACE's modules are loaded without horovod or a GPU: ``horovod.torch`` is
replaced in ``sys.modules``, for this process only, by a stub whose
``allreduce_`` returns its argument (one rank: the sum is the tensor itself),
and where cupy is missing its natural compressor runs on a numpy stand-in
(CPU). Nothing of GRACE's code is changed.

What is timed, per compressor, is one compress plus one decompress of one
fp32 tensor, like with like:

- parameters agree: ratio 1% (topk, randomk, dgc), threshold 2.576 (keeps
  ~1% of the N(0, 1) input; 0.01 would keep 99%), 127 QSGD levels, momentum
  0.9 (signum);
- error feedback is off on both sides, except where a method has it built in
  (commlab's ``dgc`` and ``efsignsgd``): there GRACE's matching memory
  (``DgcMemory``, ``EFSignSGDMemory``) runs its compensate and update too;
- PowerSGD is the computation only (rank 1, collectives are identities):
  commlab's single-process ``compress``/``decompress`` on the flat bucket, GRACE's
  compressor on the same elements viewed as a near-square matrix, with a Q it
  keeps from call to call (no memory, no residual).

One thread; the two implementations alternate within every round (which goes
first alternates too), so machine noise hits both alike. Reported: the median
per call, GB/s of fp32 input at large sizes, commlab over GRACE, and whether
each target holds: at 1K elements (the fixed cost per call) commlab no slower
than GRACE, at 25M at least twice GRACE's throughput.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import shlex
import statistics
import sys
import time
import types

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

SMALL = 100_000
"""Sizes below this are judged on the fixed cost (µs per call), the rest on throughput (GB/s)."""
SPEEDUP_AT_LARGE = 2.0
THRESHOLD = 2.576
"""|x| above which 1% of N(0, 1) lies: threshold sparsification keeping ~1%, as top-k does."""


# ---------------------------------------------------------------- loading GRACE

def grace_dir(arg):
    """(directory or None, why it is None)."""
    for where, d in (("--grace", arg), ("$GRACE_DIR", os.environ.get("GRACE_DIR")), ("default", "/tmp/grace")):
        if not d:
            continue
        if os.path.isdir(os.path.join(d, "grace_dl", "torch", "compressor")):
            return d, ""
        if where != "default":
            return None, f"{where} {d} holds no grace_dl/torch/compressor"
    return None, "no checkout at /tmp/grace and neither --grace nor $GRACE_DIR given"


def _stub_horovod():
    """horovod.torch with the one name GRACE's compressors and memories import, for one rank."""
    if "horovod.torch" in sys.modules:
        return
    hvd = types.ModuleType("horovod")
    ht = types.ModuleType("horovod.torch")
    ht.allreduce_ = lambda tensor, average=None, name=None, **kw: tensor  # one rank: the sum is itself
    ht.size = lambda: 1
    ht.rank = lambda: 0
    hvd.torch = ht
    sys.modules["horovod"], sys.modules["horovod.torch"] = hvd, ht


def _numpy_cupy():
    """The part of cupy GRACE's natural compressor uses, on numpy (CPU). Arrays stay numpy
    arrays of a subclass that answers ``toDlpack`` as cupy arrays do."""
    import numpy as np
    import torch

    class Array(np.ndarray):
        def toDlpack(self):
            return torch.from_numpy(np.ascontiguousarray(self))

    cp = types.ModuleType("cupy")
    # cupy.int32 is numpy's, which under numpy 1.x wrapped 2**31 to -2**31 as GRACE expects; numpy 2 refuses
    class Int32:
        dtype = np.dtype(np.int32)  # numpy takes any object with a dtype attribute as that dtype

        def __call__(self, v):
            return np.int64(v).astype(np.int32)
    cp.int32 = Int32()
    for name in ("uint8", "float32", "where", "clip", "right_shift", "left_shift", "bitwise_or",
                 "bitwise_and", "multiply"):
        setattr(cp, name, getattr(np, name))
    cp.fromDlpack = lambda capsule: torch.utils.dlpack.from_dlpack(capsule).numpy().view(Array)
    rng = np.random.default_rng(0)
    cp.random = types.SimpleNamespace(
        randint=lambda low, high, size, dtype: rng.integers(low, high, size=size, dtype=dtype).view(Array))
    return cp


def load_grace(d):
    """GRACE's compressor and memory modules by name, imported from checkout ``d``."""
    _stub_horovod()
    cupy_note = ""
    try:
        import cupy  # noqa: F401
    except ImportError:
        sys.modules["cupy"] = _numpy_cupy()
        cupy_note = "cupy absent: GRACE's natural runs on a numpy stand-in"
    sys.path.insert(0, os.path.abspath(d))
    mods = {}
    for name in GRACE_NAMES:
        mods[name] = importlib.import_module(f"grace_dl.torch.compressor.{name}")
    for name in ("dgc", "efsignsgd"):
        mods[f"memory.{name}"] = importlib.import_module(f"grace_dl.torch.memory.{name}")
    return mods, cupy_note


# ---------------------------------------------------------------- one call of each side

GRACE_NAMES = ("fp16", "topk", "randomk", "threshold", "dgc", "qsgd", "terngrad", "signsgd", "efsignsgd",
               "signum", "onebit", "natural", "powersgd")
"""The compressors GRACE has (its PyTorch side)."""
PARAMS = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}, "dgc": {"ratio": 0.01},
          "threshold": {"threshold": THRESHOLD}, "qsgd": {"levels": 127}, "signum": {"momentum": 0.9},
          "powersgd": {"rank": 1}}
"""commlab's parameters that match GRACE's below (the rest are defaults)."""


def commlab_call(name):
    from commlab.engine.compressors import make
    c = make(name, **PARAMS.get(name, {}))

    def call(x):
        payload, ctx = c.compress(x)
        return c.decompress(payload, ctx)
    return call


def grace_call(name, mods, n, device="cpu"):
    import torch
    m = mods[name]
    cls = {"fp16": "FP16Compressor", "topk": "TopKCompressor", "randomk": "RandomKCompressor",
           "threshold": "ThresholdCompressor", "dgc": "DgcCompressor", "qsgd": "QSGDCompressor",
           "terngrad": "TernGradCompressor", "signsgd": "SignSGDCompressor", "efsignsgd": "EFSignSGDCompressor",
           "signum": "SignumCompressor", "onebit": "OneBitCompressor", "natural": "NaturalCompressor",
           "powersgd": "PowerSGDCompressor"}[name]
    args = {"topk": (0.01,), "randomk": (0.01,), "dgc": (0.01,), "threshold": (THRESHOLD,), "qsgd": (127,),
            "signum": (0.9,), "efsignsgd": (1.0,)}.get(name, ())
    c = getattr(m, cls)(*args)
    memory = None
    if name == "dgc":
        memory = mods["memory.dgc"].DgcMemory(0.9, False)
    elif name == "efsignsgd":
        memory = mods["memory.efsignsgd"].EFSignSGDMemory(1.0)  # lr 1: residual in gradient units, as commlab's
    if name == "powersgd":
        rows, cols = near_square(n)
        c.q_memory["x"] = torch.randn(cols, 1, device=device)

        def call(x):
            x = x.view(rows, cols)
            payload, ctx = c.compress(x, "x")
            return c.decompress(payload, ctx)
        return call

    def call(x):
        if memory is not None:
            x = memory.compensate(x, "x")
        payload, ctx = c.compress(x, "x")
        if memory is not None:
            memory.update(x, "x", c, payload, ctx)
        return c.decompress(payload, ctx)
    return call


def near_square(n):
    """(rows, cols) with rows * cols = n, as square as n's divisors allow."""
    r = math.isqrt(n)
    while n % r:
        r -= 1
    return r, n // r


# ---------------------------------------------------------------- timing

def measure(names, sizes, repeat, mods, log):
    import torch
    torch.set_num_threads(1)
    results = {}
    for n in sizes:
        torch.manual_seed(0)
        x = torch.randn(n)
        calls = max(5, min(300, int(3e5 // n))) if n < SMALL else 1
        for name in names:
            sides = {"commlab": commlab_call(name)}
            if mods is not None:
                sides["grace"] = grace_call(name, mods, n)
            for f in sides.values():  # warm-up: buffers, tables, first-call costs
                f(x)
                f(x)
            times = {s: [] for s in sides}
            order = list(sides)
            for _ in range(repeat):
                for s in order:
                    f = sides[s]
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f(x)
                    times[s].append((time.perf_counter() - t0) / calls)
                order.reverse()
            row = results.setdefault(name, {})[str(n)] = {}
            for s, ts in times.items():
                med = statistics.median(ts)
                row[s] = {"seconds": med, "gbps": n * 4 / med / 1e9, "all": ts}
            del sides
            log(f"size {n:>10,} {name:>10}: " + ", ".join(f"{s} {r['seconds'] * 1e6:.0f} µs" for s, r in row.items()))
    return results


def verdicts(results, sizes):
    """Per compressor and size: the ratio and whether the target holds (None without GRACE)."""
    out = {}
    for name, per in results.items():
        for n in sizes:
            r = per[str(n)]
            if "grace" not in r:
                continue
            speedup = r["grace"]["seconds"] / r["commlab"]["seconds"]
            need = 1.0 if n < SMALL else SPEEDUP_AT_LARGE
            r["speedup"] = speedup
            r["target"] = need
            r["met"] = speedup >= need
            out[(name, n)] = r["met"]
    return out


def table(results, sizes, grace, before=None):
    """One row per compressor; ``before``: an earlier run's results, shown as commlab's previous figure."""
    head = ["compressor"]
    for n in sizes:
        unit = "µs" if n < SMALL else "GB/s"
        head += [f"{_h(n)} commlab before {unit}"] if before else []
        head += [f"{_h(n)} commlab {unit}"] + ([f"{_h(n)} GRACE {unit}", f"{_h(n)} speedup (target)"] if grace else [])
    rows = []
    for name, per in results.items():
        cells = [name]
        for n in sizes:
            r = per[str(n)]
            fmt = (lambda s: f"{s['seconds'] * 1e6:.1f}") if n < SMALL else (lambda s: f"{s['gbps']:.2f}")
            if before:
                old = before.get("results", {}).get(name, {}).get(str(n))
                cells.append(fmt(old["commlab"]) if old else "")
            cells.append(fmt(r["commlab"]))
            if grace:
                cells.append(fmt(r["grace"]))
                ok = "met" if r["met"] else "MISSED"
                cells.append(f"{r['speedup']:.2f}x (>= {r['target']:g}x: {ok})")
        rows.append(cells)
    return common.markdown_table(head, rows)


def countsketch(sizes, repeat, log):
    """Count Sketch compress+decompress (defaults: 5 rows, 1%), commlab only: GRACE has none."""
    import torch
    from commlab.engine.compressors import make
    out = {}
    for n in sizes:
        torch.manual_seed(0)
        x = torch.randn(n)
        c = make("countsketch")
        c.decompress(*c.compress(x))
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            c.decompress(*c.compress(x))
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        out[str(n)] = {"seconds": med, "gbps": n * 4 / med / 1e9, "all": ts}
        log(f"size {n:>10,} countsketch: {med * 1e3:.1f} ms")
    return out


def _h(n):
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}K"


def main(argv=None):
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--grace", default=None, help="GRACE checkout (default: $GRACE_DIR, then /tmp/grace)")
    ap.add_argument("--sizes", default="1000,25000000")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated compressor names (default: all GRACE has)")
    ap.add_argument("--sketch-sizes", default="25000000", help="Count Sketch sizes ('' for none)")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    ap.add_argument("--before", default=None, help="an earlier run's JSON: its commlab figures appear beside")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    names = [n for n in args.only.split(",") if n] or list(GRACE_NAMES)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    before = common.read_json(args.before) if args.before else None
    d, why = grace_dir(args.grace)
    mods, note = None, ""
    if d is None:
        log(f"GRACE skipped: {why}. Timing commlab alone.")
    else:
        mods, note = load_grace(d)
        log(f"GRACE from {d}" + (f" ({note})" if note else ""))
    import torch
    res = measure(names, sizes, args.repeat, mods, log)
    verdicts(res, sizes)
    sketch = countsketch([int(s) for s in args.sketch_sizes.split(",") if s], max(3, args.repeat // 2), log)
    command = "python bench/grace_compare.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    md = ["# commlab vs GRACE: compress + decompress, one fp32 tensor, one thread", "",
          f"Command: `{command}`", "",
          f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores; GRACE: "
          + (f"{d}" + (f" ({note})" if note else "") if d else f"skipped ({why})"),
          f"Medians of {args.repeat} interleaved rounds. Targets: at {_h(sizes[0])} commlab's time per call at most "
          f"GRACE's; at large sizes at least {SPEEDUP_AT_LARGE:g}x GRACE's throughput.", "",
          table(res, sizes, mods is not None, before), ""]
    if before:
        md.insert(-2, f"'before': commlab's figures from `{before.get('command', args.before)}` (an earlier run).")
    if sketch:
        old = (before or {}).get("countsketch", {})
        md += ["Count Sketch (5 rows, 1%; GRACE has none): " + ", ".join(
            f"{_h(int(n))} {r['seconds'] * 1e3:.0f} ms ({r['gbps']:.2f} GB/s)"
            + (f", before {old[n]['seconds'] * 1e3:.0f} ms: {old[n]['seconds'] / r['seconds']:.1f}x faster"
               if n in old else "") for n, r in sketch.items()), ""]
    text = "\n".join(md)
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text)
        common.write_json(args.out + ".json", {"command": command, "grace": d, "grace_note": note or why,
                                               "sizes": sizes, "repeat": args.repeat, "results": res,
                                               "countsketch": sketch})


if __name__ == "__main__":
    main()
