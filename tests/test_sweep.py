"""Sweeps: the product of a grid through the queue, a comparison table, resume, bad grids."""
import pytest

from commlab.engine.spec import SpecError
from commlab.lab.service.queue import Lab
from commlab.lab.front.sweep import Sweep

BASE = {"name": "sw", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 6, "batch_size": 16,
        "eval_every": 3, "threads": 1}


def test_sweep_runs_compares_and_resumes(tmp_path, capsys):
    q = Lab(tmp_path, max_jobs=1)
    data = {"name": "tiny", "base": BASE, "grid": {"compressor.name": ["none", "fp16"]}, "target_acc": 0.05}
    sw = Sweep(q, data=data)
    assert [c["key"] for c in sw.cells] == ["compressor.name=none", "compressor.name=fp16",
                                             "single process: mlp/digits/batch 16"]
    df = sw.run()
    assert list(df["state"]) == ["done"] * 3
    for col in ("iter_ms", "throughput", "scaling_factor", "bytes_per_step", "compression_ratio", "final_acc",
                "time_to_target_s"):
        assert df[col].notna().all(), col
    assert df.loc[df["cell"] == "compressor.name=fp16", "compression_ratio"].iloc[0] == pytest.approx(2.0)
    assert (sw.dir / "table.csv").is_file() and (sw.dir / "table.md").is_file()
    ids = set(df.index)
    # resume: the same grid again runs nothing new
    again = Sweep(q, data=data)
    assert again.id == sw.id
    df2 = again.run()
    assert set(df2.index) == ids and "3 already done" in capsys.readouterr().err
    assert {r["id"] for r in q.index.query(sweep=sw.id)} == ids


@pytest.mark.parametrize("data,where", [
    ({"base": BASE, "grid": {"compressor.name": ["none", "zip"]}}, "compressor.name=zip"),
    ({"base": BASE, "grid": {"steps": [5, -1]}}, "steps"),
    ({"base": BASE, "grid": {}}, "grid"),
    ({"base": BASE, "grid": {"steps": 5}}, "grid.steps"),
    ({"base": BASE, "grid": {"steps": [5]}, "colour": 1}, "colour"),
    ({"base": BASE, "grid": {"steps": [5]}, "target_acc": 2}, "target_acc"),
])
def test_bad_grids_are_rejected_before_anything_runs(tmp_path, data, where):
    with pytest.raises(SpecError) as e:
        Sweep(Lab(tmp_path), data=data)
    assert where in str(e.value) and "\n" not in str(e.value)
    assert not any(p for p in tmp_path.iterdir() if not p.name.startswith("."))
