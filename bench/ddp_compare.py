"""commlab's WFBP against torch DDP: iteration time on 2 gloo ranks (CPU).

    python bench/ddp_compare.py [--models cnn,resnet,mlp,transformer] [--steps 5] [--rounds 12] [--batch 32] [--json out.json]

It launches itself under torchrun (2 ranks, gloo, one thread per rank). Per
model every rank builds four identical copies (same seed) and times one
training iteration of each, on the same synthetic 3x32x32 batches, with its
own SGD(lr=0.01, momentum=0.9) (the transformer: the bundled text, 64-token windows):

- ddp:          torch DistributedDataParallel (bucket_cap_mb=25; given explicitly, it caps
                DDP's first bucket at 25 MB too, so every model here is one bucket);
- commlab:      commlab.engine.comm.wfbp.WFBP, schedule bucket 25 MB with the first bucket
                at 25 MB as well (the same buckets as that DDP), compressor
                none, mode wfbp, with the per-layer timeline on (Timeline to
                a temp file plus a LayerProbe following the communicator, as
                commlab.engine.stepper wires them), stepped as commlab.engine.trainer does;
- commlab-notl: the same with the timeline off;
- compute:      no communication at all (forward, backward, optimizer step),
                both ranks at once, i.e. the compute-only iteration time.

Every rank sets up glibc's allocator as a commlab run's worker does (commlab.engine.worker.keep_heap:
freed memory stays in the process instead of being faulted back every step); all four variants
run in that one process, DDP included.

Variants run interleaved: each round runs a block of --steps iterations of
every variant, the order rotating between rounds, after a few untimed warm-up
iterations. Each iteration is timed around the whole step; the slower rank's
time counts. Reported: the median ms/iteration of each variant, its ratio to
DDP's median, and the median of per-round ratios (more robust on this noisy
2-core machine), plus the timeline's overhead (commlab over commlab-notl).
The target is commlab/DDP <= 1.00 (median of per-round ratios) on every model.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import shutil
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

VARIANTS = ("ddp", "commlab", "commlab-notl", "compute")
TARGET = 1.00


# ---------------------------------------------------------------- worker side

def build_variants(model_name: str, batch: int, rank: int, world: int, tmpdir: str):
    """Four step functions over identical models and the same batches, plus a cleanup callback."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commlab.engine import compressors, data, models, schedules
    from commlab.engine.comm.wfbp import WFBP
    from commlab.engine.probe import LayerProbe
    from commlab.engine.timeline import Timeline

    # image models on synthetic 3x32x32 images, the transformer on the bundled text (64-token windows)
    ds = data.load("text") if models.kind(model_name) == "text" else data.load("synthetic", seed=0)
    sampler = data.ShardSampler(ds.size("train"), batch, rank, world, seed=0)
    batches = [ds.batch("train", next(sampler)) for _ in range(8)]

    def fresh():
        torch.manual_seed(0)
        m = models.build(model_name, ds.info)
        return m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)

    def plain_step(model, opt):
        it = itertools.cycle(batches)

        def step():
            x, y = next(it)
            opt.zero_grad()
            models.loss_fn(model(x), y).backward()
            opt.step()
        return step

    def commlab_step(model, opt, dp, tl, probe):
        """commlab.engine.trainer.Trainer.train_step's compute, comm and timeline calls (no metrics log)."""
        it = itertools.cycle(batches)
        n = itertools.count()

        def step():
            x, y = next(it)
            s = next(n)
            m0 = tl.mark()
            loss = models.loss_fn(model(x), y)
            m1 = tl.mark()
            loss.backward()
            m2 = tl.mark()
            dp.finish()
            m3 = tl.mark()
            opt.step()
            dp.zero_grad()
            m4 = tl.mark()
            tl.span("forward", "forward", m0, m1, {"step": s})
            tl.span("backward", "backward", m1, m2, {"step": s})
            tl.span("optimizer", "optimizer", m3, m4, {"step": s})
            tl.span("step", f"step {s}", m0, m4, {"step": s})
            if probe:
                probe.reset()
            tl.flush()
        return step

    # DDP given bucket_cap_mb caps its first bucket at it too (torch's BucketCapacityConfig): same buckets here
    schedule = functools.partial(schedules.build, "bucket", cap_mb=25.0, first_cap_mb=None)
    make_comp = lambda: compressors.make("none")  # noqa: E731

    m_ddp, o_ddp = fresh()
    ddp = DDP(m_ddp, bucket_cap_mb=25)

    m_tl, o_tl = fresh()
    tl = Timeline(os.path.join(tmpdir, f"timeline-{model_name}-rank{rank}.jsonl"), rank, enabled=True)
    probe = LayerProbe(m_tl, tl)
    dp_tl = WFBP(m_tl, schedule, make_comp, timeline=tl)
    probe.follow(dp_tl)  # as commlab.engine.stepper wires them

    m_no, o_no = fresh()
    dp_no = WFBP(m_no, schedule, make_comp)

    m_c, o_c = fresh()
    steps = {"ddp": plain_step(ddp, o_ddp),
             "commlab": commlab_step(m_tl, o_tl, dp_tl, tl, probe),
             "commlab-notl": commlab_step(m_no, o_no, dp_no, dp_no.timeline, None),
             "compute": plain_step(m_c, o_c)}
    info = {"params": sum(p.numel() for p in m_c.parameters()),
            "grad_mb": sum(p.numel() * p.element_size() for p in m_c.parameters()) / 2 ** 20,
            "commlab_buckets": [b.raw_bytes for b in dp_no.buckets]}

    def cleanup():
        for dp in (dp_tl, dp_no):
            dp.close()
        probe.close()
        tl.close()
    return steps, info, cleanup


