"""Compressor microbenchmark: compress + decompress cost of every registered compressor.

    python bench/compressor_speed.py [--sizes 1000,1000000,25000000] [--repeat 5] [--json out.json]

One process, one thread, fp32 input from a normal distribution. For each
compressor and size it reports the median time of a compress+decompress pair,
the throughput in GB/s of fp32 input, and the compression ratio (input bytes
over payload bytes). The 1 K column is the fixed cost per call that
MergeComp's merging of layers amortises. Compressors run with their default
parameters (top-k, random-k and DGC at 1%). Variants are interleaved per
round so that the machine's noise hits all of them alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def measure(names, sizes, repeat):
    import torch
    from engine.compressors import make, nbytes
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results = {}
    for n in sizes:
        x = torch.randn(n)
        comps = {name: make(name) for name in names}
        for c in comps.values():  # warm-up: lazy buffers, hash tables, first-call costs
            c.decompress(*c.compress(x))
        calls = max(3, min(200, int(2e6 // n))) if n < 1e6 else 1
        times = {name: [] for name in names}
        ratio = {}
        for _ in range(repeat):
            for name, c in comps.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    payload, ctx = c.compress(x)
                    c.decompress(payload, ctx)
                times[name].append((time.perf_counter() - t0) / calls)
                ratio[name] = (x.numel() * x.element_size()) / max(nbytes(payload), 1)
        for name in names:
            med = statistics.median(times[name])
            results.setdefault(name, {})[n] = {"seconds": med, "gbps": n * 4 / med / 1e9, "ratio": ratio[name]}
        print(f"size {n:>10,}: done", file=sys.stderr, flush=True)
    return results


def table(results, sizes):
    head = ["compressor"] + [f"{_h(n)} µs" if n < 1e5 else f"{_h(n)} GB/s" for n in sizes] + ["payload/input"]
    rows = []
    for name, per in results.items():
        cells = [name]
        for n in sizes:
            r = per[n]
            cells.append(f"{r['seconds'] * 1e6:.0f}" if n < 1e5 else f"{r['gbps']:.2f}")
        cells.append(f"{1 / per[sizes[-1]]['ratio']:.4f}")
        rows.append(cells)
    return common.markdown_table(head, rows)


def _h(n):
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}K"


def main(argv=None):
    from engine.compressors import names
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,1000000,25000000")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated compressor names (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    chosen = [n for n in args.only.split(",") if n] or list(names())
    res = measure(chosen, sizes, args.repeat)
    print(table(res, sizes))
    if args.json:
        common.write_json(args.json, {"sizes": sizes, "results": {k: {str(n): v for n, v in per.items()}
                                                                  for k, per in res.items()}})


if __name__ == "__main__":
    main()
