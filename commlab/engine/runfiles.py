"""The run directory's protocol: every file of ``runs/<id>/``, what it holds, who writes it and when, and the one
reader its consumers use; the states and fields of ``status.json``; and the reader of the trials a run's ranks
train (``read_trials``).

The ranks and the lab both write and read these files, and the engine may not import the lab, so the protocol
lives here, at the bottom. Each file is defined once, by ``_file``, which returns its name (a plain string:
``runfiles.SPEC`` is ``"spec.json"``) and records its ``RunFile`` in ``FILES``. A name that holds a rank (or
another number) is a ``str.format`` pattern (``TIMELINE.format(rank=0)``); its ``RunFile.glob`` matches all of
them, and the ``...S`` constant beside it (``TIMELINES``) is that glob.

Writers and readers are named as modules and functions of this package, and tests/test_runfiles.py checks that
each one exists. docs/reference/run-directory.md's tables of files and of status fields are generated from
``FILES``, ``STATES`` and ``STATUS_FIELDS`` (scripts/mkdocs_hooks.py), so the page cannot drift from here.

How the files are written: JSON files whole or not at all (``commlab.engine.runlog.write_json_atomic``), JSON
lines one ``write`` per line and never rewritten (``commlab.engine.runlog.JsonlWriter``), so a killed run keeps
what it logged and a reader meets at most a torn last line, which ``commlab.engine.runlog.JsonlTail`` holds
back until it is whole. A file that cannot be parsed is kept aside (``commlab.engine.runlog.set_aside``), never
deleted. The lab's own names in the runs root (``lab.json``, the index, sweeps, profiles...) are in
``commlab/lab/base/paths.py``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

FORMATS = ("json", "jsonl", "text", "marker", "lock", "folder")


@dataclass(frozen=True)
class RunFile:
    """One file (or folder) of a run directory."""
    name: str
    """Its name in the run directory; a ``str.format`` pattern (``{rank}``) for one per rank."""
    format: str
    """json (one object, written whole), jsonl (one object per line, appended), text, marker (its presence
    says something), lock (an ``flock`` target), folder."""
    holds: str
    """What is in it (its fields)."""
    writer: str
    """Who writes it: a rank, rank 0, the run's supervisor (the process that follows the run: ``commlab run``,
    a detached ``commlab.lab.service.supervise``), another lab command; with the function that writes it."""
    when: str
    """When in the run's life it is written."""
    readers: Tuple[str, ...]
    """The function (or class) every consumer reads it through, as ``module.name``; none for a log only people
    read."""
    where: str = "run"
    """``run``: in the run directory; ``root``: beside the run directories, in the runs root."""

    @property
    def glob(self) -> str:
        """A glob for every file of this pattern (the name itself when it holds no field)."""
        return re.sub(r"\{\w+\}", "*", self.name)

    @property
    def shown(self) -> str:
        """The name as the docs show it: ``timeline-rank<r>.jsonl``, ``log-node<pid>.txt``."""
        return re.sub(r"\{(\w+)\}", lambda m: "<r>" if m.group(1) == "rank" else f"<{m.group(1)}>", self.name)


FILES: Dict[str, RunFile] = {}
"""Every file of the protocol by name, in the order a run meets them."""


def _file(name: str, format: str, holds: str, writer: str, when: str, readers, where: str = "run") -> str:
    if format not in FORMATS:
        raise ValueError(f"{name}: format {format!r} not in {FORMATS}")
    if name in FILES:
        raise ValueError(f"{name}: defined twice")
    FILES[name] = RunFile(name, format, holds, writer, when, tuple([readers] if isinstance(readers, str) else readers),
                          where)
    return name


def find(filename: str) -> Optional[RunFile]:
    """The ``RunFile`` a file name of a run directory is one of (``timeline-rank3.jsonl``: the timeline), or None."""
    for f in FILES.values():
        if re.fullmatch(re.sub(r"\\\{\w+\\\}", r"\\d+", re.escape(f.name)), filename):
            return f
    return None


