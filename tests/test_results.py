"""Presets and their verdicts (commlab.lab.analysis.presets, commlab.lab.analysis.results): pure, on fake runs with made-up
metrics, so each rule (ratios against bounds, accuracy against the reference and the floor, pending and failed
runs, the explanation of a miss) is checked on its own; plus every preset's specs."""

import pytest

from commlab.lab.analysis import results
from commlab.lab.analysis.presets import ACCURACY_POINTS, PRESETS, Effect, Preset, get
from commlab.lab.base.specs import load_spec


class FakeRun:
    def __init__(self, rid, iter_ms, acc, state="done", steps=20, bytes_sent=1000, raw=4000, disturbance=None,
                 ended=None):
        self.id, self.state = rid, state
        self._status = {"state": state, "started": 100.0, "ended": ended}
        if disturbance:
            self._status["disturbance"] = disturbance
        self.rows = [{"kind": "step", "step": s, "rank": r, "loss": 1.0, "time_ms": iter_ms, "bytes_sent": bytes_sent,
                      "bytes_raw": raw, "t": 100.0 + s} for s in range(steps) for r in (0, 1)]
        if acc is not None:
            self.rows.append({"kind": "eval", "step": steps - 1, "eval_acc": acc, "eval_loss": 0.1, "t": 200.0})

    def status(self):
        return self._status

    def spec_dict(self):
        return {"world_size": 2, "batch_size": 8, "steps": 20}

    def metric_rows(self):
        return self.rows

    def timeline_files(self):
        return []

    def timeline_events(self, last_steps=None):
        return []


def bd(compute, exposed, compression=0.0, other=0.0, hidden=0.0):
    return {"compute_ms": compute, "compression_ms": compression, "exposed_comm_ms": exposed, "other_ms": other,
            "hidden_comm_ms": hidden, "step_ms": compute + exposed + compression + other}


def verdict(key, runs, breakdowns=None, created=90.0):
    group = {"id": "g", "preset": key, "created": created, "runs": {label: r.id for label, r in runs.items()}}
    by_id = {r.id: r for r in runs.values()}
    label_of = {r.id: label for label, r in runs.items()}
    return results.evaluate(group, lambda rid: by_id[rid],
                            breakdown_fn=lambda r: (breakdowns or {}).get(label_of[r.id], {}))


def test_every_preset_is_valid_and_declares_its_answer():
    for p in PRESETS:
        assert p.check() is None, p.key
        assert p.claim and p.reference in p.variants, p.key
        for e in p.effects:
            assert e.faster in p.variants and e.slower in p.variants, (p.key, e.text)
            assert (e.at_least is None) != (e.at_most is None), (p.key, e.text)
        for d in p.specs():
            spec = load_spec(data=d)
            assert spec.world_size == 2 and spec.eval_every > 0  # every run evaluates: its accuracy is checked
    assert {p.key for p in PRESETS} >= {"layerwise-vs-mergecomp", "dear-vs-ddp", "compression-links",
                                        "countsketch-vs-topk"}
    # the papers' settings that the answers depend on
    assert get("dear-vs-ddp").variants["dear"]["network"] == {"link": "modeled", "gbps": 1}
    cs = get("countsketch-vs-topk").variants["countsketch"]
    assert cs["compressor"]["name"] == "countsketch" and cs["schedule"]["name"] == "layerfusion"
    with pytest.raises(KeyError, match="allowed"):
        get("nope")


def test_ratio_meets_or_misses_the_bound():
    ok = verdict("dear-vs-ddp", {"dear": FakeRun("a", 100, 0.95), "ddp": FakeRun("b", 150, 0.95)})
    (e,) = ok.effects
    assert e.ratio == pytest.approx(1.5) and e.passed is True and ok.passed is True
    assert "1.50x" in e.line and "dear 100.0 ms vs ddp 150.0 ms" in e.line
    miss = verdict("dear-vs-ddp", {"dear": FakeRun("a", 100, 0.95), "ddp": FakeRun("b", 110, 0.95)},
                   {"dear": bd(80, 15, hidden=40), "ddp": bd(60, 45, hidden=10)})
    (e,) = miss.effects
    assert e.passed is False and miss.passed is False
    # the explanation names the parts that differ, with both figures
    assert "compute 80.0 vs 60.0 ms" in e.why and "exposed communication 15.0 vs 45.0 ms" in e.why
    assert any(line.startswith("Why it missed") for line in miss.lines)


def test_at_most_bound_for_an_effect_that_should_be_absent():
    runs = {"none @ 0.1 Gbit/s": FakeRun("a", 50, 0.99), "top-k @ 0.1 Gbit/s": FakeRun("b", 8, 0.98),
            "none @ 10 Gbit/s": FakeRun("c", 7, 0.99), "top-k @ 10 Gbit/s": FakeRun("d", 8, 0.98)}
    v = verdict("compression-links", runs)
    slow, fast = v.effects
    assert slow.ratio == pytest.approx(50 / 8) and slow.passed
    assert fast.ratio == pytest.approx(7 / 8) and fast.passed  # compression does not pay on the fast link
    runs["top-k @ 10 Gbit/s"] = FakeRun("d", 6, 0.98)
    assert verdict("compression-links", runs).effects[1].passed is False


