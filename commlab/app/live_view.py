"""The Live run page's panel: the run picker, then one run's status, progress, cancel and share (and, for a
fault-tolerant run, each replica group's state, the quorum's size and the recoveries; for a run on a cluster of
unequal workers, its workers as a ring and who waits on whom), its timeline, where the step time goes, its curves
and bytes, refreshed while it trains (ui.REFRESH_S for the status, ui.CHARTS_REFRESH_S for the charts: drawing
them is most of what watching costs the machine).
"""
from __future__ import annotations

from typing import Optional

import streamlit as st

from commlab.app import explain_view
from commlab.app.room import access
from commlab.app.widgets import report_button, state_badge, where
from commlab.engine.runfiles import FINAL
from commlab.lab.base.errors import LabError
from commlab.lab.analysis import cluster_view, comparison, live, plots, replicas, timelines
from commlab.lab.front import ui
from commlab.lab.rundir import disturbance
from commlab.lab.rundir import store
from commlab.lab.rundir.summary import fmt_bytes, summarize, warmup_steps
from commlab.room import owners

BREAKDOWN_STEPS = 40
"""Steps the live page reads back for its breakdown (and at least that many for the timeline)."""


def pick_run() -> Optional[str]:
    """The run the page is about: ?run=..., else the session's, else the newest; a selectbox changes it."""
    runs = ui.list_runs()[::-1]
    want = st.query_params.get("run") or st.session_state.get("run_id")
    if want and want not in {r.id for r in runs}:
        made = ui.get_run(want)  # made after the index was read, or not a run at all
        runs = [made, *runs] if made is not None else runs
    if not runs:
        return None
    ids = [r.id for r in runs]
    labels = {r.id: ui.run_label(r, state=False) for r in runs}  # the panel below shows the live state
    want = want if want in ids else ids[0]
    if st.query_params.get("run", want) != want:  # an id the viewer may not see: the URL names the run shown
        st.query_params["run"] = want
    st.session_state["live.pick"] = want  # the URL wins over what the widget last held

    def picked():
        st.query_params["run"] = st.session_state["live.pick"]
        st.session_state["run_id"] = st.session_state["live.pick"]
    st.selectbox("Run", ids, format_func=lambda i: labels.get(i, i), key="live.pick", on_change=picked)
    st.session_state["run_id"] = want
    return want


# --------------------------------------------------------------------------- live panel

