"""Start a run's ranks and follow them to a final status, in one line:

    launch   read the run once (its spec; the limits in its status) and place its ranks: on one machine each
             rank directly, in a session of its own; on a shaped link one torchrun node per rank inside an
             emulated cluster (torn down however the run ends); with ``Nodes`` this machine's share of a
             multi-node run (a node other than 0 only runs its share: node 0 owns the status)
    start    the log, the disturbance sampler (commlab.lab.rundir.disturbance), the processes (forked by the warm
             server when there is one, commlab.lab.base.warm), then ``mark_running`` with what was started
    follow   poll the processes; read what metrics.jsonl gained (``JsonlTail``) for the progress bar and
             ``on_metrics``; stop on a cancel request, Ctrl-C or a limit in its status (``Watch``: wall
             time, the MB its directory may grow to, the MB its disk keeps free); sample the CPU other
             processes take
    finish   kill strays, then one final transition carrying the disturbance figures: done, diverged, failed
             (the rank that caused it and its error, ``failure_cause``) or cancelled (by whom or why)

The limits are what admission recorded in the run's status; the launcher only applies them (a room sets
them: a student's wall time, disk and ``rank_mb`` quotas, commlab.room.policy). A run with a memory limit per rank
(``rank_limit_mb``) has its ranks started under it (commlab.lab.base.procs.limit_data), and a rank that passes
it fails the run with the limit named (``finish_status``).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, List, Optional

from commlab.engine import runfiles
from commlab.engine.cluster import workers as cluster_workers
from commlab.engine.runfiles import State
from commlab.engine.runlog import JsonlTail
from commlab.lab.base import procs, warm
from commlab.lab.base.procs import stop
from commlab.lab.base.torchrun import direct_ranks, free_port, torchrun_argv, worker_argv, worker_env
from commlab.lab.net.netns import Cluster, rank_argv
from commlab.lab.rundir import disturbance, ftrun
from commlab.lab.rundir.progress import RunProgress
from commlab.lab.rundir.store import Run, slug


class Watch:
    """Why a running run is stopped now (``reason``): a cancel request, or a limit admission recorded in its
    status spent: ``wall_limit_s`` seconds of running, ``disk_limit_mb`` MB in its directory, less than
    ``free_limit_mb`` MB free on its disk (the last two looked at every DISK_EVERY_S)."""

    DISK_EVERY_S = 2.0

    def __init__(self, run: Run, limits: dict, should_cancel=None):
        self.path, self.should_cancel, self.t0 = run.path, should_cancel, time.time()
        self.wall_s = limits.get("wall_limit_s")
        self.disk_mb, self.free_mb = limits.get("disk_limit_mb"), limits.get("free_limit_mb")
        self._disk_at = 0.0

    def reason(self) -> str:
        """"cancelled", or the spent limit named in one line; "" to go on."""
        if self.should_cancel and self.should_cancel():
            return "cancelled"
        now = time.time()
        if self.wall_s and now - self.t0 > self.wall_s:
            return (f"quota wall_s: stopped after {now - self.t0:.0f} s of running; the limit is "
                    f"{self.wall_s:g} s per run (runs/lab.json quotas.wall_s)")
        if (self.disk_mb or self.free_mb) and now >= self._disk_at:
            self._disk_at = now + self.DISK_EVERY_S
            used = tree_mb(self.path) if self.disk_mb else 0.0
            if self.disk_mb and used > self.disk_mb:
                return (f"quota disk_mb: stopped with {used:.0f} MB in its directory; the limit is "
                        f"{int(self.disk_mb)} MB per run (runs/lab.json quotas.disk_mb)")
            free = shutil.disk_usage(self.path).free / 2**20 if self.free_mb else 0.0
            if self.free_mb and free < self.free_mb:
                return (f"quota free_mb: stopped with {free:.0f} MB free on the runs directory's disk, under the "
                        f"{int(self.free_mb)} MB kept free (runs/lab.json quotas.free_mb)")
        return ""


def tree_mb(path) -> float:
    """MB of the files under ``path`` (links not followed; a file gone meanwhile counts nothing)."""
    total, todo = 0, [os.fspath(path)]
    while todo:
        try:
            with os.scandir(todo.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            todo.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total / 2**20


def launch(run: Run, progress: bool = True, out=None, poll_s: float = 0.2,
           on_metrics: Optional[Callable[[List[dict]], None]] = None,
           should_cancel: Optional[Callable[[], bool]] = None, nodes: Optional["Nodes"] = None) -> str:
    """Run ``run`` to completion in the foreground and return its final state.

    On loopback (and modeled links) the launcher starts every rank itself
    (``direct_ranks``), stops the others when one fails and names the rank that
    caused it. On a shaped link it builds an emulated cluster and starts each
    rank as its own torchrun node inside its namespace; the cluster is torn down
    however the run ends. With ``nodes`` this process is one node of a
    multi-machine run: it starts this node's share of the ranks, and only node
    0 writes the run's status. ``should_cancel`` is asked on every poll.
    """
    spec, limits = run.spec(), run.status()
    if spec.fault_tolerance.enabled:
        return _follow_ft(run, spec, progress, out or sys.stderr, poll_s, on_metrics, should_cancel, limits, nodes)
    with contextlib.ExitStack() as stack:
        if nodes is not None:
            if spec.world_size % nodes.nnodes:
                raise ValueError(f"world_size: {spec.world_size} ranks do not split over {nodes.nnodes} nodes")
            argv = torchrun_argv(worker_argv(str(run.path)), spec.world_size // nodes.nnodes, nodes.port,
                                 nodes.nnodes, nodes.node_rank, nodes.master_addr)
            # off loopback, gloo uses the interface the user names in GLOO_SOCKET_IFNAME (inherited)
            loopback = nodes.master_addr in ("127.0.0.1", "localhost")
            if nodes.node_rank > 0:
                return _run_to_end(argv, loopback, run.file(runfiles.NODE_LOG.format(pid=os.getpid())))
            jobs, info = [(argv, {})], {"nodes": nodes.nnodes}
        elif spec.network.link == "shaped":
            cluster = stack.enter_context(_cluster(spec, run))  # network.cluster: each rank's own rates
            port = free_port()
            jobs = [rank_argv(cluster, i, worker_argv(str(run.path)), port) for i in range(spec.world_size)]
            info = {"cluster": cluster.describe()}
            loopback = True  # each rank's env names its namespace's interface, which overrides lo
        else:
            jobs, info, loopback = direct_ranks(str(run.path), spec.world_size, free_port()), {}, True
        return _follow(run, spec, jobs, loopback, info, progress, out or sys.stderr, poll_s, on_metrics,
                       should_cancel, limits, memory=limits.get("rank_limit_mb"))


JOB_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun, Slurm batch scripts (srun) and Kubernetes PyTorchJobs set for every rank."""


