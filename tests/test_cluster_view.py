"""Who waits on whom in a cluster run (commlab.lab.analysis.cluster_view): hand-computed waits, hops and the slowest
rank on made-up step lines; then a real run with a slow worker, as `commlab show` and the Live run page tell it."""
import json
import os
from pathlib import Path

import pytest

import commlab
from commlab.engine.spec import JobSpec
from commlab.lab.analysis import cluster_view as cv
from commlab.lab.analysis import plots

BASE = {"model": "mlp", "dataset": "digits", "steps": 10, "batch_size": 8, "eval_every": 0, "threads": 1}
WORKERS = [{"gbps_up": 1, "gbps_down": 1, "delay_ms": 10},
           {"gbps_up": 0.5, "gbps_down": 2, "delay_ms": 20},
           {"gbps_up": 2, "gbps_down": 0.25, "delay_ms": 5, "speed": 0.5}]


def spec_doc(world, **net) -> dict:
    """A spec as spec.json holds it."""
    return json.loads(json.dumps(JobSpec.from_dict({**BASE, "world_size": world, "network": net}).to_dict()))


def line(step, rank, fwd, bwd, finish, **extra):
    return {"kind": "step", "step": step, "rank": rank, "loss": 1.0, "time_ms": fwd + bwd + finish + 1.0,
            "forward_ms": fwd, "backward_ms": bwd, "finish_ms": finish, "optimizer_ms": 1.0,
            "bytes_sent": 3_000_000, "bytes_raw": 3_000_000, "t": 0.0, **extra}


# -- made-up records ------------------------------------------------------------------------------------

def made_up_rows():
    """Six steps of three ranks (rank 2 computes 30 ms, the others 10), an eval line and a step only rank 0 logged.
    Steps 0-1 are warm-up (warmup_steps(6) = 2): their figures must not count."""
    rows = []
    # (finish of rank 0, rank 1, rank 2) per step; warm-up steps far off
    finish = {0: (500, 500, 900), 1: (400, 300, 100), 2: (25, 27, 5), 3: (24, 28, 4), 4: (26, 26, 6),
              5: (90, 60, 40)}
    for s in range(6):
        for r in range(3):
            fwd, bwd = (10.0, 20.0) if r == 2 else (4.0, 6.0)
            rows.append(line(s, r, fwd, bwd, float(finish[s][r]), **({"speed": 0.5, "slow_ms": 15.0} if r == 2
                                                                     else {})))
    rows.append({"kind": "eval", "step": 6, "eval_loss": 1.0, "eval_acc": 0.5})
    rows.append(line(6, 0, 100.0, 100.0, 1000.0))  # a step not every rank has logged yet: left out
    return rows


def test_made_up_records_waits_hops_and_the_slowest_by_hand():
    doc = spec_doc(3, link="modeled", cluster={"workers": WORKERS})
    v = cv.cluster_view(doc, made_up_rows())
    assert v["world"] == 3 and v["preset"] is None and v["steps"] == 4  # steps 2-5
    ws = v["workers"]
    assert [w["label"] for w in ws] == ["custom"] * 3
    assert [w["speed"] for w in ws] == [1.0, 1.0, 0.5] and ws[1]["gbps_up"] == 0.5 and ws[2]["delay_ms"] == 5.0
    assert [w["compute_ms"] for w in ws] == [10.0, 10.0, 30.0]
    # exchange: the median of steps 2-5; wait: each step's exchange minus that step's shortest
    assert ws[0]["exchange_ms"] == pytest.approx(25.5)  # 25, 24, 26, 90
    assert ws[1]["exchange_ms"] == pytest.approx(27.5)  # 27, 28, 26, 60
    assert ws[2]["exchange_ms"] == pytest.approx(5.5)   # 5, 4, 6, 40
    assert ws[0]["wait_ms"] == pytest.approx(20.0)      # 20, 20, 20, 50
    assert ws[1]["wait_ms"] == pytest.approx(21.0)      # 22, 24, 20, 20
    assert ws[2]["wait_ms"] == 0.0
    assert v["slowest"] == 2 and v["waiting"] == [0, 1]
    # the hops for one all-reduce of 3 MB over 3 ranks: chunks of 1 MB
    assert v["bytes"] == 3_000_000
    want = [(0, 1, 1.0, 30.0, 8.0 + 30.0),    # min(up 1, down 2) = 1 Gbit/s: 8 ms, and 10 + 20 ms
            (1, 2, 0.25, 25.0, 32.0 + 25.0),  # min(up 0.5, down 0.25) = 0.25: 32 ms, and 20 + 5
            (2, 0, 1.0, 15.0, 8.0 + 15.0)]    # min(up 2, down 1) = 1: 8 ms, and 5 + 10
    got = [(h["src"], h["dst"], h["gbps"], h["delay_ms"], h["ms"]) for h in v["hops"]]
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert [g[4] for g in got] == pytest.approx([w[4] for w in want])
    assert v["slowest_hop"] == 1 and v["allreduce_ms"] == pytest.approx(4 * 57.0)  # 2 (p - 1) ring steps
    assert cv.describe(v) == ("rank 2 is the slowest (speed 0.5, 30.0 ms of compute per step); ranks 0, 1 waited "
                              "20.0-21.0 ms per step on it (median); slowest hop 1 -> 2 (0.25 Gbit/s, 25 ms, 57.0 ms "
                              "a ring step)")
    t = cv.table(v)
    assert [r["waits on"] for r in t] == ["rank 2", "rank 2", "(the slowest)"]
    assert t[1]["wait ms/step"] == 21.0 and t[2]["compute ms/step"] == 30.0 and t[0]["where"] == "custom"
    json.dumps(v)  # what show --json prints


