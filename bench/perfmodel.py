"""Validation of the performance model (commlab/lab/strategy/perfmodel) against measured runs on shaped links.

    sudo python bench/perfmodel.py                 # all 25 configurations, 3 launches of 30 steps: ~8 minutes
    sudo python bench/perfmodel.py --quick         # configuration 13 only, 20 steps: a check (~3 min)
    python bench/perfmodel.py --replay bench/results/perfmodel.json   # no root: re-predict measured rows
    python bench/perfmodel.py [--only 1,4,topk] [--steps 30] [--launches 3] [--json bench/results/perfmodel.json]
                              [--md bench/results/perfmodel.md] [--runs DIR]

Needs root (shaped links: network namespaces and tc). Calibration comes first
and uses none of the validated runs:

- compute: a ``sync`` layer-wise run of the same model and batch on loopback
  (2 ranks at once, so the same core contention as the validated runs, and
  nothing overlaps backward); per-layer forward times and backward completion
  times from its timeline (commlab.lab.strategy.perfmodel.calibrate.from_run);
- the unshaped path's speed: fitted to the communicate spans of that same run
  (link_from_run: its 8 all-reduces of 40 B .. 512 KB per step);
- alpha: the mean per-step cost of the small collectives (<= 64 KB on the
  wire) of the same layer-wise sync job run on a shaped 1 Gbit link
  (alpha_from_run, replaying the token bucket to take out the time the
  bytes themselves took). Back-to-back all-reduces of 4 KiB (measure_link)
  cost more per call than the collectives of a training step (see README).
  The same fit at every validated rate is recorded too (``alpha_at_this_rate``);
- overlap slowdown: backward compute of the same job in ``wfbp`` (collectives
  overlap nearly all of backward) over that of the sync run;
- link: the sustained rate per bandwidth from back-to-back gloo all-reduces
  of 1/4 and all of ~0.4 s worth of bytes on a shaped 2-rank cluster
  (measure_link), and the tbf's token bucket (the cluster's burst_bytes: the
  first ~10 ms worth of bytes after idle time pass at the unshaped speed of
  the emulated path, measured on an unshaped cluster of the same namespaces,
  veth pairs and bridge: measure_path; loopback is several times faster);
- compressors: fixed + per-byte encode / between-rounds / decode cost, fitted
  over 4 KiB .. 4 MiB in one thread (measure_compressor).

Then every configuration of CONFIGS runs as a normal lab run on a shaped link
(``network: {link: shaped, gbps: X}``), ``--launches`` times in interleaved
rounds, and its measured iteration time (each launch's mean per-step
``time_ms`` of both ranks, warm-up steps excluded: what time to train follows;
the median over the launches; the pooled median step beside it) is set beside
the model's prediction. A configuration whose spec the engine
rejects as "not implemented yet" (a feature added to CONFIGS before it exists) is skipped with a line
saying so. ``--only`` takes config numbers or names (substrings).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

BASE = {"model": "cnn", "dataset": "digits", "batch_size": 32, "eval_every": 0, "threads": 1, "world_size": 2}

NONE = {"name": "none"}
FP16 = {"name": "fp16"}
TOPK = {"name": "topk", "ratio": 0.01, "error_feedback": True}
PSGD = {"name": "powersgd", "rank": 2, "start_iter": 2}
SIGN = {"name": "signsgd"}
QSGD = {"name": "qsgd"}
BF16 = {"name": "bf16"}
DGC = {"name": "dgc", "ratio": 0.01}
RANDK = {"name": "randomk", "ratio": 0.01}
EFSIGN = {"name": "efsignsgd"}
TERN = {"name": "terngrad"}
BUCKET = {"name": "bucket", "cap_mb": 25.0}
SMALLB = {"name": "bucket", "cap_mb": 0.1}
LW = {"name": "layerwise"}
ALL = {"name": "allinone"}

ALPHA_GBPS = 1.0
LAUNCHES = 3
"""Launches of each configuration (its steps pooled) and of the latency's calibration run (their alphas averaged):
how many small gloo calls stall on this host differs from one launch to the next (in table (a) of
docs/benchmarks/model-validation.md the median of 40 small all-reduces is 0.3-0.6 ms in one launch and 2.5-3.5 ms
in the next), and the model predicts the expectation."""
"""The rate whose calibration run gives alpha for every rate."""

# (compressor, schedule, comm mode, Gbit/s): extend freely; --only picks a subset
CONFIGS = [
    (NONE, BUCKET, "wfbp", 0.1),
    (NONE, BUCKET, "wfbp", 1),
    (NONE, BUCKET, "wfbp", 10),
    (NONE, LW, "wfbp", 1),
    (NONE, ALL, "sync", 0.1),
    (FP16, SMALLB, "wfbp", 0.1),
    (FP16, LW, "sync", 1),
    (TOPK, BUCKET, "wfbp", 0.1),
    (TOPK, LW, "wfbp", 1),
    (TOPK, ALL, "sync", 10),
    (PSGD, BUCKET, "wfbp", 0.1),
    (PSGD, LW, "wfbp", 1),
    (SIGN, BUCKET, "wfbp", 0.1),
    (SIGN, ALL, "sync", 1),
    (QSGD, SMALLB, "wfbp", 1),
    (NONE, SMALLB, "dear", 1),
    (FP16, SMALLB, "dear", 0.1),
    # added for bench/model_validation.py table (b): at least 24 configurations
    (NONE, LW, "sync", 10),
    (FP16, BUCKET, "wfbp", 1),
    (BF16, SMALLB, "dear", 1),
    (DGC, LW, "wfbp", 0.1),
    (RANDK, BUCKET, "wfbp", 1),
    (EFSIGN, BUCKET, "wfbp", 1),
    (TERN, ALL, "sync", 0.1),
    (PSGD, ALL, "sync", 10),
]


QUICK = 13
"""--quick's configuration: signSGD on a 0.1 Gbit link (an all-gathered payload, its header, a vote)."""


