"""DeAR (comm.mode dear): equals sync all-reduce, evaluation sees fresh parameters,
the timeline shows the two halves where they belong, relayout keeps optimizer state,
the cap search, and the spec's rejections."""
import json
import os
import random

import pytest
import torch

from distutil import run_world, model_state
from commlab.engine import schedules
from commlab.engine.comm import dear
from commlab.engine.compressors.base import Compressor, ErrorFeedback
from commlab.engine.compressors.capabilities import Capabilities
from commlab.engine.compressors.plan import Plan
from commlab.engine.tuners import capsearch
from commlab.engine.schedules import ParamInfo
from commlab.engine.spec import JobSpec, SpecError

STEPS = 20
MID = 10


def _spec(mode, opt, cap_mb=None, **comm):
    o = {"name": "sgd", "lr": 0.05, "momentum": 0.9} if opt == "sgd" else {"name": opt, "lr": 1e-3}
    return JobSpec.from_dict({"model": "cnn", "dataset": "digits", "batch_size": 16, "steps": STEPS,
                              "optimizer": o, "comm": {"mode": mode, **comm}, "timeline": False,
                              **({"schedule": {"cap_mb": cap_mb}} if cap_mb is not None else {})})


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _pair(rank, world, opt, variants):
    """A sync trainer and dear trainers (one per comm variant) on the same batches: the parameter
    differences at the middle (before and after evaluation) and at the end, and the eval losses."""
    from commlab.engine.trainer import Trainer
    dev = torch.device("cpu")
    ref = Trainer(_spec("sync", opt), None, rank, world, dev)
    ours = [Trainer(_with(opt, v), None, rank, world, dev) for v in variants]
    out = []
    for s in range(STEPS):
        ref.train_step()
        for t in ours:
            t.train_step()
        if s + 1 == MID:
            ref_eval = ref.evaluate()
            ref_state = model_state(ref)
            mids = []
            for t in ours:
                stale = _max_diff({k: v.detach() for k, v in t.model.state_dict().items()}, ref_state)
                ev = t.evaluate()  # must first gather the step just taken
                mids.append((stale, _max_diff(model_state(t), ref_state), ev["eval_loss"], ref_eval["eval_loss"]))
    ref_state = model_state(ref)
    for t, mid in zip(ours, mids):
        out.append({"mid": mid, "end": _max_diff(model_state(t), ref_state), "buffers": len(t.dp.buffers),
                    "bytes": t.dp.step_bytes})
        t.close()
    ref.close()
    return out


def _with(opt, v):
    """A dear spec with ``v``'s buffer options: cap_mb (the schedule's byte cap, which dear's buffers take), or
    the comm's layers or tune; and its compressor and per_bucket rules."""
    v = dict(v)
    comp = v.pop("compressor", "none")
    rules = v.pop("per_bucket", [])
    d = _spec("dear", opt).to_dict()
    if "cap_mb" in v:
        d["schedule"]["cap_mb"] = v.pop("cap_mb")
    d["comm"] = {"mode": "dear", **v}
    d["compressor"] = {"name": comp, "per_bucket": rules}
    return JobSpec.from_dict(d)


def _check(res, tol=1e-5):
    for rank_res in res:
        for r in rank_res:
            stale, mid, ev, ref_ev = r["mid"]
            assert stale > 1e-4, "after a step and before the next forward the parameters should still be stale"
            assert mid < tol, f"after evaluate() dear's parameters differ from sync's by {mid}"
            assert abs(ev - ref_ev) < 1e-4, f"eval loss {ev} != sync's {ref_ev}"
            assert r["end"] < tol, f"dear differs from sync by {r['end']} after {STEPS} steps ({r['buffers']} buffers)"


def test_dear_equals_sync_sgd_momentum():
    res = run_world(_pair, "sgd", [{"cap_mb": 0.02}, {"layers": 1}])
    _check(res)
    assert res[0][0]["buffers"] >= 3 and res[0][1]["buffers"] == 4  # cnn: 4 layers of weight + bias


def test_dear_equals_sync_adam_and_through_the_cap_search():
    # tune: the cap search relayouts the buffers several times in these 20 steps, moving Adam's state
    res = run_world(_pair, "adam", [{"cap_mb": 25.0}, {"tune": True, "tune_steps": 2}])
    _check(res)


