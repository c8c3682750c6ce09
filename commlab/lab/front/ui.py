"""Who the Streamlit pages act for, and the runs as that person may see them: the viewer (set by the app's
gate), what a student may queue (quotas, no code of their own), the runs they may list, open, cancel and
share, and how a run's name is shown. Nothing here imports streamlit, so it can be tested and used from a
notebook.

The pages' other helpers each have a module of their own: the New run form (commlab.lab.front.new_run), model sizes
counted in a child (commlab.room.previews), presets' groups (commlab.lab.front.groups), sweeps started from the UI
(commlab.lab.front.sweep_jobs), the Advisor page's jobs (commlab.lab.front.advice_jobs). The ``commlab app`` command that
serves the pages is commlab.lab.front.appserver.
"""
from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from commlab import api
from commlab.engine import codepath
from commlab.engine.runfiles import UNFINISHED
from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import default_root
from commlab.lab.rundir.ftrun import request_fault
from commlab.lab.rundir import store
from commlab.lab.rundir.store import Run, RunError
from commlab.room import open_lab, owners, places, previews
from commlab.room.owners import User

REFRESH_S = 2.0
"""How often a live panel re-reads a run that is not final (state, progress, medians)."""
CHARTS_REFRESH_S = 20.0
"""How often the Live run page redraws its four charts while the run is not final (its progress and medians
follow every REFRESH_S; a button redraws the charts at once). Streamlit gives a chart whose figure changed a
new element, so every redraw mounts four Plotly charts afresh: about 0.6-0.8 s of the viewer's browser CPU,
at normal priority, on the cores the ranks train on. Every 4 s, a page opened at Start took a third of a
core through a run's timed steps and slowed a 60-step dear run by 9%; a 60-100-step run now trains between
two redraws (docs/explanation/presets.md, "Watching a run")."""


def _lab(root):
    """The lab on ``root`` as a room's: the pages act for a viewer (commlab.room.open_lab)."""
    return open_lab(root, room=True)


def runs_dir() -> Path:
    """The runs directory the app works on: $COMMLAB_RUNS, else ./runs (read at each call)."""
    return default_root()


# --------------------------------------------------------------------------- who the UI acts for

_viewer_fn = None


def set_viewer(fn) -> None:
    """Install how the UI learns who is asking: a function returning the signed-in ``User`` (the app's
    gate reads it from the session), or None when nobody is signed in. Without one (notebooks,
    scripts) the UI acts for the local user, who sees everything."""
    global _viewer_fn
    _viewer_fn = fn


def viewer() -> User:
    """The user every function below acts for and filters by; PermissionError when nobody is signed in."""
    if _viewer_fn is None:
        return owners.local_user()
    u = _viewer_fn()
    if u is None:
        raise PermissionError("not signed in")
    return u


places.install(viewer)  # the room's places; a child started for nobody in particular (the performance model's) is the viewer's


def visible(run: Run, user: Optional[User] = None) -> bool:
    return owners.can_see(user or viewer(), run.status())


def serve_viewers(in_server: Callable[[], bool]) -> None:
    """Called by the app's entry file: in this process, whenever ``in_server()`` is true (a thread serving a
    viewer), nothing a spec names is imported or built (commlab.engine.codepath.forbid_imports_when): specs are
    checked for their syntax, and what needs the code runs in a child with limits (commlab.lab.base.sandbox); and
    a view reads at most commlab.lab.rundir.store.VIEW_MB of a run's timelines (``bound_reads_when``)."""
    codepath.forbid_imports_when(in_server)
    store.bound_reads_when(in_server)


def may_run_code(user: Optional[User] = None) -> bool:
    """Whether the viewer may use code of their own (import paths): the teacher and the local user."""
    return (user or viewer()).admin


START_WAIT_S = 60.0
"""How long a Start or a submit waits for a place for its model's preview (the form's own previews wait
commlab.lab.base.sandbox.WAIT_S): a click in a rush waits its turn instead of failing."""


def admit(root, specs: list) -> Tuple[User, list, Optional[float]]:
    """The viewer, their ``specs`` as they may be queued, and the wall-time limit to give the runs (None for
    the teacher): for a student, a spec that names code or passes a per-run limit (its model's size counted
    in a child first) is refused, one line naming the field or the limit."""
    user = viewer()
    if user.admin:
        return user, specs, None
    q = owners.quotas(root)
    out = []
    for s in specs:
        owners.refuse_code(s.to_dict())
        s = owners.check_run(q, s)
        if "params" in q or "tensors" in q:
            size = previews.model_size(s, user, wait_s=START_WAIT_S)
            owners.check_run(q, s, params=size["params"], tensors=size["tensors"])
        out.append(s)
    return user, out, q.get("wall_s")


