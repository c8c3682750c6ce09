"""A run records what ran: the spec's ``engine`` section (commlab/engine/spec.py, EngineSpec), the switches that
change how a rank computes. Unset ones come from the admitting process's environment (COMMLAB_FUSED, ...), spec.json
holds them resolved, resolved.json's ``engine_from_env`` says which the environment gave, the ranks put the spec's
values into their own environment, and rank 0 ends a run with the digest of its model (``params_sha256``): a
rerun of a run's spec.json in a clean environment is the same run."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from commlab.engine import runfiles
from commlab.engine.comm import buffers
from commlab.engine.spec import ENGINE_DEFAULTS, ENGINE_ENV, JobSpec, SpecError
from commlab.engine.trainer import params_digest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch):
    """No engine switch in this process's environment."""
    for var in ENGINE_ENV.values():
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# --------------------------------------------------------------------------- the section

def test_unset_switches_take_the_environment_then_the_defaults(clean_env):
    s = JobSpec.from_dict({})
    assert s.to_dict()["engine"] == ENGINE_DEFAULTS and s.engine.from_env == {}
    clean_env.setenv("COMMLAB_FUSED", "0")
    clean_env.setenv("COMMLAB_GRAPHS", "1")
    clean_env.setenv("COMMLAB_TIMEOUT_S", "45")
    s = JobSpec.from_dict({"engine": {"graphs": False}})  # the spec's own value wins over the environment
    assert s.to_dict()["engine"] == {"fused": False, "fused_launch": "direct", "graphs": False, "buffer_pool": True,
                                     "timeout_s": 45.0}
    assert s.engine.from_env == {"fused": "COMMLAB_FUSED=0", "timeout_s": "COMMLAB_TIMEOUT_S=45"}
    # what spec.json holds loads back to the same spec, and the ranks' reading of it says nothing came from theirs
    assert JobSpec.from_dict(s.to_dict()) == s and JobSpec.from_checked(s.to_dict()) == s
    assert JobSpec.from_checked(s.to_dict()).engine.from_env == {}
    assert s.engine.environment() == {"COMMLAB_FUSED": "0", "COMMLAB_FUSED_LAUNCH": "direct", "COMMLAB_GRAPHS": "0",
                                      "COMMLAB_BUFFER_POOL": "1", "COMMLAB_TIMEOUT_S": "45.0"}
    fused = JobSpec.from_dict({"engine": {"fused": "interpret", "fused_launch": "triton"}}).engine
    assert fused.environment()["COMMLAB_FUSED"] == "interpret" and fused.environment()["COMMLAB_FUSED_LAUNCH"] == "triton"


def test_a_checked_spec_given_again_keeps_where_its_switches_came_from(clean_env):
    """commlab.run(commlab.spec(...)) checks the JobSpec again (it may have been changed since): the switches its
    first check took from the environment still say so, unless the second one changed them."""
    import commlab
    clean_env.setenv("COMMLAB_FUSED", "0")
    clean_env.setenv("COMMLAB_GRAPHS", "1")
    first = commlab.spec({})
    clean_env.delenv("COMMLAB_FUSED")
    clean_env.delenv("COMMLAB_GRAPHS")
    again = commlab.spec(first, overrides=["engine.graphs=false"])
    assert again.engine.fused is False and again.engine.graphs is False
    assert again.engine.from_env == {"fused": "COMMLAB_FUSED=0"}


def test_a_spec_json_without_the_section_leaves_the_ranks_their_environment(clean_env):
    """A run directory written before the section existed: its switches are unset, and the rank sets nothing."""
    old = JobSpec.from_dict({}).to_dict()
    del old["engine"]
    s = JobSpec.from_checked(old)
    assert s.engine.environment() == {} and s.engine.timeout_s is None


