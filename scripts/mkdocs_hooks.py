"""MkDocs hooks (mkdocs.yml ``hooks:``): the parts of the docs that the code already states are generated from
it at build time, so they cannot drift from it.

- ``<!-- generated: cli -->`` (docs/reference/cli.md): every command's and sub-command's ``--help``, walked
  from the parser of ``commlab`` (commlab.lab.front.cli.build_parser);
- ``<!-- generated: spec -->`` (docs/reference/spec.md): every field of the job spec, its type, default and
  docstring, from the dataclasses of commlab/engine/spec.py;
- ``<!-- generated: compressor-capabilities -->`` (docs/reference/compressors.md): what each registered
  compressor declares it can do (commlab/engine/compressors/base.py), read from an instance at default parameters;
- ``<!-- generated: run-files -->`` and ``<!-- generated: run-status -->`` (docs/reference/run-directory.md): every
  file of a run directory, and the states and fields of its status.json, from the run directory's protocol
  (commlab/engine/runfiles.py);
- ``<!-- generated: cluster-presets -->`` (docs/how-to/networks.md): the presets of ``network.cluster``, every
  worker's numbers and where they come from (commlab/engine/cluster.py);
- ``js/plotly.min.js``: the installed plotly's own bundle, which the tutorial notebooks' figures draw with.

A marker on a page that this file does not know fails the build, as does a marker it cannot fill.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import re
import sys
import typing
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the hooks document this checkout, whatever is installed
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")
HELP_COLUMNS = "80"
"""argparse wraps --help to the terminal's width; a fixed width keeps the page the same everywhere."""


# --------------------------------------------------------------------------- the CLI

def commands(parser: argparse.ArgumentParser, prog: str = "commlab"):
    """(full command, one-line help, parser) of every command below ``parser``, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                full = f"{prog} {name}"
                yield full, helps.get(name) or "", sub
                yield from commands(sub, full)


def cli_reference() -> str:
    from commlab.lab.front.cli import build_parser
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        top = build_parser()
        parts = ["## `commlab`", "", top.description or "", "", "```text", top.format_help().rstrip(), "```", ""]
        for full, short, parser in commands(top):
            parts += [f"## `{full}`", "", short[:1].upper() + short[1:] + ("." if short else ""), "",
                      "```text", parser.format_help().rstrip(), "```", ""]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts)


# --------------------------------------------------------------------------- the job spec

def attribute_docs(cls) -> dict:
    """{field: the docstring under it} of a dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    out = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
            out[a.target.id] = " ".join(b.value.value.split())
    return out


def shown_type(annotation: str) -> str:
    """A field's annotation as the reference shows it: ``Literal['a', 'b']`` as ``a | b``, ``Optional[X]`` as X's
    form ``or unset``, ``Union[bool, Literal['x'], None]`` as ``bool | x or unset``."""
    m = re.fullmatch(r"Literal\[(.*)\]", annotation)
    if m:
        return " | ".join(x.strip().strip("'\"") for x in m.group(1).split(","))
    m = re.fullmatch(r"Optional\[(.*)\]", annotation)
    if m:
        return f"{shown_type(m.group(1))} or unset"
    m = re.fullmatch(r"Union\[(.*)\]", annotation)
    if m:
        parts = [p.strip() for p in re.split(r",\s*(?![^\[]*\])", m.group(1))]
        shown = " | ".join(shown_type(p) for p in parts if p != "None")
        return f"{shown} or unset" if "None" in parts else shown
    return annotation


