import streamlit as st

from commlab.app import widgets
from commlab.lab.front import ui
from commlab.lab.analysis.presets import PRESETS

widgets.setup("Home")
st.title("commlab")
st.markdown(
    "A lab for **communication-efficient distributed training**. Each run is a real `torch.distributed` "
    "job (gloo on CPU, NCCL on GPU) whose ranks record what every layer and every collective did and when. "
    "Pick a compressor, a fusion schedule and a communication mode, watch the per-layer timeline while it "
    "trains, then compare runs on accuracy against wall time.")
if ui.viewer().admin:  # the teacher and the local user; a student is not shown the machine's paths
    st.caption(f"Runs directory: {ui.text(ui.runs_dir().resolve())} (set `COMMLAB_RUNS` to change it)")

st.subheader("Start an experiment in one click")
cols = st.columns(3)
for i, preset in enumerate(PRESETS):
    with cols[i % 3]:
        widgets.preset_card(preset)

st.subheader("Recent runs")
widgets.recent_runs()
st.page_link("views/new_run.py", label="Configure a run yourself", icon=":material/add_circle:")