# --------------------------------------------------------------------------- the run, as the lab hands it over

SPEC = _file(
    "spec.json", "json",
    "the spec, validated once where the run was admitted and fully defaulted: every value the spec decides "
    "(`schedule.cap_mb` 25 or dear's `comm.tune_steps` 5 included), and the engine's switches (`engine`) as the "
    "admission resolved them from the spec, else its environment, else their defaults; the queue and the ranks read "
    "it as it is, and `commlab run runs/<id>/spec.json` runs the same job again with the same switches in any "
    "environment (an older run's `comm.cap_mb` for dear's cap loads as `schedule.cap_mb`); a trial's own in "
    "`trial-<i>/`",
    "the lab at admission (commlab.lab.rundir.store.RunStore.create); strategy auto's choice over it: the "
    "advisor in the supervisor (commlab.lab.strategy.auto.resolve_auto), or rank 0 after the trials in the run "
    "(commlab.engine.trials.run)",
    "when the run is made, before any rank starts; after strategy auto's choice",
    ("commlab.lab.rundir.store.Run.spec_dict", "commlab.engine.worker.run"))
STATUS = _file(
    "status.json", "json",
    "the run's state and what goes with it: the fields in the table below",
    "the lab's side only (the supervisor, lab commands, an own loop's rank 0: commlab.own), through the transitions "
    "of commlab.lab.rundir.store.Run (mark_queued, mark_running, mark_done, mark_failed, mark_cancelled, "
    "mark_diverged, note), each a locked read-modify-write",
    "at each change of state; figures (disturbance, strategy, shared) while the run goes on",
    "commlab.lab.rundir.store.Run.status")
STATUS_LOCK = _file(
    ".status.lock", "lock", "nothing: every status.json writer holds an flock on it for its read-modify-write",
    "commlab.lab.rundir.store.Run (made at the first status change)", "at every status change",
    "commlab.lab.rundir.store.Run.set_status")
CANCEL = _file(
    "cancel.request", "marker", "the time someone asked the run to stop",
    "commlab.lab.service.queue.Lab.cancel (`commlab cancel`, the UI)", "when the run is asked to stop",
    "commlab.lab.rundir.store.Run.cancel_requested")
SUPERVISOR_LOG = _file(
    "supervisor.log", "text", "a detached supervisor's own output (not the ranks')",
    "commlab.lab.service.queue.Lab.spawn_supervisor", "while a detached supervisor runs", ())
LOG = _file(
    "log.txt", "text", "the workers' output (torchrun's and the ranks' stdout and stderr), appended",
    "the ranks, through the launcher's file (commlab.lab.rundir.launcher.launch)", "while the ranks run",
    "commlab.lab.rundir.store.Run.log_tail")
RANK_LOG = _file(
    "log-rank{rank}.txt", "text", "a joined job's rank other than 0: its output",
    "commlab.lab.rundir.launcher.launch_rank", "while that rank runs", ())
NODE_LOG = _file(
    "log-node{pid}.txt", "text", "a multi-node run's node other than 0: its torchrun's output",
    "commlab.lab.rundir.launcher.launch (with nodes)", "while that node runs", ())

# --------------------------------------------------------------------------- what the ranks write

PID = _file(
    "pid-rank{rank}.json", "json", "`rank`, `pid` and `start` (the process's start time), so the lab can find a "
    "stray rank and make sure it is the run's", "each rank (commlab.engine.worker.record_pid)", "at the rank's start",
    "commlab.lab.rundir.store.Run.worker_pids")
PIDS = FILES[PID].glob
RESOLVED = _file(
    "resolved.json", "json", "`engine_from_env`: the engine switches (spec.json's `engine`) the admitting process "
    "took from its environment, as `{field: \"VARIABLE=value\"}`; then what the machine made of `backend: auto`, "
    "`device: auto` and `threads: 0`: `backend`, `device`, `threads` per rank, `world_size`, `local_world_size`, the "
    "`torch` version (and on a GPU `gpu_codecs`)",
    "commlab.lab.rundir.store.RunStore.create (engine_from_env); rank 0 (commlab.engine.worker.run), keeping that key",
    "when the run is admitted; once the process group is up", "commlab.lab.strategy.perfmodel.whatif.machine_info")
