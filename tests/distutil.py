"""Run a function on world_size gloo ranks (CPU, one thread each) and collect results."""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, outdir):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    # a short timeout: a collective-order bug then fails the test instead of hanging the suite
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()
    # Leave without C++ static destructors: after all work is done gloo sometimes aborts at
    # interpreter exit ("terminate called without an active exception"), as engine/worker.py notes;
    # seen here with async reduce-scatters/all-gathers. The result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(fn, *args, world: int = 2):
    """Call fn(rank, world, *args) in `world` processes; return the list of results.
    A failing rank raises here with its traceback (torch.multiprocessing.spawn)."""
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_entry, args=(world, _free_port(), fn, args, outdir), nprocs=world, join=True)
        out = []
        for r in range(world):
            with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


def emulate_exchange(comps, tensors, log=None):
    """Drive compressors' exchanges as len(comps) ranks would, without a process group; return the outputs. ``log`` collects (op, shapes)."""
    world = len(comps)
    gens = [c.exchange(t, world) for c, t in zip(comps, tensors)]
    rounds = [next(g) for g in gens]
    while True:
        op = rounds[0].op
        assert all(r.op == op for r in rounds), "ranks asked for different collectives"
        if log is not None:
            log.append((op, [tuple(x.shape) for x in rounds[0].tensors]))
        if op == "allreduce":
            total = [torch.stack([r.tensors[i] for r in rounds]).sum(0) for i in range(len(rounds[0].tensors))]
            replies = [[x.clone() for x in total] for _ in rounds]
        else:
            assert op == "allgather"
            everyone = [[x.clone() for x in r.tensors] for r in rounds]
            replies = [everyone] * world
        outs, nxt = [], []
        for g, rep in zip(gens, replies):
            try:
                nxt.append(g.send(rep))
            except StopIteration as stop:
                outs.append(stop.value)
        if outs:
            assert len(outs) == world, "ranks needed different numbers of rounds"
            return outs
        rounds = nxt
