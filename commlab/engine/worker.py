"""torchrun entry point: one rank of a run.

    torchrun --nproc-per-node 2 -m commlab.engine.worker --run-dir runs/<id>

Reads ``spec.json`` from the run directory (checked where the run was admitted: read as it is,
``JobSpec.from_checked``), puts the spec's engine switches into this process's environment, joins the
process group, trains, and appends metrics and timeline spans to the run directory. A rank that
fails writes ``error-rank<r>.json`` (the error and its traceback) before it
exits non-zero, so the launcher can say which rank failed and why. Rank 0
records what ``auto`` and ``threads: 0`` came to in ``resolved.json``, beside what the admission wrote there
(``engine_from_env``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta

from commlab.engine import runfiles
from commlab.engine.ft_lighthouse import LIGHTHOUSE_ENV
from commlab.engine.runlog import write_json_atomic
from commlab.engine.spec import ENGINE_DEFAULTS, JobSpec

# Before torch is imported: one BLAS/OpenMP pool per rank, not one per core each.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="commlab.engine.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, help="run directory holding spec.json")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    die_with_parent()
    if not keep_heap():
        print(f"rank {rank}: glibc's mallopt is not available here; freed memory goes back to the OS as usual",
              file=sys.stderr)
    record_pid(args.run_dir, rank)
    code = 0
    try:
        run(args.run_dir, rank)
    except BaseException as e:  # record, then let torchrun see the failure
        from commlab.engine.stepper import Diverged
        if isinstance(e, Diverged):
            _write_json(args.run_dir, runfiles.DIVERGED.format(rank=rank),
                        {"rank": rank, "step": e.step, "error": str(e), "time": time.time()})
            code = 3
        else:
            record_error(args.run_dir, rank, e)
            traceback.print_exc()
            code = 1
    # Leave without running C++ static destructors: at interpreter exit, torch and
    # gloo sometimes abort ("terminate called without an active exception") after
    # all work is done, which would turn a finished run into a failed one. Every
    # log of ours is already written with unbuffered os.write calls and closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent() -> None:
    """SIGKILL this rank if torchrun dies, so a killed launcher leaves no rank behind (Linux)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_heap(trim_mb: int = 256, mmap_mb: int = 32) -> bool:
    """Keep freed memory in this process instead of handing it back to the OS every step (glibc).

    A training step frees its activations at the end of backward. glibc's malloc returns the free
    top of its heap to the OS once it exceeds a trim threshold that it sizes itself (twice the
    largest freed block seen, a few MB), so the next forward pass takes thousands of page faults
    fetching the same memory back, zeroed (measured in bench/ddp_compare.py: 3-5K per commlab
    transformer step, forward 3-5 ms slower; none with this). Here the trim threshold is
    ``trim_mb`` and allocations up to ``mmap_mb`` (the most glibc sizes it to itself) come from the
    heap, so steps reuse their memory. Returns False where there is no glibc ``mallopt`` (other
    platforms); raises if glibc refuses a setting."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None)
    if mallopt is None:  # a libc without mallopt (musl)
        return False
    # the mmap threshold first: setting either one turns off glibc's own sizing of both
    for param, mb in ((M_MMAP_THRESHOLD, mmap_mb), (M_TRIM_THRESHOLD, trim_mb)):
        if mallopt(param, mb << 20) != 1:
            raise RuntimeError(f"mallopt({param}, {mb} MB): glibc refused the setting (it caps the mmap threshold)")
    return True


def record_pid(run_dir: str, rank: int) -> None:
    """(pid, start time) of this rank, so the lab can find a stray rank and verify it is ours."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        start = None
    _write_json(run_dir, runfiles.PID.format(rank=rank), {"rank": rank, "pid": os.getpid(), "start": start})