METRICS = _file(
    "metrics.jsonl", "jsonl", "per step and rank: `loss` (null when an own loop's `comm.step()` got none), "
    "`time_ms`, `forward_ms`, `backward_ms`, `finish_ms`, `optimizer_ms`, `bytes_sent`, `bytes_raw` (a slower worker "
    "of a `network.cluster` adds its `speed` and `slow_ms`, the wait that stretched its forward and backward); eval lines "
    "with `eval_acc`; `tune` lines from the tuners; `\"trial\": i` on strategy auto's trial steps; at the end of a "
    "run that trained to its last step, one `final` line from rank 0 with `params_sha256`, the sha256 of the model's "
    "state_dict (parameters and buffers, bit for bit; `run.metrics(\"final\")`): a rerun of the run's spec.json on "
    "the same machine and software ends with the same digest where its kernels are deterministic (on the CPU they "
    "are; tests/test_spec_engine.py reruns one)",
    "every rank (commlab.engine.stepper.Stepper.log; an own loop's commlab.own.OwnLoop)", "after every step",
    ("commlab.lab.rundir.store.Run.metric_rows", "commlab.engine.runlog.JsonlTail"))
TIMELINE = _file(
    "timeline-rank{rank}.jsonl", "jsonl", "Chrome trace events of rank r, a step's spans ending with its `step` "
    "span ([timelines](../explanation/timeline.md)); the advisor's lane, written before the ranks start",
    "each rank (commlab.engine.timeline.Timeline); strategy auto's lane: the advisor before the ranks start "
    "(commlab.lab.strategy.auto.trial_timeline), rank 0 during its profile and trials "
    "(commlab.engine.autoprofile.profile_then_wait, commlab.engine.trials.run)",
    "after every step", ("commlab.lab.rundir.store.Run.timeline_events", "commlab.engine.runlog.JsonlTail"))
TIMELINES = FILES[TIMELINE].glob
LAYOUT = _file(
    "layout.json", "json", "the buckets (the layers each holds, their bytes), each with its `codec` (the "
    "compressor it got)", "rank 0 (commlab.engine.stepper.Stepper.write_layout)",
    "when the communicator is built; again when a tuner changes the buckets",
    "commlab.lab.strategy.perfmodel.views.run_layout")
TUNING = _file(
    "tuning.json", "json", "`mergecomp`, `layerfusion` or dear's `comm.tune` (`\"schedule\": \"dear-cap\"`): the "
    "search trace or profile, the chosen partition or cap; for mergecomp `cache` (hit, miss, retune, off, or corrupt "
    "with `cache_problem` saying what was wrong); with strategy auto, `advisor`: the candidates, the trials and "
    "the decision", "rank 0's tuner (commlab.engine.tuners.driver); the advisor's record "
    "(commlab.lab.strategy.auto.write_record)", "while a tuner searches and when it decides; the advisor's "
    "record before the ranks start and after the run", ("commlab.lab.strategy.auto.read_record",
                                                         "commlab.lab.front.notebook.layerfusion_profile"))
ERROR = _file(
    "error-rank{rank}.json", "json", "`rank`, `error` (one line), `traceback`, `time`",
    "a rank that fails (commlab.engine.worker.record_error; an own loop's commlab.own.OwnLoop)",
    "as the rank fails, before it exits", "commlab.lab.rundir.store.Run.errors")
ERRORS = FILES[ERROR].glob
DIVERGED = _file(
    "diverged-rank{rank}.json", "json", "`rank`, `step`, `error`, `time` of a rank whose averaged gradient was "
    "not finite", "a rank that diverges (commlab.engine.worker.main; an own loop's commlab.own.OwnLoop)",
    "as the rank stops", "commlab.lab.rundir.store.Run.divergences")