def test_accuracy_against_reference_and_floor():
    ref = 0.95
    near = verdict("dear-vs-ddp", {"dear": FakeRun("a", 100, ref - ACCURACY_POINTS + 0.001),
                                   "ddp": FakeRun("b", 150, ref)})
    assert near.accuracy_ok is True
    far = verdict("dear-vs-ddp", {"dear": FakeRun("a", 100, ref - ACCURACY_POINTS - 0.01),
                                  "ddp": FakeRun("b", 150, ref)})
    assert far.accuracy_ok is False and far.passed is False
    assert "more than 2 points below ddp" in " ".join(far.accuracy)
    low = verdict("dear-vs-ddp", {"dear": FakeRun("a", 100, 0.5), "ddp": FakeRun("b", 150, 0.5)})
    assert low.accuracy_ok is False and "below the useful level 90%" in " ".join(low.accuracy)


def test_pending_runs_give_no_verdict_yet_and_failures_are_named():
    v = verdict("dear-vs-ddp", {"dear": FakeRun("a", 100, None, state="running"), "ddp": FakeRun("b", 150, None,
                                                                                             state="queued", steps=0)})
    assert not v.complete and v.passed is None and v.wall_s is None
    assert v.effects[0].passed is None
    bad = verdict("dear-vs-ddp", {"dear": FakeRun("a", 100, 0.1, state="diverged"), "ddp": FakeRun("b", 150, 0.95)})
    assert bad.passed is False and any("dear did not finish (diverged)" in n for n in bad.notes)


def test_wall_time_is_from_the_click_to_the_last_end_and_disturbance_is_reported():
    v = verdict("dear-vs-ddp", {"dear": FakeRun("a", 100, 0.95, ended=130.0),
                                "ddp": FakeRun("b", 150, 0.95, ended=160.0,
                                               disturbance={"disturbed": True, "other_cpu": 0.4,
                                                            "other_cores": 0.8, "cpus": 2, "threshold": 0.1})}, created=90.0)
    assert v.wall_s == pytest.approx(70.0)
    assert v.disturbed[0].startswith("ddp: other processes used 40% of the CPU")
    assert any("disturbed" in n for n in v.notes)


def test_bytes_and_compression_are_the_runs_own():
    v = verdict("countsketch-vs-topk", {"countsketch": FakeRun("a", 15, 0.955, bytes_sent=127176, raw=605224),
                                        "topk": FakeRun("b", 8, 0.98, bytes_sent=12112, raw=605224)})
    text = "\n".join(v.lines)
    assert "countsketch: sends 124.20 KB per step per rank (compression 4.8x)" in text
    assert "topk: sends 11.83 KB per step per rank (compression 50.0x)" in text
    assert v.accuracy_ok is False  # 95.5% is more than 2 points below top-k's 98%
    # all-reduced table vs all-gathered top-k: 2(p-1)/p x 127176 < (p-1) x 12112 iff p > 2 x 127176 / 12112 = 21.0
    assert "countsketch sends less from 22 workers on" in text
    assert "2 workers 124.20 KB vs 11.83 KB" in text


def test_groups_round_trip_and_refuse_bad_ids(tmp_path):
    gid = results.save_group(tmp_path, "dear-vs-ddp", {"dear": "r1", "ddp": "r2"}, created=5.0)
    assert gid == "r1"
    g = results.load_group(tmp_path, gid)
    assert g["runs"] == {"dear": "r1", "ddp": "r2"} and g["created"] == 5.0
    assert [x["id"] for x in results.list_groups(tmp_path)] == ["r1"]
    with pytest.raises(KeyError, match="no group"):
        results.load_group(tmp_path, "missing")
    for bad in ("../etc", "a/b", ".hidden", ""):
        with pytest.raises(Exception, match="not valid"):
            results.load_group(tmp_path, bad)
    (tmp_path / "groups" / "torn.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        results.load_group(tmp_path, "torn")
    listed = {x["id"]: x for x in results.list_groups(tmp_path)}
    assert "error" in listed["torn"]  # reported, not skipped


def test_sweep_groups_rank_their_cells():
    group = {"id": "s", "preset": None, "title": "sweep x", "created": None,
             "runs": {"compressor=none": "a", "compressor=topk": "b"}}
    by_id = {"a": FakeRun("a", 20, 0.9), "b": FakeRun("b", 10, 0.9)}
    v = results.evaluate(group, by_id.__getitem__, breakdown_fn=lambda r: {})
    assert v.title == "sweep x" and not v.effects
    assert any("fastest: compressor=topk (10.0 ms per iteration), 2.00x faster" in line for line in v.lines)


def test_a_custom_preset_with_its_own_effect():
    p = Preset("x", "X", "q", {"a": {}, "b": {}}, claim="c", reference="a",
               effects=[Effect("b over a", "b", "a", at_least=3.0)])
    assert p.labels() == ["a", "b"] and [d["name"] for d in p.specs()] == ["x: a", "x: b"]
