"""The processes of a fault-tolerant run (``fault_tolerance: {enabled: true}``), as the launcher's follow loop drives
them (commlab/lab/rundir/launcher.py):

    job = FtJob(run, spec, log)      # nothing started yet
    job.start()                      # the Lighthouse (torchft's quorum server), then one process per replica group
    while job.verdict() is None:     # exits seen, restarts due, the end
        job.feed(new_metric_lines)   # the faults: SIGKILL replica r once it has logged step s
        job.poll()
    job.stop()                       # every process still running, by the PID it was started with

Faults come from the spec (``fault_tolerance.faults``) or are asked for while the run goes on (``request_fault``,
``commlab fault RUN --kill REPLICA``): the request is a line in fault-requests.jsonl, which the follow loop reads
and executes as it polls.

What torchft decides (membership, quorum, commit, recovery) happens in the replicas (commlab/engine/ft.py); what
the lab does is here: start the Lighthouse and the replicas, execute the spec's faults, restart a replica that died
after its delay (up to ``restart.max_restarts`` over the run), and end the run when the replicas have trained to the
last step. Every process started is kept and recorded with its PID in ft-events.jsonl, and only those are ever
signalled. The replicas (the lab's worker, or your script) are forked by the warm server where there is one
(commlab/lab/base/warm.py), as a one-machine run's ranks are: a replica restarted after a kill then trains within a
second instead of importing torch again, which on a loaded machine took seconds of the CPU its peers trained on.

The end: the run is done when a replica has trained every step and exited 0; the others still running are then
given ``timeout_s`` (they finish the same last step) before they are stopped. It fails when every replica is gone
with no restart left, or when the Lighthouse dies.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from commlab.engine import ft_lighthouse, runfiles
from commlab.engine.runlog import JsonlTail, JsonlWriter, write_json_atomic
from commlab.engine.spec import JobSpec
from commlab.lab.base import procs, warm
from commlab.lab.base.torchrun import free_port, worker_argv, worker_env

RESTART_AFTER_MAX_S = 3600.0
"""The longest restart delay a fault asked for while the run goes on may give (``request_fault``)."""
CUT_MAX_S = 3600.0
"""The longest cut or slowdown a fault asked for while the run goes on may give."""
LENGTH = {"cut": "a cut's length", "slow": "a slowdown's length"}
SLOW_SPEED = (0.01, 1.0)
"""The speeds a slow fault asked for while the run goes on may give: from SLOW_SPEED[0], below SLOW_SPEED[1]."""
LIGHTHOUSE_UP_S = 120.0
"""How long the Lighthouse may take to accept connections (a tenth of a second when the machine is idle)."""


class FtJob:
    def __init__(self, run, spec: JobSpec, log, python: str = sys.executable, memory: Optional[int] = None,
                 nodes=None, cluster=None):
        """``log``: the file the replicas write to (log.txt); ``memory``: MB of data each replica may use (a room's
        ``rank_mb``), as the launcher limits ranks. ``nodes`` (commlab.lab.rundir.launcher.Nodes): this process is
        one machine of several sharing the run directory: node 0 starts the Lighthouse on the master address and
        port, every node its own block of replica groups (``mine``), whose faults it executes and whose restarts
        it makes. ``cluster`` (commlab.lab.net.netns.Cluster, a shaped link): each replica runs in its namespace,
        reached at its address, and the Lighthouse on the cluster's bridge (``hub``); every process is started
        from here (none forked warm: a fork would stay in this namespace)."""
        self.cluster = cluster
        self.run, self.spec, self.log, self.python, self.memory = run, spec, log, python, memory
        self.ft = spec.fault_tolerance
        self.groups = self.ft.replica_groups
        self.nodes = nodes
        if nodes is not None and self.groups % nodes.nnodes:
            raise ValueError(f"fault_tolerance.replica_groups: {self.groups} do not split over {nodes.nnodes} nodes")
        per = self.groups // (nodes.nnodes if nodes is not None else 1)
        first = per * (nodes.node_rank if nodes is not None else 0)
        self.mine = range(first, first + per)
        """The replica groups this process starts, restarts and executes faults on (every one on one machine)."""
        self.events = JsonlWriter(str(run.file(runfiles.FT_EVENTS)))
        self.started: List[subprocess.Popen] = []
        """Every process started here (the Lighthouse, every generation of every replica), to stop at the end."""
        self.lighthouse: Optional[subprocess.Popen] = None
        self.addr = ""
        self.live: Dict[int, Tuple[subprocess.Popen, int]] = {}
        """replica -> (its process now, its generation)."""
        self.gens: Dict[int, int] = {}
        self.restarts_left = self.ft.restart.max_restarts
        self.due: List[Tuple[float, int]] = []
        """(when, replica) of the restarts waiting for their delay."""
        self.faults = [dict(f, done=False) for f in self.ft.faults if f["kind"] in ("kill", "cut", "hang")]
        """The spec's kills, cuts and hangs (a slow fault is its replica's own: its Stepper stretches its compute)."""
        self.spawned: Dict[int, float] = {}
        """replica -> when its latest process started (time.time(), as the metric lines' ``t``)."""
        self.stepped: set = set()
        """Replicas whose latest process has logged a step."""
        self.cut: Dict[int, Tuple[float, subprocess.Popen, int]] = {}
        """replica -> (when its cut ends, monotonic; its process, stopped; its generation)."""
        self.requests = JsonlTail(run.file(runfiles.FAULT_REQUESTS))
        """Faults asked for while the run goes on (``request_fault``)."""
        self.slowdowns: Dict[str, dict] = {}
        """replica (str) -> {speed, until}: the slow faults asked for, as slowdowns.json holds them."""
        self.killed: Dict[int, float] = {}
        """replica -> restart delay of the fault that killed its process now dying."""
        self.finished: Dict[int, int] = {}
        """replica -> generation whose process trained to the end (exit 0)."""
        self.failures: List[Tuple[int, int]] = []
        """(replica, exit code) of every process that died on its own (not by a fault)."""
        self.script: Optional[Tuple[List[str], str]] = None
        """(argv, cwd) of your own script each replica group runs (script.json, ``commlab run --script``, read at
        the start), or None: the lab's worker."""
        self.server = None
        """The warm server's socket, which forks the replicas, or None: each replica is a process of this one."""
        self.t_first_finish: Optional[float] = None
        self.failed: Optional[str] = None
        """Why the run cannot go on (the Lighthouse died, every replica gone), or None."""

    # -- starting -------------------------------------------------------------
    def _record(self, event: str, **kw) -> None:
        node = {} if self.nodes is None else {"node": self.nodes.node_rank}  # which machine did it
        self.events.write({"event": event, "t": time.time(), **node, **kw})

    def _spawn(self, argv: List[str], env: dict, log, memory: Optional[int] = None,
               cwd: Optional[str] = None) -> subprocess.Popen:
        def child() -> None:
            procs.die_with_parent()
            procs.limit_data(memory)
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True, preexec_fn=child, cwd=cwd)
        self.started.append(p)
        return p

    def _warm(self, argv: List[str], env: dict, cwd: Optional[str] = None):
        """The lab's worker (or your script) with ``argv`` and ``env``, forked by the warm server (a
        ``warm.WarmRank``), or None when there is none or it fails (the caller then starts a process of its own)."""
        log = getattr(self.log, "name", None)
        if self.server is None or not isinstance(log, str):
            return None
        got = warm.start(self.server, [(argv, env)], log, cwd=cwd, memory=self.memory)
        if got is None:
            self.server = None  # it failed once: every later replica a process of this one
            return None
        self.started.append(got[0])
        return got[0]

    def start(self) -> None:
        """The Lighthouse, once it accepts connections, then every replica group (generation 0), running the run's
        script.json if it has one (read once the Lighthouse serves: with several nodes, node 0 writes it before it
        starts the Lighthouse)."""
        nodes, cluster = self.nodes, self.cluster
        host, port = ("127.0.0.1", free_port()) if nodes is None else (nodes.master_addr, nodes.port)
        bind = "127.0.0.1" if nodes is None and cluster is None else "[::]"  # one machine: loopback only
        if cluster is not None:
            host = cluster.hub  # the bridge's namespace has its own ports: any is free there
        self.addr = f"http://{host}:{port}"
        if nodes is None or nodes.node_rank == 0:
            ft = self.ft
            # The Lighthouse serves a dashboard whose buttons kill replicas, to anyone who reaches its port: on one
            # machine only the machine's own processes reach it; across machines (or a modeled cluster's bridge,
            # a namespace of its own) the replicas elsewhere must.
            argv = [self.python, ft_lighthouse.__file__, "--bind", f"{bind}:{port}",
                    "--min_replicas", str(ft.min_replicas), "--join_timeout_ms", str(ft.join_timeout_ms),
                    "--quorum_tick_ms", str(ft.quorum_tick_ms), "--heartbeat_timeout_ms", str(ft.heartbeat_timeout_ms)]
            if cluster is not None:
                argv = cluster.exec_hub_argv(argv)
            lh_log = open(self.run.file(runfiles.LIGHTHOUSE_LOG), "ab", buffering=0)
            env = {**worker_env(), "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
            self.lighthouse = self._spawn(argv, env, lh_log)
            lh_log.close()  # the child has its own descriptor
            self._record("lighthouse", pid=self.lighthouse.pid, addr=self.addr, argv=argv)
        deadline = time.monotonic() + LIGHTHOUSE_UP_S
        while True:  # node 0's Lighthouse; on the other nodes, the one node 0 starts
            if self.lighthouse is not None and self.lighthouse.poll() is not None:
                raise RuntimeError(f"fault_tolerance: the Lighthouse exited with code {self.lighthouse.returncode} "
                                   f"before it served; see {runfiles.LIGHTHOUSE_LOG}")
            if cluster is not None:
                if cluster.accepts(port, timeout=0.5):
                    break
            else:
                with contextlib.suppress(OSError):
                    socket.create_connection((host, port), timeout=0.5).close()
                    break
            if time.monotonic() > deadline:
                where = runfiles.LIGHTHOUSE_LOG if self.lighthouse is not None else "node 0's output"
                raise RuntimeError(f"fault_tolerance: the Lighthouse at {host}:{port} did not accept connections "
                                   f"within {LIGHTHOUSE_UP_S:g} s; see {where}")
            time.sleep(0.1)
        self.script = read_script(self.run)
        if self.python == sys.executable and cluster is None:  # the warm server runs this interpreter
            self.server = warm.ready()
        for r in self.mine:
            self._start_replica(r)

    def _start_replica(self, r: int) -> None:
        gen = self.gens.get(r, -1) + 1
        self.gens[r] = gen
        env = {**worker_env(), "RUST_LOG": os.environ.get("RUST_LOG", "warn"), "RANK": str(r),
               "WORLD_SIZE": str(self.groups), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(self.groups),
               ft_lighthouse.LIGHTHOUSE_ENV: self.addr, ft_lighthouse.GEN_ENV: str(gen)}
        inside = (lambda a: a) if self.cluster is None else (lambda a: self.cluster.exec_argv(r, a))
        if self.cluster is not None:  # in its namespace, reached at its address there
            env.update(self.cluster.env(r))
            env[ft_lighthouse.HOST_ENV] = self.cluster.addresses[r]
        if self.script is None:
            argv = [self.python, *worker_argv(str(self.run.path))]
            p = self._warm(argv, env) or self._spawn(inside(argv), env, self.log, self.memory)
        else:  # your own loop: commlab.wrap finds the run and its replica group in the environment
            env[ft_lighthouse.RUN_DIR_ENV] = str(self.run.path)
            argv, cwd = self.script
            argv = [self.python, *argv]
            p = self._warm(argv, env, cwd) or self._spawn(inside(argv), env, self.log, self.memory, cwd=cwd)
        self.live[r] = (p, gen)
        self.spawned[r] = time.time()
        self.stepped.discard(r)
        self._record("spawn", replica=r, gen=gen, pid=p.pid)

    def identities(self) -> List[dict]:
        """The processes started so far (pid and start time), for the run's status."""
        return [procs.identity(p.pid) for p in self.started]

    # -- following --------------------------------------------------------------
    def feed(self, rows: List[dict]) -> None:
        """New metric lines: execute the faults whose step a replica has now logged (each fault once)."""
        for row in rows:
            if row.get("kind") == "final" and self.t_first_finish is None:  # a replica, of any node, trained to the end
                self.t_first_finish = time.monotonic()
                self._nothing_to_rejoin()
            if row.get("kind") != "step" or "replica" not in row:
                continue
            r, step = row["replica"], row.get("step", -1)
            if row.get("t", 0) >= self.spawned.get(r, float("inf")):
                self.stepped.add(r)
            for f in self.faults:
                if f["done"] or f["replica"] != r or step < f["step"] or r not in self.live:
                    continue
                p, gen = self.live[r]
                if p.poll() is not None:
                    continue
                f["done"] = True
                if f["kind"] == "kill":
                    self._kill(r, f["restart_after_s"], step=step, fault=f["step"])
                elif r not in self.cut:  # a hang: a cut with no end
                    self._cut(r, f.get("seconds"), step=step, fault=f["step"])

    def _cut(self, r: int, seconds: Optional[float], **record) -> None:
        """Cut replica ``r`` off for ``seconds``: SIGSTOP its process (its session: the one started for it), so its
        peers and the Lighthouse hear nothing from it, neither traffic nor heartbeats, as across a cut link; SIGCONT
        when the time is up (``poll``). Unlike a cut link, it computes nothing meanwhile. ``seconds`` None: a hang,
        stopped until a kill or the run's end."""
        p, gen = self.live[r]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGSTOP)
        self.cut[r] = (time.monotonic() + (float("inf") if seconds is None else seconds), p, gen)
        if seconds is None:
            self._record("hang", replica=r, gen=gen, pid=p.pid, **record)
        else:
            self._record("cut", replica=r, gen=gen, pid=p.pid, seconds=seconds, **record)

    def _reconnect(self, r: int, why: str) -> None:
        """End replica ``r``'s cut: SIGCONT its process (if it still runs)."""
        _, p, gen = self.cut.pop(r)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGCONT)
        self._record("reconnect", replica=r, gen=gen, pid=p.pid, why=why)

    def _kill(self, r: int, after: Optional[float], **record) -> None:
        """SIGKILL replica ``r``'s process (the one started for it, by its PID); it restarts after ``after`` s (None:
        ``restart.delay_s``) while restarts are left."""
        p, gen = self.live[r]
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
        self.cut.pop(r, None)  # a stopped process dies of SIGKILL as well
        self.killed[r] = self.ft.restart.delay_s if after is None else after
        self._record("kill", replica=r, gen=gen, pid=p.pid, **record)

    def _slow(self, r: int, speed: float, seconds: float, **record) -> None:
        """Replica ``r`` computes at ``speed`` of its speed for ``seconds`` from now: slowdowns.json, which its
        Stepper reads before each step (commlab.engine.runfiles.read_slowdown); a restarted process reads it too."""
        until = time.time() + seconds
        self.slowdowns[str(r)] = {"speed": speed, "until": until}
        path = self.run.file(runfiles.SLOWDOWNS)
        try:  # on several machines each node writes its own replicas' entries into the one file
            with open(path) as f:
                theirs = {k: v for k, v in json.load(f).items() if int(k) not in self.mine}
        except (OSError, ValueError, AttributeError, TypeError):
            theirs = {}
        write_json_atomic(path, {**theirs, **self.slowdowns})
        self._record("slow", replica=r, speed=speed, seconds=seconds, until=until, **record)

    def _asked(self) -> None:
        """Execute the faults asked for since the last poll (fault-requests.jsonl): a kill or a cut of a replica whose
        process runs, a slowdown of any replica; one that cannot be done now is recorded as refused, with why."""
        for req in self.requests.read():
            r, by, after, kind = req.get("replica"), req.get("by"), req.get("restart_after_s"), req.get("kind")
            seconds, speed = req.get("seconds"), req.get("speed")
            if isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.groups and r not in self.mine:
                continue  # another node's replica group: that node executes it
            why = None
            if kind not in ("kill", "cut", "slow") or isinstance(r, bool) or not isinstance(r, int) \
                    or not 0 <= r < self.groups:
                why = f"not a kill, a cut or a slowdown of a replica in 0..{self.groups - 1}"
            elif kind == "kill" and after is not None and (isinstance(after, bool) or not isinstance(after, (int, float))
                                                           or not 0 <= after <= RESTART_AFTER_MAX_S):
                why = f"restart_after_s: seconds in [0, {RESTART_AFTER_MAX_S:g}] or null, got {after!r}"
            elif kind != "kill" and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                     or not 0 < seconds <= CUT_MAX_S):
                why = f"seconds: {LENGTH.get(kind)} in (0, {CUT_MAX_S:g}], got {seconds!r}"
            elif kind == "slow" and (isinstance(speed, bool) or not isinstance(speed, (int, float))
                                     or not SLOW_SPEED[0] <= speed < SLOW_SPEED[1]):
                why = f"speed: a share of its speed in [{SLOW_SPEED[0]:g}, {SLOW_SPEED[1]:g}), got {speed!r}"
            elif self.t_first_finish is not None:
                why = "training is over"
            elif kind != "slow" and (r not in self.live or self.live[r][0].poll() is not None):
                why = f"replica {r} is not running now (it is restarting, or has finished)"
            elif kind == "cut" and r in self.cut:
                why = f"replica {r} is cut off already"
            if why is not None:
                self._record("refused", replica=r, by=by, why=why, requested=True)
            elif kind == "kill":
                self._kill(r, after, requested=True, by=by)
            elif kind == "cut":
                self._cut(r, float(seconds), requested=True, by=by)
            else:
                self._slow(r, float(speed), float(seconds), requested=True, by=by)

    def poll(self) -> None:
        """Faults asked for, cuts that end, exits seen, restarts due, stragglers after the end."""
        self._asked()
        now = time.monotonic()
        for r, (until, _, _) in list(self.cut.items()):
            if now >= until:
                self._reconnect(r, "the cut's time is up")
        if self.lighthouse is not None and self.lighthouse.poll() is not None and self.failed is None:
            self.failed = f"fault_tolerance: the Lighthouse exited with code {self.lighthouse.returncode}; " \
                          f"see {runfiles.LIGHTHOUSE_LOG}"
        for r, (p, gen) in list(self.live.items()):
            code = p.poll()
            if code is None:
                continue
            del self.live[r]
            self._record("exit", replica=r, gen=gen, pid=p.pid, code=code)
            if code == 0:
                self.finished[r] = gen
                if self.t_first_finish is None:
                    self.t_first_finish = now
                    self._nothing_to_rejoin()
                continue
            delay = self.killed.pop(r, None)
            if delay is None:
                self.failures.append((r, code))
                delay = self.ft.restart.delay_s
            if self.t_first_finish is None and self.restarts_left > 0:
                self.restarts_left -= 1
                self.due.append((now + delay, r))
        for when, r in list(self.due):
            if self.t_first_finish is not None:  # training is over: nothing to rejoin
                self.due.remove((when, r))
            elif now >= when:
                self.due.remove((when, r))
                self._start_replica(r)
        if self.t_first_finish is not None and self.live and now - self.t_first_finish > self.ft.timeout_s:
            for r in list(self.cut):
                self._reconnect(r, "the others finished training")
            for r, (p, gen) in self.live.items():
                self._record("stop", replica=r, gen=gen, pid=p.pid, why="the others finished training")
            procs.stop([p for p, _ in self.live.values()])
        if not self.live and not self.due and not self.finished and self.failed is None:
            self.failed = "fault_tolerance: every replica is gone and no restart is left"

    def _nothing_to_rejoin(self) -> None:
        """Training is over (a replica trained to the last step): a restarted replica that has logged no step yet
        has no peer left to recover from and would train alone from the start; it is stopped."""
        hung = {r for r, (until, _, _) in self.cut.items() if until == float("inf")}  # nothing to wait for either
        late = {r: pg for r, pg in self.live.items()
                if (r not in self.stepped or r in hung) and pg[0].poll() is None}
        for r, (p, gen) in late.items():
            if r in self.cut:  # a stopped process would not see the SIGTERM
                self._reconnect(r, "training is over")
            self._record("stop", replica=r, gen=gen, pid=p.pid,
                         why="training is over: " + ("it hung" if r in hung else "nothing to rejoin"))
        if late:
            procs.stop([p for p, _ in late.values()])

    def verdict(self) -> Optional[str]:
        """None while the run goes on; "done" when it trained to the end and nothing runs; "failed" otherwise."""
        if self.failed is not None:
            return "failed"
        if self.finished and not self.live:
            return "done"
        return None

    def stop(self) -> None:
        """Stop every process started here that still runs (by its PID: its session), the Lighthouse last."""
        replicas = [p for p in self.started if p is not self.lighthouse]
        for r in list(self.cut):  # a stopped process would not see the SIGTERM that stops it
            self._reconnect(r, "the run ended")
        for r, (p, gen) in self.live.items():
            if p.poll() is None:
                self._record("stop", replica=r, gen=gen, pid=p.pid, why="the run ended")
        procs.stop(replicas)
        if self.lighthouse is not None:
            if self.lighthouse.poll() is None:
                self._record("stop", pid=self.lighthouse.pid, why="the run ended", lighthouse=True)
            procs.stop([self.lighthouse])
        self.events.close()



