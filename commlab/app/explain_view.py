"""The Explain panel of the Live run, Results and Compare pages: why a run's step takes its time
(commlab.lab.analysis.explain): its sentences, the critical path of its median step as a waterfall, each
collective's split, and against another run the difference part by part and what would make it pay."""
from __future__ import annotations

import html
from typing import Dict, List

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from commlab.lab.analysis import explain, timelines
from commlab.lab.front import ui
from commlab.lab.rundir.store import Run

COLORS = {"compute": "#4c78a8", "encode": "#f58518", "decode": "#e45756", "comm": "#54a24b", "sync": "#b279a2",
          "other": "#bab0ac"}


def waterfall_figure(ex: explain.Explanation) -> go.Figure:
    """The median step of the slowest rank along its critical path: one bar per piece, in time order (one trace
    per kind of piece, so a model of many layers stays one figure of a few traces)."""
    fig = go.Figure()
    by: Dict[str, dict] = {}
    for i, w in enumerate(ex.waterfall):
        d = by.setdefault(w["group"], {"x": [], "y": [], "base": [], "hover": []})
        d["x"].append(w["ms"])
        d["y"].append(i)
        d["base"].append(w["start_ms"])
        # a span's name (a layer's, from the model) is data, never markup: escaped, and passed as customdata so
        # no "%{" in it is read as a template
        d["hover"].append(f"{html.escape(str(w['label']))}<br>{w['start_ms']:.2f} + {w['ms']:.2f} ms")
    for g, d in by.items():
        fig.add_trace(go.Bar(x=d["x"], y=d["y"], base=d["base"], orientation="h", name=g,
                             marker_color=COLORS.get(g, "#888"), customdata=d["hover"],
                             hovertemplate="%{customdata}<extra>" + g + "</extra>"))
    fig.update_layout(barmode="overlay", height=min(120 + 14 * len(ex.waterfall), 520),
                      xaxis_title="ms from the step's start", yaxis=dict(autorange="reversed", showticklabels=False),
                      margin=dict(l=10, r=10, t=10, b=40))
    return fig


def collectives_frame(ex: explain.Explanation) -> pd.DataFrame:
    cols = ["name", "op", "bytes", "ms", "skew_ms", "latency_ms", "wire_ms", "rest_ms", "on_path_ms", "busbw_gbps"]
    return pd.DataFrame([{c: x.get(c) for c in cols} for x in ex.collectives], columns=cols)


def sentences(lines: List[str]) -> None:
    st.markdown("\n".join(f"- {ui.text(s)}" for s in lines))


def explain_panel(run: Run, key: str, frame=None, files: tuple = ()) -> None:
    """The panel for one run. A live run's page passes ``frame``, which gives the last steps it holds in memory
    (commlab.lab.analysis.live), and ``files``, the state of the run's files taken before it read them: nothing is
    read again for the panel, and the explanation is made once per state for every page that shows it
    (timelines.cached)."""
    st.subheader("Why the step takes its time")
    try:
        if frame is not None:  # the run's warm-up left out by step number
            ex = timelines.cached(("live.explain", *(files or (str(run.path), run.files_key()))),
                                  lambda: explain.explain_frame(frame(), run.spec_dict()))
        else:
            ex = timelines.run_explanation(run)
    except explain.NothingToExplain:
        st.caption("Explained after the first timed steps.")
        return
    sentences(ex.sentences)
    st.caption(ui.text(f"Steps {ex.steps[0]}..{ex.steps[1]}, mean step {ex.step_ms:.2f} ms; the critical path of "
                       "the slowest rank's median step, piece by piece (the training thread, and the collective it "
                       "waits on):"))
    st.plotly_chart(waterfall_figure(ex), key=f"{key}.waterfall")
    if ex.collectives:
        st.dataframe(collectives_frame(ex), key=f"{key}.collectives", hide_index=True)


def compare_panel(runs: Dict[str, Run], key: str) -> None:
    """Pick a run and one to hold it against: its explanation, and the difference part by part."""
    st.subheader("Why one is slower than another")
    labels = list(runs)
    if len(labels) < 2:
        if labels:
            explain_panel(runs[labels[0]], key)
        return
    c = st.columns(2)
    b = c[0].selectbox("Explain", labels, index=len(labels) - 1, key=f"{key}.b")
    a = c[1].selectbox("against", [x for x in labels if x != b], key=f"{key}.a")
    try:
        exb, exa = timelines.run_explanation(runs[b]), timelines.run_explanation(runs[a])
    except explain.NothingToExplain:
        st.caption("Explained after the first timed steps.")
        return
    sentences(explain.compare(exa, exb, a, b)["sentences"] + exb.sentences)
    st.plotly_chart(waterfall_figure(exb), key=f"{key}.waterfall")
