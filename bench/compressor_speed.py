"""Compressor microbenchmark: compress + decompress cost of every registered compressor, on CPU or a GPU.

    python bench/compressor_speed.py [--device cpu|cuda] [--sizes 1000,1000000,25000000]
                                     [--repeat 5] [--only fp16,topk] [--grace DIR|none]
                                     [--json out.json] [--out OUT]   # OUT.md and OUT.json

fp32 input from a normal distribution, on ``--device``. For each compressor and size it reports the
median time of a compress+decompress pair, the throughput in GB/s of fp32 input, and the compression
ratio (input bytes over payload bytes). The smallest size is the fixed cost per call that MergeComp's
merging of layers amortises. Parameters are bench/grace_compare.py's (top-k, random-k and DGC at 1%,
threshold 2.576 keeping ~1%, QSGD 127 levels, PowerSGD rank 1), the rest defaults. Variants are interleaved per round so that the machine's noise hits all of them alike.

On CPU it runs on one thread. On a GPU each timing is between two CUDA events around a batch of calls
(the host's launch cost counts, as it does in training), and two more columns appear:

- the fraction of the device's memory bandwidth reached, counting the input read and the payload
  written, ``(4 n + payload bytes) / time``, against the peak from the device's memory clock and bus
  width (and against a device-to-device copy measured in the same run);
- GRACE's compressors (sands-lab/grace, imported from a checkout outside the repository as
  bench/grace_compare.py does; never vendored) on the same device, interleaved with commlab's, and
  commlab's speedup over them.

With ``--profile-misses`` every (compressor, size) that misses a GPU target is run once more under
torch.profiler and its top kernels are written beside the tables: the profile says why.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

ELEMENTWISE = ("fp16", "bf16", "signsgd", "efsignsgd", "signum", "onebit", "qsgd", "terngrad", "natural")
"""The codecs held to a fraction of peak bandwidth: one pass over the input, no selection."""
GPU_TARGETS = {"bandwidth": 0.25, "vs_grace": 3.0, "fixed_us": 30.0}
"""On a GPU: elementwise codecs reach 25% of peak bandwidth at 25M elements, every compressor 3x GRACE's
throughput at large sizes, a fixed per-call cost of at most 30 µs (at the smallest size)."""
SMALL = 100_000
"""Sizes below this are judged on the time per call (µs), the rest on throughput (GB/s)."""
WARM_CALLS = 3
"""Calls of each side before the timing: first-call costs, and a graphed side's capture (its third call)."""
PEAK_BY_NAME = {"H100 80GB HBM3": 3.35e12, "H100": 3.35e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12,
                "A100-SXM4-40GB": 1.56e12}
"""Vendor peak bytes/s, used only when the device's properties lack the memory clock and bus width."""


# ---------------------------------------------------------------- the device and its clock

