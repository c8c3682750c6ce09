"""Optimizer muon, and the methods MuLoCo and DES-LOC (commlab/engine/methods/), held to their definitions: which
parameter Muon steps and which AdamW does, a checkpoint of the pair, synchronous Muon against the stock optimizers
on the averaged gradient, MuLoCo against a reference computed with the stock optimizers on each rank's copy,
DES-LOC's moments by hand (averaged at their periods and not between), what their schedules send, and bad specs
in one line. World size 2, gloo on CPU, one thread per rank."""
import copy

import pytest
import torch

from distutil import run_world
from commlab.engine import methods
from commlab.engine.muon import MuonAdamW, embeddings, split
from commlab.engine.spec import JobSpec, SpecError
from commlab.engine.stepper import Stepper


def _close(got, want, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                               atol=atol, rtol=0)


# --------------------------------------------------------------------------- the optimizer: Muon and AdamW

class Mixed(torch.nn.Module):
    """One parameter of every kind: an embedding table, matrices, biases, a norm, a convolution kernel, a scalar."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 4)
        self.fc = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.conv = torch.nn.Conv1d(1, 2, 3)
        self.head = torch.nn.Linear(4, 3, bias=False)
        self.gain = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, idx):
        h = self.norm(self.fc(self.emb(idx)))  # (n, 4)
        c = self.conv(h.unsqueeze(1)).mean()
        return (self.head(h) * self.gain).sum() + c


def test_muon_steps_the_matrices_and_adamw_the_rest():
    """Muon: the hidden matrices (fc, head); AdamW: the embedding table (2-D, left out by name of its module),
    biases and the norm (1-D), the convolution kernel (3-D), the scalar (0-D)."""
    m = Mixed()
    names = {id(p): n for n, p in m.named_parameters()}
    muon, adamw = split(m.parameters(), embeddings(m))
    assert [names[id(p)] for p in muon] == ["fc.weight", "head.weight"]
    assert [names[id(p)] for p in adamw] == ["gain", "emb.weight", "fc.bias", "norm.weight", "norm.bias",
                                             "conv.weight", "conv.bias"]  # a module's own parameters come first
    opt = MuonAdamW(m.parameters(), lr=0.02, momentum=0.9, weight_decay=0.01, adamw_lr=0.003, betas=(0.8, 0.95),
                    exclude=embeddings(m))
    assert isinstance(opt, torch.optim.Optimizer)
    muon_g, adamw_g = opt.param_groups
    assert [type(o).__name__ for o in opt.parts] == ["Muon", "AdamW"]
    assert (muon_g["lr"], muon_g["momentum"], muon_g["nesterov"], muon_g["weight_decay"]) == (0.02, 0.9, True, 0.01)
    assert (adamw_g["lr"], adamw_g["betas"], adamw_g["weight_decay"]) == (0.003, (0.8, 0.95), 0.01)
    # without the model, the embedding table is a matrix like any other
    assert len(split(m.parameters())[0]) == 3


def _train(model, opt, steps, idx=torch.tensor([0, 3, 4, 1])):
    for _ in range(steps):
        opt.zero_grad()
        model(idx).backward()
        opt.step()


def test_muon_adamw_is_the_stock_pair_and_its_checkpoint_resumes():
    """Three steps of MuonAdamW are three steps of torch.optim.Muon and torch.optim.AdamW side by side, bit for bit;
    state_dict/load_state_dict into a fresh one resumes exactly (both parts' state: Muon's momentum buffers, AdamW's
    moments and step), and a learning rate written into param_groups reaches the part that steps."""
    torch.manual_seed(0)
    a = Mixed()
    b = copy.deepcopy(a)
    opt = MuonAdamW(a.parameters(), lr=0.02, adamw_lr=0.01, exclude=embeddings(a))
    muon, adamw = split(b.parameters(), embeddings(b))
    stock = [torch.optim.Muon(muon, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0),
             torch.optim.AdamW(adamw, lr=0.01, weight_decay=0.0)]
    _train(a, opt, 3)
    for _ in range(3):
        for o in stock:
            o.zero_grad()
        b(torch.tensor([0, 3, 4, 1])).backward()
        for o in stock:
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    sd = copy.deepcopy(opt.state_dict())
    assert len(sd["state"]) == 9 and {"momentum_buffer"} == set(sd["state"][0]) and "exp_avg_sq" in sd["state"][2]
    c = copy.deepcopy(a)
    fresh = MuonAdamW(c.parameters(), lr=0.5, adamw_lr=0.5, exclude=embeddings(c))
    fresh.load_state_dict(sd)
    assert fresh.parts[0].state is fresh.state and fresh.parts[1].param_groups[0] is fresh.param_groups[1]
    _train(a, opt, 2)
    _train(c, fresh, 2)
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)
    for g in fresh.param_groups:
        g["lr"] = 0.0
    before = [p.detach().clone() for p in c.parameters()]
    _train(c, fresh, 1)
    assert all(torch.equal(p, q) for p, q in zip(before, c.parameters()))


# --------------------------------------------------------------------------- two ranks through the Stepper

class MLP(torch.nn.Module):
    """Two matrices (Muon) and two biases (AdamW); loss: mean squared error on a fixed batch per rank."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)


