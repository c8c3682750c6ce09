"""A PyTorch profiler trace of one's own job, read into the lab's timeline frame (commlab.lab.analysis.kineto).

Real traces: a two-rank gloo DDP job (tests/distutil.py's ranks, one thread each) records three active steps with
``torch.profiler``; the frame has one step span per step and rank, the gloo allreduces of DDP's buckets with the
model's gradient bytes, and the lab's breakdown adds up on it. A synthetic two-rank GPU trace, whose compute and
NCCL kernels overlap by a known amount, gives the known figures, and the same figures as Holistic Trace Analysis
(HTA) where HTA is installed. Bad files say what is wrong in one line."""
import gzip
import json
import re

import pytest

from commlab.engine.timeline import LANES
from commlab.lab.analysis import kineto, plots
from commlab.lab.base.errors import LabError
from distutil import run_world

ACTIVE = 3


def _record(rank, world, outdir):
    """One rank of a small DDP job under torch.profiler: warm-up one step, record three; the trace's path and the
    model's parameter count."""
    import os

    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model = DDP(net, bucket_cap_mb=0.1)  # two buckets: 68,362 and 16,640 floats
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    path = os.path.join(outdir, f"rank{rank}.json")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=ACTIVE, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(1 + ACTIVE):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            prof.step()
    return path, sum(p.numel() for p in net.parameters())


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    results = run_world(_record, str(out), world=2)
    paths = [p for p, _ in results]
    return paths, results[0][1], kineto.read_trace(paths)


def test_one_step_span_per_active_step_per_rank(ddp):
    paths, _, frame = ddp
    assert list(frame.columns[:5]) == kineto.FRAME_COLUMNS
    assert set(frame["lane"]) <= set(LANES)
    steps = frame[frame["lane"] == "step"]
    assert sorted(steps["rank"]) == [0] * ACTIVE + [1] * ACTIVE
    for rank, g in steps.groupby("rank"):
        assert g["step"].tolist() == sorted(g["step"]) and g["step"].nunique() == ACTIVE
        assert (g["name"] == [f"ProfilerStep#{int(n)}" for n in g["step"]]).all()
    assert {"forward", "backward", "optimizer", "comm"} <= set(frame["lane"])
    assert kineto.read_trace(paths).equals(frame)  # deterministic
    assert plots.timeline_figure(frame, last=2).data  # the lab's timeline draws it


def test_the_comm_lane_holds_ddp_allreduces_with_the_gradient_bytes(ddp):
    _, params, frame = ddp
    comm = frame[frame["lane"] == "comm"]
    assert set(comm["name"]) <= {"gloo:all_reduce", "gloo:broadcast"}
    ar = comm[comm["op"] == "allreduce"]
    for (rank, step), g in ar.groupby(["rank", "step"]):
        assert len(g) >= 2, "one allreduce per DDP bucket"
        assert g["bytes"].sum() == params * 4, (rank, step, g["bytes"].tolist())
    assert ar.groupby(["rank", "step"]).ngroups == 2 * ACTIVE
    waits = frame[frame["lane"] == "wait"]
    assert waits.empty or waits["inferred"].all()  # DDP's finalisation waits, inferred
    for _, w in waits.iterrows():  # each while collectives of its rank were in flight
        c = comm[comm["rank"] == w["rank"]]
        flight = _merged(zip(c["start_us"], c["start_us"] + c["dur_us"]))
        assert any(s - 1 <= w["start_us"] and w["start_us"] + w["dur_us"] <= e + 1 for s, e in flight), w.to_dict()


