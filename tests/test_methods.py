"""The methods that communicate less often (commlab/engine/methods/), held to their definitions: with H = 1 they
are synchronous training; a hand-computed two-rank example each; a rank killed mid-sync ends the run
failed with nothing lost; bad parameters get one line naming the field; the schedules say what a run
sends. World size 2, gloo on CPU, one thread per rank."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distutil import OWN_LOOP_DDP_STEPS, run_world, torchrun_own_loop
from commlab.engine import methods
from commlab.engine.methods.demo import DCTTopK, dct_basis
from commlab.engine.methods.diloco import split_even
from commlab.engine.runlog import read_jsonl
from commlab.engine.spec import JobSpec, SpecError
from commlab.engine.stepper import Stepper
from commlab.engine.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
MLP = {"model": "mlp", "dataset": "digits", "batch_size": 16, "eval_every": 0, "threads": 1, "timeline": False,
       "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "schedule": "allinone"}


# --------------------------------------------------------------------------- H = 1 is synchronous training

def _train_specs(rank, world, specs, steps, device="cpu"):
    """Each spec trained ``steps`` steps from the same start on the same batches on ``device``; the final
    parameters (on the CPU). tests/test_gpu.py runs it on CUDA."""
    out = []
    for d in specs:
        spec = JobSpec.from_dict({**MLP, **d, "world_size": world})
        tr = Trainer(spec, None, rank, world, torch.device(device))
        try:
            for _ in range(steps):
                tr.train_step()
            tr.stepper.drain()
            out.append([p.detach().cpu().clone() for p in tr.model.parameters()])
        finally:
            tr.close()
    return out


H1 = {"local_sgd": {"name": "local_sgd", "H": 1},
      "diloco": {"name": "diloco", "H": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
      "streaming": {"name": "streaming_diloco", "H": 1, "fragments": 1, "tau": 0, "outer_lr": 1.0,
                    "outer_momentum": 0.0},
      "post_local_sgd": {"name": "post_local_sgd", "H": 1, "warmup": 2}}


@pytest.mark.parametrize("mode", ["sync", "wfbp"])
def test_h1_is_synchronous_training(mode):
    """Inner SGD with momentum 0.9: local SGD and DiLoCo (outer_lr 1, no outer momentum) with H = 1 give the
    parameters of the sync mode (method none) after 5 steps, within float tolerance, on both ranks."""
    specs = [{"comm": mode}] + [{"comm": mode, "method": m} for m in H1.values()]
    res = run_world(_train_specs, specs, 5)
    for rank in res:
        ref = rank[0]
        moved = max((a - b).abs().max().item() for a, b in zip(ref, res[0][0]))
        assert moved == 0.0  # both ranks hold the same synchronous parameters
        for name, got in zip(H1, rank[1:]):
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=f"{name} with H=1 differs from sync")


def test_h2_is_not_synchronous_training():
    """The oracle can fail: with H = 2 local SGD leaves the synchronous path."""
    res = run_world(_train_specs, [{"comm": "sync"}, {"comm": "sync", "method": {"name": "local_sgd", "H": 2}}], 4)
    worst = max((a - b).abs().max().item() for a, b in zip(res[0][0], res[0][1]))
    assert worst > 1e-4


# --------------------------------------------------------------------------- hand-computed two-rank examples

class Lin(torch.nn.Module):
    """out = w . x + b: three parameters; with loss = out, the gradient is (x, 1) whatever w is."""

    def __init__(self, n=2, bias=True):
        super().__init__()
        self.fc = torch.nn.Linear(n, 1, bias=bias)

    def forward(self, x):
        return self.fc(x).sum()


def lin_stepper(rank, world, method, w0, b0=None, lr=0.1, momentum=0.0, comm="sync"):
    """Lin with weights ``w0`` (and bias ``b0``) and the Stepper of ``method`` over it, plain SGD: (model, stepper)."""
    torch.manual_seed(rank)
    model = Lin(len(w0), bias=b0 is not None)
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([w0]))
        if b0 is not None:
            model.fc.bias.fill_(b0)
    spec = JobSpec.from_dict({"world_size": world, "optimizer": {"name": "sgd", "lr": lr, "momentum": momentum},
                              "comm": comm, "schedule": "allinone", "method": method, "timeline": False})
    return model, Stepper(spec, model, None, rank, torch.device("cpu"))


def train_step(model, st, x) -> None:
    """One step of ``model`` on input ``x`` through Stepper ``st``, timed and marked as the trainer does."""
    tl = st.timeline
    t0, m0 = tl.now(), tl.mark()
    loss = model(x)
    t1, m1 = tl.now(), tl.mark()
    loss.backward()
    st.step_after_backward(loss, t0, t1, tl.now(), m0, m1, tl.mark())


def _hand(rank, world, method, steps, x_by_rank, w0, b0=None, lr=0.1, momentum=0.0, comm="sync"):
    """Steps of ``method`` on Lin with constant inputs (so constant gradients): each rank's parameters after
    each step, and its step lines."""
    model, st = lin_stepper(rank, world, method, w0, b0, lr, momentum, comm)
    lines = []
    st.log = lines.append  # the step lines, as metrics.jsonl would get them
    x = torch.tensor(x_by_rank[rank])
    after = []
    for _ in range(steps):
        train_step(model, st, x)
        ps = model.fc.weight.detach().reshape(-1).tolist() + ([model.fc.bias.item()] if b0 is not None else [])
        after.append(ps)
    extra = st.method.momentum() if hasattr(st.method, "momentum") else None
    glob = sum((t.reshape(-1).tolist() for t in st.method.global_params()), []) if st.method.global_params() else None
    st.close()
    return after, lines, extra, glob


X2 = [[1.0, 0.0], [0.0, 3.0]]
"""Rank 0's gradient is w: (1, 0), b: 1; rank 1's w: (0, 3), b: 1."""


def _close(got, want):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               atol=1e-6, rtol=0)


def test_local_sgd_by_hand():
    """H = 2, lr 0.1, start w = (1, 2), b = 0.5.
    step 0 (local): rank 0: w = (0.9, 2), b = 0.4;  rank 1: w = (1, 1.7), b = 0.4
    step 1 (local): rank 0: w = (0.8, 2), b = 0.3;  rank 1: w = (1, 1.4), b = 0.3, then averaged: (0.9, 1.7), 0.3
    step 2 (local): rank 0: (0.8, 1.7), 0.2;        rank 1: (0.9, 1.4), 0.2"""
    (a0, l0, _, g0), (a1, l1, _, _) = run_world(_hand, {"name": "local_sgd", "H": 2}, 3, X2, [1.0, 2.0], 0.5)
    _close(a0, [[0.9, 2, 0.4], [0.9, 1.7, 0.3], [0.8, 1.7, 0.2]])
    _close(a1, [[1, 1.7, 0.4], [0.9, 1.7, 0.3], [0.9, 1.4, 0.2]])
    _close(g0, [0.9, 1.7, 0.3])  # evaluation reads the last average
    # bytes: nothing on local steps; the model (3 floats) on the sync step; bytes_raw is DDP's per step
    assert [m["bytes_sent"] for m in l0] == [0, 12, 0] and [m.get("sync_bytes") for m in l0] == [None, 12, None]
    assert all(m["method"] == "local_sgd" and m["bytes_raw"] == 12 for m in l0 + l1)


def test_post_local_sgd_by_hand():
    """warmup 1, H = 2: step 0 averages gradients: w = (1, 2) - 0.1 * (0.5, 1.5) = (0.95, 1.85), b = 0.4 on both;
    steps 1, 2 local: rank 0 (0.85, 1.85), (0.75, 1.85); rank 1 (0.95, 1.55), (0.95, 1.25); b 0.3, 0.2;
    averaged after step 2: (0.85, 1.55), 0.2."""
    (a0, l0, _, _), (a1, _, _, _) = run_world(_hand, {"name": "post_local_sgd", "H": 2, "warmup": 1}, 3, X2,
                                              [1.0, 2.0], 0.5, 0.1, 0.0, "wfbp")
    _close(a0, [[0.95, 1.85, 0.4], [0.85, 1.85, 0.3], [0.85, 1.55, 0.2]])
    _close(a1, [[0.95, 1.85, 0.4], [0.95, 1.55, 0.3], [0.85, 1.55, 0.2]])
    assert [m["bytes_sent"] for m in l0] == [12, 0, 12] and "sync_bytes" not in l0[0] and l0[2]["sync_bytes"] == 12


def test_diloco_by_hand():
    """H = 2, outer_lr 0.5, outer_momentum 0.9 (Nesterov), inner SGD lr 0.1. Global g0 = (1, 2, 0.5).
    After steps 0, 1 (as local SGD): rank 0 (0.8, 2, 0.3), rank 1 (1, 1.4, 0.3);
    pseudo-gradients g0 - local: (0.2, 0, 0.2) and (0, 0.6, 0.2), averaged D = (0.1, 0.3, 0.2);
    torch's Nesterov SGD, first step: buf = D, update = D + 0.9 buf = 1.9 D; g1 = g0 - 0.5 * 1.9 D =
    (0.905, 1.715, 0.31), on both ranks. Steps 2, 3 give the same D again (constant gradients, plain inner SGD):
    buf = 0.9 D + D = 1.9 D, update = D + 0.9 * 1.9 D = 2.71 D; g2 = g1 - 1.355 D = (0.7695, 1.3085, 0.039)."""
    method = {"name": "diloco", "H": 2, "outer_lr": 0.5, "outer_momentum": 0.9}
    (a0, l0, _, g0), (a1, _, _, _) = run_world(_hand, method, 4, X2, [1.0, 2.0], 0.5)
    _close(a0[1], [0.905, 1.715, 0.31])
    _close(a1[1], [0.905, 1.715, 0.31])
    _close(a0[2], [0.805, 1.715, 0.21])
    _close(a1[2], [0.905, 1.415, 0.21])
    _close(a0[3], [0.7695, 1.3085, 0.039])
    _close(a1[3], [0.7695, 1.3085, 0.039])
    _close(g0, [0.7695, 1.3085, 0.039])
    assert [m.get("sync_bytes") for m in l0] == [None, 12, None, 12]


def test_streaming_diloco_by_hand():
    """fragments 2 (f0 = w, f1 = b), H = 2, tau 1, outer_lr 1, no outer momentum, alpha 0.5. Fragment f's outer
    step follows steps n = 2(f+1)/2 (mod 2), counted from 1: f0 at n = 1, 3, ...; f1 at n = 2, 4, ...; each
    issued tau = 1 step earlier (f0's first at n = 2, as n = 0 is before the start).
    n=1: local as before, b = 0.4 on both; f1 issued: D_b = 0.5 - 0.4 = 0.1.
    n=2: rank 0 w (0.8, 2), rank 1 (1, 1.4), b 0.3; f1 applied: global b = 0.5 - 0.1 = 0.4, b = 0.5 * 0.3 + 0.5 * 0.4
         = 0.35; f0 issued: D_w = avg((0.2, 0), (0, 0.6)) = (0.1, 0.3).
    n=3: rank 0 w (0.7, 2), rank 1 (1, 1.1), b 0.25; f0 applied: global w = (0.9, 1.7): rank 0 w = (0.8, 1.85),
         rank 1 w = (0.95, 1.4); f1 issued: D_b = 0.4 - 0.25 = 0.15.
    n=4: rank 0 w (0.7, 1.85), rank 1 (0.95, 1.1), b 0.15; f1 applied: global b = 0.25, b = 0.2."""
    method = {"name": "streaming_diloco", "H": 2, "fragments": 2, "tau": 1, "outer_lr": 1.0, "outer_momentum": 0.0,
              "alpha": 0.5}
    (a0, l0, _, g0), (a1, _, _, g1) = run_world(_hand, method, 4, X2, [1.0, 2.0], 0.5)
    _close(a0, [[0.9, 2, 0.4], [0.8, 2, 0.35], [0.8, 1.85, 0.25], [0.7, 1.85, 0.2]])
    _close(a1, [[1, 1.7, 0.4], [1, 1.4, 0.35], [0.95, 1.4, 0.25], [0.95, 1.1, 0.2]])
    _close(g0, [0.9, 1.7, 0.25])
    assert g0 == g1
    # issued: f1 (4 bytes) at steps 0 and 2, f0 (8 bytes) at step 1 (and at step 3: in flight at the end)
    assert [(m.get("fragment"), m.get("sync_bytes"), m.get("applied")) for m in l0] == \
        [(1, 4, None), (0, 8, 1), (1, 4, 0), (0, 8, 1)]


def test_streaming_diloco_mixes_by_alpha_at_tau_0_by_hand():
    """One fragment, H = 2, tau 0, outer_lr 1, no outer momentum, alpha 0.5: the all-reduce overlaps no inner
    step, and the local parameters are still mixed with the new global ones, alpha * local + (1 - alpha) * global.
    n=2: rank 0 (0.8, 2, 0.3), rank 1 (1, 1.4, 0.3) (as local SGD); D = avg((0.2, 0, 0.2), (0, 0.6, 0.2))
         = (0.1, 0.3, 0.2); global = (0.9, 1.7, 0.3); rank 0 = 0.5 (0.8, 2, 0.3) + 0.5 global = (0.85, 1.85, 0.3),
         rank 1 = (0.95, 1.55, 0.3) (taking the global outright would give (0.9, 1.7, 0.3) on both).
    n=3: rank 0 (0.75, 1.85, 0.2), rank 1 (0.95, 1.25, 0.2).
    n=4: rank 0 (0.65, 1.85, 0.1), rank 1 (0.95, 0.95, 0.1); D = avg((0.25, -0.15, 0.2), (-0.05, 0.75, 0.2))
         = (0.1, 0.3, 0.2) from the global copy, not the mixed parameters; global = (0.8, 1.4, 0.1);
         rank 0 = (0.725, 1.625, 0.1), rank 1 = (0.875, 1.175, 0.1)."""
    method = {"name": "streaming_diloco", "H": 2, "fragments": 1, "tau": 0, "outer_lr": 1.0, "outer_momentum": 0.0,
              "alpha": 0.5}
    (a0, l0, _, g0), (a1, _, _, g1) = run_world(_hand, method, 4, X2, [1.0, 2.0], 0.5)
    _close(a0, [[0.9, 2, 0.4], [0.85, 1.85, 0.3], [0.75, 1.85, 0.2], [0.725, 1.625, 0.1]])
    _close(a1, [[1, 1.7, 0.4], [0.95, 1.55, 0.3], [0.95, 1.25, 0.2], [0.875, 1.175, 0.1]])
    _close(g0, [0.8, 1.4, 0.1])
    assert g0 == g1
    assert [m.get("sync_bytes") for m in l0] == [None, 12, None, 12]


def test_streaming_diloco_alpha_default_keeps_the_global_at_tau_0():
    """Left out, alpha is 0.5 with tau > 0 and 0 with tau 0 (the local fragment takes the global one, as DiLoCo);
    a given alpha is kept whatever tau is. spec.json records the value used."""
    assert methods.make("streaming_diloco", tau=1).alpha == 0.5
    assert methods.make("streaming_diloco", tau=0).alpha == 0.0
    assert methods.make("streaming_diloco", tau=0, alpha=0.25).alpha == 0.25
    assert methods.make("streaming_diloco", tau=0).values()["alpha"] == 0.0
    assert methods.make("diloco").alpha == 0.0


def test_demo_by_hand():
    """chunk 2, topk 1, decay 0.5, lr 0.1, sign on; w has 4 elements (2 chunks), no bias. Orthonormal DCT of a
    chunk (a, b): c0 = (a + b)/sqrt2, c1 = (a - b)/sqrt2; keeping c0 decodes to ((a+b)/2, (a+b)/2), keeping c1
    to ((a-b)/2, (b-a)/2). Gradients (= inputs): rank 0 (3, 1 | 1, 3), rank 1 (1, -1 | 2, 1).
    step 0: rank 0 keeps c0, c0: sends (2, 2 | 2, 2), keeps momentum (1, -1 | -1, 1);
            rank 1 keeps c1, c0: sends (1, -1 | 1.5, 1.5), keeps (0, 0 | 0.5, -0.5).
            average (1.5, 0.5 | 1.75, 1.75): sign (1, 1, 1, 1): w -= 0.1.
    step 1: m = 0.5 m + g: rank 0 (3.5, 0.5 | 0.5, 3.5) sends (2, 2 | 2, 2), keeps (1.5, -1.5 | -1.5, 1.5);
            rank 1 (1, -1 | 2.25, 0.75) sends (1, -1 | 1.5, 1.5), keeps (0, 0 | 0.75, -0.75); sign (1, 1, 1, 1)."""
    x = [[3.0, 1.0, 1.0, 3.0], [1.0, -1.0, 2.0, 1.0]]
    method = {"name": "demo", "chunk": 2, "topk": 1, "decay": 0.5}
    (a0, l0, m0, _), (a1, _, m1, _) = run_world(_hand, method, 2, x, [1.0, 2.0, 3.0, 4.0])
    _close(a0, [[0.9, 1.9, 2.9, 3.9], [0.8, 1.8, 2.8, 3.8]])
    assert a0 == a1
    _close(m0[0].reshape(-1).tolist(), [1.5, -1.5, -1.5, 1.5])
    _close(m1[0].reshape(-1).tolist(), [0, 0, 0.75, -0.75])
    # every step sends 2 chunks x 1 coefficient x (4 bytes of value + 2 of position)
    assert [m["bytes_sent"] for m in l0] == [12, 12] and [m["sync_bytes"] for m in l0] == [12, 12]


def test_demo_without_sign_steps_the_average():
    """sign off: the update is the decoded average (1.5, 0.5 | 1.75, 1.75) of step 0 above, times lr."""
    x = [[3.0, 1.0, 1.0, 3.0], [1.0, -1.0, 2.0, 1.0]]
    method = {"name": "demo", "chunk": 2, "topk": 1, "decay": 0.5, "sign": False}
    (a0, _, _, _), _ = run_world(_hand, method, 1, x, [1.0, 2.0, 3.0, 4.0])
    _close(a0, [[1 - 0.15, 2 - 0.05, 3 - 0.175, 4 - 0.175]])


def test_dct_codec_round_trip():
    """The DCT basis is orthonormal; with topk = chunk the codec is lossless."""
    d = dct_basis(8, torch.float64, "cpu")
    torch.testing.assert_close(d @ d.T, torch.eye(8, dtype=torch.float64))
    c = DCTTopK(chunk=8, topk=8)
    t = torch.randn(32, dtype=torch.float64)
    payload, ctx = c.compress(t)
    torch.testing.assert_close(c.decompress(payload, ctx), t)
    assert payload[1].dtype == torch.int16 and payload[0].shape == (4, 8)


# --------------------------------------------------------------------------- schedules (pure)

def test_schedules_say_which_steps_send_what():
    lin = [8, 4]  # Lin's weight (2 floats) and bias (1 float)
    m = methods.make("local_sgd", H=4)
    assert [(e.step, e.kind, e.bytes, e.overlap) for e in m.schedule(lin, 10)] == [(3, "params", 12, 0),
                                                                                   (7, "params", 12, 0)]
    m = methods.make("post_local_sgd", warmup=2, H=3)
    assert [(e.step, e.kind) for e in m.schedule(lin, 9)] == [(0, "gradients"), (1, "gradients"), (4, "params"),
                                                              (7, "params")]
    m = methods.make("diloco", H=5)
    assert [(e.step, e.kind, e.bytes) for e in m.schedule(lin, 12)] == [(4, "pseudo", 12), (9, "pseudo", 12)]
    m = methods.make("streaming_diloco", H=2, fragments=2, tau=1)  # the hand-computed example's
    assert [(e.step, e.fragment, e.bytes, e.overlap) for e in m.schedule(lin, 4)] == \
        [(0, 1, 4, 1), (1, 0, 8, 1), (2, 1, 4, 1), (3, 0, 8, 1)]
    m = methods.make("streaming_diloco", H=6, fragments=3, tau=0)  # staggered: one fragment every 2 steps
    assert [(e.step, e.fragment) for e in m.schedule([4, 4, 4], 12)] == [(1, 0), (3, 1), (5, 2), (7, 0), (9, 1),
                                                                         (11, 2)]
    # DeMo: 4 + 1 elements in chunks of 2 -> 2 + 1 rows, one coefficient each, 4 bytes of value + 2 of position
    m = methods.make("demo", chunk=2, topk=1)
    assert [e.bytes for e in m.schedule([16, 4], 3)] == [18, 18, 18]
    for m in (methods.make("local_sgd", H=3), methods.make("streaming_diloco", H=5, fragments=2, tau=2),
              methods.make("demo")):
        assert [s for s in range(20) if m.exchanges_at(s)] == sorted({e.step for e in m.schedule([4, 4], 20)
                                                                       if e.kind != "gradients"})


def test_fragments_split_by_bytes():
    assert split_even([8, 4], 2) == [[0], [1]]
    assert split_even([1, 1, 1, 1, 1, 1], 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_even([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]  # every fragment holds a tensor
    with pytest.raises(ValueError, match="fragments"):
        split_even([4, 4], 3)


# --------------------------------------------------------------------------- bad parameters: one line

@pytest.mark.parametrize("method, extra, field", [
    ({"name": "diloco", "H": 0}, {}, "method.H"),
    ({"name": "local_sgd", "H": 2.5}, {}, "method.H"),
    ({"name": "diloco", "outer_lr": -1}, {}, "method.outer_lr"),
    ({"name": "diloco", "outer_momentum": 1.0}, {}, "method.outer_momentum"),
    ({"name": "diloco", "inner_lr": 0.1}, {}, "method.inner_lr"),
    ({"name": "streaming_diloco", "H": 4, "fragments": 5}, {}, "method.fragments"),
    ({"name": "streaming_diloco", "H": 4, "tau": 4}, {}, "method.tau"),
    ({"name": "demo", "topk": 65, "chunk": 64}, {}, "method.topk"),
    ({"name": "teleport"}, {}, "method.name"),
    ({"name": "nosuchpkg.mod:Thing"}, {}, "method.name"),
    ({"name": "diloco"}, {"comm": "dear"}, "comm.mode"),
    ({"name": "local_sgd"}, {"schedule": "mergecomp"}, "schedule.name"),
    ({"name": "diloco"}, {"compressor": {"name": "topk", "ratio": 0.01}}, "compressor.name"),
    ({"name": "diloco", "compressor": {"name": "topk", "ratio": 2}}, {}, "method.compressor"),
    ({"name": "local_sgd", "compressor": "fp16"}, {}, "method.compressor"),
    ({"name": "demo"}, {"optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9}}, "optimizer.momentum"),
    ({"name": "local_sgd", "H": 4}, {"fault": {"kind": "raise", "at": "sync", "step": 2}}, "fault.step"),
    ({"name": "none"}, {"fault": {"kind": "raise", "at": "sync"}}, "fault.at"),
    ({"name": "diloco"}, {"strategy": "auto", "network": {"link": "modeled", "gbps": 1}}, "strategy.mode"),
])
def test_bad_parameters_get_one_line_naming_the_field(tmp_path, capsys, method, extra, field):
    assert_refused_in_one_line(tmp_path, capsys, method, extra, field)


def assert_refused_in_one_line(tmp_path, capsys, method, extra, field):
    """`commlab run` of an mlp spec with ``method`` and ``extra`` exits 2 with one line naming ``field``, and
    creates no run."""
    from commlab.lab.front.cli import main as cli
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps({"model": "mlp", "steps": 5, "method": method, **extra}))
    runs = tmp_path / "runs"
    assert cli(["run", str(spec), "--runs", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"commlab: error: {field}:"), err
    assert not runs.exists() or not any(p for p in runs.iterdir() if not p.name.startswith("."))


def test_more_fragments_than_tensors_is_refused_before_any_rank():
    """The mlp has 6 parameter tensors: 7 fragments cannot each hold one (the lab's preflight builds the model)."""
    from commlab.engine import preflight
    from commlab.lab.service.admission import needs_first_batch
    spec = JobSpec.from_dict({"model": "mlp", "method": {"name": "streaming_diloco", "H": 8, "fragments": 7}})
    assert needs_first_batch(spec)
    assert not needs_first_batch(JobSpec.from_dict({"model": "mlp", "method": {"name": "diloco", "H": 8}}))
    with pytest.raises(SpecError, match=r"^method\.fragments: must be at most the model's 6 parameter tensors"):
        preflight.check(spec)
    preflight.check(JobSpec.from_dict({"model": "mlp", "method": {"name": "streaming_diloco", "H": 8, "fragments": 6}}))


def test_a_users_method_by_import_path(tmp_path, monkeypatch):
    """A Method subclass in the user's own module is named by import path, its parameters checked as a built-in's."""
    (tmp_path / "mymeth.py").write_text(
        "from commlab.engine.compressors.params import Param\n"
        "from commlab.engine.methods.local_sgd import LocalSGD\n"
        "class Every(LocalSGD):\n"
        "    name = 'every'\n"
        "    params = (Param('H', int, 3, 'steps between averages', lo=2),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = JobSpec.from_dict({"model": "mlp", "method": {"name": "mymeth:Every"}})
    assert spec.method.params == {"H": 3} and spec.method.build().exchanges_at(2)
    with pytest.raises(SpecError, match=r"^method\.H: must be an integer >= 2, got 1$"):
        JobSpec.from_dict({"model": "mlp", "method": {"name": "mymeth:Every", "H": 1}})
    with pytest.raises(SpecError, match=r"^method\.name: .*not a subclass"):
        JobSpec.from_dict({"model": "mlp", "method": {"name": "json:dumps"}})


def test_method_none_changes_nothing():
    """The default spec has method none, and its spec.json form round-trips."""
    s = JobSpec.from_dict({"model": "mlp"})
    assert s.method.name == "none" and s.method.build() is None
    d = JobSpec.from_dict({"model": "mlp", "method": {"name": "diloco", "H": 7, "compressor": {"name": "int8"}}})
    assert JobSpec.from_dict(d.to_dict()) == d
    assert d.to_dict()["method"]["params"] == {"H": 7, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
                                               "overlap": "none"}


# --------------------------------------------------------------------------- the examples train from the CLI

def commlab(*args, timeout=300, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def only_run(runs: Path) -> Path:
    (d,) = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")]
    return d


EXAMPLES = {"local_sgd": "params", "post_local_sgd": "params", "diloco": "pseudo", "streaming_diloco": "pseudo",
            "demo_momentum": "components"}
"""Each method's example (examples/<name>.yaml; DeMo's is demo_momentum.yaml, as examples/demo.yaml is the UI's
demo run) and the kind of its exchanges."""


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_trains_from_the_cli_and_sends_what_its_schedule_says(tmp_path, name):
    """8 steps of the example on the mlp: the run is done, its step lines carry the method, a local step sends
    nothing, the sync steps are the schedule's (with the bytes it says where nothing compresses them), the
    timeline has the method's lane, and the summary shows bytes amortized and per sync."""
    from commlab.engine import preflight
    from commlab.lab.base.specs import load_spec
    runs = tmp_path / "runs"
    sets = ["steps=8", "model=mlp", "eval_every=0", "threads=1", "timeline=true"]
    sets += {"post_local_sgd": ["method.warmup=2", "method.H=3"], "demo_momentum": []}.get(name, ["method.H=4"])
    r = commlab("run", ROOT / "examples" / f"{name}.yaml", "--quiet", "--runs", runs,
                *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = only_run(runs)
    spec = load_spec(str(run_dir / "spec.json"))
    steps = [m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if m["kind"] == "step"]
    assert len(steps) == 16 and all(m["method"] == spec.method.name for m in steps)
    m = spec.method.build()
    sizes = [b for _, b in preflight.parameters(spec)]
    events = [e for e in m.schedule(sizes, 8) if e.kind != "gradients"]
    assert {e.kind for e in events} == {EXAMPLES[name]}
    for rank in (0, 1):
        mine = {x["step"]: x for x in steps if x["rank"] == rank}
        assert sorted(s for s, x in mine.items() if "sync_bytes" in x) == sorted({e.step for e in events})
        for s, x in mine.items():
            want = [e for e in events if e.step == s]
            if not want and (name != "post_local_sgd" or s >= spec.method.params["warmup"]):
                assert x["bytes_sent"] == 0, (s, x)  # a local step sends nothing
            if want and spec.method.compressor.get("name", "none") == "none":
                assert x["sync_bytes"] == sum(e.bytes for e in want) == x["bytes_sent"], (s, x)
    lanes = {e["cat"] for e in read_jsonl(str(run_dir / "timeline-rank0.jsonl"))}
    assert ("fragment" if name == "streaming_diloco" else "outer") in lanes
    show = commlab("show", run_dir.name, "--runs", runs)
    assert show.returncode == 0 and "amortized" in show.stdout and "per sync" in show.stdout, show.stdout


def test_sparseloco_recipe_is_diloco_by_configuration(tmp_path):
    """DiLoCo with top-k 10% and error feedback on the pseudo-gradient: each sync sends about a tenth of the
    model (values and int32 positions: 0.1 * (4 + 4) / 4 = 0.2 of its bytes), and it trains."""
    runs = tmp_path / "runs"
    r = commlab("run", ROOT / "examples" / "diloco.yaml", "--quiet", "--runs", runs, "--set", "steps=8",
                "--set", "model=mlp", "--set", "threads=1", "--set", "eval_every=0", "--set",
                "method={name: diloco, H: 4, compressor: {name: topk, ratio: 0.1, error_feedback: true}}")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_jsonl(str(only_run(runs) / "metrics.jsonl"))
    syncs = [m for m in rows if m.get("sync_bytes")]
    raw = rows[0]["bytes_raw"]
    assert len(syncs) == 4 and all(0.15 * raw < m["sync_bytes"] < 0.25 * raw for m in syncs), (raw, syncs)
    assert [m for m in rows if m["kind"] == "eval"][-1]["eval_acc"] > 0.3


# --------------------------------------------------------------------------- a rank killed mid-sync

SMALL = {"name": "fault", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 12, "batch_size": 16,
         "eval_every": 0, "threads": 1, "comm": "sync"}


@pytest.mark.parametrize("method, fault, rank, says", [
    ({"name": "local_sgd", "H": 3}, {"kind": "raise", "at": "sync", "step": 5, "rank": 1}, 1,
     "injected fault at step 5 on rank 1, in the method's sync"),
    ({"name": "streaming_diloco", "H": 4, "fragments": 2, "tau": 2}, {"kind": "exit", "at": "sync", "step": 3,
                                                                       "rank": 0}, 0, "exited with code 17"),
    ({"name": "diloco", "H": 3}, {"kind": "raise", "at": "start", "step": 2, "rank": 1}, 1,
     "injected fault at step 2 on rank 1"),
])
def test_a_rank_failing_mid_sync_fails_the_run_and_loses_nothing(tmp_path, method, fault, rank, says):
    """The failing rank dies right after issuing its sync's collective (or at the start of a sync step): the run
    ends failed naming that rank and its error; every line is whole; the failing rank kept every step before the
    fault; the other kept consecutive steps, at least up to the last sync before the fault (local steps do not
    wait for each other, so it may be behind: torchrun stops it wherever it is); no process of the run is left."""
    import commlab
    from commlab.lab.base import procs
    run = commlab.run(dict(SMALL, method=method, fault=fault), runs=tmp_path)
    st = run.status()
    assert st["state"] == "failed" and st["rank"] == rank and says in st["error"], st
    rows = read_jsonl(str(run.path / "metrics.jsonl"))
    with open(run.path / "metrics.jsonl") as f:
        assert len(rows) == sum(1 for line in f if line.strip())  # nothing half-written
    m = JobSpec.from_dict(dict(SMALL, method=method)).method.build()
    before = [s for s in range(fault["step"]) if m.exchanges_at(s)]
    for r in (0, 1):
        done = sorted(x["step"] for x in rows if x["kind"] == "step" and x["rank"] == r)
        assert done == list(range(len(done))), (r, done)
        assert len(done) >= (fault["step"] if r == rank else before[-1] if before else 0), (r, done)
    left = [i for i in run.worker_pids() + [st.get("torchrun")] if procs.alive(i)]  # (this process supervised it)
    assert not left, left


# --------------------------------------------------------------------------- commlab.wrap: your own loop

def test_wrap_local_sgd_h1_matches_torch_ddp(tmp_path, own_loop_ddp):
    """examples/own_loop.py (its own loop, SGD with momentum 0.9 from its factory) with local SGD at H = 1 through
    commlab.wrap: the method's hooks run around the script's optimizer, and the parameters are torch DDP's."""
    assert OWN_LOOP_DDP_STEPS == 10  # the step count below (20 steps: 10 on each rank)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"comm": "wfbp", "method": {"name": "local_sgd", "H": 1}}))
    ours = torchrun_own_loop(tmp_path, "--spec", spec, "--runs", tmp_path / "runs", "--steps", 10,
                             "--save", tmp_path / "ours")
    assert ours.returncode == 0, ours.stdout[-3000:]
    ref = own_loop_ddp  # the script with --ddp --steps 10, run once for the suite (tests/conftest.py)
    assert ref.returncode == 0, ref.stdout[-3000:]
    for r in (0, 1):
        a, b = torch.load(tmp_path / f"ours.rank{r}"), torch.load(f"{ref.save}.rank{r}")
        for n in a:
            torch.testing.assert_close(a[n], b[n], atol=2e-6, rtol=1e-5, msg=f"rank {r} {n} differs from DDP")
    steps = [m for m in read_jsonl(str(only_run(tmp_path / "runs") / "metrics.jsonl")) if m["kind"] == "step"]
    assert len(steps) == 20 and all(m["method"] == "local_sgd" and m["sync_bytes"] == m["bytes_sent"] > 0
                                    for m in steps)


def test_wrap_streaming_diloco_with_its_fragments_in_flight(tmp_path):
    """Streaming DiLoCo through commlab.wrap: fragments issued and applied on the schedule's steps, the last one
    still in flight at the end is drained by close, the run is done and evaluation reads the global model."""
    spec = tmp_path / "spec.json"
    method = {"name": "streaming_diloco", "H": 4, "fragments": 2, "tau": 1, "compressor": {"name": "fp16"}}
    spec.write_text(json.dumps({"name": "own-streaming", "comm": "sync", "method": method}))
    p = torchrun_own_loop(tmp_path, "--spec", spec, "--runs", tmp_path / "runs", "--steps", 24, "--lr", 0.1)
    assert p.returncode == 0, p.stdout[-3000:]
    run_dir = only_run(tmp_path / "runs")
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    rows = read_jsonl(str(run_dir / "metrics.jsonl"))
    m = methods.make("streaming_diloco", H=4, fragments=2, tau=1)
    issued = sorted(x["step"] for x in rows if x["kind"] == "step" and x["rank"] == 0 and "fragment" in x)
    assert issued == [s for s in range(24) if m.exchanges_at(s)]
    assert [x["eval_acc"] for x in rows if x["kind"] == "eval"][0] > 0.2
    names = {e["name"] for e in read_jsonl(str(run_dir / "timeline-rank1.jsonl")) if e["cat"] == "fragment"}
    assert {"encode f0", "allreduce f0", "decode f1"} <= names, names
