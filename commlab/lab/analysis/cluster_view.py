"""A cluster run's workers and who waits on whom, from its spec.json and its step lines. Read by the Live run page
(drawn by ``commlab.lab.analysis.plots.cluster_figure``) and ``commlab show``; nothing here imports streamlit.

The cluster (``network.cluster.workers`` of spec.json, commlab/engine/cluster.py) gives each rank its link and
compute speed. The step lines (metrics.jsonl) give what each rank measured, per step:

- compute: ``forward_ms + backward_ms``, the work before the step's exchange ends (a slow worker's stretch, its
  ``slow_ms``, is counted in them);
- exchange: ``finish_ms`` (from the end of backward until the step's collectives are done; under a method, plus
  its ``sync_ms``): waiting for the peers, and the bytes on the link;
- wait: the rank's exchange minus the shortest exchange of any rank at that step. The rank that arrives last at
  the collective waits only for the link; what the others wait beyond that is the time they waited for it.

Each figure is the median over the steps every rank has logged, warm-up left out (a running run: what is there).
The slowest rank, the one the others wait on, is the rank with the most compute, named only when it computes longer
than the fastest rank by more than ``SLOWER`` of the fastest's compute and 1 ms (below that, what the ranks measure
differs by noise: nobody waits long on anybody).

The ring's hops are the modeled link's (commlab.engine.netmodel.ClusterLink): hop i -> i+1 moves a chunk over the
slower of rank i's up-link and rank i+1's down-link and crosses both ends' delays; the chunk is that of one
all-reduce of the step's bytes (the median of the step lines' non-zero ``bytes_sent``), ``n / p``. The slowest hop
sets the pace of every step of a ring collective.
"""
from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Optional

from commlab.engine import cluster
from commlab.engine.netmodel import ClusterLink, ring_steps
from commlab.lab.rundir.summary import warmup_steps

SLOWER = 0.2
"""A rank is the slowest when its compute per step exceeds the fastest rank's by this share (and 1 ms)."""


def region_label(preset: Optional[str], rank: int, world: int) -> str:
    """Where a rank is: its preset's name and region (``three_continents 2``; a preset of one kind of worker: its
    name alone), or ``custom`` for listed workers."""
    if not preset:
        return "custom"
    regions = len(cluster.PRESETS.get(preset, {}).get("workers", [None]))
    if regions <= 1:
        return preset
    return f"{preset} {rank * regions // world if world != regions else rank}"


def _median(vals: List[float]) -> Optional[float]:
    return float(statistics.median(vals)) if vals else None


def _per_step(rows: Iterable[dict], world: int) -> Dict[int, Dict[int, dict]]:
    """{step: {rank: its line}} of the steps every rank has logged (the last line of a step a rank logged twice)."""
    by: Dict[int, Dict[int, dict]] = {}
    for r in rows:
        if r.get("kind") != "step" or not isinstance(r.get("rank"), int) or not 0 <= r["rank"] < world:
            continue
        if not isinstance(r.get("step"), int):
            continue
        by.setdefault(r["step"], {})[r["rank"]] = r
    return {s: d for s, d in sorted(by.items()) if len(d) == world}


def _compute(r: dict) -> float:
    return float(r.get("forward_ms") or 0.0) + float(r.get("backward_ms") or 0.0)


def _exchange(r: dict) -> float:
    return float(r.get("finish_ms") or 0.0) + float(r.get("sync_ms") or 0.0)


def hops(workers: List[dict], nbytes: float) -> List[dict]:
    """The ring's hops for one all-reduce of ``nbytes``: ``src``, ``dst``, ``gbps`` (the slower of src's up and
    dst's down), ``delay_ms`` (both ends'), ``ms`` (the chunk ``nbytes / p`` on that rate, plus the delays; without
    jitter). Empty for one worker, or a cluster without rates (a loopback cluster gives speeds only)."""
    p = len(workers)
    if p < 2 or any(w.get("gbps_up") is None or w.get("gbps_down") is None for w in workers):
        return []
    _, chunk = ring_steps("allreduce", nbytes, p)
    secs = ClusterLink(workers).hops(chunk)
    return [{"src": i, "dst": (i + 1) % p, "gbps": min(workers[i]["gbps_up"], workers[(i + 1) % p]["gbps_down"]),
             "delay_ms": workers[i]["delay_ms"] + workers[(i + 1) % p]["delay_ms"], "ms": s * 1e3}
            for i, s in enumerate(secs)]


