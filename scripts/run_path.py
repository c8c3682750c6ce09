"""Trace a short ``commlab run`` in this process and count how often its path goes back to a module it left.

    .venv/bin/python scripts/run_path.py            # the count, the entries per module, the folded sequence
    .venv/bin/python scripts/run_path.py --raw      # the whole sequence of modules, one per line

The run: model mlp on digits, world_size 2, steps 3, threads 1, eval_every 0, in a fresh runs directory
(``--runs DIR`` to keep it), through ``commlab.lab.front.cli.main(["run", ...])`` as the shell's ``commlab run``
calls it. This process is the run's supervisor, so the trace covers all of ``commlab run``: reading the spec,
admitting and queueing the run, launching the ranks, following them, writing the final status and printing the
summary. The two ranks are processes of their own and are not traced (``COMMLAB_WARM=0``: this process starts
them itself rather than asking the warm-rank server, so no server is left behind); neither are other threads
(``commlab run`` has none).

Every ``call`` event (``sys.setprofile``) of a function in commlab's own modules names a module; what runs inside
an import (a module's body, its class bodies and decorators) is left out. The sequence is those modules with consecutive repeats merged. A *return* is an
entry into a module that is not the previous one and was visited before: ``queue -> store -> queue`` is one.

The follow loop polls the ranks every 0.2 s and each poll enters the same modules again, so the raw count grows
with the run's wall time. The *folded* count is taken on the sequence with every block that repeats back to back
(a poll's ``launcher -> disturbance -> launcher``, any length up to ``--longest``) kept once: the shape of the
path, whatever the number of polls. Both are printed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # trace this checkout, whatever is installed
    sys.path.insert(0, str(ROOT))
PACKAGE = ROOT / "commlab"

SPEC = ("name: run-path\nmodel: mlp\ndataset: digits\nworld_size: 2\nsteps: 3\nthreads: 1\neval_every: 0\n")


def module_of(filename: str) -> Optional[str]:
    """The dotted module of a commlab source file, None for any other file."""
    try:
        rel = Path(filename).resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    if rel.suffix != ".py":
        return None
    parts = ["commlab", *rel.with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class Tracer:
    """Records the module of every call event into commlab's own code (consecutive repeats merged)."""

    def __init__(self):
        self.sequence: List[str] = []
        self._names: dict = {}

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        name = self._names.get(code.co_filename, "")
        if name == "":
            name = self._names[code.co_filename] = module_of(code.co_filename)
        if name is None or importing(frame):
            return
        if not self.sequence or self.sequence[-1] != name:
            self.sequence.append(name)


def importing(frame) -> bool:
    """Whether ``frame`` runs inside an import: a module's body (other than this script's) is on the stack."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_code.co_filename != __file__:
            return True
        frame = frame.f_back
    return False


def returns(sequence: List[str]) -> int:
    """Entries into a module visited before (``sequence`` has no consecutive repeats)."""
    seen, n = set(), 0
    for m in sequence:
        n += m in seen
        seen.add(m)
    return n


def fold(sequence: List[str], longest: int = 64) -> List[str]:
    """``sequence`` with each block of up to ``longest`` modules that repeats back to back kept once, until
    nothing repeats; then consecutive repeats merged again."""
    seq = list(sequence)
    changed = True
    while changed:
        changed = False
        for width in range(1, longest + 1):
            out, i = [], 0
            while i < len(seq):
                block = seq[i:i + width]
                j = i + width
                while len(block) == width and seq[j:j + width] == block:
                    j += width
                if j > i + width:
                    out.extend(block)
                    i = j
                    changed = True
                else:
                    out.append(seq[i])
                    i += 1
            seq = out
    merged: List[str] = []
    for m in seq:
        if not merged or merged[-1] != m:
            merged.append(m)
    return merged


def trace_run(runs: Path, quiet: bool) -> tuple:
    """(exit code, module sequence, what the command printed, seconds) of one traced ``commlab run``."""
    from commlab.lab.front import cli
    spec = runs / "run-path.yaml"
    runs.mkdir(parents=True, exist_ok=True)
    spec.write_text(SPEC)
    argv = ["run", str(spec), "--runs", str(runs / "runs")] + (["--quiet"] if quiet else [])
    os.environ["COMMLAB_WARM"] = "0"
    tracer = Tracer()
    out = io.StringIO()
    t0 = time.time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        sys.setprofile(tracer)
        try:
            rc = cli.main(argv)
        finally:
            sys.setprofile(None)
    return rc, tracer.sequence, out.getvalue(), time.time() - t0


def short(module: str) -> str:
    return module[len("commlab."):] if module.startswith("commlab.") else module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=None, help="folder for the spec and the runs directory (default: a temporary "
                                                 "one, removed at the end)")
    ap.add_argument("--quiet", action="store_true", help="run with --quiet (no progress bar)")
    ap.add_argument("--raw", action="store_true", help="print the whole sequence, one module per line")
    ap.add_argument("--longest", type=int, default=64, help="the longest repeated block folded (default 64)")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        where = Path(args.runs) if args.runs else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        rc, seq, said, secs = trace_run(where, args.quiet)
        if rc != 0:
            print(said[-3000:], file=sys.stderr)
            print(f"run_path: commlab run exited {rc}; the trace above is of a run that did not finish",
                  file=sys.stderr)
    folded = fold(seq, args.longest)
    entries = Counter(seq)
    print(f"commlab run: exit {rc}, {secs:.1f} s, traced in this process (the CLI, which supervises the run)")
    print(f"returns to an already visited module: {returns(seq)} raw, {returns(folded)} folded "
          f"({len(seq)} entries raw, {len(folded)} folded, {len(entries)} modules)")
    print("entries per module (raw, folded):")
    folded_entries = Counter(folded)
    for m, n in sorted(entries.items(), key=lambda kv: (-folded_entries[kv[0]], kv[0])):
        print(f"  {folded_entries[m]:4d} {n:6d}  {short(m)}")
    if args.raw:
        print("sequence (raw):")
        print("\n".join(short(m) for m in seq))
    else:
        print("sequence (folded):")
        print(" -> ".join(short(m) for m in folded))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
