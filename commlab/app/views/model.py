"""The performance model (commlab/lab/strategy/perfmodel): will compression help on this cluster?"""
import streamlit as st

from commlab.app import widgets
from commlab.engine.spec import SpecError
from commlab.lab.analysis import plots
from commlab.lab.base import sandbox
from commlab.lab.front import profiles, ui
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import views
from commlab.lab.rundir import store
from commlab.lab.rundir.store import RunError
from commlab.room import owners, places

widgets.setup("Performance model")
st.title("Performance model")
st.caption("After Agarwal et al., *On the Utility of Gradient Compression* (MLSys 2022): iteration time from "
           "per-layer compute, bucket layout, encode/decode cost curves and an alpha-beta link with a single "
           "queue for collectives; speedup against DDP (none, 25 MB buckets, wfbp).")

runs = ui.runs_dir()
me = ui.viewer()


@st.cache_data(show_spinner="Calibrating from the run's timeline ...", max_entries=8)
def profile_of(run_id: str, files: tuple):
    return views.calibrated(ui.get_run_or_raise(run_id, runs), ui.viewer().name)  # the viewer's run (the key holds its id only)


@st.cache_data(show_spinner="Predicting ...", max_entries=32)
def predictions(root: str, run_id: str, files: tuple, gbps: float, workers: int, speed: float, latency: float):
    """The speedup grid, the crossovers and the sources of one run's profile at the sliders' point: kept, so a
    rerun of the page at a point seen before computes nothing."""
    prof, spec = profile_of(run_id, files)
    prof.link = {"alpha": latency * 1e-6, "beta": 8e-9, "nominal_gbps": 1.0} if latency else None
    link_note = (f"alpha {latency:g} µs per ring step as typed here, beta 8/rate (nominal)" if latency
                 else "nominal alpha-beta at each rate (alpha 0, beta 8/rate)")
    grid = views.speedup_grid(prof, spec, views.COMPRESSORS, [0.1, 1.0, 10.0, 100.0, gbps], [2, 8, 64, workers],
                              speed)
    return (grid, views.crossovers(prof, spec, views.COMPRESSORS, workers, speed),
            views.sources_table(prof, spec, views.COMPRESSORS, link=link_note))


@st.cache_data(show_spinner="Predicting every finished run ...", max_entries=8)
def every_run(root: str, seen: tuple, who: str):
    """views.predicted_vs_measured over the finished runs ``seen`` ((id, files) of each, the viewer's): kept
    until one of them changes or another is seen."""
    return views.predicted_vs_measured(runs, only=[i for i, _ in seen], who=who)


def sources_panel(df, key: str):
    """Which inputs were measured and which assumed, and how well each part of the model was checked."""
    st.markdown("**What these predictions rest on**")
    st.dataframe(df, hide_index=True, key=key)
    st.caption("measured: on this machine or from the run named; modeled: from a device's datasheet; assumed: "
               "a number nobody measured. Validated: the error of that part of the model against measurements "
               "(docs/benchmarks/model-validation.md has the tables and the commands).")


