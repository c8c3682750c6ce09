import streamlit as st

from commlab.app import results_view, widgets

widgets.setup("Results")
st.title("Results")
group = results_view.pick_group()
if group is None:
    st.info("No preset has been started yet: start one on the Home page.")
    st.page_link("views/home.py", label="Home", icon=":material/science:")
    st.stop()
results_view.results_panel(group)
