"""The Streamlit app through AppTest: every page renders over a runs directory with one
finished run; the New run form queues a run that finishes; presets, sweeps and
`commlab app` (commlab.lab.front.appserver.app_main) start what they say."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

import commlab  # noqa: E402
from commlab.engine.runlog import JsonlTail  # noqa: E402
from commlab.engine.timeline import ends_step  # noqa: E402
from commlab.lab.front import appserver, groups, new_run, sweep_jobs  # noqa: E402
from commlab.lab.strategy.perfmodel import calibrate as cal  # noqa: E402
from commlab.lab.strategy.perfmodel import views  # noqa: E402
from commlab.lab.analysis import plots, timelines
from distutil import counted  # noqa: E402
from commlab.lab.analysis.presets import PRESETS  # noqa: E402
from commlab.lab.base.kept import Kept  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENTRY = str(ROOT / "commlab" / "app" / "streamlit_app.py")
SMALL = {"model": "mlp", "dataset": "digits", "steps": 5, "batch_size": 16, "eval_every": 0, "threads": 1}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    old = os.environ.get("COMMLAB_RUNS")
    os.environ["COMMLAB_RUNS"] = str(root)
    run = commlab.run(SMALL, runs=root)
    assert run.state == "done", run.log_tail()
    yield root
    for r in commlab.runs(runs=root):  # nothing the tests started may outlive them
        if r.state in ("queued", "running"):
            commlab.cancel(r.id, runs=root)
            commlab.wait(r.id, runs=root, timeout=60)
    if old is None:
        os.environ.pop("COMMLAB_RUNS", None)
    else:
        os.environ["COMMLAB_RUNS"] = old


def page(name: str) -> AppTest:
    at = AppTest.from_file(ENTRY, default_timeout=120).run()
    if name != "home":
        at.switch_page(f"views/{name}.py").run()
    return at


def labels(elements):
    return [e.label for e in elements]


def check_home(at, runs):
    assert [t.value for t in at.title] == ["commlab"]
    starts = [b for b in at.button if b.label == "Start"]
    assert len(starts) == len(PRESETS)
    disabled = {b.key for b in starts if b.disabled}
    assert not disabled  # every preset's specs validate (a preset whose spec is refused is shown disabled)
    for key in ("layerwise-vs-mergecomp", "dear-vs-ddp", "compression-links", "countsketch-vs-topk"):
        assert f"preset-{key}" in {b.key for b in starts}


def check_new_run(at, runs):
    assert "Queue run" in labels(at.button) and not at.button(key="nr.submit").disabled
    assert {"Model", "Data set", "Compressor", "Schedule", "Comm mode", "Link"} <= set(labels(at.selectbox))
    assert not at.error


def check_live_run(at, runs):
    (run,) = commlab.runs(runs=runs, state="done")[:1]
    assert at.selectbox(key="live.pick").value == run.id
    assert len(at.get("plotly_chart")) == 5  # timeline, breakdown, the explanation's critical path, curves, bytes
    assert any("trace" in b.label for b in at.get("download_button"))
    assert any("step 5/5" in (p.proto.text or "") for p in at.get("progress"))


def check_compare(at, runs):
    assert at.multiselect(key="cmp.runs").value
    assert len(at.dataframe) == 2  # the comparison; the one run's collectives, explained
    assert len(at.get("plotly_chart")) == 4  # accuracy vs time, breakdown bars, scaling factor, the critical path
    assert any(b.label == "Export CSV" for b in at.get("download_button"))


def check_sweeps(at, runs):
    assert "Start sweep" in labels(at.button)
    assert at.multiselect(key="sw.comps").value == ["none", "fp16", "topk"]


def check_model(at, runs):
    (run,) = commlab.runs(runs=runs, state="done")[:1]
    assert at.selectbox(key="pm.run").value == run.id
    assert len(at.get("plotly_chart")) == 2  # speedup heatmaps, predicted vs measured
    sources, crossover, scatter = (d.value for d in at.dataframe[:3])
    # what the predictions rest on: compute measured (the run), the link assumed (nominal), every compressor's
    # cost measured here, each with the validation error of that part of the model
    assert list(sources["part"]) == ["compute", "link"] + [f"compressor {cal.compressor_key(c)}" for c in
                                                            views.COMPRESSORS.values()]
    assert list(sources["kind"]) == ["measured", "assumed"] + ["measured"] * len(views.COMPRESSORS)
    assert run.id in sources["source"][0] and sources["source"][1].startswith("nominal alpha-beta")
    assert sources["validated"][0].startswith("end to end (bench/perfmodel.py")
    assert sources["validated"][1].startswith("not validated")
    assert list(crossover["compressor"]) == list(views.COMPRESSORS)
    assert run.id in set(scatter["run"]) and scatter["predicted_ms"].notna().all(), scatter.to_dict("records")
    before = [c.value for c in at.caption if c.value.startswith("At the")]
    at.select_slider(key="pm.gbps").set_value(0.1).run()
    at.select_slider(key="pm.speed").set_value(20.0).run()
    assert not at.exception, [e.value for e in at.exception]
    after = [c.value for c in at.caption if c.value.startswith("At the")]
    assert before != after  # the sliders change the prediction
    at.number_input(key="pm.alpha").set_value(500.0).run()
    link = at.dataframe[0].value.iloc[1]
    assert link["kind"] == "assumed" and link["source"].startswith("alpha 500 µs per ring step as typed here")
    assert any(b.key == "pm.props" for b in at.button)


def check_results(at, runs):
    assert [t.value for t in at.title] == ["Results"]
    assert [i.value for i in at.info][:1] == ["No preset has been started yet: start one on the Home page."]


def check_advisor(at, runs):
    assert at.selectbox(key="adv.spec").options  # examples, presets and the finished run
    assert any(o.startswith("preset: ") for o in at.selectbox(key="adv.spec").options)
    assert at.button(key="adv.go")
    assert not at.error


CHECKS = {"home": check_home, "new_run": check_new_run, "results": check_results, "live_run": check_live_run,
          "compare": check_compare, "sweeps": check_sweeps, "model": check_model, "advisor": check_advisor}


@pytest.mark.parametrize("name", list(CHECKS))
def test_page_renders(runs, name):
    at = page(name)
    assert not at.exception, [e.value for e in at.exception]
    CHECKS[name](at, runs)


def test_the_live_pages_of_one_run_draw_its_timeline_and_explain_it_once(runs, monkeypatch):
    """Pages that show the same run in the same state share its timeline figure and explanation (a model of many
    tensors: seconds each): a second page, and a rerun, draw and explain nothing; another zoom draws anew."""
    from commlab.app import live_view
    from commlab.lab.analysis import explain
    made = {"figure": 0, "explain": 0}
    monkeypatch.setattr(live_view.plots, "timeline_figure", counted(made, "figure", plots.timeline_figure))
    monkeypatch.setattr(explain, "explain_frame", counted(made, "explain", explain.explain_frame))
    monkeypatch.setattr(timelines, "_CACHE", Kept(timelines.CACHED))
    first = page("live_run")
    assert not first.exception and made == {"figure": 1, "explain": 1}, made
    first.run()
    second = page("live_run")
    assert not second.exception and made == {"figure": 1, "explain": 1}, made
    second.number_input(key="live.last").set_value(2).run()
    assert not second.exception and made == {"figure": 2, "explain": 1}, made


def test_each_runs_calibration_is_kept_and_the_model_page_predicts_the_newest_runs(runs, monkeypatch):
    """Predicted against measured calibrates each finished run from its timeline (seconds for a long run): once
    per state of its files in a process, and for the newest runs only."""
    monkeypatch.setattr(views, "_calibrations", Kept(views.CALIBRATED))
    made = []
    real = cal.from_run
    monkeypatch.setattr(cal, "from_run", lambda run, *a, **k: made.append(run.id) or real(run, *a, **k))
    first = views.predicted_vs_measured(runs)
    done = [r.id for r in commlab.runs(runs=runs, state="done")]
    assert sorted(made) == sorted(done) and list(first["run"]) == done
    again = views.predicted_vs_measured(runs)
    assert sorted(made) == sorted(done) and again.equals(first)  # nothing calibrated again
    assert list(views.predicted_vs_measured(runs, only=done[-1:])["run"]) == done[-1:]  # what the page asks for
    from commlab.lab.base import sandbox  # no place for a child now: raised, never a table of notes a page keeps

    def busy(*a, **k):
        raise sandbox.Busy("prediction", "all 2 of the server's places are taken; try again in a moment")
    monkeypatch.setattr(views.pr, "without_driving", busy)
    with pytest.raises(sandbox.Busy):
        views.predicted_vs_measured(runs)


def test_model_page_predicts_a_profile_on_a_cluster(tmp_path, monkeypatch):
    """A profile file and a cluster shape: the predicted table and scaling plot, also with no run in the
    index; a shape the workers do not fill and a missing file are one-line errors."""
    from tests.test_perfmodel import tiny_profile
    from commlab.lab.strategy.perfmodel import whatif
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path / "empty"))
    spec = whatif.load_for_prediction(data={"model": "mlp", "batch_size": 16, "compressor": "fp16"})
    tiny_profile(spec=spec, machine={"cpu": "test cpu", "device": "cpu", "torch": "2.13"}).save(tmp_path / "p.json")
    at = page("model")
    assert not at.exception and any("No finished run" in i.value for i in at.info)
    charts = len(at.get("plotly_chart"))
    at.text_input(key="pm.prof.path").set_value(str(tmp_path / "p.json")).run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any("measured on test cpu" in c.value for c in at.caption)
    df = at.dataframe[-1].value
    assert list(df["workers"]) == [8, 8, 16, 16, 64, 64, 256, 256, 1024, 1024]
    assert list(df["inter_gbps"]) == [10.0, 100.0] * 5 and (df["ddp_scaling"] <= 1).all()
    assert df["ddp_ms"].iloc[-2] > df["ddp_ms"].iloc[-1]  # 1024 workers: 10 Gbit/s between nodes is slower than 100
    assert len(at.get("plotly_chart")) == charts + 1
    sources = at.dataframe[-2].value  # above the table: what it rests on
    assert list(sources["kind"]) == ["measured", "assumed", "measured"]
    assert sources["source"][1].startswith("nominal alpha-beta two-level cluster from --cluster")
    at.number_input(key="pm.cl.node").set_value(3).run()
    assert any("workers: 8 does not fill whole nodes of 3" in e.value for e in at.error)
    at.number_input(key="pm.cl.node").set_value(16).run()
    assert not at.error and at.dataframe[-1].value["ddp_ms"].iloc[2] < df["ddp_ms"].iloc[2]  # 16: one fast node
    at.text_input(key="pm.prof.path").set_value(str(tmp_path / "none.json")).run()
    assert [e.value for e in at.error] == [f"profile: no such file: {tmp_path / 'none.json'}"]


def test_live_page_follows_the_url_and_the_picker(tmp_path, monkeypatch):
    from commlab.lab.service.queue import Lab
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    q = Lab(tmp_path)
    a, b = (q.create(commlab.spec(dict(SMALL, name=n))) for n in ("first", "second"))  # queued; nothing runs
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.query_params["run"] = a.id
    at.run().switch_page("views/live_run.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="live.pick").value == a.id and at.session_state["run_id"] == a.id
    at.selectbox(key="live.pick").set_value(b.id).run()
    assert at.session_state["run_id"] == b.id and at.query_params["run"] == b.id
    assert at.button(key="live.cancel")  # not final: it can be cancelled
    at.button(key="live.redraw").click().run()  # not final: the charts wait for ui.CHARTS_REFRESH_S or this
    assert not at.exception, [e.value for e in at.exception]
    at.button(key="live.cancel").click().run()
    assert not at.exception and q.store.get(b.id).state == "cancelled"
    at.run()
    assert [w.key for w in at.button] == []  # final: drawn once, nothing to cancel or redraw


def test_an_own_loop_is_shown_with_its_model_and_the_steps_it_took(tmp_path, monkeypatch):
    """An own loop (commlab.wrap) ran its script's model for as many steps as its script chose: the live page,
    the report and ``show`` say those, not its spec's defaults (mlp on digits, 100 steps)."""
    from commlab.lab.analysis import report
    from commlab.lab.front import run_cli
    from commlab.lab.service.queue import Lab
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    run = Lab(tmp_path).create(commlab.spec(dict(SMALL, name="mine", steps=100)))
    run.set_status("running", own_loop={"script": "train.py", "model": "Net", "params": 1234,
                                        "optimizer": "SGD", "world_size": 1, "host": "h"})
    with open(run.file("metrics.jsonl"), "a") as f:
        for k in range(7):
            f.write(json.dumps({"kind": "step", "rank": 0, "step": k, "time_ms": 5.0, "loss": 1.0, "bytes_sent": 8,
                                "bytes_raw": 8, "t": time.time()}) + "\n")
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.query_params["run"] = run.id
    at.run().switch_page("views/live_run.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(c.value.replace("\\", "").startswith("own loop (Net, 1,234 parameters), 2 ranks") for c in at.caption)
    assert at.get("progress")[0].proto.text == "step 7 (own loop: its script decides how many)"
    assert [m.label for m in at.metric][1] == "accuracy (its script's evaluation)"
    run.set_status("done")
    at.run()
    assert at.get("progress")[0].proto.text == "step 7/7"
    section = report.run_section(commlab.get(run.id, runs=tmp_path), 0)
    assert "own loop (Net, 1,234 parameters)" in section and "; 7 steps</p>" in section and "mlp" not in section
    assert run_cli.setup_line(run.spec_dict(), run.status()).startswith("setup          own loop (Net, 1,234 par")


def test_new_run_form_shows_errors_next_to_the_field(runs):
    at = page("new_run")
    at.number_input(key="nr.lr").set_value(0.0).run()
    assert not at.exception
    assert [e.value for e in at.error] == ["must be in (0, 10], got 0.0"]
    assert at.button(key="nr.submit").disabled
    at.number_input(key="nr.lr").set_value(0.05)
    at.selectbox(key="nr.compressor").set_value("topk").run()
    at.number_input(key="nr.c.topk.ratio").set_value(2.0).run()
    assert [e.value for e in at.error] == ["ratio: must be in (0, 1], got 2.0"]
    # the dependent choices: a transformer only offers token data (text, synthetic tokens, a loader)
    at.number_input(key="nr.c.topk.ratio").set_value(0.01)
    at.selectbox(key="nr.model").set_value("transformer").run()
    assert at.selectbox(key="nr.dataset").options == ["text", "synthetic", "import path"]
    assert not at.error


def test_new_run_form_takes_a_cluster_of_unequal_workers(runs):
    """A modeled link offers the cluster presets; a preset replaces the one rate and latency, and a preset of
    three regions on two ranks is refused next to the cluster's field until there are three."""
    at = page("new_run")
    at.selectbox(key="nr.link").set_value("modeled").run()
    assert at.number_input(key="nr.gbps") and not at.error
    at.selectbox(key="nr.cluster").set_value("three_continents").run()
    assert not at.exception
    assert "nr.gbps" not in [w.key for w in at.number_input]
    assert [e.value for e in at.error] == ["preset three_continents has 3 regions for world_size 2; set world_size "
                                           "3 or more, or give workers"]
    assert at.button(key="nr.submit").disabled
    at.number_input(key="nr.world_size").set_value(3).run()
    assert not at.error and not at.button(key="nr.submit").disabled


def test_submit_through_the_form_runs_to_done(runs):
    at = page("new_run")
    at.text_input(key="nr.name").set_value("from-the-form")
    at.selectbox(key="nr.model").set_value("mlp").run()
    for key, v in (("nr.steps", 5), ("nr.batch_size", 16), ("nr.eval_every", 0), ("nr.threads", 1)):
        at.number_input(key=key).set_value(v)
    at.button(key="nr.submit").click().run()
    assert not at.exception, [e.value for e in at.exception]
    run_id = at.session_state["run_id"]
    assert [t.value for t in at.title] == ["Live run"]  # switched to the run's live page
    assert commlab.wait(run_id, runs=runs, timeout=240) == "done", commlab.get(run_id, runs=runs).log_tail()
    done = {r.id: r for r in commlab.runs(runs=runs, state="done")}
    assert run_id in done and done[run_id].spec_dict()["name"] == "from-the-form"


@pytest.mark.parametrize("key", [p.key for p in PRESETS])
def test_preset_queues_its_runs_and_opens_its_results(runs, key):
    """Every preset's Start button queues its runs as one group and leads to that group's results view,
    which shows the paper's claim and how many runs have finished (the runs are cancelled at once)."""
    preset = next(p for p in PRESETS if p.key == key)
    at = page("home")
    at.button(key=f"preset-{key}").click().run()
    assert not at.exception, [e.value for e in at.exception]
    gid = at.session_state["group_id"]
    group = groups.preset_group(gid, runs)
    ids = list(group["runs"].values())
    try:
        assert group["preset"] == key and list(group["runs"]) == list(preset.variants)
        names = [commlab.get(i, runs=runs).spec_dict()["name"] for i in ids]
        assert names == [f"{key}: {label}" for label in preset.variants]
        assert [t.value for t in at.title] == ["Results"]
        assert at.query_params["group"] == gid
        assert any(preset.claim in m.value for m in at.markdown)
        assert any("runs finished" in i.value for i in at.info)
    finally:
        for i in ids:
            commlab.cancel(i, runs=runs)
        for i in ids:
            assert commlab.wait(i, runs=runs, timeout=120) in ("cancelled", "done")


def test_results_view_gives_a_verdict_from_the_runs(runs):
    """A finished group (two real runs labelled as the DeAR preset's variants) gets a verdict computed
    from their own medians; a ratio under the preset's bound is reported as missed, with the why."""
    from commlab.lab.analysis import results
    from commlab.lab.rundir.summary import summarize
    a = commlab.run(dict(SMALL, name="res-a"), runs=runs)
    b = commlab.run(dict(SMALL, name="res-b", compressor={"name": "fp16"}), runs=runs)
    gid = results.save_group(runs, "dear-vs-ddp", {"dear": a.id, "ddp": b.id})
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.query_params["group"] = gid
    at.run().switch_page("views/results.py").run()
    assert not at.exception, [e.value for e in at.exception]
    ratio = summarize(b.metric_rows(), b.spec_dict())["iter_ms_median"] / \
        summarize(a.metric_rows(), a.spec_dict())["iter_ms_median"]
    text = "\n".join(m.value for m in at.markdown)
    assert f"DeAR over DDP-style wfbp, per iteration: {ratio:.2f}x" in text
    assert ("met" if ratio >= 1.2 else "missed") in text
    assert "the whole experiment took" in text
    assert len(at.get("plotly_chart")) == 4  # timelines on one axis, breakdown bars, accuracy vs wall time, the
    # critical path of one variant explained against another


def test_sweep_starts_in_the_background_and_shows_a_heatmap(runs):
    at = page("sweeps")
    at.text_input(key="sw.name").set_value("tiny")
    at.selectbox(key="sw.model").set_value("mlp").run()
    at.number_input(key="sw.steps").set_value(4)
    at.number_input(key="sw.eval").set_value(0)
    at.multiselect(key="sw.comps").set_value(["none", "fp16"])
    at.multiselect(key="sw.scheds").set_value(["bucket"])
    at.checkbox(key="sw.baseline").uncheck().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    at.button(key="sw.start").click().run()
    sid = at.session_state["sweep_id"]
    assert (Path(runs) / "sweeps" / sid / "grid.yaml").is_file()
    sw = sweep_jobs.load_sweep(sid, runs)
    t0 = time.time()
    while time.time() - t0 < 300:
        s = sweep_jobs.sweep_status(sw)
        if s["finished"] == s["total"] and not s["running"]:
            break
        time.sleep(1)
    assert s["states"] == {"done": 2}, (s, sweep_jobs.sweep_log(sw))
    at = page("sweeps")
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="sw.pick").value == sid
    assert len(at.get("plotly_chart")) == 1


