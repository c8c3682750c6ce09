"""The sandbox's places in a room: who takes the server's next free child process
(commlab.lab.base.sandbox), and how much child time each person may take.

Each child is started for a person: the one the caller names, else the viewer this process acts for
(``identify``: commlab.lab.front.ui installs its viewer), never for nobody. One at a time per person (a
second waits for the first); a free place goes to the waiting person who has had the least child time
lately (a submit's check before any preview), not to whoever asks most often. A person's previews may take
``BUDGET_S`` seconds of child time in any ``BUDGET_WINDOW_S`` (the teacher and the local user have no
budget); past it they are refused with one line saying when to try again, and nobody else is affected. Checks
before a submit and the Performance model's children have budgets of their own (``CHECK_BUDGET_S``,
``MODEL_BUDGET_S``).

``install`` makes these rules the sandbox's gate (commlab.lab.base.sandbox.install_gate): the room's
admission (commlab.room.policy) and the UI's viewer (commlab.lab.front.ui) install it.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

from commlab.lab.base import sandbox
from commlab.lab.base.sandbox import PREVIEW, WAIT_S, Busy, Limits, SandboxError
from commlab.room import owners

BUDGET_S = 60.0
"""Seconds of child wall time one person's previews may take within BUDGET_WINDOW_S: some fifteen previews of
a Hugging Face model (3 to 4 s each here, forked warm; 10 s in a child started cold), far more than a person
changing a form's fields needs,
and a bound on how much of the server's two places one person can keep. Past it their previews are refused
(one line: when to try again); checks before a submit are not refused but count. The teacher and the local
user have no budget."""
BUDGET_WINDOW_S = 300.0
"""The rolling window of BUDGET_S: child time older than this no longer counts."""
BUDGETED = ("describe", "parameters")
"""The tasks a person's BUDGET_S refuses: previews."""
CHECK_BUDGET_S = 120.0
"""Seconds of child wall time one person's checks before a submit may take within BUDGET_WINDOW_S: two of
the longest (CHECK.wall_s). A check goes before every waiting preview, and one that fails queues no run (so
the ``queued`` quota never stops a person sending the same failing spec again): without a bound of its own,
one person could keep a place busy ahead of everyone. Past it their submits of a model that needs a check are
refused (one line: when to try again)."""
MODEL_BUDGET_S = 120.0
"""Seconds of child wall time one person's Performance model children (a prediction from their profile, and the
cost curves and payloads it measures) may take within BUDGET_WINDOW_S: about thirty predictions of a profile (4 s
each here), or three of a compressor at the bounds of its parameters (35 s). Each new value of the page's number
inputs asks for a new one; without a bound one person could keep a place busy without a break. Past it their
predictions are refused (one line: when to try again)."""
MODEL_TASKS = ("predict", "curves", "rounds")
"""The tasks MODEL_BUDGET_S counts and refuses."""


class OverBudget(Busy):
    """A person's previews used their BUDGET_S of child time within BUDGET_WINDOW_S: refused until older
    child time leaves the window (not an answer about the spec)."""


