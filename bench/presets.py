"""Every Home-page preset, started as the UI starts it, several times, interleaved; each effect's ratio,
every variant's accuracy and the preset's wall time.

    .venv/bin/python bench/presets.py [--rounds 3] [--presets KEY,KEY] [--runs DIR]
    commlab bench presets ...

Round k starts the presets one after another (the order rotates between rounds), each in a fresh runs
directory ``DIR/round-k`` (so MergeComp searches as it does on a user's first click, with no cached
partition), through ``commlab.lab.front.groups.start_preset``: detached supervisors and the lab's queue, exactly what
the Start button does. The wall time is the user's: from the click to the last run's end. The verdict
(ratios, accuracy checks) is ``commlab.lab.analysis.results.evaluate``, the same code the results page shows.
Results: bench/results/presets.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import prog  # noqa: E402
import commlab  # noqa: E402
from commlab.lab.analysis import results  # noqa: E402
from commlab.lab.front import groups
from commlab.lab.analysis.presets import PRESETS  # noqa: E402
from commlab.engine.runfiles import FINAL  # noqa: E402

WALL_LIMIT_S = 90.0
"""What a preset may take on this machine, from the click to its last run's end."""


def run_preset(p, root: Path, timeout_s: float) -> dict:
    gid = groups.start_preset(p, runs=root)
    group = results.load_group(root, gid)
    deadline = time.time() + timeout_s
    while True:
        group = results.load_group(root, gid)
        states = [commlab.get(i, runs=root).state for i in group["runs"].values()]
        if len(states) == len(p.variants) and all(s in FINAL for s in states):
            break
        if time.time() > deadline:
            for i in group["runs"].values():
                commlab.cancel(i, runs=root)
            break
        time.sleep(0.5)
    v = results.evaluate(group, lambda rid: commlab.get(rid, runs=root))
    return {
        "preset": p.key, "group": gid, "wall_s": v.wall_s, "complete": v.complete, "passed": v.passed,
        "effects": [{"text": e.effect.text, "ratio": e.ratio, "passed": e.passed, "why": e.why} for e in v.effects],
        "variants": {k: {"run": x.run_id, "state": x.state, "iter_ms": x.iter_ms, "acc": x.acc,
                         "bytes_per_step": x.summary.get("bytes_per_step"),
                         "compression": x.summary.get("compression_ratio"),
                         "disturbed": x.disturbance.get("disturbed"), "other_cpu": x.disturbance.get("other_cpu")}
                     for k, x in v.variants.items()},
        "accuracy_ok": v.accuracy_ok, "crossover": results.crossover(group, lambda rid: commlab.get(rid, runs=root)),
        "faults": {"checks": v.fault_checks, "lines": v.fault_lines,
                   "goodput": {k: x.ft.get("goodput") for k, x in v.variants.items() if x.ft},
                   "rejoin_s": {k: x.ft.get("rejoin_s") for k, x in v.variants.items() if x.ft}}
        if p.faults is not None else None,
    }


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def markdown(rows: list, rounds: int) -> str:
    out = ["| preset | effect (target) | ratio per round | median | accuracy per variant (lowest over rounds) "
           "| wall s per round | within 90 s | verdict |", "|---|---|---|---|---|---|---|---|"]
    for p in PRESETS:
        rs = [r for r in rows if r["preset"] == p.key]
        if not rs:
            continue
        accs = "; ".join(f"{k} {min(r['variants'][k]['acc'] or 0 for r in rs):.1%}"
                         if all(r["variants"][k]["state"] == "done" for r in rs) else
                         f"{k} {'/'.join(sorted({r['variants'][k]['state'] for r in rs}))}" for k in p.variants)
        walls = [r["wall_s"] for r in rs]
        wall_txt = ", ".join(f"{w:.0f}" if w is not None else "-" for w in walls)
        in_time = all(w is not None and w <= WALL_LIMIT_S for w in walls)
        verdicts = ", ".join({True: "shown", False: "missed", None: "incomplete"}[r["passed"]] for r in rs)
        effects = p.effects or ([("goodput",) + pair for pair in p.faults.pairs] if p.faults else [None])
        for i, e in enumerate(effects):
            if e is None:
                eff, ratios, med = "accuracy and bytes only", "-", "-"
            elif isinstance(e, tuple):  # a plug-pulling preset: each faulted run's goodput against its twin's
                _, faulted, clean = e
                vals = [(r["faults"]["goodput"].get(faulted) or 0) / r["faults"]["goodput"][clean]
                        if r["faults"]["goodput"].get(clean) else None for r in rs]
                eff = f"goodput of {faulted} against {clean}"
                ratios = ", ".join(f"{x:.2f}" if x is not None else "-" for x in vals)
                m = _med(vals)
                med = f"{m:.2f}x" if m is not None else "-"
            else:
                lo, hi = e.bounds(p.values())  # a knob's bound (H) at the knob's default, as the runs ran
                bound = f">= {lo:g}x" if lo is not None else f"<= {hi:g}x"
                vals = [r["effects"][i]["ratio"] for r in rs]
                eff = f"{e.text} ({bound})"
                ratios = ", ".join(f"{x:.2f}" if x is not None else "-" for x in vals)
                m = _med(vals)
                med = f"{m:.2f}x" if m is not None else "-"
            first = i == 0
            out.append(f"| {p.title if first else ''} | {eff} | {ratios} | {med} | {accs if first else ''} | "
                       f"{wall_txt if first else ''} | {('yes' if in_time else 'no') if first else ''} | "
                       f"{verdicts if first else ''} |")
    kills = [f"- round {k + 1}: " + "; ".join(r["faults"]["lines"])
             for k, r in enumerate(x for x in rows if x.get("faults"))]
    if kills:
        out += ["", "Pull the plug, per round:", ""] + kills
    cross = [r["crossover"] for r in rows if r.get("crossover")]
    if cross:
        out.append("")
        out.append("Performance model, per round: " + "; ".join(cross))
    dist = [f"{r['preset']} {k}" for r in rows for k, x in r["variants"].items() if x.get("disturbed")]
    out.append("")
    out.append(f"Rounds: {rounds}. Disturbed runs (other processes above the lab's threshold): "
               + (", ".join(dist) if dist else "none"))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog(__file__), description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--presets", default=",".join(p.key for p in PRESETS),
                    help="comma-separated preset keys (default: all)")
    ap.add_argument("--runs", default="/tmp/commlab-bench-presets", help="runs directory (a round-k folder each)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one preset may take before it is cancelled")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "presets"),
                    help="results path without extension (.md and .json are written)")
    a = ap.parse_args(argv)
    keys = [k for k in a.presets.split(",") if k]
    known = {p.key: p for p in PRESETS}
    bad = [k for k in keys if k not in known]
    if bad:
        print(f"presets: unknown key {bad[0]!r}; allowed: {', '.join(known)}", file=sys.stderr)
        return 2
    if a.rounds < 1:
        print("rounds: must be >= 1", file=sys.stderr)
        return 2
    rows = []
    t0 = time.time()
    for k in range(a.rounds):
        root = Path(a.runs) / f"round-{k + 1}"
        order = keys[k % len(keys):] + keys[:k % len(keys)]
        for key in order:
            r = run_preset(known[key], root, a.timeout)
            r["round"] = k + 1
            rows.append(r)
            eff = "; ".join(f"{e['ratio']:.2f}x" if e["ratio"] else "-" for e in r["effects"]) or "-"
            acc = ", ".join(f"{n} {x['acc']:.1%}" if x["acc"] is not None else f"{n} -"
                            for n, x in r["variants"].items())
            wall = f"{r['wall_s']:.0f} s" if r["wall_s"] is not None else "-"
            print(f"round {k + 1} {key}: effects {eff}; {acc}; wall {wall}; "
                  f"{'shown' if r['passed'] else 'missed' if r['passed'] is False else 'incomplete'}", flush=True)
    table = markdown(rows, a.rounds)
    print(table)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "bench/presets.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "total_s": time.time() - t0, "cpus": os.cpu_count()}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    out.with_suffix(".md").write_text(f"`{meta['command']}` ({meta['total_s'] / 60:.1f} min)\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