def comp_section(c: dict) -> dict:
    c = dict(c)
    name, ef = c.pop("name"), c.pop("error_feedback", False)
    return {"name": name, "error_feedback": ef, **c}


def config_spec(cfg, steps: int) -> dict:
    comp, sched, mode, gbps = cfg
    comm = {"mode": mode}
    if mode == "dear":  # dear's buffers take the config's bucket cap (schedule.cap_mb), under schedule bucket
        sched = {**BUCKET, "cap_mb": sched.get("cap_mb", 25.0)}
    return dict(BASE, steps=steps, name=f"pm {label(cfg)}", compressor=comp_section(comp), schedule=dict(sched),
                comm=comm, network={"link": "shaped", "gbps": gbps})


def label(cfg) -> str:
    comp, sched, mode, gbps = cfg
    c = comp["name"] + ("+EF" if comp.get("error_feedback") else "")
    s = sched["name"] + (f"({sched['cap_mb']:g}MB)" if "cap_mb" in sched else "")
    return f"{c} {s} {mode} {gbps:g}G"


def chosen(only: str):
    if not only:
        return list(enumerate(CONFIGS, 1))
    keys = [k.strip() for k in only.split(",") if k.strip()]
    return [(i, c) for i, c in enumerate(CONFIGS, 1)
            if any(k == str(i) if k.isdigit() else k.lower() in label(c).lower() for k in keys)]


def measured_ms(runs, skip: int) -> dict:
    """The medians of the per-step times of ``runs`` (launches of one configuration; both ranks, from step ``skip``
    of each), and their mean step (``mean_time_ms``): what the prediction is compared with (``compared``)."""
    rows = [r for run in runs for r in run.metric_rows() if r.get("kind") == "step" and r["step"] >= skip]
    med = {k: statistics.median(r[k] for r in rows) for k in
           ("time_ms", "forward_ms", "backward_ms", "finish_ms", "optimizer_ms")}
    med["mean_time_ms"] = statistics.mean(r["time_ms"] for r in rows)
    med["steps"] = len(rows)
    return med


def compared(m: dict) -> float:
    """The measured step a prediction is checked against (``step_ms``): each launch's mean step time, the median
    over the launches (interleaved rounds). The mean within a launch, because a run's length is its steps' sum (what
    time to train and throughput follow) and the model's per-call latency is a mean (the occasional stall of a few
    ms included, ``calibrate.alpha_from_run``); the median over launches, because this shared host has slow spells
    that a single launch can fall into. The median step (``time_ms``, pooled) is kept beside it; a results file from
    before launches were recorded falls back to it."""
    return m.get("step_ms", m["time_ms"])


def errors(rows) -> dict:
    """Summary of the done rows: median and max absolute error against ``compared`` and against the median step."""
    done = [r for r in rows if r.get("state") == "done"]
    errs = [abs(r["error"]) for r in done]
    med = [abs(r["predicted_ms"] / r["measured"]["time_ms"] - 1) for r in done]
    against = ("median over launches of the mean step" if all("step_ms" in r["measured"] for r in done)
               else "median step")
    return {"configs": len(done), "against": against, "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None,
            "median_step": {"median_abs_error": statistics.median(med) if med else None,
                            "max_abs_error": max(med) if med else None}}


