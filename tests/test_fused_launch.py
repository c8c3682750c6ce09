"""How the fused kernels are launched (commlab/engine/compressors/fused.py ``_launch``): after Triton's first launch of a
kernel for a specialization, commlab launches the compiled kernel itself, skipping Triton's per-call binding (the
default; ``COMMLAB_FUSED_LAUNCH=triton`` keeps Triton's launch).

That is only right if commlab's key tells apart every pair of argument lists Triton compiles apart. The key is
checked here on the CPU; on a GPU with Triton, that it picks the very kernel Triton's own dispatch picks (aligned
and misaligned tensors, ints of every class) and that the codecs give the same bits either way.
"""
import copy

import pytest
import torch

from commlab.engine import compressors
from commlab.engine.compressors import contract, fused
from commlab.engine.compressors.capabilities import BucketContext


def test_the_key_separates_what_triton_specializes_on():
    """Triton specializes on a tensor's dtype and 16-byte alignment, an int's type by range, whether it is 1 and
    whether 16 divides it: each of those changes the key, and values that share them share it."""
    base = torch.zeros(64)
    same = [(base, 32, 0.5), (torch.ones(64), 48, 2.0)]
    assert fused._spec(same[0]) == fused._spec(same[1])
    changed = [(base[1:], 32, 0.5),                      # misaligned by 4 bytes
               (base.to(torch.float64), 32, 0.5),        # dtype
               (base, 33, 0.5), (base, 1, 0.5),          # not divisible by 16; the value 1
               (base, 2 ** 31, 0.5), (base, 2 ** 63, 0.5), (base, -2 ** 31 - 17, 0.5)]  # i64, u64, an odd negative i64
    keys = {fused._spec(a) for a in changed}
    assert len(keys) == len(changed) and fused._spec(same[0]) not in keys


def test_the_launch_setting_is_direct_or_triton(monkeypatch):
    monkeypatch.delenv("COMMLAB_FUSED_LAUNCH", raising=False)
    assert not fused._triton_launch()
    monkeypatch.setenv("COMMLAB_FUSED_LAUNCH", "triton")
    assert fused._triton_launch()
    monkeypatch.setenv("COMMLAB_FUSED_LAUNCH", "Direct")
    with pytest.raises(ValueError, match="^COMMLAB_FUSED_LAUNCH: must be direct or triton, got 'Direct'$"):
        fused._triton_launch()


def test_an_empty_hook_chain_is_no_hook():
    """Triton 3.6 keeps its launch hooks as a chain that is empty, not None, when nothing is set: the first GPU try
    read it as set, so the direct path was never taken. A hook counts only when something is in it."""
    triton = pytest.importorskip("triton")
    if not hasattr(triton, "knobs"):
        pytest.skip("a Triton without knobs keeps its own launch")
    from commlab.engine.compressors import fused_kernels as k
    chain = triton.knobs.HookChain()
    assert not k._set(None) and not k._set(chain)
    chain.add(print)
    assert k._set(chain) and k._set(print)


CUDA = torch.cuda.is_available() and fused.on(torch.device("cuda"), torch.float32) and fused.K.DIRECT
gpu = pytest.mark.skipif(not CUDA, reason="the direct launch runs on a CUDA GPU with Triton 3.6 or later")


@gpu
def test_the_cached_kernel_is_the_one_triton_dispatches_to(monkeypatch):
    monkeypatch.setenv("COMMLAB_FUSED_LAUNCH", "direct")
    assert not fused.K.hooked(), "no launch hook is set here: the direct path must be taken"
    fused._compiled.clear()
    cases = []
    for n in (1, 16, 1000, 4097):
        for offset in (0, 1, 4):  # 4 floats = 16 bytes: aligned again
            x = torch.randn(n + offset, device="cuda")[offset:]
            out = torch.empty(-(-n // 8) + offset, dtype=torch.uint8, device="cuda")[offset:]
            cases.append((x, out, n, out.numel()))
    for args in cases:
        grid = fused._grid(args[2])
        fused._launch(fused.K.sign_pack, grid, *args, BLOCK=fused.BLOCK)  # first: Triton's own, kept
        key = (fused.K.sign_pack, torch.cuda.current_device(), fused._spec(args), (("BLOCK", fused.BLOCK),))
        assert fused._compiled[key] is fused.K.sign_pack[grid](*args, BLOCK=fused.BLOCK)
        fused._launch(fused.K.sign_pack, grid, *args, BLOCK=fused.BLOCK)  # then the direct one: it runs
    for nparts in (1, 16, 17):  # ints of each class a kernel is specialized on (1, divisible by 16, other)
        x = torch.randn(1000, device="cuda")
        args = (x, torch.ones(fused.PARTS, device="cuda"), nparts, torch.zeros(2, dtype=torch.int64, device="cuda"),
                torch.empty(1, device="cuda"), torch.empty(1000, dtype=torch.int8, device="cuda"), 1000, 127.0, 1e-30)
        consts = {"PARTS": fused.PARTS, "BLOCK": fused.BLOCK}
        fused._launch(fused.K.qsgd_encode, fused._grid(1000), *args, **consts)
        key = (fused.K.qsgd_encode, torch.cuda.current_device(), fused._spec(args), tuple(consts.items()))
        assert fused._compiled[key] is fused.K.qsgd_encode[fused._grid(1000)](*args, **consts)


@gpu
@pytest.mark.parametrize("name", ["signsgd", "signum", "efsignsgd", "onebit", "qsgd", "terngrad", "natural"])
def test_the_direct_launch_gives_what_tritons_launch_gives(name, monkeypatch):
    """Two instances with the same state, one launched Triton's way, one commlab's, on misaligned and aligned
    inputs of odd sizes, three calls each (the first of a specialization is Triton's in both): the same payload
    bits and the same decoding, the random codecs included (their noise is seeded from the state)."""
    fused._compiled.clear()
    for n, offset in ((7, 1), (4097, 0), (70001, 3)):
        mine = compressors.make(name)  # a fresh pair per size: momentum and residual are per bucket
        bucket = BucketContext(2, 0)
        theirs = copy.deepcopy(mine)
        for step in range(3):
            x = torch.randn(n + offset, device="cuda")[offset:]
            monkeypatch.setenv("COMMLAB_FUSED_LAUNCH", "direct")
            p_mine, ctx = contract.compress(mine, x, bucket)
            out_mine = mine.decompress(p_mine, ctx)
            monkeypatch.setenv("COMMLAB_FUSED_LAUNCH", "triton")
            p_theirs, ctx_t = contract.compress(theirs, x, bucket)
            out_theirs = theirs.decompress(p_theirs, ctx_t)
            for a, b in zip(p_mine, p_theirs):
                assert torch.equal(a, b), f"{name}: payloads differ (n={n}, step {step})"
            assert torch.equal(out_mine, out_theirs), f"{name}: decodings differ (n={n}, step {step})"
    assert fused._compiled, "nothing was launched directly"
