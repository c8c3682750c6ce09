"""The workshop server in a real browser (Chromium through playwright): `commlab app --host 0.0.0.0`
as a room meets it. A browser without a token, or with a wrong one, gets the sign-in page and nothing
of the runs; the class link signs a student in and no token is in the address bar or the history,
then or later; the student's personal link opens their run and its trace downloads once, from that
session only (the file's URL serves nothing afterwards); another student's browser, given that run's id,
gets none of it; signing out ends the session, and Back shows nothing of the lab.

Needs the Python package playwright and Debian's chromium (/usr/bin/chromium); skipped without them.
"""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import commlab
from distutil import stop_process, wait_until_up
from commlab.app.room import access
from commlab.room import accounts
from commlab.room import open_lab
from test_app import SMALL
from test_browser import CHROMIUM, SETTLED, free_port

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"no browser at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def room(tmp_path):
    """A finished run of alice's (a student who signed in earlier), and the lab served on 0.0.0.0 (so with
    sign-in) over its directory."""
    runs = tmp_path / "runs"
    alice = accounts.sign_in(runs, accounts.load_access(runs)["class_token"], "alice")
    run = open_lab(runs, room=True).submit(commlab.spec(SMALL), owner="alice")
    assert run.state == "done", run.status()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != accounts.ACCESS_ENV}
    code = f"import sys; from commlab.lab.front.appserver import app_main; sys.exit(app_main({port}, {str(runs)!r}, host='0.0.0.0', demo=False))"
    log = open(tmp_path / "app.log", "wb")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), env=env, start_new_session=True,
                         stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, p, tmp_path / "app.log")
        yield url, runs, run, accounts.load_access(runs)["class_token"], alice
    finally:
        stop_process(p, signal.SIGTERM, timeout=20)
        log.close()


def settle(page, text: str) -> None:
    page.get_by_text(text).first.wait_for(timeout=60_000)
    page.wait_for_function(SETTLED, timeout=60_000)


def no_token_anywhere(page) -> None:
    """No token in the address bar, nor in any entry of this tab's history (what Back can reach), read
    from Chromium itself (DevTools' Page.getNavigationHistory)."""
    assert "token=" not in page.url, page.url
    cdp = page.context.new_cdp_session(page)
    entries = cdp.send("Page.getNavigationHistory")["entries"]
    cdp.detach()
    assert entries and all("token=" not in e["url"] for e in entries), [e["url"] for e in entries]


def sign_in(browser, url: str, class_token: str, name: str):
    """A fresh browser context signed in through the class link; returns (page, personal token)."""
    page = browser.new_context(accept_downloads=True).new_page()
    page.goto(f"{url}/?token={class_token}")
    page.get_by_text("Pick the name your runs will carry").wait_for(timeout=60_000)
    assert "token=" not in page.url and page.url.endswith("/signin/name")
    page.get_by_label("Your name").fill(name)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_text("Your personal link").wait_for(timeout=60_000)
    text = page.inner_text("body")
    personal = text.split("?token=", 1)[1].split()[0].rstrip(").,")
    page.get_by_role("button", name="Go to the lab").click()
    settle(page, "Signed in as")
    return page, personal