def from_runs():
    done = [r for r in ui.list_runs(runs, state="done")]
    if not done:
        st.info("No finished run to calibrate from yet. Start one (New run), use `commlab predict SPEC`, which "
                "measures a short profile itself, or a profile file below.")
        return

    labels = {r.id: ui.run_label(r, state=False) for r in done}
    run_id = st.selectbox("Calibrate compute from run", list(reversed(list(labels))), format_func=labels.get,
                          key="pm.run")

    try:
        files = ui.get_run_or_raise(run_id, runs).files_key()
        prof, spec = profile_of(run_id, files)
    except (cal.CalibrationError, RunError) as e:
        st.error(ui.text(views.one_line(e)))
        return
    st.caption(f"Profile: forward {prof.forward_s * 1e3:.2f} ms, backward {prof.backward_s * 1e3:.2f} ms, "
               f"optimizer {prof.optimizer_s * 1e3:.2f} ms per step ({len(prof.params)} tensors, "
               f"{sum(b for _, b in prof.params) / 2**20:.2f} MiB of gradients), from {ui.text(prof.source)}"
               + (f" (its last steps that fit {store.VIEW_MB:g} MB of timeline, as every view here reads)"
                  if ui.get_run_or_raise(run_id, runs).view_cut() else "")
               + ". Link: nominal alpha-beta at the chosen rate.")

    c1, c2, c3 = st.columns(3)
    gbps = c1.select_slider("Bandwidth (Gbit/s)", [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0], value=1.0,
                            key="pm.gbps")
    workers = c2.select_slider("Workers", [2, 4, 8, 16, 32, 64, 128, 256], value=8, key="pm.workers")
    speed = c3.select_slider("Compute speed (x this CPU)", [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0], value=1.0,
                             key="pm.speed")
    latency = st.number_input("Link latency alpha (µs per ring step)", 0.0, 10000.0, 0.0, step=10.0, key="pm.alpha")
    seen = tuple((r.id, r.files_key()) for r in done[-views.NEWEST:])
    try:  # one person's predictions one at a time: a second page asking waits for the first, then is refused
        with places.person(me.name, "prediction", sandbox.WAIT_S):
            grid, cross, sources = predictions(str(runs), run_id, files, gbps, workers, speed, latency)
            pvm = every_run(str(runs), seen, me.name)  # the runs this user may see
    except (sandbox.Busy, sandbox.TimedOut) as e:  # the server's load now: said, and nothing kept
        st.warning(ui.text(views.one_line(e)))
        return

    st.subheader("Predicted speedup over DDP")
    st.plotly_chart(plots.speedup_heatmaps(grid.drop_duplicates(["compressor", "gbps", "workers"])),
                    width="stretch", key="pm.heat")
    sources_panel(sources, "pm.sources")
    st.subheader(f"Crossover bandwidth at {workers:d} workers, compute x{speed:g}")
    st.dataframe(cross, hide_index=True)
    at = grid[(grid["gbps"] == gbps) & (grid["workers"] == workers)].drop_duplicates("compressor")
    st.caption("At the sliders' point: "
               + ", ".join(f"{ui.text(r.compressor)} {r.speedup:.2f}x" for r in at.itertuples()))

    st.subheader(ui.text(f"Predicted against measured, the newest {views.NEWEST} finished runs"))
    st.plotly_chart(plots.predicted_vs_measured_figure(pvm), width="stretch", key="pm.scatter")
    with st.expander("Per run"):
        st.dataframe(pvm, hide_index=True)

    st.subheader("Compressor properties (measured)")
    rows = views.load_properties(runs)
    if profiles.may_measure(me) and st.button("Measure the checklist" if rows is None else "Measure again",
                                           key="pm.props"):
        with st.spinner("Measuring every compressor ..."):
            rows = profiles.measure_properties(runs, me, prof)
    if rows:
        st.dataframe(views.properties_table(rows), hide_index=True)
        st.caption("All-reduce compatible: a two-rank exchange simulated in process uses only all-reduce rounds. "
                   "Linear: decoding the sum of two payloads gives the sum of the decodings. Ratio: input over "
                   "payload bytes of a 1024x1024 tensor. Fusion saves: the share of 50 per-layer calls' cost "
                   "that one fused call avoids. Accuracy: the accuracy benchmark shipped with the lab (commlab.lab.strategy.evidence).")
    else:
        st.caption("Not measured yet in this runs directory.")


