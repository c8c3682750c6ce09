"""The New run page's form: every spec field, with choices that follow each other (commlab.lab.front.new_run offers
them for the viewer), each error under its field, the model's size once the spec is valid, and Queue run.
"""
from __future__ import annotations

from typing import Dict

import streamlit as st

from commlab.app.widgets import open_run
from commlab.engine.cluster import PRESETS
from commlab.engine.spec import MAX_NAME, SpecError
from commlab.lab.base.errors import LabError
from commlab.lab.base.specs import MAX_TYPED
from commlab.lab.front import new_run, ui


def _slot(slots: Dict[str, object], path: str) -> None:
    slots[path] = st.empty()


def run_form() -> None:
    """Every spec field, with choices that follow each other; errors under their field."""
    ch = new_run.choices()
    slots: Dict[str, object] = {}
    k = "nr."
    d: dict = {}
    top = st.columns([2, 1, 1, 1])
    d["name"] = top[0].text_input("Name", "my-run", key=k + "name", max_chars=MAX_NAME)
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
        source = st.selectbox("Model from", new_run.model_sources(), key=k + "model_source",
                              help="zoo: commlab's models; torchvision: a classifier by architecture; hf: a "
                                   "Hugging Face causal LM from its config; import path: package.module:factory "
                                   "(on PYTHONPATH). Weights are random: nothing is downloaded.")
        if source == "zoo":
            model = st.selectbox("Model", ch["models"], index=list(ch["models"]).index("cnn"), key=k + "model")
            options = {}
        else:
            example = {"torchvision:": "resnet18", "hf:": "gpt2", "import path": "mypkg.models:build"}[source]
            label = "Architecture" if source != "import path" else "Import path"
            typed = st.text_input(label, example, key=k + "model_path." + source, max_chars=MAX_TYPED)
            model = new_run.model_name(source, typed)
            options, bad = new_run.parse_options(st.text_area(
                "Model options (YAML)", "n_layer: 2\nn_embd: 128\nn_head: 4" if source == "hf:" else "",
                key=k + "model_options." + source, max_chars=MAX_TYPED,
                help="Keyword arguments of the builder or config overrides."))
            if bad:
                st.error(f"model.options: {ui.text(bad)}")
        _slot(slots, "model.name")
        datasets = new_run.dataset_sources(model)
        dataset = st.selectbox("Data set", datasets, key=k + "dataset",
                               help="The data sets this model can train on, or package.module:loader returning "
                                    "(train, held-out).")
        _slot(slots, "dataset")
        d["model"] = {"name": model, "options": options}
        d["dataset"] = {"name": dataset}
        token_model = model.startswith("hf:") or model == "transformer"
        if dataset == "import path":
            d["dataset"]["name"] = st.text_input("Loader", "mypkg.data:load", key=k + "ds.path",
                                                 max_chars=MAX_TYPED).strip()
        if dataset == "synthetic":
            d["dataset"]["size"] = st.number_input("Examples", 16, 10_000_000, 2048, key=k + "ds.size")
            if token_model:
                d["dataset"]["vocab"] = st.number_input("Vocabulary", 2, 1_000_000, 1000, key=k + "ds.vocab")
                d["dataset"]["block"] = st.number_input("Context length", 2, 4096, 64, key=k + "ds.block")
            else:
                d["dataset"]["classes"] = st.number_input("Classes", 2, 10000, 10, key=k + "ds.classes")
                shape = st.text_input("Image shape C, H, W", "3, 32, 32", key=k + "ds.shape", max_chars=MAX_TYPED)
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
        d["optimizer"]["decay"] = st.selectbox("Learning-rate decay", ch["decays"], key=k + "decay",
                                               help="cosine: the rate falls to 0 at the last step")
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
            if how == "byte cap":  # dear's buffers are capped by the schedule's byte cap
                d["schedule"] = {"name": "bucket",
                                 "cap_mb": st.number_input("Buffer cap (MB)", 0.001, 4096.0, 25.0, format="%g",
                                                           key=k + "dear.cap_mb")}
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
        preset = None
        if link == "modeled":
            one = "one link for every worker"
            preset = st.selectbox("Cluster", [one, *PRESETS], key=k + "cluster",
                                  help="a cluster of unequal workers: each its own rates, delay, jitter and speed "
                                       "(the docs' wide-area clusters); or one link shared by every worker")
            preset = None if preset == one else preset
            if preset is not None:
                d["network"]["cluster"] = preset
            _slot(slots, "network.cluster")
        if link != "loopback" and preset is None:
            d["network"]["gbps"] = st.number_input("Bandwidth (Gbit/s)", 0.001, 400.0, 1.0, format="%g",
                                                   key=k + "gbps")
            _slot(slots, "network.gbps")
        if link == "modeled" and preset is None:
            lat = new_run.parse_value(st.text_input("Latency (us, blank: default)", "", key=k + "latency",
                                                    max_chars=MAX_TYPED))
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

    with st.spinner("Checking the spec ..."):  # the model's size comes from a child process (commlab.lab.base.sandbox)
        spec, err, size = new_run.form_check(d)
    if err is not None:
        where = new_run.error_field(err.path, slots, err.msg)
        (slots[where] if where else st).error(ui.text(err.msg if where else err), icon=":material/error:")
    if size is not None:
        size_slot.caption(f"{size['params']:,} parameters in {size['tensors']:d} tensors · gradient "
                          f"{size['grad_bytes'] / 2**20:.2f} MB per step before compression"
                          + (f" · tied: {ui.text(', '.join(size['tied']))}" if size["tied"] else ""))
    with st.expander("Spec (YAML): save it and run `commlab run spec.yaml` for the same job"):
        st.code(new_run.spec_yaml(spec) if spec else "(fix the error first)", language="yaml")
    if st.button("Queue run", type="primary", disabled=spec is None, key=k + "submit", icon=":material/play_arrow:"):
        try:
            run = new_run.submit(d)
        except (LabError, SpecError) as e:  # a shaped link that cannot be built; a first batch that does not fit
            path, _, msg = str(e).partition(": ")
            where = new_run.error_field(path, slots, msg)
            (slots[where] if where else st).error(ui.text(msg if where else e), icon=":material/error:")
            return
        open_run(run.id)


