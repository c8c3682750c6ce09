"""Does watching a run change its measurement? The same run, unwatched and watched in a browser.

    .venv/bin/python bench/observer.py [--modes sync,wfbp,dear] [--rounds 3] [--steps 80] [--open-before]
    commlab bench observer --rounds 3

For every comm mode the same spec (resnet on digits, 2 ranks, modeled 1 Gbit/s link) runs
unwatched and watched, interleaved: round 1 unwatched then watched, round 2 watched then
unwatched, and so on. "Watched" is what a user does: ``commlab app --no-demo`` serves the
runs directory (one server for the whole benchmark, started here like a user starts it) and
headless Chromium follows the run on the Live run page while it trains (the page refreshes itself
every ``commlab.lab.front.ui.REFRESH_S`` seconds, its charts every ``commlab.lab.front.ui.CHARTS_REFRESH_S``). The browser is the
user's: it runs at normal priority.

When the page opens:

- at Start (the default; the user's way): the browser has the app open on the New run page; the run
  starts, and at once the page switches to the Live run page in the same browser tab, as Queue run's
  ``st.switch_page`` does (here through the navigation's Live run link, which opens the newest run).
  The page's first render then falls on the run's start-up and first steps.
- ``--open-before``: the Live run page is opened on the queued run (``/live_run?run=<id>``) and fully drawn
  before the run starts, so the timed steps never overlap the page's start-up.

The run's supervisor (``python -m commlab.lab.service.supervise``) is started here in a session of its own, as the
lab starts every run (``commlab.lab.service.spawn``): where the kernel groups processes by session for scheduling,
the ranks then compete with the browser as two groups, as they do on a user's machine.

Reported per mode: the median iteration time (slower rank, warm-up left out:
``commlab.lab.rundir.summary.summarize``) watched and unwatched, the ratio watched/unwatched per round and the
median of those ratios; the CPU the observer used (the Streamlit server's and Chromium's process trees,
from /proc) over the whole run and during the timed steps alone (first timed step to last step: what can
slow the measured iterations); and how often the page showed a new step (proof that it followed the
run). Results go to bench/results/observer.md and .json.

Needs the playwright package and Debian's chromium at /usr/bin/chromium (never ``playwright install``).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench.common import markdown_table, prog, write_json  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
MODES = ("sync", "wfbp", "dear")
RESULTS = REPO / "bench" / "results"
TICK = os.sysconf("SC_CLK_TCK")
QUIET = 0.10
"""A run during which processes other than itself and the observer used more than this share of the
machine (the supervisor's disturbance figure less the observer's share) had company: its round is named
in the table, and is better run again."""

# Every time the page shows a new "step N/M" (the live panel's progress bar) it is logged with the
# page's clock: how often the page really followed the run. Runs inside the page, read once at the end.
WATCH_JS = """() => {
  window.__steps = [];
  window.__charts = [];
  const seen = (muts) => {
    const m = document.body.innerText.match(/step (\\d+)\\/(\\d+)/);
    if (m && (window.__steps.length === 0 || window.__steps[window.__steps.length - 1][1] !== +m[1]))
      window.__steps.push([Date.now() / 1000, +m[1]]);
    const now = Date.now() / 1000, c = window.__charts;
    if ((muts || []).some(x => x.target.closest && x.target.closest('.js-plotly-plot'))
        && (c.length === 0 || now - c[c.length - 1] > 0.5))
      c.push(now);  // a chart was redrawn (one mark per redraw burst)
  };
  new MutationObserver(seen).observe(document.body, {subtree: true, childList: true, characterData: true});
  seen();
}"""


def spec_for(mode: str, steps: int, gbps: float) -> dict:
    """The measured run: resnet on digits, sgd, modeled link; 2 MB buffers (dear) or buckets (sync, wfbp)."""
    spec = {"name": f"observer-{mode}", "model": "resnet", "dataset": "digits", "world_size": 2, "steps": steps,
            "batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
            "network": {"link": "modeled", "gbps": gbps}, "eval_every": 0}
    spec["comm"] = {"mode": mode}
    spec["schedule"] = {"name": "bucket", "cap_mb": 2}  # dear's buffers take the schedule's cap too
    return spec


# ---------------------------------------------------------------- CPU from /proc

def _stat(pid: int):
    """(ppid, utime + stime + cutime + cstime in ticks) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rindex(")") + 2:].split()
    return int(fields[1]), sum(int(x) for x in fields[11:15])