class JobRank:
    """This process's place in a job that a launcher other than commlab started: the torch
    convention RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK). ``commlab run`` then
    runs one rank (``python -m commlab.engine.worker`` with this environment) instead of spawning them."""

    def __init__(self, env):
        try:
            self.rank, self.world, self.port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        except ValueError:
            raise ValueError("RANK, WORLD_SIZE and MASTER_PORT must be integers, got "
                             f"{env['RANK']!r}, {env['WORLD_SIZE']!r}, {env['MASTER_PORT']!r}") from None
        self.addr = env["MASTER_ADDR"]
        if not 0 <= self.rank < self.world:
            raise ValueError(f"RANK: must be in 0..{self.world - 1} (WORLD_SIZE {self.world}), got {self.rank}")
        self.env = env

    @classmethod
    def from_env(cls, env=None) -> Optional["JobRank"]:
        env = os.environ if env is None else env
        return cls(env) if cls.present(env) else None

    @staticmethod
    def present(env=None) -> bool:
        """Whether this process is one rank of a job another launcher started (JOB_ENV all set)."""
        env = os.environ if env is None else env
        return all(env.get(k) for k in JOB_ENV)

    def local_root(self) -> Optional[int]:
        """The process whose tree holds this job's ranks on this machine, when this machine runs more than one
        (torchrun's agent, srun's step: this process's parent), so that the other local ranks count as the
        run's own CPU, not as other processes; None when this is the only one."""
        e = self.env
        try:
            local = int(e.get("LOCAL_WORLD_SIZE") or e.get("SLURM_NTASKS_PER_NODE") or 1)
        except ValueError:
            local = 1
        return os.getppid() if local > 1 else None

    def run_id(self, name: str) -> str:
        """A run id every rank derives alike without talking to the others: $COMMLAB_RUN_ID, else
        from the job's own id (Slurm's job and step, torchrun's --rdzv-id), else from the job's
        rendezvous address (a second job on the same address and port needs --run-id)."""
        import hashlib
        e = self.env
        if e.get("COMMLAB_RUN_ID"):
            return e["COMMLAB_RUN_ID"]
        if e.get("SLURM_JOB_ID"):
            return f"{slug(name)}-slurm{e['SLURM_JOB_ID']}" + (f".{e['SLURM_STEP_ID']}" if e.get("SLURM_STEP_ID") else "")
        if e.get("TORCHELASTIC_RUN_ID") not in (None, "", "none"):
            return f"{slug(name)}-{slug(e['TORCHELASTIC_RUN_ID'])}"
        key = f"{self.addr}:{self.port}:{self.world}"
        return f"{slug(name)}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def launch_rank(run: Run, job: JobRank, progress: bool = True, out=None) -> str:
    """Run this process's rank of a job started by another launcher (``JobRank``). Rank 0 owns the
    run's status, as a supervisor does (progress, disturbance, final state from every rank's
    files); the other ranks only run theirs. The run directory is shared (one machine, or NFS)."""
    argv = [sys.executable, *worker_argv(str(run.path))]
    loopback = job.addr in ("127.0.0.1", "localhost")  # off loopback, GLOO_SOCKET_IFNAME names the interface
    if job.rank > 0:
        return _run_to_end(argv, loopback, run.file(runfiles.RANK_LOG.format(rank=job.rank)))
    return _follow(run, run.spec(), [(argv, {})], loopback, {"joined": {"world_size": job.world,
                   "master": f"{job.addr}:{job.port}"}}, progress, out or sys.stderr, 0.2, None, run.cancel_requested,
                   run.status(), job_root=job.local_root())


