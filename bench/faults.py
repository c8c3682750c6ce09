"""Pull the plug: what killing workers of a fault-tolerant run costs, against the same run without a fault.

    python bench/faults.py [--rounds 2] [--steps 500] [--every 150] [--links loopback,1]
                           [--methods none,diloco] [--replicas 3] [--out bench/results/faults]

Each setting (a method on a link) runs three variants as ordinary runs of the lab (``commlab.run``, the path
``commlab run`` takes), interleaved round by round with the order rotating, so load from elsewhere falls on all
alike:

- ``plain``: the spec without fault tolerance (torchrun, one process group): what fault tolerance itself costs;
- ``clean``: ``fault_tolerance: {enabled: true}``, no fault (torchft's Lighthouse and a Manager per replica group);
- ``killed``: the same with a replica SIGKILLed every ``--every`` steps (replica 1, then 2, then 1 ...; never
  replica 0, whose records are the run's clock), each restarted by the lab half a second later; it recovers the
  model, the optimizer and the method's state from a live peer (commlab/engine/ft.py) and trains on.

The model is the CNN on the 8x8 digits (``--model``), ``--replicas`` replica groups of one process each, per-step
sync (method none: every step's gradients, 25 MB buckets, wfbp; SGD, lr 0.05, momentum 0.9) or DiLoCo (H 8, the
paper's outer Nesterov SGD at lr 0.7, momentum 0.9; Adam at lr 0.002 inside). A link is ``loopback`` or a
rate in Gbit/s, a modeled link (``network: {link: modeled}``: the engine's alpha-beta delays on every
collective; torchft's recovery transfer itself runs over loopback HTTP, so its time at that rate is also given
as its bytes over the rate).

Reported per setting, medians over rounds with the spread:

- goodput: steps committed per second of replica 0 (its first to its last step line), ``killed`` and ``clean``
  and their ratio (target: at least 0.90);
- recovery: torchft's transfer of a restarted replica's state (seconds and bytes from recoveries.jsonl), the
  same bytes at the link's rate, and from the kill to the restarted replica's first committed step (restart
  delay, process start, quorum, transfer); target: the transfer within 5 s at 1 Gbit/s;
- final held-out accuracy of replica 0, ``killed`` against ``clean`` (target: within 1 point) and ``plain``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from commlab.lab.analysis import replicas  # noqa: E402

VARIANTS = ("plain", "clean", "killed")
GOODPUT_MIN, RECOVERY_MAX_S, ACC_POINTS = 0.90, 5.0, 1.0


def spec_for(args, method: str, link: str, variant: str) -> dict:
    """The run of one variant: the same model, data, seed and steps for all three."""
    s = {"name": f"faults-{method}-{link}-{variant}", "model": args.model, "dataset": "digits",
         "world_size": args.replicas, "steps": args.steps, "batch_size": 32, "threads": 1,
         "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "eval_every": 0, "final_eval": True,
         "comm": "wfbp", "schedule": {"name": "bucket", "cap_mb": 25}}
    if method == "diloco":  # the paper's inner optimizer is Adam's kind: SGD's momentum under the outer Nesterov step
        s["method"] = {"name": "diloco", "H": 8}  # with lr 0.7 diverges here
        s["optimizer"] = {"name": "adam", "lr": 0.002}
    if link != "loopback":
        s["network"] = {"link": "modeled", "gbps": float(link)}
    if variant == "plain":
        return s
    ft = {"enabled": True, "min_replicas": 2, "join_timeout_ms": 1000, "timeout_s": 60}
    if variant == "killed":
        kills = list(range(args.every, args.steps - args.every // 2, args.every))
        ft["faults"] = [{"kind": "kill", "replica": 1 + i % (args.replicas - 1), "step": at, "restart_after_s": 0.5}
                        for i, at in enumerate(kills)]
        ft["restart"] = {"max_restarts": len(kills), "delay_s": 0.5}
    s["fault_tolerance"] = ft
    return s


def measure(run, variant: str, gbps: Optional[float]) -> dict:
    """What one run recorded: goodput, final accuracy, recoveries (after the start), kills to rejoins."""
    st = run.status()
    rows = run.metric_rows()
    steps = [r for r in rows if r["kind"] == "step"]
    out = {"state": st.get("state"), "error": st.get("error")}
    out["goodput"] = replicas.goodput(steps)
    if out["goodput"] is None:
        return out
    evals = [r for r in rows if r["kind"] == "eval" and r.get("rank", 0) == 0 and r.get("replica", 0) == 0]
    out["acc"] = evals[-1]["eval_acc"] if evals else None
    if variant == "plain":
        return out
    parts = [r.get("participants") for r in rows if r["kind"] == "step" and r.get("participants")]
    out["quorum_min"] = min(parts) if parts else None
    recs = replicas.after_start(run.recoveries(), steps)  # not the start's
    out["recoveries"] = [{"seconds": r.get("seconds"), "bytes": r.get("bytes"), "from": r.get("from_replica"),
                          "replica": r.get("replica"),
                          "at_rate_s": (r["bytes"] * 8 / (gbps * 1e9)) if gbps and r.get("bytes") else None}
                         for r in recs]
    rejoin = replicas.rejoins(run.ft_events(), steps)
    out["kills"] = len(rejoin)
    out["kill_to_rejoin_s"] = rejoin
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs, fmt="{:.2f}"):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = statistics.median(xs)
    return fmt.format(m) if len(xs) == 1 else f"{fmt.format(m)} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def summarize(setting: Dict[str, List[dict]], gbps: Optional[float]) -> dict:
    clean, killed = setting["clean"], setting["killed"]
    ratios = [k.get("goodput") / c["goodput"] for k, c in zip(killed, clean)
              if k.get("goodput") and c.get("goodput")]
    recs = [r for k in killed for r in k.get("recoveries", [])]
    secs = [r["seconds"] for r in recs if r["seconds"] is not None]
    at_rate = [r["at_rate_s"] for r in recs if r["at_rate_s"] is not None]
    rejoin = [x for k in killed for x in k.get("kill_to_rejoin_s", []) if x is not None]
    dacc = [(k["acc"] - c["acc"]) * 100 for k, c in zip(killed, clean) if k.get("acc") is not None
            and c.get("acc") is not None]
    worst_rec = max([max(a, b) for a, b in zip(secs, at_rate)] if at_rate else secs, default=None)
    return {
        "goodput_ratio": ratios, "goodput_ratio_median": med(ratios),
        "goodput": {v: [x.get("goodput") for x in setting[v]] for v in VARIANTS},
        "acc": {v: [x.get("acc") for x in setting[v]] for v in VARIANTS},
        "acc_delta_points": dacc,
        "recoveries": len(recs), "kills": sum(k.get("kills", 0) for k in killed),
        "recovery_s": secs, "recovery_at_rate_s": at_rate, "recovery_bytes": [r["bytes"] for r in recs],
        "kill_to_rejoin_s": rejoin,
        "quorum_min": min((k.get("quorum_min") or 99 for k in killed), default=None),
        "meets": {"goodput": med(ratios) is not None and med(ratios) >= GOODPUT_MIN,
                  "recovery": worst_rec is not None and worst_rec <= RECOVERY_MAX_S,
                  "accuracy": bool(dacc) and abs(med(dacc)) <= ACC_POINTS},
        "states": {v: [x.get("state") for x in setting[v]] for v in VARIANTS},
    }


def table(res: dict) -> str:
    rows = []
    for key, s in res["settings"].items():
        yes = lambda b: "meets" if b else "misses"  # noqa: E731
        rows.append([key, spread(s["goodput"]["clean"], "{:.1f}"), spread(s["goodput"]["killed"], "{:.1f}"),
                     f"{spread(s['goodput_ratio'])} ({yes(s['meets']['goodput'])})",
                     f"{s['kills']} / {s['recoveries']}", str(s["quorum_min"]),
                     f"{spread(s['recovery_s'])} ({yes(s['meets']['recovery'])})",
                     spread(s["recovery_at_rate_s"], "{:.3f}"), spread([b / 1e6 for b in s["recovery_bytes"]]),
                     spread(s["kill_to_rejoin_s"], "{:.1f}"),
                     spread([a * 100 for a in s["acc"]["plain"] if a is not None], "{:.1f}"),
                     spread([a * 100 for a in s["acc"]["clean"] if a is not None], "{:.1f}"),
                     spread([a * 100 for a in s["acc"]["killed"] if a is not None], "{:.1f}"),
                     f"{spread(s['acc_delta_points'], '{:+.1f}')} ({yes(s['meets']['accuracy'])})"])
    return common.markdown_table(
        ["method @ link", "goodput clean steps/s", "killed steps/s", "killed/clean (>= 0.90)", "kills / recoveries",
         "smallest quorum", "recovery s (<= 5)", "its bytes at the rate, s", "MB moved", "kill to rejoin s",
         "acc plain %", "acc clean %", "acc killed %", "killed - clean, points (within 1)"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--every", type=int, default=150, help="kill a replica every this many steps")
    ap.add_argument("--links", default="loopback,1", help="loopback and/or modeled rates in Gbit/s, comma-separated")
    ap.add_argument("--methods", default="none,diloco", help="none (per-step sync) and/or diloco")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--runs", help="runs directory (default: a temporary one, removed after)")
    ap.add_argument("--out", default="bench/results/faults")
    args = ap.parse_args(argv)
    prog = common.prog(__file__)
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    methods = [x.strip() for x in args.methods.split(",") if x.strip()]
    for x in links:
        if x != "loopback":
            try:
                if float(x) <= 0:
                    raise ValueError
            except ValueError:
                print(f"{prog}: --links: loopback or a rate in Gbit/s above 0, got {x!r}", file=sys.stderr)
                return 2
    if any(m not in ("none", "diloco") for m in methods):
        print(f"{prog}: --methods: none and/or diloco, got {args.methods!r}", file=sys.stderr)
        return 2
    if args.replicas < 3 or args.rounds < 1 or args.every < 8 or args.steps < 2 * args.every:
        print(f"{prog}: --replicas at least 3, --rounds at least 1, --every at least 8 and --steps at least twice "
              f"--every", file=sys.stderr)
        return 2
    import commlab
    tmp = None if args.runs else tempfile.TemporaryDirectory(prefix="clab-faults-")
    root = args.runs or tmp.name
    t0 = time.time()
    raw: Dict[str, Dict[str, List[dict]]] = {}
    try:
        for rnd in range(args.rounds):
            for method in methods:
                for link in links:
                    key = f"{method} @ {link if link == 'loopback' else link + ' Gbit/s'}"
                    gbps = None if link == "loopback" else float(link)
                    got = raw.setdefault(key, {v: [] for v in VARIANTS})
                    order = VARIANTS[rnd % 3:] + VARIANTS[:rnd % 3]
                    for v in order:
                        t = time.time()
                        run = commlab.run(spec_for(args, method, link, v), runs=root)
                        m = measure(run, v, gbps)
                        m["wall_s"] = time.time() - t
                        got[v].append(m)
                        print(f"round {rnd + 1}/{args.rounds} {key} {v}: {m.get('state')}, goodput "
                              f"{m.get('goodput') or 0:.1f} steps/s, acc {100 * (m.get('acc') or 0):.1f}%, "
                              f"{len(m.get('recoveries', []))} recoveries, {m['wall_s']:.0f} s", flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    res = {"command": "python bench/faults.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "args": vars(args), "wall_s": time.time() - t0,
           "torchft": __import__("importlib.metadata").metadata.version("torchft"),
           "cpus": os.cpu_count(), "raw": raw,
           "settings": {k: summarize(v, None if "loopback" in k else float(k.split(" @ ")[1].split()[0]))
                        for k, v in raw.items()}}
    md = (f"`{res['command']}` ({res['wall_s'] / 60:.1f} min; torchft {res['torchft']}, {args.replicas} replica "
          f"groups of one process on {res['cpus']} cores, {args.model} on digits, {args.steps} steps, a kill every "
          f"{args.every} steps; medians over {args.rounds} rounds, (min-max))\n\n" + table(res) + "\n")
    common.write_out(args.out, res, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