def tree_ticks(roots: List[int]) -> Dict[int, int]:
    """CPU ticks of every live process under ``roots`` (the roots included), by pid."""
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st:
                stats[int(name)] = st
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [r for r in roots if r in stats]
    while todo:
        pid = todo.pop()
        out[pid] = stats[pid][1]
        todo.extend(children.get(pid, []))
    return out


class CpuTrace:
    """Cumulative CPU seconds of a few groups of process trees, sampled every ``every`` seconds in a thread,
    so that the CPU of any stretch of the run (its start-up, its timed steps) can be read afterwards."""

    def __init__(self, groups: Dict[str, List[int]], every: float = 0.25):
        self.groups, self.every = groups, every
        self.t0 = {g: tree_ticks(roots) for g, roots in groups.items()}
        self.samples: List[tuple] = []
        self._stop = threading.Event()
        self._sample()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        now = {g: tree_ticks(roots) for g, roots in self.groups.items()}
        used = {g: sum(v - self.t0[g].get(pid, 0) for pid, v in now[g].items()) / TICK for g in now}
        self.samples.append((time.time(), used))

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def stop(self) -> Dict[str, float]:
        """Stop sampling; the CPU seconds of each group since the start."""
        self._stop.set()
        self.thread.join()
        self._sample()
        return dict(self.samples[-1][1])

    def at(self, t: float, group: str) -> float:
        """CPU seconds of ``group`` from the start to time ``t`` (linear between samples)."""
        prev = self.samples[0]
        for cur in self.samples:
            if cur[0] >= t:
                span = cur[0] - prev[0]
                f = (t - prev[0]) / span if span > 0 else 1.0
                return prev[1][group] + max(0.0, min(f, 1.0)) * (cur[1][group] - prev[1][group])
            prev = cur
        return prev[1][group]

    def between(self, a: float, b: float, group: str) -> float:
        return self.at(b, group) - self.at(a, group)


