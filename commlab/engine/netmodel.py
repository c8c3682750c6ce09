"""Alpha-beta cost of ring collectives, and a modeled link that holds a
collective until that time has passed.

A link of ``gbps`` gigabit/s moves ``beta = 8 / (gbps * 1e9)`` seconds per byte,
and every step of an algorithm pays a latency ``alpha = latency_us * 1e-6``
seconds. With ``p`` ranks (``world``) the ring algorithms cost:

- all-reduce of ``n`` bytes per rank: a reduce-scatter followed by an
  all-gather, ``2 (p - 1)`` steps, each rank sending (and receiving)
  ``2 (p - 1) / p * n`` bytes::

      T = 2 (p - 1) alpha + 2 (p - 1) / p * n * beta

- all-gather where every rank contributes ``m`` bytes (total ``p m``):
  ``p - 1`` steps, each rank sending ``(p - 1) / p * (p m) = (p - 1) m``::

      T = (p - 1) alpha + (p - 1) * m * beta

- reduce-scatter of ``n`` bytes per rank (each rank keeps ``n / p``): ``p - 1``
  steps, each rank sending ``(p - 1) / p * n`` bytes::

      T = (p - 1) alpha + (p - 1) / p * n * beta

A single rank moves nothing and costs 0. Links are full duplex and every rank
has its own link (as in the shaped cluster: a tbf on both directions of every
rank's veth), so a rank's sends and receives overlap.

``ModeledLink`` is what the engine uses for ``network: {link: modeled}``: after
a collective has really completed (on loopback, usually much sooner), the rank
sleeps until ``t_issue + duration`` so that the collective completes no
earlier than the model says. ``ClusterLink`` is its variant for a cluster of
unequal workers (``network.cluster``, commlab/engine/cluster.py): every rank its
own rates, delay and jitter. This module is pure Python: it imports neither
torch nor anything from commlab/lab/.
"""
from __future__ import annotations

import random
import time
from typing import Callable, List, Optional, Sequence

from commlab.engine.runlog import write_json_atomic

OPS = ("allreduce", "allgather", "reduce_scatter", "all_to_all")


def _check(nbytes: float, world: int, gbps: float, latency_us: float) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not gbps > 0:
        raise ValueError(f"gbps must be > 0, got {gbps}")
    if latency_us < 0:
        raise ValueError(f"latency_us must be >= 0, got {latency_us}")


def seconds_per_byte(gbps: float) -> float:
    """beta: 8 bits per byte over ``gbps * 1e9`` bits per second."""
    return 8.0 / (gbps * 1e9)


