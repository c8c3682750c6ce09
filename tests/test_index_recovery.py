"""The run index never loses what the run directories hold: a busy index is waited for and then reported,
a full disk or an I/O error is reported, and only a damaged file is rebuilt: in a new file swapped in
whole, with the damaged one kept aside, and never leaving an empty index behind."""
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import commlab
from commlab.lab.base.paths import INDEX
from commlab.lab.rundir.index import Index, RunIndexError
from commlab.lab.rundir.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"name": "ix", "model": "mlp", "dataset": "digits", "world_size": 2, "steps": 5, "batch_size": 16,
        "eval_every": 0}


def new_run(store, i, state="done"):
    run = store.create(commlab.spec(dict(SPEC, seed=i)))
    run.set_status(state)
    return run


def indexed(tmp_path, n=3, wait=0.5):
    """A runs directory with ``n`` finished runs, all in its index (waits ``wait`` s for a busy index)."""
    store = RunStore(tmp_path)
    idx = Index(store, lock_wait_s=wait)
    runs = [new_run(store, i) for i in range(n)]
    assert idx.reindex() == n
    return store, idx, runs


def table(idx):
    return {r["id"]: r["state"] for r in idx.query()}


def others(tmp_path):
    """What lies beside the run directories apart from the index, its SQLite files and its lock."""
    keep = {INDEX, INDEX + "-wal", INDEX + "-shm", INDEX + ".lock"}
    return sorted(p.name for p in tmp_path.iterdir() if p.is_file() and p.name not in keep)


def damage(path: Path) -> bytes:
    """Overwrite the SQLite header (and a little more) with zeros; returns the damaged file's bytes."""
    with open(path, "r+b") as f:
        f.write(b"\0" * 128)
    return path.read_bytes()


@pytest.mark.parametrize("hold", ["write", "all"])
def test_a_locked_index_is_waited_for_then_reported_and_left_alone(tmp_path, hold):
    store, idx, (a, b, c) = indexed(tmp_path)
    before, inode = table(idx), os.stat(idx.path).st_ino
    b.set_status("failed")
    holder = sqlite3.connect(idx.path, isolation_level=None)
    if hold == "all":  # readers are locked out too (a WAL index only keeps writers out otherwise)
        holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE runs SET name = name")
    try:
        t0 = time.monotonic()
        with pytest.raises(RunIndexError, match=rf"{INDEX}: locked by another process \(database is locked\)"):
            idx.update(b)
        assert 0.4 <= time.monotonic() - t0 < 10  # waited its budget (0.5 s), not SQLite's 30 s nor not at all
        if hold == "all":
            with pytest.raises(RunIndexError, match="locked"):
                idx.query()
        else:
            assert table(idx) == before  # readers go on while a writer holds the lock
    finally:
        holder.rollback()
        holder.close()
    # free again: the next read writes the row it owes from b's directory (Index.update), nothing else changed
    assert os.stat(idx.path).st_ino == inode and table(idx) == {**before, b.id: "failed"} and others(tmp_path) == []
    idx.update(b)  # and a write lands
    assert table(idx)[b.id] == "failed"


@pytest.mark.parametrize("message", ["disk I/O error", "database or disk is full"])
def test_a_full_disk_or_an_io_error_is_reported_and_nothing_is_rebuilt(tmp_path, monkeypatch, message):
    store, idx, (a, b, c) = indexed(tmp_path)
    before, inode = table(idx), os.stat(idx.path).st_ino
    b.set_status("failed")

    class Failing(sqlite3.Connection):
        def execute(self, sql, *args):
            if sql.startswith("INSERT"):
                raise sqlite3.OperationalError(message)
            return super().execute(sql, *args)
    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: connect(*a, factory=Failing, **k))
    with pytest.raises(RunIndexError, match=rf"{INDEX}: {message} \(OperationalError\); the file was left"):
        idx.update(b)
    monkeypatch.undo()
    assert (tmp_path / (INDEX + ".owed")).read_text().split() == [b.id]
    assert os.stat(idx.path).st_ino == inode and table(idx) == {**before, b.id: "failed"} and others(tmp_path) == []


