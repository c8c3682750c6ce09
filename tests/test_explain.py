"""A run explains itself (commlab/lab/analysis/explain.py, ``commlab explain``): hand-built timelines with known
critical paths, skews and overlaps; on real two-rank runs, the parts add up to the step, and a slowdown put in
on purpose (one rank slower, one codec slower, a slower link) is named in the first sentence."""
import json
import os
import sys
import textwrap

import pandas as pd
import pytest

from commlab.lab.analysis import explain
from commlab.lab.analysis.explain import GROUPS, explain_frame
from test_kineto import ddp  # noqa: F401  (the fixture: a profiled two-rank DDP job)

MS = 1000.0  # the frames hold µs


def span(rank, lane, name, t0, t1, **args):
    return {"rank": rank, "lane": lane, "name": name, "start_us": t0 * MS, "dur_us": (t1 - t0) * MS, **args}


def sync_step(rank, step, t, comm_at=35.0, codec=(5.0, 2.0), compute=1.0, nbytes=1e6, comm_ms=23.0):
    """One step of a sync run, times in ms from ``t``: forward, backward, encode, wait for the collective
    (which starts at ``comm_at`` on this rank and takes ``comm_ms``), decode, optimizer."""
    fw, bw = 10 * compute, 20 * compute
    enc, dec = codec
    c0 = t + fw + bw + enc
    a = t + comm_at if comm_at is not None else c0
    a = max(a, c0)
    we = a + comm_ms
    opt0 = we + dec
    end = opt0 + 8 * compute
    return [
        span(rank, "forward", "forward", t, t + fw, step=step),
        span(rank, "backward", "backward", t + fw, t + fw + bw, step=step),
        span(rank, "compress", "compress b0", t + fw + bw, c0, bucket=0),
        span(rank, "comm", "allreduce b0", a, we, bucket=0, op="allreduce", bytes=nbytes),
        span(rank, "wait", "wait b0", c0, we, bucket=0),
        span(rank, "decompress", "decompress b0", we, we + dec, bucket=0),
        span(rank, "optimizer", "optimizer", opt0, end, step=step),
        span(rank, "step", f"step {step}", t, end + 2, step=step),
    ]


def frame(rows):
    return pd.DataFrame(rows)


SPEC = {"world_size": 2, "network": {"link": "modeled", "gbps": 1.0, "latency_us": 100.0}}


def test_a_sync_step_has_the_path_it_was_built_with():
    # rank 0 ready for the collective at 35 ms, rank 1 at 40 ms: rank 0 waits 5 ms for its peer
    rows = sync_step(0, 0, 0.0, comm_at=35.0, comm_ms=28.0) + sync_step(1, 0, 0.0, comm_at=40.0, comm_ms=23.0,
                                                                        codec=(10.0, 2.0))
    ex = explain_frame(frame(rows), SPEC, skip_warmup=False)
    r0 = [p for p in _paths(rows) if p.rank == 0][0]
    # rank 0: forward 10 + backward 20 + optimizer 8 = 38 compute; encode 5; decode 2; the collective 28 ms on the
    # path (35..63), 5 of it skew; the last 2 ms of the step are a gap
    assert r0.parts["compute"] == pytest.approx(38 * MS)
    assert (r0.parts["encode"], r0.parts["decode"]) == (pytest.approx(5 * MS), pytest.approx(2 * MS))
    assert r0.parts["skew"] == pytest.approx(5 * MS)
    # 1 MB all-reduce on two ranks over 1 Gbit/s: 1e6 * 2 * (1/2) * 8 / 1e9 s = 8 ms on the wire; 2 rounds x 100 µs
    assert r0.parts["wire"] == pytest.approx(8 * MS) and r0.parts["latency"] == pytest.approx(0.2 * MS)
    assert r0.parts["comm_rest"] == pytest.approx((28 - 5 - 8 - 0.2) * MS)
    assert r0.parts["other"] == pytest.approx(2 * MS)
    assert sum(r0.parts.values()) == pytest.approx(r0.dur_us)
    c = ex.collectives[0]
    assert c["skew_ms"] == pytest.approx(2.5)  # rank 0 waited 5 ms, rank 1 none: the mean over ranks
    assert c["wire_ms"] == pytest.approx(8.0) and c["latency_ms"] == pytest.approx(0.2)
    assert sum(ex.path_ms.values()) == pytest.approx(ex.step_ms)