def test_tail_timeline_is_the_end_of_the_full_timeline(runs):
    run = commlab.runs(runs=runs, state="done")[0]
    full = run.timeline()
    tail = timelines.tail_timeline(run, 2)
    assert len(tail) <= len(full) and set(tail["lane"]) <= set(full["lane"])
    assert tail["start_us"].max() == full["start_us"].max()
    small = JsonlTail.last(run.timeline_files()[0], 1, ends_step, chunk=2048).read(final=True)
    assert sum(e["tid"] == 0 for e in small) >= 2  # it reads further back until it has the steps


def test_error_field_mapping():
    fields = ["name", "model.name", "dataset", "optimizer.lr", "optimizer", "compressor.name", "compressor.params",
              "compressor.error_feedback", "schedule", "network.gbps"]
    assert new_run.error_field("optimizer.lr", fields) == "optimizer.lr"
    assert new_run.error_field("optimizer.betas", fields) == "optimizer"
    assert new_run.error_field("dataset.size", fields) == "dataset"
    assert new_run.error_field("model", fields) == "model.name"
    assert new_run.error_field("compressor", fields, "ratio: must be in (0, 1]") == "compressor.params"
    assert new_run.error_field("compressor", fields, "error_feedback: dgc keeps its own") == "compressor.error_feedback"
    assert new_run.error_field("threads", fields) is None


