"""Which rank caused a failure, from torchrun's report in log.txt and the ranks' error files
(commlab/lab/rundir/launcher.py failure_cause, rank_exits_from_log). The logs are real torchrun 2.x output of
jobs where one rank was killed, raised, or exited without a word."""
import json
from pathlib import Path

import pytest

from commlab.lab.rundir.launcher import failure_cause, finish_status, rank_exits_from_log
from commlab.lab.rundir.store import Run

LOGS = Path(__file__).parent / "data" / "torchrun"
PEER_LOST = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
             "[127.0.0.1]:41234: Connection reset by peer")


def log(name: str) -> str:
    return (LOGS / name).read_text()


def make_run(tmp_path, log_name=None, errors=()) -> Run:
    path = tmp_path / "r"
    path.mkdir()
    (path / "spec.json").write_text("{}")
    if log_name:
        (path / "log.txt").write_text(log(log_name))
    for rank, error, t in errors:
        (path / f"error-rank{rank}.json").write_text(json.dumps({"rank": rank, "error": error, "time": t}))
    return Run(path)


@pytest.mark.parametrize("name, exits", [
    ("rank1-sigkill.log", [(0, -15), (1, -9)]),
    ("rank1-raised.log", [(0, -15), (1, 1)]),
    ("rank0-exit17.log", [(1, -15), (0, 17)]),
    ("rank2-of-3-sigkill.log", [(0, -15), (1, -15), (2, -9)]),
])
def test_rank_exits_from_real_torchrun_reports(name, exits):
    assert rank_exits_from_log(log(name)) == exits


def test_no_report_no_exits():
    assert rank_exits_from_log("[commlab] rank 0: mlp on digits\nTraceback (most recent call last):\n") == []


def test_killed_rank_beats_the_peer_that_lost_its_connection(tmp_path):
    run = make_run(tmp_path, "rank1-sigkill.log", [(0, PEER_LOST, 1.0)])
    assert failure_cause(run) == (1, "rank 1 was killed by SIGKILL (out of memory, or kill -9)")


def test_killed_rank_among_three(tmp_path):
    run = make_run(tmp_path, "rank2-of-3-sigkill.log", [(0, PEER_LOST, 1.0), (1, PEER_LOST, 1.1)])
    assert failure_cause(run) == (2, "rank 2 was killed by SIGKILL (out of memory, or kill -9)")


def test_a_real_error_beats_an_earlier_lost_peer(tmp_path):
    run = make_run(tmp_path, "rank1-raised.log", [(0, PEER_LOST, 1.0), (1, "RuntimeError: boom on rank 1", 2.0)])
    assert failure_cause(run) == (1, "RuntimeError: boom on rank 1")


def test_silent_exit_is_named_with_its_code(tmp_path):
    run = make_run(tmp_path, "rank0-exit17.log")
    assert failure_cause(run) == (0, "rank 0 exited with code 17 without reporting an error")


def test_a_real_error_beats_a_silent_exit(tmp_path):
    run = make_run(tmp_path, "rank0-exit17.log", [(1, "ValueError: bad batch", 5.0)])
    assert failure_cause(run) == (1, "ValueError: bad batch")


def test_only_lost_peers_gives_the_earliest(tmp_path):
    run = make_run(tmp_path, None, [(1, PEER_LOST, 2.0), (0, PEER_LOST.replace("41234", "5"), 1.0)])
    assert failure_cause(run) == (0, PEER_LOST.replace("41234", "5"))


def test_only_sigterms_in_the_report(tmp_path):
    """Every listed rank was stopped by torchrun and none wrote an error: the first one is named."""
    text = log("rank1-sigkill.log").replace("exitcode  : -9 (pid: 23107)  (SIGKILL)",
                                            "exitcode  : -15 (pid: 23107)  (SIGTERM)")
    run = make_run(tmp_path)
    (run.path / "log.txt").write_text(text)
    assert failure_cause(run) == (0, "rank 0 was killed by SIGTERM")


def test_nothing_to_go_on(tmp_path):
    assert failure_cause(make_run(tmp_path)) == (None, None)


def test_finish_status_writes_the_cause(tmp_path):
    run = make_run(tmp_path, "rank1-sigkill.log", [(0, PEER_LOST, 1.0)])
    run.set_status("running")
    assert finish_status(run, 1) == "failed"
    st = run.status()
    assert st["state"] == "failed" and st["rank"] == 1 and "SIGKILL" in st["error"] and st["returncode"] == 1
