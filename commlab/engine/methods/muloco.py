"""MuLoCo: DiLoCo with Muon as the inner optimizer.

Thérien, Huang, Defazio, Rish, Belilovsky, "MuLoCo: Muon is a practical inner optimizer for DiLoCo" (2025). The
steps are DiLoCo's (commlab/engine/methods/diloco.py): H inner steps on each rank, the pseudo-gradient (global -
local) averaged through ``method.compressor``, an outer Nesterov SGD on the global parameters. The inner optimizer
is the spec's ``optimizer: {name: muon}`` (commlab/engine/muon.py): ``torch.optim.Muon`` on the weight matrices,
``torch.optim.AdamW`` on biases, norms, convolution kernels and embedding tables, its state local to each rank
across outer steps as in DiLoCo.

The paper's claim: with Muon inside, DiLoCo matches or beats DiLoCo with AdamW inside, its pseudo-gradients point
closer to the synchronous direction as the workers grow, and they compress better (top-k and low-bit quantization
of the pseudo-gradient with error feedback lose less than they do with AdamW inside; its figure sweeps the
compression). The lab's own race comes with the race figures.

Defaults: H 30, outer_lr 0.7, outer_momentum 0.6 with Nesterov, the settings the authors' reference
implementation (github.com/bentherien/muloco-1) gives as the paper's, where DiLoCo's paper takes H 500 and outer
momentum 0.9 with AdamW inside. The inner learning rate is the spec's ``optimizer.lr`` (0.02 in the usual Muon
recipe and in that implementation).

Follows the paper in the algorithm (it is DiLoCo's with another inner optimizer). Differs in the Muon it runs:
torch's, which orthogonalizes in bfloat16 with 5 Newton-Schulz steps and scales the step by sqrt(max(1, rows /
cols)), and leaves 3-D and 4-D kernels to AdamW, where the authors' code (github.com/facebookresearch/MuLoCo)
scales the step by a spectral-norm rule and flattens such tensors into matrices; and AdamW steps the output head
only when it is tied to the embedding (the authors' recipe gives the head to AdamW as well). Under fault tolerance
it runs as DiLoCo does (each sync joins a quorum and is applied when it commits; a recovery hands over the Muon and
AdamW state with the model).

With H = 1, outer_lr = 1 and outer_momentum = 0 MuLoCo is the average of each rank's Muon step, which is not
synchronous Muon on the averaged gradient (the orthogonalization is not linear): tests/test_methods_muloco_desloc.py
holds it to a reference computed with the stock optimizers on each rank's copy instead.
"""
from __future__ import annotations

from commlab.engine.compressors.params import Param
from commlab.engine.methods.diloco import OVERLAP, DiLoCo


class MuLoCo(DiLoCo):
    name = "muloco"
    params = (
        Param("H", int, 30, "inner (Muon) steps between two outer steps", lo=1, hi=1_000_000),
        Param("outer_lr", float, 0.7, "the outer SGD's learning rate on the averaged pseudo-gradient",
              lo=0, hi=10, lo_open=True),
        Param("outer_momentum", float, 0.6, "the outer SGD's momentum (Nesterov when nesterov is on)",
              lo=0, hi=1, hi_open=True),
        Param("nesterov", bool, True, "Nesterov momentum in the outer step (as the paper)"),
        OVERLAP,
    )

    def check_job(self, job: dict) -> None:
        name = (job.get("optimizer") or {}).get("name")
        if name != "muon":
            raise ValueError(f"optimizer.name: muloco is DiLoCo with Muon inside; use optimizer muon (got {name}), "
                             f"or method diloco for another inner optimizer")
