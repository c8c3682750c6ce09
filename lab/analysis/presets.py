"""One-click experiments for the Home page (and notebooks): each preset is a question, the runs that
answer it (spec overrides on a small common base), the paper's claim, and the effects whose measured
ratios decide the answer (see lab.results).

Every preset is tuned so that, on the 2-core machine this lab was built on, its runs train to a
useful accuracy and the whole preset finishes in about a minute (bench/presets.py measures both)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from engine.spec import SpecError
from lab.base.specs import load_spec

BASE = {"model": "cnn", "dataset": "digits", "world_size": 2, "steps": 150, "batch_size": 32,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "schedule": {"name": "bucket"},
        "comm": {"mode": "wfbp"}, "eval_every": 25}
TOPK_EF = {"name": "topk", "ratio": 0.01, "error_feedback": True}
TOPK5_EF = {**TOPK_EF, "ratio": 0.05}
# A narrow resnet: the same 62 gradient tensors as the default width, a fifth of the compute, so the
# per-tensor cost of layer-wise compression dominates as it does on a GPU. Adam trains it on digits in a
# few hundred steps; SGD with momentum does not get off 10% that fast.
NARROW_RESNET = {"model": {"name": "resnet", "width": 8}, "batch_size": 8, "steps": 400,
                 "optimizer": {"name": "adam", "lr": 0.003}}
# Full-width resnet (11 MB of gradients) at a per-rank batch of 64: an 88 ms all-reduce on a 1 Gbit/s
# link against roughly as much compute, the regime where DeAR's two overlaps pay.
DEAR_BASE = {"model": "resnet", "batch_size": 64, "steps": 100, "optimizer": {"name": "adam", "lr": 0.002}}


def modeled(gbps: float) -> dict:
    return {"link": "modeled", "gbps": gbps}


@dataclass
class Effect:
    """A measured ratio of median iteration times, slower / faster, and the bound it must meet."""
    text: str
    """what it says, e.g. "MergeComp over layer-wise, per iteration\""""
    faster: str
    """the variant expected to be faster (or, with at_most, the one expected not to be)"""
    slower: str
    at_least: Optional[float] = None
    """the ratio must reach this (the paper's effect, scaled to what this machine can show)"""
    at_most: Optional[float] = None
    """the ratio must not exceed this (an effect that should be absent, e.g. compression on a fast link)"""


@dataclass
class Preset:
    key: str
    title: str
    question: str
    variants: Dict[str, dict]
    """label -> spec overrides on top of BASE; one run per variant."""
    claim: str = ""
    """what the paper found, with its figure"""
    reference: str = ""
    """the variant whose held-out accuracy the others are held to (within ACCURACY_POINTS)"""
    effects: List[Effect] = field(default_factory=list)
    accuracy_floor: float = 0.9
    """a useful level for the data set: 90% on digits, 85% on mnist"""
    crossover: Optional[Tuple[str, str]] = None
    """(uncompressed variant, compressed variant): the results view asks the performance model,
    calibrated on the first, below which bandwidth the second pays"""
    scaling: Optional[Tuple[str, str]] = None
    """(all-reduced variant, all-gathered variant): the verdict says how each one's measured traffic per
    rank grows with the number of workers, and from how many workers the all-reduced one sends less"""

    def specs(self) -> List[dict]:
        return [{**BASE, **v, "name": f"{self.key}: {label}"} for label, v in self.variants.items()]

    def labels(self) -> List[str]:
        return list(self.variants)

    def check(self) -> Optional[str]:
        """None when every run of the preset is a valid spec, else the reason it is not available."""
        for d in self.specs():
            try:
                load_spec(data=d)
            except SpecError as e:
                return str(e)
        return None


ACCURACY_POINTS = 0.02
"""A variant may trail the reference's held-out accuracy by at most this much (2 points)."""

