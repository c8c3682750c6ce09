"""Streamlit pieces several pages share: page setup, opening a run, the report download, state badges, the
comparison table's columns, and the home page's preset cards and recent runs. Each page's own panel has a
module of its own (live_view, run_form, compare_view, sweeps_view, results_view); data and decisions come
from commlab.lab.front and commlab.lab.analysis, and these modules only lay them out.
"""
from __future__ import annotations

from typing import List, Optional

import streamlit as st

from commlab.app.room import access
from commlab.lab.analysis.presets import Preset
from commlab.lab.analysis.report import report_html
from commlab.lab.base.errors import LabError
from commlab.lab.front import groups, ui
from commlab.room import owners

LIVE_PAGE = "views/live_run.py"
RESULTS_PAGE = "views/results.py"
STATE_COLORS = {"queued": "gray", "running": "blue", "done": "green", "failed": "red", "cancelled": "orange",
                "diverged": "red"}


def setup(title: str) -> None:
    st.set_page_config(page_title=f"{title} · commlab", layout="wide")


def open_run(run_id: str, compare: Optional[List[str]] = None) -> None:
    """Go to the live page of ``run_id`` (kept in the query string and the session)."""
    st.session_state["run_id"] = run_id
    if compare:
        st.session_state["compare_ids"] = compare
    st.switch_page(LIVE_PAGE, query_params={"run": run_id})


def report_button(runs: list, file_name: str, key: str, group: Optional[dict] = None) -> None:
    """Download one self-contained HTML report (commlab.lab.analysis.report) of ``runs`` (and ``group``'s verdict), built
    when clicked. The runs were resolved for the viewer already: the builder looks up nothing else."""
    by_id, me = {r.id: r for r in runs}, ui.viewer()  # built later, in a thread serving no one: who it is for, now
    st.download_button("Download report (HTML, opens offline)", on_click="ignore", key=key, mime="text/html",
                       data=access.download_data(lambda: report_html(runs, group=group, get=by_id.__getitem__,
                                                                     shown=lambda s: ui.shown_text(s, me)),
                                                 by_id, "" if group else "report"),
                       file_name=file_name, icon=":material/description:")


def where() -> str:
    """" in <runs directory>" for the teacher and the local user, as text for Markdown (ui.text); nothing for
    a student (the machine's paths are not theirs to see)."""
    return f" in {ui.text(ui.runs_dir())}" if ui.viewer().admin else ""


def state_badge(state: str) -> None:
    st.badge(state, color=STATE_COLORS.get(state, "gray"))


def table_columns() -> dict:
    """Readable number formats for a comparison table (commlab.lab.analysis.comparison.compare_runs)."""
    num = st.column_config.NumberColumn
    return {"iter_ms": num("iter ms", format="%.1f"), "throughput": num("samples/s", format="%.0f"),
            "scaling_factor": num("scaling", format="percent"), "bytes_per_step": num("bytes/step", format="bytes"),
            "compression_ratio": num("compression", format="%.1fx"), "final_acc": num("accuracy", format="percent"),
            "final_loss": num("loss", format="%.3f"), "time_to_target_s": num("to target (s)", format="%.1f"),
            "other_cpu": num("other CPU", format="percent",
                             help="share of the machine other processes used during the run"),
            "disturbed": st.column_config.CheckboxColumn("disturbed", help="other processes used more CPU than "
                                                         "the threshold: the run's timings are not results")}


# --------------------------------------------------------------------------- home

def preset_card(p: Preset) -> None:
    reason = p.check()
    with st.container(border=True):
        st.markdown(f"**{p.title}**")
        st.caption(ui.text(p.question))
        st.caption("runs: " + ", ".join(ui.text(v) for v in p.variants))
        # the preset's knobs (e.g. H, the steps between two syncs): its runs take the values set here
        values = {k.name: st.slider(ui.text(k.label), k.lo, k.hi, k.default, key=f"preset-{p.key}-{k.name}",
                                         help=ui.text(k.help))
                  for k in p.knobs}
        cap = owners.preset_steps(ui.runs_dir())
        if cap and any(d["steps"] > cap for d in p.specs(values)):
            st.caption(f"Scaled down for this room: at most {cap:d} steps per run (runs/lab.json preset_steps)")
        if reason:
            st.button("Start", key=f"preset-{p.key}", disabled=True, help=ui.text(reason))
            st.caption(f"Not available yet: {ui.text(reason)}")
        elif st.button("Start", key=f"preset-{p.key}", type="primary"):
            try:
                gid = groups.start_preset(p, values=values)
            except LabError as e:
                st.error(ui.text(e))
                return
            st.session_state["group_id"] = gid
            st.switch_page(RESULTS_PAGE, query_params={"group": gid})


def recent_runs(n: int = 8) -> None:
    runs = ui.list_runs()[-n:][::-1]
    if not runs:
        st.caption(f"No runs{where()} yet.")
        return
    for r in runs:
        cols = st.columns([5, 1])
        cols[0].page_link(LIVE_PAGE, label=ui.text(ui.run_label(r)), query_params={"run": r.id})
        with cols[1]:
            state_badge(r.state)
