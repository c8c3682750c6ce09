"""The gate in the script: every script run of every session passes here (streamlit_app.py) before any
page runs, and every list, panel and download asks it again who is looking (commlab.lab.front.ui.set_viewer).

On loopback it lets the local user through. On an exposed lab (commlab.room.accounts.access_mode) the viewer is
the user of the session whose id the browser's cookie carries (commlab/app/room/gatekeeper.py made it at sign-in; it
lets no request without one reach Streamlit). The script checks the session again on every run and
every fragment refresh, so a signed-out, expired or revoked session sees nothing more from its next
refresh on. Tokens never reach the script: the gatekeeper takes them out of the address before the page
loads. Under AppTest (no client, so no cookies) the session id is read from the session state instead.

Downloads (st.download_button) go through ``download_data``: on a workshop server the file is built at
click time only for a session that is still open and whose user may see every run in it.
``guard_server`` (installed once per server process) closes what Streamlit leaves open: its deferred
download requests are honoured only from the session the button was made for, the file they produce
gets a random /media id that serves within ONE_SHOT_S seconds, for REFETCH_S seconds from its first
fetch, then is gone; no websocket client may clear the server's caches (they are every viewer's); and uploads
are bounded per person and for the server, and dropped with their page (commlab/app/room/uploads.py)."""
from __future__ import annotations

import contextvars
import functools
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional

import streamlit as st
from streamlit import config, runtime
from streamlit.runtime import backend_operation_handler as boh
from streamlit.runtime.app_session import AppSession
from streamlit.runtime.media_file_storage import MediaFileKind, MediaFileStorageError
from streamlit.runtime.memory_media_file_storage import MemoryFile, get_extension_for_mimetype
from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

from commlab import api
from commlab.app.room import uploads
from commlab.app.room.gatekeeper import SESSION_COOKIE
from commlab.lab.front import ui
from commlab.room import accounts
from commlab.room import owners
from commlab.lab.base.kept import Kept

SESSION = "commlab.session"
"""Where AppTest puts a session id (a real browser's comes in its cookie)."""
SIGNED_OUT = "commlab.signed_out"
ONE_SHOT_S = 60.0
"""How long a generated download's /media URL lives if it is not fetched."""
REFETCH_S = 5.0
"""How long it still serves after its first fetch. Chromium fetches a download twice at times (the
navigation that turns into a download, then the download itself): served strictly once, the second
request got a 404 and the browser cancelled the download (seen in the real-browser test)."""
HELD_PER_PERSON = 3
"""Built downloads one person may hold in the server's memory at once (each until it is fetched and REFETCH_S
more, or ONE_SHOT_S): a client that asks again and again without fetching holds no more."""
HELD_MB_TOTAL = 512
"""Megabytes of built downloads the server holds for everyone at once; past it a download is refused until some
are fetched or expire."""
log = logging.getLogger("commlab.access")


def session_id() -> Optional[str]:
    """The session id of the request this thread serves: the browser's cookie; under AppTest, which has
    no client and so no headers at all (a browser's websocket always sends some), the session state."""
    if st.context.headers:
        return st.context.cookies.get(SESSION_COOKIE)
    return st.session_state.get(SESSION)


def session_user() -> Optional[owners.User]:
    """The signed-in user of the session this thread serves; None outside a session's script run (a
    server thread acting for no one gets nothing) and for a session that ended."""
    if get_script_run_ctx(suppress_warning=True) is None:
        return None
    return accounts.session_user(ui.runs_dir(), session_id())


def mode() -> str:
    return accounts.access_mode(config.get_option("server.address"))


def gate() -> owners.User:
    """The user this request acts for; otherwise a pointer to the sign-in page, and the script stops here."""
    if mode() == "off":
        ui.set_viewer(None)  # the local user, as in notebooks and scripts
        return owners.local_user()
    ui.set_viewer(session_user)
    guard_server()
    user = session_user()
    if user is not None:
        with st.sidebar:
            st.caption(f"Signed in as {ui.text(user.name)} ({'teacher' if user.admin else 'student'})")
            st.button("Sign out", key="access.out", on_click=sign_out)  # before the next run's gate
            if user.admin and not config.get_option("server.sslCertFile"):
                st.warning("Served without a certificate of its own: unless a TLS proxy in front serves it, tokens "
                           "and pages cross the network in the clear (commlab app --certfile/--keyfile, or "
                           "--behind-proxy).", icon=":material/lock_open:")
        return user
    signed_out("You are signed out." if st.session_state.pop(SIGNED_OUT, False)
               else "Your session has ended, or you have not signed in yet.")


