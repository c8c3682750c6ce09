"""gloo exchanges between two ranks: the engine's chunked all-to-all and all-gather against gloo's own single call.

    sudo python bench/gloo_exchange.py [--gbps 1,10] [--sizes 16,64] [--rounds 7] [--chunk MIB]
                                       [--out bench/results/gloo_exchange]      # OUT.md and OUT.json

On a shaped link between two ranks (commlab.lab.net.netns, root), per rate and buffer size (MiB): an all-to-all of the
buffer (half of it each way) as gloo's ``all_to_all_single`` and as the engine's messages of
``commlab.engine.comm.collectives.P2P_CHUNK`` bytes (or ``--chunk`` MiB) posted together (``_all_to_all_works``), and the
same for the all-gather of half the buffer per rank (``issue_allgather_into``, dear's parameter all-gather); the
all-reduce of the buffer for reference (gloo's ring, unchanged). Interleaved (the order rotating by one each round);
medians of the rounds, the spread (min-max), the ratio, and what the link's rate alone allows for the bytes one rank
sends."""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

VARIANTS = ("alltoall gloo", "alltoall chunked", "allgather gloo", "allgather chunked", "allreduce gloo")


def worker(argv) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from commlab.engine.comm import collectives as C
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--chunk", type=float, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    chunk = int(a.chunk * (1 << 20)) if a.chunk else C.P2P_CHUNK
    res = {"chunk_bytes": chunk, "sizes": {}}
    try:
        for mib in [int(x) for x in a.sizes.split(",")]:
            n = (mib << 20) // 4
            t, got = torch.ones(n), torch.empty(n)
            half = t[:n // 2].clone()

            def run(variant):
                C.P2P_CHUNK = chunk if variant.endswith("chunked") else 1 << 62
                if variant.startswith("alltoall"):
                    works = C._all_to_all_works(got, t, None)
                elif variant.startswith("allgather"):
                    works = C.issue_allgather_into(got, half).works
                else:
                    works = [dist.all_reduce(t, async_op=True)]
                for w in works:
                    w.wait()
            blocks = common.run_interleaved({v: (lambda v=v: run(v)) for v in VARIANTS}, a.rounds, block=1,
                                            warmup=1, sync=dist.barrier)
            times = {v: [x for (x,) in b] for v, b in blocks.items()}
            res["sizes"][mib] = times
        C.P2P_CHUNK = chunk
        if dist.get_rank() == 0:
            common.write_json(a.out, res)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def summarize(raw: dict, gbps: float) -> dict:
    out = {}
    for mib, times in raw["sizes"].items():
        row = {}
        for v, ts in times.items():
            row[v] = common.spread_ms(ts)
        for op in ("alltoall", "allgather"):
            row[f"{op} speedup"] = row[f"{op} gloo"]["median_ms"] / row[f"{op} chunked"]["median_ms"]
        each_way = int(mib) * (1 << 20) / 2  # bytes one rank sends in the all-to-all and the all-gather
        row["rate floor ms"] = each_way * 8 / (gbps * 1e9) * 1e3
        out[str(mib)] = row
    return out


def markdown(res: dict) -> str:
    lines = [f"Two ranks on a shaped link (commlab.lab.net.netns tbf), gloo; messages of {res['chunk_bytes'] / (1 << 20):g} MiB; "
             f"{res['rounds']} interleaved rounds, medians (min-max) in ms. 'floor': the bytes one rank sends at "
             "the link's rate.", ""]
    head = ["Gbit/s", "MiB", "floor", *VARIANTS, "all-to-all speedup", "all-gather speedup"]
    rows = []
    for gbps, by in res["rates"].items():
        for mib, r in by.items():
            rows.append([gbps, mib, f"{r['rate floor ms']:.1f}"]
                        + [common.spread_cell(r[v]) for v in VARIANTS]
                        + [f"{r['alltoall speedup']:.2f}x", f"{r['allgather speedup']:.2f}x"])
    return "\n".join(lines + [common.markdown_table(head, rows), ""])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", default="1,10", help="link rates, Gbit/s (default 1,10)")
    ap.add_argument("--sizes", default="16,64", help="buffer sizes in MiB (default 16,64)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--chunk", type=float, default=0,
                    help="MiB per message of the chunked variants (default: the engine's P2P_CHUNK)")
    ap.add_argument("--out", default="bench/results/gloo_exchange", help="writes OUT.md and OUT.json")
    a = ap.parse_args(argv)
    try:
        rates = [float(x) for x in a.gbps.split(",") if x.strip()]
        sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--gbps and --sizes: comma-separated numbers, got {a.gbps!r} and {a.sizes!r}")
    if not rates or not sizes or min(rates) <= 0 or not all(1 <= s <= 1024 for s in sizes) or a.rounds < 1:
        ap.error("--gbps must be positive, --sizes in 1..1024 MiB, --rounds at least 1")
    if a.chunk and not 1 / 16 <= a.chunk <= 64:
        ap.error(f"--chunk: MiB in 0.0625..64, got {a.chunk:g}")
    from commlab.lab.net import netns
    try:
        netns.check_shaped_supported()
    except netns.NetworkUnavailable as e:
        print(f"gloo_exchange: {e}", file=sys.stderr)
        return 2
    res = {"rounds": a.rounds, "rates": {}}
    args = ["--sizes", ",".join(map(str, sizes)), "--rounds", str(a.rounds), "--chunk", str(a.chunk)]
    for gbps, raw in common.run_per_rate(__file__, args, rates, "gx"):
        res["chunk_bytes"] = raw["chunk_bytes"]
        res["rates"][f"{gbps:g}"] = summarize(raw, gbps)
    if len(res["rates"]) < len(rates):
        return 1
    common.write_out(a.out, res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