def write_script(run, argv: List[str], cwd: str) -> None:
    """Have each replica group of the fault-tolerant ``run`` run your own script (``argv``: the script and its
    arguments, run with the lab's Python from ``cwd``) instead of the lab's worker: script.json, read as it starts."""
    write_json_atomic(run.file(runfiles.SCRIPT), {"argv": list(argv), "cwd": cwd})


def read_script(run) -> Optional[Tuple[List[str], str]]:
    """(argv, cwd) of the run's script.json, or None when it has none. A file that is not what the protocol says
    is a RuntimeError naming it (the run fails with it rather than train the lab's worker instead)."""
    path = run.file(runfiles.SCRIPT)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
        argv, cwd = doc["argv"], doc["cwd"]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise RuntimeError(f"{runfiles.SCRIPT}: cannot be read ({e})") from None
    if not argv or not all(isinstance(a, str) for a in argv) or not isinstance(cwd, str):
        raise RuntimeError(f"{runfiles.SCRIPT}: argv must be a non-empty list of strings and cwd a string")
    return argv, cwd


def request_fault(run, replica: int, restart_after_s: Optional[float] = None, by: str = "",
                  seconds: Optional[float] = None, speed: Optional[float] = None) -> dict:
    """Ask a running fault-tolerant ``run`` (a commlab.lab.rundir.store.Run) to kill ``replica`` now; the lab restarts
    it after ``restart_after_s`` (None: the spec's ``restart.delay_s``) while restarts are left. With ``seconds``: cut
    it off for that many seconds instead (a cut fault); with ``speed`` too: make it compute at that share of its
    speed for that many seconds (a slow fault). The run's follow loop executes it within a poll and records it in
    ft-events.jsonl (``kill``, ``cut`` or ``slow`` with ``requested``, or ``refused`` with why). ValueError, naming
    the field, when the run or the request cannot take it."""
    st = run.status()
    if st.get("state") != "running":
        raise ValueError(f"RUN: {run.id} is {st.get('state')}; faults go to a running run")
    ft = st.get("fault_tolerance")
    if not ft:
        raise ValueError(f"RUN: {run.id} is not fault tolerant (fault_tolerance.enabled): killing a worker would "
                         "end it")
    groups = int(ft.get("replica_groups", 0))
    kind = "kill" if seconds is None and speed is None else "cut" if speed is None else "slow"
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < groups:
        raise ValueError(f"--{kind}: a replica group in 0..{groups - 1}, got {replica!r}")
    if kind != "kill":
        if restart_after_s is not None:
            raise ValueError(f"--restart-after: only a kill is restarted; a {'cut' if kind == 'cut' else 'slowed'} "
                             "replica goes on by itself")
        if seconds is None or not 0 < seconds <= CUT_MAX_S:
            raise ValueError(f"--seconds: {LENGTH[kind]} in (0, {CUT_MAX_S:g}], got {seconds}")
        req = {"kind": kind, "replica": replica, "seconds": seconds, "by": by, "t": time.time()}
        if kind == "slow":
            if not SLOW_SPEED[0] <= speed < SLOW_SPEED[1]:
                raise ValueError(f"--speed: a share of its speed in [{SLOW_SPEED[0]:g}, {SLOW_SPEED[1]:g}), "
                                 f"got {speed:g}")
            req["speed"] = speed
    else:
        if restart_after_s is not None and not 0 <= restart_after_s <= RESTART_AFTER_MAX_S:
            raise ValueError(f"--restart-after: seconds in [0, {RESTART_AFTER_MAX_S:g}], got {restart_after_s:g}")
        req = {"kind": "kill", "replica": replica, "restart_after_s": restart_after_s, "by": by, "t": time.time()}
    w = JsonlWriter(str(run.file(runfiles.FAULT_REQUESTS)))
    try:
        w.write(req)
    finally:
        w.close()
    return req
