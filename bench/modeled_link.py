"""Modeled link on the real clock: how close a held collective comes to the alpha-beta time.

    python bench/modeled_link.py [--gbps 0.05] [--latency-us 100] [--reps 5] [--json out.json]

Two ranks on loopback (gloo). For an all-reduce of 1 MB it times the bare
collective, then the same collective held by commlab.engine.netmodel.ModeledLink, and
prints both next to the model's prediction; then one Sync step of a
small MLP (four layer-wise buckets, sync mode), whose buckets queue on the
link, against the sum of their predicted times. tests/test_netmodel.py checks
the same wiring on a fake clock; this is where the real clock's error shows
(sleep granularity, a loaded machine).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

NBYTES = 1 << 20


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from commlab.engine.comm.wfbp import Sync
    from commlab.engine.compressors import make
    from commlab.engine.netmodel import ModeledLink, ring_allreduce_s
    rank, world = common.init_worker()
    link = ModeledLink(a.gbps, a.latency_us)
    t = torch.ones(NBYTES // 4)
    dist.all_reduce(t)  # warm-up
    raw, held = [], []
    for _ in range(a.reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t, async_op=True).wait()
        raw.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        deadline = link.issue("allreduce", NBYTES, world)
        dist.all_reduce(t, async_op=True).wait()
        link.hold_until(deadline)
        held.append(time.perf_counter() - t0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    dp_link = ModeledLink(a.gbps, a.latency_us)
    dp = Sync(model, lambda infos: [[i] for i in range(len(infos))], lambda: make("none"), link=dp_link)
    steps = []
    for _ in range(a.reps):
        model(torch.randn(8, 256)).sum().backward()
        dist.barrier()
        t0 = time.perf_counter()
        dp.finish()
        steps.append(time.perf_counter() - t0)
        dp.zero_grad()
    dp.close()
    pred_dp = sum(ring_allreduce_s(p.numel() * 4, world, dp_link.gbps, a.latency_us) for p in model.parameters())
    if rank == 0:
        common.write_json(a.out, {"allreduce": {"raw": raw, "held": held,
                                                "predicted": ring_allreduce_s(NBYTES, world, a.gbps, a.latency_us)},
                                  "dataparallel": {"held": steps, "predicted": pred_dp}})
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", type=float, default=0.05, help="the modeled link's bandwidth (default 0.05)")
    ap.add_argument("--latency-us", type=float, default=100.0, help="per-step latency (default 100)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    ap.add_argument("--json", metavar="FILE", help="also write the raw numbers as JSON")
    common.add_worker_flags(ap)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    out = a.json or os.path.join(tempfile.mkdtemp(prefix="modeled_link-"), "out.json")
    rc = common.launch(__file__, ["--gbps", str(a.gbps), "--latency-us", str(a.latency_us), "--reps",
                                  str(a.reps), "--out", out])
    if rc:
        print(f"modeled_link: the workers failed (exit {rc})", file=sys.stderr)
        return 1
    r = common.read_json(out)
    if not a.json:
        shutil.rmtree(os.path.dirname(out))
    ar, dp = r["allreduce"], r["dataparallel"]
    rows = [("all-reduce 1 MB, bare", f"{1e3 * statistics.median(ar['raw']):.2f}", f"{1e3 * ar['predicted']:.2f}", "-"),
            ("all-reduce 1 MB, held", f"{1e3 * statistics.median(ar['held']):.2f}", f"{1e3 * ar['predicted']:.2f}",
             f"{100 * (statistics.median(ar['held']) / ar['predicted'] - 1):+.1f}%"),
            ("Sync step, 4 buckets", f"{1e3 * statistics.median(dp['held']):.2f}",
             f"{1e3 * dp['predicted']:.2f}", f"{100 * (statistics.median(dp['held']) / dp['predicted'] - 1):+.1f}%")]
    print(common.markdown_table(["what", "median ms", "model ms", "error"], rows).rstrip("\n"))
    early = min(ar["held"]) < ar["predicted"]
    print("a held all-reduce ended before the model's time" if early else
          "no held all-reduce ended before the model's time")
    return 1 if early else 0


if __name__ == "__main__":
    sys.exit(main())