class _Turns:
    """A person's turn to start a child: reentrant, and first come first served among their own threads (a
    plain lock lets the thread that just let go take it again at once, so one tab sending previews back to
    back could keep the person's other tabs and pages waiting)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._owner: Optional[int] = None
        self._depth = 0
        self._queue: Deque[int] = deque()

    def acquire(self, timeout: float) -> bool:
        me = threading.get_ident()
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            self._queue.append(me)
            try:
                while self._owner is not None or self._queue[0] != me:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                self._owner, self._depth = me, 1
                return True
            finally:
                self._queue.remove(me)
                self._cond.notify_all()  # the next in line may be at the head now

    def release(self) -> None:
        with self._cond:
            self._depth -= 1
            if not self._depth:
                self._owner = None
                self._cond.notify_all()


_people: Dict[str, _Turns] = {}
_people_lock = threading.Lock()
_asker: Optional[Callable[[], object]] = None
NOBODY = "nobody is signed in"


def identify(fn: Optional[Callable[[], object]]) -> None:
    """Install how this process learns whom a child is for when its caller names nobody (``who=None``, as the
    performance model's parameter count does): ``fn()`` gives the person acting now (an object with ``name``
    and ``admin``, commlab.room.owners.User) or None, or raises PermissionError, when nobody is signed in, and
    then no child is started. commlab.lab.front.ui installs its viewer."""
    global _asker
    _asker = fn


def whom(who, label: str = "preview") -> Tuple[str, bool]:
    """(name, budgeted) of the person a child is for: ``who`` (a name, or a user with ``name`` and ``admin``),
    else the one ``identify`` gives; budgeted unless they are the teacher or the local user (a user's ``admin``;
    for a bare name, theirs: names no student may take). Without ``identify`` and ``who`` (a script of this
    process's own), the process's user."""
    if who is None:
        if _asker is None:
            return "", False  # nobody asks for anyone: this process's own work, one child at a time
        try:
            who = _asker()
        except PermissionError:
            who = None
        if who is None:
            raise SandboxError(label, NOBODY)
    if isinstance(who, str):
        return who, who not in (owners.TEACHER, owners.local_user().name)
    return str(who.name), not getattr(who, "admin", False)


@contextlib.contextmanager
def person(who, label: str = "preview", wait_s: float = PREVIEW.wall_s + WAIT_S):
    """Held while ``who``'s child runs (a name or a user; None: see ``whom``): their next one waits for it (up
    to ``wait_s``, then Busy; their own waiting threads take turns in the order they asked). Reentrant, so a caller can hold it around a cache lookup and the child that
    fills the cache."""
    name = who if isinstance(who, str) else whom(who, label)[0]
    with _people_lock:
        lock = _people.setdefault(name, _Turns())
    if not lock.acquire(timeout=wait_s):
        raise Busy(label, "your previous one is still running; try again in a moment")
    try:
        yield
    finally:
        lock.release()


class Places:
    """Who takes the server's next free place (commlab.lab.base.sandbox.SERVER): of the people waiting who hold none, a submit's
    check first, then the one with the least child time in the last BUDGET_WINDOW_S, then the one who got a
    place least recently, then the first to ask. So one person sending previews back to back holds at most one
    place, and anyone else waiting gets the next one that frees. Also keeps each person's child time (the
    budget)."""

    POLL_S = 0.25
    """A waiter looks again at least this often (a place freed wakes every waiter at once)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waiting: List[tuple] = []
        self.held: Dict[str, int] = {}
        """Places held, by person: never more than one each."""
        self._spent: Dict[str, Deque[Tuple[float, float]]] = {}
        self._last: Dict[str, float] = {}
        self._order = itertools.count()

    def _recent(self, name: str, now: float) -> Deque[Tuple[float, float, str]]:
        """(ended at, seconds, task) of ``name``'s children in the last BUDGET_WINDOW_S, oldest first."""
        q = self._spent.get(name, deque())
        while q and q[0][0] <= now - BUDGET_WINDOW_S:
            q.popleft()
        if not q:
            self._spent.pop(name, None)
        return q

    def refuse_past_budget(self, name: str, label: str, task: str = "describe") -> None:
        """OverBudget, saying when to try again, when ``name``'s child time in the window is BUDGET_S or more
        (a preview), their checks' time CHECK_BUDGET_S or more (a ``check``), or their Performance model
        children's MODEL_BUDGET_S or more (one of MODEL_TASKS)."""
        if task == "check":
            budget, what, counted = CHECK_BUDGET_S, "checks before a submit", ("check",)
        elif task in MODEL_TASKS:
            budget, what, counted = MODEL_BUDGET_S, "predictions", MODEL_TASKS
        else:
            budget, what, counted = BUDGET_S, "previews", None  # every child of theirs counts
        with self._cond:
            now = time.monotonic()
            q = [(ended, s) for ended, s, t in self._recent(name, now) if counted is None or t in counted]
        total = sum(s for _, s in q)
        if total < budget:
            return
        for ended, seconds in q:  # oldest first: the moment enough of it has left the window
            total -= seconds
            if total < budget:
                break
        wait = max(1, math.ceil(ended + BUDGET_WINDOW_S - now))
        raise OverBudget(label, f"your {what} took {budget:g} s of the server's time in the last "
                                f"{BUDGET_WINDOW_S / 60:g} minutes, the most one person may; try again in {wait} s")

    def _first(self, entry: tuple, now: float) -> bool:
        def key(e):
            name, task, order = e
            return (task != "check", sum(s for _, s, _ in self._recent(name, now)), self._last.get(name, 0.0), order)
        free = [e for e in self._waiting if e[0] not in self.held]
        return bool(free) and min(free, key=key) is entry

    def take(self, name: str, task: str, wait_s: float) -> bool:
        """A place for ``name``'s child, when it is their turn (within ``wait_s``); False if none came."""
        deadline = time.monotonic() + wait_s
        entry = (name, task, next(self._order))
        with self._cond:
            self._waiting.append(entry)
            try:
                while True:
                    now = time.monotonic()
                    if self._first(entry, now) and sandbox.SERVER.acquire(blocking=False):
                        self.held[name] = self.held.get(name, 0) + 1
                        self._last[name] = now
                        return True
                    if now >= deadline:
                        return False
                    self._cond.wait(min(deadline - now, self.POLL_S))
            finally:
                self._waiting.remove(entry)
                self._cond.notify_all()  # the next in line may be someone else now

    def give_back(self, name: str, seconds: float, task: str = "describe") -> None:
        """``name``'s child (of ``task``) ended after ``seconds``: its place is free, its time counted."""
        with self._cond:
            sandbox.SERVER.release()
            self.held[name] -= 1
            if not self.held[name]:
                del self.held[name]
            self._spent.setdefault(name, deque()).append((time.monotonic(), seconds, task))
            self._cond.notify_all()


_places = Places()


@contextlib.contextmanager
def gate(task: str, who, label: str, limits: Limits, wait_s: float):
    """The room's gate (commlab.lab.base.sandbox.install_gate): held while ``who``'s child (None: the viewer
    ``identify`` gives, SandboxError when nobody is signed in) runs. ``OverBudget`` for a preview past its
    person's BUDGET_S, a check past their CHECK_BUDGET_S or a Performance model child past their MODEL_BUDGET_S;
    ``Busy`` when no place came within ``wait_s``."""
    name, budgeted = whom(who, label)
    with person(name, label, limits.wall_s + wait_s):
        if budgeted and (task in BUDGETED or task == "check" or task in MODEL_TASKS):
            _places.refuse_past_budget(name, label, task)
        if not _places.take(name, task, wait_s):
            raise Busy(label, f"all {sandbox.MAX_CHILDREN} of the server's places for previews and checks are "
                              "taken; try again in a moment")
        t0 = time.monotonic()
        try:
            yield
        finally:
            _places.give_back(name, time.monotonic() - t0, task)


def install(asker: Optional[Callable[[], object]] = None) -> None:
    """Make the room's rules the sandbox's gate; with ``asker``, also how this process learns whom a child is
    for (``identify``)."""
    sandbox.install_gate(gate)
    if asker is not None:
        identify(asker)
