"""Mixed strategies (compressor.per_bucket): each bucket gets its own compressor by its size, with its own
state. Rules that change nothing equal the plain run bit for bit; each bucket's result is what its own
compressor gives alone; error-feedback state belongs to its bucket; a mixed run trains and says in the
timeline which codec each bucket used; bad rules are refused with one line."""
import copy
import functools
import json

import pytest
import torch

from distutil import run_world, model_state
from commlab.engine import compressors, data, models, schedules
from commlab.engine.comm.wfbp import WFBP, Sync
from commlab.engine.compressors.base import ErrorFeedback
from commlab.engine.compressors.plan import MB, Plan, section_for
from commlab.engine.spec import JobSpec, SpecError

SMALL = 0.01
"""MB: in the cnn, the biases and the first and last weights are under it (layerwise buckets); the two
big weights (74 KB, 512 KB) are over it."""


def _spec(comp, mode="sync", schedule="layerwise", steps=12, **extra):
    return JobSpec.from_dict({"model": "cnn", "dataset": "digits", "batch_size": 16, "steps": steps,
                              "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "compressor": comp,
                              "schedule": schedule, "comm": mode, "timeline": False, **extra})


def _states(rank, world, pairs, steps=12):
    """Train each (spec a, spec b) pair on the same batches; the largest parameter difference of each pair."""
    from commlab.engine.trainer import Trainer
    dev = torch.device("cpu")
    out = []
    for a, b in pairs:
        ta, tb = Trainer(a, None, rank, world, dev), Trainer(b, None, rank, world, dev)
        for _ in range(steps):
            ta.train_step()
            tb.train_step()
        sa, sb = model_state(ta), model_state(tb)
        codecs = sorted({bk.codec for bk in tb.dp.buckets})
        out.append((max((sa[k] - sb[k]).abs().max().item() for k in sa), codecs))
        ta.close()
        tb.close()
    return out


def test_rules_that_change_nothing_equal_the_plain_run_bit_for_bit():
    none_rules = {"name": "none", "per_bucket": [{"below_mb": SMALL, "name": "none"},
                                                 {"below_mb": 0.1, "name": "none"}]}
    psgd = {"name": "powersgd", "rank": 2, "start_iter": 2}
    psgd_rules = {**psgd, "per_bucket": [{"below_mb": SMALL, "name": "powersgd", "rank": 2, "start_iter": 2}]}
    pairs = [(_spec("none"), _spec(none_rules)), (_spec("none", "wfbp"), _spec(none_rules, "wfbp")),
             (_spec(psgd, "wfbp"), _spec(psgd_rules, "wfbp"))]
    for rank_res in run_world(_states, pairs):
        for diff, codecs in rank_res:
            assert diff == 0.0
    assert rank_res[2][1] == ["powersgd(rank=2,start_iter=2)"]


def _one_step(rank, world):
    """One backward through a mixed communicator and through one plain communicator per compressor, on the
    same layout and batch: each mixed bucket against the same bucket under its own compressor alone."""
    torch.manual_seed(0)
    ds = data.load("digits", seed=0)
    base = models.build("cnn", ds.info)
    x, y = ds.batch("train", next(data.ShardSampler(ds.size("train"), 16, rank, world, seed=0)))
    sched = functools.partial(schedules.build, "layerwise")
    small = {"name": "fp16", "error_feedback": False, "params": {}}
    big = {"name": "topk", "error_feedback": True, "params": {"ratio": 0.1}}
    section = {**big, "per_bucket": [{"below_mb": SMALL, **small}]}

    def grads(make):
        m = copy.deepcopy(base)
        dp = WFBP(m, sched, make)
        models.loss_fn(m(x), y).backward()
        dp.finish()
        out = [(b.codec, b.raw_bytes, b.flat.clone()) for b in dp.buckets]
        dp.close()
        return out
    mixed = grads(Plan.from_section(section))
    alone = {c["name"]: grads(lambda c=c: compressors.make(c["name"], error_feedback=c["error_feedback"],
                                                           **c["params"])) for c in (small, big)}
    return mixed, alone


def test_each_bucket_gets_its_rule_and_matches_its_compressor_alone():
    for mixed, alone in run_world(_one_step):
        seen = set()
        for i, (codec, nbytes, flat) in enumerate(mixed):
            want = "fp16" if nbytes < SMALL * MB else "topk(ratio=0.1)+EF"
            assert codec == want, f"bucket {i} ({nbytes} bytes) got {codec}"
            seen.add(codec)
            ref = alone[codec.split("(")[0].split("+")[0]][i][2]
            assert torch.equal(flat, ref), f"bucket {i} ({codec}) differs from {codec} alone"
        assert seen == {"fp16", "topk(ratio=0.1)+EF"}
        # and the mixture is really mixed: the fp16 buckets differ from top-k's on the same gradients
        assert any(not torch.equal(f, alone["topk"][i][2]) for i, (c, _, f) in enumerate(mixed) if c == "fp16")


