"""Emulated clusters: build, shape, measure, and always tear down.

The cluster tests need root, ``ip`` and ``tc`` and are skipped otherwise. The
traffic they make stays inside the namespaces they create.
"""
import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

import commlab.lab.net.netns as netns
from distutil import shaped_unavailable
from commlab.lab.base.torchrun import worker_env
from commlab.lab.net.netcheck import measure_tcp, net_check
from commlab.lab.net.netns import (Cluster, NetnsError, NetworkUnavailable, check_shaped_supported, cleanup_stale,
                       list_lab_namespaces, rank_argv, root_lab_links)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_WHY_NOT = shaped_unavailable()
needs_root = pytest.mark.skipif(_WHY_NOT is not None, reason=f"shaped links unavailable: {_WHY_NOT}")


def _ip(*argv):
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=True).stdout


def _assert_gone(c: Cluster):
    names = c.namespaces + [c.bridge_ns]
    left = set(list_lab_namespaces()) & set(names)
    assert not left, f"namespaces left: {left}"
    assert not any(os.path.exists(f"/run/netns/{n}") for n in names)
    assert root_lab_links() == [], "an interface of the lab is in the root namespace"
    veths = _ip("-o", "link", "show", "type", "veth")
    assert "clab" not in veths
    assert not _leases_naming(names), "the subnet lease was not released"


def _leases_naming(names):
    """The subnets whose lease names any of ``names``: once released, a subnet may be leased again at once to a
    cluster another test process builds, so the lease at its number is not enough to tell."""
    return [k for k, lease in netns._read_leases().items() if set(lease.get("namespaces", ())) & set(names)]


# -- anywhere -------------------------------------------------------------------------

def test_unavailable_message_names_the_modeled_link(monkeypatch):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(NetworkUnavailable) as e:
        check_shaped_supported()
    msg = str(e.value)
    assert "root" in msg and "network: {link: modeled, gbps: X}" in msg and "\n" not in msg
    with pytest.raises(NetworkUnavailable):
        Cluster(2, 0.1)  # refused before anything is built

    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    real_which = netns.shutil.which
    monkeypatch.setattr(netns.shutil, "which", lambda t: None if t == "tc" else real_which(t) or "/x/" + t)
    with pytest.raises(NetworkUnavailable, match=r"'tc'.*modeled"):
        check_shaped_supported()
    monkeypatch.setattr(netns.shutil, "which", lambda t: None if t == "ip" else "/x/" + t)
    with pytest.raises(NetworkUnavailable, match=r"'ip'.*modeled"):
        check_shaped_supported()


class _FakeCluster:
    n = 3
    addresses = ["10.250.7.1", "10.250.7.2", "10.250.7.3"]
    namespaces = ["clab-1-7-x-r0", "clab-1-7-x-r1", "clab-1-7-x-r2"]
    ifnames = ["clab7r0", "clab7r1", "clab7r2"]
    exec_argv = Cluster.exec_argv
    env = Cluster.env


def test_rank_argv_runs_one_torchrun_node_per_namespace():
    argv, env = rank_argv(_FakeCluster(), 2, ["-m", "commlab.engine.worker", "--run-dir", "/r"], 29611, python="/py")
    assert argv[:5] == ["ip", "netns", "exec", "clab-1-7-x-r2", "/py"]
    assert argv[5:7] == ["-m", "torch.distributed.run"]
    for a in ("--nnodes=3", "--node-rank=2", "--nproc-per-node=1", "--master-addr=10.250.7.1",
              "--master-port=29611", "--max-restarts=0"):
        assert a in argv
    assert argv[-4:] == ["-m", "commlab.engine.worker", "--run-dir", "/r"]
    assert env["GLOO_SOCKET_IFNAME"] == "clab7r2"


def test_error_of_a_failing_command_is_one_line_with_the_command():
    with pytest.raises(NetnsError) as e:
        netns._run([sys.executable, "-c", "import sys; sys.stderr.write('bad\\nthing\\n'); sys.exit(3)"])
    msg = str(e.value)
    assert "\n" not in msg and "exit 3" in msg and "bad thing" in msg and "-c" in msg


# -- root only ------------------------------------------------------------------------

