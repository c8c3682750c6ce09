import streamlit as st

from commlab.app import sweeps_view, widgets

widgets.setup("Sweeps")
st.title("Sweeps")
with st.expander("New sweep", expanded=True):
    sweeps_view.sweep_form()
st.subheader("Progress and results")
sweeps_view.sweep_view()