def _merged(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def test_the_breakdown_adds_up_on_the_imported_frame(ddp):
    _, _, frame = ddp
    bd = kineto.breakdown(frame)
    assert len(bd) == 2 * ACTIVE
    parts = bd[list(plots.PARTS)].sum(axis=1)
    assert ((parts - bd["step_ms"]).abs() <= 0.02 * bd["step_ms"]).all()
    assert (bd["compute_ms"] > 0).all()
    assert (bd["exposed_comm_ms"] + bd["hidden_comm_ms"] > 0).all()
    mean = plots.mean_breakdown(bd)
    assert mean["step_ms"] > 0 and mean["exposed_comm_ms"] + mean["hidden_comm_ms"] > 0
    ov = kineto.comm_overlap(frame)
    assert ov["rank"].tolist() == [0, 1] and (ov["comm_ms"] > 0).all() and ov["overlap"].between(0, 1).all()
    assert ov["hidden_comm_ms"].tolist() == pytest.approx(bd.groupby("rank")["hidden_comm_ms"].sum().tolist())


def test_a_hundred_steps_are_read(ddp, tmp_path):
    """The DDP trace's three steps repeated to 102: about 25,000 events, 8 MB. Most of the time is json's."""
    paths, _, _ = ddp
    doc = json.loads(open(paths[0]).read())
    events = [e for e in doc["traceEvents"] if e.get("ph") != "M" and "ts" in e and e.get("cat") != "Trace"]
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e.get("dur", 0) for e in events) - t0
    out = [e for e in doc["traceEvents"] if e.get("ph") == "M"]
    for k in range(34):
        for e in events:
            m = re.match(r"ProfilerStep#(\d+)$", e["name"])
            out.append({**e, "ts": e["ts"] + k * span,
                        **({"name": f"ProfilerStep#{int(m.group(1)) + ACTIVE * k}"} if m else {})})
    big = tmp_path / "big.json"
    big.write_text(json.dumps({**doc, "traceEvents": out}))
    frame = kineto.read_trace(big)  # how long it takes: bench/explain_speed.py (tests do not time)
    assert (frame["lane"] == "step").sum() == 34 * ACTIVE
    assert sorted(frame.loc[frame["lane"] == "step", "step"].unique().tolist()) == sorted(
        {int(re.match(r"ProfilerStep#(\d+)$", e["name"]).group(1)) for e in out
         if re.match(r"ProfilerStep#(\d+)$", e.get("name", ""))})


# --------------------------------------------------------------------------- bad files

def test_bad_files_say_what_is_wrong_in_one_line(tmp_path):
    cases = {"text.json": "not json at all {", "nokey.json": json.dumps({"schemaVersion": 1}),
             "nosteps.json": json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1,
                                                         "tid": 1, "ts": 0, "dur": 5}]}),
             "torn.json.gz": b"\x1f\x8b\x08\x00garbage"}
    said = {}
    for name, body in cases.items():
        p = tmp_path / name
        p.write_bytes(body if isinstance(body, bytes) else body.encode())
        with pytest.raises(LabError) as e:
            kineto.read_trace(p)
        said[name] = str(e.value)
    for name in ("missing.json", ""):
        with pytest.raises(LabError) as e:
            kineto.read_trace(tmp_path / name if name else [])
        said[name or "none"] = str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LabError) as e:
        kineto.read_trace(empty)
    said["empty"] = str(e.value)
    for name, msg in said.items():
        assert "\n" not in msg and (name in msg or name == "none"), msg
    assert "not a JSON trace" in said["text.json"] and "not a JSON trace" in said["torn.json.gz"]
    assert "no traceEvents" in said["nokey.json"]
    assert "no ProfilerStep spans" in said["nosteps.json"]
    assert "no such trace file" in said["missing.json"]
    assert "no trace files" in said["empty"] and said["none"] == "no trace files given"


# --------------------------------------------------------------------------- hand-made host traces

def _host_trace(rank=None, wait=False):
    """Two steps of a training thread (tid 1) whose loop is wrapped in a record_function, with a data loader
    span, a hook's compress/decompress annotations inside backward, record_param_comms collectives and
    (``wait``) an explicit wait."""
    ev = []

    def x(name, ts, dur, cat="cpu_op", tid=1, **args):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args})
    for k in range(2):
        T = 1000 + 1000 * k
        x(f"ProfilerStep#{k}", T, 900, cat="user_annotation")
        x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", T + 5, 40, cat="user_annotation")
        x("## train step ##", T + 50, 800, cat="user_annotation")
        x("aten::linear", T + 60, 100)
        x("aten::mm", T + 70, 80)
        x("autograd::engine::evaluate_function: MmBackward0", T + 200, 300)
        x("compress_fp16", T + 300, 20, cat="user_annotation")
        x("record_param_comms", T + 330, 30, **{"Collective name": "allreduce", "In msg nelems": 1000,
                                               "dtype": "BFloat16"})
        if wait:
            x("c10d::wait", T + 520, 100)
        x("decompress_fp16", T + 630, 20, cat="user_annotation")
        x("Optimizer.step#Adam.step", T + 700, 100, cat="user_annotation")
    doc = {"traceEvents": ev}
    if rank is not None:
        doc["distributedInfo"] = {"rank": rank, "world_size": 2}
    return doc