def test_app_argv():
    argv = appserver.app_argv(8600)
    assert argv[:4] == [sys.executable, "-m", "streamlit", "run"] and argv[4].endswith("commlab/app/server.py")  # the gatekeeper's
    assert argv[argv.index("--server.maxUploadSize") + 1] == str(appserver.UPLOAD_MB)
    assert "--server.sslCertFile" not in argv and "--client.showErrorDetails" not in argv  # loopback: all of it
    exposed = appserver.app_argv(8600, host="0.0.0.0")
    assert exposed[exposed.index("--client.showErrorDetails") + 1] == "type"  # no traceback for a viewer
    assert exposed[exposed.index("--server.enableAgentApi") + 1] == "false"  # no page driven over plain HTTP
    assert exposed[exposed.index("--server.maxMessageSize") + 1] == str(appserver.MESSAGE_MB)
    assert "--server.maxMessageSize" not in argv  # loopback: Streamlit's own
    tls = appserver.app_argv(8600, certfile="c.pem", keyfile="k.pem")
    assert tls[tls.index("--server.sslCertFile") + 1] == "c.pem" and tls[tls.index("--server.sslKeyFile") + 1] == "k.pem"
    assert argv[argv.index("--server.address") + 1] == "127.0.0.1"
    assert argv[argv.index("--server.port") + 1] == "8600"
    assert argv[argv.index("--server.headless") + 1] == "true"
    assert appserver.app_argv(1, host="0.0.0.0")[argv.index("--server.address") + 1] == "0.0.0.0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list:
    """The process's children, whichever of its threads started them."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return sorted(out)


def alive_pid(pid: int) -> bool:
    """Running (a zombie left for its parent to reap counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_health(url: str, p, log_path, limit_s: float = 90) -> None:
    t0 = time.time()
    while True:
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                assert r.read() == b"ok"
                return
        except OSError:
            assert p.poll() is None, log_path.read_text()
            assert time.time() - t0 < limit_s, "the UI did not come up"
            time.sleep(0.5)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_app_stops_cleanly_on_a_signal(tmp_path, sig):
    """`commlab app` stopped by SIGINT (started with it ignored, as a shell starts a background job),
    SIGTERM or SIGHUP: its server and the background sweep it started end, the port is free and it says
    so, and a run's supervisor it started keeps going."""
    from commlab.lab.service.spawn import ENV, spawn_detached
    port = free_port()
    code = f"import sys; from commlab.lab.front.appserver import app_main; sys.exit(app_main({port}, {str(tmp_path)!r}, demo=False))"
    # output to a file, not a pipe: an unread pipe that fills up blocks the server and the app on exit
    log_path = tmp_path / "app.log"
    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), start_new_session=True,
                             stdout=log, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    run_pid = None
    try:
        wait_health(f"http://127.0.0.1:{port}", p, log_path)
        (server,) = children(p.pid)  # the Streamlit server
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{server}/environ").read_text().split("\0") if "=" in kv)
        sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
        # as the server's page would: a sweep and a run's supervisor, started by the app's process
        os.environ[ENV] = env[ENV]
        try:
            sweep_pid = spawn_detached(sleeper, tmp_path / "sweep.log", kind="sweep")
            run_pid = spawn_detached(sleeper, tmp_path / "run.log", kind="run")
        finally:
            del os.environ[ENV]
        assert set(children(p.pid)) == {server, sweep_pid, run_pid}
        p.send_signal(sig)
        assert p.wait(timeout=60) == 0, log_path.read_text()
        assert not alive_pid(server) and not alive_pid(sweep_pid)
        assert alive_pid(run_pid)  # runs keep their own supervisors
        with socket.socket() as s:  # the port is free (SO_REUSEADDR: past TIME_WAIT, never past a listener)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
        out = log_path.read_text()
        assert f"127.0.0.1:{port}" in out
        name = signal.Signals(sig).name
        assert f"commlab UI stopped on {name}: server (pid {server}) ended, 1 background sweep(s) stopped, " \
               f"port {port} free" in out, out
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if run_pid and alive_pid(run_pid):
            os.kill(run_pid, signal.SIGKILL)


