"""Calibration: a Profile of compute, link and compressor costs, from what the lab measures.

- compute: per-layer forward times and backward completion offsets, total
  forward / backward / optimizer time, from a run's timeline (``from_run``).
  Hook time inside backward (encoding, waits) is subtracted, so a profile
  from any run is compute only; a ``sync`` run (nothing overlaps backward)
  gives the cleanest one. The run's ``disturbance`` record (status.json: other
  processes' CPU while it ran, commlab.lab.rundir.disturbance) goes with the profile
  (``Profile.disturbance``), and ``disturbed_note`` says when its times are not
  results; commlab.lab.strategy.perfmodel.whatif.matching_run prefers an undisturbed run.
- link: alpha and beta from two all-reduce sizes on a shaped cluster
  (``measure_link``), from ``commlab net check --json`` output
  (``link_from_net_check``), or from a run's communicate spans
  (``link_from_run``: each collective's own service time, after whatever
  held the link before it, fitted against its bytes).
- compressors: fixed + per-byte cost of encoding, of the compute between
  rounds and of decoding, fitted over several sizes (``measure_compressor``);
  payload bytes per bucket by driving the real exchange once (``plan``).

The profile is plain JSON (``save``/``load``) and is reused by key.
"""
from __future__ import annotations

import bisect
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from commlab.engine import codepath
from commlab.engine.runlog import write_json_atomic
from commlab.engine.spec import JobSpec
from commlab.lab.base import sandbox
from commlab.lab.net.netcheck import measure_allreduces
from commlab.lab.net.netns import Cluster
from commlab.lab.rundir.disturbance import describe
from commlab.lab.strategy.perfmodel.costs import Link, TokenBucket, steps_and_wire
from commlab.lab.base.kept import Kept


class CalibrationError(ValueError):
    """Nothing to calibrate from (a run without timed steps, a failed profiling run)."""


SKIP_STEPS = 3
"""Warm-up steps left out of every median (allocations, first collectives)."""


@dataclass
class Profile:
    model: str
    dataset: str
    batch_size: int
    model_options: dict = field(default_factory=dict)
    source: str = ""
    params: List[Tuple[str, int]] = field(default_factory=list)
    """(name, bytes) of every parameter tensor, in gradient-ready order"""
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    layer_forward: Dict[str, float] = field(default_factory=dict)
    """forward of each layer's span: from the previous layer's end to its own, so parameterless modules
    count in the layer after them and the spans add up to the forward pass (waits taken out)"""
    layer_ready: Dict[str, float] = field(default_factory=dict)
    """backward compute from the start of backward until the layer's gradients exist"""
    link: Optional[dict] = None
    """{alpha, beta, nominal_gbps, burst_bytes, beta_burst, source}: what links at other rates
    are scaled from"""
    overlap_slowdown: float = 1.0
    compressors: Dict[str, dict] = field(default_factory=dict)
    """compressor key -> {encode, between, decode: [fixed s, s per byte], sizes, source}"""
    layer_backward: Dict[str, float] = field(default_factory=dict)
    """backward of each layer's span, from the previous layer's gradients (the output's gradient for
    the first) until its own exist (seconds; hooks inside it included)"""
    machine: dict = field(default_factory=dict)
    """where it was measured (``commlab profile``): host, cpu, cores, device, gpu, torch, threads,
    dtype, steps, clock (CUDA events or the host clock)"""
    spec: Optional[dict] = None
    """the job spec it was taken for (``commlab profile``): what ``commlab predict PROFILE`` predicts"""
    payloads: Dict[str, list] = field(default_factory=dict)
    """compressor key and bucket -> its exchange's rounds [[op, payload bytes, tensors], ...], as driving
    the real exchange gave them (commlab.lab.strategy.perfmodel.predict.payload_rounds): kept with the profile, so the
    next prediction for this model does not drive them again"""
    disturbance: dict = field(default_factory=dict)
    """what other processes did while the run the compute came from ran (``disturbance_of``); {} when the
    profile was not calibrated from a run (made by hand, or saved before this was recorded)"""

    def key(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.model_options.items()))
        return f"{self.model}{'(' + opts + ')' if opts else ''}-{self.dataset}-b{self.batch_size}"

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, asdict(self))
        return path

    @classmethod
    def load(cls, path) -> "Profile":
        d = json.loads(Path(path).read_text())
        d["params"] = [tuple(p) for p in d.get("params", [])]
        return cls(**d)

    def link_at(self, gbps: float) -> Link:
        """The link at ``gbps``: the calibrated one scaled to that rate (same alpha and
        efficiency), or the nominal alpha-beta link when none is calibrated."""
        if not self.link:
            return Link.from_gbps(gbps)
        return link_scaled(self.link, gbps)


