"""The promises every compressor makes, checked: the built-ins pass them, and so must yours.

    from commlab.engine.compressors.conformance import check
    for r in check("mypkg.codecs:ScaledSign", {"scale": 0.5}):
        print(r.line())                    # PASS / FAIL / SKIP, the check's name, one line on why

Each check drives the compressor's own exchange the way the engine does (commlab.engine.comm.exchange.run_exchange),
with every rank simulated in this process (``local_collective``): no process group, nothing to launch.

- declaration: the declared capabilities (``Capabilities``, which checks its own types) hold together; the
  exchange asks for ``rounds`` rounds, all all-reduces when ``summable`` and all all-gathers otherwise;
  ``declared_rounds``, where given, is what the exchange does; warm-up exchanges are plain all-reduces.
- shapes and dtypes: each declared dtype (``dtypes``: fp32, fp16, bf16) comes back in shape, dtype and
  device, finite, through the exchange and through ``compress``/``decompress``.
- empty and ragged: buckets of 0, 1, 7 and 1001 elements, and one of three tensors, at three ranks.
- aggregation: summable: summing the ranks' payloads stands for the sum of their inputs (the exchange at
  three ranks gives what one rank makes of the mean, within the payload dtype's rounding), lossless: the
  result is the mean; all-gathered: the result points the way of the mean.
- ranks agree: every simulated rank ends with the same tensor, bit for bit, at two and three ranks, over
  several steps (with error feedback where it applies): ranks that differ train different models.
- error feedback: with ``error_feedback``, what was sent plus the residual is everything fed in.
- state round trip: an instance loaded from another's ``state_dict`` (deep-copied) gives the same next
  outputs, bit for bit (on a GPU to float rounding: its atomic adds sum in no fixed order).
- dear shards: where ``capabilities.shard_problem()`` is None, dear's sharded exchange (a reduce-scatter of the
  payload, or a shard codec's all-to-all) gives each rank its shard of what the whole exchange gives (the sum
  path: the whole exchange's output, sliced; the all-to-all path: the exchange of the inputs' slices, since each
  slice is compressed on its own), driven as commlab/engine/comm/dear.py drives it.

Every simulated rank's instance gets its own ``BucketContext`` (bucket 1, its rank, the bucket's layout), as
the communicator gives one.

A check never raises for what the compressor does: an exception inside it is that check's FAIL, with its
type and first line.
"""
from __future__ import annotations

import contextvars
import copy
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from commlab.engine.comm.exchange import local_collective, run_exchange
from commlab.engine.compressors import contract, make, resolve
from commlab.engine.compressors.base import Compressor, nbytes
from commlab.engine.compressors.capabilities import BucketContext

Tensor = torch.Tensor

CHECKS = ("declaration", "shapes and dtypes", "empty and ragged", "aggregation", "ranks agree", "error feedback",
          "state round trip", "dear shards")
RAGGED = ((16, 24), (7,), (3, 5, 5))
"""A bucket of three parameter tensors of uneven sizes (466 elements)."""
SIZES = (0, 1, 7, 1001)
STEPS = 3
"""Steps driven where state carries over (momentum, residuals, warm-started factors)."""


@dataclass
class Result:
    check: str
    status: str
    """PASS, FAIL, or SKIP (the check does not apply to what the class declares; ``reason`` says why)."""
    reason: str

    @property
    def ok(self) -> bool:
        return self.status != "FAIL"

    def line(self) -> str:
        return f"{self.status:<4}  {self.check:<17}  {self.reason}"

    def as_dict(self) -> dict:
        return {"check": self.check, "status": self.status, "reason": self.reason}


class Finding(Exception):
    """A check's failure, one line."""


class Skip(Exception):
    """The check does not apply, one line on why."""


