"""Predictions from a Profile: iteration time of a spec at a bandwidth and worker count,
speedup over DDP, and the crossover bandwidth below which compression pays.

DDP is the same job with ``none``, 25 MB buckets and ``wfbp`` (what torch DDP does), and no method.
``compute_speedup`` divides every compute time, encoding and decoding included (a
GPU 20x faster than this CPU is ``compute_speedup=20``). A spec with a method that communicates less
often (local SGD, DiLoCo, ...) is predicted over its run's steps (``predict_method``, local.py): the mean
iteration time, its syncs amortized, Streaming DiLoCo's fragments overlapped with inner steps.
"""
from __future__ import annotations

import copy
import math
import threading
from typing import Callable, Dict, List, Optional, Tuple

from commlab.engine import schedules
from commlab.engine.codepath import imports_allowed, is_import_path
from commlab.engine.schedules import layer_of  # a parameter's module: the same rule as dear's layer buffers
from commlab.engine.spec import CAP_MB, JobSpec, SpecError, upgrade
from commlab.lab.base import sandbox
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import local
from commlab.lab.strategy.perfmodel.iteration import Bucket, Result, Round, Step, iteration_time

DDP = {"compressor": {"name": "none", "params": {}, "error_feedback": False},
       "schedule": {"name": "bucket", "cap_mb": 25.0}, "comm": {"mode": "wfbp"}}
NO_METHOD = {"name": "none", "params": {}, "compressor": {}}
"""A spec's method section when every step's gradients are exchanged (the default)."""
RUN_STEPS = JobSpec.steps
"""The steps a method is predicted over when the spec does not say (the spec's default)."""


def ddp_spec(spec: dict) -> dict:
    s = copy.deepcopy(spec)
    for k, v in DDP.items():
        s[k] = copy.deepcopy(v)
    if "method" in s:
        s["method"] = copy.deepcopy(NO_METHOD)
    return s


def method_of(spec: dict):
    """The spec's method (commlab/engine/methods/), an instance with its parameters checked, or None for none.
    A method named by import path is the user's code: built only in a process that may import code."""
    sec = spec.get("method") or NO_METHOD
    name = sec.get("name", "none")
    if name == NO_METHOD["name"]:
        return None
    if is_import_path(name) and not imports_allowed():
        raise SpecError("method.name", f"{name} is code, which is not imported here (predicted where the "
                                       "teacher runs it)")
    from commlab.engine import methods  # torch: only for a spec that names a method
    try:
        return methods.make(name, **(sec.get("params") or {}))
    except ValueError as e:
        where, _, msg = str(e).partition(": ")
        raise SpecError(f"method.{where}", msg) from None


def codec_key(m) -> str:
    """The profile's key for the cost curve of a method's own codec (``Method.codec``), e.g.
    ``demo:dct_topk(chunk=64,topk=32)+EF``."""
    return f"{m.name}:{m.codec().describe()}"