def test_an_error_sqlite_does_not_name_is_rebuilt_only_when_quick_check_fails(tmp_path, monkeypatch):
    store, idx, runs = indexed(tmp_path)
    before, inode = table(idx), os.stat(idx.path).st_ino

    class Odd(sqlite3.Connection):
        def execute(self, sql, *args):
            if sql.startswith("SELECT *"):
                raise sqlite3.DatabaseError("something odd")
            return super().execute(sql, *args)
    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: connect(*a, factory=Odd, **k))
    with pytest.raises(RunIndexError, match="something odd"):  # quick_check says the file is sound
        idx.query()
    monkeypatch.undo()
    assert os.stat(idx.path).st_ino == inode and table(idx) == before and others(tmp_path) == []


CHILD = r"""
import sys
import commlab
from commlab.lab.rundir.index import Index
from commlab.lab.rundir.store import RunStore
store = RunStore(sys.argv[1])
index = Index(store)
print(len(index.query()), flush=True)  # this process uses the index before it is damaged and rebuilt
sys.stdin.readline()
run = store.create(commlab.spec({"name": "late", "model": "mlp", "dataset": "digits", "steps": 5}))
run.set_status("done")
index.update(run)
print(run.id, flush=True)
"""


def test_a_damaged_index_is_kept_aside_and_rebuilt_and_a_process_that_used_it_writes_to_the_new_one(
        tmp_path, capsys):
    store, idx, runs = indexed(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline().strip() == "3"
        damaged = damage(idx.path)
        with pytest.raises(sqlite3.DatabaseError, match="not a database"):  # truly damaged
            sqlite3.connect(idx.path).execute("SELECT * FROM runs")
        assert set(table(idx)) == {r.id for r in runs}  # rebuilt from the directories on first use
        (aside,) = tmp_path.glob(f"{INDEX}.corrupt-*")
        assert aside.read_bytes() == damaged  # kept as it was, under a new name
        err = capsys.readouterr().err
        assert f"{INDEX}: damaged (file is not a database); kept as {aside.name}" in err
        out, _ = child.communicate("go\n", timeout=120)
        late = out.strip()
        assert child.returncode == 0 and late
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert set(table(Index(store))) == {r.id for r in runs} | {late}  # the other process's write is not lost
    assert aside.read_bytes() == damaged
    assert others(tmp_path) == [aside.name]  # no temporary file left


def test_a_run_written_while_the_index_is_rebuilt_is_in_the_new_index(tmp_path, monkeypatch):
    store, idx, runs = indexed(tmp_path)
    writer = Index(store)
    late = []
    rows = Index._rows

    def rows_then_a_new_run(self):
        got = rows(self)
        if not late:  # after the rebuild read the directories, before its swap: into the old file
            late.append(new_run(store, 9))
            writer.update(late[0])
        return got
    monkeypatch.setattr(Index, "_rows", rows_then_a_new_run)
    assert idx.reindex() == 4
    assert set(table(idx)) == {r.id for r in runs} | {late[0].id}
    assert others(tmp_path) == []  # a sound index is replaced, not kept aside


@pytest.mark.parametrize("where", ["reading the runs", "swapping"])
def test_a_rebuild_that_fails_leaves_the_damaged_index_and_says_so(tmp_path, monkeypatch, where):
    store, idx, runs = indexed(tmp_path)
    damaged = damage(idx.path)
    if where == "reading the runs":
        row_of, seen = Index.row_of, []

        def fails_on_the_third(run):
            seen.append(run.id)
            if len(seen) == 3:
                raise OSError(28, "No space left on device")
            return row_of(run)
        monkeypatch.setattr(Index, "row_of", staticmethod(fails_on_the_third))
        cause = r"OSError: \[Errno 28\] No space left on device"
    else:
        replace = os.replace

        def refuses_the_new_file(src, dst):
            if Path(src).name.startswith(f".{INDEX}."):
                raise OSError(5, "Input/output error")
            return replace(src, dst)
        monkeypatch.setattr(os, "replace", refuses_the_new_file)
        cause = r"OSError: \[Errno 5\] Input/output error"
    with pytest.raises(RunIndexError, match=rf"{INDEX}: could not be rebuilt from the run directories "
                                            rf"\({cause}\); it is damaged \(file is not a database\) and was left"):
        idx.query()
    monkeypatch.undo()
    assert idx.path.read_bytes() == damaged  # no empty index that looks valid: the damaged file, in place
    assert others(tmp_path) == []  # nothing set aside, no temporary file left
    assert set(table(idx)) == {r.id for r in runs}  # the next use rebuilds it
    assert len(list(tmp_path.glob(f"{INDEX}.corrupt-*"))) == 1


def test_reindex_keeps_a_damaged_index_aside_and_never_meets_an_old_log(tmp_path):
    store, idx, runs = indexed(tmp_path)
    damaged = damage(idx.path)
    assert idx.reindex() == 3
    (aside,) = tmp_path.glob(f"{INDEX}.corrupt-*")
    assert aside.read_bytes() == damaged and set(table(idx)) == {r.id for r in runs}
    again = damage(idx.path)  # damaged again within the second: the first one kept aside is not written over
    assert idx.reindex() == 3
    assert sorted(p.read_bytes() for p in tmp_path.glob(f"{INDEX}.corrupt-*")) == sorted([damaged, again])
    # a write-ahead log left by a killed process belongs to the file it was written for: a rebuild drops it
    con = sqlite3.connect(idx.path)
    con.execute("PRAGMA wal_autocheckpoint=0")
    con.execute("DELETE FROM runs")
    con.commit()
    stale = Path(str(idx.path) + "-wal").read_bytes()
    con.close()
    idx.path.unlink()
    Path(str(idx.path) + "-wal").write_bytes(stale)
    assert idx.reindex() == 3 and set(table(idx)) == {r.id for r in runs}


def test_a_deleted_index_is_filled_from_the_directories_not_left_empty(tmp_path):
    store, idx, runs = indexed(tmp_path)
    idx.path.unlink()
    assert set(table(idx)) == {r.id for r in runs} and others(tmp_path) == []


def test_a_damaged_page_is_found_and_the_index_rebuilt(tmp_path, capsys):
    store, idx, runs = indexed(tmp_path, n=40)  # a table of several pages
    with open(idx.path, "r+b") as f:
        page = int.from_bytes(f.read(18)[16:18], "big")
        f.seek(page)  # the second page: a page of the table's b-tree
        f.write(b"\xff" * 64)
    assert set(table(idx)) == {r.id for r in runs}
    assert len(list(tmp_path.glob(f"{INDEX}.corrupt-*"))) == 1
    assert "damaged (" in capsys.readouterr().err


def test_an_update_the_index_cannot_take_is_owed_and_paid_at_the_next_read(tmp_path, monkeypatch, capsys):
    """A supervisor writing status.json while the index is locked for long (or the disk is full) carries on:
    the row is owed, said on stderr, and the next query writes it from the run's directory."""
    import commlab
    from commlab.lab.rundir.index import Index, RunIndexError
    from commlab.lab.service.queue import Lab
    from test_app import SMALL
    q = Lab(tmp_path)
    run = q.create(commlab.spec(SMALL))
    real = Index._with

    def locked(self, fn):
        raise RunIndexError(f"{self.path}: locked (a test)")
    monkeypatch.setattr(Index, "_with", locked)
    run.set_status("cancelled", error="stopped")  # no exception reaches the supervisor
    assert "row is owed" in capsys.readouterr().err
    assert (tmp_path / "index.sqlite.owed").read_text().split() == [run.id]
    monkeypatch.setattr(Index, "_with", real)
    assert {r["id"]: r["state"] for r in Lab(tmp_path).index.query()}[run.id] == "cancelled"
    assert not (tmp_path / "index.sqlite.owed").exists()