@needs_root
def test_build_and_teardown_leave_nothing():
    with Cluster(3, 1.0, tag="build") as c:
        listed = list_lab_namespaces()
        assert all(ns in listed for ns in c.namespaces + [c.bridge_ns])
        assert len(set(c.addresses)) == 3 and all(a.startswith("10.250.") for a in c.addresses)
        q = c.qdiscs()
        assert len(q) == 6 and all("tbf" in v and "rate 1Gbit" in v for v in q.values()), q
        out = subprocess.run(c.exec_argv(1, ["ip", "-o", "addr", "show", "dev", c.ifnames[1]]),
                             capture_output=True, text=True, check=True).stdout
        assert c.addresses[1] + "/24" in out
        # inside a rank's namespace: loopback and its veth, no route out of the subnet
        links = subprocess.run(c.exec_argv(0, ["ip", "-o", "link"]), capture_output=True, text=True).stdout
        assert len(links.splitlines()) == 2
        routes = subprocess.run(c.exec_argv(0, ["ip", "route"]), capture_output=True, text=True).stdout
        assert "default" not in routes
        assert root_lab_links() == []
    _assert_gone(c)
    c.teardown()  # idempotent


def ours(tag: str) -> list:
    """This process's lab namespaces of clusters tagged ``tag``."""
    return [n for n in list_lab_namespaces() if n.startswith(f"clab-{os.getpid()}-") and f"-{tag}-" in n]


@needs_root
def test_teardown_when_the_build_fails_midway():
    class Broken(Cluster):
        def tbf_args(self):
            return ["tbf", "rate", "fast-please", "burst", "1", "latency", "1ms"]
    with pytest.raises(NetnsError) as e:
        Broken(2, 0.1, tag="broken")
    msg = str(e.value)
    assert "tc -n clab-" in msg and "fast-please" in msg and "illegal" in msg and "\n" not in msg
    assert not ours("broken")  # (the other test process may be building a cluster of its own meanwhile)
    assert root_lab_links() == []


@needs_root
def test_teardown_when_cancelled_midway_through_the_build():
    calls = []

    class Cancelled(Cluster):
        def tbf_args(self):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return super().tbf_args()
    with pytest.raises(KeyboardInterrupt):
        Cancelled(2, 0.1, tag="cancel")
    assert not ours("cancel")


@needs_root
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_teardown_when_the_body_raises(exc):
    with pytest.raises(exc):
        with Cluster(2, 0.1, tag="body") as c:
            assert c.namespaces[0] in list_lab_namespaces()
            raise exc("boom")
    _assert_gone(c)


@needs_root
def test_teardown_kills_what_a_crashed_run_left_inside():
    with Cluster(2, 0.1, tag="orphan") as c:
        # a process of ours that outlives its parent, as a torchrun worker does when its agent dies
        p = subprocess.Popen(c.exec_argv(1, [sys.executable, "-c", "import time; time.sleep(300)"]),
                             start_new_session=True)
        time.sleep(0.3)
        assert p.pid in netns._ns_pids(c.namespaces[1])
    assert p.wait(10) == -signal.SIGKILL
    _assert_gone(c)


