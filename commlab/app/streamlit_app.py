"""commlab's UI. Start it with `commlab app` (or `streamlit run commlab/app/streamlit_app.py`).

The pages live in views/, not pages/: a pages/ folder beside this file puts Streamlit in its
old multipage mode for a session that opens a page's URL directly, bypassing this navigation
(and with it the gate below)."""
import streamlit as st

from commlab.app import guard

from commlab.app.room import access

guard.install()  # nothing a viewer names is imported or built in this process
user = access.gate()  # on a workshop server, nothing below runs without a valid token
pages = [
    st.Page("views/home.py", title="Home", icon=":material/science:", default=True),
    st.Page("views/new_run.py", title="New run", icon=":material/add_circle:"),
    st.Page("views/results.py", title="Results", icon=":material/fact_check:"),
    st.Page("views/live_run.py", title="Live run", icon=":material/monitoring:"),
    st.Page("views/compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("views/sweeps.py", title="Sweeps", icon=":material/grid_on:"),
    st.Page("views/model.py", title="Performance model", icon=":material/functions:"),
    st.Page("views/advisor.py", title="Advisor", icon=":material/recommend:"),
]
if not user.admin:  # sweeps and the advisor (background jobs over every run) are the teacher's on a workshop server
    pages = [p for p in pages if p.title not in ("Sweeps", "Advisor")]
st.navigation(pages).run()