@pytest.mark.parametrize("engine, env, field, says", [
    ({"fused": "yes"}, {}, "engine.fused", "must be true, false or interpret, got 'yes'"),
    ({"fused": 1}, {}, "engine.fused", "must be true, false or interpret, got 1"),
    ({"fused_launch": "Direct"}, {}, "engine.fused_launch", "'Direct' is not allowed; allowed: direct, triton"),
    ({"graphs": "1"}, {}, "engine.graphs", "must be true or false, got '1'"),
    ({"timeout_s": 0}, {}, "engine.timeout_s", "must be in (0, 604800], got 0"),
    ({"nccl": True}, {}, "engine.nccl", "unknown field; allowed: fused, fused_launch, graphs, buffer_pool, timeout_s"),
    ({}, {"COMMLAB_GRAPHS": "yes"}, "engine.graphs", "COMMLAB_GRAPHS='yes' in the environment: must be 1 or 0 (or unset)"),
    ({}, {"COMMLAB_FUSED": "on"}, "engine.fused", "COMMLAB_FUSED='on' in the environment: must be 1 or 0 or interpret"),
    ({}, {"COMMLAB_BUFFER_POOL": "off"}, "engine.buffer_pool", "COMMLAB_BUFFER_POOL='off' in the environment"),
    ({}, {"COMMLAB_TIMEOUT_S": "soon"}, "engine.timeout_s", "COMMLAB_TIMEOUT_S='soon' in the environment: must be a "
                                                           "number of seconds"),
    ({}, {"COMMLAB_TIMEOUT_S": "-1"}, "engine.timeout_s", "got -1 (from COMMLAB_TIMEOUT_S=-1 in the environment)"),
])
def test_a_bad_switch_is_one_line_naming_the_field(clean_env, engine, env, field, says):
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict({"engine": engine})
    assert e.value.path == field and says in str(e.value) and "\n" not in str(e.value)


def test_the_cli_says_a_bad_switch_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_ENV.values()}
    r = subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "run", str(ROOT / "examples" / "demo.yaml"),
                        "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**env, "COMMLAB_GRAPHS": "maybe"})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "commlab: error: engine.graphs: COMMLAB_GRAPHS='maybe' in the environment: must be 1 or 0 (or unset)"]


def test_the_buffer_pool_reads_its_switch_when_used(monkeypatch):
    """Not at import: a rank sets COMMLAB_BUFFER_POOL from its spec after the engine's modules are imported."""
    cpu, n = torch.device("cpu"), buffers.MIN_BYTES // 4
    buffers.clear()
    try:
        monkeypatch.setenv("COMMLAB_BUFFER_POOL", "0")
        a = buffers.take(n, torch.float32, cpu)
        del a
        assert buffers._kept_bytes == 0
        monkeypatch.setenv("COMMLAB_BUFFER_POOL", "1")
        b = buffers.take(n, torch.float32, cpu)
        ptr = b.data_ptr()
        del b
        assert buffers._kept_bytes == n * 4 and buffers.take(n, torch.float32, cpu).data_ptr() == ptr
    finally:
        buffers.clear()


def test_the_digest_is_of_every_value_bit_for_bit():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    b = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    b.load_state_dict(a.state_dict())
    assert params_digest(a) == params_digest(b) and len(params_digest(a)) == 64
    with torch.no_grad():
        b[0].weight[0, 0] = torch.nextafter(b[0].weight[0, 0], torch.tensor(1.0))  # one ulp
    assert params_digest(a) != params_digest(b)
    b.load_state_dict(a.state_dict())
    b[1].running_mean += 1  # a buffer counts too
    assert params_digest(a) != params_digest(b)


# --------------------------------------------------------------------------- a rerun of spec.json

PROBE = '''
import json
import os

import torch.nn.functional as F

VARS = {vars!r}
OUT = {out!r}
_seen = False


def loss(out, y):
    """Cross entropy, as the default; on a rank's first call it writes the engine's variables as the rank sees them."""
    global _seen
    if not _seen and os.environ.get("RANK") is not None:
        _seen = True
        with open(f"{{OUT}}-{{os.environ['RANK']}}-{{os.getpid()}}.json", "w") as f:
            json.dump({{v: os.environ.get(v) for v in VARS}}, f)
    return F.cross_entropy(out, y)
'''

