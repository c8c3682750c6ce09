"""User text on the pages is shown as text, and previews are shared fairly, tried as a student would try them
on an exposed lab (COMMLAB_ACCESS=token).

- Text: a run, sweep, model or owner name, an error that echoes what was typed, an uploaded file's content
  reach the pages only through commlab.lab.front.ui.text wherever Streamlit renders Markdown. A source check walks
  every page module and names any Markdown-rendering call given other text; AppTest sessions of the
  teacher open every page with a student's run named with links, images, a colour and emphasis (marked
  disturbed, so the Compare page warns about it) and find it only escaped.
- Previews (commlab.lab.base.sandbox): one place per person at a time on every path (the performance model's
  parameter count included), places handed out by who has had the least child time lately, and a budget
  of child time per person in a rolling window, refused in one line; a submit's check goes before others'
  previews. A fake slow ``_spawn`` stands in for the child.
"""
import ast
import html
import itertools
import re
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("streamlit")

import commlab  # noqa: E402
from commlab.lab.front import ui  # noqa: E402
from commlab.lab.base.kept import Kept  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "commlab" / "app").rglob("*.py"))
assert len(PAGES) > 10, PAGES  # the pages are found (a moved folder must not leave this test with nothing to read)
"""Every module that lays out a page: what the check below reads."""

# --------------------------------------------------------------------------- the helper

EVIL = "[x](/signout) ![i](/?token=abc) :red[big] **b**"
"""A student's run name: a link that signs the teacher out, an image that would sign them in with someone
else's token without a click, a colour and bold text."""


def rendered(markdown: str) -> str:
    """``markdown`` as CommonMark (with GitHub's tables and strikethrough) renders it, as HTML."""
    from markdown_it import MarkdownIt
    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).renderInline(markdown)


TYPED = [
    EVIL, "<img src=x onerror=alert(1)> &amp; &#x41; `code` ~~gone~~ ~x~ $x^2$ | a | b |", "<http://e.x>",
    "# heading\n- item\n> quote\n```\nfence", "1. first", "2) second", "+ x", "> q", "= x", "- x", "    code",
    "=== \\*already escaped\\*", "a*b*c", "*x", "x*", "a ** b", "_a_", "__init__", "a_b_c", "[a]: /u", "[^1]",
    "x\\", ":red[big]{foreground='red'} :blue-badge[b] :help[h] :small[s] x:shimmer[y]", "{a} }b{",
    "[ ] task", ":foo[bar]", "a [b] c](u)", "z [a][b]", "x [y]", "[x]: /signout",
    "".join(chr(c) for c in range(33, 127) if not chr(c).isalnum())]
"""What a student could type: every CommonMark construct, GitHub's, and Streamlit's directives."""


@pytest.mark.parametrize("typed", TYPED)
def test_text_shows_every_character_as_typed(typed):
    """What ui.text gives renders as the characters typed (on one line, leading spaces left out), with no tag
    of its own: on its own,
    after a list's marker (the Results page's verdict lines), and after a bold label."""
    want = html.escape(" ".join(typed.split("\n")).lstrip(), quote=False).replace('"', "&quot;")
    assert rendered(ui.text(typed)).replace(ui.WORD_JOINER, "") == want
    from markdown_it import MarkdownIt
    block = MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(f"- {ui.text(typed)} — done")
    assert block.replace(ui.WORD_JOINER, "") == f"<ul>\n<li>{want} — done</li>\n</ul>\n"
    bold = rendered(f"**Disturbed:** {ui.text(typed)}").replace(ui.WORD_JOINER, "")
    assert bold == f"<strong>Disturbed:</strong> {want}"
    assert not re.search(r"(?<!\\):(red|blue-badge|help|small|shimmer)\b", ui.text(typed))  # Streamlit's directives


def test_plain_prose_passes_unchanged():
    """A message with nothing Markdown in it reads the same in the page's source: a colon before a word, an
    underscore inside one, a lone star, a comparison, a path."""
    for prose in ("preview: took more than 8 s", "quota batch_size: at most 256 examples per batch per rank",
                  "model.name: 'mabc:build' names code (an import path); only the teacher may run code",
                  "model.options: not valid YAML: aliases (*name) are not accepted here (line 2, column 10)",
                  "forward_s must be a number of seconds (>= 0)", "profile: 2,001 parameter tensors; at most 2,000",
                  "params must be [name, bytes] pairs with bytes a positive integer", "must be in (0, 10], got 0.0",
                  "run 20261129-023103-x-1dbf: no timed steps after the first 3 in its timeline"):
        assert ui.text(prose) == prose


