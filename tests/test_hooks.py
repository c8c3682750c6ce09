"""Compressors as torch DDP communication hooks."""
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distutil import run_world
from commlab.engine import data, models
from commlab.engine.compressors import names
from commlab.engine.comm.hooks import ddp_hook


def _train(rank, world, cases, steps):
    torch.manual_seed(0)
    ds = data.load("digits", seed=0)
    base = models.build("cnn", ds.info)
    out = {}
    for key, name, params in cases:
        m = DDP(copy.deepcopy(base))
        state = None
        if name is not None:
            state, hook = ddp_hook(name, **params)
            m.register_comm_hook(state, hook)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        sampler = data.ShardSampler(ds.size("train"), 16, rank, world, seed=0)
        losses = []
        for _ in range(steps):
            x, y = ds.batch("train", next(sampler))
            opt.zero_grad()
            loss = models.loss_fn(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[key] = ([p.detach().clone() for p in m.parameters()], losses, state.bytes_sent if state else None)
    return out


def test_none_hook_matches_plain_ddp():
    res = run_world(_train, [("plain", None, {}), ("hook", "none", {})], 10)
    for r in res:
        for a, b in zip(r["plain"][0], r["hook"][0]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        assert r["hook"][2] > 0


@pytest.mark.skipif("topk" not in names(), reason="topk not registered")
def test_topk_hook_trains_and_sends_less():
    res = run_world(_train, [("none", "none", {}), ("topk", "topk", {"ratio": 0.05, "error_feedback": True})], 60)
    for r in res:
        losses = r["topk"][1]
        assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
        assert r["topk"][2] < 0.2 * r["none"][2]


def test_multi_round_compressors_are_refused():
    if "powersgd" not in names():
        pytest.skip("powersgd not registered")
    with pytest.raises(ValueError, match="several rounds"):
        ddp_hook("powersgd", rank=1)


def test_rounds_are_read_from_the_instance():
    """Count Sketch takes one round by default and two with exact=True: the parameter decides, so the
    hook must be refused when it is made, not fail later inside DDP's communication future."""
    with pytest.raises(ValueError) as e:
        ddp_hook("countsketch", exact=True)
    assert str(e.value).startswith("name: countsketch (exact=True) takes several rounds (2)")
    assert "\n" not in str(e.value)
    state, _ = ddp_hook("countsketch", exact=False)
    assert state.name == "countsketch"


def test_bad_parameters_fail_at_creation():
    with pytest.raises(ValueError, match="bogus"):
        ddp_hook("none", bogus=3)