def queue_runs(root, specs: list, then=None) -> List[Run]:
    """Queue ``specs`` for the viewer within their quotas (``admit``); the ``queued`` limit is checked and
    the runs are made under one lock (owners.queue_lock), so requests at the same moment cannot both pass
    it. ``then(runs)`` runs before their supervisors start (a preset records its group). Returns the runs."""
    user, specs, wall = admit(root, specs)
    q = _lab(root)
    with owners.queue_lock(root, user.name):
        if not user.admin:
            # a run of theirs whose supervisor died is no longer queued or running: it counts no more (their
            # unfinished runs are looked at, not every run's status: that is the pages' lists' job, every few s)
            mine = q.index.query(owner=user.name)
            unfinished = [r["id"] for r in mine if r["state"] in UNFINISHED]
            if unfinished:
                q.recover_stale(ids=unfinished)
                mine = q.index.query(owner=user.name)
            active = sum(1 for r in mine if r["state"] in ("queued", "running"))
            limits = owners.quotas(root)
            owners.check_queued(limits, user, active, len(specs))
            owners.check_kept(limits, user, len(mine), len(specs), shutil.disk_usage(root).free / 2**20)
        made = [q.create(s, owner=user.name, wall_limit_s=wall, look_for_stale=user.admin) for s in specs]
    if then is not None:
        then(made)
    for run in made:
        q.spawn_supervisor(run)
    return made


# --------------------------------------------------------------------------- runs: as the viewer may see them

def lab_get(run_id: str, root) -> Run:
    return api.get(run_id, runs=root)


def get_run_or_raise(run_id: str, runs=None) -> Run:
    """The run, if the viewer may see it; RunError (the same as for a missing run) otherwise."""
    root = runs or runs_dir()
    try:
        run = lab_get(run_id, root)
    except (RunError, LabError):
        if viewer().admin:
            raise
        run = None  # a student gets the same answer, without the machine's paths
    if run is None or not visible(run):
        raise RunError(f"no run {run_id!r}")
    return run


def index_rows(runs=None, **filters) -> List[dict]:
    """The index's rows (state, model, compressor, ... per run) the viewer may see, oldest first."""
    user = viewer()
    return [r for r in _lab(runs or runs_dir()).index.query(**filters) if owners.can_see(user, r)]


def visible_ids(runs=None) -> set:
    """The ids of the runs the viewer may see, from the index's owner and shared columns alone."""
    user = viewer()
    return {i for i, row in _lab(runs or runs_dir()).index.who_sees().items() if owners.can_see(user, row)}


RECOVER_EVERY_S = 5.0
"""How often the pages' lists look for runs whose supervisor died (Lab.recover_stale reads every run's status:
a second for thousands of runs), at most, per runs directory and process."""
_recovered: Dict[str, float] = {}
_recovered_lock = threading.Lock()


def list_runs(runs=None, **filters) -> List[Run]:
    """The runs the viewer may see (their own and shared ones; all for the teacher), oldest first; runs whose
    supervisor died are marked failed first (at most every RECOVER_EVERY_S)."""
    q = _lab(runs or runs_dir())
    now = time.monotonic()
    with _recovered_lock:
        due = now - _recovered.get(str(q.root), -RECOVER_EVERY_S) >= RECOVER_EVERY_S
        if due:
            _recovered[str(q.root)] = now
    if due:
        q.recover_stale()
    user = viewer()
    return [q.store.get(r["id"]) for r in q.index.query(**filters) if owners.can_see(user, r)]


def get_run(run_id: str, runs=None) -> Optional[Run]:
    """The run, or None when there is none, the id is not valid, or the viewer may not see it."""
    try:
        return get_run_or_raise(run_id, runs)
    except (RunError, LabError):
        return None


def can_control(run: Run) -> bool:
    """Whether the viewer may cancel or share ``run`` (its owner, or the teacher)."""
    return owners.can_control(viewer(), run.status())


def cancel(run_id: str, runs=None) -> str:
    """Ask a run of the viewer's (any run for the teacher) to stop; LabError for anyone else's."""
    run = get_run_or_raise(run_id, runs)
    if not can_control(run):
        raise LabError(f"cancel: run {run_id} belongs to {owners.owner_of(run.status())}; "
                       "only its owner or the teacher may cancel it")
    return api.cancel(run_id, runs=runs or runs_dir())


