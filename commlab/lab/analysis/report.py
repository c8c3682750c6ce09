"""Reports to take home: runs, a preset's result group or a comparison as one self-contained HTML file.

Plotly's JavaScript is written into the file once, and every figure is a div drawn by it, so the file
opens with no network (no CDN) in any browser. ``commlab report RUN... -o file.html``, ``--group GID``
for a preset's result group, and the UI's report buttons (Live run, Results, Compare) all write it.

    from commlab.lab.analysis.report import report_html
    html = report_html(runs=[commlab.get(rid)], title="my run")
"""
from __future__ import annotations

import html
import json
import time
from typing import Callable, List, Optional

from commlab.engine.runfiles import FINAL
from commlab.lab.analysis import comparison, explain, plots, results, timelines
from commlab.lab.rundir.store import Run
from commlab.lab.rundir.summary import format_summary, summarize

STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{font-size:1.3em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
h3{font-size:1.1em}table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:3px 6px;
text-align:right}th{background:#f4f4f4}.note{color:#666;font-size:.9em}.warn{color:#a40}pre{background:#f7f7f7;
padding:.5em;overflow-x:auto}"""


def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs
    return get_plotlyjs()


def _fig(fig, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config={"displaylogo": False})


def _table(df) -> str:
    return df.to_html(border=0, float_format=lambda v: f"{v:.4g}", na_rep="-", escape=True)


def run_section(run: Run, n: int, shown: Callable[[str], str] = str) -> str:
    """One run: what it was, how it ended (its error as ``shown`` gives it), its headline figures, and its four
    charts."""
    spec, st = run.spec_dict(), run.status()
    summary = summarize(run.metric_rows(), spec, st)  # an own loop's steps are those it took (None while it runs)
    steps = summary["steps_done"] if summary.get("steps") is None else summary["steps"]
    out = [f"<h2>{html.escape(spec.get('name') or run.id)} <span class='note'>{html.escape(run.id)}</span></h2>",
           f"<p>{html.escape(comparison.describe_setup(spec, st))}; {steps} steps"
           + ("" if st.get("own_loop") else f", batch {spec['batch_size']} per rank") + "</p>",
           f"<p>state <b>{html.escape(str(st.get('state')))}</b>"
           + (f": {html.escape(shown(str(st.get('error'))))}" if st.get("error") else "")
           + (f"; owner {html.escape(str(st['owner']))}" if st.get("owner") else "") + "</p>"]
    lines = format_summary(summary)
    if lines:
        out.append("<pre>" + html.escape("\n".join(lines)) + "</pre>")
    if (st.get("disturbance") or {}).get("disturbed"):
        out.append("<p class='warn'>Disturbed: other processes used the CPU during this run; its timings are "
                   "not results.</p>")
    tl = timelines.tail_timeline(run, 40)
    metrics, evals = run.metrics(), run.metrics("eval")
    figs = [("Timeline (last iterations)", plots.timeline_figure(tl, last=3)),
            ("Where the step time goes", plots.breakdown_figure(plots.step_breakdown(tl))),
            ("Loss and accuracy", plots.curves_figure(metrics, evals)),
            ("Bytes per step", plots.bytes_figure(metrics))]
    for k, (title, fig) in enumerate(figs):
        out.append(f"<h3>{title}</h3>" + _fig(fig, f"run{n}-fig{k}"))
    out.append(_explained(run))
    return "\n".join(out)


def _explained(run: Run) -> str:
    """Why the run's step takes its time (commlab.lab.analysis.explain): its sentences and the critical path's parts."""
    try:
        ex = timelines.run_explanation(run)
    except explain.NothingToExplain as e:
        return f"<h3>Why the step takes its time</h3><p class='note'>{html.escape(str(e))}</p>"
    return ("<h3>Why the step takes its time</h3><ul>"
            + "".join(f"<li>{html.escape(x)}</li>" for x in ex.sentences) + "</ul><pre>"
            + html.escape("\n".join(explain.report_lines(ex)[3 + len(ex.sentences):])) + "</pre>")


def comparison_section(runs: List[Run], labels: dict, target_acc: Optional[float] = None) -> str:
    table = comparison.compare_runs(runs, target_acc=target_acc)
    why = ""
    try:  # the last run against the first, part by part
        a, b = runs[0], runs[-1]
        d = explain.compare(timelines.run_explanation(a), timelines.run_explanation(b), labels.get(a.id, a.id),
                            labels.get(b.id, b.id))
        why = ("<h3>Why one is slower than another</h3><ul>"
               + "".join(f"<li>{html.escape(x)}</li>" for x in d["sentences"]) + "</ul>")
    except explain.NothingToExplain:
        pass
    return "\n".join([
        "<h2>Comparison</h2>", _table(table), why,
        "<h3>Accuracy against wall time</h3>",
        _fig(plots.accuracy_vs_time_figure(timelines.accuracy_curves(runs, labels)), "cmp-acc"),
        "<h3>Where the step time goes</h3>",
        _fig(plots.breakdown_bars_figure(timelines.breakdown_table(runs, labels)), "cmp-breakdown")])


def group_section(group: dict, get: Callable[[str], Run]) -> str:
    """A preset's verdict from its runs' own figures, and one iteration of each on one time axis."""
    v = results.evaluate(group, get)
    out = ["<h2>Verdict</h2>"]
    if v.claim:
        out.append(f"<p><b>The paper:</b> {html.escape(v.claim)}</p>")
    verdict = {True: "shown here, with accuracy intact", False: "not shown here", None: "pending"}[v.passed]
    out.append(f"<p><b>Measured here:</b> {verdict}</p><ul>")
    out += [f"<li>{html.escape(line)}</li>" for line in v.lines]
    out += [f"<li class='warn'>{html.escape(n)}</li>" for n in v.notes]
    out.append("</ul>")
    final = {x.label: get(x.run_id) for x in v.variants.values() if x.state in FINAL}
    if final:
        out.append("<h3>One iteration of each, on one time axis</h3>" + _fig(timelines.group_timelines(final), "grp-tl"))
    return "\n".join(out)


def report_html(runs: List[Run], group: Optional[dict] = None, title: Optional[str] = None,
                get: Optional[Callable[[str], Run]] = None, target_acc: Optional[float] = None,
                shown: Callable[[str], str] = str) -> str:
    """The whole report as one HTML string. ``group`` (a preset's result group, commlab.lab.analysis.results) adds its
    verdict; more than one run adds a comparison; every run gets its own section. ``get`` looks the group's
    runs up by id (the UI passes one that checks the viewer may see them); a group needs one. ``shown``: a run's
    error as the reader may see it (the UI's, for a student, without the machine's folders)."""
    if not runs:
        raise ValueError("report: no runs")
    if group is not None and get is None:
        raise ValueError("report: a group needs get= (how to look its runs up by id)")
    labels = timelines.short_labels(runs)
    title = title or (f"commlab report: {runs[0].id}" if len(runs) == 1 else f"commlab report: {len(runs)} runs")
    body = [f"<h1>{html.escape(title)}</h1>",
            f"<p class='note'>Written {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by commlab; figures are "
            "interactive and need no network.</p>"]
    if group is not None:
        body.append(group_section(group, get))
    if len(runs) > 1:
        body.append(comparison_section(runs, labels, target_acc))
    body += [run_section(r, n, shown) for n, r in enumerate(runs)]
    meta = json.dumps({"runs": [r.id for r in runs], "group": group.get("id") if group else None})
    return ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style>"
            f"<script type='text/javascript'>{_plotly_js()}</script>"
            f"<script type='application/json' id='commlab-report'>{html.escape(meta)}</script>"
            "</head><body>\n" + "\n".join(body) + "\n</body></html>\n")
