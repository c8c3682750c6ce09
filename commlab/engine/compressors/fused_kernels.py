"""The Triton kernels behind commlab/engine/compressors/fused.py (imported only there, and only once a float32 CUDA
tensor asks for them: importing Triton costs every process that never needs it)."""
import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Under Triton's interpreter (the CPU tests): kernels are Python functions, launched only Triton's way."""
VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
DIRECT = VERSION >= (3, 6)
"""Whether fused._launch may launch a compiled kernel itself: the calling convention it uses (``CompiledKernel.run``
with every argument, constexprs included, as ``JITFunction.run`` calls it) is the one of Triton 3.6, read there;
older versions keep Triton's own launch."""


def _set(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))  # Triton 3.6: a HookChain, empty when unset


def hooked() -> bool:
    """Whether a launch hook is set (a profiler such as Proton): then every launch goes through Triton's path."""
    knobs = getattr(triton, "knobs", None)
    return knobs is None or _set(knobs.runtime.launch_enter_hook) or _set(knobs.runtime.launch_exit_hook)


_driver = None


def stream() -> int:
    """The current CUDA stream of the current device, as Triton launches on it."""
    global _driver
    if _driver is None:
        from triton.runtime import driver
        _driver = driver.active
    return _driver.get_current_stream(_driver.get_current_device())


