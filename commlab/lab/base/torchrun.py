"""The ranks' command lines: torchrun's argv (always a list, never a shell string), the ranks of a one-machine
run started without torchrun, and the environment every worker gets."""
from __future__ import annotations

import os
import socket
import sys
from typing import List, Optional, Tuple

from commlab.lab.base.paths import SOURCE


def free_port() -> int:
    """A fresh port per run: reusing one back to back once stalled gloo's rendezvous for minutes."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(entry: List[str], nproc: int, port: int, nnodes: int = 1, node_rank: int = 0,
                  master_addr: str = "127.0.0.1", python: str = sys.executable) -> List[str]:
    """torchrun's command line, as a list (never a shell string). ``entry`` is what
    each rank runs: ``["-m", "commlab.engine.worker", "--run-dir", DIR]`` or a script and its arguments.
    Its log folder is ``os.devnull``: left to itself torchrun makes a ``torchelastic_*`` folder in the temporary
    directory at every start and never removes it, a folder per run on a server that runs many. Nothing is
    lost: the ranks' output goes where the caller sends torchrun's (a run's log.txt), and a lab rank's error
    to its own error-rank file (commlab.engine.runfiles)."""
    return [python, "-m", "torch.distributed.run",
            f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc}",
            f"--master-addr={master_addr}", f"--master-port={port}", "--max-restarts=0", f"--log-dir={os.devnull}",
            *entry]


def worker_argv(run_dir: str) -> List[str]:
    return ["-m", "commlab.engine.worker", "--run-dir", str(run_dir)]


RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What ``direct_ranks`` sets for each rank: the variables torchrun sets that the engine's rendezvous
(``init_process_group``'s env://) and the worker read."""


def direct_ranks(run_dir: str, world: int, port: int, python: str = sys.executable) -> List[Tuple[List[str], dict]]:
    """(argv, env) of each rank of a one-machine run, started directly with the variables torchrun would
    set: rank 0 hosts the rendezvous store on ``port``. torchrun itself would import torch first (1.5 s
    of CPU here, before any rank starts) only to start the processes and watch them, which the launcher
    does anyway; a one-rank run (the advisor's profiling runs) saved most of its start-up this way, and
    every run on loopback or a modeled link starts that much sooner."""
    return [([python, *worker_argv(run_dir)],
             {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world),
              "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for r in range(world)]


def worker_env(base: Optional[dict] = None, loopback: bool = True) -> dict:
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    if loopback:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the hostname resolves to loopback anyway; say so
    env["PYTHONUNBUFFERED"] = "1"
    # the engine lives next to commlab/lab/; make it importable for the workers wherever they start
    root = str(SOURCE)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
