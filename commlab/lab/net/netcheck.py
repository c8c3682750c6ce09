"""Measuring an emulated cluster: raw TCP between two ranks and a gloo all-reduce.

``net_check(gbps)`` builds a shaped cluster (commlab.lab.net.netns.Cluster), measures both,
prints them next to the target and the alpha-beta prediction, and tears the
cluster down. ``commlab net check --gbps X`` calls it.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Tuple

from commlab.engine.netmodel import busbw_factor, ring_allreduce_s
from commlab.lab.base.procs import stop
from commlab.lab.base.torchrun import worker_env
from commlab.lab.net.netns import Cluster, NetnsError, rank_argv

_TCP_RECV = r"""
import json, socket, sys, time
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((addr, port)); s.listen(1); s.settimeout(timeout)
c, peer = s.accept(); c.settimeout(timeout)
buf = bytearray(1 << 20); n = 0; first = 0; t0 = t1 = None
end = time.monotonic() + timeout
while time.monotonic() < end:
    k = c.recv_into(buf)
    if not k:
        break
    now = time.perf_counter()
    if t0 is None:
        t0, first = now, k
    n += k; t1 = now
print(json.dumps({"bytes": n, "first": first, "t0": t0, "t1": t1, "peer": peer[0]}))
"""

_TCP_SEND = r"""
import json, socket, sys, time
addr, port, seconds, max_bytes = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
end = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection((addr, port), timeout=10); break
    except (ConnectionRefusedError, OSError):
        if time.monotonic() > end: raise
        time.sleep(0.05)
chunk = b"\0" * (256 << 10); n = 0
t0 = time.perf_counter()
while n < max_bytes and time.perf_counter() - t0 < seconds:
    s.sendall(chunk); n += len(chunk)
