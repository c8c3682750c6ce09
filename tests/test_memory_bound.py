"""A student's run is bounded in memory (commlab/room/owners.py ``rank_mb``, commlab/lab/base/procs.py ``limit_data``,
commlab/lab/rundir/launcher.py): the quota is checked, each rank of a student's run starts under an OS limit
(RLIMIT_DATA), a rank that passes it fails the run with one line naming the limit and the run keeps its logs,
a small run passes under the default, and the teacher's and the local user's runs have no limit unless
runs/lab.json's top-level ``rank_mb`` sets one for everyone. Runs here: CPU, gloo, two ranks, a few seconds."""
import json
import subprocess
import sys

import pytest

import commlab
from commlab.lab.base import procs
from commlab.lab.base.errors import LabError
from commlab.room import owners
from commlab.room import open_lab

SMALL = {"model": "mlp", "dataset": "digits", "steps": 5, "batch_size": 16, "eval_every": 0, "threads": 1,
         "world_size": 2}
HEAVY = {"model": "cnn", "dataset": {"name": "synthetic", "shape": [1, 128, 128], "size": 64}, "steps": 2,
         "batch_size": 16, "eval_every": 0, "threads": 1, "world_size": 2}
"""Two steps of a small cnn on big images: about 100 MB of activations a rank at the least (owners.activations_mb),
more than 450 MB of data in all (measured: it fails under 450), so it fails under a limit of 400 MB and runs in a
few seconds without one."""
BIG = {"model": "cnn", "dataset": {"name": "synthetic", "shape": [3, 512, 512], "size": 16}, "batch_size": 256,
       "world_size": 4}
"""The attacker review's spec: ~25 GB of activations per rank at the least, 888 MB of data (under data_mb)."""


def lab_json(root, **cfg):
    (root / "lab.json").write_text(json.dumps(cfg))


# --------------------------------------------------------------------------- the quota and its default