def _paths(rows):
    """Each (rank, step)'s StepPath, as explain_frame builds them."""
    df = frame(rows)
    out = []
    for r in sorted(df["rank"].unique()):
        mine = df[df["rank"] == r]
        w = mine[mine["lane"] == "step"].iloc[0]
        comms, train = [], []
        for s in mine[mine["lane"] != "step"].sort_values("start_us").itertuples():
            if s.lane == "comm":
                comms.append(explain.Collective(r, 0, len(comms), s.name, s.op, s.start_us, s.dur_us, s.bytes))
            else:
                train.append((s.start_us, s.start_us + s.dur_us, explain.RANK.get(s.lane, 1), s.lane, s.name, None))
        # skew as explain_frame finds it, from the other rank's start
        starts = {q: df[(df["rank"] == q) & (df["lane"] == "comm")]["start_us"].min() for q in df["rank"].unique()}
        for c in comms:
            c.skew_us = max(starts.values()) - c.start_us
            c.wire_us = c.bytes * 1.0 * 8 / 1e3 if c.bytes else None
            c.latency_us = 200.0
        out.append(explain.step_path(train, comms, int(r), 0, w.start_us, w.start_us + w.dur_us))
    return out


def test_overlapped_communication_is_off_the_path():
    """wfbp: the collective runs during backward; only its tail past the backward is waited for."""
    rows = []
    for r in (0, 1):
        rows += [span(r, "forward", "forward", 0, 10, step=0), span(r, "backward", "backward", 10, 40, step=0),
                 span(r, "compress", "compress b0", 20, 22, bucket=0),
                 span(r, "comm", "allreduce b0", 22, 44, bucket=0, op="allreduce", bytes=1e5),
                 span(r, "wait", "wait b0", 40, 44, bucket=0),
                 span(r, "optimizer", "optimizer", 44, 50, step=0), span(r, "step", "step 0", 0, 50, step=0)]
    ex = explain_frame(frame(rows), {"world_size": 2}, skip_warmup=False)
    assert ex.path_ms["compute"] == pytest.approx(10 + 30 - 2 + 6)  # the encode inside backward is the codec's
    assert ex.path_ms["encode"] == pytest.approx(2)
    assert sum(ex.path_ms[g] for g in explain.COMM_GROUPS) == pytest.approx(4)  # only the tail
    assert ex.hidden_comm_ms == pytest.approx(18)  # 22..40 ran behind backward
    assert ex.path_ms["wire"] == 0 and ex.link["gbps"] is None  # loopback: no rate to split by
    assert any("not known (loopback)" in s for s in ex.sentences)


def test_a_collective_queued_ahead_is_on_the_path():
    """Waiting for bucket 1 while the communication thread still sends bucket 0: bucket 0's tail is on the path."""
    rows = []
    for r in (0, 1):
        rows += [span(r, "backward", "backward", 0, 20, step=0),
                 span(r, "comm", "allreduce b0", 10, 30, bucket=0, op="allreduce", bytes=1e5),
                 span(r, "comm", "allreduce b1", 30, 35, bucket=1, op="allreduce", bytes=1e4),
                 span(r, "wait", "wait b1", 20, 35, bucket=1), span(r, "step", "step 0", 0, 36, step=0)]
    ex = explain_frame(frame(rows), {"world_size": 2}, skip_warmup=False)
    on = {c["name"]: c["on_path_ms"] for c in ex.collectives}
    assert on == {"allreduce b0": pytest.approx(10), "allreduce b1": pytest.approx(5)}
    names = [w["label"] for w in ex.waterfall]
    assert names == ["backward", "allreduce b0", "allreduce b1", "gap"]


def _run(rows_for, steps=6, spec=SPEC):
    rows = []
    for st in range(steps):
        for r in (0, 1):
            rows += rows_for(r, st, st * 200.0)
    return explain_frame(frame(rows), spec)