def fragment(run_every=None):
    """``st.fragment`` for the pages: each refresh of the fragment first asks again who is looking (a fragment's
    refresh does not pass the gate in streamlit_app.py); a session that ended since gets a full rerun, whose
    gate shows the sign-in page instead of the fragment's data (or an error box from the lab's PermissionError)."""
    def wrap(fn):
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            if mode() != "off" and session_user() is None:
                st.rerun()
            return fn(*args, **kwargs)
        return st.fragment(checked, run_every=run_every)
    return wrap


def sign_out() -> None:
    """The Sign out button's: the session ends on the server (the cookie is worth nothing from now on), and the
    uploads of its pages go with it."""
    sid = session_id()
    accounts.close_session(ui.runs_dir(), sid)
    uploads.drop_lab_session(sid)
    st.session_state[SIGNED_OUT] = True


def signed_out(why: str) -> None:
    """The only thing a request without a session gets; the script stops."""
    st.set_page_config(page_title="Sign in · commlab", layout="centered")
    st.title("commlab: sign in")
    st.caption(why)
    st.link_button("Sign in", "/signin")
    st.stop()


# --------------------------------------------------------------------------- downloads

KEPT_FILES = 4
"""Built downloads kept in this process (least recently used first out): a repeated click on the same file of
the same runs, unchanged, is served what was built."""
_kept = Kept(KEPT_FILES)
_building: set = set()
"""Who has a download being built now: one at a time per person."""
_downloads_lock = threading.Lock()


@dataclass
class _Held:
    who: str
    """the person it was built for ("" when not built by ``download_data``)"""
    size: int
    expires: float
    """time.monotonic() after which it serves no more"""


_held: "Dict[str, _Held]" = {}
"""Built downloads the server holds now (the /media files ``_one_shot`` makes), by file id."""
_held_lock = threading.Lock()


def _held_count(name: str, now: float) -> int:
    """Built downloads ``name`` holds at ``now``, not yet spent (the caller holds ``_held_lock``)."""
    return sum(1 for h in _held.values() if h.who == name and h.expires >= now)


def held_by(name: str) -> int:
    """Built downloads ``name`` holds now, not yet spent."""
    with _held_lock:
        return _held_count(name, time.monotonic())


_holder: "contextvars.ContextVar[Optional[str]]" = contextvars.ContextVar("commlab_download_holder", default=None)
"""Whose download this thread is building (set by ``download_data``'s builder; read where Streamlit stores the
file it built, in the same call)."""


def download_data(make: Callable[[], object], run_ids: Iterable[str], kind: str = "") -> Callable[[], object]:
    """``data=`` for st.download_button: builds the file when clicked. On a workshop server it checks,
    at that moment, that the token the page was built for is still valid (not revoked) and that its user
    may see every run in ``run_ids``; otherwise it builds nothing (PermissionError, logged by Streamlit,
    and the browser gets no file). Each person builds one download at a time (a click while one is being
    built builds nothing: a repeated click queues no work on the server's threads), and a file of a ``kind``
    (what ``make`` builds from the runs and the viewer alone) is kept, for that viewer, while its runs' files
    and status stay as they are."""
    if mode() == "off":
        return make
    root, sid, ids = ui.runs_dir(), session_id(), list(run_ids)

    def build():
        user = accounts.session_user(root, sid)
        if user is None:
            raise PermissionError("download refused: the session has ended")
        _holder.set(user.name)
        runs = [api.get(rid, runs=root) for rid in ids]
        for run in runs:
            if not owners.can_see(user, run.status()):
                raise PermissionError(f"download refused: {user.name} may not see run {run.id}")
        # the viewer's: what a file shows can depend on who looks (a student's errors carry no server paths); and
        # the runs' as they are: their files and their status (a report shows the state and the error)
        key = (kind, user.name, tuple((r.id, r.files_key(status=True)) for r in runs)) if kind else None
        hit = _kept.get(key) if key is not None else None
        if hit is not None:
            return hit
        with _downloads_lock:
            if user.name in _building:
                raise PermissionError(f"download refused: {user.name} has one being built; try again when it is done")
            if held_by(user.name) >= HELD_PER_PERSON:  # refused before it is built, not after
                raise PermissionError(f"download refused: {user.name} holds {HELD_PER_PERSON} downloads not yet "
                                      "fetched")
            _building.add(user.name)
        try:
            data = make()
        finally:
            with _downloads_lock:
                _building.discard(user.name)
        return _kept.put(key, data) if key is not None else data
    return build


_guard_lock = threading.Lock()
_guarded = False


