"""Plotly figures of runs: pure functions from DataFrames to ``go.Figure``.

The Streamlit app and the notebooks share them. Inputs are the frames the
Python API returns, so a notebook can do::

    from commlab.lab.analysis import plots
    r = commlab.get(run_id)
    plots.timeline_figure(r.timeline(), last=3)
    plots.breakdown_figure(plots.step_breakdown(r.timeline()))
    plots.curves_figure(r.metrics(), r.metrics("eval"), x="wall")

Frames used here:

- timeline: ``Run.timeline()``: rank, lane, name, start_us, dur_us, and the
  span args (layer, bucket, bytes, step, ...). Whole-step spans (lanes step,
  forward, backward, optimizer) carry ``step``; per-layer spans carry ``layer``.
- metrics: ``Run.metrics()``: step, rank, loss, time_ms, bytes_sent, bytes_raw, t.
- evals: ``Run.metrics("eval")``: step, eval_loss, eval_acc, t.
- a comparison table: ``commlab.compare(...)``.

Nothing here reads files or imports the engine: every function is a function
of its arguments, so each can be tested on a hand-made frame.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

# Lanes drawn by the timeline, top to bottom within a rank's group.
LANE_ORDER = ("forward", "backward", "compress", "comm", "wait", "decompress", "optimizer")
LANE_COLORS = {
    "forward": "#4C78A8", "backward": "#72B7B2", "compress": "#F58518", "comm": "#E45756",
    "wait": "#B279A2", "decompress": "#EECA3B", "optimizer": "#54A24B",
}
# The step-time breakdown: the four parts that add up to the step time, then the overlapped part.
PARTS = ("compute_ms", "compression_ms", "exposed_comm_ms", "other_ms")
PART_LABELS = {"compute_ms": "compute", "compression_ms": "compression", "exposed_comm_ms": "exposed communication",
               "other_ms": "other (framework, gaps)", "hidden_comm_ms": "hidden communication (overlapped)"}
PART_COLORS = {"compute_ms": "#4C78A8", "compression_ms": "#F58518", "exposed_comm_ms": "#E45756",
               "other_ms": "#BAB0AC", "hidden_comm_ms": "#72B7B2"}

COMPUTE_LANES = ("forward", "backward", "optimizer")
HOOK_LANES = ("compress", "decompress")
COMM_LANES = ("comm", "wait")


def plain(text) -> str:
    """User text (a run's name, a spec's label) for a Plotly label, title or hover text: no tags, which Plotly
    draws (<a href>, <b>, <span style>). Plotly reads no Markdown, so nothing else is escaped; what
    Streamlit renders as Markdown takes commlab.lab.front.ui.text instead."""
    return str(text).replace("<", "\u2039").replace(">", "\u203a")


def empty_figure(message: str, height: int = 240) -> go.Figure:
    """A blank figure that says why it is blank (no data yet, nothing selected)."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 14, "color": "#777"})
    fig.update_layout(height=height, xaxis={"visible": False}, yaxis={"visible": False},
                      margin={"l": 20, "r": 20, "t": 30, "b": 20})
    return fig


# --------------------------------------------------------------------------- timeline