def ring_allreduce_s(nbytes: float, world: int, gbps: float, latency_us: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes`` per rank:
    ``2 (p-1) * alpha + 2 (p-1)/p * nbytes * beta`` seconds (0 for one rank)."""
    _check(nbytes, world, gbps, latency_us)
    p = world
    if p == 1:
        return 0.0
    return 2 * (p - 1) * latency_us * 1e-6 + 2 * (p - 1) / p * nbytes * seconds_per_byte(gbps)


def allgather_s(nbytes_per_rank: float, world: int, gbps: float, latency_us: float = 0.0) -> float:
    """Ring all-gather, each rank contributing ``nbytes_per_rank`` (m), total p*m:
    ``(p-1) * alpha + (p-1)/p * (p*m) * beta`` = ``(p-1) alpha + (p-1) m beta`` (0 for one rank)."""
    _check(nbytes_per_rank, world, gbps, latency_us)
    p = world
    if p == 1:
        return 0.0
    return (p - 1) * latency_us * 1e-6 + (p - 1) * nbytes_per_rank * seconds_per_byte(gbps)


def reduce_scatter_s(nbytes: float, world: int, gbps: float, latency_us: float = 0.0) -> float:
    """Ring reduce-scatter of ``nbytes`` per rank (each rank ends with nbytes/p):
    ``(p-1) * alpha + (p-1)/p * nbytes * beta`` seconds (0 for one rank)."""
    _check(nbytes, world, gbps, latency_us)
    p = world
    if p == 1:
        return 0.0
    return (p - 1) * latency_us * 1e-6 + (p - 1) / p * nbytes * seconds_per_byte(gbps)


def busbw_factor(op: str, world: int) -> float:
    """Bytes each rank puts on its link per byte of the op's ``nbytes`` argument
    (the "bus bandwidth" factor of nccl-tests): all-reduce 2(p-1)/p,
    reduce-scatter and all-to-all (p-1)/p, all-gather (p-1) (its nbytes is per rank)."""
    p = world
    if op == "allreduce":
        return 2 * (p - 1) / p
    if op in ("reduce_scatter", "all_to_all"):
        return (p - 1) / p
    if op == "allgather":
        return float(p - 1)
    raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(OPS)}")


_COST = {"allreduce": ring_allreduce_s, "allgather": allgather_s, "reduce_scatter": reduce_scatter_s,
         "all_to_all": reduce_scatter_s}
"""An all-to-all of nbytes per rank (dear's shard codecs) sends (p-1)/p of them, as a reduce-scatter does."""


class ModeledLink:
    """A link of ``gbps`` gigabit/s with ``latency_us`` per algorithm step.

    ``duration(op, nbytes, world)`` is the alpha-beta time of ``op``:
    ``allreduce``, ``reduce_scatter`` and ``all_to_all`` take the bytes of one rank's input,
    ``allgather`` the bytes each rank contributes (the padded size, when
    payloads are padded to a common size).

    ``issue(op, nbytes, world)`` is called when a collective is issued and
    returns its deadline on the engine's host clock (``time.perf_counter``).
    Collectives share the link first come, first served, as the ring
    algorithms of one process group do: one issued while another still holds
    the link starts when that one ends. ``hold_until(deadline)`` sleeps until
    then; call it after the real collective has been waited on, so the
    collective completes no earlier than the model says.

    ``hold(t_issue, op, nbytes, world)`` is the stateless variant: sleep until
    ``t_issue + duration``.
    """

    def __init__(self, gbps: float, latency_us: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        _check(0, 1, gbps, latency_us)
        self.gbps = float(gbps)
        self.latency_us = float(latency_us)
        self.clock = clock
        self.sleep = sleep
        self.busy_until = 0.0

    def __repr__(self) -> str:
        return f"ModeledLink(gbps={self.gbps:g}, latency_us={self.latency_us:g})"

    def duration(self, op: str, nbytes: int, world: int) -> float:
        try:
            f = _COST[op]
        except KeyError:
            raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(OPS)}") from None
        return f(nbytes, world, self.gbps, self.latency_us)

    def deadline(self, t_issue: float, op: str, nbytes: int, world: int) -> float:
        return t_issue + self.duration(op, nbytes, world)

    def issue(self, op: str, nbytes: int, world: int, t_issue: Optional[float] = None) -> float:
        """Book the link for a collective issued now (or at ``t_issue``); return when it completes."""
        t = self.clock() if t_issue is None else t_issue
        start = max(t, self.busy_until)
        self.busy_until = start + self._booked(op, nbytes, world)
        return self.busy_until

    def _booked(self, op: str, nbytes: int, world: int) -> float:
        """The duration ``issue`` books for the next collective (a ``ClusterLink`` draws its jitter here)."""
        return self.duration(op, nbytes, world)

    def reset(self) -> None:
        self.busy_until = 0.0

    def hold_until(self, deadline: float) -> float:
        """Sleep until the clock reads ``deadline``; return the seconds slept (0 if already past)."""
        t = self.clock()
        slept = 0.0
        while t < deadline:
            # time.sleep can return a little early; loop, so we are never early
            self.sleep(deadline - t)
            t2 = self.clock()
            slept += t2 - t
            t = t2
        return slept

    def hold(self, t_issue: float, op: str, nbytes: int, world: int) -> float:
        return self.hold_until(self.deadline(t_issue, op, nbytes, world))


def ring_steps(op: str, nbytes: float, world: int) -> tuple:
    """The ring algorithm of ``op`` on ``world`` ranks as (steps, bytes each rank sends per step): all-reduce
    ``(2 (p-1), n/p)``, all-gather ``(p-1, m)`` (m: each rank's contribution), reduce-scatter and all-to-all
    ``(p-1, n/p)``. ``steps * chunk`` is ``busbw_factor(op, p) * nbytes``."""
    p = world
    if op == "allreduce":
        return 2 * (p - 1), nbytes / p
    if op == "allgather":
        return p - 1, float(nbytes)
    if op in ("reduce_scatter", "all_to_all"):
        return p - 1, nbytes / p
    raise ValueError(f"unknown collective {op!r}; allowed: {', '.join(OPS)}")


class ClusterLink(ModeledLink):
    """A modeled link where every rank has its own link: ``workers[i]`` gives rank i's ``gbps_up``,
    ``gbps_down``, ``delay_ms`` (one way, to the wide-area core) and ``jitter_ms`` (objects with those attributes,
    or dicts: ``network.cluster.workers`` of a spec, commlab/engine/cluster.py).

    In a ring, rank i sends to rank i+1 (mod p) in every step, all hops at once, and a step ends when its slowest
    hop has delivered. Hop i -> i+1 moves the step's chunk ``c`` over the slower of the sender's up-link and the
    receiver's down-link, and crosses both ends' delays::

        hop_i = c * 8 / (min(up_i, down_{i+1}) * 1e9) + (delay_i + delay_{i+1}) / 1e3 + e_i      seconds
        step  = max_i hop_i
        T     = sum over the algorithm's steps of step      (steps and c: ``ring_steps``; 0 for one rank)

    ``e_i`` is the jitter: ``(u * jitter_i + v * jitter_{i+1}) / 1e3`` with u, v uniform in [-1, 1], drawn
    anew for every hop of every step, and the hop's delay never goes below 0. Without jitter every step costs
    the same, ``T = steps * max_i hop_i``. With equal workers (rate B, delay d) it is the uniform link's
    alpha-beta time with ``alpha = 2 d``.

    The draws come from ``random.Random`` seeded by ``seed`` (the run's) and the collective's sequence number on
    this link (0, 1, 2, ... in the order ``issue`` is called): the ranks issue the same collectives in the same
    order, so every rank computes the same durations, and a rerun the same again. ``duration(op, nbytes, world,
    seq)`` is the time of the collective numbered ``seq``.
    """

    def __init__(self, workers: Sequence, seed: int = 0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        get = lambda w, k: w[k] if isinstance(w, dict) else getattr(w, k)  # noqa: E731
        self.up = [float(get(w, "gbps_up")) for w in workers]
        self.down = [float(get(w, "gbps_down")) for w in workers]
        self.delay_s = [float(get(w, "delay_ms")) * 1e-3 for w in workers]
        self.jitter_s = [float(get(w, "jitter_ms")) * 1e-3 for w in workers]
        if not self.up:
            raise ValueError("a cluster needs at least one worker")
        for i, (u, d, dl, j) in enumerate(zip(self.up, self.down, self.delay_s, self.jitter_s)):
            _check(0, 1, u, 0.0)
            _check(0, 1, d, 0.0)
            if dl < 0 or j < 0:
                raise ValueError(f"worker {i}: delay_ms and jitter_ms must be >= 0, got {dl * 1e3:g}, {j * 1e3:g}")
        super().__init__(min(self.up + self.down), 0.0, clock=clock, sleep=sleep)
        self.seed = int(seed)
        self.seq = 0
        """The sequence number of the next collective ``issue`` books."""
        self.members: Optional[List[int]] = None
        """The workers in this step's ring, in ring order: under fault tolerance, the quorum's replica groups
        (commlab/engine/stepper.py sets it at each quorum); None: every worker."""

    def __repr__(self) -> str:
        return f"ClusterLink({len(self.up)} workers, slowest {self.gbps:g} Gbit/s, seed={self.seed})"

    def hops(self, chunk: float) -> list:
        """Each hop's time without jitter for a step that moves ``chunk`` bytes: ``hops(c)[i]`` is i -> i+1."""
        p = len(self.up)
        return [chunk * 8.0 / (min(self.up[i], self.down[(i + 1) % p]) * 1e9)
                + self.delay_s[i] + self.delay_s[(i + 1) % p] for i in range(p)]

    def duration(self, op: str, nbytes: int, world: int, seq: int = 0) -> float:
        """The collective's time over the ring of ``members`` (every worker when None). Under fault tolerance the
        ring is the quorum's: a smaller quorum's ring skips the workers that are gone."""
        ring = range(len(self.up)) if self.members is None else self.members
        up, down = [self.up[w] for w in ring], [self.down[w] for w in ring]
        d, j = [self.delay_s[w] for w in ring], [self.jitter_s[w] for w in ring]
        p = len(up)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        steps, chunk = ring_steps(op, nbytes, world)
        if world == 1:
            return 0.0
        if world != p:
            raise ValueError(f"this cluster's ring has {p} workers, the collective {world} ranks")
        wire = [chunk * 8.0 / (min(up[i], down[(i + 1) % p]) * 1e9) for i in range(p)]
        if not any(j):
            return steps * max(wire[i] + d[i] + d[(i + 1) % p] for i in range(p))
        rng = random.Random(self.seed * 1_000_003 + seq)
        total = 0.0
        for _ in range(steps):
            slowest = 0.0
            for i in range(p):
                k = (i + 1) % p
                lat = d[i] + d[k] + rng.uniform(-1.0, 1.0) * j[i] + rng.uniform(-1.0, 1.0) * j[k]
                slowest = max(slowest, wire[i] + max(lat, 0.0))
            total += slowest
        return total

    def _booked(self, op: str, nbytes: int, world: int) -> float:
        seq, self.seq = self.seq, self.seq + 1
        return self.duration(op, nbytes, world, seq)

    def reset(self) -> None:
        super().reset()
        self.seq = 0


def from_spec(network, seed: int = 0) -> Optional[ModeledLink]:
    """A ModeledLink for a ``network`` spec section with ``link == "modeled"``
    (an object with attributes or a dict), else None: a ``ClusterLink`` (its jitter seeded by ``seed``, the
    run's) when the section gives a cluster."""
    get = network.get if isinstance(network, dict) else (lambda k, d=None: getattr(network, k, d))
    if get("link") != "modeled":
        return None
    cluster = get("cluster")
    if cluster:
        return ClusterLink(cluster["workers"], seed)
    gbps = get("gbps")
    if gbps is None:
        raise ValueError("network.gbps is required for a modeled link")
    return ModeledLink(gbps, get("latency_us") or 0.0)


# --------------------------------------------------------------------------
# A measuring worker, run as a torchrun node (e.g. by commlab.lab.net.netcheck.net_check):
#   python -m commlab.engine.netmodel allreduce --bytes N[,N...] --iters K[,K...] --out FILE
# For each size in turn (one process group for all: each rank imports torch once), it times K
# all-reduces of an fp32 tensor of N bytes after one warm-up, and rank 0 writes
# {"results": [{"times": [...], "nbytes": N, "world": p, ...}, ...]} as JSON to FILE.

def _measure_main(argv=None) -> int:
    import argparse
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist


    ap = argparse.ArgumentParser(prog="python -m commlab.engine.netmodel")
    ap.add_argument("op", choices=["allreduce"])
    ap.add_argument("--bytes", required=True, help="N or N,N,...: the sizes, measured in this order")
    ap.add_argument("--iters", default="5", help="K (every size) or K,K,... (one per size)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.bytes.split(",")]
    iters = [int(x) for x in a.iters.split(",")]
    if len(iters) == 1:
        iters *= len(sizes)
    if len(iters) != len(sizes):
        ap.error(f"--iters: one count, or one per size ({len(sizes)}), got {len(iters)}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        results = []
        for nbytes, k in zip(sizes, iters):
            t = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)  # warm-up: connections, buffers, TCP ramp-up
            warm = time.perf_counter() - t0
            dist.barrier()
            times = []
            for _ in range(k):
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            ok = bool(torch.all(t == float(world) ** (k + 1)).item())
            results.append({"op": a.op, "nbytes": t.numel() * 4, "world": world, "times": times, "warmup_s": warm,
                            "correct": ok, "ifname": os.environ.get("GLOO_SOCKET_IFNAME")})
        if rank == 0:
            write_json_atomic(a.out, {"results": results}, indent=None)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_measure_main())
