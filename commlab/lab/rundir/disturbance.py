"""How much CPU *other* processes used while a run ran, and whether that disturbed it.

The process that supervises a run (the launcher's follow loop) samples, about
once a second, two counters from /proc:

- the machine's busy jiffies, from the ``cpu`` line of /proc/stat (user, nice,
  system, irq, softirq and steal; guest time is already inside user and nice),
  and its capacity (those plus idle and iowait: cores x wall time);
- the run's own CPU: the supervisor's utime+stime, the CPU of the children it
  reaped during the run (a finished torchrun), and, for every process below
  the torchruns it started (torchrun, the ranks, in network namespaces or
  not, and anything they start), utime+stime+cutime+cstime. The children's
  part makes the sum a state, not a running total: when a rank exits and is
  reaped, its CPU moves into its parent's cutime and stays counted.

Other processes' CPU is busy minus own, less the lab's own observers: the
Streamlit server of ``commlab app`` (and whatever it starts: preview children)
registers itself in ``<runs>/.observers/`` and runs niced (commlab.lab.service.spawn.APP_NICE, its
scheduling group too), so it takes only what the ranks leave idle; watching a
run was measured not to change its timing there. Its CPU is reported apart
(``observer_cpu``) and does not flag the run. A registered process that is not
niced (someone reniced it, or started the server by hand) counts as any other
process, and so does every process that is not registered. Other processes' CPU
is reported as a fraction of the machine's capacity and in cores, over the run, over its timed steps (the
steps the iteration-time median uses) and as the peak over ~1 s windows. The
run is ``disturbed`` when the run-wide or the timed-steps figure is above the
threshold (default 10% of the machine, ``{"disturbance_threshold": 0.1}`` in
``runs/lab.json``). Steal time (a hypervisor running someone else) counts as
other processes: the run did not get that CPU either.

Only the local machine is measured (node 0 of a multi-node run). In a job another launcher started
(``torchrun ... commlab run``, srun), rank 0 samples, and the launcher's whole tree on this machine (every
local rank) is the run's own (``Sampler.job_root``). Parsing takes
an injectable /proc root so it can be tested on fake files.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import CONFIG, OBSERVERS
from commlab.lab.rundir.store import lab_config
from commlab.lab.rundir.summary import warmup_steps

DEFAULT_THRESHOLD = 0.10
"""Other processes above this fraction of the machine (on average) mark a run disturbed."""
SAMPLE_S = 1.0
"""Seconds between samples."""
WRITE_S = 5.0
"""Seconds between updates of status.json while the run goes on (a killed supervisor still leaves a figure)."""
CONFIG_KEY = "disturbance_threshold"
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
"""Clock ticks per second: the unit of /proc's CPU times."""


class ProcStat(NamedTuple):
    ppid: int
    own: int        # utime + stime, in clock ticks
    children: int   # cutime + cstime: children that ended and were reaped


class Sample(NamedTuple):
    t: float        # wall clock (time.time(), like the metrics lines' "t")
    busy: int       # machine busy jiffies, all CPUs
    total: int      # machine capacity jiffies, all CPUs (busy + idle + iowait)
    own: int        # the run's own CPU, jiffies
    observer: int = 0  # the lab's niced UI server's CPU (its whole tree), jiffies: not counted as disturbing


# --------------------------------------------------------------------------- /proc parsing (pure)

def parse_cpu_line(line: str) -> Tuple[int, int]:
    """(busy, total) jiffies from the aggregate ``cpu`` line of /proc/stat."""
    parts = line.split()
    if not parts or parts[0] != "cpu":
        raise ValueError(f"/proc/stat: expected the 'cpu' line, got {line[:40]!r}")
    v = [int(x) for x in parts[1:]] + [0] * 8
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def read_machine(root: str = "/proc") -> Tuple[int, int, int]:
    """(busy, total, cpus): the machine's jiffies since boot and its number of online CPUs."""
    with open(os.path.join(root, "stat")) as f:
        lines = f.read().splitlines()
    busy, total = parse_cpu_line(lines[0])
    cpus = sum(1 for ln in lines[1:] if ln.startswith("cpu") and ln[3:4].isdigit())
    return busy, total, max(cpus, 1)