def main(argv=None):
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="config numbers or name substrings, comma-separated")
    ap.add_argument("--steps", type=int, default=30, help="steps per launch (default 30; warm-up steps excluded)")
    ap.add_argument("--launches", type=int, default=LAUNCHES,
                    help=f"launches of each configuration and of the latency's calibration run (default {LAUNCHES})")
    ap.add_argument("--quick", action="store_true",
                    help=f"a check that the whole path works: configuration {QUICK} only, 20 steps, results in "
                         "a temporary directory unless --json/--md say where (about 3 minutes, calibration included)")
    ap.add_argument("--runs", default=None, help="runs directory for the measured runs (default: a temp dir)")
    ap.add_argument("--json", default=None, help="default bench/results/perfmodel.json")
    ap.add_argument("--md", default=None, help="default bench/results/perfmodel.md")
    ap.add_argument("--replay", metavar="JSON", default=None,
                    help="no runs, no root: predict the measured rows of a results file (this script's --json) "
                         "again with the current model and that file's calibration; prints the table, writes "
                         "--json/--md only when given")
    args = ap.parse_args(argv)
    if args.replay:
        return replay(args.replay, args.json, args.md)
    import tempfile
    if args.quick:
        args.only, args.steps, args.launches = args.only or str(QUICK), min(args.steps, 20), 1
        tmp = tempfile.mkdtemp(prefix="clab-pm-quick-")
        args.json = args.json or os.path.join(tmp, "perfmodel.json")
        args.md = args.md or os.path.join(tmp, "perfmodel.md")
    args.json = args.json or "bench/results/perfmodel.json"
    args.md = args.md or "bench/results/perfmodel.md"

    import commlab
    from commlab.engine.spec import SpecError
    from commlab.lab.strategy.perfmodel import calibrate as cal
    from commlab.lab.strategy.perfmodel.costs import Link
    from commlab.lab.base.specs import load_spec

    if args.steps < cal.SKIP_STEPS + 5:
        ap.error(f"--steps must be at least {cal.SKIP_STEPS + 5} (the first {cal.SKIP_STEPS} are warm-up)")
    if args.launches < 1:
        ap.error(f"--launches must be at least 1, got {args.launches}")
    t_start = time.time()
    runs = args.runs or tempfile.mkdtemp(prefix="clab-pm-")
    todo, skipped = [], []
    for i, cfg in chosen(args.only):
        try:
            spec = load_spec(data=config_spec(cfg, args.steps)).to_dict()
        except SpecError as e:
            if "not implemented yet" in str(e):
                print(f"skip {i:2d} {label(cfg)}: {e}", flush=True)
                skipped.append({"config": i, "label": label(cfg), "reason": str(e)})
                continue
            raise
        todo.append((i, cfg, spec))
    if not todo:
        print("nothing to run")
        return 1

    def done_run(spec_dict):
        r = commlab.run(spec_dict, runs=runs)
        if r.state != "done":
            raise SystemExit(f"calibration run failed: {r.log_tail()}")
        return r

    # --- calibration (none of the validated runs)
    loop = dict(BASE, steps=args.steps, compressor={"name": "none"}, schedule=dict(LW), network={"link": "loopback"})
    r_sync = done_run(dict(loop, name="pm calibrate compute (sync)", comm={"mode": "sync"}))
    prof = cal.from_run(r_sync)
    alpha, beta_loop = cal.link_from_run(r_sync)
    r_wfbp = done_run(dict(loop, name="pm calibrate overlap (wfbp)", comm={"mode": "wfbp"}))
    prof.overlap_slowdown = cal.fit_slowdown(prof, r_wfbp)
    print(f"compute: forward {prof.forward_s * 1e3:.2f} ms, backward {prof.backward_s * 1e3:.2f} ms, "
          f"optimizer {prof.optimizer_s * 1e3:.2f} ms (run {r_sync.id}); overlap slowdown "
          f"{prof.overlap_slowdown:.2f} (run {r_wfbp.id}); per step of a collective {alpha * 1e6:.0f} µs, "
          f"unshaped {Link(0.0, beta_loop).gbps:.2f} Gbit/s (comm spans of {r_sync.id})", flush=True)
    links, cal_runs, alphas = {}, [r_sync.id, r_wfbp.id], {}
    path = cal.measure_path()
    beta_burst = max(path["beta"], beta_loop)  # a burst crosses the emulated path no faster than the path
    print(f"unshaped emulated path: {Link(0.0, path['beta']).gbps:.2f} Gbit/s (loopback "
          f"{Link(0.0, beta_loop).gbps:.2f}): the speed of a token bucket's burst", flush=True)
    rates = sorted({cfg[3] for _, cfg, _ in todo} | {ALPHA_GBPS})
    for g in rates:
        m = cal.measure_link(g)
        wire = Link(0.0, m["beta"], m["burst_bytes"], beta_burst)
        per_launch = []
        for k in range(args.launches):  # a launch's share of stalled calls varies: the mean over launches
            r_a = done_run(dict(loop, name=f"pm calibrate alpha {g:g}G", comm={"mode": "sync"},
                                network={"link": "shaped", "gbps": g}))
            cal_runs.append(r_a.id)
            per_launch.append((r_a.id, cal.alpha_from_run(r_a, wire)))
        alphas[g] = statistics.mean(a for _, a in per_launch)
        links[g] = dict(m, beta_burst=beta_burst, alpha_shaped_fit=m["alpha"], alpha_run=per_launch[0][0],
                        alpha_runs=[{"run": i, "alpha": a} for i, a in per_launch], alpha_at_this_rate=alphas[g])
        print(f"link {g:g} Gbit: sustained {8 / m['beta'] / 1e9 * 1e3:.1f} Mbit/s, burst {m['burst_bytes']} B, "
              f"small collectives {alphas[g] * 1e6:.0f} µs per step (mean of {args.launches} launches: "
              f"{', '.join(f'{a * 1e6:.0f}' for _, a in per_launch)}; back-to-back 4 KiB all-reduce: mean "
              f"{m['small_mean_s'] * 1e3:.2f} ms)", flush=True)
    for g in rates:  # one latency for every rate, as the alpha-beta model has
        links[g]["alpha"] = alphas[ALPHA_GBPS]
    print(f"alpha: {alphas[ALPHA_GBPS] * 1e6:.0f} µs per ring step at every rate (from {ALPHA_GBPS:g} Gbit)",
          flush=True)
    for _, _, spec in todo:
        key = cal.compressor_key(spec["compressor"])
        if spec["compressor"]["name"] != "none" and key not in prof.compressors:
            prof.compressors[key] = cal.measure_compressor(spec["compressor"])
            curve = prof.compressors[key]
            e, d = curve["encode"], curve["decode"]
            more = curve.get("decode_more")
            print(f"compressor {key}: encode {e[0] * 1e6:.0f} µs + {e[1] * 1e12:.0f} µs/MB, decode "
                  f"{d[0] * 1e6:.0f} µs + {d[1] * 1e12:.0f} µs/MB"
                  + (f", each further rank's payload {more[0] * 1e6:.0f} µs + {more[1] * 1e12:.0f} µs/MB" if more
                     else ""), flush=True)

    # --- measured runs in interleaved rounds (a slow spell of the shared host falls on one launch of many
    # configurations, not on every launch of a few), then predictions
    launched = {i: [] for i, _, _ in todo}
    for k in range(args.launches):
        for i, cfg, spec in todo:
            if launched[i] and launched[i][-1].state != "done":
                continue
            r = commlab.run(spec, runs=runs)
            launched[i].append(r)
            print(f"round {k + 1}/{args.launches}: {i:2d} {label(cfg):34s} {r.state}", flush=True)
    rows = []
    for i, cfg, spec in todo:
        bad = [r for r in launched[i] if r.state != "done"]
        if bad:
            r = bad[0]
            print(f"config {i} {label(cfg)}: run {r.state}: {r.log_tail(3)}", flush=True)
            rows.append({"config": i, "label": label(cfg), "run": r.id, "state": r.state})
            continue
        skip = max(cal.SKIP_STEPS, int(spec["compressor"]["params"].get("start_iter", 0)) + 2)
        m = measured_ms(launched[i], skip)
        m["launches_mean_ms"] = [measured_ms([r], skip)["mean_time_ms"] for r in launched[i]]
        m["step_ms"] = statistics.median(m["launches_mean_ms"])
        g = cfg[3]
        res = predicted(dict(prof.__dict__), links[g], cfg, args.steps)
        err = res.total * 1e3 / compared(m) - 1
        rows.append({"config": i, "label": label(cfg), "run": launched[i][0].id, "runs": [r.id for r in launched[i]],
                     "state": "done", "gbps": g, "measured": m, "predicted_ms": res.total * 1e3,
                     "predicted": {k: v * 1e3 for k, v in res.as_dict().items()}, "error": err})
        print(f"{i:2d} {label(cfg):34s} measured {compared(m):7.2f} ms (launches "
              f"{', '.join(f'{x:.2f}' for x in m['launches_mean_ms'])}; median step {m['time_ms']:.2f})  predicted "
              f"{res.total * 1e3:7.2f} ms  {err:+.1%}", flush=True)
    summary = {**errors(rows), "wall_s": time.time() - t_start}
    out = {"summary": summary, "rows": rows, "skipped": skipped, "profile": prof.__dict__ | {"link": None},
           "links": links, "path": path, "calibration_runs": cal_runs, "loopback_alpha": alpha, "steps": args.steps,
           "launches": args.launches, "base": BASE}
    common.write_json(args.json, out)
    md = markdown(out)
    with open(args.md, "w") as f:
        f.write(md)
    print(md)
    return 0