DIVERGEDS = FILES[DIVERGED].glob

# --------------------------------------------------------------------------- fault tolerance (fault_tolerance: enabled)

FT_START = _file(
    "ft-start.jsonl", "jsonl", "one line per replica group's process as it is about to join its first quorum: "
    "`replica`, `gen` (its process's generation: 0 at the run's start), `t`",
    "each replica group's process (Replica.start_quorum in commlab/engine/ft.py)",
    "before its first quorum; the processes of generation 0 then wait (at most fault_tolerance.timeout_s) until every "
    "replica group has a line, so that the run's first quorum has them all",
    "commlab.engine.ft.Replica")
RECOVERIES = _file(
    "recoveries.jsonl", "jsonl", "one line per recovery of a replica group (`kind: recovery`): `replica` (the one "
    "that recovered), `from_replica` (its source), `src_replica_rank` and `src_url` (the source's place in the "
    "quorum and its recovery server), `step` (the committed step it took over), `seconds`, `bytes` (read from the "
    "source), `t`", "the replica that recovers, as it loads the state (Replica in commlab/engine/ft.py)",
    "at each recovery: a late or restarted replica's first quorum, and every replica but one at the first step",
    "commlab.lab.rundir.store.Run.recoveries")
FT_EVENTS = _file(
    "ft-events.jsonl", "jsonl", "what the lab did to a fault-tolerant run's processes, one line each with `event`, "
    "`t`, on several machines the `node` that did it, and, per process, `replica`, `gen` (0 first, then each "
    "restart) and `pid`: `lighthouse` (its `addr`), "
    "`spawn`, `kill` (a fault: at the replica's `step`; one asked for while it ran has `requested: true` and `by`), "
    "`cut` (a cut fault: the process stopped for `seconds`, likewise), `hang` (a hang fault: the process stopped "
    "until a kill or the end), `reconnect` (its cut over, and `why`), "
    "`refused` (a fault asked for that could not be done, and `why`), `exit` (`code`), `stop` (still running at "
    "the end, or a restart with nobody left to recover from; `why`)",
    "the run's supervisor (commlab.lab.rundir.ftrun.FtJob)", "as it starts, kills, restarts and stops them",
    "commlab.lab.rundir.store.Run.ft_events")
FAULT_REQUESTS = _file(
    "fault-requests.jsonl", "jsonl", "faults asked for while a fault-tolerant run goes on, one line each: `kind` "
    "(kill, cut or slow), `replica`, `restart_after_s` (a kill's; null: the spec's restart.delay_s), `seconds` (a "
    "cut's or a slowdown's), `speed` (a slowdown's), `by` (who asked), `t`",
    "`commlab fault` (commlab.lab.rundir.ftrun.request_fault)", "when someone asks",
    "commlab.lab.rundir.ftrun.FtJob")
SCRIPT = _file(
    "script.json", "json", "your own training script that each replica group of a fault-tolerant run runs instead "
    "of the lab's worker: `argv` (the script and its arguments, run with the lab's Python) and `cwd`",
    "`commlab run --script` (commlab.lab.front.run_cli.cmd_run)", "when the run is created, before it starts",
    "commlab.lab.rundir.ftrun.FtJob")
SLOWDOWNS = _file(
    "slowdowns.json", "json", "slow faults asked for while a fault-tolerant run goes on: per replica group (its "
    "number, as a string key) the `speed` it computes at (a share of its own) `until` a time (time.time()); the "
    "latest asked for a replica replaces the one before",
    "the run's supervisor (commlab.lab.rundir.ftrun.FtJob), whole each time", "when a slow fault is asked for",
    "commlab.engine.runfiles.read_slowdown")
