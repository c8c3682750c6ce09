"""The workshop server's front door under a signed-in student's attack: uploads bounded per person and for the
server, taken only for the uploader's own page and dropped with it (commlab/app/room/uploads.py); signing out only by a form
post from the lab's own page (commlab/app/room/gatekeeper.py); a valid token signing in past the wrong-token limit, and the
client address that limit counts not chosen by the client unless the teacher says a proxy is in front
(``commlab app --behind-proxy``, commlab/lab/front/appserver.py). Through the gatekeeper with a Starlette TestClient
(tests/test_accounts.py's helpers) and over the wire against a real server."""
import http.client
import os
import time
import uuid
from urllib.parse import urlsplit

import pytest

pytest.importorskip("streamlit")
from starlette.exceptions import HTTPException  # noqa: E402
from streamlit.runtime.memory_uploaded_file_manager import MemoryUploadedFileManager  # noqa: E402
from streamlit.runtime.uploaded_file_manager import UploadedFileRec  # noqa: E402

import commlab  # noqa: E402
from commlab.app.room import gatekeeper  # noqa: E402
from commlab.lab.base.errors import LabError  # noqa: E402
from commlab.room import accounts  # noqa: E402
from commlab.room import owners  # noqa: E402
from commlab.room import open_lab  # noqa: E402
from test_accounts import browser, lab_root, session_cookie  # noqa: E402,F401  (lab_root: a fixture)
from test_app import SMALL  # noqa: E402
from distutil import stop_process  # noqa: E402


# --------------------------------------------------------------------------- signing out (a form, a POST)

def test_a_get_of_signout_signs_nobody_out_and_offers_a_form(lab_root):
    """Another site can send the browser to /signout (a link, an image, a redirect): that alone ends nothing."""
    root, tokens = lab_root
    c = browser()
    c.get(f"/?token={tokens['alice']}")
    sid = session_cookie(c)
    r = c.get("/signout")
    assert r.status_code == 200 and "<form method='post' action='/signout'>" in r.text
    assert "alice" in r.text and "<script" not in r.text
    assert accounts.session_user(root, sid) == owners.User("alice") and session_cookie(c) == sid
    assert c.get("/").text == "streamlit /"


def test_signing_out_is_a_post_from_the_labs_own_page(lab_root):
    root, tokens = lab_root
    c = browser()
    c.get(f"/?token={tokens['alice']}")
    sid = session_cookie(c)
    r = c.post("/signout", headers={"Origin": "http://evil.example"})  # a form on another site
    assert r.status_code == 400 and accounts.session_user(root, sid) == owners.User("alice")
    assert c.put("/signout").status_code == 405 and accounts.session_user(root, sid) is not None
    r = c.post("/signout", headers={"Origin": "http://testserver"})  # the lab's own page
    assert r.status_code == 303 and r.headers["location"] == "/signin"
    assert accounts.session_user(root, sid) is None and not session_cookie(c)


def test_a_page_elsewhere_cannot_switch_the_browser_to_its_own_account(lab_root):
    """The forgery: another site sends alice's browser to /signout, then to /?token=<mallory's token>; were the
    first to sign her out, she would go on working in mallory's account. She stays alice."""
    root, tokens = lab_root
    mallory = accounts.sign_in(root, tokens["class"], "mallory")
    c = browser()
    c.get(f"/?token={tokens['alice']}")
    alice = session_cookie(c)
    c.get("/signout")
    r = c.get(f"/?token={mallory}")
    assert r.status_code == 303
    r = c.get(r.headers["location"])
    assert r.status_code == 200 and "signed in as <b>alice</b>" in r.text
    assert session_cookie(c) == alice and accounts.session_user(root, alice) == owners.User("alice")
    # the page that says so signs out with a form (a POST), not a link
    assert "href='/signout'" not in r.text and "<form method='post' action='/signout'>" in r.text


# --------------------------------------------------------------------------- the wrong-token limit