class Nodes:
    """This process's place in a multi-node launch (torchrun's static rendezvous)."""

    def __init__(self, nnodes: int, node_rank: int, master_addr: str, port: int):
        if not 1 <= nnodes <= 4096 or not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank: must be in 0..{nnodes - 1}, got {node_rank}")
        self.nnodes, self.node_rank, self.master_addr, self.port = nnodes, node_rank, master_addr, port


def _spawn(argv: List[str], env: dict, loopback: bool, log, memory: Optional[int] = None) -> subprocess.Popen:
    """A torchrun (or a rank) in a session of its own; it gets SIGTERM if this launcher dies, and
    stops its ranks (which die with it too). ``memory``: MB of data it and its ranks may each use."""
    def child() -> None:
        procs.die_with_parent()
        procs.limit_data(memory)
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**worker_env(loopback=loopback), **env}, start_new_session=True,
                            preexec_fn=child)


def _run_to_end(argv: List[str], loopback: bool, log_path) -> str:
    """A process of a run whose status another one owns, to its end: done, failed, or cancelled (Ctrl-C)."""
    with open(log_path, "ab", buffering=0) as log:
        p = _spawn(argv, {}, loopback, log)
        try:
            return State.DONE if p.wait() == 0 else State.FAILED
        except KeyboardInterrupt:
            stop([p])
            return State.CANCELLED


