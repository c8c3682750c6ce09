"""The gate: every script run of every session passes here (streamlit_app.py) before any page runs.

On loopback it lets the local user through, as before. On a workshop server (lab.workshop.access_mode)
a request without a valid personal or admin token gets only the sign-in prompt and the script stops:
no page, run list, figure or download is built for it. The signed-in user goes into the session, and
lab.ui reads it from there for every run it lists, opens, cancels or shares (lab.ui.set_viewer). A token
that came in the URL is taken out of it once accepted (it stays in the session only), so the address bar,
history and a shared screen do not show it; the personal link is shown once, at sign-in.

Downloads (st.download_button) go through ``download_data``: on a workshop server the file is built at
click time only for a session whose token is still valid and whose user may see every run in it.
``guard_downloads`` (installed once per server process) closes what Streamlit leaves open: its deferred
download requests are honoured only from the session the button was made for, and the file they produce
gets a random /media id that serves within ONE_SHOT_S seconds, for REFETCH_S seconds from its first
fetch, then is gone."""
from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Callable, Iterable, Optional

import streamlit as st
from streamlit import config
from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

from lab import ui, workshop

USER = "commlab.user"
TOKEN = "commlab.token"
NEW_LINK = "commlab.new_link"
ONE_SHOT_S = 60.0
"""How long a generated download's /media URL lives if it is not fetched."""
REFETCH_S = 5.0
"""How long it still serves after its first fetch. Chromium fetches a download twice at times (the
navigation that turns into a download, then the download itself): served strictly once, the second
request got a 404 and the browser cancelled the download (seen in the real-browser test)."""


def session_user() -> Optional[workshop.User]:
    """The signed-in user of the session this thread serves; None outside a session's script run (a
    server thread acting for no one gets nothing)."""
    if get_script_run_ctx(suppress_warning=True) is None:
        return None
    user = st.session_state.get(USER)
    if user is None or valid_user(ui.runs_dir(), st.session_state.get(TOKEN)) != user:
        return None  # revoked since the session signed in (a fragment's rerun passes no gate)
    return user


_checked: dict = {}


def valid_user(root, token: Optional[str]) -> Optional[workshop.User]:
    """workshop.check_token, read again only when runs/access.json changed (every list and panel asks)."""
    try:
        stamp = workshop.access_path(root).stat().st_mtime_ns
    except FileNotFoundError:
        stamp = None
    key = (str(root), token)
    hit = _checked.get(key)
    if hit is not None and hit[0] == stamp and stamp is not None:
        return hit[1]
    user = workshop.check_token(root, token)
    if len(_checked) > 1000:
        _checked.clear()
    _checked[key] = (stamp, user)
    return user


def mode() -> str:
    return workshop.access_mode(config.get_option("server.address"))


def gate() -> workshop.User:
    """The user this request acts for; otherwise the sign-in prompt, and the script stops here."""
    if mode() == "off":
        ui.set_viewer(None)  # the local user, as in notebooks and scripts
        return workshop.local_user()
    ui.set_viewer(session_user)
    root = ui.runs_dir()
    guard_downloads()
    token = st.query_params.get("token") or st.session_state.get(TOKEN)
    user = workshop.check_token(root, token)
    if user is not None:
        st.session_state[USER] = user
        st.session_state[TOKEN] = token
        if "token" in st.query_params:
            del st.query_params["token"]  # kept in the session only, out of the address bar and history
        with st.sidebar:
            st.caption(f"Signed in as **{user.name}** ({'teacher' if user.admin else 'student'})")
            if st.button("Sign out", key="access.out"):
                sign_out()
        link = st.session_state.pop(NEW_LINK, None)
        if link:
            st.success(f"Signed in as {user.name}. Your personal link (keep it private; it is how you come "
                       f"back after closing or reloading this tab): {link}")
        return user
    st.session_state.pop(USER, None)
    st.session_state.pop(TOKEN, None)
    sign_in_prompt(root, token)
    st.stop()


def sign_out() -> None:
    for k in (USER, TOKEN, NEW_LINK, "access.class"):
        st.session_state.pop(k, None)
    st.query_params.clear()
    st.rerun()


def sign_in_prompt(root, token: Optional[str]) -> None:
    """The only thing a request without a valid token gets."""
    st.set_page_config(page_title="Sign in · commlab", layout="centered")
    st.title("commlab: sign in")
    if token and workshop.is_class_token(root, token):
        st.session_state["access.class"] = token
    klass = st.session_state.get("access.class")
    if klass is None:
        if token:
            st.error("That token is not valid.")
        st.caption("This lab is shared over the network: open the link your teacher gave you, or enter its token.")
        with st.form("access.token"):
            entered = st.text_input("Access token", type="password", key="access.entered")
            if st.form_submit_button("Continue"):
                if workshop.check_token(root, entered):
                    st.session_state[TOKEN] = entered
                    st.rerun()
                if workshop.is_class_token(root, entered):
                    st.session_state["access.class"] = entered
                    st.rerun()
                st.error("That token is not valid.")
        return
    st.caption("Pick the name your runs will carry. You get a personal link: keep it, it is how you come back.")
    with st.form("access.name"):
        name = st.text_input("Your name", key="access.name_in", max_chars=32)
        if st.form_submit_button("Sign in"):
            try:
                personal = workshop.sign_in(root, klass, name.strip())
            except workshop.LabError as e:
                st.error(str(e))
                return
            st.session_state.pop("access.class", None)
            st.session_state[TOKEN] = personal
            st.session_state[NEW_LINK] = personal_link(personal)
            if "token" in st.query_params:
                del st.query_params["token"]
            st.rerun()


