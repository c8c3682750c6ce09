"""One-click experiments for the Home page (and notebooks): each preset is a question and the runs that
answer it, as spec overrides on a small common base."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from engine.spec import SpecError

BASE = {"model": "cnn", "dataset": "digits", "world_size": 2, "steps": 150, "batch_size": 32,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "schedule": {"name": "bucket"},
        "comm": {"mode": "wfbp"}, "eval_every": 25}
TOPK_EF = {"name": "topk", "ratio": 0.01, "error_feedback": True}
RESNET = {"model": "resnet", "steps": 150, "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9}}
GBIT = {"link": "modeled", "gbps": 1}


@dataclass
class Preset:
    key: str
    title: str
    question: str
    variants: Dict[str, dict]
    """label -> spec overrides on top of BASE; one run per variant."""

    def specs(self) -> List[dict]:
        return [{**BASE, **v, "name": f"{self.key}: {label}"} for label, v in self.variants.items()]

    def check(self) -> Optional[str]:
        """None when every run of the preset is a valid spec, else the reason it is not available."""
        from lab.specs import load_spec
        for d in self.specs():
            try:
                load_spec(data=d)
            except SpecError as e:
                return str(e)
        return None


PRESETS = [
    Preset("layerwise-vs-mergecomp", "Layer-wise vs MergeComp",
           "resnet at a per-rank batch of 4 (GPU-like compute time), top-k 1% + EF: one bucket per tensor, "
           "against the split points MergeComp searches by measured step time.",
           {"mergecomp": {**RESNET, "batch_size": 4, "compressor": TOPK_EF,
                          "schedule": {"name": "mergecomp", "steps_per_candidate": 3, "max_candidates": 8}},
            "layerwise": {**RESNET, "batch_size": 4, "compressor": TOPK_EF, "schedule": {"name": "layerwise"}}}),
    Preset("dear-vs-ddp", "DeAR vs DDP",
           "resnet over a modeled 1 Gbit/s link: reduce-scatter during backward and all-gather during the "
           "next forward (DeAR), against DDP-style bucketed all-reduce overlapped with backward.",
           {"dear": {**RESNET, "steps": 80, "comm": {"mode": "dear", "cap_mb": 2}, "network": GBIT},
            "ddp": {**RESNET, "steps": 80, "comm": {"mode": "wfbp"}, "network": GBIT}}),
    Preset("compression-1gbit", "Does compression help on a 1 Gbit/s link?",
           "No compression, fp16 and top-k 1% over a modeled 1 Gbit/s link (alpha-beta delays in the "
           "communicator; no root needed). Compare accuracy against wall time.",
           {"none": {"network": {"link": "modeled", "gbps": 1}},
            "fp16": {"compressor": {"name": "fp16"}, "network": {"link": "modeled", "gbps": 1}},
            "topk": {"compressor": TOPK_EF, "network": {"link": "modeled", "gbps": 1}}}),
    Preset("countsketch-vs-topk", "Count Sketch vs top-k",
           "Count Sketch tables are summable, so they are all-reduced; top-k payloads are all-gathered. "
           "Same 1% budget, error feedback on both (Sketch-Fusion SGD).",
           {"countsketch": {"compressor": {"name": "countsketch", "ratio": 0.01, "error_feedback": True}},
            "topk": {"compressor": TOPK_EF}}),
    Preset("layerwise-vs-bucket", "Layer-wise vs bucketed",
           "Top-k (1%, error feedback) per layer or fused into 25 MB buckets: how much do many small "
           "messages and per-layer encoding cost? (MergeComp's question)",
           {"layerwise": {"compressor": TOPK_EF, "schedule": {"name": "layerwise"}},
            "bucket": {"compressor": TOPK_EF, "schedule": {"name": "bucket", "cap_mb": 25}}}),
]
