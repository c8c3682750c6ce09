"""The server `commlab app` starts: Streamlit's app (streamlit_app.py) behind the gatekeeper (sign-in
pages, and no request without a session on an exposed lab; commlab/app/room/gatekeeper.py). Run as
``streamlit run commlab/app/server.py``; Streamlit finds ``app`` below and serves it."""
import logging
import os
from contextlib import asynccontextmanager

import streamlit as st
from starlette.middleware import Middleware

from commlab.app.room import access, gatekeeper
from commlab.lab.front.appserver import FORWARDED_ENV


@asynccontextmanager
async def lifespan(_app):
    access.guard_server()  # once the runtime exists: downloads bound to sessions, no cache clearing, uploads bounded
    if gatekeeper.exposed() and FORWARDED_ENV not in os.environ:
        # uvicorn read its setting before this module was imported: too late to change it here, so say it
        logging.getLogger("commlab.server").warning(
            "%s is not set (a server not started by `commlab app`): uvicorn believes X-Forwarded-For from "
            "loopback, so behind a proxy on this machine a client can choose the address the sign-in limits "
            "count; start it with %s= (empty), or with `commlab app --behind-proxy`", FORWARDED_ENV, FORWARDED_ENV)
    yield


app = st.App("streamlit_app.py", middleware=[Middleware(gatekeeper.Gate)], lifespan=lifespan)
