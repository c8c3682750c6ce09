"""Post-local SGD: synchronous data parallel training for ``warmup`` steps, then local SGD.

Lin et al., "Don't use large mini-batches, use local SGD" (ICLR 2020): the first phase, where the loss
falls fast and noise matters most, trains as usual (every step's gradients averaged by the spec's
communicator, compressor and comm mode); from step ``warmup`` on each rank steps alone and the ranks
average parameters after every H-th step of the local phase.

Follows PyTorch's ``PostLocalSGDOptimizer`` with a ``PeriodicModelAverager(period=H, warmup_steps=warmup)``
and the ``post_localSGD_hook``: the same two phases. Differs as local SGD does (commlab/engine/methods/local_sgd.py):
averages through the lab's driver and timeline, and the first average of the local phase comes after its
H-th local step (PyTorch's averager averages after the first local step, then every H). PyTorch's hook can
keep averaging gradients within a subgroup (intra-node) in the local phase; here the local phase sends no
gradients at all.
"""
from __future__ import annotations

from commlab.engine.compressors.params import Param
from commlab.engine.methods.local_sgd import LocalSGD


class PostLocalSGD(LocalSGD):
    name = "post_local_sgd"
    params = LocalSGD.params + (
        Param("warmup", int, 100, "steps of synchronous training (gradients averaged every step) first",
              lo=0, hi=10_000_000),)
    exchanges_gradients = True