class Timer:
    """Seconds per call of ``fn`` run ``calls`` times back to back: host clock on CPU, CUDA events on GPU."""

    def __init__(self, device):
        import torch
        self.torch, self.cuda = torch, device.type == "cuda"

    def __call__(self, fn, x, calls):
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(x)
            return (time.perf_counter() - t0) / calls
        torch = self.torch
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn(x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls


def peak_bandwidth(device):
    """(bytes/s, how it was found) for a CUDA device, or (None, why) when it cannot be known."""
    import torch
    p = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    if clock_khz and bus_bits:  # double data rate: two transfers per clock
        return 2 * clock_khz * 1e3 * bus_bits / 8, f"2 x {clock_khz / 1e3:.0f} MHz x {bus_bits} bit (device properties)"
    for name, peak in PEAK_BY_NAME.items():
        if name in p.name:
            return peak, f"vendor figure for {name}"
    return None, f"unknown for {p.name}: pass --peak-gbs"


def copy_bandwidth(device, nbytes=1 << 30, repeat=10):
    """Bytes/s of a device-to-device copy (read + write counted), median of ``repeat``."""
    import torch
    a = torch.empty(nbytes // 4, device=device)
    b = torch.empty_like(a)
    t = Timer(device)
    b.copy_(a)
    ts = [t(b.copy_, a, 1) for _ in range(repeat)]
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(ts)


# ---------------------------------------------------------------- one call of each side

FUSED = ("signsgd", "signum", "efsignsgd", "onebit", "qsgd", "terngrad", "natural")
"""The codecs with fused GPU kernels (commlab/engine/compressors/fused.py); on a GPU the bench also times their eager
torch path (COMMLAB_FUSED=0) in the same rounds."""


def commlab_side(name, device, eager=False, graphed=False):
    """(call(x) -> output, payload bytes of the last call). ``eager``: with the fused kernels off; ``graphed``:
    compress and decompress replayed from CUDA graphs (``COMMLAB_GRAPHS=1``, as ``BucketContext.encode`` and the
    exchanges' decoding do)."""
    from bench.grace_compare import PARAMS
    from commlab.engine.compressors import fused, graphs, make
    from commlab.engine.compressors.base import nbytes
    from commlab.engine.compressors.capabilities import DEFAULT_BUCKET
    c = make(name, **PARAMS.get(name, {}))
    last = {}

    def call(x):
        payload, ctx = c.compress(x)
        last["bytes"] = payload
        return c.decompress(payload, ctx)

    def call_eager(x):
        with fused.disabled():
            return call(x)

    def call_graphed(x):
        payload, ctx = graphs.compress(c, x, DEFAULT_BUCKET)
        last["bytes"] = payload
        return c.decompress(payload, ctx)
    graphs.force(c, graphed)  # whatever COMMLAB_GRAPHS says: each side is what it is named
    return (call_eager if eager else call_graphed if graphed else call), lambda: nbytes(last["bytes"])


def graph_max() -> int:
    """The largest size the graphed variant is timed at: the largest bucket graphed."""
    from commlab.engine.compressors import graphs
    return graphs.MAX_ELEMENTS


def graphable(name) -> bool:
    """Whether codec ``name`` may be graphed (commlab/engine/compressors/graphs.py): the bench then times that too."""
    from commlab.engine.compressors import resolve
    return resolve(name).capabilities.graphable


def grace_side(name, mods, n, device):
    """GRACE's compressor with the same parameters as commlab's defaults, or None where GRACE has none."""
    from bench import grace_compare
    if name not in grace_compare.GRACE_NAMES:
        return None
    return grace_compare.grace_call(name, mods, n, device=device)


# ---------------------------------------------------------------- timing

def measure(names, sizes, repeat, device, mods=None, log=print):
    import torch
    if device.type == "cpu":
        torch.set_num_threads(1)
    timer = Timer(device)
    results = {}
    for n in sizes:
        torch.manual_seed(0)
        x = torch.randn(n, device=device)
        if device.type == "cuda":
            calls = max(20, min(500, int(5e7 // n))) if n < SMALL else max(3, int(2e8 // n))
        else:
            calls = max(3, min(200, int(2e6 // n))) if n < 1e6 else 1
        sides = {}
        for name in names:
            sides[(name, "commlab")] = commlab_side(name, device)
            if device.type == "cuda" and name in FUSED:
                sides[(name, "eager")] = commlab_side(name, device, eager=True)
            if device.type == "cuda" and graphable(name) and n <= graph_max():
                sides[(name, "graphed")] = commlab_side(name, device, graphed=True)
            if mods is not None:
                g = grace_side(name, mods, n, device)
                if g is not None:
                    sides[(name, "grace")] = (g, None)
        errors = {}
        for key, (fn, _) in list(sides.items()):  # warm-up: lazy buffers, hash tables, first-call costs
            try:
                for _ in range(WARM_CALLS):
                    fn(x)
            except Exception as e:  # GRACE on this device can fail; commlab must not
                if key[1] == "commlab":
                    raise
                errors[key] = f"{type(e).__name__}: {e}"
                log(f"{key[0]} ({key[1]}) at {n:,}: {errors[key]}")
                del sides[key]
        times = {key: [] for key in sides}
        order = list(sides)
        for _ in range(repeat):
            for key in order:
                times[key].append(timer(sides[key][0], x, calls))
            order.reverse()
        for name in names:
            row = results.setdefault(name, {})[n] = {}
            key = (name, "commlab")
            med = statistics.median(times[key])
            payload = sides[key][1]()
            row.update({"seconds": med, "gbps": n * 4 / med / 1e9, "ratio": n * 4 / max(payload, 1),
                        "payload_bytes": payload, "moved_gbps": (n * 4 + payload) / med / 1e9})
            for way in ("eager", "graphed"):
                if (name, way) in times:
                    e = statistics.median(times[(name, way)])
                    row[way] = {"seconds": e, "gbps": n * 4 / e / 1e9}
            if "graphed" in row and (name, "grace") in times:
                row["graphed"]["speedup"] = statistics.median(times[(name, "grace")]) / row["graphed"]["seconds"]
            if (name, "grace") in times:
                g = statistics.median(times[(name, "grace")])
                row["grace"] = {"seconds": g, "gbps": n * 4 / g / 1e9}
                row["speedup"] = g / med
            elif (name, "grace") in errors:
                row["grace_error"] = errors[(name, "grace")]
            if (name, "graphed") in errors:
                row["graphed_error"] = errors[(name, "graphed")]
        del x, sides
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"size {n:>11,}: done")
    return results


def judge(results, sizes, peak):
    """Per GPU target: the list of (compressor, size, figure, met)."""
    out = {"bandwidth": [], "vs_grace": [], "fixed_us": []}
    small = min(sizes)
    for name, per in results.items():
        for n, r in per.items():
            if n == small and n < SMALL:
                us = r["seconds"] * 1e6
                out["fixed_us"].append((name, n, us, us <= GPU_TARGETS["fixed_us"]))
                if "graphed" in r:
                    us = r["graphed"]["seconds"] * 1e6
                    out["fixed_us"].append((f"{name} graphed", n, us, us <= GPU_TARGETS["fixed_us"]))
            if n >= SMALL and "speedup" in r:
                out["vs_grace"].append((name, n, r["speedup"], r["speedup"] >= GPU_TARGETS["vs_grace"]))
            if n >= SMALL and "speedup" in r.get("graphed", {}):
                v = r["graphed"]["speedup"]
                out["vs_grace"].append((f"{name} graphed", n, v, v >= GPU_TARGETS["vs_grace"]))
            if n == 25_000_000 and name in ELEMENTWISE and peak:
                frac = r["moved_gbps"] * 1e9 / peak
                out["bandwidth"].append((name, n, frac, frac >= GPU_TARGETS["bandwidth"]))
                if "graphed" in r:
                    frac = (n * 4 + r["payload_bytes"]) / r["graphed"]["seconds"] / peak
                    out["bandwidth"].append((f"{name} graphed", n, frac, frac >= GPU_TARGETS["bandwidth"]))
    return out


def profile(name, n, device, mods=None, side="commlab", top=6):
    """The top kernels (by device time) of a few compress+decompress calls, one line each."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile
    torch.manual_seed(0)
    x = torch.randn(n, device=device)
    fn = commlab_side(name, device)[0] if side == "commlab" else grace_side(name, mods, n, device)
    fn(x)
    torch.cuda.synchronize()
    calls = 5
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"]
    kernels = sum(e.count for e in events) / calls
    gpu_us = sum(e.device_time_total for e in events) / calls
    cpu_us = max((e.cpu_time_total for e in prof.key_averages() if e.key.startswith("ProfilerStep")), default=0)
    lines = [f"{side} {name} at {_h(n)}: {kernels:.0f} kernels per call, {gpu_us:.0f} µs of kernel time per call"
             + (f" (host {cpu_us / calls:.0f} µs)" if cpu_us else "")]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        lines.append(f"  {e.device_time_total / calls:9.1f} µs  x{e.count / calls:.0f}  {e.key[:90]}")
    return lines


# ---------------------------------------------------------------- tables

def table(results, sizes, cuda, peak, grace):
    head = ["compressor"]
    eager = any("eager" in r for per in results.values() for r in per.values())
    graphed = any("graphed" in r for per in results.values() for r in per.values())
    for n in sizes:
        unit = "µs" if n < SMALL else "GB/s"
        head.append(f"{_h(n)} {unit}")
        if eager:
            head.append(f"{_h(n)} eager {unit}")
        if graphed and n <= graph_max():
            head.append(f"{_h(n)} graphed {unit}")
        if grace:
            head.append(f"{_h(n)} GRACE {unit}")
            head.append(f"{_h(n)} speedup")
        if cuda and peak and n >= SMALL:
            head.append(f"{_h(n)} % peak")
    head.append("payload/input")
    rows = []
    for name, per in results.items():
        cells = [name]
        for n in sizes:
            r = per[n]
            fmt = (lambda s: f"{s * 1e6:.1f}") if n < SMALL else (lambda s: f"{n * 4 / s / 1e9:.2f}")
            cells.append(fmt(r["seconds"]))
            if eager:
                cells.append(fmt(r["eager"]["seconds"]) if "eager" in r else "-")
            if graphed and n <= graph_max():
                cells.append(fmt(r["graphed"]["seconds"]) if "graphed" in r else "-")
            if grace:
                cells.append(fmt(r["grace"]["seconds"]) if "grace" in r else
                             ("failed" if "grace_error" in r else "-"))
                cells.append(f"{r['speedup']:.2f}x" if "speedup" in r else "-")
            if cuda and peak and n >= SMALL:
                cells.append(f"{100 * r['moved_gbps'] * 1e9 / peak:.1f}")
        cells.append(f"{1 / per[sizes[-1]]['ratio']:.4f}")
        rows.append(cells)
    return common.markdown_table(head, rows)


def verdict_lines(verdicts):
    lines = []
    names = {"bandwidth": f"elementwise codecs >= {GPU_TARGETS['bandwidth']:.0%} of peak bandwidth at 25M",
             "vs_grace": f"every compressor >= {GPU_TARGETS['vs_grace']:g}x GRACE's throughput (large sizes)",
             "fixed_us": f"fixed per-call cost <= {GPU_TARGETS['fixed_us']:g} µs"}
    for key, rows in verdicts.items():
        if not rows:
            lines.append(f"- {names[key]}: not judged (no figures)")
            continue
        missed = [r for r in rows if not r[3]]
        fmt = {"bandwidth": lambda v: f"{100 * v:.1f}%", "vs_grace": lambda v: f"{v:.2f}x",
               "fixed_us": lambda v: f"{v:.1f} µs"}[key]
        lines.append(f"- {names[key]}: {len(rows) - len(missed)}/{len(rows)} met"
                     + (": missed " + ", ".join(f"{r[0]} at {_h(r[1])} ({fmt(r[2])})" for r in missed) if missed else ""))
    return lines


def _h(n):
    return f"{n // 1_000_000}M" if n >= 1_000_000 else f"{n // 1000}K"


def main(argv=None):
    from commlab.engine.compressors import names as all_names
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    ap.add_argument("--sizes", default=None, help="comma-separated element counts "
                    "(default 1000,1000000,25000000; on cuda also 100000000)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated compressor names (default: all)")
    ap.add_argument("--grace", default=None, help="GRACE checkout to time beside (default: $GRACE_DIR, then "
                    "/tmp/grace, if present; 'none' skips it)")
    ap.add_argument("--peak-gbs", type=float, default=None, help="the device's peak memory bandwidth in GB/s "
                    "(default: from its properties)")
    ap.add_argument("--profile-misses", action="store_true", help="profile every missed GPU target")
    ap.add_argument("--json", default=None, help="write the figures as JSON here")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args(argv)
    import torch
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise SystemExit(f"--device: {args.device!r} is not a device; allowed: cpu, cuda, cuda:N")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device: {args.device!r}; allowed: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device: cuda was asked for but torch sees no GPU")
    cuda = device.type == "cuda"
    sizes = [int(s) for s in (args.sizes or ("1000,1000000,25000000,100000000" if cuda else
                                             "1000,1000000,25000000")).split(",") if s]
    chosen = [n for n in args.only.split(",") if n] or list(all_names())
    unknown = [n for n in chosen if n not in all_names()]
    if unknown:
        raise SystemExit(f"--only: unknown compressor {unknown[0]!r}; allowed: {', '.join(all_names())}")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    mods, grace_note = None, "not asked for"
    if args.grace != "none":
        from bench import grace_compare
        d, why = grace_compare.grace_dir(args.grace)
        if d is None:
            grace_note = f"skipped: {why}"
            log(f"GRACE {grace_note}")
        else:
            mods, note = grace_compare.load_grace(d)
            grace_note = d + (f" ({note})" if note else "")
            log(f"GRACE from {grace_note}")
    peak, peak_note, copy_bw = None, "", None
    if cuda:
        if args.peak_gbs:
            peak, peak_note = args.peak_gbs * 1e9, "given with --peak-gbs"
        else:
            peak, peak_note = peak_bandwidth(device)
        copy_bw = copy_bandwidth(device)
        log(f"{torch.cuda.get_device_name(device)}: peak {peak / 1e9 if peak else float('nan'):.0f} GB/s "
            f"({peak_note}); device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    res = measure(chosen, sizes, args.repeat, device, mods, log)
    verdicts = judge(res, sizes, peak) if cuda else None
    profiles = []
    if cuda and args.profile_misses:
        seen = set()
        for key in ("bandwidth", "vs_grace", "fixed_us"):
            for name, n, _, met in verdicts[key]:
                if not met and (name, n) not in seen and not name.endswith(" graphed"):
                    seen.add((name, n))
                    profiles += profile(name, n, device)
                    if key == "vs_grace":
                        profiles += profile(name, n, device, mods, side="grace")
    command = "python bench/compressor_speed.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    where = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
             if cuda else f"{platform.machine()}, {os.cpu_count()} cores, one thread, torch {torch.__version__}")
    md = [f"# Compressor cost on {device.type}: compress + decompress of one fp32 tensor", "",
          f"Command: `{command}`", "", f"Device: {where}. GRACE: {grace_note}.",
          f"Medians of {args.repeat} interleaved rounds"
          + ("; 'eager' is the same codec with its fused kernels off (COMMLAB_FUSED=0), 'graphed' with its "
             "compress replayed from a CUDA graph (COMMLAB_GRAPHS=1, where the codec allows it, up to "
             f"{graph_max():,} elements), both timed in the same rounds" if cuda else "")
          + ("; CUDA-event timing of back-to-back calls (launch cost included)." if cuda else "."), ""]
    if cuda:
        md += [f"Peak memory bandwidth {peak / 1e9:.0f} GB/s ({peak_note}); a device-to-device copy measured "
               f"{copy_bw / 1e9:.0f} GB/s ({100 * copy_bw / peak:.0f}% of peak) in this run. '% peak' counts the "
               "input read and the payload written." if peak else f"Peak bandwidth unknown ({peak_note}).", ""]
    md += [table(res, sizes, cuda, peak, mods is not None), ""]
    if cuda:
        md += ["Targets:"] + verdict_lines(verdicts) + [""]
        if profiles:
            md += ["Profiles of the misses (torch.profiler, 5 calls):", "", "```"] + profiles + ["```", ""]
    text = "\n".join(md)
    print(text)
    payload = {"command": command, "device": where, "grace": grace_note, "sizes": sizes, "repeat": args.repeat,
               "peak_bytes_per_s": peak, "peak_source": peak_note, "copy_bytes_per_s": copy_bw,
               "results": {k: {str(n): v for n, v in per.items()} for k, per in res.items()},
               "verdicts": verdicts, "profiles": profiles}
    if args.json:
        common.write_json(args.json, payload)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text)
        common.write_json(args.out + ".json", payload)


if __name__ == "__main__":
    main()
