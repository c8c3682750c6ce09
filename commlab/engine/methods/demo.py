"""DeMo (Decoupled Momentum): momentum kept on each rank, only its fast components exchanged.

Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization" (2024). No gradient all-reduce. Each
step, on each rank:

1. the momentum decays and takes the gradient: m = decay * m + g;
2. the fast components of m are extracted: a DCT-II over chunks of ``chunk`` elements, and the ``topk``
   largest coefficients of each chunk by magnitude (values and int16 positions);
3. what was extracted is removed from the local momentum (m -= decode(own components)); the rest stays;
4. the components are all-gathered (they sit at different positions on each rank), summed in the DCT
   domain and decoded once; the update direction is the sign of that average (``sign``), which the
   spec's optimizer (plain SGD, as the paper's) steps with.

Steps 1-3 are an error-feedback memory whose residual decays (``DecayingResidual``, wrapping the
compressor ``DCTTopK`` as ``ErrorFeedback`` wraps any): the compressor never calls a collective, and the
exchange runs through the lab's driver like every other (lane "outer", every step).

Follows the reference implementation (github.com/bloc97/DeMo, demo.py) in the decay, the chunked DCT,
the per-chunk top-k, the removal of the sent part and the sign. Differs in: the DCT is one-dimensional
over consecutive chunks of each flattened tensor (the tail padded with zeros), where the reference
takes a 2-D DCT over tiles of each matrix whose sides divide its dimensions; positions travel as int16
(the reference sends int64); colliding positions from several ranks are summed and divided by the world
size, where the reference averages over the ranks that sent them (the same sign; without ``sign`` the
magnitudes differ); the momentum holds gradients, not gradients times the learning rate (the sign does
not change; weight decay is the optimizer's, as plain SGD's coupled decay equals the reference's
decoupled one for a sign update).
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

from commlab.engine.compressors.base import Compressor, ErrorFeedback, Round
from commlab.engine.compressors.capabilities import DEFAULT_BUCKET, BucketContext, Capabilities
from commlab.engine.compressors.params import Param
from commlab.engine.methods.base import Context, Event, Method
from commlab.engine.methods.transfer import Group, Transfer, groups

Tensor = torch.Tensor
INDEX = torch.int16
"""Positions within a chunk (chunk <= MAX_CHUNK, below int16's 32768)."""
MAX_CHUNK = 4096
"""The longest chunk: its DCT basis is chunk x chunk (64 MiB of fp32 at 4096, built in fp64 first) and every
element costs chunk multiply-adds each way; examples/demo_momentum.yaml takes 64."""
CHUNK_NOTE = " (the DCT basis is chunk x chunk, 64 MiB at 4096, and costs chunk multiply-adds per element)"

_BASES: Dict[tuple, Tensor] = {}


def dct_basis(n: int, dtype: torch.dtype, device) -> Tensor:
    """The orthonormal DCT-II matrix D (n x n): coefficients c = D x, and x = D^T c."""
    key = (n, dtype, str(device))
    if key not in _BASES:
        k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
        i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
        d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
        d[0] /= math.sqrt(2.0)
        _BASES[key] = d.to(dtype=dtype, device=device)
    return _BASES[key]


class DecayingResidual(ErrorFeedback):
    """DeMo's momentum as error feedback around ``inner``: before compressing, c = g + decay * m; after, m keeps
    what was not sent (c - decode(sent)). ``residual`` is the momentum m."""

    def __init__(self, inner: Compressor, decay: float):
        super().__init__(inner)
        self.decay = decay

    def add(self, t: Tensor) -> Tensor:
        if self.residual is None or self.residual.shape != t.shape:
            return t.clone()
        return t.add(self.residual, alpha=self.decay)


class DCTTopK(Compressor):
    """The ``topk`` largest DCT-II coefficients of each chunk of ``chunk`` elements (input length a multiple
    of ``chunk``). Payloads differ in their positions between ranks: all-gathered, summed in the DCT domain."""
    name = "dct_topk"
    params = (Param("chunk", int, 64, "elements per DCT chunk", lo=1, hi=MAX_CHUNK, note=CHUNK_NOTE),
              Param("topk", int, 32, "coefficients kept per chunk", lo=1, hi=MAX_CHUNK, note=" (at most chunk)"))
    capabilities = Capabilities(summable=False, fixed_payload=True)  # topk per chunk: sized by the input alone

    def __init__(self, **given):
        super().__init__(**given)
        if self.topk > self.chunk:
            raise ValueError(f"topk: must be at most chunk ({self.chunk}), got {self.topk}")

    def compress(self, t: Tensor):
        x = t.reshape(-1, self.chunk)
        c = x @ dct_basis(self.chunk, t.dtype, t.device).T
        idx = c.abs().topk(self.topk, dim=1, sorted=False).indices
        return [c.gather(1, idx), idx.to(INDEX)], tuple(c.shape)

    def decompress(self, payload: List[Tensor], ctx) -> Tensor:
        vals, idx = payload
        c = torch.zeros(ctx, dtype=vals.dtype, device=vals.device).scatter_(1, idx.long(), vals)
        return (c @ dct_basis(self.chunk, vals.dtype, vals.device)).reshape(-1)

    def exchange(self, t: Tensor, world_size: int, bucket: BucketContext = DEFAULT_BUCKET):
        payload, shape = bucket.encode(self, t)
        gathered = yield Round("allgather", payload)
        c = torch.zeros(shape, dtype=t.dtype, device=t.device)
        for vals, idx in gathered:  # one inverse DCT for all ranks: the transform is linear
            c.scatter_add_(1, idx.long(), vals)
        return (c @ dct_basis(self.chunk, t.dtype, t.device)).reshape(-1).div_(world_size)


class DeMo(Method):
    name = "demo"
    fault_tolerant = True
    exchanges_every_step = True
    params = (
        Param("decay", float, 0.999, "momentum decay per step (the reference's compression_decay)", lo=0, hi=1,
              hi_open=True),
        Param("topk", int, 32, "DCT coefficients sent per chunk", lo=1, hi=MAX_CHUNK, note=" (at most chunk)"),
        Param("chunk", int, 64, "elements per DCT chunk", lo=1, hi=MAX_CHUNK, note=CHUNK_NOTE),
        Param("sign", bool, True, "step with the sign of the decoded average (as the paper); false: the average"),
    )

    def __init__(self, **given):
        super().__init__(**given)
        if self.topk > self.chunk:
            raise ValueError(f"topk: must be at most chunk ({self.chunk}), got {self.topk}")

    def check_job(self, job: dict) -> None:
        if (job.get("optimizer") or {}).get("momentum"):
            raise ValueError("optimizer.momentum: demo keeps its own momentum (method.decay); use momentum 0")

    def _codec(self, nbytes: int) -> DecayingResidual:
        return DecayingResidual(DCTTopK(chunk=self.chunk, topk=self.topk), self.decay)

    def codec(self) -> DecayingResidual:
        return self._codec(0)

    def codec_numel(self, numel: int) -> int:
        return self._rows(numel) * self.chunk

    def setup(self, ctx: Context) -> None:
        super().setup(ctx)
        self.groups: List[Group] = groups(ctx, range(len(ctx.params)), "momentum", self._codec, pad_to=self.chunk)

    def exchanges_at(self, step: int) -> bool:
        return True

    def _rows(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def schedule(self, tensor_bytes: Sequence[int], steps: int, element_size: int = 4) -> List[Event]:
        rows = sum(self._rows(b // element_size) for b in tensor_bytes)
        per = rows * self.topk * (element_size + torch.tensor([], dtype=INDEX).element_size())
        return [Event(s, "components", per, 0) for s in range(steps)]

    @torch.no_grad()
    def after_backward(self, step: int) -> None:
        for g in self.groups:
            flat = g.gather([p.grad if p.grad is not None else torch.zeros_like(p) for p in g.params])
            tr = Transfer(self.ctx, g, g.compressor, flat, "outer", step)
            avg = tr.run()
            self.step_bytes += tr.sent
            for p, v in zip(g.params, g.views(avg)):
                d = v.sign() if self.sign else v
                if p.grad is None:
                    p.grad = d.clone()
                else:
                    p.grad.copy_(d)
        self.step_log["sync_bytes"] = self.step_bytes

    def momentum(self) -> List[Tensor]:
        """Each parameter's momentum (what was not sent yet), zeros before the first step."""
        out: Dict[int, Tensor] = {}
        for g in self.groups:
            r = g.compressor.residual
            for i, p, v in zip(g.index, g.params, g.views(r) if r is not None else g.params):
                out[i] = torch.zeros_like(p) if r is None else v.clone()
        return [out[i] for i in range(len(self.ctx.params))]

    def state_dict(self) -> dict:
        return {"momentum": [g.compressor.residual for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        for g, r in zip(self.groups, state["momentum"]):
            g.compressor.residual = r