def test_a_methods_sync_counts_as_exchange_and_nobody_is_slowest_among_equals():
    doc = spec_doc(2, link="modeled", cluster={"workers": WORKERS[:2]})
    rows = [line(s, r, 4.0, 6.0, 2.0, sync_ms=30.0 if r == 0 else 10.0) for s in range(5) for r in range(2)]
    v = cv.cluster_view(doc, rows)
    assert [w["exchange_ms"] for w in v["workers"]] == [32.0, 12.0]
    assert [w["wait_ms"] for w in v["workers"]] == [20.0, 0.0]
    assert v["slowest"] is None and v["waiting"] == []  # the same compute: nobody is waited on
    assert cv.describe(v).startswith("no rank is much slower than the others")
    assert all(r["waits on"] is None for r in cv.table(v))


def test_a_run_still_going_and_runs_without_a_cluster():
    doc = spec_doc(3, link="modeled", cluster="three_continents")
    v = cv.cluster_view(doc, [line(0, 0, 1.0, 1.0, 1.0), line(0, 1, 1.0, 1.0, 1.0)])  # rank 2 not there yet
    assert v["steps"] == 0 and v["slowest"] is None
    assert all(w[k] is None for w in v["workers"] for k in ("compute_ms", "exchange_ms", "wait_ms"))
    assert [w["label"] for w in v["workers"]] == ["three_continents 0", "three_continents 1", "three_continents 2"]
    assert cv.describe(v).startswith("no step logged by every rank yet; slowest hop 2 -> 0 (0.1 Gbit/s, 85 ms")
    assert cv.cluster_view(doc, [])["bytes"] == 0.0  # no bytes yet: the hops are their delays
    assert len(plots.cluster_figure(v).data) == 2  # the hops' labels, the workers
    # four ranks in three regions, in blocks; a preset of one kind of worker; speeds only on loopback
    four = cv.cluster_view(spec_doc(4, link="modeled", cluster="three_continents"), [])
    assert [w["label"] for w in four["workers"]] == ["three_continents 0", "three_continents 0",
                                                     "three_continents 1", "three_continents 2"]
    home = cv.cluster_view(spec_doc(4, link="modeled", cluster="home_broadband"), [])
    assert [w["label"] for w in home["workers"]] == ["home_broadband"] * 4
    assert len(home["hops"]) == 4 and home["slowest_hop"] is None  # every hop alike
    lo = cv.cluster_view(spec_doc(2, link="loopback", cluster={"workers": [{"speed": 1}, {"speed": 0.5}]}), [])
    assert lo["hops"] == [] and lo["slowest_hop"] is None and lo["allreduce_ms"] is None
    assert len(plots.cluster_figure(lo).data) == 1  # the workers, no hops
    # no cluster
    plain = spec_doc(2, link="modeled", gbps=1.0)
    assert cv.cluster_view(plain, made_up_rows()) is None and cv.describe(None) == ""
    assert cv.cluster_view(spec_doc(2, link="loopback"), []) is None


def test_the_figure_draws_the_ring_and_marks_the_slowest():
    v = cv.cluster_view(spec_doc(3, link="modeled", cluster={"workers": WORKERS}), made_up_rows())
    fig = plots.cluster_figure(v)
    hops, nodes = fig.data
    assert list(hops.text) == ["1 Gbit/s<br>30 ms", "0.25 Gbit/s<br>25 ms", "1 Gbit/s<br>15 ms"]
    assert list(hops.textfont.color) == ["#555", plots.SLOW_COLOR, "#555"]
    assert [t.split("<br>") for t in nodes.text] == [["rank 0", "custom", "speed 1"], ["rank 1", "custom", "speed 1"],
                                                     ["rank 2", "custom", "speed 0.5"]]
    assert list(nodes.marker.color) == ["#4C78A8", "#4C78A8", plots.SLOW_COLOR]
    arrows = [a for a in fig.layout.annotations if a.showarrow]
    assert len(arrows) == 3 and [a.arrowcolor for a in arrows] == ["#888", plots.SLOW_COLOR, "#888"]
    assert plots.cluster_figure(None).layout.annotations[0].text == "no cluster"


