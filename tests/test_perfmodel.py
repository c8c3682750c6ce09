"""The performance model's formulas against hand-computed cases (commlab/lab/strategy/perfmodel)."""
import argparse
import dataclasses
import json

import pytest
import torch

from commlab.lab.strategy.perfmodel import costs
from commlab.lab.strategy.perfmodel.iteration import Bucket, Round, Step, iteration_time


def ps_push_pull(nbytes: float, world: int, link, servers: int = 1) -> float:
    """Parameter server: every worker pushes ``nbytes`` and pulls ``nbytes`` back.

    The ``servers`` shards each hold ``nbytes / servers``; a server's link
    receives ``world * nbytes / servers`` in the push and sends as much in the
    pull (the bottleneck for few servers), while a worker's link moves
    ``nbytes`` each way. Push and pull are one message per server each, so
    ``T = 2 (alpha + max(world / servers, 1) * nbytes * beta)``.
    """
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    per_link = max(world / servers, 1.0) * nbytes
    return 2 * (link.alpha + per_link * link.beta)

GB1 = costs.Link(10e-6, 8e-9)  # 1 Gbit/s, 10 µs per step
SLOW = costs.Link(0.0, 1e-3)   # 1 ms per byte: collective times in round numbers


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def test_ring_collectives_by_hand():
    # 2(p-1) alpha + 2(p-1)/p n beta = 60 µs + 1.5 * 1e6 * 8 ns
    assert costs.allreduce(1e6, 4, GB1) == approx(60e-6 + 0.012)
    assert costs.reduce_scatter(1e6, 4, GB1) == approx(30e-6 + 0.006)
    assert costs.allgather(1e5, 4, GB1) == approx(30e-6 + 3 * 1e5 * 8e-9)
    assert costs.allreduce(1e6, 1, GB1) == 0.0
    assert costs.Link.from_gbps(1, 10) == GB1
    assert GB1.gbps == approx(1.0)


def test_allgather_of_different_sizes_pads_to_the_largest_after_a_header():
    # header: 2 tensors x 40 bytes, then the largest payload (300 bytes)
    assert costs.allgather_var([100, 300], 2, GB1, tensors=2) == approx(10e-6 + 80 * 8e-9 + 10e-6 + 300 * 8e-9)
    with pytest.raises(ValueError):
        costs.allgather_var([], 2, GB1)


def test_parameter_server_push_pull():
    assert ps_push_pull(1e6, 4, GB1) == approx(2 * (10e-6 + 4e6 * 8e-9))  # one server: its link
    assert ps_push_pull(1e6, 4, GB1, servers=4) == approx(2 * (10e-6 + 1e6 * 8e-9))
    with pytest.raises(ValueError):
        ps_push_pull(1e6, 4, GB1, servers=0)


def test_scaled_link_keeps_its_efficiency():
    measured = costs.Link(5e-6, 8e-9 / 0.9)  # 90% of 1 Gbit
    assert measured.scaled(1, 10).gbps == approx(9.0) and measured.scaled(1, 10).alpha == 5e-6


def test_token_bucket_sends_a_burst_fast_then_at_the_sustained_rate():
    tb = costs.TokenBucket(costs.Link(0.0, 1e-3, burst_bytes=100, beta_burst=1e-5))
    assert tb.duration("allreduce", 50, 2, 0.0) == approx(50 * 1e-5)  # 2 ranks: 50 bytes on the wire
    # issued as the first ends: 50 tokens left; the other 150 bytes wait for tokens at 1 ms/byte
    assert tb.duration("allreduce", 200, 2, 5e-4) == approx(150 * 1e-3)
    assert tb.tokens == 0
    # a second of idle time refills the bucket (capped at 100)
    assert tb.duration("allgather", 80, 2, 10.0) == approx(80 * 1e-5) and tb.tokens == approx(20)


def test_host_costs_add_each_collectives_fixed_cost_and_the_reduce_scatters_sum():
    # 2 ranks, 1 ms per byte, 10 µs per step; fixed: all-reduce 200 µs, all-gather 50, header 300, all-to-all 20;
    # gamma 1 µs per byte summed after a reduce-scatter: (p-1)/p of the buffer
    link = costs.Link(10e-6, 1e-3, gamma=1e-6, fixed=(("allreduce", 200e-6), ("allgather", 50e-6),
                                                     ("header", 300e-6), ("all_to_all", 20e-6)))
    assert costs.allreduce(100, 2, link) == approx(2 * 10e-6 + 100 * 1e-3 + 200e-6)  # gloo's ring sums hidden
    assert costs.reduce_scatter(100, 2, link) == approx(10e-6 + 50 * 1e-3 + 50 * 1e-6)  # no fixed cost given
    assert costs.all_to_all(100, 2, link) == approx(10e-6 + 50 * 1e-3 + 20e-6)  # moves the same, sums nothing
    assert costs.allgather(40, 2, link) == approx(10e-6 + 40 * 1e-3 + 50e-6)
    # the header: an all-gather and its own fixed cost; a payload all-gather is the header then the payload
    assert costs.collective("header", 40, 2, link) == approx(10e-6 + 40 * 1e-3 + 50e-6 + 300e-6)
    assert costs.allgather_var([70, 30], 2, link) == approx((10e-6 + 40e-3 + 350e-6) + (10e-6 + 70e-3 + 50e-6))
    assert costs.allreduce(100, 1, link) == 0.0  # one rank: no call at all
    # through the token bucket (none left here: the sustained rate), the same costs
    tb = costs.TokenBucket(dataclasses.replace(link, burst_bytes=1, beta_burst=1e-9))
    tb.tokens = 0.0
    assert tb.duration("header", 40, 2, 0.0) == approx(costs.collective("header", 40, 2, link))
    assert tb.duration("reduce_scatter", 100, 2, 0.0) == approx(costs.reduce_scatter(100, 2, link))
    # a scaled link keeps its host costs (they are not the wire's)
    assert link.scaled(1, 10).fixed == link.fixed and link.scaled(1, 10).gamma == link.gamma


def two_buckets(first_rounds=None):
    return Step(forward=1.0, backward=2.0, optimizer=0.5, buckets=[
        Bucket(ready=1.0, encode=0.1, rounds=first_rounds or [Round("allreduce", 1000, after=0.2)]),
        Bucket(ready=2.0, encode=0.1, rounds=[Round("allreduce", 500, after=0.2)])])


def test_sync_sends_everything_after_backward():
    # backward ends at 3; b0 encoded 3-3.1, sent 3.1-4.1; b1 encoded 3.1-3.2, queued, sent 4.1-4.6;
    # decode b0 4.1-4.3, b1 4.6-4.8; optimizer 0.5
    r = iteration_time(two_buckets(), SLOW, 2, "sync")
    assert r.total == approx(5.3) and r.compute == approx(3.5)
    assert r.link_busy == approx(1.5) and r.encode_decode == approx(0.6)


