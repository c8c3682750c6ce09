"""commlab's user side: specs, the queue, the run store, and a Python API.

    import commlab
    r = commlab.run({"model": "cnn", "dataset": "digits", "steps": 100})   # blocks; a Run
    r.summary(); r.metrics(); r.timeline()                            # pandas DataFrames
    q = commlab.run("examples/demo.yaml", wait=False)                     # queued; returns at once
    commlab.compare(commlab.runs(state="done"))                               # one row per run

Every call takes ``runs=`` (a directory; default ``$COMMLAB_RUNS`` or ./runs).
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Union

__all__ = ["run", "runs", "get", "cancel", "wait", "compare", "spec"]


def _lab(runs=None):
    from commlab.room import open_lab  # a room's runs directory keeps its rules (commlab.room.is_room)
    return open_lab(runs)


def spec(given, overrides=()):
    """A checked spec (a JobSpec) from a YAML path, a dict or a JobSpec, with ``overrides`` (``key=value``) applied,
    as the ranks will read it: the full check, once (the queue and the ranks read what it wrote without checking
    again), with the engine's switches left unset taken from this process's environment."""
    from commlab.engine.spec import JobSpec, SpecError
    from commlab.lab.base.specs import load_spec
    if isinstance(given, JobSpec):
        checked = load_spec(data=given.to_dict(), overrides=overrides)
        checked.engine.keep_from_env(given.engine)  # what given's own check took from the environment
    elif isinstance(given, dict):
        checked = load_spec(data=given, overrides=overrides)
    elif isinstance(given, (str, os.PathLike)):
        checked = load_spec(str(given), overrides)
    else:
        raise SpecError("spec", f"a file path, a mapping of fields or a JobSpec, got {type(given).__name__}")
    return _for_the_ranks(checked)


_checked = spec  # run() takes a parameter named spec


def _for_the_ranks(spec):
    """``spec`` with every compressor registered in this process (commlab.register_compressor) named by its
    import path: the ranks are other processes, which never ran the code that registered it."""
    from commlab.engine import compressors
    from commlab.engine.spec import JobSpec, SpecError, with_checked
    d = spec.to_dict()
    sections = [("compressor", d["compressor"]), *((f"compressor.per_bucket[{i}]", r)
                for i, r in enumerate(d["compressor"]["per_bucket"]))]
    if d["method"].get("compressor"):
        sections.append(("method.compressor", d["method"]["compressor"]))
    changed = False
    for where, section in sections:
        try:
            name = compressors.importable(section.get("name"), f"{where}.name")
            if name != section.get("name"):  # the path must import the class the spec was checked with
                compressors.resolve(name, f"{where}.name")
        except ValueError as e:
            raise SpecError(*str(e).split(": ", 1)) from None
        changed |= name != section.get("name")
        section["name"] = name
    # the same classes under names another process can import: checked already, so not checked again
    return with_checked(JobSpec.from_checked(d), engine=spec.engine) if changed else spec


def run(spec: Union[str, dict, "JobSpec"], wait: bool = True, runs=None, progress: bool = False,  # noqa: F821
        overrides: Iterable[str] = ()):
    """Queue a run and return it. ``wait=True`` blocks until it ends (this process supervises it);
    ``wait=False`` hands it to a detached supervisor and returns at once."""
    return _lab(runs).submit(_checked(spec, overrides), wait=wait, progress=progress)


def runs(runs=None, **filters) -> List:
    """Runs in the index, oldest first; filters: state, model, dataset, compressor, schedule, comm, link, sweep, name,
    owner."""
    from commlab.lab.rundir.index import runs_of
    lab = _lab(runs)
    lab.recover_stale()
    return runs_of(lab.root, **filters)


def get(run_id: str, runs=None):
    return _lab(runs).store.get(run_id)


def cancel(run_id: str, runs=None) -> str:
    return _lab(runs).cancel(run_id)


def wait(run_id: str, runs=None, timeout: Optional[float] = None) -> str:
    return _lab(runs).wait(run_id, timeout)


def compare(items, target_acc: Optional[float] = None, baseline=None):
    """A comparison table (DataFrame), one row per run. See commlab.lab.analysis.comparison.compare_runs."""
    from commlab.lab.analysis.comparison import compare_runs
    return compare_runs(items, target_acc=target_acc, baseline=baseline)

