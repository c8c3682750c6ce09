"""``commlab.wrap``: the engine's communication step inside a user's own training loop.

Each rank of the user's job (torchrun, Slurm, a PyTorchJob) calls ``wrap`` after building its
model and before training; a script may wrap several trainings in a row (a sweep in one job), each
its own run, when every rank makes the same calls. ``wrap`` joins the process group if the script
has not (from the RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT convention, or as a world of one without
them) and leaves it again at ``close()``, builds the communicator, optimizer and tuners from the
spec with the Trainer's own code (``commlab.engine.stepper.Stepper``), and opens a run: rank 0 creates the run directory (spec.json,
status.json ``running``) and broadcasts its id; every rank then writes its timeline and metrics
there. ``close()`` (or leaving the ``with`` block) marks the run ``done``, or ``failed`` with the
rank and error when the script raised, or ``diverged``.

Under fault tolerance the lab starts the ranks: ``commlab run SPEC --script 'train.py ARGS'`` runs the script once
per replica group (the Lighthouse, restarts and faults as for the lab's own trainer, commlab/lab/rundir/ftrun.py),
and ``wrap`` finds its run directory, Lighthouse and replica group in the environment: no process group of the whole
job, torchft's Manager instead; the loop takes its steps from ``steps()``, each beginning with its quorum.

Each rank checks the spec itself, before it joins the group: it is where the run is admitted, so the engine's
switches the spec leaves unset (``engine``: fused kernels, CUDA graphs, the buffer pool, the group's timeout) come
from the rank's own environment, and the spec's values are put into that environment until the loop ends.

Layering: this package sits above commlab/lab/ (run store) and commlab/engine/ (the step); neither imports it.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from commlab.engine import runfiles
from commlab.engine.ft_lighthouse import LIGHTHOUSE_ENV, RUN_DIR_ENV
from commlab.engine.spec import JobSpec, SpecError
from commlab.engine.stepper import Diverged, Stepper
from commlab.engine.trainer import params_digest
from commlab.engine.timeline import Timeline
from commlab.lab.base import procs
from commlab.lab.base.specs import read_spec_file
from commlab.lab.rundir.launcher import finish_status
from commlab.room import open_lab

SpecLike = Union[str, os.PathLike, dict, JobSpec]
OptimizerLike = Union[None, torch.optim.Optimizer, Callable[[list], torch.optim.Optimizer]]


def wrap(model: torch.nn.Module, optimizer: OptimizerLike = None, spec: SpecLike = None, *,
         runs: Optional[os.PathLike] = None, run_id: Optional[str] = None, group=None) -> "OwnLoop":
    """Return an ``OwnLoop`` for ``model`` (already on its device).

    ``optimizer``: None (the spec's ``optimizer``), a ``torch.optim`` optimizer over
    ``model.parameters()``, or a factory ``params -> optimizer``. dear steps this rank's
    shards, so it needs a factory (or None): ``lambda ps: torch.optim.SGD(ps, lr=0.1)``.
    ``spec``: a YAML/JSON path, a dict or a JobSpec; only compressor, schedule, comm, network, method,
    timeline, name, steps (for progress) and seed matter here (the loop is yours). A method (local SGD,
    DiLoCo, ...) runs its hooks around your optimizer's step inside ``step()``: it decides which steps
    exchange gradients and runs its own syncs; evaluate under ``evaluating()`` to read the parameters
    every rank agrees on (DiLoCo's global ones).
    ``run_id``: the run's name (default: a fresh one from rank 0).
    Every rank calls it alike; several calls in a row (a sweep in one script) are several runs."""
    return OwnLoop(model, optimizer, spec, runs=runs, run_id=run_id, group=group)


class OwnLoop:
    """One rank's handle on a wrapped training loop: ``step()``, ``log_eval()``, ``close()``."""

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerLike, spec: SpecLike, *,
                 runs=None, run_id=None, group=None):
        self.model = model
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.own_group = False
        """True when wrap initialised the process group (then close() destroys it)."""
        self.replica = None
        """Under fault tolerance (``commlab run --script``): this replica group's torchft side
        (commlab.engine.ft.Replica); None otherwise."""
        self._begun = False
        """Under fault tolerance: whether the step ``steps()`` gave has begun (its quorum joined)."""
        self.run = None
        """rank 0: the lab's Run, whose status this rank owns; None on the others (and under fault tolerance,
        where the lab's supervisor owns it)."""
        self._excepthook = sys.excepthook
        """sys.excepthook before the join: torch wraps it at each init (a "[rank0]:" prefix) and leaves
        it at destroy, so a second wrap would prefix every line twice."""
        self.stepper = None
        self._env_before: dict = {}
        replica_env = _replica_env()
        if replica_env is not None:
            make_opt = self._as_replica(*replica_env, optimizer)
        else:
            # the full check, here in the rank: its engine switches left unset come from this rank's environment
            self.spec = _load(spec, _world(group))
            self._env_before = _apply_engine(self.spec)
            """The engine's variables as they were before wrap set them from the spec (put back when the loop
            ends)."""
            try:
                self.own_group = _join(self.device, self.spec.engine.timeout_s)
            except BaseException:
                _restore_env(self._env_before)
                raise
            self.group = group
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
            try:
                make_opt = _optimizer_factory(optimizer, model, self.spec)
                self.run_dir, self.run_id = self._open_run(runs, run_id, model, optimizer)
            except BaseException:
                self._leave()
                raise
        try:
            self.stepper = Stepper(self.spec, model, str(self.run_dir), self.rank, self.device, self.group, make_opt,
                                   ft=self.replica)
        except BaseException as e:
            self._fail(e)
            if self.replica is not None:
                self._leave()
            raise
        self.optimizer: torch.optim.Optimizer = self.stepper.optimizer
        """The optimizer the step uses (over dear's shards with dear)."""
        self.closed = False
        self._t0 = self._t1 = None
        self._fwd = None
        """The start of the current training forward call (time, mark)."""
        # forward begins at the model's first training forward after a step, ends at its last one;
        # prepend: it runs before DeAR's gather wait, which therefore counts as forward time
        self._hooks = [model.register_forward_pre_hook(self._forward_begins, prepend=True),
                       model.register_forward_hook(self._forward_ends)]
        self._last = self._now()
        self._sigterm = None
        if threading.current_thread() is threading.main_thread():
            # torchrun (and Slurm, Kubernetes) stop the other ranks with SIGTERM when one fails: raise
            # here instead of dying, so the `with` block ends the run as failed, naming the rank that caused it
            self._sigterm = signal.signal(signal.SIGTERM, self._terminated)

    def _as_replica(self, run_dir: str, lighthouse: str, n: int, optimizer: OptimizerLike):
        """Replica group ``n`` of the fault-tolerant run in ``run_dir``, which ``commlab run --script`` admitted and
        whose supervisor started this process: the run's own spec.json (what the lab admitted, with its --set
        overrides; a spec passed to ``wrap`` is not read), no process group of the whole job but torchft's Manager
        reaching ``lighthouse``. Returns the optimizer factory."""
        from commlab.engine import ft  # lazy: torchft is optional; only a fault-tolerant loop loads it
        with open(os.path.join(run_dir, runfiles.SPEC)) as f:
            self.spec = JobSpec.from_checked(json.load(f))
        self._env_before = _apply_engine(self.spec)
        self.group = None
        self.rank, self.world = n, self.spec.fault_tolerance.replica_groups
        self.run_dir, self.run_id = Path(run_dir), Path(run_dir).name
        try:
            make_opt = _optimizer_factory(optimizer, self.model, self.spec)
            self.replica = ft.Replica(self.spec, run_dir, n, lighthouse,
                                      "nccl" if self.device.type == "cuda" else "gloo")
        except BaseException:
            self._leave()
            raise
        return make_opt

    def steps(self):
        """The steps to train, in order: ``for step in loop.steps(): ...`` (pick the batch by ``step``, then
        forward, backward and ``loop.step(loss=...)``). Under fault tolerance each step begins here with its quorum:
        a replica that is behind (restarted, or back from a cut) first recovers the model and optimizer from a
        peer, so the step may jump ahead; a step that did not commit comes again (train it on the same batch);
        and the loop ends once the run has trained its ``steps``. Without fault tolerance: the spec's steps from
        where the loop is."""
        while self.stepper.step < self.spec.steps:
            if self.replica is not None:
                s = self.stepper.begin_step()
                if s is None:  # a recovery landed in the last step's sync, which this replica ran
                    return
                self._begun = True
                yield s
            else:
                yield self.stepper.step

    def _terminated(self, signum, frame):
        if self.closed:  # already ending the run (a launcher may signal twice): finish that first
            return
        raise Stopped(f"rank {self.rank} was stopped by SIGTERM (a launcher stops every rank when one fails)")

    # -- the loop ---------------------------------------------------------
    def _now(self):
        tl: Timeline = self.stepper.timeline
        return tl.now(), tl.mark()

    def _training(self) -> bool:
        return self.model.training and torch.is_grad_enabled()

    def _forward_begins(self, mod, args) -> None:
        if self.stepper.probe:
            self.stepper.probe.active = self._training()  # no evaluation passes in the layer spans
        if self._training():
            self._fwd = self._now()
            if self._t0 is None:
                self._t0 = self._fwd

    def _forward_ends(self, mod, args, out) -> None:
        if self._training():
            t, m = self._now()
            # a slower worker (network.cluster): this forward call stretched to 1/speed of what it took
            self._t1 = self.stepper.slow_down("forward", self._fwd[0], t, m)

    def step(self, loss=None) -> dict:
        """After ``loss.backward()``: average the gradients as the spec says, step the optimizer,
        zero the gradients, log the step (with ``loss``: a tensor or a number) and feed the
        tuners. Returns the step's metrics line. Raises ``Diverged`` on every rank alike when
        the averaged gradient is not finite. Without ``loss`` the step is logged with none (the
        summary then says the loss was not recorded)."""
        _check_loss(loss)
        if self.replica is not None and not self._begun:
            raise RuntimeError("step: under fault tolerance train the steps loop.steps() gives (each begins with "
                               "its quorum): for step in loop.steps(): ...")
        self._begun = False
        t0 = self._t0 or self._last
        t1 = self._t1 or t0
        t2 = self.stepper.slow_down("backward", t1[0], *self._now())
        rec = self.stepper.step_after_backward(loss, t0[0], t1[0], t2[0], t0[1], t1[1], t2[1])
        self._t0 = self._t1 = None
        self._last = self._now()
        return rec

    def log_eval(self, acc: float, loss: float) -> None:
        """An evaluation line, as the Trainer writes it (rank 0 writes it): held-out accuracy and
        loss, for the summary and the UI's curves."""
        if self.rank == 0:
            self.stepper.log({"kind": "eval", "step": self.stepper.step, "rank": 0, "eval_loss": float(loss),
                              "eval_acc": float(acc), "t": time.time()})

    def sync_params(self) -> None:
        """dear: complete pending parameter all-gathers, so the model holds the latest parameters
        (call before evaluating or saving the model)."""
        self.stepper.sync_params()

    def evaluating(self):
        """A context in which the model holds the parameters every rank agrees on: a method's global
        parameters (DiLoCo's, local SGD's last average); the rank's own come back after it. Without a
        method (or with DeMo, whose ranks never differ) it changes nothing."""
        return self.stepper.evaluating()

    # -- the run ----------------------------------------------------------
    def _open_run(self, runs, run_id, model, optimizer):
        lab = open_lab(runs)
        box = [None]
        if self.rank == 0:
            try:
                self.run = lab.create(self.spec, run_id=run_id, ranks_here=0)  # torchrun started them
                n = sum(p.numel() for p in model.parameters())
                self.run.mark_running(supervisor=procs.identity(), own_loop={
                    "script": " ".join(sys.argv), "model": type(model).__name__, "params": n,
                    "optimizer": "spec" if optimizer is None else _optimizer_name(optimizer),
                    "world_size": self.world, "host": socket.gethostname()})
                box[0] = self.run.id
            except BaseException as e:
                box[0] = f"!{type(e).__name__}: {e}"
        dist.broadcast_object_list(box, src=0, group=self.group)
        if box[0].startswith("!"):  # rank 0 could not create the run: every rank stops with its reason
            raise RuntimeError(f"rank 0 could not create the run: {box[0][1:]}")
        return lab.root / box[0], box[0]

    def _fail(self, e: BaseException) -> None:
        """This rank failed: leave its error (or divergence) in the run directory; rank 0 then
        decides the run's final status from every rank's files."""
        if isinstance(e, Diverged):
            _write_json(self.run_dir / runfiles.DIVERGED.format(rank=self.rank),
                        {"rank": self.rank, "step": e.step, "error": str(e), "time": time.time()})
        else:
            _write_json(self.run_dir / runfiles.ERROR.format(rank=self.rank),
                        {"rank": self.rank, "error": f"{type(e).__name__}: {e}".strip(),
                         "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
                         "time": time.time()})
        if self.run is not None:
            time.sleep(1.0)  # a peer that caused this (rank 0 sees a lost connection) records its own error
            finish_status(self.run, 1)

    def close(self, error: Optional[BaseException] = None) -> None:
        """Close the writers and end the run: ``done`` when every rank got here without
        ``error``, otherwise ``failed`` (or ``diverged``) naming the rank that caused it."""
        if self.closed:
            return
        self.closed = True
        for h in self._hooks:
            h.remove()
        try:
            if error is None:
                self.stepper.drain()  # a method's exchanges still in flight (Streaming DiLoCo's fragments)
                self.stepper.sync_params()
                if self.replica is not None:  # what each replica ends with (they must agree), as the Trainer's
                    self.stepper.log({"kind": "final", "step": self.stepper.step, "rank": self.rank,
                                      "replica": self.rank, "params_sha256": params_digest(self.model),
                                      "t": time.time()})
            self.stepper.close()
        except BaseException as e:
            error = error or e
        if self.replica is not None:  # the lab's supervisor ends the run from the replicas' exits
            if error is not None:
                self._fail(error)
            self._leave()
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
            return
        if error is None:
            try:
                dist.barrier(group=self.group)  # every rank's files are closed before rank 0 says done
            except BaseException as e:  # a peer failed at the end: its error file says why
                error = e
        if error is not None:
            self._fail(error)
        elif self.run is not None:
            finish_status(self.run, 0)
        self._leave()
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)

    def _leave(self) -> None:
        """Destroy the process group wrap joined (none when the script had joined it), and put back the engine's
        variables as they were before wrap."""
        if self.own_group and dist.is_initialized():
            dist.destroy_process_group()
            sys.excepthook = self._excepthook
        if self.replica is not None:
            self.replica.close()
        _restore_env(self._env_before)
        self._env_before = {}

    def __enter__(self) -> "OwnLoop":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(exc)
        return False

    def __repr__(self) -> str:
        return f"OwnLoop(run={self.run_id!r}, rank={self.rank}/{self.world}, step={self.stepper.step})"