def test_text_breaks_what_streamlit_finds_after_parsing():
    """Bare links (www., http://, a@b.c), :streamlit: and emoji shortcodes, -> and >= are found by Streamlit in
    the parsed text, where escapes are gone: each gets a word joiner, and the reader sees the same."""
    for typed in ("www.evil.example", "WWW.evil.example", "http://evil.example", "me@evil.example",
                  ":streamlit:", ":smile:", ":material/home:", "a -> b", "a >= b", "a -- b", "a <-> b", "a ~= b"):
        shown = rendered(ui.text(typed))
        assert ui.WORD_JOINER in shown and shown.replace(ui.WORD_JOINER, "") == html.escape(typed, quote=False)
    for pattern in (r"(https?://|www(?=\.))", r"[-.\w+]+@[-\w]+", r":[\w+-]+:", r"(^|\s)(->|>=|--)(\s|$)"):
        assert not re.search(pattern, rendered(ui.text("www.e.x http://e.x me@e.x :smile: a -> b >= c")), re.I)


# --------------------------------------------------------------------------- the source check

TEXT_ARGS = {
    **{f: ((0,), ("body", "label", "text")) for f in (
        "markdown", "caption", "warning", "info", "error", "success", "toast", "title", "header", "subheader",
        "write", "spinner", "expander", "popover", "status", "tabs", "button", "download_button", "link_button",
        "toggle", "checkbox", "selectbox", "multiselect", "slider", "number_input", "text_input", "text_area",
        "file_uploader", "color_picker", "date_input", "time_input", "form_submit_button", "pills",
        "segmented_control", "chat_input")},
    "metric": ((0, 1, 2), ("label", "value", "delta")),
    "progress": ((1,), ("text",)),
    "page_link": ((1,), ("label",)),
    "radio": ((0, 1), ("label", "options", "captions")),
    "select_slider": ((0, 1), ("label", "options")),
}
"""Streamlit calls whose text Streamlit 1.67 renders as Markdown (the frontend's StreamlitMarkdown): the
positions and keywords of that text. ``help=`` of any of them is Markdown too. Not here: the options of a
selectbox or a multiselect and what their format_func gives (plain text in this version), st.code, st.text,
tables and Plotly figures."""
RENDERED_FUNC = {"radio", "select_slider", "slider", "pills", "segmented_control"}
"""Calls whose ``format_func`` output is rendered as Markdown (a radio's options, a slider's tick labels)."""
NOT_STREAMLIT = {"log", "logger", "logging", "warnings"}

ALLOWED = {
    ("*", "where()"): "app/widgets.where: the runs directory, through ui.text already",
    ("commlab/app/compare_view.py", "f"): "a column name of compare_view.FILTERS, a constant of the page",
    ("commlab/app/run_form.py", "label"): "'Architecture' or 'Import path', constants of the form",
    ("commlab/app/room/access.py", "why"): "access.signed_out's reason: constants of commlab/app/room/access.py",
    ("commlab/app/widgets.py", "p.title"): "a preset's title, written in commlab/lab/analysis/presets.py",
    ("commlab/app/widgets.py", "state"): "a state badge's: one of the lab's run states (commlab.lab.rundir.store)",
    ("commlab/app/results_view.py", "items"): "the verdict's lines, each made of ui.text and _mark's constants above",
    ("commlab/app/run_form.py", "tip"): "a compressor parameter's help and allowed values, through ui.text above",
    ("commlab/app/views/advisor.py", "list(predictions.LINKS)"): "the lab's link kinds (commlab.lab.strategy.predictions.LINKS)",
}
"""(page, expression) a page shows as Markdown that are not user text, each with why ("*": any page)."""


def _numeric(spec) -> bool:
    """A format spec that only numbers take (``:.1f``, ``:,``, ``:.0%``): no user text passes through it."""
    if spec is None:
        return False
    text = "".join(v.value for v in spec.values if isinstance(v, ast.Constant))
    return bool(re.fullmatch(r"[+ ]?[,_]?\d*(\.\d+)?[dfFgGeE%xXob]|[+ ]?\d*,(\.\d+)?[dfFgGeE%]?", text))


