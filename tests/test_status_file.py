"""status.json never loses fields: atomic writes, locked read-modify-writes, and no rebuild from
nothing when a reader meets a damaged file (commlab/lab/rundir/store.py)."""
import json
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from commlab.lab.rundir import store
from commlab.lab.rundir.store import Run, StatusError

ROOT = Path(__file__).resolve().parents[1]
SUPERVISOR = {"pid": 4242, "start": 99}

# Loops status changes on one run until killed: both kinds of write, and a padded field so that
# each write takes long enough for a kill to land inside it. Prints "ready" after its first write.
WRITER = r"""
import sys
from commlab.lab.rundir.store import Run
run = Run(sys.argv[1])
first = run.status()["n"] + 1
pad = "x" * 200_000
for n in range(first, first + 10**9):
    if n % 2:
        run.update_status(n=n, pad=pad)
    else:
        run.set_status("running", n=n, pad=pad)
    if n == first:
        print("ready", flush=True)
"""


def new_run(tmp_path, **fields) -> Run:
    path = tmp_path / "r1"
    path.mkdir()
    (path / "spec.json").write_text("{}")
    run = Run(path)
    run.set_status("queued", supervisor=SUPERVISOR, **fields)
    return run


def read_raw(run) -> dict:
    """status.json parsed directly, with no retries and no fallbacks."""
    with open(run.file("status.json")) as f:
        return json.load(f)


def temp_files(run):
    return sorted(p.name for p in run.path.glob(".status.json.*.tmp"))


def test_kill9_at_random_moments_never_tears_or_loses_fields(tmp_path):
    run = new_run(tmp_path, n=0)
    created = read_raw(run)["created"]
    rng = random.Random(15)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    last_n, mid_write = 0, 0
    for _ in range(40):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(run.path)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        threading.Event().wait(rng.uniform(0, 0.03))
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        mid_write += bool(temp_files(run))  # the kill landed between creating and renaming a write
        st = read_raw(run)  # always whole: the old file or the new one
        assert st["created"] == created and st["supervisor"] == SUPERVISOR
        assert st["state"] in ("queued", "running") and st["n"] >= last_n
        last_n = st["n"]
    assert mid_write > 0, "no kill landed inside a write: the test proved nothing"
    assert last_n > 40  # the writers really wrote
    run.update_status(after=True)  # the next writer clears what killed writers left
    assert temp_files(run) == []
    assert read_raw(run)["after"] is True


WRITE_KEYS = r"""
import sys
from commlab.lab.rundir.store import Run
run, tag = Run(sys.argv[1]), sys.argv[2]
for i in range(150):
    run.update_status(**{f"{tag}{i}": i})
"""


def test_concurrent_processes_lose_no_update(tmp_path):
    """Two processes changing the same file: every key either one wrote is there at the end."""
    run = new_run(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ps = [subprocess.Popen([sys.executable, "-c", WRITE_KEYS, str(run.path), tag], cwd=ROOT, env=env)
          for tag in ("a", "b")]
    assert [p.wait() for p in ps] == [0, 0]
    st = read_raw(run)
    missing = [f"{t}{i}" for t in "ab" for i in range(150) if f"{t}{i}" not in st]
    assert missing == [] and st["supervisor"] == SUPERVISOR


def test_concurrent_threads_lose_no_update(tmp_path):
    """Threads of one process (the UI's) share a pid: their temporary files must still differ."""
    run = new_run(tmp_path)
    errors = []

    def work(tag):
        try:
            for i in range(60):
                Run(run.path).update_status(**{f"{tag}{i}": i})
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(t,)) for t in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = read_raw(run)
    assert all(f"{t}{i}" in st for t in "abcd" for i in range(60))


