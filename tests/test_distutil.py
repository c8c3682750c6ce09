"""The rank pool behind distutil.run_world: a call sees what a freshly spawned world would (the caller's
environment and working directory, a random seed of its own, one thread), and a failing, hanging or dying rank
fails the call, never the next one; a process group that does not form is tried once more on new ranks."""
import os

import pytest
import torch

import distutil
from distutil import run_world


def _what_a_rank_sees(rank, world):
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"sum": t.item(), "env": os.environ.get("DISTUTIL_PROBE"), "cwd": os.getcwd(),
            "draw": torch.randn(3).tolist(), "threads": torch.get_num_threads(), "pid": os.getpid()}


def _fails_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def _dies_on_rank_0(rank, world):
    if rank == 0:
        os._exit(7)
    import torch.distributed as dist
    dist.barrier()  # never completes: its peer is gone


def test_a_call_sees_the_callers_environment_and_a_fresh_seed(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTUTIL_PROBE", "first")
    monkeypatch.chdir(tmp_path)
    a = run_world(_what_a_rank_sees)
    monkeypatch.setenv("DISTUTIL_PROBE", "second")
    b = run_world(_what_a_rank_sees)
    assert [r["sum"] for r in a + b] == [3.0] * 4
    assert [r["env"] for r in a] == ["first"] * 2 and [r["env"] for r in b] == ["second"] * 2
    assert {r["cwd"] for r in a + b} == {str(tmp_path)} and {r["threads"] for r in a + b} == {1}
    # a generator reseeded at random for every call, as a new process's: no call inherits another's draws
    assert a[0]["draw"] != b[0]["draw"] and a[0]["draw"] != a[1]["draw"]
    assert [r["pid"] for r in a] == [r["pid"] for r in b], "the same pool ranks served both calls"
    monkeypatch.setenv("COMMLAB_TEST_FRESH_RANKS", "1")
    fresh = run_world(_what_a_rank_sees)
    assert [r["env"] for r in fresh] == ["second"] * 2 and fresh[0]["pid"] not in {r["pid"] for r in a}


def test_a_rank_that_raises_fails_the_call_with_its_traceback_and_the_pool_goes_on():
    with pytest.raises(RuntimeError, match=r"(?s)-- rank 1 failed:.*ValueError: rank one says no"):
        run_world(_fails_on_rank_1)
    assert [r["sum"] for r in run_world(_what_a_rank_sees)] == [3.0, 3.0]


def test_a_process_group_that_does_not_form_is_tried_once_more_on_a_new_pool(tmp_path, monkeypatch):
    """Rank 1's init fails once (a port taken, a connection refused): the call is made again on new ranks and a new
    port, without waiting for rank 0, which waits in its own init for a peer that never comes. The pool whose init
    failed is gone: its ranks would wait on each other's keys in every later call."""
    before = run_world(_what_a_rank_sees)
    old = distutil._pools[2]
    once = tmp_path / "fail-init-once"
    once.write_text("")
    monkeypatch.setenv("DISTUTIL_FAIL_INIT_ONCE", str(once))
    again = run_world(_what_a_rank_sees)
    assert not once.exists() and [r["sum"] for r in again] == [3.0, 3.0]
    assert not {r["pid"] for r in again} & {r["pid"] for r in before}, "the call ran again on new ranks"
    assert not any(p.is_alive() for p in old.procs)
    assert [r["pid"] for r in run_world(_what_a_rank_sees)] == [r["pid"] for r in again]  # and they serve on


def test_a_rank_that_dies_breaks_the_call_and_the_next_call_gets_a_new_pool():
    before = run_world(_what_a_rank_sees)
    with pytest.raises(distutil._PoolBroken):
        run_world(_dies_on_rank_0)
    after = run_world(_what_a_rank_sees)
    assert [r["sum"] for r in after] == [3.0, 3.0] and after[0]["pid"] != before[0]["pid"]


def _imports_a_module_under(rank, world, src):
    import importlib
    import sys
    mod = importlib.import_module("distutil_probe_mod")
    return mod.VALUE, sys.modules["torch"].__file__


def test_a_tests_own_module_is_read_fresh_and_installed_ones_stay(tmp_path, monkeypatch):
    """A module a test wrote under tmp is imported again by the next call (a later test may write another of
    the same name); torch and the repository's modules stay imported, even when they live under tmp too (a
    fresh clone in /tmp, whose .venv is there)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "distutil_probe_mod.py").write_text("VALUE = 1\n")
    first = run_world(_imports_a_module_under, str(tmp_path))
    (tmp_path / "distutil_probe_mod.py").write_text("VALUE = 2  # changed\n")
    second = run_world(_imports_a_module_under, str(tmp_path))
    assert [v for v, _ in first] == [1, 1] and [v for v, _ in second] == [2, 2]
    assert first[0][1] == second[0][1] == torch.__file__
