"""A fault-tolerant run's replica groups as its records tell them: each one's state now, the quorum's size over time,
and the recoveries. Read by the Live run page and ``commlab show``; nothing here imports streamlit.

The records (commlab/engine/runfiles.py): ft-events.jsonl (what the lab did to each replica's processes: spawn,
kill, exit, stop), recoveries.jsonl (each recovery: who, from whom, bytes, seconds) and the step lines of
metrics.jsonl (``replica``, ``quorum_id``, ``participants``, ``committed``).

A replica's state, from its latest process (generation):

- ``training``: its process runs and has logged a step since it started;
- ``slow``: training, and its latest step ran below its own speed (a slow fault, of the spec or asked for: the
  row's ``speed`` says how much);
- ``recovering``: its process runs and has logged no step yet (importing, joining the quorum, taking a peer's state);
- ``gone``: its process was killed or died (a restart may be due: the lab's ``restart`` section decides);
- ``cut off``: a cut fault holds its process stopped (no traffic, no heartbeat); back to ``recovering`` when it ends;
- ``hung``: a hang fault holds its process stopped for good (a kill brings it back, restarted);
- ``finished``: its process trained to the end and exited 0;
- ``stopped``: the lab stopped it (the run ended, or the others had finished).
"""
from __future__ import annotations

from typing import Dict, List, Optional

STATES = ("training", "slow", "recovering", "cut off", "hung", "gone", "finished", "stopped")


def replica_states(events: List[dict], steps: List[dict], recoveries: List[dict]) -> List[dict]:
    """One row per replica group seen in ``events``: ``replica``, ``state`` (STATES), ``gen`` (its process's
    generation: 0, then one more per restart), ``kills``, ``cuts`` and ``hangs`` (over the run), ``recoveries`` (over the run, the start's
    included), ``last_step`` (the last step it logged, any generation), ``speed`` (the share of its own speed its
    latest step ran at: 1.0 without a slow fault) and ``since`` (the time of the event that set its state)."""
    out: Dict[int, dict] = {}
    for e in events:
        r = e.get("replica")
        if r is None or e.get("lighthouse"):
            continue
        row = out.setdefault(r, {"replica": r, "state": "recovering", "gen": 0, "kills": 0, "cuts": 0, "hangs": 0,
                                 "recoveries": 0, "last_step": None, "speed": 1.0, "since": e.get("t"),
                                 "_spawn_t": None, "_last_t": None})
        ev = e.get("event")
        if ev == "spawn":
            row.update(state="recovering", gen=e.get("gen", 0), since=e.get("t"), _spawn_t=e.get("t"))
        elif ev == "kill":
            row["kills"] += 1
            row.update(state="gone", since=e.get("t"))
        elif ev == "cut" and e.get("gen") == row["gen"]:
            row["cuts"] += 1
            row.update(state="cut off", since=e.get("t"))
        elif ev == "hang" and e.get("gen") == row["gen"]:
            row["hangs"] += 1
            row.update(state="hung", since=e.get("t"))
        elif ev == "reconnect" and e.get("gen") == row["gen"] and row["state"] in ("cut off", "hung"):
            row.update(state="recovering", since=e.get("t"), _spawn_t=e.get("t"))
        elif ev == "exit" and e.get("gen") == row["gen"]:
            row.update(state="finished" if e.get("code") == 0 else "gone", since=e.get("t"))
        elif ev == "stop" and e.get("gen") == row["gen"]:
            row.update(state="stopped", since=e.get("t"))
    for s in steps:
        row = out.get(s.get("replica"))
        if row is None:
            continue
        if row["last_step"] is None or s.get("step", -1) > row["last_step"]:
            row["last_step"] = s.get("step")
        if row["state"] == "recovering" and row["_spawn_t"] is not None and s.get("t", 0) >= row["_spawn_t"]:
            row.update(state="training", since=s.get("t"))
        if row["_last_t"] is None or s.get("t", 0) >= row["_last_t"]:
            row.update(_last_t=s.get("t", 0), speed=float(s.get("speed", 1.0)))
    for row in out.values():
        if row["state"] == "training" and row["speed"] < 1.0:
            row["state"] = "slow"
    for rec in recoveries:
        row = out.get(rec.get("replica"))
        if row is not None:
            row["recoveries"] += 1
    return [{k: v for k, v in out[r].items() if not k.startswith("_")} for r in sorted(out)]


def quorum_sizes(steps: List[dict]) -> List[dict]:
    """Each quorum's size, in the order the quorums formed: ``quorum_id``, ``participants``, ``t`` (its first step
    line's time), ``step``."""
    seen: Dict[int, dict] = {}
    for s in steps:
        q = s.get("quorum_id")
        if q is None or s.get("participants") is None:
            continue
        if q not in seen or s.get("t", 0) < seen[q]["t"]:
            seen[q] = {"quorum_id": q, "participants": s["participants"], "t": s.get("t", 0), "step": s.get("step")}
    return [seen[q] for q in sorted(seen)]


def after_start(recoveries: List[dict], steps: List[dict]) -> List[dict]:
    """The recoveries after the run's first step (at the first step every replica but one takes the same start from
    a peer: not a fault's)."""
    t0: Optional[float] = min((s["t"] for s in steps if "t" in s), default=None)
    return [r for r in recoveries if t0 is not None and r.get("t", 0) > t0]


def describe(states: List[dict]) -> str:
    """One line: "3 replica groups: 2 training, 1 recovering (replica 2); 2 kills, 1 cut, 1 hang" (cuts and hangs
    only where there were some)."""
    if not states:
        return ""
    counts: Dict[str, List[int]] = {}
    for s in states:
        counts.setdefault(s["state"], []).append(s["replica"])
    parts = []
    for st in STATES:
        if st in counts:
            who = counts[st]
            parts.append(f"{len(who)} {st}" + ("" if st == "training" or len(states) == len(who) else
                                               f" (replica {', '.join(map(str, who))})"))
    kills = sum(s["kills"] for s in states)
    more = [f"{n} {word}{'s' if n != 1 else ''}" for word in ("cut", "hang")
            if (n := sum(s.get(word + "s", 0) for s in states))]
    tally = ", ".join([f"{kills} kill{'s' if kills != 1 else ''}", *more])
    return f"{len(states)} replica groups: {', '.join(parts)}; {tally}"


def goodput(steps: List[dict]) -> Optional[float]:
    """Committed steps per second of replica group 0 (its rank 0), from its first step line to its last: the
    rate at which the run made progress, kills and recoveries included. None with fewer than two such lines."""
    mine = [s for s in steps if s.get("rank", 0) == 0 and s.get("replica", 0) == 0 and s.get("committed", True)
            and "t" in s]
    if len(mine) < 2:
        return None
    span = mine[-1]["t"] - mine[0]["t"]
    return (len(mine) - 1) / span if span > 0 else None


def rejoins(events: List[dict], steps: List[dict]) -> List[Optional[float]]:
    """For each kill, in order: seconds from it to the killed replica's first committed step after it (None when
    it never came back)."""
    out: List[Optional[float]] = []
    for k in (e for e in events if e.get("event") == "kill"):
        back = [s["t"] for s in steps if s.get("replica") == k.get("replica") and s.get("t", 0) > k["t"]
                and s.get("committed")]
        out.append(min(back) - k["t"] if back else None)
    return out
