"""Uploads on a workshop server: what Streamlit's upload endpoint may take, and for how long the server holds it.

Streamlit keeps every uploaded file in the server's memory (its uploaded-file manager), under the Streamlit
session id and a file id that the client names in the address ``/_stcore/upload_file/{session}/{file}``. Its
own checks are a size per file (``--server.maxUploadSize``: commlab.lab.front.appserver.UPLOAD_MB), a session that is
connected, and an XSRF pair the client can make itself; any number of files then stays until the session is shut
down, which a disconnected session may never be. On an exposed lab this module bounds it:

- an upload (or a delete) goes only to an open page of the person who sends it: the Streamlit session must be
  connected, and the lab session in its websocket's cookie must belong to the same person as the request's
  (``refusal``, asked by commlab/app/room/gatekeeper.py before Streamlit sees the request);
- one person's pages hold at most FILES_PER_PERSON files and MB_PER_PERSON MB together, the whole server at most
  MB_TOTAL MB (``bound``, around the manager's ``add_file``; a refusal is one line naming the limit, HTTP 413);
- a page's files are dropped when its websocket closes (Streamlit would keep them for a reconnect, and never drops
  those of a session that ages out of its storage unseen), when its lab session signs out (``drop_lab_session``),
  and at the next upload for any page no longer connected or no longer signed in.

The only page that takes an upload is the Performance model page (commlab/app/views/model.py: one profile). ``guard``
installs the bounds once per server process (commlab/app/room/access.py's guard_server calls it)."""
from __future__ import annotations

import logging
import re
import threading
from typing import Callable, Optional

from streamlit import config, runtime

from commlab.lab.front import ui

from commlab.room import accounts
from commlab.room.owners import User

FILES_PER_PERSON = 8
"""Uploaded files one person's open pages may hold on the server at once (a page of the Performance model holds
one profile; a person may have a few tabs and browsers open)."""
MB_PER_PERSON = 8
"""MB of uploaded files one person's open pages may hold at once (each file at most
commlab.lab.front.appserver.UPLOAD_MB)."""
MB_TOTAL = 128
"""MB of uploaded files the whole server holds at once, everyone's together: a bound on the memory uploads take
whatever the number of names a room signs in with."""
UPLOAD_PATH = re.compile(r"/_stcore/upload_file/([^/]+)/([^/]+)")
"""Streamlit's upload address: the Streamlit session id, then the file id."""
REFUSED = "upload refused: no open page of yours has that id"
"""Said alike for a page nobody has and for another person's page: the answer tells nothing about the others."""
log = logging.getLogger("commlab.uploads")


class Refused(Exception):
    """An upload over a bound; ``status`` the HTTP status it is answered with."""

    def __init__(self, status: int, line: str):
        super().__init__(line)
        self.status = status


def exposed() -> bool:
    return accounts.access_mode(config.get_option("server.address")) == "token"


def lab_session_of(session_id: str) -> Optional[str]:
    """The lab session id in the cookie of the websocket that Streamlit session ``session_id`` is connected on;
    None when no such session is connected."""
    if not runtime.exists():
        return None
    client = runtime.get_instance().get_client(session_id)
    context = getattr(client, "client_context", None) if client is not None else None
    if context is None:
        return None
    return dict(context.cookies).get(accounts.SESSION_COOKIE)


def person_of(session_id: str) -> Optional[User]:
    """The signed-in person whose page Streamlit session ``session_id`` is; None when it is not connected, or its
    lab session ended (signed out, expired, revoked)."""
    return accounts.session_user(ui.runs_dir(), lab_session_of(session_id))


def live(session_id: str) -> bool:
    return runtime.exists() and runtime.get_instance().is_active_session(session_id)


def refusal(path: str, user: User) -> Optional[str]:
    """Why ``user`` may not upload to (or delete from) the upload address ``path``; None when it is one of their
    own open pages."""
    m = UPLOAD_PATH.fullmatch(path)
    if m is None:
        return "upload refused: not an upload address (/_stcore/upload_file/SESSION/FILE)"
    if not live(m.group(1)) or person_of(m.group(1)) != user:
        return REFUSED
    return None


def drop_lab_session(lab_sid: Optional[str]) -> int:
    """Drop the uploaded files of every page signed in with lab session ``lab_sid`` (at sign-out); how many
    pages had some."""
    if not lab_sid or not runtime.exists():
        return 0
    mgr = runtime.get_instance().uploaded_file_mgr
    storage = getattr(mgr, "file_storage", None)
    if storage is None:
        return 0
    with mgr._lock:
        held = list(storage)
    gone = [sid for sid in held if lab_session_of(sid) == lab_sid]
    for sid in gone:
        mgr.remove_session_files(sid)
    return len(gone)