def assign_steps(tl: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``tl`` with ``it``: the step whose window (its ``step`` span on the same rank)
    contains the span's start, or NaN (eval spans, spans of a step not yet written)."""
    out = tl.copy()
    out["it"] = np.nan
    if out.empty or "lane" not in out:
        return out
    steps = out[out["lane"] == "step"]
    for rank, spans in steps.groupby("rank"):
        spans = spans.sort_values("start_us")
        starts = spans["start_us"].to_numpy(float)
        ends = starts + spans["dur_us"].to_numpy(float)
        nums = _step_numbers(spans)
        mask = out["rank"] == rank
        s = out.loc[mask, "start_us"].to_numpy(float)
        idx = np.searchsorted(starts, s + 1.0, side="right") - 1  # 1 us slack for rounding
        ok = (idx >= 0) & (s < ends[np.clip(idx, 0, None)])
        out.loc[mask, "it"] = np.where(ok, nums[np.clip(idx, 0, None)], np.nan)
    return out


def _step_numbers(spans: pd.DataFrame) -> np.ndarray:
    if "step" in spans and spans["step"].notna().all():
        return spans["step"].to_numpy(float)
    return spans["name"].str.extract(r"(\d+)$")[0].astype(float).to_numpy()


def last_steps(tl: pd.DataFrame, n: int) -> List[int]:
    """The last ``n`` step numbers that have a step span (on any rank)."""
    if tl.empty:
        return []
    steps = tl[tl["lane"] == "step"]
    if steps.empty:
        return []
    nums = sorted({int(v) for v in _step_numbers(steps) if v == v})
    return nums[-n:] if n > 0 else nums


def _label(row) -> str:
    layer = row.get("layer")
    if isinstance(layer, str):
        return layer
    b = row.get("bucket")
    if b is not None and b == b:
        return f"bucket {int(b)}"
    return str(row.get("name", ""))


def timeline_figure(tl: pd.DataFrame, last: int = 3, step: Optional[int] = None,
                    lanes: Sequence[str] = LANE_ORDER) -> go.Figure:
    """Spans of the last ``last`` iterations (or only ``step``), one lane group per rank.

    Forward and backward are drawn per layer when per-layer spans exist. Bars in a
    lane overlap in place (several buckets can be in flight at once). Hover shows
    the layer or bucket, bytes and duration. A dropdown zooms the x axis to one
    iteration; x is milliseconds from the first span shown."""
    if tl is None or tl.empty:
        return empty_figure("no timeline yet")
    df = assign_steps(tl)
    keep = [step] if step is not None else last_steps(df, last)
    if not keep:
        return empty_figure("no complete iteration yet")
    df = df[df["it"].isin(keep)]
    # per-layer spans replace the whole-phase span of a lane when the lane has them
    if "layer" in df:
        per_layer = df["layer"].notna()
        has_layers = set(df.loc[per_layer, "lane"])
        df = df[per_layer | ~df["lane"].isin(has_layers)]
    steps = df[df["lane"] == "step"]
    df = df[df["lane"].isin(lanes)]
    if df.empty:
        return empty_figure("no spans in the selected iterations")
    t0 = float(df["start_us"].min())
    ranks = sorted(int(r) for r in df["rank"].unique())
    rows = [(f"rank {r}", lane) for r in ranks for lane in lanes]
    fig = go.Figure()
    # an invisible first trace fixes the order of the (rank, lane) rows
    fig.add_trace(go.Bar(y=[[a for a, _ in rows], [b for _, b in rows]], x=[0] * len(rows), orientation="h",
                         showlegend=False, hoverinfo="skip", marker_color="rgba(0,0,0,0)"))
    for lane in lanes:
        d = df[df["lane"] == lane]
        if d.empty:
            continue
        start = (d["start_us"].to_numpy(float) - t0) / 1e3
        dur = d["dur_us"].to_numpy(float) / 1e3
        nbytes = d["bytes"].to_numpy() if "bytes" in d else np.full(len(d), np.nan)
        custom = np.column_stack([
            [_label(r) for r in d.to_dict("records")],
            ["-" if v != v else f"{int(v):,}" for v in nbytes.astype(float)],
            np.round(dur, 3), d["it"].astype(int).to_numpy(),
        ])
        fig.add_trace(go.Bar(
            name=lane, orientation="h", base=start, x=np.maximum(dur, 0.002),
            y=[[f"rank {int(r)}" for r in d["rank"]], [lane] * len(d)],
            marker={"color": LANE_COLORS.get(lane), "line": {"width": 0.5, "color": "white"}}, opacity=0.85,
            customdata=custom,
            hovertemplate="<b>%{customdata[0]}</b><br>" + lane + ", step %{customdata[3]}<br>"
                          "bytes %{customdata[1]}<br>%{customdata[2]} ms<extra>%{y}</extra>",
        ))
    buttons = [{"label": "all shown", "method": "relayout", "args": [{"xaxis.autorange": True}]}]
    for s in sorted(keep):
        w = steps[steps["it"] == s]
        if w.empty:
            continue
        a = (float(w["start_us"].min()) - t0) / 1e3
        b = (float((w["start_us"] + w["dur_us"]).max()) - t0) / 1e3
        pad = 0.02 * (b - a)
        buttons.append({"label": f"step {s}", "method": "relayout",
                        "args": [{"xaxis.range": [a - pad, b + pad]}]})
        fig.add_vline(x=a, line={"width": 1, "dash": "dot", "color": "#999"})
    fig.update_layout(
        barmode="overlay", height=80 + 22 * len(rows), margin={"l": 10, "r": 10, "t": 40, "b": 40},
        xaxis_title="ms", yaxis={"autorange": "reversed"}, legend={"orientation": "h", "y": 1.02, "x": 0,
                                                                     "yanchor": "bottom"},
        updatemenus=[{"buttons": buttons, "direction": "down", "x": 1.0, "xanchor": "right", "y": 1.02,
                      "yanchor": "bottom", "showactive": True}],
    )
    return fig


def median_step(tl: pd.DataFrame, rank: int = 0) -> Optional[int]:
    """The step of ``rank`` whose duration is the median of those in ``tl`` (a representative one)."""
    if tl is None or tl.empty or "lane" not in tl:
        return None
    steps = tl[(tl["lane"] == "step") & (tl["rank"] == rank)]
    if steps.empty:
        return None
    nums = _step_numbers(steps)
    order = np.argsort(steps["dur_us"].to_numpy(float))
    return int(nums[order[len(order) // 2]])


def timelines_figure(frames: Dict[str, pd.DataFrame], rank: int = 0,
                     lanes: Sequence[str] = LANE_ORDER) -> go.Figure:
    """One representative iteration (the median-length one of what each frame holds) of every variant,
    on one time axis: x is milliseconds from that iteration's start, rows are (variant, lane). Shows at a
    glance where one variant's step is longer than another's. ``frames``: label -> timeline frame."""
    fig = go.Figure()
    rows, traces, ends = [], [], {}
    for label, tl in frames.items():
        s = median_step(tl, rank)
        if s is None:
            continue
        df = assign_steps(tl[tl["rank"] == rank])
        df = df[df["it"] == s]
        if "layer" in df:
            per_layer = df["layer"].notna()
            has_layers = set(df.loc[per_layer, "lane"])
            df = df[per_layer | ~df["lane"].isin(has_layers)]
        win = df[df["lane"] == "step"]
        if win.empty:
            continue
        t0 = float(win["start_us"].min())
        ends[label] = float(win["dur_us"].max()) / 1e3
        rows += [(label, lane) for lane in lanes]
        traces.append((label, t0, df[df["lane"].isin(lanes)]))
    if not traces:
        return empty_figure("no complete iteration yet")
    fig.add_trace(go.Bar(y=[[a for a, _ in rows], [b for _, b in rows]], x=[0] * len(rows), orientation="h",
                         showlegend=False, hoverinfo="skip", marker_color="rgba(0,0,0,0)"))
    shown = set()
    for label, t0, df in traces:
        for lane in lanes:
            d = df[df["lane"] == lane]
            if d.empty:
                continue
            dur = d["dur_us"].to_numpy(float) / 1e3
            fig.add_trace(go.Bar(
                name=lane, legendgroup=lane, showlegend=lane not in shown, orientation="h",
                base=(d["start_us"].to_numpy(float) - t0) / 1e3, x=np.maximum(dur, 0.002),
                y=[[label] * len(d), [lane] * len(d)], marker={"color": LANE_COLORS.get(lane)}, opacity=0.85,
                customdata=np.column_stack([[_label(r) for r in d.to_dict("records")], np.round(dur, 3)]),
                hovertemplate="<b>%{customdata[0]}</b><br>" + lane + "<br>%{customdata[1]} ms<extra>%{y}</extra>"))
            shown.add(lane)
    for label, end in ends.items():
        fig.add_annotation(x=end, y=[label, lanes[0]], text=f"{end:.1f} ms", showarrow=False, xanchor="left",
                           font={"size": 11})
    fig.update_layout(barmode="overlay", height=80 + 20 * len(rows), margin={"l": 10, "r": 10, "t": 40, "b": 40},
                      xaxis_title="ms from the start of the iteration", yaxis={"autorange": "reversed"},
                      legend={"orientation": "h", "y": 1.02, "x": 0, "yanchor": "bottom"})
    return fig


# --------------------------------------------------------------------------- step-time breakdown

def _merge(iv: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[List[float]] = []
    for s, e in sorted(iv):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(iv: List[Tuple[float, float]]) -> float:
    return sum(e - s for s, e in iv)


def _intersect(a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Intersection of two merged interval lists."""
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def step_breakdown(tl: pd.DataFrame) -> pd.DataFrame:
    """Where each step's time went, per rank and step, in ms.

    The rule (intervals are unions of spans, clipped to the step's window, so
    nothing is counted twice and concurrent spans are not added up):

    - C (compute): forward, backward and optimizer spans; H (hooks): compress and
      decompress spans; M: comm and wait spans.
    - ``compression_ms`` = |H|: encoding and decoding, which run on the training
      thread (inside backward for wfbp, after it for sync).
    - ``compute_ms`` = |C minus H|: forward + backward + optimizer without the
      hook time spent inside them.
    - ``exposed_comm_ms`` = |M minus (C or H)|: waiting for collectives and
      communication while the training thread computes nothing.
    - ``other_ms`` = the rest of the window (Python and framework overhead, gaps).
    - These four add up to ``step_ms`` exactly.
    - ``hidden_comm_ms`` = |comm and (C or H)|: communication that overlapped
      computation or hooks. It is not part of the sum: it happened at the same
      time as compute, so it cost no extra time.
    """
    cols = ["rank", "step", "step_ms", *PARTS, "hidden_comm_ms"]
    if tl is None or tl.empty:
        return pd.DataFrame(columns=cols)
    df = assign_steps(tl)
    df = df[df["it"].notna()]
    rows = []
    for (rank, it), g in df.groupby(["rank", "it"]):
        win = g[g["lane"] == "step"]
        if win.empty:
            continue
        w0 = float(win["start_us"].iloc[0])
        w1 = w0 + float(win["dur_us"].iloc[0])

        def spans(lanes):
            d = g[g["lane"].isin(lanes)]
            s = d["start_us"].to_numpy(float)
            e = s + d["dur_us"].to_numpy(float)
            return _merge((max(a, w0), min(b, w1)) for a, b in zip(s, e))

        C, H, M, Mc = spans(COMPUTE_LANES), spans(HOOK_LANES), spans(COMM_LANES), spans(("comm",))
        CH = _merge(C + H)
        step = w1 - w0
        compression = _length(H)
        compute = _length(C) - _length(_intersect(C, H))
        exposed = _length(M) - _length(_intersect(M, CH))
        hidden = _length(_intersect(Mc, CH))
        other = step - compute - compression - exposed
        rows.append([int(rank), int(it), step / 1e3, compute / 1e3, compression / 1e3, exposed / 1e3,
                     max(other, 0.0) / 1e3, hidden / 1e3])
    return pd.DataFrame(rows, columns=cols)


def mean_breakdown(bd: pd.DataFrame, skip: int = 0) -> Dict[str, float]:
    """The mean breakdown over ranks and steps, leaving out the first ``skip`` steps
    (warm-up). Means keep the parts adding up to the mean step time."""
    if bd is None or bd.empty:
        return {}
    steps = sorted(bd["step"].unique())
    if 0 < skip < len(steps):
        bd = bd[bd["step"].isin(steps[skip:])]
    return {c: float(bd[c].mean()) for c in ("step_ms", *PARTS, "hidden_comm_ms")}


def _breakdown_bars(df: pd.DataFrame, x: Sequence, horizontal: bool = False) -> go.Figure:
    """Stacked bars of PARTS at positions ``x``, with hidden communication beside them."""
    fig = go.Figure()
    base = np.zeros(len(df))
    for part in PARTS:
        v = df[part].to_numpy(float)
        kw = dict(y=list(x), x=v, orientation="h") if horizontal else dict(x=list(x), y=v)
        fig.add_trace(go.Bar(name=PART_LABELS[part], base=base.copy(), offsetgroup="step",
                             marker_color=PART_COLORS[part],
                             hovertemplate=f"{PART_LABELS[part]}: %{{{'x' if horizontal else 'y'}:.2f}} ms"
                                           "<extra></extra>", **kw))
        base += v
    v = df["hidden_comm_ms"].to_numpy(float)
    kw = dict(y=list(x), x=v, orientation="h") if horizontal else dict(x=list(x), y=v)
    fig.add_trace(go.Bar(name=PART_LABELS["hidden_comm_ms"], offsetgroup="hidden",
                         marker={"color": PART_COLORS["hidden_comm_ms"], "pattern": {"shape": "/"}},
                         hovertemplate=f"hidden communication: %{{{'x' if horizontal else 'y'}:.2f}} ms"
                                       "<extra></extra>", **kw))
    fig.update_layout(barmode="group", legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
                      margin={"l": 10, "r": 10, "t": 40, "b": 40})
    return fig


def breakdown_figure(bd: pd.DataFrame, rank: Optional[int] = None, last: Optional[int] = None) -> go.Figure:
    """Per-step time breakdown (see ``step_breakdown``): stacked compute, compression,
    exposed communication and other, which add up to the step time, and hidden
    (overlapped) communication as a hatched bar beside each stack. Averaged over
    ranks unless ``rank`` is given; ``last`` keeps the last steps only."""
    if bd is None or bd.empty:
        return empty_figure("no complete step yet")
    d = bd if rank is None else bd[bd["rank"] == rank]
    d = d.groupby("step", as_index=False)[["step_ms", *PARTS, "hidden_comm_ms"]].mean().sort_values("step")
    if last:
        d = d.tail(last)
    fig = _breakdown_bars(d, d["step"].tolist())
    fig.update_layout(xaxis_title="step", yaxis_title="ms", height=340)
    return fig


def breakdown_bars_figure(df: pd.DataFrame) -> go.Figure:
    """One stacked bar per run. ``df``: index = run label, columns PARTS and hidden_comm_ms
    (for example rows of ``mean_breakdown``)."""
    if df is None or df.empty:
        return empty_figure("no runs with a timeline")
    fig = _breakdown_bars(df, [str(i) for i in df.index], horizontal=True)
    fig.update_layout(xaxis_title="ms per step (mean after warm-up)", yaxis={"autorange": "reversed"},
                      height=140 + 48 * len(df))
    return fig


# --------------------------------------------------------------------------- curves

def wall_origin(metrics: pd.DataFrame) -> Optional[float]:
    """Wall-clock start of training: the first step's end time minus its duration."""
    if metrics is None or metrics.empty or "t" not in metrics:
        return None
    first = metrics.loc[metrics["t"].idxmin()]
    return float(first["t"] - first.get("time_ms", 0.0) / 1e3)


def curves_figure(metrics: pd.DataFrame, evals: pd.DataFrame, x: str = "step") -> go.Figure:
    """Training loss (mean over ranks) with eval loss, and held-out accuracy, vs ``x``:
    "step" or "wall" (seconds since training started)."""
    if x not in ("step", "wall"):
        raise ValueError(f"x: must be 'step' or 'wall', got {x!r}")
    if (metrics is None or metrics.empty) and (evals is None or evals.empty):
        return empty_figure("no metrics yet")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("loss", "held-out accuracy"), horizontal_spacing=0.1)
    t0 = wall_origin(metrics)
    xlabel = "step" if x == "step" else "wall time (s)"

    def xs(d):
        return d["step"] if x == "step" or t0 is None else d["t"] - t0
    # an own loop that gave comm.step() no loss logs none: no training-loss line then
    if metrics is not None and not metrics.empty and "loss" in metrics and metrics["loss"].notna().any():
        m = metrics.groupby("step", as_index=False).agg(loss=("loss", "mean"), t=("t", "max"))
        fig.add_trace(go.Scatter(x=xs(m), y=m["loss"], name="train loss", mode="lines",
                                 line={"color": "#4C78A8"}), row=1, col=1)
    if evals is not None and not evals.empty:
        e = evals.sort_values("step")
        if "rank" in e:
            e = e.groupby("step", as_index=False).agg(eval_loss=("eval_loss", "mean"),
                                                      eval_acc=("eval_acc", "mean"), t=("t", "max"))
        fig.add_trace(go.Scatter(x=xs(e), y=e["eval_loss"], name="eval loss", mode="lines+markers",
                                 line={"color": "#F58518"}), row=1, col=1)
        fig.add_trace(go.Scatter(x=xs(e), y=e["eval_acc"], name="eval accuracy", mode="lines+markers",
                                 line={"color": "#54A24B"}), row=1, col=2)
    fig.update_xaxes(title_text=xlabel)
    fig.update_yaxes(tickformat=".0%", range=[0, 1.02], row=1, col=2)
    fig.update_layout(height=320, margin={"l": 10, "r": 10, "t": 40, "b": 40},
                      legend={"orientation": "h", "y": -0.25, "x": 0})
    return fig


def bytes_figure(metrics: pd.DataFrame) -> go.Figure:
    """Bytes each rank sent per step, against the uncompressed gradient bytes (log scale:
    compression ratios of 100x and more are common)."""
    if metrics is None or metrics.empty or "bytes_sent" not in metrics:
        return empty_figure("no steps yet")
    m = metrics.groupby("step", as_index=False)[["bytes_sent", "bytes_raw"]].mean()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=m["step"], y=m["bytes_sent"], name="sent (per rank)", mode="lines",
                             line={"color": "#E45756", "shape": "hv"}))
    fig.add_trace(go.Scatter(x=m["step"], y=m["bytes_raw"], name="uncompressed", mode="lines",
                             line={"color": "#777", "dash": "dash"}))
    fig.update_layout(xaxis_title="step", yaxis={"title": "bytes", "type": "log"}, height=300,
                      margin={"l": 10, "r": 10, "t": 30, "b": 40}, legend={"orientation": "h", "y": 1.1})
    return fig


# --------------------------------------------------------------------------- comparing runs

def accuracy_vs_time_figure(curves: pd.DataFrame) -> go.Figure:
    """Held-out accuracy vs wall time, one line per run. ``curves``: run, wall_s, eval_acc."""
    if curves is None or curves.empty:
        return empty_figure("no evaluations in the selected runs")
    fig = go.Figure()
    for run, d in curves.groupby("run", sort=False):
        d = d.sort_values("wall_s")
        fig.add_trace(go.Scatter(x=d["wall_s"], y=d["eval_acc"], name=str(run), mode="lines+markers"))
    fig.update_layout(xaxis_title="wall time since the first step (s)", yaxis_title="held-out accuracy",
                      yaxis={"tickformat": ".0%"}, height=360, margin={"l": 10, "r": 10, "t": 30, "b": 40})
    return fig


def scaling_figure(table: pd.DataFrame, label: str = "name") -> go.Figure:
    """Scaling factor per run (throughput over N times the single-process throughput)."""
    if table is None or table.empty or "scaling_factor" not in table or table["scaling_factor"].isna().all():
        return empty_figure("no scaling factor: compare with a world-size-1 run of the same model, "
                            "data set and batch")
    d = table[table["scaling_factor"].notna()]
    labels = d[label].astype(str) + " (" + d.index.astype(str).str[-4:] + ")" if label in d else d.index
    fig = go.Figure(go.Bar(x=[plain(v) for v in labels], y=d["scaling_factor"], marker_color="#4C78A8",
                           text=[f"{v:.0%}" for v in d["scaling_factor"]], textposition="outside"))
    fig.add_hline(y=1.0, line={"dash": "dot", "color": "#999"})
    fig.update_layout(yaxis={"title": "scaling factor", "tickformat": ".0%"}, height=320,
                      margin={"l": 10, "r": 10, "t": 30, "b": 40})
    return fig


def sweep_heatmap(df: pd.DataFrame, x: str, y: str, value: str = "iter_ms", baseline=None,
                  higher_is_better: bool = False) -> go.Figure:
    """A grid of ``value`` over (``y``, ``x``). With ``baseline`` (a value of ``y``,
    e.g. the compressor "none"), cells are coloured by speedup over the baseline
    row in the same column: baseline / value for times (``higher_is_better=False``),
    value / baseline otherwise. Several rows per cell are averaged."""
    if df is None or df.empty or value not in df or df[value].isna().all():
        return empty_figure("no finished cells yet")
    d = df.dropna(subset=[value])
    grid = d.pivot_table(index=y, columns=x, values=value, aggfunc="mean")
    grid = grid.reindex(index=[v for v in pd.unique(d[y]) if v in grid.index],
                        columns=[v for v in pd.unique(d[x]) if v in grid.columns])
    title = value
    z = grid
    if baseline is not None and baseline in grid.index:
        ref = grid.loc[baseline]
        z = (grid / ref) if higher_is_better else (1.0 / grid).mul(ref, axis=1)
        title = f"speedup over {y} = {baseline}"
        text = [[("-" if not math.isfinite(s) else f"{s:.2f}x<br>{v:.3g}") for s, v in zip(zr, vr)]
                for zr, vr in zip(z.to_numpy(float), grid.to_numpy(float))]
        colorscale, mid = "RdBu", 1.0
    else:
        text = [[("-" if not math.isfinite(v) else f"{v:.3g}") for v in r] for r in grid.to_numpy(float)]
        colorscale, mid = "Viridis", None
    fig = go.Figure(go.Heatmap(z=z.to_numpy(float), x=[str(c) for c in grid.columns], y=[str(i) for i in grid.index],
                               text=text, texttemplate="%{text}", colorscale=colorscale, zmid=mid,
                               colorbar={"title": {"text": "speedup" if baseline is not None and mid else value}},
                               hovertemplate=f"{y}=%{{y}}<br>{x}=%{{x}}<br>%{{text}}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title=x, yaxis={"title": y, "autorange": "reversed"},
                      height=140 + 50 * len(grid.index),
                      margin={"l": 10, "r": 10, "t": 50, "b": 40})
    return fig


# ----------------------------------------------------------------- performance model (commlab/lab/strategy/perfmodel)

def speedup_heatmaps(grid: pd.DataFrame) -> go.Figure:
    """One heatmap per compressor: predicted speedup over DDP, bandwidth (x) by workers (y).
    ``grid``: compressor, gbps, workers, speedup (commlab.lab.strategy.perfmodel.views.speedup_grid)."""
    if grid.empty:
        return empty_figure("no predictions")
    comps = list(dict.fromkeys(grid["compressor"]))
    fig = make_subplots(rows=1, cols=len(comps), subplot_titles=comps, shared_yaxes=True,
                        horizontal_spacing=0.03)
    top = max(2.0, float(grid["speedup"].max()))
    for i, c in enumerate(comps, 1):
        d = grid[grid["compressor"] == c].pivot(index="workers", columns="gbps", values="speedup")
        fig.add_trace(go.Heatmap(
            z=np.log2(d.values), x=[f"{g:g}" for g in d.columns], y=[str(w) for w in d.index],
            text=[[f"{v:.2f}x" for v in row] for row in d.values], texttemplate="%{text}",
            zmin=-np.log2(top), zmax=np.log2(top), colorscale="RdBu", showscale=i == len(comps),
            colorbar={"title": "speedup", "tickvals": [-1, 0, 1], "ticktext": ["0.5x", "1x", "2x"]},
            hovertemplate=f"{c}<br>%{{x}} Gbit/s, %{{y}} workers: %{{text}}<extra></extra>"), row=1, col=i)
        fig.update_xaxes(title_text="Gbit/s", type="category", row=1, col=i)
    fig.update_yaxes(title_text="workers", type="category", row=1, col=1)
    fig.update_layout(height=320, margin={"l": 50, "r": 20, "t": 40, "b": 40})
    return fig


def predicted_vs_measured_figure(df: pd.DataFrame) -> go.Figure:
    """Scatter of predicted against measured iteration time (ms), one point per run, with y = x."""
    d = df.dropna(subset=["measured_ms", "predicted_ms"]) if len(df) else df
    if d is None or d.empty:
        return empty_figure("no finished multi-rank runs to compare")
    hi = float(max(d["measured_ms"].max(), d["predicted_ms"].max())) * 1.1
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[0, hi], y=[0, hi], mode="lines", line={"dash": "dot", "color": "gray"},
                             name="predicted = measured"))
    for comm, g in d.groupby("comm"):
        fig.add_trace(go.Scatter(
            x=g["measured_ms"], y=g["predicted_ms"], mode="markers", name=str(comm),
            text=[f"{r.run}<br>{r.compressor}, {r.schedule}, {r.link}" for r in g.itertuples()],
            hovertemplate="%{text}<br>measured %{x:.2f} ms, predicted %{y:.2f} ms<extra></extra>"))
    fig.update_layout(xaxis_title="measured ms / iteration", yaxis_title="predicted ms / iteration",
                      height=380, margin={"l": 50, "r": 20, "t": 20, "b": 40})
    return fig


def predicted_scaling_figure(df: pd.DataFrame, spec_label: str = "spec") -> go.Figure:
    """Predicted scaling factor (one worker's time over p workers') against workers, DDP dashed and the
    spec solid, one colour per inter-node rate. ``df``: commlab.lab.strategy.perfmodel.views.cluster_prediction."""
    if df is None or df.empty:
        return empty_figure("no predictions")
    fig = go.Figure()
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    for i, (g, d) in enumerate(df.sort_values("workers").groupby("inter_gbps", sort=True)):
        c = colors[i % len(colors)]
        fig.add_trace(go.Scatter(x=d["workers"], y=d["ddp_scaling"], mode="lines+markers", name=f"DDP, {g:g} Gbit/s",
                                 line={"dash": "dash", "color": c}))
        fig.add_trace(go.Scatter(x=d["workers"], y=d["scaling"], mode="lines+markers",
                                 name=f"{plain(spec_label)}, {g:g} Gbit/s", line={"color": c},
                                 customdata=d["speedup"],
                                 hovertemplate="%{x} workers: scaling %{y:.2f}, %{customdata:.2f}x DDP<extra></extra>"))
    fig.update_xaxes(title_text="workers", type="log")
    fig.update_yaxes(title_text="scaling factor", range=[0, 1.05])
    fig.update_layout(height=340, margin={"l": 50, "r": 20, "t": 30, "b": 40})
    return fig


# --------------------------------------------------------------------------- a cluster of unequal workers

SLOW_COLOR = "#E45756"
"""The slowest rank and the slowest hop of a cluster (the colour of communication elsewhere)."""


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def cluster_figure(view: Optional[dict]) -> go.Figure:
    """A cluster's workers as a ring (``view``: commlab.lab.analysis.cluster_view.cluster_view): a node per rank
    (its rank, place and speed; the slowest rank red), an arrow per hop i -> i+1 labelled with its rate (the slower
    of i's up and i+1's down) and both ends' delay, the slowest hop red and thicker. Hover: each worker's link and
    what it measured, each hop's modeled time."""
    if not view or not view.get("workers"):
        return empty_figure("no cluster")
    ws, p = view["workers"], len(view["workers"])
    turn = math.pi / 2 if p == 2 else 0.0  # two workers side by side, more around a circle from the top
    ang = [math.pi / 2 + turn - 2 * math.pi * r / p for r in range(p)]
    xy = [(math.cos(a), math.sin(a)) for a in ang]
    fig = go.Figure()
    # the hops; two workers have two, i -> j and j -> i, each set off to its right so that they do not overlap,
    # and their labels beyond; around a larger ring each label sits inside its hop, on two lines (the workers'
    # labels are outside)
    mids = []
    for k, h in enumerate(view.get("hops") or []):
        (x0, y0), (x1, y1) = xy[h["src"]], xy[h["dst"]]
        dx, dy = x1 - x0, y1 - y0
        n = math.hypot(dx, dy) or 1.0
        ox, oy = (dy / n * 0.09, -dx / n * 0.09) if p == 2 else (0.0, 0.0)
        a = (x0 + 0.22 * dx + ox, y0 + 0.22 * dy + oy)
        b = (x0 + 0.78 * dx + ox, y0 + 0.78 * dy + oy)
        mx, my = x0 + 0.5 * dx, y0 + 0.5 * dy
        if p == 2:
            mx, my = mx + 2.6 * ox, my + 2.6 * oy
        else:
            r = math.hypot(mx, my) or 1.0
            mx, my = mx / r * max(r - 0.28, 0.0), my / r * max(r - 0.28, 0.0)
        slow = k == view.get("slowest_hop")
        fig.add_annotation(x=b[0], y=b[1], ax=a[0], ay=a[1], xref="x", yref="y", axref="x", ayref="y",
                           showarrow=True, arrowhead=2, arrowsize=1.2, arrowwidth=3.5 if slow else 1.5,
                           arrowcolor=SLOW_COLOR if slow else "#888", text="")
        mids.append((mx, my, f"{h['gbps']:g} Gbit/s{', ' if p == 2 else '<br>'}{h['delay_ms']:g} ms",
                     f"hop {h['src']} -> {h['dst']}: {h['gbps']:g} Gbit/s (the slower of rank {h['src']}'s up and "
                     f"rank {h['dst']}'s down), {h['delay_ms']:g} ms of delay; {h['ms']:.2f} ms a ring step"
                     + (" (the slowest hop)" if slow else ""), slow))
    if p > 8:  # labels all round would overlap: the slowest hop's only (the others' on hover)
        mids = [m if m[4] else (*m[:2], "", *m[3:]) for m in mids]
    if mids:
        fig.add_trace(go.Scatter(
            x=[m[0] for m in mids], y=[m[1] for m in mids], mode="text", text=[m[2] for m in mids],
            textfont={"size": 11, "color": [SLOW_COLOR if m[4] else "#555" for m in mids]},
            hovertext=[m[3] for m in mids], hoverinfo="text", showlegend=False))
    slowest = view.get("slowest")

    def where(a: float) -> str:
        c, s = math.cos(a), math.sin(a)
        return "middle right" if c > 0.5 else "middle left" if c < -0.5 else "top center" if s >= 0 else \
            "bottom center"
    fig.add_trace(go.Scatter(
        x=[q[0] for q in xy], y=[q[1] for q in xy], mode="markers+text",
        marker={"size": 40, "color": [SLOW_COLOR if w["rank"] == slowest else "#4C78A8" for w in ws],
                "line": {"width": 1, "color": "#fff"}},
        text=[f"rank {w['rank']}<br>{plain(w['label'])}<br>speed {w['speed']:g}" for w in ws],
        textposition=[where(a) for a in ang], textfont={"size": 12},
        hovertext=[f"rank {w['rank']} ({plain(w['label'])}): speed {w['speed']:g}"
                   + (f", {w['gbps_up']:g} Gbit/s up, {w['gbps_down']:g} down" if w.get("gbps_up") is not None
                      else "")
                   + f", {w['delay_ms']:g} ms delay, {w['jitter_ms']:g} ms jitter<br>per step: compute "
                   f"{_ms(w['compute_ms'])}, exchange {_ms(w['exchange_ms'])}, waited {_ms(w['wait_ms'])}"
                   + (" (the slowest)" if w["rank"] == slowest else "") for w in ws],
        hoverinfo="text", showlegend=False))
    box = {"visible": False, "range": [-1.9, 1.9]}
    tall = {"range": [-0.7, 0.7]} if p == 2 else {}  # two workers side by side need little height
    fig.update_layout(xaxis=box, yaxis={**box, **tall, "scaleanchor": "x"}, height=220 if p == 2 else 380,
                      showlegend=False,
                      plot_bgcolor="rgba(0,0,0,0)",
                      margin={"l": 10, "r": 10, "t": 20, "b": 10})
    return fig
