"""Sign-in on an exposed lab, as a student, an outsider and a revoked student would try it: tokens are
exchanged for sessions at the gatekeeper (commlab/app/room/gatekeeper.py) in plain HTTP before Streamlit; sessions,
expiry, rotation, revocation and caps (commlab/room/accounts.py)."""
import json
import os

import pytest

pytest.importorskip("streamlit")
from starlette.responses import PlainTextResponse  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from starlette.websockets import WebSocketDisconnect  # noqa: E402

import commlab  # noqa: E402
from commlab.app.room import gatekeeper  # noqa: E402
from commlab.room import accounts  # noqa: E402
from commlab.room import owners
from commlab.room import open_lab  # noqa: E402
from commlab.lab.base.errors import LabError  # noqa: E402
from test_app import SMALL  # noqa: E402


async def streamlit_stand_in(scope, receive, send):
    """What stands behind the gate: answers every request it gets (so a test sees what got through)."""
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})
        return
    await PlainTextResponse(f"streamlit {scope['path']}")(scope, receive, send)


@pytest.fixture
def lab_root(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    monkeypatch.setenv(accounts.ACCESS_ENV, "token")
    for limiter in (gatekeeper.fails, gatekeeper.names, gatekeeper.addresses, gatekeeper.exchanges):
        limiter.seen.clear()
    data = accounts.load_access(tmp_path)
    return tmp_path, {"class": data["class_token"], "admin": data["admin_token"],
                      "alice": accounts.sign_in(tmp_path, data["class_token"], "alice")}


def browser() -> TestClient:
    """A fresh browser (its own cookie jar) in front of the gate; redirects are not followed."""
    return TestClient(gatekeeper.Gate(streamlit_stand_in), follow_redirects=False)


def session_cookie(c: TestClient):
    return c.cookies.get(gatekeeper.SESSION_COOKIE)


# --------------------------------------------------------------------------- the door

def test_no_session_reaches_nothing_but_the_sign_in_page(lab_root):
    c = browser()
    for path in ("/", "/live_run?run=x", "/compare", "/model"):
        r = c.get(path)
        assert r.status_code == 303 and r.headers["location"] == "/signin", path
    for path in ("/_stcore/host-config", "/_stcore/upload_file/a/b", "/media/abc.json", "/component/x/index.html",
                 "/_stcore/metrics"):
        r = c.get(path)
        assert r.status_code == 403 and "streamlit" not in r.text, path
    assert c.put("/_stcore/upload_file/a/b", content=b"x" * 100).status_code == 403
    with pytest.raises(WebSocketDisconnect) as closed:
        with c.websocket_connect("/_stcore/stream"):
            pass
    assert closed.value.code == 1008
    for public in ("/_stcore/health", "/static/js/index.js", "/favicon.png"):
        assert c.get(public).text == f"streamlit {public}"
    r = c.get("/signin")
    assert r.status_code == 200 and "Access token" in r.text and "<script" not in r.text
    assert "served without TLS" in r.text


def test_a_printed_link_becomes_a_session_and_leaves_the_address(lab_root):
    root, tokens = lab_root
    c = browser()
    r = c.get(f"/live_run?token={tokens['alice']}&run=abc")
    assert r.status_code == 303 and r.headers["location"] == "/live_run?run=abc"  # the token is gone
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and tokens["alice"] not in cookie
    assert accounts.session_user(root, session_cookie(c)) == owners.User("alice")
    r = c.get("/live_run?run=abc")
    assert r.text == "streamlit /live_run"  # signed in: Streamlit gets it
    with c.websocket_connect("/_stcore/stream") as ws:  # and the websocket
        ws.close()
    r = c.get("/?token=" + tokens["admin"])  # a link never switches who is signed in: sign out first
    assert r.status_code == 303 and r.headers["location"] == gatekeeper.LINK_UNUSED  # the token leaves the address
    r = c.get(r.headers["location"])
    assert "signed in as <b>alice</b>, so the link was not used" in r.text and tokens["admin"] not in r.text
    assert accounts.session_user(root, session_cookie(c)) == owners.User("alice")
    c.post("/signout")  # signing out is a form post (a GET of /signout changes nothing: tests/test_room_gate.py)
    r = c.get("/?token=" + tokens["admin"])
    assert r.headers["location"] == "/" and accounts.session_user(root, session_cookie(c)).admin
    stored = accounts.access_path(root).read_text()
    assert session_cookie(c) not in stored and tokens["alice"] not in stored  # sessions and personal: hashes only


@pytest.mark.parametrize("path", ["/%09/evil.example/x", "/%5Cevil.example", "/a%0a/b", "/a%20b",
                                  "/%2F%2Fevil.example"])
def test_a_link_sends_the_browser_nowhere_but_this_lab(lab_root, path):
    """After a link's token is taken out of the address, the browser goes back to that address: only when it
    is plainly one of this lab's (browsers drop a tab, so /<TAB>/evil.example is //evil.example)."""
    root, tokens = lab_root
    r = browser().get(f"{path}?token={tokens['alice']}&run=abc")
    assert r.status_code == 303 and r.headers["location"] == "/?run=abc"


def test_a_link_from_another_site_does_not_switch_who_is_signed_in(lab_root):
    """Login CSRF: a page elsewhere makes the browser open /?token=<the attacker's own token>. The browser stays
    alice's; her own link again changes nothing; the sign-in form (a POST from this lab's page) still may."""
    root, tokens = lab_root
    mallory = accounts.sign_in(root, tokens["class"], "mallory")
    c = browser()
    c.get(f"/?token={tokens['alice']}")
    alice = session_cookie(c)
    r = c.get(f"/live_run?token={mallory}")
    assert r.status_code == 303 and r.headers["location"] == gatekeeper.LINK_UNUSED
    r = c.get(r.headers["location"])
    assert "signed in as <b>alice</b>" in r.text and "mallory" not in r.text
    assert session_cookie(c) == alice and accounts.session_user(root, alice) == owners.User("alice")
    r = c.get(f"/signin?token={mallory}")
    assert r.status_code == 303 and session_cookie(c) == alice
    r = c.get(f"/live_run?token={tokens['alice']}&run=x")
    assert r.status_code == 303 and r.headers["location"] == "/live_run?run=x" and session_cookie(c) == alice
    r = c.post("/signin", data={"token": mallory})
    assert r.status_code == 303 and accounts.session_user(root, session_cookie(c)) == owners.User("mallory")


def test_a_token_in_a_form_opens_a_session(lab_root):
    root, tokens = lab_root
    c = browser()
    r = c.post("/signin", data={"token": tokens["alice"]})
    assert r.status_code == 303 and r.headers["location"] == "/"
    assert accounts.session_user(root, session_cookie(c)) == owners.User("alice")


@pytest.mark.parametrize("bad", ["wrong", "", "A" * 24, "../access.json", "x" * 500])
def test_a_wrong_token_is_refused(lab_root, bad):
    root, tokens = lab_root
    c = browser()
    answers = [c.post("/signin", data={"token": bad})]
    if bad:  # an empty token in the address is no token: the sign-in page, as without one
        answers.append(c.get(f"/?token={bad}"))
    for r in answers:
        assert r.status_code == 401 and "That token is not valid." in r.text
        assert session_cookie(c) is None and tokens["alice"] not in r.text
    assert c.get("/").status_code == 303 and c.get("/?token=").headers["location"] == "/signin"


def test_class_token_then_a_name_gives_a_personal_token(lab_root):
    root, tokens = lab_root
    q = open_lab(root, room=True)
    q.create(commlab.spec(SMALL), owner="dora")  # runs the CLI started as dora: the name is hers
    c = browser()
    r = c.get(f"/?token={tokens['class']}")
    assert r.status_code == 303 and r.headers["location"] == "/signin/name"
    assert session_cookie(c) is None  # the class token alone is nobody
    assert "Pick the name" in c.get("/signin/name").text
    for taken, msg in (("alice", "'alice' is taken"), ("../dave", "name: '../dave' is not allowed"),
                       ("teacher", "is reserved"), ("dora", "'dora' is reserved"),
                       (owners.local_user().name, "is reserved"), ("<b>x</b>", "is not allowed")):
        r = c.post("/signin/name", data={"name": taken})
        assert r.status_code == 400 and msg in r.text.replace("&#x27;", "'"), (taken, r.text)
        assert "<b>x</b>" not in r.text  # what the student typed is shown as text
    r = c.post("/signin/name", data={"name": "dave"})
    assert r.status_code == 200
    personal = r.text.split("?token=", 1)[1].split("<", 1)[0]
    assert accounts.check_token(root, personal) == owners.User("dave")
    assert accounts.session_user(root, session_cookie(c)) == owners.User("dave")
    assert c.get("/").text == "streamlit /"
    assert c.get("/signin/name").status_code == 303  # the name page served its purpose
    assert "dave" in accounts.users(root)


def test_sign_in_forms_from_another_site_or_too_large_are_refused(lab_root):
    root, tokens = lab_root
    c = browser()
    r = c.post("/signin", data={"token": tokens["alice"]}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 400 and session_cookie(c) is None
    r = c.post("/signin", data={"token": tokens["alice"] + "x" * 5000})
    assert r.status_code == 400 and session_cookie(c) is None


def test_signing_out_ends_the_session(lab_root):
    root, tokens = lab_root
    c = browser()
    c.get(f"/?token={tokens['alice']}")
    sid = session_cookie(c)
    r = c.post("/signout")
    assert r.status_code == 303 and r.headers["location"] == "/signin"
    assert accounts.session_user(root, sid) is None
    c.cookies.set(gatekeeper.SESSION_COOKIE, sid)  # the old cookie, kept by a stubborn browser
    assert c.get("/").status_code == 303


def test_wrong_tokens_are_rate_limited_per_address(lab_root):
    root, tokens = lab_root
    c = browser()
    for _ in range(gatekeeper.FAILS_PER_MIN):
        assert c.post("/signin", data={"token": "guess"}).status_code == 401
    r = c.post("/signin", data={"token": "another-guess"})
    assert r.status_code == 429 and session_cookie(c) is None  # more wrong ones are refused, for a minute
    r = c.post("/signin", data={"token": tokens["alice"]})
    assert r.status_code == 303 and session_cookie(c)  # a valid token is not locked out by them


def test_one_browser_takes_few_names_and_the_class_token_a_bounded_number(lab_root):
    root, tokens = lab_root
    c = browser()
    for k in range(gatekeeper.NAMES_PER_HOUR):
        c.post("/signout")  # a signed-in browser's link changes nothing (test_a_link_from_another_site...)
        c.get(f"/?token={tokens['class']}")
        assert c.post("/signin/name", data={"name": f"n{k}"}).status_code == 200
    c.post("/signout")
    c.get(f"/?token={tokens['class']}")
    r = c.post("/signin/name", data={"name": "another"})
    assert r.status_code == 429 and "another" not in accounts.users(root)
    (root / "lab.json").write_text(json.dumps({"access": {"max_signins": 5}}))
    d = browser()  # alice and n0..n2 took 4 names of 5
    d.get(f"/?token={tokens['class']}")
    assert d.post("/signin/name", data={"name": "e1"}).status_code == 200
    e = browser()
    e.get(f"/?token={tokens['class']}")
    r = e.post("/signin/name", data={"name": "e2"})
    assert r.status_code == 400 and "access.max_signins" in r.text
    new = accounts.rotate(root, "class")  # a new class token starts a new count
    assert not accounts.is_class_token(root, tokens["class"])
    e.get(f"/?token={new}")
    assert e.post("/signin/name", data={"name": "e2"}).status_code == 200
    assert len(json.loads(accounts.access_path(root).read_text())["users"]) == 6  # alice n0 n1 n2 e1 e2


def test_names_are_bounded_per_address_and_a_grant_serves_one_name(lab_root):
    """A person who clears their cookies is a new browser each time: the names one client address may take in an
    hour are bounded too (access.names_per_address); and the grant to pick a name, sent again by hand, is spent."""
    root, tokens = lab_root
    c = browser()
    c.get(f"/?token={tokens['class']}")
    grant = c.cookies.get(gatekeeper.GRANT_COOKIE)
    assert c.post("/signin/name", data={"name": "first"}).status_code == 200
    again = browser()
    again.cookies.set(gatekeeper.GRANT_COOKIE, grant)
    r = again.post("/signin/name", data={"name": "second"})
    assert r.status_code == 303 and r.headers["location"] == "/signin" and "second" not in accounts.users(root)
    (root / "lab.json").write_text(json.dumps({"access": {"names_per_address": 2}}))
    fresh = browser()  # no cookies: a browser of its own, as far as the lab can tell
    fresh.get(f"/?token={tokens['class']}")
    assert fresh.post("/signin/name", data={"name": "third"}).status_code == 200
    fresh = browser()
    fresh.get(f"/?token={tokens['class']}")
    r = fresh.post("/signin/name", data={"name": "fourth"})
    assert r.status_code == 429 and "network address" in r.text and "fourth" not in accounts.users(root)


def test_revoking_a_person_ends_their_sessions_and_keeps_their_browser_out(lab_root):
    root, tokens = lab_root
    c = browser()
    c.get(f"/?token={tokens['class']}")
    c.post("/signin/name", data={"name": "mallory"})
    sid = session_cookie(c)
    assert accounts.session_user(root, sid) == owners.User("mallory")
    assert accounts.revoke(root, "mallory") == 1
    assert accounts.session_user(root, sid) is None and c.get("/").status_code == 303
    c.get(f"/?token={tokens['class']}")  # the same person, the same browser, another name
    r = c.post("/signin/name", data={"name": "mallory2"})
    assert r.status_code == 400 and "revoked" in r.text and "mallory2" not in accounts.users(root)
    with pytest.raises(LabError, match="'mallory' was revoked"):
        accounts.sign_in(root, tokens["class"], "mallory")
    with pytest.raises(LabError, match="no student 'nobody'"):
        accounts.revoke(root, "nobody")


# --------------------------------------------------------------------------- lifetimes and rotation

class Clock:
    def __init__(self, t):
        self.t = t

    def time(self):
        return self.t


def test_personal_tokens_and_sessions_expire(lab_root, monkeypatch):
    root, tokens = lab_root
    (root / "lab.json").write_text(json.dumps({"access": {"personal_days": 2, "session_hours": 1}}))
    clock = Clock(accounts.time.time())
    monkeypatch.setattr(accounts, "time", clock)
    bob = accounts.sign_in(root, tokens["class"], "bob")
    sid, user = accounts.open_session(root, bob)
    clock.t += 3599
    assert accounts.session_user(root, sid) == owners.User("bob")
    clock.t += 2
    assert accounts.session_user(root, sid) is None  # the session's hour is up
    sid, _ = accounts.open_session(root, bob)  # the token still opens a new one
    clock.t += 2 * 86400
    assert accounts.check_token(root, bob) is None and accounts.open_session(root, bob) is None
    assert accounts.session_user(root, sid) is None
    people = {p["name"]: p for p in accounts.people(root)}
    assert people["bob"]["expires"] < clock.t
    new = accounts.rotate(root, "bob")  # the teacher gives bob a fresh token
    assert accounts.check_token(root, new) == owners.User("bob") and accounts.check_token(root, bob) is None
    (root / "lab.json").write_text(json.dumps({"access": {"admin_days": 1}}))
    assert accounts.check_token(root, tokens["admin"]) is None  # made more than a day ago on this clock
    assert accounts.check_token(root, accounts.rotate(root, "admin")).admin


def test_rotating_a_token_ends_its_sessions(lab_root):
    root, tokens = lab_root
    sid, _ = accounts.open_session(root, tokens["alice"])
    tsid, _ = accounts.open_session(root, tokens["admin"])
    new = accounts.rotate(root, "alice")
    assert accounts.session_user(root, sid) is None and accounts.check_token(root, tokens["alice"]) is None
    assert accounts.session_user(root, tsid).admin  # the teacher's are not alice's
    accounts.rotate(root, "admin")
    assert accounts.session_user(root, tsid) is None and accounts.check_token(root, tokens["admin"]) is None
    assert accounts.check_token(root, new) == owners.User("alice")


def test_a_person_keeps_a_bounded_number_of_sessions_and_the_file_stays_small(lab_root):
    root, tokens = lab_root
    sids = [accounts.open_session(root, tokens["alice"])[0] for _ in range(accounts.SETTINGS["sessions_per_person"] + 3)]
    alive = [s for s in sids if accounts.session_user(root, s)]
    assert alive == sids[-accounts.SETTINGS["sessions_per_person"]:]  # the oldest closed
    data = json.loads(accounts.access_path(root).read_text())
    assert len(data["sessions"]) == accounts.SETTINGS["sessions_per_person"]


@pytest.mark.parametrize("bad,msg", [
    ({"personal_days": 0}, "access.personal_days: must be a positive number, got 0"),
    ({"max_signins": 2.5}, "access.max_signins: must be a positive integer, got 2.5"),
    ({"session_hours": "1"}, "access.session_hours: must be a positive number, got '1'"),
    ({"forever": 1}, "access: unknown setting 'forever'"),
    ([1], "access: must be an object"),
])
def test_bad_access_settings_are_named(tmp_path, bad, msg):
    (tmp_path / "lab.json").write_text(json.dumps({"access": bad}))
    with pytest.raises(LabError, match=msg.replace("(", r"\(").replace(".", r"\.")):
        accounts.settings(tmp_path)


def test_an_access_file_from_before_sessions_still_signs_people_in(tmp_path):
    tok = "t" * 24
    accounts.access_path(tmp_path).write_text(json.dumps({
        "class_token": "c" * 20, "admin_token": "a" * 30,
        "users": {accounts._hash(tok): {"name": "olga", "created": accounts.time.time()}}}))
    assert accounts.check_token(tmp_path, tok) == owners.User("olga")
    sid, _ = accounts.open_session(tmp_path, tok)
    assert accounts.session_user(tmp_path, sid) == owners.User("olga")


def test_cookies_are_secure_under_tls(lab_root, monkeypatch):
    root, tokens = lab_root
    monkeypatch.setattr(gatekeeper, "tls", lambda scope=None: True)
    c = browser()
    r = c.get(f"/?token={tokens['alice']}")
    assert "Secure" in r.headers["set-cookie"]
    assert "served without TLS" not in c.get("/signin").text


def test_behind_a_tls_proxy_cookies_are_secure_and_the_personal_link_is_https(lab_root):
    """Behind a proxy that ends TLS (``commlab app --behind-proxy``: uvicorn takes the request's scheme from the
    proxy it trusts) the lab has no certificate of its own: the request's scheme says https, so the cookies are
    Secure, the personal link is https and the sign-in page warns of nothing."""
    root, tokens = lab_root
    c = TestClient(gatekeeper.Gate(streamlit_stand_in), follow_redirects=False, base_url="https://lab.example")
    r = c.get(f"/?token={tokens['class']}")
    assert "Secure" in r.headers["set-cookie"]
    r = c.post("/signin/name", data={"name": "bea"})
    assert "https://lab.example/?token=" in r.text
    assert all("Secure" in v for v in r.headers.get_list("set-cookie"))
    assert "served without TLS" not in c.get("/signin").text
    assert "served without TLS" in browser().get("/signin").text  # plain http: warned


def test_a_name_page_trying_name_after_name_ends_and_sign_ins_are_bounded_per_address(lab_root, monkeypatch):
    """Each name refused cost a read of every run's row, and a grant allowed any number of them: a page ends
    after NAME_TRIES refused names (the class token again), a name that cannot be one reads no run's owner, and
    tokens exchanged from one address are ``signins_per_minute`` a minute (each rewrites the accounts file; each
    class token's page holds a grant), the teacher's not counted."""
    from distutil import counted
    root, tokens = lab_root
    open_lab(root, room=True).create(commlab.spec(SMALL), owner="dora")  # an index, and an owner of runs
    calls = {"owners": 0}
    monkeypatch.setattr(accounts.Index, "owners", counted(calls, "owners", accounts.Index.owners))
    c = browser()
    c.get(f"/?token={tokens['class']}")
    for name in ["!"] * (gatekeeper.NAME_TRIES - 2) + ["alice"]:  # a bad form, then a name taken
        r = c.post("/signin/name", data={"name": name})
        assert r.status_code == 400 and "Pick the name" in r.text, name
    assert calls["owners"] == 1  # only the name that could be one read the owners of runs
    r = c.post("/signin/name", data={"name": "!"})
    assert r.status_code == 400 and "give the class token again" in r.text and "Access token" in r.text
    r = c.post("/signin/name", data={"name": "zed"})
    assert r.status_code == 303 and r.headers["location"] == "/signin" and "zed" not in accounts.users(root)
    (root / "lab.json").write_text(json.dumps({"access": {"signins_per_minute": 3}}))
    gatekeeper.exchanges.seen.clear()
    for _ in range(3):
        assert browser().get(f"/?token={tokens['class']}").headers["location"] == "/signin/name"
    r = browser().get(f"/?token={tokens['alice']}")
    assert r.status_code == 429 and "Too many sign-ins from this address" in r.text and not session_cookie(r)
    r = browser().get(f"/?token={tokens['admin']}")  # the teacher is not counted, nor locked out
    assert r.status_code == 303 and r.headers["location"] == "/"


def test_a_damaged_access_file_is_one_line_for_every_request(lab_root):
    """Every signed-in request reads the accounts file: a damaged one (cut short; an entry of the wrong shape) is
    a 503 with one line and no path of the machine, not a traceback; a websocket is closed; fixed, all is as it
    was."""
    root, tokens = lab_root
    c, naming = browser(), browser()
    c.get(f"/?token={tokens['alice']}")
    naming.get(f"/?token={tokens['class']}")  # a name page open
    path = accounts.access_path(root)
    whole = path.read_text()
    data = json.loads(whole)
    for damaged in (whole[:-5], json.dumps({**data, "sessions": {h: "x" for h in data["sessions"]}})):
        path.write_text(damaged)
        for r in (c.get("/live_run"), c.get("/signout"), c.get(f"/?token={tokens['alice']}"),
                  naming.post("/signin/name", data={"name": "nina"})):
            assert r.status_code == 503 and "sign-in is unavailable" in r.text and str(root) not in r.text
        with pytest.raises(WebSocketDisconnect) as closed:
            with c.websocket_connect("/_stcore/stream"):
                pass
        assert closed.value.code == 1011
    path.write_text(whole)
    assert c.get("/live_run").text == "streamlit /live_run"


def test_class_is_a_name_no_student_may_take(lab_root):
    """``commlab workshop rotate class`` renews the class token: a student named class could never be rotated."""
    root, tokens = lab_root
    with pytest.raises(LabError, match="reserved"):
        accounts.sign_in(root, tokens["class"], "Class")


def test_loopback_needs_no_session(lab_root, monkeypatch):
    monkeypatch.setenv(accounts.ACCESS_ENV, "off")
    assert browser().get("/live_run").text == "streamlit /live_run"
    assert os.environ["COMMLAB_RUNS"]


def test_served_over_tls_with_the_teachers_certificate(tmp_path):
    """`commlab app --certfile --keyfile`: https, Secure cookies, the links say https, and no warning."""
    import shutil
    import signal
    import ssl
    import subprocess
    import sys
    import urllib.request
    from distutil import stop_process
    from test_app import ROOT, free_port
    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    runs = tmp_path / "runs"
    token = accounts.load_access(runs)["admin_token"]
    port = free_port()
    code = (f"import sys; from commlab.lab.front.appserver import app_main; sys.exit(app_main({port}, {str(runs)!r}, host='0.0.0.0', "
            f"demo=False, certfile={str(cert)!r}, keyfile={str(key)!r}))")
    env = {k: v for k, v in os.environ.items() if k != accounts.ACCESS_ENV}
    log_path = tmp_path / "app.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), env=env, start_new_session=True,
                             stdout=log, stderr=subprocess.STDOUT)
    ctx = ssl.create_default_context(cafile=str(cert))
    ctx.check_hostname = False
    try:
        import time
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"https://127.0.0.1:{port}/_stcore/health", context=ctx, timeout=2).read()
                break
            except OSError:
                assert p.poll() is None and time.time() < deadline, log_path.read_text()
                time.sleep(0.5)

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *a, **k):
                return None
        opener = urllib.request.build_opener(NoRedirect, urllib.request.HTTPSHandler(context=ctx))
        with pytest.raises(urllib.error.HTTPError) as got:
            opener.open(f"https://127.0.0.1:{port}/?token={token}", timeout=10)
        assert got.value.code == 303 and "Secure" in got.value.headers["Set-Cookie"]
        with pytest.raises(OSError):  # no plain HTTP on the same port
            urllib.request.urlopen(f"http://127.0.0.1:{port}/signin", timeout=5).read()
    finally:
        stop_process(p, signal.SIGTERM, timeout=30)
    out = log_path.read_text()
    assert "students: https://" in out and "WARNING: served without TLS" not in out


def test_certfile_and_keyfile_come_together(tmp_path, capsys):
    from commlab.lab.front.cli import main
    assert main(["app", "--runs", str(tmp_path), "--host", "0.0.0.0", "--certfile", str(tmp_path / "c.pem")]) == 2
    assert capsys.readouterr().err.strip() == ("commlab: error: --certfile, --keyfile: give both (the certificate "
                                               "and its private key) or neither")
    (tmp_path / "c.pem").write_text("x")
    assert main(["app", "--runs", str(tmp_path), "--certfile", str(tmp_path / "c.pem"),
                 "--keyfile", str(tmp_path / "nope.pem")]) == 2
    assert "--keyfile: cannot read" in capsys.readouterr().err
