"""The server `commlab app` starts: Streamlit's app (streamlit_app.py) behind the gatekeeper (sign-in
pages, and no request without a session on an exposed lab; app/gatekeeper.py). Run as
``streamlit run app/server.py``; Streamlit finds ``app`` below and serves it."""
from contextlib import asynccontextmanager

import streamlit as st
from starlette.middleware import Middleware

from app import access, gatekeeper


@asynccontextmanager
async def lifespan(_app):
    access.guard_server()  # once the runtime exists: downloads bound to sessions, no cache clearing
    yield


app = st.App("streamlit_app.py", middleware=[Middleware(gatekeeper.Gate)], lifespan=lifespan)