def _is_text_call(node) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "text" and isinstance(f.value, ast.Name)
            and f.value.id == "ui") or (isinstance(f, ast.Name) and f.id == "text")


def _safe(node, page: str) -> bool:
    """Whether ``node`` (in ``page``) can only give text that is not Markdown from a user: a constant,
    ui.text(...), a number, or made of those; or an expression on the ALLOWED list."""
    def safe(n) -> bool:
        return _safe(n, page)
    if node is None or isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.JoinedStr):
        return all(isinstance(v, ast.Constant) or safe(v.value) or (v.conversion == -1 and _numeric(v.format_spec))
                   for v in node.values)
    if isinstance(node, ast.Call) and (_is_text_call(node) or
                                       (isinstance(node.func, ast.Name) and node.func.id in ("len", "int"))):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return safe(node.left) and safe(node.right)
    if isinstance(node, ast.IfExp):
        return safe(node.body) and safe(node.orelse)
    if isinstance(node, ast.BoolOp):
        return all(safe(v) for v in node.values)
    if isinstance(node, (ast.List, ast.Tuple)):
        return all(safe(e) for e in node.elts)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join" \
            and isinstance(node.func.value, ast.Constant) and len(node.args) == 1 \
            and isinstance(node.args[0], (ast.GeneratorExp, ast.ListComp, ast.Name)):
        return safe(getattr(node.args[0], "elt", node.args[0]))
    source = ast.unparse(node)
    return (page, source) in ALLOWED or ("*", source) in ALLOWED


def _wrapped(node) -> bool:
    """Whether an f-string puts a ui.text(...) part inside emphasis (``**{...}**``) or after a ``[`` it has
    not closed: ui.text leaves a lone ``*`` and a ``]`` alone, which such a page could pair with."""
    if not isinstance(node, ast.JoinedStr):
        return False
    parts = node.values
    for i, v in enumerate(parts):
        if isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Call) and _is_text_call(v.value):
            before = "".join(p.value for p in parts[:i] if isinstance(p, ast.Constant))
            after = parts[i + 1].value if i + 1 < len(parts) and isinstance(parts[i + 1], ast.Constant) else ""
            if before.endswith(("*", "_")) or after.startswith(("*", "_")) or before.count("[") > before.count("]"):
                return True
    return False


