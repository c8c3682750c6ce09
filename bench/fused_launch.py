"""The host's cost of launching the fused GPU kernels: commlab's direct launch against Triton's own (CUDA only).

    python bench/fused_launch.py [--sizes 1000,100000,1000000] [--rounds 7] [--out bench/results/fused_launch]

For each codec with fused kernels (commlab/engine/compressors/fused.py) and size: a compress + decompress pair timed with
CUDA events around back-to-back calls (the host's cost counts, as in training), launched by commlab's
direct launch (the default: the compiled kernel, after Triton's first launch of its specialization) and by
Triton's ``JITFunction.run`` (``COMMLAB_FUSED_LAUNCH=triton``), interleaved per round; medians and the spread (min-max)
of the rounds, and the ratio. Also the bare launch of one kernel (``sign_pack`` on 1,000 elements), host time
per launch, both ways.
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
from bench.compressor_speed import FUSED, Timer, commlab_side  # noqa: E402

WAYS = ("commlab", "triton")


def _way(way: str):
    os.environ["COMMLAB_FUSED_LAUNCH"] = "direct" if way == "commlab" else "triton"


def bare_launch(device, rounds: int, calls: int = 2000) -> dict:
    """Host µs per launch of ``sign_pack`` on 1,000 elements (launches only, synchronised once per batch)."""
    import torch
    from commlab.engine.compressors import fused
    x = torch.randn(1000, device=device)
    out = torch.empty(125, dtype=torch.uint8, device=device)
    times = {w: [] for w in WAYS}
    for _ in range(rounds):
        for w in WAYS:
            _way(w)
            fused._launch(fused.K.sign_pack, (1,), x, out, 1000, 125, BLOCK=fused.BLOCK)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fused._launch(fused.K.sign_pack, (1,), x, out, 1000, 125, BLOCK=fused.BLOCK)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            times[w].append((t1 - t0) / calls * 1e6)
    os.environ.pop("COMMLAB_FUSED_LAUNCH", None)
    return {w: {"median_us": statistics.median(t), "min_us": min(t), "max_us": max(t)} for w, t in times.items()}


def measure(sizes, rounds: int, device, log=print) -> dict:
    import torch
    timer = Timer(device)
    out = {}
    for n in sizes:
        x = torch.randn(n, device=device)
        calls = max(20, min(500, int(5e7 // n)))
        sides = {name: commlab_side(name, device)[0] for name in FUSED}
        for name, fn in sides.items():  # warm-up: compile, and keep each specialization
            for w in WAYS:
                _way(w)
                fn(x)
                fn(x)
        times = {(name, w): [] for name in FUSED for w in WAYS}
        order = list(times)
        for _ in range(rounds):
            for name, w in order:
                _way(w)
                times[(name, w)].append(timer(sides[name], x, calls) * 1e6)
            order.reverse()
        os.environ.pop("COMMLAB_FUSED_LAUNCH", None)
        for name in FUSED:
            row = out.setdefault(name, {})[n] = {}
            for w in WAYS:
                t = times[(name, w)]
                row[w] = {"median_us": statistics.median(t), "min_us": min(t), "max_us": max(t)}
            row["speedup"] = row["triton"]["median_us"] / row["commlab"]["median_us"]
        log(f"size {n:>11,}: done")
    return out


def markdown(res: dict) -> str:
    b = res["bare"]
    lines = [f"Device: {res['device']}; Triton {res['triton']}; {res['rounds']} interleaved rounds, medians "
             "(min-max).", "",
             f"One launch of `sign_pack` (1,000 elements), host time: commlab {b['commlab']['median_us']:.1f} µs "
             f"({b['commlab']['min_us']:.1f}-{b['commlab']['max_us']:.1f}), Triton's "
             f"{b['triton']['median_us']:.1f} µs ({b['triton']['min_us']:.1f}-{b['triton']['max_us']:.1f}).", ""]
    sizes = sorted({n for rows in res["codecs"].values() for n in rows})
    head = ["codec"] + [f"{n:,}: {w} µs" for n in sizes for w in WAYS] + [f"{n:,}: speedup" for n in sizes]
    rows = []
    for name, by in res["codecs"].items():
        cells = [name]
        for n in sizes:
            for w in WAYS:
                r = by[n][w]
                cells.append(f"{r['median_us']:.1f} ({r['min_us']:.1f}-{r['max_us']:.1f})")
        cells += [f"{by[n]['speedup']:.2f}x" for n in sizes]
        rows.append(cells)
    return "\n".join(lines + [common.markdown_table(head, rows), ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,100000,1000000", help="elements, comma-separated")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--out", default="bench/results/fused_launch", help="writes OUT.md and OUT.json")
    a = ap.parse_args(argv)
    try:
        sizes = [int(float(s)) for s in a.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes: comma-separated element counts, got {a.sizes!r}")
    if a.rounds < 1:
        ap.error(f"--rounds: at least 1, got {a.rounds}")
    import torch
    from commlab.engine.compressors import fused
    device = torch.device("cuda")
    if not torch.cuda.is_available() or not fused.on(device, torch.float32):
        print("fused_launch: needs a CUDA GPU (compute capability 8.0+) with Triton", file=sys.stderr)
        return 2
    if not fused.K.DIRECT:
        print(f"fused_launch: Triton {fused.K.triton.__version__} keeps its own launch (3.6 or later needed)",
              file=sys.stderr)
        return 2
    res = {"device": torch.cuda.get_device_name(device), "triton": fused.K.triton.__version__, "rounds": a.rounds,
           "bare": bare_launch(device, a.rounds), "codecs": measure(sizes, a.rounds, device)}
    common.write_out(a.out, res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
