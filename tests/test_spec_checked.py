"""The spec is data, checked once: the full check (JobSpec.from_dict, commlab/engine/spec.py) runs where a run is
admitted; the queue, the launcher and the ranks read what it wrote (spec.json) with JobSpec.from_checked, which
builds no compressor or method, imports nothing the spec names and reads no environment. Each list of names has
one source, and schedule.cap_mb is the one byte cap (an older spec's comm.cap_mb loads as it)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import commlab
from commlab.engine import external, methods, runfiles, schedules
from commlab.engine import compressors
from commlab.engine import spec as S
from commlab.engine.comm import modes
from commlab.engine.spec import JobSpec, SpecError
from commlab.lab.base.specs import apply_overrides, load_spec
from commlab.lab.rundir.store import Run
from commlab.lab.service.queue import Lab

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"name": "once", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 3, "batch_size": 16,
         "eval_every": 0, "threads": 1}


# --------------------------------------------------------------------------- checked once

COUNTER = '''
import os

if os.environ.get("SPEC_CHECKS"):  # every full check of a JobSpec in this process, one line each
    from commlab.engine import spec as _spec

    _check = _spec.JobSpec.__post_init__

    def _counted(self):
        with open(os.environ["SPEC_CHECKS"], "a") as f:
            f.write(f"{os.getpid()} {os.environ.get('RANK', 'admission')}\\n")
        _check(self)

    _spec.JobSpec.__post_init__ = _counted
'''


def test_commlab_run_checks_the_spec_once_on_its_way_to_the_ranks(tmp_path):
    """`commlab run` of a two-rank spec, every process of it counting its full checks (a sitecustomize on
    PYTHONPATH wraps JobSpec's check): one, in the command's own process; none in the queue, the launcher or the
    ranks (there were six: the command, three in its supervisor, one per rank)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(COUNTER)
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps(SMALL))
    count = tmp_path / "checks.txt"
    env = {**os.environ, "SPEC_CHECKS": str(count), "COMMLAB_WARM": "0",  # ranks of this process's own, not forked
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)] + ([os.environ["PYTHONPATH"]]
                                                                   if os.environ.get("PYTHONPATH") else []))}
    r = subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--quiet", "--runs",
                        str(tmp_path / "runs")], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert len(list(run_dir.glob("pid-rank*.json"))) == 2  # both ranks ran (and would have counted)
    lines = count.read_text().splitlines()
    assert [ln.split()[1] for ln in lines] == ["admission"], lines


TORCH_SEEN = '''
import atexit
import os
import sys

if os.environ.get("TORCH_SEEN"):  # whether this process imported torch, written as it exits
    def _seen():
        with open(os.environ["TORCH_SEEN"], "a") as f:
            argv = [os.path.basename(sys.argv[0]), *sys.argv[1:2]]
            f.write(f"{' '.join(argv)}|{'torch' in sys.modules}\\n")
    atexit.register(_seen)
'''


