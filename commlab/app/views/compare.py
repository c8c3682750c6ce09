import streamlit as st

from commlab.app import compare_view, widgets

widgets.setup("Compare")
st.title("Compare runs")
compare_view.compare_view()
