"""Every failure surfaces with its cause, and spec.json says what a run used: the workers' own
files, a corrupt MergeComp cache, a malformed runs/lab.json, the spec's run-time defaults."""
import json
import os

import pytest
import torch

import commlab
from commlab.engine import runfiles, worker
from commlab.engine.tuners import mergecomp
from commlab.engine.spec import DEAR_CAP_MB, DEAR_TUNE_STEPS, JobSpec
from commlab.lab.service import supervise
from commlab.lab.front.cli import main as cli
from commlab.lab.service.queue import Lab

SMALL = {"name": "e", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 3, "batch_size": 16,
         "eval_every": 0, "threads": 1}


# --------------------------------------------------------------------------- the workers' files

def test_worker_file_that_cannot_be_written_is_reported(tmp_path, capsys):
    missing = tmp_path / "gone"
    assert worker._write_json(str(missing), "error-rank1.json", {"rank": 1, "error": "boom"}) is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[commlab] rank 1: could not write ")
    assert "error-rank1.json" in err[0] and "FileNotFoundError" in err[0]


def test_worker_file_is_written_whole(tmp_path, capsys):
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        worker.record_error(str(tmp_path), 3, e)
    assert capsys.readouterr().err == ""
    rec = json.loads((tmp_path / "error-rank3.json").read_text())
    assert rec["rank"] == 3 and rec["error"] == "RuntimeError: boom" and "raise RuntimeError" in rec["traceback"]
    assert [p.name for p in tmp_path.iterdir()] == ["error-rank3.json"]  # no temporary file left


# --------------------------------------------------------------------------- MergeComp's cache

def test_corrupt_cache_is_kept_aside_and_reported_on_read(tmp_path):
    cache = tmp_path / runfiles.MERGECOMP_CACHE
    cache.write_text('{"k": {"cuts": [1, 2')
    with pytest.raises(mergecomp.CacheCorrupt, match=r"mergecomp-cache\.json is unreadable \(JSONDecodeError"):
        mergecomp.read_cache(str(tmp_path), "k")
    (aside,) = tmp_path.glob("mergecomp-cache.json.corrupt-*")
    assert aside.read_text() == '{"k": {"cuts": [1, 2' and not cache.exists()
    assert mergecomp.read_cache(str(tmp_path), "k") is None  # from here on: no cache, as on a first run


def test_corrupt_cache_is_kept_aside_and_reported_on_write(tmp_path):
    cache = tmp_path / runfiles.MERGECOMP_CACHE
    cache.write_text('["not", "entries"]')
    problem = mergecomp.write_cache(str(tmp_path), "k", {"cuts": [3]})
    assert "is unreadable" in problem and "moved to mergecomp-cache.json.corrupt-" in problem
    assert json.loads(cache.read_text()) == {"k": {"cuts": [3]}}
    (aside,) = tmp_path.glob("mergecomp-cache.json.corrupt-*")
    assert aside.read_text() == '["not", "entries"]'
    assert mergecomp.write_cache(str(tmp_path), "j", {"cuts": []}) is None
    assert set(json.loads(cache.read_text())) == {"k", "j"}


def test_a_run_says_its_mergecomp_cache_was_corrupt(tmp_path):
    (tmp_path / runfiles.MERGECOMP_CACHE).write_text("{ this is not json")
    run = commlab.run(dict(SMALL, steps=8, schedule={"name": "mergecomp"}), runs=tmp_path)
    assert run.state == "done", run.status()
    tuning = json.loads(run.file("tuning.json").read_text())
    assert tuning["cache"] == "corrupt" and "searching afresh" in tuning["cache_problem"]
    assert "mergecomp cache: " in run.file("log.txt").read_text()
    assert len(list(tmp_path.glob("mergecomp-cache.json.corrupt-*"))) == 1


# --------------------------------------------------------------------------- runs/lab.json