def test_new_run_form_follows_the_comm_mode(runs):
    at = page("new_run")
    assert len(at.selectbox(key="nr.compressor").options) > 10
    at.selectbox(key="nr.compressor").set_value("topk").run()
    at.selectbox(key="nr.comm").set_value("dear").run()
    assert not at.exception, [e.value for e in at.exception]
    # dear offers only the compressors it accepts (single-round, summable, shape kept, or a shard codec:
    # read from each compressor's declared capabilities), with error feedback if wanted, and sizes its
    # own buffers
    assert at.selectbox(key="nr.compressor").options == ["none", "fp16", "bf16", "int8"]
    at.selectbox(key="nr.compressor").set_value("fp16").run()
    assert not at.checkbox(key="nr.ef").disabled
    at.checkbox(key="nr.ef").check()
    assert "Schedule" not in labels(at.selectbox)
    at.radio(key="nr.dear.how").set_value("online cap search").run()
    assert not at.error and not at.button(key="nr.submit").disabled
    at.selectbox(key="nr.comm").set_value("wfbp").run()
    at.selectbox(key="nr.schedule").set_value("mergecomp").run()
    assert at.checkbox(key="nr.mc.retune") and not at.error
    # the inputs come from the declaration: types, and a blank box for a parameter with no default
    at.selectbox(key="nr.compressor").set_value("countsketch").run()
    assert at.number_input(key="nr.c.countsketch.rows").value == 5
    assert at.checkbox(key="nr.c.countsketch.exact").value is False
    assert at.text_input(key="nr.c.countsketch.cols").label == "cols (blank: 4 k, at most n / rows)"
    at.selectbox(key="nr.compressor").set_value("dgc").run()
    assert at.checkbox(key="nr.ef").disabled  # dgc keeps its own residual
    assert not at.error


