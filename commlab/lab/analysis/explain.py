"""Why a step took the time it took: its critical path, what each collective waited for, who straggled, and
what a change would buy. Reads a timeline frame (``Run.timeline()``'s schema, or a profiler trace read by
commlab.lab.analysis.kineto) after the fact or beside a live run; it costs the run nothing.

The critical path of a step follows the training thread, which runs forward, backward, the codec's encode
and decode, and the optimizer one after another. Where that thread waits on a collective (a ``wait`` span),
the path moves to the communication thread: the collective that was running then, the one waited for or one
queued ahead of it; a wait with no collective running is left as ``other``. At each instant the innermost
span names the path (a wait, then encode or decode, then a layer's own span, then the phase), so the path's
parts add up to the step exactly. It does not see dependencies the timeline does not record (a GPU stream's
queue, a lock inside the framework); what it cannot place is ``other``.

Each collective is split into

- skew: waiting for the last peer to arrive (the latest start over the ranks minus this rank's start; ranks
  on one machine share a clock, across machines their clocks must agree to well under a collective);
- latency: the link's latency times the algorithm's rounds (known for a modeled link; unknown otherwise);
- wire: the bytes a rank sends over the link's rate (a ring: 2(n-1)/n of the payload for an all-reduce,
  (n-1) payloads for an all-gather), with its algorithm and bus bandwidth against the link's; unknown on
  loopback, whose rate is not the lab's to know;
- the rest: the library's own work, copies and contention.

On the path, a collective's skew is counted first (a rank waits for its peers before bytes move).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

from commlab.lab.rundir.summary import warmup_steps

GROUPS = ("compute", "encode", "decode", "skew", "latency", "wire", "comm_rest", "sync", "other")
"""The parts of a step on its critical path, in ms; they add up to the step."""
WORDS = {"compute": "compute (forward, backward, optimizer)", "encode": "the codec's encode",
         "decode": "the codec's decode", "skew": "waiting for peers in collectives (skew)",
         "latency": "the link's latency", "wire": "bytes on the wire", "comm_rest": "collectives' own overhead",
         "sync": "a method's own exchanges", "other": "framework overhead and gaps"}
COMM_GROUPS = ("skew", "latency", "wire", "comm_rest")
RANK = {"wait": 5, "outer": 4, "compress": 3, "decompress": 3, "layer": 2, "forward": 1, "backward": 1,
        "optimizer": 1, "tune": 1}
"""Which training-thread span names an instant of the path: the innermost (highest) one."""
TRAIN_LANES = ("forward", "backward", "optimizer", "compress", "decompress", "wait", "outer", "tune")
COMM_LANES = ("comm",)
STRAGGLER_SHARE = 0.15
"""A rank whose compute exceeds the fastest rank's by this share of the step (and 1 ms) is named a straggler."""


def ring_factor(op: str, n: int) -> Tuple[float, int]:
    """(bytes a rank sends per byte of its payload, latency rounds) of collective ``op`` over ``n`` ranks."""
    op = (op or "").replace("_", "").replace(" ", "").lower()
    if n <= 1:
        return 0.0, 0
    if "allreduce" in op:
        return 2.0 * (n - 1) / n, 2 * (n - 1)
    if "allgather" in op:
        return float(n - 1), n - 1
    if "reducescatter" in op:
        return (n - 1) / n, n - 1
    if "alltoall" in op:
        return (n - 1) / n, n - 1
    if "broadcast" in op or "reduce" in op:
        return 1.0, 1
    return 1.0, 1


@dataclass
class Link:
    gbps: Optional[float] = None
    """The link's rate per rank, Gbit/s (None: not known, e.g. loopback)."""
    latency_us: Optional[float] = None
    """One message's latency (None: not known)."""
    world: int = 2

    @classmethod
    def of_spec(cls, spec: Optional[dict], world: int) -> "Link":
        net = (spec or {}).get("network") or {}
        link = net.get("link", "loopback")
        gbps = net.get("gbps") if link in ("shaped", "modeled") else None
        lat = net.get("latency_us") if link == "modeled" else None
        if link == "modeled" and lat is None:
            lat = 0.0
        return cls(gbps, lat, world)


