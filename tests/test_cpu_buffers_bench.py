"""bench/cpu_buffers.py end to end on loopback (no root): every variant timed, the table written. It asserts no
speed (the figures are in docs/benchmarks/gloo-exchange.md); that reused buffers are safe is
tests/test_comm_buffers.py's."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cpu_buffers as cb

ROOT = Path(__file__).resolve().parents[1]


def test_loopback_one_size_every_variant(tmp_path):
    out = tmp_path / "cb"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_buffers.py"), "--gbps", "0", "--sizes", "4",
                        "--rounds", "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    row = doc["rates"]["loopback"]["4"]
    for v in cb.VARIANTS:
        assert row[v]["median_ms"] > 0 and row[v]["min_ms"] <= row[v]["median_ms"] <= row[v]["max_ms"], v
    assert row["allgather speedup"] > 0 and row["reduce_scatter speedup"] > 0
    assert "| loopback | 4 |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("argv, said", [(["--sizes", "1"], "--sizes in 2..1024 MiB"),
                                        (["--gbps", "x"], "--gbps and --sizes: comma-separated numbers")])
def test_bad_arguments_are_one_line(argv, said):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_buffers.py"), *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and said in p.stderr.strip().splitlines()[-1]
