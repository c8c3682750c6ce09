"""Regenerate the UI's screenshots in docs/screenshots/ from a fresh lab.

    .venv/bin/python scripts/screenshots.py [--out docs/screenshots] [--port N] [--runs DIR]

Starts `commlab app` over an empty runs directory (a temporary one unless --runs names one), so the app queues
its demo run as it does for a new user; waits for the demo run to finish, then drives Debian's chromium
(/usr/bin/chromium, through Playwright; nothing is downloaded) over the pages: Home, Live run of the demo run,
the Sketch-Fusion preset started from Home and followed on its Results page until its verdict is complete,
Compare, New run, Sweeps, Performance model and Advisor. Every shot waits for what it shows (a heading, the
traces of a figure, the end of Streamlit's script run), never for a fixed time. About 3 minutes on 2 cores.
At the end the app is stopped and every run it started has ended.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
PRESET = "countsketch-vs-topk"
"""The quickest preset, followed to its verdict for results.png."""

SETTLED = """() => document.querySelectorAll('[data-stale="true"]').length === 0
    && !document.querySelector('[data-testid="stSkeleton"]')
    && !document.querySelector('[data-testid="stStatusWidget"]')"""
"""No script run in progress and nothing left over from an earlier one."""
HAS_TRACE = """name => [...document.querySelectorAll('.js-plotly-plot')].some(
    p => (p._fullData || []).some(t => t.name === name && t.visible !== false && t.x && t.x.length > 0))"""
PLOTS_AT_LEAST = "n => document.querySelectorAll('.js-plotly-plot').length >= n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=2):
                return
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"screenshots: commlab app ended (status {proc.returncode}):\n{log.read_text()}")
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"screenshots: the UI did not come up in {timeout:.0f} s; see {log}")
            time.sleep(0.3)


def demo_run(runs: Path, timeout: float = 600.0):
    """The demo run the app queued, once it is done."""
    import commlab
    t0 = time.monotonic()
    while not commlab.runs(runs=runs):
        if time.monotonic() - t0 > 60:
            raise SystemExit(f"screenshots: commlab app queued no demo run in {runs}")
        time.sleep(0.5)
    run = commlab.runs(runs=runs)[0]
    state = commlab.wait(run.id, runs=runs, timeout=timeout)
    if state != "done":
        raise SystemExit(f"screenshots: the demo run {run.id} ended {state}: {commlab.get(run.id, runs=runs).errors()}")
    return commlab.get(run.id, runs=runs)


def shoot(page, out: Path, name: str, full_page: bool = False) -> None:
    page.wait_for_function(SETTLED, timeout=60_000, polling=250)
    page.screenshot(path=str(out / name), full_page=full_page)
    print(f"wrote {out / name}", flush=True)


def take(url: str, runs: Path, out: Path) -> None:
    from playwright.sync_api import sync_playwright
    demo = demo_run(runs)
    steps = demo.spec_dict()["steps"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.set_default_timeout(60_000)
            page.goto(url)
            page.locator(f".st-key-preset-{PRESET}").wait_for()
            shoot(page, out, "home.png")

            page.goto(f"{url}/live_run?run={demo.id}")
            page.get_by_text("Where the step time goes").wait_for()
            page.wait_for_function(HAS_TRACE, arg="backward", timeout=120_000, polling=500)
            page.wait_for_function(HAS_TRACE, arg="eval accuracy", timeout=120_000, polling=500)
            page.get_by_text(f"step {steps}/{steps}").wait_for()
            shoot(page, out, "live_run.png")

            page.goto(url)
            page.locator(f".st-key-preset-{PRESET}").get_by_role("button", name="Start").click()
            page.wait_for_url("**/results?group=*")
            page.get_by_text("the whole experiment took").wait_for(timeout=600_000)  # the verdict, complete
            page.wait_for_function(HAS_TRACE, arg="comm", timeout=60_000, polling=500)
            page.wait_for_function(PLOTS_AT_LEAST, arg=3, timeout=60_000, polling=250)
            shoot(page, out, "results.png", full_page=True)

            page.goto(url + "/compare")
            page.get_by_text("Accuracy against wall time").wait_for()
            page.wait_for_function(PLOTS_AT_LEAST, arg=3, timeout=60_000, polling=250)
            shoot(page, out, "compare.png")

            for link, title, name, plots in (("New run", "New run", "new_run.png", 0),
                                             ("Sweeps", "Sweeps", "sweeps.png", 0),
                                             ("Performance model", "Performance model", "model.png", 2),
                                             ("Advisor", "Advisor", "advisor.png", 0)):
                page.get_by_role("link", name=link).click()
                page.get_by_role("heading", name=title, exact=True).wait_for()
                if plots:  # calibrating and measuring the compressors' curves takes a while
                    page.wait_for_function(PLOTS_AT_LEAST, arg=plots, timeout=180_000, polling=500)
                shoot(page, out, name)
        finally:
            browser.close()


def stop(proc: subprocess.Popen, runs: Path) -> None:
    """Stop the app (SIGINT: its clean stop), then every run still going; nothing of it is left."""
    import commlab
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for r in commlab.runs(runs=runs):
        if r.state in ("queued", "running"):
            commlab.cancel(r.id, runs=runs)
    for r in commlab.runs(runs=runs):
        commlab.wait(r.id, runs=runs, timeout=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=f"Writes {OUT.relative_to(ROOT)}/*.png unless --out says otherwise.")
    ap.add_argument("--out", default=str(OUT), help=f"folder for the PNGs (default {OUT.relative_to(ROOT)})")
    ap.add_argument("--port", type=int, default=None, help="the app's port (default: a free one)")
    ap.add_argument("--runs", default=None, help="an empty runs directory to use (default: a temporary one)")
    args = ap.parse_args(argv)
    if not os.access(CHROMIUM, os.X_OK):
        print(f"screenshots: no browser at {CHROMIUM} (apt-get install chromium)", file=sys.stderr)
        return 2
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        print("screenshots: the playwright package is missing (the dev extra)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="commlab-screenshots-"))
    runs = Path(args.runs).resolve() if args.runs else tmp / "runs"
    if runs.exists() and any(runs.iterdir()):
        print(f"screenshots: --runs {runs} is not empty; the shots are of a fresh lab", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "app.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "commlab.lab.front.cli", "app", "--port", str(port), "--runs", str(runs)],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_up(url, proc, log)
        take(url, runs, out)
    finally:
        stop(proc, runs)
    if not args.runs:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
