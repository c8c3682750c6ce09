"""The exposed lab's front door, in front of Streamlit (commlab/app/server.py mounts it): sign-in pages of plain
HTML, and a middleware that lets no request without a session reach Streamlit.

A browser signs in once with a token, through ``/signin`` (a form: the token travels in the request body),
or through a printed link ``/?token=...``, which this middleware answers with a redirect (303) to the
same address without the token: the address bar and the history never show a token, because the page
with it is never loaded. A personal or admin token opens a session (commlab.room.accounts.open_session) whose id
goes into an HttpOnly cookie; the class token leads to ``/signin/name``, where the student picks a name
and gets a personal token, shown once on that page.

Without a valid session: the websocket (``/_stcore/stream``) is refused before Streamlit accepts it, a
page gets a redirect to ``/signin``, anything else (uploads, media, Streamlit's other endpoints) a 403.
Only the sign-in pages, the health check and the static front-end files are public. Every request is
checked again (a revoked or signed-out session ends at its next request; the script checks it too:
commlab/app/room/access.py). An upload goes only to an open page of the person who sends it (commlab/app/room/uploads.py). On loopback
(access mode ``off``) the middleware lets everything through.

Signing out is a POST to ``/signout`` from the lab's own page (``same_origin``); a GET of it gets a page with
that form, and changes nothing (another site can make a browser open any address).

Sign-in is rate-limited in memory: ``FAILS_PER_MIN`` wrong tokens per client address (a valid token is checked
first and always signs in; the limit refuses only more wrong ones), ``NAMES_PER_HOUR`` new names per browser and
``names_per_address`` (commlab.room.accounts.SETTINGS) per client address; a grant to pick a name serves one name;
commlab.room.accounts caps names per class token. The client address is the socket's peer, unless ``commlab app
--behind-proxy`` named the proxy whose X-Forwarded-For is believed (commlab.lab.front.appserver). A link with a token
never replaces the session a browser has: who is signed in changes only by signing out, or by the sign-in form."""
from __future__ import annotations

import html
import re
import secrets
import threading
import time
from collections import deque
from http.cookies import CookieError, SimpleCookie
from typing import Deque, Dict, Optional, Tuple
from urllib.parse import parse_qsl, urlencode

from streamlit import config

from commlab.app.room import uploads
from commlab.lab.base.errors import LabError
from commlab.lab.front import ui
from commlab.room import accounts

SESSION_COOKIE = accounts.SESSION_COOKIE
BROWSER_COOKIE = "commlab_browser"
GRANT_COOKIE = "commlab_grant"
PUBLIC = ("/signin", "/signin/name", "/signout", "/_stcore/health", "/favicon.png")
PUBLIC_PREFIXES = ("/static/",)
GRANT_S = 900.0
"""How long a class-token sign-in may take to pick a name."""
FAILS_PER_MIN = 20
"""Wrong tokens per minute from one client address; past it, wrong ones get a 429 (valid ones still sign in)."""
NAMES_PER_HOUR = 3
NAME_TRIES = 10
"""Names a browser may try on one name page; past it the grant ends (the class token again for another)."""
PAGES_PER_PERSON = 8
"""Pages (websockets: tabs, windows) one student may have open at once on an exposed lab; the teacher has no
limit. Each page runs its script on every interaction and its live panels on a timer."""
TEACHERS_ENDPOINTS = ("/_stcore/metrics",)
"""Streamlit endpoints a student is refused: the server's metrics count every viewer's sessions and caches."""
_pages: Dict[str, int] = {}
_pages_lock = threading.Lock()
MAX_BODY = 4096
"""Bytes a sign-in form may send."""


def exposed() -> bool:
    return accounts.access_mode(config.get_option("server.address")) == "token"


def tls(scope=None) -> bool:
    """Whether the browser reaches the lab over TLS: served with a certificate, or (``scope``: the request)
    through a proxy ``commlab app --behind-proxy`` trusts that says so (uvicorn takes the scheme from its
    X-Forwarded-Proto)."""
    return bool(config.get_option("server.sslCertFile")) or (scope or {}).get("scheme") in ("https", "wss")


# --------------------------------------------------------------------------- small state, in memory

