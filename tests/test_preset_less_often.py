"""The "communicate less often" preset: its specs take H from the card's slider, its group remembers H, and its
verdict counts exchanges (at least H times fewer than DDP), the mean step with the syncs amortized, bytes and
the time to DDP's accuracy, from the runs' own metrics."""
from pathlib import Path

import pytest

import commlab
from commlab.lab.analysis import results
from commlab.lab.analysis.presets import get
from commlab.lab.base.errors import LabError
from commlab.lab.base.specs import load_spec
from commlab.lab.front import groups

PRESET = get("less-often")


def test_its_specs_take_h_and_are_valid():
    assert PRESET.check() is None
    for h in (2, 8, 32):
        specs = {d["name"].split(": ")[1]: load_spec(data=d).to_dict() for d in PRESET.specs({"H": h})}
        assert specs["DDP"]["method"]["name"] == "none"
        assert specs["local SGD"]["method"]["params"] == {"H": h}
        assert specs["DiLoCo"]["method"]["params"]["H"] == h
        assert all(s["network"] == {"link": "modeled", "gbps": 0.1, "latency_us": None, "cluster": None}
                   for s in specs.values())
    assert [d["method"]["H"] for d in PRESET.specs()[1:]] == [8, 8]  # the default
    with pytest.raises(ValueError, match=r"^H: must be an integer in 2\.\.32, got 1$"):
        PRESET.values({"H": 1})
    with pytest.raises(ValueError, match="^tau: preset less-often has no such knob"):
        PRESET.values({"tau": 1})
    with pytest.raises(LabError, match="H: must be"):
        groups.start_preset(PRESET, runs="/nonexistent", values={"H": 99})


class FakeRun:
    """A finished run whose steps take ``local_ms``, or ``sync_ms`` on a step that sends (every ``every``-th
    step, from the (every-1)-th), with held-out accuracy ``evals`` [(step, acc)]."""

    def __init__(self, rid, every, local_ms, sync_ms, evals, steps=40, method=None):
        self.id, self.state = rid, "done"
        self.rows = []
        for s in range(steps):
            sends = (s + 1) % every == 0
            for r in (0, 1):
                row = {"kind": "step", "step": s, "rank": r, "loss": 1.0, "time_ms": sync_ms if sends else local_ms,
                       "bytes_sent": 1000 if sends else 0, "bytes_raw": 1000, "t": 100.0 + s}
                if method:
                    row.update(method=method, **({"sync_bytes": 1000} if sends else {}))
                self.rows.append(row)
        self.rows += [{"kind": "eval", "step": s, "eval_acc": a, "eval_loss": 0.1, "t": 200.0} for s, a in evals]

    def status(self):
        return {"state": "done", "started": 100.0, "ended": 150.0}

    def spec_dict(self):
        return {"world_size": 2, "batch_size": 32, "steps": 40}

    def metric_rows(self):
        return self.rows

    def timeline_files(self):
        return []

    def timeline_events(self, last_steps=None):
        return []


def verdict(values):
    runs = {"DDP": FakeRun("a", 1, 100.0, 100.0, [(10, 0.6), (20, 0.9), (30, 0.95), (40, 0.97)]),
            "local SGD": FakeRun("b", 8, 40.0, 140.0, [(10, 0.5), (20, 0.85), (30, 0.96), (40, 0.965)],
                                 method="local_sgd"),
            "DiLoCo": FakeRun("c", 8, 40.0, 140.0, [(10, 0.5), (20, 0.95), (30, 0.96), (40, 0.97)],
                              method="diloco")}
    group = {"id": "g", "preset": PRESET.key, "created": 90.0, "runs": {k: r.id for k, r in runs.items()},
             "values": values}
    by_id = {r.id: r for r in runs.values()}
    return results.evaluate(group, by_id.__getitem__, breakdown_fn=lambda r: {})


def test_the_verdict_counts_exchanges_against_h_and_the_amortized_step():
    v = verdict({"H": 8})
    exchanges, diloco_step, local_step = v.effects
    # 40 DDP steps all exchange; a sync every 8 steps is 5 of 40: 8x fewer, against H = 8
    assert exchanges.ratio == 8.0 and exchanges.passed is True
    assert "DiLoCo 5 vs DDP 40 steps that exchanged; target at least 8x" in exchanges.line
    # the mean step after warm-up: (100 ms) against 35 local steps of 40 ms and 5 syncs of 140 ms
    assert diloco_step.ratio > 1.2 and diloco_step.passed and local_step.passed
    assert v.accuracy_ok is True and v.passed is True
    assert "run with H = 8" in v.lines
    line = next(x for x in v.lines if x.startswith("DiLoCo: 5 steps exchanged"))
    # DDP's final 97% less 2 points: DDP there at step 30 (30 x 100 ms = 3.0 s), DiLoCo at step 20: 18 local
    # steps of 40 ms before it and 2 syncs (steps 7 and 15) of 140 ms = 1.0 s
    assert "against DDP's 40 (8.0x fewer)" in line and "after 1.0 s of training against DDP's 3.0 s (3.00x sooner)" \
        in line and "125 B per step amortized against 1000 B (8.0x less)" in line
    # the claim is the paper's, before the measured verdict
    assert v.claim == PRESET.claim and "H times fewer exchanges" in v.claim


def test_a_larger_h_than_the_runs_had_misses_the_exchange_bound():
    v = verdict({"H": 16})
    assert v.effects[0].passed is False and v.passed is False
    assert "target at least 16x" in v.effects[0].line and "run with H = 16" in v.lines


def test_a_group_without_values_is_judged_at_the_defaults():
    assert "run with H = 8" in verdict(None).lines


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    yield tmp_path
    for r in commlab.runs(runs=tmp_path):  # nothing a test queued may outlive it
        if r.state in ("queued", "running"):
            commlab.cancel(r.id, runs=tmp_path)
            commlab.wait(r.id, runs=tmp_path, timeout=60)


def test_the_cards_h_slider_sets_the_runs_h(runs):
    """The Home page's card has an H slider; Start queues the three runs with that H and records it in the group,
    and the Results page says it (the runs are cancelled at once)."""
    from streamlit.testing.v1 import AppTest
    entry = str(Path(__file__).resolve().parents[1] / "commlab" / "app" / "streamlit_app.py")
    at = AppTest.from_file(entry, default_timeout=120).run()
    slider = at.slider(key=f"preset-{PRESET.key}-H")
    assert (slider.value, slider.min, slider.max) == (8, 2, 32) and slider.label.startswith("H")
    slider.set_value(16).run()
    at.button(key=f"preset-{PRESET.key}").click().run()
    assert not at.exception, [e.value for e in at.exception]
    gid = at.session_state["group_id"]
    group = groups.preset_group(gid, runs)
    ids = list(group["runs"].values())
    try:
        assert group["values"] == {"H": 16} and list(group["runs"]) == ["DDP", "local SGD", "DiLoCo"]
        params = {k: commlab.get(i, runs=runs).spec_dict()["method"] for k, i in group["runs"].items()}
        assert params["local SGD"]["params"]["H"] == 16 and params["DiLoCo"]["params"]["H"] == 16
        assert params["DDP"]["name"] == "none"
        assert [t.value for t in at.title] == ["Results"]
        assert any(PRESET.claim in m.value for m in at.markdown)
        assert any("run with H = 16" in m.value for m in at.markdown)
    finally:
        for i in ids:
            commlab.cancel(i, runs=runs)
        for i in ids:
            assert commlab.wait(i, runs=runs, timeout=120) in ("cancelled", "done")
