"""How well each part of a prediction was checked against measurements: the validation tables of
docs/benchmarks/model-validation.md, shipped as package data (validation.json, written by
scripts/publish_validation.py from bench/results; the product never reads bench/).

- (a) collectives on shaped links, predicted against measured (bench/model_validation.py --table a);
- (b) whole iterations on shaped links, 2 CPU ranks (bench/perfmodel.py);
- (c) MergeComp's published 8 x V100 scaling factors against the device model (--table c);
- (d) this CPU's per-layer times against its roofline (--table d);
- (e) steps measured on a GPU (H100) against that device's roofline (--table e).

``quote(part, kind)`` gives the line for one row of ``ondevice.source_rows``.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

DEVICE_VARIANT = "datasheet / predicted"
"""Table (c)'s variant that ``commlab predict --device`` is: datasheet links, modeled codecs, nothing fitted."""


@lru_cache(maxsize=1)
def load() -> dict:
    return json.loads(resources.files("commlab.lab.strategy.perfmodel").joinpath("validation.json").read_text())


def _pct(x: float) -> str:
    return f"{x:.1%}"


def end_to_end() -> str:
    b = load().get("b")
    if not b:
        return "end to end not measured yet (bench/perfmodel.py)"
    return (f"end to end (bench/perfmodel.py, {b['configs']} configurations, cnn on 2 CPU ranks, shaped links, "
            f"{b.get('measured') or 'uncommitted'}): median error {_pct(b['median_abs_error'])}, "
            f"max {_pct(b['max_abs_error'])} "
            + (f"(measured: the median of each configuration's {b['launches']} launches, each its mean step)"
               if b.get("launches", 1) > 1 else f"against the {b.get('against', 'median step')}"))


def collectives() -> str:
    a = load().get("a")
    if not a:
        return "collectives on shaped links not measured yet (bench/model_validation.py --table a)"
    return (f"collectives on shaped links (table a, {a['points']} points, {a.get('measured') or 'uncommitted'}): "
            f"geomean error {_pct(a['geomean_abs_error'])}, max {_pct(a['max_abs_error'])}")


def device() -> str:
    c = load().get("c")
    s = (c or {}).get("summary", {}).get(DEVICE_VARIANT)
    if not s:
        return "against published multi-GPU results: not measured yet (bench/model_validation.py --table c)"
    return (f"MergeComp's published scaling on 8 x {c.get('device', 'V100')} (table c, datasheet links, modeled "
            f"codecs): median error {s['median_abs_points']:g} points, max {s['max_abs_points']:g}, "
            f"{s['within_5_points']} of {s['n']} within 5 points")


def roofline() -> str:
    d = load().get("d")
    if not d:
        return "roofline per layer: not measured yet (bench/model_validation.py --table d)"
    parts = ", ".join(f"{m} {_pct(v['median_abs_error'])} (step {v['step_error']:+.0%})" for m, v in d["models"].items())
    return f"roofline on this CPU, median error per layer (table d): {parts}"


def gpu() -> str:
    e = load().get("e")
    if not e:
        return "roofline on a GPU: not measured yet (bench/model_validation.py --table e)"
    parts = ", ".join(f"{r['model'].split(':')[-1]} {r['held_out_step_error']:+.0%}" for r in e["rows"]
                      if "held_out_step_error" in r)
    return (f"roofline on an {e['device']}, step error with the efficiency of the other model's measured step "
            f"(table e, {e.get('measured') or 'uncommitted'}): {parts}")


def quote(part: str, kind: str) -> str:
    """The validation of one input of a prediction: ``part`` compute, link or compressor; ``kind`` measured,
    modeled or assumed (ondevice.source_rows)."""
    if kind == "assumed":
        return "not validated: an assumption (say what you know: --link, --cluster, --device)"
    if part == "link":
        return device() if kind == "modeled" else f"{collectives()}; {end_to_end()}"
    if kind == "modeled":
        return f"{gpu()}; {roofline()}; {device()}" if part == "compute" else device()
    return end_to_end()
