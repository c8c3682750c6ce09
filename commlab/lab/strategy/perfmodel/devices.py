"""Devices this machine may not have: peak FLOP/s per precision, memory bandwidth, interconnects.

Every number in ``DEVICES`` is a vendor datasheet peak (dense, without structured sparsity), with the
datasheet named beside it; bandwidths are per direction (a datasheet's "300 GB/s NVLink" is the sum of
both directions of all links: 150 GB/s each way). A device can also be described by hand, as a dict or
a YAML file with the same fields (``from_dict``, ``load``).

What a datasheet does not give, and a prediction needs, are efficiencies (achieved / peak):

- ``compute_eff[precision]``: of the peak FLOP/s, for matrix products and convolutions; calibrated per
  device from a published single-GPU throughput (commlab.lab.strategy.perfmodel.roofline.solve_compute_eff), or from a step
  measured with commlab on a lent GPU (H100's TF32, which H200 shares), each value naming its source below;
  H100's and H200's other precisions take A100's.
- ``memory_eff``: of the memory bandwidth, for element-wise and normalisation kernels; 0.85, what
  bandwidth benchmarks (STREAM-like copies) reach on HBM GPUs. Assumed, not calibrated.
- ``link_eff``: of an interconnect's per-direction bandwidth, what NCCL's bus bandwidth reaches; 0.8.
  Assumed, not calibrated; a measured link replaces it.
- ``kernel_s``: the shortest a kernel takes (launch and tail), 4 µs. Assumed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, Optional, Tuple

import yaml

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
GB = 1e9
T = 1e12


@dataclass(frozen=True)
class Device:
    name: str
    flops: Dict[str, float]
    """peak FLOP/s of matrix products per precision (tensor cores where the precision uses them)"""
    mem_bw: float
    """memory bandwidth, bytes/s"""
    pcie_bw: float
    """host link (PCIe x16), bytes/s each way"""
    nvlink_bw: float = 0.0
    """NVLink, bytes/s each way per GPU (all its links); 0: none"""
    nvlink: str = ""
    pcie: str = ""
    nic_gbps: float = 100.0
    """a typical NIC of servers built with this GPU, Gbit/s"""
    nics_per_node: int = 1
    gpus_per_node: int = 8
    default_precision: str = "fp32"
    """what an fp32 model runs in by default: TF32 on Ampere and later (PyTorch's default for convolutions)"""
    compute_eff: Dict[str, float] = field(default_factory=dict)
    memory_eff: float = 0.85
    link_eff: float = 0.8
    kernel_s: float = 4e-6
    sources: Dict[str, str] = field(default_factory=dict)
    """field -> where its value comes from"""
    match: str = ""
    """a regular expression for the names torch.cuda.get_device_name gives this device"""

    def peak(self, precision: str) -> float:
        if precision not in self.flops:
            raise ValueError(f"device {self.name}: no peak FLOP/s for {precision}; it has {', '.join(self.flops)}")
        return self.flops[precision]

    def efficiency(self, precision: str) -> float:
        """Achieved / peak FLOP/s for ``precision`` (calibrated where a source is named, else the fp32 value)."""
        return self.compute_eff.get(precision, self.compute_eff.get("fp32", 0.5))

    @property
    def intra(self) -> str:
        return "nvlink" if self.nvlink_bw > 0 else "pcie"

    def intra_bw(self) -> float:
        """What NCCL's ring gets inside a node, per GPU each way: NVLink where there is, else PCIe."""
        return (self.nvlink_bw if self.nvlink_bw > 0 else self.pcie_bw) * self.link_eff

    def describe(self) -> str:
        link = f"{self.nvlink} {self.nvlink_bw / GB:g} GB/s" if self.nvlink_bw else f"{self.pcie} {self.pcie_bw / GB:g} GB/s"
        peaks = ", ".join(f"{p} {v / T:g}" for p, v in self.flops.items())
        return f"{self.name}: {peaks} TFLOP/s, {self.mem_bw / GB:g} GB/s memory, {link} each way"


V100_SHEET = "NVIDIA Tesla V100 datasheet (2018)"
A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (2021, 80GB SXM)"
H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (2022, SXM5)"
H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet (2024, SXM)"
DLE = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md (commit 291f0d0): "
       "ResNet-50 v1.5 training, 1 GPU")
ASSUMED = "assumed (module docstring of commlab.lab.strategy.perfmodel.devices)"