def _follow(run, spec, jobs, loopback, info, progress, out, poll_s, on_metrics, should_cancel, limits: dict,
            memory: Optional[int] = None, job_root: Optional[int] = None) -> str:
    """Start the jobs, follow them, write the final status (see the module docstring). ``limits``: the run's
    status as the launch read it (its wall-time quota, its memory limit for ``finish_status``); ``memory``: MB
    each rank may use."""
    cpu = disturbance.Sampler(disturbance.threshold(run.path.parent), runs_root=run.path.parent,
                              on_update=lambda d: run.note(disturbance=d))
    cpu.job_root = job_root
    log = open(run.file(runfiles.LOG), "ab", buffering=0)
    # ranks started directly are forked by the warm server when there is one (commlab.lab.base.warm); it is asked
    # for before sampling starts, so that a server starting up does not count against this run
    server = warm.ready() if all(_direct(argv) for argv, _ in jobs) else None
    cpu.start()  # before the job: its processes count as the run's own from their first tick
    procs_ = server and warm.start(server, [(argv, {**worker_env(loopback=loopback), **env}) for argv, env in jobs],
                                   str(run.file(runfiles.LOG)), memory=memory)
    procs_ = procs_ or [_spawn(argv, env, loopback, log, memory) for argv, env in jobs]
    cpu.roots = lambda: [p.pid for p in procs_ if p.returncode is None]  # reaped ones are in our cutime
    cpu.reaped = lambda: sum(getattr(p, "ticks", 0) for p in procs_)  # warm ranks' (the server reaps them)
    # "torchruns": the processes started here (the ranks themselves on one machine); the names are kept
    # so that run directories written before read the same
    run.mark_running(torchruns=[procs.identity(p.pid) for p in procs_], argv=jobs[0][0], **info)
    tail = JsonlTail(run.file(runfiles.METRICS))
    bar = RunProgress(spec.steps, spec.world_size, out, final_eval=spec.final_eval) if progress else None
    watch = Watch(run, limits, should_cancel)
    stopped = None
    """Why the launcher stopped the job before its end: the cancelled run's error."""
    try:
        while True:
            codes = [p.poll() for p in procs_]
            new = tail.read()
            if new and on_metrics:
                on_metrics(new)
            if bar:
                bar.feed(new)  # redraws the elapsed time while the ranks start, too
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):  # one node failed: the others cannot go on
                time.sleep(1.0)  # let them notice and record their own errors first
                stop(procs_)
                break
            stopped = watch.reason()
            if stopped:
                break
            cpu.tick()
            time.sleep(poll_s)
    except KeyboardInterrupt:
        stopped = "cancelled" + (" by the user (Ctrl-C)" if not should_cancel or not should_cancel() else "")
    finally:
        log.close()
    if stopped:
        stop(procs_)
        kill_strays(run)
        if bar:
            bar.feed(tail.read())  # the lines the ranks wrote before they stopped: the summary counts them too
            bar.close(State.CANCELLED)
        run.mark_cancelled(stopped, disturbance=cpu.finish(run.metric_rows()))
        return State.CANCELLED
    kill_strays(run)
    codes = [p.poll() for p in procs_]
    rc = next((c for c in codes if c), 0)
    # a rank started directly: its exit code is its own (torchrun's report in the log names the others')
    exits = [(int(env["RANK"]), c) for (argv, env), c in zip(jobs, codes) if c and _direct(argv)]
    state = finish_status(run, rc, exits or None, disturbance=cpu.finish(run.metric_rows()), limits=limits)
    if bar:
        bar.feed(tail.read())  # what the ranks wrote since the last poll (the summary counts it too)
        bar.close(state)
    return state


def _follow_ft(run, spec, progress, out, poll_s, on_metrics, should_cancel, limits: dict, nodes=None) -> str:
    """A fault-tolerant run (commlab/lab/rundir/ftrun.py): the Lighthouse and one process per replica group, the
    faults executed and dead replicas restarted as the metrics come in, every process started stopped by its PID
    at the end however it ends; then one final transition (done, diverged, failed or cancelled). With ``nodes``:
    this machine's block of replica groups (node 0 also starts the Lighthouse); only node 0 writes the status,
    from its own replica groups' end (a node's replicas finish training with the others')."""
    node = nodes.node_rank if nodes is not None else 0
    cluster = _cluster(spec, run) if spec.network.link == "shaped" and nodes is None else None
    try:
        return _follow_ft_job(run, spec, progress, out, poll_s, on_metrics, should_cancel, limits, nodes, node,
                              cluster)
    finally:
        if cluster is not None:  # after every process of the run has been stopped
            cluster.teardown()


def _cluster(spec, run) -> Cluster:
    """The emulated cluster of a shaped link: one namespace per rank (each its own rates under network.cluster)."""
    ws = cluster_workers(spec)
    rates = [(w["gbps_up"], w["gbps_down"]) for w in ws] if ws else None
    return Cluster(spec.world_size, None if rates else spec.network.gbps, tag=run.id[-4:], rates=rates)