def _fp16(rank, world, ef):
    """dear with fp16 against sync with fp16: the same arithmetic (cast, pre-divide, sum in half),
    and with error feedback the same residual, kept per element across dear's relayouts (tune)."""
    from commlab.engine.trainer import Trainer
    dev = torch.device("cpu")
    d = _spec("sync", "sgd").to_dict()
    d["compressor"] = {"name": "fp16", "error_feedback": ef}
    ref = Trainer(JobSpec.from_dict(d), None, rank, world, dev)
    ours = []
    for comm in ({"cap_mb": 0.05}, {"tune": True, "tune_steps": 2}):
        o = _with("sgd", {**comm, "compressor": "fp16"}).to_dict()
        o["compressor"]["error_feedback"] = ef
        ours.append(Trainer(JobSpec.from_dict(o), None, rank, world, dev))
    for _ in range(8):
        for t in [ref] + ours:
            t.train_step()
    out = [_max_diff(model_state(t), model_state(ref)) for t in ours]
    residual = _ef(ours[0].dp.buffers[0].compressor)
    for t in [ref] + ours:
        t.close()
    return out, None if residual is None else residual.residual.abs().max().item()


@pytest.mark.parametrize("ef", [False, True])
def test_dear_fp16_matches_sync_fp16(ef):
    for diffs, residual in run_world(_fp16, ef):
        assert max(diffs) < 1e-5
        assert (residual is not None and residual > 0) == ef  # error feedback really ran in dear


def _timeline(rank, world, run_dir):
    from commlab.engine.trainer import Trainer
    d = _with("sgd", {"cap_mb": 0.05}).to_dict()
    d["timeline"] = True
    t = Trainer(JobSpec.from_dict(d), run_dir, rank, world, torch.device("cpu"))
    for _ in range(3):
        t.train_step()
    t.close()


def test_timeline_allgather_in_forward_reduce_scatter_in_backward(tmp_path):
    run_world(_timeline, str(tmp_path))
    ev = [json.loads(line) for line in open(os.path.join(tmp_path, "timeline-rank0.jsonl"))]

    def spans(pred):
        return [(e["ts"], e["ts"] + e["dur"], e) for e in ev if pred(e)]

    fwd = spans(lambda e: e["cat"] == "forward")
    bwd = spans(lambda e: e["cat"] == "backward" and e["name"] == "backward")
    ag = spans(lambda e: e["cat"] == "comm" and e["name"].startswith("allgather"))
    rs = spans(lambda e: e["cat"] == "comm" and e["name"].startswith("reduce_scatter"))
    assert ag and rs and fwd and bwd
    overlaps = lambda s, others: any(a < s[1] and s[0] < b for a, b, _ in others)  # noqa: E731
    # no gathers in step 0 (parameters start fresh); in steps 1 and 2 every gather lies in forward
    assert len(ag) == 2 * len({e["args"]["bucket"] for _, _, e in rs})
    assert all(overlaps(s, fwd) for s in ag), "an all-gather span does not overlap any forward span"
    assert not any(overlaps(s, bwd) for s in ag), "an all-gather ran during backward"
    # reduce-scatters are issued in backward: the first buffers' ones start before backward ends
    first = min(rs, key=lambda s: s[0])
    assert overlaps((first[0], first[0] + 1), bwd)


def _relayout(rank, world):
    """Relayout mid-training (Adam): the state moves element by element, so training goes on
    exactly as with one layout throughout."""
    import copy
    from commlab.engine import data, models
    torch.manual_seed(0)
    ds = data.load("digits", seed=0)
    base = models.build("mlp", ds.info)
    runs = []
    for change in (False, True):
        m = copy.deepcopy(base)
        d = dear.DeAR(m, lambda ps: schedules.layout_cap(ps, 0.3), Plan.of("none"))
        opt = torch.optim.Adam(d.shard_params(), lr=1e-3)
        d.attach(opt)
        sampler = data.ShardSampler(ds.size("train"), 16, rank, world, seed=0)
        for s in range(12):
            if change and s == 6:
                d.relayout(schedules.layout_layers(d.infos, 1))
            x, y = ds.batch("train", next(sampler))
            models.loss_fn(m(x), y).backward()
            d.finish()
            opt.step()
            d.zero_grad()
        d.sync_params()
        runs.append(({k: v.clone() for k, v in m.state_dict().items()}, len(d.buffers)))
        d.close()
    return _max_diff(runs[0][0], runs[1][0]), runs[0][1], runs[1][1]