def test_commlab_run_admits_in_a_warm_child_and_never_imports_torch(tmp_path):
    """`commlab run` checks its spec in a child of the warm server (torch imported there already): the command's
    own process never imports torch, and what it admits is what the check in this process gives: the same
    spec.json, the engine switch its environment set recorded as from there, the same one-line errors (one
    of them about that environment)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(TORCH_SEEN)
    seen = tmp_path / "seen.txt"
    env = {**os.environ, "TORCH_SEEN": str(seen), "COMMLAB_FUSED": "0",
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)] + ([os.environ["PYTHONPATH"]]
                                                                   if os.environ.get("PYTHONPATH") else []))}
    env.pop("COMMLAB_WARM", None)

    def run(data, extra=()):
        spec = tmp_path / "s.json"
        spec.write_text(json.dumps(data))
        return subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", "run", str(spec), "--quiet", "--runs",
                               str(tmp_path / "runs"), *extra], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env=env)

    r = run({**SMALL, "compressor": {"name": "topk", "ratio": 0.1}})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if d.is_dir() and not d.name.startswith(".")]
    done = Run(run_dir)
    assert done.state == "done"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMMLAB_FUSED", "0")
        here = JobSpec.from_dict({**SMALL, "compressor": {"name": "topk", "ratio": 0.1}})
    assert done.spec_dict() == here.to_dict() and here.engine.fused is False
    assert json.loads((run_dir / runfiles.RESOLVED).read_text())["engine_from_env"] == {"fused": "COMMLAB_FUSED=0"}

    bad = {**SMALL, "compressor": {"name": "topk", "ratio": 2}}
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(bad)
    r = run(bad)
    assert r.returncode == 2 and r.stderr.strip() == f"commlab: error: {e.value}", r.stderr
    env["COMMLAB_TIMEOUT_S"] = "-1"
    r = run(SMALL, ["--check"])
    assert r.returncode == 2 and r.stderr.strip() == ("commlab: error: engine.timeout_s: must be in (0, 604800], "
                                                      "got -1 (from COMMLAB_TIMEOUT_S=-1 in the environment)"), r.stderr
    assert [ln for ln in seen.read_text().splitlines() if ln.startswith("cli.py ")] == ["cli.py run|False"] * 3


def test_the_queue_and_the_launcher_read_spec_json_without_checking(tmp_path, monkeypatch):
    run = Lab(tmp_path).create(commlab.spec(dict(SMALL, compressor={"name": "topk", "ratio": 0.1})))

    def no_check(self):
        raise AssertionError("checked again")
    monkeypatch.setattr(JobSpec, "__post_init__", no_check)
    s = run.spec()
    assert s.compressor.params == {"ratio": 0.1} and s.world_size == 2 and s.to_dict() == run.spec_dict()


def nothing_checks(monkeypatch) -> None:
    """Every way the check builds or imports what a spec names, made to fail."""
    def refuse(*a, **k):
        raise AssertionError("from_checked built or imported something")
    for mod, name in ((compressors, "check"), (compressors, "resolve"), (compressors, "make"), (methods, "make"),
                      (external, "check_import"), (external, "check_model"), (external, "import_object")):
        monkeypatch.setattr(mod, name, refuse)


def test_from_checked_builds_and_imports_nothing(monkeypatch):
    checked = {**JobSpec.from_dict({}).to_dict(),
               "compressor": {"name": "nowhere.codecs:Gone", "error_feedback": True, "params": {"k": 3},
                              "per_bucket": [{"below_mb": 1.0, "name": "none", "error_feedback": False, "params": {}}]},
               "model": {"name": "nowhere.models:build", "options": {"width": 4}, "loss": "nowhere.losses:l1"},
               "method": {"name": "diloco", "params": {"H": 5}, "compressor": {}}}
    nothing_checks(monkeypatch)
    monkeypatch.setenv("COMMLAB_GRAPHS", "not read")  # nor the environment
    s = JobSpec.from_checked(checked)
    assert s.to_dict() == checked and s.engine.from_env == {}
    assert s.compressor.per_bucket[0]["below_mb"] == 1.0 and s.model.options == {"width": 4}


def test_from_checked_takes_a_checked_document_only():
    with pytest.raises(SpecError, match=r"^comm\.rate: unknown field; this is not a spec\.json that commlab's "
                                        r"check wrote$"):
        JobSpec.from_checked({"comm": {"mode": "wfbp", "rate": 3}})
    with pytest.raises(SpecError, match=r"^schedule: must be a mapping, got 'bucket'$"):
        JobSpec.from_checked({"schedule": "bucket"})  # a short form is the check's to expand


def test_a_spec_the_check_made_reads_back_the_same():
    for d in (SMALL, {"comm": "dear", "schedule": {"cap_mb": 2}, "compressor": "fp16"},
              {"method": {"name": "diloco", "H": 4, "compressor": {"name": "topk", "ratio": 0.1}}},
              {"schedule": "mergecomp", "compressor": {"name": "powersgd", "rank": 2}},
              {"compressor": {"name": "topk", "ratio": 0.01, "per_bucket": [{"below_mb": 1, "name": "none"}]}}):
        s = JobSpec.from_dict(d)
        assert JobSpec.from_checked(json.loads(json.dumps(s.to_dict()))) == s, d


# --------------------------------------------------------------------------- one list of each

def test_each_list_of_names_has_one_source():
    assert S.SCHEDULES_AVAILABLE == tuple(schedules.SCHEDULES)
    assert tuple(modes.MODES) == S.COMM_AVAILABLE
    assert all(cls.mode == m for m, cls in modes.MODES.items())
    assert not [n for n in dir(S) if n.endswith("_PLANNED")]
    comm = re.compile(r"""["']sync["'],\s*["']wfbp["'],\s*["']dear["']""")
    sched = re.compile(r"""["']layerwise["'],\s*["']allinone["']""")
    found = {"comm": [], "schedule": []}
    for p in sorted((ROOT / "commlab").rglob("*.py")):
        text = p.read_text()
        found["comm"] += [str(p.relative_to(ROOT))] * len(comm.findall(text))
        found["schedule"] += [str(p.relative_to(ROOT))] * len(sched.findall(text))
    assert found == {"comm": ["commlab/engine/spec.py"], "schedule": []}


