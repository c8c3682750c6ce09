"""The shape of the code, as a test: no import circle anywhere, every arrow pointing down the layers, imports
inside functions only where they keep a heavy library out of a light module, no re-exports.

Layers, top to bottom (a module may import from its own package or any package below it, never above):

    commlab.app, commlab                the Streamlit pages; the public Python surface (commlab/__init__.py, own.py)
    commlab.lab.front                   the ways in: CLI, what the pages need, accounts, notebooks, sweeps
    commlab.api                         the Python API (run, runs, get, cancel, wait, compare, spec)
    commlab.lab                         the lab's package (its docstring only)
    commlab.lab.analysis                reading runs: tables, figures, live reading, reports, presets' verdicts
    commlab.lab.service                 many runs: the queue, supervisors, owners and quotas
    commlab.lab.strategy                strategy choice: the performance model, the advisor, strategy auto
    commlab.lab.rundir                  one run: its directory, the index, the launcher, progress, disturbance
    commlab.lab.net                     network emulation
    commlab.lab.base                    errors, paths, spec files, processes, the limited child
    commlab.engine                      what runs inside each rank (never imports the lab, the app or the API)

The graph is read from the source (every ``import`` and ``from ... import``, at module level and inside
functions; ``if TYPE_CHECKING:`` blocks are skipped)."""
import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("commlab",)
LAYERS = ["commlab.engine", "commlab.lab.base", "commlab.lab.net", "commlab.lab.rundir", "commlab.lab.strategy",
          "commlab.lab.service", "commlab.lab.analysis", "commlab.lab", "commlab.room", "commlab.api", "commlab.lab.front",
          "commlab.app", "commlab"]
"""Bottom to top. commlab.app and commlab are one level: neither imports the other."""
TOP = LAYERS.index("commlab.app")
HEAVY = ("torch", "torchvision", "transformers", "pandas", "plotly", "streamlit", "triton")
"""What an import inside a function may keep out of a module that does not load it already."""
API = "commlab.api"
"""Its functions build on the whole lab, so it imports lazily on purpose."""
LAZY = "# lazy:"
"""An import inside a function whose line says why (``# lazy: ...``) is left alone: the limited child
(commlab/lab/base/sandbox.py) must set its limits before it imports anything of the lab."""


def modules(root: Path):
    """{module name: path} of every product module under ``root``."""
    out = {}
    for top in PRODUCT:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