def check(name, params: Optional[dict] = None, worlds: Sequence[int] = (2, 3), device="cpu") -> List[Result]:
    """Every check of ``CHECKS`` on the compressor ``name`` (a registered name, ``package.module:Class``, or
    the class) made with ``params``, its inputs on ``device`` (a CUDA device checks the compressor on GPU
    tensors: one that allocates on the default device fails the shapes check). A name that does not resolve,
    or parameters its declaration refuses, give one FAIL (declaration) and nothing else."""
    params = dict(params or {})
    token = _DEVICE.set(torch.device(device))
    try:
        return _check_all(name, params, worlds)
    finally:
        _DEVICE.reset(token)


def _check_all(name, params: dict, worlds: Sequence[int]) -> List[Result]:
    try:
        resolve(name)
        make(name, **params)
    except ValueError as e:
        return [Result("declaration", "FAIL", str(e))]
    maker = _Maker(name, params)
    out = []
    for label, fn in zip(CHECKS, (_declaration, _shapes_dtypes, _empty_ragged, _aggregation, _ranks_agree,
                                  _error_feedback, _state_round_trip, _dear_shards)):
        try:
            out.append(Result(label, "PASS", fn(maker, tuple(worlds))))
        except Skip as e:
            out.append(Result(label, "SKIP", str(e)))
        except Finding as e:
            out.append(Result(label, "FAIL", str(e)))
        except Exception as e:  # the compressor's own code failed: that is this check's finding
            out.append(Result(label, "FAIL", f"{type(e).__name__}: {_first_line(e)}"))
    return out


def passed(results: List[Result]) -> bool:
    return all(r.ok for r in results)


# --------------------------------------------------------------------------- driving

def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


class _Maker:
    """Fresh instances, each with the context the communicator would give it (bucket, rank, layout), past any
    warm-up; ``drive``, ``sharded`` and ``compress`` hand each one its context."""

    def __init__(self, name, params: dict):
        self.name, self.params = name, params
        probe = make(name, **params)
        self.probe = probe
        self.caps = probe.capabilities
        self.can_ef = not self.caps.builtin_feedback
        self.contexts: Dict[int, BucketContext] = {}
        """By id of an instance this maker made: its context."""

    def __call__(self, shapes=RAGGED, rank: int = 0, ef: bool = False, warm: bool = False, bucket: int = 1):
        c = make(self.name, error_feedback=ef, **self.params)
        self.contexts[id(c)] = BucketContext(bucket, rank, layout(shapes))
        if not warm:
            contract.skip_warmup(c)
        return c

    def ranks(self, world: int, shapes=RAGGED, ef: bool = False, warm: bool = False) -> List[Compressor]:
        return [self(shapes, r, ef, warm) for r in range(world)]

    def drive(self, comps: List[Compressor], xs: List[Tensor], log: Optional[list] = None) -> List[Tensor]:
        return drive(comps, xs, log, [self.contexts[id(c)] for c in comps])

    def sharded(self, comps: List[Compressor], xs: List[Tensor]) -> List[Tensor]:
        return sharded(comps, xs, [self.contexts[id(c)] for c in comps])

    def compress(self, c: Compressor, x: Tensor) -> tuple:
        """``c``'s own ``compress`` of ``x`` (no exchange, no error feedback), given its context where it takes one."""
        return contract.compress(contract.unwrap(c), x, self.contexts[id(c)])


def layout(shapes) -> List[Tuple[int, Tuple[int, ...]]]:
    out, off = [], 0
    for s in shapes:
        out.append((off, tuple(s)))
        off += math.prod(s)
    return out


_DEVICE: contextvars.ContextVar = contextvars.ContextVar("conformance_device", default=torch.device("cpu"))
"""The device the checks' inputs live on (``check``'s ``device``)."""


