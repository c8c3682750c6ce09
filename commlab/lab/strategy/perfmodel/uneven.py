"""A cluster of unequal workers in the performance model (``network.cluster``, commlab/engine/cluster.py): its ring
collectives (``ClusterRing``) and its slowest worker (``at_speed``).

The link. A collective on the cluster costs what the engine's modeled cluster link holds it to
(commlab.engine.netmodel.ClusterLink): the ring algorithm's steps (``netmodel.ring_steps``: all-reduce ``2(p-1)``
steps of ``n/p`` bytes, all-gather ``p-1`` of ``m``, reduce-scatter and all-to-all ``p-1`` of ``n/p``), each as
slow as its slowest hop. Hop i -> i+1 (mod p) moves the step's chunk ``c`` over the slower of the sender's up-link
and the receiver's down-link and crosses both ends' one-way delays::

    hop_i = c * 8 / (min(up_i, down_{i+1}) * 1e9) + (delay_i + delay_{i+1}) / 1e3 + e_i      seconds
    T     = steps * E[max_i hop_i]

Jitter: ``e_i = (u * jitter_i + v * jitter_{i+1}) / 1e3`` with u, v uniform in [-1, 1], drawn anew for every hop
of every step, and a hop's delay never below 0 (as the engine draws it). The model takes each step's *expected
maximum* over its hops, not the hops' mean: the mean jitter is 0, and pricing each hop at its mean would put
every step at the slowest hop without jitter, which the draws of the hops near it can only lengthen. The
expectation is exact up to quadrature: ``E[max] = L + integral from L to H of (1 - prod_i F_i(x)) dx``, F_i the
distribution of hop i (its two uniforms' sum is a trapezoid), L the largest of the hops' shortest times and H
the largest of their longest. Without jitter it is the engine's time exactly, ``steps * max_i hop_i``; with
equal workers (rate B, delay d) it is the uniform link's alpha-beta time at B with ``alpha = 2 d``.

Every ring step pays its slowest hop's delays, so an all-reduce on p workers pays ``2(p-1)`` of them per call.
A strategy that exchanges gradients every step pays them for every bucket of every step; a method that
syncs every H steps pays them once per sync. Nothing special does that: it is what the collectives cost.

The compute. Every collective waits for every rank, so a synchronous step lasts as long as the slowest
worker's compute; a method's inner steps run at each worker's own pace, but its sync waits for the slowest,
so a period of H steps costs H times the slowest worker's compute plus the sync. ``at_speed`` is the profile
as the slowest worker computes: forward and backward, and each layer's share of them, stretched to 1/speed
(as the engine's slow worker stretches them, commlab.engine.stepper's ``slow_down``; the optimizer step and
the codecs run at the machine's pace there, and here). Where the engine emulates a slow worker, it issues
wfbp's buckets as fast as the machine computes and waits at the end of backward; the model issues them as a
slower machine would, at the stretched layer times.

Assumptions: the hops of a step are independent (no shared bottleneck in the wide-area core); no regions (two
workers are ``delay_i + delay_j`` apart even in one place, as in the engine); the ring runs in rank order;
collectives queue on the cluster one after the other, as on one link. Pure arithmetic: no torch.
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

from commlab.engine import netmodel

GAUSS_POINTS = 24
"""Gauss-Legendre points per piece of the jitter integral (between two of the hops' distributions' kinks)."""


@lru_cache(maxsize=None)
def _gauss(n: int) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Gauss-Legendre nodes and weights on [-1, 1] (Newton's iteration on the Legendre polynomial; no numpy)."""
    xs, ws = [], []
    for i in range(1, n + 1):
        x = math.cos(math.pi * (i - 0.25) / (n + 0.5))
        for _ in range(100):
            p0, p1 = 1.0, x
            for k in range(2, n + 1):
                p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
            dp = n * (x * p1 - p0) / (x * x - 1)
            dx = p1 / dp
            x -= dx
            if abs(dx) < 1e-15:
                break
        xs.append(x)
        ws.append(2 / ((1 - x * x) * dp * dp))
    return tuple(xs), tuple(ws)


