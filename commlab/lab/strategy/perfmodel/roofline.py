"""Compute on a device this machine may lack: a roofline per layer from the model's FLOPs and bytes.

``count`` runs one forward and backward pass of the model on the meta device (shapes only, no data,
no memory) under a dispatch mode that sees every aten operator, forward and backward:

- FLOPs of matrix products, convolutions and attention from torch.utils.flop_counter's formulas
  (the same ones FlopCounterMode uses), 0 for the rest;
- bytes: every input and output tensor of the operator, once (compulsory traffic; no cache reuse, no
  re-reads: batch norm's two passes over its input count as one);
- the layer: the module whose parameter the operator reads (a weight, a batch norm's scale), found by
  storage, so backward operators go to the right layer too; operators that read no parameter (an
  activation, pooling, a residual add, their gradients) go to the next layer that runs, as the
  engine's probe counts them (commlab/engine/probe.py); views move nothing and are skipped.

``seconds`` prices one operator on a device: ``max(F / (P e_c), B / (W e_m), t_kernel)``, the peak
FLOP/s P and memory bandwidth W of the precision it runs in, the efficiencies e_c and e_m
(commlab.lab.strategy.perfmodel.devices) and the shortest kernel. 16-bit precisions move half the bytes.
``profile`` turns the counts into a commlab.lab.strategy.perfmodel.calibrate.Profile (per-layer forward, backward and
ready times), so the step simulation runs on it unchanged; the optimizer step is memory-bound (SGD
with momentum reads parameter, gradient and momentum and writes two: 5 bytes per gradient byte; Adam 7).

``codec_curve``: a compressor's encode / between-rounds / decode cost on the device, from the bytes
its own code moves (driving its exchange through commlab.engine.comm.exchange.run_exchange with a clock that adds up
the priced operators of two sizes, then fitted fixed + per byte). Sorting kernels (top-k, sort) read
their input ``SORT_PASSES`` times (a radix select's passes over 32-bit keys).
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from commlab.engine import models
from commlab.engine.comm.exchange import run_exchange
from commlab.engine.compressors import contract
from commlab.engine.compressors.capabilities import BucketContext
from commlab.engine.spec import JobSpec
from commlab.engine.trainer import load_data
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel.devices import Device

SORT_PASSES = 4
SORTING = {"aten.topk", "aten.sort", "aten.kthvalue", "aten.msort"}
OPTIMIZER_BYTES = {"sgd": 5.0, "adam": 7.0, "adamw": 7.0}
HALF = {"fp16", "bf16"}


@dataclass
class Op:
    name: str
    flops: float
    bytes: float


@dataclass
class Counts:
    """One training step's operators, per layer, as ``count`` found them."""
    params: List[Tuple[str, int]]
    """(name, bytes) of the trainable parameters in gradient-ready order (reverse registration)"""
    forward: Dict[str, List[Op]] = field(default_factory=dict)
    backward: Dict[str, List[Op]] = field(default_factory=dict)
    backward_order: List[str] = field(default_factory=list)
    """layers in the order their gradients become ready"""
    batch: int = 0

    def totals(self) -> Dict[str, float]:
        fw = [o for ops in self.forward.values() for o in ops]
        bw = [o for ops in self.backward.values() for o in ops]
        return {"forward_flops": sum(o.flops for o in fw), "backward_flops": sum(o.flops for o in bw),
                "forward_bytes": sum(o.bytes for o in fw), "backward_bytes": sum(o.bytes for o in bw),
                "kernels": len(fw) + len(bw)}