def test_wfbp_overlaps_buckets_with_backward():
    # b0 ready at 2, encoded to 2.1, sent 2.1-3.1; backward resumes, b1 ready at 3.1 (0.1 late),
    # encoded to 3.2, sent 3.2-3.7; decode b0 3.2-3.4, b1 3.7-3.9; + 0.5
    assert iteration_time(two_buckets(), SLOW, 2, "wfbp").total == approx(4.4)
    # backward 1.5x slower only while a collective is in flight: nothing is before b0 (ready at 2, as
    # without slowdown); b0's all-reduce 2.1-3.1 slows the next 1.0 s of backward to 0.667 s of work,
    # the last 0.333 s runs at full speed: b1 ready at 3.433, encoded to 3.533, sent 3.533-4.033;
    # decode b0 3.533-3.733, b1 4.033-4.233; + 0.5
    assert iteration_time(two_buckets(), SLOW, 2, "wfbp", slowdown=1.5).total == approx(4.7 + 1 / 30)


def test_overlap_slowdown_only_while_a_collective_is_in_flight():
    # one bucket, ready when backward ends (a 25 MB cap on a small model): nothing overlaps backward,
    # so the slowdown changes nothing: backward 1-3, header 3-3.04, data 3.04-3.14, decode to 3.24, + 0.5
    step = Step(1.0, 2.0, 0.5, [Bucket(ready=2.0, encode=0.0, rounds=[Round("allgather", 100, after=0.1)])])
    assert iteration_time(step, SLOW, 2, "wfbp", slowdown=1.5).total == approx(3.74)
    # a bucket ready at 0.5 whose all-reduce (0.2 s) ends long before backward: 0.2 s of it at 1/2 speed
    # (0.1 s of work), the rest at full speed: backward ends 0.1 s late
    early = Step(1.0, 2.0, 0.5, [Bucket(ready=0.5, encode=0.0, rounds=[Round("allreduce", 200)])])
    assert iteration_time(early, SLOW, 2, "wfbp", slowdown=2.0).total == approx(3.6)
    assert iteration_time(early, SLOW, 2, "wfbp", slowdown=1.0).total == approx(3.5)


def test_wfbp_multi_round_exchange_blocks_backward_when_the_next_bucket_launches():
    rounds = [Round("allreduce", 1000, after=0.3), Round("allreduce", 200, after=0.2)]
    # b0 sent 2.1-3.1; at b1's launch (3.1) the hook waits for it, encodes round 2 (to 3.4),
    # sends it 3.4-3.6; b1 encoded 3.4-3.5, queued, sent 3.6-4.1; finish: b0 decoded 3.6-3.8,
    # b1 4.1-4.3; + 0.5
    assert iteration_time(two_buckets(rounds), SLOW, 2, "wfbp").total == approx(4.8)


def test_allgather_round_waits_for_its_header():
    step = Step(1.0, 2.0, 0.5, [Bucket(ready=2.0, encode=0.0, rounds=[Round("allgather", 100, after=0.1)])])
    # header (40 bytes) 3-3.04 blocks backward's end, data 3.04-3.14, decode to 3.24, + 0.5
    assert iteration_time(step, SLOW, 2, "wfbp").total == approx(3.74)


def test_dear_prices_a_shard_codecs_all_to_all_as_the_reduce_scatter_it_stands_for():
    """A bucket's sharded round may be an all-to-all (int8's slices): on a flat link, a two-level cluster
    and a token bucket it takes what a reduce-scatter of the same bytes takes."""
    def step(op):
        return Step(1.0, 2.0, 0.5, [Bucket(ready=1.0, encode=0.0, rounds=[Round(op, 1000)], raw_bytes=4000,
                                           forward=0.4)])
    cluster = costs.Cluster(2, costs.Link(1e-6, 1e-4), costs.Link(1e-5, 1e-3))
    bucket = costs.Link(0.0, 1e-3, burst_bytes=500, beta_burst=1e-4)
    for link, world in ((SLOW, 2), (cluster, 4), (bucket, 2)):
        assert iteration_time(step("all_to_all"), link, world, "dear").total == \
            approx(iteration_time(step("reduce_scatter"), link, world, "dear").total)
    assert costs.steps_and_wire("all_to_all", 1000, 4) == costs.steps_and_wire("reduce_scatter", 1000, 4)


def test_dear_overlaps_all_gather_with_forward_and_shards_the_optimizer():
    step = Step(1.0, 2.0, 0.5, [
        Bucket(ready=1.0, encode=0.0, rounds=[Round("reduce_scatter", 1000)], raw_bytes=1000, forward=0.4),
        Bucket(ready=2.0, encode=0.0, rounds=[Round("reduce_scatter", 400)], raw_bytes=400, forward=0.6)])
    # all-gathers in forward order: b1 (200 B/rank) 0-0.2, b0 (500) 0.2-0.7; forward b1 0.2-0.8,
    # b0 0.8-1.2; backward from 1.2: b0 ready 2.2, reduce-scatter 2.2-2.7; b1 at 3.2, 3.2-3.4; the
    # finite-gradients flag (4 bytes) 3.4-3.404; optimizer on half the parameters: 0.25
    assert iteration_time(step, SLOW, 2, "dear").total == approx(3.654)


def test_dear_gathers_one_bucket_ahead_of_forward():
    # three buckets of 400 B (gathers of 200 B/rank: 0.2 s each), forward order b2 (0.5 s of forward),
    # b1, b0 (0.1 s each). b2's first layer issues b2's and b1's gathers: 0-0.2, 0.2-0.4; b2 runs
    # 0.2-0.7; only then is b0's gather issued: 0.7-0.9 (the link idle from 0.4), b1 0.7-0.8, b0 0.9-1.0.
    # Backward from 1.0: reduce-scatters (200 wire bytes) 1.3-1.5, 1.6-1.8, 2.0-2.2, flag 2.2-2.204,
    # optimizer 0.4 / 2
    step = Step(0.7, 1.0, 0.4, [
        Bucket(ready=0.3, encode=0.0, rounds=[Round("reduce_scatter", 400)], raw_bytes=400, forward=0.1),
        Bucket(ready=0.6, encode=0.0, rounds=[Round("reduce_scatter", 400)], raw_bytes=400, forward=0.1),
        Bucket(ready=1.0, encode=0.0, rounds=[Round("reduce_scatter", 400)], raw_bytes=400, forward=0.5)])
    r = iteration_time(step, SLOW, 2, "dear", record=True)
    assert r.total == approx(2.404)
    gathers = [(e["start"], e["end"]) for e in r.events if e["name"].endswith("params")]
    assert gathers == [(0.0, approx(0.2)), (approx(0.2), approx(0.4)), (approx(0.7), approx(0.9))]


def test_one_worker_is_pure_compute_and_bad_input_is_rejected():
    assert iteration_time(two_buckets(), SLOW, 1, "wfbp").total == approx(3.5)
    with pytest.raises(ValueError, match="allowed"):
        iteration_time(two_buckets(), SLOW, 2, "bogus")


# ------------------------------------------------------------------ calibration, crossover, CLI