def may_pull_plugs(user: Optional[User] = None) -> bool:
    """Whether the viewer may kill a worker of a fault-tolerant run: the teacher and the local user (on an exposed
    lab a kill changes what a student's run computed)."""
    return (user or viewer()).admin


def pull_plug(run_id: str, replica: int, runs=None, seconds: Optional[float] = None,
              speed: Optional[float] = None) -> dict:
    """Kill ``replica`` of a running fault-tolerant run for the viewer (commlab.lab.rundir.ftrun.request_fault; the
    lab restarts it after the spec's delay), or with ``seconds`` cut it off for that many seconds, or with ``speed``
    too slow it down to that share of its speed for that long; LabError for anyone but the teacher and the local
    user, or a request the run cannot take."""
    who = viewer()
    if not may_pull_plugs(who):
        what = "kill" if seconds is None else "cut off" if speed is None else "slow down"
        raise LabError(f"fault: only the teacher may {what} a worker of a run; {who.name} may not")
    run = get_run_or_raise(run_id, runs)
    try:
        return request_fault(run, replica, None, by=who.name, seconds=seconds, speed=speed)
    except ValueError as e:
        raise LabError(f"fault: {e}") from None


def share(run_id: str, shared: bool = True, runs=None) -> bool:
    """Show a run of the viewer's to the whole class (or stop showing it); LabError for anyone else's."""
    root = runs or runs_dir()
    run = get_run_or_raise(run_id, root)
    if not can_control(run):
        raise LabError(f"share: run {run_id} belongs to {owners.owner_of(run.status())}; "
                       "only its owner or the teacher may share it")
    run.note(shared=bool(shared))
    _lab(root).index.update(run)
    return bool(shared)


def owner(run: Run) -> str:
    return owners.owner_of(run.status())


ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+@~-]+/)+")
"""The folders of an absolute path (``/srv/lab/engine/``), as a run's log and errors show them."""


def shown_text(text: str, user: Optional[User] = None) -> str:
    """A run's error line as the viewer (or ``user``) may see it: the teacher and the local user as it is; a
    student without the machine's folders (``.../models.py``: a file's name is kept, where it lives is not theirs
    to know)."""
    return text if (user or viewer()).admin else ABSOLUTE_PATH.sub(".../", text)


FRAME = re.compile(r'^\s+File "[^"]*", line \d+')
"""A traceback's frame line (``  File "/srv/lab/engine/trainer.py", line 188, in step``)."""


def shown_log(run: Run, n: int = 30) -> str:
    """The last ``n`` lines of a run's log as the viewer may see them: as they are for the teacher and the local
    user; for a student without tracebacks (each becomes one line saying so: the error itself follows it; a
    traceback whose first line is above the last ``n`` is known by its frames) and without the machine's folders."""
    text = run.log_tail(n)
    if viewer().admin:
        return text
    out, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("Traceback (most recent call last)") or (not inside and FRAME.match(line)):
            out.append("(a traceback, left out)")
            inside = True
            continue
        if inside and (not line.strip() or line.startswith((" ", "\t", "^", "~"))):
            continue  # its frames: file, line and code, indented
        inside = False
        out.append(shown_text(line))
    return "\n".join(out)


BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")
"""Line and paragraph breaks, tabs and other control characters: a new line could start a heading, a list, a
quote, a table row or a code fence, so user text is kept on one line (each run of them becomes a space)."""
ALWAYS = frozenset("\\`<$~|{")
"""Characters escaped wherever they are: a backslash (which would escape what follows), code, HTML and
autolinks, LaTeX, strikethrough, table cells, a Streamlit directive's attributes."""
LINK_END = re.compile(r"\](?:[(\[{]|$)")
"""A ``]`` that could end a link or an image (``](``), a reference (``][``), a directive's label (``]{``), or
meet a page's own text: a ``[`` before one is escaped. Other brackets (``must be [name, bytes] pairs``) stay;
a ``]`` closes nothing without its ``[``, and pages put no ``[`` of their own before user text."""

DIRECTIVES = re.compile(r"(?:red|orange|yellow|green|blue|violet|gray|grey|rainbow|primary)(?:-background|-badge)?"
                        r"(?![\w-])|(?:color|shimmer|small|help)(?![\w-])", re.I)
