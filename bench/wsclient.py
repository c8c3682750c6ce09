"""A browser's side of a Streamlit session, at the websocket level: what bench/workshop.py's simulated
students and the workshop security tests use instead of a real browser (one Chromium tab costs a core).

A session connects to ``/_stcore/stream`` and asks for script runs (``BackMsg.rerun_script``) with a
query string, a page and widget states, as the browser does; it keeps every ``ForwardMsg`` the server
sends back, so a test can look for what must not be in any of them. On an exposed lab it first signs in
over HTTP, as a browser does at the sign-in page (``sign_in``), and carries the session cookie.

    jar = sign_in(base_url, token)                 # the Cookie header of a signed-in browser
    s = Session(base_url, cookie=jar.header)
    page = s.run("run=...", page="live_run")       # blocks until the script run has finished
    page.text                                      # every message of that run, as protobuf text
    page.widget("preset-dear-vs-ddp")              # a widget's id, from its key
    s.run("token=...", widgets={wid: True})        # a button's click (trigger)
"""
from __future__ import annotations

import asyncio
import http.client
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlencode, urlsplit

from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect


# --------------------------------------------------------------------------- signing in over HTTP

@dataclass
class Jar:
    """A browser's cookies for one lab, and what its sign-in pages answered."""
    cookies: Dict[str, str] = field(default_factory=dict)
    status: int = 0
    location: Optional[str] = None
    body: str = ""
    personal: Optional[str] = None
    """The personal token the name page showed (class-token sign-in only)."""

    @property
    def header(self) -> str:
        return "; ".join(f"{k}={v}" for k, v in self.cookies.items() if v)

    def request(self, base_url: str, method: str, path: str, form: Optional[dict] = None) -> "Jar":
        """One request with this jar's cookies (no redirect followed); keeps what the server set."""
        u = urlsplit(base_url)
        con = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        headers = {"Cookie": self.header} if self.header else {}
        body = None
        if form is not None:
            body = urlencode(form)
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        try:
            con.request(method, path, body=body, headers=headers)
            r = con.getresponse()
            self.status, self.location = r.status, r.getheader("Location")
            self.body = r.read().decode(errors="replace")
            for line in r.headers.get_all("Set-Cookie") or []:
                c = SimpleCookie()
                c.load(line)
                for k, m in c.items():
                    self.cookies[k] = m.value
        finally:
            con.close()
        return self


def sign_in(base_url: str, token: str, name: Optional[str] = None, jar: Optional[Jar] = None) -> Jar:
    """Sign in as a browser does at /signin: a personal or admin token gives a session cookie; the class
    token and ``name`` give a personal token (``jar.personal``) and a session. The jar holds the outcome
    (a refused sign-in: no session cookie, ``status`` and ``body`` say why)."""
    jar = jar or Jar()
    jar.request(base_url, "POST", "/signin", {"token": token})
    if jar.status == 303 and jar.location == "/signin/name" and name is not None:
        jar.request(base_url, "POST", "/signin/name", {"name": name})
        m = re.search(r"\?token=([A-Za-z0-9_-]+)", jar.body)
        jar.personal = m.group(1) if m else None
    return jar