def _loss(model, rank):
    x, y = _batch(rank)
    return (model(x) - y).pow(2).mean()


def _fresh():
    torch.manual_seed(7)
    return MLP()


def _ranks(rank, world, spec, steps, model_fn="mlp", x_by_rank=None):
    """``steps`` steps of ``spec`` through the Stepper on this rank's fixed batch; each step's parameters (flat),
    the step lines, the optimizer's state of each parameter (exp_avg and exp_avg_sq as flat lists, after each
    step) and the method's state."""
    model = _fresh() if model_fn == "mlp" else Lin()
    if model_fn == "lin":
        with torch.no_grad():
            model.fc.weight.copy_(torch.tensor([[1.0, 2.0]]))
            model.fc.bias.fill_(0.5)
    st = Stepper(JobSpec.from_dict({"world_size": world, "schedule": "allinone", "timeline": False, **spec}), model,
                 None, rank, torch.device("cpu"))
    lines = []
    st.log = lines.append
    tl = st.timeline
    after, moments = [], []
    try:
        for _ in range(steps):
            t0, m0 = tl.now(), tl.mark()
            loss = _loss(model, rank) if model_fn == "mlp" else model(torch.tensor(x_by_rank[rank]))
            t1, m1 = tl.now(), tl.mark()
            loss.backward()
            st.step_after_backward(loss, t0, t1, tl.now(), m0, m1, tl.mark())
            after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
            state = st.optimizer.state
            moments.append({k: torch.cat([state[p][k].reshape(-1) for p in model.parameters()]).tolist()
                            for k in ("exp_avg", "exp_avg_sq") if all(k in state[p] for p in model.parameters())})
        st.drain()
        return after, lines, moments, st.method.state_dict() if st.method is not None else None
    finally:
        st.close()


MUON = {"name": "muon", "lr": 0.02, "momentum": 0.9, "weight_decay": 0.01, "adamw_lr": 0.01, "betas": [0.8, 0.95]}


def _stock_pair(model):
    muon, adamw = split(model.parameters())
    return [torch.optim.Muon(muon, lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01),
            torch.optim.AdamW(adamw, lr=0.01, betas=(0.8, 0.95), weight_decay=0.01)]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def test_synchronous_muon_is_the_stock_pair_on_the_averaged_gradient():
    """Optimizer muon with method none: each step the communicator averages the two ranks' gradients and MuonAdamW
    steps; the reference averages them by hand and steps torch.optim.Muon and torch.optim.AdamW."""
    (a0, _, _, _), (a1, _, _, _) = run_world(_ranks, {"optimizer": MUON}, 3)
    ref = _fresh()
    opts = _stock_pair(ref)
    want = []
    for _ in range(3):
        grads = []
        for r in (0, 1):
            ref.zero_grad()
            _loss(ref, r).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        for o in opts:
            o.step()
        want.append(_flat(ref))
    _close(a0, want)
    assert a0 == a1


def _switch(rank, world):
    model = _fresh()
    spec = JobSpec.from_dict({"world_size": world, "optimizer": MUON, "schedule": "allinone", "timeline": False})
    st = Stepper(spec, model, None, rank, torch.device("cpu"))
    try:
        tl = st.timeline
        loss = _loss(model, rank)
        t0, m0 = tl.now(), tl.mark()
        loss.backward()
        st.step_after_backward(loss, t0, t0, tl.now(), m0, m0, tl.mark())
        old = st.optimizer
        st.switch(JobSpec.from_dict({**spec.to_dict(), "schedule": {"name": "layerwise"}}))
        return st.optimizer is old and len(old.state) == 4
    finally:
        st.close()