def test_relayout_keeps_optimizer_state():
    for diff, nb_before, nb_after in run_world(_relayout):
        assert nb_before != nb_after
        assert diff < 1e-6


def _ef(c):
    """The error feedback wrapping compressor ``c``, or None."""
    return c if isinstance(c, ErrorFeedback) else None


def _residuals(d):
    """Each parameter's slice of its buffer's error-feedback residual (zeros where none is kept)."""
    out = {}
    for b in d.buffers:
        r = b.compressor.residual
        for n, p, off in zip(b.names, b.params, b.offsets):
            out[n] = torch.zeros(p.numel()) if r is None else r[off:off + p.numel()].clone()
    return out


def _relayout_residual(rank, world):
    from commlab.engine import data, models
    torch.manual_seed(0)
    ds = data.load("digits", seed=0)
    m = models.build("mlp", ds.info)
    d = dear.DeAR(m, lambda ps: schedules.layout_cap(ps, 0.3), Plan.of("fp16", error_feedback=True))
    opt = torch.optim.SGD(d.shard_params(), lr=0.05)
    d.attach(opt)
    sampler = data.ShardSampler(ds.size("train"), 16, rank, world, seed=0)
    for _ in range(2):
        x, y = ds.batch("train", next(sampler))
        models.loss_fn(m(x), y).backward()
        d.finish()
        opt.step()
        d.zero_grad()
    before, n_before = _residuals(d), len(d.buffers)
    d.relayout(schedules.layout_layers(d.infos, 1))
    after, n_after = _residuals(d), len(d.buffers)
    pads = [b.compressor.residual[b.numel:].abs().max().item()
            for b in d.buffers if b.padded > b.numel and b.compressor.residual is not None]
    d.close()
    return n_before, n_after, max(before[k].abs().max().item() for k in before), \
        max((before[k] - after[k]).abs().max().item() for k in before), max(pads, default=0.0)


def test_relayout_moves_the_error_feedback_residual_with_its_parameters():
    for n_before, n_after, size, moved, pad in run_world(_relayout_residual):
        assert n_before != n_after and size > 0
        assert moved == 0 and pad == 0


# ---------------------------------------------------------------- pure parts

def _infos(names_sizes):
    return [ParamInfo(n, k, 4) for n, k in names_sizes]


def test_layout_layers_groups_weight_and_bias():
    ps = _infos([("c.weight", 10), ("c.bias", 2), ("b.weight", 10), ("b.bias", 2), ("a.weight", 5)])
    assert schedules.layout_layers(ps, 1) == [[0, 1], [2, 3], [4]]
    assert schedules.layout_layers(ps, 2) == [[0, 1, 2, 3], [4]]
    assert schedules.layout_layers(ps, 9) == [[0, 1, 2, 3, 4]]


def _cost(opt_log2: float, noise: float, rng: random.Random):
    """A synthetic iteration time, unimodal in log cap, with multiplicative noise."""
    return lambda cap: (100 + 3 * (torch.log2(torch.tensor(cap)).item() - opt_log2) ** 2) * (1 + rng.gauss(0, noise))


def test_cap_search_as_good_as_grid_in_fewer_trials():
    caps = capsearch.cap_candidates(12 * 2 ** 20)  # a resnet-sized model: 1/16 .. 16 MB, 9 caps
    assert len(caps) == 9
    rng = random.Random(0)
    for opt in range(-4, 5):  # the best cap anywhere in the range
        for _ in range(5):
            f = _cost(opt + rng.uniform(-0.5, 0.5), 0.01, rng)
            tuner = capsearch.CapTuner(caps)
            while (c := tuner.propose()) is not None:
                tuner.report(c, [f(c) for _ in range(3)])
            grid = {c: f(c) for c in caps}
            exact = lambda c: 100 + 3 * (torch.log2(torch.tensor(c)).item() - opt) ** 2  # noqa: E731
            assert len(tuner.trials) <= 6 < len(caps)
            assert exact(tuner.best) <= 1.05 * min(exact(c) for c in grid)


