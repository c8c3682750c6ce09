"""bench/gloo_exchange.py end to end on one shaped link (root): every variant timed, the table written. It
asserts no speed: tests do not time things (the figures are in docs/benchmarks/gloo-exchange.md); that the
engine's exchanges are chunked is tests/test_comm_seam.py's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gloo_exchange as gx
from distutil import shaped_unavailable

ROOT = Path(__file__).resolve().parents[1]


_WHY_NOT = shaped_unavailable()


@pytest.mark.skipif(_WHY_NOT is not None, reason=f"shaped links unavailable: {_WHY_NOT}")
def test_one_rate_one_size_every_variant(tmp_path):
    out = tmp_path / "gx"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gloo_exchange.py"), "--gbps", "10", "--sizes", "8",
                        "--rounds", "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["chunk_bytes"] == 2 << 20 and list(doc["rates"]) == ["10"]
    row = doc["rates"]["10"]["8"]
    for v in gx.VARIANTS:
        assert row[v]["median_ms"] > 0 and row[v]["min_ms"] <= row[v]["median_ms"] <= row[v]["max_ms"], v
    assert row["rate floor ms"] == pytest.approx(4 * (1 << 20) * 8 / 10e9 * 1e3)
    assert "| 10 | 8 |" in out.with_suffix(".md").read_text()


def test_bad_arguments_are_one_line(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gloo_exchange.py"), "--sizes", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--sizes in 1..1024 MiB" in p.stderr.strip().splitlines()[-1]