def test_a_valid_token_signs_in_past_the_wrong_token_limit(lab_root):
    """A room behind one address (a NAT, a proxy) shares the limit: wrong guesses from it are refused for a
    minute, but nobody with a valid token is locked out by them."""
    root, tokens = lab_root
    guesser = browser()
    for _ in range(gatekeeper.FAILS_PER_MIN):
        assert guesser.post("/signin", data={"token": "guess"}).status_code == 401
    r = guesser.post("/signin", data={"token": "guess"})
    assert r.status_code == 429 and "Too many wrong tokens" in r.text
    assert browser().get("/?token=wrong-again").status_code == 429  # a link is a guess too
    c = browser()  # another person of the room, same address
    r = c.post("/signin", data={"token": tokens["alice"]})
    assert r.status_code == 303 and accounts.session_user(root, session_cookie(c)) == owners.User("alice")
    d = browser()
    r = d.get(f"/live_run?token={tokens['admin']}&run=x")
    assert r.status_code == 303 and r.headers["location"] == "/live_run?run=x"
    assert accounts.session_user(root, session_cookie(d)).admin
    e = browser()
    r = e.get(f"/?token={tokens['class']}")  # the class token leads to the name page as always
    assert r.status_code == 303 and r.headers["location"] == "/signin/name"
    assert guesser.post("/signin", data={"token": "guess"}).status_code == 429  # wrong ones are still refused


# --------------------------------------------------------------------------- the client address

def test_the_server_trusts_a_forwarded_address_only_behind_a_proxy(tmp_path, monkeypatch):
    """The server's environment says which peers may name the client (X-Forwarded-For): none unless the teacher
    says a proxy is in front; uvicorn (which serves Streamlit) then keeps the socket's peer address."""
    import asyncio

    import uvicorn
    from commlab.lab.front import appserver

    seen = []

    async def app(scope, receive, send):
        seen.append(scope["client"][0])

    def client_seen(env: dict, peer: str) -> str:
        monkeypatch.setenv("FORWARDED_ALLOW_IPS", env["FORWARDED_ALLOW_IPS"])
        cfg = uvicorn.Config(app)
        cfg.load()
        scope = {"type": "http", "client": (peer, 5000), "headers": [(b"x-forwarded-for", b"10.9.9.9")]}
        asyncio.run(cfg.loaded_app(scope, None, None))
        return seen[-1]

    plain = appserver.server_env(tmp_path, exposed=True)
    assert client_seen(plain, "127.0.0.1") == "127.0.0.1"  # a proxy on this host, not declared: its address
    local = appserver.server_env(tmp_path, exposed=True, behind_proxy=appserver.LOCAL_PROXY)
    assert client_seen(local, "127.0.0.1") == "10.9.9.9"
    assert client_seen(local, "192.168.1.20") == "192.168.1.20"  # a student's own header: not trusted
    there = appserver.server_env(tmp_path, exposed=True, behind_proxy="192.168.1.5, 10.1.0.0/16")
    assert client_seen(there, "10.1.2.3") == "10.9.9.9" and client_seen(there, "127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize("value, msg", [("proxy.example", "'proxy.example' is not an IP address or network"),
                                        ("*", "'*' is not an IP address or network"),
                                        ("10.0.0.1/8", "'10.0.0.1/8' is not an IP address or network"),
                                        ("", "give at least one address")])
def test_behind_proxy_names_what_it_takes(tmp_path, value, msg):
    from commlab.lab.front import appserver
    with pytest.raises(LabError) as e:
        appserver.trusted_proxies(value)
    assert str(e.value).startswith("--behind-proxy: ") and msg in str(e.value)
    with pytest.raises(LabError, match="--behind-proxy: only for a server bound beyond loopback"):
        appserver.app_main(8501, tmp_path, host="127.0.0.1", demo=False, behind_proxy=appserver.LOCAL_PROXY)