# Compute efficiencies: solved with commlab.lab.strategy.perfmodel.roofline.solve_compute_eff so that the roofline of
# torchvision's ResNet-50 (v1.5, like theirs; batch 256, main.py's default per GPU, 224x224) gives the DeepLearningExamples throughput; re-derived by
# tests/test_perfmodel_devices.py::test_compute_efficiencies_follow_from_their_sources.
EFF_SOURCES = {
    ("V100-SXM2", "fp32"): (f"{DLE}: 356 img/s FP32 on DGX-1 (V100 32GB)", 356.0),
    ("V100-SXM2", "fp16"): (f"{DLE}: 1156 img/s mixed precision on DGX-1 (V100 32GB)", 1156.0),
    ("A100", "tf32"): (f"{DLE}: 938 img/s TF32 on DGX A100 (A100 80GB)", 938.0),
    ("A100", "fp16"): (f"{DLE}: 2470 img/s mixed precision on DGX A100 (A100 80GB)", 2470.0),
}
# Measured with commlab's own engine where a GPU was lent (``commlab profile`` of torchvision's ResNet-50 on
# synthetic 224x224 images, batch 64, PyTorch's defaults: TF32 convolutions, no channels-last, no AMP); solved
# the same way at that batch, re-derived from the committed profile by
# tests/test_perfmodel_devices.py::test_a_gpu_measured_efficiency_follows_from_its_profile.
MEASURED_EFF_SOURCES = {
    ("H100", "tf32"): ("measured in this repository: ResNet-50, batch 64, 40.09 ms per step (1,596 img/s) on an "
                       "H100 80GB HBM3 (bench/data/h100/profile-resnet50-b64.json; scripts/gpu_check.sh profiles)",
                       1596.4, 64),
}
COMPUTE_EFF = {
    ("V100-SXM2", "fp32"): 0.721,
    ("V100-SXM2", "fp16"): 0.368,
    ("A100", "tf32"): 0.202,
    ("A100", "fp16"): 0.304,
    ("H100", "tf32"): 0.112,
}


def _eff(name: str) -> Dict[str, float]:
    got = {p: v for (d, p), v in COMPUTE_EFF.items() if d == name}
    if "fp16" in got:
        got.setdefault("bf16", got["fp16"])
    return got


def _eff_sources(name: str, like: Optional[str] = None) -> Dict[str, str]:
    """Where ``name``'s efficiencies come from: its own published or measured figures, else ``like``'s."""
    src = {f"compute_eff.{p}": s for (d, p), (s, _) in EFF_SOURCES.items() if d == (like or name)}
    if like:
        src = {k: f"{v}; taken from {like} (no {name} figure checked)" for k, v in src.items()}
    measured = "H100" if name == "H200" else name  # H200: H100's compute, faster memory
    for (d, p), (s, _, _) in MEASURED_EFF_SOURCES.items():
        if d == measured:
            src[f"compute_eff.{p}"] = s if d == name else f"{s}; taken from {d} (the same compute)"
    return src


def _eff_measured(like: str, name: str) -> Dict[str, float]:
    """``like``'s efficiencies with ``name``'s own measured ones over them."""
    return {**_eff(like), **{p: v for (d, p), v in COMPUTE_EFF.items() if d == name and (d, p) in MEASURED_EFF_SOURCES}}


def _sources(sheet: str, extra: Dict[str, str]) -> Dict[str, str]:
    return {"flops": sheet, "mem_bw": sheet, "pcie_bw": sheet, "nvlink_bw": sheet,
            "nic_gbps": "typical of servers of its generation (assumed)", "memory_eff": ASSUMED,
            "link_eff": ASSUMED, "kernel_s": ASSUMED, **extra}


DEVICES: Dict[str, Device] = {}


def _add(d: Device) -> None:
    DEVICES[d.name] = d


_add(Device("V100-SXM2", flops={"fp32": 15.7 * T, "fp16": 125 * T}, mem_bw=900 * GB, pcie_bw=16 * GB,
            nvlink_bw=150 * GB, nvlink="NVLink 2 (6 links)", pcie="PCIe 3.0 x16", nic_gbps=100, nics_per_node=4,
            compute_eff=_eff("V100-SXM2"), match=r"V100.*SXM|V100-SXM|Tesla V100$",
            sources=_sources(V100_SHEET, {**_eff_sources("V100-SXM2"),
                                          "nic_gbps": "DGX-1: 4 x 100 Gbit/s EDR InfiniBand per node"})))