def test_error_feedback_state_is_per_bucket():
    """Each bucket's instance keeps its own residual, of its own bucket's shape: what its own compression
    dropped from its own input, untouched by the other buckets' exchanges."""
    plan = Plan.from_section({"name": "topk", "error_feedback": True, "params": {"ratio": 0.25},
                              "per_bucket": [{"below_mb": 1e-3, "name": "fp16", "error_feedback": True,
                                              "params": {}}]})
    small, big, big2 = plan.make(400), plan.make(4000), plan.make(4000)
    assert (small.name, big.name) == ("fp16", "topk")
    assert all(isinstance(c, ErrorFeedback) and c.residual is None for c in (small, big, big2))
    torch.manual_seed(1)
    a, b = torch.randn(1000), torch.randn(1000)
    pa, ca = big.encode(a.clone())
    big2.encode(b.clone())  # another bucket's exchange
    torch.testing.assert_close(big.residual, a - big.decompress(pa, ca))
    assert big.residual.shape == a.shape and big2.residual.shape == b.shape
    assert int((big.residual != 0).sum()) == 750  # top-k kept 25%: the rest is owed
    # the next step sends the new gradient plus what was owed, only this bucket's
    before = big.residual.clone()
    pa2, ca2 = big.encode(a.clone())
    torch.testing.assert_close(big.decompress(pa2, ca2) + big.residual, a + before)
    s = torch.randn(100)
    small.encode(s.clone())
    torch.testing.assert_close(small.residual, s - s.half().float())
    assert big.residual.shape == (1000,)


def _relayout(rank, world):
    """A mixed communicator whose relayout moves parameters between buckets of different compressors:
    the residual follows its parameters into a bucket whose compressor keeps one."""
    torch.manual_seed(0)
    ds = data.load("digits", seed=0)
    m = models.build("cnn", ds.info)
    x, y = ds.batch("train", next(data.ShardSampler(ds.size("train"), 16, rank, world, seed=0)))
    plan = Plan.from_section({"name": "topk", "error_feedback": True, "params": {"ratio": 0.1},
                              "per_bucket": [{"below_mb": SMALL, "name": "randomk", "error_feedback": True,
                                              "params": {"ratio": 0.5}}]})
    dp = Sync(m, functools.partial(schedules.build, "layerwise"), plan)
    models.loss_fn(m(x), y).backward()
    dp.finish()
    dp.zero_grad()
    owed = {}
    for b in dp.buckets:
        for n, off, v in zip(b.names, b.offsets, b.views):
            owed[n] = b.compressor.residual[off:off + v.numel()].clone()
    codecs_before = [b.codec for b in dp.buckets]
    dp.relayout(schedules.build("allinone", dp.infos))  # one bucket of 600 KB: top-k for every parameter
    (b,) = dp.buckets
    moved = {n: b.compressor.residual[off:off + v.numel()].clone() for n, off, v in zip(b.names, b.offsets, b.views)}
    return codecs_before, b.codec, max((owed[n] - moved[n]).abs().max().item() for n in owed), \
        min(owed[n].abs().max().item() for n in owed)


def test_relayout_moves_each_residual_with_its_parameters_across_compressors():
    for before, after, diff, smallest in run_world(_relayout):
        assert set(before) == {"randomk(ratio=0.5)+EF", "topk(ratio=0.1)+EF"} and after == "topk(ratio=0.1)+EF"
        assert smallest > 0 and diff == 0.0


def _train(rank, world, run_dir, spec_d):
    from commlab.engine.trainer import Trainer
    t = Trainer(JobSpec.from_dict(spec_d), run_dir if rank == 0 else None, rank, world, torch.device("cpu"))
    losses = [t.train_step()["loss"] for _ in range(spec_d["steps"])]
    acc = t.evaluate()["eval_acc"]
    t.close()
    return losses, acc