def test_a_strategy_switch_keeps_the_muon_optimizer_and_its_state():
    """A switch of strategy (strategy auto's trials) over the same parameters keeps the optimizer, although muon's
    groups list the matrices before the biases."""
    assert run_world(_switch) == [True, True]


def _muloco_reference(H, outer_lr, outer_momentum, steps):
    """MuLoCo by its definition, in one process: each rank's copy steps the stock pair on its own batch, the state
    kept across outer steps; after every H-th step the pseudo-gradients (global - local) are averaged, torch's
    Nesterov SGD steps the global copy, and both copies take it. The parameters of rank 0 and 1 after each step."""
    glob = _fresh()
    copies = [copy.deepcopy(glob), copy.deepcopy(glob)]
    opts = [_stock_pair(c) for c in copies]
    outer = torch.optim.SGD(glob.parameters(), lr=outer_lr, momentum=outer_momentum,
                            nesterov=outer_momentum > 0)
    out = [[], []]
    for s in range(steps):
        for r, (c, os_) in enumerate(zip(copies, opts)):
            for o in os_:
                o.zero_grad()
            _loss(c, r).backward()
            for o in os_:
                o.step()
        if (s + 1) % H == 0:
            with torch.no_grad():
                for g, p0, p1 in zip(glob.parameters(), *(c.parameters() for c in copies)):
                    g.grad = ((g - p0) + (g - p1)) / 2
            outer.step()
            with torch.no_grad():
                for c in copies:
                    for p, g in zip(c.parameters(), glob.parameters()):
                        p.copy_(g)
        for r in (0, 1):
            out[r].append(_flat(copies[r]))
    return out


def test_muloco_is_diloco_with_the_stock_muon_inside():
    """H = 2, outer_lr 0.7, outer_momentum 0.6 (Nesterov), 6 steps: both ranks' parameters after every step are the
    reference's (three outer steps). The oracle can fail: the same reference with H = 3 differs."""
    method = {"name": "muloco", "H": 2, "outer_lr": 0.7, "outer_momentum": 0.6}
    (a0, l0, _, st0), (a1, _, _, _) = run_world(_ranks, {"optimizer": MUON, "method": method}, 6)
    r0, r1 = _muloco_reference(2, 0.7, 0.6, 6)
    _close(a0, r0)
    _close(a1, r1)
    assert a0[1] == a1[1] and a0[5] == a1[5] and a0[2] != a1[2]  # alike after each outer step, apart between
    nbytes = 4 * len(a0[0])
    assert [m.get("sync_bytes") for m in l0] == [None, nbytes] * 3 and all(m["method"] == "muloco" for m in l0)
    assert st0["syncs"] == 3
    wrong, _ = _muloco_reference(3, 0.7, 0.6, 6)
    assert max(abs(x - y) for x, y in zip(a0[5], wrong[5])) > 1e-4


def test_muloco_at_h1_averages_each_ranks_muon_step_and_is_not_synchronous_muon():
    """H = 1, outer_lr 1, no outer momentum: each step sets the parameters to the average of the two ranks' Muon (and
    AdamW) steps, each rank keeping its own momentum: the reference's. Unlike local SGD with plain SGD this is not
    synchronous training: Muon orthogonalizes each rank's update, and the average of two orthogonalized updates
    is not the orthogonalized average (the synchronous run differs by far more than rounding)."""
    method = {"name": "muloco", "H": 1, "outer_lr": 1.0, "outer_momentum": 0.0}
    (a0, _, _, _), _ = run_world(_ranks, {"optimizer": MUON, "method": method}, 3)
    r0, _ = _muloco_reference(1, 1.0, 0.0, 3)
    _close(a0, r0)
    (sync, _, _, _), _ = run_world(_ranks, {"optimizer": MUON}, 3)
    assert max(abs(x - y) for x, y in zip(a0[2], sync[2])) > 1e-3


# --------------------------------------------------------------------------- DES-LOC by hand

