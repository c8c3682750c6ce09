"""Streaming DiLoCo: DiLoCo whose parameters are synced a fragment at a time, each fragment's all-reduce
overlapped with inner steps, optionally compressed.

Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free Lunch"
(2025). The parameters are cut into ``fragments`` parts; fragment f's outer step comes every H steps,
after steps n = H(f+1)/F (mod H), so the syncs are spread over the period and the peak bytes of a step
are one fragment's, not the model's. Steps for fragment f:

1. ``tau`` steps before its outer step: its pseudo-gradient (global - local) is encoded and its
   all-reduce issued, asynchronously; the inner steps go on meanwhile (lane "fragment" shows it in flight);
2. at its outer step: wait for the all-reduce, step the fragment's global parameters with the outer
   Nesterov SGD, and set the local fragment to alpha * local + (1 - alpha) * global, whatever tau is
   (alpha 0: the local fragment takes the global one, as DiLoCo). Left out, alpha is 0.5 with tau > 0
   and 0 with tau = 0;
3. ``method.compressor`` compresses the pseudo-gradient: int4 for the paper's 4-bit outer updates (the
   paper's are 4-bit floats, int4's a uniform code with a scale per block), int8 or qsgd.

Follows the paper in the staggered schedule, the overlap tau and the mixing alpha; differs in the
fragment pattern: contiguous runs of tensors of about equal bytes (the paper's "sequential"; it found
"strided" layers slightly better), because a tensor list does not say which tensors form a layer.
torchft (torchft/local_sgd.py) issues each fragment at H/F - tau of its turn and applies it at H/F, as
here, and mixes by ``fragment_update_alpha`` as here (the weight of the local parameters) at any delay;
its weight defaults to 0 (the local steps are dropped), here alpha defaults to 0.5 when tau > 0 and to 0
when tau = 0 (DiLoCo's replacement); it requires H to be a multiple of the fragments and tau < H/F, here
fragments <= H and tau < H suffice (a fragment's sync is applied before it is issued again).
"""
from __future__ import annotations

from commlab.engine.compressors.params import Param
from commlab.engine.methods.diloco import DiLoCo


class StreamingDiLoCo(DiLoCo):
    name = "streaming_diloco"
    checks_model = True
    params = DiLoCo.params + (
        Param("fragments", int, 2, "parts of the parameters synced in turn, each every H steps", lo=1, hi=100_000),
        Param("tau", int, 1, "inner steps a fragment's all-reduce overlaps before its outer step", lo=0,
              hi=1_000_000),
        Param("alpha", float, None, "weight of the local fragment when it is mixed with the new global one",
              lo=0, hi=1, unset="0.5 with tau > 0, 0 (take the global fragment) with tau 0"),
    )

    def __init__(self, **given):
        super().__init__(**given)
        if self.alpha is None:
            # 0 at tau 0 keeps a spec without alpha where it was: the local fragment takes the global one
            self.alpha = 0.5 if self.tau > 0 else 0.0