@pytest.mark.parametrize("mode", ["wfbp", "dear"])
def test_a_mixed_run_trains_and_its_timeline_names_each_codec(tmp_path, mode):
    if mode == "wfbp":  # small buckets as they are, the big ones PowerSGD rank 2
        comp = {"name": "powersgd", "rank": 2, "start_iter": 2, "per_bucket": [{"below_mb": SMALL, "name": "none"}]}
        spec = _spec(comp, "wfbp", steps=40, timeline=True).to_dict()
        want = {"none", "powersgd(rank=2,start_iter=2)"}
    else:  # dear, a buffer per layer: small ones reduce-scattered as they are, big ones as int8
        comp = {"name": "int8", "per_bucket": [{"below_mb": SMALL, "name": "none"}]}
        spec = _spec(comp, {"mode": "dear", "layers": 1}, schedule="bucket", steps=40, timeline=True).to_dict()
        want = {"none", "int8"}
    for losses, acc in run_world(_train, str(tmp_path), spec):
        assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
        assert acc > 0.7
    layout = json.loads((tmp_path / "layout.json").read_text())
    assert {b["codec"] for b in layout["buckets"]} == want
    codecs = set()
    for line in (tmp_path / "timeline-rank0.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("cat") == "comm":
            codecs.add(e["args"]["codec"])
    assert codecs == want


def test_section_for_is_the_plan_on_dicts():
    sec = {"name": "powersgd", "error_feedback": False, "params": {"rank": 4},
           "per_bucket": [{"below_mb": 1.0, "name": "none", "error_feedback": False, "params": {}},
                          {"below_mb": 4.0, "name": "fp16", "error_feedback": True, "params": {}}]}
    plan = Plan.from_section(sec)
    for nbytes in (0, MB - 1, MB, 4 * MB - 1, 4 * MB, 100 * MB):
        want = section_for(sec, nbytes)
        assert plan.make(nbytes).describe() == want["name"] + ("(rank=4)" if want["name"] == "powersgd" else "") + \
            ("+EF" if want["error_feedback"] else "")
    assert section_for(sec, MB)["name"] == "fp16" and section_for(sec, MB - 1)["name"] == "none"


@pytest.mark.parametrize("rules,msg", [
    ([{"below_mb": 1, "name": "zip"}], r"^compressor\.per_bucket\[0\]\.name: unknown compressor 'zip'; allowed: none"),
    ([{"name": "none"}], r"^compressor\.per_bucket\[0\]\.below_mb: must be a number in \(0, 4096\]"),
    ([{"below_mb": -1, "name": "none"}], r"^compressor\.per_bucket\[0\]\.below_mb: must be a number"),
    ([{"below_mb": 2, "name": "none"}, {"below_mb": 1, "name": "fp16"}],
     r"^compressor\.per_bucket\[1\]\.below_mb: never matches: rule 0"),
    ([{"below_mb": 1, "name": "topk", "ratio": 2}], r"^compressor\.per_bucket\[0\]: ratio: must be in \(0, 1\]"),
    ([{"below_mb": 1, "name": "none", "rank": 2}], r"^compressor\.per_bucket\[0\]: rank: none takes no parameters"),
    ([{"below_mb": 1, "name": "powersgd", "error_feedback": True}],
     r"^compressor\.per_bucket\[0\]: error_feedback: powersgd keeps its own residual"),
    ([{"below_mb": 1, "name": "none", "error_feedback": "yes"}],
     r"^compressor\.per_bucket\[0\]\.error_feedback: must be true or false"),
    (["none"], r"^compressor\.per_bucket\[0\]: must be a mapping like \{below_mb: 1, name: none\}"),
    ([{"below_mb": 1, "name": "none", "per_bucket": []}], r"^compressor\.per_bucket\[0\]\.per_bucket: a rule cannot"),
])
def test_bad_rules_are_refused_with_one_line(rules, msg):
    with pytest.raises(SpecError, match=msg):
        JobSpec.from_dict({"compressor": {"name": "fp16", "per_bucket": rules}})


def test_dear_refuses_a_rule_it_cannot_reduce_scatter():
    with pytest.raises(SpecError, match=r"^compressor\.per_bucket\[0\]\.name: comm.mode dear .* topk has payloads "
                                        r"that cannot be summed; allowed: none, fp16, bf16, int8$"):
        JobSpec.from_dict({"comm": "dear", "compressor": {"name": "int8", "per_bucket": [
            {"below_mb": 1, "name": "topk"}]}})


def test_spec_json_keeps_the_rules_fully_defaulted():
    s = JobSpec.from_dict({"compressor": {"name": "powersgd", "rank": 4, "per_bucket": [
        {"below_mb": 1, "name": "topk", "ratio": 0.1, "error_feedback": True}]}})
    d = s.to_dict()
    assert d["compressor"]["per_bucket"] == [{"below_mb": 1.0, "name": "topk", "error_feedback": True,
                                              "params": {"ratio": 0.1}}]
    assert JobSpec.from_dict(json.loads(json.dumps(d))) == s