@dataclass
class Collective:
    rank: int
    step: int
    index: int
    """Its place among the step's collectives on this rank: the same index is the same collective on every rank."""
    name: str
    op: str
    start_us: float
    dur_us: float
    bytes: Optional[float]
    skew_us: float = 0.0
    latency_us: Optional[float] = None
    wire_us: Optional[float] = None
    on_path_us: float = 0.0

    def split_on_path(self) -> Dict[str, float]:
        """Its time on the critical path in the collective's parts, µs. The path holds its last ``on_path_us``;
        skew is its first part (a rank waits for its peers before bytes move); latency, wire and the rest share
        what follows in proportion (their order inside a collective is not recorded)."""
        return self.split(self.on_path_us)

    def split(self, left: Optional[float] = None) -> Dict[str, float]:
        """Its last ``left`` µs (default: all of it) in its parts: skew, then latency, wire and the rest. Where
        the link's model asks more time than moved after the skew (a modeled link pads a collective to its
        model's time counted from its start, waits for peers included), latency and wire are scaled down to
        what there was, so the parts add up to the collective."""
        out = dict.fromkeys(COMM_GROUPS, 0.0)
        left = min(self.dur_us if left is None else left, self.dur_us)
        if left <= 0:
            return out
        out["skew"] = max(0.0, self.skew_us - (self.dur_us - left))
        moving = self.dur_us - self.skew_us
        rest = left - out["skew"]
        if rest <= 0 or moving <= 0:
            return out
        lat, wire = self.latency_us or 0.0, self.wire_us or 0.0
        scale = min(1.0, moving / (lat + wire)) if lat + wire > 0 else 1.0  # a model above the measured time
        f = rest / moving
        out["latency"], out["wire"] = lat * scale * f, wire * scale * f
        out["comm_rest"] = max(0.0, rest - out["latency"] - out["wire"])
        return out


@dataclass
class StepPath:
    rank: int
    step: int
    start_us: float
    dur_us: float
    parts: Dict[str, float]
    """µs per group on the critical path (GROUPS); they add up to ``dur_us``."""
    segments: List[Tuple[float, float, str, str]] = field(default_factory=list)
    """(start µs, end µs, group, name) along the path, in time order."""
    compute_us: float = 0.0
    """This rank's compute in the step, on the path or not."""
    codec_off_us: float = 0.0
    comm_hidden_us: float = 0.0


# --------------------------------------------------------------------------- one step's path

def _intervals(spans: Sequence[Tuple[float, float, int, str, str, object]], w0: float, w1: float):
    """Cut [w0, w1] into pieces named by the highest-ranked span covering each (the latest to start among
    equals): [(a, b, span or None)]. A sweep over the spans' ends: each piece looks only at the spans open then."""
    edges = []
    for k, s in enumerate(spans):
        a, b = max(s[0], w0), min(s[1], w1)
        if b > a:
            edges.append((a, 1, k))
            edges.append((b, 0, k))
    edges.sort()
    out: list = []
    open_: set = set()
    t = w0
    i = 0
    while i <= len(edges):
        nxt = edges[i][0] if i < len(edges) else w1
        if nxt > t:
            best = None
            for k in open_:
                s = spans[k]
                if best is None or s[2] > best[2] or (s[2] == best[2] and s[0] > best[0]):
                    best = s
            if out and out[-1][2] is best:
                out[-1] = (out[-1][0], nxt, best)
            else:
                out.append((t, nxt, best))
            t = nxt
        if i == len(edges):
            break
        x = edges[i][0]
        while i < len(edges) and edges[i][0] == x:  # every edge at this instant before the next piece
            _, opening, k = edges[i]
            (open_.add if opening else open_.discard)(k)
            i += 1
    return out


def _group_of(lane: str) -> str:
    return {"compress": "encode", "decompress": "decode", "outer": "sync"}.get(lane, "compute")