def unescaped(path: Path, root: Path = REPO) -> list:
    """``file:line: call`` for each Markdown-rendering Streamlit call in ``path`` given text that is not safe."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        receiver = node.func.value
        if name not in TEXT_ARGS and not any(k.arg == "help" for k in node.keywords):
            continue
        if isinstance(receiver, ast.Name) and receiver.id in NOT_STREAMLIT:
            continue
        positions, keywords = TEXT_ARGS.get(name, ((), ()))
        texts = [a for i, a in enumerate(node.args) if i in positions]
        texts += [k.value for k in node.keywords if k.arg in (*keywords, "help")]
        if name in RENDERED_FUNC:
            texts += [k.value for k in node.keywords if k.arg == "format_func"]
        page = str(path.relative_to(root))
        bad = [t for t in texts if not _safe(t, page) or _wrapped(t)]
        if bad:
            out.append(f"{page}:{node.lineno}: {name}({', '.join(ast.unparse(b) for b in bad)})")
    return out


def test_every_page_shows_user_text_through_ui_text(tmp_path):
    """No page gives a Markdown-rendering Streamlit call text that did not pass ui.text, other than constants,
    numbers and the ALLOWED values, and none puts ui.text's inside emphasis or brackets of its own. The check
    itself first flags user text in each form a page could pass it, and lets escaped text through."""
    probe = tmp_path / "page.py"
    probe.write_text("\n".join([
        "st.warning(f'Disturbed: {names}')", "c[0].caption(owner)", "st.error(str(e))",
        "st.selectbox('Run', ids, help=run.name)", "slots[w].error(e.msg if w else str(e))",
        "st.metric(name, 3)", "st.radio('x', names)", "st.markdown('**a** ' + x)",
        "st.warning(f'ok {ui.text(names)} {n:.1f} {len(x)}')", "st.caption(ui.text(x))",
        "st.selectbox('Run', ids, format_func=labels.get)", "log.warning('%s', x)",
        "st.caption(f'Signed in as **{ui.text(name)}**')", "st.markdown(f':red[{ui.text(x)}]')",
    ]))
    assert [line.split(": ", 1)[1] for line in unescaped(probe, tmp_path)] == [
        "warning(f'Disturbed: {names}')", "caption(owner)", "error(str(e))", "selectbox(run.name)",
        "error(e.msg if w else str(e))", "metric(name)", "radio(names)", "markdown('**a** ' + x)",
        "caption(f'Signed in as **{ui.text(name)}**')", "markdown(f':red[{ui.text(x)}]')"]
    found = [line for p in PAGES for line in unescaped(p)]
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------- the pages, as the teacher sees them

from commlab.lab.analysis import results  # noqa: E402
from commlab.lab.analysis.presets import PRESETS  # noqa: E402
from commlab.room import accounts  # noqa: E402
from commlab.room import owners  # noqa: E402
from commlab.room import open_lab  # noqa: E402
from test_app import SMALL  # noqa: E402
from test_workshop import app, room  # noqa: E402,F401  (room: the fixture)

MARKDOWN_FIELDS = {"body", "label", "help", "text"}
"""The fields of the elements' messages that the browser renders as Markdown (an alert's, a caption's and a
markdown element's body, a widget's, metric's, expander's and page link's label, help texts, a progress
bar's text). A selectbox's options are not among them: plain text in this version of Streamlit."""
DISTURBED = {"disturbed": True, "other_cpu": 0.4, "other_cores": 0.8, "cpus": 2, "threshold": 0.1,
             "timed_other_cpu": 0.5, "final": True}
"""What the supervisor writes into status.json (commlab.lab.rundir.disturbance) when other processes took the CPU."""


def markdown_texts(at) -> list:
    """Every text of the page that the browser renders as Markdown (MARKDOWN_FIELDS of every element)."""
    out = []

    def fields(msg):
        for fd, value in msg.ListFields():
            repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
            values = value if repeated else [value]
            if fd.type == fd.TYPE_MESSAGE:
                for m in values:
                    fields(m)
            elif fd.name in MARKDOWN_FIELDS:
                out.extend(v for v in values if isinstance(v, str))

    def walk(node):
        if getattr(node, "proto", None) is not None:
            fields(node.proto)
        kids = getattr(node, "children", None) or {}
        for c in (kids.values() if isinstance(kids, dict) else kids):
            walk(c)
    walk(at._tree)
    return out


def assert_as_text(texts: list, where: str) -> None:
    """None of ``texts`` renders a link, an image, bold text from the name or a Streamlit directive."""
    for t in texts:
        shown = rendered(t)
        assert "<a " not in shown and "<img" not in shown and "<strong>b</strong>" not in shown, (where, t)
        assert not re.search(r"(?<!\\)(:red|\[x\])", t), (where, t)  # no directive, no link text
        if "/signout" in t.replace("\\", ""):  # the name itself (a run id holds it too, as a slug)
            assert ui.text("[x](/signout)") in t, (where, t)


@pytest.fixture
def evil(room):  # noqa: F811
    """``room`` with alice's finished run named EVIL, marked disturbed, in a preset's group, and a sweep of the
    teacher's named EVIL (its grid only)."""
    root, runs, tokens = room
    run = open_lab(root, room=True).create(commlab.spec(dict(SMALL, name=EVIL)), owner="alice")
    run.set_status("done", disturbance=DISTURBED)
    preset = PRESETS[0]
    results.save_group(root, preset.key, {label: run.id for label in preset.labels()}, created=time.time())
    return root, run, tokens


PAGES_SEEN = [(None, {}), ("live_run", {}), ("compare", {}), ("results", {}), ("sweeps", {}), ("advisor", {}),
              ("model", {}), ("new_run", {}), ("live_run", {"run": EVIL}), ("results", {"group": EVIL}),
              ("results", {"sweep": EVIL})]


def test_the_compare_page_warns_about_a_disturbed_run_by_its_name_as_text(evil):
    """The teacher's Compare page names a student's disturbed run in its warning: the characters of the name,
    no link, no image (which the browser would load at once), no colour."""
    root, run, tokens = evil
    at = app(tokens["admin"], page="compare")
    warned = [w.proto.body for w in at.warning if "Disturbed" in w.proto.body]
    assert warned and ui.text(EVIL) in warned[0], [w.proto.body for w in at.warning]
    assert_as_text(markdown_texts(at), "compare")


