"""Secrets and runs private to the lab's user: the admin token is kept only as its hash (an older file with it
in the clear is rewritten), the teacher's link is shown once, when the token is made, and the runs directory
and every run's directory are readable by the lab's account alone."""
import json
import os
import stat

import pytest

from commlab.lab.base.paths import PRIVATE_MODE, make_private
from commlab.lab.front import appserver
from commlab.room import accounts
from commlab.lab.rundir.store import RunStore
from commlab.room import owners

import commlab


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_the_admin_token_is_kept_only_as_its_hash(tmp_path):
    made = accounts.load_access(tmp_path)
    admin = made["admin_token"]
    text = accounts.access_path(tmp_path).read_text()
    assert admin not in text and accounts._hash(admin) in text
    assert accounts.check_token(tmp_path, admin).admin
    assert "admin_token" not in accounts.load_access(tmp_path)  # only the call that made it holds it
    new = accounts.rotate(tmp_path, "admin")
    assert new not in accounts.access_path(tmp_path).read_text()
    assert accounts.check_token(tmp_path, new).admin and accounts.check_token(tmp_path, admin) is None
    with pytest.raises(accounts.LabError, match="--token: must differ from the admin token"):
        accounts.set_class_token(tmp_path, new)


def test_an_older_file_with_the_admin_token_in_the_clear_is_rewritten_with_its_hash(tmp_path):
    admin = "a" * 30
    accounts.access_path(tmp_path).write_text(json.dumps({"class_token": "c" * 20, "admin_token": admin}))
    assert accounts.check_token(tmp_path, admin) == owners.User(owners.TEACHER, admin=True)
    text = accounts.access_path(tmp_path).read_text()
    assert admin not in text and accounts._hash(admin) in text
    assert mode(accounts.access_path(tmp_path)) == 0o600
    assert accounts.check_token(tmp_path, admin).admin  # read again from the rewritten file


def test_a_damaged_admin_hash_is_named(tmp_path):
    accounts.access_path(tmp_path).write_text(json.dumps({"class_token": "c" * 20, "admin_hash": "x"}))
    with pytest.raises(accounts.LabError, match="admin_hash must be the SHA-256 of the admin token"):
        accounts.load_access(tmp_path)


def test_the_teachers_link_is_printed_once_when_the_token_is_made(tmp_path):
    first = appserver.sign_in_lines(tmp_path, "0.0.0.0", 8501)
    [line] = [x for x in first.splitlines() if "teacher:" in x]
    token = line.split("?token=")[1].split()[0]
    assert accounts.check_token(tmp_path, token).admin
    again = appserver.sign_in_lines(tmp_path, "0.0.0.0", 8501)
    assert token not in again and "commlab workshop rotate admin" in again
    assert accounts.load_access(tmp_path)["class_token"] in again  # the class link is printed at every start


def test_the_runs_directory_and_each_run_are_the_labs_users_alone(tmp_path):
    old = os.umask(0o022)
    try:
        root = tmp_path / "runs"
        run = RunStore(root).create(commlab.spec({"name": "private", "steps": 1}))
        assert mode(root) == PRIVATE_MODE and mode(run.path) == PRIVATE_MODE
        (tmp_path / "other").mkdir()
        accounts.load_access(tmp_path / "other" / "runs")  # the access file's folder, made first
        assert mode(tmp_path / "other" / "runs") == PRIVATE_MODE
    finally:
        os.umask(old)


def test_an_exposed_lab_narrows_its_runs_directory_but_not_a_shared_folder(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    assert not make_private(mine) and mode(mine) == 0o755  # loopback: an existing folder is the user's business
    assert make_private(mine, narrow=True) and mode(mine) == PRIVATE_MODE
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # as /tmp is
    assert not make_private(shared, narrow=True) and mode(shared) == 0o1777
