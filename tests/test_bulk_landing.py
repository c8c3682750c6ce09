"""Bulk landing (commlab/engine/comm/core.py): from the second step, a bucket that cannot launch before backward
ends (wfbp and dear: the last one; sync: every one) has no per-parameter hook and lands its
gradients in finish, all at once. Its gradients must equal the hook-landed ones, a gradient that
never arrives still counts as zero, a second backward is still refused, a relayout moves the bulk
landing to the new last bucket, and earlier buckets still launch during backward."""
import functools

import pytest
import torch
import torch.distributed as dist

from distutil import run_world
from commlab.engine import schedules


class _Branchy(torch.nn.Module):
    """``c`` (registered first, so its gradients arrive last and fill the last bucket) is used on
    even steps only: on odd steps its gradients never arrive."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c = torch.nn.Linear(4, 3)
        self.a = torch.nn.Linear(5, 4)
        self.b = torch.nn.Linear(4, 3)

    def forward(self, x, use_c):
        h = torch.tanh(self.a(x))
        out = self.b(h)
        return out + self.c(h) if use_c else out


def _batch(rank, step):
    return torch.randn(8, 5, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference(x, use_c):
    m = _Branchy()
    m(x, use_c).square().sum().backward()
    out = []
    for p in m.parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        out.append(g / dist.get_world_size())
    return out


def _hooks(model):
    return [len(p._post_accumulate_grad_hooks) for p in model.parameters()]


def _make(kind, model):
    from commlab.engine.comm.modes import MODES
    from commlab.engine.compressors import make
    from commlab.engine.schedules import layout_cap
    if kind == "dear":
        return MODES["dear"](model, lambda ps: layout_cap(ps, 25.0), lambda: make("none"))
    sched, mode = kind.split("/")
    return MODES[mode](model, functools.partial(schedules.build, sched), lambda: make("none"))


def _compare(rank, world, kind, zero):
    """Two copies: one as it comes (bulk landing from the second step), one with ``record_ready`` on,
    which keeps every parameter's landing hook. Both must land identical gradients."""
    models = [_Branchy(), _Branchy()]
    dps = [_make(kind, m) for m in models]
    dps[1].record_ready = True
    out = []
    for step in range(4):
        x = _batch(rank, step)
        grads, states = [], []
        for m, dp in zip(models, dps):
            m(x, step % 2 == 0).square().sum().backward()
            states.append(([b.bulk for b in dp.buckets], _hooks(m)))  # how this step's gradients landed
            dp.finish()
            grads.append([b.shard_param.grad.clone() for b in dp.buckets] if kind == "dear" else
                         [p.grad.clone() for p in m.parameters()])
            if zero == "inplace" and kind != "dear":
                for p in m.parameters():
                    p.grad.zero_()  # zero_grad(set_to_none=False): autograd adds into the buckets
            else:
                dp.zero_grad()
        out.append((grads, states, _reference(x, step % 2 == 0)))
    for dp in dps:
        dp.close()
    return out


@pytest.mark.parametrize("kind,zero", [("allinone/wfbp", "none"), ("layerwise/wfbp", "none"),
                                       ("layerwise/sync", "none"), ("allinone/wfbp", "inplace"),
                                       ("dear", "none")])
def test_bulk_landed_gradients_equal_hook_landed_ones(kind, zero):
    for rank_out in run_world(_compare, kind, zero):
        for step, (grads, states, ref) in enumerate(rank_out):
            bulk, hooked = grads
            for a, b in zip(bulk, hooked):
                assert torch.equal(a, b), (kind, zero, step)
            if kind != "dear":  # the averages themselves, the unused layer's zero included
                for g, r in zip(bulk, ref):
                    torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
            (flags, hooks), (flags_rr, hooks_rr) = states
            assert not any(flags_rr) and hooks_rr == [1] * 6  # record_ready: every parameter hooked
            n = len(flags)
            want = [False] * n if step == 0 else ([True] * n if kind.endswith("sync") else [False] * (n - 1) + [True])
            assert flags == want, (kind, step, flags)
            if step > 0 and kind != "layerwise/wfbp":
                # every bucket in bulk: a hook on one parameter only (the second-backward check)
                assert sorted(hooks) == [0] * 5 + [1], hooks


def _twice(rank, world, kind):
    model = _Branchy()
    dp = _make(kind, model)
    x = _batch(rank, 0)
    model(x, True).sum().backward()
    dp.finish()
    dp.zero_grad()
    assert any(b.bulk for b in dp.buckets)
    model(x, True).sum().backward()
    try:
        model(x, True).sum().backward()  # a second backward without finish() in between, in a bulk step
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["allinone/sync", "allinone/wfbp", "dear"])
def test_a_second_backward_in_a_bulk_step_is_still_an_error(kind):
    for msg in run_world(_twice, kind):
        assert msg is not None and "was produced twice in one step" in msg


def _relayout(rank, world):
    model = _Branchy()
    dp = _make("layerwise/wfbp", model)
    names = [n for n, _ in model.named_parameters()]
    out = []
    layouts = [None, [[0, 1, 2], [3, 4, 5]], [[0], [1, 2, 3, 4, 5]], [[0, 1, 2, 3, 4, 5]], [[i] for i in range(6)]]
    for step, layout in enumerate(layouts):
        if layout is not None:
            dp.relayout(layout)
        x = _batch(rank, step)
        model(x, True).square().sum().backward()
        launched = dp._next  # buckets launched during backward (in order)
        bulk = {n: dp.slot[p][0].bulk for n, p in model.named_parameters()}
        hooks = _hooks(model)
        dp.finish()
        grads = [p.grad.clone() for p in model.parameters()]
        out.append((launched, len(dp.buckets), bulk, hooks, grads, _reference(x, True), names))
        dp.zero_grad()
    dp.close()
    return out


def test_relayout_moves_bulk_landing_to_the_new_last_bucket_and_earlier_buckets_launch_in_backward():
    for rank_out in run_world(_relayout):
        for step, (launched, nb, bulk, hooks, grads, ref, names) in enumerate(rank_out):
            for g, r in zip(grads, ref):
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
            if step == 0:  # the first step: every gradient by its hook, every bucket launched in backward
                assert launched == nb == 6 and not any(bulk.values())
                continue
            # from the second step the last bucket launches in finish, every earlier one during backward
            assert launched == nb - 1, (step, launched, nb)
            # positions index the gradient order: b.bias, b.weight, a.bias, a.weight, c.bias, c.weight
            last = {1: ["a.weight", "c.bias", "c.weight"], 2: ["b.weight", "a.bias", "a.weight", "c.bias", "c.weight"],
                    3: names, 4: ["c.weight"]}[step]
            assert sorted(n for n, v in bulk.items() if v) == sorted(last), (step, bulk)
            # hooked parameters have their landing hook; bulk ones none, but for one (the second-backward check)
            assert sum(hooks) == sum(not v for v in bulk.values()) + 1, (step, hooks)
