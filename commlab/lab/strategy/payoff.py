"""Will a compressor pay? Its cost curve beside the built-ins', and its predicted iteration time against no
compression and the best built-in, on links and cluster sizes, for one model's profile.

    rows = cost_table(section, builtin_sections())       # encode/decode cost and bytes, measured here
    grid = payoff_grid(profile, spec, section, builtin_sections(), gbps=GBPS, workers=WORKERS)
    for line in verdict(grid): print(line)

What it predicts is iteration time on a modeled alpha-beta link (commlab.lab.strategy.perfmodel.predict; the
profile's calibrated link scaled to each rate where it has one), with 25 MB buckets and wfbp, the way the
advisor predicts its candidates. Accuracy is not predicted: a lossy compressor that pays per step may
still need more steps (the advisor's penalty, commlab.lab.strategy.penalty).

A compressor that names code (``package.module:Class``) is measured afresh every time: its code may have
changed since the last measurement, so its curve is not kept for the machine (the built-ins' are).
"""
from __future__ import annotations

import copy
from typing import List, Optional, Sequence, Tuple

from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import predict as pr
from commlab.lab.strategy.perfmodel import whatif
from commlab.lab.strategy.perfmodel.properties import ratio
from commlab.lab.strategy.space import compressor_space

GBPS = (0.1, 1.0, 10.0, 100.0)
WORKERS = (2, 8, 64)
STRATEGY = {"schedule": {"name": "bucket", "cap_mb": 25.0}, "comm": {"mode": "wfbp"}}
"""What every compressor is predicted with: DDP's buckets and overlap, so only the compressor differs."""
NONE = {"name": "none", "params": {}, "error_feedback": False, "per_bucket": []}


def section(name: str, params: Optional[dict] = None, error_feedback: bool = False) -> dict:
    """A compressor section in the spec's full form."""
    return {"name": name, "params": dict(params or {}), "error_feedback": bool(error_feedback), "per_bucket": []}


def builtin_sections() -> List[Tuple[str, dict]]:
    """The built-ins a compressor is measured and predicted against: the advisor's single compressors (the
    ones that keep accuracy), without its mixed sections and without ``none`` (the reference, apart)."""
    return [(label, c) for label, c in compressor_space() if not c.get("per_bucket") and c["name"] != "none"]


def label_of(c: dict) -> str:
    return cal.compressor_key(c)


def ensure(profile: cal.Profile, mine: dict, others: Sequence[Tuple[str, dict]], runs=None) -> None:
    """Give ``profile`` the cost curves of ``mine``, measured now, and of ``others`` (the machine's kept
    curves where measured before)."""
    profile.compressors.pop(cal.compressor_key(mine), None)
    whatif.ensure_curves(profile, [{"compressor": c} for c in [mine] + [c for _, c in others]], runs, kept=True)


def cost_table(profile: cal.Profile, mine: dict, others: Sequence[Tuple[str, dict]]) -> List[dict]:
    """One row per compressor, ``mine`` first: encode and decode cost (fixed microseconds and microseconds per
    MB of fp32 input, from the fitted curves) and the compression ratio on a 1 M-element tensor."""
    rows = []
    for label, c in [("yours: " + label_of(mine).rpartition(":")[2], mine)] + list(others):  # the class, not its path
        curve = profile.compressors.get(cal.compressor_key(c))
        row = {"compressor": label, "key": cal.compressor_key(c), "mine": c is mine}
        if curve is None:  # runs no compressor code (none)
            row.update(encode_us=0.0, encode_us_per_mb=0.0, decode_us=0.0, decode_us_per_mb=0.0)
        else:
            row.update(encode_us=curve["encode"][0] * 1e6, encode_us_per_mb=curve["encode"][1] * 1e6 * (1 << 20),
                       decode_us=curve["decode"][0] * 1e6, decode_us_per_mb=curve["decode"][1] * 1e6 * (1 << 20))
        row["ratio"] = ratio(c["name"], **c["params"])  # error feedback sends nothing more
        rows.append(row)
    return rows


def with_compressor(spec: dict, c: dict) -> dict:
    s = copy.deepcopy(spec)
    s.update(copy.deepcopy(STRATEGY))
    s["compressor"] = copy.deepcopy(c)
    return s


def payoff_grid(profile: cal.Profile, spec: dict, mine: dict, others: Sequence[Tuple[str, dict]],
                gbps: Sequence[float] = GBPS, workers: Sequence[int] = WORKERS) -> List[dict]:
    """Per (rate, workers): predicted ms per step with no compression, with ``mine``, and with the best of
    ``others``; ``pays`` (``mine`` faster than none) and ``best`` (faster than every built-in too)."""
    rows = []
    for g in gbps:
        link = profile.link_at(g)
        for w in workers:
            def ms(c):
                return pr.predict(profile, with_compressor(spec, c), g, w, link=link).total * 1e3
            base, yours = ms(NONE), ms(mine)
            best_label, best = min(((label, ms(c)) for label, c in others), key=lambda e: e[1])
            rows.append({"gbps": g, "workers": w, "none_ms": base, "yours_ms": yours, "best_builtin": best_label,
                         "best_builtin_ms": best, "speedup": base / yours, "pays": yours < base,
                         "best": yours < min(base, best)})
    return rows


def verdict(grid: List[dict]) -> List[str]:
    """Where it pays, in words: per link rate, the cluster sizes where it beats no compression and where it
    beats every built-in too."""
    lines = []
    for g in dict.fromkeys(r["gbps"] for r in grid):
        at = [r for r in grid if r["gbps"] == g]
        pays = [str(r["workers"]) for r in at if r["pays"]]
        best = [str(r["workers"]) for r in at if r["best"]]
        if not pays:
            lines.append(f"{g:g} Gbit/s: does not pay (no compression is faster at {', '.join(str(r['workers']) for r in at)} workers)")
            continue
        tail = f"; the fastest of all at {', '.join(best)}" if best else \
            f"; a built-in is faster ({', '.join(sorted({r['best_builtin'] for r in at if r['pays']}))})"
        lines.append(f"{g:g} Gbit/s: pays at {', '.join(pays)} workers{tail}")
    return lines


def format_costs(rows: List[dict]) -> List[str]:
    head = f"{'COMPRESSOR':<40} {'ENCODE us':>10} {'+us/MB':>9} {'DECODE us':>10} {'+us/MB':>9} {'RATIO':>7}"
    out = [head]
    for r in rows:
        out.append(f"{r['compressor'][:40]:<40} {r['encode_us']:>10.1f} {r['encode_us_per_mb']:>9.1f} "
                   f"{r['decode_us']:>10.1f} {r['decode_us_per_mb']:>9.1f} {r['ratio']:>6.1f}x")
    return out


def format_grid(grid: List[dict]) -> List[str]:
    head = f"{'GBIT/S':>7} {'WORKERS':>7} {'NONE ms':>9} {'YOURS ms':>9} {'BEST BUILT-IN':<16} {'ms':>9} {'PAYS':>5}"
    out = [head]
    for r in grid:
        out.append(f"{r['gbps']:>7g} {r['workers']:>7} {r['none_ms']:>9.1f} {r['yours_ms']:>9.1f} "
                   f"{r['best_builtin'][:16]:<16} {r['best_builtin_ms']:>9.1f} "
                   f"{'best' if r['best'] else 'yes' if r['pays'] else 'no':>5}")
    return out
