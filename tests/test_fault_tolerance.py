"""Fault tolerance's parts that need no running replica: the spec's fault_tolerance section and its refusals, the
batches keyed by step, the collectives' refusal of what a replica group does not offer, the lab's decisions on
kills, restarts and the end of a run (commlab/lab/rundir/ftrun.py, on stand-in processes), and torchft beside our
torch. A whole fault-tolerant run with a kill and a restart is tests/test_ft_run.py."""
import importlib.util
import json
import time

import pytest
import torch

from commlab.engine import data, runfiles
from commlab.engine.comm import collectives
from commlab.engine.runlog import read_jsonl
from commlab.engine.spec import JobSpec, SpecError
from commlab.lab.rundir import ftrun

HAS_TORCHFT = importlib.util.find_spec("torchft") is not None
needs_torchft = pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed (./setup.sh installs it)")

BASE = {"model": "mlp", "dataset": "digits", "world_size": 3, "steps": 20,
        "fault_tolerance": {"enabled": True, "min_replicas": 2}}


def spec(**over):
    d = json.loads(json.dumps(BASE))
    ft = over.pop("ft", {})
    d.update(over)
    d["fault_tolerance"].update(ft)
    return d


@pytest.mark.parametrize("over,where,says", [
    ({"ft": {"min_replicas": 4}}, "fault_tolerance.min_replicas", "at most replica_groups 3"),
    ({"ft": {"replica_groups": 2}}, "fault_tolerance.replica_groups", "must equal world_size 3"),
    ({"comm": "dear"}, "comm.mode", "dear shards parameters"),
    ({"method": {"name": "streaming_diloco", "H": 4, "fragments": 2, "tau": 3}}, "method.tau",
     "tau must be at most 2"),
    ({"fault": {"kind": "exit", "step": 3, "rank": 1}}, "fault.kind", "fault_tolerance.faults"),
    ({"ft": {"faults": [{"kind": "kill", "replica": 3, "step": 2}]}}, "fault_tolerance.faults[0].replica",
     "below replica_groups 3"),
    ({"ft": {"faults": [{"kind": "kill", "replica": 1, "step": 20}]}}, "fault_tolerance.faults[0].step",
     "below steps 20"),
    ({"ft": {"faults": [{"kind": "freeze", "replica": 1, "step": 2}]}}, "fault_tolerance.faults[0].kind",
     "allowed: kill, cut, slow, hang"),
    ({"ft": {"faults": [{"kind": "hang", "replica": 1, "step": 2, "seconds": 3}]}},
     "fault_tolerance.faults[0].seconds", "unknown field for a hang fault"),
    ({"ft": {"faults": [{"kind": "cut", "replica": 1, "step": 2}]}}, "fault_tolerance.faults[0].seconds",
     "in (0, 3600]"),
    ({"ft": {"faults": [{"kind": "cut", "replica": 1, "step": 2, "seconds": 1, "speed": 0.5}]}},
     "fault_tolerance.faults[0].speed", "unknown field for a cut fault"),
    ({"ft": {"faults": [{"kind": "slow", "replica": 1, "step": 2}]}}, "fault_tolerance.faults[0].speed",
     "in [0.01, 1)"),
    ({"ft": {"faults": [{"kind": "slow", "replica": 1, "step": 2, "speed": 1.5}]}},
     "fault_tolerance.faults[0].speed", "share of its speed"),
    ({"ft": {"faults": [{"kind": "slow", "replica": 1, "step": 2, "speed": 0.5, "steps": 0}]}},
     "fault_tolerance.faults[0].steps", "integer >= 1"),
    ({"ft": {"faults": [{"kind": "slow", "replica": 1, "step": 2, "speed": 0.5, "restart_after_s": 1}]}},
     "fault_tolerance.faults[0].restart_after_s", "unknown field for a slow fault"),
    ({"ft": {"faults": [{"kind": "slow", "replica": 3, "step": 2, "speed": 0.5}]}},
     "fault_tolerance.faults[0].replica", "below replica_groups 3"),
    ({"ft": {"faults": [{"replica": 1, "step": 2, "when": 3}]}}, "fault_tolerance.faults[0].when", "unknown field"),
    ({"ft": {"faults": [{"replica": 1}]}}, "fault_tolerance.faults[0].step", "integer >= 0"),
    ({"ft": {"restart": {"max_restarts": -1}}}, "fault_tolerance.restart.max_restarts", "0..1000"),
    ({"ft": {"restart": {"tries": 1}}}, "fault_tolerance.restart.tries", "unknown field"),
    ({"ft": {"join_timeout_ms": 0}}, "fault_tolerance.join_timeout_ms", "must be in 1.."),
    ({"ft": {"enabled": False, "faults": [{"replica": 1, "step": 2}]}}, "fault_tolerance.faults",
     "needs fault_tolerance.enabled"),
])
def test_a_spec_fault_tolerance_cannot_run_is_refused_in_one_line_naming_the_field(over, where, says):
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(spec(**over))
    assert e.value.path == where, str(e.value)
    assert says in str(e.value) and "\n" not in str(e.value)


@needs_torchft
@pytest.mark.parametrize("compressor", [{"name": "topk", "ratio": 0.1, "error_feedback": True},
                                        {"name": "int8", "error_feedback": True}, {"name": "qsgd"},
                                        {"name": "countsketch", "ratio": 0.05}, {"name": "randomk", "ratio": 0.1},
                                        {"name": "fp16", "error_feedback": True},
                                        {"name": "topk", "ratio": 0.1, "per_bucket": [{"below_mb": 0.01, "name": "fp16"}]}],
                         ids=lambda c: c["name"] + ("-rules" if "per_bucket" in c else ""))