def guard_server() -> None:
    """Install, once in this server process, what keeps one session out of the others' business:

    - no websocket client clears the server's caches (Streamlit's "clear cache" message clears them for
      every viewer): refused and logged on an exposed lab;

    - a deferred download (the file built when its button is clicked) is built only for a request from
      the session that the button was made for; Streamlit itself builds it for any session that names
      its id;
    - the /media file it produces gets a random id (not a hash of its content), serves for REFETCH_S
      seconds from its first fetch, and is dropped ONE_SHOT_S seconds after it was made if nobody fetched
      it, so a URL that leaks afterwards (browser history, a shared screen, a proxy log) serves nothing; one
      person holds at most HELD_PER_PERSON such files at once and everyone HELD_MB_TOTAL MB (a client asking
      for the same download again and again without fetching it holds no more memory);
    - uploads: at most commlab.app.room.uploads' FILES_PER_PERSON files and MB_PER_PERSON MB per person, MB_TOTAL MB for the
      server, dropped when their page's websocket closes (commlab.app.room.uploads.guard)."""
    global _guarded
    with _guard_lock:
        if _guarded:
            return
        if not runtime.exists():  # a test's AppTest runs the script without a server
            return
        _guard_clear_cache()
        _guard_deferred()
        _one_shot(runtime.get_instance().media_file_mgr._storage)
        uploads.guard()
        _guarded = True


def _guard_clear_cache() -> None:
    original = AppSession._handle_clear_cache_request
    if getattr(original, "commlab_guarded", False):
        return

    def handle(self):
        if mode() == "off":
            return original(self)
        log.warning("refused a websocket request to clear the server's caches (session %s)", self.id)
    handle.commlab_guarded = True
    AppSession._handle_clear_cache_request = handle


def _guard_deferred() -> None:
    original = boh.DeferredFileHandler.handle
    if getattr(original, "commlab_guarded", False):
        return

    async def handle(self, request, session_id):
        mgr = runtime.get_instance().media_file_mgr
        with mgr._lock:
            entry = mgr._deferred_callables.get(request.deferred_file.file_id)
        if entry is None or entry["session_id"] != session_id:
            return boh.BackendOperationResponse(request_id=request.request_id,
                                                error_msg="Failed to generate file for download")
        return await original(self, request, session_id)
    handle.commlab_guarded = True
    boh.DeferredFileHandler.handle = handle


def _one_shot(storage) -> None:
    fetched: set = set()
    load, get, url = storage.load_and_get_id, storage.get_file, storage.get_url

    def drop(file_id):
        _held.pop(file_id, None)
        fetched.discard(file_id)
        storage.delete_file(file_id)

    def load_and_get_id(path_or_data, mimetype, kind, filename=None):
        if kind != MediaFileKind.DOWNLOADABLE:
            return load(path_or_data, mimetype, kind, filename)
        data = storage._read_file(path_or_data) if isinstance(path_or_data, str) else path_or_data
        file_id, who = secrets.token_hex(32), _holder.get() or ""
        with _held_lock:
            now = time.monotonic()
            for old in [k for k, h in _held.items() if h.expires < now]:  # expired: dropped
                drop(old)
            mine = _held_count(who, now)
            if who and mine >= HELD_PER_PERSON:  # who: a download built by download_data's builder
                raise MediaFileStorageError(f"download refused: {who} holds {mine} downloads not "
                                            f"yet fetched (at most {HELD_PER_PERSON}); fetch them or wait "
                                            f"{ONE_SHOT_S:.0f} s")
            if sum(h.size for h in _held.values()) + len(data) > HELD_MB_TOTAL * 2**20:
                raise MediaFileStorageError(f"download refused: the server holds {HELD_MB_TOTAL} MB of downloads "
                                            f"not yet fetched; try again in a minute")
            storage._files_by_id[file_id] = MemoryFile(content=data, mimetype=mimetype, kind=kind,
                                                       filename=filename)
            _held[file_id] = _Held(who, len(data), now + ONE_SHOT_S)
        return file_id

    def get_file(filename):
        file_id = os.path.splitext(filename)[0]
        with _held_lock:
            h = _held.get(file_id)
            if h is not None:
                now = time.monotonic()
                f = storage._files_by_id.get(file_id)
                if h.expires >= now and f is not None:
                    if file_id not in fetched:  # the first fetch: it serves REFETCH_S more seconds
                        fetched.add(file_id)
                        h.expires = min(h.expires, now + REFETCH_S)
                    return f
                drop(file_id)
                raise MediaFileStorageError(f"no media file {file_id!r}")
        return get(filename)

    def get_url(file_id):
        with _held_lock:
            f = storage._files_by_id.get(file_id) if file_id in _held else None
        if f is None:
            return url(file_id)  # Streamlit's own files (and an expired id: its own error)
        return f"{storage._media_endpoint}/{file_id}{get_extension_for_mimetype(f.mimetype)}"

    storage.load_and_get_id, storage.get_file, storage.get_url = load_and_get_id, get_file, get_url