# -- a real run: rank 1 computes at a quarter of the speed -------------------------------------------

@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    net = {"link": "modeled", "cluster": {"workers": [{"gbps_up": 10, "gbps_down": 10},
                                                      {"gbps_up": 10, "gbps_down": 5, "speed": 0.25}]}}
    run = commlab.run({**BASE, "name": "quarter", "world_size": 2, "comm": {"mode": "sync"}, "network": net},
                      runs=root)
    assert run.state == "done", run.status()
    return root, run


def test_a_real_run_names_the_slow_worker(slow_run):
    _, run = slow_run
    v = cv.cluster_view(run.spec_dict(), run.metric_rows())
    assert v["steps"] == 8  # 10 steps, 2 of warm-up
    assert v["slowest"] == 1 and v["waiting"] == [0]
    w0, w1 = v["workers"]
    assert w1["compute_ms"] > w0["compute_ms"] and w1["speed"] == 0.25
    assert w0["wait_ms"] > w1["wait_ms"]  # rank 0 waits in its exchange while rank 1 computes
    assert [(h["src"], h["dst"], h["gbps"]) for h in v["hops"]] == [(0, 1, 5.0), (1, 0, 10.0)]
    assert v["slowest_hop"] == 0  # into rank 1's 5 Gbit/s down-link
    assert v["bytes"] > 0


def test_commlab_show_tells_who_waited_on_whom(slow_run, capsys):
    from commlab.lab.front import cli
    root, run = slow_run
    assert cli.main(["show", run.id, "--runs", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    (waits,) = [x for x in out if x.startswith("waits ")]
    assert "rank 1 is the slowest (speed 0.25" in waits and "rank 0 waited" in waits
    assert "slowest hop 0 -> 1 (5 Gbit/s, 0 ms" in waits
    (net,) = [x for x in out if x.startswith("network ")]
    assert "cluster of 2 workers" in net
    # the summary `commlab run` prints at the end
    from types import SimpleNamespace

    from commlab.lab.front import run_cli
    assert run_cli.report(run, "done", SimpleNamespace(json=False)) == 0
    assert any(x.startswith("waits          rank 1 is the slowest") for x in capsys.readouterr().out.splitlines())
    assert cli.main(["show", run.id, "--runs", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"]["slowest"] == 1 and doc["cluster"]["waiting"] == [0]
    assert [w["rank"] for w in doc["cluster"]["workers"]] == [0, 1]


def _live_page(root, run_id):
    from streamlit.testing.v1 import AppTest
    old = os.environ.get("COMMLAB_RUNS")
    os.environ["COMMLAB_RUNS"] = str(root)
    try:
        at = AppTest.from_file(str(Path(commlab.__file__).parent / "app" / "streamlit_app.py"), default_timeout=120)
        at.query_params["run"] = run_id
        return at.run().switch_page("views/live_run.py").run()
    finally:
        if old is None:
            os.environ.pop("COMMLAB_RUNS", None)
        else:
            os.environ["COMMLAB_RUNS"] = old


def test_the_live_page_draws_the_cluster_and_only_for_a_cluster_run(slow_run, tmp_path):
    pytest.importorskip("streamlit")
    from commlab.lab.service.queue import Lab
    root, run = slow_run
    at = _live_page(root, run.id)
    assert not at.exception, [e.value for e in at.exception]
    assert "Cluster: who waits on whom" in [h.value for h in at.subheader]
    charts = at.get("plotly_chart")
    assert len(charts) == 6  # the ring, then the five every run has
    ring = json.loads(charts[0].proto.spec)
    assert any("rank 1<br>custom<br>speed 0.25" in (t or "") for d in ring["data"] for t in d.get("text") or [])
    (table,) = [d.value for d in at.dataframe if "waits on" in d.value.columns]
    assert list(table["rank"]) == [0, 1] and list(table["waits on"]) == ["rank 1", "(the slowest)"]
    assert any("rank 1 is the slowest" in c.value for c in at.caption)
    # a run without a cluster: nothing of it
    plain = Lab(tmp_path).create(commlab.spec({**BASE, "name": "plain", "world_size": 2,
                                               "network": {"link": "modeled", "gbps": 1.0}}))
    at = _live_page(tmp_path, plain.id)
    assert not at.exception, [e.value for e in at.exception]
    assert "Cluster: who waits on whom" not in [h.value for h in at.subheader]
    assert not any("waits on" in d.value.columns for d in at.dataframe)
    assert all("speed" not in json.dumps(json.loads(c.proto.spec)["data"]) for c in at.get("plotly_chart"))