def bound(mgr, person_of: Callable[[str], Optional[User]] = person_of,
          live: Callable[[str], bool] = live) -> None:
    """Bound what Streamlit's uploaded-file manager ``mgr`` (a MemoryUploadedFileManager) takes on an exposed
    lab: ``add_file`` first drops the files of pages no longer ``live`` or no longer signed in, then refuses a file
    for a page nobody is signed in on (403), or over FILES_PER_PERSON, MB_PER_PERSON or MB_TOTAL (413). The route
    that calls it answers a starlette HTTPException with its status and line."""
    original = mgr.add_file
    if getattr(original, "commlab_guarded", False):
        return
    owner: dict = {}
    """Streamlit session id -> the person its files count against (a page's person never changes: its
    websocket's cookie is the one it connected with)."""
    lock = threading.Lock()

    def add_file(session_id, file):
        if not exposed():
            return original(session_id, file)
        try:
            with lock:  # one check and add at a time: two uploads at once cannot pass a bound together
                _admit(session_id, file)
                original(session_id, file)
        except Refused as e:
            from starlette.exceptions import HTTPException
            log.warning("%s (Streamlit session %s)", e, session_id)
            raise HTTPException(status_code=e.status, detail=str(e)) from None

    def _admit(session_id, file):
        with mgr._lock:
            held = {sid: {fid: len(f.data) for fid, f in files.items()} for sid, files in mgr.file_storage.items()}
        for sid in list(held):
            if sid == session_id:
                continue
            if not live(sid) or person_of(sid) is None:
                mgr.remove_session_files(sid)
                owner.pop(sid, None)
                held.pop(sid)
        for sid in [s for s in owner if s not in held and s != session_id]:
            owner.pop(sid)
        who = person_of(session_id) if live(session_id) else None
        if who is None:
            mgr.remove_session_files(session_id)
            owner.pop(session_id, None)
            raise Refused(403, REFUSED)
        owner[session_id] = who
        held.setdefault(session_id, {}).pop(file.file_id, None)  # the same file again replaces it
        mine = [n for sid, files in held.items() if owner.get(sid) == who for n in files.values()]
        size = len(file.data)
        if len(mine) + 1 > FILES_PER_PERSON:
            raise Refused(413, f"upload refused: at most {FILES_PER_PERSON} files held per person at once "
                               f"(commlab.app.room.uploads.FILES_PER_PERSON); your open pages hold {len(mine)}: remove one, "
                               f"or close a page you no longer use")
        if sum(mine) + size > MB_PER_PERSON * 2**20:
            raise Refused(413, f"upload refused: at most {MB_PER_PERSON} MB of files held per person at once "
                               f"(commlab.app.room.uploads.MB_PER_PERSON); your open pages hold {sum(mine) / 2**20:.1f} MB")
        total = sum(n for files in held.values() for n in files.values())
        if total + size > MB_TOTAL * 2**20:
            raise Refused(413, f"upload refused: the server holds {total / 2**20:.1f} MB of uploads, at most "
                               f"{MB_TOTAL} MB (commlab.app.room.uploads.MB_TOTAL); try again later")

    add_file.commlab_guarded = True
    mgr.add_file = add_file


def _drop_on_disconnect(rt) -> None:
    """A page's files go when its websocket closes: Streamlit keeps a disconnected session for a reconnect (and its
    files with it), and one that ages out of its storage is never shut down, so its files would stay for good."""
    original = rt.disconnect_session
    if getattr(original, "commlab_guarded", False):
        return

    def disconnect_session(session_id, *args, **kwargs):
        try:
            return original(session_id, *args, **kwargs)
        finally:
            if not rt.is_active_session(session_id):  # not reconnected from another socket meanwhile
                rt.uploaded_file_mgr.remove_session_files(session_id)
    disconnect_session.commlab_guarded = True
    rt.disconnect_session = disconnect_session


def guard() -> None:
    """Install the bounds on this server process's runtime (once; a no-op without a runtime)."""
    if not runtime.exists():
        return
    rt = runtime.get_instance()
    mgr = rt.uploaded_file_mgr
    if hasattr(mgr, "file_storage"):  # Streamlit's in-memory manager: what the bounds read
        bound(mgr)
    _drop_on_disconnect(rt)
