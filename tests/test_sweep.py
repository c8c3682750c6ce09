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


class _Run:
    """A queued run that is done after its state has been read three times."""

    def __init__(self, n: int):
        self.id, self.reads = f"run-{n}", 0

    @property
    def state(self) -> str:
        self.reads += 1
        return "done" if self.reads > 3 else "queued"


def test_a_sweep_keeps_its_slots_and_two_more_runs_queued(tmp_path, monkeypatch):
    """Each queued run has a supervisor process waiting for its place: a sweep submits a cell as one ends, never
    more than the lab's slots and AHEAD runs unfinished at once, and submits every cell once."""
    from commlab.lab.front import sweep as sweep_mod
    q = Lab(tmp_path, max_jobs=2)
    made, live_at_submit = [], []

    def submit(spec, wait=True, sweep=None, **kw):
        assert wait is False and sweep == sw.id
        live_at_submit.append(sum(r.reads <= 3 for r in made))  # unfinished, without reading (which ages them)
        made.append(_Run(len(made)))
        return made[-1]
    monkeypatch.setattr(q, "submit", submit)
    monkeypatch.setattr(q, "recover_stale", lambda: None)
    monkeypatch.setattr(Sweep, "table", lambda self, runs=None: runs)
    sw = Sweep(q, data={"base": BASE, "grid": {"seed": list(range(9))}, "baseline": False})
    runs = sw.run(poll_s=0)
    assert len(made) == 9 and sorted(runs.values()) == sorted(r.id for r in made)
    assert live_at_submit[:4] == [0, 1, 2, 3]  # the slots and AHEAD queued at once, the rest as runs end
    assert max(live_at_submit) == q.max_jobs + sweep_mod.AHEAD - 1, live_at_submit


def test_a_grid_of_more_than_max_cells_is_refused_before_any_is_checked(tmp_path, monkeypatch):
    from commlab.lab.front import sweep as sweep_mod
    monkeypatch.setattr(sweep_mod, "load_spec", lambda **kw: pytest.fail("a cell was checked"))
    with pytest.raises(SpecError) as e:
        Sweep(Lab(tmp_path), data={"base": BASE, "grid": {"seed": list(range(10)), "steps": list(range(1, 11)),
                                                          "batch_size": list(range(1, 11)), "lr": [1, 2]}})
    assert str(e.value) == ("grid: more than 1000 cells (the product of its lists' lengths, 10 x 10 x 10 x 2); a "
                            "sweep runs at most 1000")


@pytest.mark.parametrize("data,where", [
    ({"base": BASE, "grid": {"compressor.name": ["none", "zip"]}}, "compressor.name=zip"),
    ({"base": BASE, "grid": {"steps": [5, -1]}}, "steps"),
    ({"base": BASE, "grid": {}}, "grid"),
    ({"base": BASE, "grid": {"steps": 5}}, "grid.steps"),
    ({"base": BASE, "grid": {"steps": [5]}, "colour": 1}, "colour"),
    ({"base": BASE, "grid": {"steps": [5]}, "target_acc": 2}, "target_acc"),
    # more ranks than one run may start on this machine (commlab.lab.service.queue.max_ranks), after a cell that fits
    ({"base": BASE, "grid": {"world_size": [2, 1024]}}, "grid cell (world_size=1024): world_size: 1024 ranks on this "
                                                        "machine, more than the "),
])
def test_bad_grids_are_rejected_before_anything_runs(tmp_path, data, where):
    with pytest.raises(SpecError) as e:
        Sweep(Lab(tmp_path), data=data)
    assert where in str(e.value) and "\n" not in str(e.value)
    assert not any(p for p in tmp_path.iterdir() if not p.name.startswith("."))