def test_a_straggler_is_named_first():
    # rank 1 computes twice as long: it reaches the collective 30 ms later, and rank 0's collective lasts 30 ms
    # longer, waiting for it
    ex = _run(lambda r, st, t: sync_step(r, st, t, comm_at=None, compute=2.0 if r == 1 else 1.0,
                                         comm_ms=23.0 + (30.0 if r == 0 else 0.0)))
    assert ex.straggler == 1 and ex.bound == "straggler"
    assert ex.sentences[0].startswith("Rank 1 is a straggler")
    assert ex.ranks_ms[0]["skew_ms"] == pytest.approx(30.0) and ex.ranks_ms[1]["skew_ms"] == 0


def test_a_slow_codec_is_named_first():
    ex = _run(lambda r, st, t: sync_step(r, st, t, comm_at=None, codec=(60.0, 20.0), comm_ms=10.0))
    assert ex.straggler is None and ex.bound == "encode"
    assert ex.sentences[0].startswith("The step") and "the codec's encode" in ex.sentences[0]


def test_a_slow_link_is_named_first():
    slow = {"world_size": 2, "network": {"link": "modeled", "gbps": 0.1, "latency_us": 100.0}}
    # 1 MB over 0.1 Gbit/s: 80 ms on the wire; the collective takes 90
    ex = _run(lambda r, st, t: sync_step(r, st, t, comm_at=None, comm_ms=90.0), spec=slow)
    assert ex.bound == "wire" and "bytes on the wire" in ex.sentences[0]
    assert ex.collectives[0]["wire_ms"] == pytest.approx(80.0)


def test_two_runs_compared_part_by_part_and_what_would_make_it_pay():
    plain = _run(lambda r, st, t: sync_step(r, st, t, comm_at=None, codec=(0.0, 0.0), comm_ms=50.0,
                                            nbytes=4e6), spec={"world_size": 2, "network": {"link": "modeled",
                                                                                              "gbps": 1.0}})
    coded = _run(lambda r, st, t: sync_step(r, st, t, comm_at=None, codec=(40.0, 20.0), comm_ms=10.0,
                                            nbytes=4e5), spec={"world_size": 2, "network": {"link": "modeled",
                                                                                              "gbps": 1.0}})
    d = explain.compare(plain, coded, "ddp", "topk")
    assert d["net_ms"] == pytest.approx(20.0)  # +60 codec, -40 communication
    assert d["path_ms"]["encode"] == pytest.approx(40.0) and d["path_ms"]["decode"] == pytest.approx(20.0)
    assert d["sentences"][0].startswith("topk is 20.0 ms per step slower than ddp")
    be = d["break_even"]
    assert be["codec_speedup"] == pytest.approx(60 / 40)  # a codec taking 40 ms instead of 60 breaks even
    # steps of 110 and 90 ms with 3.2 and 32 ms on the wire at 1 Gbit/s: topk's is 106.8 + 3.2 / r, ddp's
    # 58 + 32 / r (ms, r in Gbit/s), equal at r = 28.8 / 48.8; below it topk pays
    assert be["link_gbps"] == pytest.approx(28.8 / 48.8, rel=1e-6)
    assert any("Gbit/s or less" in s for s in d["sentences"])


def test_a_run_against_itself_is_the_same_time_with_no_part_named():
    ex = _run(lambda r, st, t: sync_step(r, st, t, comm_at=None, codec=(40.0, 20.0), comm_ms=10.0))
    d = explain.compare(ex, ex, "topk", "topk again")
    assert d["net_ms"] == 0 and not any(d["path_ms"].values())
    assert d["sentences"][0] == (f"topk again and topk take the same time per step ({ex.step_ms:.1f} ms); no part of "
                                 "the critical path differs by 0.05 ms or more.")


def test_the_parts_add_up_and_bad_steps_are_one_line():
    ex = _run(lambda r, st, t: sync_step(r, st, t))
    assert sum(ex.path_ms[g] for g in GROUPS) == pytest.approx(ex.step_ms)
    with pytest.raises(explain.NothingToExplain, match="no finished step in 50..60"):
        explain_frame(frame(sync_step(0, 0, 0.0)), SPEC, steps=(50, 60))
    with pytest.raises(explain.NothingToExplain, match="no timeline spans"):
        explain_frame(pd.DataFrame(), SPEC)


# --------------------------------------------------------------------------- real runs

