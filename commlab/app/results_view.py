"""The results view of a preset's (or a sweep's) group of runs: the verdict computed from the runs'
measurements, the paper's claim beside it, and the variants' timelines, step breakdowns and accuracy
curves side by side. It fills in as runs finish.

Watching must not slow the runs it shows, so while runs are in flight the panel redraws only cheap
figures (state, progress, medians) and builds the figures of a variant once, when it is final."""
from __future__ import annotations

from typing import Optional

import pandas as pd
import streamlit as st

from commlab.app import explain_view, widgets

from commlab.app.room import access
from commlab.lab.analysis import plots, replicas, timelines
from commlab.lab.analysis.results import preset_of
from commlab.lab.front import groups, sweep_jobs, ui
from commlab.engine.spec import SpecError
from commlab.lab.base.errors import LabError

PAGE = widgets.RESULTS_PAGE
REFRESH_S = 3.0
"""The panel re-reads its runs this often while any is in flight."""


def pick_group() -> Optional[dict]:
    """The group the page is about: ?group=..., ?sweep=..., else the session's, else the newest preset group."""
    sweep = st.query_params.get("sweep")
    if sweep:
        try:
            return sweep_jobs.sweep_group(sweep)
        except (LabError, SpecError, OSError, ValueError, KeyError) as e:
            st.error(f"sweep {ui.text(repr(sweep))}: {ui.text(e)}")
            return None
    found = groups.preset_groups()
    if not found:
        return None
    ids = [g["id"] for g in found]
    want = st.query_params.get("group") or st.session_state.get("group_id")
    if want and want not in ids:
        try:
            found.insert(0, groups.preset_group(want))
            ids.insert(0, want)
        except (KeyError, ValueError) as e:
            st.error(ui.text(str(e).strip("'\"")))
    want = want if want in ids else ids[0]
    titles = {g["id"]: f"{_title(g)} · {g['id'][:15]}" for g in found}
    st.session_state["res.pick"] = want

    def picked():
        st.query_params["group"] = st.session_state["res.pick"]
        st.session_state["group_id"] = st.session_state["res.pick"]
    st.selectbox("Preset run", ids, format_func=lambda i: titles.get(i, i), key="res.pick", on_change=picked)
    return next(g for g in found if g["id"] == want)


def _title(g: dict) -> str:
    p = preset_of(g)
    return p.title if p else g.get("title", g.get("preset") or g["id"])


def _mark(ok: Optional[bool]) -> str:
    return {True: ":green[**met**]", False: ":red[**missed**]", None: ":gray[pending]"}[ok]


