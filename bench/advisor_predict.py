"""What the advisor's predictions cost, each in a fresh process (as each strategy auto run's supervisor is).

    python bench/advisor_predict.py [--model resnet] [--gbps 0.1,1,10] [--passes 2] [--json FILE]

One profiling run of the model in a temporary runs directory first (not timed here; bench/advisor.py counts
it as the first setting's profile), then its saved payloads are dropped, and ``commlab.lab.strategy.advisor.advise``
(predictions only) runs once per rate, in turn, each in a new Python process: the first pass meets each rate's
MergeComp partitions and bucket layouts for the first time and keeps their payloads in the profile (as the
lab does); later passes find them kept. Printed: the ``predict`` seconds ``advise`` reports, per pass and rate.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE = """
import json, sys
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from bench.advisor import base_spec
from commlab.lab.strategy import advisor
from commlab.lab.strategy.space import load_spec_dict
spec = load_spec_dict(base_spec(sys.argv[2], "modeled", float(sys.argv[3]), 300))
a = advisor.advise(spec, runs=sys.argv[1], say=lambda m: None)
print(json.dumps({{"cost_s": a.cost_s, "winner": a.winner.label}}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=common.prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet", help="resnet or transformer (bench/advisor.py's settings)")
    ap.add_argument("--gbps", default="0.1,1,10")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from bench.advisor import MODELS, base_spec, run_cell
    if args.model not in MODELS:
        ap.error(f"--model: unknown {args.model!r}; allowed: {', '.join(MODELS)}")
    if args.passes < 1:
        ap.error("--passes: must be >= 1")
    rates = [g for g in args.gbps.split(",") if g]
    from commlab.lab.strategy.perfmodel import whatif
    from commlab.lab.strategy.space import load_spec_dict
    from commlab.lab.rundir.store import RunStore
    store = RunStore(tempfile.mkdtemp(prefix="commlab-advpredict-"))
    spec = load_spec_dict(base_spec(args.model, "modeled", float(rates[0]), 300))
    prof = whatif.resolve_profile(spec, store.root, say=lambda m: print(m, file=sys.stderr),
                                  runner=lambda s, prepare=None: run_cell(store, s, prepare))
    prof.payloads = {}
    prof.save(whatif.profile_dir(store.root) / f"{prof.key()}.json")
    rows, out = [], []
    for p in range(1, args.passes + 1):
        for g in rates:
            res = subprocess.run([sys.executable, "-c", ONE.format(root=ROOT), str(store.root), args.model, g],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"advise at {g} Gbit/s failed: {res.stderr.strip().splitlines()[-1]}")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            out.append({"pass": p, "gbps": float(g), **r})
            rows.append([str(p), g, f"{r['cost_s']['predict']:.2f}", r["winner"]])
            print(f"pass {p}, {g} Gbit/s: predictions {r['cost_s']['predict']:.2f} s", file=sys.stderr, flush=True)
    print(common.markdown_table(["pass", "Gbit/s", "predictions s", "predicted winner"], rows))
    if args.json:
        common.write_json(args.json, {"model": args.model, "results": out, "runs": str(store.root)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
