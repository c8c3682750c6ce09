"""The documentation: the site builds strictly (a broken link, a missing page, an unknown anchor or a failing
mkdocstrings reference fails ``mkdocs build --strict``), the README stays a front page whose links all resolve,
every relative link of the docs resolves, and what the docs generate from the code is all there: every command
in the CLI reference, every job-spec field, every compressor. The package map is what the code draws now."""
import ast
import functools
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 260

pytest.importorskip("mkdocs", reason="the docs need the dev extra (./setup.sh installs it)")


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return out


def test_the_site_builds_strictly_with_every_page(site):
    for page in ("index.html", "getting-started/index.html", "reference/cli/index.html",
                 "reference/python-api/index.html", "explanation/packages/index.html",
                 "notebooks/00_tour/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    assert (site / "js" / "plotly.min.js").is_file()  # the tutorials' figures draw with it
    tour = (site / "notebooks" / "00_tour" / "index.html").read_text()
    assert "Plotly.newPlot" in tour  # the executed notebook's figures, not only its code


def test_every_notebook_is_a_page_with_its_figures(site):
    """Each notebook in notebooks/ has its executed copy in docs/notebooks/ (its figures on its page), a place in
    the navigation and a row in the tutorials' table; a new notebook that nobody rendered fails here."""
    names = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert len(names) >= 7
    nav = (ROOT / "mkdocs.yml").read_text()
    table = (DOCS / "tutorials" / "index.md").read_text()
    for name in names:
        assert (DOCS / "notebooks" / f"{name}.ipynb").is_file(), f"{name} is not rendered (render_notebooks.py --docs)"
        assert f"notebooks/{name}.ipynb" in nav, f"{name} is not in mkdocs.yml's nav"
        assert f"(../notebooks/{name}.ipynb)" in table, f"{name} has no row in docs/tutorials/index.md"
        rendered = json.loads((DOCS / "notebooks" / f"{name}.ipynb").read_text())
        code = [c for c in rendered["cells"] if c["cell_type"] == "code"]
        assert code and all(c.get("execution_count") for c in code), f"{name}'s docs copy is not executed"
        source = (ROOT / "notebooks" / f"{name}.ipynb").read_text()
        if "px." in source or "plots." in source:  # a notebook that draws shows its figures on its page
            page = (site / "notebooks" / name / "index.html").read_text()
            assert "Plotly.newPlot" in page, f"{name}'s page has no figure"


def test_every_cli_command_is_in_the_cli_reference(site):
    from commlab.lab.front.cli import build_parser
    hooks = load_script("mkdocs_hooks")
    page = (site / "reference" / "cli" / "index.html").read_text()
    names = [full for full, _, _ in hooks.commands(build_parser())]
    assert "commlab run" in names and "commlab net check" in names
    for full in names:
        assert f"usage: {full} " in page or f"usage: {full}\n" in page, f"{full} is missing from the CLI reference"


def test_every_spec_field_and_compressor_is_in_the_reference(site):
    import dataclasses
    import typing

    from commlab.engine import compressors
    from commlab.engine import spec as S
    page = (site / "reference" / "spec" / "index.html").read_text()

    def paths(cls, prefix=""):
        hints = typing.get_type_hints(cls, vars(S))
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from paths(hints[f.name], f"{prefix}{f.name}.")
            else:
                yield prefix + f.name
    fields = list(paths(S.JobSpec))
    assert "compressor.per_bucket" in fields
    for p in fields:
        assert f"<code>{p}</code>" in page, f"spec field {p} is missing from the job spec reference"
    comp = (site / "reference" / "compressors" / "index.html").read_text()
    for name in compressors.names():
        assert f"<code>{name}</code>" in comp, name


def test_every_run_file_state_and_status_field_is_on_the_run_directory_page(site):
    """The page's tables are generated from the run directory's protocol (commlab/engine/runfiles.py)."""
    from html import escape

    from commlab.engine import runfiles
    page = (site / "reference" / "run-directory" / "index.html").read_text()
    for f in runfiles.FILES.values():
        assert f"<code>{escape(f.shown, quote=False)}</code>" in page, f"{f.name} is missing from the run directory page"
    for name in [*runfiles.STATES, *runfiles.STATUS_FIELDS]:
        assert f"<code>{name}</code>" in page, name


def markdown_links(text: str):
    """Targets of [text](target) and ![alt](target), outside fenced code and inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


def broken_links(path: Path):
    """The relative link targets of a markdown file that name no file."""
    out = []
    for target in markdown_links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the same page (mkdocs checks those)
        if not (path.parent / target.split("#", 1)[0]).exists():
            out.append(target)
    return out


def test_the_readme_is_a_front_page_and_its_links_resolve():
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the docs are for the rest"
    # .ci/run and the first page of the docs rely on these two lines, as they are
    assert "./setup.sh && .venv/bin/commlab app" in lines[3]
    assert "./setup.sh && .venv/bin/python -m pytest -q" in lines[4]
    assert any(t.startswith("docs/") for t in markdown_links(readme.read_text()))
    assert broken_links(readme) == []


def test_every_relative_link_of_the_docs_resolves():
    pages = sorted(DOCS.rglob("*.md"))
    assert len(pages) > 30
    bad = [f"{p.relative_to(ROOT)}: {t}" for p in pages for t in broken_links(p)]
    assert bad == []


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a) [url](https://x.org) [same](#b) `[code](nowhere.md)`\n\n```\n[f](gone.md)\n"
                    "```\n![img](missing.png) [gone](../gone/x.md)\n")
    assert broken_links(page) == ["missing.png", "../gone/x.md"]


def test_the_package_map_is_what_the_code_draws():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "package_map.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_screenshot_script_says_what_it_does():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "screenshots.py"), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "docs/screenshots" in r.stdout


NUMBER_WORDS = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def test_the_docs_count_the_presets_from_the_code():
    """README, Getting started and the docs' front page say how many one-click experiments the UI's Home has:
    as many as commlab/lab/analysis/presets.py PRESETS holds."""
    from commlab.lab.analysis.presets import PRESETS
    word = NUMBER_WORDS[len(PRESETS)]
    for page in (ROOT / "README.md", DOCS / "getting-started.md", DOCS / "index.md"):
        said = re.findall(r"(\w+) one-click experiments", page.read_text(), re.I)
        assert said and {w.lower() for w in said} == {word}, f"{page.name}: {said}, PRESETS has {len(PRESETS)}"


def test_commands_in_the_docs_run_torchrun_from_the_venv():
    """A shell block never starts a bare ``torchrun`` (the one on PATH, if any, is not the lab's torch)."""
    bad = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", page.read_text(), re.S):
            bad += [f"{page.relative_to(ROOT)}: {ln.strip()}" for ln in block.splitlines()
                    if re.match(r"(?:[A-Z_]+=\S+ )*torchrun\b", ln.strip())]
    assert bad == []


def test_no_text_names_the_old_perfmodel_package():
    """The performance model moved to commlab/lab/strategy/perfmodel: no output string, docstring or page names the
    old path (``predict --device``'s sources and the ``commlab bench`` list did). Data recorded by old runs
    (bench/results, bench/data) keeps what it said then."""
    old = re.compile(r"\blab[./]" + "perfmodel")
    files = [p for d in ("commlab", "scripts", "tests") for p in (ROOT / d).rglob("*.py")]
    files += list((ROOT / "bench").glob("*.py")) + list(DOCS.rglob("*.md")) + [ROOT / "README.md"]
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, ln in enumerate(p.read_text().splitlines(), 1)
           if old.search(ln)]
    assert bad == []


# -- words that name the code: every module, attribute and file a docstring, comment or page names is there --

TOP_PACKAGES = ("engine", "lab", "app", "commlab")
# a dotted name ending so is a file's name (runs/<id>/lab.json, app.log), not a module
FILE_SUFFIXES = {"json", "jsonl", "yaml", "yml", "md", "py", "txt", "log", "csv", "html", "svg", "png", "lock",
                 "ipynb", "sh", "toml", "db", "sqlite", "pid", "out", "err", "tmp", "pt", "npz"}
DOTTED_NAME = re.compile(r"(?<![\w.${/\\-])((?:" + "|".join(TOP_PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)(?::(\w+))?")
# a path whose next part starts with a capital is a placeholder or a ratio (bench/NAME.py, commlab/DDP)
FILE_NAME = re.compile(r"(?<![\w./~$-])((?:engine|lab|app|commlab|scripts|bench|tests|docs|notebooks|examples)"
                       r"/(?![A-Z])[\w./-]*|test_\w+\.py)(?:::(\w+))?")
OPEN_ENDED = tuple("*<{[$")  # bench/results/*.md, tests/test_<area>.py: only the folder before it is named


@functools.lru_cache(maxsize=None)
def defined_names(path: Path) -> dict:
    """{name: None, or for a class the names of its members} of what a module file defines or imports at top
    level (inside if/try/with too), and what its ``__all__`` lists (a module ``__getattr__`` may serve those)."""
    out: dict = {}

    def members(cls):
        names = set()
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
                        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                            names.add(n.attr)
        return names

    def bind(body):
        for node in body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = members(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = None
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    out.update((n.id, None) for n in ast.walk(t) if isinstance(n, ast.Name))
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                        for t in node.targets):
                    out.update((c.value, None) for c in ast.walk(node.value) if isinstance(c, ast.Constant))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update(((a.asname or a.name).split(".")[0], None) for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    bind(getattr(node, field, []) or [])
    bind(ast.parse(path.read_text()).body)
    return out


def module_file(parts) -> Optional[Path]:
    p = ROOT.joinpath(*parts)
    for f in (p.with_name(p.name + ".py"), p / "__init__.py"):
        if f.is_file():
            return f
    return None


def names_a_module(name: str) -> bool:
    """``name`` is a module of the source tree, or a module and a name defined in it (and, for a class, one of
    its members); what follows that is not checked (a spec field, a method of what it returns)."""
    parts = name.split(".")
    k = next((k for k in range(len(parts), 0, -1) if module_file(parts[:k])), 0)
    if k == 0:
        return False
    rest = parts[k:]
    if not rest or rest[0].startswith("__") and rest[0].endswith("__"):  # every module has a __file__
        return True
    defined = defined_names(module_file(parts[:k]))
    if rest[0] not in defined:
        return False
    return len(rest) == 1 or defined[rest[0]] is None or rest[1] in defined[rest[0]]


@functools.lru_cache(maxsize=None)
def ignored_folders():
    """What the commands write into the checkout and git ignores (notebooks/html/)."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return tuple(ln.strip("/") + "/" for ln in lines if ln.endswith("/") and "/" in ln.rstrip("/"))


def names_a_file(path: str, test: Optional[str]) -> bool:
    """``path`` is a file or folder of the checkout (``tests/`` understood for a bare test file's name), an
    output stem whose files are there (``--out bench/results/cpu_buffers`` wrote cpu_buffers.md), or inside an
    ignored folder the commands write; ``test``, if any, is defined in it."""
    p = ROOT / "tests" / path if path.startswith("test_") else ROOT / path
    if (path.rstrip("/") + "/").startswith(ignored_folders()):
        return True
    if not p.exists():
        return not p.suffix and p.parent.is_dir() and any(p.parent.glob(p.name + ".*"))
    defines = re.compile(rf"^\s*(?:async\s+)?def {test}\b|^class {test}\b", re.M)
    return test is None or defines.search(p.read_text()) is not None


def stale_names(text: str):
    """(offset, name) of each module or file ``text`` names that is not in the source tree."""
    out = []
    for m in DOTTED_NAME.finditer(text):
        name = m.group(1)  # commlab.lab.front.* names commlab.lab.front
        if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
            continue
        full = name + (f":{m.group(2)}" if m.group(2) else "")
        if not names_a_module(name) or m.group(2) and not names_a_module(f"{name}.{m.group(2)}"):
            out.append((m.start(), full))
    for m in FILE_NAME.finditer(text):
        path, test = m.group(1).rstrip(".-"), m.group(2)
        if text[m.end(1):m.end(1) + 1] in OPEN_ENDED:
            path, test = path.rsplit("/", 1)[0], None
        if not names_a_file(path, test):
            out.append((m.start(), path + (f"::{test}" if test else "")))
    return out


def words_of(path: Path):
    """(line, text) of the words in a file: a Python file's comments and string literals (docstrings, messages;
    not a string that is one dotted name alone), a notebook's markdown cells, a page's whole text."""
    raw = path.read_text()
    if path.suffix == ".md":
        yield 1, raw
    elif path.suffix == ".ipynb":
        lines, at = raw.splitlines(), 0
        for cell in json.loads(raw)["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            source = cell["source"] if isinstance(cell["source"], list) else cell["source"].splitlines(True)
            for s in source:  # nbformat writes each source line on a line of its own: its line in the file
                quoted = (json.dumps(s, ensure_ascii=False), json.dumps(s))
                at = next((i for i in range(at, len(lines)) if quoted[0] in lines[i] or quoted[1] in lines[i]), at)
                yield at + 1, s
    else:
        for tok in tokenize.generate_tokens(io.StringIO(raw).readline):
            if tok.type == tokenize.STRING and re.fullmatch(r"[a-zA-Z]*(['\"])[\w.]+\1", tok.string):
                continue  # a key in code that happens to be dotted: a logger's name, a session key
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                yield tok.start[0], tok.string


def product_and_docs():
    files = [p for d in TOP_PACKAGES + ("scripts",) for p in sorted((ROOT / d).rglob("*.py"))]
    files += sorted((ROOT / "bench").glob("*.py")) + sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
    return files + sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((DOCS / "notebooks").glob("*.ipynb"))


def test_every_module_and_file_the_words_name_is_there():
    """Every dotted module path (``commlab.lab.front.cli``, ``commlab.engine.comm.exchange.Exchange``) and file path
    (``commlab/engine/comm/dear.py``, ``tests/test_docs.py``, with ``::name`` a test in it) named in the product's
    docstrings, comments and strings, in the docs, the README and the notebooks' text exists: moved modules
    leave no old names behind (``lab.workshop``, ``lab/spawn.py``, ``engine/comm.py`` were). Names outside the
    project's packages (``mypkg.codecs:ScaledSign``, ``compressor.name``) are not checked; bench/results and
    bench/data keep what they said then."""
    bad = []
    for path in product_and_docs():
        if path.suffix == ".py" and not stale_names(path.read_text()):
            continue  # nothing stale in the whole file, code included: no need to tell words from code (slow)
        for line, text in words_of(path):
            for offset, name in stale_names(text):
                bad.append(f"{path.relative_to(ROOT)}:{line + text.count(chr(10), 0, offset)}: {name}")
    assert bad == [], "names that are not in the code:\n" + "\n".join(bad)


def test_the_name_check_finds_a_stale_name(tmp_path):
    text = ("commlab.run(spec) reads runs/<id>/lab.json; commlab.lab.front.cli:main; commlab.engine.comm.exchange; mypkg.codecs:Sign\n"
            "compressor.name, commlab.lab.front.*, see commlab/lab/strategy/perfmodel/ and bench/results/*.md, tests/test_docs.py::"
            "test_nothing_speaks_of_issues and test_docs.py; f'{lab.root}'; bench/NAME.py; commlab/DDP; "
            "--out bench/results/cpu_buffers; notebooks/html/00_tour.html\n"
            "Gone: lab.workshop, lab/spawn.py, commlab.engine.comm.exchange.Nothing, commlab.lab.front.cli:nothing, "
            "tests/test_docs.py::test_gone, test_gone.py.")
    assert [n for _, n in stale_names(text)] == ["lab.workshop", "commlab.engine.comm.exchange.Nothing",
                                                  "commlab.lab.front.cli:nothing", "lab/spawn.py",
                                                  "tests/test_docs.py::test_gone", "test_gone.py"]
    assert [n for _, n in stale_names("# at the end of a comment: lab/auto.py")] == ["lab/auto.py"]
    assert [n for _, n in stale_names("(lab.sandbox")] == ["lab.sandbox"]
    nb = tmp_path / "n.ipynb"  # a notebook's markdown line is reported at its line in the file
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "source": ["import lab\n", "# lab.workshop"]},
                                        {"cell_type": "markdown", "source": ["# Title\n", "See lab.queue."]}]},
                             indent=1))
    said = [(line, n) for line, text in words_of(nb) for _, n in stale_names(text)]
    assert said == [(nb.read_text().splitlines().index('    "See lab.queue."') + 1, "lab.queue")]


def test_the_advise_how_to_names_only_flags_advise_has():
    """Every flag in the how-to's synopsis is one ``commlab advise`` takes (it said ``--json advice.json``; the
    file flag is ``--json-out``)."""
    from commlab.lab.front.cli import build_parser
    synopsis = re.search(r"```bash\n(.*?)```", (DOCS / "how-to" / "advise.md").read_text(), re.S).group(1)
    sub = next(a for a in build_parser()._actions if a.dest == "command" or getattr(a, "choices", None)
               and "advise" in (a.choices or {}))
    known = {s for a in sub.choices["advise"]._actions for s in a.option_strings}
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", synopsis))
    assert flags and flags <= known, flags - known
    assert "--json-out advice.json" in synopsis


TRACKER_WORDS = re.compile(r"\bissues? ?#?\d+|\bthe issue\b|\bissue's\b|\bissue tracker\b", re.IGNORECASE)


def test_nothing_speaks_of_issues():
    """The product, its docs, notebooks, benchmark results and tests speak of the project alone: an issue number
    or "the issue" means nothing to a reader of the lab (a figure's target is the target, a change's reason
    is said in words)."""
    dirs = ("commlab", "scripts", "tests", "bench", "notebooks", "examples", "docs")
    files = [p for d in dirs for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md", ".ipynb", ".yaml", ".yml", ".txt", ".json") and p.is_file()]
    files.append(ROOT / "README.md")
    me = Path(__file__).resolve()
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in files if p.resolve() != me
           for i, ln in enumerate(p.read_text(errors="replace").splitlines(), 1) if TRACKER_WORDS.search(ln)]
    assert bad == []
