"""The performance model's prediction of the methods that communicate less often (commlab/lab/strategy/perfmodel/local.py
and predict.predict_method), against hand-computed cases on a tiny profile.

The profile (tests/test_perfmodel.py's): forward 2 ms, backward 4 ms, optimizer 0.5 ms (compute Y = 6.5 ms per
step), four tensors of 400,000 + 400 + 40,000 + 40 bytes (B = 440,440) in registration order fc1.weight, fc1.bias,
fc2.weight, fc2.bias. On a nominal link of r Gbit/s a two-rank ring all-reduce of n bytes takes n * 8 / r ns."""
import pytest

from commlab.lab.strategy.perfmodel import costs
from commlab.lab.strategy.perfmodel import predict as pr
from commlab.lab.strategy.perfmodel import whatif

B = 440_440
Y = 6.5e-3
OPT = 0.5e-3


def profile(**kw):
    from commlab.lab.strategy.perfmodel.calibrate import Profile
    p = Profile(model="mlp", dataset="digits", batch_size=16, source="test",
                params=[("fc2.bias", 40), ("fc2.weight", 40_000), ("fc1.bias", 400), ("fc1.weight", 400_000)],
                forward_s=2e-3, backward_s=4e-3, optimizer_s=OPT,
                layer_forward={"fc1": 1.5e-3, "fc2": 0.5e-3}, layer_ready={"fc2": 1e-3, "fc1": 4e-3})
    p.__dict__.update(kw)
    return p


def spec(name="none", steps=8, method_compressor=None, **params):
    return {"model": {"name": "mlp", "options": {}}, "dataset": {"name": "digits"}, "batch_size": 16, "steps": steps,
            "compressor": {"name": "none", "params": {}, "error_feedback": False, "per_bucket": []},
            "schedule": {"name": "bucket", "cap_mb": 25.0}, "comm": {"mode": "sync"},
            "method": {"name": name, "params": params, "compressor": method_compressor or {}}}


def allreduce(n, gbps, world=2):
    return costs.allreduce(n, world, costs.Link.from_gbps(gbps))


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def test_local_sgd_is_compute_with_one_exchange_every_h_steps():
    # H = 4: three local steps of Y, then Y + X: (3Y + Y + X) / 4 per step, over a run of 8 steps
    r = pr.predict(profile(), spec("local_sgd", H=4), 0.1, 2)
    x = allreduce(B, 0.1)
    assert x == approx(B * 8 / 0.1e9)
    assert r.total == approx((3 * Y + Y + x) / 4)
    assert r.syncs == 2 and r.bytes_per_sync == B and r.bytes_per_step == approx(B / 4)
    assert r.step_s == {"local": approx(Y), "sync": approx(Y + x)}
    assert r.compute == approx(Y) and r.exposed_comm == approx(x / 4) and r.link_busy == approx(x / 4)
    # a run that ends mid-period pays for the syncs it has: 10 steps, syncs after steps 3 and 7
    assert pr.predict(profile(), spec("local_sgd", steps=10, H=4), 0.1, 2).total == approx((10 * Y + 2 * x) / 10)


def test_diloco_adds_its_outer_step_and_compresses_its_pseudo_gradient():
    # the outer SGD step costs the optimizer's step: (4Y + X + OPT) / 4
    r = pr.predict(profile(), spec("diloco", H=4), 1, 2)
    assert r.total == approx((4 * Y + allreduce(B, 1) + OPT) / 4)
    # through int8: the payload is the codec's (a quarter of the raw bytes and its scales), its curve measured
    p = profile()
    s = spec("diloco", H=4, method_compressor={"name": "int8", "params": {}, "error_feedback": False,
                                               "per_bucket": []})
    with pytest.raises(KeyError, match="int8"):
        pr.predict(p, s, 1, 2)
    assert whatif.ensure_curves(p, [s]) == 1 and "int8" in p.compressors
    q = pr.predict(p, s, 1, 2)
    assert B / 4 <= q.bytes_per_sync < B / 3
    assert q.encode_decode > 0