def link_scaled(link: dict, gbps: float) -> Link:
    """A calibrated link (a profile's ``link``, or the lab's shaped-link calibration: alpha, beta,
    nominal_gbps, optionally its token bucket) at another rate, with the same alpha and efficiency."""
    measured = Link(link["alpha"], link["beta"], link.get("burst_bytes", 0.0), link.get("beta_burst", 0.0))
    return measured.scaled(link["nominal_gbps"], gbps)


def spec_key(spec: dict) -> str:
    m = spec["model"]
    opts = ",".join(f"{k}={v}" for k, v in sorted((m.get("options") or {}).items()))
    return f"{m['name']}{'(' + opts + ')' if opts else ''}-{spec['dataset']['name']}-b{spec['batch_size']}"


def compressor_key(c: dict) -> str:
    """A compressor section as one string, ``name(param=value,...)+EF`` (``Compressor.describe`` of its
    instance); a mixed section (compressor.per_bucket) appends its rules: ``[<1MB:none;<8MB:fp16]``."""
    params = ",".join(f"{k}={v}" for k, v in sorted((c.get("params") or {}).items()))
    key = f"{c['name']}{'(' + params + ')' if params else ''}{'+EF' if c.get('error_feedback') else ''}"
    rules = c.get("per_bucket") or []
    if rules:
        key += "[" + ";".join(f"<{r['below_mb']:g}MB:{compressor_key(r)}" for r in rules) + "]"
    return key


# --------------------------------------------------------------------------- fitting

