"""bench/ddp_compare.py --pool: the rounds of several saved runs reported as one run."""
import json

import pytest

from bench import ddp_compare as dc


def _saved(path, models):
    raw = {"models": {m: {"info": {"params": 10, "grad_mb": 0.1, "commlab_buckets": [10]},
                          "times_s": {v: [[t] * 3 for t in rounds[v]] for v in dc.VARIANTS}}
                      for m, rounds in models.items()}}
    path.write_text(json.dumps(raw))
    return str(path)


def test_pool_joins_every_round_of_every_file(tmp_path):
    r = {"ddp": [1.0] * 3, "commlab": [0.9, 1.2, 1.3], "commlab-notl": [1.0] * 3, "compute": [0.5] * 3}
    one = {"ddp": [1.0], "commlab": [0.95], "commlab-notl": [1.0], "compute": [0.5]}
    a = _saved(tmp_path / "a.json", {"cnn": r, "mlp": r})
    b = _saved(tmp_path / "b.json", {"cnn": one})
    pooled = dc.pool([a, b])
    assert len(pooled["models"]["cnn"]["times_s"]["commlab"]) == 4 and len(pooled["models"]["mlp"]["times_s"]["ddp"]) == 3
    text, summary = dc.report(pooled)
    # per-round ratios 0.9, 1.2, 1.3, 0.95: median 1.075 (neither file's alone: 1.2 and 0.95)
    assert summary["cnn"]["variants"]["commlab"]["round_ratio"] == pytest.approx(1.075)
    assert "cnn" in text and "MISSES" in text


def test_pool_refuses_a_file_that_is_not_a_saved_run(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="is not a ddp_compare --json file"):
        dc.pool([str(bad)])