def test_streaming_diloco_hides_a_fragment_behind_its_tau_steps():
    """H 4, 2 fragments, tau 1: fragment 0 (fc1.weight, 400,000 bytes) is issued after step 0 and applied after
    step 1; fragment 1 (the other three, 40,440 bytes) issued after step 2, applied after step 3. Each apply
    adds the outer step (0.5 ms)."""
    s = spec("streaming_diloco", H=4, fragments=2, tau=1, alpha=0.5)
    # 1 Gbit/s: 3.2 ms and 0.32 ms in flight, both shorter than a step: nothing is exposed
    fast = pr.predict(profile(), s, 1, 2)
    assert fast.total == approx(Y + 2 * OPT / 4)
    assert fast.bytes_per_sync == approx(B / 2) and fast.syncs == 4
    # 0.1 Gbit/s: fragment 0 takes 32 ms. Step 0 ends at 6.5 (issued, done 38.5); step 1 waits until 38.5,
    # + outer = 39.0; step 2 ends 45.5 (fragment 1 done 48.7352); step 3 52.0 + 0.5; step 4 ends 59.0
    # (done 91.0); step 5 waits until 91.0 + 0.5; step 6 ends 98.0 (done 101.2352); step 7 104.5 + 0.5 = 105.0
    slow = pr.predict(profile(), s, 0.1, 2)
    assert slow.total == approx(105.0e-3 / 8)
    # tau = 0 (DiLoCo's blocking sync, in two fragments): every transfer is exposed
    blocking = pr.predict(profile(), spec("streaming_diloco", H=4, fragments=2, tau=0), 1, 2)
    assert blocking.total == approx((8 * Y + 2 * (allreduce(400_000, 1) + allreduce(40_440, 1)) + 4 * OPT) / 8)


def test_post_local_sgd_pays_the_synchronous_step_in_its_warm_up():
    # warmup 4: four steps of the spec's synchronous step G; then three local steps and one with the average
    p = profile()
    g = pr.predict(p, spec(), 0.1, 2).total
    assert g == approx(Y + allreduce(B, 0.1))  # one 25 MB bucket after backward (sync)
    r = pr.predict(p, spec("post_local_sgd", warmup=4, H=4), 0.1, 2)
    assert r.total == approx((4 * g + 4 * Y + allreduce(B, 0.1)) / 8)
    assert r.bytes_per_step == approx((4 * B + B) / 8) and r.syncs == 1


def test_demo_all_gathers_its_components_every_step():
    """chunk 64, top 4: 1 + 157 + 2 + 1563 = 1723 chunks over the four tensors, 4 values (4 bytes) and 4
    positions (int16) each: 41,352 bytes per step, all-gathered with no header (a fixed payload)."""
    key = "demo:dct_topk(chunk=64,topk=4)+EF"
    p = profile(compressors={key: {"encode": [1e-3, 0.0], "between": [0.0, 0.0], "decode": [2e-3, 0.0]}})
    s = spec("demo", topk=4, chunk=64)
    assert pr.codec_key(pr.method_of(s)) == key
    r = pr.predict(p, s, 1, 2)
    assert r.bytes_per_step == 41_352 and r.syncs == 8
    gather = costs.allgather(41_352, 2, costs.Link.from_gbps(1))
    assert r.total == approx(Y + 1e-3 + gather + 2e-3)
    # without a curve the codec is timed here, in process, like a compressor's
    q = profile()
    whatif.ensure_curves(q, [s])
    assert key in q.compressors and pr.predict(q, s, 1, 2).encode_decode > 0


def test_one_worker_sends_nothing_and_ddp_has_no_method():
    assert pr.predict(profile(), spec("diloco", H=4), 0.1, 1).total == approx(Y)
    s = spec("local_sgd", H=8)
    assert pr.ddp_spec(s)["method"]["name"] == "none" and s["method"]["name"] == "local_sgd"
    # local SGD beats DDP on a slow link, and by about H on the exchange
    assert pr.speedup(profile(), s, 0.1, 2) > 3
    assert pr.speedup(profile(), s, 400, 2) == pytest.approx(1.0, abs=0.01)