class _Recorder(TorchDispatchMode):
    """Every non-view aten operator with its FLOPs and bytes, in the order they run; with ``price``,
    ``clock`` adds up their seconds."""

    def __init__(self, price: Optional[Callable[[Op], float]] = None):
        super().__init__()
        self.ops: List[Op] = []
        self.price = price
        self.clock = 0.0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or func.is_view:
            return out
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        name = str(func.overloadpacket)
        formula = flop_registry.get(func.overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula else 0.0
        seen = {_storage(t) for t in ins}  # an output that is an input (in place, out=) counts once
        nbytes = float(sum(t.numel() * t.element_size() for t in ins)
                       + sum(t.numel() * t.element_size() for t in outs if _storage(t) not in seen))
        if name in SORTING:
            nbytes += (SORT_PASSES - 1) * sum(t.numel() * t.element_size() for t in ins)
        op = Op(name, flops, nbytes)
        self.ops.append(op)
        if self.price:
            self.clock += self.price(op)
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def count(model: torch.nn.Module, x, y, loss_fn) -> Counts:
    """Forward, loss and backward of ``model`` on ``x`` (tensors on the meta device), per layer: a layer
    (a module that owns parameters) gets the operators from the end of the layer before it to its own
    end: in forward, its forward hook; in backward, the last of its parameters' gradients (their
    post-accumulate-grad hooks), as commlab/engine/probe.py times them. The loss counts in the last layer's
    forward."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layer_of = {n: n.rsplit(".", 1)[0] if "." in n else n for n, _ in named}
    rec = _Recorder()
    ends_fwd: Dict[str, int] = {}
    ends_bwd: Dict[str, int] = {}
    handles = []
    modules = dict(model.named_modules())
    for layer in dict.fromkeys(layer_of.values()):
        def fwd_end(mod, inp, out, layer=layer):
            ends_fwd[layer] = len(rec.ops)
        handles.append((modules[layer] if layer in modules else model).register_forward_hook(fwd_end))
    for n, p in named:
        def grad_ready(param, layer=layer_of[n]):
            ends_bwd[layer] = len(rec.ops)
        handles.append(p.register_post_accumulate_grad_hook(grad_ready))
    try:
        with rec:
            loss = loss_fn(model(x), y)
            n_fwd = len(rec.ops)
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    c = Counts(params=list(reversed([(n, p.numel() * p.element_size()) for n, p in named])),
               batch=int(x.shape[0]) if hasattr(x, "shape") else 0)
    _split(rec.ops[:n_fwd], ends_fwd, c.forward, None)
    _split(rec.ops[n_fwd:], {k: v - n_fwd for k, v in ends_bwd.items()}, c.backward, c.backward_order)
    return c


def _split(ops: List[Op], ends: Dict[str, int], into: Dict[str, List[Op]], order: Optional[List[str]]) -> None:
    """Give each layer the operators since the previous layer's end (``ends``: operator counts); what
    runs after the last end counts in the last layer."""
    start = 0
    layers = sorted(ends, key=lambda k: ends[k])
    for i, layer in enumerate(layers):
        stop = len(ops) if i == len(layers) - 1 else ends[layer]
        into[layer] = list(ops[start:stop])
        start = max(start, stop)
        if order is not None:
            order.append(layer)


SIZING_EXAMPLES = 64
"""Examples in the synthetic data set ``count_spec`` builds its model on (commlab.engine.preflight.DESCRIBE_EXAMPLES)."""


def count_spec(spec: dict) -> Counts:
    """``count`` for a spec's model, data set and batch size, built on the meta device."""
    js = JobSpec.from_dict(spec) if isinstance(spec, dict) else spec
    if js.dataset.name == "synthetic":  # the counts depend on the data's shape, never on how many examples there
        # are: a small data set of that shape, as commlab.engine.preflight.sized builds (its DESCRIBE_EXAMPLES);
        # an ImageNet-shaped one of the default 2048 examples is 1.5 GB and took 13 s to make here
        js = dataclasses.replace(js, dataset=dataclasses.replace(js.dataset, size=SIZING_EXAMPLES))
    info = load_data(js).info
    b = js.batch_size
    with torch.device("meta"):
        model = models.build(js.model.name, info, **js.model.options)
        if info.kind == "text":
            x = torch.zeros(b, *info.input_shape, dtype=torch.long)
            y = torch.zeros(b, *info.input_shape, dtype=torch.long)
        else:
            x = torch.randn(b, *info.input_shape)
            y = torch.zeros(b, dtype=torch.long)
    return count(model, x, y, models.make_loss(js.model.loss))


# --------------------------------------------------------------------------- pricing

def pricer(device: Device, precision: str, compute_eff: Optional[float] = None) -> Callable[[Op], float]:
    """Seconds of one operator on ``device`` in ``precision`` (the module docstring's formula)."""
    peak = device.peak(precision) * (compute_eff if compute_eff is not None else device.efficiency(precision))
    bw = device.mem_bw * device.memory_eff
    scale = 0.5 if precision in HALF else 1.0

    def price(op: Op) -> float:
        return max(op.flops / peak, op.bytes * scale / bw, device.kernel_s)
    return price


def step_seconds(c: Counts, device: Device, precision: str, compute_eff: Optional[float] = None,
                 optimizer: str = "sgd") -> Dict[str, float]:
    price = pricer(device, precision, compute_eff)
    fwd = sum(price(o) for ops in c.forward.values() for o in ops)
    bwd = sum(price(o) for ops in c.backward.values() for o in ops)
    grad = sum(b for _, b in c.params)
    opt = OPTIMIZER_BYTES.get(optimizer, 5.0) * grad / (device.mem_bw * device.memory_eff)
    return {"forward": fwd, "backward": bwd, "optimizer": opt, "total": fwd + bwd + opt}


def solve_compute_eff(c: Counts, device: Device, precision: str, samples_per_s: float,
                      optimizer: str = "sgd") -> float:
    """The compute efficiency at which the roofline step of ``c`` (its batch) runs at ``samples_per_s``
    (a published single-GPU throughput). Raises ValueError when even the peak is too slow."""
    target = c.batch / samples_per_s
    if step_seconds(c, device, precision, 1.0, optimizer)["total"] > target:
        raise ValueError(f"{device.name} {precision}: {samples_per_s:g} samples/s is above the roofline at peak")
    lo, hi = 1e-3, 1.0
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if step_seconds(c, device, precision, mid, optimizer)["total"] > target else (lo, mid)
    return hi


def profile(c: Counts, device: Device, precision: str, base: Optional[cal.Profile] = None,
            optimizer: str = "sgd") -> cal.Profile:
    """A Profile of the step on ``device``: per-layer roofline times (``base`` gives the model, data set,
    batch and spec to keep; its compressor curves are not kept: they were measured elsewhere)."""
    price = pricer(device, precision)
    fwd = {k: sum(price(o) for o in ops) for k, ops in c.forward.items()}
    bwd = {k: sum(price(o) for o in ops) for k, ops in c.backward.items()}
    ready, t = {}, 0.0
    for layer in c.backward_order:
        t += bwd[layer]
        ready[layer] = t
    secs = step_seconds(c, device, precision, optimizer=optimizer)
    p = copy.deepcopy(base) if base is not None else cal.Profile(model="", dataset="", batch_size=c.batch)
    p.params = list(c.params)
    p.forward_s, p.backward_s, p.optimizer_s = secs["forward"], secs["backward"], secs["optimizer"]
    p.layer_forward, p.layer_backward, p.layer_ready = fwd, bwd, ready
    p.overlap_slowdown = 1.0
    p.compressors = {}
    p.link = None
    p.source = f"roofline on {device.name} ({precision}, compute efficiency {device.efficiency(precision):.3g})"
    p.machine = {"device": device.name, "precision": precision, "clock": "roofline (commlab.lab.strategy.perfmodel.roofline)"}
    return p


# --------------------------------------------------------------------------- compressors on the device

CODEC_NUMELS = (1 << 16, 1 << 20)


def codec_curve(comp: dict, device: Device, precision: str = "fp32", numels=CODEC_NUMELS) -> dict:
    """Fixed + per-byte encode / between / decode seconds of the compressor config ``comp`` on ``device``,
    priced from the operators its exchange runs (module docstring); the same shape as
    calibrate.measure_compressor's, so build_step reads it unchanged."""
    price = pricer(device, precision)
    stages: Dict[str, list] = {"encode": [], "between": [], "decode": []}
    torch.manual_seed(0)
    for n in numels:
        cols = 256 if n % 256 == 0 else 1
        c = cal.make_compressor(comp)
        bucket = BucketContext(layout=((0, (n // cols, cols)),))
        contract.skip_warmup(c)
        x = torch.randn(n)
        rounds, _ = cal.drive(c, x.clone(), bucket=bucket)  # lazy state (residuals, PowerSGD's Q) made outside
        s = _priced(c, x, price, 1, bucket)
        for k, v in (("encode", s[0]), ("between", sum(s[1:-1])), ("decode", s[-1])):
            stages[k].append((n * 4, v))
        if rounds and rounds[-1][0] == "allgather":  # what each further rank's payload adds to the decode
            many = _priced(c, x, price, cal.DECODE_PAYLOADS, bucket)[-1]
            stages.setdefault("decode_more", []).append((n * 4, max(0.0, many - s[-1]) / (cal.DECODE_PAYLOADS - 1)))
    out = {"sizes": [n * 4 for n in numels], "kind": "modeled",
           "source": f"from the bytes its operators move on {device.name} {precision} (commlab.lab.strategy.perfmodel.roofline)"}
    for k, rows in stages.items():
        out[k] = list(cal.fit_affine([r[0] for r in rows], [r[1] for r in rows], relative=False))
    return out


def _priced(c, x, price, world: int, bucket) -> List[float]:
    """The priced compute of one exchange of ``c`` on ``x`` as one of ``world`` ranks that sent the same
    payload (calibrate.gathered): [encode, between rounds..., decode] seconds on the device."""
    rec = _Recorder(price)
    reply = cal.gathered(world)

    def collective(op, payloads):
        rec.paused = True  # the link's work, priced by the collectives model
        try:
            return reply(op, payloads)
        finally:
            rec.paused = False
    with rec:
        (ex,) = run_exchange([c], [x.clone()], world, collective, timer=lambda: rec.clock, buckets=[bucket])
    return ex.compute


# --------------------------------------------------------------------------- calibrating against this machine

def measure_cpu(threads: int = 1, repeat: int = 5) -> Device:
    """This CPU as a device: its achievable peak (a 1024 x 1024 fp32 matrix product's FLOP/s), memory
    bandwidth (bytes read and written by a 64 MiB copy, per second) and shortest operator (an add of 16
    numbers), measured in ``threads`` threads, the medians of ``repeat``."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        big, small = torch.randn(16 << 20), torch.randn(16)

        def timed(f, n=1):
            f()
            out = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                for _ in range(n):
                    f()
                out.append((time.perf_counter() - t0) / n)
            return statistics.median(out)
        flops = 2 * 1024 ** 3 / timed(lambda: a @ b)
        bw = 2 * big.numel() * 4 / timed(big.clone)
        kernel = timed(lambda: small + small, 200)
    finally:
        torch.set_num_threads(old)
    return Device(name="this CPU", flops={"fp32": flops}, mem_bw=bw, pcie_bw=1.0, compute_eff={"fp32": 1.0},
                  memory_eff=1.0, kernel_s=kernel,
                  sources={"flops": "measured: 1024x1024 fp32 matmul", "mem_bw": "measured: 64 MiB copy",
                           "kernel_s": "measured: an add of 16 numbers"})


def fit_layers(c: Counts, profile: cal.Profile, device: Device, precision: str = "fp32") -> dict:
    """The efficiencies at which the roofline explains a measured per-layer profile of the same model:
    ``t_L = F_L / (P e_c) + B_L / (W e_m) + n_L t_op``, least squares in relative error over the layers'
    forward + backward times (each operator is compute- or memory-bound; a layer's span holds them all).
    Returns e_c, e_m, the per-operator overhead and, per layer, measured and modeled seconds (the roofline
    with the fitted efficiencies, ``max`` per operator as ``pricer`` prices it). An efficiency above 1
    says the measured peak is not the roof (on a CPU: activations that stay in cache move faster than a
    64 MiB copy)."""
    layers = [k for k in c.forward if k in profile.layer_forward and k in profile.layer_backward]
    X, y = [], []
    for k in layers:
        ops = c.forward[k] + c.backward.get(k, [])
        X.append([sum(o.flops for o in ops), sum(o.bytes for o in ops), len(ops)])
        y.append(profile.layer_forward[k] + profile.layer_backward[k])
    X, y = np.array(X, float), np.array(y, float)
    w = 1.0 / np.maximum(y, 1e-9)
    keep = [0, 1, 2]
    while True:  # non-negative: drop a term whose fit is negative, refit
        coef, *_ = np.linalg.lstsq(X[:, keep] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = dict(zip(keep, coef))
    a, b, k_op = max(full.get(0, 0.0), 0.0), max(full.get(1, 0.0), 0.0), max(full.get(2, 0.0), 0.0)
    e_c = 1.0 / (a * device.peak(precision)) if a > 0 else 1.0
    e_m = 1.0 / (b * device.mem_bw) if b > 0 else 1.0
    fitted = Device(name=device.name, flops=device.flops, mem_bw=device.mem_bw, pcie_bw=device.pcie_bw,
                    compute_eff={precision: e_c}, memory_eff=e_m, kernel_s=max(k_op, 1e-9))
    price = pricer(fitted, precision)
    rows = [{"layer": k, "measured_s": float(t),
             "modeled_s": sum(price(o) for o in c.forward[k] + c.backward.get(k, []))} for k, t in zip(layers, y)]
    return {"compute_eff": e_c, "memory_eff": e_m, "op_s": k_op, "rows": rows}