# ---------------------------------------------------------------- the observer

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``commlab app --no-demo`` on a free port over ``runs``, as a user starts it (own process group)."""

    def __init__(self, runs: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "ab")
        self.p = subprocess.Popen([sys.executable, "-m", "commlab.lab.front.cli", "app", "--no-demo", "--port", str(self.port),
                                   "--runs", str(runs)], cwd=str(REPO), stdout=self.log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        t0 = time.time()
        while True:
            try:
                with urllib.request.urlopen(self.url + "/_stcore/health", timeout=2):
                    return
            except OSError:
                if self.p.poll() is not None or time.time() - t0 > 120:
                    self.close()
                    raise RuntimeError(f"the UI did not come up; see {log}")
                time.sleep(0.3)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGINT)
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
            except ProcessLookupError:
                pass
        self.log.close()


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def chromium_roots() -> List[int]:
    """The main Chromium processes under this one (playwright's driver starts them): their trees are
    the browser's renderer, GPU and utility processes. The driver itself is the benchmark's, not the
    user's, and is not counted."""
    mine = tree_ticks([os.getpid()])
    browsers = {pid for pid in mine if "chrom" in os.path.basename(_exe(pid))}
    return [pid for pid in browsers if (_stat(pid) or (0,))[0] not in browsers]


# ---------------------------------------------------------------- one run

def new_viewer(browser, url: str):
    page = browser.new_page(viewport={"width": 1400, "height": 2400})
    page.set_default_timeout(120_000)
    page.goto(url)
    return page


def step_times(run) -> tuple:
    """(first step's end, the last warm-up step's end, the last step's end), in wall-clock seconds, the
    slower rank's: the run's timed steps lie between the second and the third."""
    from commlab.lab.rundir.summary import warmup_steps
    ends: Dict[int, float] = {}
    for m in run.metric_rows():
        if m.get("kind") == "step" and m.get("t") is not None:
            ends[m["step"]] = max(ends.get(m["step"], 0.0), m["t"])
    if not ends:
        return None, None, None
    warm = warmup_steps(len(ends))
    return ends[min(ends)], ends.get(warm - 1, ends[min(ends)]), ends[max(ends)]


def one_run(runs: Path, spec: dict, server: Server, pw, watched: bool, page_name: str = "live_run",
            viewers: int = 1, results_page: bool = False, open_before: bool = False) -> dict:
    import commlab
    from commlab.lab.base import procs
    from commlab.lab.service.queue import Lab
    from commlab.lab.rundir.summary import summarize
    lab_ = Lab(runs)
    run = lab_.create(commlab.spec(spec))
    run.mark_queued(supervisor=procs.identity())  # this process owns it until the supervisor starts
    browser = None
    pages: list = []
    out = {"run": run.id, "watched": watched, "open": "before" if open_before else "start"}
    try:
        if watched:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
            for _ in range(viewers):  # more than one: several tabs (or users) on the same run
                if open_before:
                    page = new_viewer(browser, f"{server.url}/{page_name}?run={run.id}")
                    page.get_by_text("Where the step time goes").wait_for()
                    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 3")
                else:  # the app open on the New run page, as a user has it when they press Queue run
                    page = new_viewer(browser, f"{server.url}/new_run")
                    page.get_by_text("Queue run").wait_for()
                page.evaluate(WATCH_JS)  # the page is not reloaded when it switches: the watch stays
                pages.append(page)
            if results_page:  # the preset results page too, on a group holding this run (another tab)
                from commlab.lab.analysis.results import save_group
                gid = save_group(runs, "observer", {spec["name"]: run.id})
                res = new_viewer(browser, f"{server.url}/results?group={gid}")
                res.get_by_text("Measured here").wait_for()
            time.sleep(1.0)  # what the pages did while they opened is over
        browser_roots = chromium_roots() if watched else []
        trace = CpuTrace({"server": [server.p.pid], "browser": browser_roots})
        t0 = time.time()
        with open(run.file("supervisor.log"), "ab") as log:
            sup = subprocess.Popen([sys.executable, "-m", "commlab.lab.service.supervise", "--runs", str(runs), run.id],
                                   cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        if watched and not open_before:
            for page in pages:  # right after Start: the tab goes from New run to the Live run page
                if page_name == "live_run":
                    page.get_by_role("link", name="Live run").click()
                else:
                    page.goto(f"{server.url}/{page_name}?run={run.id}")
        try:
            sup.wait(timeout=600)
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.wait()
        wall = time.time() - t0
        used = trace.stop()
        out["server_cpu_s"], out["browser_cpu_s"] = used["server"], used["browser"]
        out["observer_cpu_s"] = used["server"] + used["browser"]
        out["wall_s"] = wall
        out["observer_cpu_pct"] = 100 * out["observer_cpu_s"] / wall
        out["state"] = run.state
        # the supervisor's own reading of other processes' share of the machine over the run
        # (commlab.lab.rundir.disturbance): about 0 unwatched on a quiet machine; watched, it sees the observer too
        out["other_cpu"] = (run.status().get("disturbance") or {}).get("other_cpu")
        s = summarize(run.metric_rows(), run.spec_dict())
        out["iter_ms"] = s.get("iter_ms_median")
        first, timed, last = step_times(run)
        if first is not None:
            out["first_step_s"], out["timed_from_s"], out["timed_s"] = first - t0, timed - t0, last - timed
            for g in ("server", "browser"):
                out[f"{g}_cpu_startup_s"] = trace.between(t0, timed, g)
                out[f"{g}_cpu_timed_s"] = trace.between(timed, last, g)
            out["observer_cpu_timed_pct"] = (100 * (out["server_cpu_timed_s"] + out["browser_cpu_timed_s"])
                                             / max(last - timed, 1e-9))
        if pages:
            page = pages[-1]
            out["page_url"] = page.url
            # while the ranks trained (first step logged to last), how long the page went without a new step
            seen = page.evaluate("() => window.__steps")
            ts = [m["t"] for m in run.metric_rows() if m.get("kind") == "step"]
            first, last = (min(ts), max(ts)) if ts else (t0, time.time())
            during = [t for t, _ in seen if first < t < last]
            marks = [first, *during, last]
            out["page_updates"] = len(during)
            out["page_max_gap_s"] = max(b - a for a, b in zip(marks, marks[1:]))
            out["page_last_step"] = seen[-1][1] if seen else None
            drawn = [first, *[t for t in page.evaluate("() => window.__charts") if first < t < last], last]
            out["charts_max_gap_s"] = max(b - a for a, b in zip(drawn, drawn[1:]))
            out["train_s"] = last - first
    finally:
        if browser is not None:
            browser.close()
    return out


# ---------------------------------------------------------------- report

def others(r: dict) -> float:
    """The share of the machine that processes other than the run and the observer used during a run:
    the supervisor's figure (everything but the run) less the observer's own share."""
    cpus = os.cpu_count() or 1
    return (r.get("other_cpu") or 0.0) - r.get("observer_cpu_s", 0.0) / max(r.get("wall_s", 1.0), 1e-9) / cpus


def report(results: List[dict], modes: List[str]) -> tuple:
    rows, summary = [], {}
    for mode in modes:
        rs = [r for r in results if r["mode"] == mode and r.get("iter_ms")]
        un = [r["iter_ms"] for r in rs if not r["watched"]]
        wa = [r["iter_ms"] for r in rs if r["watched"]]
        by_round: Dict[int, dict] = {}
        for r in rs:
            by_round.setdefault(r["round"], {})[r["watched"]] = r["iter_ms"]
        ratios = [d[True] / d[False] for _, d in sorted(by_round.items()) if True in d and False in d]
        cpu_w = [r["observer_cpu_pct"] for r in rs if r["watched"]]
        cpu_u = [r["observer_cpu_pct"] for r in rs if not r["watched"]]
        cpu_t = [r["observer_cpu_timed_pct"] for r in rs if r["watched"] and r.get("observer_cpu_timed_pct") is not None]
        gaps = [r["page_max_gap_s"] for r in rs if r["watched"] and r.get("page_max_gap_s") is not None]
        cgaps = [r["charts_max_gap_s"] for r in rs if r["watched"] and r.get("charts_max_gap_s") is not None]
        ups = [r["page_updates"] for r in rs if r["watched"] and r.get("page_updates") is not None]
        if not (un and wa and ratios):
            continue
        busy = sorted({r["round"] for r in rs if others(r) > QUIET})
        m = {"unwatched_ms": statistics.median(un), "watched_ms": statistics.median(wa), "round_ratios": ratios,
             "median_ratio": statistics.median(ratios), "observer_cpu_pct_watched": statistics.median(cpu_w),
             "observer_cpu_pct_unwatched": statistics.median(cpu_u),
             "observer_cpu_pct_timed": statistics.median(cpu_t) if cpu_t else None,
             "page_updates": ups, "page_max_gap_s": max(gaps) if gaps else None,
             "charts_max_gap_s": max(cgaps) if cgaps else None,
             "rounds_with_other_load": busy}
        summary[mode] = m
        rows.append((mode, f"{m['unwatched_ms']:.1f}", f"{m['watched_ms']:.1f}",
                     " ".join(f"{x:.3f}" for x in ratios), f"**{m['median_ratio']:.3f}**",
                     f"{m['observer_cpu_pct_watched']:.0f}% ({m['observer_cpu_pct_unwatched']:.0f}%)",
                     f"{m['observer_cpu_pct_timed']:.0f}%" if cpu_t else "-",
                     (f"{min(ups)}-{max(ups)}, max gap {m['page_max_gap_s']:.1f} s (charts "
                      f"{m['charts_max_gap_s']:.1f} s)") if ups else "-",
                     ", ".join(map(str, busy)) or "none"))
    table = markdown_table(["mode", "unwatched ms", "watched ms", "watched/unwatched per round", "median ratio",
                            "observer CPU watched (unwatched), % of a core", "in the timed steps",
                            "page updates per run",
                            "rounds disturbed by others"], rows)
    return table, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comm modes, comma-separated (default: all)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (unwatched, watched) per mode")
    ap.add_argument("--steps", type=int, default=80, help="steps per run")
    ap.add_argument("--gbps", type=float, default=1.0, help="the modeled link's bandwidth")
    ap.add_argument("--runs", default=None, help="runs directory (default: a fresh one under /tmp)")
    ap.add_argument("--out", default=str(RESULTS / "observer"), help="results path without extension")
    ap.add_argument("--page", default="live_run", help="the page to watch (default live_run)")
    ap.add_argument("--viewers", type=int, default=1, help="browser tabs open on the run when watched (default 1)")
    ap.add_argument("--results-page", action="store_true",
                    help="when watched, also open the results page of a group holding the run (another tab)")
    ap.add_argument("--open-before", action="store_true",
                    help="open the page on the queued run and let it draw before the run starts (default: at "
                         "Start, switching from the New run page as a user does)")
    a = ap.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or a.rounds < 1 or a.steps < 20:
        print(f"observer: --modes from {', '.join(MODES)}, --rounds >= 1, --steps >= 20", file=sys.stderr)
        return 2
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("observer: needs the playwright package (pip install playwright; never `playwright install`)",
              file=sys.stderr)
        return 2
    if not os.access(CHROMIUM, os.X_OK):
        print(f"observer: no browser at {CHROMIUM} (apt-get install chromium)", file=sys.stderr)
        return 2
    import tempfile
    from commlab.lab.front import ui
    runs = Path(a.runs or tempfile.mkdtemp(prefix="commlab-observer-"))
    runs.mkdir(parents=True, exist_ok=True)
    server = Server(runs, runs / "app.log")
    results: List[dict] = []
    t_start = time.time()
    try:
        with sync_playwright() as pw:
            for rnd in range(a.rounds):
                for k, mode in enumerate(modes):
                    order = (False, True) if (rnd + k) % 2 == 0 else (True, False)
                    for watched in order:
                        r = one_run(runs, spec_for(mode, a.steps, a.gbps), server, pw, watched, a.page, a.viewers,
                                    a.results_page, a.open_before)
                        r.update(mode=mode, round=rnd + 1)
                        results.append(r)
                        extra = (f", page: {r.get('page_updates')} updates, max gap {r.get('page_max_gap_s', 0):.1f} s"
                                 f" (charts {r.get('charts_max_gap_s', 0):.1f} s); in the timed steps (from "
                                 f"{r.get('timed_from_s', 0):.1f} s, {r.get('timed_s', 0):.1f} s long) server "
                                 f"{r.get('server_cpu_timed_s', 0):.2f} s, browser {r.get('browser_cpu_timed_s', 0):.2f} s"
                                 if watched else "")
                        print(f"round {rnd + 1} {mode:4s} {'watched  ' if watched else 'unwatched'}: "
                              f"{r.get('iter_ms') or float('nan'):.1f} ms ({r['state']}), observer "
                              f"{r['observer_cpu_pct']:.0f}% of a core (server {r['server_cpu_s']:.1f} s, browser "
                              f"{r['browser_cpu_s']:.1f} s in {r['wall_s']:.1f} s), others per the supervisor "
                              f"{100 * (r.get('other_cpu') or 0):.0f}% of the machine{extra}", flush=True)
    finally:
        server.close()
    table, summary = report(results, modes)
    cmd = "commlab bench observer " + " ".join(argv if argv is not None else sys.argv[1:])
    info = {"command": cmd.strip(), "modes": modes, "rounds": a.rounds, "steps": a.steps, "gbps": a.gbps,
            "page": a.page, "viewers": a.viewers, "results_page": a.results_page,
            "open": "before" if a.open_before else "start", "cpus": os.cpu_count(), "refresh_s": ui.REFRESH_S,
            "charts_refresh_s": ui.CHARTS_REFRESH_S,
            "elapsed_s": time.time() - t_start, "spec": {m: spec_for(m, a.steps, a.gbps) for m in modes}}
    pages = f"the {a.page} page" + (" and a results page" if a.results_page else "") \
        + (f" ({a.viewers} tabs)" if a.viewers > 1 else "") \
        + (", opened before the run starts" if a.open_before else ", opened at Start")
    md = (f"# Watching a run: the same run unwatched and with {pages} open in headless Chromium\n\n"
          f"`{info['command']}`, {os.cpu_count()} cores, {a.steps} steps per run, modeled {a.gbps:g} Gbit/s link, "
          f"{a.rounds} interleaved rounds, {info['elapsed_s'] / 60:.1f} min. Median iteration time (slower rank, "
          f"warm-up left out); ratio = watched/unwatched in the same round. Observer CPU: the Streamlit server's "
          f"and Chromium's process trees during the run, and during its timed steps alone, % of one core. Page updates: how often the page showed a "
          f"new step while the ranks trained, and the longest wait for a new step (and for a chart redraw).\n\n"
          f"{table}\n")
    print("\n" + md)
    write_json(a.out + ".json", {"info": info, "summary": summary, "runs": results})
    with open(a.out + ".md", "w") as f:
        f.write(md)
    bad_runs = [r for r in results if r.get("state") != "done"]
    return 1 if bad_runs else 0


if __name__ == "__main__":
    sys.exit(main())
