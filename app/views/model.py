"""The performance model (lab/perfmodel): will compression help on this cluster?"""
import streamlit as st

from app import widgets
from lab import plots, ui
from lab.perfmodel import calibrate as cal
from lab.perfmodel import views

widgets.setup("Performance model")
st.title("Performance model")
st.caption("After Agarwal et al., *On the Utility of Gradient Compression* (MLSys 2022): iteration time from "
           "per-layer compute, bucket layout, encode/decode cost curves and an alpha-beta link with a single "
           "queue for collectives; speedup against DDP (none, 25 MB buckets, wfbp).")

runs = ui.runs_dir()
done = [r for r in ui.list_runs(runs, state="done")]
if not done:
    st.info("No finished run to calibrate from yet. Start one (New run), or use `commlab predict SPEC`, "
            "which measures a short profile itself.")
    st.stop()

labels = {r.id: ui.run_label(r, state=False) for r in done}
run_id = st.selectbox("Calibrate compute from run", list(reversed(list(labels))), format_func=labels.get,
                      key="pm.run")


@st.cache_data(show_spinner="Calibrating from the run's timeline ...", max_entries=8)
def profile_of(run_id: str, files: tuple):
    run = ui.get_run(run_id, runs)
    prof = cal.from_run(run, skip=min(cal.SKIP_STEPS, max(0, run.spec_dict()["steps"] - 2)))
    views.ensure_curves(prof, views.COMPRESSORS)
    return prof, run.spec_dict()


try:
    prof, spec = profile_of(run_id, ui._files_key(ui.get_run(run_id, runs)))
except cal.CalibrationError as e:
    st.error(str(e))
    st.stop()
st.caption(f"Profile: forward {prof.forward_s * 1e3:.2f} ms, backward {prof.backward_s * 1e3:.2f} ms, "
           f"optimizer {prof.optimizer_s * 1e3:.2f} ms per step ({len(prof.params)} tensors, "
           f"{sum(b for _, b in prof.params) / 2**20:.2f} MiB of gradients), from {prof.source}. "
           "Link: nominal alpha-beta at the chosen rate.")

c1, c2, c3 = st.columns(3)
gbps = c1.select_slider("Bandwidth (Gbit/s)", [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0], value=1.0,
                        key="pm.gbps")
workers = c2.select_slider("Workers", [2, 4, 8, 16, 32, 64, 128, 256], value=8, key="pm.workers")
speed = c3.select_slider("Compute speed (x this CPU)", [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0], value=1.0,
                         key="pm.speed")
latency = st.number_input("Link latency alpha (µs per ring step)", 0.0, 10000.0, 0.0, step=10.0, key="pm.alpha")
prof.link = {"alpha": latency * 1e-6, "beta": 8e-9, "nominal_gbps": 1.0} if latency else None

st.subheader("Predicted speedup over DDP")
grid = views.speedup_grid(prof, spec, views.COMPRESSORS, [0.1, 1.0, 10.0, 100.0, gbps], [2, 8, 64, workers], speed)
st.plotly_chart(plots.speedup_heatmaps(grid.drop_duplicates(["compressor", "gbps", "workers"])),
                width="stretch", key="pm.heat")
st.subheader(f"Crossover bandwidth at {workers} workers, compute x{speed:g}")
st.dataframe(views.crossovers(prof, spec, views.COMPRESSORS, workers, speed), hide_index=True)
at = grid[(grid["gbps"] == gbps) & (grid["workers"] == workers)].drop_duplicates("compressor")
st.caption("At the sliders' point: " + ", ".join(f"{r.compressor} {r.speedup:.2f}x" for r in at.itertuples()))

st.subheader("Predicted against measured, every run in the index")
pvm = views.predicted_vs_measured(runs, only=labels)  # the runs this user may see
st.plotly_chart(plots.predicted_vs_measured_figure(pvm), width="stretch", key="pm.scatter")
with st.expander("Per run"):
    st.dataframe(pvm, hide_index=True)

st.subheader("Compressor properties (measured)")
rows = views.load_properties(runs)
if st.button("Measure the checklist" if rows is None else "Measure again", key="pm.props"):
    with st.spinner("Measuring every compressor ..."):
        rows = views.measure_properties(runs, prof)
if rows:
    st.dataframe(views.properties_table(rows), hide_index=True)
    st.caption("All-reduce compatible: a two-rank exchange simulated in process uses only all-reduce rounds. "
               "Linear: decoding the sum of two payloads gives the sum of the decodings. Ratio: input over "
               "payload bytes of a 1024x1024 tensor. Fusion saves: the share of 50 per-layer calls' cost "
               "that one fused call avoids. Accuracy: bench/results/compressor_accuracy.json.")
else:
    st.caption("Not measured yet in this runs directory.")
