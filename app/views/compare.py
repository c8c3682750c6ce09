import streamlit as st

from app import widgets

widgets.setup("Compare")
st.title("Compare runs")
widgets.compare_view()
