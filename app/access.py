"""The gate: every script run of every session passes here (streamlit_app.py) before any page runs.

On loopback it lets the local user through, as before. On a workshop server (lab.workshop.access_mode)
a request without a valid personal or admin token gets only the sign-in prompt and the script stops:
no page, run list, figure or download is built for it. The signed-in user goes into the session, and
lab.ui reads it from there for every run it lists, opens, cancels or shares (lab.ui.set_viewer); the
token goes back into the URL, so a reload or a bookmark keeps the session signed in."""
from __future__ import annotations

from typing import Optional

import streamlit as st
from streamlit import config
from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

from lab import ui, workshop

USER = "commlab.user"
TOKEN = "commlab.token"


def session_user() -> Optional[workshop.User]:
    """The signed-in user of the session this thread serves; None outside a session's script run (a
    server thread acting for no one gets nothing)."""
    if get_script_run_ctx(suppress_warning=True) is None:
        return None
    return st.session_state.get(USER)


def mode() -> str:
    return workshop.access_mode(config.get_option("server.address"))


def gate() -> workshop.User:
    """The user this request acts for; otherwise the sign-in prompt, and the script stops here."""
    if mode() == "off":
        ui.set_viewer(None)  # the local user, as in notebooks and scripts
        return workshop.local_user()
    ui.set_viewer(session_user)
    root = ui.runs_dir()
    token = st.query_params.get("token") or st.session_state.get(TOKEN)
    user = workshop.check_token(root, token)
    if user is not None:
        st.session_state[USER] = user
        st.session_state[TOKEN] = token
        if st.query_params.get("token") != token:
            st.query_params["token"] = token  # kept in the URL across pages, reloads and bookmarks
        with st.sidebar:
            st.caption(f"Signed in as **{user.name}** ({'teacher' if user.admin else 'student'})")
            if st.button("Sign out", key="access.out"):
                sign_out()
        return user
    st.session_state.pop(USER, None)
    sign_in_prompt(root, token)
    st.stop()


def sign_out() -> None:
    for k in (USER, TOKEN, "access.class"):
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
                if workshop.is_class_token(root, entered) or workshop.check_token(root, entered):
                    st.query_params["token"] = entered
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
            st.query_params["token"] = personal
            st.rerun()
