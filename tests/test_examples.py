"""The examples a newcomer starts from (examples/): every spec is valid; your own factory and loader, a
torchvision model and a Hugging Face model each build and take their first batch (the lab's preflight);
your own model trains from the CLI with its package on PYTHONPATH. (examples/own_loop.py is run by
tests/test_own_loop.py, the shaped-link specs by tests/test_shaped_runs.py where root is available.)"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commlab.engine import preflight
from commlab.lab.base.specs import load_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
WANTED = {"torchvision-resnet18": "torchvision:resnet18", "hf-gpt2": "hf:gpt2", "own-model": "mypkg.models:build",
          "shaped-0.1gbit": "resnet", "dear-1gbit": "resnet"}


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # what PYTHONPATH=examples does for the CLI


def test_every_kind_of_example_is_there(on_path):
    for name, model in WANTED.items():
        spec = load_spec(str(EXAMPLES / f"{name}.yaml"))
        assert spec.model.name == model, name
    assert load_spec(str(EXAMPLES / "shaped-0.1gbit.yaml")).network.link == "shaped"
    assert (EXAMPLES / "own_loop.py").is_file()


@pytest.mark.parametrize("name", ["own-model", "torchvision-resnet18", "hf-gpt2"])
def test_an_outside_model_takes_its_first_batch(on_path, name):
    pytest.importorskip({"own-model": "torch", "torchvision-resnet18": "torchvision",
                         "hf-gpt2": "transformers"}[name])
    spec = load_spec(str(EXAMPLES / f"{name}.yaml"))
    d = preflight.check(spec)  # builds the model, one forward pass and the loss, as the lab does before a run
    assert d["params"] > 0


def test_your_own_model_trains_from_the_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(ROOT)])}
    r = subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "run", str(EXAMPLES / "own-model.yaml"), "--quiet",
                        "--set", "eval_every=0", "--set", "threads=1",
                        "--runs", str(tmp_path / "runs")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = [p for p in (tmp_path / "runs").iterdir() if (p / "status.json").exists()]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "done"
    evals = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in ln]
    assert evals and evals[-1]["eval_acc"] > 0.75  # the spirals are learnt (about 0.9 here), not guessed (0.5)