def tear(run) -> bytes:
    """Replace status.json with its first half, as a writer that does not rename would leave it."""
    whole = run.file("status.json").read_bytes()
    run.file("status.json").write_bytes(whole[:len(whole) // 2])
    return whole[:len(whole) // 2]


def test_a_torn_file_is_never_rebuilt_from_nothing(tmp_path, monkeypatch):
    run = new_run(tmp_path)
    torn = tear(run)
    monkeypatch.setattr(store, "_pause", lambda: None)  # the retries find the same torn file at once
    fresh = Run(run.path)  # a process that never saw the whole file
    st = fresh.status()
    assert st["state"] == "unknown" and "status.json: not valid JSON" in st["unreadable"]
    for change in (lambda: fresh.set_status("cancelled"), lambda: fresh.update_status(x=1)):
        with pytest.raises(StatusError, match=r"status\.json: not valid JSON .*nothing written over it"):
            change()
        assert run.file("status.json").read_bytes() == torn  # left for a person to look at


def test_a_torn_file_is_rebuilt_from_the_last_whole_copy_and_kept(tmp_path, monkeypatch, capsys):
    run = new_run(tmp_path, figure=1.5)
    assert run.status()["figure"] == 1.5  # this process now holds a whole copy
    torn = tear(run)
    monkeypatch.setattr(store, "_pause", lambda: None)
    st = run.set_status("running")
    assert st["state"] == "running" and st["supervisor"] == SUPERVISOR and st["figure"] == 1.5
    assert "not valid JSON" in st["recovered"]
    assert read_raw(run) == st
    (aside,) = run.path.glob("status.json.corrupt-*")
    assert aside.read_bytes() == torn and aside.name in st["recovered"]
    assert "not valid JSON" in capsys.readouterr().err


def test_a_change_waits_for_a_writer_that_finishes_its_file(tmp_path, monkeypatch):
    """A reader that meets a half-written file reads again; the whole file it then finds keeps every field."""
    run = new_run(tmp_path, figure=2)
    whole = run.file("status.json").read_bytes()
    tear(run)
    pauses = []

    def writer_finishes():
        pauses.append(1)
        if len(pauses) == 3:
            run.file("status.json").write_bytes(whole)
    monkeypatch.setattr(store, "_pause", writer_finishes)
    st = Run(run.path).set_status("running")
    assert len(pauses) == 3
    assert st["figure"] == 2 and st["supervisor"] == SUPERVISOR and "recovered" not in st


def test_not_an_object_is_unreadable_too(tmp_path, monkeypatch):
    run = new_run(tmp_path)
    run.file("status.json").write_text("[1, 2]")
    monkeypatch.setattr(store, "_pause", lambda: None)
    with pytest.raises(StatusError, match="must be a JSON object, got list"):
        Run(run.path).update_status(x=1)


def test_only_from_keeps_a_final_state(tmp_path):
    run = new_run(tmp_path)
    run.set_status("done", returncode=0)
    st = run.set_status("cancelled", only_from=("queued", "running"), error="late")
    assert st["state"] == "done" and "error" not in st and read_raw(run)["state"] == "done"
    assert run.set_status("failed", only_from=("done",), error="x")["state"] == "failed"


def test_update_status_creates_nothing(tmp_path):
    path = tmp_path / "r2"
    path.mkdir()
    Run(path).update_status(x=1)
    assert not (path / "status.json").exists()


def test_unreadable_error_file_is_reported_as_its_ranks_error(tmp_path):
    run = new_run(tmp_path)
    run.file("error-rank0.json").write_text(json.dumps({"rank": 0, "error": "Connection reset by peer",
                                                          "time": 1.0}))
    run.file("error-rank1.json").write_text('{"rank": 1, "err')
    errs = run.errors()
    assert [e["rank"] for e in errs] == [0, 1]
    assert errs[1]["error"].startswith("error-rank1.json is unreadable:")


def test_the_shared_json_writer_is_whole_or_nothing(tmp_path):
    """commlab.engine.runlog.write_json_atomic, which every JSON file of a run and of the lab goes through: a value
    json cannot encode leaves the old file as it was and no temporary file behind; ``mode`` sets the new
    file's permissions (the workshop's access file is 0600)."""
    import json
    import stat

    import pytest

    from commlab.engine.runlog import write_json_atomic
    path = tmp_path / "x.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    write_json_atomic(str(path), {"b": [1, 2]}, indent=None, mode=0o600)
    assert path.read_text() == '{"b": [1, 2]}'
    write_json_atomic(tmp_path / "y.json", {}, mode=0o600)
    assert stat.S_IMODE((tmp_path / "y.json").stat().st_mode) == 0o600
