"""Figure builders on small hand-made frames: the traces they draw and the breakdown arithmetic."""
import math

import numpy as np
import pandas as pd
import pytest

from commlab.lab.analysis import plots


def span(rank, lane, name, start_ms, end_ms, **args):
    return {"rank": rank, "lane": lane, "name": name, "start_us": start_ms * 1e3,
            "dur_us": (end_ms - start_ms) * 1e3, **args}


def one_step(rank, step, t):
    """A wfbp-like step starting at t ms; see test_breakdown_by_hand for the expected figures."""
    return [
        span(rank, "step", f"step {step}", t + 1, t + 11, step=step),
        span(rank, "forward", "forward", t + 1, t + 3, step=step),
        span(rank, "forward", "fc1", t + 1, t + 2, layer="fc1"),
        span(rank, "forward", "fc2", t + 2, t + 3, layer="fc2"),
        span(rank, "backward", "backward", t + 3, t + 8, step=step),
        span(rank, "backward", "fc2", t + 3, t + 5, layer="fc2"),
        span(rank, "backward", "fc1", t + 5, t + 8, layer="fc1"),
        span(rank, "compress", "compress b0", t + 4, t + 4.5, bucket=0),
        span(rank, "comm", "allreduce b0", t + 4.5, t + 7, bucket=0, bytes=4096),
        span(rank, "comm", "allreduce b1", t + 7.5, t + 9, bucket=1, bytes=1024),
        span(rank, "wait", "wait b1", t + 8, t + 9, bucket=1),
        span(rank, "decompress", "decompress b0", t + 9, t + 9.2, bucket=0),
        span(rank, "optimizer", "optimizer", t + 9.3, t + 10.5, step=step),
        span(rank, "ready", "b0 ready", t + 4, t + 4, bucket=0),
    ]


@pytest.fixture
def timeline():
    rows = []
    for rank in (0, 1):
        for step in range(3):
            rows += one_step(rank, step, 20 * step + 0.3 * rank)
    rows.append(span(0, "eval", "eval", 62, 70, step=3, acc=0.5))  # between steps: belongs to none
    return pd.DataFrame(rows)


def test_assign_steps(timeline):
    df = plots.assign_steps(timeline)
    assert df.loc[df["lane"] == "eval", "it"].isna().all()
    assert sorted(df["it"].dropna().unique()) == [0, 1, 2]
    # every per-layer span falls in the step of its whole-phase span
    assert (df.groupby(["rank", "it"]).size() == 14).all()


def test_breakdown_by_hand(timeline):
    bd = plots.step_breakdown(timeline)
    assert len(bd) == 6 and set(bd["rank"]) == {0, 1}
    row = bd.iloc[0]
    # compute [1,8] + [9.3,10.5] minus compress [4,4.5] inside backward
    assert row["compute_ms"] == pytest.approx(7.0 + 1.2 - 0.5)
    assert row["compression_ms"] == pytest.approx(0.5 + 0.2)
    # comm [4.5,7] and [7.5,8] overlap backward; [8,9] is covered by comm and wait at once: counted once
    assert row["exposed_comm_ms"] == pytest.approx(1.0)
    assert row["hidden_comm_ms"] == pytest.approx(2.5 + 0.5)
    assert row["other_ms"] == pytest.approx(0.1 + 0.5)  # [9.2,9.3] and [10.5,11]
    total = bd[list(plots.PARTS)].sum(axis=1)
    np.testing.assert_allclose(total, bd["step_ms"], rtol=1e-9, atol=1e-6)


def test_breakdown_sums_with_overlapping_and_out_of_window_spans():
    rows = [span(0, "step", "step 0", 0, 10, step=0),
            span(0, "backward", "backward", 0, 6, step=0),
            span(0, "compress", "c", 1, 2, bucket=0), span(0, "compress", "c", 1.5, 2.5, bucket=1),
            span(0, "comm", "a", 5, 14, bucket=0), span(0, "wait", "w", 6, 9, bucket=0),
            span(0, "optimizer", "optimizer", 9, 9.5, step=0)]
    bd = plots.step_breakdown(pd.DataFrame(rows))
    r = bd.iloc[0]
    assert r[list(plots.PARTS)].sum() == pytest.approx(r["step_ms"])
    assert r["compression_ms"] == pytest.approx(1.5)  # [1, 2.5], not 2.0
    assert r["exposed_comm_ms"] == pytest.approx(3.0 + 0.5)  # comm clipped to the window at 10
    assert r["hidden_comm_ms"] == pytest.approx(1.0 + 0.5)  # [5, 6] under backward, [9, 9.5] under the optimizer


def test_mean_breakdown_keeps_the_sum(timeline):
    bd = plots.step_breakdown(timeline)
    m = plots.mean_breakdown(bd, skip=1)
    assert sum(m[p] for p in plots.PARTS) == pytest.approx(m["step_ms"])
    assert plots.mean_breakdown(pd.DataFrame()) == {}