"""The names Streamlit (1.67) gives a meaning to after a colon (``:red``, ``:blue-badge``, ``:help``...): its
text directives. Their content and attributes need ``[`` or ``{``, which are always escaped; the colon before
one of these names is escaped too, so not even the word turns into a colour or an icon. A colon before any
other name is left alone: Streamlit shows an unknown directive as its ``:name``."""
BLOCK_START = re.compile(r"[#>+=-]|\d{1,9}[.)]")
"""What makes a heading, a quote, a list item or a rule when it begins a block: escaped at the start of the
text (a page may put it there, or after a list's ``- ``)."""
WORD_JOINER = "\u2060"
AFTER_PARSING = re.compile(r"(?<!\S)(?=(?:<->|->|<-|--|>=|<=|~=)(?!\S)).|www(?=\.)|:(?=//)"
                           r"|(?<=[-.\w+])@(?=[-\w])|:(?=[\w+-]+:|material/)", re.I)
"""What Streamlit's Markdown finds in the text *after* parsing, where escapes no longer count: GitHub's bare
links (``www.x``, ``http://x``, ``a@b.c``), ``:streamlit:``, ``:material/...:`` and emoji shortcodes, and the
symbols it draws for ``->``, ``<-``, ``<->``, ``--``, ``>=``, ``<=``, ``~=`` between spaces. An invisible word
joiner after the matched character breaks each of these patterns and leaves what is read the same."""


def text(value) -> str:
    """User text (a run's, a sweep's or a model's name, an owner's, an id from the address, an error that
    quotes them, an uploaded file's content) for anything Streamlit renders as Markdown: st.markdown,
    st.caption, st.warning/info/error/success, st.toast, headers, widget labels and help texts, radio options,
    progress texts, metric labels, expander labels, page links. Shown as typed, on one line (BREAKS) and
    without leading spaces (four would start a code block): a backslash goes before every character that
    could mean something where it stands (ALWAYS, a ``[`` that could open a link (LINK_END), ``*`` and ``_``
    where they could pair for emphasis, ``&`` before an entity, ``:`` before a directive's name (DIRECTIVES),
    BLOCK_START), and what Streamlit finds after parsing is broken up (AFTER_PARSING), so no link, image, tag,
    formatting, colour, icon or formula comes from it. Plain prose (``quota steps: at most 2000 steps per
    run, asked for 5000``, ``params must be [name, bytes] pairs``) passes unchanged, so messages read the same
    in the page's source.

    Not for what is not Markdown (st.code, st.text, tables, the options of a selectbox or a multiselect,
    Plotly figures: commlab.lab.analysis.plots.plain): there the backslashes would show."""
    s = AFTER_PARSING.sub(lambda m: m.group(0) + WORD_JOINER, BREAKS.sub(" ", str(value)).lstrip())
    start = BLOCK_START.match(s)
    lead = start.end() - 1 if start else -1
    stars = s.count("*")
    ends = [m.start() for m in LINK_END.finditer(s)]
    last_end = ends[-1] if ends else -1
    out = []
    for i, ch in enumerate(s):
        before, after = s[i - 1:i], s[i + 1:i + 2]
        if ch in ALWAYS or i == lead:
            out.append("\\")
        elif ch == "[" and (i < last_end or i == 0 or after == "^" or re.search(r":[A-Za-z][\w-]*$", s[:i])):
            out.append("\\")  # a link, an image, a footnote, a task box, a directive's label
        elif ch == "*" and (stars > 1 or not before.strip() or not after.strip()):
            # one star inside the text has no partner of its own ("aliases (*name)"); pages put no emphasis
            # of their own around user text that it could pair with
            out.append("\\")
        elif ch == "_" and not (before.isalnum() and after.isalnum()):
            out.append("\\")  # inside a word (batch_size) it never emphasizes
        elif ch == "&" and (after == "#" or after.isalnum()):
            out.append("\\")
        elif ch == ":" and DIRECTIVES.match(s, i + 1):
            out.append("\\")
        out.append(ch)
    return "".join(out)


def run_label(run: Run, state: bool = True) -> str:
    """"<name>  [<state>]  <id>" (the name is left out when the id already carries it), and "  · <owner>"
    when the run is someone else's."""
    try:
        name = run.spec_dict().get("name", "")
    except (OSError, ValueError):
        name = ""
    st_ = run.status()
    tag = f"  [{st_.get('state', 'unknown')}]" if state else ""
    who = owners.owner_of(st_)
    mine = "" if who == viewer().name else f"  · {who}" + (" (shared)" if st_.get("shared") else "")
    return (f"{run.id}{tag}" if not name or name in run.id else f"{name}{tag}  {run.id}") + mine
