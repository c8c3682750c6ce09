"""MergeComp's 8 x V100 experiments, as the performance model sees them (table (c) of model_validation).

The published setup (bench/data/mergecomp_v100.json, "setup") is rebuilt from parts, none fitted to a
published bar:

- compute: torchvision ResNet-50/101, batch 64, fp32, on the V100-SXM2 device profile
  (commlab.lab.strategy.perfmodel.roofline: per-layer roofline, compute efficiency from NVIDIA's published ResNet-50
  throughput, commlab.lab.strategy.perfmodel.devices);
- links: NCCL's ring/tree and protocols (commlab.lab.strategy.perfmodel.collectives) on NVLink or PCIe; either the
  datasheet rate x the device's link efficiency ("datasheet"), or one effective rate per interconnect
  fitted to the six published FP32 baselines of that interconnect ("fp32-calibrated": a link
  calibration, as ``commlab net check`` would give, used for every compressed configuration);
- Horovod: tensors are fused per cycle (5 ms, Horovod 0.20's default, for the FP32 and Horovod fp16
  runs; 0.1 ms for MergeComp's, from run_pcie.sh) up to 64 MB and issued at the cycle's end;
- MergeComp's codecs (``CODECS``): payload bytes per gradient element and the bytes each codec's
  kernels read and write per element, read off its code (mergeComp_dl/torch/compressor, memory/);
  their time on the V100 is those bytes over its memory bandwidth (memory-bound), or the CPU's
  dispatch of their kernels (``OP_CPU_S`` each), whichever is longer; all-gathered payloads are
  decoded once per rank;
- layer-wise: one codec call and one collective per tensor; MergeComp: the model's own search of the
  partition (1 to 4 groups, split points scanned), as MergeComp searches by measured iteration time.

The scaling factor is one GPU's step (compute only) over the step on p GPUs, as the paper's throughput
ratio. Everything assumed is a constant below, set once.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from commlab.engine.schedules import layer_of
from commlab.engine.external import import_torchvision
from commlab.lab.strategy.perfmodel import collectives, devices, roofline
from commlab.lab.strategy.perfmodel.iteration import Bucket, Round, Step, iteration_time

DATA = Path(__file__).resolve().parent / "data" / "mergecomp_v100.json"
BATCH = 64
HOROVOD_CYCLE_S = 5e-3      # Horovod 0.20's default cycle time (v0.21 changed it to 1 ms)
MERGECOMP_CYCLE_S = 0.1e-3  # run_pcie.sh / run_nvlink.sh: --cycle-time-ms 0.1
FUSION_BYTES = 64 << 20     # Horovod 0.20's default fusion buffer
OP_CPU_S = 10e-6            # assumed: one eager PyTorch operator's dispatch and launch on the CPU
HOROVOD_OP_S = 50e-6        # assumed: one Horovod operation's enqueue and negotiation, on the CPU


@dataclass(frozen=True)
class Codec:
    op: str                 # the collective: allreduce or allgather
    payload: float          # bytes on the wire per fp32 gradient element
    encode: float           # bytes the encode (and its error-feedback memory) moves per element
    decode: float           # bytes one payload's decode moves per element of the gradient
    enc_kernels: int
    dec_kernels: int


# bytes per element, from MergeComp's code (the estimate of each stage in the comment)
CODECS = {
    "none": Codec("allreduce", 4.0, 0.0, 0.0, 0, 0),
    # cast (read 4, write 2) / cast back (2, 4)
    "fp16": Codec("allreduce", 2.0, 6.0, 6.0, 1, 1),
    # 1% values (fp32) + int32 indices; DGC memory: momentum and velocity updates (24), |x| > threshold
    # from a 0.1% sample (5), nonzero (1), masked memory update (9)
    "dgc": Codec("allgather", 0.08, 39.0, 4.0, 15, 2),
    # residual (12), |x| (8), torch.topk: radix select, SORT_PASSES reads of 4 bytes (16), update (8)
    "topk": Codec("allgather", 0.08, 12.0 + 8.0 + 4 * roofline.SORT_PASSES + 8.0, 4.0, 10, 2),
    # residual (12), torch.randperm(numel): a radix sort of 64-bit keys and values, 8 passes reading and
    # writing 16 bytes each (256), update (8)
    "randomk": Codec("allgather", 0.08, 12.0 + 256.0 + 8.0, 4.0, 12, 2),
    # int8 levels (64 < 128); residual (12), norm, |x|, scale, floor, rand, compare, sign, cast (61)
    "qsgd": Codec("allgather", 1.0, 73.0, 13.0, 12, 3),
    # packed signs and a mean; residual (12), sign (5), pack (1.1), |x| mean (12) / unpack, +-1, scale (14)
    "efsignsgd": Codec("allgather", 0.125, 30.0, 14.0, 8, 4),
    "signsgd": Codec("allgather", 0.125, 18.0, 14.0, 6, 4),
    # momentum (12) + signsgd's
    "signum": Codec("allgather", 0.125, 30.0, 14.0, 8, 4),
    # residual (12), mask (5), two means (10), pack (1.1) / unpack and two masked products (22)
    "onebit": Codec("allgather", 0.125, 29.0, 22.0, 9, 6),
}


def published() -> List[dict]:
    return json.loads(DATA.read_text())["rows"]


def model_counts(name: str) -> roofline.Counts:
    import_torchvision()
    import torchvision.models as tvm
    with torch.device("meta"):
        m = getattr(tvm, name)(weights=None)
        x = torch.randn(BATCH, 3, 224, 224)
        y = torch.zeros(BATCH, dtype=torch.long)
    return roofline.count(m, x, y, torch.nn.functional.cross_entropy)


@dataclass(frozen=True)
class Knobs:
    """What the "published-calibrated" variant sets from one published point each (1.0 / 0: the device
    profile's own values)."""
    codec_scale: Tuple[Tuple[str, float], ...] = ()
    """codec -> its cost over the memory-bound model's"""
    per_call_s: float = 0.0
    """extra CPU seconds per codec call (layer-wise pays it per tensor)"""

    def scale(self, name: str) -> float:
        return dict(self.codec_scale).get(name, 1.0)


class Setup:
    """One model on the V100: its roofline profile and tensors in gradient-ready order."""

    def __init__(self, name: str, device: devices.Device):
        self.name, self.device = name, device
        self.profile = roofline.profile(model_counts(name), device, "fp32")
        p = self.profile
        self.sizes = [b for _, b in p.params]
        self.ready = [p.layer_ready[layer_of(n)] for n, _ in p.params]
        self.one = p.forward_s + p.backward_s + p.optimizer_s

    def codec_s(self, codec: Codec, nbytes: float, which: str, scale: float = 1.0) -> float:
        elems = nbytes / 4
        gpu = elems * (codec.encode if which == "encode" else codec.decode) / (self.device.mem_bw * self.device.memory_eff)
        kernels = codec.enc_kernels if which == "encode" else codec.dec_kernels
        gpu += kernels * self.device.kernel_s
        return max(gpu * scale, kernels * OP_CPU_S)

    def step(self, groups: List[List[int]], codec: Codec, world: int, cycle: float, fused: bool,
             scale: float = 1.0, per_call: float = 0.0) -> Step:
        """Buckets: ``groups`` of tensor indices, each one codec call and one collective (``fused``: Horovod
        fuses what is ready in the same cycle, up to 64 MB, instead)."""
        if fused:
            groups = horovod_fusion(self.ready, self.sizes, cycle)
        buckets = []
        for g in groups:
            raw = sum(self.sizes[i] for i in g)
            ready = max(self.ready[i] for i in g)
            ready = (math.floor(ready / cycle) + 1) * cycle  # issued at the end of the cycle it became ready in
            enc = HOROVOD_OP_S + (self.codec_s(codec, raw, "encode", scale) + per_call if codec.encode else 0.0)
            dec = (self.codec_s(codec, raw, "decode", scale) * (world if codec.op == "allgather" else 1)
                   if codec.decode else 0.0)
            nbytes = raw / 4 * codec.payload
            buckets.append(Bucket(ready=ready, encode=enc, raw_bytes=raw,
                                  rounds=[Round(codec.op, nbytes, after=dec, header=False)]))
        p = self.profile
        return Step(forward=p.forward_s, backward=p.backward_s, optimizer=p.optimizer_s, buckets=buckets)

    def scaling(self, groups, codec: Codec, world: int, link, cycle: float, fused: bool = False,
                scale: float = 1.0, per_call: float = 0.0) -> float:
        step = self.step(groups, codec, world, cycle, fused, scale, per_call)
        return self.one / iteration_time(step, link, world, "wfbp").total

    def mergecomp(self, codec: Codec, world: int, link, scale: float = 1.0,
                  per_call: float = 0.0) -> Tuple[float, List[List[int]]]:
        """The best partition into 1..4 contiguous groups the model finds (MergeComp searches the same
        space by measured iteration time): each split point scanned over 24 positions, one at a time."""
        n = len(self.sizes)
        cum = [0.0]
        for b in self.sizes:
            cum.append(cum[-1] + b)
        grid = sorted({min(n - 1, max(1, next(i for i, c in enumerate(cum) if c >= cum[-1] * q / 25)))
                       for q in range(1, 25)})

        def groups(cuts):
            edges = [0, *sorted(cuts), n]
            return [list(range(a, b)) for a, b in zip(edges, edges[1:]) if b > a]
        def sc(cuts):
            return self.scaling(groups(cuts), codec, world, link, MERGECOMP_CYCLE_S, False, scale, per_call)
        best = (sc([]), [])
        for k in (1, 2, 3):
            cuts = list(best[1])
            if len(cuts) != k - 1:
                break
            options = [(sc(cuts + [c]), cuts + [c]) for c in grid if c not in cuts]
            top = max(options)
            if top[0] > best[0]:
                best = top
        return best[0], groups(best[1])


def horovod_fusion(ready: List[float], sizes: List[int], cycle: float) -> List[List[int]]:
    """Horovod's tensor fusion: what is ready in the same cycle, in order, up to FUSION_BYTES a buffer."""
    out, cur, cur_bytes, cur_tick = [], [], 0, None
    for i, (t, b) in enumerate(zip(ready, sizes)):
        tick = math.floor(t / cycle)
        if cur and (tick != cur_tick or cur_bytes + b > FUSION_BYTES):
            out.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += b
        cur_tick = tick
    if cur:
        out.append(cur)
    return out


def topology(link: str, bw: float) -> collectives.Topology:
    return collectives.Topology(gpus_per_node=8, intra_bw=bw, nic_bw=12.5e9, nics=1, intra=link)


def datasheet_bw(device: devices.Device, link: str) -> float:
    return (device.nvlink_bw if link == "nvlink" else device.pcie_bw) * device.link_eff


def predict_row(setups: Dict[str, Setup], row: dict, bw: float, knobs: Knobs = Knobs()) -> float:
    s = setups[row["model"]]
    topo = topology(row["link"], bw)
    p = row["gpus"]
    singles = [[i] for i in range(len(s.sizes))]
    if row["compressor"] == "none":
        return 100 * s.scaling(singles, CODECS["none"], p, topo, HOROVOD_CYCLE_S, fused=True)
    codec, k = CODECS[row["compressor"]], (knobs.scale(row["compressor"]), knobs.per_call_s)
    if row["link"] == "nvlink" and row["schedule"] == "layerwise":  # Horovod's own fp16 compression
        return 100 * s.scaling(singles, codec, p, topo, HOROVOD_CYCLE_S, True, *k)
    if row["schedule"] == "layerwise":
        return 100 * s.scaling(singles, codec, p, topo, MERGECOMP_CYCLE_S, False, *k)
    return 100 * s.mergecomp(codec, p, topo, *k)[0]


def _solve(f, target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] (log scale) with f(x) = target, f decreasing; the nearer end when out of reach."""
    if f(lo) <= target:
        return lo
    if f(hi) >= target:
        return hi
    for _ in range(40):
        m = math.sqrt(lo * hi)
        lo, hi = (m, hi) if f(m) > target else (lo, m)
    return math.sqrt(lo * hi)


CALIBRATION_POINT = {"model": "resnet50", "gpus": 2, "link": "pcie"}
"""The published point the "published-calibrated" variant takes its knobs from: the per-call overhead
from fp16's layer-wise bar (a cast costs what its bytes cost, so what fp16 layer-wise loses beyond its
link time is per call), then each other codec's cost scale from its MergeComp bar. Its errors leave
these points out."""


def calibrate_knobs(setups: Dict[str, Setup], rows: List[dict], bw: Dict[str, float]) -> Tuple[Knobs, List[dict]]:
    """The per-call overhead, then the codec cost scales (module docstring); the knobs and the rows used."""
    at = [r for r in rows if all(r[k] == v for k, v in CALIBRATION_POINT.items())]
    lw = next(r for r in at if r["compressor"] == "fp16" and r["schedule"] == "layerwise")
    per_call = _solve(lambda x: predict_row(setups, lw, bw["pcie"], Knobs((), x)), lw["scaling_pct"], 1e-7, 1.0)
    used, scales = [lw], {}
    for r in at:
        if r["schedule"] != "mergecomp" or r["compressor"] == "fp16":
            continue
        used.append(r)
        scales[r["compressor"]] = _solve(
            lambda x: predict_row(setups, r, bw[r["link"]], Knobs(((r["compressor"], x),), per_call)),
            r["scaling_pct"], 1e-2, 1e5)
    return Knobs(tuple(sorted(scales.items())), per_call), used


def calibrate_bw(setups: Dict[str, Setup], rows: List[dict], link: str) -> float:
    """The one effective rate of ``link`` that best fits its published FP32 baselines (least squares in
    points, golden-section search on a log scale over 0.05..500 GB/s)."""
    base = [r for r in rows if r["compressor"] == "none" and r["link"] == link]

    def err(logb):
        return sum((predict_row(setups, r, math.exp(logb)) - r["scaling_pct"]) ** 2 for r in base)
    a, b = math.log(0.05e9), math.log(500e9)
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = err(c), err(d)
    for _ in range(40):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = err(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = err(d)
    return math.exp((a + b) / 2)


def table_c(device_name: str = "V100-SXM2") -> dict:
    """Every published number beside the model's prediction in three variants (module docstring, and
    "published-calibrated": the fp32-calibrated links plus each codec's cost scale and the per-call
    overhead set from one published point each); errors in points, calibration points left out."""
    dev = devices.get(device_name)
    rows = published()
    setups = {m: Setup(m, dev) for m in sorted({r["model"] for r in rows})}
    ds = {l: datasheet_bw(dev, l) for l in ("nvlink", "pcie")}
    fitted = {l: calibrate_bw(setups, rows, l) for l in ("nvlink", "pcie")}
    knobs, used = calibrate_knobs(setups, rows, fitted)
    variants = {"datasheet": (ds, Knobs()), "fp32-calibrated": (fitted, Knobs()),
                "published-calibrated": (fitted, knobs)}
    calibration = {"fp32-calibrated": lambda r: r["compressor"] == "none",
                   "published-calibrated": lambda r: r["compressor"] == "none" or r in used,
                   "datasheet": lambda r: False}
    out = []
    for r in rows:
        o = {k: r[k] for k in ("model", "gpus", "link", "compressor", "schedule", "scaling_pct")}
        for v, (bw, kn) in variants.items():
            pred = predict_row(setups, r, bw[r["link"]], kn)
            o[v] = round(pred, 1)
            o[v + "_error"] = round(pred - r["scaling_pct"], 1)
            o[v + "_calibration"] = calibration[v](r)
        out.append(o)
    summary = {}
    for v in variants:
        for part, sel in (("predicted", lambda o: True), ("compressed", lambda o: o["compressor"] != "none"),
                          ("fp32 baselines", lambda o: o["compressor"] == "none")):
            errs = [abs(o[v + "_error"]) for o in out if sel(o) and not o[v + "_calibration"]]
            if errs:
                summary[f"{v} / {part}"] = {
                    "n": len(errs), "median_abs_points": round(statistics.median(errs), 1),
                    "mean_abs_points": round(statistics.mean(errs), 1), "max_abs_points": round(max(errs), 1),
                    "within_5_points": sum(e <= 5 for e in errs)}
    return {"device": dev.name, "compute_1gpu_ms": {m: round(s.one * 1e3, 1) for m, s in setups.items()},
            "bus_gb_s": {"datasheet": {l: round(b / 1e9, 3) for l, b in ds.items()},
                         "fp32-calibrated": {l: round(b / 1e9, 3) for l, b in fitted.items()}},
            "codec_scale": {k: round(v, 2) for k, v in knobs.codec_scale},
            "per_call_ms": round(knobs.per_call_s * 1e3, 3), "rows": out, "summary": summary}