def _write_json(run_dir: str, name: str, obj: dict) -> bool:
    """Write one of the files that tell the lab about this rank (its pid, why it failed), whole or
    not at all: a temporary file renamed into place. A failure is reported on stderr, which torchrun
    puts in log.txt, and is not raised: the rank's own error (or its training) matters more than
    this file, and the launcher falls back to torchrun's exit report. Returns whether it was written."""
    path = os.path.join(run_dir, name)
    try:
        write_json_atomic(path, obj)
        return True
    except (OSError, TypeError, ValueError) as e:
        rank = obj.get("rank", os.environ.get("RANK", "?"))
        print(f"[commlab] rank {rank}: could not write {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return False


def record_error(run_dir: str, rank: int, e: BaseException) -> None:
    _write_json(run_dir, runfiles.ERROR.format(rank=rank), {"rank": rank, "error": f"{type(e).__name__}: {e}".strip(),
                                                    "traceback": traceback.format_exc(), "time": time.time()})


def run(run_dir: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from commlab.engine.compressors import contract, graphs
    from commlab.engine.trainer import Trainer, resolve_backend, resolve_device

    with open(os.path.join(run_dir, runfiles.SPEC)) as f:
        spec = JobSpec.from_checked(json.load(f))
    os.environ.update(spec.engine.environment())  # before the engine's code reads them (it reads them when used)
    if spec.fault_tolerance.enabled:
        return run_replica(run_dir, spec, rank)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world != spec.world_size:
        raise RuntimeError(f"world_size: the spec asks for {spec.world_size} ranks but torchrun started {world}")
    threads = spec.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    device = resolve_device(spec, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = resolve_backend(spec, device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s(spec)))
    if rank == 0:  # what the spec's machine-dependent choices (auto, threads 0) came to on this machine
        resolved = {**admitted(run_dir), "rank": 0, "backend": backend, "device": str(device), "threads": threads,
                    "world_size": world, "local_world_size": local_world, "torch": torch.__version__}
        if device.type == "cuda":  # the switches that change a GPU run's codecs (fused kernels, CUDA graphs)
            resolved["gpu_codecs"] = graphs.settings()
        _write_json(run_dir, runfiles.RESOLVED, resolved)
    trainer = None
    trials = runfiles.read_trials(run_dir)  # strategy auto's plan, if any, is the Trainer's to read
    if trials and trials.session:
        try:
            run_trials(run_dir, trials.session, dist.get_rank(), world, device)
        finally:
            dist.destroy_process_group()
        return
    try:
        trainer = Trainer(spec, run_dir, dist.get_rank(), world, device)
        if rank == 0:
            print(f"[commlab] rank 0: {spec.model.name} on {spec.dataset.name}, world {world}, "
                  f"{backend} on {device}, {threads} thread(s) per rank, {len(trainer.dp.buckets)} bucket(s)",
                  flush=True)
        trainer.train()
        if rank == 0 and device.type == "cuda":
            line = graphs.summary(contract.unwrap(b.compressor) for b in getattr(trainer.dp, "buckets", ())
                                  if getattr(b, "compressor", None) is not None)  # error feedback: the codec it wraps
            if line:
                print(f"[commlab] rank 0: {line}", flush=True)
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_replica(run_dir: str, spec: JobSpec, n: int) -> None:
    """Replica group ``n`` of a fault-tolerant run (one process, one rank; RANK is ``n``): no process group of the
    whole run, a torchft Manager instead, reaching the run's Lighthouse at $COMMLAB_FT_LIGHTHOUSE, which the lab
    started (commlab/lab/rundir/ftrun.py). A restarted replica is a new process with the same ``n``."""
    import torch

    from commlab.engine import ft  # lazy: torchft is optional (the ft extra); only a fault-tolerant run loads it
    from commlab.engine.trainer import Trainer, resolve_backend, resolve_device
    groups = spec.fault_tolerance.replica_groups
    lighthouse = os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise RuntimeError(f"fault_tolerance: ${LIGHTHOUSE_ENV} is not set; the lab starts the Lighthouse and "
                           "sets it for each replica (commlab run)")
    threads = spec.threads or max(1, (os.cpu_count() or 1) // groups)
    torch.set_num_threads(threads)
    device = resolve_device(spec, n)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # gloo on CPU, and where the replicas outnumber the GPUs (LOCAL_WORLD_SIZE: the replica groups)
    replica = ft.Replica(spec, run_dir, n, lighthouse, resolve_backend(spec, device))
    if n == 0:
        _write_json(run_dir, runfiles.RESOLVED, {**admitted(run_dir), "rank": 0, "backend": replica.backend,
                                                 "device": str(device), "threads": threads, "world_size": groups,
                                                 "local_world_size": groups, "torch": torch.__version__,
                                                 "torchft": ft.version()})
    trainer = None
    try:
        trainer = Trainer(spec, run_dir, n, groups, device, ft=replica)
        print(f"[commlab] replica {n}: {spec.model.name} on {spec.dataset.name}, {groups} replica groups "
              f"(min {spec.fault_tolerance.min_replicas}), {replica.backend} on {device}, pid {os.getpid()}",
              flush=True)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        replica.close()


def timeout_s(spec: JobSpec) -> float:
    """The process group's timeout: timeout_s of the spec's engine section; for a spec.json written before the spec had it,
    COMMLAB_TIMEOUT_S, else 300 s."""
    t = spec.engine.timeout_s
    return float(t if t is not None else os.environ.get("COMMLAB_TIMEOUT_S") or ENGINE_DEFAULTS["timeout_s"])


def admitted(run_dir: str) -> dict:
    """What the admission recorded in resolved.json before any rank started (``engine_from_env``), kept when rank 0
    writes the file; {} when there is none or it cannot be read."""
    try:
        with open(os.path.join(run_dir, runfiles.RESOLVED)) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: old[k] for k in ADMITTED if isinstance(old, dict) and k in old}


ADMITTED = ("engine_from_env",)
"""resolved.json's keys that the admission writes (commlab/lab/rundir/store.py, RunStore.create)."""


def run_trials(run_dir: str, dirs: list, rank: int, world: int, device) -> None:
    """A trial session (the advisor's ``--measure``, trials.json): each trial folder's spec for its ``steps``
    training steps (no evaluation), one after the other in one process group, so the trials pay one start-up
    (interpreter, torch, gloo) instead of one each; every trial writes metrics.jsonl, its timeline and
    tuning.json in its own folder."""
    from commlab.engine.trainer import Trainer
    for d in dirs:
        sub = os.path.join(run_dir, d)
        with open(os.path.join(sub, runfiles.SPEC)) as f:
            spec = JobSpec.from_checked(json.load(f))
        if spec.world_size != world:
            raise RuntimeError(f"{sub}: world_size {spec.world_size}, but the session has {world} ranks")
        trainer = Trainer(spec, sub, rank, world, device)
        try:
            for _ in range(spec.steps):
                trainer.train_step()
            trainer.sync_params()
        finally:
            trainer.close()


if __name__ == "__main__":
    sys.exit(main())