PARTITION = _file(
    "partition.json", "json", "a fault-tolerant run's buckets under a tuning schedule (mergecomp, layerfusion), "
    "chosen before its replicas start: `schedule`, `order` (the parameters' names in bucket order), `cuts` "
    "(where one bucket ends and the next begins), `from` (the search run that chose it, or `cache`)",
    "the run's supervisor (commlab.lab.strategy.ftsearch.choose_partition)", "before the replicas start",
    "commlab.engine.runfiles.read_partition")
LIGHTHOUSE_LOG = _file(
    "log-lighthouse.txt", "text", "a fault-tolerant run's Lighthouse (torchft's quorum server): its output",
    "the run's supervisor (commlab.lab.rundir.ftrun.FtJob)", "while the run goes on", ())

# --------------------------------------------------------------------------- trial sessions (the advisor's --measure)

TRIALS = _file(
    "trials.json", "json", "`dirs`: the session's trial folders, in the order the ranks run them",
    "the advisor (commlab.lab.strategy.trials.prepare_session)", "before the session's ranks start",
    "commlab.engine.runfiles.read_trials")
TRIAL_DIR = _file(
    "trial-{i}", "folder", "one trial of a session: its own spec.json, metrics.jsonl, timelines and tuning.json "
    "(no status: the session run has it)", "the advisor makes it (commlab.lab.strategy.trials.prepare_session); "
    "the ranks fill it (commlab.engine.worker.run_trials)", "before the ranks start; during the trial",
    "commlab.lab.strategy.trials.session_trials")

# --------------------------------------------------------------------------- strategy: auto in the run

AUTO_PENDING = _file(
    "auto-pending.json", "json", "`profile_steps`, `timeout_s`: the lab asks the ranks to profile the model "
    "before it plans", "the supervisor's advisor (commlab.lab.strategy.auto.start_profile_in_run)",
    "before the ranks start", "commlab.engine.autoprofile.pending")
PROFILE_TIMELINE = _file(
    "profile-timeline-rank{rank}.jsonl", "jsonl", "the dry profile steps' spans, in the timeline's format",
    "each rank (commlab.engine.autoprofile.profile_then_wait)", "during the dry steps",
    "commlab.lab.strategy.auto.plan_after_profile")
PROFILE_TIMELINES = FILES[PROFILE_TIMELINE].glob
AUTO_PROFILED = _file(
    "auto-profiled.json", "json", "`steps`, `wall_s`, `barrier_s`, `ranks`, `params` (in gradient-ready order), "
    "`t`: the ranks' signal that the profile is done", "rank 0 (commlab.engine.autoprofile.profile_then_wait)",
    "after the dry steps", "commlab.lab.strategy.auto.plan_after_profile")
AUTO_TRIALS = _file(
    "auto-trials.json", "json", "the trial plan: `trials` (each `label`, `spec`, `final`, `penalty`, and "
    "`reference`, `layout`, `extra_ms`), `warmup`, `steps`, `abort_after`, `abort_ratio` and the optional "
    "`lead_in`, `runoff_within`, `runoff_steps`, `reference_within`, `hold_margin`, `stop_ratio`",
    "the supervisor's advisor (commlab.lab.strategy.auto.resolve_auto, commlab.lab.strategy.auto.plan_after_profile)",
    "before the ranks start, or while they wait after their profile", "commlab.engine.runfiles.read_trials")
AUTO_FAILED = _file(
    "auto-failed.json", "json", "`error`, `t`: the advisor failed after the profile; the ranks fail the run with it",
    "the supervisor's advisor (commlab.lab.strategy.auto.plan_after_profile)", "instead of auto-trials.json",
    "commlab.engine.autoprofile.wait_plan")
AUTO_RESULT = _file(
    "auto-result.json", "json", "the trials' measurements (`trials`), the `winner`, whether the reference `held`, "
    "`decided_step`, and what the choice cost the run (`cost_s`)", "rank 0 (commlab.engine.trials.run)",
    "when the trials are done", "commlab.lab.strategy.auto.fold_in_run")
