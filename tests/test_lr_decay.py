"""optimizer.decay: the spec's optimizer's learning rate over the run, checked against torch's own
CosineAnnealingLR, in a two-rank run, and refused where it cannot apply."""
import pytest
import torch

from distutil import run_world
from test_methods import Lin, train_step
from commlab.engine.muon import MuonAdamW
from commlab.engine.spec import JobSpec, SpecError
from commlab.engine.stepper import Stepper, decay_lr

STEPS = 6


def _torch_rates(lr: float, steps: int) -> list:
    """The rate each step uses under torch.optim.lr_scheduler.CosineAnnealingLR(T_max=steps, eta_min=0)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=0.0)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def test_cosine_is_torchs_cosine_annealing_for_every_group_and_none_keeps_the_rate():
    spec = JobSpec.from_dict({"steps": STEPS, "optimizer": {"name": "muon", "lr": 0.02, "decay": "cosine"}})
    opt = MuonAdamW([torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2))], lr=0.02,
                    adamw_lr=0.001)
    got = []
    for s in range(STEPS):
        decay_lr(opt, spec, s)
        got.append([g["lr"] for g in opt.param_groups])
    for i, lr in enumerate((0.02, 0.001)):  # Muon's group, then AdamW's: each from its own first rate
        assert [r[i] for r in got] == pytest.approx(_torch_rates(lr, STEPS), rel=1e-12, abs=1e-15)
    assert all(g["initial_lr"] in (0.02, 0.001) for g in opt.param_groups)
    flat = JobSpec.from_dict({"steps": STEPS, "optimizer": {"name": "sgd", "lr": 0.1}})
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    decay_lr(sgd, flat, STEPS - 1)
    assert sgd.param_groups[0]["lr"] == 0.1


def _steps(rank, world, decay):
    """Lin, w = (1, 2), constant gradient x = (1, 3) on both ranks, plain SGD at 0.1 with ``decay``: the weights
    after each step."""
    model = Lin(2, bias=False)
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([[1.0, 2.0]]))
    spec = JobSpec.from_dict({"world_size": world, "steps": STEPS, "comm": "sync", "schedule": "allinone",
                              "optimizer": {"name": "sgd", "lr": 0.1, "decay": decay}, "timeline": False})
    st = Stepper(spec, model, None, rank, torch.device("cpu"))
    st.log = lambda line: None
    x = torch.tensor([1.0, 3.0])
    after = []
    for _ in range(STEPS):
        train_step(model, st, x)
        after.append(model.fc.weight.detach().reshape(-1).tolist())
    return after


def test_a_two_rank_run_steps_with_the_decayed_rates():
    """The gradient is (1, 3) every step, so after step k the weights are (1, 2) - (1, 3) x the sum of the rates
    so far: torch's cosine rates under decay cosine, 0.1 each under none."""
    for decay, rates in (("cosine", _torch_rates(0.1, STEPS)), ("none", [0.1] * STEPS)):
        r0, r1 = run_world(_steps, decay)
        want = []
        total = 0.0
        for r in rates:
            total += r
            want.append([1.0 - total, 2.0 - 3.0 * total])
        torch.testing.assert_close(torch.tensor(r0, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   atol=1e-6, rtol=0)
        assert r0 == r1


def test_a_bad_decay_gets_one_line_naming_the_field():
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict({"optimizer": {"name": "sgd", "decay": "linear"}})
    assert "optimizer.decay" in str(e.value) and "cosine" in str(e.value)


def test_your_own_optimizer_with_decay_is_refused_before_anything_starts():
    from commlab.own import _optimizer_factory
    model = Lin(2, bias=False)
    spec = JobSpec.from_dict({"optimizer": {"name": "sgd", "decay": "cosine"}})
    for mine in (torch.optim.SGD(model.parameters(), lr=0.1), lambda params: torch.optim.SGD(params, lr=0.1)):
        with pytest.raises(ValueError, match="optimizer.decay"):
            _optimizer_factory(mine, model, spec)
    assert _optimizer_factory(None, model, spec) is None