def test_timeline_figure(timeline):
    fig = plots.timeline_figure(timeline, last=2)
    names = [t.name for t in fig.data if t.name]
    assert names == list(plots.LANE_ORDER)
    by = {t.name: t for t in fig.data if t.name}
    # forward and backward are drawn per layer: 2 layers x 2 steps x 2 ranks
    assert len(by["backward"].x) == 8 and set(by["backward"].customdata[:, 0]) == {"fc1", "fc2"}
    assert len(by["comm"].x) == 8
    assert "4,096" in set(by["comm"].customdata[:, 1])
    assert set(by["comm"].y[0]) == {"rank 0", "rank 1"}
    # the invisible first trace orders every (rank, lane) row
    assert len(fig.data[0].y[0]) == 2 * len(plots.LANE_ORDER)
    labels = [b.label for b in fig.layout.updatemenus[0].buttons]
    assert labels == ["all shown", "step 1", "step 2"]
    # the step filter draws one iteration only
    one = plots.timeline_figure(timeline, step=0)
    assert {int(s) for s in next(t for t in one.data if t.name == "comm").customdata[:, 3]} == {0}


def test_timeline_figure_empty():
    assert plots.timeline_figure(pd.DataFrame()).layout.annotations
    assert plots.breakdown_figure(pd.DataFrame()).layout.annotations


def test_breakdown_figure_stacks_to_step_time(timeline):
    bd = plots.step_breakdown(timeline)
    fig = plots.breakdown_figure(bd)
    stack = [t for t in fig.data if t.offsetgroup == "step"]
    assert [t.name for t in stack] == [plots.PART_LABELS[p] for p in plots.PARTS]
    top = np.asarray(stack[-1].base, float) + np.asarray(stack[-1].y, float)
    want = bd.groupby("step")["step_ms"].mean().to_numpy()
    np.testing.assert_allclose(top, want, rtol=1e-9)
    assert any(t.offsetgroup == "hidden" for t in fig.data)


def test_breakdown_bars_per_run(timeline):
    bd = plots.step_breakdown(timeline)
    df = pd.DataFrame([plots.mean_breakdown(bd), plots.mean_breakdown(bd[bd["rank"] == 0])], index=["a", "b"])
    fig = plots.breakdown_bars_figure(df)
    assert len(fig.data) == len(plots.PARTS) + 1
    assert list(fig.data[0].y) == ["a", "b"]


@pytest.fixture
def metrics():
    steps = [{"kind": "step", "step": s, "rank": r, "loss": 2.0 - 0.1 * s + 0.01 * r, "time_ms": 10.0,
              "bytes_sent": 100 + r, "bytes_raw": 1000, "t": 100.0 + 0.01 * (s + 1)}
             for s in range(10) for r in (0, 1)]
    evals = [{"kind": "eval", "step": s, "rank": 0, "eval_loss": 1.5, "eval_acc": 0.1 * s, "t": 100.0 + 0.01 * s + 0.005}
             for s in (5, 10)]
    return pd.DataFrame(steps), pd.DataFrame(evals)


def test_curves_figure(metrics):
    m, e = metrics
    fig = plots.curves_figure(m, e)
    assert [t.name for t in fig.data] == ["train loss", "eval loss", "eval accuracy"]
    assert list(fig.data[0].x) == list(range(10))
    assert fig.data[0].y[0] == pytest.approx(2.005)
    wall = plots.curves_figure(m, e, x="wall")
    assert wall.data[0].x[0] == pytest.approx(0.01)  # first step ends 10 ms after training starts
    assert wall.data[2].x[-1] == pytest.approx(0.105)
    with pytest.raises(ValueError):
        plots.curves_figure(m, e, x="epoch")


def test_bytes_figure(metrics):
    fig = plots.bytes_figure(metrics[0])
    assert [t.name for t in fig.data] == ["sent (per rank)", "uncompressed"]
    assert fig.data[0].y[0] == pytest.approx(100.5)


def test_accuracy_vs_time_and_scaling():
    curves = pd.DataFrame({"run": ["a", "a", "b"], "wall_s": [1.0, 2.0, 1.5], "eval_acc": [0.5, 0.8, 0.6]})
    assert [t.name for t in plots.accuracy_vs_time_figure(curves).data] == ["a", "b"]
    table = pd.DataFrame({"name": ["x", "y"], "scaling_factor": [0.9, None]}, index=["run-aaaa", "run-bbbb"])
    fig = plots.scaling_figure(table)
    assert list(fig.data[0].y) == [0.9]
    assert plots.scaling_figure(table.assign(scaling_factor=None)).layout.annotations


def test_sweep_heatmap_speedup():
    df = pd.DataFrame({"compressor": ["none", "none", "topk", "topk"], "schedule": ["layerwise", "bucket"] * 2,
                       "iter_ms": [20.0, 10.0, 10.0, 20.0]})
    fig = plots.sweep_heatmap(df, x="schedule", y="compressor", baseline="none")
    z = np.asarray(fig.data[0].z, float)
    assert list(fig.data[0].y) == ["none", "topk"] and list(fig.data[0].x) == ["layerwise", "bucket"]
    np.testing.assert_allclose(z, [[1.0, 1.0], [2.0, 0.5]])
    raw = plots.sweep_heatmap(df, x="schedule", y="compressor")
    np.testing.assert_allclose(np.asarray(raw.data[0].z, float), [[20, 10], [10, 20]])
    assert plots.sweep_heatmap(df.iloc[:0], x="schedule", y="compressor").layout.annotations
    assert math.isclose(plots.sweep_heatmap(df, "schedule", "compressor", value="iter_ms",
                                            baseline="none", higher_is_better=True).data[0].z[1][0], 0.5)


def test_curves_figure_without_training_loss(metrics):
    """An own loop that gave comm.step() no loss (null in every step line): the accuracy and eval loss alone."""
    m, e = metrics
    fig = plots.curves_figure(m.assign(loss=None), e)
    assert [t.name for t in fig.data] == ["eval loss", "eval accuracy"]
