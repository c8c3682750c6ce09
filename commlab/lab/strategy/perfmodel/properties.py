"""The desirable properties of a compressor (Agarwal et al., MLSys 2022, section 5),
checked by measuring each compressor of the library, not typed in:

- all-reduce compatible: a two-rank exchange, simulated in this process, uses
  only all-reduce rounds (payloads summed, not gathered);
- linear: for single-round summable compressors, decoding the sum of two
  ranks' payloads gives the sum of their decodings (relative error < 1e-2);
- compression ratio: input bytes over payload bytes, on a 1 M-element tensor
  laid out as a 1024 x 1024 matrix, in steady state;
- encode + decode overhead: measured fixed + per-byte cost
  (calibrate.measure_compressor), and as a share of a profile's compute when
  one is given (fwd + bwd of that model, the model's gradient size encoded
  once);
- fusion friendly: how much of the cost of compressing 50 layers one by one
  is saved by compressing them as one bucket (the fixed cost share);
- accuracy neutral: from measured accuracy (the accuracy benchmark's cells, commlab.lab.strategy.evidence):
  the better of plain and +EF within 1 point of ``none``; "not measured" otherwise.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from commlab.lab.strategy import evidence
from commlab.lab.strategy.perfmodel import calibrate as cal

"""The accuracy benchmark's results; a later file's cells replace an earlier one's (reruns)."""


def two_rank_exchange(name: str, n: int = 4096, **params):
    """Drive two compressor instances (ranks 0 and 1) through one exchange, replying to
    each round as the collective would. Returns (ops, output of rank 0, output of rank 1)."""
    import torch

    from commlab.engine import compressors
    from commlab.engine.compressors.capabilities import BucketContext
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, generator=g) for _ in range(2)]
    comps = [compressors.make(name, **params) for _ in range(2)]
    buckets = [BucketContext(0, r, ((0, (n // 64, 64)),)) for r in range(2)]
    for _ in range(comps[0].capabilities.warmup_exchanges):  # past plain warm-up exchanges (PowerSGD)
        _lockstep(comps, [x.clone() for x in xs], buckets)
    return _lockstep(comps, xs, buckets)


def _lockstep(comps, xs, buckets):
    from commlab.engine.comm.exchange import local_collective, run_exchange
    ops = []

    def collective(op, payloads):
        ops.append(op)
        return local_collective(op, payloads)
    ex0, ex1 = run_exchange(comps, xs, 2, collective, buckets=buckets)
    return ops, ex0.out, ex1.out


def linear(name: str, n: int = 4096, **params) -> Optional[bool]:
    """decode(P(x) + P(y)) == decode(P(x)) + decode(P(y)) for a single-round summable
    compressor (same seed on both: shared random indices, sketches); None when it does
    not apply (multi-round, or not summable)."""
    import torch

    from commlab.engine import compressors
    caps = compressors.make(name, **params).capabilities
    if not caps.summable or caps.rounds > 1:
        return None
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
    a, b = compressors.make(name, **params), compressors.make(name, **params)
    px, cx = a.compress(x)
    py, _ = b.compress(y)
    if [t.shape for t in px] != [t.shape for t in py]:
        return False
    both = a.decompress([u + v for u, v in zip(px, py)], cx)
    apart = a.decompress(px, cx) + b.decompress(py, cx)
    return bool(torch.linalg.vector_norm(both - apart) <= 1e-2 * torch.linalg.vector_norm(apart))


def ratio(name: str, n: int = 1 << 20, **params) -> float:
    import torch
    from commlab.engine.compressors.capabilities import BucketContext
    c = cal.make_compressor({"name": name, "params": params})
    bucket = BucketContext(layout=((0, (1024, n // 1024)),))
    x = torch.randn(n)
    for _ in range(c.capabilities.warmup_exchanges + 1):
        rounds, _ = cal.drive(c, x.clone(), bucket=bucket)
    sent = sum(b for _, b, _ in rounds)
    return n * 4 / max(sent, 1)


def accuracy(results: Optional[List[dict]] = None) -> Dict[str, dict]:
    """compressor -> {acc, acc_ef} from the accuracy benchmark's results (commlab.lab.strategy.evidence by default)."""
    out: Dict[str, dict] = {}
    for data in evidence.compressor_results() if results is None else results:
        for c in data.get("cells", []):
            if c.get("acc") is not None:
                out.setdefault(c["compressor"], {})["acc_ef" if c.get("ef") else "acc"] = c["acc"]
    return out


def checklist(names: Optional[List[str]] = None, profile: Optional[cal.Profile] = None,
              numels=cal.CURVE_NUMELS, accuracy_results: Optional[List[dict]] = None) -> List[dict]:
    """One row per compressor (default: every registered one) with each property measured."""
    from commlab.engine import compressors
    acc = accuracy(accuracy_results)
    uncompressed = [n for n in compressors.names() if compressors.REGISTRY[n].capabilities.identity]  # declared
    base = next((acc[n]["acc"] for n in uncompressed if acc.get(n, {}).get("acc") is not None), None)
    model_bytes = sum(b for _, b in profile.params) if profile else None
    compute = (profile.forward_s + profile.backward_s) if profile else None
    rows = []
    for name in names or list(compressors.names()):
        ops, o0, o1 = two_rank_exchange(name)
        curve = cal.measure_compressor({"name": name}, numels=numels, repeat=3, warm=1)
        n = 50 * 20000 * 4  # 50 layers of 20 k parameters
        per_layer = 50 * (cal.cost(curve["encode"], n / 50) + cal.cost(curve["decode"], n / 50))
        fused = cal.cost(curve["encode"], n) + cal.cost(curve["decode"], n)
        a = acc.get(name, {})
        best = max([v for v in (a.get("acc"), a.get("acc_ef")) if v is not None], default=None)
        row = {"compressor": name,
               "allreduce_compatible": all(op == "allreduce" for op in ops),
               "rounds": len(ops),
               "ranks_agree": bool((o0 - o1).abs().max() <= 1e-6 * (1 + o0.abs().max())),
               "linear": linear(name),
               "ratio": ratio(name),
               "encode_us_fixed": curve["encode"][0] * 1e6, "encode_us_per_mb": curve["encode"][1] * 1e12,
               "decode_us_fixed": curve["decode"][0] * 1e6, "decode_us_per_mb": curve["decode"][1] * 1e12,
               "fusion_saving": 1 - fused / per_layer if per_layer > 0 else 0.0,
               "accuracy": best, "accuracy_baseline": base,
               "accuracy_neutral": None if best is None or base is None else best >= base - 0.01}
        if profile:
            row["overhead_vs_compute"] = (cal.cost(curve["encode"], model_bytes)
                                          + cal.cost(curve["decode"], model_bytes)) / compute
        rows.append(row)
    return rows


def yes_no(v) -> str:
    return "not measured" if v is None else ("yes" if v else "no")