def results_panel(group: dict) -> None:
    p = preset_of(group)
    if p is not None:
        st.caption(ui.text(p.question))
    first = groups.group_verdict(group)
    live = not first.complete
    finals = sum(x.final for x in first.variants.values())

    @access.fragment(run_every=REFRESH_S if live else None)
    def panel():
        v = groups.group_verdict(group)
        if live and sum(x.final for x in v.variants.values()) != finals:
            st.rerun()  # a run finished: redraw the page once, with its figures (they are not in this fragment)
        done = sum(x.final for x in v.variants.values())
        if v.claim:
            st.markdown(f"**The paper:** {ui.text(v.claim)}")
        if not v.complete:
            st.info(f"{done:d} of {len(group['runs'])} runs finished; the answer fills in as they finish.",
                    icon=":material/hourglass_top:")
        if v.passed:
            st.success("The paper's effect shows here, with accuracy intact.", icon=":material/check_circle:")
        elif v.passed is False:
            st.error("Not shown here: see what missed and why below.", icon=":material/cancel:")
        items = []
        for e in v.effects:
            items.append(f"- {ui.text(e.line)} — {_mark(e.passed)}")
            if e.why:
                items.append(f"    - why: {ui.text(e.why)}")
        if v.accuracy:
            items.append(f"- accuracy ({_mark(v.accuracy_ok)}): " + "; ".join(ui.text(a) for a in v.accuracy))
        items += [f"- {ui.text(line)}" for line in v.lines[len(v.effects):] if not line.startswith("Why it missed")]
        cross = groups.group_crossover(group) if v.complete else None
        if cross:
            items.append(f"- {ui.text(cross)}")
        if v.wall_s is not None:
            items.append(f"- the whole experiment took {v.wall_s:.0f} s of wall time, from the click to the "
                         f"last run's end")
        with st.container(border=True):
            st.markdown("**Measured here**\n\n" + "\n".join(items))
        for n in v.notes:
            st.warning(ui.text(n), icon=":material/warning:")
        for d in v.disturbed:
            st.warning(f"Disturbed: {ui.text(d)}", icon=":material/warning:")
        rows = []
        faulted = any(y.ft for y in v.variants.values())  # fault-tolerant runs: what the faults cost, side by side
        for x in v.variants.values():
            s = x.summary
            rows.append({"variant": x.label, "state": x.state, "steps": f"{s.get('steps_done', 0)}/{s.get('steps')}",
                         "iter_ms": x.iter_ms, "mean_ms": x.mean_ms, "final_acc": x.acc,
                         "bytes_per_step": s.get("bytes_per_step"),
                         "compression_ratio": s.get("compression_ratio"),
                         "exposed_comm_ms": x.breakdown.get("exposed_comm_ms") if x.breakdown else None,
                         "disturbed": bool(x.disturbance.get("disturbed")), "run": x.run_id})
            if faulted:
                rows[-1].update(kills=x.ft.get("kills"), recoveries=len(x.ft.get("recoveries") or []) if x.ft else None,
                                goodput=x.ft.get("goodput"))
        cols = widgets.table_columns()
        cols["goodput"] = st.column_config.NumberColumn(
            "goodput steps/s", format="%.1f", help="committed steps per second, kills and recoveries included")
        cols["exposed_comm_ms"] = st.column_config.NumberColumn("exposed comm ms", format="%.1f")
        cols["mean_ms"] = st.column_config.NumberColumn(  # a method's local steps are cheap and its syncs not
            "mean step ms", format="%.1f", help="the mean iteration after warm-up: a method's syncs amortized")
        st.dataframe(pd.DataFrame(rows).set_index("variant"), key="res.table", column_config=cols)
    panel()
    members = [r for r in (ui.get_run(i) for i in group["runs"].values()) if r is not None]
    if members:
        widgets.report_button(members, f"{group['id']}.html", key="res.report", group=group)
    # Figures of the runs that were final when the page was drawn: built once, outside the refreshing
    # fragment, so a browser watching a group does not re-render them every few seconds.
    final = {x.label: ui.get_run(x.run_id) for x in first.variants.values() if x.final}
    final = {k: r for k, r in final.items() if r is not None}
    if not final:
        return
    st.subheader("One iteration of each, on one time axis")
    st.caption("The median-length iteration of each finished run's last steps, rank 0.")
    st.plotly_chart(timelines.group_timelines(final), key="res.timelines")
    labels = {r.id: k for k, r in final.items()}
    c = st.columns(2)
    with c[0]:
        st.subheader("Where the step time goes")
        st.plotly_chart(plots.breakdown_bars_figure(timelines.breakdown_table(list(final.values()), labels)),
                        key="res.breakdown")
    with c[1]:
        st.subheader("Accuracy against wall time")
        st.plotly_chart(plots.accuracy_vs_time_figure(timelines.accuracy_curves(list(final.values()), labels)),
                        key="res.acc")
    quorums = {k: replicas.quorum_sizes([m for m in r.metric_rows() if m.get("kind") == "step"])
               for k, r in final.items() if (r.spec_dict().get("fault_tolerance") or {}).get("enabled")}
    if any(quorums.values()):
        st.subheader("Replica groups in each quorum, by step")
        st.caption("A fault-tolerant run's quorums: a kill drops its replica group until it recovers and rejoins.")
        st.line_chart(pd.DataFrame([{"variant": ui.text(k), "step": q["step"], "replica groups": q["participants"]}
                                    for k, qs in quorums.items() for q in qs]),
                      x="step", y="replica groups", color="variant", height=220)
    explain_view.compare_panel(final, "res.explain")
    st.caption("Each run's own page:")  # page links: in-app, so a workshop session stays signed in
    for k, r in final.items():
        st.page_link(widgets.LIVE_PAGE, label=ui.text(k), query_params={"run": r.id})