def inputs(world: int, n: int, dtype=torch.float32, seed: int = 0) -> List[Tensor]:
    """The same numbers on any device: drawn on the CPU, then moved to the checks' device."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(_DEVICE.get(), dtype) for _ in range(world)]


def drive(comps: List[Compressor], xs: List[Tensor], log: Optional[list] = None,
          buckets: Optional[List[BucketContext]] = None) -> List[Tensor]:
    """One exchange of every simulated rank's input (cloned: an exchange may write into its input); the
    outputs, cloned (a cast decodes into a buffer its next exchange rewrites). ``log`` gets, per round,
    (op, bytes rank 0 put on the wire, its tensor count). ``buckets``: each rank's context."""
    def collective(op, payloads):
        if log is not None:
            log.append((op, nbytes(payloads[0]), len(payloads[0])))
        return local_collective(op, payloads)
    exs = run_exchange(comps, [x.clone() for x in xs], len(comps), collective, buckets=buckets)
    return [ex.out.clone() for ex in exs]


def tolerance(m: "_Maker", fresh: Compressor, x: Tensor) -> float:
    """Relative tolerance for results that sum the same values in another order or rounding: four ulps of the
    coarsest floating dtype on the wire (or of the input), at least 1e-5. ``fresh``: an instance used for
    nothing else (compressing changes state)."""
    payload, _ = m.compress(fresh, x.clone())
    eps = [torch.finfo(t.dtype).eps for t in list(payload) + [x] if t.is_floating_point()]
    return max([1e-5] + [4 * e for e in eps])