def shown_default(f: dataclasses.Field) -> str:
    v = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "`true`" if v else "`false`"
    return f"`{v!r}`" if not isinstance(v, str) else f"`{v}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def spec_reference() -> str:
    from commlab.engine import spec as S
    rows, sections = [], []

    def walk(cls, prefix: str):
        docs = attribute_docs(cls)
        hints = typing.get_type_hints(cls, vars(S))
        for f in dataclasses.fields(cls):
            path = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(hints[f.name]):
                sections.append((path, hints[f.name]))
                continue
            rows.append((path, shown_type(str(f.type)), shown_default(f), docs.get(f.name, "")))

    walk(S.JobSpec, "")
    out = ["| field | type | default | what it does |", "|---|---|---|---|"]
    out += [f"| `{p}` | {cell(t)} | {cell(d)} | {cell(doc)} |" for p, t, d, doc in rows]
    for path, cls in sections:
        rows.clear()
        walk(cls, f"{path}.")
        head = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
        jobdoc = attribute_docs(S.JobSpec).get(path, "")
        out += ["", f"### `{path}`", ""]
        if head or jobdoc:
            out += [" ".join((head or jobdoc).split()), ""]
        out += ["| field | type | default | what it does |", "|---|---|---|---|"]
        out += [f"| `{p}` | {cell(t)} | {cell(d)} | {cell(doc)} |" for p, t, d, doc in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------- compressor capabilities

CAPABILITIES = ("summable", "keeps_shape", "lossless", "identity", "rounds", "builtin_feedback", "builtin_momentum",
                "counts_steps", "steady_payload", "shard_codec", "warmup_exchanges", "elementwise")
"""Fields of commlab.engine.compressors.capabilities.Capabilities shown per compressor, where the record has them."""


def capabilities_reference() -> str:
    from commlab.engine import compressors
    from commlab.engine.compressors.capabilities import Capabilities
    caps = [c for c in CAPABILITIES if hasattr(Capabilities, c)]
    head = ["compressor", *caps, "dear reduce-scatter"]
    out = ["| " + " | ".join(f"`{h}`" if h in caps else h for h in head) + " |", "|" + "---|" * len(head)]
    for name in compressors.names():
        k = compressors.make(name).capabilities
        vals = []
        for a in caps:
            v = getattr(k, a)
            vals.append(("yes" if v else "") if isinstance(v, bool) else
                        ", ".join(v) if isinstance(v, tuple) else str(v))
        vals.append(k.shard_path() or "")
        out.append(f"| `{name}` | " + " | ".join(cell(v) for v in vals) + " |")
    return "\n".join(out)


# --------------------------------------------------------------------------- the run directory

def code_names(text: str) -> str:
    """``text`` with each dotted name of the code (commlab.lab.rundir.store.Run.status) set as code."""
    return re.sub(r"(?<![`\w.])(commlab(?:\.\w+)+)", r"`\1`", text)


def run_files_reference() -> str:
    from commlab.engine import runfiles
    out = ["| file | what it holds | written by, when | read through |", "|---|---|---|---|"]
    for f in runfiles.FILES.values():
        name = f"`{f.shown}`" + ("/" if f.format == "folder" else "") + \
            (f" ({f.format})" if f.format in ("marker", "lock") else "") + \
            (" (in the runs root)" if f.where == "root" else "")
        readers = ", ".join(f"`{r}`" for r in f.readers) or "people (no code reads it)"
        out.append(f"| {name} | {cell(f.holds)} | {cell(code_names(f.writer))}; {cell(f.when)} | {readers} |")
    return "\n".join(out)


def run_status_reference() -> str:
    from commlab.engine import runfiles
    out = ["| state | means |", "|---|---|"]
    out += [f"| `{s}` | {cell(runfiles.STATE_MEANS[s])}{' (final)' if s in runfiles.FINAL else ''} |"
            for s in runfiles.STATES]
    out += ["", "| field | written by | what it holds |", "|---|---|---|"]
    for f in runfiles.STATUS_FIELDS.values():
        by = re.sub(r"(mark_[a-z]+|note)", r"`\1`", f.set_by)
        out.append(f"| `{f.name}` | {cell(by)} | {cell(f.means)} |")
    return "\n".join(out)


def cluster_presets_reference() -> str:
    from commlab.engine import cluster
    out = ["| preset | worker | up, down (Gbit/s) | delay (ms, one way) | jitter (ms) | what it stands for, and the figures' source |",
           "|---|---|---|---|---|---|"]
    for name, p in cluster.PRESETS.items():
        for i, w in enumerate(p["workers"]):
            who = "every rank" if len(p["workers"]) == 1 else f"region {i}"
            about = f"{cell(p['about'])}; {cell(p['source'])}" if i == 0 else ""
            out.append(f"| {'`' + name + '`' if i == 0 else ''} | {who} | {w['gbps_up']:g}, {w['gbps_down']:g} | "
                       f"{w['delay_ms']:g} | {w['jitter_ms']:g} | {about} |")
    return "\n".join(out)


GENERATORS = {"cli": cli_reference, "spec": spec_reference, "compressor-capabilities": capabilities_reference,
              "run-files": run_files_reference, "run-status": run_status_reference,
              "cluster-presets": cluster_presets_reference}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def fill(m):
        name = m.group(1)
        if name not in GENERATORS:
            raise PluginError(f"{page.file.src_uri}: unknown generated section {name!r}; "
                              f"known: {', '.join(GENERATORS)}")
        try:
            return GENERATORS[name]()
        except Exception as e:  # a generator that breaks must fail the build, saying where
            raise PluginError(f"{page.file.src_uri}: generating {name!r} failed: {type(e).__name__}: {e}") from e
    return MARKER.sub(fill, markdown)


def on_files(files, config):
    import plotly
    bundle = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not bundle.is_file():
        raise PluginError(f"no plotly.min.js in the installed plotly ({bundle}); the tutorials' figures need it")
    files.append(File.generated(config, "js/plotly.min.js", abs_src_path=str(bundle)))
    return files
