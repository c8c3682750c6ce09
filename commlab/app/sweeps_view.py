"""The Sweeps page's panels (the teacher's on a workshop server): a grid of compressors, schedules and comm
modes over one base spec, validated as a whole before it starts in the background (commlab.lab.front.sweep_jobs),
and a sweep's progress, table, heatmap and log while it runs.
"""
from __future__ import annotations

import streamlit as st

from commlab.app.room import access
from commlab.app.widgets import RESULTS_PAGE, table_columns
from commlab.engine.spec import MAX_NAME, SpecError
from commlab.lab.analysis import plots
from commlab.lab.base.errors import LabError
from commlab.lab.base.specs import MAX_TYPED
from commlab.lab.front import new_run, sweep_jobs, ui


def sweep_form() -> None:
    """Base spec fields and lists of values; validated as a whole before it can start."""
    ch = new_run.choices()
    k = "sw."
    c = st.columns(4)
    name = c[0].text_input("Name", "my-sweep", key=k + "name", max_chars=MAX_NAME)
    model = c[1].selectbox("Model", ch["models"], index=list(ch["models"]).index("cnn"), key=k + "model")
    dataset = c[2].selectbox("Data set", new_run.datasets_for(model), key=k + "dataset")
    world = c[3].number_input("World size", 1, 64, 2, key=k + "world")
    c = st.columns(4)
    steps = c[0].number_input("Steps", 1, 1_000_000, 100, key=k + "steps")
    batch = c[1].number_input("Batch size", 1, 65536, 32, key=k + "batch")
    eval_every = c[2].number_input("Evaluate every", 0, 1_000_000, 25, key=k + "eval")
    link = c[3].selectbox("Link", ch["links"], key=k + "link")
    base = {"model": model, "dataset": dataset, "world_size": world, "steps": steps, "batch_size": batch,
            "eval_every": eval_every, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "network": {"link": link}}
    if link != "loopback":
        base["network"]["gbps"] = st.number_input("Bandwidth (Gbit/s)", 0.001, 400.0, 1.0, format="%g", key=k + "gbps")
    st.markdown("**Grid** (every combination runs)")
    c = st.columns(3)
    comps = c[0].multiselect("Compressors", ch["compressors"], default=["none", "fp16", "topk"], key=k + "comps")
    ef = c[0].checkbox("Error feedback on lossy compressors", True, key=k + "ef")
    scheds = c[1].multiselect("Schedules", ch["schedules"], default=["layerwise", "bucket"], key=k + "scheds")
    modes = c[2].multiselect("Comm modes", ch["comm"], default=["wfbp"], key=k + "modes")
    compressors = []
    for comp in comps:
        params = new_run.compressor_params(comp)
        entry = {"name": comp}
        if params:
            text = st.text_input(f"{ui.text(comp)} parameters (YAML, blank: defaults)",
                                 ", ".join(f"{p.name}: {p.default}" for p in params if p.name == "ratio"
                                           and p.default is not None), key=f"{k}p.{comp}", max_chars=MAX_TYPED)
            extra = new_run.parse_value("{" + text + "}") if text.strip() else {}
            if isinstance(extra, dict):
                entry.update(extra)
        info = new_run.compressor_info(comp)
        if ef and not info["lossless"] and not info["builtin_feedback"]:
            entry["error_feedback"] = True
        compressors.append(entry)
    c = st.columns(2)
    target = c[0].number_input("Target accuracy (0: none)", 0.0, 1.0, 0.0, step=0.05, key=k + "target")
    baseline = c[1].checkbox("Add single-process runs (for the scaling factor)", True, key=k + "baseline")
    data = sweep_jobs.sweep_data(name, base, {"compressor": compressors, "schedule.name": scheds, "comm.mode": modes},
                         target_acc=target or None, baseline=baseline)
    try:
        sw = sweep_jobs.make_sweep(data)
    except SpecError as e:
        st.error(ui.text(e), icon=":material/error:")
        return
    st.caption(f"{len(sw.cells)} runs (sweep id {ui.text(sw.id)}); they go through the queue, a few at a time.")
    if st.button("Start sweep", type="primary", key=k + "start", icon=":material/play_arrow:"):
        try:
            st.session_state["sweep_id"] = sweep_jobs.start_sweep(data)
        except LabError as e:
            st.error(ui.text(e))
            return
        st.rerun()


def sweep_view() -> None:
    ids = sweep_jobs.list_sweeps()
    if not ids:
        st.caption("No sweeps yet.")
        return
    want = st.session_state.get("sweep_id")
    sid = st.selectbox("Sweep", ids, index=ids.index(want) if want in ids else 0, key="sw.pick")
    try:
        sw = sweep_jobs.load_sweep(sid)
    except (SpecError, OSError, ValueError) as e:
        st.error(f"cannot read sweep {ui.text(sid)}: {ui.text(e)}")
        return
    live = sweep_jobs.sweep_status(sw)["running"]

    @access.fragment(run_every=ui.REFRESH_S if live else None)
    def status():
        s = sweep_jobs.sweep_status(sw)
        if live and not s["running"]:
            st.rerun()
        st.progress(s["finished"] / s["total"] if s["total"] else 0.0,
                    text=f"{s['finished']:d}/{s['total']:d} runs finished · "
                         + ", ".join(f"{n:d} {ui.text(state)}" for state, n in sorted(s["states"].items()))
                         + (" · sweep process running" if s["running"] else ""))
        table = sweep_jobs.sweep_table(sw)
        if table.empty:
            st.caption("No run of this sweep has started yet.")
            return
        st.dataframe(table, key="sw.table", column_config=table_columns())
        st.download_button("Export CSV", access.download_data(lambda: table.to_csv().encode(), []),
                           file_name=f"{sw.id}.csv", mime="text/csv",
                           on_click="ignore", key="sw.csv", icon=":material/download:")
        cells = table[~table["baseline"]] if table["baseline"].any() and not table["baseline"].all() else table
        axes = [a for a in ("compressor", "schedule", "comm", "world_size", "link") if cells[a].nunique() > 1] \
            or ["compressor"]
        c = st.columns(3)
        y = c[0].selectbox("Rows", axes, key="sw.y")
        x = c[1].selectbox("Columns", [a for a in axes if a != y] or ["schedule"], key="sw.x")
        value = c[2].selectbox("Value", ["iter_ms", "throughput", "final_acc", "scaling_factor", "bytes_per_step",
                                         *(["time_to_target_s"] if "time_to_target_s" in cells else [])],
                               key="sw.value")
        baseline = "none" if y == "compressor" and "none" in set(cells["compressor"]) else None
        st.plotly_chart(plots.sweep_heatmap(cells, x=x, y=y, value=value, baseline=baseline,
                                            higher_is_better=value in ("throughput", "final_acc", "scaling_factor")),
                        key="sw.heatmap")
        st.page_link(RESULTS_PAGE, label="This sweep's results: the verdict, timelines side by side",
                     query_params={"sweep": sw.id}, icon=":material/fact_check:")
        with st.expander("log"):
            st.code(sweep_jobs.sweep_log(sw) or "(empty)")

    status()
