"""The 2025-26 low-communication pieces held to their definitions: the 4-bit codec of Streaming DiLoCo's outer
updates (``int4``), SparseLoCo (``sparseloco``: chunked top-k, 2-bit values, a decaying error-feedback
accumulator instead of the outer momentum) and DiLoCo's overlapped outer step (``overlap: delayed | eager``).

Each is checked on two gloo ranks with different gradients on a tiny linear model, against a reference written
here in plain torch from the papers' equations (no engine code), to 1e-6; the simplest cases also against numbers
worked out by hand (in the docstrings). World size 2, gloo on CPU, one thread per rank."""

import pytest
import torch

from distutil import run_world
from commlab.engine import compressors, methods
from commlab.engine.methods.base import Event
from commlab.engine.spec import JobSpec

LR = 0.1
"""The inner SGD's learning rate (no momentum): with loss = w . x, each inner step moves w by -LR * x."""


def _run(rank, world, method, xs, w0, b0=None):
    """``len(xs[rank])`` steps of ``method`` on Lin, rank r's input at step s being ``xs[r][s]``: each rank's flat
    parameters after each step, its step lines, its global parameters and, where the method has them, its
    groups' error-feedback residuals after the last step."""
    from test_methods import lin_stepper
    model, st = lin_stepper(rank, world, method, w0, b0, LR)
    lines, after = [], []
    st.log = lines.append
    tl = st.timeline
    for x in xs[rank]:
        t0, m0 = tl.now(), tl.mark()
        loss = model(torch.tensor(x))
        t1, m1 = tl.now(), tl.mark()
        loss.backward()
        st.step_after_backward(loss, t0, t1, tl.now(), m0, m1, tl.mark())
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
    glob = torch.cat([t.reshape(-1) for t in st.method.global_params()]).tolist()
    res = [getattr(g.compressor, "residual", None) for gs in st.method.parts for g in gs]
    res = [None if r is None else r.tolist() for r in res]
    st.close()
    return after, lines, glob, res


def _close(got, want):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- the references, in plain torch

def int4_ref(x, block):
    """Block-wise 4-bit: each block's scale is its largest magnitude / 7; each element round(x / scale)."""
    out = torch.empty_like(x)
    for a in range(0, x.numel(), block):
        b = x[a:a + block]
        s = b.abs().max() / 7
        out[a:a + block] = (b / s).round().clamp(-7, 7) * s if s > 0 else 0
    return out


