"""``strategy: auto`` without a profile of the model: the run's own ranks measure it, then wait for the plan.

When the lab has no profile of the model, the supervisor (commlab/lab/strategy/auto.py) writes ``auto-pending.json`` instead
of a trial plan and starts the ranks at once, so the advisor's profile costs no start-up of its own (the
interpreter, torch, the data and the process group are the run's anyway). Each rank, once its model is
built and before any communicator exists:

1. trains ``profile_steps`` *dry* steps: forward and backward on its own batches with the layer probe on, the
   optimizer's step timed on a scratch copy of the parameters; no gradient is exchanged, no parameter,
   buffer (BatchNorm statistics) or random state of the run changes, so the run goes on exactly as if they
   had not been. The spans go to ``profile-timeline-rank<r>.jsonl``, in the run timeline's format, for the
   lab's ``calibrate.from_events``;
2. meets the other ranks (a barrier, where the communicator's first collective would have met them); rank 0
   writes ``auto-profiled.json`` (steps, seconds, the parameters in gradient-ready order);
3. waits for the lab's plan, ``auto-trials.json`` (commlab/engine/trials.py), or ``auto-failed.json`` (the advisor
   failed: the rank raises with its message), at most ``timeout_s``.

Rank 0 puts the dry steps and the wait on the timeline's advisor lane. What the profile and the predictions
cost the run (``Waited``) is the dry steps' time plus the wait for the plan after the barrier. Not counted:
start-up the run pays anyway (torch's first optimizer imports torch._dynamo, 1.3 s here, made before the
first dry step; the barrier's wait for the other rank's start-up).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from commlab.engine import data, runfiles
from commlab.engine.probe import LayerProbe
from commlab.engine.runlog import write_json_atomic
from commlab.engine.stepper import make_optimizer
from commlab.engine.timeline import Clock, CudaClock, Timeline

POLL_S = 0.005


@dataclass
class Waited:
    """What the profile steps and the wait for the plan took on this rank (seconds)."""
    profile_s: float
    wait_s: float
    steps: int


def pending(run_dir: Optional[str]) -> Optional[dict]:
    """The lab's request for profile steps (``auto-pending.json``), checked, or None."""
    if not run_dir:
        return None
    path = os.path.join(run_dir, runfiles.AUTO_PENDING)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        req = json.load(f)
    for k, lo in (("profile_steps", 1), ("timeout_s", 1)):
        v = req.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{path}: {k} must be a number >= {lo}, got {v!r}")
    return req


def profile_then_wait(spec, model, dataset, loss_fn, run_dir: str, rank: int, world: int, device,
                      req: dict) -> Waited:
    """Steps 1-3 above; returns what they took."""
    clock = CudaClock(device) if device.type == "cuda" else Clock()
    tl = Timeline(os.path.join(run_dir, runfiles.PROFILE_TIMELINE.format(rank=rank)), rank, clock=clock)
    try:
        t0, t1 = dry_steps(spec, model, dataset, loss_fn, tl, rank, world, device, int(req["profile_steps"]))
    finally:
        tl.close()
    if dist.is_initialized() and dist.get_world_size() > 1:
        # the ranks meet here as they would at the communicator's first collective: a wait here is the other
        # rank's start-up (or its slower dry steps), reported as barrier_s
        dist.barrier()
    tb = time.perf_counter()
    if rank == 0:
        write_json_atomic(os.path.join(run_dir, runfiles.AUTO_PROFILED),
                          {"steps": int(req["profile_steps"]), "wall_s": t1 - t0, "barrier_s": tb - t1,
                           "ranks": world, "params": param_list(model), "t": time.time()})
    wait_plan(run_dir, float(req["timeout_s"]))
    t2 = time.perf_counter()
    if rank == 0:
        lane = Timeline(os.path.join(run_dir, runfiles.TIMELINE.format(rank=rank)), rank, clock=clock)
        lane.span("advisor", f"profile: {req['profile_steps']} dry steps", t0, t1,
                  {"profile_steps": int(req["profile_steps"])})
        lane.span("advisor", "waiting for the advisor's plan", tb, t2, {})
        lane.close()
    return Waited(profile_s=t1 - t0, wait_s=t2 - tb, steps=int(req["profile_steps"]))


def param_list(model) -> list:
    """[name, bytes] of the trainable parameters in gradient-ready order (the reverse of registration, as the
    communicator orders them): what the lab's profile lists (``commlab.lab.strategy.perfmodel.calibrate.param_list``)."""
    return [[n, p.numel() * p.element_size()] for n, p in model.named_parameters() if p.requires_grad][::-1]


def dry_steps(spec, model, dataset, loss_fn, tl, rank: int, world: int, device, steps: int) -> tuple:
    """``steps`` timed forward/backward passes that leave the run untouched (see the module docstring).
    Returns the host times of their start and end: the start is taken after the scratch optimizer is made,
    since torch's first optimizer imports torch._dynamo (1.3 s here), which the run's own optimizer pays
    otherwise."""
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b.detach().clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    scratch = [p.detach().clone().requires_grad_(True) for p in params]
    opt = make_optimizer(spec, scratch)
    sampler = data.ShardSampler(dataset.size("train"), spec.batch_size, rank, world, spec.seed)
    probe = LayerProbe(model, tl)
    model.train()
    t0 = time.perf_counter()
    try:
        for k in range(steps):
            x, y = dataset.batch("train", next(sampler))
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            m0 = tl.mark()
            loss = loss_fn(model(x), y)
            m1 = tl.mark()
            loss.backward()
            m2 = tl.mark()
            for s, p in zip(scratch, params):
                s.grad = p.grad
            m3 = tl.mark()
            opt.step()
            m4 = tl.mark()
            model.zero_grad(set_to_none=True)
            probe.reset()
            args = {"step": k, "profile": True}
            tl.span("forward", "forward", m0, m1, args)
            tl.span("backward", "backward", m1, m2, args)
            tl.span("optimizer", "optimizer", m3, m4, args)
            tl.span("step", f"profile step {k}", m0, m4, args)
            tl.flush()
        t1 = time.perf_counter()
    finally:
        probe.close()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    return t0, t1


def wait_plan(run_dir: str, timeout_s: float) -> None:
    """Until the lab writes the trial plan; raises with the lab's message if it writes AUTO_FAILED instead, or
    when ``timeout_s`` pass without either."""
    plan, failed = os.path.join(run_dir, runfiles.AUTO_TRIALS), os.path.join(run_dir, runfiles.AUTO_FAILED)
    end = time.monotonic() + timeout_s
    while True:
        if os.path.isfile(failed):
            with open(failed) as f:
                raise RuntimeError(f"strategy auto: {json.load(f).get('error', 'the advisor failed')}")
        if os.path.isfile(plan):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"strategy auto: no trial plan ({runfiles.AUTO_TRIALS}) {timeout_s:g} s after the "
                               "profile steps; the advisor in the run's supervisor did not answer")
        time.sleep(POLL_S)
