import streamlit as st

from app import widgets

widgets.setup("Performance model")
st.title("Performance model")
st.info("Coming with issue 9. Nothing on this page computes anything yet.", icon=":material/construction:")
st.markdown(
    "The model will follow *On the Utility of Gradient Compression* (Agarwal et al., MLSys 2022): from a "
    "run's measured compute time, its encode and decode cost and compression ratio, and a link's bandwidth "
    "and worker count, it will predict the iteration time with and without compression, and so whether "
    "compression pays off, before you spend the machine time.\n\n"
    "Until then, measure it: the preset *Does compression help on a 1 Gbit/s link?* on the Home page runs "
    "the same job with and without compression over a modeled 1 Gbit/s link.")
st.page_link("views/home.py", label="Presets on the Home page", icon=":material/science:")