def topk2bit_ref(x, chunk, k):
    """Each chunk keeps its k largest magnitudes (a short last chunk ceil(k r / chunk)), each sent as the
    nearest of (-s, -s/3, s/3, s), s the chunk's largest kept magnitude."""
    out = torch.zeros_like(x)
    for a in range(0, x.numel(), chunk):
        c = x[a:a + chunk]
        kk = -(-k * c.numel() // chunk)
        i = c.abs().topk(kk).indices
        s = c[i].abs().max()
        code = (1.5 * c[i] / s + 1.5).round().clamp(0, 3) if s > 0 else torch.full((kk,), 2.0)
        out[a + i] = (2 * code - 3) / 3 * s
    return out


def reference(xs, w0, H, outer_lr, momentum=0.0, nesterov=False, overlap="none", codec=None, beta=None):
    """DiLoCo on two (or more) ranks from its equations, with inner SGD at LR on the gradients xs[r][s]:
    every H steps each rank's pseudo-gradient d_r = global - local; ``codec`` (a function of a flat tensor)
    compresses it, through an error feedback whose residual decays by ``beta`` when ``beta`` is given
    (SparseLoCo: e = beta e + d, sent = codec(e), e = e - sent); the average goes to an outer SGD (momentum,
    Nesterov) on the global parameters. overlap delayed: sync t's average is stepped with at sync t + 1;
    eager: at sync t + 1 each rank steps with avg_t + (d_r(t+1) - d_r(t)) / world, and at the first sync with
    d_r(1) / world. The local parameters then take their rank's global ones. Returns each rank's parameters
    after each step and its global parameters at the end."""
    world = len(xs)
    glob = [torch.tensor(w0, dtype=torch.float32) for _ in range(world)]
    local = [g.clone() for g in glob]
    opts = [torch.optim.SGD([g], lr=outer_lr, momentum=momentum, nesterov=nesterov and momentum > 0) for g in glob]
    err = [None] * world
    prev_avg, prev_own = None, [None] * world
    after = [[] for _ in range(world)]
    for s in range(len(xs[0])):
        for r in range(world):
            local[r] -= LR * torch.tensor(xs[r][s])
        if (s + 1) % H == 0:
            d = [glob[r] - local[r] for r in range(world)]
            sent = []
            for r in range(world):
                x = d[r] if beta is None else (d[r] if err[r] is None else d[r] + beta * err[r])
                y = x if codec is None else codec(x)
                if beta is not None:
                    err[r] = x - y
                sent.append(y)
            avg = sum(sent) / world
            for r in range(world):
                if overlap == "none":
                    grad = avg
                elif overlap == "delayed":
                    grad = prev_avg
                else:
                    grad = d[r] / world if prev_avg is None else d[r] / world + prev_avg - prev_own[r] / world
                    prev_own[r] = d[r]
                if grad is not None:
                    with torch.no_grad():
                        glob[r].grad = grad.clone()
                        opts[r].step()
                        glob[r].grad = None
                local[r] = glob[r].detach().clone()
            prev_avg = avg
        for r in range(world):
            after[r].append(local[r].tolist())
    return after, [g.tolist() for g in glob], err


# --------------------------------------------------------------------------- int4

def test_int4_codes_by_hand_and_bytes_on_the_wire():
    """block 4, x = (0.6, -1.4, 0.13, 0.45 | 2, 0, 0, -0.5 | 3.5): scales 1.4/7 = 0.2, 2/7, 3.5/7 = 0.5; codes
    (3, -7, 1, 2 | 7, 0, 0, -2 | 7), sent as nibbles code + 8 = (11, 1, 9, 10, 15, 8, 8, 6, 15), two per byte,
    the first high: 0xB1 0x9A 0xF8 0x86 0xF0. Decoded: (0.6, -1.4, 0.2, 0.4 | 2, 0, 0, -4/7 | 3.5).
    Bytes: 3 scales (12) + 5 = 17, in one all-gather of two tensors."""
    c = compressors.make("int4", block=4)
    x = torch.tensor([0.6, -1.4, 0.13, 0.45, 2.0, 0.0, 0.0, -0.5, 3.5])
    payload, ctx = c.compress(x)
    _close(payload[0].tolist(), [0.2, 2 / 7, 0.5])
    assert payload[1].tolist() == [0xB1, 0x9A, 0xF8, 0x86, 0xF0] and payload[1].dtype == torch.uint8
    _close(c.decompress(payload, ctx).tolist(), [0.6, -1.4, 0.2, 0.4, 2, 0, 0, -4 / 7, 3.5])
    assert sum(t.numel() * t.element_size() for t in payload) == 17
    assert c.declared_rounds(9, 4) == [("allgather", 17, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_round_trip(dtype):
    """Every element comes back within half its block's scale (largest magnitude / 14) and as the reference's;
    values on the grid (a scale times integers in -7..7) come back as they are; 7.5x fewer bytes than fp32."""
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.linspace(0.1, 10, 1000)
    c = compressors.make("int4")
    payload, ctx = c.compress(x.to(dtype))
    y = c.decompress(payload, ctx)
    assert y.dtype == dtype and y.shape == x.shape
    xs = x.to(dtype).float()
    torch.testing.assert_close(y.float(), int4_ref(xs, 128).to(dtype).float(), atol=1e-6,
                               rtol=1e-6 if dtype == torch.float32 else 1e-2)
    for a in range(0, 1000, 128):
        blk = xs[a:a + 128]
        assert (y.float()[a:a + 128] - blk).abs().max() <= blk.abs().max() / 14 * 1.1
    grid = torch.tensor([-7, -3, 0, 1, 5, 7] * 10, dtype=torch.float32) * 0.25
    p, cx = c.compress(grid)
    torch.testing.assert_close(c.decompress(p, cx), grid, atol=1e-7, rtol=0)
    assert sum(t.numel() * t.element_size() for t in payload) == 4 * 8 + 500  # 8 blocks, 2 codes a byte


def test_streaming_diloco_sends_its_outer_updates_in_4_bits():
    """method: {name: streaming_diloco, compressor: {name: int4}} (one fragment, tau 0, outer_lr 1, no momentum),
    H = 2 on Lin (w, b). After 2 steps the pseudo-gradients are rank 0 (0.2, 0, 0.2), rank 1 (0, 0.6, 0.2).
    In 4 bits: rank 0's scale 0.2/7 holds them exactly; rank 1's scale 0.6/7 turns 0.2 into code 2, 1.2/7.
    Average (0.1, 0.3, (0.2 + 1.2/7)/2); global = (1, 2, 0.5) - average. Each sync sends 3 elements in one
    block: a 4-byte scale and 2 bytes of codes, 6 bytes."""
    x = [[[1.0, 0.0]] * 4, [[0.0, 3.0]] * 4]
    method = {"name": "streaming_diloco", "H": 2, "fragments": 1, "tau": 0, "outer_lr": 1.0, "outer_momentum": 0.0,
              "compressor": {"name": "int4"}}
    (a0, l0, g0, _), (a1, _, g1, _) = run_world(_run, method, x, [1.0, 2.0], 0.5)
    avg = (0.1, 0.3, (0.2 + 1.2 / 7) / 2)
    _close(a0[1], [1 - avg[0], 2 - avg[1], 0.5 - avg[2]])
    assert a0[1] == a1[1] and g0 == g1
    ref, _, _ = reference([[xx + [1.0] for xx in x[r]] for r in range(2)], [1.0, 2.0, 0.5], 2, 1.0,
                          codec=lambda t: int4_ref(t, 128))
    _close(a0, ref[0])
    _close(a1, ref[1])
    assert [m.get("sync_bytes") for m in l0] == [None, 6, None, 6]


# --------------------------------------------------------------------------- topk_2bit

def test_topk_2bit_selects_per_chunk_and_sends_2_bits_by_hand():
    """chunk 4, k 2 on (1, -3, 0.5, 2 | 0.1, 0.2, -0.9, 0.3 | 5, 1): chunk 0 keeps -3 and 2 (positions 1, 3),
    scale 3: -3 is code 0 (-s), 2 is code round(1.5 * 2/3 + 1.5) = round(2.5) = 2 (s/3 = 1); chunk 1 keeps
    -0.9, 0.3 (positions 2, 3), scale 0.9: codes 0, 2 (-0.9, 0.3); the last chunk (2 elements) keeps
    ceil(2 * 2 / 4) = 1: 5 (position 0), code 3. Codes (0, 2, 0, 2, 3), four a byte: 0b00100010, 0b11000000.
    Bytes: 3 scales (12) + 5 int16 positions (10) + 2 = 24."""
    c = compressors.make("topk_2bit", chunk=4, k=2)
    x = torch.tensor([1.0, -3.0, 0.5, 2.0, 0.1, 0.2, -0.9, 0.3, 5.0, 1.0])
    payload, ctx = c.compress(x)
    scales, pos, codes = payload
    _close(scales.tolist(), [3, 0.9, 5])
    assert pos.dtype == torch.int16 and pos.tolist() == [1, 3, 2, 3, 0]
    assert codes.tolist() == [0b00100010, 0b11000000]
    _close(c.decompress(payload, ctx).tolist(), [0, -3, 0, 1, 0, 0, -0.9, 0.3, 5, 0])
    _close(c.decompress(payload, ctx).tolist(), topk2bit_ref(x, 4, 2).tolist())
    assert sum(t.numel() * t.element_size() for t in payload) == 24
    assert c.declared_rounds(10, 4) == [("allgather", 24, 3)]
    torch.manual_seed(1)
    y = torch.randn(10_000)
    p, cx = compressors.make("topk_2bit").compress(y)  # defaults: 4096 / 64
    torch.testing.assert_close(compressors.make("topk_2bit").decompress(p, cx), topk2bit_ref(y, 4096, 64))
    assert (compressors.make("topk_2bit").decompress(p, cx) != 0).sum() == 64 + 64 + 29  # 1808 * 64 / 4096 -> 29


# --------------------------------------------------------------------------- SparseLoCo

X3 = [[[1.0, 0.5, -0.25]] * 2 + [[2.0, -0.5, 0.25]] * 4, [[0.0, 2.0, 1.0]] * 6]
"""Lin without bias, three weights: rank r's gradient at each step; rank 0's changes after the first sync."""


def test_sparseloco_by_hand():
    """chunk 3 (the whole model), k 2, beta 0.5, outer_lr 1, H 2, inner SGD lr 0.1, w = (1, 2, 3). After steps 0, 1
    the pseudo-gradients are d0 = (0.2, 0.1, -0.05), d1 = (0, 0.4, 0.2).
    Rank 0: e = d0; it keeps 0.2 and 0.1, scale 0.2; 0.1 is code round(1.5 * 0.5 + 1.5) = 2, 0.2/3: sends
    (0.2, 0.2/3, 0) and keeps e = (0, 0.1/3, -0.05). Rank 1: keeps 0.4 and 0.2, scale 0.4; 0.2 -> 0.4/3: sends
    (0, 0.4, 0.4/3), keeps e = (0, 0, 0.2/3). Average (0.1, 0.7/3, 0.2/3); global = w - average, on both ranks.
    The second sync decays e by beta before adding the new pseudo-gradient (the reference computes it)."""
    method = {"name": "sparseloco", "H": 2, "outer_lr": 1.0, "beta": 0.5, "chunk": 3, "k": 2}
    x = [X3[0][:4], X3[1][:4]]
    r0, r1 = run_world(_run, {**method}, x, [1.0, 2.0, 3.0])
    (a0, l0, g0, e0), (a1, _, g1, e1) = r0, r1
    _close(a0[1], [0.9, 2 - 0.7 / 3, 3 - 0.2 / 3])
    assert a0[1] == a1[1]
    ref, glob, err = reference(x, [1.0, 2.0, 3.0], 2, 1.0, codec=lambda t: topk2bit_ref(t, 3, 2), beta=0.5)
    _close(a0, ref[0])
    _close(a1, ref[1])
    _close(g0, glob[0])
    assert g0 == g1
    _close(e0[0], err[0].tolist())  # the residual after the second sync: what rank 0 has not sent yet
    _close(e1[0], err[1].tolist())
    # two kept entries (int16 positions) and one scale per sync: 4 + 2 * 2 + 1 bytes
    assert [m.get("sync_bytes") for m in l0] == [None, 9, None, 9]


def test_sparseloco_is_diloco_with_its_codec_and_no_outer_momentum():
    """The recipe's defaults, and what the spec records; no method.compressor; bytes at 1.56%."""
    m = methods.make("sparseloco")
    assert m.values() == {"H": 50, "outer_lr": 1.0, "beta": 0.95, "chunk": 4096, "k": 64, "overlap": "none"}
    assert isinstance(m, methods.REGISTRY["diloco"]) and not m.takes_compressor
    assert m.outer_momentum == 0.0 and m.codec().describe() == "topk_2bit(chunk=4096,k=64)+EF"
    assert m.codec().decay == 0.95
    s = JobSpec.from_dict({"model": "mlp", "method": {"name": "sparseloco", "H": 8}})
    assert s.to_dict()["method"]["params"]["H"] == 8 and JobSpec.from_dict(s.to_dict()) == s
    assert [(e.step, e.kind, e.bytes, e.overlap) for e in m.schedule([4 * 8192], 100)] == [
        (49, "pseudo", 32768, 0), (99, "pseudo", 32768, 0)]


# --------------------------------------------------------------------------- overlapped outer updates

X2 = [[[1.0, 0.0]] * 2 + [[2.0, 0.0]] * 2 + [[1.0, 0.0]] * 2, [[0.0, 3.0]] * 6]
"""Lin with a bias: rank 0's gradient w changes from sync to sync, rank 1's does not; b's is 1."""


def test_overlap_delayed_applies_the_outer_step_one_sync_late_by_hand():
    """DiLoCo, H 2, outer_lr 1, no momentum, overlap delayed; w = (1, 2), b = 0.5; gradients rank 0 (1, 0) for
    steps 0-1, (2, 0) for 2-3, (1, 0) for 4-5; rank 1 (0, 3); b's 1.
    sync 1 (after step 1): d0 = (0.2, 0, 0.2), d1 = (0, 0.6, 0.2) issued; nothing has arrived: no outer step,
      the local parameters go back to the global ones, (1, 2, 0.5);
    sync 2 (step 3): d0 = (0.4, 0, 0.2), d1 = (0, 0.6, 0.2) issued; sync 1's average (0.1, 0.3, 0.2) arrives:
      global = (0.9, 1.7, 0.3) (what DiLoCo had after sync 1);
    sync 3 (step 5): sync 2's average (0.2, 0.3, 0.2): global = (0.7, 1.4, 0.1)."""
    method = {"name": "diloco", "H": 2, "outer_lr": 1.0, "outer_momentum": 0.0, "overlap": "delayed"}
    (a0, l0, g0, _), (a1, _, g1, _) = run_world(_run, method, X2, [1.0, 2.0], 0.5)
    _close(a0, [[0.9, 2, 0.4], [1, 2, 0.5], [0.8, 2, 0.4], [0.9, 1.7, 0.3], [0.8, 1.7, 0.2], [0.7, 1.4, 0.1]])
    _close(a1, [[1, 1.7, 0.4], [1, 2, 0.5], [1, 1.7, 0.4], [0.9, 1.7, 0.3], [0.9, 1.4, 0.2], [0.7, 1.4, 0.1]])
    assert g0 == g1
    # every sync sends its pseudo-gradient when issued; the last is still in flight at the end (drained)
    assert [m.get("sync_bytes") for m in l0] == [None, 12, None, 12, None, 12]


def test_overlap_eager_steps_with_the_fresh_local_pseudo_gradient_by_hand():
    """As above with overlap eager: sync 1 steps each rank with its own d / 2: rank 0 global (0.9, 2, 0.4),
    rank 1 (1, 1.7, 0.4). Sync 2: d0 = (0.4, 0, 0.2) (from its own global), d1 = (0, 0.6, 0.2); each rank steps
    with sync 1's average plus (fresh - its sync-1 pseudo-gradient) / 2: rank 0 (0.1, 0.3, 0.2) + (0.1, 0, 0) =
    (0.2, 0.3, 0.2): global (0.7, 1.7, 0.2); rank 1 (0.1, 0.3, 0.2): global (0.9, 1.4, 0.2)."""
    method = {"name": "diloco", "H": 2, "outer_lr": 1.0, "outer_momentum": 0.0, "overlap": "eager"}
    (a0, _, g0, _), (a1, _, g1, _) = run_world(_run, method, X2, [1.0, 2.0], 0.5)
    _close(a0[1], [0.9, 2, 0.4])
    _close(a1[1], [1, 1.7, 0.4])
    _close(a0[3], [0.7, 1.7, 0.2])
    _close(a1[3], [0.9, 1.4, 0.2])
    xs = [[x + [1.0] for x in X2[r]] for r in range(2)]
    ref, glob, _ = reference(xs, [1.0, 2.0, 0.5], 2, 1.0, overlap="eager")
    _close(a0, ref[0])
    _close(a1, ref[1])
    _close(g0, glob[0])
    _close(g1, glob[1])


@pytest.mark.parametrize("overlap", ["none", "delayed", "eager"])
def test_overlap_with_nesterov_momentum_matches_the_reference(overlap):
    """outer_lr 0.5, Nesterov momentum 0.9, H 2, three syncs: torch's SGD stepping the reference's global copy.
    overlap none is today's DiLoCo (tests/test_methods.py's hand-computed case holds it too)."""
    method = {"name": "diloco", "H": 2, "outer_lr": 0.5, "outer_momentum": 0.9, "overlap": overlap}
    (a0, _, g0, _), (a1, _, g1, _) = run_world(_run, method, X2, [1.0, 2.0], 0.5)
    xs = [[x + [1.0] for x in X2[r]] for r in range(2)]
    ref, glob, _ = reference(xs, [1.0, 2.0, 0.5], 2, 0.5, 0.9, True, overlap)
    _close(a0, ref[0])
    _close(a1, ref[1])
    _close(g0, glob[0])
    _close(g1, glob[1])


def test_overlap_none_is_todays_diloco_bit_for_bit():
    """Left out, overlap is none: the same parameters, bit for bit, as DiLoCo with overlap none given, and the
    same schedule; spec.json records it."""
    base = {"name": "diloco", "H": 2, "outer_lr": 0.5, "outer_momentum": 0.9}
    (a, _, g, _), _ = run_world(_run, base, X2, [1.0, 2.0], 0.5)
    (b, _, h, _), _ = run_world(_run, {**base, "overlap": "none"}, X2, [1.0, 2.0], 0.5)
    assert a == b and g == h
    assert JobSpec.from_dict({"model": "mlp", "method": base}).to_dict()["method"]["params"]["overlap"] == "none"


def test_the_schedule_gives_the_overlap_to_the_performance_model():
    """A sync's result is used H steps after its issue (delayed, eager), so the model counts its all-reduce as
    hidden behind those steps; overlap none keeps 0 (blocking)."""
    lin = [8, 4]
    assert [tuple(e) for e in methods.make("diloco", H=4).schedule(lin, 8)] == [(3, "pseudo", 12, 0, 0),
                                                                                 (7, "pseudo", 12, 0, 0)]
    for mode in ("delayed", "eager"):
        assert methods.make("diloco", H=4, overlap=mode).schedule(lin, 8) == [Event(3, "pseudo", 12, 4, 0),
                                                                               Event(7, "pseudo", 12, 4, 0)]
    assert [e.overlap for e in methods.make("streaming_diloco", H=4, fragments=2, tau=0,
                                            overlap="delayed").schedule(lin, 8)] == [4, 4, 4, 4]


# --------------------------------------------------------------------------- bad parameters: one line

@pytest.mark.parametrize("method, extra, field", [
    ({"name": "diloco", "overlap": "sometimes"}, {}, "method.overlap"),
    ({"name": "diloco", "overlap": True}, {}, "method.overlap"),
    ({"name": "streaming_diloco", "overlap": "delayed", "tau": 1}, {}, "method.overlap"),
    ({"name": "streaming_diloco", "overlap": "eager", "fragments": 2, "tau": 0}, {"fault_tolerance": {"enabled": True}},
     "method.overlap"),
    ({"name": "sparseloco", "k": 65, "chunk": 64}, {}, "method.k"),
    ({"name": "sparseloco", "beta": 1.5}, {}, "method.beta"),
    ({"name": "sparseloco", "chunk": 40000}, {}, "method.chunk"),
    ({"name": "sparseloco", "compressor": {"name": "topk"}}, {}, "method.compressor"),
    ({"name": "diloco", "compressor": {"name": "int4", "block": 0}}, {}, "method.compressor"),  # the message goes on: "block: ..."
    ({"name": "diloco", "compressor": {"name": "topk_2bit", "k": 9, "chunk": 8}}, {}, "method.compressor"),
])
def test_bad_parameters_get_one_line_naming_the_field(tmp_path, capsys, method, extra, field):
    from test_methods import assert_refused_in_one_line
    assert_refused_in_one_line(tmp_path, capsys, method, extra, field)
