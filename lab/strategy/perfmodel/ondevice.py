"""Predictions for a named device (``commlab predict ... --device H100``), and what they rest on.

- compute: a profile measured on that device (``commlab profile`` on the GPU records its name) is used
  as it is; otherwise the model's roofline on the device (lab.perfmodel.roofline), in the device's
  default precision or the one named (``--device H100:bf16``);
- compressor costs: curves measured on that device where the profile has them, else modeled from the
  bytes each codec's operators move on the device;
- links: NCCL's algorithms and protocols (lab.perfmodel.collectives) on the device's intra-node fabric
  (NVLink, else PCIe: datasheet bandwidth x link efficiency) and ``nics`` NICs per node at the rate the
  table sweeps (``--gbps``); ``--cluster`` overrides node size, intra-node rate and NICs.

``sources`` lists, for any prediction, which inputs were measured and which assumed or modeled.
"""
from __future__ import annotations

import copy
from typing import Callable, List, Optional

from engine.compressors.plan import parts
from lab.strategy.perfmodel import calibrate as cal
from lab.strategy.perfmodel import collectives, devices, roofline
from lab.strategy.perfmodel.devices import Device

VALIDATED = {
    "flat": "bench/perfmodel.py (cnn, 2 CPU ranks, shaped 0.1-10 Gbit/s links): median error 8.9%, max 25.9% "
            "over 17 configurations",
    "device": "bench/model_validation.py --table c (MergeComp's published 8 x V100 scaling factors, ResNet-50/101): "
              "see docs/benchmarks/model-validation.md",
}
"""Where the parts a prediction uses were checked, and how well (docs/benchmarks/ has the tables)."""


def measured_on(profile: cal.Profile, device: Device) -> bool:
    """Whether ``profile`` was measured on ``device`` (its machine names a GPU of that kind)."""
    gpu = (profile.machine or {}).get("gpu")
    found = devices.identify(gpu) if gpu else None
    return found is not None and found.name == device.name


def device_profile(profile: cal.Profile, spec: dict, device: Device, precision: str,
                   say: Callable[[str], None] = lambda m: None) -> cal.Profile:
    """The profile to predict ``spec`` on ``device`` with: ``profile`` itself when measured there, else
    the roofline of the spec's model (the profile's model, data set, batch and spec kept); then a cost
    curve for every compressor the spec uses (measured ones kept when measured on the device)."""
    if measured_on(profile, device):
        p = copy.deepcopy(profile)
        say(f"compute: measured on {profile.machine.get('gpu')} ({profile.source})")
    else:
        p = roofline.profile(roofline.count_spec(spec), device, precision, base=profile,
                             optimizer=spec.get("optimizer", {}).get("name", "sgd"))
        say(f"compute: {p.source}")
    meth = (spec.get("method") or {}).get("compressor") or {}
    for c in parts(spec["compressor"]) + (parts(meth) if meth else []):  # and a method's pseudo-gradients'
        k = cal.compressor_key(c)
        if cal.needs_curve(c) and k not in p.compressors:
            p.compressors[k] = roofline.codec_curve(c, device, precision)
    return p


def topology(device: Device, nic_gbps: float, shape: Optional[dict] = None) -> collectives.Topology:
    """The device's nodes: ``--cluster`` keys (node_size, intra_gbps, nics, intra_us/inter_us are not
    used: NCCL's latencies are modeled) where given, else the device's own."""
    shape = shape or {}
    intra_bw = shape["intra_gbps"] * 1e9 / 8 if "intra_gbps" in shape else device.intra_bw()
    return collectives.Topology(gpus_per_node=shape.get("node_size", device.gpus_per_node), intra_bw=intra_bw,
                                nic_bw=nic_gbps * 1e9 / 8 * device.link_eff, nics=shape.get("nics", device.nics_per_node),
                                intra=device.intra)


def link_maker(device: Device, shape: Optional[dict] = None) -> Callable[[float], collectives.Topology]:
    return lambda g: topology(device, g, shape)


def sources(profile: cal.Profile, spec: dict, device: Optional[Device] = None, precision: str = "",
            compute_speedup: float = 1.0, link: str = "", cluster: bool = False) -> List[str]:
    """``commlab predict``'s "sources" lines: for compute, links and each compressor's cost, whether
    it was measured (and where), or modeled or assumed (and from what)."""
    m = profile.machine or {}
    where = m.get("gpu") or m.get("cpu") or m.get("host") or ""
    out = []
    if device is not None and not measured_on(profile, device):
        eff_src = device.sources.get(f"compute_eff.{precision}", "assumed")
        out.append(f"compute: modeled, roofline on {device.name} {precision}: datasheet peaks "
                   f"({device.sources.get('flops', '?')}), compute efficiency {device.efficiency(precision):.3g} "
                   f"({eff_src}), memory efficiency {device.memory_eff:g} (assumed)")
    else:
        line = f"compute: measured, {profile.source}" + (f" on {where}" if where else "")
        if compute_speedup != 1.0:
            line += f", divided by --compute-speedup {compute_speedup:g} (assumed)"
        out.append(line)
    if device is not None:
        out.append(f"link: modeled, NCCL ring/tree and LL/LL128/Simple on {device.intra} ("
                   f"{device.sources.get('nvlink_bw' if device.nvlink_bw else 'pcie_bw', 'datasheet')} x link "
                   f"efficiency {device.link_eff:g}, assumed) and NICs at the table's rate x {device.link_eff:g}"
                   + ("; --cluster overrides" if cluster else ""))
    elif cluster:
        out.append("link: assumed, nominal alpha-beta two-level cluster from --cluster (no calibration)")
    elif profile.link:
        out.append(f"link: measured, {profile.link.get('source', 'calibrated')} (alpha, beta and token bucket "
                   f"scaled to each rate)")
    else:
        out.append("link: assumed, nominal alpha-beta at each rate (alpha 0, beta 8/rate); calibrate with --link")
    for c in parts(spec["compressor"]):
        k = cal.compressor_key(c)
        if not cal.needs_curve(c):
            out.append(f"compressor {k}: nothing to cost (its exchange runs no compressor code)")
            continue
        curve = profile.compressors.get(k) or {}
        src = curve.get("source", "not yet measured")
        kind = curve.get("kind", "measured")
        on = "" if kind == "modeled" else f" on {where}" if where else ""
        out.append(f"compressor {k}: {kind}, {src}{on}"
                   + (f", divided by --compute-speedup {compute_speedup:g} (assumed)"
                      if compute_speedup != 1.0 and kind == "measured" else ""))
    meth = spec.get("method") or {}
    if meth.get("name", "none") != "none":
        comp = meth.get("compressor") or {}
        curve = profile.compressors.get(cal.compressor_key(comp), {}) if comp and cal.needs_curve(comp) else {}
        out.append(f"method {meth['name']}: modeled, its own schedule over the run's {spec.get('steps')} steps "
                   f"(lab/strategy/perfmodel/local.py): local steps compute only, syncs priced on the link"
                   + (f"; its compressor {cal.compressor_key(comp)}: {curve.get('kind', 'measured')}, "
                      f"{curve.get('source', 'not yet measured')}" if curve else ""))
    out.append("validated: " + (VALIDATED["device"] if device is not None else VALIDATED["flat"])
               + ("; methods: not validated against runs yet (bench/local_updates.py measures them)"
                  if meth.get("name", "none") != "none" else ""))
    return out

