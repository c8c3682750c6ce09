"""Emulated clusters for ``network: {link: shaped, gbps: X}`` (Linux, root).

A ``Cluster(n, gbps)`` (or ``Cluster(n, None, rates=[(up, down), ...])``) is built from network namespaces:

    clab-<pid>-<k>-<tag>-br     a bridge  clab<k>br
      |  clab<k>b0 ... clab<k>b<n-1>      (bridge ends of the veth pairs, tbf on each)
    clab-<pid>-<k>-<tag>-r<i>   rank i:   clab<k>r<i>, address 10.250.<k>.<i+1>/24 (tbf on it)

The bridge itself has 10.250.<k>.254 in its namespace (``hub``): a service of the whole cluster listens there,
unshaped (a fault-tolerant run's Lighthouse, ``exec_hub_argv``), reachable from every rank.

Every veth pair is created directly inside the namespaces (``ip -n``), so no
interface of the lab ever appears in the root namespace, and both of its ends
get ``tbf rate R burst B latency 50ms``: the rank's end shapes what the rank
sends, the bridge's end what it receives. With ``rates`` (a cluster of unequal
workers, ``network.cluster``) rank i's end gets its up rate and the bridge's end
its down rate. Only rates: delay and jitter would need netem (or fq with
departure times), which the lab does not use: the kernels it runs on may lack
them (the one it was built on has neither). Addresses exist only inside the
lab's namespaces, which have no route anywhere else.

``<pid>`` is the creating process and ``<k>`` the cluster's subnet
(10.250.<k>.0/24). Subnets are leased under a file lock in
``/run/commlab-netns`` (a tmpfs, like /run/netns, so both vanish together at
reboot): a lease names the owner's PID and its start time (so a recycled PID
is not taken for the owner). ``cleanup_stale()`` runs at every Cluster start
and removes the namespaces (and leases) of owners that are gone, e.g. after
the launcher was killed with SIGKILL.

Teardown deletes the veth pairs (which removes their qdiscs), checks that no
veth is left in the namespaces, deletes the namespaces, checks that none of
them is listed any more and that no interface of the cluster is in the root
namespace, and releases the lease. It runs from ``__exit__``, when the build
fails midway, at interpreter exit, and is idempotent. Processes still running
inside the cluster's namespaces (only the lab starts any there) are killed
first, by PID, so the namespaces really go away.

Every ``ip``/``tc`` call is an argv list; a failing one raises ``NetnsError``
with the command and its stderr on one line.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from commlab.engine.runlog import write_json_atomic
from commlab.lab.base.procs import alive, start_time
from commlab.lab.base.torchrun import torchrun_argv

PREFIX = "clab-"
NS_RE = re.compile(r"^clab-(\d+)-(\d+)-([a-z0-9]+)-(br|r\d+)$")
SUBNET = "10.250.{k}.0/24"
MAX_CLUSTERS = 256
MAX_RANKS = 250
REGISTRY = os.environ.get("COMMLAB_NETNS_DIR", "/run/commlab-netns")
MODELED_HINT = "use network: {link: modeled, gbps: X} instead"


class NetworkUnavailable(RuntimeError):
    """Shaped links cannot be built here (not Linux, not root, no ip or no tc)."""


class NetnsError(RuntimeError):
    """An ip/tc command failed, or teardown left something behind."""


# -- small helpers -------------------------------------------------------------

def check_shaped_supported() -> None:
    """Raise NetworkUnavailable (one line, naming the modeled link) unless we
    are root on Linux with ``ip`` and ``tc`` on the PATH."""
    if not sys.platform.startswith("linux"):
        raise NetworkUnavailable(f"network link 'shaped' needs Linux network namespaces "
                                 f"(this is {sys.platform}); {MODELED_HINT}")
    if os.geteuid() != 0:
        raise NetworkUnavailable(f"network link 'shaped' needs root to build network namespaces "
                                 f"(running as uid {os.geteuid()}); {MODELED_HINT}")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetworkUnavailable(f"network link 'shaped' needs the '{tool}' command (iproute2), "
                                     f"which is not on the PATH; {MODELED_HINT}")


def _run(argv: Sequence[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
    argv = [str(a) for a in argv]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{shlex.join(argv)}` timed out after {timeout:g} s") from None
    except OSError as e:
        raise NetnsError(f"`{shlex.join(argv)}` could not start: {e}") from None
    if check and p.returncode != 0:
        err = " ".join((p.stderr or p.stdout or "").split()) or "no output"
        raise NetnsError(f"`{shlex.join(argv)}` failed (exit {p.returncode}): {err}")
    return p


def list_lab_namespaces() -> List[str]:
    """Names of all network namespaces of the lab (any owner), from ``ip netns list``."""
    out = _run(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(PREFIX))


def root_lab_links() -> List[str]:
    """Interfaces of the lab (``clab...``) in the root namespace. Always empty
    unless something went wrong: the lab creates its veths inside namespaces."""
    out = _run(["ip", "-o", "link", "show"]).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if name.startswith("clab"):
                names.append(name)
    return names


def _ns_links(ns: str, kind: Optional[str] = None) -> List[str]:
    argv = ["ip", "-n", ns, "-o", "link", "show"] + (["type", kind] if kind else [])
    out = _run(argv).stdout
    return [line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def _ns_pids(ns: str) -> List[int]:
    p = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _proc_start(pid: int) -> Optional[int]:
    return start_time(pid)


def _alive(pid: int, start: Optional[int] = None) -> bool:
    return alive({"pid": pid, "start": start})


def _kill_ns_processes(ns: str, timeout: float = 5.0) -> List[int]:
    """SIGKILL the processes inside ``ns`` (only the lab starts any there), by PID."""
    me = os.getpid()
    killed = []
    for pid in _ns_pids(ns):
        if pid == me:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while killed and time.monotonic() < deadline and [p for p in _ns_pids(ns) if p != me]:
        time.sleep(0.05)
    return killed


def _delete_namespaces(names: Sequence[str], kill: bool = True) -> List[str]:
    """Delete the veths inside each namespace, check none is left, then delete
    the namespaces. Returns the problems found (empty when all went well)."""
    problems = []
    present = set(list_lab_namespaces())
    names = [n for n in names if n in present]
    if kill:
        for ns in names:
            _kill_ns_processes(ns)
    for ns in names:  # deleting one end of a veth pair deletes the other, and the qdiscs on both
        try:
            for link in _ns_links(ns, "veth"):
                _run(["ip", "-n", ns, "link", "del", link], check=False)
            left = _ns_links(ns, "veth")
            if left:
                problems.append(f"veth {', '.join(left)} still in {ns}")
        except NetnsError as e:
            problems.append(str(e))
    for ns in names:
        p = _run(["ip", "netns", "del", ns], check=False)
        if p.returncode != 0:
            problems.append(f"`ip netns del {ns}` failed: {' '.join(p.stderr.split())}")
    left = set(list_lab_namespaces()) & set(names)
    if left:
        problems.append(f"namespaces still listed: {', '.join(sorted(left))}")
    return problems


# -- the lease registry ----------------------------------------------------------

@contextlib.contextmanager
def _locked():
    import fcntl
    os.makedirs(REGISTRY, mode=0o755, exist_ok=True)
    fd = os.open(os.path.join(REGISTRY, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _lease_path(k: int) -> str:
    return os.path.join(REGISTRY, f"subnet-{k}.json")


def _read_leases() -> Dict[int, dict]:
    out = {}
    try:
        entries = os.listdir(REGISTRY)
    except FileNotFoundError:
        return out
    for name in entries:
        m = re.fullmatch(r"subnet-(\d+)\.json", name)
        if not m:
            continue
        try:
            with open(os.path.join(REGISTRY, name)) as f:
                out[int(m.group(1))] = json.load(f)
        except (OSError, ValueError):
            out[int(m.group(1))] = {}
    return out


def _owner_alive(pid: int, k: int, leases: Dict[int, dict]) -> bool:
    lease = leases.get(k) or {}
    start = lease.get("start") if lease.get("pid") == pid else None
    return _alive(pid, start)


def _cleanup_stale_locked(kill: bool = True) -> List[str]:
    leases = _read_leases()
    stale = []
    for ns in list_lab_namespaces():
        m = NS_RE.match(ns)
        if not m:
            continue  # not a name we make; leave it alone
        pid, k = int(m.group(1)), int(m.group(2))
        if not _owner_alive(pid, k, leases):
            stale.append(ns)
    # bridges last: rank namespaces first, so their veths go with them
    stale.sort(key=lambda n: n.endswith("-br"))
    problems = _delete_namespaces(stale, kill=kill) if stale else []
    existing = set(list_lab_namespaces())
    for k, lease in leases.items():
        pid = lease.get("pid")
        owner_ok = isinstance(pid, int) and _alive(pid, lease.get("start"))
        if not owner_ok and not (set(lease.get("namespaces") or []) & existing):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_lease_path(k))
    if problems:
        raise NetnsError("stale cleanup incomplete: " + "; ".join(problems))
    return stale


def cleanup_stale(kill: bool = True) -> List[str]:
    """Delete the lab's namespaces whose creating process is gone (and their
    leases); return their names. With ``kill``, processes left inside them are
    killed first (by PID), so the namespaces and veths really disappear."""
    check_shaped_supported()
    with _locked():
        return _cleanup_stale_locked(kill)


def _allocate(pid: int, tag: str, n: int) -> int:
    with _locked():
        try:
            _cleanup_stale_locked()
        except NetnsError as e:  # what is left keeps its subnet (excluded below); build anyway
            import warnings
            warnings.warn(str(e), RuntimeWarning)
        leases = _read_leases()
        used = set(leases)
        for ns in list_lab_namespaces():
            m = NS_RE.match(ns)
            if m:
                used.add(int(m.group(2)))
        for k in range(MAX_CLUSTERS):
            if k not in used:
                break
        else:
            raise NetnsError(f"all {MAX_CLUSTERS} lab subnets are in use ({REGISTRY})")
        base = f"{PREFIX}{pid}-{k}-{tag}"
        lease = {"pid": pid, "start": _proc_start(pid), "tag": tag, "n": n, "created": time.time(),
                 "subnet": SUBNET.format(k=k),
                 "namespaces": [f"{base}-br"] + [f"{base}-r{i}" for i in range(n)]}
        write_json_atomic(_lease_path(k), lease, indent=None)
        return k


def _release(k: int) -> None:
    with _locked():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_lease_path(k))


# -- the cluster -------------------------------------------------------------------

def tbf_burst_bytes(gbps: float) -> int:
    """About 10 ms of traffic (rate/800 in bytes per bit/s), at least 32 KB."""
    return max(int(gbps * 1e9 / 800), 32 * 1024)


class Cluster:
    """``n_ranks`` network namespaces joined through a bridge, every link shaped to ``gbps``.

    ``namespaces[i]``, ``addresses[i]`` and ``ifnames[i]`` describe rank i;
    ``exec_argv(i, argv)`` runs a command inside its namespace and ``env(i)``
    gives the variables a gloo rank there needs. ``gbps=None`` builds the same
    cluster unshaped. Use as a context manager, or call ``teardown()``.
    """

    def __init__(self, n_ranks: int, gbps: Optional[float], tag: Optional[str] = None, *,
                 rates: Optional[Sequence[Tuple[float, float]]] = None,
                 latency_ms: float = 50.0, burst_bytes: Optional[int] = None, mtu: int = 1500,
                 kill_on_teardown: bool = True):
        check_shaped_supported()
        if not isinstance(n_ranks, int) or not 1 <= n_ranks <= MAX_RANKS:
            raise ValueError(f"n_ranks must be an integer in 1..{MAX_RANKS}, got {n_ranks!r}")
        if gbps is not None and not gbps > 0:
            raise ValueError(f"gbps must be > 0 (or None for an unshaped cluster), got {gbps!r}")
        if rates is not None:
            rates = [(float(u), float(d)) for u, d in rates]
            if len(rates) != n_ranks or not all(u > 0 and d > 0 for u, d in rates):
                raise ValueError(f"rates must be {n_ranks} pairs (up, down) of Gbit/s > 0, got {rates!r}")
        self.n = n_ranks
        self.gbps = None if gbps is None else float(gbps)
        self.rates: Optional[List[Tuple[float, float]]] = rates
        """Each rank's (up, down) Gbit/s, or None: every link at ``gbps``."""
        self.latency_ms = latency_ms
        self.burst_bytes = burst_bytes if burst_bytes is not None else (
            tbf_burst_bytes(self.gbps) if self.gbps and rates is None else None)
        """Every tbf's burst; None: each tbf's ``tbf_burst_bytes`` of its own rate (per-rank rates)."""
        self.mtu = mtu
        self.kill_on_teardown = kill_on_teardown
        self.pid = os.getpid()
        tag = re.sub(r"[^a-z0-9]", "", (tag or "").lower())[:8]
        self.tag = tag or secrets.token_hex(2)
        self.k: Optional[int] = None
        self.bridge_ns = ""
        self.bridge = ""
        self.namespaces: List[str] = []
        self.addresses: List[str] = []
        self.ifnames: List[str] = []
        self.bridge_ifnames: List[str] = []
        self.subnet = ""
        self.hub = ""
        """The bridge's own address, in its namespace: where a service of the whole cluster listens."""
        self._created: List[str] = []
        self._closed = False
        atexit.register(self.teardown)
        try:
            self.k = _allocate(self.pid, self.tag, n_ranks)
            self._build()
        except BaseException as e:
            try:
                self.teardown()
            except Exception as te:  # keep the build's error first; say what teardown left
                e.add_note(f"teardown after the failed build: {te}")
            raise

    # the tc arguments of every link (tests override this to make a build fail midway)
    def tbf_args(self, gbps: Optional[float] = None) -> List[str]:
        """A tbf of ``gbps`` (default: the cluster's), its burst ``burst_bytes`` or ``tbf_burst_bytes`` of it."""
        g = self.gbps if gbps is None else gbps
        burst = self.burst_bytes if self.burst_bytes is not None else tbf_burst_bytes(g)
        return ["tbf", "rate", f"{int(round(g * 1e9))}bit", "burst", str(burst), "latency", f"{self.latency_ms:g}ms"]

    def _build(self) -> None:
        k = self.k
        base = f"{PREFIX}{self.pid}-{k}-{self.tag}"
        self.subnet = SUBNET.format(k=k)
        self.bridge_ns, self.bridge = f"{base}-br", f"clab{k}br"
        self.namespaces = [f"{base}-r{i}" for i in range(self.n)]
        self.ifnames = [f"clab{k}r{i}" for i in range(self.n)]
        self.bridge_ifnames = [f"clab{k}b{i}" for i in range(self.n)]
        self.addresses = [f"10.250.{k}.{i + 1}" for i in range(self.n)]
        br = self.bridge_ns
        self._add_ns(br)
        _run(["ip", "-n", br, "link", "add", self.bridge, "type", "bridge"])
        self.hub = f"10.250.{k}.254"
        _run(["ip", "-n", br, "addr", "add", f"{self.hub}/24", "dev", self.bridge])
        _run(["ip", "-n", br, "link", "set", self.bridge, "up"])
        for i in range(self.n):
            ns, ifn, bif = self.namespaces[i], self.ifnames[i], self.bridge_ifnames[i]
            self._add_ns(ns)
            _run(["ip", "-n", br, "link", "add", bif, "mtu", self.mtu, "type", "veth",
                  "peer", "name", ifn, "mtu", self.mtu, "netns", ns])
            _run(["ip", "-n", br, "link", "set", bif, "master", self.bridge])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", ifn])
            if self.rates is not None or self.gbps:
                # the rank's end shapes what it sends (up), the bridge's end what it receives (down); a uniform
                # cluster's tbf_args() takes no rate (a subclass may override it so)
                up, down = (self.tbf_args(), self.tbf_args()) if self.rates is None else \
                    (self.tbf_args(self.rates[i][0]), self.tbf_args(self.rates[i][1]))
                _run(["tc", "-n", ns, "qdisc", "add", "dev", ifn, "root", *up])
                _run(["tc", "-n", br, "qdisc", "add", "dev", bif, "root", *down])
            _run(["ip", "-n", br, "link", "set", bif, "up"])
            _run(["ip", "-n", ns, "link", "set", ifn, "up"])
        self._wait_up()

    def _add_ns(self, ns: str) -> None:
        self._created.append(ns)  # before: a half-made namespace is still torn down
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _wait_up(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for ns, ifn in zip(self.namespaces, self.ifnames):
            while True:
                out = _run(["ip", "-n", ns, "-o", "link", "show", "dev", ifn]).stdout
                if "state UP" in out or "LOWER_UP" in out:
                    break
                if time.monotonic() > deadline:
                    raise NetnsError(f"{ifn} in {ns} did not come up within {timeout:g} s: {' '.join(out.split())}")
                time.sleep(0.02)

    # -- using it
    def exec_argv(self, i: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside rank i's namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *[str(a) for a in argv]]

    def exec_hub_argv(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside the bridge's namespace, where ``hub`` is this host's address."""
        return ["ip", "netns", "exec", self.bridge_ns, *[str(a) for a in argv]]

    def accepts(self, port: int, timeout: float = 2.0) -> bool:
        """Whether something accepts TCP connections on ``hub``:``port`` (asked from inside the bridge's
        namespace: the root namespace has no route to the cluster)."""
        probe = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                 "timeout=float(sys.argv[3])).close()\nexcept OSError:\n    sys.exit(1)")
        got = _run(self.exec_hub_argv([sys.executable, "-I", "-c", probe, self.hub, str(port), str(timeout)]),
                   timeout=timeout + 10, check=False)
        return got.returncode == 0

    def env(self, i: int) -> Dict[str, str]:
        """What a gloo rank in namespace i needs: without it gloo advertises the
        hostname's address (127.0.0.1) to its peers and hangs."""
        return {"GLOO_SOCKET_IFNAME": self.ifnames[i], "TP_SOCKET_IFNAME": self.ifnames[i]}

    def qdiscs(self) -> Dict[str, str]:
        """``tc qdisc show`` of every shaped interface (for checks and reports)."""
        out = {}
        for ns, ifn in zip(self.namespaces + [self.bridge_ns] * self.n, self.ifnames + self.bridge_ifnames):
            out[f"{ns}/{ifn}"] = " ".join(_run(["tc", "-n", ns, "qdisc", "show", "dev", ifn]).stdout.split())
        return out

    def describe(self) -> str:
        if self.rates is not None:
            each = ", ".join(f"r{i} {u:g} up/{d:g} down" for i, (u, d) in enumerate(self.rates))
            shape = f"tbf per rank in Gbit/s ({each}; latency {self.latency_ms:g} ms)"
        else:
            shape = f"{self.gbps:g} Gbit/s tbf (burst {self.burst_bytes} B, latency {self.latency_ms:g} ms) " \
                    f"on both ends of every link" if self.gbps else "unshaped"
        return f"{self.n} ranks on {self.subnet} via bridge {self.bridge} ({self.hub}) in {self.bridge_ns}, {shape}"

    # -- ending it
    def teardown(self) -> None:
        """Delete everything the cluster made and check it is gone. Idempotent."""
        if self._closed:
            return
        created = [ns for ns in self._created if ns != self.bridge_ns] + (
            [self.bridge_ns] if self.bridge_ns in self._created else [])
        problems = _delete_namespaces(created, kill=self.kill_on_teardown) if created else []
        if self.k is not None:
            stray = [l for l in root_lab_links() if re.fullmatch(rf"clab{self.k}[rb]\d+|clab{self.k}br", l)]
            if stray:
                problems.append(f"interfaces in the root namespace: {', '.join(stray)}")
        if problems:
            raise NetnsError(f"teardown of cluster {self.tag} incomplete: " + "; ".join(problems))
        if self.k is not None:
            _release(self.k)
        self._created = []
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.teardown)

    close = teardown

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def __repr__(self) -> str:
        return f"Cluster({self.describe()})"


# -- running ranks in it -------------------------------------------------------------

def rank_argv(cluster: Cluster, i: int, entry: List[str], port: int,
              python: str = sys.executable) -> Tuple[List[str], Dict[str, str]]:
    """Rank i as its own torchrun node inside its namespace, with rendezvous on
    rank 0's address: ``(argv, env_updates)``. Pick a fresh ``port`` per run."""
    inner = torchrun_argv(entry, 1, port, nnodes=cluster.n, node_rank=i,
                          master_addr=cluster.addresses[0], python=python)
    return cluster.exec_argv(i, inner), cluster.env(i)
