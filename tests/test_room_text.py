"""User text on the pages is shown as text, tried as a student would try it on an exposed lab
(COMMLAB_ACCESS=token): a run, sweep, model or owner name, an error that echoes what was typed, an uploaded
file's content reach the pages only through lab.front.ui.text wherever Streamlit renders Markdown. A source
check walks every page module and names any Markdown-rendering call given other text; AppTest sessions of the
teacher open every page with a student's run named with links, images, a colour and emphasis (marked
disturbed, so the Compare page warns about it) and find it only escaped.
"""
import ast
import html
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("streamlit")

import lab  # noqa: E402
from lab.front import ui  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([*(REPO / "app").glob("*.py"), *(REPO / "app" / "views").glob("*.py")])
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
    ("app/compare_view.py", "f"): "a column name of compare_view.FILTERS, a constant of the page",
    ("app/run_form.py", "label"): "'Architecture' or 'Import path', constants of the form",
    ("app/access.py", "why"): "access.signed_out's reason: constants of app/access.py",
    ("app/widgets.py", "p.title"): "a preset's title, written in lab/analysis/presets.py",
    ("app/widgets.py", "state"): "a state badge's: one of the lab's run states (lab.rundir.store)",
    ("app/results_view.py", "items"): "the verdict's lines, each made of ui.text and _mark's constants above",
    ("app/run_form.py", "tip"): "a compressor parameter's help and allowed values, through ui.text above",
    ("app/views/advisor.py", "list(predictions.LINKS)"): "the lab's link kinds (lab.strategy.predictions.LINKS)",
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

from lab.analysis import results  # noqa: E402
from lab.analysis.presets import PRESETS  # noqa: E402
from lab.front import accounts  # noqa: E402
from lab.service import owners  # noqa: E402
from lab.service.queue import Lab  # noqa: E402
from test_app import SMALL  # noqa: E402
from test_workshop import app, room  # noqa: E402,F401  (room: the fixture)

MARKDOWN_FIELDS = {"body", "label", "help", "text"}
"""The fields of the elements' messages that the browser renders as Markdown (an alert's, a caption's and a
markdown element's body, a widget's, metric's, expander's and page link's label, help texts, a progress
bar's text). A selectbox's options are not among them: plain text in this version of Streamlit."""
DISTURBED = {"disturbed": True, "other_cpu": 0.4, "other_cores": 0.8, "cpus": 2, "threshold": 0.1,
             "timed_other_cpu": 0.5, "final": True}
"""What the supervisor writes into status.json (lab.rundir.disturbance) when other processes took the CPU."""


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
    run = Lab(root).create(lab._spec(dict(SMALL, name=EVIL)), owner="alice")
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
    run = Lab(root).create(lab._spec(SMALL), owner="www.evil.example")
    ui.set_viewer(lambda: owners.User("www.evil.example"))
    ui.share(run.id)
    at = app(tokens["carol"], page="live_run", run=run.id)
    owned = [c.proto.body for c in at.caption if "shared with the class" in c.proto.body]
    assert owned and owned[0].startswith("www" + ui.WORD_JOINER + ".evil.example's run"), owned