def parse_pid_stat(text: str) -> ProcStat:
    """ppid and CPU ticks from one /proc/<pid>/stat line (the command name may hold spaces and ')')."""
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14..17
    return ProcStat(int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]))


def scan(root: str = "/proc") -> Dict[int, ProcStat]:
    """Every process's ppid and CPU (one read of /proc/<pid>/stat each); vanished ones are skipped."""
    out: Dict[int, ProcStat] = {}
    for name in os.listdir(root):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(root, name, "stat"), "rb") as f:
                out[int(name)] = parse_pid_stat(f.read().decode(errors="replace"))
        except (OSError, ValueError, IndexError):
            continue
    return out


def tree_ticks(table: Dict[int, ProcStat], roots: Iterable[int]) -> int:
    """CPU of the processes ``roots`` and all their descendants, with what they reaped (own + children)."""
    kids: Dict[int, List[int]] = {}
    for pid, p in table.items():
        kids.setdefault(p.ppid, []).append(pid)
    seen, todo, total = set(), [r for r in roots if r in table], 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += table[pid].own + table[pid].children
        todo.extend(kids.get(pid, ()))
    return total


# --------------------------------------------------------------------------- arithmetic (pure)

def _window(a: Sample, b: Sample) -> Optional[float]:
    """Other processes' share of the machine between two samples (None for an empty window)."""
    cap = b.total - a.total
    if cap <= 0:
        return None
    other = (b.busy - a.busy) - (b.own - a.own) - (b.observer - a.observer)
    return min(max(other / cap, 0.0), 1.0)


def _at(samples: List[Sample], t: float) -> Sample:
    """The counters at time ``t``, interpolated linearly between the samples around it."""
    if t <= samples[0].t:
        return samples[0]
    for a, b in zip(samples, samples[1:]):
        if a.t <= t <= b.t:
            f = (t - a.t) / (b.t - a.t) if b.t > a.t else 1.0
            return Sample(t, *(x + f * (y - x) for x, y in zip(a[1:], b[1:])))
    return samples[-1]


def peak(samples: List[Sample], span_s: float = SAMPLE_S) -> Optional[float]:
    """The highest share over consecutive windows of at least ~``span_s`` seconds."""
    best, anchor = None, 0
    for i in range(1, len(samples)):
        if samples[i].t - samples[anchor].t >= 0.9 * span_s or i == len(samples) - 1:
            w = _window(samples[anchor], samples[i])
            if w is not None and samples[i].t - samples[anchor].t >= 0.5 * span_s:
                best = w if best is None else max(best, w)
            anchor = i
    return best


def figures(samples: List[Sample], cpus: int, threshold: float = DEFAULT_THRESHOLD,
            timed: Optional[Tuple[float, float]] = None) -> dict:
    """The ``disturbance`` object of status.json from a series of samples.

    ``timed`` is the (start, end) wall time of the timed steps, when known."""
    d = {"threshold": threshold, "cpus": cpus, "samples": len(samples)}
    if len(samples) < 2:
        d.update(other_cpu=None, disturbed=None)
        return d
    a, b = samples[0], samples[-1]
    secs = b.t - a.t
    share = _window(a, b)
    d.update(seconds=round(secs, 2), other_cpu=share,
             other_cores=None if share is None else share * cpus,
             own_cores=(b.own - a.own) / max(b.total - a.total, 1) * cpus, own_cpu_s=(b.own - a.own) / CLK_TCK,
             peak_other_cpu=peak(samples))
    if b.observer > a.observer:
        d["observer_cpu"] = (b.observer - a.observer) / max(b.total - a.total, 1)
    if timed and timed[1] > timed[0] and timed[0] >= a.t - SAMPLE_S:
        d["timed_other_cpu"] = _window(_at(samples, timed[0]), _at(samples, timed[1]))
    worst = [x for x in (share, d.get("timed_other_cpu")) if x is not None]
    d["disturbed"] = bool(worst) and max(worst) > threshold
    for k in ("other_cpu", "other_cores", "own_cores", "own_cpu_s", "peak_other_cpu", "timed_other_cpu",
              "observer_cpu"):
        if d.get(k) is not None:
            d[k] = round(d[k], 4)
    return d