AUTO_ADVICE = _file(
    "auto-advice.json", "json", "the advisor's record as planned after the ranks' profile, kept apart from "
    "tuning.json (an engine tuner of the first trial may write tuning.json whole before the run ends)",
    "the supervisor's advisor (commlab.lab.strategy.auto.plan_after_profile)", "with auto-trials.json",
    "commlab.lab.strategy.auto.keep_record")

# --------------------------------------------------------------------------- beside the run directories

MERGECOMP_CACHE = _file(
    "mergecomp-cache.json", "json", "MergeComp's chosen partitions by setting, for later runs (a trial session "
    "holds one of its own, seeded with the advisor's predictions)", "rank 0's MergeComp tuner "
    "(commlab.engine.tuners.mergecomp.write_cache)", "when MergeComp decides",
    "commlab.engine.tuners.mergecomp.read_cache", where="root")

# --------------------------------------------------------------------------- status.json

class State:
    """The states of status.json, as the file holds them (plain strings)."""
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DIVERGED = "diverged"
    UNKNOWN = "unknown"
    """Not a state a run is put in: what a reader gets for a run with no status.json yet, or one that cannot be
    parsed (with ``unreadable``)."""


STATES = (State.QUEUED, State.RUNNING, State.DONE, State.FAILED, State.CANCELLED, State.DIVERGED)
FINAL = (State.DONE, State.FAILED, State.CANCELLED, State.DIVERGED)
UNFINISHED = (State.QUEUED, State.RUNNING)
STATE_MEANS = {
    State.QUEUED: "made; waiting for a slot, or for strategy auto's advisor",
    State.RUNNING: "its ranks were started",
    State.DONE: "every rank finished",
    State.FAILED: "a rank failed (`rank`, `error`), the supervisor could not go on, or the supervisor died "
                  "(`stale: ...`)",
    State.CANCELLED: "stopped on request (`commlab cancel`, Ctrl-C) or by a student's wall-time quota",
    State.DIVERGED: "a rank's averaged gradient was not finite (`rank`, `step`)",
}


@dataclass(frozen=True)
class Field:
    """A field of status.json."""
    name: str
    set_by: str
    """The transition (a method of commlab.lab.rundir.store.Run) that writes it."""
    means: str


def _fields(*rows) -> Dict[str, Field]:
    return {name: Field(name, set_by, means) for name, set_by, means in rows}


