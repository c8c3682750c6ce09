"""Job spec validation and the pure bucket builders."""
import pytest

from commlab.engine import schedules
from commlab.engine.schedules import MB, ParamInfo
from commlab.engine.spec import JobSpec, SpecError
from commlab.lab.base.specs import apply_overrides, load_spec


# -- spec ---------------------------------------------------------------------
def test_defaults_and_round_trip():
    s = JobSpec.from_dict({})
    assert s.model.name == "cnn" and s.comm.mode == "wfbp" and s.world_size == 2
    d = s.to_dict()
    assert JobSpec.from_dict(d) == s
    assert set(d) >= {"name", "model", "dataset", "world_size", "backend", "device", "steps", "batch_size",
                      "optimizer", "seed", "compressor", "schedule", "comm", "network", "eval_every"}


def test_short_forms():
    s = JobSpec.from_dict({"model": "resnet", "dataset": "synthetic", "compressor": {"name": "none"},
                           "comm": "sync", "network": "loopback", "schedule": "layerwise"})
    assert (s.model.name, s.dataset.name, s.comm.mode, s.schedule.name) == ("resnet", "synthetic", "sync", "layerwise")
    s = JobSpec.from_dict({"model": {"name": "resnet", "width": 16}, "dataset": "synthetic"})
    assert s.model.options == {"width": 16}


@pytest.mark.parametrize("data,field,hint", [
    ({"bogus": 1}, "bogus", "allowed"),
    ({"optimizer": {"name": "sgd", "lr": 0.1, "nesterov": True}}, "optimizer.nesterov", "allowed"),
    ({"model": "vgg"}, "model.name", "mlp, cnn, resnet, transformer"),
    ({"dataset": "cifar10"}, "dataset.name", "digits, mnist, text, synthetic"),
    ({"world_size": 0}, "world_size", "1..1024"),
    ({"world_size": "two"}, "world_size", "integer"),
    ({"steps": -5}, "steps", "1.."),
    ({"batch_size": 1.5}, "batch_size", "integer"),
    ({"optimizer": {"name": "sgd", "lr": 0}}, "optimizer.lr", "(0, 10]"),
    ({"optimizer": {"name": "sgd", "momentum": 1.0}}, "optimizer.momentum", "[0, 1)"),
    ({"optimizer": {"name": "adam", "momentum": 0.9}}, "optimizer.momentum", "betas"),
    ({"optimizer": {"name": "rmsprop"}}, "optimizer.name", "sgd, adam, adamw"),
    ({"compressor": {"name": "gzip"}}, "compressor.name", "none"),
    ({"compressor": {"name": "none", "ratio": 0.1}}, "compressor", "ratio"),
    ({"schedule": {"name": "bucket", "cap_mb": 0}}, "schedule.cap_mb", "(0, 4096]"),
    ({"schedule": {"name": "fastest"}}, "schedule.name", "layerwise"),
    ({"comm": {"mode": "async"}}, "comm.mode", "sync, wfbp"),
    ({"network": {"link": "wifi"}}, "network.link", "loopback"),
    ({"network": {"link": "loopback", "gbps": 1}}, "network.gbps", "loopback"),
    ({"network": {"link": "modeled"}}, "network.gbps", "[0.001, 400]"),
    ({"network": {"link": "shaped", "gbps": 1, "latency_us": 5}}, "network.latency_us", "modeled"),
    ({"model": "transformer", "dataset": "digits"}, "model.name", "text"),
    ({"model": "cnn", "dataset": "text"}, "model.name", "image"),
    ({"dataset": {"name": "digits", "shape": [3, 8, 8]}}, "dataset.shape", "synthetic"),
    ({"dataset": {"name": "synthetic", "shape": [3, 8]}}, "dataset.shape", "[C, H, W]"),
    ({"backend": "mpi"}, "backend", "auto, gloo, nccl"),
    ({"backend": "nccl", "device": "cpu"}, "backend", "gloo"),
    ({"timeline": "yes"}, "timeline", "true or false"),
    ({"fault": {"kind": "raise", "rank": 5}}, "fault.rank", "world_size"),
    ([1, 2], "", "mapping"),
])
def test_bad_specs_name_the_field(data, field, hint):
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(data)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(field), msg
    assert hint in msg, msg