class Stopped(BaseException):
    """This rank was told to stop (SIGTERM); a BaseException, like KeyboardInterrupt, so that a
    script's ``except Exception`` does not swallow it."""


_store = None
"""(store, rank, world size) of the job's rendezvous (env://), kept for the process's life: every
wrap that joins the group itself uses it, under a key prefix of its own."""
_joins = 0
"""How many groups wrap has joined from the environment in this process (the next prefix)."""


def _world(group) -> int:
    """The job's world size before wrap joins it: the group's when the script joined one, else the torch
    convention's WORLD_SIZE (with RANK and MASTER_ADDR), else 1 (a plain ``python script.py``)."""
    if dist.is_initialized():
        return dist.get_world_size(group)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        try:
            return int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            raise ValueError(f"WORLD_SIZE: must be an integer, got {os.environ['WORLD_SIZE']!r}") from None
    return 1


def _apply_engine(spec: JobSpec) -> dict:
    """Put the spec's engine switches into this process's environment, where the engine's code reads them;
    returns what those variables held before (None: unset)."""
    new = spec.engine.environment()
    before = {k: os.environ.get(k) for k in new}
    os.environ.update(new)
    return before


def _restore_env(before: dict) -> None:
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _join(device: torch.device, timeout_s: float) -> bool:
    """Join the process group from the environment unless the script did; True if we did.

    Every wrap that joins also leaves (``close`` destroys the group), so a script may wrap several
    trainings in a row. torch names each new default group alike ("0") and torchrun's store outlives
    it, so a second group on the store's plain "default_pg" keys would read the first one's stale
    addresses and wait for peers that are gone. Each join therefore takes the next prefix of one
    store kept for the job; every rank calls wrap as often, so the ranks agree on it."""
    global _store, _joins
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=float(timeout_s))
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        if _store is None:  # rank 0 hosts it outside torchrun: kept, a later wrap's peers find it up
            _store = next(dist.rendezvous("env://", timeout=timeout))
        store, rank, world = _store
        store.set_timeout(timeout)
        _joins += 1
        dist.init_process_group(backend, store=dist.PrefixStore(f"commlab.wrap{_joins}", store), rank=rank,
                                world_size=world, timeout=timeout)
    else:  # a plain `python script.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timeout)
    return True