class Lin(torch.nn.Module):
    """out = w . x + b; with loss = out the gradient is (x, 1) whatever w is: constant per rank."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.fc(x).sum()


X = [[1.0, 2.0], [3.0, -1.0]]
"""Rank 0's gradient (w: (1, 2), b: 1), rank 1's (w: (3, -1), b: 1)."""
ADAM = {"name": "adam", "lr": 0.1, "betas": [0.5, 0.5]}
DESLOC = {"name": "desloc", "Hx": 2, "Hu": 3, "Hv": 4}

M_HAND = [  # exp_avg after each step: m = 0.5 m + 0.5 g; averaged after step 2 (Hu = 3), not after steps 0, 1, 3
    ([0.5, 1, 0.5], [1.5, -0.5, 0.5]),
    ([0.75, 1.5, 0.75], [2.25, -0.75, 0.75]),
    ([1.75, 0.4375, 0.875], [1.75, 0.4375, 0.875]),  # (0.875, 1.75, 0.875) and (2.625, -0.875, 0.875) averaged
    ([1.375, 1.21875, 0.9375], [2.375, -0.28125, 0.9375]),
]
V_HAND = [  # exp_avg_sq after each step: v = 0.5 v + 0.5 g^2 (g^2: (1, 4, 1) and (9, 1, 1)); averaged after step 3
    ([0.5, 2, 0.5], [4.5, 0.5, 0.5]),
    ([0.75, 3, 0.75], [6.75, 0.75, 0.75]),
    ([0.875, 3.5, 0.875], [7.875, 0.875, 0.875]),
    ([4.6875, 2.34375, 0.9375], [4.6875, 2.34375, 0.9375]),  # (0.9375, 3.75, 0.9375) and (8.4375, 0.9375, 0.9375)
]


def test_desloc_by_hand():
    """Adam, lr 0.1, betas (0.5, 0.5); Hx = 2, Hu = 3, Hv = 4; start w = (1, 2), b = 0.5. The moments are M_HAND and
    V_HAND: each averaged exactly at its period, and apart on the ranks between.
    Steps 0-2: Adam's bias-corrected moments are g and g^2, so each step moves every parameter by 0.1 sign(g):
    step 0: rank 0 (0.9, 1.9, 0.4), rank 1 (0.9, 2.1, 0.4); step 1: (0.8, 1.8, 0.3) and (0.8, 2.2, 0.3), then the
    parameters are averaged (Hx = 2): (0.8, 2.0, 0.3); step 2: (0.7, 1.9, 0.2) and (0.7, 2.1, 0.2).
    Step 3 (t = 4, both corrections 1 - 0.5^4 = 0.9375) reads the first moment averaged after step 2:
    rank 0: m_hat = (1.375, 1.21875, 0.9375) / 0.9375 = (1.4667, 1.3, 1), sqrt(v_hat) = (1, 2, 1), so
    w = (0.7 - 0.14667, 1.9 - 0.065), b = 0.1; rank 1: m_hat = (2.5333, -0.3, 1), sqrt(v_hat) = (3, 1, 1), so
    w = (0.7 - 0.084444, 2.1 + 0.03), b = 0.1; then averaged: (0.584444, 1.9825, 0.1)."""
    spec = {"optimizer": ADAM, "method": DESLOC}
    (a0, l0, mo0, st0), (a1, _, mo1, _) = run_world(_ranks, spec, 4, "lin", X)
    _close(a0[:3], [[0.9, 1.9, 0.4], [0.8, 2.0, 0.3], [0.7, 1.9, 0.2]])
    _close(a1[:3], [[0.9, 2.1, 0.4], [0.8, 2.0, 0.3], [0.7, 2.1, 0.2]])
    _close(a0[3], [0.7 - (1.375 / 0.9375 + 2.375 / 0.9375 / 3) * 0.1 / 2, 1.9825, 0.1])
    _close(a1[3], a0[3])
    for s in range(4):
        _close(mo0[s]["exp_avg"], M_HAND[s][0])
        _close(mo1[s]["exp_avg"], M_HAND[s][1])
        _close(mo0[s]["exp_avg_sq"], V_HAND[s][0])
        _close(mo1[s]["exp_avg_sq"], V_HAND[s][1])
    # what each step averaged and sent: the model (3 floats, 12 bytes) per exchange
    assert [(m.get("synced"), m.get("sync_bytes"), m["bytes_sent"]) for m in l0] == \
        [(None, None, 0), (["params"], 12, 12), (["exp_avg"], 12, 12), (["params", "exp_avg_sq"], 24, 24)]
    assert st0["syncs"] == {"params": 2, "exp_avg": 1, "exp_avg_sq": 1}
    _close(torch.cat([t.reshape(-1) for t in st0["synced"]]), a0[3])


def _desloc_reference(Hx, Hu, Hv, steps):
    """DES-LOC by its definition, in one process: torch.optim.Adam on each rank's copy of Lin, and the parameters,
    exp_avg and exp_avg_sq averaged by hand after every Hx-th, Hu-th and Hv-th step. Rank 0's parameters and
    moments after each step."""
    copies = [Lin(), Lin()]
    for c in copies:
        with torch.no_grad():
            c.fc.weight.copy_(torch.tensor([[1.0, 2.0]]))
            c.fc.bias.fill_(0.5)
    opts = [torch.optim.Adam(c.parameters(), lr=0.1, betas=(0.5, 0.5)) for c in copies]
    out = []
    for s in range(steps):
        for c, o, x in zip(copies, opts, X):
            o.zero_grad()
            c(torch.tensor(x)).backward()
            o.step()
        with torch.no_grad():
            for (p0, p1) in zip(copies[0].parameters(), copies[1].parameters()):
                pairs = [(p0, p1)] if (s + 1) % Hx == 0 else []
                for key, period in (("exp_avg", Hu), ("exp_avg_sq", Hv)):
                    if (s + 1) % period == 0:
                        pairs.append((opts[0].state[p0][key], opts[1].state[p1][key]))
                for a, b in pairs:
                    avg = (a + b) / 2
                    a.copy_(avg)
                    b.copy_(avg)
        ps = list(copies[0].parameters())
        out.append((_flat(copies[0]), {k: torch.cat([opts[0].state[p][k].reshape(-1) for p in ps]).tolist()
                                       for k in ("exp_avg", "exp_avg_sq")}))
    return out


def test_desloc_is_local_adam_with_its_three_periods():
    """12 steps with Hx = 2, Hu = 3, Hv = 4 against the plain-torch reference (parameters and both moments of
    rank 0 after every step, to 1e-6); the oracle can fail: the reference with the moments' periods swapped, or
    with the second moment kept local, differs."""
    spec = {"optimizer": ADAM, "method": DESLOC}
    (a0, _, mo0, _), _ = run_world(_ranks, spec, 12, "lin", X)
    ref = _desloc_reference(2, 3, 4, 12)
    for s, (params, moments) in enumerate(ref):
        _close(a0[s], params)
        _close(mo0[s]["exp_avg"], moments["exp_avg"])
        _close(mo0[s]["exp_avg_sq"], moments["exp_avg_sq"])
    for wrong in (_desloc_reference(2, 4, 3, 12), _desloc_reference(2, 3, 10 ** 6, 12)):
        worst = max(abs(x - y) for s in range(12) for k in ("exp_avg", "exp_avg_sq")
                    for x, y in zip(mo0[s][k], wrong[s][1][k]))
        assert worst > 1e-3


# --------------------------------------------------------------------------- schedules and specs

def test_schedules_say_what_each_step_sends():
    lin = [8, 4]
    m = methods.make("desloc", Hx=2, Hu=3, Hv=4)
    assert [(e.step, e.kind, e.bytes) for e in m.schedule(lin, 8)] == [
        (1, "params", 12), (2, "moments", 12), (3, "params", 12), (3, "moments", 12), (5, "params", 12),
        (5, "moments", 12), (7, "params", 12), (7, "moments", 12)]
    assert [s for s in range(30) if m.exchanges_at(s)] == sorted({e.step for e in m.schedule(lin, 30)})
    d = methods.make("desloc", Hx=8)
    assert (d.Hu, d.Hv) == (24, 48) and d.values() == {"Hx": 8, "Hu": 24, "Hv": 48}
    assert methods.make("desloc").values() == {"Hx": 16, "Hu": 48, "Hv": 96}
    mu = methods.make("muloco")
    assert mu.values() == {"H": 30, "outer_lr": 0.7, "outer_momentum": 0.6, "nesterov": True, "overlap": "none"}
    assert [(e.step, e.kind, e.bytes) for e in mu.schedule(lin, 61)] == [(29, "pseudo", 12), (59, "pseudo", 12)]
    assert {"muloco", "desloc"} <= set(methods.names())


def test_the_spec_records_what_muon_and_the_methods_use():
    s = JobSpec.from_dict({"model": "mlp", "optimizer": {"name": "muon", "lr": 0.02},
                           "method": "muloco"})
    assert s.to_dict()["optimizer"] == {"name": "muon", "lr": 0.02, "momentum": 0.95, "weight_decay": 0.0,
                                        "betas": None, "adamw_lr": 0.001, "decay": "none"}
    assert JobSpec.from_dict(s.to_dict()) == s
    sgd = JobSpec.from_dict({"model": "mlp"}).to_dict()["optimizer"]
    assert sgd["momentum"] == 0.0 and sgd["adamw_lr"] is None
    d = JobSpec.from_dict({"model": "mlp", "optimizer": "adamw", "method": {"name": "desloc", "Hx": 4}})
    assert d.method.params == {"Hx": 4, "Hu": 12, "Hv": 24}


@pytest.mark.parametrize("method, extra, field", [
    ({"name": "muloco"}, {"optimizer": {"name": "adamw", "lr": 0.001}}, "optimizer.name"),
    ({"name": "muloco", "H": 0}, {"optimizer": "muon"}, "method.H"),
    ({"name": "desloc"}, {"optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}}, "optimizer.name"),
    ({"name": "desloc"}, {"optimizer": "muon"}, "optimizer.name"),
    ({"name": "desloc", "Hu": 0}, {"optimizer": "adam"}, "method.Hu"),
    ({"name": "desloc", "H": 4}, {"optimizer": "adam"}, "method.H"),
    ({"name": "desloc"}, {"optimizer": "adam", "compressor": "fp16"}, "compressor.name"),
    ({"name": "none"}, {"optimizer": "muon", "comm": "dear"}, "comm.mode"),
    ({"name": "none"}, {"optimizer": {"name": "adam", "adamw_lr": 0.01}}, "optimizer.adamw_lr"),
    ({"name": "none"}, {"optimizer": {"name": "muon", "adamw_lr": 20}}, "optimizer.adamw_lr"),
    ({"name": "none"}, {"optimizer": {"name": "muon", "momentum": 1}}, "optimizer.momentum"),
    ({"name": "none"}, {"optimizer": {"name": "adamw", "momentum": 0.9}}, "optimizer.momentum"),
    ({"name": "none"}, {"optimizer": {"name": "lion"}}, "optimizer.name"),
])
def test_bad_specs_get_one_line_naming_the_field(tmp_path, capsys, method, extra, field):
    from test_methods import assert_refused_in_one_line
    assert_refused_in_one_line(tmp_path, capsys, method, extra, field)
    with pytest.raises(SpecError):
        JobSpec.from_dict({"model": "mlp", "method": method, **extra})


def test_the_advisor_offers_no_dear_to_muon():
    """dear steps flat shards, which Muon cannot: the strategy space leaves dear out for optimizer muon only."""
    from commlab.lab.strategy.space import space
    base = JobSpec.from_dict({"model": "mlp"}).to_dict()
    muon = JobSpec.from_dict({"model": "mlp", "optimizer": "muon"}).to_dict()
    assert any(c.comm["mode"] == "dear" for c in space(base, methods=False))
    assert not any(c.comm["mode"] == "dear" for c in space(muon, methods=False))


# --------------------------------------------------------------------------- the examples train from the CLI

@pytest.mark.parametrize("name, sets", [("muloco", ["method.H=4"]), ("desloc", ["method.Hx=2"])])
def test_example_trains_from_the_cli_and_sends_what_its_schedule_says(tmp_path, name, sets):
    """8 steps of examples/<name>.yaml on a narrow mlp: the run is done, each rank's sync steps are its schedule's with
    the bytes it says (nothing compresses them), a local step sends nothing, and evaluation ran."""
    from commlab.engine import preflight
    from commlab.engine.runlog import read_jsonl
    from commlab.lab.base.specs import load_spec
    from test_methods import ROOT, commlab, only_run
    runs = tmp_path / "runs"
    # a narrow mlp: torch's Muon orthogonalizes in bfloat16, which this CPU multiplies about 30 times slower than
    # float32 (8 steps of the 512-wide mlp took 73 s; the 32-wide one, seconds)
    sets = sets + ["steps=8", "model=mlp", "model.hidden=32", "eval_every=0", "threads=1", "timeline=true"]
    r = commlab("run", ROOT / "examples" / f"{name}.yaml", "--quiet", "--runs", runs,
                *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = only_run(runs)
    spec = load_spec(str(run_dir / "spec.json"))
    rows = read_jsonl(str(run_dir / "metrics.jsonl"))
    steps = [m for m in rows if m["kind"] == "step"]
    assert len(steps) == 16 and all(m["method"] == name for m in steps)
    events = spec.method.build().schedule([b for _, b in preflight.parameters(spec)], 8)
    for rank in (0, 1):
        for x in (m for m in steps if m["rank"] == rank):
            assert x["bytes_sent"] == x.get("sync_bytes", 0) == sum(e.bytes for e in events if e.step == x["step"])
    assert [m for m in rows if m["kind"] == "eval"]
    lanes = {e["cat"] for e in read_jsonl(str(run_dir / "timeline-rank0.jsonl"))}
    assert "outer" in lanes