def off_by(a: Tensor, b: Tensor, tol: float) -> Optional[str]:
    """None when ``a`` is ``b`` within ``tol`` of ``b``'s largest magnitude; else how far off."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} where {tuple(b.shape)} was expected"
    if not a.numel():
        return None
    a, b = a.double(), b.double()
    scale = max(b.abs().max().item(), 1e-12)
    err = (a - b).abs().max().item()
    return None if err <= tol * scale else f"off by {err:.3g} (allowed {tol:.2g} of the largest value, {scale:.3g})"


def _kept(out: Tensor, x: Tensor, where: str) -> None:
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise Finding(f"{where}: gave {tuple(out.shape)} {out.dtype} on {out.device} for {tuple(x.shape)} "
                      f"{x.dtype} on {x.device}")
    if out.is_floating_point() and not torch.isfinite(out).all():
        raise Finding(f"{where}: gave non-finite values for finite input")


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


# --------------------------------------------------------------------------- the checks

def _declaration(m: _Maker, worlds) -> str:
    c = m.caps
    if c.identity and not (c.summable and c.keeps_shape and c.lossless):
        raise Finding("identity declares the payload is the input: it must be summable, keeps_shape and lossless too")
    world = max(worlds)
    comps = m.ranks(world)
    n = layout(RAGGED)[-1][0] + math.prod(RAGGED[-1])
    log: list = []
    m.drive(comps, inputs(world, n), log)
    want = "allreduce" if c.summable else "allgather"
    rounds = comps[0].capabilities.rounds
    if len(log) != rounds:
        raise Finding(f"declares {rounds} round(s), its exchange asked for {len(log)}")
    if any(op != want for op, _, _ in log):
        raise Finding(f"declares summable={c.summable}, so every round should be {want}; asked for "
                      f"{', '.join(op for op, _, _ in log)}")
    sent = sum(b for _, b, _ in log)
    if comps[0].capabilities.steady_payload:
        declared = contract.declared_rounds(comps[0], n, 4, m.contexts[id(comps[0])])
        if declared is not None and [tuple(r) for r in declared] != [tuple(r) for r in log]:
            raise Finding(f"declared_rounds says {declared}, the exchange sent {log}")
    warm = ""
    if c.warmup_exchanges:
        first: list = []
        m.drive(m.ranks(world, warm=True), inputs(world, n), first)
        if [op for op, _, _ in first] != ["allreduce"] or first[0][1] != n * 4:
            raise Finding(f"declares {c.warmup_exchanges} warm-up exchange(s), but its first exchange sent {first}, "
                          f"not one all-reduce of the {n * 4} input bytes")
        warm = f"; {c.warmup_exchanges} plain all-reduce(s) first"
    fixed = ""
    if c.fixed_payload:
        _fixed_sizes(m, world, n)
        fixed = "; payload sizes fixed on every rank"
    return (f"{'summable: all-reduced' if c.summable else 'all-gathered'}, {len(log)} round(s), {sent} bytes for "
            f"{n * 4} of fp32 ({n * 4 / max(sent, 1):.1f}x){warm}{fixed}")


def _fixed_sizes(m: _Maker, world: int, n: int) -> None:
    """``fixed_payload`` holds: each round's payload has the same tensor sizes on every rank and for any values
    (ranks with normal, zero, one-spike and constant inputs in one exchange, then the other way round)."""
    g = torch.Generator().manual_seed(7)
    spike = torch.zeros(n)
    spike[n // 2] = 1e6
    kinds = [torch.randn(n, generator=g), torch.zeros(n), spike, torch.full((n,), 3.0)]
    for order in (kinds, kinds[::-1]):
        xs = [order[r % len(order)].to(_DEVICE.get()) for r in range(world)]
        sizes: list = []

        def collective(op, payloads):
            sizes.append([[tuple(t.shape) for t in p] for p in payloads] if op != "all_to_all" else None)
            return local_collective(op, payloads)
        comps = m.ranks(world)
        run_exchange(comps, xs, world, collective, buckets=[m.contexts[id(c)] for c in comps])
        for i, per_rank in enumerate(sizes):
            if per_rank is not None and any(p != per_rank[0] for p in per_rank):
                raise Finding(f"declares fixed_payload, but in round {i + 1} the ranks' payload sizes differ "
                              f"with their values: {per_rank}; declare fixed_payload=False")


def _shapes_dtypes(m: _Maker, worlds) -> str:
    n = layout(RAGGED)[-1][0] + math.prod(RAGGED[-1])
    dts = [d for d in m.caps.dtypes if d.is_floating_point]
    for dt in dts:
        for shapes in (((1,),), ((7,),), RAGGED):
            k = layout(shapes)[-1][0] + math.prod(shapes[-1])
            xs = inputs(2, k, dt, seed=k)
            for r, out in enumerate(m.drive(m.ranks(2, shapes), xs)):
                _kept(out, xs[r], f"{_dtype(dt)} bucket of {k}, rank {r}")
        x = inputs(1, n, dt)[0].reshape(2, n // 2)
        c = m(((2, n // 2),))
        payload, ctx = m.compress(c, x.clone())
        if not isinstance(payload, list) or not all(isinstance(t, torch.Tensor) for t in payload):
            raise Finding(f"compress must return a list of tensors as its payload, returned {type(payload).__name__}")
        _kept(c.decompress(payload, ctx), x, f"{_dtype(dt)} {tuple(x.shape)} through compress and decompress")
    return f"{', '.join(_dtype(d) for d in dts)} kept on buckets of 1, 7 and {n} elements and a 2-d tensor"


def _empty_ragged(m: _Maker, worlds) -> str:
    world = max(worlds)
    for n in SIZES:
        xs = inputs(world, n, seed=n)
        try:
            outs = m.drive(m.ranks(world, ((n,),)), xs)
        except Exception as e:  # the compressor's own failure, with the bucket it failed on
            raise Finding(f"bucket of {n} element(s): {type(e).__name__}: {_first_line(e)}") from None
        for r, out in enumerate(outs):
            _kept(out, xs[r], f"bucket of {n} element(s), rank {r}")
    return f"buckets of {', '.join(map(str, SIZES))} elements at {world} ranks"


def _aggregation(m: _Maker, worlds) -> str:
    world = max(worlds)
    c = m.caps
    n = layout(RAGGED)[-1][0] + math.prod(RAGGED[-1])
    comps = m.ranks(world)
    alone = m(rank=0)
    tol = tolerance(m, m(), inputs(1, n)[0])
    for step in range(STEPS):
        xs = inputs(world, n, seed=10 + step)
        mean = torch.stack(xs).mean(0)
        outs = m.drive(comps, xs)
        if c.summable:
            (ref,) = m.drive([alone], [mean])
            bad = off_by(outs[0], ref, tol)
            if bad:
                raise Finding(f"declares summable, but at step {step} the sum of {world} ranks' payloads does not "
                              f"decode as one rank's payload of their sum: {bad}")
        if c.lossless:
            bad = off_by(outs[0], mean, tol)
            if bad:
                raise Finding(f"declares lossless, but at step {step} the exchange is not the mean: {bad}")
        if step == 0 and not c.lossless:
            cos = torch.nn.functional.cosine_similarity(outs[0].double(), mean.double(), dim=0).item()
            if not cos > 0.05:
                raise Finding(f"the result does not follow the mean of the inputs (cosine {cos:.3f})")
    if c.lossless:
        return f"the mean of {world} ranks' inputs within {tol:.2g}"
    if not c.summable:
        return f"all-gathered and decoded on every rank; the result follows the mean at {world} ranks"
    if comps[0].capabilities.rounds > 1:
        how = f"over its {comps[0].capabilities.rounds} rounds"
    elif _decode_linear(m, n, tol):
        how = "decoding is linear too"
    else:
        how = "its decoding is not linear (an estimate, as a sketch's): the payloads' sum is what counts"
    return f"summed payloads stand for the summed inputs at {world} ranks within {tol:.2g}; {how}"


def _decode_linear(m: _Maker, n: int, tol: float) -> bool:
    a, b = m(rank=0), m(rank=1)
    x, y = inputs(2, n, seed=5)
    px, cx = m.compress(a, x.clone())
    px = [t.clone() for t in px]
    py, _ = m.compress(b, y.clone())
    if [t.shape for t in px] != [t.shape for t in py]:
        return False
    both = a.decompress([u + v for u, v in zip(px, py)], cx).clone()
    apart = a.decompress(px, cx).clone() + b.decompress(py, cx)
    return off_by(both, apart, tol) is None


def _ranks_agree(m: _Maker, worlds) -> str:
    n = layout(RAGGED)[-1][0] + math.prod(RAGGED[-1])
    efs = (False, True) if m.can_ef else (False,)
    for world in worlds:
        for ef in efs:
            comps = m.ranks(world, ef=ef)
            for step in range(STEPS):
                outs = m.drive(comps, inputs(world, n, seed=20 + step))
                for r, o in enumerate(outs[1:], 1):
                    if not torch.equal(o, outs[0]):
                        diff = (o.double() - outs[0].double()).abs().max().item()
                        raise Finding(f"rank {r} of {world} ended with another result than rank 0 at step {step}"
                                      f"{' with error feedback' if ef else ''} (max difference {diff:.3g}); every "
                                      f"rank must decode every payload alike (rank-specific values belong in the "
                                      f"payload, not in ctx)")
    return (f"identical on {' and '.join(map(str, worlds))} ranks over {STEPS} steps"
            f"{', with and without error feedback' if m.can_ef else ''}")


def _error_feedback(m: _Maker, worlds) -> str:
    if not m.can_ef:
        raise Skip("keeps its own residual (builtin_feedback): the error_feedback flag is refused, as it must be")
    n = 600
    c = m(((n,),), ef=True)
    fed, sent = (torch.zeros(n, dtype=torch.float64, device=_DEVICE.get()) for _ in range(2))
    steps = 6
    for step in range(steps):
        g = inputs(1, n, seed=30 + step)[0]
        fed += g.double()
        (out,) = m.drive([c], [g])
        sent += out.double()
    if c.residual is None:
        raise Finding("error feedback kept no residual")
    bad = off_by(sent + c.residual.double(), fed, 1e-4)
    if bad:
        raise Finding(f"what was sent plus the residual is not everything fed in over {steps} steps: {bad}")
    share = (c.residual.norm() / fed.norm()).item()
    return f"sent + residual = everything fed in over {steps} steps (residual {share:.1%} of it)"


def _state_round_trip(m: _Maker, worlds) -> str:
    world = min(worlds)
    ef = m.can_ef
    n = layout(RAGGED)[-1][0] + math.prod(RAGGED[-1])
    a = m.ranks(world, ef=ef)
    for step in range(STEPS):
        m.drive(a, inputs(world, n, seed=40 + step))
    states = [copy.deepcopy(c.state_dict()) for c in a]
    b = m.ranks(world, ef=ef)
    for c, s in zip(b, states):
        c.load_state_dict(copy.deepcopy(s))
    # on a GPU, atomic adds (a sketch's scatter-add) sum in no fixed order: two identical instances differ by
    # float rounding there, so a GPU compares to rounding (1e-5 of the largest output) and a CPU bit for bit
    exact = _DEVICE.get().type == "cpu"
    for step in range(2):
        xs = inputs(world, n, seed=50 + step)
        for r, (u, v) in enumerate(zip(m.drive(a, xs), m.drive(b, xs))):
            same = torch.equal(u, v) if exact else \
                (u.double() - v.double()).abs().max().item() <= 1e-5 * u.double().abs().max().item()
            if not same:
                raise Finding(f"an instance loaded from state_dict() gave another result {step + 1} step(s) later "
                              f"(rank {r}, max difference {(u.double() - v.double()).abs().max().item():.3g}): "
                              f"some state is missing from state_dict/load_state_dict")
    keys = sorted({k for s in states for k in s})
    return (f"the same outputs{'' if exact else ' (to float rounding on a GPU)'} after loading state_dict() "
            f"({', '.join(keys) if keys else 'no state'})"
            f"{', error feedback on' if ef else ''}")


def _dear_shards(m: _Maker, worlds) -> str:
    problem = m.caps.shard_problem()
    if problem:
        raise Skip(f"dear refuses it: it {problem}")
    path = m.caps.shard_path()
    n0 = layout(RAGGED)[-1][0] + math.prod(RAGGED[-1])
    for world in worlds:
        n = -(-n0 // world) * world  # dear pads a buffer to a multiple of the world size, with zeros
        xs = [torch.nn.functional.pad(x, (0, n - n0)) for x in inputs(world, n0, seed=60 + world)]
        shapes = RAGGED + ((n - n0,),) if n > n0 else RAGGED
        got = m.sharded(m.ranks(world, shapes), xs)
        s = n // world
        if path == "sum":
            full = m.drive(m.ranks(world, shapes), xs)[0]
            refs = [full[r * s:(r + 1) * s] for r in range(world)]
        else:
            refs = [m.drive(m.ranks(world, ((s,),)), [x[r * s:(r + 1) * s] for x in xs])[0] for r in range(world)]
        tol = tolerance(m, m(shapes), xs[0])
        for r in range(world):
            bad = off_by(got[r], refs[r], tol)
            if bad:
                raise Finding(f"rank {r} of {world}: dear's {path} exchange of its shard differs from "
                              f"{'the whole exchange, sliced' if path == 'sum' else 'the exchange of that slice'}: {bad}")
    how = "the payload reduce-scattered" if path == "sum" else "each shard compressed alone, all-to-all"
    return f"{path} ({how}): each rank's shard as the whole exchange gives it, at {' and '.join(map(str, worlds))} ranks"


def sharded(comps: List[Compressor], xs: List[Tensor], buckets: Optional[List[BucketContext]] = None) -> List[Tensor]:
    """Each rank's shard after dear's exchange, every rank in this process: the sharded exchange
    (commlab/engine/compressors/contract.py, a reduce-scatter of the payload or each slice compressed alone and
    all-to-all) driven by the exchange driver, exactly as dear drives it on real ranks."""
    try:
        exs = run_exchange(comps, [x.clone() for x in xs], len(comps), local_collective, ranks=range(len(comps)),
                           buckets=buckets)
    except (RuntimeError, ValueError) as e:
        raise Finding(str(e).splitlines()[0]) from None
    return [ex.out.reshape(-1).to(x.dtype) for ex, x in zip(exs, xs)]


def table(results: List[Result]) -> List[str]:
    return [r.line() for r in results]


def summary(results: List[Result]) -> Dict[str, int]:
    out = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for r in results:
        out[r.status] += 1
    return out