def worker(args) -> None:
    import torch.distributed as dist

    from commlab.engine.worker import keep_heap
    rank, world = common.init_worker()
    keep_heap()  # as commlab.engine.worker sets up a run's rank; DDP shares this process, so it runs with it too
    tmpdir = tempfile.mkdtemp(prefix="commlab-bench-")
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if rank == 0 else None
    out = {"world_size": world, "models": {}}
    try:
        for name in args.models.split(","):
            if log:
                log(f"[{name}] {args.rounds} rounds x {args.steps} steps x {len(VARIANTS)} variants")
            steps, info, cleanup = build_variants(name, args.batch, rank, world, tmpdir)
            times = common.run_interleaved(steps, args.rounds, args.steps, args.warmup, dist.barrier, log)
            cleanup()
            out["models"][name] = {"info": info, "times_s": common.gather_max(times)}
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    if rank == 0:
        common.write_json(args.out, out)
    dist.destroy_process_group()


# ---------------------------------------------------------------- parent side

def report(raw: dict) -> tuple[str, dict]:
    rows, summary, notes = [], {}, []
    for model, res in raw["models"].items():
        s = common.summarize(res["times_s"], baseline="ddp")
        overhead = common.summarize(res["times_s"], baseline="commlab-notl")["commlab"]
        summary[model] = {"variants": s, "timeline_overhead": overhead}
        for v in VARIANTS:
            rows.append([model, v, f"{s[v]['median_ms']:.1f}", f"{s[v]['ratio']:.3f}", f"{s[v]['round_ratio']:.3f}"])
        r = s["commlab"]
        verdict = "meets" if r["round_ratio"] <= TARGET else "MISSES"
        notes.append(f"- {model} ({res['info']['params'] / 1e6:.2f}M params, {res['info']['grad_mb']:.1f} MB "
                     f"gradient, commlab buckets {len(res['info']['commlab_buckets'])}): timeline overhead "
                     f"{overhead['ratio']:.3f}x (per-round {overhead['round_ratio']:.3f}x); commlab/DDP "
                     f"{r['ratio']:.3f} (per-round {r['round_ratio']:.3f}) {verdict} the <= {TARGET} target")
    table = common.markdown_table(
        ["model", "variant", "median ms/iter", "ratio vs DDP", "per-round ratio (median)"], rows)
    return table + "\n\n" + "\n".join(notes), summary


def pool(paths) -> dict:
    """The rounds of several saved runs as one run's raw results: per model, each variant's rounds in file
    order (a model missing from a file adds nothing from it)."""
    models: dict = {}
    for path in paths:
        try:
            raw = common.read_json(path)
        except (OSError, ValueError) as e:
            raise SystemExit(f"ddp_compare --pool: cannot read {path}: {e}")
        if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict):
            raise SystemExit(f"ddp_compare --pool: {path} is not a ddp_compare --json file (no models)")
        for model, res in raw["models"].items():
            into = models.setdefault(model, {"info": res["info"], "times_s": {v: [] for v in VARIANTS}})
            for v in VARIANTS:
                into["times_s"][v].extend(res["times_s"][v])
    return {"models": models}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,resnet,mlp,transformer",
                    help="comma-separated: cnn, resnet, mlp, transformer")
    ap.add_argument("--steps", type=int, default=5, help="timed iterations per variant per round")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations per variant first")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    ap.add_argument("--json", help="save raw per-iteration times and the summary here")
    ap.add_argument("--pool", nargs="+", metavar="JSON",
                    help="measure nothing: pool the rounds of runs saved with --json (per model, every round of "
                         "every file) and report them as one run")
    common.add_worker_flags(ap)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.pool:
        text, _ = report(pool(args.pool))
        print(f"pooled: {', '.join(args.pool)}\n\n{text}")
        return 0
    with tempfile.TemporaryDirectory(prefix="commlab-bench-") as d:
        out = os.path.join(d, "raw.json")
        fwd = ["--models", args.models, "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--warmup", str(args.warmup), "--batch", str(args.batch), "--out", out]
        rc = common.launch(__file__, fwd, nproc=2)
        if rc != 0 or not os.path.exists(out):
            print(f"ddp_compare: the torchrun job failed (exit {rc})", file=sys.stderr)
            return 1
        raw = common.read_json(out)
    text, summary = report(raw)
    print(text)
    if args.json:
        common.write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
                                      "summary": summary, **raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