def sum_cdf(s: float, a: float, b: float) -> float:
    """P(a u + b v <= s) for u, v uniform in [-1, 1] and 0 <= a <= b: a trapezoid's distribution."""
    if b == 0:
        return 1.0 if s >= 0 else 0.0
    if s <= -(a + b):
        return 0.0
    if s >= a + b:
        return 1.0
    if a == 0:
        return (s + b) / (2 * b)
    if s <= a - b:
        return (s + a + b) ** 2 / (8 * a * b)
    if s <= b - a:
        return a / (2 * b) + (s + b - a) / (2 * b)
    return 1 - (a + b - s) ** 2 / (8 * a * b)


@dataclasses.dataclass(frozen=True)
class Hop:
    """One hop's time without its wire part: delay ``d`` (both ends', seconds) and jitter ``a <= b`` (seconds)."""
    d: float
    a: float
    b: float

    def cdf(self, y: float) -> float:
        """P(the hop's delay, never below 0, <= y)."""
        return 0.0 if y < 0 else sum_cdf(y - self.d, self.a, self.b)

    def bounds(self) -> Tuple[float, float]:
        return max(self.d - self.a - self.b, 0.0), self.d + self.a + self.b

    def kinks(self) -> List[float]:
        return [0.0] + [self.d + k for k in (-(self.a + self.b), self.a - self.b, self.b - self.a, self.a + self.b)]


def expected_max(hops: Sequence[Tuple[float, "Hop", int]]) -> float:
    """E[max] over independent hops, each ``(wire seconds, Hop, how many alike)``: the time of one ring step."""
    lo = max(w + h.bounds()[0] for w, h, _ in hops)
    hi = max(w + h.bounds()[1] for w, h, _ in hops)
    if hi <= lo:
        return lo
    cuts = sorted({lo, hi} | {w + k for w, h, _ in hops for k in h.kinks() if lo < w + k < hi})
    xs, ws = _gauss(GAUSS_POINTS)
    total = 0.0
    for x0, x1 in zip(cuts, cuts[1:]):
        half, mid = (x1 - x0) / 2, (x1 + x0) / 2
        for x, wt in zip(xs, ws):
            t = mid + half * x
            prod = 1.0
            for w, h, n in hops:
                prod *= h.cdf(t - w) ** n
                if prod == 0.0:
                    break
            total += wt * half * (1.0 - prod)
    return lo + total


def _get(w, k):
    return w[k] if isinstance(w, dict) else getattr(w, k)