_add(Device("V100-PCIE", flops={"fp32": 14 * T, "fp16": 112 * T}, mem_bw=900 * GB, pcie_bw=16 * GB,
            pcie="PCIe 3.0 x16", nic_gbps=25, nics_per_node=1,
            compute_eff={k: v * 1.0 for k, v in _eff("V100-SXM2").items()}, match=r"V100.*PCIE|V100S",
            sources=_sources(V100_SHEET, _eff_sources("V100-PCIE", like="V100-SXM2"))))
_add(Device("A100", flops={"fp32": 19.5 * T, "tf32": 156 * T, "fp16": 312 * T, "bf16": 312 * T},
            mem_bw=2039 * GB, pcie_bw=32 * GB, nvlink_bw=300 * GB, nvlink="NVLink 3 (12 links)", pcie="PCIe 4.0 x16",
            nic_gbps=200, nics_per_node=8, default_precision="tf32", compute_eff=_eff("A100"), match=r"A100",
            sources=_sources(A100_SHEET, {**_eff_sources("A100"),
                                          "nic_gbps": "DGX A100: 8 x 200 Gbit/s HDR InfiniBand per node"})))
_add(Device("H100", flops={"fp32": 67 * T, "tf32": 494.5 * T, "fp16": 989.5 * T, "bf16": 989.5 * T},
            mem_bw=3350 * GB, pcie_bw=64 * GB, nvlink_bw=450 * GB, nvlink="NVLink 4 (18 links)", pcie="PCIe 5.0 x16",
            nic_gbps=400, nics_per_node=8, default_precision="tf32", compute_eff=_eff_measured("A100", "H100"), match=r"H100",
            sources=_sources(H100_SHEET, {**_eff_sources("H100", like="A100"),
                                          "nic_gbps": "DGX H100: 8 x 400 Gbit/s NDR InfiniBand per node"})))
_add(Device("H200", flops={"fp32": 67 * T, "tf32": 494.5 * T, "fp16": 989.5 * T, "bf16": 989.5 * T},
            mem_bw=4800 * GB, pcie_bw=64 * GB, nvlink_bw=450 * GB, nvlink="NVLink 4 (18 links)", pcie="PCIe 5.0 x16",
            nic_gbps=400, nics_per_node=8, default_precision="tf32", compute_eff=_eff_measured("A100", "H100"), match=r"H200",
            sources=_sources(H200_SHEET, {**_eff_sources("H200", like="A100"),
                                          "nic_gbps": "DGX H200: 8 x 400 Gbit/s NDR InfiniBand per node"})))

ALIASES = {"V100": "V100-SXM2", "V100-SXM": "V100-SXM2", "V100-PCIe": "V100-PCIE", "A100-SXM4": "A100",
           "H100-SXM": "H100", "H100-SXM5": "H100", "H200-SXM": "H200"}


def get(name: str) -> Device:
    """A named device (case-insensitive; V100 is the SXM2 one), or a one-line ValueError."""
    key = {k.lower(): k for k in list(DEVICES) + list(ALIASES)}.get(name.strip().lower())
    if key is None:
        raise ValueError(f"--device: unknown device {name!r}; known: {', '.join(DEVICES)}, or a YAML file")
    return DEVICES[ALIASES.get(key, key)]


def identify(gpu_name: str) -> Optional[Device]:
    """The device a torch.cuda.get_device_name string names (e.g. "Tesla V100-SXM2-32GB"), or None."""
    for d in DEVICES.values():
        if d.match and re.search(d.match, gpu_name or "", re.IGNORECASE):
            return d
    return None


# --------------------------------------------------------------------------- described by hand

DICT_FIELDS = {
    "name": "a name", "peak_tflops": "peak TFLOP/s per precision, e.g. {fp32: 19.5, tf32: 156}",
    "memory_gb_s": "memory bandwidth, GB/s", "nvlink_gb_s": "NVLink per GPU each way, GB/s (0: none)",
    "pcie_gb_s": "PCIe each way, GB/s", "nic_gbit_s": "one NIC, Gbit/s", "nics_per_node": "NICs per node",
    "gpus_per_node": "GPUs per node", "precision": "what fp32 models run in (fp32 or tf32)",
    "compute_efficiency": "achieved / peak per precision, e.g. {fp32: 0.7}", "memory_efficiency": "0..1",
    "link_efficiency": "0..1", "like": "a known device whose values fill the fields not given",
}


