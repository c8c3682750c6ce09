"""A fault-tolerant run's replica groups as its records tell them (commlab.lab.analysis.replicas), from records
written as the lab writes them: a kill, the exit it causes, the restart, the recovery, the first step after it."""
from commlab.lab.analysis import replicas

EVENTS = [
    {"event": "lighthouse", "t": 0.0, "pid": 9},
    *({"event": "spawn", "replica": r, "gen": 0, "pid": 10 + r, "t": 0.1} for r in range(3)),
    {"event": "kill", "replica": 2, "gen": 0, "pid": 12, "step": 4, "t": 2.0},
    {"event": "exit", "replica": 2, "gen": 0, "pid": 12, "code": -9, "t": 2.1},
]
STEPS = [{"kind": "step", "replica": r, "step": s, "t": 1.0 + s * 0.2, "quorum_id": 1 if s < 5 else 2,
          "participants": 3 if s < 5 else 2, "committed": True} for s in range(8) for r in range(3)
         if not (r == 2 and s > 4)]
START = [{"replica": r, "from_replica": 0, "t": 0.9, "bytes": 10, "seconds": 0.01} for r in (1, 2)]


def by(states):
    return {s["replica"]: s for s in states}


def test_a_killed_replica_is_gone_then_recovering_then_training():
    s = by(replicas.replica_states(EVENTS, STEPS, START))
    assert [s[r]["state"] for r in range(3)] == ["training", "training", "gone"]
    assert s[2]["kills"] == 1 and s[2]["last_step"] == 4 and s[2]["gen"] == 0
    back = [*EVENTS, {"event": "spawn", "replica": 2, "gen": 1, "pid": 13, "t": 3.0}]
    s = by(replicas.replica_states(back, STEPS, START))
    assert s[2]["state"] == "recovering" and s[2]["gen"] == 1  # its old lines are from before the restart
    rec = {"replica": 2, "from_replica": 1, "t": 3.5, "bytes": 1000, "seconds": 0.05}
    later = [*STEPS, {"kind": "step", "replica": 2, "step": 9, "t": 3.6, "quorum_id": 3, "participants": 3}]
    s = by(replicas.replica_states(back, later, [*START, rec]))
    assert s[2]["state"] == "training" and s[2]["recoveries"] == 2 and s[2]["last_step"] == 9
    assert replicas.after_start([*START, rec], later) == [rec]
    assert [q["participants"] for q in replicas.quorum_sizes(later)] == [3, 2, 3]
    line = replicas.describe(list(s.values()))
    assert line == "3 replica groups: 3 training; 1 kill", line


def test_the_end_finished_or_stopped():
    end = [*EVENTS, {"event": "exit", "replica": 0, "gen": 0, "code": 0, "t": 9.0},
           {"event": "stop", "replica": 1, "gen": 0, "pid": 11, "t": 9.5, "why": "the others finished training"},
           {"event": "stop", "pid": 9, "lighthouse": True, "t": 9.6, "why": "the run ended"}]
    s = replicas.replica_states(end, STEPS, START)
    assert [x["state"] for x in s] == ["finished", "stopped", "gone"]
    assert replicas.describe(s) == ("3 replica groups: 1 gone (replica 2), 1 finished (replica 0), 1 stopped "
                                    "(replica 1); 1 kill")


def test_a_cut_replica_is_cut_off_then_recovering_then_training():
    """A cut fault: the lab stops the replica's process (``cut``), lets it go on (``reconnect``); it counts as
    recovering until it logs a step after that."""
    cut = [*EVENTS[:4], {"event": "cut", "replica": 1, "gen": 0, "pid": 11, "step": 3, "seconds": 2.0, "t": 1.7}]
    s = by(replicas.replica_states(cut, STEPS[:12], START))
    assert s[1]["state"] == "cut off" and s[1]["cuts"] == 1 and s[1]["kills"] == 0
    assert replicas.describe(list(s.values())) == ("3 replica groups: 2 training, 1 cut off (replica 1); 0 kills, "
                                                   "1 cut")
    back = [*cut, {"event": "reconnect", "replica": 1, "gen": 0, "pid": 11, "t": 3.7, "why": "the cut's time is up"}]
    s = by(replicas.replica_states(back, STEPS[:12], START))
    assert s[1]["state"] == "recovering"  # nothing logged since it went on
    later = [*STEPS[:12], {"kind": "step", "replica": 1, "step": 6, "t": 3.9, "quorum_id": 3, "participants": 3}]
    assert by(replicas.replica_states(back, later, START))[1]["state"] == "training"


def test_a_replica_whose_latest_step_ran_slow_is_slow_until_a_step_runs_at_its_speed():
    """A slow fault (of the spec, or asked for with `commlab fault --slow`): the step lines say ``speed``; the
    replica is ``slow`` while its latest one does, training again after."""
    slowed = [*STEPS, {"kind": "step", "replica": 0, "step": 8, "t": 9.0, "speed": 0.25, "slow_ms": 30.0}]
    s = by(replicas.replica_states(EVENTS, slowed, START))
    assert s[0]["state"] == "slow" and s[0]["speed"] == 0.25 and s[1]["state"] == "training" and s[1]["speed"] == 1.0
    assert replicas.describe(list(s.values())) == ("3 replica groups: 1 training, 1 slow (replica 0), 1 gone "
                                                   "(replica 2); 1 kill")
    again = [*slowed, {"kind": "step", "replica": 0, "step": 9, "t": 9.5}]
    assert by(replicas.replica_states(EVENTS, again, START))[0]["state"] == "training"


def test_a_hung_replica_is_hung_until_killed():
    hung = [*EVENTS[:4], {"event": "hang", "replica": 1, "gen": 0, "pid": 11, "step": 3, "t": 1.7}]
    s = by(replicas.replica_states(hung, STEPS[:12], START))
    assert s[1]["state"] == "hung"
    assert replicas.describe(list(s.values())) == "3 replica groups: 2 training, 1 hung (replica 1); 0 kills, 1 hang"
    killed = [*hung, {"event": "kill", "replica": 1, "gen": 0, "pid": 11, "t": 4.0}]
    assert by(replicas.replica_states(killed, STEPS[:12], START))[1]["state"] == "gone"
