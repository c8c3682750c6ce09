"""Copy the performance model's validation results into the lab's package data
(commlab/lab/strategy/perfmodel/validation.json), which ``commlab predict``'s "sources" and the Performance model page
quote beside the parts a prediction uses: the product never reads bench/.

    python scripts/publish_validation.py     # after bench/perfmodel.py or bench/model_validation.py
"""
import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "commlab" / "lab" / "strategy" / "perfmodel" / "validation.json"


def measured(path: Path) -> str:
    """The commit (short hash and date) that last wrote ``path``; "" when it is not committed."""
    return subprocess.run(["git", "log", "-1", "--format=%h %cs", "--", str(path)], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()


def table_b() -> dict:
    f = RESULTS / "perfmodel.json"
    if not f.is_file():
        return {}
    d = json.loads(f.read_text())
    s = d["summary"]
    return {"file": f"bench/results/{f.name}", "measured": measured(f), "steps": d.get("steps"),
            "launches": d.get("launches", 1), "against": s.get("against", "median step"),
            "configs": s["configs"], "median_abs_error": s["median_abs_error"], "max_abs_error": s["max_abs_error"]}


def tables_acd() -> dict:
    f = RESULTS / "model_validation.json"
    if not f.is_file():
        return {}
    d = json.loads(f.read_text())
    out = {}
    a = (d.get("a") or {}).get("summary") or {}
    if "geomean_abs_error" in a:
        out["a"] = {"file": f"bench/results/{f.name}", "measured": measured(f), **a}
    if "c" in d:
        out["c"] = {"file": f"bench/results/{f.name}", "measured": measured(f), "device": d["c"].get("device"),
                    "summary": d["c"]["summary"]}
    if "d" in d:
        out["d"] = {"file": f"bench/results/{f.name}", "measured": measured(f),
                    "models": {m: {k: v[k] for k in ("layers", "median_abs_error", "max_abs_error", "step_error")}
                               for m, v in d["d"]["models"].items()}}
    if "e" in d:
        rows = d["e"]["rows"]
        out["e"] = {"file": f"bench/results/{f.name}", "measured": measured(f),
                    "device": ", ".join(sorted({r["device"] for r in rows})),
                    "rows": [{"model": r["model"], "batch": r["batch"], "measured_ms": r["measured_ms"],
                              "borrowed_step_error": r["borrowed"]["step_error"],
                              **({"held_out_step_error": r["held_out"]["step_error"]} if "held_out" in r else {})}
                             for r in rows]}
    return out


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    doc = {"b": table_b(), **tables_acd()}
    doc = {k: v for k, v in doc.items() if v}
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: tables {', '.join(sorted(doc)) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