def test_overrides_and_files(tmp_path):
    d = apply_overrides({"model": "cnn", "steps": 10}, ["steps=20", "model.name=mlp", "compressor.name=none",
                                                        "optimizer.lr=0.1"])
    assert d["steps"] == 20 and d["model"] == {"name": "mlp"} and d["optimizer"]["lr"] == 0.1
    p = tmp_path / "s.yaml"
    p.write_text("model: mlp\nsteps: 7\n")
    assert load_spec(str(p)).steps == 7
    p.write_text("model: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(str(p))
    with pytest.raises(SpecError, match="FIELD=VALUE"):
        apply_overrides({}, ["steps"])


# -- schedules ----------------------------------------------------------------
def fake(sizes, dtype="float32"):
    return [ParamInfo(name=f"p{i}", numel=n, element_size=4, dtype=dtype) for i, n in enumerate(sizes)]


def test_layerwise_and_allinone():
    ps = fake([10, 20, 30])
    assert schedules.build("layerwise", ps) == [[0], [1], [2]]
    assert schedules.build("allinone", ps) == [[0, 1, 2]]


def test_bucket_cap_closes_at_cap_and_first_bucket_small():
    quarter = MB // 4 // 4  # elements of 0.25 MB in fp32
    ps = fake([quarter] * 12)
    # first bucket capped at 1 MB (4 tensors), then 2 MB buckets (8 tensors)
    assert schedules.build("bucket", ps, cap_mb=2) == [list(range(4)), list(range(4, 12))]
    assert schedules.build("bucket", ps, cap_mb=0.5) == [[i, i + 1] for i in range(0, 12, 2)]
    assert schedules.bucket(ps, cap_mb=2, first_cap_mb=None) == [list(range(8)), list(range(8, 12))]
    # a tensor larger than the cap gets a bucket of its own
    big = fake([quarter, 8 * quarter, quarter])
    assert schedules.bucket(big, cap_mb=0.5, first_cap_mb=None) == [[0, 1], [2]]


def test_buckets_never_mix_dtypes():
    ps = fake([4, 4]) + fake([4, 4], dtype="float16")
    assert schedules.build("allinone", ps) == [[0, 1], [2, 3]]
    assert schedules.build("bucket", ps, cap_mb=25) == [[0, 1], [2, 3]]


def test_check_rejects_broken_layouts():
    ps = fake([1, 1, 1])
    for bad in ([[0], [2]], [[1, 0], [2]], [[0], [], [1, 2]], [[0, 1, 2, 2]]):
        with pytest.raises(AssertionError):
            schedules.check(bad, ps)
    with pytest.raises(ValueError, match="cap_mb"):
        schedules.bucket(ps, cap_mb=0)
    with pytest.raises(ValueError, match="allowed"):
        schedules.build("nope", ps)


def test_every_example_spec_is_valid(monkeypatch):
    from pathlib import Path
    from commlab.lab.service.queue import Lab
    from commlab.lab.front.sweep import Sweep
    examples = Path(__file__).resolve().parents[1] / "examples"
    monkeypatch.syspath_prepend(str(examples))  # own-model.yaml's package, as its comment says (PYTHONPATH=examples)
    specs = [p for p in examples.glob("*.yaml") if p.name not in ("sweep.yaml", "pytorchjob.yaml")]  # a grid, a k8s manifest
    assert len(specs) >= 3
    for p in specs:
        load_spec(str(p))
    assert len(Sweep(Lab(examples / ".unused"), str(examples / "sweep.yaml")).cells) == 7


@pytest.mark.parametrize("name", ["demo", "topk-ef", "transformer-text", "resnet-modeled-1gbit", "mergecomp-topk",
                                  "dear-1gbit", "mixed-modeled-1gbit", "local_sgd", "post_local_sgd", "diloco",
                                  "streaming_diloco", "demo_momentum"])
def test_examples_are_valid_specs(name):
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "examples", f"{name}.yaml")
    assert load_spec(path).name  # a spec the README points at must never rot
