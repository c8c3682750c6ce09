"""One rank's training loop: data shard, model, communicator, optimizer, logs.

The trainer names its parts as attributes and always closes its writers, so a
crash keeps every line logged before it.
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from engine import compressors, data, dear, models, netmodel, schedules, tuners
from engine.comm import DataParallel
from engine.dear import DeAR
from engine.probe import LayerProbe
from engine.runlog import JsonlWriter
from engine.spec import JobSpec
from engine.timeline import Clock, CudaClock, Timeline


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
    if spec.backend != "auto":
        return spec.backend
    return "nccl" if device.type == "cuda" else "gloo"


def make_optimizer(spec: JobSpec, params):
    o = spec.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[o.name]
    betas = tuple(o.betas) if o.betas else (0.9, 0.999)
    return cls(params, lr=o.lr, betas=betas, weight_decay=o.weight_decay)


def load_data(spec: JobSpec) -> "data.Dataset":
    d = spec.dataset
    kw = {k: v for k, v in (("shape", tuple(d.shape) if d.shape else None), ("classes", d.classes),
                            ("size", d.size), ("block", d.block)) if v is not None}
    return data.load(d.name, seed=spec.seed, **kw)


def schedule_fn(spec: JobSpec):
    s = spec.schedule
    opts = {"cap_mb": s.cap_mb} if s.name == "bucket" else {}
    return functools.partial(schedules.build, s.name, **opts)


EVAL_MAX = 4096
"""Held-out examples per evaluation at most: the text split has 46 k windows, which would take longer
than the training between two evaluations."""


class Diverged(RuntimeError):
    """The averaged gradient is not finite: training cannot go on."""

    def __init__(self, step: int):
        super().__init__(f"diverged at step {step}: the averaged gradient is not finite (NaN or inf)")
        self.step = step


class Trainer:
    def __init__(self, spec: JobSpec, run_dir: Optional[str], rank: int, world: int,
                 device: torch.device, group=None):
        self.spec, self.run_dir, self.rank, self.world, self.device = spec, run_dir, rank, world, device
        torch.manual_seed(spec.seed)
        self.data = load_data(spec)
        self.model = models.build(spec.model.name, self.data.info, **spec.model.options).to(device)
        path = (lambda name: os.path.join(run_dir, name)) if run_dir else None
        clock = CudaClock(device) if device.type == "cuda" else Clock()
        self.timeline = Timeline(path(f"timeline-rank{rank}.jsonl") if path else None, rank,
                                 enabled=spec.timeline, clock=clock)
        self.metrics = JsonlWriter(path("metrics.jsonl")) if path else None
        self.probe = LayerProbe(self.model, self.timeline) if self.timeline.enabled else None
        c = spec.compressor
        self.cap_tuner = None
        """dear with comm.tune: the buffer-cap search (engine.dear.CapTuner), fed in _tune."""
        if spec.comm.mode == "dear":
            # ZeRO-style: the optimizer steps this rank's shard of every buffer (engine/dear.py)
            self.dp = DeAR(self.model, self._dear_layout(), c.name, timeline=self.timeline, group=group,
                           link=netmodel.from_spec(spec.network), error_feedback=c.error_feedback,
                           compressor_params=c.params)
            self.optimizer = make_optimizer(spec, self.dp.shard_params())
            self.dp.attach(self.optimizer)
        else:
            self.dp = DataParallel(self.model, schedule_fn(spec),
                                   lambda: compressors.make(c.name, error_feedback=c.error_feedback, **c.params),
                                   mode=spec.comm.mode, timeline=self.timeline, group=group,
                                   link=netmodel.from_spec(spec.network))
            self.optimizer = make_optimizer(spec, self.model.parameters())
        self.sampler = data.ShardSampler(self.data.size("train"), spec.batch_size, rank, world, spec.seed)
        self.step = 0
        if rank == 0 and run_dir:
            self._write_layout()
        self.tuning = None
        """mergecomp / layerfusion: the tuner's driver, which relayouts at step boundaries."""
        if spec.schedule.name in ("mergecomp", "layerfusion"):
            self.tuning = tuners.Tuning(spec, self.dp, run_dir, self.timeline, group,
                                        on_layout=self._write_layout if rank == 0 and run_dir else None)

    def _dear_layout(self):
        """dear's buffers: by comm.layers, by comm.cap_mb (default 25 MB), or the tuner's first trial cap."""
        cm = self.spec.comm
        if cm.layers is not None:
            return functools.partial(dear.layout_layers, layers=cm.layers)
        cap = cm.cap_mb or 25.0
        if cm.tune:
            total = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
            self.cap_tuner = dear.CapTuner(dear.cap_candidates(total))
            self.tune_steps = cm.tune_steps or 5
            self.trial_cap, self.trial_ms = self.cap_tuner.propose(), []
            cap = self.trial_cap
        return functools.partial(dear.layout_cap, cap_mb=cap)

    def _tune(self, time_ms: float) -> None:
        """Feed the cap search one measured step; at the end of a trial rank 0 decides the next cap
        (or the best one, when the search is over) and broadcasts it; every rank then relayouts."""
        self.trial_ms.append(time_ms)
        if len(self.trial_ms) < self.tune_steps:
            return
        decision = torch.zeros(2, dtype=torch.float64, device=self.device)  # [cap_mb, search over]
        if self.rank == 0:
            self.cap_tuner.report(self.trial_cap, self.trial_ms[1:])  # the first step after a relayout warms up
            nxt = self.cap_tuner.propose()
            decision[0], decision[1] = (nxt, 0.0) if nxt is not None else (self.cap_tuner.best, 1.0)
            self.log({"kind": "tune", "step": self.step, "rank": 0, "cap_mb": self.trial_cap,
                      "median_ms": self.cap_tuner.measured[self.cap_tuner.caps.index(self.trial_cap)],
                      "next_cap_mb": float(decision[0]), "done": bool(decision[1]), "t": time.time()})
        dist.broadcast(decision, 0)
        cap, done = float(decision[0]), bool(decision[1])
        if cap != self.trial_cap:
            self.dp.relayout(dear.layout_cap(self.dp.infos, cap))
        self.trial_cap, self.trial_ms = cap, []
        if done:
            self.cap_tuner = None  # keep the best cap from here on
        if self.rank == 0 and self.run_dir:
            self._write_layout()

    def sync_params(self) -> None:
        """Complete pending parameter all-gathers (dear), so the model holds the latest parameters."""
        sync = getattr(self.dp, "sync_params", None)
        if sync:
            sync()

    def model_state(self) -> dict:
        """The model's state_dict with up-to-date parameters (what a checkpoint saves)."""
        self.sync_params()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _write_layout(self) -> None:
        buckets = [{"bucket": b.index, "layers": b.names, "bytes": b.raw_bytes,
                    "compressor": b.compressor.name} for b in self.dp.buckets]
        with open(os.path.join(self.run_dir, "layout.json"), "w") as f:
            json.dump({"params": sum(p.numel() for p in self.model.parameters()),
                       "tensors": len(self.dp.infos), "buckets": buckets}, f, indent=1)

    def log(self, obj: dict) -> None:
        if self.metrics:
            self.metrics.write(obj)

    def train_step(self) -> dict:
        """One iteration: forward, backward (with overlapped comm in wfbp), finish, optimizer step."""
        tl = self.timeline
        self._maybe_fault()
        idx = next(self.sampler)
        x, y = self.data.batch("train", idx)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        t0 = tl.now()
        m0 = tl.mark()
        logits = self.model(x)
        loss = models.loss_fn(logits, y)
        if self._fault_now("nan"):
            loss = loss * float("nan")
        m1 = tl.mark()
        t1 = tl.now()
        loss.backward()
        m2 = tl.mark()
        t2 = tl.now()
        self.dp.finish()
        finite = self.dp.grads_finite()  # every rank sees the same averaged gradient: one decision for all
        t3 = tl.now()
        m3 = tl.mark()
        self.optimizer.step()
        self.dp.zero_grad()
        m4 = tl.mark()
        loss_value = loss.item()  # syncs the device: the step is over here
        if not bool(finite):
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
        rec = {"kind": "step", "step": s, "rank": self.rank, "loss": loss_value, "epoch": self.sampler.epoch,
               "time_ms": (t4 - t0) * 1e3, "forward_ms": (t1 - t0) * 1e3, "backward_ms": (t2 - t1) * 1e3,
               "finish_ms": (t3 - t2) * 1e3, "optimizer_ms": (t4 - t3) * 1e3,
               "bytes_sent": self.dp.step_bytes, "bytes_raw": self.dp.step_raw_bytes, "t": time.time()}
        self.log(rec)
        self.step += 1
        if self.tuning is not None and not self.tuning.done:
            self.tuning.after_step(t4 - t0, t1)  # search steps are training steps: they train too
            tl.flush()
        if self.cap_tuner is not None:
            self._tune(rec["time_ms"])
        return rec

    def _fault_now(self, kind: str) -> bool:
        f = self.spec.fault
        return f.kind == kind and f.step == self.step and f.rank == self.rank

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
        if self.probe:
            self.probe.active = False
        self.model.eval()
        n_all = self.data.size("test")
        n = min(n_all, EVAL_MAX)
        stride = n_all // n  # a fixed, evenly spread subset when the held-out split is large (text)
        bs = max(self.spec.batch_size, 256)
        tot = torch.zeros(3, dtype=torch.float64)
        for idx in data.eval_batches(n, bs, self.rank, self.world):
            x, y = self.data.batch("test", idx * stride)
            x, y = x.to(self.device), y.to(self.device)
            logits = self.model(x)
            c, k = models.correct(logits, y)
            tot += torch.tensor([models.loss_fn(logits, y).item() * k, c, k], dtype=torch.float64)
        tot = tot.to(self.device)
        dist.all_reduce(tot)
        self.model.train()
        if self.probe:
            self.probe.active = True
        loss_sum, c, k = tot.tolist()
        rec = {"kind": "eval", "step": self.step, "rank": self.rank, "eval_loss": loss_sum / max(k, 1),
               "eval_acc": c / max(k, 1), "t": time.time()}
        tl.span("eval", "eval", t0, tl.now(), {"step": self.step, "acc": rec["eval_acc"]})
        tl.flush()
        if self.rank == 0:
            self.log(rec)
        return rec

    def train(self) -> None:
        spec = self.spec
        self.model.train()
        for _ in range(spec.steps):
            self.train_step()
            if spec.eval_every and self.step % spec.eval_every == 0 and self.step < spec.steps:
                self.evaluate()
        self.sync_params()
        self.evaluate()

    def close(self) -> None:
        self.dp.close()
        if self.probe:
            self.probe.close()
        self.timeline.close()
        if self.metrics:
            self.metrics.close()
