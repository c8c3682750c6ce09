"""With compressor `none`, every schedule x {sync, wfbp} must train exactly like torch DDP."""
import copy
import functools

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distutil import run_world
from commlab.engine import compressors, data, models, schedules
from commlab.engine.comm.modes import MODES
from commlab.engine.comm.wfbp import WFBP

STEPS = 20


def _train_pair(rank, world, model_name, dataset, batch, opt_name, layouts):
    """Train a DDP reference and one engine copy per layout on identical batches; return max differences."""
    torch.manual_seed(0)
    ds = data.load(dataset, seed=0)
    base = models.build(model_name, ds.info)

    def make_opt(params):
        if opt_name == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.Adam(params, lr=1e-3)

    ref = DDP(copy.deepcopy(base))
    ref_opt = make_opt(ref.parameters())
    ours = []
    for sched, opts, mode in layouts:
        m = copy.deepcopy(base)
        dp = MODES[mode](m, functools.partial(schedules.build, sched, **opts), lambda: compressors.make("none"))
        ours.append((m, dp, make_opt(m.parameters())))
    sampler = data.ShardSampler(ds.size("train"), batch, rank, world, seed=0)
    for _ in range(STEPS):
        x, y = ds.batch("train", next(sampler))
        ref_opt.zero_grad()
        models.loss_fn(ref(x), y).backward()
        ref_opt.step()
        for m, dp, opt in ours:
            models.loss_fn(m(x), y).backward()
            dp.finish()
            opt.step()
            dp.zero_grad()
    diffs = []
    ref_params = dict(ref.module.named_parameters())
    for (sched, opts, mode), (m, dp, _) in zip(layouts, ours):
        worst = max((p - ref_params[n]).abs().max().item() for n, p in m.named_parameters())
        moved = max((p - q).abs().max().item() for p, q in zip(m.parameters(), base.parameters()))
        diffs.append((sched, str(opts), mode, len(dp.buckets), worst, moved))
    return diffs


LAYOUTS = [(s, o, mode) for s, o in (("layerwise", {}), ("allinone", {}), ("bucket", {"cap_mb": 0.25}))
           for mode in ("sync", "wfbp")]


def _check(results):
    for rank_diffs in results:
        for sched, opts, mode, nb, worst, moved in rank_diffs:
            assert moved > 1e-3, f"{sched}/{mode}: parameters did not move"
            torch.testing.assert_close(worst, 0.0, atol=1e-6, rtol=0,
                                       msg=f"{sched}{opts}/{mode} ({nb} buckets) differs from DDP by {worst}")


def test_cnn_sgd_momentum_matches_ddp():
    res = run_world(_train_pair, "cnn", "digits", 16, "sgd", LAYOUTS)
    _check(res)
    # the layouts really differ: layerwise has one bucket per tensor, allinone one bucket
    nb = {(s, m): n for s, _, m, n, _, _ in res[0]}
    assert nb[("layerwise", "sync")] == 8 and nb[("allinone", "sync")] == 1 and nb[("bucket", "sync")] > 1


def test_resnet_adam_matches_ddp():
    res = run_world(_train_pair, "resnet", "digits", 8, "adam",
                    [("bucket", {"cap_mb": 1.0}, "wfbp"), ("layerwise", {}, "wfbp"), ("allinone", {}, "sync")])
    _check(res)


def _broadcast(rank, world):
    torch.manual_seed(rank)  # a different init on each rank, on purpose
    m = torch.nn.Linear(4, 3)
    WFBP(m, functools.partial(schedules.build, "allinone"), lambda: compressors.make("none"))
    out = [torch.empty(3, 4) for _ in range(world)]
    dist.all_gather(out, m.weight.detach().contiguous())
    return out


def test_parameters_broadcast_from_rank0():
    res = run_world(_broadcast)
    torch.testing.assert_close(res[0][0], res[0][1])