def step_path(train: list, comms: List[Collective], rank: int, step: int, w0: float, w1: float) -> StepPath:
    """The critical path of one step of one rank. ``train``: its training-thread spans (start, end, rank, lane,
    name, args) in the window; ``comms``: its collectives in the window."""
    parts = dict.fromkeys(GROUPS, 0.0)
    segs: List[Tuple[float, float, str, str]] = []
    for a, b, s in _intervals(train, w0, w1):
        lane, name = (s[3], s[4]) if s is not None else ("", "gap")
        if s is not None and lane != "wait":
            g = _group_of(lane)
            parts[g] += b - a
            segs.append((a, b, g, name))
            continue
        # waiting, or nothing recorded on the training thread (a GPU stream's gap): the path is the collective
        # running then (the one waited for, or one queued ahead of it); with none, the rest is ``other``
        t = a
        for c in comms:
            c0, c1 = c.start_us, c.start_us + c.dur_us
            if c1 <= t or c0 >= b:
                continue
            if c0 > t:
                parts["other"] += c0 - t
                segs.append((t, c0, "other", name))
                t = c0
            e = min(c1, b)
            c.on_path_us += e - t
            segs.append((t, e, "comm", c.name))
            t = e
            if t >= b:
                break
        if t < b:
            parts["other"] += b - t
            segs.append((t, b, "other", name))
    for c in comms:
        for g, v in c.split_on_path().items():
            parts[g] += v
    sp = StepPath(rank, step, w0, w1 - w0, parts, segs)
    comp = [(s[0], s[1]) for s in train if s[3] in ("forward", "backward", "optimizer")]
    hooks = [(s[0], s[1]) for s in train if s[3] in ("compress", "decompress")]
    sp.compute_us = _length(_merge(comp)) - _length(_intersect(_merge(comp), _merge(hooks)))
    sp.codec_off_us = 0.0  # the codec runs on the training thread here: all of it is on the path
    busy = _merge(comp + hooks)
    sp.comm_hidden_us = _length(_intersect(_merge([(c.start_us, c.start_us + c.dur_us) for c in comms]), busy))
    return sp


