"""The methods that communicate less often (engine/methods/), held to their definitions: with H = 1 they
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

from distutil import run_world
from engine import methods
from engine.methods.demo import DCTTopK, dct_basis
from engine.methods.diloco import split_even
from engine.runlog import read_jsonl
from engine.spec import JobSpec, SpecError
from engine.stepper import Stepper
from engine.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
MLP = {"model": "mlp", "dataset": "digits", "batch_size": 16, "eval_every": 0, "threads": 1, "timeline": False,
       "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "schedule": "allinone"}


# --------------------------------------------------------------------------- H = 1 is synchronous training

def _train_specs(rank, world, specs, steps):
    """Each spec trained ``steps`` steps from the same start on the same batches; the final parameters."""
    out = []
    for d in specs:
        spec = JobSpec.from_dict({**MLP, **d, "world_size": world})
        tr = Trainer(spec, None, rank, world, torch.device("cpu"))
        try:
            for _ in range(steps):
                tr.train_step()
            tr.stepper.drain()
            out.append([p.detach().clone() for p in tr.model.parameters()])
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


def _hand(rank, world, method, steps, x_by_rank, w0, b0=None, lr=0.1, momentum=0.0, comm="sync"):
    """Steps of ``method`` on Lin with constant inputs (so constant gradients): each rank's parameters after
    each step, and its step lines."""
    torch.manual_seed(rank)
    model = Lin(len(w0), bias=b0 is not None)
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([w0]))
        if b0 is not None:
            model.fc.bias.fill_(b0)
    spec = JobSpec.from_dict({"world_size": world, "optimizer": {"name": "sgd", "lr": lr, "momentum": momentum},
                              "comm": comm, "schedule": "allinone", "method": method, "timeline": False})
    st = Stepper(spec, model, None, rank, torch.device("cpu"))
    lines = []
    st.log = lines.append  # the step lines, as metrics.jsonl would get them
    x = torch.tensor(x_by_rank[rank])
    after = []
    tl = st.timeline
    for _ in range(steps):
        t0, m0 = tl.now(), tl.mark()
        loss = model(x)
        t1, m1 = tl.now(), tl.mark()
        loss.backward()
        st.step_after_backward(loss, t0, t1, tl.now(), m0, m1, tl.mark())
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
    (a0, l0, _, g0), (a1, l1, _, g1) = run_world(_hand, {"name": "local_sgd", "H": 2}, 3, X2, [1.0, 2.0], 0.5)
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
