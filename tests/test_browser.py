"""End to end in a real browser: `commlab app` (commlab.lab.front.appserver.app_main) serves the UI, a
click on each preset starts its runs and opens its results view, one preset's
verdict fills in as its runs finish, and the live page draws a run's timeline
and accuracy curve; the Results, Live run and Compare pages show why a step
takes its time (the Explain panel).

Needs the Python package playwright and Debian's chromium (/usr/bin/chromium);
the test is skipped without them. It never downloads a browser. Screenshots go
to the test's tmp directory; set COMMLAB_SCREENSHOTS=DIR to keep copies
(docs/screenshots/ holds the README's).
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import commlab
from distutil import stop_process, wait_until_up
from commlab.lab.analysis import timelines
from commlab.lab.analysis.presets import PRESETS  # noqa: E402
from test_presets_train import BROWSER_FOLLOWS, assert_trained  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"no browser at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)

# The live page's figures, found by their traces. Plotly keeps them on the chart's div; _fullData holds
# the decoded arrays (data may hold numpy arrays still base64-encoded as {dtype, bdata}).
HAS_TRACE = """name => [...document.querySelectorAll('.js-plotly-plot')].some(
    p => (p._fullData || []).some(t => t.name === name && t.visible !== false && t.x && t.x.length > 0))"""
SETTLED = """() => document.querySelectorAll('[data-stale="true"]').length === 0
    && !document.querySelector('[data-testid="stSkeleton"]')
    && !document.querySelector('[data-testid="stStatusWidget"]')"""
"""No script run in progress and nothing left over from an earlier one (for the screenshots)."""


def labels_of(runs):
    return timelines.short_labels(commlab.runs(runs=runs))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    """The UI on a free port over an empty runs directory; stopped, with every run it started."""
    runs = tmp_path / "runs"
    port = free_port()
    code = f"import sys; from commlab.lab.front.appserver import app_main; sys.exit(app_main({port}, {str(runs)!r}, demo=False))"
    log = open(tmp_path / "app.log", "wb")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), start_new_session=True, stdout=log,
                         stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, p, tmp_path / "app.log")
        yield url, runs
    finally:
        for r in commlab.runs(runs=runs):
            if r.state in ("queued", "running"):
                commlab.cancel(r.id, runs=runs)
        for r in commlab.runs(runs=runs):
            commlab.wait(r.id, runs=runs, timeout=60)
        stop_process(p, signal.SIGINT, timeout=20)
        log.close()


def keep(shot: Path, name: str) -> None:
    where = os.environ.get("COMMLAB_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(where) / name)


def test_presets_to_results_then_live_timeline_and_accuracy(server, tmp_path):
    """A preset's Start leads to its results view (every preset's Start is tests/test_app.py's, through the
    pages' own test harness); one preset (the quickest) is followed until its verdict is complete, with the
    timelines side by side; then a run's live page and the other pages."""
    from commlab.lab.front import groups
    url, runs = server
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            page.set_default_timeout(60_000)
            followed = next(p for p in PRESETS if p.key == BROWSER_FOLLOWS)
            page.goto(url)
            card = page.locator(f".st-key-preset-{BROWSER_FOLLOWS}")
            card.get_by_role("button", name="Start").click()  # waits until the button is there
            page.wait_for_url("**/results?group=*")
            page.get_by_text(followed.claim[:40]).wait_for()
            page.get_by_text("runs finished").first.wait_for()
            # the verdict fills in as the runs finish, with no reload
            page.get_by_text("the whole experiment took").wait_for(timeout=300_000)
            page.wait_for_function(HAS_TRACE, arg="comm", timeout=60_000, polling=500)
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 3")
            page.get_by_text("countsketch: sends").wait_for()
            # the Explain panel: why one variant is slower than another, and its critical path
            page.get_by_text("Why one is slower than another").wait_for()
            page.get_by_text("ms per step").first.wait_for()
            page.get_by_text("is bound by").first.wait_for()
            page.wait_for_function(SETTLED, timeout=60_000, polling=250)
            shot = tmp_path / "results.png"
            page.screenshot(path=str(shot), full_page=True)
            keep(shot, "results.png")
            gid = page.url.rsplit("group=", 1)[1]
            ids = list(groups.preset_group(gid, runs)["runs"].values())
            assert all(commlab.get(i, runs=runs).state == "done" for i in ids)
            # tests/test_presets_train.py leaves this preset's accuracy to this test: the same checks
            assert_trained(followed, groups.preset_group(gid, runs), lambda rid: commlab.get(rid, runs=runs))
            page.goto(f"{url}/live_run?run={ids[0]}")
            page.get_by_text("Where the step time goes").wait_for()
            page.wait_for_function(HAS_TRACE, arg="backward", timeout=120_000, polling=500)
            page.wait_for_function(HAS_TRACE, arg="eval accuracy", timeout=120_000, polling=500)
            page.get_by_text("step 300/300").wait_for()
            page.get_by_text("Why the step takes its time").wait_for()
            page.get_by_text("is bound by").first.wait_for()
            page.wait_for_function(SETTLED, timeout=60_000, polling=250)
            shot = tmp_path / "live_run.png"
            page.screenshot(path=str(shot))
            keep(shot, "live_run.png")
            page.goto(url + "/compare")
            page.get_by_text("Accuracy against wall time").wait_for()
            page.get_by_text("Why one is slower than another").wait_for()
            page.get_by_text("ms per step").first.wait_for()
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 3")
            page.wait_for_function(SETTLED, timeout=60_000, polling=250)
            shot = tmp_path / "compare.png"
            page.screenshot(path=str(shot))
            keep(shot, "compare.png")
            # the other pages, each with its real content, for the README
            for link, title, name in (("Home", "commlab", "home.png"), ("New run", "New run", "new_run.png"),
                                      ("Sweeps", "Sweeps", "sweeps.png"),
                                      ("Performance model", "Performance model", "model.png")):
                page.get_by_role("link", name=link).click()
                page.get_by_role("heading", name=title, exact=True).wait_for()
                if name == "model.png":  # calibrating and measuring the compressors' curves takes a while
                    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 2",
                                           timeout=120_000, polling=500)
                page.wait_for_function(SETTLED, timeout=60_000, polling=250)
                shot = tmp_path / name
                page.screenshot(path=str(shot))
                keep(shot, name)
        finally:
            browser.close()