def test_fits_recover_known_costs():
    from commlab.lab.strategy.perfmodel import calibrate as cal
    xs = [4096, 65536, 1 << 20, 1 << 22]
    a, b = cal.fit_affine(xs, [20e-6 + 1e-9 * x for x in xs])
    assert a == pytest.approx(20e-6) and b == pytest.approx(1e-9)
    alpha, beta = cal.fit_link([(2, w, 2 * 50e-6 + w * 8e-9) for w in (4096, 1e5, 1e6)])
    assert alpha == pytest.approx(50e-6) and beta == pytest.approx(8e-9)
    with pytest.raises(ValueError):
        cal.fit_link([(2, 4096, 1e-3), (2, 4096, 2e-3)])
    assert cal.fit_link([(2, 4096, 2e-3), (2, 1e6, 1.9e-3)]) == (pytest.approx(0.975e-3, rel=0.05), 0.0)


def tiny_profile(**kw):
    from commlab.lab.strategy.perfmodel.calibrate import Profile
    p = Profile(model="mlp", dataset="digits", batch_size=16, source="test",
                params=[("fc2.bias", 40), ("fc2.weight", 40_000), ("fc1.bias", 400), ("fc1.weight", 400_000)],
                forward_s=2e-3, backward_s=4e-3, optimizer_s=0.5e-3,
                layer_forward={"fc1": 1.5e-3, "fc2": 0.5e-3}, layer_ready={"fc2": 1e-3, "fc1": 4e-3},
                compressors={"fp16": {"encode": [10e-6, 1e-10], "between": [0, 0], "decode": [10e-6, 1e-10]}})
    p.__dict__.update(kw)
    return p


def spec(comp="fp16", sched="bucket", mode="wfbp"):
    return {"model": {"name": "mlp", "options": {}}, "dataset": {"name": "digits"}, "batch_size": 16,
            "compressor": {"name": comp, "params": {}, "error_feedback": False},
            "schedule": {"name": sched, "cap_mb": 25.0}, "comm": {"mode": mode}}


def test_all_gathered_payloads_decode_at_the_measured_cost_of_each_further_one():
    from commlab.lab.strategy.perfmodel import calibrate as cal
    from commlab.lab.strategy.perfmodel import predict as pr
    curve = {"encode": [0, 0], "between": [0, 0], "decode": [100e-6, 1e-9], "decode_more": [10e-6, 0.1e-9]}
    # 1 MB: one decode 100 + 1000 µs; each further payload 10 + 100 µs; 8 ranks: 1100 + 7 * 110 µs
    assert cal.decode_cost(curve, 1e6, 8) == approx(1.87e-3)
    assert cal.decode_cost(curve, 1e6, 1) == approx(1.1e-3)
    # a curve without decode_more (older profiles, hand-made curves): every payload decoded on its own
    old = {k: v for k, v in curve.items() if k != "decode_more"}
    assert cal.decode_cost(old, 1e6, 8) == approx(8 * 1.1e-3)
    # the step's last all-gather round carries that decode
    prof = tiny_profile()
    prof.compressors["signsgd"] = curve
    step = pr.build_step(prof, spec("signsgd", "allinone"), world=8)
    (b,) = step.buckets
    assert b.rounds[-1].op == "allgather"
    assert b.rounds[-1].after == approx(cal.decode_cost(curve, b.raw_bytes, 8))
    # signSGD's payload is fixed (fixed_payload): its all-gather exchanges no shapes first, as in the engine;
    # threshold's follows the values: a header first
    assert not b.rounds[-1].header
    prof.compressors["threshold"] = curve
    (b,) = pr.build_step(prof, spec("threshold", "allinone"), world=8).buckets
    assert b.rounds[-1].op == "allgather" and b.rounds[-1].header


def test_gathered_decodes_one_payload_per_rank_and_measures_what_each_adds():
    import torch

    from commlab.engine import compressors
    from commlab.lab.strategy.perfmodel import calibrate as cal
    reply = cal.gathered(3)
    (got,) = reply("allgather", [[torch.ones(2)]])
    assert len(got) == 3 and all(torch.equal(p[0], torch.ones(2)) for p in got)
    (summed,) = reply("allreduce", [[torch.ones(2)]])
    assert torch.equal(summed[0], torch.ones(2))
    # driven as one of 3 ranks: signSGD's vote sums 3 payloads' signs (3 votes alike: the signs of x)
    from commlab.engine.comm.exchange import run_exchange
    x = torch.randn(1000)
    (ex,) = run_exchange([compressors.make("signsgd")], [x.clone()], 3, cal.gathered(3))
    assert torch.equal(ex.out, torch.where(x >= 0, 1.0, -1.0))
    rounds, times = cal.drive(compressors.make("signsgd"), x.clone(), world=3)
    assert rounds == [("allgather", 125, 1)] and len(times) == 2
    curve = cal.measure_compressor({"name": "signsgd"}, numels=(1024, 16384), repeat=2, warm=1)
    assert len(curve["decode_more"]) == 2 and len(curve["decode_more_samples"]) == 2
    assert "decode_more" not in cal.measure_compressor({"name": "fp16"}, numels=(1024, 16384), repeat=2, warm=1)


def test_fp16_halves_the_bytes_and_pays_only_on_slow_links(tmp_path):
    from commlab.lab.strategy.perfmodel import calibrate as cal
    from commlab.lab.strategy.perfmodel import predict as pr
    p = tiny_profile()
    step = pr.build_step(p, spec(), 2)
    assert [r.nbytes for b in step.buckets for r in b.rounds] == [pytest.approx(440_440 / 2)]
    assert step.buckets[0].ready == pytest.approx(4e-3)  # the bucket holds fc1: ready at the end
    slow, fast = pr.speedup(p, spec(), 0.1, 2), pr.speedup(p, spec(), 100, 2)
    assert slow > 1.5 and fast < 1.0
    g = pr.crossover_gbps(p, spec(), 2)
    assert 0.1 < g < 100 and pr.speedup(p, spec(), g * 0.9, 2) > 1 > pr.speedup(p, spec(), g * 1.1, 2)
    assert pr.predict(p, spec(), 1, 2).total > pr.predict(p, spec(), 1, 2, compute_speedup=20).total
    p.save(tmp_path / "p.json")
    assert cal.Profile.load(tmp_path / "p.json") == p