@pytest.mark.parametrize("text, problem", [
    ("{max_jobs: 2}", "not valid JSON"),
    ("[2]", "must be a JSON object"),
    ('{"max_job": 2}', "unknown key 'max_job'; allowed: max_jobs, disturbance_threshold"),
    ('{"max_jobs": 0}', "max_jobs must be a positive integer, got 0"),
    ('{"max_jobs": "2"}', "max_jobs must be a positive integer, got '2'"),
    ('{"max_jobs": true}', "max_jobs must be a positive integer, got True"),
    ('{"max_ranks": -4}', "max_ranks must be a positive integer, got -4"),
])
def test_malformed_lab_json_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch, text, problem):
    monkeypatch.setenv("COMMLAB_MAX_JOBS", "1")  # an override does not hide a broken file
    (tmp_path / "lab.json").write_text(text)
    assert cli(["runs", "--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"commlab: error: {tmp_path / 'lab.json'}: "), err
    assert problem in err[0]


def test_lab_json_is_read(tmp_path, monkeypatch):
    monkeypatch.delenv("COMMLAB_MAX_JOBS", raising=False)
    (tmp_path / "lab.json").write_text('{"max_jobs": 3, "disturbance_threshold": 0.5}')
    assert Lab(tmp_path).max_jobs == 3


def test_a_run_asking_for_more_ranks_than_the_machine_starts_is_refused_before_it_is_queued(tmp_path, monkeypatch):
    """Four ranks per core, at least eight, unless runs/lab.json's max_ranks says otherwise; one node's share of a
    multi-machine run counts, the ranks of a job another launcher started (torchrun, srun) do not."""
    from commlab.lab.base.errors import LabError
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    lab = Lab(tmp_path)

    def made():
        return sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("."))
    with pytest.raises(LabError, match=r"^world_size: 9 ranks on this machine, more than the 8 it starts for one "
                                       r"run \(4 per core, at least 8; runs/lab.json's max_ranks sets another\)$"):
        lab.create(commlab.spec(dict(SMALL, world_size=9)))
    assert made() == []
    assert lab.create(commlab.spec(dict(SMALL, world_size=8))).status()["state"] == "queued"
    lab.create(commlab.spec(dict(SMALL, world_size=16)), ranks_here=8)  # node 0 of two
    lab.create(commlab.spec(dict(SMALL, world_size=64)), ranks_here=0)  # a job torchrun or srun started
    assert len(made()) == 3
    (tmp_path / "lab.json").write_text('{"max_ranks": 12}')
    lab.create(commlab.spec(dict(SMALL, world_size=12)))
    with pytest.raises(LabError, match="world_size: 13 ranks on this machine, more than the 12 it starts"):
        lab.create(commlab.spec(dict(SMALL, world_size=13)))
    (tmp_path / "lab.json").write_text('{"max_ranks": 0}')
    with pytest.raises(LabError, match="lab.json: max_ranks must be a positive integer, got 0"):
        lab.create(commlab.spec(SMALL))  # a lab opened before the file changed
    assert len(made()) == 4


def test_a_detached_supervisor_puts_a_broken_lab_json_in_the_status(tmp_path, capsys):
    run = Lab(tmp_path).create(commlab.spec(SMALL))
    (tmp_path / "lab.json").write_text("{")
    assert supervise.main(["--runs", str(tmp_path), run.id]) == 2
    st = run.status()
    assert st["state"] == "failed" and "lab.json: not valid JSON" in st["error"]


# --------------------------------------------------------------------------- spec.json: what was used

def test_dear_defaults_are_in_the_spec():
    assert DEAR_CAP_MB == 25.0 and DEAR_TUNE_STEPS == 5
    d = JobSpec.from_dict({"comm": {"mode": "dear"}}).to_dict()
    assert d["schedule"]["cap_mb"] == 25.0 and d["comm"]["tune_steps"] is None and "cap_mb" not in d["comm"]
    comm = JobSpec.from_dict({"comm": {"mode": "dear", "tune": True}}).to_dict()["comm"]
    assert comm["tune_steps"] == 5
    comm = JobSpec.from_dict({"comm": {"mode": "dear", "layers": 2}}).to_dict()["comm"]
    assert comm["layers"] == 2
    for c in ({"mode": "dear"}, {"mode": "dear", "tune": True}, {"mode": "dear", "layers": 2}, {"mode": "wfbp"}):
        s = JobSpec.from_dict({"comm": c})
        assert JobSpec.from_dict(s.to_dict()) == s  # what spec.json holds loads back to the same spec


def test_check_prints_the_defaults_a_run_uses(tmp_path, capsys):
    spec = tmp_path / "d.yaml"
    spec.write_text("comm: {mode: dear}\n")
    assert cli(["run", str(spec), "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"]["cap_mb"] == 25.0


def test_a_run_records_what_it_resolved(tmp_path):
    run = commlab.run(dict(SMALL, comm={"mode": "dear"}, threads=0), runs=tmp_path)
    assert run.state == "done", run.status()
    assert run.spec_dict()["schedule"]["cap_mb"] == 25.0
    res = json.loads(run.file(runfiles.RESOLVED).read_text())
    # device auto: the GPU where there is one, and gloo over CUDA tensors while two ranks share one GPU
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = ("gloo", "cpu") if not gpus else ("nccl" if gpus >= 2 else "gloo", "cuda:0")
    assert (res["backend"], res["device"]) == want
    assert res["threads"] == max(1, (os.cpu_count() or 1) // 2) and res["world_size"] == 2

