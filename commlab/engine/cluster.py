"""Clusters of unequal workers: each rank its own link (rate up and down, one-way delay, jitter) and compute speed.

The spec's ``network.cluster`` names a preset (``PRESETS``) or lists the workers; ``resolve`` checks it and expands
it to one ``Worker`` per rank, which ``spec.json`` holds as ``network.cluster.workers`` (so a run directory records
every number that decided its timings). ``workers(spec)`` reads that list back from a spec or a spec.json document.

What each field means:

- ``gbps_up``, ``gbps_down``: the worker's access link, Gbit/s, what it sends and what it receives.
- ``delay_ms``: the worker's one-way delay to the wide-area core, ms. Two workers are ``delay_i + delay_j`` apart
  (one way). The model has no regions: two workers in the same region are also ``2 x delay`` apart.
- ``jitter_ms``: the spread of that delay: each crossing draws ``delay + U(-jitter, +jitter)`` (never below 0).
- ``speed``: compute speed, 1.0 normal, 0.5 a machine half as fast (1/speed times the compute time). A worker
  can be slowed, not sped up: at most 1.

A modeled link (``commlab.engine.netmodel.ClusterLink``) uses all five; a shaped link (``commlab.lab.net.netns``)
the rates, with a ``tc tbf`` per direction; the Stepper (``commlab.engine.stepper``) the speed, on any link.

Pure Python: it imports neither torch nor the lab.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

MAX_GBPS = 400.0
"""The highest rate of a worker's link, as a uniform link's (commlab.engine.spec.MAX_GBPS)."""
MIN_GBPS = 0.001
MAX_DELAY_MS = 10_000.0
MIN_SPEED = 0.01
"""A worker at most 100 times slower than the machine it runs on."""

LINK_FIELDS = ("gbps_up", "gbps_down", "delay_ms", "jitter_ms")
FIELDS = LINK_FIELDS + ("speed",)
ENTRY_FIELDS = FIELDS + ("count",)
SECTION_FIELDS = ("preset", "workers")


class ClusterError(ValueError):
    """A bad cluster section: ``path`` (``network.cluster...``) and what is wrong with it, one line."""

    def __init__(self, path: str, msg: str):
        self.path, self.msg = path, msg
        super().__init__(f"{path}: {msg}")


@dataclass(frozen=True)
class Worker:
    """One rank's link and compute speed (the module's docstring says what each field means)."""
    gbps_up: Optional[float] = None
    """None only on a loopback link, which has no rate."""
    gbps_down: Optional[float] = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    speed: float = 1.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The presets: (what it stands for, where its figures come from, its workers). An entry without ``count`` in a
# list of one stands for every rank alike, so those presets fit any world size; the others have one worker per
# region and fit any world size of at least their regions (``_in_regions``: ranks in blocks, one region each).
PRESETS: Dict[str, dict] = {
    "datacenter": {
        "about": "one datacenter: 25 Gbit/s each way, 0.025 ms to the switch (0.05 ms between two workers)",
        "source": "cloud instances get 10-100 Gbit/s networking (25 Gbit/s is a common mid-size figure); round "
                  "trips inside one datacenter are about 0.1 ms",
        "workers": [{"gbps_up": 25.0, "gbps_down": 25.0, "delay_ms": 0.025, "jitter_ms": 0.0}],
    },
    "two_regions": {
        "about": "two workers in two regions of one continent: 1 Gbit/s each way, 30 ms apart one way",
        "source": "a single TCP flow between two cloud regions reaches about 1 Gbit/s; US east to US west "
                  "round trips are about 60-70 ms",
        "workers": [{"gbps_up": 1.0, "gbps_down": 1.0, "delay_ms": 15.0, "jitter_ms": 0.5},
                    {"gbps_up": 1.0, "gbps_down": 1.0, "delay_ms": 15.0, "jitter_ms": 0.5}],
    },
    "three_continents": {
        "about": "North America, Europe and Asia, the Asian worker on a slower link: 0.5 Gbit/s (0.1 up and 0.2 "
                 "down in Asia), 55-90 ms apart one way",
        "source": "transatlantic round trips are about 80-110 ms, Europe to Asia and the transpacific about "
                  "170-200 ms; long-haul TCP flows between continents reach some hundreds of Mbit/s",
        "workers": [{"gbps_up": 0.5, "gbps_down": 0.5, "delay_ms": 25.0, "jitter_ms": 1.0},
                    {"gbps_up": 0.5, "gbps_down": 0.5, "delay_ms": 30.0, "jitter_ms": 1.0},
                    {"gbps_up": 0.1, "gbps_down": 0.2, "delay_ms": 60.0, "jitter_ms": 3.0}],
    },
    "home_broadband": {
        "about": "home connections: 0.05 Gbit/s up, 0.3 down, 10 ms to the provider's core (20 ms between two "
                 "homes) with 2 ms of jitter",
        "source": "cable and fibre plans of about 300 Mbit/s down and tens of Mbit/s up; national broadband "
                  "measurements report 10-30 ms of latency and a few ms of jitter",
        "workers": [{"gbps_up": 0.05, "gbps_down": 0.3, "delay_ms": 10.0, "jitter_ms": 2.0}],
    },
}


def _number(where: str, v: Any, lo: float, hi: float, what: str, lo_open: bool = False) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise ClusterError(where, f"must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}] ({what}), got {v!r}")
    return float(v)


def _entries(section: dict, world: int, where: str) -> tuple:
    """The section's entries as written (a preset's or the workers list), and the preset's name or None."""
    unknown = sorted(set(section) - set(SECTION_FIELDS))
    if unknown:
        raise ClusterError(f"{where}.{unknown[0]}", f"unknown field; allowed: {', '.join(SECTION_FIELDS)}")
    preset = section.get("preset")
    given = section.get("workers")
    if preset is None and given is None:
        raise ClusterError(where, f"give a preset ({', '.join(PRESETS)}) or workers: [{{gbps_up, gbps_down, "
                                  f"delay_ms, jitter_ms, speed}}, ...]")
    if given is not None and (not isinstance(given, (list, tuple)) or not given):
        raise ClusterError(f"{where}.workers", f"must be a non-empty list of workers, got {given!r}")
    if preset is None:
        return list(given), None
    if preset not in PRESETS:
        raise ClusterError(f"{where}.preset" if "preset" in section else where,
                           f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    return [dict(e) for e in PRESETS[preset]["workers"]], preset


def _expand(entries: list, world: int, where: str, preset: Optional[str]) -> List[dict]:
    """One entry per rank: ``count`` repeats an entry; a list of one entry without count is every rank alike."""
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ClusterError(f"{where}[{i}]", f"must be a mapping like {{gbps_up: 1, gbps_down: 1, delay_ms: 30}}, "
                                               f"got {e!r}")
        unknown = sorted(set(e) - set(ENTRY_FIELDS))
        if unknown:
            raise ClusterError(f"{where}[{i}].{unknown[0]}", f"unknown field; allowed: {', '.join(ENTRY_FIELDS)}")
        c = e.get("count", 1)
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 1024:
            raise ClusterError(f"{where}[{i}].count", f"must be an integer in 1..1024 (ranks alike), got {c!r}")
    if len(entries) == 1 and "count" not in entries[0]:
        return [dict(entries[0]) for _ in range(world)]
    if preset is not None and world != len(entries):
        return _in_regions(entries, world, where, preset)
    out = [dict(e) for e in entries for _ in range(e.get("count", 1))]
    if len(out) != world:
        counts = "+".join(str(e.get("count", 1)) for e in entries)
        what = f"preset {preset} has {len(out)} workers" if preset else \
            f"{len(out)} workers (counts {counts})" if any("count" in e for e in entries) else f"{len(out)} workers"
        raise ClusterError(where if not preset else where.rpartition(".")[0],
                           f"{what} for world_size {world}; give one worker per rank (count repeats one), or a "
                           f"single entry without count for every rank alike" if not preset else
                           f"{what} for world_size {world}; set world_size {len(out)} or give workers")
    for e in out:
        e.pop("count", None)
    return out


def _in_regions(entries: list, world: int, where: str, preset: str) -> List[dict]:
    """A preset of one worker per region for ``world`` ranks: rank r in region ``r * regions // world`` (blocks of
    neighbouring ranks, the first regions taking one more when they do not divide evenly), so a ring crosses each
    region's border once each way. Needs at least one rank per region. Two ranks of one region are still
    ``delay_i + delay_j`` apart (the model has no regions): a ring step lasts as long as its slowest hop, which
    crosses a border, so a ring collective's time does not change."""
    n = len(entries)
    if world < n:
        raise ClusterError(where.rpartition(".")[0], f"preset {preset} has {n} regions for world_size {world}; set "
                                                     f"world_size {n} or more, or give workers")
    return [dict(entries[r * n // world]) for r in range(world)]


def resolve(section: Any, world: int, link: str, gbps: Optional[float] = None,
            where: str = "network.cluster") -> dict:
    """A cluster section checked and resolved for ``world`` ranks on ``link``: ``{"preset": name or None,
    "workers": [Worker.to_dict(), ...]}`` with one worker per rank, every field given (what spec.json holds).

    ``section``: a preset's name, ``{preset: name}``, ``{workers: [...]}``, or the resolved form itself (a preset
    given beside workers: they must be the preset's own). ``gbps`` (the uniform ``network.gbps``) is the rate of
    every worker that gives none. Raises ``ClusterError`` naming the field. On ``loopback`` workers give only
    ``speed``; on ``shaped`` no delay or jitter (tc tbf shapes rates only, and netem, which would delay packets,
    is not used: ``modeled`` models both)."""
    if isinstance(section, str):
        section = {"preset": section}
    if not isinstance(section, dict):
        raise ClusterError(where, f"must be a preset's name ({', '.join(PRESETS)}) or {{workers: [...]}}, "
                                  f"got {section!r}")
    entries, preset = _entries(section, world, where)
    wlist = f"{where}.workers"
    rows = _expand(entries, world, wlist, preset)
    if preset and section.get("workers") is not None:
        mine = resolve({"preset": preset}, world, link, gbps, where)["workers"]
        theirs = resolve({"workers": section["workers"]}, world, link, gbps, where)["workers"]
        if mine != theirs:
            raise ClusterError(wlist, f"differ from preset {preset}'s; give the preset or the workers, not both")
        return {"preset": preset, "workers": mine}
    out = []
    for r, e in enumerate(rows):
        at = f"{wlist}[{r}]"
        if link == "loopback":
            have = [k for k in LINK_FIELDS if e.get(k) not in (None, 0, 0.0)]
            if have:
                why = f"preset {preset} gives each worker's link" if preset else f"a loopback link has no {have[0]}"
                raise ClusterError(f"{at}.{have[0]}" if not preset else where,
                                   f"{why}; use network.link modeled (or shaped), or give loopback workers only "
                                   f"their speed")
        up, down = e.get("gbps_up", gbps), e.get("gbps_down", gbps)
        if link != "loopback":
            for key, v in (("gbps_up", up), ("gbps_down", down)):
                if v is None:
                    raise ClusterError(f"{at}.{key}", f"a {link} link needs each worker's rate: a number in "
                                                      f"[{MIN_GBPS:g}, {MAX_GBPS:g}] (Gbit/s), or network.gbps "
                                                      f"for every worker that gives none")
                _number(f"{at}.{key}", v, MIN_GBPS, MAX_GBPS, "Gbit/s")
        delay = _number(f"{at}.delay_ms", e.get("delay_ms", 0.0), 0.0, MAX_DELAY_MS, "ms one way")
        jitter = _number(f"{at}.jitter_ms", e.get("jitter_ms", 0.0), 0.0, MAX_DELAY_MS, "ms")
        speed = _number(f"{at}.speed", e.get("speed", 1.0), MIN_SPEED, 1.0,
                        "1 normal, 0.5 half as fast; a worker can be slowed, not sped up")
        if link == "shaped" and (delay or jitter):
            key = "delay_ms" if delay else "jitter_ms"
            given = f"preset {preset} gives {key} {delay if delay else jitter:g}" if preset else \
                f"{delay if delay else jitter:g} ms"
            raise ClusterError(f"{at}.{key}" if not preset else where,
                               f"{given}, but a shaped link cannot delay packets here (tc tbf shapes rates only; "
                               f"delay and jitter need netem, which the lab does not use); use network.link modeled")
        out.append(Worker(None if up is None else float(up), None if down is None else float(down),
                          delay, jitter, speed).to_dict())
    return {"preset": preset, "workers": out}


def workers(spec: Any) -> Optional[List[dict]]:
    """The resolved per-rank workers of a spec (a ``JobSpec``, or a spec.json document as a dict), each
    ``{gbps_up, gbps_down, delay_ms, jitter_ms, speed}``; None when the spec gives no cluster (a uniform link).
    For whatever reads a run's timings after it: the performance model, the advisor, the Live page."""
    net = spec.get("network") if isinstance(spec, dict) else getattr(spec, "network", None)
    if net is None:
        return None
    cl = net.get("cluster") if isinstance(net, dict) else getattr(net, "cluster", None)
    if not cl:
        return None
    return [dict(w) for w in cl["workers"]]


def speed_of(spec: Any, rank: int) -> float:
    """Rank ``rank``'s compute speed (1.0 without a cluster)."""
    ws = workers(spec)
    return 1.0 if ws is None else float(ws[rank]["speed"])