def predicted(profile: dict, link: dict, cfg, steps: int):
    """The model's prediction of configuration ``cfg`` from a calibration (a results file's profile and the
    link at the config's rate)."""
    from commlab.lab.base.specs import load_spec
    from commlab.lab.strategy.perfmodel import calibrate as cal
    from commlab.lab.strategy.perfmodel import predict as pr
    p = dict(profile, link=link, params=[tuple(x) for x in profile["params"]])
    spec = load_spec(data=config_spec(cfg, steps)).to_dict()
    return pr.predict(cal.Profile(**p), spec, cfg[3], spec["world_size"])


def replay(path: str, out_json=None, out_md=None) -> int:
    """``--replay``: a measured results file's rows predicted again by the current model, from that file's own
    calibration (profile, links); the configurations are looked up by label."""
    with open(path) as f:
        old = json.load(f)
    by_label = {label(c): c for c in CONFIGS}
    rows = []
    for r in old["rows"]:
        cfg = by_label.get(r["label"])
        if r.get("state") != "done" or cfg is None:
            rows.append(dict(r, state=r.get("state") if cfg else "not in CONFIGS"))
            continue
        res = predicted(old["profile"], old["links"][next(k for k in old["links"] if float(k) == cfg[3])], cfg,
                        old.get("steps", 60))
        rows.append(dict(r, predicted_ms=res.total * 1e3, predicted={k: v * 1e3 for k, v in res.as_dict().items()},
                         error=res.total * 1e3 / compared(r["measured"]) - 1))
    out = dict(old, rows=rows, replayed_from=path, summary=dict(old["summary"], **errors(rows)))
    md = markdown(out)
    if out_json:
        common.write_json(out_json, out)
    if out_md:
        with open(out_md, "w") as f:
            f.write(md)
    print(f"{path}: its measured rows, predicted by the current model from its own calibration\n\n{md}")
    return 0


