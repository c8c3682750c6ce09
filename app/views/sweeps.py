import streamlit as st

from app import widgets

widgets.setup("Sweeps")
st.title("Sweeps")
with st.expander("New sweep", expanded=True):
    widgets.sweep_form()
st.subheader("Progress and results")
widgets.sweep_view()
