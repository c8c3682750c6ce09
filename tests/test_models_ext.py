"""Models and data sets from outside the zoo: torchvision:<arch>, hf:<type>, the user's own
factory and loader; synthetic data shaped for them; one-line errors before any rank starts."""
import json
import os
import textwrap

import pytest

import commlab
from commlab.engine import external, preflight
from commlab.engine.spec import JobSpec, SpecError

HAS_TV = external.available(external.TORCHVISION)
HAS_HF = external.available(external.HF)
needs_tv = pytest.mark.skipif(not HAS_TV, reason="torchvision is not installed (models extra)")
needs_hf = pytest.mark.skipif(not HAS_HF, reason="transformers is not installed (models extra)")

BASE = {"world_size": 2, "steps": 3, "batch_size": 4, "eval_every": 0, "threads": 1}
GPT2 = {"name": "hf:gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4}


def _done(run):
    st = run.status()
    assert st["state"] == "done", (st, open(run.file("log.txt")).read()[-3000:])
    rows = [json.loads(line) for line in open(run.file("metrics.jsonl"))]
    return [r for r in rows if r.get("kind") == "step"], [r for r in rows if r.get("kind") == "eval"]


def _layers(run, rank=0):
    ev = [json.loads(line) for line in open(run.file(f"timeline-rank{rank}.jsonl"))]
    return {e["args"].get("layer") for e in ev if e.get("cat") == "forward" or e.get("tid") == "forward"} - {None}


# ---------------------------------------------------------------- torchvision

@needs_tv
def test_torchvision_resnet18_builds_at_its_size():
    spec = JobSpec.from_dict({"model": "torchvision:resnet18",
                              "dataset": {"name": "synthetic", "shape": [3, 32, 32], "classes": 1000, "size": 64}})
    assert preflight.describe(spec)["params"] == 11_689_512


# what must hold on outside models: top-k + error feedback under mergecomp, and dear with fp16
MERGECOMP_TOPK = {"compressor": {"name": "topk", "ratio": 0.01, "error_feedback": True},
                  "schedule": {"name": "mergecomp", "warmup_steps": 0, "steps_per_candidate": 1, "max_candidates": 2}}
DEAR_FP16 = {"compressor": "fp16", "comm": {"mode": "dear"}}
COMMS = pytest.mark.parametrize("comm", [MERGECOMP_TOPK, DEAR_FP16], ids=["topk-ef-mergecomp", "dear-fp16"])


def _timelines(run, op):
    """Both ranks wrote a timeline with the comm mode's collectives and compress spans."""
    for rank in (0, 1):
        ev = [json.loads(line) for line in open(run.file(f"timeline-rank{rank}.jsonl"))]
        ops = {e["args"]["op"] for e in ev if e.get("cat") == "comm"}
        assert op in ops, (rank, ops)
        assert any(e.get("cat") == "compress" for e in ev)


@needs_tv
@COMMS
def test_torchvision_resnet18_trains(tmp_path, comm):
    spec = {**BASE, "model": "torchvision:resnet18", "dataset": {"name": "synthetic", "shape": [3, 32, 32],
                                                                 "size": 64}, **comm}
    steps, evals = _done(commlab.run(spec, runs=tmp_path))
    run = commlab.runs(runs=tmp_path)[0]
    assert len({r["step"] for r in steps}) == 3 and evals
    assert "bn1" in _layers(run) and "fc" in _layers(run)  # per-layer spans of the library's own modules
    _timelines(run, "reduce_scatter" if comm is DEAR_FP16 else "allgather")  # top-k's payloads are all-gathered
    said = open(run.file("log.txt")).read().count("[commlab] torchvision: its C++ extension does not load")
    assert said == (1 if external._TV_SHIM is not None else 0)  # once (rank 0), and only when the shim is in use


@needs_tv
def test_torchvision_without_its_extension_imports_and_ops_raise():
    """Where torchvision's C++ extension does not load (the CUDA wheel beside a CPU torch), its
    operators are defined without kernels: the models work, calling an operator raises."""
    import torch
    tv = external.import_torchvision()
    m = tv.models.resnet18(num_classes=10)
    assert sum(p.numel() for p in m.parameters()) == 11_181_642
    m(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    if external._TV_SHIM is None:
        pytest.skip("torchvision's C++ extension loads here: no shim in use")
    with pytest.raises(RuntimeError):
        tv.ops.nms(torch.rand(3, 4), torch.rand(3), 0.5)


# ---------------------------------------------------------------- Hugging Face

@needs_hf
def test_hf_gpt2_dear_matches_wfbp_and_fp16_trains(tmp_path):
    """GPT-2 ties lm_head to wte: dear gathers the shared buffer at wte's forward and lm_head reads it
    there; its losses follow wfbp's (same averaged gradients, same optimizer)."""
    common = {**BASE, "steps": 4, "model": GPT2, "dataset": {"name": "text", "block": 32},
              "optimizer": {"name": "adam", "lr": 0.001}}
    losses = {}
    for name, extra in (("wfbp", {}), ("dear", {"comm": {"mode": "dear"}}),
                        ("dear-fp16", {"comm": {"mode": "dear"}, "compressor": "fp16"})):
        steps, evals = _done(commlab.run({**common, "name": name, **extra}, runs=tmp_path / name))
        losses[name] = [r["loss"] for r in sorted(steps, key=lambda r: (r["step"], r["rank"]))]
        assert evals and 0 <= evals[-1]["eval_acc"] <= 1
    assert losses["dear"] == pytest.approx(losses["wfbp"], rel=1e-4)
    assert losses["dear-fp16"] == pytest.approx(losses["wfbp"], rel=1e-2)
    run = commlab.runs(runs=tmp_path / "wfbp")[0]
    assert "model.lm_head" in _layers(run) and "model.transformer.h.0.attn.c_attn" in _layers(run)


@needs_hf
@COMMS
def test_hf_gpt2_4_layers_trains(tmp_path, comm):
    """A small GPT-2: 4 layers, 256 wide, 4 heads (vocabulary of the synthetic tokens)."""
    model = {"name": "hf:gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4}
    spec = {**BASE, "model": model, "dataset": {"name": "synthetic", "vocab": 512, "block": 32, "size": 64},
            "optimizer": {"name": "adam", "lr": 0.001}, **comm}
    steps, evals = _done(commlab.run(spec, runs=tmp_path))
    run = commlab.runs(runs=tmp_path)[0]
    assert len({r["step"] for r in steps}) == 3 and evals
    assert "model.transformer.h.3.mlp.c_fc" in _layers(run)
    _timelines(run, "reduce_scatter" if comm is DEAR_FP16 else "allgather")


@needs_hf
def test_hf_on_synthetic_tokens_of_any_vocab():
    spec = JobSpec.from_dict({"model": GPT2, "dataset": {"name": "synthetic", "vocab": 300, "block": 16}})
    info = preflight.check(spec)
    assert info["params"] == 300 * 64 + 1024 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
    assert info["tied"] == ["model.lm_head.weight = model.transformer.wte"]


# ---------------------------------------------------------------- the user's own code

USER = '''
import torch, torch.nn as nn

def build(info, width=8):
    """BatchNorm and an in-place ReLU, as torchvision's classifiers have."""
    c = info.input_shape[0]
    return nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, info.num_classes))

def wants_32(info):
    return nn.Sequential(nn.Flatten(), nn.Linear(32, info.num_classes))

class Pairs(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 6, 6, generator=g)
        self.y = (self.x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (self.x[:, 0].mean(dim=(1, 2)) > 0).long()
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        return self.x[i], int(self.y[i])

def load(n=96, seed=0):
    return Pairs(n, seed), Pairs(n // 4, seed + 1)

def l1(out, y):
    return (out.softmax(-1) - torch.nn.functional.one_hot(y, out.shape[-1])).abs().mean()
'''


@pytest.fixture
def userpkg(tmp_path, monkeypatch, forget_modules):
    forget_modules("mypkg")  # examples/mypkg may have been imported by an earlier test
    d = tmp_path / "src"
    (d / "mypkg").mkdir(parents=True)
    (d / "mypkg" / "__init__.py").write_text("")
    (d / "mypkg" / "models.py").write_text(textwrap.dedent(USER))
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PYTHONPATH", str(d) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # for the ranks
    return d


def test_user_factory_and_loader_train_with_bn_buffers(tmp_path, userpkg):
    spec = {**BASE, "steps": 4, "model": {"name": "mypkg.models:build", "width": 6},
            "dataset": {"name": "mypkg.models:load", "n": 64},
            "compressor": {"name": "topk", "ratio": 0.1, "error_feedback": True}, "comm": {"mode": "wfbp"}}
    run = commlab.run(spec, runs=tmp_path / "runs")
    steps, evals = _done(run)
    assert len(steps) == 8 and evals[-1]["eval_acc"] > 0
    assert json.load(open(run.file("spec.json")))["dataset"]["options"] == {"n": 64}
    assert {"0", "1", "5"} <= _layers(run)  # conv, batchnorm, linear


def test_user_loss_is_used(userpkg):
    spec = JobSpec.from_dict({"model": {"name": "mypkg.models:build", "loss": "mypkg.models:l1"},
                              "dataset": "mypkg.models:load"})
    assert spec.model.loss == "mypkg.models:l1" and spec.model.options == {}
    assert preflight.check(spec)["params"] > 0


def test_sync_buffers_averages_running_stats(userpkg):
    """Each rank's BatchNorm statistics follow its own shard; before evaluation they are averaged."""
    from distutil import run_world
    (b0, a0), (b1, a1) = run_world(_bn_ranks)
    assert b0 != pytest.approx(b1)
    assert a0 == pytest.approx(a1) and a0 == pytest.approx([(x + y) / 2 for x, y in zip(b0, b1)])


def _bn_ranks(rank, world):
    import torch
    from commlab.engine.trainer import Trainer
    spec = JobSpec.from_dict({"model": "mypkg.models:build", "dataset": "mypkg.models:load", "batch_size": 4,
                              "timeline": False})
    t = Trainer(spec, None, rank, world, torch.device("cpu"))
    t.train_step()
    before = t.model[1].running_mean.tolist()
    t.sync_buffers()
    after = t.model[1].running_mean.tolist()
    t.close()
    return before, after


# ---------------------------------------------------------------- one-line errors before any rank

def _one_line(fn):
    with pytest.raises(SpecError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_unknown_torchvision_arch_is_one_line():
    msg = _one_line(lambda: JobSpec.from_dict({"model": "torchvision:resnet19",
                                               "dataset": {"name": "synthetic"}}))
    assert msg.startswith("model")
    assert ("did you mean resnet18" in msg) if HAS_TV else ("torchvision is not usable" in msg)


def test_import_failures_are_one_line(userpkg):
    assert "cannot import 'nopkg.models'" in _one_line(lambda: JobSpec.from_dict({"model": "nopkg.models:build"}))
    assert "has no 'nothere'" in _one_line(lambda: JobSpec.from_dict({"model": "mypkg.models:nothere"}))
    assert _one_line(lambda: JobSpec.from_dict({"dataset": "nopkg:load"})).startswith("dataset.name")
    if HAS_HF:
        assert "did you mean" in _one_line(lambda: JobSpec.from_dict({"model": "hf:gpt3", "dataset": "text"}))


def test_torchvision_refuses_one_channel_data():
    msg = _one_line(lambda: JobSpec.from_dict({"model": "torchvision:resnet18", "dataset": "digits"}))
    assert "3-channel" in msg or "not usable" in msg


def test_bad_first_batch_is_one_line_and_starts_nothing(tmp_path, userpkg):
    spec = {**BASE, "model": "mypkg.models:wants_32", "dataset": "mypkg.models:load"}
    msg = _one_line(lambda: commlab.run(spec, runs=tmp_path / "runs"))
    assert msg.startswith("model: mypkg.models:wants_32 does not take the first batch") and "(2, 3, 6, 6)" in msg
    assert not list((tmp_path / "runs").glob("*/spec.json"))  # no run was created, no rank started


# ---------------------------------------------------------------- the New run form

def test_new_run_form_offers_outside_models_and_shows_their_size(tmp_path, monkeypatch, userpkg):
    pytest.importorskip("streamlit")
    from pathlib import Path
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path / "runs"))
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "commlab" / "app" / "streamlit_app.py"),
                           default_timeout=120).run()
    at.switch_page("views/new_run.py").run()
    assert any("parameters" in c.value for c in at.caption)  # the zoo's cnn, before any change
    at.selectbox(key="nr.model_source").set_value("import path").run()
    at.text_input(key="nr.model_path.import path").set_value("mypkg.models:build")
    at.text_area(key="nr.model_options.import path").set_value("width: 5").run()
    at.selectbox(key="nr.dataset").set_value("import path").run()
    at.text_input(key="nr.ds.path").set_value("mypkg.models:load").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    # conv 3*5*9+5, batchnorm 2*5, linear 5*4+4 (the loader's labels take 4 values)
    assert any(c.value.startswith(f"{3 * 5 * 9 + 5 + 10 + 24:,} parameters in 6 tensors") for c in at.caption)
    at.text_input(key="nr.model_path.import path").set_value("nopkg.models:build").run()
    assert any("cannot import 'nopkg.models'" in e.value for e in at.error)
    assert at.button(key="nr.submit").disabled
    if HAS_HF:
        at.selectbox(key="nr.model_source").set_value("hf:").run()
        assert at.selectbox(key="nr.dataset").options == ["text", "synthetic", "import path"]
        at.selectbox(key="nr.dataset").set_value("synthetic").run()
        assert not at.error, [e.value for e in at.error]
        assert at.number_input(key="nr.ds.vocab").value == 1000 and any("tied: model.lm_head.weight" in c.value for c in at.caption)
