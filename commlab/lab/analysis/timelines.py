"""Reading a run's timeline and figures for pages and reports: the last steps of every rank's timeline,
read from the end of its files; a run's step-time breakdown; accuracy against wall time; short labels; and
a small cache of what was built, kept until the run's files change."""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

import pandas as pd

from commlab.engine.runfiles import FINAL
from commlab.lab.analysis import explain, live, plots
from commlab.lab.analysis.plots import plain
from commlab.lab.analysis.trace import chrome_trace
from commlab.lab.rundir.store import Run, timeline_frame
from commlab.lab.rundir.summary import warmup_steps
from commlab.lab.base.kept import Kept


def progress(run: Run) -> Tuple[int, int]:
    """(steps done, steps planned)."""
    spec = run.spec_dict()
    done = 0
    for m in run.metric_rows():
        if m.get("kind") == "step":
            done = max(done, m["step"] + 1)
    return done, spec["steps"]


def tail_timeline(run: Run, steps: int = 3) -> pd.DataFrame:
    """The timeline frame of roughly the last ``steps`` iterations of every rank (and what follows them), each
    file read from its end (``Run.timeline_events``), so a long run costs no more than a short one."""
    return timeline_frame(run.timeline_events(last_steps=steps))


CACHED = 32
"""Figures and frames kept by ``cached`` in this process, least recently used first out."""
_CACHE = Kept(CACHED)


def cached(key: tuple, fn):
    """``fn()``, kept under ``key`` (include ``run.files_key()`` so it is built again when the run grows)."""
    return _CACHE.get_or(key, fn)


def run_breakdown(run: Run, max_steps: int = 100) -> Dict[str, float]:
    """Mean step-time breakdown of a run (see ``plots.step_breakdown``) over its last
    ``max_steps`` steps, warm-up left out; cached until the run's files change. While the run goes on
    (a page refreshing every few seconds), only what its files gained is read and each step is
    computed once (commlab.lab.analysis.live)."""
    if max_steps <= live.KEEP_STEPS and run.state not in FINAL:
        lr = live.live_run(run)
        bd = lr.breakdown(max_steps)
        done, _ = lr.progress()
        warm = int((bd["step"].drop_duplicates() < warmup_steps(done)).sum()) if len(bd) else 0
        return plots.mean_breakdown(bd, skip=warm)  # the warm-up steps that are in the tail

    def compute():
        bd = plots.step_breakdown(tail_timeline(run, max_steps))
        n = bd["step"].nunique() if len(bd) else 0
        done, _ = progress(run)
        skip = max(0, warmup_steps(done) - (done - n))  # warm-up steps that are in the tail
        return plots.mean_breakdown(bd, skip=skip)
    return cached(("breakdown", str(run.path), max_steps, run.files_key()), compute)


def run_explanation(run: Run, max_steps: int = 100):
    """commlab.lab.analysis.explain's explanation of the run's last ``max_steps`` steps after the warm-up;
    cached until the run's files change. NothingToExplain before its first timed steps."""
    def compute():
        return explain.explain_frame(tail_timeline(run, max_steps), run.spec_dict())
    return cached(("explain", str(run.path), max_steps, run.files_key()), compute)


def group_timelines(runs_by_label: Dict[str, Run], steps: int = 20):
    """plots.timelines_figure over the last ``steps`` steps of each run; cached until the runs' files change."""

    def build():
        return plots.timelines_figure({k: tail_timeline(r, steps) for k, r in runs_by_label.items()})
    key = ("timelines", steps, *((k, str(r.path), r.files_key()) for k, r in runs_by_label.items()))
    return cached(key, build)


def trace_json(run: Run) -> str:
    return json.dumps(chrome_trace(run), separators=(",", ":"))


def accuracy_curves(runs: List[Run], labels: Optional[Dict[str, str]] = None) -> pd.DataFrame:
    """Long frame (run, step, wall_s, eval_acc) of every run's evaluations, wall time
    counted from its first step's start."""
    rows = []
    for r in runs:
        m, e = r.metrics(), r.metrics("eval")
        t0 = plots.wall_origin(m)
        if e.empty or t0 is None:
            continue
        lab_ = (labels or {}).get(r.id, r.id)
        for _, x in e.iterrows():
            rows.append({"run": lab_, "step": x["step"], "wall_s": x["t"] - t0, "eval_acc": x["eval_acc"]})
    return pd.DataFrame(rows, columns=["run", "step", "wall_s", "eval_acc"])


def breakdown_table(runs: List[Run], labels: Optional[Dict[str, str]] = None) -> pd.DataFrame:
    rows, index = [], []
    for r in runs:
        b = run_breakdown(r)
        if b:
            rows.append(b)
            index.append((labels or {}).get(r.id, r.id))
    return pd.DataFrame(rows, index=index)


def short_labels(runs: List[Run]) -> Dict[str, str]:
    """Readable, unique labels: the run's name plus the last four characters of its id."""
    out = {}
    for r in runs:
        try:
            name = r.spec_dict().get("name") or r.id
        except (OSError, ValueError):
            name = r.id
        out[r.id] = plain(f"{name} ({r.id[-4:]})")
    return out