def test_a_host_trace_lanes_by_name_and_place(tmp_path):
    p = tmp_path / "a.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(_host_trace(wait=True), f)
    frame = kineto.read_trace(p)
    s0 = frame[frame["step"] == 0].set_index("name")
    assert s0.loc["aten::linear", "lane"] == "forward"  # looked into the span around the whole step
    assert "## train step ##" not in s0.index and "aten::mm" not in s0.index  # a container; nested in forward
    assert not any(n.startswith("enumerate(DataLoader)") for n in frame["name"])
    assert s0.loc["autograd::engine::evaluate_function: MmBackward0", "lane"] == "backward"
    assert s0.loc["compress_fp16", "lane"] == "compress" and s0.loc["decompress_fp16", "lane"] == "decompress"
    assert s0.loc["record_param_comms", "lane"] == "comm"
    assert s0.loc["record_param_comms", "op"] == "allreduce" and s0.loc["record_param_comms", "bytes"] == 2000
    assert s0.loc["c10d::wait", "lane"] == "wait" and s0.loc["Optimizer.step#Adam.step", "lane"] == "optimizer"
    bd = kineto.breakdown(frame)
    assert bd["compression_ms"].tolist() == pytest.approx([0.04, 0.04])
    assert bd["exposed_comm_ms"].tolist() == pytest.approx([0.1, 0.1])  # the wait, outside compute
    assert (bd[list(plots.PARTS)].sum(axis=1) - bd["step_ms"]).abs().max() < 1e-9


def test_ranks_from_the_traces_or_their_order(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.json", "b.json", "c.json"))
    a.write_text(json.dumps(_host_trace(rank=1)))
    b.write_text(json.dumps(_host_trace(rank=0)))
    c.write_text(json.dumps(_host_trace()))
    assert sorted(set(kineto.read_trace([a, b])["rank"])) == [0, 1]
    assert sorted(set(kineto.read_trace([c, tmp_path / "a.json"])["rank"])) == [0, 1]  # c is the first
    with pytest.raises(LabError, match=r"b\.json: rank 0 again \(also .*c\.json\)"):
        kineto.read_trace([c, b])


# --------------------------------------------------------------------------- GPU: known figures, HTA's figures

STEP_US, STEPS, FIRST = 10_000, 4, 5
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
GRAD_BYTES = 4 << 20


def gpu_trace(rank: int, shift: int = 0, sized_kernel: bool = True) -> dict:
    """A GPU Kineto trace of one rank, as torch.profiler writes it on CUDA: four DDP steps of 10 ms, host spans
    (training thread, autograd's device thread) launching kernels on two streams by correlation id. On the GPU,
    step k begins at G = 300 us after its host step: forward kernels 0-1000 and 1000-1800, a host-to-device copy
    1800-1900, backward kernels 2000-3000 and 3100-4000, the NCCL allreduce 3500-5500 (+ ``shift``) on its own
    stream, the optimizer's kernel 6000-6500. So per step: compute 4200 us and memory 100 us, communication
    2000 us of which 500 - ``shift`` overlap the backward kernel (exposed: 1500 + ``shift``)."""
    pid, main, bwd = 1000 + rank, 1000 + rank, 2000 + rank
    ev = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
          {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}}]
    corr = [100_000 * (rank + 1)]
    sizes = {"Collective name": "allreduce", "In msg nelems": GRAD_BYTES // 4, "Out msg nelems": GRAD_BYTES // 4,
             "dtype": "Float", "Group size": 2}

    def cpu(name, tid, ts, dur, cat="cpu_op", **args):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
                   "args": {"External id": len(ev), **args}})

    def launch(tid, ts, name, kts, kdur, stream=7, cat="kernel", call="cudaLaunchKernel", **kargs):
        corr[0] += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": call, "pid": pid, "tid": tid, "ts": ts, "dur": 10,
                   "args": {"External id": len(ev), "cbid": 211, "correlation": corr[0]}})
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": kts, "dur": kdur,
                   "args": {"External id": len(ev), "device": 0, "context": 1, "stream": stream,
                            "correlation": corr[0], **kargs}})
    for k in range(STEPS):
        T = 1_000_000 + k * STEP_US
        G = T + 300
        cpu(f"ProfilerStep#{FIRST + k}", main, T, STEP_US - 100, cat="user_annotation")
        cpu("Optimizer.zero_grad#SGD.zero_grad", main, T + 10, 50, cat="user_annotation")
        cpu("DistributedDataParallel.forward", main, T + 100, 1500, cat="user_annotation")
        cpu("aten::addmm", main, T + 200, 100)
        launch(main, T + 250, "ampere_sgemm_128x64_tn", G, 1000)
        cpu("aten::addmm", main, T + 400, 100)
        launch(main, T + 450, "ampere_sgemm_64x64_tn", G + 1000, 800)
        cpu("aten::copy_", main, T + 550, 100)
        launch(main, T + 560, "Memcpy HtoD (Pageable -> Device)", G + 1800, 100, cat="gpu_memcpy",
               call="cudaMemcpyAsync")
        cpu("autograd::engine::evaluate_function: AddmmBackward0", bwd, T + 1700, 300)
        launch(bwd, T + 1750, "ampere_sgemm_128x64_nt", G + 2000, 1000)
        cpu("autograd::engine::evaluate_function: AddmmBackward0", bwd, T + 2050, 300)
        launch(bwd, T + 2100, "ampere_sgemm_64x64_nt", G + 3100, 900)
        cpu("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", bwd, T + 2400, 150)
        cpu("record_param_comms", bwd, T + 2410, 80, **sizes)
        cpu("nccl:all_reduce", bwd, T + 2420, 60, cat="user_annotation")
        launch(bwd, T + 2430, NCCL, G + 3500 + shift, 2000, stream=20, **(sizes if sized_kernel else {}))
        cpu("Optimizer.step#SGD.step", main, T + 3000, 400, cat="user_annotation")
        launch(main, T + 3100, "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float> >",
               G + 6000, 500)
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
            "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85520809984,
                                  "computeMajor": 9, "computeMinor": 0, "maxThreadsPerBlock": 1024,
                                  "maxThreadsPerMultiprocessor": 2048, "regsPerBlock": 65536, "warpSize": 32,
                                  "sharedMemPerBlock": 49152, "numSms": 132, "regsPerMultiprocessor": 65536,
                                  "sharedMemPerBlockOptin": 232448, "sharedMemPerMultiprocessor": 233472}],
            "displayTimeUnit": "ms", "baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceEvents": ev}


