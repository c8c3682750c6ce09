"""Run a function on world_size gloo ranks (CPU, one thread each) and collect results."""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import pickle
import types
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
    # A spawned child re-runs the parent's __main__ module first. After streamlit's AppTest.from_function
    # (tests/test_streamlit_deprecations.py), __main__ is the app script it wrote to a temporary file, which
    # fails outside AppTest: the children get an empty __main__ instead (fn is pickled by its module's name).
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        with tempfile.TemporaryDirectory() as outdir:
            mp.spawn(_entry, args=(world, _free_port(), fn, args, outdir), nprocs=world, join=True)
            return _results(outdir, world)
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _results(outdir, world):
    out = []
    for r in range(world):
        with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
            out.append(pickle.load(f))
    return out


def emulate_exchange(comps, tensors, log=None):
    """Drive compressors' exchanges as len(comps) ranks would, without a process group; return the outputs. ``log`` collects (op, shapes)."""
    from engine.comm.exchange import local_collective, run_exchange

    def collective(op, payloads):
        if log is not None:
            log.append((op, [tuple(x.shape) for x in payloads[0]]))
        return local_collective(op, payloads)
    return [ex.out for ex in run_exchange(comps, tensors, len(comps), collective)]


def stop_process(p, sig, timeout: float, group: bool = False) -> None:
    """Stop a server the test started in its own session: ``sig`` (to its process group when ``group``),
    then SIGKILL to the whole group if it is still there after ``timeout`` seconds."""
    import signal
    import subprocess
    if p.poll() is not None:
        return
    if group:
        os.killpg(p.pid, sig)
    else:
        p.send_signal(sig)
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def wait_until_up(url: str, p, log_path, timeout: float = 120.0) -> None:
    """Wait for the Streamlit server at ``url`` that process ``p`` started to answer its health check;
    fail with its log if the process ends or ``timeout`` seconds pass first."""
    import time
    import urllib.request
    t0 = time.time()
    while True:
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=2):
                return
        except OSError:
            assert p.poll() is None, open(log_path).read()
            assert time.time() - t0 < timeout, "the UI did not come up"
            time.sleep(0.3)
