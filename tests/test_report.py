"""Reports to take home (commlab/lab/analysis/report.py, `commlab report`): one HTML file with the figures, which opens in
headless Chromium with every network request refused and draws them."""
import os
import re
from pathlib import Path

import pytest

import commlab
from commlab.lab.analysis import results
from commlab.lab.front.cli import main
from test_app import SMALL

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    a = commlab.run(dict(SMALL, name="rep-a", eval_every=2), runs=root)
    b = commlab.run(dict(SMALL, name="rep-b", eval_every=2, compressor={"name": "fp16"}), runs=root)
    assert a.state == b.state == "done", (a.log_tail(), b.log_tail())
    gid = results.save_group(root, "dear-vs-ddp", {"dear": a.id, "ddp": b.id})
    return root, a, b, gid


def test_report_command_writes_one_self_contained_file(finished, tmp_path, capsys):
    root, a, b, gid = finished
    out = tmp_path / "r.html"
    assert main(["report", "--group", gid, "-o", str(out), "--runs", str(root)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    text = out.read_text()
    assert not re.search(r"<script[^>]+src=", text)  # nothing loaded from elsewhere
    assert not re.search(r"<link[^>]+href=", text)
    assert "Plotly" in text and text.count("Plotly.newPlot") == 1 + 2 + 2 * 4  # group, comparison, 4 per run
    assert a.id in text and b.id in text and "The paper:" in text and "DeAR over DDP-style wfbp" in text


@pytest.mark.parametrize("argv,msg", [
    (["report", "-o", "x.html"], "commlab: error: give run ids or --group GID"),
    (["report", "no-such-run"], "commlab: error: no run 'no-such-run'"),
    (["report", "../../etc"], "commlab: error: run id '../../etc' is not valid"),
    (["report", "--group", "nope"], "commlab: error: --group: group: no group 'nope'"),
])
def test_report_bad_input_is_one_line(finished, tmp_path, capsys, argv, msg):
    root = finished[0]
    assert main([*argv, "--runs", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(msg) and err.count("\n") == 1, err


def test_report_opens_offline_in_chromium(finished, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no browser at {CHROMIUM}")
    root, a, b, gid = finished
    out = tmp_path / "r.html"
    assert main(["report", a.id, b.id, "--group", gid, "-o", str(out), "--runs", str(root)]) == 0
    asked = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            ctx = browser.new_context(offline=True)

            def refuse(route):  # anything but the file itself would need a network
                if not route.request.url.startswith("file://"):
                    asked.append(route.request.url)
                    return route.abort()
                return route.continue_()
            ctx.route("**/*", refuse)
            page = ctx.new_page()
            page.set_default_timeout(60_000)
            page.goto(Path(out).as_uri())
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length === 11")
            drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(
                p => (p._fullData || []).filter(t => (t.x && t.x.length) || (t.y && t.y.length)).length)""")
            names = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].flatMap(
                p => (p._fullData || []).map(t => t.name))""")
        finally:
            browser.close()
    assert asked == []
    assert all(n > 0 for n in drawn), drawn  # every figure has data on it
    assert "backward" in names and "eval accuracy" in names, sorted(set(map(str, names)))


def test_live_page_offers_the_report(finished, monkeypatch):
    from streamlit.testing.v1 import AppTest
    from test_app import ENTRY
    root, a, b, gid = finished
    monkeypatch.setenv("COMMLAB_RUNS", str(root))
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.query_params["run"] = a.id
    at.run().switch_page("views/live_run.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(b.label.startswith("Download report") for b in at.get("download_button"))


def test_the_ui_builds_a_report_in_a_thread_that_acts_for_no_one(finished):
    """The report button's builder runs in a server thread outside any session (a signed-in lookup there
    raises): it reads only the runs the page resolved for the viewer."""
    from commlab.lab.front import ui
    from commlab.lab.analysis.report import report_html
    root, a, b, gid = finished
    group = results.load_group(root, gid)
    ui.set_viewer(lambda: None)  # what commlab/app/room/access.py's resolver gives outside a session
    try:
        with pytest.raises(PermissionError):
            ui.get_run(a.id, root)
        text = report_html([a, b], group=group, get={a.id: a, b.id: b}.__getitem__)
    finally:
        ui.set_viewer(None)
    assert text.count("Plotly.newPlot") == 11