@pytest.mark.parametrize("value", [0, -5, 1.5, "2048", True])
def test_a_bad_rank_mb_quota_is_one_line_naming_it(tmp_path, value):
    lab_json(tmp_path, quotas={"rank_mb": value})
    with pytest.raises(LabError, match=r"quotas\.rank_mb: must be a positive integer or null \(no limit\), got ") as e:
        owners.quotas(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", [0, 2.5, "1024"])
def test_a_bad_rank_mb_for_everyone_is_one_line_naming_it(tmp_path, value):
    lab_json(tmp_path, rank_mb=value)
    with pytest.raises(LabError, match=r"lab\.json: rank_mb must be a positive integer or null \(no limit\), got "):
        open_lab(tmp_path, room=True).create(commlab.spec(SMALL))


def test_the_default_fits_the_machine():
    """max_jobs x world_size x rank_mb within 3/4 of the machine's memory, RANK_MB at most, 512 at least."""
    assert owners.machine_rank_mb(1, 4, memory=24105) == 2048  # this 2-core, 23.5 GB machine: 8 GB at most
    assert owners.machine_rank_mb(8, 4, memory=32768) == 768  # 16 cores, 32 GB: 8 x 4 x 768 = 24 GB
    assert owners.machine_rank_mb(8, 4, memory=65536) == 1536
    assert owners.machine_rank_mb(16, 4, memory=8192) == 512  # overcommitted: the floor (no rank starts below it)
    assert 512 <= owners.quotas("/nonexistent")["rank_mb"] <= 2048


def test_a_quota_set_in_lab_json_is_taken_as_it_is(tmp_path, monkeypatch):
    lab_json(tmp_path, quotas={"rank_mb": 100_000})
    assert owners.quotas(tmp_path)["rank_mb"] == 100_000
    lab_json(tmp_path, quotas={"rank_mb": None})
    assert "rank_mb" not in owners.quotas(tmp_path)
    lab_json(tmp_path, max_jobs=64)  # the default follows the slots the queue has
    monkeypatch.delenv("COMMLAB_MAX_JOBS", raising=False)
    assert owners.quotas(tmp_path)["rank_mb"] == owners.machine_rank_mb(64, 4)


def test_who_gets_which_limit(tmp_path):
    """A student's run: their quota; the teacher's and the local user's: none, unless lab.json's top-level
    rank_mb sets one for everyone (then a student gets the smaller of the two)."""
    q = open_lab(tmp_path, room=True)
    spec = commlab.spec(SMALL)
    student = q.create(spec, owner="alice").status()
    assert student["rank_limit_mb"] == owners.quotas(tmp_path)["rank_mb"]
    assert student["rank_limit_from"] == "runs/lab.json quotas.rank_mb"
    for owner in ("teacher", None):
        assert "rank_limit_mb" not in q.create(spec, owner=owner).status()
    lab_json(tmp_path, rank_mb=3000, quotas={"rank_mb": 4000})
    assert q.create(spec, owner="teacher").status()["rank_limit_mb"] == 3000
    assert q.create(spec).status()["rank_limit_from"] == "runs/lab.json rank_mb"
    assert q.create(spec, owner="alice").status()["rank_limit_mb"] == 3000
    lab_json(tmp_path, quotas={"rank_mb": None})
    assert "rank_limit_mb" not in q.create(spec, owner="alice").status()


# --------------------------------------------------------------------------- refused before it is queued

def test_an_image_batch_too_big_for_a_rank_is_refused_naming_the_field(tmp_path):
    with pytest.raises(owners.QuotaError, match=r"^quota rank_mb: at most 2048 MB per rank; a batch of 256 images "
                                                r"3x512x512 through cnn needs at least 25,720 MB") as e:
        owners.check_run({"rank_mb": 2048}, commlab.spec(BIG))
    assert e.value.field == "batch_size" and "\n" not in str(e.value)
    # resnet counts its width
    with pytest.raises(owners.QuotaError, match="through resnet"):
        owners.check_run({"rank_mb": 2048}, commlab.spec({**BIG, "model": {"name": "resnet", "options": {"width": 8}}}))
    # the lab's ordinary specs pass the default
    for spec in (SMALL, {**SMALL, "model": "cnn"}, {**BIG, "dataset": {"name": "synthetic"}},
                 {**BIG, "model": "resnet", "dataset": {"name": "synthetic"}}):
        owners.check_run({"rank_mb": 2048}, commlab.spec(spec))


def test_the_estimate_is_a_lower_bound():
    """HEAVY needs more than 450 MB a rank (test_a_student_run_over_its_limit_fails_in_one_line fails it under
    400, and it failed under 450 when measured); the estimate says at least 363: accepted under 400, refused
    only under less than 363."""
    spec = commlab.spec(HEAVY)
    assert owners.RANK_BASE_MB + owners.data_mb(spec) + owners.activations_mb(spec) == pytest.approx(363, abs=1)
    owners.check_run({"rank_mb": 400}, spec)
    with pytest.raises(owners.QuotaError, match="quota rank_mb"):
        owners.check_run({"rank_mb": 350}, spec)


# --------------------------------------------------------------------------- the OS limit

def test_limit_data_bounds_what_a_process_allocates():
    code = ("import resource; print(resource.getrlimit(resource.RLIMIT_DATA)[0] >> 20); "
            "x = bytearray(600 << 20); print('allocated')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: procs.limit_data(200))
    assert p.stdout.splitlines()[0] == "200" and "allocated" not in p.stdout and "MemoryError" in p.stderr
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: procs.limit_data(None))
    assert "allocated" in p.stdout, p.stderr


@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_student_run_over_its_limit_fails_in_one_line(tmp_path, monkeypatch, warm):
    """Both ways a rank starts: forked by the warm server, and as a process of the launcher's."""
    monkeypatch.setenv("COMMLAB_WARM", warm)
    lab_json(tmp_path, quotas={"rank_mb": 400})
    run = open_lab(tmp_path, room=True).submit(commlab.spec(HEAVY), wait=True, owner="alice")
    st = run.status()
    assert st["state"] == "failed", st
    assert st["error"] == (f"out of memory: rank {st['rank']} passed its limit of 400 MB (runs/lab.json "
                           f"quotas.rank_mb); make the batch or the images smaller"), st
    assert "can't allocate memory" in st["cause"]
    # what it logged is kept: the rank's traceback in the log and its error file
    assert "can't allocate memory" in run.file("log.txt").read_text()
    assert any("can't allocate memory" in e["error"] for e in run.errors())


def test_a_small_student_run_passes_under_the_default(tmp_path):
    run = open_lab(tmp_path, room=True).submit(commlab.spec(SMALL), wait=True, owner="alice")
    st = run.status()
    assert st["state"] == "done", st
    assert st["rank_limit_mb"] == owners.quotas(tmp_path)["rank_mb"]


def test_the_teachers_run_has_no_limit(tmp_path):
    """The spec that fails a student's run under 400 MB runs to the end for the teacher under the same lab.json."""
    lab_json(tmp_path, quotas={"rank_mb": 400})
    run = open_lab(tmp_path, room=True).submit(commlab.spec(HEAVY), wait=True, owner="teacher")
    st = run.status()
    assert st["state"] == "done", st
    assert "rank_limit_mb" not in st
