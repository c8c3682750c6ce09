"""Streamlit pieces the pages share: the run picker, the New run form, the live
panel, preset cards. Data and decisions come from lab.ui and lab.plots; this
module only lays them out.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import streamlit as st

from app import access
from lab.analysis import comparison, live, plots, timelines
from lab.analysis.report import report_html
from lab.front import ui
from lab.rundir import disturbance
from lab.rundir.store import FINAL
from lab.rundir.summary import fmt_bytes, summarize, warmup_steps
from engine.spec import SpecError
from lab.analysis.presets import Preset
from lab.base.errors import LabError
from lab.service import owners

LIVE_PAGE = "views/live_run.py"
RESULTS_PAGE = "views/results.py"
BREAKDOWN_STEPS = 40
"""Steps the live page reads back for its breakdown (and at least that many for the timeline)."""
STATE_COLORS = {"queued": "gray", "running": "blue", "done": "green", "failed": "red", "cancelled": "orange",
                "diverged": "red"}


def setup(title: str) -> None:
    st.set_page_config(page_title=f"{title} · commlab", layout="wide")


def open_run(run_id: str, compare: Optional[List[str]] = None) -> None:
    """Go to the live page of ``run_id`` (kept in the query string and the session)."""
    st.session_state["run_id"] = run_id
    if compare:
        st.session_state["compare_ids"] = compare
    st.switch_page(LIVE_PAGE, query_params={"run": run_id})


def report_button(runs: list, file_name: str, key: str, group: Optional[dict] = None) -> None:
    """Download one self-contained HTML report (lab.report) of ``runs`` (and ``group``'s verdict), built
    when clicked. The runs were resolved for the viewer already: the builder looks up nothing else."""
    by_id = {r.id: r for r in runs}
    st.download_button("Download report (HTML, opens offline)", on_click="ignore", key=key, mime="text/html",
                       data=access.download_data(lambda: report_html(runs, group=group, get=by_id.__getitem__),
                                                 by_id),
                       file_name=file_name, icon=":material/description:")


def where() -> str:
    """" in <runs directory>" for the teacher and the local user; nothing for a student (the machine's
    paths are not theirs to see)."""
    return f" in {ui.runs_dir()}" if ui.viewer().admin else ""


def state_badge(state: str) -> None:
    st.badge(state, color=STATE_COLORS.get(state, "gray"))


# --------------------------------------------------------------------------- home

def preset_card(p: Preset) -> None:
    reason = p.check()
    with st.container(border=True):
        st.markdown(f"**{p.title}**")
        st.caption(p.question)
        st.caption("runs: " + ", ".join(p.variants))
        # the preset's knobs (e.g. H, the steps between two syncs): its runs take the values set here
        values = {k.name: st.slider(k.label, k.lo, k.hi, k.default, key=f"preset-{p.key}-{k.name}", help=k.help)
                  for k in p.knobs}
        cap = owners.preset_steps(ui.runs_dir())
        if cap and any(d["steps"] > cap for d in p.specs(values)):
            st.caption(f"Scaled down for this room: at most {cap} steps per run (runs/lab.json preset_steps)")
        if reason:
            st.button("Start", key=f"preset-{p.key}", disabled=True, help=reason)
            st.caption(f"Not available yet: {reason}")
        elif st.button("Start", key=f"preset-{p.key}", type="primary"):
            try:
                gid = ui.start_preset(p, values=values)
            except LabError as e:
                st.error(str(e))
                return
            st.session_state["group_id"] = gid
            st.switch_page(RESULTS_PAGE, query_params={"group": gid})


def recent_runs(n: int = 8) -> None:
    runs = ui.list_runs()[-n:][::-1]
    if not runs:
        st.caption(f"No runs{where()} yet.")
        return
    for r in runs:
        cols = st.columns([5, 1])
        cols[0].page_link(LIVE_PAGE, label=ui.md(ui.run_label(r)), query_params={"run": r.id})
        with cols[1]:
            state_badge(r.state)


# --------------------------------------------------------------------------- run picker

def pick_run() -> Optional[str]:
    """The run the page is about: ?run=..., else the session's, else the newest; a selectbox changes it."""
    runs = ui.list_runs()[::-1]
    want = st.query_params.get("run") or st.session_state.get("run_id")
    if want and want not in {r.id for r in runs}:
        made = ui.get_run(want)  # made after the index was read, or not a run at all
        runs = [made, *runs] if made is not None else runs
    if not runs:
        return None
    ids = [r.id for r in runs]
    labels = {r.id: ui.run_label(r, state=False) for r in runs}  # the panel below shows the live state
    want = want if want in ids else ids[0]
    if st.query_params.get("run", want) != want:  # an id the viewer may not see: the URL names the run shown
        st.query_params["run"] = want
    st.session_state["live.pick"] = want  # the URL wins over what the widget last held

    def picked():
        st.query_params["run"] = st.session_state["live.pick"]
        st.session_state["run_id"] = st.session_state["live.pick"]
    st.selectbox("Run", ids, format_func=lambda i: labels.get(i, i), key="live.pick", on_change=picked)
    st.session_state["run_id"] = want
    return want


# --------------------------------------------------------------------------- live panel

def live_panel(run_id: str) -> None:
    """Status, progress, cancel, timeline, breakdown, curves and bytes of one run. Until the run is final
    the status refreshes every ui.REFRESH_S seconds and the charts every ui.CHARTS_REFRESH_S, or at once
    on the Redraw button (drawing them is most of what watching costs the machine the run trains on). A
    refresh that finds nothing new sends the same figures, which the browser does not draw again."""
    run = ui.get_run(run_id)
    if run is None:
        st.error(f"No run {ui.md(repr(run_id))}{ui.md(where())}.")
        return
    spec = run.spec_dict()
    st.caption(ui.md(comparison.describe_setup(spec)))
    c = st.columns([1, 1, 1, 2])
    last = c[0].number_input("Iterations in the timeline", 1, 20, 3, key="live.last")
    step = c[1].number_input("Zoom to step (-1: last iterations)", -1, spec["steps"], -1, key="live.step")
    xaxis = c[2].radio("Curves against", ["step", "wall time"], horizontal=True, key="live.x")
    with c[3]:
        st.download_button("Download trace (Chrome/Perfetto JSON)", data=access.download_data(lambda: timelines.trace_json(run), [run.id]),
                           file_name=f"{run.id}.trace.json", mime="application/json", on_click="ignore",
                           key="live.trace", icon=":material/download:")
        report_button([run], f"{run.id}.html", key="live.report")
    started_final = run.state in FINAL
    mine = ui.can_control(run)
    owner = ui.owner(run)
    if mine and owner != owners.local_user().name:  # a workshop user's own run: share it with the class
        shared = bool(run.status().get("shared"))
        if st.toggle("Shared with the class", shared, key="live.share",
                     help="Other students see a shared run in their lists, comparisons and reports.") != shared:
            ui.share(run.id, not shared)
    elif not mine:
        st.caption(f"{owner}'s run, shared with the class")

    def still_visible():
        """The run again, as the viewer may see it now (signed out, revoked, unshared: no more of it)."""
        again = ui.get_run(run_id)
        if again is None:
            st.rerun()  # the whole page again: the gate, then "No run"
        return again

    @st.fragment(run_every=None if started_final else ui.REFRESH_S)
    def panel():
        run = still_visible()
        state = run.state
        if state in FINAL and not started_final:
            st.rerun()  # a full rerun redraws the panel without its refresh timer
        status = run.status()
        lr = live.live_run(run)  # only what was appended since the last refresh is read
        done, total = lr.progress()
        head = st.columns([1, 4, 1])
        with head[0]:
            state_badge(state)
        head[1].progress(min(done / total, 1.0) if total else 0.0, text=f"step {done}/{total}")
        if state not in FINAL and mine and head[2].button("Cancel run", key="live.cancel", icon=":material/stop:"):
            st.toast(f"cancel requested ({ui.cancel(run.id)})")
        if state in ("failed", "diverged"):
            st.error(f"{state}: {ui.md(status.get('error', ''))}")
            with st.expander("log (last lines)"):
                st.code(run.log_tail(30) or "(empty)")
        machine_note(status.get("disturbance"))
        s = summarize(lr.metric_rows(), spec)
        m = st.columns(4)
        m[0].metric("iteration (median)", f"{s['iter_ms_median']:.1f} ms" if s.get("iter_ms_median") else "-")
        m[1].metric("held-out accuracy", f"{s['final_acc']:.1%}" if s.get("final_acc") is not None else "-")
        m[2].metric("bytes sent / step / rank", fmt_bytes(s.get("bytes_per_step")))
        m[3].metric("compression", f"{s['compression_ratio']:.1f}x" if s.get("compression_ratio") else "-")

    @st.fragment(run_every=None if started_final else ui.CHARTS_REFRESH_S)
    def charts():
        run = still_visible()
        state = run.state
        lr = live.live_run(run)
        done, _ = lr.progress()
        if not started_final:
            note, redraw = st.columns([5, 1], vertical_alignment="center")
            note.caption(f"While the run goes on, the charts are redrawn every {ui.CHARTS_REFRESH_S:g} s and the "
                         f"progress above every {ui.REFRESH_S:g} s: a redraw costs your browser CPU on the cores "
                         "the run trains on.")
            redraw.button("Redraw charts", key="live.redraw", icon=":material/refresh:",
                          help="Draw the charts now from what the run has logged so far.")
        st.subheader("Timeline")
        if step < 0:
            fig = plots.timeline_figure(lr.timeline(int(last) + 1), last=int(last))
        else:
            back = max(done - int(step) + 1, 1)
            tl = lr.timeline(back) if lr.has_steps(back) else timelines.tail_timeline(run, max(spec["steps"] - step + 1, 1))
            fig = plots.timeline_figure(tl, step=int(step))
        st.plotly_chart(fig, key="live.timeline")
        st.subheader("Where the step time goes")
        bd = lr.breakdown(BREAKDOWN_STEPS, final=state in FINAL)  # each step's breakdown is computed once
        st.plotly_chart(plots.breakdown_figure(bd), key="live.breakdown")
        timed = bd[bd["step"] >= warmup_steps(done)] if len(bd) else bd
        mean = plots.mean_breakdown(timed if len(timed) else bd)
        if mean:
            st.caption(f"mean over the last {BREAKDOWN_STEPS} steps, warm-up left out: " + ", ".join(
                f"{plots.PART_LABELS[k]} {mean[k]:.2f} ms" for k in (*plots.PARTS, "hidden_comm_ms"))
                + f"; step {mean['step_ms']:.2f} ms")
        st.subheader("Loss and accuracy")
        metrics = lr.metrics()
        st.plotly_chart(plots.curves_figure(metrics, lr.metrics("eval"),
                                            x="step" if xaxis == "step" else "wall"), key="live.curves")
        st.subheader("Bytes per step")
        st.plotly_chart(plots.bytes_figure(metrics), key="live.bytes")

    panel()
    charts()


def machine_note(d: Optional[dict]) -> None:
    """A warning with the figure when other processes disturbed the run; a quiet caption otherwise."""
    label, text = disturbance.describe(d)
    if label == "disturbed":
        st.warning(f"Disturbed run: {text[len('yes: '):]}. Its timings are not results.", icon=":material/warning:")
    elif d and d.get("other_cpu") is not None:
        st.caption(f"Machine {text}.")


# --------------------------------------------------------------------------- new run form

def _slot(slots: Dict[str, object], path: str) -> None:
    slots[path] = st.empty()


def run_form() -> None:
    """Every spec field, with choices that follow each other; errors under their field."""
    ch = ui.choices()
    slots: Dict[str, object] = {}
    k = "nr."
    d: dict = {}
    top = st.columns([2, 1, 1, 1])
    d["name"] = top[0].text_input("Name", "my-run", key=k + "name")
    with top[0]:
        _slot(slots, "name")
    d["world_size"] = top[1].number_input("World size (ranks)", 1, 64, 2, key=k + "world_size")
    with top[1]:
        _slot(slots, "world_size")
    d["steps"] = top[2].number_input("Steps", 1, 1_000_000, 200, key=k + "steps")
    with top[2]:
        _slot(slots, "steps")
    d["batch_size"] = top[3].number_input("Batch size (per rank)", 1, 65536, 32, key=k + "batch_size")
    with top[3]:
        _slot(slots, "batch_size")

    left, mid, right = st.columns(3)
    with left:
        st.markdown("**Workload**")
        source = st.selectbox("Model from", ui.model_sources(), key=k + "model_source",
                              help="zoo: commlab's models; torchvision: a classifier by architecture; hf: a "
                                   "Hugging Face causal LM from its config; import path: package.module:factory "
                                   "(on PYTHONPATH). Weights are random: nothing is downloaded.")
        if source == "zoo":
            model = st.selectbox("Model", ch["models"], index=list(ch["models"]).index("cnn"), key=k + "model")
            options = {}
        else:
            example = {"torchvision:": "resnet18", "hf:": "gpt2", "import path": "mypkg.models:build"}[source]
            model = ui.model_name(source, st.text_input("Architecture" if source != "import path" else "Import path",
                                                        example, key=k + "model_path." + source))
            options, bad = ui.parse_options(st.text_area(
                "Model options (YAML)", "n_layer: 2\nn_embd: 128\nn_head: 4" if source == "hf:" else "",
                key=k + "model_options." + source, help="Keyword arguments of the builder or config overrides."))
            if bad:
                st.error(f"model.options: {bad}")
        _slot(slots, "model.name")
        datasets = ui.dataset_sources(model)
        dataset = st.selectbox("Data set", datasets, key=k + "dataset",
                               help="The data sets this model can train on, or package.module:loader returning "
                                    "(train, held-out).")
        _slot(slots, "dataset")
        d["model"] = {"name": model, "options": options}
        d["dataset"] = {"name": dataset}
        token_model = model.startswith("hf:") or model == "transformer"
        if dataset == "import path":
            d["dataset"]["name"] = st.text_input("Loader", "mypkg.data:load", key=k + "ds.path").strip()
        if dataset == "synthetic":
            d["dataset"]["size"] = st.number_input("Examples", 16, 10_000_000, 2048, key=k + "ds.size")
            if token_model:
                d["dataset"]["vocab"] = st.number_input("Vocabulary", 2, 1_000_000, 1000, key=k + "ds.vocab")
                d["dataset"]["block"] = st.number_input("Context length", 2, 4096, 64, key=k + "ds.block")
            else:
                d["dataset"]["classes"] = st.number_input("Classes", 2, 10000, 10, key=k + "ds.classes")
                shape = st.text_input("Image shape C, H, W", "3, 32, 32", key=k + "ds.shape")
                try:
                    dims = [int(v) for v in shape.replace(",", " ").split()]
                except ValueError:
                    dims = shape  # the spec's check names the field
                if dims != [3, 32, 32]:
                    d["dataset"]["shape"] = dims
        if dataset == "text":
            d["dataset"]["block"] = st.number_input("Context length", 2, 4096, 64, key=k + "ds.block")
        size_slot = st.empty()
        d["eval_every"] = st.number_input("Evaluate every N steps (0: only at the end)", 0, 1_000_000, 50,
                                          key=k + "eval_every")
        _slot(slots, "eval_every")
        st.markdown("**Optimizer**")
        opt = st.selectbox("Optimizer", ch["optimizers"], key=k + "opt")
        d["optimizer"] = {"name": opt, "lr": st.number_input("Learning rate", 0.0, 10.0, 0.05, format="%g",
                                                             step=0.01, key=k + "lr")}
        _slot(slots, "optimizer.lr")
        if opt == "sgd":
            d["optimizer"]["momentum"] = st.number_input("Momentum", 0.0, 0.999, 0.9, key=k + "momentum")
            _slot(slots, "optimizer.momentum")
        d["optimizer"]["weight_decay"] = st.number_input("Weight decay", 0.0, 1.0, 0.0, format="%g",
                                                         key=k + "wd")
        _slot(slots, "optimizer")

    with mid:
        st.markdown("**Communication**")
        mode = st.selectbox("Comm mode", ch["comm"], index=list(ch["comm"]).index("wfbp"), key=k + "comm",
                            help="sync: after backward; wfbp: each bucket as soon as it is ready, overlapped "
                                 "with backward; dear: reduce-scatter in backward, all-gather in the next forward")
        d["comm"] = {"mode": mode}
        if mode == "dear":
            how = st.radio("DeAR buffers", ("byte cap", "nearby layers", "online cap search"), horizontal=True,
                           key=k + "dear.how")
            if how == "byte cap":
                d["comm"]["cap_mb"] = st.number_input("Buffer cap (MB)", 0.001, 4096.0, 25.0, format="%g",
                                                      key=k + "dear.cap_mb")
            elif how == "nearby layers":
                d["comm"]["layers"] = st.number_input("Layers per buffer", 1, 10_000, 3, key=k + "dear.layers")
            else:
                d["comm"]["tune"] = True
                d["comm"]["tune_steps"] = st.number_input("Steps per trial cap", 2, 1000, 5,
                                                          key=k + "dear.tune_steps")
        _slot(slots, "comm")
        st.markdown("**Compression**")
        d["compressor"] = _compressor_fields(ch, mode, slots, k)
        if mode == "dear":
            st.caption("Fusion: dear sizes its own buffers (above); the schedule does not apply.")
        else:
            st.markdown("**Fusion**")
            sched = st.selectbox("Schedule", ch["schedules"], index=list(ch["schedules"]).index("bucket"),
                                 key=k + "schedule",
                                 help="mergecomp: split points searched by measured step time; layerfusion: "
                                      "merged from the profiled backward and fitted costs")
            d["schedule"] = {"name": sched}
            if sched == "bucket":
                d["schedule"]["cap_mb"] = st.number_input("Bucket cap (MB)", 0.001, 4096.0, 25.0, format="%g",
                                                          key=k + "cap_mb")
            elif sched == "mergecomp":
                d["schedule"]["max_candidates"] = st.number_input("Partitions to try at most", 1, 1000, 24,
                                                                  key=k + "mc.max_candidates")
                d["schedule"]["steps_per_candidate"] = st.number_input("Timed steps per partition", 1, 1000, 5,
                                                                       key=k + "mc.steps")
                d["schedule"]["retune"] = st.checkbox("Search again (ignore the cached partition)", False,
                                                      key=k + "mc.retune")
        _slot(slots, "schedule")

    with right:
        st.markdown("**Network**")
        link = st.selectbox("Link", ch["links"], key=k + "link",
                            help="loopback: as fast as the machine; modeled: alpha-beta delays in the "
                                 "communicator (no root); shaped: tc on an emulated cluster (needs root)")
        d["network"] = {"link": link}
        if link != "loopback":
            d["network"]["gbps"] = st.number_input("Bandwidth (Gbit/s)", 0.001, 400.0, 1.0, format="%g",
                                                   key=k + "gbps")
            _slot(slots, "network.gbps")
        if link == "modeled":
            lat = ui.parse_value(st.text_input("Latency (us, blank: default)", "", key=k + "latency"))
            if lat is not None:
                d["network"]["latency_us"] = lat
            _slot(slots, "network.latency_us")
        _slot(slots, "network.link")
        st.markdown("**Placement**")
        d["device"] = st.selectbox("Device", ch["devices"], key=k + "device",
                                   help=None if ch["cuda"] else "no CUDA device here: CPU only")
        d["backend"] = st.selectbox("Backend", ch["backends"], key=k + "backend")
        _slot(slots, "backend")
        with st.expander("More"):
            d["seed"] = st.number_input("Seed", 0, 2**31 - 1, 0, key=k + "seed")
            d["threads"] = st.number_input("Threads per rank (0: cores / world size)", 0, 1024, 0, key=k + "threads")
            d["timeline"] = st.checkbox("Record the timeline", True, key=k + "timeline")
        _slot(slots, "seed")

    with st.spinner("Checking the spec ..."):  # the model's size comes from a child process (lab.sandbox)
        spec, err, size = ui.form_check(d)
    if err is not None:
        where = ui.error_field(err.path, slots, err.msg)
        (slots[where] if where else st).error(err.msg if where else str(err), icon=":material/error:")
    if size is not None:
        tied = f" · tied: {', '.join(size['tied'])}" if size["tied"] else ""
        size_slot.caption(f"{size['params']:,} parameters in {size['tensors']} tensors · gradient "
                          f"{size['grad_bytes'] / 2**20:.2f} MB per step before compression{tied}")
    with st.expander("Spec (YAML): save it and run `commlab run spec.yaml` for the same job"):
        st.code(ui.spec_yaml(spec) if spec else "(fix the error first)", language="yaml")
    if st.button("Queue run", type="primary", disabled=spec is None, key=k + "submit", icon=":material/play_arrow:"):
        try:
            run = ui.submit(d)
        except (LabError, SpecError) as e:  # a shaped link that cannot be built; a first batch that does not fit
            path, _, msg = str(e).partition(": ")
            where = ui.error_field(path, slots, msg)
            (slots[where] if where else st).error(msg if where else str(e), icon=":material/error:")
            return
        open_run(run.id)


# --------------------------------------------------------------------------- compare

FILTERS = ("state", "model", "dataset", "compressor", "schedule", "comm", "link", "sweep")



def _compressor_fields(ch: dict, mode: str, slots: Dict[str, object], k: str) -> dict:
    """The compressor section: one from the registry, with inputs built from its declared parameters; or, for
    the teacher and the local user, a class by import path with its parameters in YAML (checked in a child
    process, which imports it: this one never does)."""
    sources = ui.compressor_sources()
    source = sources[0]
    if len(sources) > 1:
        source = st.selectbox("Compressor from", sources, key=k + "comp_source",
                              help="registry: the lab's compressors; import path: package.module:Class, a subclass "
                                   "of commlab.Compressor on PYTHONPATH (`commlab check compressor` checks it)")
    if source == ui.IMPORT_PATH:
        comp = st.text_input("Compressor class", "", key=k + "comp_path", placeholder="mypkg.codecs:ScaledSign").strip()
        _slot(slots, "compressor.name")
        params, bad = ui.parse_options(st.text_area("Compressor parameters (YAML)", "", key=k + "comp_params",
                                                    help="Keyword parameters the class declares (its params)."))
        if bad:
            st.error(f"compressor.params: {bad}")
        _slot(slots, "compressor.params")
        ef = st.checkbox("Error feedback", False, key=k + "comp_ef",
                         help="Add the residual before compressing and keep what was dropped.")
        _slot(slots, "compressor.error_feedback")
        return {"name": comp, "error_feedback": bool(ef), "params": params}
    offered = ui.compressors_for(mode)
    comp = st.selectbox("Compressor", offered, key=k + "compressor",
                        help=None if len(offered) == len(ch["compressors"]) else
                        f"{mode} reduce-scatters payloads, so it offers the single-round, summable compressors "
                        f"whose payload keeps the gradient's shape: {', '.join(offered)}")
    _slot(slots, "compressor.name")
    info = ui.compressor_info(comp)
    st.caption(("summable payloads: all-reduced" if info["summable"] else "payloads all-gathered, decoded per rank")
               + (f" · {info['rounds']} rounds" if info["rounds"] > 1 else "")
               + (" · keeps its own residual" if info["builtin_feedback"] else ""))
    params = {}
    for p in ui.compressor_params(comp):  # as the compressor declares them (engine.compressors.Param)
        key = f"{k}c.{comp}.{p.name}"
        tip = f"{p.help}; {p.allowed()}"
        if p.type is bool:
            params[p.name] = st.checkbox(p.name, p.default, key=key, help=p.help)
        elif p.default is None:
            v = ui.parse_value(st.text_input(f"{p.name} (blank: {p.unset})", "", key=key, help=tip))
            if v is not None:
                params[p.name] = v
        elif p.type is int:
            params[p.name] = st.number_input(p.name, value=p.default, step=1, key=key, help=tip)
        else:
            params[p.name] = st.number_input(p.name, value=float(p.default), format="%g", key=key, help=tip)
    _slot(slots, "compressor.params")
    no_ef = info["builtin_feedback"]
    ef = st.checkbox("Error feedback", False, key=k + "ef", disabled=no_ef,
                     help="Add the residual before compressing and keep what was dropped."
                          + (f" {comp} keeps its own residual." if no_ef else ""))
    _slot(slots, "compressor.error_feedback")
    return {"name": comp, "error_feedback": bool(ef and not no_ef), "params": params}


def table_columns() -> dict:
    """Readable number formats for a comparison table (lab.comparison.compare_runs)."""
    num = st.column_config.NumberColumn
    return {"iter_ms": num("iter ms", format="%.1f"), "throughput": num("samples/s", format="%.0f"),
            "scaling_factor": num("scaling", format="percent"), "bytes_per_step": num("bytes/step", format="bytes"),
            "compression_ratio": num("compression", format="%.1fx"), "final_acc": num("accuracy", format="percent"),
            "final_loss": num("loss", format="%.3f"), "time_to_target_s": num("to target (s)", format="%.1f"),
            "other_cpu": num("other CPU", format="percent",
                             help="share of the machine other processes used during the run"),
            "disturbed": st.column_config.CheckboxColumn("disturbed", help="other processes used more CPU than "
                                                         "the threshold: the run's timings are not results")}


def compare_view() -> None:
    rows = ui.index_rows()
    if not rows:
        st.info(f"No runs{where()} yet.")
        return
    cols = st.columns(len(FILTERS))
    filters = {}
    for c, f in zip(cols, FILTERS):
        values = sorted({str(r[f]) for r in rows if r.get(f) is not None})
        v = c.selectbox(f, ["any", *values], key=f"cmp.f.{f}")
        if v != "any":
            filters[f] = v
    runs = ui.list_runs(**filters)
    labels = timelines.short_labels(runs)
    ids = [r.id for r in runs]
    wanted = [i for i in st.session_state.get("compare_ids", []) if i in ids]
    default = wanted or [r.id for r in runs if r.state == "done"][-4:] or ids[-4:]
    chosen = st.multiselect("Runs", ids, default=default, format_func=lambda i: labels.get(i, i), key="cmp.runs")
    target = st.number_input("Target accuracy for time-to-target (0: none)", 0.0, 1.0, 0.0, step=0.05,
                             key="cmp.target")
    picked = [r for r in runs if r.id in chosen]
    if not picked:
        st.caption("Pick runs to compare.")
        return
    table = comparison.compare_runs(picked, target_acc=target or None)
    bad = [labels.get(i, i) for i in table.index[table["disturbed"] == True]] if len(table) else []  # noqa: E712
    if bad:
        st.warning(f"Disturbed (other processes used the CPU; timings are not results): {', '.join(bad)}",
                   icon=":material/warning:")
    st.dataframe(table, key="cmp.table", column_config=table_columns())
    st.download_button("Export CSV", access.download_data(lambda: table.to_csv().encode(), [r.id for r in picked]),
                       file_name="commlab-compare.csv", mime="text/csv",
                       on_click="ignore", key="cmp.csv", icon=":material/download:")
    report_button(picked, "commlab-compare.html", key="cmp.report")
    st.subheader("Accuracy against wall time")
    st.plotly_chart(plots.accuracy_vs_time_figure(timelines.accuracy_curves(picked, labels)), key="cmp.acc")
    st.subheader("Where the step time goes")
    st.plotly_chart(plots.breakdown_bars_figure(timelines.breakdown_table(picked, labels)), key="cmp.breakdown")
    st.subheader("Scaling factor")
    st.caption("Throughput at N ranks over N times the single-process throughput of the same model, data set "
               "and batch: include a world-size-1 run (sweeps add one by themselves).")
    st.plotly_chart(plots.scaling_figure(table), key="cmp.scaling")


# --------------------------------------------------------------------------- sweeps

def sweep_form() -> None:
    """Base spec fields and lists of values; validated as a whole before it can start."""
    ch = ui.choices()
    k = "sw."
    c = st.columns(4)
    name = c[0].text_input("Name", "my-sweep", key=k + "name")
    model = c[1].selectbox("Model", ch["models"], index=list(ch["models"]).index("cnn"), key=k + "model")
    dataset = c[2].selectbox("Data set", ui.datasets_for(model), key=k + "dataset")
    world = c[3].number_input("World size", 1, 64, 2, key=k + "world")
    c = st.columns(4)
    steps = c[0].number_input("Steps", 1, 1_000_000, 100, key=k + "steps")
    batch = c[1].number_input("Batch size", 1, 65536, 32, key=k + "batch")
    eval_every = c[2].number_input("Evaluate every", 0, 1_000_000, 25, key=k + "eval")
    link = c[3].selectbox("Link", ch["links"], key=k + "link")
    base = {"model": model, "dataset": dataset, "world_size": world, "steps": steps, "batch_size": batch,
            "eval_every": eval_every, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "network": {"link": link}}
    if link != "loopback":
        base["network"]["gbps"] = st.number_input("Bandwidth (Gbit/s)", 0.001, 400.0, 1.0, format="%g", key=k + "gbps")
    st.markdown("**Grid** (every combination runs)")
    c = st.columns(3)
    comps = c[0].multiselect("Compressors", ch["compressors"], default=["none", "fp16", "topk"], key=k + "comps")
    ef = c[0].checkbox("Error feedback on lossy compressors", True, key=k + "ef")
    scheds = c[1].multiselect("Schedules", ch["schedules"], default=["layerwise", "bucket"], key=k + "scheds")
    modes = c[2].multiselect("Comm modes", ch["comm"], default=["wfbp"], key=k + "modes")
    compressors = []
    for comp in comps:
        params = ui.compressor_params(comp)
        entry = {"name": comp}
        if params:
            text = st.text_input(f"{comp} parameters (YAML, blank: defaults)",
                                 ", ".join(f"{p.name}: {p.default}" for p in params if p.name == "ratio"
                                           and p.default is not None), key=f"{k}p.{comp}")
            extra = ui.parse_value("{" + text + "}") if text.strip() else {}
            if isinstance(extra, dict):
                entry.update(extra)
        info = ui.compressor_info(comp)
        if ef and not info["lossless"] and not info["builtin_feedback"]:
            entry["error_feedback"] = True
        compressors.append(entry)
    c = st.columns(2)
    target = c[0].number_input("Target accuracy (0: none)", 0.0, 1.0, 0.0, step=0.05, key=k + "target")
    baseline = c[1].checkbox("Add single-process runs (for the scaling factor)", True, key=k + "baseline")
    data = ui.sweep_data(name, base, {"compressor": compressors, "schedule.name": scheds, "comm.mode": modes},
                         target_acc=target or None, baseline=baseline)
    try:
        sw = ui.make_sweep(data)
    except SpecError as e:
        st.error(str(e), icon=":material/error:")
        return
    st.caption(f"{len(sw.cells)} runs (sweep id {sw.id}); they go through the queue, a few at a time.")
    if st.button("Start sweep", type="primary", key=k + "start", icon=":material/play_arrow:"):
        try:
            st.session_state["sweep_id"] = ui.start_sweep(data)
        except LabError as e:
            st.error(str(e))
            return
        st.rerun()


def sweep_view() -> None:
    ids = ui.list_sweeps()
    if not ids:
        st.caption("No sweeps yet.")
        return
    want = st.session_state.get("sweep_id")
    sid = st.selectbox("Sweep", ids, index=ids.index(want) if want in ids else 0, key="sw.pick")
    try:
        sw = ui.load_sweep(sid)
    except (SpecError, OSError, ValueError) as e:
        st.error(f"cannot read sweep {sid}: {e}")
        return
    live = ui.sweep_status(sw)["running"]

    @st.fragment(run_every=ui.REFRESH_S if live else None)
    def status():
        s = ui.sweep_status(sw)
        if live and not s["running"]:
            st.rerun()
        st.progress(s["finished"] / s["total"] if s["total"] else 0.0,
                    text=f"{s['finished']}/{s['total']} runs finished · "
                         + ", ".join(f"{n} {state}" for state, n in sorted(s["states"].items()))
                         + (" · sweep process running" if s["running"] else ""))
        table = ui.sweep_table(sw)
        if table.empty:
            st.caption("No run of this sweep has started yet.")
            return
        st.dataframe(table, key="sw.table", column_config=table_columns())
        st.download_button("Export CSV", access.download_data(lambda: table.to_csv().encode(), []),
                           file_name=f"{sw.id}.csv", mime="text/csv",
                           on_click="ignore", key="sw.csv", icon=":material/download:")
        cells = table[~table["baseline"]] if table["baseline"].any() and not table["baseline"].all() else table
        axes = [a for a in ("compressor", "schedule", "comm", "world_size", "link") if cells[a].nunique() > 1] \
            or ["compressor"]
        c = st.columns(3)
        y = c[0].selectbox("Rows", axes, key="sw.y")
        x = c[1].selectbox("Columns", [a for a in axes if a != y] or ["schedule"], key="sw.x")
        value = c[2].selectbox("Value", ["iter_ms", "throughput", "final_acc", "scaling_factor", "bytes_per_step",
                                         *(["time_to_target_s"] if "time_to_target_s" in cells else [])],
                               key="sw.value")
        baseline = "none" if y == "compressor" and "none" in set(cells["compressor"]) else None
        st.plotly_chart(plots.sweep_heatmap(cells, x=x, y=y, value=value, baseline=baseline,
                                            higher_is_better=value in ("throughput", "final_acc", "scaling_factor")),
                        key="sw.heatmap")
        st.page_link(RESULTS_PAGE, label="This sweep's results: the verdict, timelines side by side",
                     query_params={"sweep": sw.id}, icon=":material/fact_check:")
        with st.expander("log"):
            st.code(ui.sweep_log(sw) or "(empty)")

    status()