@dataclass
class Page:
    messages: List[ForwardMsg] = field(default_factory=list)
    seconds: float = 0.0
    """From the request to the end of the last script run it caused."""
    query_string: Optional[str] = None
    """The query string the server last set (st.query_params), if it set one."""

    @property
    def text(self) -> str:
        return "\n".join(str(m) for m in self.messages)

    def widget(self, key: str) -> Optional[str]:
        """The id of the widget whose user key is ``key`` (Streamlit puts the key at the end of the id)."""
        for m in self.messages:
            if m.WhichOneof("type") != "delta" or m.delta.WhichOneof("type") != "new_element":
                continue
            el = m.delta.new_element
            inner = getattr(el, el.WhichOneof("type") or "", None)
            wid = getattr(inner, "id", "") if inner is not None else ""
            if isinstance(wid, str) and wid.endswith("-" + key):
                return wid
        return None

    def deferred_file_id(self, key: str) -> Optional[str]:
        """The deferred file id of the download button whose user key is ``key`` (what its click asks for)."""
        for m in self.messages:
            if m.WhichOneof("type") == "delta" and m.delta.WhichOneof("type") == "new_element" \
                    and m.delta.new_element.WhichOneof("type") == "download_button":
                b = m.delta.new_element.download_button
                if b.id.endswith("-" + key):
                    return b.deferred_file_id or None
        return None

    def fragment_ids(self) -> List[str]:
        """The ids of the fragments (st.fragment) whose elements this page drew, in order of first sight."""
        out: List[str] = []
        for m in self.messages:
            if m.WhichOneof("type") == "delta" and m.delta.fragment_id and m.delta.fragment_id not in out:
                out.append(m.delta.fragment_id)
        return out

    def kinds(self) -> List[str]:
        """The messages' types, in order (for a report of what came back)."""
        return [m.WhichOneof("type") for m in self.messages]

    def exceptions(self) -> List[str]:
        out = []
        for m in self.messages:
            if m.WhichOneof("type") == "delta" and m.delta.WhichOneof("type") == "new_element" \
                    and m.delta.new_element.WhichOneof("type") == "exception":
                out.append(m.delta.new_element.exception.message)
        return out


class RunTracker:
    """Whether every script run a request caused has ended. A run that ends with FINISHED_EARLY_FOR_RERUN
    (st.rerun, st.switch_page, a form that reruns, or a newer request that interrupted it) is followed by
    another run that the same request caused, however long the server takes to start it: the page is not
    finished until that one has ended too. (Counting such an end as the last one could return a page
    before the run that follows, when the server starts it later than the quiet time.)"""

    def __init__(self):
        self.started = self.ended = 0
        self.rerun_due = False
        self.finished = False

    def feed(self, f: ForwardMsg) -> bool:
        """Take one message; True when it ended a script run (the page's time so far)."""
        kind = f.WhichOneof("type")
        if kind == "new_session":
            self.started += 1
            self.rerun_due = False
        elif kind == "script_finished":
            self.ended += 1
            self.rerun_due = f.script_finished == ForwardMsg.FINISHED_EARLY_FOR_RERUN
        else:
            return False
        self.finished = self.ended >= self.started and not self.rerun_due
        return kind == "script_finished"


