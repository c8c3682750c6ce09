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


def assert_trained(preset, group: dict, get) -> None:
    """Every run of ``group`` (a preset's) done, at the preset's accuracy floor and within its reference's."""
    v = results.evaluate(group, get)
    assert v.complete
    assert v.accuracy_ok is True, v.accuracy
    for x in v.variants.values():
        assert x.acc >= preset.accuracy_floor, (x.label, x.acc)


@pytest.mark.parametrize("key", [p.key for p in PRESETS if p.key != BROWSER_FOLLOWS or not browser_can_run()])
def test_preset_runs_train(tmp_path, key):
    preset = next(p for p in PRESETS if p.key == key)
    gid = groups.start_preset(preset, runs=tmp_path)
    group = results.load_group(tmp_path, gid)
    try:
        for rid in group["runs"].values():
            assert commlab.wait(rid, runs=tmp_path, timeout=600) == "done", commlab.get(rid, runs=tmp_path).log_tail()
    finally:
        for rid in group["runs"].values():
            if commlab.get(rid, runs=tmp_path).state not in ("done", "failed", "cancelled", "diverged"):
                commlab.cancel(rid, runs=tmp_path)
    assert_trained(preset, group, lambda rid: commlab.get(rid, runs=tmp_path))
