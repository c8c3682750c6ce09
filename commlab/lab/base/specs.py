"""Read job specs from YAML or JSON files, with dotted command-line overrides."""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterable, List, Optional

import yaml

from commlab.engine import codepath
from commlab.engine.spec import JobSpec, SpecError, check_size
from commlab.lab.base import sandbox
from commlab.lab.base.paths import not_a_file

MAX_TYPED = 4096
"""Characters of YAML a text box may send (model or loader options, a parameter's value)."""


class SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader that reads ``1e-3`` and ``2.5e4`` as numbers, as JSON and YAML 1.2 do: PyYAML follows
    YAML 1.1, where a float needs a dot and a signed exponent, so ``lr: 1e-3`` was the string '1e-3' and the spec
    said the learning rate was not a number."""


SpecLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def load_yaml(text: str) -> object:
    """YAML as a spec is read: safe, with exponent-only numbers as floats (``SpecLoader``)."""
    return yaml.load(text, Loader=SpecLoader)


class _NoAliases(SpecLoader):
    """PyYAML's safe loader without aliases (``*name``): typed text cannot repeat a node by reference, so what
    it builds is never larger than the text (an alias bomb of a few hundred bytes expands to gigabytes)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not accepted here",
                                              event.start_mark)
        return super().compose_node(parent, index)


def typed_yaml(text: str) -> object:
    """What a viewer typed in a text box, as YAML: at most MAX_TYPED characters, no aliases, nested at most
    as deep as the parser's recursion allows. ValueError with one line otherwise."""
    if len(text) > MAX_TYPED:
        raise ValueError(f"at most {MAX_TYPED} characters, got {len(text)}")
    try:
        return yaml.load(text, Loader=_NoAliases)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ValueError(f"not valid YAML: {getattr(e, 'problem', None) or str(e).splitlines()[0]}{where}") from None
    except RecursionError:
        raise ValueError("not valid YAML: nested too deeply") from None