def _replica_env():
    """(run directory, Lighthouse address, replica group) when the lab started this process as a replica group of a
    fault-tolerant run of your own script (``commlab run --script``), else None."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return None
    lighthouse = os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse or not os.environ.get("RANK", "").isdigit():
        raise RuntimeError(f"fault_tolerance: ${RUN_DIR_ENV} is set but ${LIGHTHOUSE_ENV} or $RANK is not; the lab "
                           "sets all three for each replica group (commlab run --script)")
    return run_dir, lighthouse, int(os.environ["RANK"])


def _check_loss(loss) -> None:
    """Refuse, before the step runs, a loss the metrics line could not hold as one number."""
    if loss is None or (isinstance(loss, (int, float)) and not isinstance(loss, bool)):
        return
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return
    what = f"a tensor of {loss.numel()} elements" if isinstance(loss, torch.Tensor) else type(loss).__name__
    raise TypeError(f"loss: expected a one-element tensor, a number or None, got {what}")


def _load(spec: SpecLike, world: int) -> JobSpec:
    """The spec with world_size taken from the job (a spec that names another one is refused)."""
    if isinstance(spec, JobSpec):
        data = spec.to_dict()
    elif isinstance(spec, dict):
        data = json.loads(json.dumps(spec))
    elif spec is None:
        data = {}
    else:
        data = read_spec_file(str(spec))
    if "world_size" in data and data["world_size"] != world and not isinstance(spec, JobSpec):
        raise SpecError("world_size", f"the spec asks for {data['world_size']} ranks but this job has {world}")
    data["world_size"] = world
    out = JobSpec.from_dict(data)
    if out.fault_tolerance.enabled:
        raise SpecError("fault_tolerance.enabled", "a fault-tolerant own loop runs as the replica groups the lab "
                                                   "starts: commlab run SPEC --script 'train.py ARGS' (not under "
                                                   "torchrun)")
    if isinstance(spec, JobSpec):
        out.engine.keep_from_env(spec.engine)  # what its own check took from the environment
    return out


def _optimizer_factory(optimizer: OptimizerLike, model: torch.nn.Module, spec: JobSpec):
    if optimizer is not None and spec.optimizer.decay != "none":
        raise ValueError(f"optimizer.decay: {spec.optimizer.decay} decays the spec's own optimizer; with "
                         f"your own, leave it none and use a torch.optim.lr_scheduler")
    if optimizer is None or (callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)):
        return optimizer  # None: the spec's optimizer; otherwise a factory over what the communicator gives
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, a factory params -> optimizer, or None; "
                        f"got {type(optimizer).__name__}")
    if spec.comm.mode == "dear":
        raise ValueError("optimizer: comm.mode dear steps this rank's parameter shards, not the model's parameters; "
                         "pass a factory instead, e.g. commlab.wrap(model, lambda params: torch.optim.SGD(params, "
                         "lr=0.1), spec)")
    mine = {id(p) for p in model.parameters()}
    theirs = [p for g in optimizer.param_groups for p in g["params"]]
    if not theirs or any(id(p) not in mine for p in theirs):
        raise ValueError("optimizer: it must be built over model.parameters() of the model passed to wrap")
    return lambda params: optimizer


def _optimizer_name(optimizer) -> str:
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    return getattr(optimizer, "__name__", None) or getattr(getattr(optimizer, "func", None), "__name__", "factory")


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    except OSError as e:  # said on stderr: the rank's own error matters more than this file
        print(f"[commlab] rank {obj.get('rank')}: could not write {path}: {e}", file=sys.stderr, flush=True)