def _follow_ft_job(run, spec, progress, out, poll_s, on_metrics, should_cancel, limits: dict, nodes, node: int,
                   cluster) -> str:
    log = open(run.file(runfiles.LOG if node == 0 else runfiles.NODE_LOG.format(pid=os.getpid())), "ab", buffering=0)
    job = ftrun.FtJob(run, spec, log, memory=limits.get("rank_limit_mb"), nodes=nodes, cluster=cluster)
    if node > 0:
        return _follow_ft_node(run, job, log, poll_s)
    tail = JsonlTail(run.file(runfiles.METRICS))
    bar = RunProgress(spec.steps, spec.world_size, out, final_eval=spec.final_eval) if progress else None
    watch = Watch(run, limits, should_cancel)
    stopped = None
    try:
        job.start()
        argv = [sys.executable, *(job.script[0] if job.script else worker_argv(str(run.path)))]
        script = {"script": {"argv": job.script[0], "cwd": job.script[1]}} if job.script else {}
        placed = {"cluster": cluster.describe()} if cluster is not None else {}
        run.mark_running(torchruns=job.identities(), argv=argv, **placed,
                         fault_tolerance={"replica_groups": job.groups, "lighthouse": job.addr, **script})
        while job.verdict() is None:
            new = tail.read()
            if new and on_metrics:
                on_metrics(new)
            if bar:
                bar.feed(new)
            job.feed(new)
            job.poll()
            if run.divergences():  # every replica sees the same averaged gradient: the run cannot go on
                break
            stopped = watch.reason()
            if stopped:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        stopped = "cancelled" + (" by the user (Ctrl-C)" if not should_cancel or not should_cancel() else "")
    except RuntimeError as e:  # the Lighthouse did not come up
        job.failed = str(e)
    finally:
        job.stop()
        log.close()
        kill_strays(run, job.mine if nodes is not None else None)
    if bar:
        bar.feed(tail.read())
    if stopped:
        if bar:
            bar.close(State.CANCELLED)
        run.mark_cancelled(stopped)
        return State.CANCELLED
    verdict = job.verdict()
    if run.divergences():
        state = finish_status(run, 1)
    elif verdict == State.DONE:
        run.mark_done(0)
        state = State.DONE
    else:
        exits = [(r, c) for r, c in job.failures]
        rank, why = failure_cause(run, exits=exits) if exits else (None, None)
        why_all = job.failed or "fault_tolerance: the run ended before a replica trained to the last step"
        run.mark_failed(why_all + (f" (replica {rank}: {why})" if why else ""), returncode=1, rank=rank)
        state = State.FAILED
    if bar:
        bar.close(state)
    return state


def _follow_ft_node(run, job, log, poll_s: float) -> str:
    """A node after the first of a fault-tolerant run: its replica groups to their end (node 0 owns the status);
    returns this node's verdict (cancelled on Ctrl-C)."""
    tail = JsonlTail(run.file(runfiles.METRICS))
    try:
        job.start()
        while job.verdict() is None and run.state not in (State.CANCELLED, State.FAILED):  # node 0 gave up
            job.feed(tail.read())
            job.poll()
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return State.CANCELLED
    except RuntimeError as e:  # node 0's Lighthouse did not come up
        job.failed = str(e)
        print(f"[commlab] {e}", file=sys.stderr)
    finally:
        job.stop()
        log.close()
        kill_strays(run, job.mine)
    return job.verdict() or (State.FAILED if job.failed else run.state)


def _direct(argv: List[str]) -> bool:
    return "torch.distributed.run" not in argv


