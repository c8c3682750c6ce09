"""Fault tolerance on torchft 0.2.0: one replica group per process, whose membership, quorum, commit and recovery
are torchft's (the Lighthouse and a ``Manager`` per replica group). The only module of commlab that imports torchft.

    replica = Replica(spec, run_dir, 2, lighthouse="http://host:port", backend="gloo")
    trainer = Trainer(spec, run_dir, 2, spec.fault_tolerance.replica_groups, device, ft=replica)

Each step (commlab/engine/stepper.py) starts with ``start_quorum`` (synchronous: a replica that is behind, a
restarted one or one that joined late, receives the model, optimizer and compressor state of an up-to-date peer
and loads them before its forward pass) and asks ``should_commit`` before the optimizer step: a step commits only where every
participant's exchange succeeded, and one that does not is redone on the same batch (batches are keyed by the
committed step). Under a method that syncs now and then (local SGD, DiLoCo, ...) the inner steps are local: the
quorum is joined at each sync and at a process's first step, a sync is applied only when it commits, and a recovery
also hands over the method's state and the lab's step (``position``: the Manager's step counts commits, the lab's
counts inner steps).

What is here:

- ``Replica``: the replica group's TCPStore (it hosts its own: one process, one rank), torchft's reconfigurable
  process group, the Manager (replica id ``replica_<n>``: torchft reads the trailing digits), the state registered
  for recovery, and the records of each quorum;
- ``FtGroup``: the group the lab's collectives (commlab/engine/comm/collectives.py) run on: this quorum's rank and
  size from the Manager, all-reduces and all-gathers on the process group torchft reconfigured for the quorum, and
  a failed one reported to the Manager (the step then does not commit) instead of raised;
- ``CountingTransport``: torchft's HTTP recovery transport, measured: each recovery's source, step, seconds and
  bytes read, written by the receiver to ``recoveries.jsonl``;

Private parts of torchft used (pinned to 0.2.0): ``HTTPTransport._load_from_address`` (overridden to count
bytes), ``HTTPTransport._server`` (its port, for the address a replica on a shaped link is reached at) with ``torchft.checkpointing._serialization._streaming_load`` (what it reads with), ``Manager._quorum_id``
(read for the records) and ``torchft._torchft.lighthouse_main`` (the console script's entry point, which the
Lighthouse's own process, commlab/engine/ft_lighthouse.py, loads without torch).
"""
from __future__ import annotations

import importlib.metadata
import os
import socket
import time
import urllib.request
from datetime import timedelta
from typing import Callable, Optional

import torch
from torch.distributed import AllreduceOptions, ReduceOp, TCPStore
from torch.distributed.distributed_c10d import AllgatherOptions
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing import HTTPTransport
from torchft.checkpointing._serialization import _streaming_load

from commlab.engine import runfiles
from commlab.engine.comm.collectives import Group
from commlab.engine.ft_lighthouse import GEN_ENV, HOST_ENV
from commlab.engine.runlog import JsonlWriter, read_jsonl
from commlab.engine.spec import JobSpec



def version() -> str:
    return importlib.metadata.version("torchft")


def replica_id(n: int) -> str:
    """torchft's replica id of replica group ``n``; the Manager appends a fresh uuid (a restarted replica is a new
    member) and reads the trailing digits of the part before it."""
    return f"replica_{n}"


class _Counting:
    """A binary file-like reader that counts the bytes read through it."""

    def __init__(self, f):
        self.f, self.n = f, 0

    def read(self, n=-1):
        b = self.f.read(n)
        self.n += len(b)
        return b

    def readinto(self, buf):
        k = self.f.readinto(buf)
        self.n += k or 0
        return k

    def readline(self, *a):
        b = self.f.readline(*a)
        self.n += len(b)
        return b


class CountingTransport(HTTPTransport):
    """torchft's HTTP recovery transport (the peer serves its staged state, the receiver GETs and loads it), with
    each received state measured: ``on_recv`` gets {src_replica_rank, src_url, step, seconds, bytes}."""

    def __init__(self, timeout: timedelta, on_recv: Callable[[dict], None], host: Optional[str] = None):
        self.host = host  # before torchft's __init__, which says the address
        """The address peers fetch this replica's state at (None: the machine's hostname, as torchft's)."""
        super().__init__(timeout, num_chunks=0)
        self.on_recv = on_recv
        self._bytes = 0

    def address(self) -> str:
        if self.host is None:
            return super().address()
        return f"http://{self.host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    def _load_from_address(self, address: str, timeout: timedelta) -> object:  # an instance's, not the class's
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            c = _Counting(f)
            obj = _streaming_load(c, weights_only=False)  # the state holds non-tensors (the optimizer's)
        self._bytes += c.n
        return obj

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        self._bytes = 0
        t0 = time.perf_counter()
        out = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self.on_recv({"src_replica_rank": src_rank, "src_url": metadata, "step": step,
                      "seconds": time.perf_counter() - t0, "bytes": self._bytes})
        return out