def cluster_view(spec: dict, rows: Iterable[dict]) -> Optional[dict]:
    """A cluster run as its records tell it (the module's docstring says how each figure is taken); None for a run
    without a cluster. ``spec``: spec.json as a dict; ``rows``: metrics.jsonl's lines (others than step lines are
    left out). Returns::

        {"preset": name or None, "world": p, "steps": steps counted (0 before every rank has logged one),
         "workers": [{"rank", "label", "gbps_up", "gbps_down", "delay_ms", "jitter_ms", "speed",
                      "compute_ms", "exchange_ms", "wait_ms"}, ...],     # the three figures None until counted
         "slowest": rank or None, "waiting": the other ranks, which wait on it ([] without a slowest),
         "bytes": the step's bytes (per rank), "hops": hops(...),
         "slowest_hop": its index in hops, or None (no hops, or every hop alike),
         "allreduce_ms": the modeled time of one all-reduce of those bytes (its slowest hop per ring step) or None}
    """
    ws = cluster.workers(spec)
    if ws is None:
        return None
    p = len(ws)
    preset = ((spec.get("network") or {}).get("cluster") or {}).get("preset")
    rows = list(rows)
    complete = _per_step(rows, p)
    counted = list(complete)[warmup_steps(len(complete)):] if complete else []
    sent = [float(r["bytes_sent"]) for r in rows if r.get("kind") == "step" and r.get("bytes_sent")]
    nbytes = _median(sent) or 0.0
    out_workers = []
    for r, w in enumerate(ws):
        lines = [complete[s][r] for s in counted]
        waits = [_exchange(complete[s][r]) - min(_exchange(x) for x in complete[s].values()) for s in counted]
        out_workers.append({"rank": r, "label": region_label(preset, r, p), **w,
                            "compute_ms": _median([_compute(x) for x in lines]),
                            "exchange_ms": _median([_exchange(x) for x in lines]),
                            "wait_ms": _median(waits)})
    slowest = None
    if counted and p > 1:
        by_compute = sorted(out_workers, key=lambda x: x["compute_ms"])
        fastest = by_compute[0]["compute_ms"]
        if by_compute[-1]["compute_ms"] - fastest > max(1.0, SLOWER * fastest):
            slowest = by_compute[-1]["rank"]
    hs = hops(ws, nbytes)
    slow_hop = max(range(len(hs)), key=lambda i: (hs[i]["ms"], -hs[i]["gbps"])) if hs else None
    if hs and all((h["ms"], h["gbps"]) == (hs[0]["ms"], hs[0]["gbps"]) for h in hs):
        slow_hop = None  # every hop alike: none is the slowest
    steps, _ = ring_steps("allreduce", nbytes, p)
    return {"preset": preset, "world": p, "steps": len(counted), "workers": out_workers, "slowest": slowest,
            "waiting": [] if slowest is None else [r for r in range(p) if r != slowest],
            "bytes": nbytes, "hops": hs, "slowest_hop": slow_hop,
            "allreduce_ms": steps * max(h["ms"] for h in hs) if hs else None}


def table(view: dict) -> List[dict]:
    """One row per rank for a table: its speed, compute and wait per step (ms), the rank it waits on ("(the slowest)"
    for the slowest; None when no rank is the slowest), its exchange per step, then its place and link."""
    slowest = view["slowest"]
    rnd = lambda v: None if v is None else round(v, 2)  # noqa: E731
    return [{"rank": w["rank"], "speed": w["speed"], "compute ms/step": rnd(w["compute_ms"]),
             "wait ms/step": rnd(w["wait_ms"]),
             "waits on": None if slowest is None else "(the slowest)" if w["rank"] == slowest else f"rank {slowest}",
             "exchange ms/step": rnd(w["exchange_ms"]), "where": w["label"], "up Gbit/s": w["gbps_up"],
             "down Gbit/s": w["gbps_down"], "delay ms": w["delay_ms"]}
            for w in view["workers"]]


def _ranks(rs: List[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def describe(view: Optional[dict]) -> str:
    """One line: "rank 2 is the slowest (speed 0.5, 41.2 ms of compute per step); ranks 0, 1, 3 waited 38.9 ms per
    step on it (median)", with the slowest hop; "" without a cluster."""
    if view is None:
        return ""
    if not view["steps"]:
        head = "no step logged by every rank yet"
    elif view["slowest"] is None:
        head = "no rank is much slower than the others: nobody waits long on anybody"
    else:
        s = view["workers"][view["slowest"]]
        waits = [view["workers"][r]["wait_ms"] for r in view["waiting"]]
        lo, hi = min(waits), max(waits)
        ms = f"{lo:.1f} ms" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}-{hi:.1f} ms"
        head = (f"rank {s['rank']} is the slowest (speed {s['speed']:g}, {s['compute_ms']:.1f} ms of compute per "
                f"step); {_ranks(view['waiting'])} waited {ms} per step on it (median)")
    if view["slowest_hop"] is not None:
        h = view["hops"][view["slowest_hop"]]
        head += (f"; slowest hop {h['src']} -> {h['dst']} ({h['gbps']:g} Gbit/s, {h['delay_ms']:g} ms, "
                 f"{h['ms']:.1f} ms a ring step)")
    return head