def test_every_page_shows_a_runs_name_as_text(evil):
    """Every page the teacher opens, and addresses that name the run's name where an id belongs, show the
    student's run name as its characters."""
    root, run, tokens = evil
    for page, params in PAGES_SEEN:
        params = {**params, **({"run": run.id} if page == "live_run" and not params else {})}
        at = app(tokens["admin"], page=page, **params)
        texts = markdown_texts(at)
        assert_as_text(texts, f"{page} {params}")
        if page is None:
            assert any(ui.text(EVIL) in t for t in texts)  # Home links to it by its name
        if "group" in params or "sweep" in params:
            assert any(ui.text(EVIL) in t for t in (e.proto.body for e in at.error)), [e.value for e in at.error]


def test_an_owners_name_is_text(room):  # noqa: F811
    """A student's name is theirs to choose within accounts.NAME, which lets a bare address through: another
    student's Live run page names the owner of a shared run with no link made from it."""
    root, runs, tokens = room
    access_ = accounts.load_access(root)
    accounts.sign_in(root, access_["class_token"], "www.evil.example")
    run = open_lab(root, room=True).create(commlab.spec(SMALL), owner="www.evil.example")
    ui.set_viewer(lambda: owners.User("www.evil.example"))
    ui.share(run.id)
    at = app(tokens["carol"], page="live_run", run=run.id)
    owned = [c.proto.body for c in at.caption if "shared with the class" in c.proto.body]
    assert owned and owned[0].startswith("www" + ui.WORD_JOINER + ".evil.example's run"), owned


# --------------------------------------------------------------------------- previews, shared fairly

from collections import deque  # noqa: E402

from commlab.engine import codepath  # noqa: E402
from commlab.engine.spec import SpecError  # noqa: E402
from commlab.lab.base import sandbox  # noqa: E402
from commlab.room import places, previews  # noqa: E402
from commlab.lab.strategy.perfmodel import calibrate as cal  # noqa: E402

CHILD_S = 0.3
"""How long a fake child takes."""


class Children:
    """A fake ``sandbox._spawn``: each child takes ``seconds`` (or waits for ``hold`` when its thread's name says
    so), answers as the task would, and is recorded under its thread's name (``<person>-<what>``): when it
    started, and how many of each person's children ran at once at most."""

    def __init__(self, seconds: float = CHILD_S, hold=None):
        self.seconds, self.hold = seconds, hold
        self.lock = threading.Lock()
        self.running = {}
        self.most = {}
        self.started = []

    def __call__(self, task, spec, limits):
        me = threading.current_thread().name
        who = me.split("-")[0]
        with self.lock:
            self.started.append((me, time.monotonic()))
            self.running[who] = self.running.get(who, 0) + 1
            self.most[who] = max(self.most.get(who, 0), self.running[who])
        try:
            if self.hold is not None and me in self.hold:
                self.hold[me].wait(10)
            else:
                time.sleep(self.seconds)
        finally:
            with self.lock:
                self.running[who] -= 1
        if task == "parameters":
            return [["w", 4]]
        return {"params": 1, "grad_bytes": 4, "tensors": 1, "tied": []}


def sized(k: int):
    """A spec whose model is another one for each ``k`` (its preview is not kept from an earlier one)."""
    return commlab.spec({"model": "mlp", "dataset": {"name": "synthetic", "classes": 2 + k}})