def personal_link(token: str) -> str:
    """The address of this lab with ``token``, as the student's browser reached it."""
    url = (getattr(st.context, "url", None) or "").split("?")[0]
    base = url.rsplit("/", 1)[0] if url.count("/") > 2 else url
    return f"{base.rstrip('/')}/?token={token}"


# --------------------------------------------------------------------------- downloads

def download_data(make: Callable[[], object], run_ids: Iterable[str]) -> Callable[[], object]:
    """``data=`` for st.download_button: builds the file when clicked. On a workshop server it checks,
    at that moment, that the token the page was built for is still valid (not revoked) and that its user
    may see every run in ``run_ids``; otherwise it builds nothing (PermissionError, logged by Streamlit,
    and the browser gets no file)."""
    if mode() == "off":
        return make
    import lab
    root, token, ids = ui.runs_dir(), st.session_state.get(TOKEN), list(run_ids)

    def build():
        user = workshop.check_token(root, token)
        if user is None:
            raise PermissionError("download refused: the session's token is no longer valid")
        for rid in ids:
            if not workshop.can_see(user, lab.get(rid, runs=root).status()):
                raise PermissionError(f"download refused: {user.name} may not see run {rid}")
        return make()
    return build


_guard_lock = threading.Lock()
_guarded = False


def guard_downloads() -> None:
    """Install, once in this server process, what binds Streamlit's downloads to their session:

    - a deferred download (the file built when its button is clicked) is built only for a request from
      the session that the button was made for; Streamlit itself builds it for any session that names
      its id;
    - the /media file it produces gets a random id (not a hash of its content), serves for REFETCH_S
      seconds from its first fetch, and is dropped ONE_SHOT_S seconds after it was made if nobody fetched
      it, so a URL that leaks afterwards (browser history, a shared screen, a proxy log) serves nothing."""
    global _guarded
    with _guard_lock:
        if _guarded:
            return
        from streamlit import runtime
        if not runtime.exists():  # a test's AppTest runs the script without a server
            return
        _guard_deferred()
        _one_shot(runtime.get_instance().media_file_mgr._storage)
        _guarded = True


def _guard_deferred() -> None:
    from streamlit import runtime
    from streamlit.runtime import backend_operation_handler as boh
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
    from streamlit.runtime.media_file_storage import MediaFileKind, MediaFileStorageError
    from streamlit.runtime.memory_media_file_storage import MemoryFile, get_extension_for_mimetype
    expires: dict = {}
    fetched: set = set()
    lock = threading.Lock()
    load, get, url = storage.load_and_get_id, storage.get_file, storage.get_url

    def load_and_get_id(path_or_data, mimetype, kind, filename=None):
        if kind != MediaFileKind.DOWNLOADABLE:
            return load(path_or_data, mimetype, kind, filename)
        data = storage._read_file(path_or_data) if isinstance(path_or_data, str) else path_or_data
        file_id = secrets.token_hex(32)
        with lock:
            now = time.monotonic()
            for old in [k for k, t in expires.items() if t < now]:  # expired: dropped
                expires.pop(old)
                fetched.discard(old)
                storage.delete_file(old)
            storage._files_by_id[file_id] = MemoryFile(content=data, mimetype=mimetype, kind=kind,
                                                       filename=filename)
            expires[file_id] = now + ONE_SHOT_S
        return file_id

    def get_file(filename):
        file_id = os.path.splitext(filename)[0]
        with lock:
            if file_id in expires:
                now = time.monotonic()
                f = storage._files_by_id.get(file_id)
                if expires[file_id] >= now and f is not None:
                    if file_id not in fetched:  # the first fetch: it serves REFETCH_S more seconds
                        fetched.add(file_id)
                        expires[file_id] = min(expires[file_id], now + REFETCH_S)
                    return f
                expires.pop(file_id)
                fetched.discard(file_id)
                storage.delete_file(file_id)
                raise MediaFileStorageError(f"no media file {file_id!r}")
        return get(filename)

    def get_url(file_id):
        with lock:
            f = storage._files_by_id.get(file_id) if file_id in expires else None
        if f is None:
            return url(file_id)  # Streamlit's own files (and an expired id: its own error)
        return f"{storage._media_endpoint}/{file_id}{get_extension_for_mimetype(f.mimetype)}"

    storage.load_and_get_id, storage.get_file, storage.get_url = load_and_get_id, get_file, get_url