def read_spec_file(path: str, field: str = "SPEC") -> dict:
    """A spec (or sweep) file's data. Errors are one line: ``field: no such file: PATH``, or, for a file
    that does not parse, where as compilers say it, ``PATH:LINE:COLUMN: not valid YAML: problem``."""
    problem = not_a_file(path, "a spec file")
    if problem:
        raise SpecError(field, problem)
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(field, f"{path}: cannot be read as text ({getattr(e, 'strerror', None) or e})") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else load_yaml(text)
    except json.JSONDecodeError as e:
        raise SpecError("", f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    except yaml.YAMLError as e:
        raise SpecError("", yaml_error(path, e)) from None
    if data is None:
        data = {}
    return data


def yaml_error(path: str, e: yaml.YAMLError) -> str:
    """PyYAML's error as ``PATH:LINE:COLUMN: not valid YAML: problem (context)`` (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
    context = getattr(e, "context", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """``steps=50`` or ``compressor.name=topk``; values are parsed as YAML scalars."""
    check_size(data)  # before the copy, which would expand a structure that repeats itself by reference
    data = json.loads(json.dumps(data))  # deep copy
    if overrides and not isinstance(data, dict):
        raise SpecError("", f"a spec must be a mapping of fields, got {type(data).__name__}")
    for item in overrides or ():
        key, eq, raw = item.partition("=")
        if not eq or not all(part.strip() for part in key.split(".")):
            raise SpecError("--set", f"expected FIELD=VALUE (FIELD a name, or names joined by dots), got {item!r}")
        value = load_yaml(raw) if raw else ""
        try:
            check_size(value)  # a date, a set: nothing a spec holds
        except SpecError as e:
            raise SpecError(key.strip() if e.path == "spec" else f"{key.strip()}.{e.path}", e.msg) from None
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            cur = node.get(part)
            if isinstance(cur, str):  # short form `model: cnn` -> {name: cnn}
                cur = {"mode" if part == "comm" else "link" if part == "network" else "name": cur}
            if cur is None:
                cur = {}
            if not isinstance(cur, dict):
                raise SpecError(key, f"cannot set a field inside {part}, which is {cur!r}")
            node[part] = cur
            node = cur
        node[parts[-1]] = value
    return data


def read_job_spec(path: str) -> dict:
    """A job spec file's data; a sweep file given for one (``commlab run examples/sweep.yaml``) is one line
    that says what it is and which command takes it, not the first of its fields that a spec lacks."""
    data = read_spec_file(path)
    if isinstance(data, dict) and "base" in data and "grid" in data:
        raise SpecError("", f"{path} is a sweep file (base and grid), not a job spec; run it with "
                            f"`commlab sweep {path}`")
    return data


def load_spec(path: Optional[str] = None, overrides: Iterable[str] = (), data: Optional[dict] = None) -> JobSpec:
    """The checked spec of a file (or ``data``) with ``overrides``: the full check (``JobSpec.from_dict``), which
    admits a run. What it gives is written to spec.json, which the queue and the ranks read without checking it
    again (``JobSpec.from_checked``)."""
    if data is None:
        data = read_job_spec(path) if path else {}
    return JobSpec.from_dict(apply_overrides(data, overrides))


def admit_spec(path: str, overrides: Iterable[str] = (), here: bool = False) -> JobSpec:
    """``load_spec`` of a file, made where it costs least: ``commlab run``'s admission. The full check imports the
    registries of compressors, methods and models, and with them torch: 2.5 s of CPU here, spent before the run
    was even queued by a command that needs torch for nothing else. Where this process has not imported torch
    and may import what the spec names, the check runs in a child forked by this user's warm server
    (commlab.lab.base.warm: torch imported there already; about 0.2 s), in this process's environment and
    folder, and this process reads the checked document back (``JobSpec.from_checked``, with the engine switches
    the child took from that environment). A bad spec is the same one-line SpecError. Without an answer from a
    child (warm ranks off, no server, a child that died) the check runs here, and with ``here`` (a process that
    imports torch anyway: a rank of a job another launcher started, which trains in this process)."""
    data = apply_overrides(read_job_spec(path), overrides)
    if here or "torch" in sys.modules or not codepath.imports_allowed():
        return JobSpec.from_dict(data)
    answer = _check_in_child(data)
    if answer is None:
        return JobSpec.from_dict(data)
    if "error" in answer:
        raise SpecError(answer["error"]["path"], answer["error"]["msg"])
    return JobSpec.from_checked(answer["spec"], from_env=answer["from_env"])


def _check_in_child(data: dict) -> Optional[dict]:
    """The answer of ``main`` run in a warm child on ``data``, or None."""
    with tempfile.TemporaryDirectory(prefix="commlab-check-") as d:
        inp, out = Path(d) / "spec.json", Path(d) / "answer.json"
        inp.write_text(json.dumps(data))
        child = sandbox.warm_child(__name__, [str(out)], inp, Path(os.devnull))
        if not child or child.wait() != 0:
            return None
        try:
            with open(out) as f:
                answer = json.load(f)
        except (OSError, ValueError):
            return None
    return answer if isinstance(answer, dict) and ("spec" in answer or "error" in answer) else None


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m commlab.lab.base.specs ANSWER < DATA``: the full check of the spec data on stdin, its answer
    written to the file ANSWER: ``{"spec": checked document, "from_env": {...}}`` or ``{"error": {"path", "msg"}}``.
    Anything else (an error the check does not turn into a SpecError) leaves no answer, and the caller checks
    the spec itself, where that error shows as it would have."""
    (out,) = sys.argv[1:] if argv is None else argv
    try:
        spec = JobSpec.from_dict(json.load(sys.stdin))
        answer: dict = {"spec": spec.to_dict(), "from_env": spec.engine.from_env}
    except SpecError as e:
        answer = {"error": {"path": e.path, "msg": e.msg}}
    with open(out, "w") as f:
        json.dump(answer, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