def markdown(out) -> str:
    s = out["summary"]
    head = ["#", "config", "measured ms", "launches (mean step, ms)", "predicted ms", "error", "median step ms",
            "error vs median", "fwd / bwd / finish / opt ms (medians)", "predicted exposed comm ms"]
    rows = []
    for r in out["rows"]:
        if r.get("state") != "done":
            rows.append([r["config"], r["label"], r.get("state"), "", "", "", "", "", "", ""])
            continue
        m = r["measured"]
        rows.append([r["config"], r["label"], f"{compared(m):.2f}",
                     " / ".join(f"{x:.2f}" for x in m.get("launches_mean_ms", [])), f"{r['predicted_ms']:.2f}",
                     f"{r['error']:+.1%}",
                     f"{m['time_ms']:.2f}", f"{r['predicted_ms'] / m['time_ms'] - 1:+.1%}",
                     f"{m['forward_ms']:.2f} / {m['backward_ms']:.2f} / {m['finish_ms']:.2f} / {m['optimizer_ms']:.2f}",
                     f"{r['predicted']['exposed_comm']:.2f}"])
    lines = [common.markdown_table(head, rows), ""]
    if s["median_abs_error"] is not None:
        vs = s.get("median_step") or {}
        lines.append(f"{s['configs']} configurations: median absolute error {s['median_abs_error']:.1%}, "
                     f"max {s['max_abs_error']:.1%} against the {s.get('against', 'median step')}"
                     + (f" (against the median step: {vs['median_abs_error']:.1%}, max {vs['max_abs_error']:.1%})"
                        if vs.get("median_abs_error") is not None and s.get("against") != "median step" else "")
                     + (f" (wall {s['wall_s'] / 60:.1f} min)" if "wall_s" in s else ""))
    for k in out["skipped"]:
        lines.append(f"- skipped {k['config']} {k['label']}: {k['reason']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