PRESETS = [
    Preset("layerwise-vs-mergecomp", "Layer-wise vs MergeComp",
           "A narrow resnet (62 gradient tensors, little compute per tensor, as on a GPU) with top-k 1% + "
           "error feedback: one compressor call and one collective per tensor, against the few merged "
           "groups MergeComp finds by timing candidate split points.",
           {"layerwise": {**NARROW_RESNET, "compressor": TOPK_EF, "schedule": {"name": "layerwise"}},
            "mergecomp": {**NARROW_RESNET, "compressor": TOPK_EF,
                          "schedule": {"name": "mergecomp", "steps_per_candidate": 3, "max_candidates": 8}}},
           claim="MergeComp (Wang, Wu, Ng 2021): merging layers before compressing is up to 3.83x faster "
                 "than layer-wise compression, without losing accuracy.",
           reference="layerwise",
           effects=[Effect("MergeComp over layer-wise, per iteration", "mergecomp", "layerwise", at_least=2.0)]),
    Preset("dear-vs-ddp", "DeAR vs DDP",
           "resnet (11 MB of gradients) over a modeled 1 Gbit/s link: reduce-scatter during backward and "
           "all-gather during the next forward (DeAR), against DDP-style bucketed all-reduce overlapped "
           "with backward (25 MB buckets).",
           {"dear": {**DEAR_BASE, "comm": {"mode": "dear", "cap_mb": 2}, "network": modeled(1)},
            "ddp": {**DEAR_BASE, "comm": {"mode": "wfbp"}, "network": modeled(1)}},
           claim="DeAR (Zhang et al. 2023): decoupling all-reduce trains up to 83% faster than DDP-style "
                 "wait-free back-propagation on 10 Gbit/s Ethernet; accuracy is unchanged (the same "
                 "arithmetic).",
           reference="ddp",
           effects=[Effect("DeAR over DDP-style wfbp, per iteration", "dear", "ddp", at_least=1.2)]),
    Preset("compression-links", "Does compression pay? A slow link and a fast one",
           "An MLP on digits (1.2 MB of gradients, about a millisecond of compute) with and without top-k 5% + "
           "error feedback, over a modeled 0.1 Gbit/s link and a modeled 10 Gbit/s link (alpha-beta delays in "
           "the communicator; no root needed), next to the bandwidth below which the performance model, "
           "calibrated on these runs, predicts top-k pays.",
           {"none @ 0.1 Gbit/s": {"model": "mlp", "network": modeled(0.1)},
            "top-k @ 0.1 Gbit/s": {"model": "mlp", "compressor": TOPK5_EF, "network": modeled(0.1)},
            "none @ 10 Gbit/s": {"model": "mlp", "network": modeled(10)},
            "top-k @ 10 Gbit/s": {"model": "mlp", "compressor": TOPK5_EF, "network": modeled(10)}},
           claim="On the Utility of Gradient Compression (Agarwal et al. 2022): compression pays only where "
                 "communication dominates the iteration; on fast links its encode and decode cost more than "
                 "the bytes it saves (it beat optimized synchronous training in 6 of 200+ setups).",
           reference="none @ 10 Gbit/s",
           effects=[Effect("top-k over none on the slow link", "top-k @ 0.1 Gbit/s", "none @ 0.1 Gbit/s",
                           at_least=1.0),
                    Effect("top-k over none on the fast link (should not pay)", "top-k @ 10 Gbit/s",
                           "none @ 10 Gbit/s", at_most=1.0)],
           crossover=("none @ 10 Gbit/s", "top-k @ 10 Gbit/s")),
    Preset("countsketch-vs-topk", "Sketch-Fusion: Count Sketch vs top-k",
           "Count Sketch tables are linear, so ranks sum them in an all-reduce; top-k payloads are "
           "all-gathered. Both keep the largest 2% of each merged group, with error feedback and LayerFusion's "
           "merging; the sketch (3 rows) finds them from the summed table and fetches their exact values in a "
           "second round. Its bytes are the table's, shown as they are.",
           {"countsketch": {"steps": 300, "compressor": {"name": "countsketch", "rows": 3, "ratio": 0.02,
                                                         "error_feedback": True, "exact": True},
                            "schedule": {"name": "layerfusion"}},
            "topk": {"steps": 300, "compressor": {**TOPK_EF, "ratio": 0.02}, "schedule": {"name": "layerfusion"}}},
           claim="Sketch-Fusion SGD (Dai et al. 2024): Count Sketch compression is all-reducible and, with "
                 "LayerFusion, trains to the accuracy of top-k while its traffic per worker does not grow "
                 "with the number of workers.",
           reference="topk", scaling=("countsketch", "topk")),
]


def get(key: str) -> Preset:
    for p in PRESETS:
        if p.key == key:
            return p
    raise KeyError(f"preset: unknown key {key!r}; allowed: {', '.join(p.key for p in PRESETS)}")