SHIFT = {0: 0, 1: 200}
"""Rank 1's allreduce starts 200 us later: 300 us of it overlap, 1700 us are exposed."""


@pytest.fixture(scope="module")
def gpu_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu")
    for rank, shift in SHIFT.items():  # rank 1's kernel has no sizes: they come from its record_param_comms
        (d / f"rank{rank}.json").write_text(json.dumps(gpu_trace(rank, shift, sized_kernel=rank == 0)))
    return d


def known(rank: int) -> dict:
    """The synthetic trace's figures for one rank, over its steps, in us (HTA's definitions where they differ)."""
    shift = SHIFT[rank]
    busy = 1900 + 1000 + (2400 + shift) + 500  # the union of the kernels in a step
    return {"kernel_time": (STEPS - 1) * STEP_US + 6500, "compute": STEPS * 4200, "memory": STEPS * 100,
            "hidden": STEPS * (500 - shift), "exposed": STEPS * (1500 + shift), "comm": STEPS * 2000,
            "idle": (STEPS - 1) * (STEP_US - busy) + (6500 - busy)}


def test_a_gpu_trace_puts_kernels_on_the_lanes_that_launched_them(gpu_dir):
    frame = kineto.read_trace(gpu_dir)
    assert set(frame["device"]) == {"gpu"}
    k = frame[(frame["rank"] == 0) & (frame["step"] == FIRST) & (frame["lane"] != "step")].set_index("name")
    assert k.loc["ampere_sgemm_128x64_tn", "lane"] == "forward" and k.loc["ampere_sgemm_64x64_nt", "lane"] == "backward"
    assert k.loc["Memcpy HtoD (Pageable -> Device)", "lane"] == "forward"
    assert k.loc["Memcpy HtoD (Pageable -> Device)", "kind"] == "memory"
    assert k.filter(like="vectorized_elementwise", axis=0)["lane"].tolist() == ["optimizer"]
    assert k.loc[NCCL, "lane"] == "comm" and k.loc[NCCL, "stream"] == 20 and k.loc[NCCL, "op"] == "allreduce"
    comm = frame[frame["lane"] == "comm"]
    assert (comm["bytes"] == GRAD_BYTES).all() and len(comm) == 2 * STEPS  # rank 1's from record_param_comms
    steps = frame[frame["lane"] == "step"]
    assert steps["step"].tolist() == list(range(FIRST, FIRST + STEPS)) * 2
    assert steps["dur_us"].tolist() == [STEP_US] * (STEPS - 1) + [6500] + [STEP_US] * (STEPS - 1) + [6500]
    assert (steps["host_dur_us"] == STEP_US - 100).all()
    host = kineto.read_trace(gpu_dir, device="cpu")  # the host's side: the NCCL collective is its enqueue
    assert set(host[host["lane"] == "comm"]["name"]) == {"nccl:all_reduce"}
    assert (host[host["lane"] == "step"]["dur_us"] == STEP_US - 100).all()