def test_an_unknown_name_says_what_is_allowed():
    for d, field, allowed in (({"comm": "ring"}, "comm.mode", "sync, wfbp, dear"),
                              ({"schedule": "greedy"}, "schedule.name", "layerwise, allinone, bucket, mergecomp, "
                                                                        "layerfusion"),
                              ({"network": "pigeon"}, "network.link", "loopback, shaped, modeled")):
        with pytest.raises(SpecError) as e:
            JobSpec.from_dict(d)
        assert e.value.path == field and e.value.msg.endswith(f"; allowed: {allowed}")


# --------------------------------------------------------------------------- one byte cap

OLD_DEAR = {"name": "bucket", "cap_mb": 25.0, "warmup_steps": None, "steps_per_candidate": None, "max_groups": None,
            "max_candidates": None, "retune": None, "profile_steps": None}


def old_spec_json(comm: dict) -> dict:
    """A dear run's spec.json as the version before wrote it: schedule at its default, the cap in comm.cap_mb."""
    d = JobSpec.from_dict({}).to_dict()
    del d["engine"]
    d["schedule"] = dict(OLD_DEAR)
    d["comm"] = {"mode": "wfbp", "cap_mb": None, "layers": None, "tune": False, "tune_steps": None, **comm}
    return d


@pytest.mark.parametrize("comm, cap", [
    ({"mode": "dear", "cap_mb": 2.0}, 2.0),
    ({"mode": "dear", "cap_mb": 25.0}, 25.0),
    ({"mode": "dear", "layers": 3}, 25.0),
    ({"mode": "dear", "tune": True, "tune_steps": 5}, 25.0),
    ({"mode": "wfbp"}, 25.0),
])
def test_an_older_run_directory_loads_with_its_cap_under_the_new_name(tmp_path, comm, cap):
    old = old_spec_json(comm)
    run = Run(tmp_path / "old")
    run.path.mkdir()
    run.file(runfiles.SPEC).write_text(json.dumps(old))
    d = run.spec_dict()
    assert d["schedule"]["cap_mb"] == cap and "cap_mb" not in d["comm"]
    assert run.spec().schedule.cap_mb == cap and run.spec().comm.mode == comm["mode"]
    again = JobSpec.from_dict(old)  # `commlab run runs/<old>/spec.json`: the full check takes it too
    assert again.schedule.cap_mb == cap and again.comm == run.spec().comm