def _merge(iv: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[List[float]] = []
    for a, b in sorted(iv):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return float(sum(b - a for a, b in iv))


def _intersect(x, y) -> List[Tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


# --------------------------------------------------------------------------- a run

@dataclass
class Explanation:
    steps: Tuple[int, int]
    """The first and last step explained."""
    ranks: List[int]
    step_ms: float
    """The mean step over the explained steps and ranks: the parts add up to it."""
    path_ms: Dict[str, float]
    """Mean ms per step on the critical path, by group (GROUPS)."""
    hidden_comm_ms: float
    """Communication that ran while the training thread computed or coded: off the path."""
    collectives: List[dict]
    """Per collective of a step (by its index), means over the explained steps and ranks."""
    ranks_ms: List[dict]
    """Per rank: mean step, compute and skew in ms, and how far its compute is behind the fastest rank's."""
    layers: List[dict]
    """Per layer (where spans name layers): mean forward+backward ms per rank, and the spread across ranks."""
    link: dict
    waterfall: List[dict]
    """The median step of the slowest rank, along its path: label, group, start_ms (from the step's start), ms."""
    sentences: List[str]
    straggler: Optional[int] = None

    @property
    def bound(self) -> str:
        return "straggler" if self.straggler is not None else max(self.path_ms, key=self.path_ms.get)

    def to_dict(self) -> dict:
        return {"steps": list(self.steps), "ranks": self.ranks, "step_ms": self.step_ms, "bound": self.bound,
                "path_ms": self.path_ms, "hidden_comm_ms": self.hidden_comm_ms, "collectives": self.collectives,
                "ranks_ms": self.ranks_ms, "layers": self.layers, "link": self.link, "straggler": self.straggler,
                "waterfall": self.waterfall, "sentences": self.sentences}


class NothingToExplain(ValueError):
    """The frame holds no finished step to explain."""


def explain_frame(tl: pd.DataFrame, spec: Optional[dict] = None, steps: Optional[Tuple[int, int]] = None,
                  skip_warmup: bool = True) -> Explanation:
    """The explanation of the steps in ``tl`` (a timeline frame), ``steps`` (first, last) or all after the
    run's warm-up (commlab.lab.rundir.summary.warmup_steps of the steps up to the frame's last). ``spec``: the run's spec dict (its network and world size), when known."""
    if tl is None or tl.empty or "lane" not in tl:
        raise NothingToExplain("no timeline spans: nothing to explain yet")
    cols = ["rank", "lane", "name", "start_us", "dur_us"]
    extra = [c for c in ("step", "bucket", "op", "bytes", "layer") if c in tl]
    df = tl[cols + extra]
    df = df[df["lane"].isin(("step",) + TRAIN_LANES + COMM_LANES)]
    stepspans = df[df["lane"] == "step"]
    if stepspans.empty:
        raise NothingToExplain("no finished step in the timeline: nothing to explain yet")
    nums = (stepspans["step"] if "step" in stepspans and stepspans["step"].notna().all()
            else stepspans["name"].str.extract(r"(\d+)$")[0].astype(float))
    stepspans = stepspans.assign(num=nums.astype(int).to_numpy())
    done = sorted(set(stepspans["num"]))
    if steps is not None:
        lo, hi = steps
    else:
        lo, hi = done[0], done[-1]
        if skip_warmup and len(done) > 1:  # steps count from 0: the run's warm-up, whatever part the frame holds
            lo = max(lo, min(warmup_steps(done[-1] + 1), hi))
    chosen = stepspans[(stepspans["num"] >= lo) & (stepspans["num"] <= hi)]
    if chosen.empty:
        raise NothingToExplain(f"steps: no finished step in {lo}..{hi}; the timeline has {done[0]}..{done[-1]}")
    ranks = sorted(int(r) for r in chosen["rank"].unique())
    world = int((spec or {}).get("world_size") or len(ranks) or 1)
    link = Link.of_spec(spec, world)

    # each rank's spans, sorted by start, cut into the chosen steps' windows
    rows = {r: g.sort_values("start_us") for r, g in df[df["lane"] != "step"].groupby("rank")}
    paths: List[StepPath] = []
    comms_by: Dict[Tuple[int, int], List[Collective]] = {}
    layer_ms: Dict[Tuple[str, int], List[float]] = {}
    for r in ranks:
        g = rows.get(r)
        win = chosen[chosen["rank"] == r].sort_values("start_us")
        if g is None:
            g = df.iloc[0:0]
        starts = g["start_us"].to_numpy(float)
        ends = starts + g["dur_us"].to_numpy(float)
        lanes = g["lane"].to_numpy(object)
        names = g["name"].to_numpy(object)
        layer = g["layer"].to_numpy(object) if "layer" in g else np.full(len(g), None, object)
        ops = g["op"].to_numpy(object) if "op" in g else np.full(len(g), None, object)
        nbytes = g["bytes"].to_numpy(object) if "bytes" in g else np.full(len(g), None, object)
        for w0, d, num in zip(win["start_us"].to_numpy(float), win["dur_us"].to_numpy(float), win["num"]):
            w1 = w0 + d
            i0 = int(np.searchsorted(starts, w0 - 1.0, side="left"))
            i1 = int(np.searchsorted(starts, w1, side="left"))
            train, comms = [], []
            for i in range(i0, i1):
                lane = lanes[i]
                if lane in COMM_LANES:
                    b = nbytes[i]
                    comms.append(Collective(r, int(num), len(comms), str(names[i]), str(ops[i] or names[i]),
                                            float(starts[i]), float(ends[i] - starts[i]),
                                            float(b) if b is not None and b == b else None))
                    continue
                if lane == "wait" and isinstance(ops[i], str) and ops[i]:  # a collective the training thread runs
                    comms.append(Collective(r, int(num), len(comms), str(names[i]), str(ops[i]), float(starts[i]),
                                            float(ends[i] - starts[i]), None))
                lay = layer[i]
                has_layer = isinstance(lay, str) and lay
                rank_ = RANK["layer"] if has_layer and lane in ("forward", "backward") else RANK.get(lane, 1)
                train.append((float(starts[i]), float(ends[i]), rank_, lane, str(names[i]), None))
                if has_layer and lane in ("forward", "backward"):
                    layer_ms.setdefault((lay, r), []).append((ends[i] - starts[i]) / 1e3)
            comms_by[(r, int(num))] = comms
            paths.append((r, int(num), w0, w1, train, comms))
    # skew: the same collective (its index in the step) on every rank
    for key, comms in comms_by.items():
        r, num = key
        for c in comms:
            peers = [comms_by.get((q, num), []) for q in ranks]
            arrivals = [p[c.index].start_us for p in peers if len(p) > c.index and p[c.index].op == c.op]
            if len(arrivals) > 1:
                c.skew_us = min(max(0.0, max(arrivals) - c.start_us), c.dur_us)
            factor, rounds = ring_factor(c.op, world)
            if link.gbps and c.bytes is not None:
                c.wire_us = c.bytes * factor * 8 / (link.gbps * 1e3)
            if link.latency_us is not None:
                c.latency_us = link.latency_us * rounds
    explained = [step_path(train, comms, r, num, w0, w1) for r, num, w0, w1, train, comms in paths]
    return _summarize(explained, comms_by, layer_ms, ranks, link, (lo, hi))


def _summarize(paths: List[StepPath], comms_by, layer_ms, ranks, link: Link, steps) -> Explanation:
    n = len(paths)
    step_ms = sum(p.dur_us for p in paths) / n / 1e3
    path_ms = {g: sum(p.parts[g] for p in paths) / n / 1e3 for g in GROUPS}
    hidden = sum(p.comm_hidden_us for p in paths) / n / 1e3
    # collectives by index: means over steps and ranks
    by_index: Dict[int, List[Collective]] = {}
    for comms in comms_by.values():
        for c in comms:
            by_index.setdefault(c.index, []).append(c)
    colls = []
    for k in sorted(by_index):
        cs = by_index[k]
        m = len(cs)
        dur = sum(c.dur_us for c in cs) / m
        b = [c.bytes for c in cs if c.bytes is not None]
        mean_b = sum(b) / len(b) if b else None
        factor, _ = ring_factor(cs[0].op, link.world)
        split = [c.split() for c in cs]
        row = {"index": k, "name": cs[0].name, "op": cs[0].op, "bytes": mean_b, "ms": dur / 1e3,
               "skew_ms": sum(x["skew"] for x in split) / m / 1e3,
               "latency_ms": (sum(x["latency"] for x in split) / m / 1e3) if link.latency_us is not None else None,
               "wire_ms": (sum(x["wire"] for x in split) / m / 1e3) if link.gbps and mean_b is not None else None,
               "rest_ms": sum(x["comm_rest"] for x in split) / m / 1e3,
               "on_path_ms": sum(c.on_path_us for c in cs) / m / 1e3}
        if link.gbps and mean_b is not None:
            row["wire_model_ms"] = sum(c.wire_us or 0 for c in cs) / m / 1e3  # bytes over the rate, unscaled
        moving = dur - sum(c.skew_us for c in cs) / m
        if mean_b is not None and moving > 0:
            alg = mean_b * (link.world if "gather" in (cs[0].op or "").lower() else 1) * 8 / (moving * 1e3)
            row["algbw_gbps"] = alg
            row["busbw_gbps"] = mean_b * factor * 8 / (moving * 1e3)
        colls.append(row)
    # ranks: compute and skew
    per_rank = []
    for r in ranks:
        mine = [p for p in paths if p.rank == r]
        comp = sum(p.compute_us for p in mine) / len(mine) / 1e3
        per_rank.append({"rank": r, "step_ms": sum(p.dur_us for p in mine) / len(mine) / 1e3, "compute_ms": comp,
                         "skew_ms": sum(p.parts["skew"] for p in mine) / len(mine) / 1e3})
    fastest = min(x["compute_ms"] for x in per_rank)
    for x in per_rank:
        x["behind_ms"] = x["compute_ms"] - fastest
    slow = max(per_rank, key=lambda x: x["behind_ms"])
    straggler = None
    if len(per_rank) > 1 and slow["behind_ms"] > max(1.0, STRAGGLER_SHARE * step_ms):
        straggler = slow["rank"]
    # layers
    layers = []
    names = sorted({k[0] for k in layer_ms})
    for name in names:
        by_r = {r: float(np.mean(layer_ms[(name, r)])) for r in ranks if (name, r) in layer_ms}
        if by_r:
            layers.append({"layer": name, "ms_by_rank": by_r, "spread_ms": max(by_r.values()) - min(by_r.values())})
    layers.sort(key=lambda x: -x["spread_ms"])
    # the waterfall: the median step of the slowest rank
    slow_rank = max(per_rank, key=lambda x: x["step_ms"])["rank"]
    mine = sorted((p for p in paths if p.rank == slow_rank), key=lambda p: p.dur_us)
    med = mine[len(mine) // 2]
    fall = [{"label": name, "group": g, "start_ms": (a - med.start_us) / 1e3, "ms": (b - a) / 1e3}
            for a, b, g, name in med.segments if b - a > 0]
    ex = Explanation(steps=tuple(steps), ranks=list(ranks), step_ms=step_ms, path_ms=path_ms, hidden_comm_ms=hidden,
                     collectives=colls, ranks_ms=per_rank, layers=layers[:10],
                     link={"gbps": link.gbps, "latency_us": link.latency_us, "world": link.world},
                     waterfall=fall, sentences=[], straggler=straggler)
    ex.sentences = sentences(ex)
    return ex


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def sentences(ex: Explanation) -> List[str]:
    """A few plain sentences: what bounds the step and by how much, then what else matters."""
    out = []
    words = dict(WORDS)
    if ex.link.get("gbps") is None:
        words["comm_rest"] = "communication (moving the bytes and the library's work)"
    p, step = ex.path_ms, ex.step_ms
    comm = sum(p[g] for g in COMM_GROUPS)
    if ex.straggler is not None:
        r = next(x for x in ex.ranks_ms if x["rank"] == ex.straggler)
        waits = [x["skew_ms"] for x in ex.ranks_ms if x["rank"] != ex.straggler]
        out.append(f"Rank {ex.straggler} is a straggler: its compute takes {r['behind_ms']:.1f} ms more per step than "
                   f"the fastest rank's, and the other ranks wait {max(waits or [0]):.1f} ms per step for it in "
                   f"their collectives (skew).")
        if ex.layers and ex.layers[0]["spread_ms"] > 0.5 * r["behind_ms"] / max(1, len(ex.layers)):
            out.append(f"Its slowest layer against the other ranks is {ex.layers[0]['layer']} "
                       f"(+{ex.layers[0]['spread_ms']:.1f} ms).")
    bound = max(p, key=p.get)
    out.append(f"The step ({step:.1f} ms) is bound by {words[bound]}: {p[bound]:.1f} ms of it "
               f"({_pct(p[bound], step)}) on the critical path.")
    if bound not in COMM_GROUPS and comm > 0.05 * step:
        out.append(f"Communication on the critical path: {comm:.1f} ms ({_pct(comm, step)}): "
                   + ", ".join(f"{words[g]} {p[g]:.1f} ms" for g in COMM_GROUPS if p[g] > 0.005) + ".")
    elif bound in COMM_GROUPS:
        others = [g for g in COMM_GROUPS if g != bound and p[g] > 0.005]
        if others:
            out.append("The rest of its communication on the path: "
                       + ", ".join(f"{words[g]} {p[g]:.1f} ms" for g in others) + ".")
    codec = p["encode"] + p["decode"]
    if codec > 0.05 * step and bound not in ("encode", "decode"):
        out.append(f"The codec takes {codec:.1f} ms of the step on the critical path (encode {p['encode']:.1f}, "
                   f"decode {p['decode']:.1f}).")
    if ex.hidden_comm_ms > 0.5:
        out.append(f"{ex.hidden_comm_ms:.1f} ms of communication ran hidden behind compute and the codec.")
    if ex.link.get("gbps") is None:
        out.append("The link's rate is not known (loopback): collectives are split into skew and the rest, not "
                   "into latency and wire.")
    return out


def report_lines(ex: Explanation, title: str = "") -> List[str]:
    """The explanation as text: the sentences, the critical path's parts, the collectives' split."""
    out = []
    if title:
        out.append(f"run            {title}")
    out.append(f"steps          {ex.steps[0]}..{ex.steps[1]} on ranks {', '.join(map(str, ex.ranks))}; "
               f"mean step {ex.step_ms:.2f} ms")
    out += ["", *ex.sentences, "", "critical path  ms per step (share of the step)"]
    for g in GROUPS:
        if ex.path_ms[g] >= 0.005:
            out.append(f"  {g:<12} {ex.path_ms[g]:8.2f}  ({_pct(ex.path_ms[g], ex.step_ms)})")
    out.append(f"  {'hidden comm':<12} {ex.hidden_comm_ms:8.2f}  (off the path)")
    if ex.collectives:
        link = ex.link
        rate = (f"{link['gbps']:g} Gbit/s per rank" if link.get("gbps") else "rate not known (loopback)") + (
            f", latency {link['latency_us']:g} µs" if link.get("latency_us") is not None else "")
        out += ["", f"collectives    ms per step, means over steps and ranks; the link: {rate}"]
        out.append(f"  {'name':<20} {'bytes':>10} {'ms':>7} {'skew':>7} {'latency':>8} {'wire':>7} {'rest':>7} "
                   f"{'on path':>8} {'busbw Gb/s':>11}")
        def f(v, w):
            return f"{v:{w}.2f}" if v is not None else f"{'-':>{w}}"
        for c in ex.collectives:
            b = f"{c['bytes']:10.0f}" if c.get("bytes") is not None else f"{'-':>10}"
            out.append(f"  {c['name'][:20]:<20} {b} {f(c['ms'], 7)} {f(c['skew_ms'], 7)} {f(c['latency_ms'], 8)} "
                       f"{f(c['wire_ms'], 7)} {f(c['rest_ms'], 7)} {f(c['on_path_ms'], 8)} {f(c.get('busbw_gbps'), 11)}")
    if len(ex.ranks_ms) > 1:
        out += ["", "ranks          ms per step"]
        for x in ex.ranks_ms:
            out.append(f"  rank {x['rank']:<3} step {x['step_ms']:7.2f}  compute {x['compute_ms']:7.2f} "
                       f"(+{x['behind_ms']:.2f} behind the fastest)  skew {x['skew_ms']:6.2f}")
    return out


# --------------------------------------------------------------------------- two runs

SAME_MS = 0.05
"""Two runs' parts (and steps) closer than this, in ms per step, are not named as a difference."""


def compare(a: Explanation, b: Explanation, label_a: str = "A", label_b: str = "B") -> dict:
    """``b`` against ``a``, part by part: on the critical path (ms per step, b minus a) and off it, the net,
    sentences, and what would make the slower one pay (``break_even``)."""
    diff = {g: b.path_ms[g] - a.path_ms[g] for g in GROUPS}
    net = b.step_ms - a.step_ms
    parts = sorted((g for g in GROUPS if abs(diff[g]) >= SAME_MS), key=lambda g: -abs(diff[g]))
    faster, slower = (label_b, label_a) if net < 0 else (label_a, label_b)
    if abs(net) < SAME_MS:
        head = f"{label_b} and {label_a} take the same time per step ({b.step_ms:.1f} ms)"
    else:
        head = (f"{label_b} is {abs(net):.1f} ms per step {'slower' if net > 0 else 'faster'} than {label_a} "
                f"({b.step_ms:.1f} against {a.step_ms:.1f} ms)")
    said = [head + (": " + ", ".join(f"{WORDS[g]} {diff[g]:+.1f} ms" for g in parts[:4]) + " on the critical path."
                    if parts else f"; no part of the critical path differs by {SAME_MS} ms or more.")]
    hid = b.hidden_comm_ms - a.hidden_comm_ms
    if abs(hid) >= SAME_MS:
        said.append(f"Off the path, hidden communication {hid:+.1f} ms.")
    be = break_even(a, b, label_a, label_b)
    said += be.pop("sentences")
    return {"a": label_a, "b": label_b, "net_ms": net, "path_ms": diff, "hidden_comm_ms": hid, "faster": faster,
            "slower": slower, "break_even": be, "sentences": said}


def break_even(a: Explanation, b: Explanation, label_a: str = "A", label_b: str = "B") -> dict:
    """What would make the slower of two runs as fast as the other, from their own parts (a simple model: the
    codec's time scales with its speed, the wire time with 1 / the link's rate, all else stays): the codec
    speed-up, the link rate, and the gain if its exposed communication were hidden."""
    slow, fast, name = (b, a, label_b) if b.step_ms >= a.step_ms else (a, b, label_a)
    gap = slow.step_ms - fast.step_ms
    out: dict = {"gap_ms": gap, "slower": name, "sentences": []}
    if gap <= 0:
        return out
    codec = slow.path_ms["encode"] + slow.path_ms["decode"]
    fast_codec = fast.path_ms["encode"] + fast.path_ms["decode"]
    if codec > fast_codec:
        need = codec - gap
        if need > 0:
            out["codec_speedup"] = codec / need
            out["sentences"].append(f"{name}'s codec would have to be {codec / need:.1f}x faster to break even "
                                    f"({codec:.1f} ms on the path now).")
        else:
            out["codec_speedup"] = math.inf
            out["sentences"].append(f"Even a codec that took no time would not make {name} break even: its codec is "
                                    f"{codec:.1f} ms of a {gap:.1f} ms gap.")
    wire_s, wire_f = slow.path_ms["wire"], fast.path_ms["wire"]
    rate = slow.link.get("gbps")
    if rate and (wire_s or wire_f):
        fixed_s, fixed_f = slow.step_ms - wire_s, fast.step_ms - wire_f
        # step(r) = fixed + wire * rate / r for both; equal where r = rate * (wire_s - wire_f) / (fixed_f - fixed_s)
        if fixed_f > fixed_s and wire_s > wire_f:
            r = rate * (wire_s - wire_f) / (fixed_f - fixed_s)
            out["link_gbps"] = r
            out["sentences"].append(f"On a link of {r:.3g} Gbit/s or more {name} would break even (now {rate:g}).")
        elif fixed_s > fixed_f and wire_f > wire_s:
            r = rate * (wire_f - wire_s) / (fixed_s - fixed_f)
            out["link_gbps"] = r
            out["sentences"].append(f"On a link of {r:.3g} Gbit/s or less {name} would break even (now {rate:g}).")
    exposed = sum(slow.path_ms[g] for g in COMM_GROUPS)
    out["hidden_gain_ms"] = exposed
    if exposed > 0.05:
        out["sentences"].append(f"Hiding {name}'s exposed communication would save up to {exposed:.1f} ms per step"
                                f"{' (enough to break even)' if exposed >= gap else ''}.")
    return out


# --------------------------------------------------------------------------- runs

def explain_run(run, steps: Optional[Tuple[int, int]] = None) -> Explanation:
    """``run``'s explanation (a commlab.lab.rundir.store.Run): ``steps`` (first, last), or all after its warm-up
    (the pages explain the last steps: commlab.lab.analysis.timelines.run_explanation)."""
    return explain_frame(run.timeline(), run.spec_dict(), steps=steps)
