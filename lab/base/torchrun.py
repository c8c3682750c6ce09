"""The ranks' command lines: torchrun's argv (always a list, never a shell string), a single rank started
without torchrun, and the environment every worker gets."""
from __future__ import annotations

import os
import socket
import sys
from typing import List, Optional, Tuple

from lab.base.paths import SOURCE


def free_port() -> int:
    """A fresh port per run: reusing one back to back once stalled gloo's rendezvous for minutes."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(entry: List[str], nproc: int, port: int, nnodes: int = 1, node_rank: int = 0,
                  master_addr: str = "127.0.0.1", python: str = sys.executable) -> List[str]:
    """torchrun's command line, as a list (never a shell string). ``entry`` is what
    each rank runs: ``["-m", "engine.worker", "--run-dir", DIR]`` or a script and its arguments."""
    return [python, "-m", "torch.distributed.run",
            f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc}",
            f"--master-addr={master_addr}", f"--master-port={port}", "--max-restarts=0", *entry]


def worker_argv(run_dir: str) -> List[str]:
    return ["-m", "engine.worker", "--run-dir", str(run_dir)]


def single_rank(run_dir: str, port: int, python: str = sys.executable) -> Tuple[List[str], dict]:
    """A one-rank run's worker started directly, with the variables torchrun would set: torchrun itself
    would import torch first (1.6 s here) only to start one process (the advisor's profiling runs are
    one rank; their start-up is most of the advisor's cost on a fast link)."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return [python, *worker_argv(run_dir)], env


def worker_env(base: Optional[dict] = None, loopback: bool = True) -> dict:
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    if loopback:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the hostname resolves to loopback anyway; say so
    env["PYTHONUNBUFFERED"] = "1"
    # the engine lives next to lab/; make it importable for the workers wherever they start
    root = str(SOURCE)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
