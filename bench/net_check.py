"""Shaped-link check: raw TCP and gloo all-reduce against the target rate and the alpha-beta model.

    python bench/net_check.py [--gbps 0.1,1] [--seconds 3] [--json out.json]

Needs root, ``ip`` and ``tc`` (Linux). For every rate it builds a 2-rank
emulated cluster (network namespaces, veth pairs to a bridge, tbf on both ends
of every link; see commlab/lab/net/netns.py), measures raw TCP from rank 0 to rank 1 and a
gloo all-reduce (each rank its own torchrun node in its namespace), prints
them next to the target and the ring alpha-beta prediction, and tears the
cluster down. All traffic stays inside the namespaces it creates.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import prog  # noqa: E402
from commlab.lab.net import netcheck, netns  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", default="0.1,1", help="comma-separated link rates in Gbit/s (default 0.1,1)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of TCP and of all-reduces per rate")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results as JSON")
    a = ap.parse_args(argv)
    try:
        rates = [float(x) for x in a.gbps.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--gbps: not a list of numbers: {a.gbps!r}")
    try:
        netns.check_shaped_supported()
    except netns.NetworkUnavailable as e:
        print(f"net_check: {e}", file=sys.stderr)
        return 2
    results = []
    for g in rates:
        print(f"## {g:g} Gbit/s", flush=True)
        results.append(netcheck.net_check(g, seconds=a.seconds, out=sys.stdout))
        print(flush=True)
    print("| target Mbit/s | TCP Mbit/s | TCP/target | all-reduce MiB | median ms | model ms | busbw Mbit/s | model/measured |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['target_gbps'] * 1e3:g} | {r['tcp_gbps'] * 1e3:.1f} | {r['tcp_ratio']:.1%} "
              f"| {r['allreduce_bytes'] / 2**20:.2f} | {r['allreduce_median_s'] * 1e3:.1f} "
              f"| {r['allreduce_predicted_s'] * 1e3:.1f} | {r['allreduce_busbw_gbps'] * 1e3:.1f} "
              f"| {r['allreduce_ratio']:.1%} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
