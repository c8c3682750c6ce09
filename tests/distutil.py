"""Run a function on world_size gloo ranks (CPU, one thread each) and collect results.

The ranks are a pool kept by each test process, one per world size: spawned once (torch and ``torch._dynamo``
imported, about 2.5 s of CPU a rank), then each ``run_world`` call sends them the function, which they run in a
fresh gloo process group with the caller's environment, ``sys.path`` and working directory, a fresh random
seed (as a new process gets) and one thread. A call that fails, hangs or kills a rank ends the pool; the next call spawns a new one.
``COMMLAB_TEST_FRESH_RANKS=1`` spawns fresh ranks for every call instead."""
from __future__ import annotations

import atexit
import importlib
import multiprocessing.connection
import os
import socket
import sys
import tempfile
import pickle
import time
import traceback
import types
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def shaped_unavailable():
    """Why shaped links (commlab.lab.net.netns: root, ip, tc, network namespaces) cannot be built here, or None."""
    from commlab.lab.net.netns import NetworkUnavailable, check_shaped_supported
    try:
        check_shaped_supported()
    except NetworkUnavailable as e:
        return str(e)
    return None


def torchrun_script(cwd, script, *args, timeout: float = 240, env: Optional[dict] = None):
    """``script`` with ``args`` under plain torchrun (two ranks on loopback, one thread each, this checkout first on
    PYTHONPATH, no COMMLAB_RUNS from the caller, ``env`` added), its output in ``stdout``. The launcher runs in a
    session of its own: past ``timeout`` it is ended with its ranks (no rank outlives a failed test). A port free
    when picked may be taken before torchrun binds it (by the other xdist worker): then the job is started once
    more on another."""
    import signal
    import subprocess

    import pytest

    from commlab.lab.base.torchrun import free_port, torchrun_argv
    root = os.path.dirname(ROOT_TESTS)
    full = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    full.pop("COMMLAB_RUNS", None)
    for _ in range(2):
        argv = torchrun_argv([str(script), *map(str, args)], 2, free_port())
        p = subprocess.Popen(argv, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            pytest.fail(f"the job did not end within {timeout} s:\n{out[-3000:]}")
        if "EADDRINUSE" not in out:
            break
    return subprocess.CompletedProcess(argv, p.returncode, out)


def torchrun_own_loop(cwd, *args, timeout: float = 240):
    """examples/own_loop.py with ``args`` under plain torchrun (``torchrun_script``)."""
    return torchrun_script(cwd, os.path.join(os.path.dirname(ROOT_TESTS), "examples", "own_loop.py"), *args,
                           timeout=timeout)


OWN_LOOP_DDP_STEPS = 10
"""Steps of the torch DDP reference run of examples/own_loop.py that tests/conftest.py's ``own_loop_ddp`` runs once."""


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
    # interpreter exit ("terminate called without an active exception"), as commlab/engine/worker.py notes;
    # seen here with async reduce-scatters/all-gathers. The result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


ROOT_TESTS = os.path.dirname(os.path.abspath(__file__))
CALL_TIMEOUT_S = 600
"""A hang guard for one call (each collective also times out after 90 s)."""


def run_world(fn, *args, world: int = 2):
    """Call fn(rank, world, *args) in `world` processes; return the list of results.
    A failing rank raises here with its traceback."""
    if os.environ.get("COMMLAB_TEST_FRESH_RANKS", "") not in ("", "0"):
        with _empty_main(), tempfile.TemporaryDirectory() as outdir:
            mp.spawn(_entry, args=(world, _free_port(), fn, args, outdir), nprocs=world, join=True)
            return _results(outdir, world)
    for attempt in (1, 2):
        pool = _pools.get(world)
        if pool is None:
            pool = _pools[world] = _Pool(world)
        try:
            return pool.call(fn, args)
        except _PoolBroken as e:
            _pools.pop(world, None)
            pool.close(grace_s=0)  # a rank still waiting on its peer would not read the stop
            if not (isinstance(e, _InitFailed) and attempt == 1):
                raise
            # a process group that could not form (a port taken between picking and binding it, a peer's
            # connection refused) is the machine's doing, not the test's: once more, on new ranks and a new port


class _empty_main:
    """A spawned child re-runs the parent's __main__ module first. After streamlit's AppTest.from_function
    (tests/test_streamlit_deprecations.py), __main__ is the app script it wrote to a temporary file, which
    fails outside AppTest: the children get an empty __main__ instead (fn is pickled by its module's name)."""

    def __enter__(self):
        self.main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")

    def __exit__(self, *exc):
        if self.main is not None:
            sys.modules["__main__"] = self.main
        return False


class _PoolBroken(RuntimeError):
    pass


class _InitFailed(_PoolBroken):
    """A rank's process group did not form. Its ranks cannot serve again: one whose init failed has counted a
    group the others did not (torch names groups by that count), so each later call would wait on keys its peer
    never writes."""


_pools: dict = {}


class _Pool:
    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world, self.conns, self.procs = world, [], []
        with _empty_main():
            for rank in range(world):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_serve, args=(rank, world, theirs), daemon=True)
                p.start()
                theirs.close()
                self.conns.append(mine)
                self.procs.append(p)

    def call(self, fn, args):
        payload = pickle.dumps((fn, args))
        where = (_free_port(), dict(os.environ), list(sys.path), os.getcwd())
        try:
            for c in self.conns:
                c.send((where, payload))
            waiting, replies = dict(enumerate(self.conns)), {}
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while waiting:  # as they come: a peer of a rank whose init failed waits in its own init
                ready = multiprocessing.connection.wait(list(waiting.values()), max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise _PoolBroken(f"rank {min(waiting)} did not answer within {CALL_TIMEOUT_S} s")
                for rank in [r for r, c in waiting.items() if c in ready]:
                    ok, value, stage = waiting.pop(rank).recv()
                    if stage == "init":
                        raise _InitFailed(f"rank {rank}'s process group did not form:\n{value}")
                    replies[rank] = (ok, value)
            replies = [replies[r] for r in sorted(replies)]
        except (EOFError, OSError, BrokenPipeError) as e:
            codes = [p.exitcode for p in self.procs]
            raise _PoolBroken(f"a rank of the pool died (exit codes {codes}): {e!r}") from None
        errors = [f"-- rank {r} failed:\n{value}" for r, (ok, value) in enumerate(replies) if not ok]
        if errors:
            raise RuntimeError("\n".join(errors))
        return [pickle.loads(value) for _, value in replies]

    def close(self, grace_s: float = 5):
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(grace_s)
            if p.is_alive():
                p.kill()
                p.join()


@atexit.register
def _close_pools():
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


def _serve(rank, world, conn):
    """A pool rank: run each call sent until told to stop (None) or the caller is gone."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch._dynamo  # noqa: F401  every optimizer's first step imports it: once per pool, not per call
    tmp = os.path.realpath(tempfile.gettempdir())
    # never the interpreter's, the repository's or an installed package's modules, even when they live under tmp
    # (a fresh clone in /tmp and its .venv)
    keep = tuple(os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, os.path.dirname(ROOT_TESTS)))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        (port, env, path, cwd), payload = msg
        stage = "setup"
        try:
            os.environ.clear()
            os.environ.update(env)
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            sys.path[:] = path
            os.chdir(cwd)
            for name, mod in list(sys.modules.items()):  # a test's own modules (under tmp) are read fresh
                f = getattr(mod, "__file__", None) or ""
                real = os.path.realpath(f) if f else ""
                if real.startswith(tmp + os.sep) and not real.startswith(keep) and name != "__main__":
                    del sys.modules[name]
            importlib.invalidate_caches()
            torch.seed()  # a new process's generator starts from a random seed; so does every call
            torch.set_num_threads(1)
            torch.set_grad_enabled(True)
            fn, args = pickle.loads(payload)
            stage = "init"
            once = os.environ.get("DISTUTIL_FAIL_INIT_ONCE")  # this pool's own test: rank 1's init fails while it
            if once and rank == 1 and os.path.exists(once):  # finds that file, which it removes
                os.unlink(once)
                raise RuntimeError("a process group that did not form (DISTUTIL_FAIL_INIT_ONCE)")
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=90))
            stage = "call"
            try:
                reply = (True, pickle.dumps(fn(rank, world, *args)), stage)
            finally:
                dist.destroy_process_group()
        except BaseException:
            reply = (False, traceback.format_exc(), stage)
        try:
            conn.send(reply)
        except OSError:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as _entry: no C++ static destructors


def _results(outdir, world):
    out = []
    for r in range(world):
        with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
            out.append(pickle.load(f))
    return out


def emulate_exchange(comps, tensors, log=None, buckets=None, sent=None):
    """Drive compressors' exchanges as len(comps) ranks would, without a process group; return the outputs. ``log`` collects (op, shapes).
    ``buckets``: each rank's BucketContext (default: each on its own); ``sent`` gets each rank's payload bytes (``Exchange.sent``)."""
    from commlab.engine.comm.exchange import local_collective, run_exchange

    def collective(op, payloads):
        if log is not None:
            log.append((op, [tuple(x.shape) for x in payloads[0]]))
        return local_collective(op, payloads)
    exs = run_exchange(comps, tensors, len(comps), collective, buckets=buckets)
    if sent is not None:
        sent[:] = [ex.sent for ex in exs]
    return [ex.out for ex in exs]


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


def warm_servers(tmpdir) -> list:
    """Pids of the warm servers (commlab.lab.base.warm) started under ``tmpdir`` (a test's own TMPDIR) that still run,
    from the line each writes to its log when it starts serving."""
    from pathlib import Path

    from commlab.lab.base import procs, warm
    out = []
    for log in Path(tmpdir).glob("commlab-warm-*/*.log"):
        for line in log.read_text().splitlines():
            if line.startswith(warm.READY):
                pid = int(line.split()[2])
                if procs.start_time(pid) is not None and warm.MARK in procs.cmdline(pid):
                    out.append(pid)
    return out


def stop_warm_servers(tmpdir) -> None:
    """SIGTERM the warm servers a test started under its own ``tmpdir``."""
    import signal

    from commlab.lab.base import procs, warm
    for pid in warm_servers(tmpdir):
        procs.kill_if_ours({"pid": pid, "start": procs.start_time(pid)}, warm.MARK, signal.SIGTERM)


def model_state(trainer) -> dict:
    """A Trainer's model state_dict with up-to-date parameters (dear's parameters completed first), cloned."""
    trainer.sync_params()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def counted(calls: dict, name: str, real):
    """``real``, counting each call in ``calls[name]`` (a test checks what a page computed again)."""
    def f(*a, **k):
        calls[name] += 1
        return real(*a, **k)
    return f