def buckets_of(profile: cal.Profile, spec: dict, layout: Optional[List[List[str]]] = None) -> List[List[int]]:
    """The spec's buckets over the profile's parameters: ``layout`` (groups of parameter names, e.g. a run's
    layout.json after its tuner chose) when given; else dear's buffers (comm.layers or schedule.cap_mb) or the
    spec's schedule, through the engine's own pure builders. Without a layout, the tuned schedules
    (mergecomp, layerfusion, dear's cap search) are predicted with their starting layout. A spec written before
    schedule.cap_mb held dear's cap (its comm.cap_mb: a saved profile's) is read as now (upgrade)."""
    if layout:
        pos = {n: i for i, (n, _) in enumerate(profile.params)}
        missing = [n for g in layout for n in g if n not in pos]
        if missing:
            raise KeyError(f"layout names parameters the profile does not have: {missing[:3]}")
        return [[pos[n] for n in g] for g in layout]
    infos = [schedules.ParamInfo(name=n, numel=b // 4, element_size=4, dtype="float32", device="cpu")
             for n, b in profile.params]
    spec = upgrade(spec)
    c = spec["comm"]
    s = spec["schedule"]
    if c["mode"] == "dear":
        if c.get("layers"):
            return schedules.layout_layers(infos, c["layers"])
        return schedules.layout_cap(infos, s.get("cap_mb") or CAP_MB)
    opts = {"cap_mb": s["cap_mb"]} if s["name"] == "bucket" else {}
    return schedules.build(s["name"], infos, **opts)


ROUNDS_KEPT = 4096
"""Buckets' rounds kept in this process (``payload_rounds``), least recently used first out: a server that
predicts for every profile a room uploads must not keep them all."""
_ROUNDS_CACHE: Dict[tuple, list] = {}


def _keep(key: tuple, rounds: list) -> list:
    _ROUNDS_CACHE.pop(key, None)  # a dict keeps insertion order: the key goes last, as the most recent
    _ROUNDS_CACHE[key] = rounds
    while len(_ROUNDS_CACHE) > ROUNDS_KEPT:
        del _ROUNDS_CACHE[next(iter(_ROUNDS_CACHE))]
    return rounds
_NOISE: list = []
"""One random vector, grown as needed, that payload_rounds drives compressors on (slices of it): drawing a
fresh one per bucket was most of the advisor's prediction time."""


def _noise(n: int):
    import torch
    if not _NOISE or _NOISE[0].numel() < n:
        g = torch.Generator().manual_seed(0)
        _NOISE[:] = [torch.randn(max(n, 2 * _NOISE[0].numel() if _NOISE else n), generator=g)]
    return _NOISE[0][:n]


def _fixed(comp: dict) -> bool:
    """Whether the compressor of section ``comp`` declares ``fixed_payload``: its all-gathers go without the
    exchange of shapes in front (commlab.engine.comm.collectives.issue_allgather)."""
    return cal.make_compressor(comp).capabilities.fixed_payload


def payload_rounds(profile: cal.Profile, comp: dict, idx: List[int],
                   sharded: bool = False) -> List[Tuple[str, int, int]]:
    """(op, payload bytes, tensors) of each round for one bucket, as the compressor declares them
    (``declared_rounds``, commlab/engine/compressors/contract.py) or else from driving the real exchange on a
    bucket of that layout (in steady state: past any warm-up iterations). ``sharded``: dear's exchange of the
    bucket (``contract.shard_exchange``, ``declared_shard_rounds``), kept under a key of its own.
    Cached by the bucket's size alone when the compressor treats it as one flat tensor
    (``per_tensor`` false: its payload cannot depend on how the bucket splits into tensors)."""
    shapes, off = [], 0
    for i in idx:
        n = profile.params[i][1] // 4
        shapes.append((off, _matrix_shape(profile.params[i][0], n)))
        off += n
    ckey = (("dear:" if sharded else "") + cal.compressor_key(comp)  # profiles saved before keep their keys
            + cal.code_stamp(comp))  # the user's code: driven again once it changed
    key = (ckey, tuple(profile.params[i] for i in idx))
    if key in _ROUNDS_CACHE:
        return _keep(key, _ROUNDS_CACHE[key])
    saved = f"{ckey}|{','.join(map(str, idx))}"  # the profile's own record: its parameters by index
    if saved in profile.payloads:
        return _keep(key, [tuple(r) for r in profile.payloads[saved]])
    from commlab.engine.compressors import contract
    from commlab.engine.compressors.capabilities import BucketContext
    c = cal.make_compressor(comp)
    bucket = BucketContext(layout=shapes)
    flat_key = None if contract.per_tensor(c, off, bucket) else (ckey, off)
    if flat_key is not None and flat_key in _ROUNDS_CACHE:
        rounds = _ROUNDS_CACHE[flat_key]
    else:
        declared = contract.declared_shard_rounds if sharded else contract.declared_rounds
        rounds = declared(c, off, 4, bucket) if c.capabilities.steady_payload else None
        if rounds is None:
            wanted = getattr(_DRY, "wanted", None)
            if wanted is not None:  # without_driving's first pass: driven elsewhere, then asked again
                wanted.setdefault(key, (profile, comp, shapes, off, sharded, saved, flat_key))
                return [("allreduce", off * 4, 1)]  # a stand-in, kept nowhere
            rounds = _driven(c, off, sharded, bucket)
        if flat_key is not None:
            _keep(flat_key, rounds)
    _keep(key, rounds)
    profile.payloads[saved] = [list(r) for r in rounds]
    return rounds


def _driven(c, n: int, sharded: bool, bucket) -> List[Tuple[str, int, int]]:
    """The rounds of one exchange of ``c`` (in ``bucket``, a BucketContext, for its layout) on a bucket of ``n``
    elements, driven here."""
    from commlab.engine.compressors import contract
    x = _noise(n)
    contract.skip_warmup(c)  # past plain warm-up exchanges (PowerSGD), without driving them
    for _ in range(1 if c.capabilities.steady_payload else 2):  # a steady payload's sizes show in one exchange
        rounds, _ = cal.drive(c, x.clone(), sharded=sharded, bucket=bucket)
    return rounds


_DRY = threading.local()
"""``wanted`` (bucket key -> what driving it needs) while ``without_driving`` takes its first pass in this thread."""


def without_driving(predictions: Callable[[], object], who: Optional[str] = None):
    """``predictions()`` (any calls that predict), with no compressor driven in this process where it serves
    viewers (commlab.engine.codepath.forbid_imports_when): a first pass notes the buckets whose payload only driving
    the exchange tells (``payload_rounds``: their compressor declares none), one child with limits drives them
    all (commlab.lab.strategy.perfmodel.child, task ``rounds``; ``who``'s one at a time), and the second pass, which
    returns, finds their rounds kept. Where this process may import code (the command line) it is
    ``predictions()``."""
    if imports_allowed():
        return predictions()
    _DRY.wanted = wanted = {}
    try:
        predictions()
    except Exception:  # the second pass says it: the first one only notes what to drive
        pass
    finally:
        _DRY.wanted = None
    if wanted:
        items = [{"compressor": comp, "shapes": [[o, list(shape)] for o, shape in shapes], "n": n,
                  "sharded": sharded} for _, comp, shapes, n, sharded, _, _ in wanted.values()]
        got = sandbox.run("rounds", {"items": items}, cal.CURVES, who=who)
        if not isinstance(got, list) or len(got) != len(wanted):
            raise sandbox.SandboxError("payload", "the child process gave no payloads")
        for (key, (profile, _, _, _, _, saved, flat_key)), rounds in zip(wanted.items(), got):
            rounds = [(str(op), int(nbytes), int(k)) for op, nbytes, k in rounds]
            if flat_key is not None:
                _keep(flat_key, rounds)
            _keep(key, rounds)
            profile.payloads[saved] = [list(r) for r in rounds]
    return predictions()


def rounds_here(data: dict) -> List[list]:
    """The sandbox's ``rounds`` task (commlab.lab.base.sandbox): each item's bucket (a compressor section, its layout
    ``shapes`` and ``n`` elements, ``sharded`` for dear's exchange) driven in this process."""
    from commlab.engine.compressors.capabilities import BucketContext
    out = []
    for item in data["items"]:
        c = cal.make_compressor(item["compressor"])
        bucket = BucketContext(layout=tuple((int(o), tuple(shape)) for o, shape in item["shapes"]))
        out.append([list(r) for r in _driven(c, int(item["n"]), bool(item["sharded"]), bucket)])
    return out


def _matrix_shape(name: str, n: int):
    # biases and norms are vectors; weights are treated as (out, rest) matrices, which is how
    # PowerSGD reshapes them; the exact split does not change any other compressor's payload
    if name.endswith("bias") or n < 64:
        return (n,)
    rows = 1
    for d in range(int(math.sqrt(n)), 0, -1):
        if n % d == 0:
            rows = d
            break
    return (rows, n // rows)


def build_step(profile: cal.Profile, spec: dict, world: int, compute_speedup: float = 1.0,
               layout: Optional[List[List[str]]] = None) -> Step:
    """The step's buckets, each with its own compressor's rounds and costs (a mixed section gives
    buckets different compressors by size, as the engine's Plan does). dear's buckets send what the
    compressor's sharded exchange sends (a reduce-scatter of the payload, or a shard codec's all-to-all);
    each rank decodes its shard of every rank's payload: one buffer's worth of decoding in all."""
    from commlab.engine.compressors.plan import section_for
    f = 1.0 / compute_speedup
    sharded = spec["comm"]["mode"] == "dear"
    buckets = []
    kinds: Dict[str, tuple] = {}  # a section's curve and whether it is plain, found once (not once per bucket)
    for idx in buckets_of(profile, spec, layout):
        names = [profile.params[i][0] for i in idx]
        layers = list(dict.fromkeys(layer_of(n) for n in names))
        raw = sum(profile.params[i][1] for i in idx)
        comp = section_for(spec["compressor"], raw)
        known = kinds.get(repr(comp))
        if known is None:
            key = cal.compressor_key(comp)
            plain = not cal.needs_curve(comp)
            known = kinds[repr(comp)] = (key, profile.compressors.get(key), plain, not plain and _fixed(comp))
        key, curve, plain, fixed = known
        if curve is None and not plain:
            raise KeyError(f"profile has no cost curve for compressor {key}")
        ready = max(profile.layer_ready.get(l, profile.backward_s) for l in layers)
        fwd = sum(profile.layer_forward.get(l, 0.0) for l in layers)
        rounds = ([("reduce_scatter" if sharded else "allreduce", raw, 1)] if plain
                  else payload_rounds(profile, comp, idx, sharded))
        enc = cal.cost(curve["encode"], raw) if curve else 0.0
        mid = cal.cost(curve["between"], raw) if curve else 0.0
        dec = cal.cost(curve["decode"], raw) if curve else 0.0
        plan = []
        for r, (op, nbytes, k) in enumerate(rounds):
            last = r == len(rounds) - 1
            if not last:
                after = mid / max(len(rounds) - 1, 1)
            else:  # an all-gathered payload: every rank decodes all ``world`` of them
                after = cal.decode_cost(curve, raw, world) if curve and op == "allgather" else dec
            plan.append(Round(op, nbytes, after=after * f, tensors=k, header=not fixed))
        buckets.append(Bucket(ready=ready * f, encode=enc * f, rounds=plan, raw_bytes=raw, forward=fwd * f))
    return Step(forward=profile.forward_s * f, backward=profile.backward_s * f,
                optimizer=profile.optimizer_s * f, buckets=buckets)


def predict(profile: cal.Profile, spec: dict, gbps: float, world: int, compute_speedup: float = 1.0,
            link=None, record: bool = False,
            layout: Optional[List[List[str]]] = None, step: Optional[Step] = None) -> Result:
    """One iteration of ``spec`` (the mean over its run's steps for a method: ``predict_method``). ``step``:
    the spec's step at this ``world``, ``compute_speedup`` and ``layout``, when the caller built it already
    (``step_of``; it does not depend on the rate, so a table over rates builds it once per worker count)."""
    m = method_of(spec)
    if m is not None:
        return predict_method(profile, spec, m, link or profile.link_at(gbps), world, compute_speedup)
    if step is None:
        step = build_step(profile, spec, world, compute_speedup, layout)
    mode = spec["comm"]["mode"]
    slow = profile.overlap_slowdown if mode != "sync" else 1.0
    return iteration_time(step, link or profile.link_at(gbps), world, mode, slow, record)


def step_of(profile: cal.Profile, spec: dict, world: int, compute_speedup: float = 1.0) -> Optional[Step]:
    """``build_step`` for ``predict(..., step=)``; None for a spec with a method (predicted over its run's steps,
    without a step)."""
    return None if method_of(spec) is not None else build_step(profile, spec, world, compute_speedup)


def steps_for(profile: cal.Profile, spec: dict, world: int, compute_speedup: float = 1.0) -> tuple:
    """(DDP's step, the spec's step) for ``speedup(..., steps=)``: built once for every rate of a table or a search
    (a step does not depend on the rate), not twice per rate."""
    return step_of(profile, ddp_spec(spec), world, compute_speedup), step_of(profile, spec, world, compute_speedup)


def speedup(profile: cal.Profile, spec: dict, gbps: float, world: int, compute_speedup: float = 1.0,
            links: Optional[Callable[[float], object]] = None, steps: Optional[tuple] = None) -> float:
    """DDP's predicted iteration time over the spec's (> 1: the spec is faster). ``links`` maps a
    rate to the link (default: the profile's link at that rate; e.g. a two-level cluster). ``steps``: what
    ``steps_for`` gives at this ``world`` and ``compute_speedup``, when the caller built it already."""
    link = links(gbps) if links else None
    ddp, own = steps or (None, None)
    base = predict(profile, ddp_spec(spec), gbps, world, compute_speedup, link=link, step=ddp).total
    return base / predict(profile, spec, gbps, world, compute_speedup, link=link, step=own).total


def crossover_gbps(profile: cal.Profile, spec: dict, world: int, compute_speedup: float = 1.0,
                   lo: float = 1e-3, hi: float = 1e3,
                   links: Optional[Callable[[float], object]] = None) -> Optional[float]:
    """The bandwidth below which the spec beats DDP: None if it never does in [lo, hi],
    ``hi`` if it always does."""
    steps = steps_for(profile, spec, world, compute_speedup)

    def gain(g):
        return speedup(profile, spec, g, world, compute_speedup, links, steps) - 1.0
    grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
    vals = [gain(g) for g in grid]
    if vals[-1] > 0:
        return hi
    if vals[0] <= 0:
        return None
    i = max(i for i, v in enumerate(vals) if v > 0)  # the last bandwidth where it still pays
    a, b = grid[i], grid[i + 1]
    for _ in range(30):
        m = math.sqrt(a * b)
        a, b = (m, b) if gain(m) > 0 else (a, m)
    return a


def predict_method(profile: cal.Profile, spec: dict, m, link, world: int,
                   compute_speedup: float = 1.0) -> local.MethodResult:
    """The mean iteration time and bytes of ``spec``'s run with the method ``m`` (``method_of``): its own
    schedule (``Method.schedule`` over the profile's tensors in registration order and the spec's steps),
    each exchange priced from the profile (local.py says how the steps are simulated). Local steps are
    forward, backward and the optimizer; gradient steps (post-local SGD's warm-up) are the spec's step without
    the method; a pseudo-gradient goes through ``method.compressor`` (its payload and cost curve as a bucket's)
    or the method's own codec (SparseLoCo's: its declared rounds and the codec's curve),
    parameters are all-reduced raw, DeMo's components are all-gathered with its codec's measured cost; the
    outer step costs the optimizer's step."""
    f = 1.0 / compute_speedup
    order = list(reversed(range(len(profile.params))))  # the profile is in gradient-ready order
    tensor_bytes = [profile.params[i][1] for i in order]
    try:
        m.check_model(tensor_bytes)
    except ValueError as e:
        where, _, msg = str(e).partition(": ")
        raise SpecError(f"method.{where}", msg) from None
    steps = spec.get("steps") or RUN_STEPS
    events = m.schedule(tensor_bytes, steps)
    parts = [[order[i] for i in part] for part in m.parts(tensor_bytes)]
    plain = {**spec, "method": copy.deepcopy(NO_METHOD)}
    grad = None
    if any(e.kind == local.GRADIENTS for e in events):
        # the rate is the link's (``link`` is given; a two-level cluster has no single rate)
        grad = (predict(profile, plain, 1.0, world, compute_speedup, link=link),
                sum(r.nbytes for b in build_step(profile, plain, world, compute_speedup).buckets for r in b.rounds))
    comp = spec["method"].get("compressor") if m.takes_compressor else None
    own = None if m.takes_compressor else m.codec()  # a codec of the method's own for its pseudo-gradients
    outer = profile.optimizer_s * f if m.takes_compressor or own is not None else 0.0
    priced: Dict[tuple, local.Sync] = {}

    def price(e) -> local.Sync:
        key = (e.kind, e.fragment)
        if key not in priced:
            priced[key] = _price(e)
        return priced[key]

    def _price(e) -> local.Sync:
        if e.kind == local.GRADIENTS:
            return local.Sync(0.0, [Round("allreduce", grad[1])])
        if e.kind == local.COMPONENTS:
            curve = _curve(profile, codec_key(m))
            raw = 4 * sum(m.codec_numel(b // 4) for b in tensor_bytes)
            return local.Sync(cal.cost(curve["encode"], raw) * f,
                              [Round("allgather", e.bytes, after=cal.cost(curve["decode"], raw) * f, tensors=2,
                                     header=not m.codec().capabilities.fixed_payload)])
        if e.kind == "pseudo" and own is not None:  # SparseLoCo's codec: its rounds as it declares them
            from commlab.engine.compressors import contract
            curve = _curve(profile, codec_key(m))
            rounds = contract.declared_rounds(own, m.codec_numel(e.bytes // 4), 4)
            enc, dec = (cal.cost(curve[k], e.bytes) * f for k in ("encode", "decode"))
            return local.Sync(enc, [Round(op, nbytes, tensors=k, after=dec * (world if op == "allgather" else 1),
                                          header=not own.capabilities.fixed_payload)
                                    for op, nbytes, k in rounds], outer=outer)
        if not comp or not cal.needs_curve(comp):  # parameters, or an uncompressed pseudo-gradient
            return local.Sync(0.0, [Round("allreduce", e.bytes)], outer=outer)
        curve = _curve(profile, cal.compressor_key(comp))
        rounds = payload_rounds(profile, comp, parts[e.fragment])
        enc, mid, dec = (cal.cost(curve[k], e.bytes) * f for k in ("encode", "between", "decode"))
        fixed = _fixed(comp)
        plan = [Round(op, nbytes, tensors=k, after=(dec * (world if op == "allgather" else 1))
                      if r == len(rounds) - 1 else mid / max(len(rounds) - 1, 1), header=not fixed)
                for r, (op, nbytes, k) in enumerate(rounds)]
        return local.Sync(enc, plan, outer=outer)
    no_grad = Result(0.0, 0.0)
    return local.simulate(events, steps, (profile.forward_s + profile.backward_s) * f, profile.optimizer_s * f,
                          grad[0] if grad else no_grad, price, link, world)


def _curve(profile: cal.Profile, key: str) -> dict:
    curve = profile.compressors.get(key)
    if curve is None:
        raise KeyError(f"profile has no cost curve for compressor {key}")
    return curve
