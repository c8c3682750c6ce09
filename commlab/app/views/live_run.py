import streamlit as st

from commlab.app import live_view, widgets

widgets.setup("Live run")
st.title("Live run")
run_id = live_view.pick_run()
if run_id is None:
    st.info("No runs yet.")
    st.page_link("views/new_run.py", label="Start one", icon=":material/add_circle:")
    st.stop()
live_view.live_panel(run_id)
