"""The engine's CPU collectives with their large buffers reused (commlab/engine/comm/buffers.py) against fresh ones.

    sudo python bench/cpu_buffers.py [--gbps 1,10] [--sizes 16,64] [--rounds 7] [--out bench/results/cpu_buffers]
    python bench/cpu_buffers.py --gbps 0                 # loopback, no root: the host's part alone

Two ranks on a shaped link (commlab.lab.net.netns, root), gloo, per rate and buffer size (MiB): the payload all-gather
(``issue_allgather`` of one fp32 tensor of half the buffer per rank: a zeroed send buffer and a receive buffer for
every rank's payload) and dear's reduce-scatter on gloo (``issue_reduce_scatter(via_alltoall=True)``: an all-to-all
of the buffer's chunks and the sum of what arrived), each waited for and its result read and dropped, as a step
does. Each with the buffers taken from the pool and allocated fresh (the pool switched off in the same process),
interleaved (the order rotating by one each round); medians of the rounds, the spread (min-max) and the ratio."""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

VARIANTS = ("allgather fresh", "allgather pooled", "reduce_scatter fresh", "reduce_scatter pooled")


def worker(argv) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from commlab.engine.comm import buffers
    from commlab.engine.comm.collectives import issue_allgather, issue_reduce_scatter
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    use_count = buffers._use_count
    res = {"pool": use_count is not None, "sizes": {}}
    try:
        for mib in [int(x) for x in a.sizes.split(",")]:
            n = (mib << 20) // 4
            t = torch.ones(n)
            payload = torch.ones(n // 2)
            scratch: dict = {}

            def run(variant):
                buffers._use_count = use_count if variant.endswith("pooled") else None
                if variant.startswith("allgather"):
                    got = issue_allgather([payload]).wait()
                else:
                    got = issue_reduce_scatter(t, via_alltoall=True, scratch=scratch).wait()
                del got  # read and dropped, as a step's decode does

            # one call a block, the order rotating by one each round, the ranks together before each call
            blocks = common.run_interleaved({v: (lambda v=v: run(v)) for v in VARIANTS}, a.rounds, block=1,
                                            warmup=1, sync=dist.barrier)
            times = {v: [x for (x,) in b] for v, b in blocks.items()}
            res["sizes"][mib] = times
        buffers._use_count = use_count
        if dist.get_rank() == 0:
            common.write_json(a.out, res)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def summarize(raw: dict) -> dict:
    out = {}
    for mib, times in raw["sizes"].items():
        row = {v: common.spread_ms(ts) for v, ts in times.items()}
        for op in ("allgather", "reduce_scatter"):
            row[f"{op} speedup"] = row[f"{op} fresh"]["median_ms"] / row[f"{op} pooled"]["median_ms"]
        out[str(mib)] = row
    return out


def markdown(res: dict) -> str:
    lines = [f"Two ranks, gloo; {res['rounds']} interleaved rounds, medians (min-max) in ms; 'fresh': the buffers "
             "allocated on every call, 'pooled': taken from commlab/engine/comm/buffers.py.", ""]
    head = ["Gbit/s", "MiB", *VARIANTS, "all-gather speedup", "reduce-scatter speedup"]
    rows = []
    for gbps, by in res["rates"].items():
        for mib, r in by.items():
            rows.append([gbps, mib]
                        + [common.spread_cell(r[v]) for v in VARIANTS]
                        + [f"{r['allgather speedup']:.2f}x", f"{r['reduce_scatter speedup']:.2f}x"])
    return "\n".join(lines + [common.markdown_table(head, rows), ""])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", default="1,10", help="link rates, Gbit/s; 0 is loopback (default 1,10)")
    ap.add_argument("--sizes", default="16,64", help="buffer sizes in MiB (default 16,64)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--out", default="bench/results/cpu_buffers", help="writes OUT.md and OUT.json")
    a = ap.parse_args(argv)
    try:
        rates = [float(x) for x in a.gbps.split(",") if x.strip()]
        sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--gbps and --sizes: comma-separated numbers, got {a.gbps!r} and {a.sizes!r}")
    if not rates or not sizes or min(rates) < 0 or not all(2 <= s <= 1024 for s in sizes) or a.rounds < 1:
        ap.error("--gbps must be 0 (loopback) or positive, --sizes in 2..1024 MiB, --rounds at least 1")
    if any(rates):
        from commlab.lab.net import netns
        try:
            netns.check_shaped_supported()
        except netns.NetworkUnavailable as e:
            print(f"cpu_buffers: {e}", file=sys.stderr)
            return 2
    res = {"rounds": a.rounds, "rates": {}}
    args = ["--sizes", ",".join(map(str, sizes)), "--rounds", str(a.rounds)]
    for gbps, raw in common.run_per_rate(__file__, args, rates, "cb"):
        if not raw["pool"]:
            print("cpu_buffers: this torch has no storage use count, so the engine reuses no buffer", file=sys.stderr)
            return 2
        res["rates"][f"{gbps:g}" if gbps else "loopback"] = summarize(raw)
    if len(res["rates"]) < len(rates):
        return 1
    common.write_out(a.out, res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
