"""One rank's training loop: data shard, model, communicator, optimizer, logs.

The trainer names its parts as attributes and always closes its writers, so a
crash keeps every line logged before it.
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from commlab.engine import autoprofile, data, models, runfiles, trials
from commlab.engine.spec import JobSpec, with_checked
from commlab.engine.stepper import Stepper


def resolve_device(spec: JobSpec, local_rank: int = 0) -> torch.device:
    want = spec.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device: cuda was asked for but torch sees no GPU; use device: cpu or auto")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_backend(spec: JobSpec, device: torch.device) -> str:
    """auto: nccl on GPU, gloo on CPU, and gloo (over CUDA tensors) when this node runs more ranks than it
    has GPUs: NCCL refuses two ranks on one device."""
    if spec.backend != "auto":
        if spec.backend == "nccl" and device.type == "cuda" and shares_gpu(spec):
            raise RuntimeError(f"backend: nccl cannot put {local_ranks(spec)} ranks on {torch.cuda.device_count()} "
                               "GPU(s) (NCCL refuses two ranks per device); use backend gloo or auto")
        return spec.backend
    if device.type != "cuda":
        return "gloo"
    return "gloo" if shares_gpu(spec) else "nccl"


def local_ranks(spec: JobSpec) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else the whole world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", spec.world_size))


def shares_gpu(spec: JobSpec) -> bool:
    return local_ranks(spec) > torch.cuda.device_count()


def load_data(spec: JobSpec) -> "data.Dataset":
    d = spec.dataset
    kw = {k: v for k, v in (("shape", tuple(d.shape) if d.shape else None), ("classes", d.classes),
                            ("size", d.size), ("block", d.block), ("vocab", d.vocab),
                            ("options", d.options or None)) if v is not None}
    return data.load(d.name, seed=spec.seed, **kw)


def _plan(run_dir: Optional[str]) -> Optional[dict]:
    """strategy auto's trial plan (auto-trials.json), read through the run directory's one trials reader
    (``runfiles.read_trials``), or None."""
    found = runfiles.read_trials(run_dir)
    return found.plan if found else None


EVAL_MAX = 4096
"""Held-out examples per evaluation at most: the text split has 46 k windows, which would take longer
than the training between two evaluations."""


def params_digest(model: torch.nn.Module) -> str:
    """The sha256 of ``model``'s state_dict (its parameters and buffers: each one's name, dtype, shape and bytes,
    in the state_dict's order), in hex: two models with the same digest hold the same values, bit for bit."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Trainer:
    def __init__(self, spec: JobSpec, run_dir: Optional[str], rank: int, world: int,
                 device: torch.device, group=None, ft=None):
        """``ft``: the replica group's fault tolerance (commlab.engine.ft.Replica; ``rank`` is then the replica
        group's number and ``world`` the replica groups): each step joins a quorum, and the batch of a step is
        that of its committed step, so a step that does not commit is trained again on the same batch."""
        torch.manual_seed(spec.seed)
        self.data = load_data(spec)
        self.model = models.build(spec.model.name, self.data.info, **spec.model.options).to(device)
        self.loss_fn = models.make_loss(spec.model.loss)
        self.waited: Optional[autoprofile.Waited] = None
        """strategy auto without a profile: what the ranks' profile steps and the wait for the plan took."""
        req = autoprofile.pending(run_dir) if _plan(run_dir) is None else None
        if req is not None:
            self.waited = autoprofile.profile_then_wait(spec, self.model, self.data, self.loss_fn, run_dir, rank,
                                                        world, device, req)
        self.trials = _plan(run_dir)
        """strategy auto's trials, trained as the run's first steps (commlab/engine/trials.py), or None."""
        if self.trials is not None:
            if trials.most_steps(self.trials) >= spec.steps:
                raise ValueError(f"{runfiles.AUTO_TRIALS}: the trials take up to {trials.most_steps(self.trials)} "
                                 f"steps; the run has {spec.steps} (steps must be more)")
            # built once, under the first trial's strategy (checked by the lab that planned the trials)
            first = JobSpec.from_checked(self.trials["trials"][0]["spec"])
            spec = with_checked(spec, compressor=first.compressor, schedule=first.schedule, comm=first.comm,
                                strategy=first.strategy)
        self.spec, self.run_dir, self.rank, self.world, self.device = spec, run_dir, rank, world, device
        self.ft = ft
        self.stepper = Stepper(spec, self.model, run_dir, rank, device, group, ft=ft)
        """The communicator, optimizer, tuners and writers (commlab/engine/stepper.py), shared with own loops."""
        self.dp, self.optimizer, self.timeline, self.probe = (self.stepper.dp, self.stepper.optimizer,
                                                              self.stepper.timeline, self.stepper.probe)
        self.tuning = self.stepper.tuning
        self.sampler = data.ShardSampler(self.data.size("train"), spec.batch_size, rank, world, spec.seed)

    @property
    def step(self) -> int:
        return self.stepper.step

    def sync_params(self) -> None:
        """Complete pending parameter all-gathers (dear), so the model holds the latest parameters."""
        self.stepper.sync_params()

    def sync_buffers(self) -> None:
        """Average floating-point buffers (BatchNorm running statistics) over ranks. Each rank's
        statistics follow its own shard between evaluations, as with torch DDP's
        broadcast_buffers=False; averaging them before evaluation evaluates one model everywhere,
        with statistics from every shard (rank 0's alone, as DDP's default broadcast gives, would
        see 1/world of the data). Integer buffers (num_batches_tracked) are equal on every rank."""
        bufs = [b for b in self.model.buffers() if b.is_floating_point()]
        if not bufs or self.world == 1 or self.ft is not None:  # fault tolerance: a recovery copies them
            return
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in bufs])
        dist.all_reduce(flat)
        flat /= self.world
        with torch.no_grad():
            for b, v in zip(bufs, flat.split([b.numel() for b in bufs])):
                b.copy_(v.view_as(b))

    def log(self, obj: dict) -> None:
        self.stepper.log(obj)

    def switch(self, spec: JobSpec, layout: Optional[dict] = None) -> None:
        """Train on under another strategy from the next step (commlab/engine/trials.py; Stepper.switch)."""
        self.spec = spec
        self.stepper.switch(spec, layout)
        self.dp, self.optimizer, self.tuning = self.stepper.dp, self.stepper.optimizer, self.stepper.tuning

    def train_step(self, **extra) -> dict:
        """One iteration: forward, backward (with overlapped comm in wfbp), finish, optimizer step.
        ``extra`` goes into the step's metrics record."""
        tl = self.timeline
        self._maybe_fault()
        if self.ft is not None:  # the quorum first: it says which step this is (a recovery may move it on)
            step = self.stepper.begin_step()
            if step is None:  # a recovery landed in the last step's sync, which this replica ran: nothing is left
                return {}
            idx = self.sampler.at(step)
        else:
            idx = next(self.sampler)
        x, y = self.data.batch("train", idx)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        t0 = tl.now()
        m0 = tl.mark()
        logits = self.model(x)
        loss = self.loss_fn(logits, y)
        if self._fault_now("nan"):
            loss = loss * float("nan")
        m1 = tl.mark()
        t1 = tl.now()
        t1, m1 = self.stepper.slow_down("forward", t0, t1, m1)  # a slower worker's (network.cluster)
        loss.backward()
        m2 = tl.mark()
        t2 = tl.now()
        t2, m2 = self.stepper.slow_down("backward", t1, t2, m2)
        return self.stepper.step_after_backward(loss, t0, t1, t2, m0, m1, m2, {"epoch": self.sampler.epoch, **extra})

    def _fault_now(self, kind: str) -> bool:
        f = self.spec.fault
        return f.kind == kind and f.at == "start" and f.step == self.step and f.rank == self.rank

    def _maybe_fault(self) -> None:
        if self._fault_now("raise"):
            raise RuntimeError(f"injected fault at step {self.step} on rank {self.rank}")
        if self._fault_now("exit"):
            os._exit(17)  # die without cleanup, as a crash would

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss and accuracy; every rank evaluates its share, counts are summed."""
        tl = self.timeline
        self.sync_params()  # dear: no stale parameters in evaluation
        t0 = tl.now()
        self.sync_buffers()
        if self.probe:
            self.probe.active = False
        with self.stepper.evaluating():  # a method's global parameters (DiLoCo's), alike on every rank
            tot = self._held_out()
        loss_sum, c, k = tot.tolist()
        rec = {"kind": "eval", "step": self.step, "rank": self.rank, "eval_loss": loss_sum / max(k, 1),
               "eval_acc": c / max(k, 1), "t": time.time()}
        tl.span("eval", "eval", t0, tl.now(), {"step": self.step, "acc": rec["eval_acc"]})
        tl.flush()
        if self.rank == 0:
            self.log(rec)
        return rec

    def _held_out(self) -> torch.Tensor:
        """(loss sum, correct, count) over the held-out split, summed over ranks."""
        self.model.eval()
        n_all = self.data.size("test")
        n = min(n_all, EVAL_MAX)
        stride = n_all // n  # a fixed, evenly spread subset when the held-out split is large (text)
        bs = max(self.spec.batch_size, 256)
        tot = torch.zeros(3, dtype=torch.float64)
        # fault tolerance: every replica holds the same model and evaluates all of it (no collective outside a quorum)
        rank, world = (0, 1) if self.ft is not None else (self.rank, self.world)
        for idx in data.eval_batches(n, bs, rank, world):
            x, y = self.data.batch("test", idx * stride)
            x, y = x.to(self.device), y.to(self.device)
            logits = self.model(x)
            c, k = models.correct(logits, y)
            tot += torch.tensor([self.loss_fn(logits, y).item() * k, c, k], dtype=torch.float64)
        tot = tot.to(self.device)
        if self.ft is None:
            dist.all_reduce(tot)
        self.model.train()
        if self.probe:
            self.probe.active = True
        return tot

    def train(self) -> None:
        spec = self.spec
        self.model.train()

        reached = False  # spec.stop_at_acc: an evaluation at or above it ends the run (all ranks read one sum)

        def maybe_evaluate():
            nonlocal reached
            if spec.eval_every and self.step % spec.eval_every == 0 and self.step < spec.steps:
                acc = self.evaluate()["eval_acc"]
                reached = bool(spec.stop_at_acc) and acc >= spec.stop_at_acc
        if self.trials is not None:
            trials.run(self, self.trials, maybe_evaluate)
        while self.step < spec.steps and not reached:
            before = self.step
            rec = self.train_step()
            # a step that did not commit is trained again; under a method, a sync that does not commit is not (its
            # inner steps are dropped): there the step has moved on
            if rec.get("committed", True) if self.stepper.method is None else self.step != before:
                maybe_evaluate()
        self.stepper.drain()
        self.sync_params()
        if spec.final_eval and not reached:
            self.evaluate()
        if self.rank == 0 or self.ft is not None:  # what the run ends with: a rerun ends with the same digest
            # fault tolerance: every replica says what it ends with (they must agree)
            self.log({"kind": "final", "step": self.step, "rank": self.rank, "params_sha256": params_digest(self.model),
                      "t": time.time(), **({"replica": self.ft.n} if self.ft is not None else {})})

    def close(self) -> None:
        self.stepper.close()
