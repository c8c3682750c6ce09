"""The advisor (commlab/lab/strategy/advisor.py): which communication strategy for this model on this link?"""
import pandas as pd
import streamlit as st

from commlab.app import widgets

from commlab.app.room import access
from commlab.app.results_view import results_panel
from commlab.engine.cluster import PRESETS
from commlab.lab.front import advice_jobs, ui
from commlab.lab.strategy import advisor, predictions

widgets.setup("Advisor")
st.title("Advisor")
st.caption("Ranks what the engine can do (compressors, bucket caps, MergeComp, wfbp, dear, the methods that "
           "communicate less often) by predicted time to accuracy: the performance model's iteration time on the "
           "link times a convergence penalty (how many more steps than DDP). A candidate whose penalty has no "
           "evidence for this model (the evidence column) never outranks one that has. With trials, DDP and the "
           "top candidates train to the target accuracy on that link, one run each, and the time to it decides.")

runs = ui.runs_dir()
choices = advice_jobs.spec_choices(runs)
if not choices:
    st.info("No spec to advise on: no example specs, presets or finished runs were found.")
    st.stop()
label = st.selectbox("Spec (its compressor, schedule and comm are what gets chosen)", list(choices), key="adv.spec")
ONE_LINK = "one link for every worker"
cluster = st.selectbox("Cluster", [ONE_LINK, *PRESETS], key="adv.cluster",
                       help="a cluster of unequal workers on modeled links (each worker its own rates, delay, jitter "
                            "and speed; the docs' wide-area clusters), or one link shared by every worker")
cluster = None if cluster == ONE_LINK else cluster
c1, c2, c3, c4, c5 = st.columns(5)
link = c1.radio("Link", list(predictions.LINKS), key="adv.link", horizontal=True, disabled=cluster is not None,
                help="modeled: alpha-beta delays on loopback (no root); shaped: tc on an emulated cluster (root)")
gbps = c2.select_slider("Bandwidth (Gbit/s)", [0.1, 0.3, 1.0, 3.0, 10.0], value=1.0, key="adv.gbps",
                        disabled=cluster is not None)
measure = c3.checkbox("Train the top candidates to the target", value=True, key="adv.measure")
trials = c4.number_input("Trials", 1, 10, advisor.TRIALS, key="adv.trials", disabled=not measure)
target = c5.number_input("Target accuracy (0: 97% of DDP's best)", 0.0, 1.0, 0.0, 0.01, key="adv.target")
if st.button("Advise", key="adv.go", type="primary"):
    try:
        st.session_state["adv.job"] = advice_jobs.start_job(choices[label], runs, gbps, link, measure, int(trials),
                                                            float(target) or None, cluster)
    except (ValueError, OSError) as e:
        st.error(ui.text(str(e).splitlines()[0]))

known = advice_jobs.jobs(runs)
if not known:
    st.info("No advice yet: pick a spec and a link, then Advise.")
    st.stop()
current = st.session_state.get("adv.job") if st.session_state.get("adv.job") in known else known[0]
jid = st.selectbox("Advice", known, index=known.index(current), key="adv.pick")
first = advice_jobs.job(jid, runs)


@access.fragment(run_every=2 if first["state"] == "running" else None)
def progress():
    j = advice_jobs.job(jid, runs)
    if j["state"] != first["state"]:
        st.rerun()
    if j["state"] == "running":
        lines = [line for line in j["log"].splitlines() if line.strip()]
        st.info("Advising ... " + (ui.text(lines[-1]) if lines else "starting"), icon=":material/hourglass_top:")
    elif j["state"] == "failed":
        st.error(f"The advisor failed: {ui.text(j['error'])}")


progress()
if first["state"] != "done":
    st.stop()

adv = first["advice"]
req = first["request"]
net = adv["network"]
where = predictions.network_words(net) + ("" if net.get("cluster") else " link")
st.subheader(ui.text(f"{len(adv['candidates'])} candidates on a {where}, {adv['world']:d} workers"))
if adv.get("disturbed"):  # timings taken while other processes took the CPU: not results
    st.warning(f"Winner ({ui.text(adv['chosen_by'])}): {ui.text(adv['reason'])}", icon=":material/warning:")
else:
    st.success(f"Winner ({ui.text(adv['chosen_by'])}): {ui.text(adv['reason'])}", icon=":material/emoji_events:")
if adv.get("ddp_not_tried"):
    st.caption(ui.text(adv["ddp_not_tried"]))
rows = pd.DataFrame(advice_jobs.table_rows(adv)).set_index("rank")
cols = {k: st.column_config.NumberColumn(k.replace("_", " "), format="%.1f")
        for k in ("predicted_ms", "predicted_x_penalty", "measured_ms", "measured_x_penalty", "to_target_s")}
st.dataframe(rows, key="adv.table", column_config=cols)
cost = adv["cost_s"]
st.caption(f"Link: {ui.text(adv['link_source'])}. Profile: {ui.text(adv['profile_source'])}. The advisor's own cost: "
           f"{cost['total']:.1f} s (profile and cost curves {cost['profile']:.1f} s, predictions "
           f"{cost['predict']:.1f} s, trials {cost['trials']:.1f} s).")
with st.expander("The winner as a spec"):
    st.code(open(first["best"]).read(), language="yaml")

group = advice_jobs.job_group(jid, runs)
if group is None:
    if st.button("Start the winner (and DDP beside it)", key="adv.start"):
        group = advice_jobs.start_winner(jid, runs)
        st.rerun()
else:
    st.subheader("The winner against DDP, measured")
    results_panel(group)