def test_predict_cli_rejects_bad_input_in_one_line(tmp_path, capsys):
    from commlab.lab.front.cli import main
    f = tmp_path / "s.yaml"
    f.write_text("model: mlp\nbatch_size: 16\ncompressor: {name: fp16}\n")
    assert main(["predict", str(f), "--gbps", "fast", "--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gbps" in err
    assert main(["predict", str(f), "--workers", "0", "--runs", str(tmp_path)]) == 2
    assert main(["predict", str(f), "--profile", str(tmp_path / "none.json"), "--runs", str(tmp_path)]) == 2
    assert "--profile" in capsys.readouterr().err


def test_predict_cli_prints_the_table_and_crossover(tmp_path, capsys):
    from commlab.lab.front.cli import main
    f = tmp_path / "s.yaml"
    f.write_text("model: mlp\nbatch_size: 16\ncompressor: {name: fp16}\ncomm: {mode: dear}\n")
    prof = tiny_profile(compressors={})
    prof.save(tmp_path / "p.json")
    assert main(["predict", str(f), "--gbps", "0.1,100", "--workers", "2,8", "--profile", str(tmp_path / "p.json"),
                 "--compute-speedup", "20", "--runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dear" in out and "x20" in out
    rows = [l.split() for l in out.splitlines() if l.strip() and l.split()[0] in ("2", "8")]
    assert [(r[0], r[1]) for r in rows] == [("2", "0.1"), ("2", "100"), ("8", "0.1"), ("8", "100")]
    assert out.count("crossover:") == 2
    # the missing fp16 curve was measured and saved into the profile
    from commlab.lab.strategy.perfmodel.calibrate import Profile
    assert "fp16" in Profile.load(tmp_path / "p.json").compressors


def test_properties_are_measured_not_declared(tmp_path):
    import json
    from commlab.lab.strategy.perfmodel import properties as pp
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"cells": [{"compressor": "none", "ef": False, "acc": 0.99},
                                         {"compressor": "topk", "ef": True, "acc": 0.985},
                                         {"compressor": "signsgd", "ef": False, "acc": 0.80}]}))
    rows = {r["compressor"]: r for r in pp.checklist(["fp16", "topk", "powersgd", "signsgd", "countsketch"],
                                                     numels=(1024, 16384),
                                                     accuracy_results=[json.loads(acc.read_text())])}
    assert rows["fp16"]["allreduce_compatible"] and rows["fp16"]["linear"] and rows["fp16"]["ratio"] == 2.0
    assert not rows["topk"]["allreduce_compatible"] and rows["topk"]["linear"] is None
    assert rows["topk"]["ratio"] == pytest.approx(50, rel=0.05)  # 1%: a value and an index each
    assert rows["powersgd"]["allreduce_compatible"] and rows["powersgd"]["rounds"] == 2
    assert rows["countsketch"]["allreduce_compatible"] and rows["countsketch"]["linear"] is False  # median decode
    assert all(r["ranks_agree"] for r in rows.values())
    assert rows["topk"]["accuracy_neutral"] is True and rows["signsgd"]["accuracy_neutral"] is False
    assert rows["fp16"]["accuracy_neutral"] is None and pp.yes_no(None) == "not measured"


def test_link_from_net_check_output(tmp_path, capsys):
    from commlab.lab.front.cli import main
    from commlab.lab.strategy.perfmodel import calibrate as cal
    # 2 ranks: the 1 MB all-reduce moves 1 MB, the 4 KiB one 4 KiB; alpha 100 µs per step, 1 Gbit
    res = {"allreduce_world": 2, "target_gbps": 1.0, "allreduce_bytes": 1_000_000,
           "allreduce_median_s": 2 * 100e-6 + 1e6 * 8e-9, "allreduce_small_bytes": 4096,
           "allreduce_small_mean_s": 2 * 100e-6 + 4096 * 8e-9}
    link = cal.link_from_net_check(res)
    assert link["alpha"] == pytest.approx(100e-6) and link["beta"] == pytest.approx(8e-9)
    f = tmp_path / "check.json"
    f.write_text(json.dumps(res))
    tiny_profile().save(tmp_path / "p.json")
    s = tmp_path / "s.yaml"
    s.write_text("model: mlp\nbatch_size: 16\ncompressor: {name: fp16}\n")
    assert main(["predict", str(s), "--profile", str(tmp_path / "p.json"), "--link", str(f), "--workers", "2",
                 "--runs", str(tmp_path)]) == 0
    assert "calibrated at 1 Gbit/s" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert main(["predict", str(s), "--profile", str(tmp_path / "p.json"), "--link", str(tmp_path / "bad.json"),
                 "--runs", str(tmp_path)]) == 2
    assert "--link" in capsys.readouterr().err


def test_plot_builders_for_the_model_page():
    import pandas as pd
    from commlab.lab.analysis import plots
    grid = pd.DataFrame([{"compressor": c, "gbps": g, "workers": w, "speedup": s}
                         for c, s in (("fp16", 1.5), ("topk", 0.8)) for g in (1, 10) for w in (2, 8)])
    fig = plots.speedup_heatmaps(grid)
    assert len(fig.data) == 2 and fig.data[0].z.shape == (2, 2)
    pvm = pd.DataFrame([{"run": "a", "compressor": "none", "schedule": "bucket", "link": "loopback", "comm": "wfbp",
                         "measured_ms": 5.0, "predicted_ms": 5.5},
                        {"run": "b", "compressor": "none", "schedule": "bucket", "link": "loopback", "comm": "sync",
                         "measured_ms": None, "predicted_ms": None}])
    fig = plots.predicted_vs_measured_figure(pvm)
    assert len(fig.data) == 2  # the diagonal and one comm mode with a point


def test_predict_calibrates_from_a_real_run_then_reuses_the_profile(tmp_path, capsys):
    import commlab
    from commlab.lab.front.cli import main
    from commlab.lab.strategy.perfmodel import calibrate as cal
    small = {"model": "mlp", "dataset": "digits", "steps": 6, "batch_size": 16, "eval_every": 0, "threads": 1,
             "comm": {"mode": "sync"}, "schedule": {"name": "layerwise"}}
    run = commlab.run(small, runs=tmp_path)
    assert run.state == "done", run.log_tail()
    prof = cal.from_run(run)
    assert prof.forward_s > 0 and prof.backward_s > 0 and set(prof.layer_ready) == {"net.1", "net.3", "net.5"}
    assert max(prof.layer_ready.values()) <= prof.backward_s * 1.01  # completion offsets lie inside backward
    alpha, beta = cal.link_from_run(run)  # six all-reduces of different sizes per step
    assert alpha >= 0 and beta >= 0 and alpha + beta > 0  # on loopback the per-byte cost may not be resolvable
    s = tmp_path / "s.yaml"
    s.write_text("model: mlp\nbatch_size: 16\ncompressor: {name: none}\n")
    assert main(["predict", str(s), "--calibrate", run.id, "--gbps", "1", "--workers", "2", "--runs", str(tmp_path)]) == 0
    assert f"calibrated from run {run.id}" in capsys.readouterr().out
    assert main(["predict", str(s), "--gbps", "1", "--workers", "2", "--runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reusing" in out and "1.00x" in out  # none vs DDP: the same job


def test_dear_specs_load_with_their_own_buffer_options():
    from commlab.engine.spec import SpecError
    from commlab.lab.strategy.perfmodel import whatif
    spec = whatif.load_for_prediction(data={"model": "cnn", "comm": "dear", "schedule": {"cap_mb": 2}})
    assert spec["comm"]["mode"] == "dear" and spec["schedule"]["cap_mb"] == 2
    with pytest.raises(SpecError, match="compressor"):
        whatif.load_for_prediction(data={"model": "cnn", "comm": "dear", "compressor": "topk"})


# ------------------------------------------------------------------ two-level clusters, profile files

def test_hierarchical_collectives_by_hand():
    # 4 nodes of 4; inside 1 µs + 1 ns/byte, between 10 µs + 10 ns/byte, one NIC per node (4 rings share it)
    c = costs.Cluster(4, costs.Link(1e-6, 1e-9), costs.Link(10e-6, 10e-9))
    n, m = 1e6, 1e4
    # reduce-scatter inside (3 steps, 3/4 n), all-reduce of n/4 across 4 nodes at 4x10 ns/byte, all-gather inside
    assert c.time("allreduce", n, 16) == approx(3e-6 + 0.75e6 * 1e-9 + 6 * 10e-6 + 1.5 * 0.25e6 * 40e-9
                                                + 3e-6 + 0.75e6 * 1e-9)
    assert c.time("allreduce", n, 16) == approx(0.016566)  # 6 µs + 1.5 ms inside, 60 µs + 15 ms between
    assert c.time("reduce_scatter", n, 16) == approx(3e-6 + 0.75e6 * 1e-9 + 3 * 10e-6 + 0.75 * 0.25e6 * 40e-9)
    # all-gather: across nodes (m each, 3 steps), then inside the node (4 m each, 3 steps)
    assert c.time("allgather", m, 16) == approx(3 * 10e-6 + 3 * m * 40e-9 + 3e-6 + 3 * 4 * m * 1e-9)
    # four NICs: each ring has a link of its own
    four = costs.Cluster(4, c.intra, c.inter, nics=4)
    assert four.time("allreduce", n, 16) == approx(6e-6 + 1.5e6 * 1e-9 + 60e-6 + 1.5 * 0.25e6 * 10e-9)
    # one node or less: a flat ring on the fast link
    assert c.time("allreduce", n, 4) == approx(costs.allreduce(n, 4, c.intra))
    assert c.time("allreduce", n, 2) == approx(costs.allreduce(n, 2, c.intra))
    with pytest.raises(ValueError, match="whole nodes of 4"):
        c.time("allreduce", n, 6)
    # through the iteration model: one bucket after backward (sync), the link the cluster
    step = Step(forward=1.0, backward=2.0, optimizer=0.5, buckets=[
        Bucket(ready=2.0, encode=0.0, rounds=[Round("allreduce", n)])])
    assert iteration_time(step, c, 16, "sync").total == approx(3.5 + 0.016566)


def _layered_profile():
    """Six layers of two tensors (gradient-ready order) with fp16's and PowerSGD's curves in the profile (none
    measured here): under layerwise, 12 buckets, PowerSGD's of two rounds beside one-round ones."""
    params, ready, fwd = [], {}, {}
    for i, layer in enumerate(f"l{k}" for k in range(5, -1, -1)):
        params += [(f"{layer}.bias", 4 * 64), (f"{layer}.weight", 4 * 64 * 96)]
        ready[layer], fwd[layer] = 1e-3 * (i + 1), 0.5e-3
    curve = {"encode": [20e-6, 2e-10], "between": [5e-6, 1e-10], "decode": [15e-6, 1e-10]}
    return tiny_profile(params=params, layer_ready=ready, layer_forward=fwd, backward_s=7e-3, forward_s=3e-3,
                        overlap_slowdown=1.5, compressors={"fp16": curve, "powersgd(rank=2,start_iter=0)": curve})


def test_cluster_predictions_keep_their_numbers():
    """The page's cluster table, against the numbers the model gave before wfbp's multi-round exchanges were
    advanced from a list of the pending ones (not every earlier bucket) and a step was built once per worker
    count (not once per rate): the same to the last digit kept here."""
    from commlab.lab.strategy.perfmodel import views

    def sp(comp, sched, mode):
        return {"model": "mlp", "dataset": "digits", "batch_size": 16,
                "compressor": {"name": comp, "params": {"rank": 2, "start_iter": 0} if comp == "powersgd" else {}},
                "schedule": {"name": sched}, "comm": {"mode": mode}}
    before = {  # ddp_ms, spec_ms, exposed_comm_ms per (workers, inter_gbps): (2, 0.1), (2, 10), (8, 0.1), (8, 10)
        ("powersgd", "layerwise", "wfbp"): [[10.50397312, 11.00958656, 0.00014336],
                                            [10.50397312, 11.00958656, 0.00014336],
                                            [27.39095936, 11.58741952, 0.57797632],
                                            [10.56356992, 11.01173696, 0.00229376]],
        ("fp16", "layerwise", "sync"): [[10.50397312, 10.9646976, 0.0], [10.50397312, 10.9646976, 0.0],
                                        [27.39095936, 19.49253344, 8.52783584], [10.56356992, 10.9646976, 0.0]],
        ("none", "bucket", "wfbp"): [[10.50397312, 10.50397312, 0.00397312], [10.50397312, 10.50397312, 0.00397312],
                                     [27.39095936, 27.39095936, 16.89095936],
                                     [10.56356992, 10.56356992, 0.06356992]],
    }
    shape = {"node_size": 2, "intra_gbps": 100.0, "nics": 1}
    for key, want in before.items():
        df = views.cluster_prediction(_layered_profile(), shape, [2, 8], [0.1, 10.0], 1.0, spec=sp(*key))
        assert df[["workers", "inter_gbps"]].values.tolist() == [[2, 0.1], [2, 10.0], [8, 0.1], [8, 10.0]]
        got = df[["ddp_ms", "spec_ms", "exposed_comm_ms"]].values.tolist()
        assert got == [[approx(v) for v in row] for row in want], key


def _cluster_rows(out):
    return [l.split() for l in out.splitlines() if l.strip() and l.split()[0].isdigit()]


def test_predict_from_a_saved_profile_gives_a_two_level_table(tmp_path, capsys):
    from commlab.lab.front.cli import main
    from commlab.lab.strategy.perfmodel import whatif
    spec = whatif.load_for_prediction(data={"model": "mlp", "batch_size": 16, "compressor": "fp16"})
    tiny_profile(spec=spec).save(tmp_path / "p.json")
    workers = [8, 16, 32, 64, 128, 256, 512, 1024]
    assert main(["predict", str(tmp_path / "p.json"), "--workers", ",".join(map(str, workers)),
                 "--cluster", "node_size=8,intra_gbps=1600,inter_gbps=100", "--runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hierarchical" in out and "nodes of 8, 1600 Gbit/s inside, 100 between" in out
    rows = _cluster_rows(out)
    assert [int(r[0]) for r in rows] == workers and all(r[1] == "100" for r in rows)
    # DDP: one 25 MB bucket holding all 440,440 bytes, ready when backward ends (4 ms): forward 2 + backward 4
    # + the hierarchical all-reduce + optimizer 0.5 ms; 8 workers are one node (a flat ring at 1600 Gbit/s)
    n, bi, be = 440_440, 8 / 1600e9, 8 * 8 / 100e9  # the node's one NIC shared by 8 rings

    def ddp_ms(p):
        nodes = p // 8
        if nodes == 1:
            return (6.5e-3 + 2 * 7 / 8 * n * bi) * 1e3
        return (6.5e-3 + 2 * 7 / 8 * n * bi + 2 * (nodes - 1) / nodes * n / 8 * be) * 1e3
    for r, p in zip(rows, workers):
        assert float(r[2]) == pytest.approx(ddp_ms(p), abs=0.006)  # printed with two decimals
        assert float(r[6]) == pytest.approx(6.5 / ddp_ms(p), abs=0.006)  # DDP scaling: compute / iteration
        assert r[4].endswith("x") and 0 < float(r[7]) <= 1.0
        assert r[5] == r[4] + "?"  # to the target: speedup / penalty 1, which rests on no run of this model
    assert out.count("crossover (inter-node rate):") == len(workers)
    # a rate sweep of the inter-node link instead of a fixed one
    assert main(["predict", str(tmp_path / "p.json"), "--workers", "64", "--gbps", "1,400",
                 "--cluster", "node_size=8,intra_gbps=1600"]) == 0
    rows = _cluster_rows(capsys.readouterr().out)
    assert [(r[0], r[1]) for r in rows] == [("64", "1"), ("64", "400")] and float(rows[0][2]) > float(rows[1][2])


def test_predict_profile_bad_inputs_are_one_line(tmp_path, capsys):
    from commlab.lab.front.cli import main
    from commlab.lab.strategy.perfmodel import whatif
    spec = whatif.load_for_prediction(data={"model": "mlp", "batch_size": 16, "compressor": "fp16"})
    good = tmp_path / "p.json"
    tiny_profile(spec=spec).save(good)
    tiny_profile().save(tmp_path / "nospec.json")
    (tmp_path / "broken.json").write_text('{"model": "mlp", "forward_s": ')
    (tmp_path / "other.json").write_text('{"model": "mlp", "forward_s": 0.1}')
    cases = [
        ([str(good), "--cluster", "node_size=8,intra_gbs=100"], "--cluster: expected KEY=VALUE"),
        ([str(good), "--cluster", "node_size=0,intra_gbps=100"], "node_size must be an integer in [1, 4096]"),
        ([str(good), "--cluster", "inter_gbps=100"], "needs node_size and intra_gbps"),
        ([str(good), "--cluster", "node_size=8,intra_gbps=fast"], "intra_gbps must be a number"),
        ([str(good), "--workers", "8,12", "--cluster", "node_size=8,intra_gbps=100"], "--workers: 12 does not fill"),
        ([str(good), "--gbps", "1", "--cluster", "node_size=8,intra_gbps=100,inter_gbps=10"], "give one"),
        ([str(good), "--set", "batch_size=8"], "the profile is for mlp-digits-b16"),
        ([str(good), "--profile", str(good)], "PROFILE is a profile already"),
        ([str(tmp_path / "nospec.json")], "records no spec"),
        ([str(tmp_path / "broken.json")], "broken.json:1:31: not valid JSON"),
        ([str(tmp_path / "missing.json")], "no such file"),
        ([str(tmp_path / "other.json")], "PROFILE: " + str(tmp_path / "other.json") + " is not a profile"),
    ]
    for argv, msg in cases:
        assert main(["predict", *argv, "--runs", str(tmp_path)]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and msg in err, (argv, err)
    from commlab.engine.spec import SpecError
    with pytest.raises(SpecError, match="not a profile"):
        whatif.load_profile_file(str(tmp_path / "other.json"))
    # a curve's decode_more is optional, and checked like the rest when it is there
    d = json.loads(good.read_text())
    d["compressors"]["fp16"]["decode_more"] = "cheap"
    assert "decode_more" in whatif.profile_problem(d)
    d["compressors"]["fp16"]["decode_more"] = [1e-6, 1e-10]
    assert whatif.profile_problem(d) is None
    # what the pages put into their text is text: a profile anyone uploads is refused in one line otherwise
    for where, bad, said in ((d, {"source": ["x"]}, "source must be a string"),
                             (d["compressors"]["fp16"], {"source": 1}, "compressors.fp16: its source, kind and code"),
                             (d["compressors"]["fp16"], {"kind": None}, "compressors.fp16: its source, kind and code"),
                             (d, {"link": {"alpha": 0, "beta": 1e-9, "nominal_gbps": 1, "source": {}}},
                              "link.source must be a string"),
                             (d, {"disturbance": {"disturbed": True, "text": "busy"}}, "disturbance must be a mapping"),
                             (d, {"disturbance": []}, "disturbance must be a mapping")):
        kept = dict(where)
        where.update(bad)
        assert said in whatif.profile_problem(d), bad
        where.clear()
        where.update(kept)
    assert whatif.profile_problem(d) is None
    with pytest.raises(SpecError, match="^upload: u.json is not a profile \\(nested too deeply\\)$"):
        whatif.profile_from_text("[" * 100_000 + "]" * 100_000, "u.json", "upload")
    deep = dict(d, machine=json.loads('{"a": ' * 900 + "1" + "}" * 900))  # parses; asdict and dumps would recurse
    with pytest.raises(SpecError, match="nested more than 32 levels"):
        whatif.profile_from_text(json.dumps(deep), "u.json", "upload")
    assert whatif.profile_from_text(json.dumps(d), "u.json", "upload").model == d["model"]


def test_profile_cli_measures_a_model_then_predict_reads_it(tmp_path, capsys):
    import json
    from commlab.lab.front.cli import main
    s = tmp_path / "s.yaml"
    s.write_text("model: mlp\ndataset: digits\nbatch_size: 16\ncompressor: {name: fp16}\ncomm: {mode: dear}\n")
    out_file = tmp_path / "prof.json"
    assert main(["profile", str(s), "-o", str(out_file), "--steps", "6", "--runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "slowest layers in backward" in out
    d = json.loads(out_file.read_text())
    assert d["spec"]["comm"]["mode"] == "dear" and d["batch_size"] == 16 and "fp16" in d["compressors"]
    m = d["machine"]
    on_gpu = torch.cuda.is_available()  # device auto
    assert (m["device"].startswith("cuda") if on_gpu else m["device"] == "cpu") and m["dtype"] == "float32"
    assert m["torch"]
    assert m["clock"] == ("CUDA events" if on_gpu else "host clock")
    assert set(d["layer_backward"]) == set(d["layer_ready"]) == {"net.1", "net.3", "net.5"}
    assert len(d["params"]) == 6 and sum(b for _, b in d["params"]) == 4 * (64 * 512 + 512 + 512 * 512 + 512
                                                                             + 512 * 10 + 10)
    assert main(["predict", str(out_file), "--workers", "8,1024", "--cluster",
                 "node_size=8,intra_gbps=1600,inter_gbps=100"]) == 0
    rows = _cluster_rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["8", "1024"]
    assert main(["profile", str(s), "--steps", "2", "--runs", str(tmp_path / "runs")]) == 2
    assert "--steps" in capsys.readouterr().err


def test_from_run_takes_forward_waits_out_of_the_layer_spans_that_hold_them():
    """Layer spans tile the forward pass (commlab/engine/probe.py), so a dear all-gather wait between two layers
    lies inside the next layer's span: the profile's layer forward is that span less the wait."""
    from commlab.lab.strategy.perfmodel import calibrate as cal

    def x(cat, ts, dur, **args):
        return {"ph": "X", "pid": 0, "cat": cat, "name": args.get("layer", cat), "ts": ts, "dur": dur, "args": args}

    class Run:
        id = "fake"

        def spec_dict(self):
            return {"model": {"name": "mlp"}, "dataset": {"name": "digits"}, "batch_size": 16}

        def status(self):
            return {"state": "done"}  # no disturbance record: not measured

        def timeline_events(self):
            return [x("forward", 0.0, 1000.0, step=0), x("forward", 0.0, 400.0, layer="net.1"),
                    x("wait", 450.0, 100.0, bucket=0), x("forward", 400.0, 400.0, layer="net.3"),
                    x("forward", 800.0, 150.0, layer="net.5"),
                    x("backward", 1000.0, 2000.0, step=0), x("backward", 1000.0, 900.0, layer="net.5"),
                    x("optimizer", 3000.0, 100.0, step=0)]

    prof = cal.from_run(Run(), skip=0)
    assert prof.layer_forward == pytest.approx({"net.1": 400e-6, "net.3": 300e-6, "net.5": 150e-6})
    assert prof.forward_s == pytest.approx(1e-3) and prof.layer_backward == pytest.approx({"net.5": 900e-6})


def test_skipping_warm_up_gives_the_steady_state_payload():
    """The model reads PowerSGD's payload after ``skip_warmup`` instead of driving its plain exchanges
    first: the same rounds, bytes and tensors as after driving them all (a layout of matrices and a vector)."""
    from commlab.engine import compressors
    from commlab.engine.compressors import contract
    from commlab.engine.compressors.capabilities import BucketContext
    from commlab.lab.strategy.perfmodel import calibrate as cal
    shapes, off = [], 0
    for shape in ((64, 48), (32,), (40, 40)):
        shapes.append((off, shape))
        off += int(torch.tensor(shape).prod())
    bucket = BucketContext(layout=shapes)
    x = torch.randn(off, generator=torch.Generator().manual_seed(0))
    got = []
    for skip in (False, True):
        c = compressors.make("powersgd", rank=2, start_iter=5)
        if skip:
            contract.skip_warmup(c)
        for _ in range(2 if skip else c.capabilities.warmup_exchanges + 2):
            rounds, _ = cal.drive(c, x.clone(), bucket=bucket)
        got.append(rounds)
    assert got[0] == got[1] and len(got[0]) == 2 and got[0][0][1] < off * 4  # compressed, two rounds


def test_every_compressor_can_skip_its_warm_up():
    from commlab.engine import compressors
    from commlab.engine.compressors import contract
    for name in compressors.names():
        contract.skip_warmup(compressors.make(name))  # raises where warm-up exchanges are declared but not skippable


@pytest.mark.parametrize("ef", [False, True])
def test_a_steady_payload_shows_its_sizes_in_one_exchange(ef):
    """Every compressor declaring ``steady_payload`` (the model then drives a layout once) sends the same
    sizes on its first exchange as on later ones with other values (another scale, other signs, a tensor
    of zeros), under error feedback too; threshold's, which does not declare it, follows the values."""
    from commlab.engine import compressors
    from commlab.engine.compressors import contract
    from commlab.engine.compressors.capabilities import BucketContext
    from commlab.lab.strategy.perfmodel import calibrate as cal
    shapes, off = [], 0
    for shape in ((64, 48), (32,), (40, 40)):
        shapes.append((off, shape))
        off += int(torch.tensor(shape).prod())
    bucket = BucketContext(layout=shapes)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(off, generator=g), 100 * torch.randn(off, generator=g).abs(), torch.zeros(off),
              torch.randn(off, generator=g) * torch.linspace(0, 1, off)]
    steady = []
    for name in compressors.names():
        if ef and (name == "none" or compressors.REGISTRY[name].capabilities.builtin_feedback):
            continue
        c = compressors.make(name, error_feedback=ef)
        contract.skip_warmup(c)
        sizes = [cal.drive(c, x.clone(), bucket=bucket)[0] for x in inputs]
        if c.capabilities.steady_payload:
            steady.append(name)
            assert all(s == sizes[0] for s in sizes), (name, sizes)
        else:
            assert name in ("threshold", "dgc")
    assert {"none", "fp16", "topk", "int8", "powersgd"} <= set(steady) or ef
    c = compressors.make("threshold")
    assert cal.drive(c, inputs[0].clone())[0] != cal.drive(c, inputs[1].clone())[0]


def _tiled(*shapes):
    out, off = [], 0
    for shape in shapes:
        out.append((off, shape))
        off += int(torch.tensor(shape).prod())
    return out, off


DECLARED_LAYOUTS = [_tiled((1,)), _tiled((1000,)), _tiled((4099,)), _tiled((300_001,)),
                    _tiled((64, 48), (32,), (40, 40)),  # matrices worth compressing and a vector between
                    _tiled((3, 2), (7,)),  # nothing worth compressing: one plain all-reduce
                    _tiled((512, 600), (600,))]


@pytest.mark.parametrize("params", [{}, {"ratio": 0.3}, {"block": 7}, {"rank": 4}])
def test_declared_rounds_are_the_driven_ones(params):
    """Every compressor that declares a bucket's rounds (the model then skips driving it) declares what one
    driven exchange sends: sizes with odd remainders, one element, above 2**16 (top-k's sampled
    pre-filter), per-tensor layouts with and without matrices worth compressing; with and without error
    feedback. Top-k, int8 and PowerSGD (per tensor) declare; PowerSGD without a layout does not."""
    from commlab.engine import compressors
    from commlab.engine.compressors import contract
    from commlab.engine.compressors.capabilities import BucketContext
    from commlab.lab.strategy.perfmodel import calibrate as cal
    g = torch.Generator().manual_seed(2)
    declaring = set()
    for name in compressors.names():
        cls = compressors.REGISTRY[name]
        given = {k: v for k, v in params.items() if k in {p.name for p in cls.params}}
        if params and not given:
            continue
        for ef in (False, True) if not cls.capabilities.builtin_feedback and name != "none" else (False,):
            for layout, n in DECLARED_LAYOUTS:
                bucket = BucketContext(layout=layout)
                c = compressors.make(name, error_feedback=ef, **given)
                declared = contract.declared_rounds(c, n, 4, bucket)
                if declared is None:
                    continue
                declaring.add(name)
                contract.skip_warmup(c)
                driven, _ = cal.drive(c, torch.randn(n, generator=g), bucket=bucket)
                assert declared == driven, (name, given, ef, layout[:3])
                if c.capabilities.shard_problem() is None:  # dear's exchange, declared as the model reads it
                    sharded = compressors.make(name, error_feedback=ef, **given)
                    driven, _ = cal.drive(sharded, torch.randn(n, generator=g), sharded=True, bucket=bucket)
                    assert contract.declared_shard_rounds(sharded, n, 4, bucket) == driven, \
                        (name, given, ef, layout[:3])
    want = {(): {"topk", "int8", "powersgd"}, ("ratio",): {"topk"}, ("block",): {"int8"}, ("rank",): {"powersgd"}}
    assert declaring >= want[tuple(params)]
    assert contract.declared_rounds(compressors.make("powersgd"), 1000, 4) is None  # flat mode: driven


def test_the_model_uses_declared_rounds_without_driving(monkeypatch):
    """A bucket whose compressor declares its rounds is not driven: the prediction's payload is the
    declaration (here a top-k bucket of a made-up profile), and driving it is never called."""
    from commlab.lab.strategy.perfmodel import calibrate as cal
    from commlab.lab.strategy.perfmodel import predict as pr
    prof = cal.Profile(model="m", dataset="d", batch_size=1, params=[("a.weight", 4 * 5000), ("b.weight", 4 * 7001)])
    monkeypatch.setattr(pr, "_ROUNDS_CACHE", {})
    monkeypatch.setattr(cal, "drive", lambda *a, **k: pytest.fail("drove a declared compressor"))
    comp = {"name": "topk", "params": {"ratio": 0.01}, "error_feedback": True}
    got = pr.payload_rounds(prof, comp, [0, 1])
    assert got == [("allgather", 121 * 8, 2)]  # k = ceil(0.01 * 12001) = 121 values and int32 indices


def test_the_model_drives_dears_exchange_as_the_engine_runs_it(monkeypatch):
    """dear's buckets get the rounds of the compressor's sharded exchange: declared where the compressor
    declares them (int8: never driven), else driven through cal.drive(sharded=True) (fp16: one reduce-scatter
    of its half-precision payload), kept apart from the same bucket's whole exchange."""
    from commlab.lab.strategy.perfmodel import calibrate as cal
    from commlab.lab.strategy.perfmodel import predict as pr
    prof = cal.Profile(model="m", dataset="d", batch_size=1, params=[("a.weight", 4 * 5000), ("b.weight", 4 * 7001)])
    monkeypatch.setattr(pr, "_ROUNDS_CACHE", {})
    real, driven = cal.drive, []

    def drive(c, t, *a, **k):
        driven.append((c.name, k.get("sharded", False)))
        return real(c, t, *a, **k)
    monkeypatch.setattr(cal, "drive", drive)
    int8 = {"name": "int8", "params": {}, "error_feedback": False}
    assert pr.payload_rounds(prof, int8, [0, 1], sharded=True) == [("all_to_all", 4 * 47 + 12001, 2)]
    assert driven == []
    fp16 = {"name": "fp16", "params": {}, "error_feedback": True}
    assert pr.payload_rounds(prof, fp16, [0, 1], sharded=True) == [("reduce_scatter", 2 * 12001, 1)]
    assert pr.payload_rounds(prof, fp16, [0, 1]) == [("allreduce", 2 * 12001, 1)]
    assert driven == [("fp16", True), ("fp16", False)]
    assert {k.split("|")[0] for k in prof.payloads} == {"dear:int8", "dear:fp16+EF", "fp16+EF"}


def test_the_profile_commands_default_is_the_labs_profiling_run():
    """``commlab profile --help`` states the default steps the lab's own profiling run takes."""
    from commlab.lab.front.cli import build_parser
    from commlab.lab.strategy.perfmodel import whatif
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices["profile"]
    steps = next(a for a in sub._actions if a.dest == "steps")
    assert f"default {whatif.PROFILE_STEPS}," in steps.help and steps.default is None


def test_net_check_save_keeps_the_labs_link_calibration(tmp_path, monkeypatch, capsys):
    """`commlab net check --save` writes the check's alpha and beta where the advisor reads them (the check
    itself, which needs namespaces, is stubbed: its figures are given)."""
    from commlab.lab.net import netcheck, netns
    from commlab.lab.front.cli import main
    from commlab.lab.strategy.perfmodel import whatif
    res = {"allreduce_world": 2, "target_gbps": 1.0, "allreduce_bytes": 1_000_000,
           "allreduce_median_s": 2 * 500e-6 + 1e6 * 8e-9, "allreduce_small_bytes": 4096,
           "allreduce_small_mean_s": 2 * 500e-6 + 4096 * 8e-9}
    monkeypatch.setattr(netns, "check_shaped_supported", lambda: None)
    monkeypatch.setattr(netcheck, "net_check", lambda *a, **k: res)
    assert whatif.saved_shaped_link(tmp_path) is None
    assert main(["net", "check", "--gbps", "1", "--json", "--save", "--runs", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["target_gbps"] == 1.0 and "shaped-link calibration" in out.err
    link = whatif.saved_shaped_link(tmp_path)
    assert link["alpha"] == pytest.approx(500e-6) and link["nominal_gbps"] == 1.0
    assert "net check --save at 1 Gbit/s" in link["source"]


def test_a_run_without_timed_steps_is_not_taken_for_the_models_profile(tmp_path):
    """An advisor's trial session (its steps are the trials', in their own folders) and a run too short to time
    are not the model's latest run for calibration; a matching run whose timeline holds no timed step gives no
    profile (one is measured instead) rather than an error."""
    import commlab
    from commlab.engine import runfiles
    from commlab.lab.service.queue import Lab
    from commlab.lab.strategy.perfmodel import whatif
    spec = {"model": "mlp", "dataset": "digits", "steps": 8, "batch_size": 16}
    q = Lab(tmp_path)
    session = q.create(commlab.spec({**spec, "name": "advise trials: 1 candidates"}))
    session.file(runfiles.TRIALS).write_text('{"dirs": []}')
    session.set_status("done")
    short = q.create(commlab.spec({**spec, "steps": 3}))
    short.set_status("done")
    d = session.spec_dict()
    assert whatif.matching_run(d, tmp_path) is None and not whatif.has_profile(d, tmp_path)
    plain = q.create(commlab.spec(spec))  # finished, but its timeline holds nothing (no rank ever wrote one)
    plain.set_status("done")
    assert whatif.matching_run(d, tmp_path).id == plain.id
    said = []
    assert whatif.known_profile(d, tmp_path, say=said.append) is None
    assert said and "no timed steps" in said[0]


def test_a_speedup_from_steps_built_once_is_the_speedup():
    """speedup_grid and crossover_gbps build each spec's step once per worker count (predict.steps_for), not twice
    per rate: the same answers."""
    from commlab.lab.base.specs import load_spec
    from commlab.lab.strategy.perfmodel import calibrate as cal
    from commlab.lab.strategy.perfmodel import predict as pr
    prof = cal.Profile(model="cnn", dataset="digits", batch_size=32, params=[("b.bias", 40), ("b.weight", 5120),
                                                                             ("a.weight", 73728)],
                       forward_s=0.005, backward_s=0.006, optimizer_s=0.0005,
                       layer_ready={"b": 0.001, "a": 0.006}, layer_forward={"a": 0.003, "b": 0.002})
    spec = load_spec(data={"model": "cnn", "dataset": "digits", "schedule": "layerwise",
                           "compressor": {"name": "none"}, "comm": "sync"}).to_dict()
    for world in (2, 16):
        steps = pr.steps_for(prof, spec, world)
        for gbps in (0.1, 1.0, 10.0):
            assert pr.speedup(prof, spec, gbps, world, steps=steps) == pr.speedup(prof, spec, gbps, world)