def live_panel(run_id: str) -> None:
    """Status, progress, cancel, timeline, breakdown, curves and bytes of one run. Until the run is final
    the status refreshes every ui.REFRESH_S seconds and the charts every ui.CHARTS_REFRESH_S, or at once
    on the Redraw button (drawing them is most of what watching costs the machine the run trains on). A
    refresh that finds nothing new sends the same figures, which the browser does not draw again."""
    run = ui.get_run(run_id)
    if run is None:
        st.error(f"No run {ui.text(repr(run_id))}{where()}.")
        return
    spec = run.spec_dict()
    first = run.status()
    own = bool(first.get("own_loop"))  # its script decides how many steps: the spec's are a default
    st.caption(ui.text(comparison.describe_setup(spec, first)))
    c = st.columns([1, 1, 1, 2])
    last = c[0].number_input("Iterations in the timeline", 1, 20, 3, key="live.last")
    step = c[1].number_input("Zoom to step (-1: last iterations)", -1, None if own else spec["steps"], -1,
                             key="live.step")
    xaxis = c[2].radio("Curves against", ["step", "wall time"], horizontal=True, key="live.x")
    with c[3]:
        st.download_button("Download trace (Chrome/Perfetto JSON)", data=access.download_data(lambda: timelines.trace_json(run), [run.id], "trace"),
                           file_name=f"{run.id}.trace.json", mime="application/json", on_click="ignore",
                           key="live.trace", icon=":material/download:",
                           help=(f"Each rank's last steps that fit {store.VIEW_MB:g} MB of timeline, as every view here "
                                 "reads; `commlab trace` with this run's id writes the whole run.") if run.view_cut() else None)
        report_button([run], f"{run.id}.html", key="live.report")
    started_final = run.state in FINAL
    mine = ui.can_control(run)
    owner = ui.owner(run)
    if mine and owner != owners.local_user().name:  # a workshop user's own run: share it with the class
        shared = bool(run.status().get("shared"))
        if st.toggle("Shared with the class", shared, key="live.share",
                     help="Other students see a shared run in their lists, comparisons and reports.") != shared:
            ui.share(run.id, not shared)
    elif not mine:
        st.caption(f"{ui.text(owner)}'s run, shared with the class")

    def still_visible():
        """The run again, as the viewer may see it now (signed out, revoked, unshared: no more of it)."""
        again = ui.get_run(run_id)
        if again is None:
            st.rerun()  # the whole page again: the gate, then "No run"
        return again

    @access.fragment(run_every=None if started_final else ui.REFRESH_S)
    def panel():
        run = still_visible()
        state = run.state
        if state in FINAL and not started_final:
            st.rerun()  # a full rerun redraws the panel without its refresh timer
        status = run.status()
        lr = live.live_run(run)  # only what was appended since the last refresh is read
        s = summarize(lr.metric_rows(), spec, status)  # an own loop's total: the steps it took, once it ended
        done, total = s["steps_done"], s.get("steps")
        head = st.columns([1, 4, 1])
        with head[0]:
            state_badge(state)
        head[1].progress(min(done / total, 1.0) if total else 0.0,
                         text=f"step {done:d}/{total:d}" if total is not None else
                         f"step {done:d} (own loop: its script decides how many)")
        if state not in FINAL and mine and head[2].button("Cancel run", key="live.cancel", icon=":material/stop:"):
            st.toast(f"cancel requested ({ui.text(ui.cancel(run.id))})")
        if state in ("failed", "diverged"):
            st.error(f"{ui.text(state)}: {ui.text(ui.shown_text(status.get('error', '')))}")
            with st.expander("log (last lines)"):
                st.code(ui.shown_log(run, 30) or "(empty)")
        machine_note(status.get("disturbance"))
        if status.get("fault_tolerance"):
            replica_panel(run, lr.metric_rows(), running=state == "running" and ui.may_pull_plugs())
        m = st.columns(4)
        m[0].metric("iteration (median)", f"{s['iter_ms_median']:.1f} ms" if s.get("iter_ms_median") else "-")
        m[1].metric("accuracy (its script's evaluation)" if own else "held-out accuracy",
                    f"{s['final_acc']:.1%}" if s.get("final_acc") is not None else "-")
        m[2].metric("bytes sent / step / rank", ui.text(fmt_bytes(s.get("bytes_per_step"))))
        m[3].metric("compression", f"{s['compression_ratio']:.1f}x" if s.get("compression_ratio") else "-")

    @access.fragment(run_every=None if started_final else ui.CHARTS_REFRESH_S)
    def charts():
        run = still_visible()
        state = run.state
        # what is drawn from the run's files below is kept under their state before they are read (a key older
        # than what it holds is drawn again; a newer one would keep a stale figure)
        files = (str(run.path), run.files_key())
        lr = live.live_run(run)
        done, _ = lr.progress()
        if not started_final:
            note, redraw = st.columns([5, 1], vertical_alignment="center")
            note.caption(f"While the run goes on, the charts are redrawn every {ui.CHARTS_REFRESH_S:g} s and the "
                         f"progress above every {ui.REFRESH_S:g} s: a redraw costs your browser CPU on the cores "
                         "the run trains on.")
            redraw.button("Redraw charts", key="live.redraw", icon=":material/refresh:",
                          help="Draw the charts now from what the run has logged so far.")
        view = cluster_view.cluster_view(spec, lr.metric_rows())
        if view is not None:
            cluster_panel(view)
        st.subheader("Timeline")
        # drawn once per state of the run's files for every page that shows the same (timelines.cached)
        if step < 0:
            fig = timelines.cached(("live.timeline", *files, int(last)), lambda: plots.timeline_figure(
                lr.timeline(int(last) + 1), last=int(last)))
        else:
            back = max(done - int(step) + 1, 1)
            fig = timelines.cached(("live.step", *files, int(step)), lambda: plots.timeline_figure(
                lr.timeline(back) if lr.has_steps(back) else timelines.tail_timeline(run, back), step=int(step)))
        st.plotly_chart(fig, key="live.timeline")
        if step >= 0 and run.view_cut():
            st.caption(f"The server reads each rank's last steps that fit {store.VIEW_MB:g} MB of timeline: an older "
                       "step shows no spans here. `commlab trace` with this run's id writes the whole run.")
        st.subheader("Where the step time goes")
        bd = lr.breakdown(BREAKDOWN_STEPS, final=state in FINAL)  # each step's breakdown is computed once
        st.plotly_chart(plots.breakdown_figure(bd), key="live.breakdown")
        timed = bd[bd["step"] >= warmup_steps(done)] if len(bd) else bd
        shown = timed if len(timed) else bd
        mean = plots.mean_breakdown(shown)
        if mean:
            st.caption(f"mean over the last {shown['step'].nunique():d} steps"
                       + (", warm-up left out: " if len(timed) else ": ") + ", ".join(
                f"{ui.text(plots.PART_LABELS[k])} {mean[k]:.2f} ms" for k in (*plots.PARTS, "hidden_comm_ms"))
                + f"; step {mean['step_ms']:.2f} ms")
        explain_view.explain_panel(run, "live.explain", frame=lambda: lr.timeline(BREAKDOWN_STEPS), files=files)
        st.subheader("Loss and accuracy")
        metrics = lr.metrics()
        st.plotly_chart(plots.curves_figure(metrics, lr.metrics("eval"),
                                            x="step" if xaxis == "step" else "wall"), key="live.curves")
        st.subheader("Bytes per step")
        st.plotly_chart(plots.bytes_figure(metrics), key="live.bytes")

    panel()
    charts()