def test_bad_method_parameters_are_one_line_spec_errors():
    from commlab.engine.spec import SpecError
    with pytest.raises(SpecError, match=r"method\.H"):
        pr.predict(profile(), spec("local_sgd", H=0), 1, 2)
    with pytest.raises(SpecError, match=r"method\.fragments"):  # five fragments of a four-tensor model
        pr.predict(profile(), spec("streaming_diloco", H=8, fragments=5, tau=0), 1, 2)


def test_predict_cli_prints_a_methods_amortized_step_and_traffic(tmp_path, capsys):
    from commlab.lab.front.cli import main
    f = tmp_path / "s.yaml"
    f.write_text("model: mlp\nbatch_size: 16\nsteps: 8\ncomm: {mode: sync}\nmethod: {name: local_sgd, H: 4}\n")
    profile().save(tmp_path / "p.json")
    assert main(["predict", str(f), "--gbps", "0.1", "--workers", "2", "--profile", str(tmp_path / "p.json"),
                 "--runs", str(tmp_path), "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    (row,) = out["rows"]
    assert row["spec_ms"] == pytest.approx((4 * Y + allreduce(B, 0.1)) / 4 * 1e3)
    assert row["syncs"] == 2 and row["bytes_per_sync"] == B and "method local_sgd(H=4)" in out["setup"]
    assert any(s.startswith("method local_sgd") for s in out["sources"])
    assert main(["predict", str(f), "--gbps", "0.1", "--workers", "2", "--profile", str(tmp_path / "p.json"),
                 "--runs", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "MiB/SYNC" in text and "syncs amortized" in text
    f.write_text(f.read_text().replace("H: 4", "H: 0"))
    assert main(["predict", str(f), "--profile", str(tmp_path / "p.json"), "--runs", str(tmp_path)]) == 2
    assert "method.H" in capsys.readouterr().err


def test_diloco_overlap_hides_its_all_reduce_behind_the_next_h_steps():
    """H 4, 12 steps, 1 Gbit/s (X = 3.52 ms, shorter than 4 steps), overlap delayed: sync 3 is issued after step 3
    and waited for after step 7, sync 7 after step 11, sync 11 drained at the end: 12Y + 2 OPT for the outer steps
    of syncs 3 and 7, then the wait for sync 11 past the second outer step: (12Y + OPT + X) / 12. Blocking
    (overlap none): (12Y + 3X + 3 OPT) / 12."""
    x = allreduce(B, 1)
    assert OPT < x < 4 * Y
    for mode in ("delayed", "eager"):
        r = pr.predict(profile(), spec("diloco", steps=12, H=4, overlap=mode), 1, 2)
        assert r.total == approx((12 * Y + OPT + x) / 12) and r.syncs == 3
    blocking = pr.predict(profile(), spec("diloco", steps=12, H=4), 1, 2)
    assert blocking.total == approx((12 * Y + 3 * x + 3 * OPT) / 12)


def test_sparseloco_is_priced_through_its_own_codec():
    """The whole model in one group, 110,110 fp32 elements: 26 chunks of 4096 keep 64 each, the last 3,614
    keep ceil(64 * 3614 / 4096) = 57: 1,721 entries, 27 scales: 108 + 3,442 + 431 = 3,981 bytes, all-gathered
    (a fixed payload: no header first); encode 1 ms and decode 2 ms per payload from its curve, the outer step OPT."""
    key = "sparseloco:topk_2bit(chunk=4096,k=64)+EF"
    p = profile(compressors={key: {"encode": [1e-3, 0.0], "between": [0.0, 0.0], "decode": [2e-3, 0.0]}})
    s = spec("sparseloco", H=4)
    assert pr.codec_key(pr.method_of(s)) == key
    r = pr.predict(p, s, 1, 2)
    assert r.bytes_per_sync == 3_981 and r.syncs == 2
    link = costs.Link.from_gbps(1)
    gather = costs.allgather(3_981, 2, link)
    assert r.total == approx((8 * Y + 2 * (1e-3 + gather + 2 * 2e-3 + OPT)) / 8)
    q = profile()  # without a curve the codec is timed here, in process
    whatif.ensure_curves(q, [s])
    assert key in q.compressors and pr.predict(q, s, 1, 2).encode_decode > 0
