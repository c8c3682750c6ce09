"""GPU-only checks: the engine on CUDA tensors, CUDA-event timelines, NCCL. Skipped without a GPU.

One GPU runs two kinds of job: one rank over NCCL, and two ranks sharing the device, which NCCL
refuses (two ranks per device), so ``backend: auto`` picks gloo over CUDA tensors there. Two GPUs
add a two-rank NCCL run. Besides the comm modes and built-in compressors: a user's compressor through
the public extension API (``mypkg.codecs:ScaledSign`` from examples/), the conformance checks on CUDA
tensors, and the methods that communicate less often, from the CLI, held to their H = 1 definition,
and through ``commlab.wrap``.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distutil import run_world
from commlab.engine import compressors
from commlab.engine.compressors import conformance
from commlab.engine.runlog import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs (NCCL, one rank per GPU)")


def _run(tmp_path, *sets, spec="demo.yaml", env=None):
    runs = tmp_path / "runs"
    args = [sys.executable, "-m", "commlab.lab.front.cli", "run", str(ROOT / "examples" / spec), "--quiet", "--runs", str(runs),
            "--set", "device=cuda", "--set", "eval_every=0"]
    for s in sets:
        args += ["--set", s]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    dirs = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")] if runs.exists() else []
    assert r.returncode == 0 and len(dirs) == 1, r.stdout + r.stderr
    run_dir = dirs[0]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "done", (run_dir / "log.txt").read_text()[-3000:]
    return run_dir, json.loads((run_dir / "resolved.json").read_text())


def _timeline_is_cuda_timed(run_dir, world, lane="comm"):
    for rank in range(world):
        ev = read_jsonl(str(run_dir / f"timeline-rank{rank}.jsonl"))
        assert ev and all(e["dur"] >= 0 for e in ev)
        cats = {e["cat"] for e in ev}
        assert {"forward", "backward", lane} <= cats, cats
        # compute spans come from CUDA events resolved against one reference: each step's forward
        # lies before its backward on the host-aligned axis
        fwd = sorted(e["ts"] for e in ev if e["cat"] == "forward")
        assert fwd == sorted(fwd) and len(fwd) >= 10


def _final_loss(run_dir):
    losses = [r["loss"] for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r.get("kind") == "step"]
    assert losses and all(l == l for l in losses)  # no NaN
    return losses


@needs_gpu
def test_the_fused_kernels_ran_here():
    """Where the fused kernels are meant to run (compute capability 8.0 on, Triton), every one built and ran at
    first use: a failure there would leave the suite's fused-kernel tests skipped, not failed."""
    from commlab.engine.compressors import fused
    if torch.cuda.get_device_capability(0) < fused.MIN_CAPABILITY or not fused._import():
        pytest.skip("no fused kernels on this GPU (before Ampere, or no Triton)")
    assert fused.on(torch.device("cuda", 0), torch.float32), fused.problem


@needs_gpu
def test_one_rank_nccl_with_cuda_event_timeline(tmp_path):
    run_dir, resolved = _run(tmp_path, "world_size=1", "backend=nccl", "steps=30")
    assert resolved["backend"] == "nccl" and resolved["device"].startswith("cuda")
    _timeline_is_cuda_timed(run_dir, 1)


@needs_gpu
@pytest.mark.parametrize("sets", [
    ("comm.mode=sync",),
    ("comm.mode=wfbp",),
    ("comm.mode=dear", "schedule.cap_mb=1"),
    ("compressor.name=topk", "compressor.ratio=0.05", "compressor.error_feedback=true"),
    ("compressor.name=powersgd", "compressor.rank=2"),
], ids=["sync", "wfbp", "dear", "topk-ef", "powersgd"])
def test_two_ranks_share_one_gpu(tmp_path, sets):
    run_dir, resolved = _run(tmp_path, "world_size=2", "steps=40", *sets)
    expected = "gloo" if GPUS < 2 else "nccl"
    assert resolved["backend"] == expected and resolved["device"].startswith("cuda")
    _timeline_is_cuda_timed(run_dir, 2)
    losses = _final_loss(run_dir)
    assert min(losses[-10:]) < losses[0]  # it learns


@needs_gpu
def test_mergecomp_search_on_gpu(tmp_path):
    run_dir, _ = _run(tmp_path, "world_size=2", "steps=60", spec="mergecomp-topk.yaml")
    tuning = json.loads((run_dir / "tuning.json").read_text())
    assert tuning, "mergecomp wrote no tuning record"
    _timeline_is_cuda_timed(run_dir, 2)


@needs_gpu
def test_nccl_refuses_two_ranks_on_one_gpu_with_a_clear_error(tmp_path):
    if GPUS >= 2:
        pytest.skip("two GPUs: NCCL has one per rank")
    runs = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "run", str(ROOT / "examples" / "demo.yaml"), "--quiet",
                        "--runs", str(runs), "--set", "device=cuda", "--set", "backend=nccl", "--set", "steps=5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    (run_dir,) = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")]
    said = (run_dir / "log.txt").read_text() + (run_dir / "status.json").read_text()
    assert "NCCL refuses two ranks per device" in said


@needs_two
def test_nccl_two_gpus_with_cuda_event_timeline(tmp_path):
    run_dir, resolved = _run(tmp_path, "backend=nccl", "steps=30", "schedule.name=layerwise")
    assert resolved["backend"] == "nccl"
    _timeline_is_cuda_timed(run_dir, 2)