def replica_panel(run, rows, running: bool = False) -> None:
    """A fault-tolerant run's replica groups (commlab.lab.analysis.replicas): each one's state, the quorum's size
    over the run, and the recoveries after the start. ``running`` (a running run, and a viewer who may pull plugs:
    the teacher or the local user): a button that kills a replica group (ui.pull_plug)."""
    steps = [r for r in rows if r.get("kind") == "step" and "replica" in r]
    states = replicas.replica_states(run.ft_events(), steps, run.recoveries())
    if not states:
        st.caption("Replica groups: starting (the Lighthouse first).")
        return
    st.caption(ui.text(replicas.describe(states)))
    cols = st.columns(len(states))
    for c, s in zip(cols, states):
        state = s["state"] + (f" ({s['speed']:g}x)" if s["state"] == "slow" else "")
        c.metric(ui.text(f"replica {s['replica']}"), ui.text(state),
                 help=ui.text(f"process generation {s['gen']}, {s['kills']} kill(s), last step {s['last_step']}"))
    if running:
        pick, pull, secs, cut, slow_speed, slow = st.columns([2, 1, 1, 1, 1, 1], vertical_alignment="bottom")
        r = pick.selectbox("Replica group", [s["replica"] for s in states], key="live.plug_replica")
        if pull.button("Pull the plug", key="live.plug", icon=":material/power_off:",
                       help="SIGKILL this replica group's process; the lab restarts it after the spec's delay and it "
                            "recovers from a live peer"):
            try:
                ui.pull_plug(run.id, int(r))
                st.toast(ui.text(f"asked to kill replica {r}; it is restarted after the spec's delay"))
            except LabError as e:
                st.error(ui.text(str(e)))
        seconds = secs.number_input("Seconds", 0.5, 600.0, 10.0, key="live.cut_s")
        if cut.button("Cut off", key="live.cut", icon=":material/link_off:",
                      help="stop this replica group's process for the seconds given (no traffic, no heartbeat, as "
                           "across a cut link); then it goes on and recovers from a live peer"):
            try:
                ui.pull_plug(run.id, int(r), seconds=float(seconds))
                st.toast(ui.text(f"asked to cut replica {r} off for {seconds:g} s"))
            except LabError as e:
                st.error(ui.text(str(e)))
        speed = slow_speed.number_input("Speed", 0.05, 0.95, 0.5, step=0.05, key="live.slow_speed")
        if slow.button("Slow down", key="live.slow", icon=":material/speed:",
                       help="this replica group computes at the speed given (a share of its own) for the seconds "
                            "given, as on a busy machine; the others wait for it at every exchange"):
            try:
                ui.pull_plug(run.id, int(r), seconds=float(seconds), speed=float(speed))
                st.toast(ui.text(f"asked to slow replica {r} to {speed:g} of its speed for {seconds:g} s"))
            except LabError as e:
                st.error(ui.text(str(e)))
    sizes = replicas.quorum_sizes(steps)
    recs = replicas.after_start(run.recoveries(), steps)
    with st.expander(f"Quorum over the run ({len(sizes)} quorums) and recoveries ({len(recs)})"):
        if sizes:
            st.line_chart({"step": [q["step"] for q in sizes], "quorum size": [q["participants"] for q in sizes]},
                          x="step", y="quorum size", height=160)
        if recs:
            st.dataframe([{"replica": r.get("replica"), "from replica": r.get("from_replica"),
                           "step": r.get("lab_step", r.get("step")), "seconds": round(r.get("seconds") or 0.0, 3),
                           "MB": round((r.get("bytes") or 0) / 1e6, 2)}
                          for r in recs], hide_index=True)


def cluster_panel(view: dict) -> None:
    """A cluster run's workers (commlab.lab.analysis.cluster_view): the ring with each hop's rate and delay, the
    slowest rank and hop in red; beside it, each rank's compute, exchange and wait per step and whom it waits on."""
    st.subheader("Cluster: who waits on whom")
    ring, numbers = st.columns(2)
    ring.plotly_chart(plots.cluster_figure(view), key="live.cluster")
    with numbers:
        st.dataframe(cluster_view.table(view), hide_index=True)
        how = (f". Per step, the median of {view['steps']} steps every rank logged (warm-up left out): compute is "
               "forward and backward, exchange the time until the step's collectives were done, wait what a rank's "
               "exchange took beyond the shortest one's." if view["steps"] else ".")
        st.caption(ui.text(cluster_view.describe(view) + how))


def machine_note(d: Optional[dict]) -> None:
    """A warning with the figure when other processes disturbed the run; a quiet caption otherwise."""
    label, text = disturbance.describe(d)
    if label == "disturbed":
        st.warning(f"Disturbed run: {ui.text(text[len('yes: '):])}. Its timings are not results.",
                   icon=":material/warning:")
    elif d and d.get("other_cpu") is not None:
        st.caption(f"Machine {ui.text(text)}.")