def test_every_per_step_compressor_runs_fault_tolerant_error_feedback_included(compressor):
    s = JobSpec.from_dict(spec(compressor=compressor))
    assert s.compressor.name == compressor["name"] and s.fault_tolerance.enabled
    assert s.compressor.error_feedback == compressor.get("error_feedback", False)


@needs_torchft
@pytest.mark.parametrize("schedule", ["mergecomp", "layerfusion"])
def test_a_tuning_schedule_runs_fault_tolerant_on_a_partition_chosen_before_the_replicas(schedule, tmp_path):
    """mergecomp and layerfusion are accepted; a replica trains the partition.json its run holds, and without one it
    refuses in one line naming the field (a replica that searched on its own would not agree with the others)."""
    from commlab.engine.stepper import _partition
    s = JobSpec.from_dict(spec(schedule=schedule))
    assert s.schedule.name == schedule and s.fault_tolerance.enabled
    with pytest.raises(RuntimeError, match=f"schedule.name: {schedule} under fault tolerance trains the partition"):
        _partition(s, str(tmp_path))
    (tmp_path / runfiles.PARTITION).write_text(json.dumps({"schedule": schedule, "order": ["a", "b", "c"],
                                                          "cuts": [1], "from": "cache"}))
    assert _partition(s, str(tmp_path)) == {"order": ["a", "b", "c"], "cuts": [1]}
    assert _partition(JobSpec.from_dict(spec(schedule="bucket")), str(tmp_path)) is None


@pytest.mark.parametrize("doc,says", [({"order": [], "cuts": []}, "order must be a non-empty list"),
                                      ({"order": ["a", "b"], "cuts": [2]}, "cuts must be a list of positions in 1..1"),
                                      ({"order": ["a", 3], "cuts": []}, "order must be"),
                                      ([1, 2], "order must be")])
def test_a_damaged_partition_file_is_refused_naming_it(tmp_path, doc, says):
    (tmp_path / runfiles.PARTITION).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=says):
        runfiles.read_partition(str(tmp_path))
    assert runfiles.read_partition(str(tmp_path / "elsewhere")) is None and runfiles.read_partition(None) is None


@needs_torchft
def test_strategy_auto_under_fault_tolerance_ranks_only_what_the_replicas_can_run():
    """A fault-tolerant spec may leave its strategy to the advisor: the space lists dear without ranking it (it
    does not run under fault tolerance) and ranks MergeComp (its search runs before the replicas start); the same
    spec without fault tolerance ranks them all."""
    from commlab.lab.strategy.space import FT_NO_DEAR, space
    d = spec(strategy={"mode": "auto", "measure": False}, network={"link": "modeled", "gbps": 1},
             optimizer={"name": "adam"})
    s = JobSpec.from_dict(d).to_dict()
    cands = space(s, methods=False)
    left = {c.label: c.excluded for c in cands if c.excluded}
    assert left and all(why == FT_NO_DEAR for why in left.values())
    assert {c.label for c in cands if c.comm["mode"] == "dear"} == set(left)
    assert any(c.schedule["name"] == "mergecomp" and not c.excluded for c in cands)
    plain = space({**s, "fault_tolerance": {**s["fault_tolerance"], "enabled": False}}, methods=False)
    assert not [c for c in plain if c.excluded] and len(plain) == len(cands)


@needs_torchft
def test_a_fault_tolerant_spec_is_fully_defaulted():
    s = JobSpec.from_dict(spec(ft={"faults": [{"replica": 2, "step": 5}]}))
    ft = s.to_dict()["fault_tolerance"]
    assert ft["replica_groups"] == 3 and ft["min_replicas"] == 2 and ft["restart"] == {"max_restarts": 3,
                                                                                        "delay_s": 2.0}
    assert ft["faults"] == [{"kind": "kill", "replica": 2, "step": 5, "restart_after_s": None}]
    assert JobSpec.from_dict(s.to_dict()) == s  # spec.json reads back as the same spec
    assert JobSpec.from_checked(s.to_dict()) == s
    slow = JobSpec.from_dict(spec(ft={"faults": [{"kind": "slow", "replica": 1, "step": 5, "speed": 0.25}]}))
    assert slow.to_dict()["fault_tolerance"]["faults"] == [{"kind": "slow", "replica": 1, "step": 5, "speed": 0.25,
                                                            "steps": None}]
    assert JobSpec.from_dict(slow.to_dict()) == slow


def test_a_replica_keeps_the_product_of_the_slow_faults_that_cover_its_step():
    from commlab.engine.stepper import slow_factor
    faults = [{"kind": "slow", "replica": 0, "step": 5, "steps": 3, "speed": 0.5},
              {"kind": "slow", "replica": 0, "step": 6, "steps": None, "speed": 0.25}]
    assert [slow_factor(faults, s) for s in (4, 5, 6, 7, 8, 100)] == [1.0, 0.5, 0.125, 0.125, 0.25, 0.25]


@needs_torchft
@pytest.mark.parametrize("method", [{"name": "local_sgd", "H": 4}, {"name": "post_local_sgd", "H": 4, "warmup": 2},
                                    {"name": "diloco", "H": 4, "compressor": {"name": "bf16"}},
                                    {"name": "streaming_diloco", "H": 4, "fragments": 2, "tau": 2},
                                    {"name": "desloc", "Hx": 4}])
