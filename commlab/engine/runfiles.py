"""Every file name inside a run directory (``runs/<id>/``), in one place.

The ranks and the lab both write and read these files, and the engine may not import the lab, so the names
live here, at the bottom. A name that holds a rank (or another number) is a ``str.format`` pattern; where a
reader lists such files, a glob for all of them sits beside it. The lab's own names in the runs root
(``lab.json``, the index, sweeps, profiles...) are in ``commlab/lab/base/paths.py``.
"""

# The run, as the lab hands it to the ranks and follows it.
SPEC = "spec.json"
"""The validated, fully defaulted spec (a trial's own in ``trial-<i>/``)."""
STATUS = "status.json"
"""state, times and, on failure, the rank and the error (commlab/lab/rundir/store.py writes it under STATUS_LOCK)."""
STATUS_LOCK = ".status.lock"
CANCEL = "cancel.request"
"""Present when someone asked the run to stop; the supervisor acts on it."""
SUPERVISOR_LOG = "supervisor.log"
LOG = "log.txt"
"""The workers' output, one file for the run."""
RANK_LOG = "log-rank{rank}.txt"
NODE_LOG = "log-node{pid}.txt"

# What the ranks write.
METRICS = "metrics.jsonl"
TIMELINE = "timeline-rank{rank}.jsonl"
TIMELINES = "timeline-rank*.jsonl"
LAYOUT = "layout.json"
"""The communicator's final bucket layout (which layers each bucket holds)."""
TUNING = "tuning.json"
"""What a tuner tried and chose (mergecomp, dear's buffer size, strategy auto)."""
RESOLVED = "resolved.json"
"""Written where the run is admitted: ``engine_from_env``, the engine switches (spec.json's ``engine``) its process
took from its environment, as ``{field: "VARIABLE=value"}``; then by rank 0 at start, keeping that key: the values
the spec leaves to the machine (backend and device auto, threads 0), as they were resolved there."""
PID = "pid-rank{rank}.json"
PIDS = "pid-rank*.json"
ERROR = "error-rank{rank}.json"
ERRORS = "error-rank*.json"
DIVERGED = "diverged-rank{rank}.json"
DIVERGEDS = "diverged-rank*.json"

# Trial sessions (the advisor's --measure): one run whose ranks run several trials.
TRIALS = "trials.json"
"""The session's list of trials (the advisor writes it, commlab.engine.worker runs it)."""
TRIAL_DIR = "trial-{i}"

# strategy: auto (commlab/lab/strategy/auto.py and commlab/engine/autoprofile.py, commlab/engine/trials.py).
AUTO_PENDING = "auto-pending.json"
"""The lab asks the ranks to profile the model before it plans."""
AUTO_PROFILED = "auto-profiled.json"
AUTO_FAILED = "auto-failed.json"
AUTO_TRIALS = "auto-trials.json"
"""The lab's trial plan for the run's own ranks."""
AUTO_RESULT = "auto-result.json"
AUTO_ADVICE = "auto-advice.json"
"""The advisor's record as planned after the ranks' profile steps, kept apart from tuning.json: an engine
tuner of the first trial may write tuning.json whole before the run ends (the lab puts the record back)."""
PROFILE_TIMELINE = "profile-timeline-rank{rank}.jsonl"
PROFILE_TIMELINES = "profile-timeline-rank*.jsonl"

# Beside the run directories, in the runs root, but written by the ranks.
MERGECOMP_CACHE = "mergecomp-cache.json"
"""Chosen MergeComp partitions by setting, for later runs."""
