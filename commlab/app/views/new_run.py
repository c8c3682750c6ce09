import streamlit as st

from commlab.app import run_form, widgets

widgets.setup("New run")
st.title("New run")
st.caption("Every field of the job spec. Choices follow each other (data sets that fit the model, the "
           "compressor's own parameters); a bad value is named under its field before anything starts.")
run_form.run_form()