class _Done:
    """The work handle of a collective not issued (the step has failed already): nothing to wait for."""

    def __init__(self, t: torch.Tensor):
        self._fut = torch.futures.Future()
        self._fut.set_result([t])

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self):
        return self._fut


class _Reported:
    """A collective's work handle whose failure is reported to the Manager (the step will not commit) instead of
    raised: the peers of a fault-tolerant step may die in it."""

    def __init__(self, work, manager: Manager):
        self.work, self.manager = work, manager

    def wait(self, timeout=None) -> bool:
        try:
            self.work.wait()
            return True
        except Exception as e:  # a lost peer: gloo's "Connection closed by peer", a timeout
            self.manager.report_error(e)
            return False

    def get_future(self):
        return self.work.get_future()


class FtGroup(Group):
    """The lab's collectives on torchft's process group, reconfigured by the Manager at each new quorum."""

    def __init__(self, replica: "Replica"):
        self.replica = replica

    def size(self) -> int:
        r = self.replica
        return r.manager.num_participants() if r.quorum_started else r.groups

    def rank(self) -> int:
        """This replica's rank in this step's quorum (its place among the sorted replica ids), or its replica id
        before the first quorum."""
        r = self.replica
        got = r.manager.participating_rank() if r.quorum_started else None
        return r.n if got is None else got

    def backend(self) -> str:
        return self.replica.backend

    def all_reduce(self, t: torch.Tensor):
        m = self.replica.manager
        if m.errored() is not None:  # the step has failed: it will not commit, and its peers may be gone
            return _Done(t)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        try:
            return _Reported(self.replica.pg.allreduce([t], opts), m)
        except Exception as e:
            m.report_error(e)
            return _Done(t)

    def all_gather(self, outs, t: torch.Tensor):
        m = self.replica.manager
        if m.errored() is not None:
            return _Done(t)
        try:
            return _Reported(self.replica.pg.allgather([outs], [t], AllgatherOptions()), m)
        except Exception as e:
            m.report_error(e)
            return _Done(t)

    def failed(self) -> bool:
        return self.replica.manager.errored() is not None


class _Members:
    """torchft's process group, remembering the replica groups of the quorum it was last configured for (the
    Manager passes them at each new quorum, in ring order): ``members``, None before the first."""
    members: Optional[list] = None

    def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                  group_world_size=None, global_ranks=None):
        self.members = None if global_ranks is None else [int(r) for r in global_ranks]
        return super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                                 global_ranks)


class _GlooMembers(_Members, ProcessGroupGloo):
    pass


class _NcclMembers(_Members, ProcessGroupNCCL):
    pass