def from_dict(d: dict, where: str = "device") -> Device:
    """A device described by hand (keys in ``DICT_FIELDS``; ``like: H100`` starts from a known one)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping of {', '.join(DICT_FIELDS)}")
    bad = [k for k in d if k not in DICT_FIELDS]
    if bad:
        raise ValueError(f"{where}: unknown field {bad[0]!r}; allowed: {', '.join(DICT_FIELDS)}")
    base = get(str(d["like"])) if "like" in d else None
    if base is None and not {"peak_tflops", "memory_gb_s"} <= set(d):
        raise ValueError(f"{where}: needs peak_tflops and memory_gb_s (or like: one of {', '.join(DEVICES)})")

    def num(key, lo, hi):
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise ValueError(f"{where}: {key} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        return float(v)

    def per_precision(key, lo, hi):
        v = d[key]
        if not isinstance(v, dict) or not v or any(p not in PRECISIONS for p in v):
            raise ValueError(f"{where}: {key} must map precisions ({', '.join(PRECISIONS)}) to numbers, got {v!r}")
        out = {}
        for p, x in v.items():
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:
                raise ValueError(f"{where}: {key}.{p} must be a number in [{lo:g}, {hi:g}], got {x!r}")
            out[p] = float(x)
        return out

    kw = {"name": str(d.get("name") or (f"{base.name}-like" if base else "custom"))}
    src = {}
    if "peak_tflops" in d:
        kw["flops"] = {p: v * T for p, v in per_precision("peak_tflops", 1e-3, 1e5).items()}
    for key, attr, scale, lo, hi in (("memory_gb_s", "mem_bw", GB, 1, 1e6), ("nvlink_gb_s", "nvlink_bw", GB, 0, 1e5),
                                     ("pcie_gb_s", "pcie_bw", GB, 0.1, 1e4), ("nic_gbit_s", "nic_gbps", 1, 0.001, 1e5),
                                     ("memory_efficiency", "memory_eff", 1, 0.01, 1),
                                     ("link_efficiency", "link_eff", 1, 0.01, 1)):
        if key in d:
            kw[attr] = num(key, lo, hi) * scale
    for key in ("nics_per_node", "gpus_per_node"):
        if key in d:
            kw[key] = int(num(key, 1, 4096))
    if "precision" in d:
        if d["precision"] not in PRECISIONS:
            raise ValueError(f"{where}: precision must be one of {', '.join(PRECISIONS)}, got {d['precision']!r}")
        kw["default_precision"] = d["precision"]
    if "compute_efficiency" in d:
        kw["compute_eff"] = per_precision("compute_efficiency", 0.001, 1)
    src = {k: f"given in {where}" for k in ("flops", "mem_bw", "nvlink_bw", "pcie_bw", "nic_gbps", "memory_eff",
                                           "link_eff") if k in kw}
    src.update({f"compute_eff.{p}": f"given in {where}" for p in kw.get("compute_eff", {})})
    if base is not None:
        return replace(base, sources={**base.sources, **src}, match="", **kw)
    kw.setdefault("pcie_bw", 16 * GB)
    if "compute_eff" not in kw:
        kw["compute_eff"] = {"fp32": 0.5}
        src["compute_eff.fp32"] = "assumed 0.5 (none given)"
    return Device(sources={**_sources(f"given in {where}", {}), **src}, **kw)


def load(name_or_path: str) -> Device:
    """``--device``: a known name, or a YAML/JSON file describing one."""
    p = Path(name_or_path)
    if p.suffix.lower() in (".yaml", ".yml", ".json") or p.is_file():
        if not p.is_file():
            raise ValueError(f"--device: no such file: {name_or_path}")
        try:  # YAML is a superset of JSON: one reader for both
            d = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"--device: {name_or_path} is not YAML ({str(e).splitlines()[0]})") from None
        return from_dict(d, name_or_path)
    return get(name_or_path)


def parse(text: str) -> Tuple[Device, str]:
    """``--device NAME[:PRECISION]`` or ``FILE[:PRECISION]`` -> (device, precision)."""
    base, _, prec = text.rpartition(":") if text.rsplit(":", 1)[-1] in PRECISIONS else (text, "", "")
    dev = load(base)
    prec = prec or dev.default_precision
    dev.peak(prec)
    return dev, prec