def test_the_lab_gives_the_known_figures_of_a_gpu_trace(gpu_dir):
    frame = kineto.read_trace(gpu_dir)
    total = kineto.breakdown(frame).groupby("rank").sum()
    ov = kineto.comm_overlap(frame).set_index("rank")
    for rank in SHIFT:
        want, got = known(rank), total.loc[rank] * 1e3
        assert got["step_ms"] == pytest.approx(want["kernel_time"])
        assert got["compute_ms"] == pytest.approx(want["compute"] + want["memory"])  # a copy is its phase's work
        assert got["exposed_comm_ms"] == pytest.approx(want["exposed"])
        assert got["hidden_comm_ms"] == pytest.approx(want["hidden"])
        assert got["other_ms"] == pytest.approx(want["idle"])
        assert ov.loc[rank, "overlap"] == pytest.approx(want["hidden"] / want["comm"])


@pytest.mark.filterwarnings("ignore:The inplace keyword")  # HTA's own pandas calls, on pandas 3
def test_hta_agrees_with_the_lab_on_a_gpu_trace(gpu_dir):
    """HTA's temporal breakdown and communication-computation overlap of the same trace, all its steps
    (``include_last_profiler_step=True``), against the lab's frame summed over the steps. Tolerance: 1 us on each
    figure (both read the same integer microseconds; HTA rounds timestamps down to them) and 0.0001 on the ratio.
    By definition HTA counts memcpy/memset as non-compute and the lab as compute of the phase that launched them:
    with the frame's ``kind == "memory"`` rows left out the lab's compute and overlap are HTA's, and HTA's
    non-compute is the lab's exposed communication plus the time only copies run."""
    hta = pytest.importorskip("hta.trace_analysis", reason="holistictraceanalysis is in the dev extra")
    ta = hta.TraceAnalysis(trace_dir=str(gpu_dir), include_last_profiler_step=True)
    tb = ta.get_temporal_breakdown(visualize=False).set_index("rank")
    hov = ta.get_comm_comp_overlap(visualize=False).set_index("rank")
    frame = kineto.read_trace(gpu_dir)
    no_copies = frame[frame["kind"].ne("memory")]
    lab = kineto.breakdown(frame).groupby("rank").sum() * 1e3
    lab_nc = kineto.breakdown(no_copies).groupby("rank").sum() * 1e3
    ov = kineto.comm_overlap(no_copies).set_index("rank")
    for rank in SHIFT:
        want, h = known(rank), tb.loc[rank]
        assert h["kernel_time(us)"] == pytest.approx(lab.loc[rank, "step_ms"], abs=1) == want["kernel_time"]
        assert h["idle_time(us)"] == pytest.approx(lab.loc[rank, "other_ms"], abs=1) == want["idle"]
        assert h["compute_time(us)"] == pytest.approx(lab_nc.loc[rank, "compute_ms"], abs=1) == want["compute"]
        assert h["compute_time(us)"] == pytest.approx(lab.loc[rank, "compute_ms"] - want["memory"], abs=1)
        only_copies = lab_nc.loc[rank, "other_ms"] - lab.loc[rank, "other_ms"]
        assert h["non_compute_time(us)"] == pytest.approx(lab.loc[rank, "exposed_comm_ms"] + only_copies, abs=1)
        assert hov.loc[rank, "comp_comm_overlap_pctg"] / 100 == pytest.approx(ov.loc[rank, "overlap"], abs=1e-4)
        assert ov.loc[rank, "overlap"] == pytest.approx(want["hidden"] / want["comm"])
