"""commlab inside your own training loop.

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
"""
from __future__ import annotations

__all__ = ["wrap", "OwnLoop"]


def __getattr__(name):  # torch is imported only when the API is used
    if name in __all__:
        from commlab import own
        return getattr(own, name)
    raise AttributeError(name)