# --------------------------------------------------------------------------- a user's compressor

@needs_gpu
def test_a_users_compressor_trains_on_one_gpu(tmp_path):
    """examples/mypkg/codecs.py's ScaledSign, named by import path as a researcher would: two ranks on the GPU."""
    pypath = str(ROOT / "examples") + os.pathsep + os.environ.get("PYTHONPATH", "")
    run_dir, resolved = _run(tmp_path, "world_size=2", "steps=40", "compressor.name=mypkg.codecs:ScaledSign",
                             "compressor.scale=0.5", env={"PYTHONPATH": pypath})
    assert resolved["device"].startswith("cuda")
    assert json.loads((run_dir / "spec.json").read_text())["compressor"]["name"] == "mypkg.codecs:ScaledSign"
    _timeline_is_cuda_timed(run_dir, 2)
    losses = _final_loss(run_dir)
    assert min(losses[-10:]) < losses[0]


@needs_gpu
@pytest.mark.parametrize("name,params", [(n, {}) for n in compressors.names()] + [("mypkg.codecs:ScaledSign",
                                                                                   {"scale": 0.5})])
def test_conformance_checks_pass_on_cuda_tensors(name, params, monkeypatch, forget_modules):
    """The promises every compressor makes (commlab/engine/compressors/conformance.py), with its inputs on the GPU:
    the built-ins and the example package's; ``commlab check compressor NAME --device cuda`` runs the same."""
    if name.startswith("mypkg"):
        forget_modules("mypkg")
        monkeypatch.syspath_prepend(str(ROOT / "examples"))
    results = conformance.check(name, params, device="cuda")
    assert conformance.passed(results), "\n".join(r.line() for r in results if not r.ok)


@needs_gpu
def test_check_command_on_cuda(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "examples") + os.pathsep + str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "check", "compressor", "mypkg.codecs:ScaledSign",
                        "--device", "cuda", "--checks-only"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and " passed, 0 failed" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------- communicating less often

METHODS = {"local_sgd": "outer", "post_local_sgd": "outer", "diloco": "outer", "streaming_diloco": "fragment",
           "demo_momentum": "outer"}


@needs_gpu
@pytest.mark.parametrize("name", list(METHODS))
def test_local_update_methods_train_on_one_gpu(tmp_path, name):
    """Each method's example (examples/<name>.yaml) with both ranks on the GPU: done, learning, its own lane in
    a CUDA-event timeline, local steps sending nothing."""
    sets = {"post_local_sgd": ["method.warmup=6", "method.H=3"], "demo_momentum": []}.get(name, ["method.H=4"])
    run_dir, resolved = _run(tmp_path, "world_size=2", "steps=40", "timeline=true", *sets, spec=f"{name}.yaml")
    assert resolved["device"].startswith("cuda") and resolved["backend"] == ("gloo" if GPUS < 2 else "nccl")
    _timeline_is_cuda_timed(run_dir, 2, lane=METHODS[name])
    losses = _final_loss(run_dir)
    assert min(losses[-10:]) < losses[0]
    steps = [m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if m["kind"] == "step"]
    assert any(m.get("sync_bytes", 0) > 0 for m in steps)
    if name != "demo_momentum":  # DeMo sends its momentum's fast components every step
        assert any(m["bytes_sent"] == 0 for m in steps)


@needs_gpu
def test_h1_methods_are_synchronous_training_on_cuda():
    """tests/test_methods.py's definition check on CUDA tensors: local SGD, post-local SGD, DiLoCo and
    Streaming DiLoCo with H = 1 (outer rate 1, no outer momentum) give sync training's parameters."""
    from test_methods import H1, _train_specs
    specs = [{"comm": "sync"}] + [{"comm": "sync", "method": m} for m in H1.values()]
    res = run_world(_train_specs, specs, 5, "cuda")
    for rank in res:
        ref = rank[0]
        assert max((a - b).abs().max().item() for a, b in zip(ref, res[0][0])) == 0.0
        for name, got in zip(H1, rank[1:]):
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"{name} with H=1 differs from sync")


@needs_gpu
def test_wrap_local_sgd_h1_matches_torch_ddp_on_cuda(tmp_path):
    """examples/own_loop.py --device cuda: local SGD at H = 1 through commlab.wrap against torch DDP, both ranks
    on the GPU."""
    from test_methods import own_loop
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"comm": "wfbp", "method": {"name": "local_sgd", "H": 1}}))
    ours = own_loop(tmp_path, "--device", "cuda", "--spec", spec, "--runs", tmp_path / "runs", "--steps", 10,
                    "--save", tmp_path / "ours")
    assert ours.returncode == 0, ours.stdout[-3000:]
    ref = own_loop(tmp_path, "--device", "cuda", "--ddp", "--steps", 10, "--save", tmp_path / "ddp")
    assert ref.returncode == 0, ref.stdout[-3000:]
    for r in (0, 1):
        a, b = torch.load(tmp_path / f"ours.rank{r}"), torch.load(tmp_path / f"ddp.rank{r}")
        for n in a:
            torch.testing.assert_close(a[n], b[n], atol=1e-5, rtol=1e-4, msg=f"rank {r} {n} differs from DDP")