SWITCHES = {"COMMLAB_FUSED": "0", "COMMLAB_FUSED_LAUNCH": "triton", "COMMLAB_GRAPHS": "1",
            "COMMLAB_BUFFER_POOL": "0", "COMMLAB_TIMEOUT_S": "120"}


def _run(spec_path, runs, env):
    r = subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec_path), "--quiet",
                        "--runs", str(runs)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run_dir,) = [d for d in runs.iterdir() if d.is_dir() and not d.name.startswith(".")]
    final = [json.loads(x) for x in (run_dir / runfiles.METRICS).read_text().splitlines() if '"final"' in x]
    assert len(final) == 1 and final[0]["rank"] == 0 and final[0]["step"] == 4
    return (json.loads((run_dir / runfiles.SPEC).read_text()), json.loads((run_dir / runfiles.RESOLVED).read_text()),
            final[0]["params_sha256"], run_dir)


def _seen(probe_dir, tag):
    """{rank: the engine's variables as that rank saw them}, from the probe loss's files."""
    out = {}
    for p in probe_dir.glob(f"{tag}-*.json"):
        rank = int(p.name.split("-")[1])
        assert rank not in out, "one file per rank"
        out[rank] = json.loads(p.read_text())
    return out


def test_a_rerun_of_spec_json_in_a_clean_environment_is_the_same_run(tmp_path):
    """Two ranks with the engine's switches set in the environment of `commlab run`: spec.json records them and
    resolved.json says they came from there; the ranks run with them. Then `commlab run` of that spec.json in an
    environment without them: the same spec.json, nothing from the environment, the ranks again with the spec's
    values, and the same final parameters (the digest rank 0 writes)."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (tmp_path / "engineprobe.py").write_text(PROBE.format(vars=list(ENGINE_ENV.values()), out=str(probe_dir / "a")))
    spec = {"name": "rerun", "model": {"name": "mlp", "loss": "engineprobe:loss"}, "dataset": "digits",
            "world_size": 2, "steps": 4, "batch_size": 16, "eval_every": 0, "final_eval": False, "threads": 1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    clean = {k: v for k, v in os.environ.items() if k not in ENGINE_ENV.values()}
    clean["PYTHONPATH"] = str(tmp_path) + (os.pathsep + clean["PYTHONPATH"] if clean.get("PYTHONPATH") else "")
    clean["PYTHONDONTWRITEBYTECODE"] = "1"  # the probe is rewritten between the runs: no stale cache of it

    first, resolved, digest, run_dir = _run(tmp_path / "spec.json", tmp_path / "runs1", {**clean, **SWITCHES})
    assert first["engine"] == {"fused": False, "fused_launch": "triton", "graphs": True, "buffer_pool": False,
                               "timeout_s": 120.0}
    assert resolved["engine_from_env"] == {"fused": "COMMLAB_FUSED=0", "fused_launch": "COMMLAB_FUSED_LAUNCH=triton",
                                           "graphs": "COMMLAB_GRAPHS=1", "buffer_pool": "COMMLAB_BUFFER_POOL=0",
                                           "timeout_s": "COMMLAB_TIMEOUT_S=120"}
    assert resolved["world_size"] == 2 and resolved["device"] == "cpu"  # rank 0 kept the admission's key
    want = {**SWITCHES, "COMMLAB_TIMEOUT_S": "120.0"}
    assert _seen(probe_dir, "a") == {0: want, 1: want}

    (tmp_path / "engineprobe.py").write_text(PROBE.format(vars=list(ENGINE_ENV.values()), out=str(probe_dir / "b")))
    again, resolved2, digest2, _ = _run(run_dir / runfiles.SPEC, tmp_path / "runs2", clean)
    assert again == first and resolved2["engine_from_env"] == {}
    assert _seen(probe_dir, "b") == {0: want, 1: want}  # the spec's values, not the clean environment's
    assert digest2 == digest
