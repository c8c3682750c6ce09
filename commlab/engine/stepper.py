"""What a rank does around its optimizer step, shared by the Trainer and a user's own loop.

A ``Stepper`` owns, for one rank: the communicator the spec asks for (commlab/engine/comm/modes.py: ``Sync``,
``WFBP`` or ``DeAR``), the stock ``torch.optim`` optimizer over what that communicator
hands it (``optimizer_params()``: the model's parameters, or DeAR's shards), the tuning driver
(``tuners.start``: mergecomp, layerfusion or dear's buffer-cap search) and the writers of the run directory
(``timeline-rank<r>.jsonl``, ``metrics.jsonl``, ``layout.json``). The caller runs forward and
backward; ``step()`` does the rest of the iteration:

    finish the exchange -> divergence check -> optimizer.step -> zero_grad -> log -> tuners

With a method (commlab/engine/methods/: local SGD, DiLoCo, ...) its hooks run around that: ``begin`` at each
step boundary decides whether the communicator exchanges the next step's gradients (wfbp sends during
backward), ``after_backward`` after the finish, ``after_optimizer_step`` after the optimizer (periodic
syncs). Step lines then carry ``method``, ``sync_ms`` and, on steps with an exchange of the method's,
``sync_bytes``; ``bytes_sent`` counts what the step sent (0 on a local step).

Fault tolerance (``ft``, a replica group's ``commlab.engine.ft.Replica``): ``begin_step`` joins the step's quorum
before the forward pass (a replica that is behind recovers there), the exchange averages over the quorum's
participants, and the optimizer steps only when the step commits (``Replica.should_commit``); a step that does
not commit is logged with ``committed: false`` and trained again. Step lines then carry ``replica``,
``quorum_id``, ``participants``, ``committed``, ``quorum_ms`` and ``commit_ms``.

Under a method as well, its steps are local and join no quorum: the method's syncs join one and commit
(``Quorum``, through ``Context.quorum``), and so do the steps that exchange gradients (post-local SGD's warm-up)
and this process's first step (the start: a quorum, a barrier, a commit). A recovery also hands over the method's
``state_dict()`` and this Stepper's position (its step, and whether it was at a step's start or in a sync); one
that lands in its peers' sync runs that sync from the recovered state. A sync that does not commit is not trained
again: the step moves on (the method puts back what it covers). Step lines carry ``replica``, the last quorum's
``quorum_id`` and ``participants``, and ``quorum_ms``, ``committed`` and ``commit_ms`` on the steps that joined one.

``commlab.engine.trainer.Trainer`` drives it from its data loop; ``commlab.wrap`` from the user's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
from typing import Callable, Optional

import torch

from commlab.engine import cluster, netmodel, runfiles, schedules, tuners
from commlab.engine.comm import modes
from commlab.engine.comm.core import Communicator
from commlab.engine.compressors.plan import Plan
from commlab.engine.methods.base import Context, Method, Quorum, cloned, without_residuals
from commlab.engine.muon import MuonAdamW, embeddings
from commlab.engine.probe import LayerProbe
from commlab.engine.runlog import JsonlWriter
from commlab.engine.spec import MUON_ADAMW_LR, MUON_MOMENTUM, JobSpec
from commlab.engine.timeline import Clock, CudaClock, Timeline

OptimizerFactory = Callable[[list], torch.optim.Optimizer]
"""Builds the optimizer over the parameters it is given: the model's, or DeAR's shards."""


def make_optimizer(spec: JobSpec, params, model: Optional[torch.nn.Module] = None):
    """The spec's optimizer over ``params``. muon: ``MuonAdamW``, which leaves the weights of ``model``'s
    embedding tables to AdamW (without ``model``, every 2-D parameter goes to Muon)."""
    o = spec.optimizer
    # a spec read as checked (spec.json of a version before muon) may lack the fields muon brought: their defaults
    momentum = o.momentum if o.momentum is not None else (MUON_MOMENTUM if o.name == "muon" else 0.0)
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=momentum, weight_decay=o.weight_decay)
    betas = tuple(o.betas) if o.betas else (0.9, 0.999)
    if o.name == "muon":
        return MuonAdamW(params, lr=o.lr, momentum=momentum, weight_decay=o.weight_decay,
                         adamw_lr=o.adamw_lr if o.adamw_lr is not None else MUON_ADAMW_LR,
                         betas=betas, exclude=embeddings(model) if model is not None else ())
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[o.name]
    return cls(params, lr=o.lr, betas=betas, weight_decay=o.weight_decay)


def decay_lr(optimizer, spec: JobSpec, step: int) -> None:
    """Set every group's learning rate for ``step`` (0-based) under ``optimizer.decay``: cosine, from the group's
    first rate (kept as ``initial_lr``, torch's lr_scheduler key, so it travels with the optimizer's state) down
    to 0 at ``spec.steps``."""
    if spec.optimizer.decay == "none":
        return
    factor = 0.5 * (1.0 + math.cos(math.pi * min(step, spec.steps) / spec.steps))
    for g in optimizer.param_groups:
        g["lr"] = g.setdefault("initial_lr", g["lr"]) * factor


def slow_factor(faults, step: int) -> float:
    """The share of its speed a replica keeps at ``step`` under its slow faults (fault_tolerance.faults of kind
    slow): the product of the speeds of those that cover the step (from ``step``, for ``steps`` or to the end)."""
    out = 1.0
    for f in faults:
        if f["step"] <= step and (f["steps"] is None or step < f["step"] + f["steps"]):
            out *= f["speed"]
    return out


def schedule_fn(spec: JobSpec):
    s = spec.schedule
    opts = {"cap_mb": s.cap_mb} if s.name == "bucket" else {}
    return functools.partial(schedules.build, s.name, **opts)


class Diverged(RuntimeError):
    """The averaged gradient is not finite: training cannot go on."""

    def __init__(self, step: int):
        super().__init__(f"diverged at step {step}: the averaged gradient is not finite (NaN or inf)")
        self.step = step


class Stepper:
    def __init__(self, spec: JobSpec, model: torch.nn.Module, run_dir: Optional[str], rank: int,
                 device: torch.device, group=None, make_opt: Optional[OptimizerFactory] = None, ft=None):
        self.spec, self.model, self.run_dir, self.rank, self.device = spec, model, run_dir, rank, device
        self.ft = ft
        """The replica group's fault tolerance (commlab.engine.ft.Replica), or None."""
        if ft is not None:
            group = ft.group  # the collectives run on the quorum's process group
        path = (lambda name: os.path.join(run_dir, name)) if run_dir else None
        clock = CudaClock(device) if device.type == "cuda" else Clock()
        self.timeline = Timeline(path(runfiles.TIMELINE.format(rank=rank)) if path else None, rank,
                                 enabled=spec.timeline, clock=clock)
        self.metrics = JsonlWriter(path(runfiles.METRICS)) if path else None
        self.probe = LayerProbe(model, self.timeline) if self.timeline.enabled else None
        self.group = group
        self._make_opt = make_opt or (lambda params: make_optimizer(self.spec, params, self.model))
        self._own_optimizer = make_opt is None
        """The spec's optimizer (its ``decay`` applies), not one a user's own loop passed in."""
        self.step = 0
        self.speed = cluster.speed_of(spec, rank)
        """This worker's compute speed (network.cluster, and a slow fault's while it lasts; 1.0 without either):
        below 1, ``slow_down`` stretches its forward and backward to 1/speed of what they took."""
        self._base_speed = self.speed
        self._slow_faults = [f for f in spec.fault_tolerance.faults if f["kind"] == "slow"
                             and f["replica"] == ft.n] if ft is not None else []
        """fault_tolerance.faults of kind slow on this replica group: its speed while each lasts"""
        self._asked: Optional[tuple] = None
        """(speed, until) of the slow fault last asked for this replica group while the run goes on, or None."""
        self._asked_version: Optional[tuple] = None
        self._slow_s = 0.0
        """Seconds ``slow_down`` waited in this step, for its line."""
        self.optimizer: Optional[torch.optim.Optimizer] = None
        # fault tolerance: no broadcast, the first quorum's recovery gives every replica the same start; a tuning
        # schedule's buckets were chosen before the replicas started (partition.json), the same for every replica,
        # a restarted one too: replicas that each searched would not agree
        self._build(_partition(spec, run_dir) if ft is not None else None, broadcast=ft is None)
        self.method: Optional[Method] = spec.method.build()
        """The method (commlab/engine/methods/), or None for method none (every step's gradients, nothing else)."""
        if ft is not None:
            # under a method the state is copied when it is sent: a sync that fails changes the parameters at once
            keep = cloned if self.method is not None else (lambda x: x)
            ft.register("model", self.model.load_state_dict, lambda: keep(self.model.state_dict()))
            ft.register("optimizer", lambda sd: self.optimizer.load_state_dict(sd),
                        lambda: keep(self.optimizer.state_dict()))
            ft.register("compressors", self._load_shared_codec_state, self._shared_codec_state)
        self._quorum: dict = {}
        """This step's quorum (fault tolerance), for its line."""
        self._codec_before: Optional[list] = None
        """Fault tolerance: each bucket's compressor state as the step began, put back when it does not commit."""
        self._method_before: Optional[dict] = None
        """A method that exchanges in every step (DeMo): its state as this step's quorum began, put back when the
        step does not commit."""
        self._exchanging = True
        """Whether this step exchanges gradients (the method's ``begin``; always without a method)."""
        # fault tolerance under a method: where this replica is, and what its quorums did this step
        self._joined = False
        """This process has joined a quorum (its first step joins one before it trains anything)."""
        self._at = "start"
        """Where this replica is when it joins a quorum, sent with its state: "start" (this process's first quorum),
        "step" (a step that exchanges gradients, before its forward pass) or "sync" (in the method's sync)."""
        self._healed_at: Optional[str] = None
        """Where the source of this quorum's recovery was, or None (no recovery)."""
        self._sync_joined: Optional[int] = None
        """The step of a sync whose quorum is joined already (a recovery at a step's start that landed in a sync)."""
        self._rec: dict = {}
        """This step's quorum and commit, for its line (under a method: only the steps that joined one)."""
        if self.method is not None:
            if ft is not None and not self.method.fault_tolerant:  # a user's method the spec check could not import
                raise RuntimeError(f"method.name: {spec.method.name} {self.method.NOT_FAULT_TOLERANT}")
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            sec = spec.method.compressor
            self.ctx = Context(params=[p for _, p in named], names=[n for n, _ in named], world=self.dp.world,
                               rank=self.dp.rank, group=group, link=self.dp.link, timeline=self.timeline,
                               plan=Plan.from_section(sec) if sec else None, on_issue=self._fault_in_sync,
                               quorum=_SyncQuorum(self) if ft is not None else None, optimizer=self.optimizer)
            self.method.setup(self.ctx)
            if ft is not None:
                ft.register("method", self.method.load_state_dict, lambda: cloned(self.method.state_dict()))
                ft.position = lambda: {"step": self.step, "at": self._at}
                ft.on_position = self._recovered_position
            self._begin()

    def _build(self, layout: Optional[dict] = None, broadcast: bool = True) -> None:
        """The communicator, optimizer and tuning driver ``self.spec`` asks for, over the model.
        ``broadcast``: the communicator starts by broadcasting rank 0's parameters and buffers (not on a
        switch: the ranks hold the same parameters already, and on a slow link the broadcast of the whole
        model was most of a switch's time)."""
        spec, model, group = self.spec, self.model, self.group
        # each bucket's own compressor instance, by its size where compressor.per_bucket has rules
        plan = Plan.from_section(dataclasses.asdict(spec.compressor))
        # dear: ZeRO-style, the optimizer steps this rank's shard of every buffer (commlab/engine/comm/dear.py)
        buckets = self._dear_layout() if spec.comm.mode == "dear" else schedule_fn(spec)
        self.dp: Communicator = modes.make(spec.comm.mode, model, buckets, plan, timeline=self.timeline,
                                           group=group, link=netmodel.from_spec(spec.network, spec.seed),
                                           broadcast_from_rank0=broadcast)
        if self.probe:
            self.probe.follow(self.dp)  # one gradient hook per parameter: the communicator's
        if layout is not None:  # a partition given (strategy auto's MergeComp trial, partition.json): names and cuts
            if sorted(layout["order"]) != sorted(self.dp.order_names):
                raise RuntimeError("schedule: the partition given names other parameters than this model's "
                                   f"({len(layout['order'])} against {len(self.dp.order_names)}); was the model "
                                   "changed? search again (schedule.retune: true)")
            order = [self.dp.order_names.index(n) for n in layout["order"]]
            self.dp.relayout(schedules.from_cuts([self.dp.infos[i] for i in order], layout["cuts"]), order)
        params = self.dp.optimizer_params()
        old = self.optimizer
        mine = [p for g in old.param_groups for p in g["params"]] if old is not None else []
        # the same parameters (not dear's shards), in any order (muon groups the matrices first): its state goes on
        if len(mine) == len(params) and {id(p) for p in mine} == {id(p) for p in params}:
            self.optimizer = old
        else:
            self.optimizer = self._make_opt(params)
        self.dp.attach(self.optimizer)
        own = self.rank == 0 and self.run_dir
        if own:
            self.write_layout()
        self.tuning = None if layout is not None else tuners.start(
            spec, self.dp, self.run_dir, self.timeline, group, on_layout=self.write_layout if own else None,
            log=self.log)
        """mergecomp, layerfusion, dear's cap search: the tuning driver, which relayouts at step boundaries."""

    def switch(self, spec: JobSpec, layout: Optional[dict] = None) -> None:
        """Another strategy from the next step on (strategy auto's trials, then its choice): the
        communicator, tuning driver and, where the parameters it steps change (dear's shards), the
        optimizer are rebuilt for ``spec`` over the same model; the timeline, layer probe, metrics and
        step count go on. Every rank calls it at the same step boundary. The old communicator's
        compressor state (error-feedback residuals) is dropped: the new strategy starts afresh.
        ``layout`` ({"order": names, "cuts": [...]}) fixes the buckets instead of a tuner."""
        self.dp.sync_params()  # dear: the model holds the latest parameters before its shards go
        self.dp.close()
        self.spec = spec
        self._build(layout, broadcast=False)

    def _dear_layout(self):
        """dear's buffers: by comm.layers or by schedule.cap_mb (with comm.tune, its default: the cap search
        relayouts to its first trial cap before the first step)."""
        cm = self.spec.comm
        if cm.layers is not None:
            return functools.partial(schedules.layout_layers, layers=cm.layers)
        return functools.partial(schedules.layout_cap, cap_mb=self.spec.schedule.cap_mb)

    def sync_params(self) -> None:
        """Complete pending parameter all-gathers (dear), so the model holds the latest parameters."""
        self.dp.sync_params()

    def slow_down(self, what: str, t_from: float, t_to: float, m_to):
        """A slower worker (``speed`` s < 1, from network.cluster): at the end of a compute phase (``what``:
        forward or backward) that ran from ``t_from`` to ``t_to`` (host times of ``timeline.now()``; ``m_to``:
        the mark taken at ``t_to``), wait (1/s - 1) times what it took, so that it takes 1/s as long as measured,
        and record the wait as a ``slow`` span. Returns the time and mark after the wait, which stand for the
        phase's end from then on (its forward or backward span, its ``_ms`` field include the wait); with s = 1
        ``(t_to, m_to)`` at once. What runs during the phase (wfbp's and dear's collectives, issued from its
        hooks) is issued as fast as the machine computes: only the end of the phase is late."""
        if self.speed >= 1.0:
            return t_to, m_to
        tl = self.timeline
        if self.device.type == "cuda":  # what the phase took on the device, not how long its launches took
            torch.cuda.synchronize(self.device)
            t_to = tl.now()
        measured = t_to - t_from
        until = t_to + (1.0 / self.speed - 1.0) * measured
        t = tl.now()
        while t < until:  # time.sleep may wake a little early
            time.sleep(until - t)
            t = tl.now()
        tl.span("slow", f"slow {what} x{1.0 / self.speed:.3g}", t_to, t,
                {"step": self.step, "speed": self.speed, "measured_ms": round(measured * 1e3, 3)})
        self._slow_s += t - t_to
        return t, tl.mark()

    def begin_step(self) -> Optional[int]:
        """Before a step's forward pass, under fault tolerance: join the step's quorum (recovering first when this
        replica is behind) and average over its participants. Returns the step to train: the committed steps so
        far, the same again after a step that did not commit. Without fault tolerance, the step count.

        Under a method, only the steps that exchange gradients (post-local SGD's warm-up) and this process's first
        step join a quorum here; the method's syncs join theirs (``Quorum``), and the other steps are local. A
        recovery here that lands in the peers' sync runs that sync with them, and the next step is trained; None
        when that sync was the run's last step."""
        if self.ft is None:
            return self.step
        if self.method is not None:
            s = self._begin_step_method()
        else:
            q = self.ft.start_quorum()
            self.step = s = q.pop("step")
            self._take_quorum(q)
        if s is not None:
            self.speed = self._base_speed * slow_factor(self._slow_faults, s) * self._asked_speed()
        return s

    def _asked_speed(self) -> float:
        """The speed a slow fault asked for while the run goes on gives this replica group now (slowdowns.json,
        which the lab's supervisor writes; read again only when it changed), or 1."""
        run_dir = getattr(self.ft, "run_dir", None)
        if not run_dir:
            return 1.0
        try:
            st = os.stat(os.path.join(run_dir, runfiles.SLOWDOWNS))
        except OSError:
            return 1.0
        version = (st.st_ino, st.st_mtime_ns)  # written whole each time: a new file, a new inode
        if version != self._asked_version:
            self._asked_version = version
            self._asked = runfiles.read_slowdown(run_dir, self.ft.n)
        return self._asked[0] if self._asked is not None and time.time() < self._asked[1] else 1.0

    def _take_quorum(self, q: dict) -> None:
        """This step's quorum: the world the exchanges average over, what its line records."""
        q.pop("step", None)
        self._quorum = q
        self._rec = dict(q)
        rank = self.ft.group.rank()
        self.dp.set_world(q["participants"], rank)
        if isinstance(self.dp.link, netmodel.ClusterLink):  # the ring is the quorum's workers
            members = getattr(self.ft, "members", lambda: None)()
            ok = members is not None and len(members) == q["participants"]
            self.dp.link.members = members if ok else list(range(q["participants"]))
        if self.method is not None:
            self.ctx.world, self.ctx.rank = q["participants"], rank
        states = [b.compressor.state_dict() for b in self.dp.buckets]
        self._codec_before = [cloned(st) for st in states] if any(states) else None
        every = self.method is not None and self.method.exchanges_every_step
        self._method_before = cloned(self.method.state_dict()) if every else None

    def _begin_step_method(self) -> Optional[int]:
        while self.step < self.spec.steps:
            if self._joined and not self._in_quorum():
                return self.step  # a local step: no quorum
            # this step's quorum (it exchanges gradients, or the method exchanges in it), or this process's first one
            self._at = "step" if self._in_quorum() else "start"
            self._healed_at = None
            q = self.ft.start_quorum()
            self._joined = True
            self._take_quorum(q)
            if self._healed_at is not None:
                self._begin()  # what the recovered step does
            if self._healed_at == "sync":
                self._sync_with_peers()
                continue
            if self._in_quorum():
                return self.step  # committed after its exchange (step_after_backward)
            # the start: nothing to exchange but a barrier, which holds each source until the replicas that recover
            # from it have read its state (its commit stops serving it), as a step's exchange does
            self.ft.group.all_reduce(torch.zeros(1)).wait()
            tc = time.perf_counter()
            ok = self.ft.should_commit()
            self._rec.update({"committed": ok, "commit_ms": (time.perf_counter() - tc) * 1e3})
            if ok:
                return self.step
            self._joined = False  # try again
        return None

    def _in_quorum(self) -> bool:
        """Under a method: whether this step joins a quorum and commits (its gradients are exchanged, or the
        method's own exchange runs in it: DeMo's)."""
        return self._exchanging or self.method.exchanges_every_step

    def _recovered_position(self, pos: dict) -> None:
        """A recovery is loading its source's state: the source's step, and where it was."""
        self.step = int(pos["step"])
        self._healed_at = pos.get("at")

    def _join_sync(self, step: int) -> int:
        """``Quorum.join`` of the method's syncs (see ``_SyncQuorum``)."""
        if self._sync_joined is not None:  # joined already, at the step's start (``_sync_with_peers``)
            step, self._sync_joined = self._sync_joined, None
            return step
        self._at = "sync"
        self._healed_at = None
        # a commit earlier in this step (overlap: the sync before, whose average this step used) stays on its line
        kept = {k: self._rec[k] for k in ("committed", "commit_ms", "error") if k in self._rec}
        self._take_quorum(self.ft.start_quorum())
        self._rec.update(kept)
        if self._healed_at is not None:
            self._rec["recovered"] = True  # this step's line: the state, step and sync are the source's
        if self._healed_at not in (None, "sync"):
            raise RuntimeError(f"fault tolerance: a sync at step {step} recovered from a replica at a step's "
                               f"{self._healed_at}, not in the same sync")
        return self.step

    def _commit_sync(self) -> bool:
        """``Quorum.commit`` of the method's syncs: the commit, recorded on the step's line."""
        tc = time.perf_counter()
        ok = self.ft.should_commit()
        self._rec.update({"committed": ok, "commit_ms": (time.perf_counter() - tc) * 1e3})
        if not ok:
            self._rec["error"] = self.ft.error()
        return ok

    def _sync_with_peers(self) -> None:
        """A recovery at a step's start whose source was in its sync: the quorum is that sync's, so this replica
        runs the sync of the recovered step (from the recovered state, without a forward pass) and logs it."""
        s = self.step
        self._sync_joined = s
        t0 = self.timeline.now()
        self._begin()
        self.method.after_optimizer_step(s)
        if self._sync_joined is not None:
            raise RuntimeError(f"fault tolerance: recovered in a sync at step {s}, but {self.method.name} has none "
                               f"there")
        meth = self.method
        self.log({"kind": "step", "step": s, "rank": self.rank, "loss": None, "recovered": True,
                  "time_ms": (self.timeline.now() - t0) * 1e3, "bytes_sent": meth.step_bytes, "bytes_raw": 0,
                  "method": meth.name, "sync_ms": (self.timeline.now() - t0) * 1e3, **meth.step_log,
                  "replica": self.ft.n, **self._rec, "t": time.time()})
        self._rec = {}
        self.step = s + 1
        self._begin()

    def _shared_codec_state(self) -> list:
        """Each bucket's compressor state as a replica that recovers takes it: the state replicas share (PowerSGD's
        Q, step counters), without this replica's own residuals, which the receiver would count twice."""
        return [without_residuals(b.compressor.state_dict()) for b in self.dp.buckets]

    def _load_shared_codec_state(self, states: list) -> None:
        if len(states) != len(self.dp.buckets):
            raise RuntimeError(f"fault tolerance: the recovered state has {len(states)} buckets' compressor state, "
                               f"this replica {len(self.dp.buckets)} buckets")
        for b, st in zip(self.dp.buckets, states):
            b.compressor.load_state_dict(st)  # residuals absent: they start from zero

    def _begin(self) -> None:
        """The method's say on the coming step: does the communicator exchange its gradients?"""
        self._exchanging = self.method.begin(self.step)
        self.dp.set_exchanging(self._exchanging)

    def _fault_in_sync(self, step: int) -> None:
        """fault.at sync (testing): fail right after the method's collective of ``step`` is issued."""
        f = self.spec.fault
        if f.at == "sync" and f.step == step and f.rank == self.rank:
            if f.kind == "exit":
                os._exit(17)  # die without cleanup, mid-sync, as a crash would
            raise RuntimeError(f"injected fault at step {step} on rank {self.rank}, in the method's sync")

    def evaluating(self):
        """A context in which the model holds the parameters every rank agrees on (a method's global
        parameters, e.g. DiLoCo's), for evaluation; the local ones come back after it."""
        return self.method.evaluating() if self.method is not None else contextlib.nullcontext()

    def drain(self) -> None:
        """At the end of training, on every rank: wait for the method's exchanges still in flight."""
        if self.method is not None:
            self.method.drain()

    def write_layout(self) -> None:
        buckets = [{"bucket": b.index, "layers": b.names, "bytes": b.raw_bytes,
                    "compressor": b.compressor.name, "codec": b.codec} for b in self.dp.buckets]
        with open(os.path.join(self.run_dir, runfiles.LAYOUT), "w") as f:
            json.dump({"params": sum(p.numel() for p in self.model.parameters()),
                       "tensors": len(self.dp.infos), "buckets": buckets}, f, indent=1)

    def log(self, obj: dict) -> None:
        if self.metrics:
            self.metrics.write(obj)

    def step_after_backward(self, loss, t0: float, t1: float, t2: float, m0, m1, m2, extra: Optional[dict] = None) -> dict:
        """End an iteration whose forward ran from (t0, m0) to (t1, m1) and whose backward ended at
        (t2, m2) (host times of ``timeline.now()``, marks of ``timeline.mark()``): finish the exchange,
        step the optimizer, log the step, feed the tuners. ``loss`` is a tensor, a number or None.
        Raises ``Diverged`` when the averaged gradient is not finite (on every rank alike)."""
        tl = self.timeline
        meth = self.method
        self.dp.finish()
        sync_s = 0.0
        if meth is not None:
            tb = tl.now()
            meth.after_backward(self.step)  # DeMo: its exchange replaces the gradients, alike on every rank
            sync_s += tl.now() - tb
        finite = self.dp.grads_finite()  # every rank sees the same averaged gradient: one decision for all
        commit_ms = None
        committed = True
        # every participant's exchange went through, or nobody steps (under a method: the steps that exchange)
        per_step = self.ft is not None and (self._exchanging if meth is None else self._in_quorum())
        if per_step:
            tc = tl.now()
            committed = self.ft.should_commit()
            commit_ms = (tl.now() - tc) * 1e3
        t3 = tl.now()
        m3 = tl.mark()
        if committed:
            if self._own_optimizer:
                decay_lr(self.optimizer, self.spec, self.step)
            self.optimizer.step()
        else:
            if self._codec_before is not None:  # the compressors' state as if the step had never been tried
                for b, st in zip(self.dp.buckets, self._codec_before):
                    b.compressor.load_state_dict(st)
            if self._method_before is not None:  # the method's too (DeMo's momentum)
                meth.load_state_dict(self._method_before)
        self.dp.zero_grad()
        m4 = tl.mark()
        if meth is not None:
            ta = tl.now()
            meth.after_optimizer_step(self.step)  # periodic syncs, fragments issued or applied
            sync_s += tl.now() - ta
            after = tl.now() - ta
        loss_value = loss.item() if isinstance(loss, torch.Tensor) else loss  # .item() syncs the device
        if committed and not bool(finite):  # a step that did not commit may hold anything: it is dropped
            raise Diverged(self.step)
        t4 = tl.now()
        s = self.step
        tl.span("forward", "forward", m0, m1, {"step": s})
        tl.span("backward", "backward", m1, m2, {"step": s})
        tl.span("optimizer", "optimizer", m3, m4, {"step": s})
        tl.span("step", f"step {s}", t0, t4, {"step": s})
        if self.probe:
            self.probe.reset()
        tl.flush()
        rec = {"kind": "step", "step": s, "rank": self.rank, "loss": loss_value, **(extra or {}),
               "time_ms": (t4 - t0) * 1e3, "forward_ms": (t1 - t0) * 1e3, "backward_ms": (t2 - t1) * 1e3,
               "finish_ms": (t3 - t2) * 1e3, "optimizer_ms": (t4 - t3) * 1e3,
               "bytes_sent": self.dp.step_bytes, "bytes_raw": self.dp.step_raw_bytes, "t": time.time()}
        if self.speed < 1.0:
            rec.update({"speed": self.speed, "slow_ms": self._slow_s * 1e3})
            self._slow_s = 0.0
        if meth is not None:
            rec.update({"optimizer_ms": (t4 - t3 - after) * 1e3, "bytes_sent": self.dp.step_bytes + meth.step_bytes,
                        "method": meth.name, "sync_ms": sync_s * 1e3, **meth.step_log})
        if self.ft is not None and meth is None:
            rec.update({"replica": self.ft.n, **self._quorum, "committed": committed, "commit_ms": commit_ms})
            if not committed:
                rec["error"] = self.ft.error()
        elif self.ft is not None:  # the last quorum; its timings and commit where this step joined one
            rec.update({"replica": self.ft.n, "quorum_id": self._quorum.get("quorum_id"),
                        "participants": self._quorum.get("participants"), **self._rec})
            if per_step:
                rec.update({"committed": committed, "commit_ms": commit_ms})
                if not committed:
                    rec["error"] = self.ft.error()
            self._rec = {}
        self.log(rec)
        if self.ft is not None and meth is None:
            self.step = self.ft.current_step()
        elif committed:  # a method's step counts inner steps (a sync that fails does not train them again)
            self.step = self.step + 1
        if self.tuning is not None and not self.tuning.done:
            self.tuning.after_step(t4 - t0, t1)  # search steps are training steps: they train too
            tl.flush()
        if meth is not None:
            self._begin()
        return rec

    def close(self) -> None:
        if self.method is not None:
            self.method.close()
        self.dp.close()
        if self.probe:
            self.probe.close()
        self.timeline.close()
        if self.metrics:
            self.metrics.close()


def _partition(spec: JobSpec, run_dir: Optional[str]) -> Optional[dict]:
    """A fault-tolerant replica's buckets under mergecomp or layerfusion: the partition the lab chose before the
    replicas started (runfiles.PARTITION); None for the other schedules."""
    if spec.schedule.name not in ("mergecomp", "layerfusion"):
        return None
    got = runfiles.read_partition(run_dir)
    if got is None:
        raise RuntimeError(f"schedule.name: {spec.schedule.name} under fault tolerance trains the partition the lab "
                           f"chose before the replicas started ({runfiles.PARTITION} in the run directory), and this "
                           f"run has none; start it with commlab run, or use layerwise, allinone or bucket")
    return got


class _SyncQuorum(Quorum):
    """The method's syncs' quorum under fault tolerance: the Stepper's replica joins and commits."""

    def __init__(self, stepper: Stepper):
        self.stepper = stepper

    def join(self, step: int) -> int:
        return self.stepper._join_sync(step)

    def commit(self) -> bool:
        return self.stepper._commit_sync()