s.shutdown(socket.SHUT_WR)
s.recv(1)
s.close()
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}))
"""


def measure_tcp(cluster: Cluster, src: int = 0, dst: int = 1, seconds: float = 3.0,
                port: int = 5201) -> dict:
    """Raw TCP from rank ``src`` to rank ``dst`` for about ``seconds``: the
    receiver's goodput (bytes after the first read over the time to the last)."""
    gbps = cluster.gbps or 20.0
    max_bytes = int(gbps * 1e9 / 8 * seconds * 1.5) + (1 << 20)
    timeout = seconds + 20
    py = sys.executable
    recv = subprocess.Popen(cluster.exec_argv(dst, [py, "-c", _TCP_RECV, cluster.addresses[dst], port, timeout]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    send = subprocess.Popen(cluster.exec_argv(src, [py, "-c", _TCP_SEND, cluster.addresses[dst], port,
                                                     seconds, max_bytes]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        s_out, s_err = send.communicate(timeout=timeout + 5)
        r_out, r_err = recv.communicate(timeout=timeout + 5)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"TCP measurement did not finish within {timeout + 5:g} s") from None
    finally:
        stop([send, recv])
    if send.returncode or recv.returncode:
        err = " ".join((s_err + " " + r_err).split())[-400:]
        raise NetnsError(f"TCP measurement failed (sender exit {send.returncode}, "
                         f"receiver exit {recv.returncode}): {err}")
    r = json.loads(r_out.strip().splitlines()[-1])
    dt = (r["t1"] or 0) - (r["t0"] or 0)
    if dt <= 0:
        raise NetnsError(f"TCP measurement moved too little data: {r}")
    bps = (r["bytes"] - r["first"]) * 8 / dt
    return {"bytes": r["bytes"], "seconds": dt, "gbps": bps / 1e9, "from": cluster.addresses[src],
            "to": cluster.addresses[dst], "peer_seen": r["peer"]}


def measure_allreduce(cluster: Cluster, nbytes: int, iters: int, port: Optional[int] = None,
                      timeout: float = 90.0) -> dict:
    """Time ``iters`` gloo all-reduces of ``nbytes`` (fp32), every rank a torchrun
    node in its namespace (``python -m commlab.engine.netmodel allreduce``)."""
    return measure_allreduces(cluster, [(nbytes, iters)], port, timeout)[0]


def measure_allreduces(cluster: Cluster, sizes: List[Tuple[int, int]], port: Optional[int] = None,
                       timeout: float = 90.0) -> List[dict]:
    """``measure_allreduce`` of each (nbytes, iters) of ``sizes`` in turn, by one set of ranks (each imports
    torch and joins the group once, not once per size); one result per size, in order."""
    port = port or (20000 + secrets.randbelow(20000))
    env0 = worker_env()
    procs = []
    with tempfile.TemporaryDirectory(prefix="clab-check-") as tmp:
        out = os.path.join(tmp, "result.json")
        logs = []
        try:
            for i in range(cluster.n):
                argv, upd = rank_argv(cluster, i, ["-m", "commlab.engine.netmodel", "allreduce",
                                                   "--bytes", ",".join(str(n) for n, _ in sizes),
                                                   "--iters", ",".join(str(k) for _, k in sizes), "--out", out,
                                                   "--timeout", str(int(timeout))], port)
                log = open(os.path.join(tmp, f"rank{i}.log"), "wb")
                logs.append(log)
                procs.append(subprocess.Popen(argv, env={**env0, **upd}, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    break
                time.sleep(0.1)
            timed_out = any(p.poll() is None for p in procs)
        finally:
            stop(procs)
            for log in logs:
                log.close()
        if timed_out or any(p.returncode for p in procs) or not os.path.exists(out):
            tail = ""
            for i in range(len(procs)):
                with open(os.path.join(tmp, f"rank{i}.log"), "rb") as f:
                    lines = [l for l in f.read().decode(errors="replace").splitlines() if l.strip()]
                tail += f" [rank {i}] " + " | ".join(lines[-3:])
            why = f"timed out after {timeout:g} s" if timed_out else \
                f"exit codes {[p.returncode for p in procs]}"
            raise NetnsError(f"all-reduce measurement {why}:{tail[-800:]}")
        with open(out) as f:
            return json.load(f)["results"]


SMALL_BYTES = 4096


def net_check(gbps: float, seconds: float = 3.0, target_s: float = 0.5, latency_us: float = 0.0,
              max_bytes: int = 64 << 20, out=None, n_ranks: int = 2) -> dict:
    """Build a shaped cluster, measure raw TCP and a gloo all-reduce, tear it down.

    The all-reduce tensor is sized to take about ``target_s`` at ``gbps`` (at
    most ``max_bytes``), repeated to fill about ``seconds``. Returns target,
    TCP goodput, the all-reduce's median time, its algorithmic bandwidth
    (bytes / time) and bus bandwidth (2(p-1)/p * bytes / time), the alpha-beta
    prediction and the ratio predicted / measured time (1.0 = as modeled).
    ``out``: a stream to print progress and the result table to.
    """
    say = (lambda s: print(s, file=out, flush=True)) if out else (lambda s: None)
    t_start = time.monotonic()
    p = n_ranks
    factor = busbw_factor("allreduce", p)
    nbytes = int(target_s * gbps * 1e9 / 8 / factor) // 4 * 4
    nbytes = max(4096, min(nbytes, max_bytes))
    pred = ring_allreduce_s(nbytes, p, gbps, latency_us)
    iters = max(3, min(20, int(round(seconds / max(pred, 1e-3)))))
    with Cluster(p, gbps, tag="chk") as c:
        say(f"cluster: {c.describe()}")
        tcp = measure_tcp(c, 0, 1, seconds)
        say(f"tcp: {tcp['gbps'] * 1e3:.1f} Mbit/s")
        # then the latency: what a collective costs with ~no bytes
        ar, small = measure_allreduces(c, [(nbytes, iters), (SMALL_BYTES, 20)])
        qd = c.qdiscs()
    times = sorted(ar["times"])
    med = times[len(times) // 2]
    res = {
        "target_gbps": gbps,
        "tcp_gbps": tcp["gbps"],
        "tcp_ratio": tcp["gbps"] / gbps,
        "allreduce_bytes": nbytes,
        "allreduce_iters": iters,
        "allreduce_world": p,
        "allreduce_median_s": med,
        "allreduce_min_s": times[0],
        "allreduce_max_s": times[-1],
        "allreduce_algbw_gbps": nbytes * 8 / med / 1e9,
        "allreduce_busbw_gbps": factor * nbytes * 8 / med / 1e9,
        "allreduce_predicted_s": pred,
        "allreduce_ratio": pred / med,
        "allreduce_correct": ar.get("correct"),
        "allreduce_small_bytes": small["nbytes"],
        "allreduce_small_median_s": sorted(small["times"])[len(small["times"]) // 2],
        "allreduce_small_mean_s": sum(small["times"]) / len(small["times"]),
        "latency_us": latency_us,
        "qdiscs": qd,
        "check_seconds": time.monotonic() - t_start,
    }
    for line in format_net_check(res):
        say(line)
    return res


def format_net_check(r: dict) -> List[str]:
    def mbit(g):
        return f"{g * 1e3:9.1f} Mbit/s"
    return [
        f"target link           {mbit(r['target_gbps'])}",
        f"raw TCP (rank0->1)    {mbit(r['tcp_gbps'])}   {r['tcp_ratio']:.1%} of target",
        f"gloo all-reduce       {r['allreduce_bytes'] / 2**20:.2f} MiB x {r['allreduce_iters']}, world "
        f"{r['allreduce_world']}: median {r['allreduce_median_s'] * 1e3:.1f} ms "
        f"(predicted {r['allreduce_predicted_s'] * 1e3:.1f} ms, ring alpha-beta)",
        f"  algorithmic bw      {mbit(r['allreduce_algbw_gbps'])}   (bytes / time)",
        f"  bus bw              {mbit(r['allreduce_busbw_gbps'])}   {r['allreduce_ratio']:.1%} of the model's",
        f"small all-reduce      {r['allreduce_small_bytes'] / 1024:.0f} KiB: median "
        f"{r['allreduce_small_median_s'] * 1e3:.2f} ms, mean {r['allreduce_small_mean_s'] * 1e3:.2f} ms",
        f"check took {r['check_seconds']:.1f} s; cluster torn down",
    ]
