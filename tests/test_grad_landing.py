"""Where gradients land: the copy-in and re-pointing after zero_grad(set_to_none=True), the
"produced twice" error, and the divergence check (commlab/engine/comm/core.py land_grad, Sync, WFBP and DeAR
grads_finite), against hand-computed averages."""
import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distutil import run_world
from commlab.engine import schedules
from commlab.engine.comm.core import land_grad


def fake_bucket(n=2):
    return SimpleNamespace(seen=[False] * n, pending=n, names=[f"w{i}" for i in range(n)])


def test_land_grad_counts_a_gradient_already_in_place():
    p = torch.nn.Parameter(torch.zeros(3))
    view = torch.zeros(6)[:3]
    p.grad = view
    view.fill_(2.0)
    b = fake_bucket()
    assert land_grad(p, view, b, 0) is False
    assert b.seen == [True, False] and b.pending == 1 and p.grad is view


def test_land_grad_copies_a_replaced_gradient_in():
    flat = torch.zeros(6)
    view = flat[3:]
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0])  # what autograd makes after zero_grad(set_to_none=True)
    b = fake_bucket()
    assert land_grad(p, view, b, 1) is True  # the caller re-points p.grad
    assert flat.tolist() == [0, 0, 0, 1, 2, 3] and b.pending == 1 and b.seen == [False, True]


def test_land_grad_refuses_a_second_gradient_in_one_step():
    view = torch.zeros(2)
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = view
    b = fake_bucket()
    land_grad(p, view, b, 0)
    with pytest.raises(RuntimeError, match="gradient of w0 was produced twice in one step; call finish"):
        land_grad(p, view, b, 0)
    assert b.pending == 1  # not counted twice


# --------------------------------------------------------------------------- in a process group

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 5, generator=g)


def _reference_grads(x):
    """A plain backward on a copy of the model and a hand-written average over ranks."""
    m = _model()
    m(x).square().sum().backward()
    out = []
    for p in m.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out.append(g / dist.get_world_size())
    return out


def _set_to_none(rank, world, mode):
    from commlab.engine.comm.modes import MODES
    from commlab.engine.compressors import make
    model = _model()
    handed = {}  # param -> autograd's gradient was not the bucket view (seen before the communicator's hook runs)

    def is_view(p):
        b, pos = dp.slot[p]
        return p.grad.data_ptr() == b.views[pos].data_ptr()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: handed.__setitem__(p, not is_view(p)))
    dp = MODES[mode](model, functools.partial(schedules.build, "layerwise"), lambda: make("none"))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step sees the same model as the reference
    out = []
    for step in range(3):
        x = _batch(rank, step)
        handed.clear()
        model(x).square().sum().backward()
        replaced = [handed[p] for p in model.parameters()]
        # re-pointed as each gradient landed, during backward, not only in finish; from the second step a
        # bulk bucket's (sync: every one; wfbp: the last) land in finish, all at once
        bound_in_backward = all(is_view(p) for p in model.parameters() if not dp.slot[p][0].bulk)
        dp.finish()
        got = [p.grad.clone() for p in model.parameters()]
        bound = bound_in_backward and all(is_view(p) for p in model.parameters())
        out.append((got, _reference_grads(x), replaced, bound))
        opt.step()
        opt.zero_grad(set_to_none=True)  # torch's default: p.grad becomes None
        assert all(p.grad is None for p in model.parameters())
    dp.close()
    return out


@pytest.mark.parametrize("mode", ["sync", "wfbp"])
def test_set_to_none_copies_in_and_points_grad_at_the_bucket_again(mode):
    """Three steps: hook landing everywhere in the first, bulk landing of some buckets in the others."""
    for rank_out in run_world(_set_to_none, mode):
        for step, (got, ref, replaced, bound) in enumerate(rank_out):
            # the first step starts bound by the constructor; after set_to_none autograd made new tensors
            assert all(replaced) == (step > 0) and any(replaced) == (step > 0), (step, replaced)
            assert bound, f"step {step}: p.grad was not pointed at the bucket again"
            for g, r in zip(got, ref):
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def _twice(rank, world, kind):
    from commlab.engine.comm.dear import DeAR
    from commlab.engine.comm.wfbp import Sync
    from commlab.engine.compressors import make
    from commlab.engine.schedules import layout_cap
    model = _model()
    if kind == "dear":
        dp = DeAR(model, lambda ps: layout_cap(ps, 25.0), lambda: make("none"))  # noqa: F841 - kept alive for its hooks
    else:
        dp = Sync(model, functools.partial(schedules.build, "allinone"), lambda: make("none"))  # noqa: F841 - kept alive for its hooks
    x = _batch(rank, 0)
    model(x).sum().backward()
    try:
        model(x).sum().backward()  # a second backward without finish() in between
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["sync", "dear"])
def test_a_second_backward_before_finish_is_an_error(kind):
    for msg in run_world(_twice, kind):
        assert msg is not None and "was produced twice in one step" in msg


def _finite(rank, world, kind):
    from commlab.engine.comm.modes import MODES
    from commlab.engine.compressors import make
    from commlab.engine.schedules import layout_cap
    model = _model()
    if kind == "dear":
        dp = MODES["dear"](model, lambda ps: layout_cap(ps, 25.0), lambda: make("none"))
        opt = torch.optim.SGD(dp.shard_params(), lr=0.0)
        dp.attach(opt)
    else:
        dp = MODES[kind](model, functools.partial(schedules.build, "layerwise"), lambda: make("none"))
    out = []
    # per step: what rank 1 multiplies its loss by (rank 0 always 1): finite, NaN, inf, finite again
    for step, scale in enumerate((1.0, float("nan"), float("inf"), 1.0)):
        loss = model(_batch(rank, step)).square().sum()
        (loss * (scale if rank == 1 else 1.0)).backward()
        dp.finish()
        out.append(bool(dp.grads_finite()))
        dp.zero_grad()
    return out


@pytest.mark.parametrize("kind", ["sync", "wfbp", "dear"])
def test_grads_finite_is_false_on_every_rank_when_one_rank_is_not_finite(kind):
    assert run_world(_finite, kind) == [[True, False, False, True]] * 2