# ---------------------------------------------------------------- spec

@pytest.mark.parametrize("patch,field", [
    ({"compressor": {"name": "topk", "ratio": 0.01}}, "compressor.name"),
    ({"compressor": {"name": "powersgd"}}, "compressor.name"),
    ({"schedule": {"name": "layerwise"}}, "schedule"),
    ({"schedule": {"cap_mb": 0}}, "schedule.cap_mb"),
    ({"comm": {"mode": "dear", "layers": 0}}, "comm.layers"),
    ({"schedule": {"cap_mb": 4}, "comm": {"mode": "dear", "layers": 2}}, "comm.layers"),
    ({"schedule": {"cap_mb": 4}, "comm": {"mode": "dear", "tune": True}}, "comm.tune"),
    ({"comm": {"mode": "dear", "layers": 2, "tune": True}}, "comm.layers"),
    ({"comm": {"mode": "dear", "tune_steps": 3}}, "comm.tune_steps"),
    ({"comm": {"mode": "sync", "tune": True}}, "comm.tune"),
])
def test_spec_rejects(patch, field):
    d = {"model": "cnn", "comm": {"mode": "dear"}, **patch}
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(d)
    assert e.value.path == field and "\n" not in str(e.value)


def test_spec_accepts_dear():
    for comp in ("none", "fp16", "bf16", {"name": "fp16", "error_feedback": True}, "int8",
                 {"name": "int8", "block": 32, "error_feedback": True}):
        s = JobSpec.from_dict({"compressor": comp, "comm": {"mode": "dear", "tune": True, "tune_steps": 4}})
        assert JobSpec.from_dict(s.to_dict()) == s


@pytest.mark.parametrize("comp,lacks", [
    ({"name": "topk"}, "topk has payloads that cannot be summed"),
    ({"name": "qsgd"}, "qsgd has payloads that cannot be summed"),
    ({"name": "randomk", "ratio": 0.1}, "randomk has a payload that does not keep the gradient's shape"),
    ({"name": "countsketch"}, "countsketch has a payload that does not keep the gradient's shape"),
    ({"name": "countsketch", "exact": True}, "countsketch takes 2 rounds"),
    ({"name": "powersgd", "rank": 2}, "powersgd takes 2 rounds"),
])
def test_dear_refuses_by_capability(comp, lacks):
    """The refusal says which capability the compressor instance lacks, and lists the ones dear takes."""
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict({"model": "cnn", "compressor": comp, "comm": {"mode": "dear"}})
    msg = str(e.value)
    assert e.value.path == "compressor.name" and "\n" not in msg
    assert f"; {lacks}; allowed: none, fp16, bf16, int8" in msg
    with pytest.raises(ValueError, match=f"^compressor.name: .*{lacks}"):  # the communicator checks the same
        dear.DeAR(torch.nn.Linear(2, 2), lambda ps: [[0, 1]],
                  Plan.of(comp["name"], **{k: v for k, v in comp.items() if k != "name"}))


# ---------------------------------------------------------------- compressed reduce-scatter (int8)

BLOCK = 64