def timed_window(metrics: List[dict]) -> Optional[Tuple[float, float]]:
    """(start, end) wall time of the steps the iteration-time median uses (commlab.lab.rundir.summary)."""
    steps: Dict[int, List[dict]] = {}
    for m in metrics:
        if m.get("kind") == "step" and "t" in m:
            steps.setdefault(m["step"], []).append(m)
    if not steps:
        return None
    order = sorted(steps)
    timed = order[warmup_steps(len(order)):] or order
    start = min(m["t"] - m.get("time_ms", 0) / 1e3 for m in steps[timed[0]])
    end = max(m["t"] for m in steps[timed[-1]])
    return start, end


# --------------------------------------------------------------------------- the lab's own observers

OBSERVER_NICE = 4
"""The nice value at or above which a registered observer is not counted (commlab.lab.service.spawn.APP_NICE, the value its
server runs at; a test checks they agree)."""


def _stat_fields(root: str, pid: int) -> Optional[List[str]]:
    """The fields of /proc/<pid>/stat after the command name (field 3 onwards); None when gone."""
    try:
        with open(os.path.join(root, str(pid), "stat"), "rb") as f:
            text = f.read().decode(errors="replace")
        return text[text.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None


def start_time(pid: int, root: str = "/proc") -> Optional[int]:
    """When ``pid`` started, in clock ticks since boot (field 22): with the pid, it names one process even
    after the pid is reused."""
    f = _stat_fields(root, pid)
    return int(f[19]) if f and len(f) > 19 else None


def register_observer(runs_root, pid: int) -> Path:
    """Record ``pid`` (the app's niced Streamlit server) as one of the lab's observers of ``runs_root``."""
    d = Path(runs_root) / OBSERVERS
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{int(pid)}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"pid": int(pid), "start": start_time(pid)}))
    os.replace(tmp, path)
    return path


def unregister_observer(runs_root, pid: int) -> None:
    try:
        (Path(runs_root) / OBSERVERS / f"{int(pid)}.json").unlink()
    except FileNotFoundError:  # never registered, or already gone: nothing to undo
        pass


def observers(runs_root, root: str = "/proc") -> List[int]:
    """The registered observers of ``runs_root`` that still run (same pid and start time) at nice
    OBSERVER_NICE or more. A file whose process ended or whose pid was reused is ignored; an unreadable one
    too (it names no process we can check)."""
    if runs_root is None:
        return []
    out = []
    try:
        files = list((Path(runs_root) / OBSERVERS).glob("*.json"))
    except OSError:
        return []
    for p in files:
        try:
            rec = json.loads(p.read_text())
            pid, start = int(rec["pid"]), rec.get("start")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        f = _stat_fields(root, pid)
        if not f or len(f) <= 19 or (start is not None and int(f[19]) != start):
            continue
        if int(f[16]) >= OBSERVER_NICE:  # field 19: nice
            out.append(pid)
    return out


# --------------------------------------------------------------------------- configuration

def threshold(runs_root) -> float:
    """The runs directory's threshold (``disturbance_threshold`` in lab.json), else the default."""
    v = lab_config(runs_root).get(CONFIG_KEY, DEFAULT_THRESHOLD)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise LabError(f"{Path(runs_root) / CONFIG}: {CONFIG_KEY} must be a fraction of the machine in "
                       f"(0, 1], e.g. 0.1, got {v!r}")
    return float(v)


# --------------------------------------------------------------------------- the sampler