SLOW = '''
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from commlab import Compressor


class SlowHalf(Compressor):
    """fp16, with 15 ms of extra encode work per bucket."""
    summable = True
    keeps_shape = True

    def compress(self, t):
        time.sleep(0.015)
        return [t.half()], t.dtype

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)


class Lagging(nn.Module):
    def __init__(self, inner, lag_s):
        super().__init__()
        self.inner, self.lag_s = inner, lag_s

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(self.lag_s)
        return self.inner(x)


def lagging(info=None, lag_ms=0.0):
    """An MLP on digits whose rank 1 spends ``lag_ms`` more in every forward."""
    inner = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return Lagging(inner, lag_ms / 1e3)
'''


@pytest.fixture(scope="module")
def slowpkg(tmp_path_factory):
    top = tmp_path_factory.mktemp("explainpkg")
    (top / "explainpkg").mkdir()
    (top / "explainpkg" / "__init__.py").write_text("")
    (top / "explainpkg" / "slow.py").write_text(textwrap.dedent(SLOW))
    sys.path.insert(0, str(top))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(top) + (os.pathsep + old if old else "")
    yield top
    sys.path.remove(str(top))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


BASE = {"model": "mlp", "dataset": "digits", "steps": 12, "batch_size": 32, "eval_every": 0, "threads": 1,
        "world_size": 2}


@pytest.fixture(scope="module")
def runs(slowpkg, tmp_path_factory):
    """Four short two-rank runs: plain, one rank slower, one codec slower, a slower modeled link."""
    import commlab
    root = tmp_path_factory.mktemp("explainruns")
    made = {
        "plain": BASE,
        "straggler": dict(BASE, model={"name": "explainpkg.slow:lagging", "lag_ms": 25.0}),
        "codec": dict(BASE, compressor={"name": "explainpkg.slow:SlowHalf"}),
        "link": dict(BASE, network={"link": "modeled", "gbps": 0.02, "latency_us": 50.0}),
    }
    out = {}
    for k, spec in made.items():
        run = commlab.run(spec, runs=root)
        assert run.state == "done", (k, run.status().get("error"))
        out[k] = run
    return root, out


@pytest.mark.parametrize("kind,first", [("straggler", "Rank 1 is a straggler"),
                                        ("codec", "bound by the codec's encode"),
                                        ("link", "bound by bytes on the wire")])
def test_a_slowdown_put_in_a_real_run_is_named_first(runs, kind, first):
    _, made = runs
    ex = explain.explain_run(made[kind])
    assert first in ex.sentences[0], ex.sentences
    assert sum(ex.path_ms.values()) == pytest.approx(ex.step_ms, rel=0.02)  # the parts add up to the step


def _shaped_unavailable():
    from commlab.lab.net.netns import NetworkUnavailable, check_shaped_supported
    try:
        check_shaped_supported()
    except NetworkUnavailable as e:
        return str(e)
    return None


@pytest.mark.skipif(_shaped_unavailable() is not None, reason=f"shaped links: {_shaped_unavailable()}")
def test_a_slower_shaped_link_is_named_first(slowpkg, tmp_path):
    """A real emulated link (network namespaces, tc) at 0.05 Gbit/s: the wire bounds the step."""
    import commlab
    run = commlab.run(dict(BASE, steps=8, network={"link": "shaped", "gbps": 0.05}), runs=tmp_path)
    assert run.state == "done", run.status().get("error")
    ex = explain.explain_run(run)
    assert "bound by bytes on the wire" in ex.sentences[0], ex.sentences
    assert ex.collectives[0]["wire_ms"] > 0 and sum(ex.path_ms.values()) == pytest.approx(ex.step_ms, rel=0.02)


def test_a_real_plain_run_adds_up_to_its_measured_step(runs):
    """(Whether a rank straggles in a plain run depends on what else the machine runs: not asserted here.)"""
    _, made = runs
    ex = explain.explain_run(made["plain"])
    assert sum(ex.path_ms.values()) == pytest.approx(ex.step_ms, rel=0.02)
    # the explained step is the measured step: the mean of the step spans over the explained steps
    tl = made["plain"].timeline()
    st = tl[(tl["lane"] == "step") & (tl["step"] >= ex.steps[0]) & (tl["step"] <= ex.steps[1])]
    assert ex.step_ms == pytest.approx(st["dur_us"].mean() / 1e3, rel=0.02)
    assert [c["op"] for c in ex.collectives] and all(c["bytes"] for c in ex.collectives if c["op"] == "allreduce")