def from_profile():
    """A profile file (commlab profile) and a cluster shape: the predicted table and scaling plot."""
    st.subheader("Your model at scale: a profile and a cluster")
    st.caption("A profile from `commlab profile SPEC -o profile.json` (per-layer compute measured on the machine "
               "it ran on, the spec it predicts), on a two-level cluster: nodes of fast links joined by a slower "
               "network, hierarchical all-reduce (reduce-scatter inside the node, all-reduce across nodes, "
               "all-gather inside). Assumptions: docs/explanation/perfmodel.md.")
    c1, c2, c3 = st.columns(3)
    saved = profiles.lab_profiles(runs)
    name = c1.selectbox("A profile of this lab", ["none", *saved], key="pm.prof.saved")
    path = c2.text_input("Profile file (path" + ("" if me == owners.local_user() else " in the runs directory")
                         + ")", key="pm.prof.path", placeholder=".profiles/resnet-digits-32.json") \
        if me.admin else ""
    up = c3.file_uploader(f"or upload one (at most {profiles.MAX_UPLOAD >> 20:d} MiB"
                          + ("" if me.admin else f", {profiles.MAX_TENSORS:,} tensors") + ")", type=["json"],
                          key="pm.prof.upload")
    if not path and up is None and name == "none":
        st.caption("No profile chosen.")
        return
    try:
        prof = profiles.read_profile(runs, me, upload=(up.name, up.getvalue()) if up is not None else None,
                                  path=path if up is None and path else None,
                                  name=name if up is None and not path and name != "none" else None)
    except SpecError as e:
        st.error(ui.text(e))
        return
    m = prof.machine or {}
    st.caption(f"{ui.text(prof.key())}: forward {prof.forward_s * 1e3:.2f} ms, backward "
               f"{prof.backward_s * 1e3:.2f} ms, "
               f"optimizer {prof.optimizer_s * 1e3:.2f} ms per step, {len(prof.params)} tensors, "
               f"{sum(b for _, b in prof.params) / 2**20:.2f} MiB of gradients; measured on "
               f"{ui.text(m.get('gpu') or m.get('cpu') or 'an unrecorded machine')} ({ui.text(m.get('device', '?'))}, "
               f"torch {ui.text(m.get('torch', '?'))}), from {ui.text(prof.source)}.")
    c1, c2, c3, c4 = st.columns(4)
    workers = c1.multiselect("Workers", [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], default=[8, 16, 64, 256, 1024],
                             key="pm.cl.workers")
    node = c2.number_input("Node size (workers per node)", 1, 4096, 8, key="pm.cl.node")
    intra = c3.number_input("Intra-node link (Gbit/s)", 0.001, 100000.0, 1600.0, key="pm.cl.intra")
    nics = c4.number_input("NICs per node", 1, 64, 1, key="pm.cl.nics")
    c1, c2, c3 = st.columns(3)
    inter = c1.multiselect("Inter-node link (Gbit/s)", [1.0, 10.0, 25.0, 100.0, 200.0, 400.0], default=[10.0, 100.0],
                           key="pm.cl.inter")
    speed = c2.number_input("Compute speed (x the profiled machine)", 0.001, 10000.0, 1.0, key="pm.cl.speed")
    comp = c3.selectbox("Compressor", ["the profile's spec"] + list(views.COMPRESSORS), key="pm.cl.comp")
    if not workers or not inter:
        st.caption("Choose at least one worker count and one inter-node rate.")
        return
    shape = {"node_size": int(node), "intra_gbps": float(intra), "nics": int(nics)}
    spec = prof.spec
    if comp != "the profile's spec" and spec:
        spec = views.with_compressor(spec, views.COMPRESSORS[comp])
    try:
        with st.spinner("Predicting ..."):
            df = profiles.cluster_prediction(me, prof, shape, sorted(workers), sorted(inter), speed, spec=spec)
    except (SpecError, KeyError, ValueError) as e:
        st.error(ui.text(views.one_line(e) if not me.admin else str(e).splitlines()[0] if str(e) else type(e).__name__))
        return
    c = (spec or {}).get("compressor", {})
    label = f"{c.get('name')}{' +EF' if c.get('error_feedback') else ''} {(spec or {}).get('comm', {}).get('mode')}"
    st.plotly_chart(plots.predicted_scaling_figure(df, label), width="stretch", key="pm.cl.plot")
    sources_panel(views.sources_table(prof, spec or prof.spec, cluster=True), "pm.cl.sources")
    st.dataframe(df.round(3), hide_index=True, key="pm.cl.table")
    st.caption(f"Scaling factor: one worker's iteration time (compute only) over p workers' (1 = linear). "
               f"DDP: none, 25 MB buckets, wfbp. Spec: {ui.text(label)}.")


from_runs()
from_profile()
