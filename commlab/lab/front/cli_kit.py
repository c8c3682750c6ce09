"""What every ``commlab`` command shares: the parser's conventions (one-line errors, help with examples and
defaults, ``--json`` and ``--runs``), the checks of paths made before any work starts, and the output helpers.
commlab/lab/front/cli.py assembles the parser from the command groups (run_cli, model_cli, check_cli) and its own."""
from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable

import tomllib

from commlab.lab.analysis import cluster_view, replicas
from commlab.lab.base.paths import SOURCE, default_root, make_private, not_a_file
from commlab.lab.rundir.store import RunStore
from commlab.lab.rundir.summary import summarize
from commlab.lab.service.queue import Lab
from commlab.room import open_lab

ROOT = SOURCE


class UsageError(Exception):
    """Bad arguments: one line, exit status 2."""


class Help(argparse.HelpFormatter):
    """Examples as written; every option that has a default says it, unless its help already states
    one in words."""

    def _fill_text(self, text, width, indent):
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if not action.option_strings or "default" in h or d is None or d is False or d == [] or d is argparse.SUPPRESS:
            return h
        return f"{h} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line (argparse would print the usage block too), as ``FIELD: problem``, with a pointer to
        this command's help when the message does not list what is allowed."""
        message = re.sub(r"^argument ", "", message)
        m = re.match(r"(?P<dest>[^:]+): invalid choice: (?P<v>.+?) \(choose from (?P<c>.*)\)$", message)
        if m:  # only commands have bare choices (options check theirs with one_of)
            value, allowed = m["v"].strip("'"), [c.strip(" '") for c in m["c"].split(",")]
            close = difflib.get_close_matches(value, allowed, n=1)
            message = f"{value!r} is not a {self.prog} command" + (f"; did you mean {close[0]!r}?" if close else "")
        if "allowed:" not in message:
            message += f" (see '{self.prog} --help')"
        raise UsageError(message)


def version() -> str:
    """The installed distribution's version, else the checkout's pyproject.toml's."""
    try:
        return importlib.metadata.version("commlab")
    except importlib.metadata.PackageNotFoundError:
        try:
            with open(ROOT / "pyproject.toml", "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def command(sub, name: str, summary: str, examples: Iterable[str] = (), more: str = "") -> Parser:
    """A subcommand with its one-line summary (in the parent's list), a description (the summary and
    ``more``) and an epilog of example invocations."""
    text = summary[0].upper() + summary[1:] + "." + (" " + more if more else "")
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples) if examples else None
    return sub.add_parser(name, help=summary, description=text, epilog=epilog,
                          formatter_class=Help)


def group(p: Parser, title: str, dest: str, metavar: str) -> argparse._SubParsersAction:
    """A command made of sub-commands (net, workshop); given none, it prints its usage and a hint."""
    p.set_defaults(func=None, cmd_parser=p)
    return p.add_subparsers(title=title, dest=dest, metavar=metavar, parser_class=Parser)


def one_of(what: str, allowed: Iterable[str]) -> Callable[[str], str]:
    """An argument type that takes only ``allowed``, and says which in one line."""
    allowed = tuple(allowed)

    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}; allowed: {', '.join(allowed)}")
        return value
    return check


def runs_arg(p) -> None:
    p.add_argument("--runs", metavar="DIR", default=None,
                   help="runs directory (default: $COMMLAB_RUNS, else ./runs; created when a run is made)")


def json_arg(p, what: str = "the results") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON document on stdout "
                                                        "(notes and progress go to stderr)")


def add_spec_args(p, spec_help: str) -> None:
    """SPEC and its --set overrides, as every command that reads a spec takes them."""
    p.add_argument("spec", metavar="SPEC", help=spec_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a spec field, e.g. --set steps=50 --set compressor.name=none (repeatable)")


# --------------------------------------------------------------------------- checks and output

def out_file(option: str, path: str) -> str:
    """An output file, checked before any work starts: its folder exists (none is made) and can be written."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option}: {path} is a directory; give a file name")
    folder = p.parent
    if not folder.is_dir():
        raise UsageError(f"{option}: {path}: no such directory: {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{option}: {path}: permission denied")
    return path


def in_file(option: str, path: str) -> str:
    """An input file, checked before any work starts."""
    problem = not_a_file(path)
    if problem:
        raise UsageError(f"{option}: {problem}")
    return path


def runs_root(args, create: bool = True) -> Path:
    """The runs directory (--runs, $COMMLAB_RUNS or ./runs): a directory, made (with its parents) when a
    command that writes runs needs it."""
    root = Path(args.runs) if args.runs else default_root()
    if root.exists() and not root.is_dir():
        raise UsageError(f"--runs: {root} is not a directory")
    if create:
        try:
            make_private(root)
        except OSError as e:
            raise UsageError(f"--runs: cannot create {root}: {e.strerror}") from None
    return root


def lab_of(args) -> Lab:
    return open_lab(runs_root(args))


def store_of(args) -> RunStore:
    return RunStore(runs_root(args, create=False))


def notes(args):
    """Where a command's human lines go: stderr when stdout carries its JSON."""
    return sys.stderr if getattr(args, "json", False) else sys.stdout


def emit(obj) -> None:
    print(json.dumps(obj, indent=1, default=str))


def run_document(run) -> dict:
    """A run as ``show --json`` and ``run --json`` print it."""
    spec, st = run.spec_dict(), run.status()
    rows = run.metric_rows()
    doc = {"id": run.id, "state": st.get("state"), "status": st, "summary": summarize(rows, spec, st), "spec": spec}
    if st.get("fault_tolerance"):  # each replica group's state, the quorums, the recoveries after the start
        steps = [r for r in rows if r.get("kind") == "step" and "replica" in r]
        recs = run.recoveries()
        doc["replicas"] = {"states": replicas.replica_states(run.ft_events(), steps, recs),
                           "quorums": replicas.quorum_sizes(steps), "recoveries": replicas.after_start(recs, steps)}
    view = cluster_view.cluster_view(spec, rows)
    if view is not None:  # each worker's link, speed, compute and wait; the slowest rank and hop
        doc["cluster"] = view
    return doc


def numbers(flag: str, text: str, kind, lo, hi) -> list:
    """A comma-separated list of numbers in [lo, hi], or one line naming the flag."""
    try:
        vals = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or not all(lo <= v <= hi for v in vals):
        raise UsageError(f"{flag}: must be a comma-separated list of numbers in [{lo:g}, {hi:g}], got {text!r}")
    return vals