class ClusterRing:
    """The ring collectives of a cluster of unequal workers (``workers``: one per rank, dicts or objects with
    ``gbps_up``, ``gbps_down``, ``delay_ms``, ``jitter_ms`` and ``speed``: spec.json's
    ``network.cluster.workers``), priced as the module docstring says. ``time(op, nbytes, world)`` is what
    commlab.lab.strategy.perfmodel.costs.collective asks of a link that prices its own collectives; ``preset``
    only names it."""

    burst_bytes = 0.0  # no token bucket: iteration.py and local.py read this of any link

    def __init__(self, workers: Sequence, preset: Optional[str] = None):
        if not workers:
            raise ValueError("a cluster needs at least one worker")
        self.workers = [{k: _get(w, k) for k in ("gbps_up", "gbps_down", "delay_ms", "jitter_ms", "speed")}
                        for w in workers]
        for i, w in enumerate(self.workers):
            if w["gbps_up"] is None or w["gbps_down"] is None:
                raise ValueError(f"worker {i} has no rate (a loopback cluster gives only speeds)")
        self.preset = preset
        self.p = len(self.workers)
        # rank i's hop to i+1, once per distinct (rate, delays, jitter): a preset's ranks in regions repeat them
        kinds: Dict[tuple, int] = {}
        for i in range(self.p):
            s, r = self.workers[i], self.workers[(i + 1) % self.p]
            rate = min(s["gbps_up"], r["gbps_down"])
            js = sorted((s["jitter_ms"] * 1e-3, r["jitter_ms"] * 1e-3))
            key = (rate, Hop((s["delay_ms"] + r["delay_ms"]) * 1e-3, js[0], js[1]))
            kinds[key] = kinds.get(key, 0) + 1
        self.hop_kinds = [(rate, hop, n) for (rate, hop), n in kinds.items()]
        self.jitter = any(h.b > 0 for _, h, _ in self.hop_kinds)
        self._steps: Dict[float, float] = {}

    def __repr__(self) -> str:
        return f"ClusterRing({self.p} workers{', ' + self.preset if self.preset else ''})"

    def step_s(self, chunk: float) -> float:
        """One ring step that moves ``chunk`` bytes per hop: its slowest hop (its expected slowest with
        jitter)."""
        got = self._steps.get(chunk)
        if got is None:
            hops = [(chunk * 8.0 / (rate * 1e9), hop, n) for rate, hop, n in self.hop_kinds]
            got = expected_max(hops) if self.jitter else max(w + h.d for w, h, _ in hops)
            if len(self._steps) > 4096:  # MergeComp's search prices many sizes: keep the latest few thousand
                self._steps.clear()
            self._steps[chunk] = got
        return got

    def time(self, op: str, nbytes: float, world: int) -> float:
        """Seconds of one ``op`` (allreduce, allgather, reduce_scatter; ``nbytes`` as commlab.engine.netmodel
        takes it) over the cluster's ``world`` ranks; 0 for one rank."""
        if world == 1:
            return 0.0
        if world != self.p:
            raise ValueError(f"this cluster has {self.p} workers, the collective {world} ranks")
        steps, chunk = netmodel.ring_steps(op, nbytes, world)
        return steps * self.step_s(chunk)

    @property
    def gbps(self) -> float:
        """The slowest hop's rate (Gbit/s)."""
        return min(rate for rate, _, _ in self.hop_kinds)

    @property
    def slowest_speed(self) -> float:
        return min(w["speed"] for w in self.workers)

    def summary(self) -> dict:
        """What the advice and the what-if table say of the cluster: the slowest hop of the ring, the largest
        delay, the longest a ring step's delays make it, the largest jitter and the slowest worker."""
        p, ws = self.p, self.workers
        rate = lambda i: min(ws[i]["gbps_up"], ws[(i + 1) % p]["gbps_down"])  # noqa: E731
        slow_hop = min(range(p), key=rate)
        far = max(range(p), key=lambda i: ws[i]["delay_ms"])
        step = max(range(p), key=lambda i: ws[i]["delay_ms"] + ws[(i + 1) % p]["delay_ms"])
        slow = min(range(p), key=lambda i: ws[i]["speed"])
        return {"preset": self.preset, "workers": p,
                "slowest_link_gbps": rate(slow_hop), "slowest_link": f"{slow_hop} -> {(slow_hop + 1) % p}",
                "largest_delay_ms": ws[far]["delay_ms"], "largest_delay_rank": far,
                "ring_step_delay_ms": ws[step]["delay_ms"] + ws[(step + 1) % p]["delay_ms"] if p > 1 else 0.0,
                "largest_jitter_ms": max(w["jitter_ms"] for w in ws),
                "slowest_speed": ws[slow]["speed"], "slowest_rank": slow}

    def describe(self) -> str:
        s = self.summary()
        name = f"cluster {s['preset']}" if s["preset"] else "cluster of the spec's workers"
        jitter = (f", jitter up to {s['largest_jitter_ms']:g} ms (each ring step: its expected slowest hop)"
                  if s["largest_jitter_ms"] else "")
        return (f"{name}, {s['workers']} workers: slowest link {s['slowest_link_gbps']:g} Gbit/s (hop "
                f"{s['slowest_link']}), largest delay {s['largest_delay_ms']:g} ms one way (rank "
                f"{s['largest_delay_rank']}), a ring step at least {s['ring_step_delay_ms']:g} ms of delays"
                f"{jitter}, slowest worker speed {s['slowest_speed']:g} (rank {s['slowest_rank']})")


def at_speed(profile, speed: float):
    """``profile`` as a worker of compute ``speed`` computes it: forward and backward, and each layer's share
    of them, divided by ``speed``; the optimizer step and the cost curves as measured. The same profile at
    speed 1; otherwise a copy that shares its cost curves and payloads (what predictions add to them, they add
    to the profile's)."""
    if speed >= 1.0:
        return profile
    f = 1.0 / speed
    return dataclasses.replace(profile, forward_s=profile.forward_s * f, backward_s=profile.backward_s * f,
                               layer_forward={k: v * f for k, v in profile.layer_forward.items()},
                               layer_ready={k: v * f for k, v in profile.layer_ready.items()},
                               layer_backward={k: v * f for k, v in profile.layer_backward.items()},
                               compressors=profile.compressors, payloads=profile.payloads)
