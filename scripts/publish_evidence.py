"""Copy the accuracy benchmarks' latest results into the lab's package data (commlab/lab/strategy/evidence.json), which
the advisor's convergence penalties and the properties checklist read: the product never reads bench/.

    python scripts/publish_evidence.py          # after bench/compressor_accuracy.py or bench/strategy_accuracy.py
"""
import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "commlab" / "lab" / "strategy" / "evidence.json"
COMPRESSORS = ("compressor_accuracy.json", "compressor_accuracy_rerun.json")
STRATEGIES = "strategy_accuracy.json"


def entry(name: str) -> dict:
    data = json.loads((RESULTS / name).read_text())
    commit = subprocess.run(["git", "log", "-1", "--format=%h %cs", "--", str(RESULTS / name)], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    return {"file": f"bench/results/{name}", "measured": commit or None, "steps": data.get("steps"),
            "cells": data.get("cells", [])}


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    doc = {"compressor_accuracy": [entry(n) for n in COMPRESSORS if (RESULTS / n).is_file()],
           "strategy_accuracy": entry(STRATEGIES) if (RESULTS / STRATEGIES).is_file() else None}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {sum(len(e['cells']) for e in doc['compressor_accuracy'])} compressor "
          f"cells, {len((doc['strategy_accuracy'] or {}).get('cells', []))} strategy cells")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