class Replica:
    """One replica group (this process): its Manager and what it records. ``n``: the replica group's number."""

    def __init__(self, spec: JobSpec, run_dir: Optional[str], n: int, lighthouse: str, backend: str = "gloo"):
        """``backend``: gloo or nccl, the process group torchft reconfigures at each quorum."""
        ft = spec.fault_tolerance
        self.n, self.groups, self.run_dir = n, ft.replica_groups, run_dir
        self.id = replica_id(n)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: fault tolerance runs gloo or nccl, got {backend!r}")
        self.backend = backend
        timeout = timedelta(seconds=ft.timeout_s)
        self.timeout_s = ft.timeout_s
        # one process per replica group: it hosts its group's store (the Manager connects to it as a client)
        host = os.environ.get(HOST_ENV)  # a shaped link: this replica's namespace's address; else loopback
        self.store = TCPStore(host or "localhost", 0, is_master=True, wait_for_workers=False)
        self.pg = _NcclMembers(timeout=timeout) if self.backend == "nccl" else _GlooMembers(timeout=timeout)
        self.transport = CountingTransport(timeout, self._received, host)
        self.recoveries = JsonlWriter(os.path.join(run_dir, runfiles.RECOVERIES)) if run_dir else None
        self._recv: Optional[dict] = None
        """The last state received, until its load says whose it was (``_load_meta``)."""
        self.recovered: list = []
        """This process's recoveries, as written to recoveries.jsonl."""
        self.position: Optional[Callable[[], dict]] = None
        """Where this replica is in training, sent with its state (the Stepper's, under a method: the lab's step and
        whether it is at a step's start or in a sync), or None."""
        self.on_position: Optional[Callable[[dict], None]] = None
        """Told the source's position when a recovery loads its state (before the model and the rest)."""
        self.quorum_started = False
        self.manager = Manager(
            pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=ft.min_replicas,
            use_async_quorum=False,  # a replica that heals loads the state before its forward pass
            timeout=timeout, quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timedelta(seconds=ft.quorum_timeout_s), rank=0, world_size=1,
            store_addr=host or "localhost", store_port=self.store.port, lighthouse_addr=lighthouse,
            replica_id=self.id, hostname=host or socket.gethostname(), checkpoint_transport=self.transport)
        self.manager.register_state_dict_fn("commlab", self._load_meta, self._meta)
        self.group = FtGroup(self)
        self.last: dict = {}
        """This step's quorum: quorum_id, participants, quorum_ms (``start_quorum``)."""

    # -- what a recovery hands over -----------------------------------------
    def register(self, key: str, load: Callable[[object], None], save: Callable[[], object]) -> None:
        """State a replica that recovers takes from its source (the model, the optimizer), under ``key``."""
        self.manager.register_state_dict_fn(key, load, save)

    def _meta(self) -> dict:
        meta = {"replica": self.n}
        if self.position is not None:
            meta["position"] = self.position()
        return meta

    def _received(self, rec: dict) -> None:
        self._recv = rec

    def _load_meta(self, meta: dict) -> None:
        """The received state is being loaded: record the recovery, with the replica it came from."""
        rec = {"kind": "recovery", "replica": self.n, "from_replica": meta.get("replica"), **(self._recv or {}),
               "t": time.time()}
        pos = meta.get("position")
        if pos is not None:  # under a method the Manager's step counts commits; the lab's step is this one
            rec["lab_step"] = pos.get("step")
        self._recv = None
        self.recovered.append(rec)
        if self.recoveries:
            self.recoveries.write(rec)
        if pos is not None and self.on_position is not None:
            self.on_position(pos)

    # -- each step -----------------------------------------------------------
    def start_quorum(self) -> dict:
        """Join this step's quorum (healing first when this replica is behind); returns quorum_id, participants,
        quorum_ms and the committed step to train (``step``), as the step's line records them."""
        if not self.quorum_started:
            self._meet_at_the_start()
        t0 = time.perf_counter()
        self.manager.start_quorum()
        self.quorum_started = True
        m = self.manager
        self.last = {"quorum_id": m._quorum_id, "participants": m.num_participants(),
                     "quorum_ms": (time.perf_counter() - t0) * 1e3}
        return {**self.last, "step": m.current_step()}

    def _meet_at_the_start(self) -> None:
        """Before this process's first quorum: its line in ft-start.jsonl; at the run's start (generation 0) wait, at
        most ``timeout_s``, until every replica group has one. torchft's Lighthouse forms a first quorum of
        ``min_replicas`` once ``join_timeout_ms`` has passed, and a replica whose process came up later than that
        (a loaded machine) would miss the run's start and take it from a peer at its next quorum, so that a run
        without a fault no longer trained as the same run without fault tolerance does. A restarted process
        (generation 1 and on) joins at once."""
        if not self.run_dir:
            return
        path = os.path.join(self.run_dir, runfiles.FT_START)
        gen = int(os.environ.get(GEN_ENV) or 0)
        w = JsonlWriter(path)
        w.write({"replica": self.n, "gen": gen, "t": time.time()})
        w.close()
        deadline = time.monotonic() + self.timeout_s
        while gen == 0 and time.monotonic() < deadline:
            if {r.get("replica") for r in read_jsonl(path)} >= set(range(self.groups)):
                return
            time.sleep(0.02)

    def members(self) -> Optional[list]:
        """The replica groups of this step's quorum, in ring order (their numbers), or None before the first."""
        return self.pg.members

    def should_commit(self) -> bool:
        """Whether this step commits (every participant's exchange succeeded and enough took part); call once per
        step, after the exchange, before the optimizer step."""
        return self.manager.should_commit()

    def current_step(self) -> int:
        """Committed steps so far (a recovery sets it to its source's)."""
        return self.manager.current_step()

    def error(self) -> Optional[str]:
        """This step's failure, one line (None when none)."""
        e = self.manager.errored()
        if e is None:
            return None
        return f"{type(e.original_exception).__name__}: {e.original_exception}".splitlines()[0][:300]

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        if self.recoveries:
            self.recoveries.close()
