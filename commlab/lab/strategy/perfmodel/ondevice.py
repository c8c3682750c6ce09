"""Predictions for a named device (``commlab predict ... --device H100``), and what they rest on.

- compute: a profile measured on that device (``commlab profile`` on the GPU records its name) is used
  as it is; otherwise the model's roofline on the device (commlab.lab.strategy.perfmodel.roofline), in the device's
  default precision or the one named (``--device H100:bf16``);
- compressor costs: curves measured on that device where the profile has them, else modeled from the
  bytes each codec's operators move on the device;
- links: NCCL's algorithms and protocols (commlab.lab.strategy.perfmodel.collectives) on the device's intra-node fabric
  (NVLink, else PCIe: datasheet bandwidth x link efficiency) and ``nics`` NICs per node at the rate the
  table sweeps (``--gbps``); ``--cluster`` overrides node size, intra-node rate and NICs.

``source_rows`` / ``sources`` list, for any prediction, which inputs were measured and which assumed or modeled,
and how well each part was validated (commlab.lab.strategy.perfmodel.validation).
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

from commlab.engine.compressors.plan import parts
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import collectives, devices, roofline, validation
from commlab.lab.strategy.perfmodel.devices import Device


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


def source_rows(profile: cal.Profile, spec: dict, device: Optional[Device] = None, precision: str = "",
                compute_speedup: float = 1.0, link: str = "", cluster: bool = False) -> List[Dict[str, str]]:
    """What a prediction rests on, one row per input (compute, link, each compressor's cost): ``kind``
    measured, modeled or assumed, ``source`` where it comes from, and ``validated`` how well that part of the
    model was checked against measurements (commlab.lab.strategy.perfmodel.validation)."""
    m = profile.machine or {}
    where = m.get("gpu") or m.get("cpu") or m.get("host") or ""
    rows = []

    def row(part, kind, source, label=None):
        rows.append({"part": label or part, "kind": kind, "source": source, "validated": validation.quote(part, kind)})
    if device is not None and not measured_on(profile, device):
        eff_src = device.sources.get(f"compute_eff.{precision}", "assumed")
        row("compute", "modeled", f"roofline on {device.name} {precision}: datasheet peaks "
            f"({device.sources.get('flops', '?')}), compute efficiency {device.efficiency(precision):.3g} "
            f"({eff_src}), memory efficiency {device.memory_eff:g} (assumed)")
    else:
        line = profile.source + (f" on {where}" if where else "")
        if compute_speedup != 1.0:
            line += f", divided by --compute-speedup {compute_speedup:g} (assumed)"
        note = cal.disturbed_note(profile.disturbance)
        if note:
            line += f"; DISTURBED: {note}"
        row("compute", "measured", line)
    if device is not None:
        row("link", "modeled", f"NCCL ring/tree and LL/LL128/Simple on {device.intra} ("
            f"{device.sources.get('nvlink_bw' if device.nvlink_bw else 'pcie_bw', 'datasheet')} x link "
            f"efficiency {device.link_eff:g}, assumed) and NICs at the table's rate x {device.link_eff:g}"
            + ("; --cluster overrides" if cluster else ""))
    elif cluster:
        row("link", "assumed", "nominal alpha-beta two-level cluster from --cluster (no calibration)")
    elif link:
        row("link", "assumed", link)
    elif profile.link:
        row("link", "measured", f"{profile.link.get('source', 'calibrated')} (alpha, beta and token bucket "
            f"scaled to each rate)")
    else:
        row("link", "assumed", "nominal alpha-beta at each rate (alpha 0, beta 8/rate); calibrate with --link")
    for c in parts(spec["compressor"]):
        k = cal.compressor_key(c)
        if not cal.needs_curve(c):
            rows.append({"part": f"compressor {k}", "kind": "none", "validated": "",
                         "source": "nothing to cost (its exchange runs no compressor code)"})
            continue
        curve = profile.compressors.get(k) or {}
        kind = curve.get("kind", "measured") if curve else "assumed"
        on = "" if kind == "modeled" else f" on {where}" if where else ""
        row("compressor", kind, curve.get("source", "not yet measured") + on
            + (f", divided by --compute-speedup {compute_speedup:g} (assumed)"
               if compute_speedup != 1.0 and kind == "measured" else ""), label=f"compressor {k}")
    meth = spec.get("method") or {}
    if meth.get("name", "none") != "none":
        comp = meth.get("compressor") or {}
        curve = profile.compressors.get(cal.compressor_key(comp), {}) if comp and cal.needs_curve(comp) else {}
        rows.append({"part": f"method {meth['name']}", "kind": "modeled",
                     "validated": "not validated against runs yet (bench/local_updates.py measures them)",
                     "source": f"its own schedule over the run's {spec.get('steps')} steps "
                               f"(commlab/lab/strategy/perfmodel/local.py): local steps compute only, syncs priced on the link"
                               + (f"; its compressor {cal.compressor_key(comp)}: {curve.get('kind', 'measured')}, "
                                  f"{curve.get('source', 'not yet measured')}" if curve else "")})
    return rows


def sources(profile: cal.Profile, spec: dict, device: Optional[Device] = None, precision: str = "",
            compute_speedup: float = 1.0, link: str = "", cluster: bool = False) -> List[str]:
    """``commlab predict``'s "sources" lines: ``source_rows`` as text, each input's validation indented
    under it."""
    out = []
    for r in source_rows(profile, spec, device, precision, compute_speedup, link, cluster):
        out.append(f"{r['part']}: {r['kind']}, {r['source']}" if r["kind"] != "none" else f"{r['part']}: {r['source']}")
        if r["validated"]:
            out.append(f"  validated: {r['validated']}")
    return out