def _quantized(x: torch.Tensor, block: int) -> tuple:
    """The test's own block-wise int8 round trip of a shard: (decoded, per-element scale)."""
    n = x.numel()
    nb = -(-n // block)
    pad = torch.zeros(nb * block)
    pad[:n] = x
    scale = pad.view(nb, block).abs().amax(1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(pad.view(nb, block) / safe[:, None]).clamp(-127, 127)
    return (codes * scale[:, None]).reshape(-1)[:n], scale.repeat_interleave(block)[:n]


def _int8_step(rank, world, ef):
    """One backward through DeAR with int8 buffers; every rank's gradient buffers (gathered) for the
    reference, the shard gradients dear produced, and the error-feedback residuals."""
    import torch.distributed as dist
    from commlab.engine import data, models
    torch.manual_seed(0)
    ds = data.load("digits", seed=0)
    m = models.build("cnn", ds.info)
    d = dear.DeAR(m, lambda ps: schedules.layout_layers(ps, 1), Plan.of("int8", error_feedback=ef, block=BLOCK))
    d.attach(torch.optim.SGD(d.shard_params(), lr=0.0))  # lr 0: the same gradients twice (error feedback)
    x, y = ds.batch("train", next(data.ShardSampler(ds.size("train"), 16, rank, world, seed=0)))
    out = []
    for _ in range(2 if ef else 1):
        resid = [None if _ef(b.compressor) is None or b.compressor.residual is None
                 else b.compressor.residual.clone() for b in d.buffers]  # before backward encodes anew
        models.loss_fn(m(x), y).backward()
        local = [b.flat.clone() for b in d.buffers]  # as landed (the all-to-all is issued, nothing written)
        d.finish()
        d.optimizer.step()
        every = []
        for t in local:
            g = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(g, t)
            every.append(g)
        out.append({"every": every, "resid_before": resid, "shards": [b.shard_param.grad.clone() for b in d.buffers],
                    "lo": [(b.lo, b.shard) for b in d.buffers], "sent": d.step_bytes,
                    "raw": sum(b.padded * 4 for b in d.buffers),
                    "resid": [b.compressor.residual.clone() if _ef(b.compressor) else None for b in d.buffers]})
        d.zero_grad()
    d.close()
    return out


def test_dear_int8_reduce_scatter_is_the_average_of_the_quantized_shards():
    """Each rank's shard gradient is the fp32 sum of every rank's block-wise int8 round trip of that shard,
    over the world size (checked against the test's own quantizer), and within the quantization bound of
    the exact average: half a block scale per rank, averaged."""
    res = run_world(_int8_step, False)
    world = len(res)
    for r, (step,) in enumerate(res):
        assert len(step["shards"]) >= 3
        worst = 0.0
        for bi, (lo, shard) in enumerate(step["lo"]):
            parts = [g[lo:lo + shard] for g in step["every"][bi]]
            exact = sum(parts) / world
            decoded = [_quantized(p, BLOCK) for p in parts]
            ref = sum(q for q, _ in decoded) / world
            bound = sum(s for _, s in decoded) / 2 / world
            got = step["shards"][bi]
            torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-6)
            assert ((got - exact).abs() <= bound + 1e-7).all()
            worst = max(worst, (got - exact).abs().max().item())
        assert worst > 0, "int8 changed nothing: was the gradient really quantized?"
        assert step["sent"] < 0.3 * step["raw"]  # int8 codes + a scale per 64 elements, not fp32


def test_dear_int8_error_feedback_sends_what_was_owed():
    """With error feedback the residual is each rank's whole buffer minus its shards' round trips, and the
    next step quantizes the gradient plus that residual."""
    res = run_world(_int8_step, True)
    world = len(res)
    for r, (first, second) in enumerate(res):
        for bi, (lo, shard) in enumerate(first["lo"]):
            mine = first["every"][bi][r]
            decoded = torch.cat([_quantized(s, BLOCK)[0] for s in mine.view(world, -1)])
            torch.testing.assert_close(first["resid"][bi], mine - decoded, atol=1e-7, rtol=0)
            assert first["resid"][bi].abs().max() > 0
            # step two: the same gradient (lr 0), plus the residual, quantized shard by shard
            assert torch.equal(second["resid_before"][bi], first["resid"][bi])
            sent = [g + 0 for g in second["every"][bi]]
            owed = [res[q][0]["resid"][bi] for q in range(world)]
            ref = sum(_quantized((s + o)[lo:lo + shard], BLOCK)[0] for s, o in zip(sent, owed)) / world
            torch.testing.assert_close(second["shards"][bi], ref, atol=1e-7, rtol=1e-6)


def _int8_train(rank, world):
    from commlab.engine.trainer import Trainer
    dev = torch.device("cpu")
    ref = Trainer(_spec("sync", "sgd"), None, rank, world, dev)
    out = []
    for comp in ({"name": "int8"}, {"name": "int8", "error_feedback": True}):
        d = _spec("dear", "sgd", cap_mb=0.05).to_dict()
        d["compressor"] = comp
        out.append(Trainer(JobSpec.from_dict(d), None, rank, world, dev))
    losses = [[] for _ in out]
    for _ in range(STEPS):
        ref.train_step()
        for i, t in enumerate(out):
            losses[i].append(t.train_step()["loss"])
    res = [(ls, _max_diff(model_state(t), model_state(ref)), t.evaluate()["eval_acc"]) for ls, t in zip(losses, out)]
    for t in [ref] + out:
        t.close()
    return res


def test_dear_int8_trains_close_to_sync():
    for rank_res in run_world(_int8_train):
        for losses, diff, acc in rank_res:
            assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
            assert 0 < diff < 0.05  # quantized, so not equal, but close after 20 steps
            assert acc > 0.7


def test_dear_none_through_a_plan_equals_sync():
    """The per-buffer plan path with every rule none is the plain path: dear == sync."""
    res = run_world(_pair, "sgd", [{"cap_mb": 0.02, "per_bucket": [{"below_mb": 0.01, "name": "none"},
                                                                   {"below_mb": 0.1, "name": "none"}]}])
    _check(res)


# ---------------------------------------------------------------- compressors outside the registry

class Halves(Compressor):
    """A user's compressor: sends half the gradient, decodes by doubling. Summable and shape-keeping by
    declaration, so dear reduce-scatters its payloads."""
    name = "halves"
    capabilities = Capabilities(keeps_shape=True)

    def compress(self, t):
        return [t / 2], None

    def decompress(self, payload, ctx):
        return payload[0] * 2


class HalfSlices(Compressor):
    """A user's shard codec: half precision plus one fp32 scale per slice, not summable (the scales
    differ), so dear exchanges each rank's slices all-to-all."""
    name = "half-slices"
    capabilities = Capabilities(summable=False, shard_codec=True)

    def compress(self, t):
        scale = t.abs().amax().clamp_min(1e-12).reshape(1).float()
        return [(t / scale).half(), scale], t.dtype

    def decompress(self, payload, ctx):
        codes, scale = payload
        return (codes.float() * scale).to(ctx)


def _own_compressors(rank, world):
    """One backward of the same batch under dear with none, Halves and HalfSlices: each buffer's shard
    gradient, and each instance's bytes and rounds."""
    import copy
    from commlab.engine import data, models
    torch.manual_seed(0)
    ds = data.load("digits", seed=0)
    base = models.build("cnn", ds.info)
    x, y = ds.batch("train", next(data.ShardSampler(ds.size("train"), 16, rank, world, seed=0)))
    out = {}
    for label, plan in (("none", Plan.of("none")), ("halves", Halves), ("half-slices", HalfSlices)):
        m = copy.deepcopy(base)
        d = dear.DeAR(m, lambda ps: schedules.layout_cap(ps, 0.05), plan)
        d.attach(torch.optim.SGD(d.shard_params(), lr=0.0))
        models.loss_fn(m(x), y).backward()
        d.finish()
        out[label] = ([b.shard_param.grad.clone() for b in d.buffers], d.step_bytes,
                      sum(b.padded * 4 for b in d.buffers))
        d.close()
    return out


def test_dear_drives_compressors_outside_the_registry_by_their_capabilities():
    """The exchange driver takes any compressor whose declared capabilities dear accepts: a summable,
    shape-keeping one is reduce-scattered (exactly none's result: halving and doubling are exact), a
    shard codec's slices go all-to-all (none's result up to half precision) at half the bytes plus a
    scale (padded to 8 bytes) per slice."""
    for res in run_world(_own_compressors):
        ref, ref_bytes, raw = res["none"]
        halves, half_bytes, _ = res["halves"]
        sliced, sliced_bytes, _ = res["half-slices"]
        assert len(ref) >= 2 and ref_bytes == raw
        for a, b, c in zip(ref, halves, sliced):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
            # half precision of each slice scaled to its largest value: off by at most ~2^-11 of that
            torch.testing.assert_close(c, a, rtol=0, atol=1e-3 * a.abs().max().item())
            assert not torch.equal(c, a)
        assert half_bytes == raw and raw / 2 <= sliced_bytes < raw / 2 + 16 * len(ref) * 2