@triton.jit
def _pack(bits, pid, out_ptr, nbytes, BLOCK: tl.constexpr):
    # (BLOCK,) 0/1 int32 -> BLOCK // 8 bytes, element 0 in the top bit
    b2 = tl.reshape(bits, (BLOCK // 8, 8))
    w = 1 << (7 - tl.arange(0, 8))
    byte = tl.sum(b2 * w[None, :], axis=1)
    bo = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(out_ptr + bo, byte.to(tl.uint8), mask=bo < nbytes)


@triton.jit
def sign_pack(x_ptr, out_ptr, n, nbytes, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=-1.0)  # padding bits are 0
    _pack((x >= 0).to(tl.int32), pid, out_ptr, nbytes, BLOCK)


@triton.jit
def momentum_sign_pack(x_ptr, m_ptr, out_ptr, n, nbytes, beta, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    m = m * beta + x * (1.0 - beta)
    tl.store(m_ptr + offs, m, mask=mask)
    _pack(((m >= 0) & mask).to(tl.int32), pid, out_ptr, nbytes, BLOCK)


@triton.jit
def ef_accumulate(x_ptr, e_ptr, part_ptr, n, BLOCK: tl.constexpr):
    # e += x; part[pid] = sum |e| over the block
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(e_ptr + offs, mask=mask, other=0.0) + tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(e_ptr + offs, e, mask=mask)
    tl.store(part_ptr + pid, tl.sum(tl.abs(e), axis=0))


@triton.jit
def ef_pack(e_ptr, total_ptr, scale_ptr, out_ptr, n, nbytes, BLOCK: tl.constexpr):
    # scale = sum |e| / n; bits of e, then e -= +-scale (what this rank's payload decodes to)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(total_ptr) / n
    if pid == 0:
        tl.store(scale_ptr, s)
    e = tl.load(e_ptr + offs, mask=mask, other=-1.0)
    pos = e >= 0
    tl.store(e_ptr + offs, e - tl.where(pos, s, -s), mask=mask)
    _pack(pos.to(tl.int32), pid, out_ptr, nbytes, BLOCK)


@triton.jit
def onebit_pack(x_ptr, out_ptr, part_ptr, nparts, n, nbytes, BLOCK: tl.constexpr):
    # bits, and per block: count of x >= 0, sum of those, sum of the rest
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=-1.0)
    pos = (x >= 0) & mask
    tl.store(part_ptr + pid, tl.sum(pos.to(tl.float32), axis=0))
    tl.store(part_ptr + nparts + pid, tl.sum(tl.where(pos, x, 0.0), axis=0))
    tl.store(part_ptr + 2 * nparts + pid, tl.sum(tl.where(pos | ~mask, 0.0, x), axis=0))
    _pack(pos.to(tl.int32), pid, out_ptr, nbytes, BLOCK)


@triton.jit
def onebit_means(sums_ptr, means_ptr, n):
    # sums: (count of x >= 0, their sum, the others' sum) -> (mean of the others, mean of x >= 0); 0 for none
    npos = tl.load(sums_ptr)
    tl.store(means_ptr, tl.load(sums_ptr + 2) / tl.maximum(n - npos, 1.0))
    tl.store(means_ptr + 1, tl.load(sums_ptr + 1) / tl.maximum(npos, 1.0))


@triton.jit
def decode_bits(p_ptr, stride, tab_ptr, out_ptr, n, WORLD: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    # WORLD payloads of bits (a constant: one compiled variant per world size, its loop unrolled), rank r's at p_ptr + r * stride. MODE 0: the majority vote, the sign of the sum
    # of +-1 (0 on a tie); 1: a set bit is tab[2r + 1], a clear one tab[2r], averaged over ranks; 2: +-tab[r],
    # averaged over ranks
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = offs // 8
    shift = 7 - (offs % 8)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(WORLD):
        b = (tl.load(p_ptr + r * stride + byte, mask=mask, other=0).to(tl.int32) >> shift) & 1
        if MODE == 0:
            acc += b.to(tl.float32)
        elif MODE == 1:
            acc += tl.where(b != 0, tl.load(tab_ptr + 2 * r + 1), tl.load(tab_ptr + 2 * r))
        else:
            s = tl.load(tab_ptr + r)
            acc += tl.where(b != 0, s, -s)
    if MODE == 0:
        d = acc * 2.0 - WORLD
        out = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    else:
        out = acc / WORLD
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _words(seed, pid, BLOCK: tl.constexpr):
    # BLOCK random 32-bit words for block pid: four from each Philox draw, a quarter of tl.rand's draws, whose
    # rounds held the coding kernels to half the memory's pace (H100, 25M: qsgd_encode 81 µs for 125 MB)
    c = pid * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    a, b, d, e = tl.randint4x(seed, c)
    return tl.reshape(tl.join(tl.join(a, b), tl.join(d, e)), (BLOCK,))


@triton.jit
def _uniform(seed, pid, BLOCK: tl.constexpr):
    # BLOCK numbers in [0, 1) for block pid (what tl.rand4x makes of the same words)
    return tl.random.uint_to_uniform_float(_words(seed, pid, BLOCK))


@triton.jit
def reduce_parts(x_ptr, part_ptr, rng_ptr, n, MODE: tl.constexpr, LOOP: tl.constexpr, BLOCK: tl.constexpr):
    # program p: over blocks p, p + P, p + 2P, ... (P programs), the sum of x^2 (MODE 0) or the largest |x|
    # (MODE 1; NaN kept), into part[p]; program 0 also counts the call in rng[1] (which keys the coding
    # kernel's noise: it runs after this one, on the same stream). Without LOOP, one block per program
    # (Triton's interpreter, which cannot run a loop with bounds known only at run time)
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if LOOP:
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc = _fold(acc, tl.load(x_ptr + offs, mask=offs < n, other=0.0), MODE)
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        acc = _fold(acc, tl.load(x_ptr + offs, mask=offs < n, other=0.0), MODE)
    if MODE == 0:
        tl.store(part_ptr + pid, tl.sum(acc, axis=0))
    else:
        tl.store(part_ptr + pid, tl.reduce(acc, 0, _maxn))
    if pid == 0:
        tl.store(rng_ptr + 1, tl.load(rng_ptr + 1) + 1)


@triton.jit
def _maxn(a, b):
    # the larger, or NaN if either is: tl.maximum drops NaN on a GPU by default, and a NaN gradient must reach
    # the decoded bucket (the trainer's divergence check reads it), as in the eager codecs
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fold(acc, x, MODE: tl.constexpr):
    if MODE == 0:
        return acc + x * x
    return _maxn(acc, tl.abs(x))


@triton.jit
def _total(part_ptr, nparts, MODE: tl.constexpr, PARTS: tl.constexpr):
    # reduce_parts's partials, combined: every program of a coding kernel reads them all (PARTS floats at most,
    # from L2) and gets the same number
    i = tl.arange(0, PARTS)
    p = tl.load(part_ptr + i, mask=i < nparts, other=0.0)
    if MODE == 0:
        return tl.sum(p, axis=0)
    return tl.reduce(p, 0, _maxn)


@triton.jit
def _seed(rng_ptr):
    # this call's Philox key from [base seed, calls so far]: a new key per call and per rank
    return tl.load(rng_ptr) + tl.load(rng_ptr + 1) * 6364136223846793005


@triton.jit
def qsgd_encode(x_ptr, part_ptr, nparts, rng_ptr, sent_ptr, codes_ptr, n, levels, min_norm,
                PARTS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    norm = _maxn(tl.sqrt(_total(part_ptr, nparts, 0, PARTS)) * (1.0 + 1.0 / 1048576.0), min_norm)
    if pid == 0:
        tl.store(sent_ptr, norm)
    step = norm / levels
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    v = tl.floor(_uniform(_seed(rng_ptr), pid, BLOCK) + x / step)
    tl.store(codes_ptr + offs, v.to(codes_ptr.dtype.element_ty), mask=mask)


@triton.jit
def qsgd_decode(c_ptr, stride, norm_ptr, out_ptr, n, levels, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(WORLD):
        step = tl.load(norm_ptr + r) / levels
        acc += tl.load(c_ptr + r * stride + offs, mask=mask, other=0).to(tl.float32) * step
    tl.store(out_ptr + offs, (acc / WORLD).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def tern_encode(x_ptr, part_ptr, nparts, rng_ptr, s_ptr, out_ptr, n, nbytes, tiny,
                PARTS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = _maxn(_total(part_ptr, nparts, 1, PARTS), tiny)
    if pid == 0:
        tl.store(s_ptr, s)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    v = (_uniform(_seed(rng_ptr), pid, BLOCK) + 1.0) + x / s
    c = tl.where(mask, v.to(tl.int32), 1)  # v >= 0: truncation is floor; padding codes 1 (zero)
    c2 = tl.reshape(c, (BLOCK // 4, 4))
    w = 1 << (6 - 2 * tl.arange(0, 4))
    byte = tl.sum(c2 * w[None, :], axis=1)
    bo = pid * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    tl.store(out_ptr + bo, byte.to(tl.uint8), mask=bo < nbytes)


@triton.jit
def tern_decode(p_ptr, stride, s_ptr, out_ptr, n, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = offs // 4
    shift = 6 - 2 * (offs % 4)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(WORLD):
        c = (tl.load(p_ptr + r * stride + byte, mask=mask, other=0).to(tl.int32) >> shift) & 3
        acc += (tl.minimum(c, 2) - 1).to(tl.float32) * tl.load(s_ptr + r)
    tl.store(out_ptr + offs, (acc / WORLD).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def natural_encode(x_ptr, part_ptr, nparts, rng_ptr, off_ptr, codes_ptr, n, PARTS: tl.constexpr,
                   BLOCK: tl.constexpr):
    # Natural compression of float32: a random integer below the mantissa's unit added to x's bits carries into
    # the exponent field with the probability that rounds |x| up to the next power of two; the code is
    # sign << 7 | (field - offset), offset = max(field(max|x|) + 1 - 127, 0); with an offset, 0 < |x| < v1 =
    # 2^(offset + 1 - 127) codes 1 with probability |x| / v1, else 0 (the eager codec's rules)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    top = (_total(part_ptr, nparts, 1, PARTS).to(tl.int32, bitcast=True) >> 23) & 255
    offset = tl.maximum(top - 126, 0)
    if pid == 0:
        tl.store(off_ptr, offset)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    xi = x.to(tl.int32, bitcast=True)
    w = _words(_seed(rng_ptr), pid, BLOCK)
    r = (w & 8388607).to(tl.int32, bitcast=True) + xi
    field = (r >> 23) & 255
    mag = tl.maximum(field - offset, 0)
    a = xi & 2147483647  # |x| as bits
    small = (offset > 0) & (a > 0) & (a < ((offset + 1) << 23))
    v1 = ((offset + 1) << 23).to(tl.float32, bitcast=True)
    hit = tl.random.uint_to_uniform_float(w) < tl.abs(x) / v1
    mag = tl.where(small, hit.to(tl.int32), mag)
    code = mag | tl.where(r < 0, 128, 0)
    tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)


@triton.jit
def natural_decode(c_ptr, stride, off_ptr, out_ptr, n, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    # code k = sign << 7 | m: 0 for m = 0, else +-2^(offset + m - 127), averaged over ranks (each its offset)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(WORLD):
        c = tl.load(c_ptr + r * stride + offs, mask=mask, other=0).to(tl.int32)
        m = c & 127
        bits = ((m + tl.load(off_ptr + r)) << 23) | ((c >> 7) << 31)
        acc += tl.where(m > 0, bits.to(tl.float32, bitcast=True), 0.0)
    tl.store(out_ptr + offs, (acc / WORLD).to(out_ptr.dtype.element_ty), mask=mask)