class Limiter:
    """At most ``n`` events per ``window_s`` per key (a sliding window); bounded in keys."""

    def __init__(self, n: int, window_s: float, keys: int = 10_000):
        self.n, self.window_s, self.keys = n, window_s, keys
        self.seen: Dict[str, Deque[float]] = {}
        self.lock = threading.Lock()

    def full(self, key: str, now: Optional[float] = None, n: Optional[int] = None) -> bool:
        """Whether ``key`` has had ``n`` (this limiter's, unless given) events in the window already."""
        now = time.monotonic() if now is None else now
        with self.lock:
            q = self.seen.get(key)
            while q and q[0] <= now - self.window_s:
                q.popleft()
            return bool(q) and len(q) >= (self.n if n is None else n)

    def add(self, key: str, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self.lock:
            self.seen.setdefault(key, deque()).append(now)
            if len(self.seen) > self.keys:
                for k in [k for k, v in self.seen.items() if not v or v[-1] <= now - self.window_s]:
                    self.seen.pop(k)


fails = Limiter(FAILS_PER_MIN, 60.0)
exchanges = Limiter(accounts.SETTINGS["signins_per_minute"], 60.0)
"""Tokens exchanged (for a session, or the class token for a name page) per client address: each rewrites the
accounts file, and each class token's name page holds a grant; its bound is the lab's setting, read each time;
the teacher's are not counted."""
names = Limiter(NAMES_PER_HOUR, 3600.0)
addresses = Limiter(accounts.SETTINGS["names_per_address"], 3600.0)
"""New names per client address; its bound is the lab's setting, read at each sign-in."""
_grants: Dict[str, Tuple[float, str]] = {}
"""grant id -> (expiry, class token): a browser that gave the class token and has yet to pick a name."""
_tries: Dict[str, int] = {}
"""grant id -> names refused on its page so far"""
_grants_lock = threading.Lock()


def _grant(class_token: str) -> str:
    gid = secrets.token_urlsafe(24)
    now = time.monotonic()
    with _grants_lock:
        for k in [k for k, (t, _) in _grants.items() if t < now]:
            _grants.pop(k)
        if len(_grants) > 2000:
            _grants.pop(next(iter(_grants)))
        _grants[gid] = (now + GRANT_S, class_token)
    return gid


def _granted(gid: Optional[str]) -> Optional[str]:
    with _grants_lock:
        hit = _grants.get(gid or "")
    return hit[1] if hit and hit[0] >= time.monotonic() else None


def _use_grant(gid: Optional[str]) -> None:
    """A grant serves one name: sent again (the cookie kept by hand), it is no grant."""
    with _grants_lock:
        _grants.pop(gid or "", None)
        _tries.pop(gid or "", None)


def _refused_name(gid: Optional[str]) -> bool:
    """A name was refused on grant ``gid``'s page; True when that ends the grant (NAME_TRIES)."""
    with _grants_lock:
        _tries[gid or ""] = _tries.get(gid or "", 0) + 1
        for k in [k for k in _tries if k not in _grants]:
            _tries.pop(k)
        over = _tries.get(gid or "", 0) >= NAME_TRIES
    if over:
        _use_grant(gid)
    return over


# --------------------------------------------------------------------------- requests and answers

def cookies(scope) -> Dict[str, str]:
    jar = SimpleCookie()
    for k, v in scope.get("headers", []):
        if k == b"cookie":
            try:
                jar.load(v.decode("latin-1"))
            except CookieError:  # a malformed Cookie header is no session
                return {}
    return {k: m.value for k, m in jar.items()}


def client(scope) -> str:
    """The client's address, as the limits count it: the socket's peer. (uvicorn, which serves the app, replaces
    it with X-Forwarded-For only from the proxies ``commlab app --behind-proxy`` names: commlab.lab.front.appserver.)"""
    c = scope.get("client")
    return c[0] if c else "?"


def session_of(scope) -> Optional[accounts.User]:
    return accounts.session_user(ui.runs_dir(), cookies(scope).get(SESSION_COOKIE))


def _cookie(name: str, value: str, max_age: Optional[int], scope=None) -> Tuple[bytes, bytes]:
    parts = [f"{name}={value}", "Path=/", "HttpOnly", "SameSite=Lax"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    if tls(scope):
        parts.append("Secure")
    return b"set-cookie", "; ".join(parts).encode()


async def respond(send, status: int, body: str = "", headers=(), kind: str = "text/html; charset=utf-8") -> None:
    data = body.encode()
    hs = [(b"content-type", kind.encode()), (b"content-length", str(len(data)).encode()),
          (b"cache-control", b"no-store"), (b"referrer-policy", b"same-origin"),
          (b"x-frame-options", b"DENY"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": data})


async def redirect(send, where: str, headers=()) -> None:
    await respond(send, 303, "", [(b"location", where.encode()), *headers], kind="text/plain")


def page(title: str, body: str) -> str:
    """A self-contained HTML page (no script, no outside resource)."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)} · commlab</title>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'><style>"
            "body{font-family:sans-serif;max-width:36rem;margin:4rem auto;padding:0 1rem;color:#262730}"
            "input{font-size:1rem;padding:.4rem;width:100%;box-sizing:border-box;margin:.3rem 0 .8rem}"
            "button{font-size:1rem;padding:.4rem 1rem}.err{color:#b00020}.warn{color:#8a5300}"
            "code{word-break:break-all;background:#f0f2f6;padding:.2rem}</style></head>"
            f"<body><h1>{html.escape(title)}</h1>{body}</body></html>")


def token_form(error: str = "", scope=None) -> str:
    err = f"<p class='err'>{html.escape(error)}</p>" if error else ""
    warn = "" if tls(scope) else ("<p class='warn'>This lab is served without TLS: what you type crosses the network "
                             "in the clear. Use it only on a network you trust.</p>")
    return page("commlab: sign in", f"{err}<p>This lab is shared over the network: open the link your teacher "
                "gave you, or enter its token.</p><form method='post' action='/signin'>"
                "<label>Access token<input type='password' name='token' autocomplete='off' autofocus></label>"
                f"<button type='submit'>Continue</button></form>{warn}")


def name_form(error: str = "") -> str:
    err = f"<p class='err'>{html.escape(error)}</p>" if error else ""
    return page("commlab: sign in", f"{err}<p>Pick the name your runs will carry. You get a personal link: keep "
                "it, it is how you come back from another browser.</p><form method='post' action='/signin/name'>"
                "<label>Your name<input name='name' maxlength='32' autocomplete='off' autofocus></label>"
                "<button type='submit'>Sign in</button></form>")


async def read_form(receive) -> Optional[dict]:
    """An urlencoded form body of at most MAX_BODY bytes; None when larger."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if len(body) > MAX_BODY:
            return None
        if not msg.get("more_body"):
            break
    return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))


def same_origin(scope) -> bool:
    """A form post must come from this lab's own page (no Origin header: a client that is not a browser)."""
    h = dict(scope.get("headers", []))
    origin = h.get(b"origin", b"").decode("latin-1")
    if not origin or origin == "null":
        return not origin
    host = h.get(b"host", b"").decode("latin-1")
    return origin.split("://", 1)[-1] == host


LOCAL_PATH = re.compile(r"/(?!/)[A-Za-z0-9_.~-]*(?:/[A-Za-z0-9_.~-]+)*/?")
"""A path on this lab: letters, digits and ``_.~-`` between single slashes. Nothing a browser would read as
another host: no ``//``, no backslash, no tab or newline (which browsers drop, so ``/<TAB>/evil`` is ``//evil``)."""


def where_to(path: str, query: str) -> str:
    """``path`` with ``query`` minus its token: a local address (never another host); ``/`` for any path that
    is not plainly one of this lab's."""
    rest = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "token"]
    path = path if LOCAL_PATH.fullmatch(path) else "/"
    return path + ("?" + urlencode(rest) if rest else "")


SIGN_OUT_FORM = "<form method='post' action='/signout'><button type='submit'>Sign out</button></form>"
"""Signing out is a form post from the lab's own page: a plain link to /signout, which any other site can make a
browser open, could sign a person out and let that site's next link sign them in as someone else."""


LINK_UNUSED = "/signout?link=unused"
"""Where a link opened in a browser signed in as someone else is sent: the token leaves the address at once."""


def sign_out_page(user: Optional[accounts.User], link_unused: bool = False) -> str:
    """What a GET of /signout gets: the form that signs out (a GET changes nothing); ``link_unused``: after a link
    that was not used, why."""
    who = (f"<p>This browser is signed in as <b>{html.escape(user.name)}</b>"
           + (", so the link was not used: a link never changes who is signed in. To use it, sign out first, "
              "then open the link again.</p>" if link_unused else ".</p>") if user is not None
           else "<p>This browser is not signed in.</p>")
    return page("commlab: sign out", f"{who}{SIGN_OUT_FORM if user is not None else ''}"
                "<p><a href='/'><button>Go to the lab</button></a></p>")


async def exchange(scope, send, token: str, then: str, browser: Optional[str], set_browser: list,
                   link: bool = False) -> None:
    """Answer a token: a session (personal, admin) and a redirect to ``then``; the name page (class); or
    the sign-in form with a refusal. A ``link`` (a GET with ``?token=``, which another site can make a browser
    open) does not replace a session the browser has: it gets a page saying who is signed in."""
    root = ui.runs_dir()
    try:
        current = session_of(scope) if link else None
        if current is not None:
            if accounts.check_token(root, token) == current:  # their own link again: nothing changes
                return await redirect(send, then, set_browser)
            return await redirect(send, LINK_UNUSED, set_browser)  # the token leaves the address bar at once
        teacher = getattr(accounts.check_token(root, token), "admin", False)
        if not teacher and exchanges.full(client(scope), n=accounts.settings(root)["signins_per_minute"]):
            return await respond(send, 429, token_form("Too many sign-ins from this address; wait a minute.",
                                                       scope), set_browser)
        opened = accounts.open_session(root, token, browser)
        if opened:
            if not teacher:
                exchanges.add(client(scope))
            sid, _ = opened
            return await redirect(send, then, [_cookie(SESSION_COOKIE, sid, None, scope), *set_browser])
        if accounts.is_class_token(root, token):
            exchanges.add(client(scope))
            return await redirect(send, "/signin/name", [_cookie(GRANT_COOKIE, _grant(token), int(GRANT_S), scope),
                                                         *set_browser])
    except LabError as e:  # a damaged access.json or lab.json: the teacher's to fix; said without the path
        return await unavailable(send, e, scope)
    # The token was checked before this limit: a room behind one address (a NAT, a TLS proxy) shares the limit,
    # and wrong guesses from one person there must not lock everyone with a valid token out.
    if fails.full(client(scope)):
        return await respond(send, 429, token_form("Too many wrong tokens from this address; wait a minute.",
                                                   scope), set_browser)
    fails.add(client(scope))
    await respond(send, 401, token_form("That token is not valid.", scope), set_browser)


async def unavailable(send, e: LabError, scope=None) -> None:
    """A damaged accounts or lab file: the teacher's to fix; one line, without the machine's path."""
    await respond(send, 503, token_form(f"sign-in is unavailable: {str(e).split(': ', 1)[-1]}", scope))


# --------------------------------------------------------------------------- the middleware

class Gate:
    """ASGI middleware: the sign-in routes, and no request without a session past it (exposed labs only)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or not exposed():
            return await self.app(scope, receive, send)
        path = scope.get("path", "/")
        jar = cookies(scope)
        browser = jar.get(BROWSER_COOKIE)
        set_browser = []
        if not browser or len(browser) > 64:
            browser = secrets.token_urlsafe(18)
            set_browser = [_cookie(BROWSER_COOKIE, browser, 365 * 86400, scope)]
        if scope["type"] == "http" and path in ("/signin", "/signin/name", "/signout"):
            return await self.signin(scope, receive, send, path, jar, browser, set_browser)
        if path in PUBLIC or path.startswith(PUBLIC_PREFIXES):
            return await self.app(scope, receive, send)
        query = scope.get("query_string", b"").decode("latin-1")
        token = dict(parse_qsl(query)).get("token")
        if scope["type"] == "http" and scope.get("method") == "GET" and token is not None:
            return await exchange(scope, send, token, where_to(path, query), browser, set_browser, link=True)
        try:
            user = session_of(scope)
        except LabError as e:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1011, "reason": "sign-in is unavailable"})
            return await unavailable(send, e, scope)
        if user is not None:
            if path.startswith("/_stcore/upload_file/"):  # only into the sender's own open page (commlab/app/room/uploads.py)
                why = uploads.refusal(path, user)
                if why:
                    return await respond(send, 403, why, kind="text/plain")
            if path.startswith(TEACHERS_ENDPOINTS) and not user.admin:
                return await respond(send, 403, "the teacher's only", kind="text/plain")
            if scope["type"] == "websocket" and not user.admin:
                return await self.page(scope, receive, send, user)
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008, "reason": "sign in first"})
        if scope.get("method") == "GET" and not path.startswith(("/_stcore/", "/media/", "/component/")):
            return await redirect(send, "/signin", set_browser)
        await respond(send, 403, "sign in first", kind="text/plain")

    async def page(self, scope, receive, send, user):
        """A student's page (its websocket) while they have fewer than PAGES_PER_PERSON open; each page's script
        runs cost the server's CPU, and sign-in sessions bound browsers, not the pages one browser opens."""
        with _pages_lock:
            if _pages.get(user.name, 0) >= PAGES_PER_PERSON:
                refused = True
            else:
                refused = False
                _pages[user.name] = _pages.get(user.name, 0) + 1
        if refused:
            return await send({"type": "websocket.close", "code": 1008,
                               "reason": f"at most {PAGES_PER_PERSON} open pages per person; close one"})
        try:
            return await self.app(scope, receive, send)
        finally:
            with _pages_lock:
                _pages[user.name] -= 1
                if not _pages[user.name]:
                    del _pages[user.name]

    async def signin(self, scope, receive, send, path, jar, browser, set_browser):
        root = ui.runs_dir()
        method = scope.get("method")
        if path == "/signout":
            if method == "GET":
                try:
                    who = session_of(scope)
                except LabError as e:
                    return await unavailable(send, e, scope)
                query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
                return await respond(send, 200, sign_out_page(who, query.get("link") == "unused"), set_browser)
            if method != "POST":
                return await respond(send, 405, "", [(b"allow", b"GET, POST")], kind="text/plain")
            if await read_form(receive) is None or not same_origin(scope):
                return await respond(send, 400, page("commlab: sign out", "<p class='err'>That request was "
                                                     f"refused.</p>{SIGN_OUT_FORM}"))
            sid = jar.get(SESSION_COOKIE)
            try:
                accounts.close_session(root, sid)
            except LabError as e:
                return await unavailable(send, e, scope)
            uploads.drop_lab_session(sid)  # the uploads of its pages go with it
            return await redirect(send, "/signin", [_cookie(SESSION_COOKIE, "", 0, scope)])
        if method == "GET" and path == "/signin":
            token = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"))).get("token")
            if token is not None:
                return await exchange(scope, send, token, "/", browser, set_browser, link=True)
            return await respond(send, 200, token_form(scope=scope), set_browser)
        klass = _granted(jar.get(GRANT_COOKIE))
        if method == "GET":  # /signin/name
            return await (respond(send, 200, name_form(), set_browser) if klass else redirect(send, "/signin"))
        if method != "POST":
            return await respond(send, 405, "", kind="text/plain")
        form = await read_form(receive)
        if form is None or not same_origin(scope):
            return await respond(send, 400, token_form("That request was refused.", scope))
        if path == "/signin":
            return await exchange(scope, send, form.get("token", ""), "/", browser, set_browser)
        if not klass:
            return await redirect(send, "/signin")
        if names.full(browser):
            return await respond(send, 429, name_form("This browser has taken enough names for now; use "
                                                      "your personal link, or ask the teacher."))
        try:
            per_address = accounts.settings(root)["names_per_address"]
        except LabError as e:  # a damaged lab.json: the teacher's to fix; said without the path
            return await unavailable(send, e, scope)
        if addresses.full(client(scope), n=per_address):
            return await respond(send, 429, name_form("This network address has taken enough names for now; use "
                                                      "your personal link, or ask the teacher."))
        name = form.get("name", "").strip()
        try:
            personal = accounts.sign_in(root, klass, name, browser)
        except accounts.DamagedAccess as e:
            return await unavailable(send, e, scope)
        except LabError as e:
            if _refused_name(jar.get(GRANT_COOKIE)):  # a page that tries name after name: the class token again
                return await respond(send, 400, token_form(f"{e} ({NAME_TRIES} names refused: give the class "
                                                           "token again)", scope),
                                     [_cookie(GRANT_COOKIE, "", 0, scope), *set_browser])
            return await respond(send, 400, name_form(str(e)), set_browser)
        _use_grant(jar.get(GRANT_COOKIE))
        names.add(browser)
        addresses.add(client(scope))
        sid, _ = accounts.open_session(root, personal, browser)
        host = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
        link = f"{'https' if tls(scope) else 'http'}://{host}/?token={personal}"
        body = (f"<p>Signed in as <b>{html.escape(name)}</b>.</p><p>Your personal link (keep it private; it "
                f"signs you in from another browser, until it expires or the teacher rotates it):</p>"
                f"<p><code>{html.escape(link)}</code></p><p>This page shows it once.</p>"
                "<p><a href='/'><button>Go to the lab</button></a></p>")
        await respond(send, 200, page("commlab: signed in", body),
                      [_cookie(SESSION_COOKIE, sid, None, scope), _cookie(GRANT_COOKIE, "", 0, scope), *set_browser])