def finish_status(run: Run, rc: int, exits=None, disturbance: Optional[dict] = None,
                  limits: Optional[dict] = None) -> str:
    """Turn the job's exit code and the files its ranks left into the run's final status, in one transition
    (with ``disturbance``, the CPU figures, when the launcher measured them). ``exits``: (rank, exit code) of
    the failed ranks started directly; else they are read from torchrun's report. ``limits``: the run's status
    as the launcher read it (its memory limit); read now when not given."""
    diverged = run.divergences()
    if diverged:
        d = min(diverged, key=lambda x: x.get("step", 0))
        run.mark_diverged(returncode=rc, rank=d.get("rank"), step=d.get("step"), error=d.get("error"),
                          disturbance=disturbance)
        return State.DIVERGED
    if rc == 0:
        run.mark_done(0, disturbance=disturbance)
        return State.DONE
    rank, why = failure_cause(run, exits=exits)
    st = run.status() if limits is None else limits
    limit = st.get("rank_limit_mb")
    if limit and out_of_memory(run, why):
        who = "a rank" if rank is None else f"rank {rank}"
        run.mark_failed(f"out of memory: {who} passed its limit of {limit} MB "
                        f"({st.get('rank_limit_from') or 'rank_mb'}); make the batch or the images smaller",
                        returncode=rc, rank=rank, cause=why, disturbance=disturbance)
        return State.FAILED
    run.mark_failed(why or f"the job exited with code {rc}; see {runfiles.LOG}", returncode=rc, rank=rank,
                    disturbance=disturbance)
    return State.FAILED


OOM_SIGNS = ("MemoryError", "can't allocate memory", "Cannot allocate memory", "cannot allocate memory",
             "std::bad_alloc", "out of memory")
"""What a rank says when an allocation fails: Python's MemoryError, torch's CPU allocator ("can't allocate
memory: you tried to allocate N bytes"), an errno 12, C++'s bad_alloc, glibc's "cannot allocate memory
for thread-local data" (before it aborts)."""

THREAD_FAILED = "RuntimeError: Resource temporarily unavailable"
"""A thread that could not be started (std::system_error, EAGAIN): its stack could not be mapped."""


def out_of_memory(run: Run, why: Optional[str]) -> bool:
    """Whether a failed run's cause (``why``, failure_cause's) is an allocation that failed: said so in the
    failing rank's error, or, for a rank that died without one (an abort, a crash in C++), in the log."""
    if why and (any(s in why for s in OOM_SIGNS) or why == THREAD_FAILED):
        return True
    silent = not why or "was killed by" in why or "exited with code" in why
    return silent and any(s in run.log_tail(400) for s in OOM_SIGNS)


PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout")


def failure_cause(run: Run, exits=None):
    """(rank, message) of the rank that caused a failure.

    When one rank dies, its peers fail too, with errors about the lost
    connection, and torchrun stops the rest with SIGTERM; torchrun's own "root
    cause" is not reliable when these land within a second. So the cause is,
    in order: a rank whose error is not a lost peer; a rank that died without
    an error file (a signal other than SIGTERM, os._exit, a crash in C++);
    the earliest error file.
    """
    if exits is None:  # (rank, exit code) of the failed ranks, from torchrun's report
        exits = rank_exits_from_log(run.log_tail(400))
    errs = {e.get("rank"): e for e in run.errors()}
    real = [e for e in errs.values() if not any(p in (e.get("error") or "") for p in PEER_LOST)]
    silent = [(r, c) for r, c in exits if r not in errs and c != -signal.SIGTERM]
    if silent and not real:  # died without a word (a signal, os._exit, a crash in C++)
        rank, code = silent[0]
        return rank, _signal_message(rank, code) if code < 0 else \
            f"rank {rank} exited with code {code} without reporting an error"
    pick = real or list(errs.values())
    if pick:
        first = min(pick, key=lambda e: e.get("time", 0))
        return first.get("rank"), first.get("error")
    for rank, code in exits:
        return rank, _signal_message(rank, code) if code < 0 else f"rank {rank} exited with code {code}"
    return None, None


def rank_exits_from_log(text: str):
    """(rank, exit code) of every failed rank in torchrun's failure report."""
    import re
    return [(int(r), int(c)) for r, c in
            re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text)]


def _signal_message(rank: int, code: int) -> str:
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"rank {rank} was killed by {name}" + (" (out of memory, or kill -9)" if code == -9 else "")


def kill_strays(run: Run, ranks=None) -> None:
    """SIGKILL any rank of this run that is still alive (verified by pid, start time and command line); with
    ``ranks``, only those (a node of several, whose other ranks are another node's)."""
    for ident in run.worker_pids():
        if ranks is None or ident.get("rank") in ranks:
            procs.kill_if_ours(ident, str(run.path))