class Sampler:
    """Samples the machine and the run's processes from the supervisor's follow loop.

    ``start()`` before the job starts, ``roots`` set to the torchruns' pids once
    they do, ``tick()`` on every poll (it samples once per ``SAMPLE_S``), and
    ``finish()`` after the job's processes have been reaped.
    """

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, root: str = "/proc",
                 me: Optional[int] = None, clock: Callable[[], float] = time.time,
                 on_update: Optional[Callable[[dict], None]] = None, runs_root=None):
        self.threshold, self.root, self.clock, self.on_update = threshold, root, clock, on_update
        self.runs_root = runs_root
        """Where the lab's observers register (``observers``); None: every other process counts."""
        self.me = me or os.getpid()
        self.job_root: Optional[int] = None
        """The process of a job started by another launcher (the torchrun agent, srun's step) whose tree holds every
        rank on this machine: all of it is the run's own. None: this process, its reaped children and ``roots``."""
        self.roots: Callable[[], List[int]] = lambda: []
        self.reaped: Callable[[], int] = lambda: 0
        """CPU (ticks) of the run's processes that another process reaped (warm ranks: commlab.lab.base.warm)"""
        self.samples: List[Sample] = []
        self.cpus = 1
        self.children0: Optional[int] = None
        self.cost_s = 0.0
        self.last_write = 0.0
        self.broken = False

    def sample(self) -> Optional[Sample]:
        if self.broken:
            return None
        t0 = time.thread_time()
        try:
            busy, total, self.cpus = read_machine(self.root)
            table = scan(self.root)
        except (OSError, ValueError, IndexError):
            self.broken = True  # no /proc (not Linux): the run simply has no figure
            return None
        me = table.get(self.me, ProcStat(0, 0, 0))
        if self.children0 is None:
            self.children0 = me.children
        if self.job_root in table:  # the launcher's whole tree (this process in it); what it reaped stays in
            own = tree_ticks(table, [self.job_root]) + self.reaped()
        else:
            own = me.own + (me.children - self.children0) \
                + tree_ticks(table, [r for r in self.roots() if r != self.me]) + self.reaped()
        s = Sample(self.clock(), busy, total, own, tree_ticks(table, observers(self.runs_root, self.root)))
        self.samples.append(s)
        self.cost_s += time.thread_time() - t0
        return s

    def start(self) -> None:
        self.sample()
        self.last_write = self.clock()

    def tick(self) -> None:
        now = self.clock()
        if self.samples and now - self.samples[-1].t < SAMPLE_S:
            return
        self.sample()
        if self.on_update and now - self.last_write >= WRITE_S:
            self.last_write = now
            self.on_update(self.result(final=False))

    def result(self, final: bool, metrics: Optional[List[dict]] = None) -> dict:
        d = figures(self.samples, self.cpus, self.threshold, timed_window(metrics) if metrics else None)
        d["final"] = final
        d["sample_ms"] = round(self.cost_s / max(len(self.samples), 1) * 1e3, 3)
        return d

    def finish(self, metrics: Optional[List[dict]] = None) -> dict:
        self.sample()
        return self.result(final=True, metrics=metrics)


# --------------------------------------------------------------------------- words

def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.01 or x == 0 else "<1%"


def describe(d: Optional[dict]) -> Tuple[str, str]:
    """(label, text) for one line of ``commlab show``: ("disturbed", "yes: ...") or ("machine", "quiet: ...")."""
    if not d or d.get("other_cpu") is None:
        return "machine", "not measured (no CPU figure for this run)"
    so_far = "" if d.get("final", True) else " so far"
    text = (f"other processes used {_pct(d['other_cpu'])} of the CPU ({d['other_cores']:.2f} of "
            f"{d['cpus']} cores) during the run{so_far}")
    extra = []
    if d.get("timed_other_cpu") is not None:
        extra.append(f"{_pct(d['timed_other_cpu'])} during the timed steps")
    if d.get("peak_other_cpu") is not None:
        extra.append(f"peak {_pct(d['peak_other_cpu'])} over 1 s")
    text += (", " + ", ".join(extra) if extra else "") + f" (threshold {_pct(d['threshold'])})"
    if d.get("observer_cpu"):
        text += f"; the lab's niced UI server used {_pct(d['observer_cpu'])}, not counted"
    if d.get("disturbed"):
        return "disturbed", "yes: " + text
    return "machine", "quiet: " + text


def mark(d: Optional[dict]) -> str:
    """A short cell for tables: other processes' share over the run, "37% disturbed" or "2%"; "-" when not
    measured."""
    if not d or d.get("other_cpu") is None:
        return "-"
    return f"{_pct(d['other_cpu'])} disturbed" if d.get("disturbed") else _pct(d["other_cpu"])