def started(name: str, target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    t.start()
    return t


@pytest.fixture
def fake(monkeypatch):
    """Fake children, no kept previews, and a viewer named by the asking thread (``alice-form`` is alice)."""
    kids = Children()
    monkeypatch.setattr(sandbox, "_spawn", kids)
    monkeypatch.setattr(previews, "_previews", Kept(previews.PREVIEWS))
    cal._parameters.cache_clear()
    ui.set_viewer(lambda: owners.User(threading.current_thread().name.split("-")[0]))
    yield kids
    ui.set_viewer(None)
    cal._parameters.cache_clear()


def test_a_student_sending_previews_back_to_back_holds_one_place(fake):
    """Alice changes her model's options as fast as the answers come, in two tabs of the New run form and on the
    Performance model page (whose parameter count names nobody): never two children of hers at once, and bob's
    one preview gets a place within one child's time."""
    until = time.monotonic() + 8 * CHILD_S
    counter = itertools.count(1)
    errors = []

    def form():
        while time.monotonic() < until:
            try:
                previews.model_size(sized(next(counter)), ui.viewer())
            except SpecError as e:
                errors.append(str(e))

    def model_page():
        with codepath.no_imports():  # as in the server: the parameter count is a child's
            while time.monotonic() < until:
                cal.param_list({"model": {"name": "mlp"},
                                "dataset": {"name": "synthetic", "classes": 1000 + next(counter)}})

    alice = [started("alice-tab1", form), started("alice-tab2", form), started("alice-model", model_page)]
    time.sleep(2 * CHILD_S)
    asked = time.monotonic()
    bob = started("bob-form", lambda: previews.model_size(sized(9_000), ui.viewer()))
    for t in [*alice, bob]:
        t.join(30)
    assert not errors, errors
    assert fake.most["alice"] == 1, fake.most
    (got,) = [t for name, t in fake.started if name == "bob-form"]
    assert got - asked < CHILD_S, got - asked
    assert sum(1 for name, _ in fake.started if name == "alice-model") >= 2  # her page was served too


def test_a_free_place_goes_to_who_had_least_child_time(fake, monkeypatch):
    """One place, held by carol's child. Alice, who had a child a moment ago, asks first, then bob, who had
    none, then dave's submit needs its check: when carol's child ends, dave's check goes first, then bob, then
    alice."""
    monkeypatch.setattr(sandbox, "MAX_CHILDREN", 1)
    monkeypatch.setattr(sandbox, "SERVER", threading.BoundedSemaphore(1))
    release = threading.Event()
    fake.hold = {"carol-form": release}
    spec = sized(1).to_dict()
    ask = lambda task, who: sandbox.run(task, spec, sandbox.PREVIEW, who=who)  # noqa: E731
    started("alice-before", ask, "describe", "alice").join(5)
    carol = started("carol-form", ask, "describe", "carol")
    while not any(n == "carol-form" for n, _ in fake.started):
        time.sleep(0.01)
    waiting = []
    for name, task, who in (("alice-form", "describe", "alice"), ("bob-form", "describe", "bob"),
                            ("dave-submit", "check", "dave")):
        waiting.append(started(name, ask, task, who))
        time.sleep(0.3)  # each waits before the next asks
    release.set()
    for t in [carol, *waiting]:
        t.join(10)
    assert [n for n, _ in fake.started] == ["alice-before", "carol-form", "dave-submit", "bob-form", "alice-form"]


def test_a_persons_budget_refuses_their_previews_in_one_line(fake, monkeypatch):
    """Past BUDGET_S of child time in the window, alice's next preview is refused with one line saying when to
    try again; bob's previews, the teacher's and alice's own check before a submit still get children."""
    monkeypatch.setattr(places, "BUDGET_S", 3 * CHILD_S)
    for k in range(3):
        previews.model_size(sized(k), owners.User("alice"))
    with pytest.raises(SpecError) as refused:
        previews.model_size(sized(3), owners.User("alice"))
    said = str(refused.value)
    assert re.fullmatch(r"preview: your previews took 0\.9 s of the server's time in the last 5 minutes, the most "
                        r"one person may; try again in (\d+) s", said), said
    assert 290 <= int(said.rsplit(" ", 2)[1]) <= 300
    n = len(fake.started)
    previews.model_size(sized(4), owners.User("bob"))
    previews.model_size(sized(5), owners.User(owners.TEACHER, admin=True))
    sandbox.run("check", sized(6).to_dict(), sandbox.CHECK, who="alice")
    assert len(fake.started) == n + 3
    assert previews.model_size(sized(0), "alice")["params"] == 1  # a kept answer costs nothing: still shown
    with pytest.raises(SpecError, match="^preview: your previews took"):  # a new model is refused again
        previews.model_size(sized(7), "alice")
    assert len(fake.started) == n + 3


def test_the_new_run_form_says_when_to_try_again(room, monkeypatch):  # noqa: F811
    """A student past their budget sees the refusal under the form in one line, and can still not queue."""
    root, runs, tokens = room
    monkeypatch.setattr(sandbox, "_spawn", Children())
    monkeypatch.setattr(previews, "_previews", Kept(previews.PREVIEWS))
    monkeypatch.setattr(places, "BUDGET_S", CHILD_S)
    places._places._spent["alice"] = deque([(time.monotonic(), CHILD_S, "describe")])  # a preview of hers just now
    at = app(tokens["alice"], page="new_run")
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and re.fullmatch(
        r"preview: your previews took 0\.3 s of the server's time in the last 5 minutes, the most one person may; "
        r"try again in \d+ s", errors[0]), errors
    assert at.button(key="nr.submit").disabled


def test_no_child_is_started_for_nobody(fake, monkeypatch):
    """The performance model's parameter count names nobody: its child is the viewer's (their place, their
    budget); with nobody signed in, no child is started at all."""
    held = []

    def spawn(task, spec, limits):
        held.append(dict(places._places.held))
        return fake(task, spec, limits)
    monkeypatch.setattr(sandbox, "_spawn", spawn)
    ui.set_viewer(lambda: owners.User("alice"))
    with codepath.no_imports():  # as in the server
        cal.param_list({"model": {"name": "mlp"}, "dataset": {"name": "digits"}})
    assert held == [{"alice": 1}]
    ui.set_viewer(lambda: None)  # signed out, or a server thread serving no one
    with codepath.no_imports(), pytest.raises(cal.CalibrationError, match="^preview: nobody is signed in$"):
        cal.param_list({"model": {"name": "mlp"}, "dataset": {"name": "synthetic"}})
    with pytest.raises(sandbox.SandboxError, match="nobody is signed in"):
        sandbox.run("describe", sized(1).to_dict())
    assert len(held) == 1


def test_a_persons_checks_have_a_budget_of_their_own(fake, monkeypatch):
    """A check before a submit goes before every waiting preview, and one that fails queues no run: past
    CHECK_BUDGET_S of check time in the window, alice's next check is refused with one line, so she cannot keep
    a place ahead of everyone by sending the same failing spec again; bob's check and the teacher's still run,
    and a submit owned by the teacher is never budgeted."""
    monkeypatch.setattr(places, "CHECK_BUDGET_S", 2 * CHILD_S)
    spec = sized(1).to_dict()
    for _ in range(2):
        sandbox.run("check", spec, sandbox.CHECK, who="alice")
    with pytest.raises(places.OverBudget) as refused:
        sandbox.run("check", spec, sandbox.CHECK, who="alice")
    assert re.fullmatch(r"check: your checks before a submit took 0\.6 s of the server's time in the last 5 "
                        r"minutes, the most one person may; try again in \d+ s", str(refused.value)), refused.value
    n = len(fake.started)
    sandbox.run("check", spec, sandbox.CHECK, who="bob")
    for _ in range(3):
        sandbox.run("check", spec, sandbox.CHECK, who=owners.User(owners.TEACHER, admin=True))
    assert len(fake.started) == n + 4


def test_a_persons_predictions_have_a_budget_of_their_own(fake, monkeypatch):
    """The Performance model's children (a prediction from a student's profile, the cost curves and payloads it
    measures) may take up to 150 s each, and each new value of the page's number inputs asks for one: past
    MODEL_BUDGET_S of their time in the window, alice's next one is refused with one line; her previews, bob's
    predictions and the teacher's still get children."""
    monkeypatch.setattr(places, "MODEL_BUDGET_S", 2 * CHILD_S)
    for task in ("predict", "curves"):
        sandbox.run(task, {}, cal.PREDICT, who="alice")
    for task, label in (("predict", "prediction"), ("curves", "cost curve"), ("rounds", "payload")):
        with pytest.raises(places.OverBudget) as refused:
            sandbox.run(task, {}, cal.PREDICT, who="alice")
        assert re.fullmatch(rf"{label}: your predictions took 0\.6 s of the server's time in the last 5 minutes, "
                            r"the most one person may; try again in \d+ s", str(refused.value)), refused.value
    n = len(fake.started)
    previews.model_size(sized(1), owners.User("alice"))
    sandbox.run("predict", {}, cal.PREDICT, who="bob")
    for who in [owners.TEACHER, owners.local_user().name] * 2:  # by name, as the pages name the viewer
        sandbox.run("predict", {}, cal.PREDICT, who=who)
    assert len(fake.started) == n + 6
