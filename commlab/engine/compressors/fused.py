"""Fused GPU kernels (Triton) for the elementwise codecs: one pass over memory per direction.

In eager torch a sign or stochastic codec is 6-30 kernels (compare, pack, norm, clamp, cast, ...), each
reading and writing the whole bucket or an intermediate of it, and each costing the host a launch; on an
H100 that held them to 4-12% of memory bandwidth at 25M elements and 100-400 µs per call at 1K
(bench/results/gpu.md). Here each direction is one kernel (two, and a torch sum of per-block partials, where a
whole-bucket reduction must finish before any element can be coded), and decoding the payloads of every rank is one kernel too:

==========  ======================================================  ==================================
codec       compress                                                decompress (one payload or all)
==========  ======================================================  ==================================
signsgd     sign bits                                               +-1, or the vote over ranks
signum      momentum step and its sign bits                         +-1, or the vote over ranks
efsignsgd   residual += g and |.| per block; (their sum: torch);    +-scale per rank, averaged
            scale, bits and residual -= decoded
onebit      bits, count and sums per block; (their sums: torch);    a mean per bit per rank, averaged
            the two means
qsgd        sums of squares per program; codes floor(x / step + U)  code * norm / levels, averaged
terngrad    max|x| per program; 2-bit codes floor(x / s + 1 + U)    s * {-1, 0, 1}, averaged
natural     max|x| per program; bits + random mantissa -> exponent  +-2^(offset + k - 127) or 0, averaged
==========  ======================================================  ==================================

The payloads are byte for byte the eager codecs' (same layout, same scalars), so a fused rank and an eager
rank exchange with each other. Deterministic codecs give the eager results (up to the order of a float
sum: the partial sums here are per block); the random ones draw their noise from Triton's Philox
generator (four numbers per draw), keyed per call from the compressor's seed, bucket and rank and a call
count the norm's pass keeps on the GPU (no host round trip, and a CUDA graph of the call draws new noise
each replay), so they are the same distribution, not the same numbers, as the eager path's
``torch.Generator``; QSGD's norm is summed in another order than torch's (the same to float rounding).

Used for float32 tensors on CUDA GPUs of compute capability 8.0 or later (Ampere on) when Triton imports and
every kernel ran once at first use (``smoke``; a failure is warned and leaves the eager codecs);
``COMMLAB_FUSED=0`` turns it off (the eager path, for comparison), ``COMMLAB_FUSED=interpret`` also takes it on the CPU under ``TRITON_INTERPRET=1``
(Triton's interpreter: how the kernels are tested on a machine without a GPU).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import List, Sequence

import torch

Tensor = torch.Tensor

BLOCK = 4096
"""Elements per program of the elementwise kernels (a multiple of 8 and of 4, for the packing)."""

K = None
"""commlab.engine.compressors.fused_kernels once imported; False where Triton is missing."""


def _import():
    global K
    if K is None:
        try:
            from commlab.engine.compressors import fused_kernels
            K = fused_kernels
        except ImportError:  # no Triton here: the eager path stays
            K = False
    return K


MIN_CAPABILITY = (8, 0)
"""The oldest GPUs the fused path takes (Ampere): what Triton supports in full. Older ones keep the eager path."""
_capable: dict = {}  # CUDA device index -> whether it has MIN_CAPABILITY


def on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float32 work of ``dtype`` on ``device`` takes the fused kernels: on a CUDA GPU of compute
    capability 8.0 or later with Triton (or the CPU under Triton's interpreter, ``COMMLAB_FUSED=interpret``),
    unless ``COMMLAB_FUSED=0``."""
    if dtype != torch.float32:
        return False
    mode = os.environ.get("COMMLAB_FUSED", "1")
    if mode == "0":
        return False
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        ok = _capable.get(index)
        if ok is None:
            ok = _capable[index] = (torch.cuda.get_device_capability(index) >= MIN_CAPABILITY and bool(_import())
                                    and _first_run(index))
        return ok
    if not (mode == "interpret" and os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return bool(_import())


problem: dict = {}
"""CUDA device index -> why the fused kernels failed their first run there (that process then runs the eager
codecs on it)."""


def _first_run(index: int) -> bool:
    """Whether every fused kernel built and ran on a few elements of GPU ``index`` (``smoke``). A Triton or a
    driver that cannot leaves this process on the eager codecs, said once, instead of failing a run at its
    first compressed step (or halfway through a codec's kernels, its state half updated)."""
    try:
        smoke(torch.device("cuda", index))
        return True
    except Exception as e:  # noqa: BLE001 - any failure: the eager path, and the reason said and kept
        text = str(e).strip().splitlines()
        problem[index] = f"{type(e).__name__}: {text[0] if text else ''}".strip()
        warnings.warn(f"the fused GPU kernels failed on cuda:{index} ({problem[index]}); the eager codecs run "
                      "there instead (COMMLAB_FUSED=0 goes straight to them)", RuntimeWarning, stacklevel=3)
        return False


def smoke(device: torch.device) -> None:
    """Each fused entry point, encoding and decoding, once on 1000 elements of ``device``: compiles every kernel
    (once per machine: Triton keeps them on disk) and raises what any of them raises. Draws on no generator."""
    n, f32 = 1000, torch.float32
    with torch.cuda.device(device):
        x = torch.linspace(-1.0, 1.0, n, device=device)
        rng = torch.zeros(2, dtype=torch.int64, device=device)
        decode_bits([pack_signs(x)], n, VOTE, (), f32)
        momentum_signs(x, torch.zeros_like(x), 0.9)
        scale, bits = ef_signs(x, torch.zeros_like(x))
        decode_bits([bits], n, PM, [scale], f32)
        means, bits = onebit(x)
        decode_bits([bits], n, LOHI, [means], f32)
        norm, codes = qsgd_codes(x, rng, 127, 1e-30, torch.int8)
        qsgd_decode_all([norm], [codes], n, 127, f32)
        s, packed = tern_codes(x, rng, 1e-30)
        tern_decode_all([s], [packed], n, f32)
        offset, codes = natural_codes(x, rng)
        natural_decode_all([offset], [codes], n, f32)
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def scoped_env(name: str, value: str):
    """Inside: the environment variable ``name`` set to ``value``; afterwards as it was (set or not)."""
    was = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = was


def disabled():
    """Inside: the eager codecs everywhere, as with ``COMMLAB_FUSED=0`` (the reference the kernels are held to,
    and timed against)."""
    return scoped_env("COMMLAB_FUSED", "0")


def settings() -> dict:
    """This process's switches of the fused kernels: ``COMMLAB_FUSED`` and ``COMMLAB_FUSED_LAUNCH``, as read."""
    return {"fused": os.environ.get("COMMLAB_FUSED", "1"), "fused_launch": os.environ.get("COMMLAB_FUSED_LAUNCH", "direct")}


def enabled(x: Tensor) -> bool:
    """Whether the tensor ``x`` takes the fused kernels (``on`` its device and dtype, contiguous, not empty)."""
    return x.numel() > 0 and on(x.device, x.dtype) and x.is_contiguous()


def _grid(n: int, block: int = BLOCK):
    return (max(1, -(-n // block)),)


# --------------------------------------------------------------------------- launching

_compiled: dict = {}
"""(kernel, device, specialization, constexprs) -> the kernel Triton compiled for them (``_launch``)."""
_constexprs: dict = {}  # kernel -> the names of its constexpr parameters, in signature order
I32 = 2 ** 31


def _spec(args) -> tuple:
    """What Triton specializes a compiled kernel on, for ``args``, or finer: a tensor's dtype and whether its
    address is 16-byte aligned; an int's type by range, whether it is 1 and whether 16 divides it; a float's
    type (Triton passes every Python float as fp32)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            key.append(("b", a))
        elif isinstance(a, int):
            key.append(((0 if -I32 <= a < I32 else 1 if a < 2 ** 63 else 2), a == 1, a % 16 == 0))
        else:
            key.append(type(a))
    return tuple(key)


def _triton_launch() -> bool:
    """Whether ``COMMLAB_FUSED_LAUNCH`` asks for Triton's own launch (``triton``) rather than the direct one
    (``direct``, the default)."""
    way = os.environ.get("COMMLAB_FUSED_LAUNCH", "direct")
    if way not in ("direct", "triton"):
        raise ValueError(f"COMMLAB_FUSED_LAUNCH: must be direct or triton, got {way!r}")
    return way == "triton"


def _launch(kernel, grid: tuple, *args, **consts) -> None:
    """``kernel[grid](*args, **consts)``, cheaper on the host after the first call with the same specialization.

    Triton's own launch (``JITFunction.run``) binds and specializes every argument in Python on every call, where
    these kernels run for 1-40 µs on a small bucket. The direct launch keeps the kernel Triton compiled for a
    specialization (``_spec``) and calls it as ``JITFunction.run`` does, without the binding: on an H100, one
    launch of a 1K kernel took 10.7 µs of host time against Triton's 15.9, and the six fused codecs' compress +
    decompress 1.04-1.29x less time (bench/results/fused_launch.md; tests/test_fused_launch.py and
    tests/test_fused.py pass through it there). ``COMMLAB_FUSED_LAUNCH=triton`` keeps Triton's own launch, as do
    Triton's interpreter, a Triton older than 3.6 and a set launch hook (a profiler)."""
    if _triton_launch() or not K.DIRECT or K.INTERPRET or K.hooked():
        kernel[grid](*args, **consts)
        return
    key = (kernel, torch.cuda.current_device(), _spec(args), tuple(consts.items()))
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **consts)  # Triton compiles (or finds) the kernel and launches it
        if compiled is not None:
            _compiled[key] = compiled
        return
    names = _constexprs.get(kernel)
    if names is None:
        names = _constexprs[kernel] = kernel.arg_names[len(args):]
    g = grid + (1,) * (3 - len(grid))
    compiled.run(g[0], g[1], g[2], K.stream(), compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *(consts[a] for a in names))


# --------------------------------------------------------------------------- what the codecs call

def _nbytes(n: int, per: int = 8) -> int:
    return -(-n // per)


def pack_signs(x: Tensor) -> Tensor:
    """``bitpack.pack_bits(x >= 0)`` for a flat float32 ``x``: ceil(n/8) bytes."""
    n = x.numel()
    out = torch.empty(_nbytes(n), dtype=torch.uint8, device=x.device)
    if n:
        _launch(K.sign_pack, _grid(n), x, out, n, out.numel(), BLOCK=BLOCK)
    return out


def momentum_signs(x: Tensor, m: Tensor, beta: float) -> Tensor:
    """m = beta * m + (1 - beta) * x in place; the sign bits of the new m."""
    n = x.numel()
    out = torch.empty(_nbytes(n), dtype=torch.uint8, device=x.device)
    if n:
        _launch(K.momentum_sign_pack, _grid(n), x, m, out, n, out.numel(), float(beta), BLOCK=BLOCK)
    return out


def ef_signs(x: Tensor, e: Tensor) -> List[Tensor]:
    """EF-signSGD's step: e += x; the payload [||e||_1 / n (1,), sign bits of e]; then e -= the decoded payload."""
    n = x.numel()
    grid = _grid(n)
    part = torch.empty(grid[0], dtype=torch.float32, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    out = torch.empty(_nbytes(n), dtype=torch.uint8, device=x.device)
    if not n:
        return [scale.zero_(), out]
    _launch(K.ef_accumulate, grid, x, e, part, n, BLOCK=BLOCK)
    _launch(K.ef_pack, grid, e, part.sum(0, keepdim=True), scale, out, n, out.numel(), BLOCK=BLOCK)
    return [scale, out]


def onebit(x: Tensor) -> List[Tensor]:
    """1-bit SGD's payload: [(mean of x < 0, mean of x >= 0) (2,), bits of x >= 0]."""
    n = x.numel()
    grid = _grid(n)
    part = torch.empty(3 * grid[0], dtype=torch.float32, device=x.device)
    means = torch.zeros(2, dtype=torch.float32, device=x.device)
    out = torch.empty(_nbytes(n), dtype=torch.uint8, device=x.device)
    if n:
        _launch(K.onebit_pack, grid, x, out, part, grid[0], n, out.numel(), BLOCK=BLOCK)
        _launch(K.onebit_means, (1,), part.view(3, -1).sum(1), means, float(n))
    return [means, out]


def _rows(pieces: Sequence[Tensor]) -> Tensor:
    """The ranks' payload pieces as one (world, k) tensor: a view for one rank, a copy for more."""
    if len(pieces) == 1:
        return pieces[0].reshape(1, -1)
    return torch.stack([p.reshape(-1) for p in pieces])


def _out(n: int, dtype: torch.dtype, device) -> Tensor:
    return torch.empty(n, dtype=dtype, device=device)


VOTE, LOHI, PM = 0, 1, 2
"""decode_bits's modes: the majority vote; a (lo, hi) pair per rank; +-scale per rank."""


def decode_bits(packs: Sequence[Tensor], n: int, mode: int, table: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """Decode one rank's bit payload, or average several ranks' (the vote: their majority), into a fresh flat
    tensor of ``dtype``. ``table`` holds each rank's values: (lo, hi) for LOHI, (scale,) for PM, none for VOTE."""
    p = _rows(packs)
    out = _out(n, dtype, p.device)
    tab = p if mode == VOTE else _rows(table)
    if n:
        _launch(K.decode_bits, _grid(n), p, p.stride(0), tab, out, n, WORLD=p.shape[0], MODE=mode, BLOCK=BLOCK)
    return out


PARTS = 1024
"""The most programs of ``reduce_parts`` (the norm's or the extremes' pass): each coding program reads them all.
With 8 warps each, on an H200: 25.9 µs for 25M elements (3.9 TB/s), 92.5 µs for 100M, against 29.2 and 105 µs
with 512 programs of 4 warps and torch's 2-norm's 35.5 and 106 µs (.gpu probe, medians of 5 x 20 calls)."""
REDUCE_WARPS = 8
SUMSQ, ABSMAX = 0, 1
"""reduce_parts's modes: the sum of squares (QSGD's norm); the largest magnitude (TernGrad's scale)."""


def _parts(x: Tensor, mode: int, rng: Tensor) -> Tensor:
    """``reduce_parts`` over the flat ``x``: its partials (one per program); the call counted in ``rng[1]``."""
    blocks = _grid(x.numel())[0]
    if K.INTERPRET and blocks > PARTS:  # one block per program there: more would not fit the coding kernels
        raise ValueError(f"Triton's interpreter: at most {PARTS * BLOCK} elements per bucket, got {x.numel()}")
    part = torch.empty(min(blocks, PARTS), dtype=torch.float32, device=x.device)
    _launch(K.reduce_parts, (part.numel(),), x, part, rng, x.numel(), MODE=mode, LOOP=not K.INTERPRET,
            BLOCK=BLOCK, num_warps=REDUCE_WARPS)
    return part


def qsgd_codes(x: Tensor, rng: Tensor, levels: int, min_norm: float, code_dtype) -> List[Tensor]:
    """QSGD's payload from ``x``: [its 2-norm as sent (1,), codes (n,)]. ``rng``, [base seed, calls so far]
    (int64 on x's device), keys this call's noise and counts it, on the GPU (a CUDA graph replays the same
    launches and still draws new noise)."""
    n = x.numel()
    part = _parts(x, SUMSQ, rng)
    sent = torch.empty(1, dtype=torch.float32, device=x.device)
    codes = torch.empty(n, dtype=code_dtype, device=x.device)
    _launch(K.qsgd_encode, _grid(n), x, part, part.numel(), rng, sent, codes, n, float(levels), float(min_norm),
            PARTS=PARTS, BLOCK=BLOCK)
    return [sent, codes]


def qsgd_decode_all(norms: Sequence[Tensor], codes: Sequence[Tensor], n: int, levels: int, dtype) -> Tensor:
    """One rank's QSGD payload decoded, or the mean of several ranks' (their norms float32, (1,) each)."""
    return _decode_rows(K.qsgd_decode, codes, norms, n, dtype, float(levels))


def _decode_rows(kernel, codes: Sequence[Tensor], scalars: Sequence[Tensor], n: int, dtype, *extra) -> Tensor:
    """``kernel`` over the ranks' codes as one (world, k) tensor and their per-rank scalars, into a fresh flat
    tensor of ``dtype``: the decoding kernels that take (codes, row stride, scalars, out, n, *extra)."""
    c = _rows(codes)
    s = _rows(scalars)
    out = _out(n, dtype, c.device)
    if n:
        _launch(kernel, _grid(n), c, c.stride(0), s, out, n, *extra, WORLD=c.shape[0], BLOCK=BLOCK)
    return out


def tern_codes(x: Tensor, rng: Tensor, tiny: float) -> List[Tensor]:
    """TernGrad's payload from ``x``: [max|x| (1,), 2-bit codes packed 4 per byte]; the noise as ``qsgd_codes``'s."""
    n = x.numel()
    part = _parts(x, ABSMAX, rng)
    s = torch.empty(1, dtype=torch.float32, device=x.device)
    out = torch.empty(_nbytes(n, 4), dtype=torch.uint8, device=x.device)
    _launch(K.tern_encode, _grid(n), x, part, part.numel(), rng, s, out, n, out.numel(), float(tiny),
            PARTS=PARTS, BLOCK=BLOCK)
    return [s, out]


def tern_decode_all(scales: Sequence[Tensor], packs: Sequence[Tensor], n: int, dtype) -> Tensor:
    """One rank's TernGrad payload decoded, or the mean of several ranks'."""
    return _decode_rows(K.tern_decode, packs, scales, n, dtype)


def natural_codes(x: Tensor, rng: Tensor) -> List[Tensor]:
    """Natural compression's payload from a float32 ``x``: [offset int32 (1,), codes uint8 (n,)], the eager
    codec's layout and rules, the offset found on the GPU (no host round trip); the noise as ``qsgd_codes``'s."""
    n = x.numel()
    part = _parts(x, ABSMAX, rng)
    off = torch.empty(1, dtype=torch.int32, device=x.device)
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    _launch(K.natural_encode, _grid(n), x, part, part.numel(), rng, off, codes, n, PARTS=PARTS, BLOCK=BLOCK)
    return [off, codes]


def natural_decode_all(offsets: Sequence[Tensor], codes: Sequence[Tensor], n: int, dtype) -> Tensor:
    """One rank's natural-compression payload decoded, or the mean of several ranks'."""
    return _decode_rows(K.natural_decode, codes, offsets, n, dtype)
