"""Every Home-page preset's runs train: started as the Start button starts them (one group, the lab's
queue), every run ends done, with held-out accuracy at the preset's useful level and within 2 points of
its reference variant (commlab.lab.analysis.results decides, as on the results page). Timings and the effects' ratios are
not checked here: they are measured by bench/presets.py."""
import importlib.util
import os

import pytest

import commlab
from commlab.lab.analysis import results
from commlab.lab.front import groups
from commlab.lab.analysis.presets import PRESETS

BROWSER_FOLLOWS = "countsketch-vs-topk"
"""tests/test_browser.py starts this preset with its Start button and follows it to its verdict, then checks it
with ``assert_trained``; it trains here only where that test cannot run (no chromium or no playwright)."""


def browser_can_run() -> bool:
    return os.path.exists("/usr/bin/chromium") and importlib.util.find_spec("playwright") is not None


def expected_state(preset, label: str) -> str:
    """done, but failed for a plug-pulling preset's run without fault tolerance (its worker's death ends it)."""
    return "failed" if preset.faults is not None and label == preset.faults.unprotected else "done"


def assert_trained(preset, group: dict, get) -> None:
    """Every run of ``group`` (a preset's) done (or failed where its preset says it must), at the preset's accuracy
    floor and within its reference's; a plug-pulling preset's faulted runs killed, recovered and back."""
    v = results.evaluate(group, get)
    assert v.complete
    assert v.accuracy_ok is True, v.accuracy
    assert all(c is True for c in v.fault_checks), v.lines
    for x in v.variants.values():
        assert x.state == expected_state(preset, x.label), (x.label, x.state)
        if x.state == "done":
            assert x.acc >= preset.accuracy_floor, (x.label, x.acc)
    if preset.faults is not None:
        for faulted, clean in preset.faults.pairs:
            ft = v.variants[faulted].ft
            assert ft["kills"] == 1 and ft["recoveries"] and all(x is not None for x in ft["rejoin_s"]), ft
            assert v.variants[clean].ft["kills"] == 0 and not v.variants[clean].ft["recoveries"]


def check_fault_results_page(group: dict, root) -> None:
    """The Results page of a plug-pulling preset's group: the faulted runs beside their twins, with their kills,
    recoveries and goodput in the table and the quorum by step drawn."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest
    at = AppTest.from_file(str(Path(commlab.__file__).parent / "app" / "streamlit_app.py"), default_timeout=120)
    at.query_params["group"] = group["id"]
    at.run().switch_page("views/results.py").run()
    assert not at.exception, [e.value for e in at.exception]
    text = "\n".join(m.value for m in at.markdown)
    assert "no fault tolerance, a kill: failed after" in text and "per-step sync, a kill: done; 1 kill" in text
    table = at.dataframe[0].value
    assert list(table.loc[["per-step sync, a kill", "per-step sync, no fault"], "kills"]) == [1, 0]
    assert table.loc["DiLoCo, a kill", "recoveries"] >= 1 and table["goodput"].notna().sum() == 4
    assert "Replica groups in each quorum, by step" in [h.value for h in at.subheader]


@pytest.mark.parametrize("key", [p.key for p in PRESETS if p.key != BROWSER_FOLLOWS or not browser_can_run()])
def test_preset_runs_train(tmp_path, key, monkeypatch):
    preset = next(p for p in PRESETS if p.key == key)
    gid = groups.start_preset(preset, runs=tmp_path)
    group = results.load_group(tmp_path, gid)
    try:
        for label, rid in group["runs"].items():
            assert commlab.wait(rid, runs=tmp_path, timeout=600) == expected_state(preset, label), \
                commlab.get(rid, runs=tmp_path).log_tail()
    finally:
        for rid in group["runs"].values():
            if commlab.get(rid, runs=tmp_path).state not in ("done", "failed", "cancelled", "diverged"):
                commlab.cancel(rid, runs=tmp_path)
    assert_trained(preset, group, lambda rid: commlab.get(rid, runs=tmp_path))
    if preset.faults is not None:
        monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
        check_fault_results_page(group, tmp_path)