STATUS_FIELDS: Dict[str, Field] = _fields(
    ("state", "every transition", "one of the states above"),
    ("created", "mark_queued", "when the run was made (seconds since the epoch, as every time here)"),
    ("started", "mark_running", "when its ranks were started"),
    ("ended", "mark_done, mark_failed, mark_cancelled, mark_diverged", "when it reached its final state"),
    ("owner", "mark_queued", "who submitted it ([workshop](../how-to/workshop.md#per-user-runs))"),
    ("sweep", "mark_queued", "the sweep it is a cell of"),
    ("wall_limit_s", "mark_queued", "a student's wall-time quota: the launcher cancels the run past it"),
    ("rank_limit_mb", "mark_queued", "MB of memory each rank may use"),
    ("rank_limit_from", "mark_queued", "where that limit comes from (`rank_mb` of runs/lab.json, a student's quota)"),
    ("disk_limit_mb", "mark_queued", "a student's disk quota: the launcher cancels the run when its directory "
                                     "passes these MB"),
    ("free_limit_mb", "mark_queued", "the MB a student's run leaves free on its disk: the launcher cancels the run "
                                     "when the free space falls under them"),
    ("supervisor", "mark_queued, mark_running", "the process that follows the run: `pid` and `start`; a run whose "
                                                "supervisor is gone is marked failed by the next lab command"),
    ("advisor_for", "mark_queued", "strategy auto's trial run: the run it advises"),
    ("tuning_for", "mark_queued", "a tuning schedule's search run before a fault-tolerant run's replicas start: "
                                  "the run whose buckets it chooses"),
    ("torchruns", "mark_running", "the processes the launcher started (the ranks on one machine, else torchruns): "
                                  "`pid` and `start` each"),
    ("torchrun", "mark_running", "the first of `torchruns` (kept for run directories written before)"),
    ("argv", "mark_running", "the first process's command line"),
    ("nodes", "mark_running", "a multi-node run's number of machines"),
    ("cluster", "mark_running", "a shaped link's emulated cluster (namespaces, interfaces, rate)"),
    ("joined", "mark_running", "a job another launcher started: its `world_size` and `master`"),
    ("fault_tolerance", "mark_running", "a fault-tolerant run: its `replica_groups`, its Lighthouse's address "
                                        "`lighthouse` and, when the replicas run your own script (`commlab run "
                                        "--script`), its `script` (`argv`, `cwd`)"),
    ("own_loop", "mark_running", "a `commlab.wrap` run: `script`, `model`, `params`, `optimizer`, `world_size`, `host`"),
    ("returncode", "mark_done, mark_failed, mark_diverged", "the job's exit code"),
    ("rank", "mark_failed, mark_diverged", "the rank that caused the failure or diverged"),
    ("step", "mark_diverged", "the step at which it diverged"),
    ("error", "mark_failed, mark_cancelled, mark_diverged", "why, in one line (the failing rank's error, the lab's "
                                                            "reason)"),
    ("cause", "mark_failed", "a rank that passed its memory limit: its own error"),
    ("disturbance", "note, and the final transition", "how much CPU other processes used while the run ran (below)"),
    ("strategy", "note", "strategy auto: `chosen`, `by` (how) and `cost_s` (what the advice cost)"),
    ("shared", "note", "a student's run shown to the whole class"),
    ("recovered", "any transition", "status.json was damaged: where it was kept aside and that the status went "
                                    "on from the last whole copy this process held"),
)
"""Every field the lab writes into status.json. A reader may also find ``unreadable`` (never written: the reason
the file could not be parsed, with state ``unknown``)."""


# --------------------------------------------------------------------------- trials: the one reader of the ranks

PLAN_KEYS = ("label", "spec", "final", "penalty")
"""What each trial of auto-trials.json must have."""


@dataclass
class Trials:
    """What a run's ranks train besides the run's own spec: a trial session's folders (``session``, from
    trials.json: the ranks run each folder's spec in turn instead of the run's) or strategy auto's plan
    (``plan``, from auto-trials.json: the run's first steps, commlab/engine/trials.py)."""
    session: List[str] = field(default_factory=list)
    plan: Optional[dict] = None


def read_trials(run_dir: Optional[str]) -> Optional[Trials]:
    """The trials of a run directory, checked; None when it has none (a plain run, or strategy auto's ranks
    before the plan is written). A file that is not what the protocol says is a ``ValueError`` naming it."""
    if not run_dir:
        return None
    session, plan = os.path.join(run_dir, TRIALS), os.path.join(run_dir, AUTO_TRIALS)
    has_session, has_plan = os.path.isfile(session), os.path.isfile(plan)
    if has_session and has_plan:
        raise ValueError(f"{run_dir}: holds both {TRIALS} and {AUTO_TRIALS}; a run is a trial session or has "
                         "trials in it, not both")
    if has_session:
        return Trials(session=_check_session(session, _load(session)))
    if has_plan:
        return Trials(plan=_check_plan(plan, _load(plan)))
    return None