class Session:
    """One browser tab's websocket session, driven synchronously (its event loop runs in a thread)."""

    def __init__(self, base_url: str, timeout_s: float = 120.0, cookie: Optional[str] = None):
        self.url = base_url.replace("http://", "ws://").rstrip("/") + "/_stcore/stream"
        self.cookie = cookie
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ws = self._call(self._connect())
        self.all: List[ForwardMsg] = []
        """Every message of this session, for checks over the whole session."""
        self.session_id: Optional[str] = None
        """The server's id of this session (from its first script run's new_session)."""
        self.page_hash = ""
        """The page the last run drew (a browser sends it back with a fragment's refresh)."""

    async def _connect(self):
        req = HTTPRequest(self.url, headers={"Cookie": self.cookie} if self.cookie else {})
        return await websocket_connect(req, subprotocols=["streamlit"])  # made on the session's loop

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s + 10)

    def run(self, query_string: str = "", page: str = "", widgets: Optional[Dict[str, object]] = None,
            quiet_s: float = 0.3, fragment: Optional[str] = None) -> Page:
        """Ask for a script run and collect what comes back until a run has finished and nothing more
        comes for ``quiet_s`` (a click that switches page causes a second run). ``fragment``: rerun only that
        fragment, as the browser does for an st.fragment(run_every=...) refresh."""
        m = BackMsg()
        m.rerun_script.query_string = query_string
        m.rerun_script.page_name = page
        if fragment:  # a browser names the page it shows: a full rerun the fragment asks for (st.rerun) stays there
            m.rerun_script.page_script_hash = self.page_hash
            m.rerun_script.fragment_id = fragment
            m.rerun_script.is_auto_rerun = True
        for wid, value in (widgets or {}).items():
            if not isinstance(wid, str) or not wid:
                raise ValueError(f"widget id: must be a non-empty string (Page.widget found none?), got {wid!r}")
            w = m.rerun_script.widget_states.widgets.add()
            w.id = wid
            if value is True:
                w.trigger_value = True
            elif isinstance(value, bool):
                w.bool_value = value
            elif isinstance(value, int):
                w.int_value = value
            elif isinstance(value, float):
                w.double_value = value
            else:
                w.string_value = str(value)
        return self._call(self._exchange(m, quiet_s))

    async def _drain(self) -> None:
        """Keep what is still arriving from an earlier request (a script run that a click started late,
        under load) out of the next page: read it into ``all`` until nothing comes for a moment."""
        while True:
            try:
                raw = await asyncio.wait_for(self.ws.read_message(), 0.05)
            except asyncio.TimeoutError:
                return
            if raw is None:
                return
            f = ForwardMsg()
            f.ParseFromString(raw)
            self.all.append(f)

    async def _exchange(self, m: BackMsg, quiet_s: float) -> Page:
        await self._drain()
        page = Page()
        t0 = time.perf_counter()
        self.ws.write_message(m.SerializeToString(), binary=True)
        runs = RunTracker()
        deadline = t0 + self.timeout_s
        while True:
            wait = quiet_s if runs.finished else max(0.1, deadline - time.perf_counter())
            try:
                raw = await asyncio.wait_for(self.ws.read_message(), wait)
            except asyncio.TimeoutError:
                if runs.finished:
                    return page
                raise TimeoutError(f"no script run finished within {self.timeout_s:g} s") from None
            if raw is None:
                raise ConnectionError("the server closed the websocket")
            f = ForwardMsg()
            f.ParseFromString(raw)
            page.messages.append(f)
            self.all.append(f)
            if f.WhichOneof("type") == "page_info_changed":
                page.query_string = f.page_info_changed.query_string
            if f.WhichOneof("type") == "new_session":
                self.page_hash = f.new_session.page_script_hash
                if f.new_session.initialize.session_id:
                    self.session_id = f.new_session.initialize.session_id
            if runs.feed(f):
                page.seconds = time.perf_counter() - t0

    def send(self, m: BackMsg) -> None:
        """Send any BackMsg as it is (an attacker's message: nothing is waited for)."""
        async def write():
            self.ws.write_message(m.SerializeToString(), binary=True)
        self._call(write())

    def deferred_file(self, file_id: str, session_id: Optional[str] = None) -> Tuple[str, str]:
        """Ask for a deferred download (what a browser sends when a st.download_button whose data is a
        callable is clicked), naming this session (or ``session_id``); (url, error message)."""
        m = BackMsg()
        req = m.backend_operation_request
        req.request_id = uuid.uuid4().hex
        req.session_id = session_id if session_id is not None else (self.session_id or "")
        req.deferred_file.file_id = file_id
        return self._call(self._backend(m))

    async def _backend(self, m: BackMsg) -> Tuple[str, str]:
        await self._drain()
        self.ws.write_message(m.SerializeToString(), binary=True)
        rid = m.backend_operation_request.request_id
        deadline = time.perf_counter() + self.timeout_s
        while True:
            raw = await asyncio.wait_for(self.ws.read_message(), max(0.1, deadline - time.perf_counter()))
            if raw is None:
                raise ConnectionError("the server closed the websocket")
            f = ForwardMsg()
            f.ParseFromString(raw)
            self.all.append(f)
            if f.WhichOneof("type") == "backend_operation_response" \
                    and f.backend_operation_response.request_id == rid:
                r = f.backend_operation_response
                return r.deferred_file.url, r.error_msg

    async def _close(self) -> None:
        self.ws.close()  # on the session's loop: tornado's streams are not thread-safe

    def close(self) -> None:
        try:
            self._call(self._close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
