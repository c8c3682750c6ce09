"""The Compare page's panel: runs filtered by the index's columns, picked, and compared in one table
(commlab.lab.analysis.comparison) with its CSV and report, accuracy against wall time, where the step time goes and
the scaling factor.
"""
from __future__ import annotations

import streamlit as st

from commlab.app import explain_view
from commlab.app.room import access
from commlab.app.widgets import report_button, table_columns, where
from commlab.lab.analysis import comparison, plots, timelines
from commlab.lab.front import ui

FILTERS = ("state", "model", "dataset", "compressor", "schedule", "comm", "link", "sweep")
MAX_RUNS = 8
"""Runs compared at once: each costs its timeline's breakdown and explanation on every rerun, and its part of the
report."""


def compare_view() -> None:
    rows = ui.index_rows()
    if not rows:
        st.info(f"No runs{where()} yet.")
        return
    cols = st.columns(len(FILTERS))
    filters = {}
    for c, f in zip(cols, FILTERS):
        values = sorted({str(r[f]) for r in rows if r.get(f) is not None})
        v = c.selectbox(f, ["any", *values], key=f"cmp.f.{f}")
        if v != "any":
            filters[f] = v
    runs = ui.list_runs(**filters)
    labels = timelines.short_labels(runs)
    ids = [r.id for r in runs]
    wanted = [i for i in st.session_state.get("compare_ids", []) if i in ids][-MAX_RUNS:]
    default = wanted or [r.id for r in runs if r.state == "done"][-4:] or ids[-4:]
    chosen = st.multiselect(ui.text(f"Runs (at most {MAX_RUNS})"), ids, default=default, max_selections=MAX_RUNS,
                            format_func=lambda i: labels.get(i, i), key="cmp.runs")
    target = st.number_input("Target accuracy for time-to-target (0: none)", 0.0, 1.0, 0.0, step=0.05,
                             key="cmp.target")
    picked = [r for r in runs if r.id in chosen][:MAX_RUNS]  # also when a client sends more than the widget allows
    if not picked:
        st.caption("Pick runs to compare.")
        return
    table = comparison.compare_runs(picked, target_acc=target or None)
    bad = [labels.get(i, i) for i in table.index[table["disturbed"] == True]] if len(table) else []  # noqa: E712
    if bad:
        st.warning("Disturbed (other processes used the CPU; timings are not results): "
                   + ", ".join(ui.text(b) for b in bad), icon=":material/warning:")
    st.dataframe(table, key="cmp.table", column_config=table_columns())
    st.download_button("Export CSV", access.download_data(lambda: table.to_csv().encode(), [r.id for r in picked]),
                       file_name="commlab-compare.csv", mime="text/csv",
                       on_click="ignore", key="cmp.csv", icon=":material/download:")
    report_button(picked, "commlab-compare.html", key="cmp.report")
    st.subheader("Accuracy against wall time")
    st.plotly_chart(plots.accuracy_vs_time_figure(timelines.accuracy_curves(picked, labels)), key="cmp.acc")
    st.subheader("Where the step time goes")
    st.plotly_chart(plots.breakdown_bars_figure(timelines.breakdown_table(picked, labels)), key="cmp.breakdown")
    explain_view.compare_panel({labels.get(r.id, r.id): r for r in picked}, "cmp.explain")
    st.subheader("Scaling factor")
    st.caption("Throughput at N ranks over N times the single-process throughput of the same model, data set "
               "and batch: include a world-size-1 run (sweeps add one by themselves).")
    st.plotly_chart(plots.scaling_figure(table), key="cmp.scaling")