def read_slowdown(run_dir: Optional[str], replica: int) -> Optional[Tuple[float, float]]:
    """(speed, until) of the slow fault asked for replica group ``replica`` of a running run (slowdowns.json), or
    None: no such file, none for this replica, or a file that is not what the protocol says (a rank goes on at its
    own speed rather than fail on it)."""
    if not run_dir:
        return None
    try:
        got = _load(os.path.join(run_dir, SLOWDOWNS)).get(str(replica))
        speed, until = float(got["speed"]), float(got["until"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return (speed, until) if 0.0 < speed <= 1.0 else None


def read_partition(run_dir: Optional[str]) -> Optional[dict]:
    """``{"order": names, "cuts": [...]}`` of partition.json (a fault-tolerant run's buckets, chosen before its
    replicas start), or None where the run has none. A file that is not what the protocol says is a ``ValueError``
    naming it."""
    path = os.path.join(run_dir, PARTITION) if run_dir else None
    if path is None or not os.path.isfile(path):
        return None
    doc = _load(path)
    order, cuts = (doc.get("order"), doc.get("cuts")) if isinstance(doc, dict) else (None, None)
    if not isinstance(order, list) or not order or not all(isinstance(n, str) for n in order):
        raise ValueError(f"{path}: order must be a non-empty list of parameter names, got {order!r}")
    if not isinstance(cuts, list) or not all(isinstance(c, int) and 0 < c < len(order) for c in cuts):
        raise ValueError(f"{path}: cuts must be a list of positions in 1..{len(order) - 1}, got {cuts!r}")
    return {"order": order, "cuts": cuts}


def _load(path: str):
    with open(path) as f:
        return json.load(f)


def _check_session(path: str, doc) -> List[str]:
    dirs = doc.get("dirs") if isinstance(doc, dict) else None
    if not dirs or not isinstance(dirs, list) or \
            not all(isinstance(d, str) and d and "/" not in d and d not in (".", "..") for d in dirs):
        raise ValueError(f"{path}: dirs must be a non-empty list of subdirectory names, got {dirs!r}")
    return dirs


def _check_plan(path: str, plan) -> dict:
    if not isinstance(plan, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(plan).__name__}")
    trials = plan.get("trials")
    if not isinstance(trials, list) or not trials:
        raise ValueError(f"{path}: trials must be a non-empty list, got {trials!r}")
    for i, t in enumerate(trials):
        missing = [k for k in PLAN_KEYS if k not in t]
        if missing:
            raise ValueError(f"{path}: trials[{i}] lacks {', '.join(missing)}")
        if not isinstance(t["penalty"], (int, float)) or t["penalty"] <= 0:
            raise ValueError(f"{path}: trials[{i}].penalty must be a positive number, got {t['penalty']!r}")
    for k, lo in (("warmup", 0), ("steps", 1), ("abort_after", 1)):
        if not isinstance(plan.get(k), int) or plan[k] < lo:
            raise ValueError(f"{path}: {k} must be an integer >= {lo}, got {plan.get(k)!r}")
    for k, lo in (("lead_in", 0), ("runoff_steps", 1)):
        if k in plan and (not isinstance(plan[k], int) or isinstance(plan[k], bool) or plan[k] < lo):
            raise ValueError(f"{path}: {k} must be an integer >= {lo}, got {plan[k]!r}")
    for key in ("runoff_within", "reference_within"):
        within = plan.get(key)
        if within is not None:
            if not isinstance(within, (int, float)) or isinstance(within, bool) or within < 1:
                raise ValueError(f"{path}: {key} must be a number >= 1, got {within!r}")
            if "runoff_steps" not in plan:
                raise ValueError(f"{path}: {key} needs runoff_steps (the timed steps of a second visit)")
    if not isinstance(plan.get("abort_ratio"), (int, float)) or plan["abort_ratio"] < 1:
        raise ValueError(f"{path}: abort_ratio must be a number >= 1, got {plan.get('abort_ratio')!r}")
    hold = plan.get("hold_margin")
    if hold is not None and (not isinstance(hold, (int, float)) or hold < 1):
        raise ValueError(f"{path}: hold_margin must be a number >= 1, got {hold!r}")
    refs = [i for i, t in enumerate(trials) if t.get("reference")]
    if len(refs) > 1:
        raise ValueError(f"{path}: at most one trial is the reference, got trials {refs}")
    stop = plan.get("stop_ratio")
    if stop is not None and (not isinstance(stop, (int, float)) or stop < plan["abort_ratio"]):
        raise ValueError(f"{path}: stop_ratio must be a number >= abort_ratio ({plan['abort_ratio']}), got {stop!r}")
    return plan