def test_sign_in_and_one_shot_downloads_in_chromium(room):
    url, runs, run, class_token, token = room
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            # no token, then a wrong one: the sign-in page only, nothing of the run
            stranger = browser.new_context().new_page()
            stranger.goto(f"{url}/live_run?run={run.id}")
            stranger.get_by_text("This lab is shared over the network").wait_for(timeout=60_000)
            assert stranger.url.endswith("/signin") and run.id not in stranger.content()
            stranger.goto(f"{url}/?token=not-a-token")
            stranger.get_by_text("That token is not valid.").wait_for(timeout=60_000)
            assert run.id not in stranger.content() and class_token not in stranger.content()

            dave, dave_token = sign_in(browser, url, class_token, "dave")
            assert accounts.check_token(runs, dave_token).name == "dave"
            time.sleep(8)  # what the attacker saw: the token still in the address bar 8 s later
            no_token_anywhere(dave)
            assert dave_token not in dave.content() and run.id not in dave.content()
            dave.goto(f"{url}/new_run")  # a student's New run form names no code
            settle(dave, "Model from")
            dave.get_by_role("combobox", name="Model from").click()  # open the choices
            options = dave.get_by_role("option").all_inner_texts()
            assert "zoo" in options and "import path" not in options, options
            dave.keyboard.press("Escape")
            accounts.revoke(runs, "dave")  # revoked: the next page is the sign-in page, the token is dead
            dave.reload()
            dave.get_by_text("This lab is shared over the network").wait_for(timeout=60_000)
            dave.goto(f"{url}/?token={dave_token}")
            dave.get_by_text("That token is not valid.").wait_for(timeout=60_000)

            alice = browser.new_context(accept_downloads=True).new_page()  # alice's personal link
            alice.goto(f"{url}/live_run?run={run.id}&token={token}")
            settle(alice, "Download trace")
            assert "token=" not in alice.url and "run=" in alice.url
            no_token_anywhere(alice)
            alice.goto(f"{url}/live_run?run={run.id}")
            settle(alice, "Download trace")
            with alice.expect_download(timeout=60_000) as got:
                alice.get_by_role("button", name="Download trace").click()
            download = got.value
            # Chromium may fetch a download twice; served strictly once, it cancelled it (access.REFETCH_S)
            trace = json.loads(Path(download.path()).read_text())
            assert trace["traceEvents"], "an empty trace"
            assert "/media/" in download.url
            time.sleep(access.REFETCH_S + 0.5)
            assert alice.context.request.get(download.url).status == 404  # served once: the URL is spent
            with pytest.raises(urllib.error.HTTPError) as outsider:  # and never to a browser without a session
                urllib.request.urlopen(download.url, timeout=10)
            assert outsider.value.code == 403

            # another student's browser with alice's run id: nothing of it
            bob, bob_token = sign_in(browser, url, class_token, "bob")
            bob.goto(f"{url}/live_run?run={run.id}")
            settle(bob, "Live run")
            assert run.id not in bob.content()
            assert bob.get_by_role("button", name="Download trace").count() == 0

            # signing out ends the session: a reload, and Back, show nothing of the lab
            alice.get_by_role("button", name="Sign out").click()
            alice.get_by_text("You are signed out.").wait_for(timeout=60_000)
            alice.goto(f"{url}/live_run?run={run.id}")
            alice.get_by_text("This lab is shared over the network").wait_for(timeout=60_000)
            assert run.id not in alice.content()
            alice.go_back()
            alice.wait_for_timeout(3000)
            assert run.id not in alice.content() or "commlab: sign in" in alice.content()
        finally:
            browser.close()


def test_a_run_name_cannot_sign_the_teacher_into_a_students_account_in_chromium(tmp_path):
    """The chain a student could build: a run named with two Markdown images, ``/signout`` and ``/?token=<the
    student's own token>``, made disturbed so that the teacher's Compare page names it in its warning. In
    Chromium the name shows as its characters: no image is loaded, no link made, and the teacher is still the
    teacher afterwards (and a GET of /signout would end nothing anyway)."""
    from test_room_text import DISTURBED
    runs = tmp_path / "runs"
    access_ = accounts.load_access(runs)
    admin = access_["admin_token"]
    mallory = accounts.sign_in(runs, access_["class_token"], "mallory")
    name = f"![a](/signout) ![b](/?token={mallory}) [see](http://evil.example) :red[big] **b**"
    run = open_lab(runs, room=True).create(commlab.spec(dict(SMALL, name=name)), owner="mallory")
    run.set_status("done", disturbance=DISTURBED)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != accounts.ACCESS_ENV}
    code = f"import sys; from commlab.lab.front.appserver import app_main; sys.exit(app_main({port}, {str(runs)!r}, host='0.0.0.0', demo=False))"
    log = open(tmp_path / "app.log", "wb")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), env=env, start_new_session=True,
                         stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, p, tmp_path / "app.log")
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            try:
                teacher = browser.new_context().new_page()
                asked = []
                teacher.on("request", lambda r: asked.append(r.url))
                teacher.goto(f"{url}/?token={admin}")
                settle(teacher, "Signed in as")
                asked.clear()  # the sign-in link itself carried a token
                teacher.goto(f"{url}/compare")
                settle(teacher, "Disturbed")
                teacher.wait_for_timeout(2000)  # an image in the warning would have been fetched by now
                warning = teacher.get_by_text("Disturbed").first.inner_text()
                assert "![a](/signout)" in warning and ":red[big]" in warning, warning
                assert teacher.locator("img[src*='signout'], img[src*='token=']").count() == 0
                assert teacher.locator("a[href*='evil.example']").count() == 0
                assert not any("/signout" in u or "token=" in u for u in asked), asked
                teacher.reload()
                settle(teacher, "Signed in as")
                assert "Signed in as teacher" in teacher.inner_text("body").replace("**", "")
                assert "mallory" not in teacher.get_by_text("Signed in as").first.inner_text()
            finally:
                browser.close()
    finally:
        stop_process(p, signal.SIGTERM, timeout=20)
        log.close()