def fit_affine(xs, ys, relative: bool = True) -> Tuple[float, float]:
    """Least squares ``y = a + b x`` (a, b >= 0), weighted by 1/y, between absolute
    error (where the largest sizes decide everything) and relative error (where the
    smallest do): the fixed cost still shows and large buckets are still close."""
    if len(xs) < 2:
        raise ValueError("need at least two sizes to fit fixed + per-byte cost")
    w = [1.0 / max(y, 1e-12) if relative else 1.0 for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    if det <= 0:
        raise ValueError("sizes must differ to fit a per-byte cost")
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    if b < 0:
        return statistics.median(ys), 0.0
    if a < 0:  # through the origin
        return 0.0, sum(wi * x * y for wi, x, y in zip(w, xs, ys)) / sxx
    return a, b


def fit_link(rows) -> Tuple[float, float]:
    """alpha, beta from measured collectives: rows of (steps, wire bytes per rank, seconds),
    ``seconds = steps * alpha + wire * beta``, least squares in relative error."""
    if len({r[1] for r in rows}) < 2:
        raise ValueError("need collectives of at least two sizes to fit alpha and beta")
    w = [1.0 / max(t, 1e-9) ** 2 for _, _, t in rows]
    a11 = sum(wi * s * s for wi, (s, _, _) in zip(w, rows))
    a12 = sum(wi * s * n for wi, (s, n, _) in zip(w, rows))
    a22 = sum(wi * n * n for wi, (_, n, _) in zip(w, rows))
    b1 = sum(wi * s * t for wi, (s, _, t) in zip(w, rows))
    b2 = sum(wi * n * t for wi, (_, n, t) in zip(w, rows))
    det = a11 * a22 - a12 * a12
    alpha = (b1 * a22 - b2 * a12) / det
    beta = (a11 * b2 - a12 * b1) / det
    if alpha < 0:  # latency below what the fit can resolve: bandwidth only
        alpha, beta = 0.0, b2 / a22
    if beta < 0:  # times do not grow with bytes (fast links, noise): latency only
        alpha, beta = b1 / a11, 0.0
    return alpha, beta


# --------------------------------------------------------------------------- compute from a run

def _median(xs, default=0.0):
    return statistics.median(xs) if xs else default


NOT_RESULTS = "timings disturbed by other processes: not results"
"""What the lab says of times measured while other processes took more CPU than the threshold."""


def disturbance_of(run) -> dict:
    """What other processes did while ``run`` ran, in brief, from its status.json ``disturbance`` record
    (commlab.lab.rundir.disturbance): ``run`` (its id), ``disturbed`` (True or False; None when not measured),
    ``other_cpu`` (their share of the machine over the run) and ``text`` (``commlab show``'s words)."""
    rec = run.status().get("disturbance") or {}
    label, text = describe(rec)
    measured = rec.get("other_cpu") is not None
    return {"run": run.id, "disturbed": bool(rec.get("disturbed")) if measured else None,
            "other_cpu": rec.get("other_cpu"), "text": text}


def disturbed_note(d: Optional[dict]) -> str:
    """One line when ``d`` (``disturbance_of``'s) says the run was disturbed; "" when it was quiet or not
    measured."""
    if not d or not d.get("disturbed"):
        return ""
    text = d.get("text", "")
    text = text[len("yes: "):] if text.startswith("yes: ") else text
    return f"run {d['run']} was disturbed: {text}; {NOT_RESULTS}"


def from_run(run, skip: int = SKIP_STEPS) -> Profile:
    """A compute profile from a finished run's timeline (every rank, steps after ``skip``), with the run's
    ``disturbance_of``."""
    p = from_events(run.spec_dict(), run.timeline_events(), f"run {run.id}", skip)
    p.disturbance = disturbance_of(run)
    return p


def from_events(spec: dict, ev: List[dict], source: str, skip: int = SKIP_STEPS,
                params: Optional[List[Tuple[str, int]]] = None) -> Profile:
    """A compute profile from timeline events (every rank's, steps after ``skip``) of the spec's model;
    ``params`` as ``param_list`` gives them (which builds the model), when the caller has them."""
    steps = {}
    for e in ev:
        if e.get("cat") in ("forward", "backward", "optimizer") and "step" in (e.get("args") or {}):
            steps.setdefault((e["pid"], e["args"]["step"]), {})[e["cat"]] = (e["ts"], e["ts"] + e["dur"])
    keep = {k: v for k, v in steps.items() if k[1] >= skip and {"forward", "backward", "optimizer"} <= set(v)}
    if not keep:
        raise CalibrationError(f"{source}: no timed steps after the first {skip} in its timeline")
    by_pid = {}
    for e in ev:
        by_pid.setdefault(e["pid"], []).append(e)
    fwd, bwd, opt = [], [], []
    layer_fwd: Dict[str, list] = {}
    layer_ready: Dict[str, list] = {}
    layer_bwd: Dict[str, list] = {}
    for pid, evs in by_pid.items():
        windows = sorted((v["forward"][0], v["backward"][0], v["backward"][1], v) for (p, _), v in keep.items()
                         if p == pid)
        evs.sort(key=lambda e: e["ts"])  # each step's spans found by bisection: linear in the steps, not quadratic
        ts = [e["ts"] for e in evs]
        for f0, b0, b1, v in windows:
            inside = evs[bisect.bisect_left(ts, b0):bisect.bisect_right(ts, b1)]
            hooks = sorted((e["ts"], e["ts"] + e["dur"]) for e in inside
                           if e.get("cat") in ("compress", "wait", "decompress"))
            fwd.append((v["forward"][1] - v["forward"][0]) / 1e6)
            bwd.append((b1 - b0 - sum(h1 - h0 for h0, h1 in hooks)) / 1e6)
            opt.append((v["optimizer"][1] - v["optimizer"][0]) / 1e6)
            for e in inside:
                if e.get("cat") == "backward" and "layer" in (e.get("args") or {}):
                    end = e["ts"] + e["dur"]
                    held = sum(min(h1, end) - h0 for h0, h1 in hooks if h0 < end)
                    layer_ready.setdefault(e["args"]["layer"], []).append((end - b0 - held) / 1e6)
                    layer_bwd.setdefault(e["args"]["layer"], []).append(e["dur"] / 1e6)
            f1 = v["forward"][1]
            # a layer's forward span holds what ran since the previous layer's end (commlab/engine/probe.py), dear's
            # parameter all-gather waits included: take those out, as hook time is taken out of backward
            during = evs[bisect.bisect_left(ts, f0):bisect.bisect_right(ts, f1)]
            waits = [(e["ts"], e["ts"] + e["dur"]) for e in during if e.get("cat") == "wait"]
            for e in during:
                if e.get("cat") == "forward" and "layer" in (e.get("args") or {}):
                    s0, s1 = e["ts"], e["ts"] + e["dur"]
                    held = sum(max(0.0, min(h1, s1) - max(h0, s0)) for h0, h1 in waits)
                    layer_fwd.setdefault(e["args"]["layer"], []).append((e["dur"] - held) / 1e6)
    return Profile(model=spec["model"]["name"], dataset=spec["dataset"]["name"], batch_size=spec["batch_size"],
                   model_options=dict(spec["model"].get("options") or {}), source=source,
                   params=[tuple(p) for p in params] if params is not None else param_list(spec),
                   forward_s=_median(fwd), backward_s=_median(bwd),
                   optimizer_s=_median(opt), layer_forward={k: _median(v) for k, v in layer_fwd.items()},
                   layer_ready={k: _median(v) for k, v in layer_ready.items()},
                   layer_backward={k: _median(v) for k, v in layer_bwd.items()})


def param_list(spec: dict) -> List[Tuple[str, int]]:
    """(name, bytes) of the spec's model parameters in gradient-ready order, as
    the communicators order them (reverse registration order). Counted without the weights
    (commlab.engine.preflight.parameters); in a process that serves viewers, in a child (commlab.lab.base.sandbox)."""
    d = spec.to_dict() if hasattr(spec, "to_dict") else spec
    key = json.dumps({"model": d["model"], "dataset": d["dataset"], "seed": 0}, sort_keys=True)
    return list(reversed([tuple(p) for p in _parameters(key)]))


@lru_cache(maxsize=32)
def _parameters(key: str) -> tuple:
    if codepath.imports_allowed():
        from commlab.engine import preflight  # torch, only when this process builds the model itself
        return tuple(tuple(p) for p in preflight.parameters(JobSpec.from_dict(json.loads(key))))
    try:
        # for the viewer (commlab.room.places.identify): their one place at a time, their budget, as for the form's previews
        return tuple(tuple(p) for p in sandbox.run("parameters", json.loads(key), sandbox.PREVIEW))
    except sandbox.SandboxError as e:
        raise CalibrationError(str(e)) from None


def param_dtypes(spec: dict) -> List[str]:
    """The dtypes of the spec's trainable parameters (e.g. ["float32"])."""
    from commlab.engine import preflight  # torch
    js = JobSpec.from_dict(spec) if isinstance(spec, dict) else spec
    return sorted({str(p.dtype).replace("torch.", "") for p in preflight.sized(js).parameters() if p.requires_grad})


def fit_slowdown(profile: Profile, run, skip: int = SKIP_STEPS) -> float:
    """The overlap slowdown: backward compute in ``run`` (hooks excluded) over the profile's,
    for a run whose collectives overlap backward (wfbp)."""
    other = from_run(run, skip)
    return other.backward_s / profile.backward_s if profile.backward_s else 1.0


# --------------------------------------------------------------------------- link

def link_from_run(run, skip: int = SKIP_STEPS) -> Tuple[float, float]:
    """alpha, beta fitted to a run's communicate spans (service times, see service_times)."""
    p = run.spec_dict()["world_size"]
    rows = [(*steps_and_wire(op, nbytes, p), t) for op, nbytes, t, _ in service_times(run, skip)]
    return fit_link(rows)


def service_times(run, skip: int = SKIP_STEPS, rank: int = 0) -> List[Tuple[str, int, float, float]]:
    """(op, payload bytes, seconds, start) of every collective of one rank after ``skip`` steps,
    each counted from when it got the link (its issue, or the end of the one before it)."""
    events = run.timeline_events()
    starts = sorted(e["ts"] for e in events if e.get("cat") == "step" and e["pid"] == rank)
    t_skip = starts[min(skip, len(starts) - 1)] if starts else 0.0
    comm = sorted((e for e in events if e.get("cat") == "comm" and e["pid"] == rank), key=lambda e: e["ts"])
    out, free = [], 0.0
    for e in comm:
        start, end = max(e["ts"], free), e["ts"] + e["dur"]
        free = max(free, end)
        if e["ts"] >= t_skip and end > start:
            out.append((e["args"]["op"], e["args"]["bytes"], (end - start) / 1e6, start / 1e6))
    return out


def alpha_from_run(run, link: Link, max_wire: float = 65536, skip: int = SKIP_STEPS) -> float:
    """Per-step latency from a run's small collectives (wire bytes <= ``max_wire``) on a link
    whose rates are known (``link``: sustained beta, token bucket, fast beta; its alpha is
    ignored): the mean of (service time - modeled transfer time) / ring steps, replaying the
    token bucket over all of the run's collectives in order. The mean, not the median,
    because the occasional stall of a few ms is part of what a training step pays."""
    world = run.spec_dict()["world_size"]
    wire_only = TokenBucket(Link(0.0, link.beta, link.burst_bytes, link.beta_burst))
    per_step = []
    for op, nbytes, t, start in service_times(run, skip):
        steps, wire = steps_and_wire(op, nbytes, world)
        move = wire_only.duration(op, nbytes, world, start)
        wire_only.t = start + t  # the bucket refills from when the collective really ended
        if wire <= max_wire and steps:
            per_step.append(max(0.0, t - move) / steps)
    if not per_step:
        raise CalibrationError(f"run {run.id}: no collectives of at most {max_wire:g} wire bytes to fit alpha from")
    return statistics.mean(per_step)


def link_from_net_check(result: dict) -> dict:
    """A profile link from ``commlab net check --json``: beta from its large all-reduce,
    alpha from its small one (the mean: occasional stalls are part of the cost), the tbf's
    token bucket left out (net check's back-to-back all-reduces run with it empty)."""
    p = result["allreduce_world"]
    big = steps_and_wire("allreduce", result["allreduce_bytes"], p)
    if "allreduce_small_bytes" in result:
        small = steps_and_wire("allreduce", result["allreduce_small_bytes"], p)
        alpha, beta = fit_link([(*big, result["allreduce_median_s"]), (*small, result["allreduce_small_mean_s"])])
    else:
        alpha, beta = 0.0, result["allreduce_median_s"] / big[1]
    return {"alpha": alpha, "beta": beta, "nominal_gbps": result["target_gbps"], "source": "commlab net check"}


def measure_link(gbps: float, n_ranks: int = 2, target_s: float = 0.4) -> dict:
    """Build a shaped cluster and time back-to-back gloo all-reduces of ~1/4 and all of
    ``target_s`` worth of bytes (so the tbf's token bucket is long empty: the sustained
    rate), and of 4 KiB (the per-collective cost, mean of 30). Needs root (commlab.lab.net.netns).

    Returns ``beta`` (sustained seconds per byte, from the two large sizes), the
    cluster's ``burst_bytes``, ``small_mean_s`` and the samples."""
    big = max(1 << 16, int(target_s * gbps * 1e9 / 8 / (2 * (n_ranks - 1) / n_ranks)) // 4 * 4)
    big = min(big, 64 << 20)
    rows = []
    with Cluster(n_ranks, gbps, tag="pm") as c:
        burst = c.burst_bytes
        small, *large = measure_allreduces(c, [(4096, 30), (big // 4, 8), (big, 5)])
        for r in large:
            rows.append((*steps_and_wire("allreduce", r["nbytes"], n_ranks), statistics.median(r["times"])))
    alpha_big, beta = fit_link(rows)
    return {"alpha": alpha_big, "beta": beta, "nominal_gbps": gbps, "burst_bytes": burst,
            "small_mean_s": statistics.mean(small["times"]), "small_median_s": statistics.median(small["times"]),
            "samples": rows,
            "source": f"measured all-reduce on a shaped {gbps:g} Gbit cluster, {n_ranks} ranks"}


def measure_path(n_ranks: int = 2, sizes=(1 << 20, 8 << 20), iters: int = 6) -> dict:
    """The emulated cluster's own speed with no shaping (the same namespaces, veth pairs, bridge and MTU,
    no tbf): what a shaped link's token bucket lets a burst through at. Loopback (``lo``, 64 KB packets,
    no bridge) is several times faster, and a burst cannot cross the path faster than the path itself.
    Back-to-back gloo all-reduces of ``sizes``, medians of ``iters``; needs root (commlab.lab.net.netns).

    Returns ``alpha`` and ``beta`` (seconds per ring step and per byte) and the samples."""
    rows = []
    with Cluster(n_ranks, None, tag="path") as c:
        for r in measure_allreduces(c, [(n, iters) for n in sizes]):
            rows.append((*steps_and_wire("allreduce", r["nbytes"], n_ranks), statistics.median(r["times"])))
    alpha, beta = fit_link(rows)
    return {"alpha": alpha, "beta": beta, "samples": rows,
            "source": f"measured all-reduce on an unshaped emulated cluster, {n_ranks} ranks"}


# --------------------------------------------------------------------------- compressors

def drive(comp, t, world: int = 1, sharded: bool = False, bucket=None):
    """Run one exchange of ``comp`` on ``t`` in this process, as one rank of ``world`` whose peers all sent
    what it sent (``gathered``: an all-gather returns ``world`` copies of its payload, so the decode is that
    of ``world`` payloads); ``sharded``: dear's exchange (commlab.engine.compressors.contract.shard_exchange)
    instead of the whole one. ``bucket``: the ``BucketContext`` it is driven with (its layout; default: a flat
    bucket on its own).

    Returns the rounds as [(op, payload bytes, tensors)] (an all-to-all: every destination's payload's
    bytes, one destination's tensors) and the compute times [encode, between rounds..., decode] in seconds."""
    from commlab.engine.comm.exchange import run_exchange
    rounds = []
    reply = gathered(world)

    def collective(op, payloads):
        (mine,) = payloads
        each = mine if op == "all_to_all" else [mine]  # an all-to-all's payloads: one per destination
        rounds.append((op, sum(x.numel() * x.element_size() for p in each for x in p), len(each[0])))
        return reply(op, payloads)
    (ex,) = run_exchange([comp], [t], world, collective, timer=time.perf_counter, ranks=[0] if sharded else None,
                         buckets=None if bucket is None else [bucket])
    return rounds, ex.compute


def gathered(world: int):
    """The collective of one process standing for ``world`` ranks that all sent the same payload: an
    all-gather returns ``world`` copies of it (what each rank then decodes), an all-reduce its own payload
    (the sum's values do not change what decoding it costs)."""
    from commlab.engine.comm.exchange import local_collective

    def collective(op, payloads):
        if op == "allgather" and world > 1:
            (mine,) = payloads
            return [[[x.clone() for x in mine] for _ in range(world)]]
        return local_collective(op, payloads)
    return collective


DECODE_PAYLOADS = 4
"""All-gathered payloads decoded at once to measure what each further one adds to a decode (``decode_more``):
a majority vote or a sum of sparse payloads pays its fixed work once, not once per rank."""


CURVE_NUMELS = (1024, 16384, 262144, 1048576)


def make_compressor(c: dict):
    from commlab.engine import compressors
    return compressors.make(c["name"], error_feedback=bool(c.get("error_feedback")), **(c.get("params") or {}))


def code_stamp(c: dict) -> str:
    """For a compressor section that names code (``package.module:Class``): the size and modification time
    of the file that defines the class, so a curve or payload measured before the file changed is measured
    again; "" for a registered compressor (the lab's own code)."""
    if not codepath.is_import_path(c["name"]):
        return ""
    import inspect

    from commlab.engine import compressors
    try:
        st = Path(inspect.getfile(compressors.resolve(c["name"], "compressor.name"))).stat()
    except (TypeError, OSError):  # no file to look at (a class made at run time): always measured again
        return f"@{time.time_ns()}"
    return f"@{st.st_size}-{st.st_mtime_ns}"


def needs_curve(c: dict) -> bool:
    """False when the compressor config ``c`` runs no compressor code: an ``identity`` compressor
    (declared) without error feedback, whose exchange is one all-reduce of the raw gradient
    (``commlab.engine.comm.exchange.Exchange.prescales``). Such a config has no cost curve and sends the raw bytes."""
    from commlab.engine.comm.exchange import Exchange
    return not Exchange.prescales(make_compressor(c))


def measure_compressor(c: dict, numels=CURVE_NUMELS, repeat: int = 5, warm: int = 4,
                       make: Optional[Callable[[], object]] = None) -> dict:
    """Fixed + per-byte cost of encoding, of the compute between rounds and of decoding for
    the compressor config ``c`` (a spec's compressor section), in one thread, fp32. ``make`` builds the
    compressor instead of the registry (a method's own codec: ``Method.codec``)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs
    try:
        return _measure_compressor(make or (lambda: make_compressor(c)), numels, repeat, warm)
    finally:
        torch.set_num_threads(threads)


def _measure_compressor(make, numels, repeat, warm):
    import torch

    from commlab.engine.compressors import contract
    from commlab.engine.compressors.capabilities import BucketContext
    torch.manual_seed(0)
    stages: Dict[str, list] = {"encode": [], "between": [], "decode": []}
    for n in numels:
        cols = 256 if n % 256 == 0 else 1
        comp = make()
        bucket = BucketContext(layout=((0, (n // cols, cols)),))  # one weight matrix, as PowerSGD sees a layer
        x = torch.randn(n)
        plain = 0
        try:
            contract.skip_warmup(comp)  # past plain warm-up exchanges (PowerSGD's start_iter) without sending them
        except NotImplementedError:  # a compressor of the user's that cannot skip them: they are driven
            plain = comp.capabilities.warmup_exchanges
        for _ in range(warm + plain):  # lazy buffers, and a warm start's state
            drive(comp, x.clone(), bucket=bucket)
        runs = [drive(comp, x.clone(), bucket=bucket) for _ in range(repeat)]
        samples = [r[1] for r in runs]
        enc = statistics.median(s[0] for s in samples)
        dec = statistics.median(s[-1] for s in samples)
        mid = statistics.median(sum(s[1:-1]) for s in samples)
        for k, v in (("encode", enc), ("between", mid), ("decode", dec)):
            stages[k].append((n * 4, v))
        if runs[0][0] and runs[0][0][-1][0] == "allgather":  # decoded once per rank's payload
            many = statistics.median(drive(comp, x.clone(), DECODE_PAYLOADS, bucket=bucket)[1][-1]
                                     for _ in range(repeat))
            stages.setdefault("decode_more", []).append((n * 4, max(0.0, many - dec) / (DECODE_PAYLOADS - 1)))
    out = {"sizes": [n * 4 for n in numels], "source": "measured in-process (commlab.lab.strategy.perfmodel.calibrate)"}
    for k, rows in stages.items():
        out[k] = list(fit_affine([r[0] for r in rows], [r[1] for r in rows]))
        out[k + "_samples"] = [r[1] for r in rows]
    return out


CHILD = "commlab.lab.strategy.perfmodel.child"
"""The module of the children that measure for a viewer of the UI (its tasks: curves, rounds, predict)."""
for _task, _label in (("curves", "cost curve"), ("rounds", "payload"), ("predict", "prediction")):
    sandbox.register(_task, _label, CHILD)
CURVES = sandbox.Limits(wall_s=120.0, cpu_s=90, memory=2 << 30)
"""A child's limits for the cost curves of a few compressors or the payloads of a few buckets: every built-in's
curve at the command line's sizes took 2.3 s of CPU here, after 1.5 s of importing torch; a compressor at the
bounds of its parameters fits (a Count Sketch table of 2**26 cells, 32 x 2,097,152, took 35 s and about 1.3 GB)."""
PREDICT = sandbox.Limits(wall_s=150.0, cpu_s=90, memory=2 << 30)
"""A child's limits for a cluster prediction of a viewer's profile (commlab.lab.strategy.perfmodel.views): one of 2,000
tensors took 1 s of CPU for the page's 10 cells, and its compressor's curve at the bounds of its parameters up to
35 s more (CURVES)."""
CURVES_KEPT = 512
"""Cost curves a child measured for this process (``measure_curves``), least recently used first out: the
Performance model page asks for the same compressors on every load (each finished run's, the page's five)."""
_CURVES = Kept(CURVES_KEPT)


def measure_curves(items: List[dict], numels=CURVE_NUMELS, repeat: int = 5, warm: int = 4,
                   who: Optional[str] = None) -> List[dict]:
    """The cost curve of each item, as ``measure_compressor`` times it: ``{"compressor": section}`` (a spec's
    compressor section, checked already) or ``{"method": section}`` (a spec's method section: its own codec,
    ``Method.codec``, at ``Method.codec_numel`` of each size).

    Where this process may import code (the command line, the advisor's process, a notebook) they are timed
    here. In a process that serves viewers (commlab.engine.codepath.forbid_imports_when) nothing they configured runs
    here: one child with limits times them all (commlab.lab.strategy.perfmodel.child, task ``curves``, limits CURVES;
    ``who``'s one at a time, the server's MAX_CHILDREN at once), and what it measured is kept in this process
    (``CURVES_KEPT``), so asking again measures nothing; a limit the child hits, or no place for it, is a one-line
    sandbox.SandboxError (a ValueError). Sections that name code are timed anew each time (their file may have
    changed)."""
    if codepath.imports_allowed():
        return [_measure_item(item, numels, repeat, warm) for item in items]
    keys = [json.dumps([item, list(numels), repeat, warm], sort_keys=True, default=str) for item in items]
    have = {k: curve for k in keys for curve in [_CURVES.get(k)] if curve is not None}
    todo = {k: item for k, item in zip(keys, items) if k not in have}
    if todo:
        got = sandbox.run("curves", {"items": list(todo.values()), "numels": list(numels), "repeat": repeat,
                                     "warm": warm}, CURVES, who=who)
        if not isinstance(got, list) or len(got) != len(todo):
            raise sandbox.SandboxError("cost curve", "the child process gave no curves")
        for k, item, curve in zip(todo, todo.values(), got):
            have[k] = curve
            if not codepath.code_fields({"section": item}):
                _CURVES.put(k, curve)
    return [dict(have[k]) for k in keys]


def curves_here(data: dict) -> List[dict]:
    """The sandbox's ``curves`` task (commlab.lab.base.sandbox): ``measure_curves``' items timed in this process."""
    numels = [int(n) for n in data["numels"]]
    return [_measure_item(item, numels, int(data["repeat"]), int(data["warm"])) for item in data["items"]]


def _measure_item(item: dict, numels, repeat: int, warm: int) -> dict:
    if "method" in item:
        from commlab.engine import methods  # torch
        sec = item["method"]
        m = methods.make(sec["name"], **(sec.get("params") or {}))
        return measure_compressor({"name": m.name}, [m.codec_numel(n) for n in numels], repeat, warm,
                                  make=m.codec)
    return measure_compressor(item["compressor"], numels, repeat, warm)


def decode_cost(curve: dict, nbytes: float, payloads: int) -> float:
    """Seconds to decode ``payloads`` all-gathered payloads of a bucket of ``nbytes``: one decode and what
    each further payload adds (``decode_more``); a curve without it (measured before it was, or given by
    hand) is taken to decode each payload on its own."""
    one = cost(curve["decode"], nbytes)
    more = cost(curve["decode_more"], nbytes) if "decode_more" in curve else one
    return one + (payloads - 1) * more


def cost(curve, nbytes: float) -> float:
    a, b = curve
    return a + b * nbytes