def test_advisor_page_advises_shows_the_ranking_and_starts_the_winner(runs):
    """Advise (predictions only, a real detached `commlab advise`), the ranked table, then the winner and
    DDP queued as one group shown in the results view (cancelled at once)."""
    from commlab.lab.front import advice_jobs
    at = page("advisor")
    label = next(k for k in advice_jobs.spec_choices(runs) if k.startswith("run: "))  # the newest finished run
    at.selectbox(key="adv.spec").set_value(label)
    at.select_slider(key="adv.gbps").set_value(0.1)
    at.checkbox(key="adv.measure").uncheck().run()
    at.button(key="adv.go").click().run()
    assert not at.exception, [e.value for e in at.exception]
    jid = at.session_state["adv.job"]
    t0 = time.time()
    while advice_jobs.job(jid, runs)["state"] == "running" and time.time() - t0 < 240:
        time.sleep(1)
    j = advice_jobs.job(jid, runs)
    assert j["state"] == "done", j["log"]
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    table = at.dataframe[0].value
    assert len(table) == len(j["advice"]["candidates"]) > 10
    assert table.iloc[0]["candidate"] == j["advice"]["winner"]
    assert table["measured_ms"].isna().all()  # no trials asked for
    assert (table["evidence"] != "").all() and "to_target_s" in table.columns  # what each penalty rests on
    # the winner line is a warning when a run the advice rests on was disturbed by other processes
    shown = at.warning if j["advice"]["disturbed"] else at.success
    assert any(j["advice"]["winner"] in s.value for s in shown)
    at.button(key="adv.start").click().run()
    assert not at.exception, [e.value for e in at.exception]
    group = advice_jobs.job_group(jid, runs)
    try:
        assert list(group["runs"]) == ["advisor's choice", "DDP"]
        chosen = commlab.get(group["runs"]["advisor's choice"], runs=runs).spec_dict()
        ddp = commlab.get(group["runs"]["DDP"], runs=runs).spec_dict()
        assert chosen["network"] == ddp["network"] == {"link": "modeled", "gbps": 0.1, "latency_us": None,
                                                       "cluster": None}
        assert ddp["compressor"]["name"] == "none" and ddp["comm"]["mode"] == "wfbp"
        assert any("runs finished" in i.value for i in at.info)  # the results view of the group
    finally:
        for i in group["runs"].values():
            commlab.cancel(i, runs=runs)
        for i in group["runs"].values():
            assert commlab.wait(i, runs=runs, timeout=120) in ("cancelled", "done")