def test_commlab_app_takes_behind_proxy(tmp_path, capsys):
    from commlab.lab.front import appserver
    from commlab.lab.front.cli import build_parser
    p = build_parser()
    assert p.parse_args(["app", "--host", "0.0.0.0"]).behind_proxy is None
    assert p.parse_args(["app", "--behind-proxy"]).behind_proxy == appserver.LOCAL_PROXY
    assert p.parse_args(["app", "--behind-proxy", "10.0.0.7"]).behind_proxy == "10.0.0.7"
    from commlab.lab.front.cli import main
    assert main(["app", "--host", "0.0.0.0", "--behind-proxy", "proxy.example", "--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--behind-proxy: 'proxy.example' is not an IP address or network" in err and "Traceback" not in err


# --------------------------------------------------------------------------- uploads, in the server's memory

def rec(size: int, fid=None) -> UploadedFileRec:
    return UploadedFileRec(file_id=fid or uuid.uuid4().hex, name="p.json", type="application/json", data=b"x" * size)


@pytest.fixture
def held(monkeypatch):
    """The server's uploaded-file manager, bounded as commlab/app/room/uploads.py bounds it, with small limits; a Streamlit
    session id here is '<person>-<n>', and ``live`` the sessions still connected."""
    from commlab.app.room import uploads
    monkeypatch.setenv(accounts.ACCESS_ENV, "token")
    monkeypatch.setattr(uploads, "FILES_PER_PERSON", 3)
    monkeypatch.setattr(uploads, "MB_PER_PERSON", 1)
    monkeypatch.setattr(uploads, "MB_TOTAL", 2)
    mgr = MemoryUploadedFileManager("/_stcore/upload_file")
    live = set()
    uploads.bound(mgr, person_of=lambda sid: owners.User(sid.split("-")[0]) if sid in live else None,
                  live=lambda sid: sid in live)
    return mgr, live


def refused(mgr, sid, f) -> str:
    with pytest.raises(HTTPException) as e:
        mgr.add_file(sid, f)
    assert e.value.status_code in (403, 413)
    return e.value.detail


def test_uploads_are_bounded_per_person_in_files_and_bytes(held):
    mgr, live = held
    live |= {"alice-1", "alice-2", "bob-1"}
    for sid in ("alice-1", "alice-2", "alice-1"):  # one person's pages, together
        mgr.add_file(sid, rec(1000))
    detail = refused(mgr, "alice-2", rec(10))
    assert "at most 3 files" in detail and "FILES_PER_PERSON" in detail
    again = next(iter(mgr.file_storage["alice-1"]))
    mgr.add_file("alice-1", rec(2000, again))  # the same file sent again replaces it: no more room taken
    mgr.remove_file("alice-1", again)  # a file removed (the page's uploader cleared) frees its place
    mgr.add_file("alice-2", rec(10))
    assert len(mgr.file_storage["alice-1"]) + len(mgr.file_storage["alice-2"]) == 3
    mgr.add_file("bob-1", rec(300_000))  # another person's count is their own
    assert "at most 1 MB" in refused(mgr, "bob-1", rec(800_000))
    mgr.add_file("bob-1", rec(700_000))


def test_uploads_are_bounded_for_the_whole_server(held):
    mgr, live = held
    people = [f"p{k}-1" for k in range(5)]
    live |= set(people)
    for sid in people[:2]:
        mgr.add_file(sid, rec(900_000))
    detail = refused(mgr, people[2], rec(500_000))
    assert "the server holds" in detail and "MB_TOTAL" in detail
    mgr.add_file(people[2], rec(100_000))  # what still fits
    live.discard(people[0])  # a page closed: its files are dropped, their room is free
    mgr.add_file(people[3], rec(800_000))
    assert people[0] not in mgr.file_storage


def test_an_upload_for_a_page_whose_sign_in_ended_is_refused(held):
    mgr, live = held
    assert "no open page" in refused(mgr, "alice-1", rec(10))  # person_of: nobody (ended, or never was)
    assert not mgr.file_storage.get("alice-1")


# --------------------------------------------------------------------------- uploads, over the wire

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`commlab app --host 0.0.0.0` (no proxy declared) over a runs directory with alice and bob."""
    import signal
    import subprocess
    import sys
    from test_app import ROOT, free_port, wait_health
    root = tmp_path_factory.mktemp("room")
    access = accounts.load_access(root)
    tokens = {"class": access["class_token"], "admin": access["admin_token"],
              **{o: accounts.sign_in(root, access["class_token"], o) for o in ("alice", "bob")}}
    open_lab(root, room=True).create(commlab.spec(SMALL), owner="alice")
    port = free_port()
    code = (f"import sys; from commlab.lab.front.appserver import app_main; "
            f"sys.exit(app_main({port}, {str(root)!r}, host='0.0.0.0', demo=False))")
    log_path = root / "app.log"
    env = {k: v for k, v in os.environ.items() if k not in (accounts.ACCESS_ENV, "FORWARDED_ALLOW_IPS")}
    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), start_new_session=True, env=env,
                             stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, p, log_path)
        yield url, root, tokens
    finally:
        stop_process(p, signal.SIGTERM, timeout=30)


def upload(url, cookie, session_id, size=100, method="PUT", file_id=None):
    """A file sent as Streamlit's uploader sends it, with an XSRF pair the client makes itself (Streamlit's
    check is a double submit); (status, body)."""
    from streamlit.web.server.starlette.starlette_app_utils import generate_xsrf_token_string
    xsrf = generate_xsrf_token_string()
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"UploadedFile\"; filename=\"p.json\"\r\n"
            f"Content-Type: application/json\r\n\r\n").encode() + b"x" * size + f"\r\n--{boundary}--\r\n".encode()
    u = urlsplit(url)
    con = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        con.request(method, f"/_stcore/upload_file/{session_id}/{file_id or uuid.uuid4()}",
                    body=body if method == "PUT" else None,
                    headers={"Cookie": f"{cookie}; _streamlit_xsrf={xsrf}" if cookie else f"_streamlit_xsrf={xsrf}",
                             "X-Xsrftoken": xsrf, "Content-Type": f"multipart/form-data; boundary={boundary}"})
        r = con.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        con.close()


def page_of(url, jar):
    """A page of the lab open in a browser signed in with ``jar``: its websocket session (its id known)."""
    from bench.wsclient import Session
    s = Session(url, cookie=jar.header)
    s.run("")
    assert s.session_id
    return s


def test_over_the_wire_an_upload_goes_only_to_the_uploaders_own_page(served):
    from bench.wsclient import sign_in
    url, root, tokens = served
    alice_jar, bob_jar = sign_in(url, tokens["alice"]), sign_in(url, tokens["bob"])
    alice, bob = page_of(url, alice_jar), page_of(url, bob_jar)
    try:
        status, body = upload(url, bob_jar.header, alice.session_id)  # bob, into alice's page
        assert status == 403 and "no open page of yours" in body
        fid = str(uuid.uuid4())
        assert upload(url, alice_jar.header, alice.session_id, file_id=fid)[0] == 204
        assert upload(url, bob_jar.header, alice.session_id, method="DELETE", file_id=fid)[0] == 403
        assert upload(url, bob_jar.header, str(uuid.uuid4()))[0] == 403  # a page nobody has
        assert upload(url, None, bob.session_id)[0] == 403  # no lab session at all
        assert upload(url, bob_jar.header, bob.session_id)[0] == 204  # his own page takes it
    finally:
        alice.close()
        bob.close()


def test_over_the_wire_uploads_are_bounded_per_person_and_dropped_with_their_page(served):
    """Any number of files under made-up ids: the person's bound refuses more; closing the page frees it."""
    from commlab.app.room import uploads
    from bench.wsclient import sign_in
    url, root, tokens = served
    jar = sign_in(url, tokens["alice"])
    first = page_of(url, jar)
    try:
        answers = [upload(url, jar.header, first.session_id, size=1000) for _ in range(uploads.FILES_PER_PERSON + 1)]
        assert [s for s, _ in answers[:-1]] == [204] * uploads.FILES_PER_PERSON
        status, body = answers[-1]
        assert status == 413 and f"at most {uploads.FILES_PER_PERSON} files" in body
    finally:
        first.close()
    second = page_of(url, jar)  # the first page's files went with it
    try:
        for _ in range(50):  # the server notices the closed socket in its own time
            status, _ = upload(url, jar.header, second.session_id, size=1000)
            if status == 204:
                break
            time.sleep(0.1)
        assert status == 204
    finally:
        second.close()


def test_over_the_wire_signing_out_drops_the_persons_uploads(served):
    from commlab.app.room import uploads
    from bench.wsclient import sign_in
    url, root, tokens = served
    jar = sign_in(url, tokens["bob"])
    open_page = page_of(url, jar)
    fresh = None
    try:
        for _ in range(uploads.FILES_PER_PERSON):
            assert upload(url, jar.header, open_page.session_id, size=1000)[0] == 204
        assert upload(url, jar.header, open_page.session_id, size=1000)[0] == 413
        jar.request(url, "POST", "/signout", {})
        assert jar.status == 303 and jar.location == "/signin"
        again = sign_in(url, tokens["bob"])
        fresh = page_of(url, again)
        assert upload(url, again.header, fresh.session_id, size=1000)[0] == 204  # the old page's files are gone
        assert upload(url, jar.header, open_page.session_id, size=1000)[0] == 403  # its session ended
    finally:
        open_page.close()
        if fresh is not None:
            fresh.close()


# --------------------------------------------------------------------------- the address, over the wire

def test_over_the_wire_a_client_cannot_choose_the_address_its_guesses_count_against(served):
    """Without --behind-proxy a request's X-Forwarded-For names no one: wrong tokens count against the socket's
    peer, whatever address each claims; the limit then refuses wrong guesses, never a valid token."""
    url, root, tokens = served
    u = urlsplit(url)

    def post(token, forwarded):
        con = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        try:
            con.request("POST", "/signin", body=f"token={token}",
                        headers={"Content-Type": "application/x-www-form-urlencoded", "X-Forwarded-For": forwarded})
            r = con.getresponse()
            r.read()
            return r.status
        finally:
            con.close()

    answers = [post("guess", f"10.0.{k}.1") for k in range(gatekeeper.FAILS_PER_MIN + 1)]
    assert answers[:-1] == [401] * gatekeeper.FAILS_PER_MIN and answers[-1] == 429
    assert post(tokens["alice"], "10.0.99.1") == 303


# --------------------------------------------------------------------------- pages, metrics, chosen tokens

async def pages_stand_in(scope, receive, send):
    """Streamlit's websocket as far as the gate can tell: accepted, held open until the client leaves."""
    if scope["type"] != "websocket":
        from starlette.responses import PlainTextResponse
        return await PlainTextResponse(f"streamlit {scope['path']}")(scope, receive, send)
    await receive()
    await send({"type": "websocket.accept"})
    while (await receive())["type"] != "websocket.disconnect":
        pass


def test_a_student_keeps_a_bounded_number_of_pages_open(lab_root, monkeypatch):
    """Each open page runs its script at every interaction and its panels on a timer: a student's pages past
    PAGES_PER_PERSON are refused (closed before Streamlit sees them); one closed frees its place; the teacher
    has no limit."""
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect
    root, tokens = lab_root
    monkeypatch.setattr(gatekeeper, "PAGES_PER_PERSON", 2)
    c = TestClient(gatekeeper.Gate(pages_stand_in), follow_redirects=False)
    c.get(f"/?token={tokens['alice']}")
    with c.websocket_connect("/_stcore/stream"), c.websocket_connect("/_stcore/stream"):
        with pytest.raises(WebSocketDisconnect) as refused:
            with c.websocket_connect("/_stcore/stream"):
                pass
        assert refused.value.code == 1008 and "at most 2 open pages" in refused.value.reason
    with c.websocket_connect("/_stcore/stream"):  # the two closed: places again
        pass
    t = TestClient(gatekeeper.Gate(pages_stand_in), follow_redirects=False)
    t.get(f"/?token={tokens['admin']}")
    with t.websocket_connect("/_stcore/stream"), t.websocket_connect("/_stcore/stream"), \
            t.websocket_connect("/_stcore/stream"):
        pass
    assert gatekeeper._pages == {}


def test_the_servers_metrics_are_the_teachers(lab_root):
    root, tokens = lab_root
    c = browser()
    c.get(f"/?token={tokens['alice']}")
    assert c.get("/_stcore/metrics").status_code == 403
    t = browser()
    t.get(f"/?token={tokens['admin']}")
    assert t.get("/_stcore/metrics").text == "streamlit /_stcore/metrics"


def test_a_class_token_the_teacher_chooses_is_long_enough_not_to_be_guessed(tmp_path):
    """Past the wrong-token limit a right token still signs in (no lockout for a room behind one address), so
    what keeps a guesser out is the token's length."""
    with pytest.raises(LabError, match=f"--token: must be at least {accounts.MIN_CLASS_TOKEN} characters"):
        accounts.set_class_token(tmp_path, "class-2024-x")
    assert accounts.set_class_token(tmp_path, "class-2026-nov-gpu-lab")["class_token"] == "class-2026-nov-gpu-lab"