_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from commlab.lab.net.netns import Cluster
c = Cluster(2, 0.1, tag="stale")
print(json.dumps({"namespaces": c.namespaces + [c.bridge_ns], "k": c.k}), flush=True)
time.sleep(120)
"""


@needs_root
def test_stale_cluster_of_a_killed_creator_is_removed():
    child = subprocess.Popen([sys.executable, "-c", _CHILD, ROOT], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 30)
        assert ready, "the child did not build its cluster in 30 s"
        info = json.loads(child.stdout.readline())
    finally:
        os.kill(child.pid, signal.SIGKILL)  # a crash: no teardown, no atexit
        child.wait(10)
    names = info["namespaces"]
    assert set(names) <= set(list_lab_namespaces()), "the killed child's namespaces should still be there"
    assert all(f"-{child.pid}-" in n for n in names)
    with Cluster(1, None, tag="live") as live:
        # a new cluster cleans up at its start, and cleanup spares clusters whose creator lives
        assert not set(names) & set(list_lab_namespaces())
        assert cleanup_stale() == []
        assert live.namespaces[0] in list_lab_namespaces()
    assert not _leases_naming(names)
    assert root_lab_links() == []


@needs_root
def test_two_clusters_at_once_are_separate_and_both_pass_traffic():
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:  # built at the same time: the subnet lease is taken under a lock
        fa, fb = pool.submit(Cluster, 2, 0.1, "a"), pool.submit(Cluster, 2, 0.1, "b")
        try:
            a, b = fa.result(60), fb.result(60)
        except BaseException:
            for f in (fa, fb):
                if f.exception() is None:
                    f.result().teardown()
            raise
    with a, b:
        assert not set(a.namespaces + [a.bridge_ns]) & set(b.namespaces + [b.bridge_ns])
        assert a.subnet != b.subnet and not set(a.addresses) & set(b.addresses)
        for c in (a, b):
            r = measure_tcp(c, 0, 1, seconds=0.5, port=5301)
            assert r["bytes"] > 1 << 20 and r["peer_seen"] == c.addresses[0]
        # isolated: a rank of one cluster has no route to the other
        code = ("import socket,sys\n"
                "try:\n socket.create_connection((sys.argv[1], 5301), timeout=2)\n"
                "except OSError as e:\n print(type(e).__name__, e.errno)\nelse:\n print('connected')")
        out = subprocess.run(a.exec_argv(0, [sys.executable, "-c", code, b.addresses[1]]),
                             capture_output=True, text=True, timeout=20).stdout
        assert "connected" not in out and out.strip()
    _assert_gone(a)
    _assert_gone(b)


@needs_root
@pytest.mark.parametrize("gbps", [0.1, 1.0])
def test_net_check_tcp_and_allreduce_within_20_percent(gbps):
    """The shaped link carries what its rate says. A measurement: where the first check misses (the suite's other
    worker may be starting a run's processes on the same two cores at that moment; alone it measures 0.95-0.96),
    it is taken once more, and the second must hold."""
    def within(r):
        return 0.8 <= r["tcp_ratio"] <= 1.2 and 0.8 <= r["allreduce_ratio"] <= 1.2
    r = net_check(gbps, seconds=3.0)
    print(json.dumps({k: v for k, v in r.items() if k != "qdiscs"}))
    if not within(r):
        r = net_check(gbps, seconds=3.0)
        print("again:", json.dumps({k: v for k, v in r.items() if k != "qdiscs"}))
    assert 0.8 <= r["tcp_ratio"] <= 1.2, f"TCP {r['tcp_gbps']:.3f} Gbit/s at a {gbps} Gbit/s target"
    assert r["allreduce_correct"] and 0 < r["allreduce_small_median_s"] <= r["allreduce_small_mean_s"] * 20
    assert 0.8 <= r["allreduce_ratio"] <= 1.2, (
        f"all-reduce took {r['allreduce_median_s']:.3f} s, the alpha-beta model says {r['allreduce_predicted_s']:.3f} s")
    assert not any(n.startswith("clab-%d-" % os.getpid()) for n in list_lab_namespaces())


_CRASHING_WORKER = r"""
import os, time
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
if dist.get_rank() == 1:
    os._exit(3)  # a worker that dies without a word
dist.all_reduce(torch.ones(10))
time.sleep(120)
"""


@needs_root
def test_a_run_whose_worker_crashes_leaves_nothing(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(_CRASHING_WORKER)
    env = worker_env()
    procs, left = [], []
    with Cluster(2, 1.0, tag="crash") as c:
        for i in range(2):
            argv, upd = rank_argv(c, i, [str(script)], 29400 + (os.getpid() % 1000))
            procs.append(subprocess.Popen(argv, env={**env, **upd}, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        try:
            assert procs[1].wait(60) != 0, "rank 1's torchrun should report its worker's failure"
        finally:
            left = [pid for ns in c.namespaces for pid in netns._ns_pids(ns)]
    # rank 0's agent and worker (if still there) were killed by the teardown
    for p in procs:
        assert p.wait(10) is not None
    time.sleep(0.2)
    assert all(netns._proc_start(pid) is None for pid in left), "a process of the run outlived the teardown"
    _assert_gone(c)


@needs_root
def test_the_link_calibration_fits_the_shaped_rate_and_leaves_nothing():
    """calibrate.measure_link (notebook 04 as root, `commlab` perfmodel calibration): the sustained rate it
    fits from timed all-reduces on a shaped 1 Gbit/s cluster is that rate (within the 20% the net check
    allows), a 4 KiB all-reduce takes time, and the cluster is gone afterwards."""
    from commlab.lab.strategy.perfmodel import calibrate
    m = calibrate.measure_link(1.0)
    assert m["source"] == "measured all-reduce on a shaped 1 Gbit cluster, 2 ranks" and m["nominal_gbps"] == 1.0
    assert 0.8 < 8 / m["beta"] / 1e9 < 1.2, m
    assert m["alpha"] >= 0 and m["small_mean_s"] > 0 and len(m["samples"]) == 2
    # its cluster (tag "pm", this process's) is gone; other tests' clusters may run beside it
    assert not [ns for ns in list_lab_namespaces() if ns.startswith(f"clab-{os.getpid()}-") and "-pm-" in ns]