def test_the_methods_that_sync_now_and_then_run_fault_tolerant(method):
    opt = {"optimizer": {"name": "adam", "lr": 0.001}} if method["name"] == "desloc" else {}
    s = JobSpec.from_dict(spec(method=method, **opt))
    assert s.method.name == method["name"] and s.fault_tolerance.enabled


USERS_METHOD = """
from commlab.engine.methods.base import Method
from commlab.engine.methods.local_sgd import LocalSGD

class Mine(Method):
    name = "mine"

class Averaging(LocalSGD):  # local SGD's syncs, which join the quorum
    name = "averaging"
"""


def test_a_users_method_runs_fault_tolerant_only_when_it_says_its_syncs_join_the_quorum(tmp_path, monkeypatch):
    """``Method.fault_tolerant``: a user's method that does not say so is refused in one line naming the field, in
    the spec and, where the spec check could not import it, by the rank; one that inherits local SGD's syncs runs."""
    from commlab.engine.trainer import Trainer
    (tmp_path / "usersmethod.py").write_text(USERS_METHOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(spec(method={"name": "usersmethod:Mine"}))
    assert e.value.path == "method.name" and "Method.fault_tolerant" in str(e.value) and "\n" not in str(e.value)
    assert JobSpec.from_dict(spec(method={"name": "usersmethod:Averaging", "H": 4})).method.params == {"H": 4}
    plain = JobSpec.from_dict(spec(model={"name": "mlp"}, method={"name": "usersmethod:Mine"},
                                   fault_tolerance={"enabled": False}))
    s = JobSpec.from_checked({**plain.to_dict(), "world_size": 1, "batch_size": 16, "timeline": False,
                              "fault_tolerance": {**plain.to_dict()["fault_tolerance"], "enabled": True,
                                                  "replica_groups": 1, "min_replicas": 1}})
    with pytest.raises(RuntimeError, match=r"^method\.name: usersmethod:Mine does not say its syncs join"):
        Trainer(s, None, 0, 1, torch.device("cpu"), ft=StandIn([True]))


def test_a_spec_without_fault_tolerance_is_as_before():
    s = JobSpec.from_dict({"model": "mlp", "dataset": "digits"})
    assert s.fault_tolerance.enabled is False and s.fault_tolerance.replica_groups is None
    older = {k: v for k, v in s.to_dict().items() if k != "fault_tolerance"}  # a spec.json written before
    assert JobSpec.from_checked(older) == s


def test_batches_keyed_by_step_are_the_stream_at_that_step():
    a = data.ShardSampler(100, 8, 1, 3, seed=4)
    stream = [next(a) for _ in range(9)]  # 4 batches per epoch: two epochs and one more
    b = data.ShardSampler(100, 8, 1, 3, seed=4)
    for step in (5, 2, 8, 0, 4, 4):
        assert torch.equal(b.at(step), stream[step]), step
        assert b.epoch == step // 4
    assert torch.equal(next(b), stream[5])  # the stream goes on after the step asked for
    with pytest.raises(ValueError, match="step must be >= 0"):
        b.at(-1)


class OnlyAllReduce(collectives.Group):
    def size(self):
        return 2

    def rank(self):
        return 0

    def backend(self):
        return "gloo"

    def all_reduce(self, t):
        raise AssertionError("not reached")


def test_a_replica_groups_collectives_refuse_what_it_does_not_offer_in_one_line():
    g = OnlyAllReduce()
    assert (collectives.group_size(g), collectives.group_rank(g), collectives.group_backend(g)) == (2, 0, "gloo")
    with pytest.raises(RuntimeError, match="all-gather on a OnlyAllReduce is not supported"):
        collectives.issue_allgather_into(torch.zeros(4), torch.ones(2), g)  # dear's, refused with dear
    with pytest.raises(RuntimeError, match="all-to-all on a OnlyAllReduce"):
        collectives.issue_all_to_all([[torch.ones(2)], [torch.ones(2)]], g)
    with pytest.raises(RuntimeError, match="reduce-scatter on a OnlyAllReduce"):
        collectives.issue_reduce_scatter(torch.ones(4), g)


class Gathering(OnlyAllReduce):
    """A replica group of two whose peer sends ``peer`` (tensors of other shapes than this rank's), or whose
    all-gathers fail from the ``fail_from``-th on (0: the header's; 1: the data's), as a lost peer's do: reported,
    the outputs left holding anything."""

    def __init__(self, peer, fail_from=None):
        self.peer, self.fail_from, self.calls, self.errored = peer, fail_from, 0, False

    def all_gather(self, outs, t):
        n, self.calls = self.calls, self.calls + 1
        if self.fail_from is not None and n >= self.fail_from:
            self.errored = True
            for o in outs:
                o.fill_(7)
        else:
            outs[0].copy_(t)
            outs[1].copy_(self.peer[n])
        return Solo().all_reduce(t)  # nothing to wait for

    def failed(self):
        return self.errored


@pytest.mark.parametrize("fail_from", [None, 0, 1], ids=["ok", "header-lost", "data-lost"])
def test_a_replica_groups_all_gather_gathers_payloads_of_any_shape_and_a_failed_one_reads_as_its_own(fail_from):
    """A replica group's all-gather (top-k's and the other all-gathered compressors' round): payloads of other
    shapes from the peer are read back; when a peer is lost in the header's or the data's exchange (the step will
    not commit), every rank's payload reads as this rank's own, which decompresses, instead of bytes that may not."""
    mine = [torch.arange(3, dtype=torch.float32), torch.tensor([0, 2], dtype=torch.int64)]
    theirs = [torch.arange(5, dtype=torch.float32) + 10, torch.tensor([4, 1, 3], dtype=torch.int64)]
    peer_header = torch.tensor([[1, 5, 0, 0, 0], [1, 3, 0, 0, 0]], dtype=torch.int64)
    offs, cap = collectives.pack_offsets([20, 24])
    peer_bytes = torch.zeros(max(cap, collectives.pack_offsets([12, 16])[1]), dtype=torch.uint8)
    for t, off in zip(theirs, offs):
        peer_bytes[off:off + t.numel() * t.element_size()] = t.view(-1).view(torch.uint8)
    g = Gathering([peer_header, peer_bytes], fail_from)
    got = collectives.issue_allgather(mine, g).wait()
    want = [mine, theirs] if fail_from is None else [mine, mine]
    assert len(got) == 2 and all(torch.equal(a, b) for p, q in zip(got, want) for a, b in zip(p, q)), got
    assert g.failed() == (fail_from is not None)


# -- the lab's side, on stand-in processes ------------------------------------------------------------------------

class Proc:
    """A stand-in for a replica's process: its exit code is what the test says."""
    n = 1000

    def __init__(self):
        Proc.n += 1
        self.pid, self.code = Proc.n, None

    def poll(self):
        return self.code


class Dir:
    def __init__(self, path):
        self.path = path

    def file(self, name):
        return self.path / name


class Job(ftrun.FtJob):
    """FtJob whose replicas are stand-ins and whose kills only mark them (nothing is signalled)."""

    def _start_replica(self, r):
        gen = self.gens.get(r, -1) + 1
        self.gens[r] = gen
        self.live[r] = (Proc(), gen)
        self.spawned[r] = time.time()
        self.stepped.discard(r)
        self._record("spawn", replica=r, gen=gen, pid=self.live[r][0].pid)


@pytest.fixture
def no_signals(monkeypatch):
    killed = []

    def kill(pid, sig):
        killed.append(pid)
        for p, _ in list(job_procs):
            if p.pid == pid:
                p.code = -9
    job_procs = []
    monkeypatch.setattr(ftrun.os, "kill", kill)
    return killed, job_procs


def job_of(tmp_path, **ft):
    s = JobSpec.from_checked(spec(model={"name": "mlp"}, dataset={"name": "digits"}, ft={"replica_groups": 3, **ft}))
    return Job(Dir(tmp_path), s, None)


def test_the_lab_kills_at_the_faults_step_once_and_restarts_after_the_delay(tmp_path, no_signals):
    killed, procs_ = no_signals
    job = job_of(tmp_path, faults=[{"kind": "kill", "replica": 2, "step": 4, "restart_after_s": 0.0}],
                 restart={"max_restarts": 1, "delay_s": 0.0})
    for r in range(3):
        job._start_replica(r)
    procs_.extend(job.live.values())
    first = job.live[2][0]
    job.feed([{"kind": "step", "replica": 2, "step": 3}, {"kind": "step", "replica": 1, "step": 4}])
    assert killed == []  # replica 1's step 4 is not replica 2's
    job.feed([{"kind": "step", "replica": 2, "step": 4}, {"kind": "step", "replica": 2, "step": 5}])
    assert killed == [first.pid]  # once
    job.poll()  # its exit seen, the restart due now (delay 0)
    job.poll()
    assert job.gens[2] == 1 and job.live[2][0] is not first and job.restarts_left == 0
    job.feed([{"kind": "step", "replica": 2, "step": 9}])
    assert killed == [first.pid]  # the fault fired already
    assert job.verdict() is None
    for p, _ in job.live.values():
        p.code = 0
    job.poll()
    assert job.verdict() == "done"
    ev = read_jsonl(str(tmp_path / runfiles.FT_EVENTS))
    assert [(e["event"], e.get("replica"), e.get("gen")) for e in ev if e["event"] in ("kill", "spawn")][-2:] == \
        [("kill", 2, 0), ("spawn", 2, 1)]
    assert any(e["event"] == "exit" and e["replica"] == 2 and e["gen"] == 0 and e["code"] == -9 for e in ev)


def test_a_run_whose_replicas_all_die_without_restarts_fails(tmp_path, no_signals):
    job = job_of(tmp_path, restart={"max_restarts": 1, "delay_s": 0.0})
    for r in range(3):
        job._start_replica(r)
    for p, _ in job.live.values():
        p.code = 1
    job.poll()
    job.poll()  # one restart (of replica 0), the others stay dead
    assert job.verdict() is None and list(job.live) == [0]
    job.live[0][0].code = 1
    job.poll()
    assert job.verdict() == "failed" and "no restart is left" in job.failed
    assert sorted(r for r, _ in job.failures) == [0, 0, 1, 2]


def test_no_restart_once_a_replica_has_trained_to_the_end(tmp_path, no_signals):
    job = job_of(tmp_path, restart={"max_restarts": 3, "delay_s": 0.0})
    for r in range(3):
        job._start_replica(r)
    job.feed([{"kind": "step", "replica": r, "step": 1, "t": time.time() + 1} for r in range(3)])
    job.live[0][0].code = 0
    job.live[1][0].code = 1
    job.poll()
    job.poll()
    assert 1 not in job.live and job.gens[1] == 0  # not restarted: training is over
    job.live[2][0].code = 0
    job.poll()
    assert job.verdict() == "done"


@needs_torchft
def test_torchft_imports_beside_our_torch():
    before = torch.__version__
    from commlab.engine import ft
    assert ft.version() == "0.2.0" and torch.__version__ == before
    assert ft.replica_id(3) == "replica_3"


# -- the stepper under fault tolerance, in one process: a stand-in replica that decides which steps commit ----------

class Solo(collectives.Group):
    """A replica group of one: its all-reduce is the tensor itself."""

    def size(self):
        return 1

    def rank(self):
        return 0

    def backend(self):
        return "gloo"

    def all_reduce(self, t):
        class Done:
            def wait(self, timeout=None):
                return True

            def get_future(self):
                f = torch.futures.Future()
                f.set_result([t])
                return f
        return Done()

    def all_gather(self, outs, t):
        for o in outs:
            o.copy_(t)
        return self.all_reduce(t)


class StandIn:
    """What the Stepper asks of commlab.engine.ft.Replica, with the commits given by the test."""

    def __init__(self, commits):
        self.n, self.group, self.commits, self.step, self.registered = 0, Solo(), iter(commits), 0, {}

    def register(self, key, load, save):
        self.registered[key] = (load, save)

    def start_quorum(self):
        return {"quorum_id": 1, "participants": 1, "quorum_ms": 0.0, "step": self.step}

    def should_commit(self):
        ok = next(self.commits)
        self.step += ok
        return ok

    def current_step(self):
        return self.step

    def error(self):
        return "RuntimeError: a peer is gone"


def state_of(trainer):
    """Each bucket's compressor state, copied."""
    from commlab.engine.methods.base import cloned as _cloned
    return [_cloned(b.compressor.state_dict()) for b in trainer.dp.buckets]


def same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_step_that_does_not_commit_changes_nothing_and_is_trained_again_on_the_same_batch():
    from commlab.engine.trainer import Trainer
    s = JobSpec.from_checked({**spec(model={"name": "mlp"}, dataset={"name": "digits"}, world_size=1,
                                     ft={"replica_groups": 1, "min_replicas": 1}),
                              "compressor": {"name": "powersgd", "params": {"rank": 2, "start_iter": 0}},
                              "batch_size": 16, "timeline": False})
    standin = StandIn([True, True, False, True])
    t = Trainer(s, None, 0, 1, torch.device("cpu"), ft=standin)
    try:
        t.train_step()
        t.train_step()
        assert t.step == 2
        params = [p.detach().clone() for p in t.model.parameters()]
        codec = state_of(t)
        assert any(v is not None and not isinstance(v, int) for st in codec for v in st.values())  # Q, residual
        failed = t.train_step()
        assert failed["committed"] is False and failed["error"] == "RuntimeError: a peer is gone"
        assert t.step == 2 and failed["step"] == 2
        assert all(torch.equal(a, b) for a, b in zip(params, t.model.parameters()))  # the optimizer did not step
        assert same(state_of(t), codec)  # PowerSGD's Q, residual and count as the step began
        again = t.train_step()
        assert again["committed"] is True and again["step"] == 2 and t.step == 3
        assert again["loss"] == failed["loss"]  # the same batch on the same model
        assert not all(torch.equal(a, b) for a, b in zip(params, t.model.parameters()))
        # what a replica that recovers takes: the shared state, not this replica's residual
        load, save = standin.registered["compressors"]
        handed = save()
        assert all(st["residual"] is None and (st.get("q") is not None or st.get("qs") is not None) for st in handed)
        load(handed)
        assert all(b.compressor.residual is None for b in t.dp.buckets)
        assert {"model", "optimizer", "compressors"} <= set(standin.registered)
    finally:
        t.close()


def test_error_feedback_under_fault_tolerance_keeps_its_residual_through_a_step_that_does_not_commit():
    """Top-k with error feedback (an all-gathered round): a step that does not commit puts the residual back as
    the step began; what a replica that recovers takes has no residual (each replica's own), and loading it
    starts the residual from zero."""
    from commlab.engine.trainer import Trainer
    s = JobSpec.from_checked({**spec(model={"name": "mlp"}, dataset={"name": "digits"}, world_size=1,
                                     ft={"replica_groups": 1, "min_replicas": 1}),
                              "compressor": {"name": "topk", "error_feedback": True, "params": {"ratio": 0.1}},
                              "batch_size": 16, "timeline": False})
    standin = StandIn([True, False, True])
    t = Trainer(s, None, 0, 1, torch.device("cpu"), ft=standin)
    try:
        t.train_step()
        params = [p.detach().clone() for p in t.model.parameters()]
        codec = state_of(t)
        assert all(st["ef"]["residual"] is not None and st["ef"]["residual"].abs().sum() > 0 for st in codec)
        failed = t.train_step()
        assert failed["committed"] is False and t.step == 1
        assert all(torch.equal(a, b) for a, b in zip(params, t.model.parameters()))
        assert same(state_of(t), codec)  # the residual as the step began
        again = t.train_step()
        assert again["committed"] is True and again["loss"] == failed["loss"] and t.step == 2
        assert not same(state_of(t), codec)
        load, save = standin.registered["compressors"]
        handed = save()
        assert all(st["ef"]["residual"] is None for st in handed)
        load(handed)
        assert all(st["ef"]["residual"] is None for st in state_of(t))
    finally:
        t.close()


def test_a_demo_step_that_does_not_commit_puts_its_momentum_back_and_is_trained_again():
    """DeMo under fault tolerance: its exchange (an all-gather in every step) joins the step's quorum; a step that
    does not commit leaves the parameters and DeMo's momentum as the step began, and the same batch comes again."""
    from commlab.engine.trainer import Trainer
    s = JobSpec.from_checked({**spec(model={"name": "mlp"}, dataset={"name": "digits"}, world_size=1,
                                     ft={"replica_groups": 1, "min_replicas": 1}),
                              "method": {"name": "demo", "params": {"topk": 8}},
                              "optimizer": {"name": "sgd", "lr": 0.001}, "batch_size": 16, "timeline": False})
    standin = StandIn([True, True, False, True])
    t = Trainer(s, None, 0, 1, torch.device("cpu"), ft=standin)
    try:
        t.train_step()
        t.train_step()
        params = [p.detach().clone() for p in t.model.parameters()]
        momentum = [m.clone() for m in t.stepper.method.momentum()]
        assert any(m.abs().sum() > 0 for m in momentum)
        failed = t.train_step()
        assert failed["committed"] is False and failed["step"] == 2 and t.step == 2
        assert all(torch.equal(a, b) for a, b in zip(params, t.model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(momentum, t.stepper.method.momentum()))
        again = t.train_step()
        assert again["committed"] is True and again["step"] == 2 and again["loss"] == failed["loss"] and t.step == 3
        assert not all(torch.equal(a, b) for a, b in zip(momentum, t.stepper.method.momentum()))
    finally:
        t.close()


def test_a_slowdown_asked_for_slows_this_replicas_steps_until_its_time_is_up(tmp_path):
    """slowdowns.json (what the lab's supervisor writes when `commlab fault --slow` asks): the Stepper reads its own
    replica's entry before each step and computes at that speed until ``until``; another replica's entry, a
    slowdown whose time is up and a damaged file leave it at its own speed."""
    from commlab.engine.runlog import write_json_atomic
    from commlab.engine.trainer import Trainer
    s = JobSpec.from_checked({**spec(model={"name": "mlp"}, dataset={"name": "digits"}, world_size=1,
                                     ft={"replica_groups": 1, "min_replicas": 1}), "batch_size": 16,
                              "timeline": False})
    standin = StandIn([True] * 5)
    standin.run_dir = str(tmp_path)
    path = tmp_path / runfiles.SLOWDOWNS
    t = Trainer(s, None, 0, 1, torch.device("cpu"), ft=standin)
    try:
        assert "speed" not in t.train_step()  # no file
        write_json_atomic(path, {"0": {"speed": 0.5, "until": time.time() + 600}, "1": {"speed": 0.1, "until": 0}})
        slowed = t.train_step()
        assert slowed["speed"] == 0.5 and slowed["slow_ms"] > 0
        write_json_atomic(path, {"0": {"speed": 0.5, "until": time.time() - 1}})
        assert "speed" not in t.train_step()
        write_json_atomic(path, {"1": {"speed": 0.25, "until": time.time() + 600}})
        assert "speed" not in t.train_step()
        path.write_text('{"0": {"speed": 0.5, "until"')
        assert "speed" not in t.train_step()
    finally:
        t.close()


class Twins(Solo):
    """Three replica groups when built, then a quorum of two whose other member sent the same gradient: the sum of
    an all-reduce is twice this replica's tensor."""

    def size(self):
        return 3

    def all_reduce(self, t):
        t.mul_(2)
        return super().all_reduce(t)


@pytest.mark.parametrize("compressor", ["none", "fp16"])
def test_a_step_averages_over_the_quorums_participants(compressor):
    """Built for three replicas (1/3 where gradients land pre-divided), trained in a quorum of two twins: the average
    is this replica's own gradient, as a quorum of one gives."""
    from commlab.engine.trainer import Trainer
    finals = []
    for group, participants in ((Solo(), 1), (Twins(), 2)):
        s = JobSpec.from_checked({**spec(model={"name": "mlp"}, dataset={"name": "digits"},
                                         ft={"replica_groups": 3, "min_replicas": 1}),
                                  "compressor": {"name": compressor}, "batch_size": 16, "timeline": False})
        standin = StandIn([True, True])
        standin.group = group
        standin.start_quorum = lambda standin=standin, n=participants: {"quorum_id": 1, "participants": n,
                                                                        "quorum_ms": 0.0, "step": standin.step}
        t = Trainer(s, None, 0, 3, torch.device("cpu"), ft=standin)
        try:
            t.train_step()
            t.train_step()
            finals.append([p.detach().clone() for p in t.model.parameters()])
        finally:
            t.close()
    for a, b in zip(*finals):
        torch.testing.assert_close(a, b)


@needs_torchft
def test_the_lighthouse_process_loads_torchfts_extension_without_torch():
    """commlab/engine/ft_lighthouse.py loads torchft's compiled Lighthouse without torchft's package or torch (which
    would cost the process seconds of CPU before it serves)."""
    import subprocess
    import sys
    code = ("import sys; from commlab.engine import ft_lighthouse as f; m = f.torchft_extension(); "
            "print(callable(m.lighthouse_main), hasattr(m, 'LighthouseServer'), "
            "'torch' in sys.modules, 'torchft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False", "False"], out.stdout


def test_a_lighthouse_that_does_not_come_up_is_one_line_and_nothing_is_left(tmp_path):
    job = ftrun.FtJob(Dir(tmp_path), JobSpec.from_checked(spec(model={"name": "mlp"}, dataset={"name": "digits"},
                                                                ft={"replica_groups": 3})), None, python="/bin/false")
    with pytest.raises(RuntimeError, match=r"^fault_tolerance: the Lighthouse exited with code 1 before it served; "
                                           r"see log-lighthouse.txt$"):
        job.start()
    job.stop()
    assert job.live == {} and all(p.poll() is not None for p in job.started)
    ev = read_jsonl(str(tmp_path / runfiles.FT_EVENTS))
    assert [e["event"] for e in ev] == ["lighthouse"] and ev[0]["pid"] == job.started[0].pid


# -- a method's syncs under fault tolerance, in one process: stand-in replicas of one -----------------------------------

def method_trainer(method, standin, steps=12):
    """One replica's Trainer under ``method`` (DES-LOC's with Adam, which it needs) with ``standin`` as its replica."""
    from commlab.engine.trainer import Trainer
    opt = {"optimizer": {"name": "adam", "lr": 0.01}} if method["name"] == "desloc" else {}
    s = JobSpec.from_checked({**spec(model={"name": "mlp"}, dataset={"name": "digits"}, world_size=1, steps=steps,
                                     ft={"replica_groups": 1, "min_replicas": 1}, **opt),
                              "method": JobSpec.from_dict(spec(method=method, **opt)).method.__dict__,
                              "batch_size": 16, "timeline": False})
    return Trainer(s, None, 0, 1, torch.device("cpu"), ft=standin)


def test_a_diloco_sync_that_does_not_commit_puts_the_local_parameters_back_to_the_global_ones_and_moves_on():
    standin = StandIn([True, True, False, True])  # the start, the syncs after steps 1, 3 and 5
    t = method_trainer({"name": "diloco", "H": 2, "outer_lr": 0.7, "outer_momentum": 0.9}, standin)
    try:
        m = t.stepper.method
        rows = [t.train_step() for _ in range(2)]
        assert rows[0]["committed"] is True and rows[0]["quorum_ms"] is not None  # the start's quorum and commit
        assert rows[1]["committed"] is True and m.syncs == 1
        glob = [g.clone() for g in m.glob]
        outer = state_of_optimizer(m.outer)
        t.train_step()
        assert not all(torch.equal(p, g) for p, g in zip(t.model.parameters(), glob))  # a local step moved them
        failed = t.train_step()
        assert failed["step"] == 3 and failed["committed"] is False and failed["error"] == "RuntimeError: a peer is gone"
        assert t.step == 4  # the inner steps are not trained again: the step moves on
        assert all(torch.equal(p, g) for p, g in zip(t.model.parameters(), glob))  # back to the global parameters
        assert all(torch.equal(a, b) for a, b in zip(m.glob, glob)) and m.syncs == 1
        assert same(state_of_optimizer(m.outer), outer)  # no outer step, its momentum as it was
        t.train_step()
        ok = t.train_step()
        assert ok["step"] == 5 and ok["committed"] is True and m.syncs == 2
        assert not all(torch.equal(a, b) for a, b in zip(m.glob, glob))
    finally:
        t.close()


class Skewing(Solo):
    """A replica group of one whose all-reduce, once ``skew`` is set, adds one to every element: as if a peer had sent
    other tensors, so that an average applied shows."""
    skew = False

    def all_reduce(self, t):
        if self.skew:
            t.add_(1)
        return super().all_reduce(t)


def test_a_desloc_sync_that_does_not_commit_keeps_each_replicas_moments_and_puts_the_parameters_back():
    """Hx = Hu = Hv = 2: the parameters and both moments are due after steps 1, 3, 5. Beside a twin whose syncs all
    commit (a quorum of one: its averages are its own tensors), the sync after step 3 fails on a skewing group: the
    moments stay this replica's own (the twin's), the parameters go back to their last average, nothing is counted."""
    method = {"name": "desloc", "Hx": 2, "Hu": 2, "Hv": 2}
    a_in, b_in = StandIn([True, True, False, True]), StandIn([True] * 6)  # the start, then the syncs
    a_in.group = Skewing()
    a, b = method_trainer(method, a_in), method_trainer(method, b_in)
    try:
        for _ in range(3):
            assert a.train_step()["loss"] == b.train_step()["loss"]
        ma, mb = a.stepper.method, b.stepper.method
        synced = [g.clone() for g in ma.synced]
        a_in.group.skew = True
        failed, ok = a.train_step(), b.train_step()
        assert failed["step"] == ok["step"] == 3 and failed["committed"] is False and ok["committed"] is True
        assert failed["synced"] == [] and ok["synced"] == ["params", "exp_avg", "exp_avg_sq"]
        assert ma.syncs == {"params": 1, "exp_avg": 1, "exp_avg_sq": 1} and mb.syncs["params"] == 2
        assert all(torch.equal(p, g) for p, g in zip(a.model.parameters(), synced))
        assert not all(torch.equal(p, g) for p, g in zip(b.model.parameters(), synced))
        sa, sb = a.optimizer.state, b.optimizer.state
        for pa, pb in zip(a.model.parameters(), b.model.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(sa[pa][key], sb[pb][key]), key
        a.train_step()
        assert a.train_step()["committed"] is True and ma.syncs["params"] == 2
        assert not torch.equal(sa[next(a.model.parameters())]["exp_avg"], sb[next(b.model.parameters())]["exp_avg"])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("method", [
    {"name": "diloco", "H": 2, "outer_lr": 0.7, "compressor": {"name": "topk", "ratio": 0.1, "error_feedback": True}},
    {"name": "sparseloco", "H": 2, "chunk": 64, "k": 8}], ids=["diloco-topk-ef", "sparseloco"])
def test_a_sync_that_does_not_commit_puts_its_compressors_state_back_and_a_recovery_hands_over_no_residual(method):
    """A stateful compressor of a method's syncs (error feedback on the pseudo-gradient, SparseLoCo's recipe): the
    sync that does not commit leaves every group compressor's state (its residual) as the sync began; the state a
    replica that recovers takes holds what the replicas share of it and no residual, which then starts from zero."""
    from commlab.engine.methods.base import cloned
    standin = StandIn([True, True, False, True])  # the start, the syncs after steps 1, 3 and 5
    t = method_trainer(method, standin)
    try:
        m = t.stepper.method
        groups = [g for gs in m.parts for g in gs]
        codec = lambda: [cloned(g.compressor.state_dict()) for g in groups]  # noqa: E731
        t.train_step()
        t.train_step()  # the first sync: a residual now
        before = codec()
        assert all(st["ef"]["residual"] is not None for st in before)
        t.train_step()
        failed = t.train_step()
        assert failed["committed"] is False and same(codec(), before)
        t.train_step()
        assert t.train_step()["committed"] is True and not same(codec(), before)
        load, save = standin.registered["method"]
        handed = save()
        assert [st["ef"]["residual"] for st in handed["codecs"]] == [None] * len(groups)
        load(handed)
        assert all(g.compressor.residual is None for g in groups)
    finally:
        t.close()


def state_of_optimizer(opt):
    from commlab.engine.methods.base import cloned as _cloned
    return _cloned(opt.state_dict())


class Source(StandIn):
    """A stand-in that keeps what it would send a replica that recovers from it, as it joins the quorum at ``at``."""

    def __init__(self, commits, at):
        super().__init__(commits)
        self.at, self.sent = at, None

    def start_quorum(self):
        pos = self.position()
        if pos["step"] == self.at and pos["at"] == "sync":
            self.sent = (pos, {k: save() for k, (_, save) in self.registered.items()})
        return super().start_quorum()


class Healing(StandIn):
    """A stand-in whose first quorum recovers from ``sent`` (as commlab.engine.ft.Replica loads a received state)."""

    def __init__(self, commits, sent):
        super().__init__(commits)
        self.sent = sent

    def start_quorum(self):
        if self.sent is not None:
            pos, state = self.sent
            self.sent = None
            self.on_position(pos)
            for k, (load, _) in self.registered.items():
                load(state[k])
        return super().start_quorum()


@pytest.mark.parametrize("method", [{"name": "diloco", "H": 3, "outer_lr": 0.7, "outer_momentum": 0.9},
                                    {"name": "streaming_diloco", "H": 4, "fragments": 2, "tau": 1},
                                    {"name": "local_sgd", "H": 3},
                                    {"name": "desloc", "Hx": 3, "Hu": 2, "Hv": 5}])
def test_a_replica_that_starts_late_recovers_in_the_peers_sync_runs_it_and_trains_on_as_they_do(method):
    """The source joins the sync of step 5 (or where a fragment is issued); a fresh replica's first quorum takes
    its state there: it runs that sync without a forward pass and trains on, bit for bit as the source."""
    from commlab.engine.trainer import params_digest
    at = 5 if method["name"] != "streaming_diloco" else 6  # fragment 1 of 2 is issued after step 6 (H 4, tau 1)
    src = Source([True] * 20, at)
    a = method_trainer(method, src)
    late = None
    try:
        while src.sent is None:
            a.train_step()
        assert set(src.sent[1]) == {"model", "optimizer", "compressors", "method"}
        late = method_trainer(method, Healing([True] * 20, src.sent))
        first = late.train_step()  # its quorum lands in the source's sync, which it runs, then it trains a step
        assert late.stepper.method.state_dict()["syncs"] == a.stepper.method.state_dict()["syncs"]
        same_step = a.train_step()
        assert first["step"] == same_step["step"] == at + 1 and first["loss"] == same_step["loss"]
        for _ in range(4):
            ra, rl = a.train_step(), late.train_step()
            assert ra["step"] == rl["step"] and ra["loss"] == rl["loss"]
        assert params_digest(a.model) == params_digest(late.model)
    finally:
        a.close()
        if late is not None:
            late.close()


@needs_torchft
def test_the_processes_of_the_start_wait_for_every_replica_group_and_a_restart_does_not(tmp_path, monkeypatch):
    """Replica._meet_at_the_start (commlab/engine/ft.py): each process writes its line to ft-start.jsonl; one of
    generation 0 returns only once every replica group has a line (or its timeout_s has passed), a restarted one
    (COMMLAB_FT_GEN 1) at once. A stand-in for the Replica: the method reads run_dir, n, groups and timeout_s."""
    import threading
    import types

    from commlab.engine import ft
    from commlab.engine.ft_lighthouse import GEN_ENV
    path = tmp_path / runfiles.FT_START

    def meet(n, gen, timeout_s=600.0):
        monkeypatch.setenv(GEN_ENV, str(gen))
        ft.Replica._meet_at_the_start(types.SimpleNamespace(run_dir=str(tmp_path), n=n, groups=3, timeout_s=timeout_s))
        return {r["replica"] for r in read_jsonl(str(path))}

    seen = {}
    first = threading.Thread(target=lambda: seen.update(first=meet(0, 0)))
    first.start()
    while not path.exists() or not read_jsonl(str(path)):
        time.sleep(0.01)
    assert first.is_alive()  # replica 0 waits: 1 and 2 have no line yet
    assert meet(1, 1) == {0, 1}  # a restarted process writes its line and goes on at once
    assert first.is_alive()
    row = {"replica": 2, "gen": 0, "t": time.time()}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    first.join(60)
    assert not first.is_alive() and seen["first"] == {0, 1, 2}
    assert meet(0, 0, timeout_s=0.05) == {0, 1, 2}  # all there: no wait
    path.unlink()
    assert meet(2, 0, timeout_s=0.2) == {2}  # nobody else comes: it goes on after timeout_s