def test_commlab_explain_prints_and_compares(runs, capsys):
    from commlab.lab.front import cli
    root, made = runs
    assert cli.main(["explain", made["codec"].id, "--runs", str(root), "--against", made["plain"].id]) == 0
    out = capsys.readouterr().out
    assert "bound by the codec's encode" in out and "critical path" in out and "collectives" in out
    assert f"against        {made['plain'].id}" in out and "ms per step slower than" in out
    assert cli.main(["explain", made["link"].id, "--runs", str(root), "--json", "--steps", "4:9"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["explanation"]["bound"] == "wire" and doc["explanation"]["steps"] == [4, 9]
    assert cli.main(["explain", made["link"].id, "--runs", str(root), "--steps", "9:4"]) == 2
    err = capsys.readouterr().err
    assert "--steps: FIRST:LAST with FIRST <= LAST" in err and "Traceback" not in err


def test_the_live_and_compare_pages_explain(runs, monkeypatch):
    from streamlit.testing.v1 import AppTest
    from test_app import ENTRY
    root, made = runs
    monkeypatch.setenv("COMMLAB_RUNS", str(root))
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.query_params["run"] = made["codec"].id
    at.run().switch_page("views/live_run.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Why the step takes its time" in [h.value for h in at.subheader]
    text = " ".join(m.value.replace("\\", "") for m in at.markdown)
    assert "bound by the codec's encode" in text
    assert any("skew_ms" in d.value.columns for d in at.dataframe)  # each collective split
    at.switch_page("views/compare.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Why one is slower than another" in [h.value for h in at.subheader]
    text = " ".join(m.value.replace("\\", "") for m in at.markdown)
    assert "ms per step" in text and "than" in text


def test_the_html_report_carries_the_explanation(runs):
    from commlab.lab.analysis.report import report_html
    _, made = runs
    page = report_html([made["plain"], made["codec"]])
    assert page.count("Why the step takes its time") == 2 and "Why one is slower than another" in page
    assert "bound by the codec&#x27;s encode" in page and "ms per step slower than" in page


# --------------------------------------------------------------------------- your own job's profiler trace

def test_a_gpu_profiler_trace_is_explained(tmp_path, capsys):
    """The synthetic GPU trace of tests/test_kineto.py: per step 4.3 ms of kernels on the compute stream (the
    copy counted with its phase), and the allreduce's exposed tail on the path: 1.5 ms on rank 0, 1.7 on rank 1."""
    from commlab.lab.analysis import kineto
    from commlab.lab.front import cli
    from test_kineto import SHIFT, gpu_trace
    for rank, shift in SHIFT.items():
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(gpu_trace(rank, shift)))
    ex = explain_frame(kineto.read_trace(tmp_path), {"world_size": 2}, skip_warmup=False)
    assert ex.path_ms["compute"] == pytest.approx(4.3, abs=0.01)
    assert sum(ex.path_ms[g] for g in explain.COMM_GROUPS) == pytest.approx(1.6, abs=0.01)
    assert sum(ex.path_ms.values()) == pytest.approx(ex.step_ms)
    assert cli.main(["explain", "--trace", str(tmp_path), "--gbps", "100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["explanation"]
    assert doc["link"]["gbps"] == 100 and doc["collectives"][0]["wire_ms"] is not None
    assert cli.main(["explain", "--trace", str(tmp_path / "nothing.json")]) == 2
    err = capsys.readouterr().err
    assert "nothing.json" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_cpu_ddp_profiler_trace_is_explained(ddp, capsys):
    """A real two-rank gloo DDP job profiled with torch.profiler (tests/test_kineto.py makes it): the steps are
    explained, the parts add up, and the allreduces are split with their bytes."""
    from commlab.lab.front import cli
    paths, _, frame = ddp
    ex = explain_frame(frame, {"world_size": 2}, skip_warmup=False)
    assert sum(ex.path_ms.values()) == pytest.approx(ex.step_ms)
    assert [c["op"] for c in ex.collectives if c["bytes"]] and ex.sentences[0].startswith(("The step", "Rank"))
    assert cli.main(["explain", "--trace", str(paths[0]), "--trace", str(paths[1])]) == 0
    assert "critical path" in capsys.readouterr().out
