"""What `commlab run` shows while a run goes on, on stderr.

Two phases, each with its own clock: **starting** (from the launch to rank 0's first step line: processes,
imports, the process group, data) and **training** (steps). The rate is the timed steps' own: the median
iteration time of the recent steps (``time_ms``, the slower rank's), as the summary's figure is, so start-up
and evaluation never drag it down; the ETA is the remaining steps at the wall-clock pace since the first step
(evaluations included, since they take real time too).

On a terminal it is a rich progress display (spinner while starting; bar, steps, it/s, elapsed and ETA
while training), in colour where the terminal has it (rich follows NO_COLOR and TERM); the final line names
the state, coloured by it. Anywhere else (a pipe, a log file, CI) it prints plain lines: one when the ranks
start, one when the first step arrives, one every ``total // 10`` steps, and one at the end.

The stream is the user's to close (``commlab run ... 2>&1 | head -1``): a closed pipe only silences the
progress (``Quiet``); the run goes on to its end, as it would with no one watching.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Dict, Iterable, Optional

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

RATE_WINDOW = 20
"""Steps whose median iteration time gives the rate (recent enough to follow a change of layout)."""
WARMUP = 2
"""Leading steps left out of the rate while later ones exist (allocation and lazy initialisation)."""
STATE_STYLE = {"done": "green", "failed": "red", "diverged": "red", "cancelled": "yellow"}


class Quiet:
    """A progress stream that a reader going away (a closed pipe: BrokenPipeError, or any OSError on
    writing) silences instead of failing: the writes are dropped from then on, and the stream's file
    descriptor, unless it is stdout's, is pointed at /dev/null, so that nothing else in this process (the
    interpreter's last flush at exit included) trips over it. Left to itself rich would raise SystemExit(1)
    from its console, which the queue took for the run's launcher failing."""

    def __init__(self, stream):
        self.stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self.stream.write(text)
            except (OSError, ValueError):  # ValueError: the stream was closed in this process
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._gone()

    def _gone(self) -> None:
        self.gone = True
        try:
            fd = self.stream.fileno()
            if fd != sys.__stdout__.fileno():  # stdout's reader gone is the command's to report (exit 141)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
        except (AttributeError, OSError, ValueError):
            pass

    def isatty(self) -> bool:
        try:
            return not self.gone and self.stream.isatty()
        except (AttributeError, OSError, ValueError):
            return False

    def __getattr__(self, name):
        return getattr(self.stream, name)


def quiet(stream) -> Quiet:
    """``stream`` (default stderr) as a ``Quiet`` one; one already is returned as it is."""
    stream = stream if stream is not None else sys.stderr
    return stream if isinstance(stream, Quiet) else Quiet(stream)