class Imports(ast.NodeVisitor):
    """(target module, line, inside a function) of every import of a file, with ``from X import y`` resolved
    to the module ``X.y`` when that is a module."""

    def __init__(self, name: str, known: set, is_pkg: bool):
        self.name, self.known, self.is_pkg = name, known, is_pkg
        self.found, self.depth = [], 0

    def _add(self, target, line):
        self.found.append((target, line, self.depth > 0))

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        t = node.test
        if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
                (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
            for n in node.orelse:
                self.visit(n)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for a in node.names:
            self._add(a.name, node.lineno)

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.name.split(".")
            base = base[:len(base) - node.level + (1 if self.is_pkg else 0)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module
        for a in node.names:
            sub = f"{mod}.{a.name}"
            self._add(sub if sub in self.known else mod, node.lineno)


def graph(root: Path):
    """{module: [(imported product module, line, in a function)]} and {module: [third-party tops imported at
    module level]}; ``excused``: the (module, line) of the lazy imports that say why."""
    mods = modules(root)
    known = set(mods)
    edges, tops = {}, {}
    excused.clear()
    for name, path in mods.items():
        v = Imports(name, known, path.name == "__init__.py")
        src = path.read_text()
        v.visit(ast.parse(src, str(path)))
        lines = src.split("\n")
        excused.update((name, line) for _, line, lazy in v.found if lazy and LAZY in lines[line - 1])
        edges[name] = []
        tops[name] = set()
        for target, line, lazy in v.found:
            if target in known or target.split(".")[0] in PRODUCT:
                hit = target
                while hit not in known and "." in hit:
                    hit = hit.rsplit(".", 1)[0]
                if hit in known and hit != name:
                    edges[name].append((hit, line, lazy))
            elif not lazy:
                tops[name].add(target.split(".")[0])
    return mods, edges, tops


excused: set = set()


def circles(edges):
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w, _, _ in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in list(edges):
        if v not in index:
            strong(v)
    return out


def deepest(module: str):
    """The index in LAYERS of the deepest layer whose name is ``module`` or a package above it (None if none)."""
    best = None
    for i, name in enumerate(LAYERS):
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(LAYERS[best])):
            best = i
    return best


def layer(module: str) -> int:
    """The level of ``module`` (its deepest layer's index; commlab.app and commlab share one); ValueError for a
    module in no layer (one directly in commlab.lab, or loose at the top beside the layers' packages)."""
    best = deepest(module)
    loose = best is not None and LAYERS[best] in ("commlab.lab", "commlab") and module != LAYERS[best] and \
        module not in TOP_MODULES
    if best is None or loose:
        raise ValueError(f"{module}: in no layer; a lab module belongs in one of {', '.join(LAYERS[1:7])}")
    return TOP if LAYERS[best] == "commlab" else best


TOP_MODULES = {"commlab.own"}
"""Modules of the public surface beside commlab/__init__.py."""


def against_layers(edges):
    """'a (file:line) -> b' for every import from a lower layer up to a higher one (or across app/commlab)."""
    bad = []
    for a, outs in edges.items():
        for b, line, _ in outs:
            la, lb = layer(a), layer(b)
            if lb > la or (la == lb == TOP and LAYERS[deepest(a)] != LAYERS[deepest(b)]):
                bad.append(f"{a}:{line} -> {b}")
    return bad


def heavy_closure(tops, edges):
    """{module: heavy libraries its module-level imports load, directly or through product modules}."""
    memo = {}

    def of(m, seen=()):
        if m in memo:
            return memo[m]
        got = {t for t in tops.get(m, ()) if t in HEAVY}
        for b, _, lazy in edges.get(m, ()):
            if not lazy and b not in seen:
                got |= of(b, seen + (m,))
        memo[m] = got
        return got
    return {m: of(m) for m in edges}


def needless_lazy(edges, tops):
    """Imports inside functions that keep no heavy library out of the importing module."""
    heavy = heavy_closure(tops, edges)
    bad = []
    for a, outs in edges.items():
        if a == API:
            continue
        for b, line, lazy in outs:
            if lazy and not (heavy[b] - heavy[a]) and (a, line) not in excused:
                bad.append(f"{a}:{line} imports {b} inside a function, which loads nothing heavy that {a} "
                           f"does not (hoist it; a circle is fixed by moving code)")
    return bad


# --------------------------------------------------------------------------- the rules

@pytest.fixture(scope="module")
def product():
    return graph(ROOT)


def test_no_import_circles(product):
    mods, edges, tops = product
    assert circles(edges) == []


def test_every_module_has_a_layer_and_arrows_point_down(product):
    mods, edges, tops = product
    for m in mods:
        layer(m)
    assert against_layers(edges) == []


def test_imports_inside_functions_keep_a_heavy_library_out(product):
    mods, edges, tops = product
    assert needless_lazy(edges, tops) == []


def test_every_package_says_what_it_owns(product):
    mods, edges, tops = product
    for name, path in mods.items():
        if path.name == "__init__.py" and name != API:
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc.split()) >= 8, f"{path.relative_to(ROOT)}: say what the package owns"


def test_the_rules_can_fail(tmp_path):
    """A two-module circle, an arrow up the layers, a needless lazy import and a module in no layer are found."""
    for rel, body in {"commlab/__init__.py": "", "commlab/engine/__init__.py": "",
                      "commlab/engine/a.py": "from commlab.engine import b\n",
                      "commlab/engine/b.py": "def f():\n    from commlab.engine import a\n",
                      "commlab/engine/c.py": "import commlab.lab.front.x\n",
                      "commlab/lab/__init__.py": "", "commlab/lab/front/__init__.py": "",
                      "commlab/lab/front/x.py": "", "commlab/lab/loose.py": "", "commlab/app/__init__.py": "",
                      "commlab/app/y.py": "from commlab import own\n", "commlab/own.py": ""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(body)
    mods, edges, tops = graph(tmp_path)
    assert circles(edges) == [["commlab.engine.a", "commlab.engine.b"]]
    assert sorted(against_layers({k: v for k, v in edges.items() if k != "commlab.lab.loose"})) == \
        ["commlab.app.y:1 -> commlab.own", "commlab.engine.c:1 -> commlab.lab.front.x"]
    assert any("commlab.engine.b:2 imports commlab.engine.a inside a function" in b
               for b in needless_lazy(edges, tops))
    with pytest.raises(ValueError, match="commlab.lab.loose: in no layer"):
        layer("commlab.lab.loose")
    assert os.path.isdir(ROOT / "commlab" / "lab" / "front")
