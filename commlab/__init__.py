"""commlab's Python API: runs in the lab, the lab inside your own training loop, and your own compressor.

    import commlab
    r = commlab.run({"model": "cnn", "dataset": "digits", "steps": 100})   # blocks; a Run
    r.summary(); r.metrics(); r.timeline()                                # pandas DataFrames
    q = commlab.run("examples/demo.yaml", wait=False)                     # queued; returns at once
    commlab.compare(commlab.runs(state="done"))                           # one row per run

Every such call takes ``runs=`` (a directory; default ``$COMMLAB_RUNS`` or ./runs); see commlab/api.py.
Inside your own loop:

    import commlab
    with commlab.wrap(model, optimizer, "spec.yaml") as comm:   # or a dict, or a JobSpec
        for x, y in loader:                                     # your data, your shards
            loss = loss_fn(model(x), y)
            loss.backward()
            comm.step(loss=loss)          # replaces optimizer.step(); optimizer.zero_grad()

Launch it with plain torchrun (or Slurm, or a PyTorchJob). The spec's compressor, schedule,
comm mode (dear included) and network apply; the run lands in the runs directory (``runs=``,
default ``$COMMLAB_RUNS`` or ./runs) where ``commlab show``, ``commlab trace`` and the UI read it.
See commlab/own.py.

Your own compressor subclasses ``commlab.Compressor`` (its docstring is the guide), declares its
parameters with ``commlab.Param`` and what it can do with one ``commlab.Capabilities`` record, and is named in a spec by import path
(``compressor: {name: mypkg.codecs:ScaledSign}``) or, after ``commlab.register_compressor``, by a
short name (``commlab.run`` hands the ranks its import path: the class must live in a module on PYTHONPATH, not
in the script that runs). ``commlab.check_compressor`` (``commlab check compressor`` on the command line) holds it
to the checks the built-ins pass.
"""
from __future__ import annotations

__all__ = ["run", "runs", "get", "cancel", "wait", "compare", "spec",
           "wrap", "OwnLoop", "Compressor", "Capabilities", "ErrorFeedback", "Param", "Round", "register_compressor",
           "check_compressor"]
_API = ("run", "runs", "get", "cancel", "wait", "compare", "spec")

from commlab import api  # noqa: E402  (imports nothing of the lab until a function is called)


def __getattr__(name):  # torch is imported only when the API is used
    if name in _API:
        return getattr(api, name)
    if name in ("wrap", "OwnLoop"):
        from commlab import own
        return getattr(own, name)
    if name in ("Compressor", "ErrorFeedback", "Round", "Param"):
        from commlab.engine.compressors import base  # Param is declared in commlab/engine/compressors/params.py
        return getattr(base, name)
    if name == "Capabilities":
        from commlab.engine.compressors.capabilities import Capabilities
        return Capabilities
    if name == "register_compressor":
        from commlab.engine.compressors import register
        return register
    if name == "check_compressor":
        from commlab.engine.compressors.conformance import check
        return check
    raise AttributeError(name)