def _compressor_fields(ch: dict, mode: str, slots: Dict[str, object], k: str) -> dict:
    """The compressor section: one from the registry, with inputs built from its declared parameters; or, for
    the teacher and the local user, a class by import path with its parameters in YAML (checked in a child
    process, which imports it: this one never does)."""
    sources = new_run.compressor_sources()
    source = sources[0]
    if len(sources) > 1:
        source = st.selectbox("Compressor from", sources, key=k + "comp_source",
                              help="registry: the lab's compressors; import path: package.module:Class, a subclass "
                                   "of commlab.Compressor on PYTHONPATH (`commlab check compressor` checks it)")
    if source == new_run.IMPORT_PATH:
        comp = st.text_input("Compressor class", "", key=k + "comp_path", placeholder="mypkg.codecs:ScaledSign",
                             max_chars=MAX_TYPED).strip()
        _slot(slots, "compressor.name")
        params, bad = new_run.parse_options(st.text_area("Compressor parameters (YAML)", "", key=k + "comp_params",
                                                         max_chars=MAX_TYPED,
                                                         help="Keyword parameters the class declares (its params)."))
        if bad:
            st.error(f"compressor.params: {ui.text(bad)}")
        _slot(slots, "compressor.params")
        ef = st.checkbox("Error feedback", False, key=k + "comp_ef",
                         help="Add the residual before compressing and keep what was dropped.")
        _slot(slots, "compressor.error_feedback")
        return {"name": comp, "error_feedback": bool(ef), "params": params}
    offered = new_run.compressors_for(mode)
    comp = st.selectbox("Compressor", offered, key=k + "compressor",
                        help=None if len(offered) == len(ch["compressors"]) else
                        f"{ui.text(mode)} reduce-scatters payloads, so it offers the single-round, summable "
                        f"compressors whose payload keeps the gradient's shape: {ui.text(', '.join(offered))}")
    _slot(slots, "compressor.name")
    info = new_run.compressor_info(comp)
    st.caption(("summable payloads: all-reduced" if info["summable"] else "payloads all-gathered, decoded per rank")
               + (f" · {info['rounds']:d} rounds" if info["rounds"] > 1 else "")
               + (" · keeps its own residual" if info["builtin_feedback"] else ""))
    params = {}
    for p in new_run.compressor_params(comp):  # as the compressor declares them (commlab.engine.compressors.params.Param)
        key = f"{k}c.{comp}.{p.name}"
        tip = ui.text(f"{p.help}; {p.allowed()}")
        if p.type is bool:
            params[p.name] = st.checkbox(ui.text(p.name), p.default, key=key, help=ui.text(p.help))
        elif p.default is None:
            v = new_run.parse_value(st.text_input(ui.text(f"{p.name} (blank: {p.unset})"), "", key=key, help=tip,
                                                  max_chars=MAX_TYPED))
            if v is not None:
                params[p.name] = v
        elif p.type is int:
            params[p.name] = st.number_input(ui.text(p.name), value=p.default, step=1, key=key, help=tip)
        else:
            params[p.name] = st.number_input(ui.text(p.name), value=float(p.default), format="%g", key=key,
                                             help=tip)
    _slot(slots, "compressor.params")
    no_ef = info["builtin_feedback"]
    ef = st.checkbox("Error feedback", False, key=k + "ef", disabled=no_ef,
                     help="Add the residual before compressing and keep what was dropped."
                          + (f" {ui.text(comp)} keeps its own residual." if no_ef else ""))
    _slot(slots, "compressor.error_feedback")
    return {"name": comp, "error_feedback": bool(ef and not no_ef), "params": params}