def test_the_old_name_in_a_spec_file_means_what_it_meant(tmp_path, capsys):
    from commlab.lab.front.cli import main
    f = tmp_path / "d.yaml"
    f.write_text("comm: {mode: dear, cap_mb: 4}\n")
    assert main(["run", str(f), "--check"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schedule"]["cap_mb"] == 4.0 and "cap_mb" not in d["comm"]
    s = load_spec(data={"comm": "dear"}, overrides=["comm.cap_mb=0.5"])
    assert s.schedule.cap_mb == 0.5 and s == load_spec(data={"comm": "dear", "schedule": {"cap_mb": 0.5}})


@pytest.mark.parametrize("d, field, says", [
    ({"schedule": {"cap_mb": 8}, "comm": {"mode": "dear", "cap_mb": 4}}, "comm.cap_mb",
     "is schedule.cap_mb's old name, and the two differ (4 and 8); give schedule.cap_mb only"),
    ({"comm": {"mode": "wfbp", "cap_mb": 4}}, "comm.cap_mb",
     "only comm.mode dear took comm.cap_mb; the byte cap of buckets is schedule.cap_mb (write schedule: {cap_mb: 4})"),
    ({"comm": {"mode": "dear", "cap_mb": 0}}, "comm.cap_mb", "must be in (0, 4096], got 0"),
    ({"comm": {"mode": "dear", "cap_mb": "big"}}, "comm.cap_mb", "must be a number, got 'big'"),
    ({"comm": {"mode": "dear", "layers": 2, "cap_mb": 4}}, "comm.layers",
     "give one of schedule.cap_mb, comm.layers or comm.tune"),
    ({"schedule": {"cap_mb": 4}, "comm": {"mode": "dear", "tune": True}}, "comm.tune",
     "give one of schedule.cap_mb, comm.layers or comm.tune"),
    ({"schedule": "layerwise", "comm": "dear"}, "schedule", "leave schedule.name at bucket, got layerwise"),
])
def test_caps_that_cannot_both_hold_are_one_line_naming_the_fields(d, field, says):
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(d)
    assert e.value.path == field and says in e.value.msg and "\n" not in str(e.value)


def test_dear_takes_the_schedules_cap():
    s = JobSpec.from_dict({"comm": "dear", "schedule": {"cap_mb": 2}})
    assert s.schedule.cap_mb == 2.0 and s.comm.layers is None and not s.comm.tune
    assert JobSpec.from_dict({"comm": "dear"}).schedule.cap_mb == S.DEAR_CAP_MB == S.CAP_MB == 25.0
    # the --set form of the old name on a spec file that already says schedule: {cap_mb: 25} (demo.yaml does)
    data = apply_overrides({"schedule": {"name": "bucket", "cap_mb": 25}}, ["comm.mode=dear", "comm.cap_mb=1"])
    assert JobSpec.from_dict(data).schedule.cap_mb == 1.0


def test_numbers_with_an_exponent_and_no_dot_are_numbers(tmp_path):
    """``lr: 1e-3`` is a float in a spec file, a --set value and a text box, as in JSON and YAML 1.2 (PyYAML's own
    loader, following YAML 1.1, reads it as the string '1e-3', and the spec then said the rate was not a number)."""
    from commlab.lab.base.specs import load_yaml, typed_yaml
    f = tmp_path / "s.yaml"
    f.write_text("name: run-1e5\nmodel: mlp\ndataset: digits\nsteps: 2\noptimizer: {name: adam, lr: 1e-3}\n"
                 "compressor: {name: topk, ratio: 5E-2}\n")
    s = load_spec(str(f), overrides=["network.link=modeled", "network.gbps=2.5e1"])
    assert s.name == "run-1e5" and s.optimizer.lr == 0.001 and s.network.gbps == 25.0
    assert s.compressor.params["ratio"] == 0.05
    assert typed_yaml("{ratio: 1e-2}") == {"ratio": 0.01}
    assert [load_yaml(t) for t in ("-2E+5", "1.0e3", "1_000e2", "1e", "e5", "1e-3x", "0.5", "7")] == \
        [-200000.0, 1000.0, 100000.0, "1e", "e5", "1e-3x", 0.5, 7]
    with pytest.raises(SpecError, match=r"network.gbps: a modeled link needs gbps in \[0.001, 400\], got 1e-09"):
        load_spec(str(f), overrides=["network.link=modeled", "network.gbps=1e-9"])


def test_a_zoo_models_options_are_checked_with_the_spec():
    """What each zoo model's builder takes, no more (a rank met `cnn` with `width` as a TypeError), each a
    positive integer; the names are the builders' own keyword arguments."""
    import inspect

    from commlab.engine import models
    from commlab.engine.codepath import ZOO_OPTIONS
    builders = {"mlp": models.MLP, "cnn": models.CNN, "resnet": models.ResNet, "transformer": models.GPT}
    for name, cls in builders.items():
        kw = [p.name for p in inspect.signature(cls).parameters.values() if p.default is not inspect.Parameter.empty]
        assert tuple(kw) == ZOO_OPTIONS[name], name
    from commlab.engine.codepath import _ZOO_DEFAULTS  # what the n_embd / n_head check assumes of the transformer
    gpt = inspect.signature(models.GPT).parameters
    assert {k: gpt[k].default for k in _ZOO_DEFAULTS} == _ZOO_DEFAULTS
    for model, said in [({"name": "cnn", "width": 8}, "model.width: cnn takes no option 'width'; allowed: none"),
                        ({"name": "mlp", "dropout": 0.1}, "model.dropout: mlp takes no option 'dropout'; allowed: "
                                                          "hidden, depth"),
                        ({"name": "resnet", "width": 0}, "model.width: must be an integer in 1..65536, got 0"),
                        ({"name": "resnet", "options": {"width": "8"}}, "model.width: must be an integer in 1..65536, "
                                                                        "got '8'"),
                        ({"name": "transformer", "n_embd": 130}, "model.n_embd: must be divisible by n_head (4), "
                                                                 "got 130")]:
        with pytest.raises(SpecError) as e:
            commlab.spec({"model": model, "dataset": "text" if model["name"] == "transformer" else "digits"})
        assert str(e.value) == said
    assert commlab.spec({"model": {"name": "resnet", "width": 8}}).model.options == {"width": 8}
    assert commlab.spec({"model": {"name": "transformer", "n_embd": 132, "n_head": 6}, "dataset": "text"})


def test_a_fault_at_a_sync_step_is_checked_without_walking_the_run():
    """The check names a method's first exchanges when ``fault.step`` has none; it looks at no more than SCAN_STEPS
    steps, each in constant time (a student's uploaded profile once asked for 10,000,000 steps of 100,000 fragments
    in the server's process: days of CPU)."""
    from commlab.engine import methods
    spec = {"model": "cnn", "dataset": "digits", "steps": 10_000_000,
            "method": {"name": "streaming_diloco", "H": 1_000_000, "fragments": 100_000},
            "fault": {"kind": "raise", "at": "sync", "step": 0}}
    with pytest.raises(SpecError, match=r"^fault.step: method streaming_diloco has no exchange of its own in step 0 "
                                        r"\(its first: 8, 18, 28, 38\)$"):
        JobSpec.from_dict(spec)
    # Streaming DiLoCo's constant-time answer is its per-fragment definition's
    cls = methods.resolve("streaming_diloco")
    for h, n, tau in [(1, 1, 0), (7, 3, 2), (10, 10, 0), (12, 5, 11), (50, 4, 3), (60, 7, 0)]:
        m = cls(H=h, fragments=n, tau=tau)
        assert [m.exchanges_at(s) for s in range(3 * h)] == \
            [any(m.issues(s, f) for f in range(n)) for s in range(3 * h)], (h, n, tau)
    never = {**spec, "steps": 200_000, "method": {"name": "local_sgd", "H": 150_000}}
    with pytest.raises(SpecError, match=r"\(its first: none in its first 100000 steps\)$"):
        JobSpec.from_dict({**never, "fault": {"kind": "raise", "at": "sync", "step": 3}})
