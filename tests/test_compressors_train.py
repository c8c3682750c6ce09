"""Every compressor, through the engine at world size 2, trains cnn on digits (the loss falls)."""
import functools

import torch

from distutil import run_world
from commlab.engine import compressors, data, models, schedules
from commlab.engine.comm.wfbp import WFBP

STEPS = 40
NO_SGD_MOMENTUM = {"dgc", "signum"}  # they apply momentum themselves
# Sparsifiers keep 1% by default, which over 40 steps without error feedback
# barely moves a model; these keep enough to show learning within the budget.
# Majority-vote sign methods decode to +-1 per element, so the learning rate alone sets the step.
LR = {"signsgd": 0.002, "signum": 0.002}
PARAMS = {"topk": {"ratio": 0.1}, "topk_2bit": {"chunk": 64, "k": 7}, "randomk": {"ratio": 0.3},
          "threshold": {"threshold": 0.001},
          "countsketch": {"ratio": 0.03}}


def _train_all(rank, world, cases):
    ds = data.load("digits", seed=0)
    out = {}
    for name, ef in cases:
        torch.manual_seed(0)
        model = models.build("cnn", ds.info)
        dp = WFBP(model, functools.partial(schedules.build, "layerwise"),
                  lambda: compressors.make(name, error_feedback=ef, **PARAMS.get(name, {})))
        opt = torch.optim.SGD(model.parameters(), lr=LR.get(name, 0.05), momentum=0.0 if name in NO_SGD_MOMENTUM else 0.9)
        sampler = data.ShardSampler(ds.size("train"), 32, rank, world, seed=0)
        losses, sent, raw = [], 0, 0
        for _ in range(STEPS):
            x, y = ds.batch("train", next(sampler))
            loss = models.loss_fn(model(x), y)
            loss.backward()
            dp.finish()
            opt.step()
            dp.zero_grad()
            losses.append(loss.item())
            sent += dp.step_bytes
            raw += dp.step_raw_bytes
        same = [p.detach().clone() for p in model.parameters()]
        dp.close()
        out[(name, ef)] = (losses, sent, raw, same)
    return out


def test_every_compressor_reduces_the_loss():
    cases = [(n, False) for n in compressors.names()]
    cases += [(n, True) for n in ("topk", "signsgd", "qsgd") if n in compressors.names()]
    res = run_world(_train_all, cases)
    failures = []
    for case in cases:
        losses, sent, raw, params = res[0][case]
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        if not last < 0.7 * first:
            failures.append(f"{case}: loss {first:.3f} -> {last:.3f}")
        # every rank applied the same averaged update: parameters agree across ranks
        for a, b in zip(params, res[1][case][3]):
            torch.testing.assert_close(a, b, msg=lambda m: f"{case}: ranks diverged: {m}")
        if case[0] != "none":
            assert 0 < sent < 0.9 * raw, f"{case}: sent {sent} bytes of {raw}"
    assert not failures, failures