def test_advisor_page_plans_for_a_cluster_of_unequal_workers(runs, tmp_path):
    """Choosing a cluster preset disables the one link's rate and kind; the job asks `commlab advise` for the
    cluster (its preset, and the preset's regions as the workers when the spec has fewer ranks), never a rate."""
    from commlab.engine.spec import SpecError
    from commlab.lab.front import advice_jobs
    at = page("advisor")
    assert not at.select_slider(key="adv.gbps").disabled
    at.selectbox(key="adv.cluster").set_value("three_continents").run()
    assert not at.exception and at.select_slider(key="adv.gbps").disabled and at.radio(key="adv.link").disabled
    spec = {"world_size": 2}
    assert advice_jobs.cluster_workers(spec, "three_continents") == 3
    assert advice_jobs.cluster_workers(spec, "datacenter") is None
    argv = advice_jobs.advise_argv(tmp_path / "s.json", tmp_path, 1.0, "modeled", False, 3, tmp_path, None,
                                   "three_continents", 3)
    assert argv[argv.index("--cluster") + 1] == "three_continents" and argv[argv.index("--workers") + 1] == "3"
    assert "--gbps" not in argv and "--link" not in argv
    plain = advice_jobs.advise_argv(tmp_path / "s.json", tmp_path, 0.1, "modeled", False, 3, tmp_path)
    assert "--cluster" not in plain and plain[plain.index("--gbps") + 1] == "0.1"
    with pytest.raises(SpecError, match="cluster: unknown cluster preset 'mars'"):
        advice_jobs.start_job({"name": "x", "world_size": 2}, runs, 1.0, "modeled", False, cluster="mars")