def _clock(s: float) -> str:
    s = max(int(round(s)), 0)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class RunProgress:
    """Fed the run's metric lines by the launcher's follow loop; ``tick()`` on every poll; ``close(state)``."""

    def __init__(self, total: int, ranks: int, out=None, clock: Callable[[], float] = time.monotonic,
                 console: Optional[Console] = None, final_eval: bool = False):
        self.total, self.ranks, self.clock = total, ranks, clock
        self.final_eval = final_eval
        """The ranks evaluate after the last step (spec.final_eval): said when the last step is in, since it
        can take as long as many steps (a language model's held-out text)."""
        self.evaluating = False
        self.said_eval = False
        self.acc_step = -1
        self.logged = 0
        """Steps logged by any rank (the summary's ``steps_done``): the count the final line gives."""
        self.out = quiet(out)
        self.console = console or Console(file=self.out, highlight=False)
        self.tty = self.console.is_terminal
        self.t0 = clock()
        self.t_first: Optional[float] = None
        self.first_done = 0
        self.done = 0
        self.loss: Optional[float] = None
        self.acc: Optional[float] = None
        self.info = ""
        self.times: Dict[int, float] = {}
        """step -> the slower rank's time_ms so far (what the summary's median takes)."""
        self.every = max(1, total // 10)
        self.next_line = self.every
        self.printed = -1
        self.progress: Optional[Progress] = None
        if self.tty:
            self.progress = Progress(
                SpinnerColumn(finished_text=" "), TextColumn("{task.description}"), BarColumn(),
                MofNCompleteColumn(), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                console=self.console, get_time=clock, transient=False, auto_refresh=False)
            self.progress.start()
            self.start_task = self.progress.add_task(f"starting {ranks} rank(s)", total=None, rate="", info="")
            self.train_task = None
            self.progress.refresh()
        else:
            self._line(f"starting {ranks} rank(s) ...")

    # ------------------------------------------------------------------ figures

    def rate(self) -> Optional[float]:
        """Steps per second of the timed steps: 1000 / the median of the recent steps' time_ms."""
        if not self.times:
            return None
        steps = sorted(self.times)
        recent = ([k for k in steps if k >= WARMUP] or steps)[-RATE_WINDOW:]
        med = statistics.median(self.times[k] for k in recent)
        return 1e3 / med if med > 0 else None

    def eta(self) -> Optional[float]:
        if self.t_first is None or self.done <= self.first_done:
            return None
        pace = (self.clock() - self.t_first) / (self.done - self.first_done)
        return pace * max(self.total - self.done, 0)

    def _rate_text(self) -> str:
        r = self.rate()
        return "" if r is None else f"{r:.1f} it/s"

    # ------------------------------------------------------------------ feeding

    def feed(self, lines: Iterable[dict]) -> None:
        for m in lines:
            if m.get("kind") == "step" and isinstance(m.get("time_ms"), (int, float)):
                self.times[m["step"]] = max(self.times.get(m["step"], 0.0), float(m["time_ms"]))
            if m.get("kind") == "step" and isinstance(m.get("step"), int):
                self.logged = max(self.logged, m["step"] + 1)
            if m.get("kind") == "step" and m.get("rank") == 0:
                if self.t_first is None:
                    self._started(m["step"])
                self.done = m["step"] + 1
                if isinstance(m.get("loss"), (int, float)):
                    self.loss = m["loss"]
            elif m.get("kind") == "eval" and isinstance(m.get("eval_acc"), (int, float)):
                self.acc = m["eval_acc"]  # the latest held-out accuracy stays on show until the next
                self.acc_step = max(self.acc_step, int(m.get("step") or 0))
                if self.evaluating and m.get("step", 0) >= self.total:
                    self.evaluating = False
                    if self.progress is not None and self.train_task is not None:
                        self.progress.update(self.train_task, description="training")
        self.info = " ".join(([f"loss {self.loss:.4f}"] if self.loss is not None else [])
                             + ([f"acc {self.acc:.2%}"] if self.acc is not None else []))
        self.tick()
        if self.final_eval and self.done >= self.total and not self.said_eval and self.acc_step < self.total:
            self._final_eval()

    def _final_eval(self) -> None:
        """The last step is in and the ranks evaluate now: said, so the wait is not a silent one."""
        self.said_eval = self.evaluating = True
        if self.progress is not None:
            if self.train_task is not None:
                self.progress.update(self.train_task, description="final evaluation ...")
            self.progress.refresh()
        else:
            self._line("final evaluation ...")

    def _started(self, step: int) -> None:
        self.t_first = self.clock()
        self.first_done = step + 1  # steps done when the clock of the training phase starts
        took = self.t_first - self.t0
        if self.progress is not None:
            self.progress.update(self.start_task, description=f"started {self.ranks} rank(s) in {took:.1f} s",
                                 total=1, completed=1)
            self.progress.stop_task(self.start_task)
            self.train_task = self.progress.add_task("training", total=self.total, rate="", info="")
        else:
            self._line(f"ranks started in {took:.1f} s; training {self.total} steps")

    def tick(self) -> None:
        """Redraw (a terminal) or print the line that is due (elsewhere)."""
        if self.progress is not None:
            if self.train_task is not None:
                self.progress.update(self.train_task, completed=self.done, rate=self._rate_text(), info=self.info)
            self.progress.refresh()
        elif self.t_first is not None and self.done >= self.next_line:
            self._plain()
            while self.next_line <= self.done:
                self.next_line += self.every

    def _plain(self) -> None:
        self.printed = self.done
        eta = self.eta()
        parts = [f"step {self.done}/{self.total} ({self.done / max(self.total, 1):.0%})", self._rate_text(),
                 f"elapsed {_clock(self.clock() - self.t0)}", "" if eta is None else f"eta {_clock(eta)}", self.info]
        self._line("  ".join(p for p in parts if p))

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, soft_wrap=True)

    def close(self, state: Optional[str] = None) -> None:
        """Stop the display; with ``state``, one last line naming it (coloured by it on a terminal)."""
        if self.progress is not None:
            self.tick()
            self.progress.stop()
        elif self.t_first is not None and self.done != self.printed:
            self._plain()  # the last steps since the last line
        if state:
            took = _clock(self.clock() - self.t0)
            style = STATE_STYLE.get(state)
            # the steps any rank logged, as the summary counts them (after Ctrl-C one rank may be a step ahead)
            text = f"run {state} after {max(self.logged, self.done)}/{self.total} steps in {took}"
            if style and self.tty:
                self.console.print(f"[{style}]{text}[/{style}]", highlight=False)
            else:
                self._line(text)
