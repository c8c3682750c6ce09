"""One-click experiments for the Home page (and notebooks): each preset is a question, the runs that
answer it (spec overrides on a small common base), the paper's claim, and the effects whose measured
ratios decide the answer (see commlab.lab.analysis.results).

Every preset is tuned so that, on the 2-core machine this lab was built on, its runs train to a
useful accuracy and the whole preset finishes in about a minute (bench/presets.py measures both)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from commlab.engine import cluster
from commlab.engine.spec import SpecError
from commlab.lab.base.specs import load_spec

BASE = {"model": "cnn", "dataset": "digits", "world_size": 2, "steps": 150, "batch_size": 32,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "schedule": {"name": "bucket"},
        "comm": {"mode": "wfbp"}, "eval_every": 25}
TOPK_EF = {"name": "topk", "ratio": 0.01, "error_feedback": True}
TOPK5_EF = {**TOPK_EF, "ratio": 0.05}
# A narrow resnet: the same 62 gradient tensors as the default width, a fifth of the compute, so the
# per-tensor cost of layer-wise compression dominates as it does on a GPU. Adam trains it on digits in a
# few hundred steps; SGD with momentum does not get off 10% that fast. At a constant rate its held-out
# accuracy at step 400 swings by 5 points or more between seeds and partitions (top-k 1% on merged groups or per
# tensor alike); decayed to 0 along a cosine it ends within about 1.5 points. Fewer steps leave MergeComp's variant
# too far from layer-wise: at 250 steps it ended 2.3 points below (91.9% against 94.2%; 200 steps: 90.0-92.2%).
NARROW_RESNET = {"model": {"name": "resnet", "width": 8}, "batch_size": 8, "steps": 400,
                 "optimizer": {"name": "adam", "lr": 0.003, "decay": "cosine"}}
# Full-width resnet (11 MB of gradients) at a per-rank batch of 64: an 88 ms all-reduce on a 1 Gbit/s
# link against roughly as much compute, the regime where DeAR's two overlaps pay.
DEAR_BASE = {"model": "resnet", "batch_size": 64, "steps": 100, "optimizer": {"name": "adam", "lr": 0.002}}


def modeled(gbps: float) -> dict:
    return {"link": "modeled", "gbps": gbps}


@dataclass(frozen=True)
class Knob:
    """A value the preset card asks for with a slider (an integer); the preset's specs and bounds take it
    where they hold ``Use(name)``."""
    name: str
    label: str
    default: int
    lo: int
    hi: int
    help: str = ""


@dataclass(frozen=True)
class Use:
    """A knob's value, in a variant's spec overrides or an effect's bound."""
    knob: str


def fill(obj: Any, values: Dict[str, int]) -> Any:
    """``obj`` (spec overrides, a bound) with every ``Use`` replaced by its knob's value."""
    if isinstance(obj, Use):
        return values[obj.knob]
    if isinstance(obj, dict):
        return {k: fill(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fill(v, values) for v in obj]
    return obj


MEASURES = {"iteration": "median iteration time", "step_mean": "mean step time, syncs amortized",
            "exchanges": "steps that sent anything"}
"""What an effect's ratio compares (commlab.lab.analysis.results reads each from the runs)."""


@dataclass
class Effect:
    """A measured ratio, slower / faster (of median iteration times unless ``measure`` says otherwise), and
    the bound it must meet."""
    text: str
    """what it says, e.g. "MergeComp over layer-wise, per iteration\""""
    faster: str
    """the variant expected to be faster (or, with at_most, the one expected not to be)"""
    slower: str
    at_least: Union[float, Use, None] = None
    """the ratio must reach this (the paper's effect, scaled to what this machine can show); a knob's value
    with ``Use``"""
    at_most: Union[float, Use, None] = None
    """the ratio must not exceed this (an effect that should be absent, e.g. compression on a fast link)"""
    measure: str = "iteration"
    """one of ``MEASURES``: median iteration time, the mean step (a method's syncs amortized), or the count of
    steps that exchanged anything (fewer is "faster")"""

    def __post_init__(self):
        if self.measure not in MEASURES:
            raise ValueError(f"measure: {self.measure!r}; allowed: {', '.join(MEASURES)}")

    def bounds(self, values: Dict[str, int]) -> Tuple[Optional[float], Optional[float]]:
        """(at least, at most) with the knobs' values filled in."""
        return fill(self.at_least, values), fill(self.at_most, values)


@dataclass(frozen=True)
class Faults:
    """What a plug-pulling preset compares: ``unprotected`` runs without fault tolerance, so the worker's death
    must end it ``failed``; each (faulted, clean) pair is one fault-tolerant setting with the fault and without
    it, and the verdict sets them side by side (kills, recoveries, goodput, accuracy)."""
    unprotected: str
    pairs: Tuple[Tuple[str, str], ...]


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

    knobs: List[Knob] = field(default_factory=list)
    """values the preset card asks for (sliders), which ``variants`` and effect bounds take as ``Use``"""
    exchanges: Optional[Tuple[str, List[str]]] = None
    """(every-step variant, [methods]): the verdict counts each method's exchanges and bytes against the
    every-step one's, and the time each took to reach that one's final accuracy"""
    faults: Optional["Faults"] = None
    """a preset that pulls a worker's plug: which variant runs without fault tolerance (and must fail) and
    which faulted runs are set beside their fault-free twins"""

    def values(self, given: Optional[Dict[str, int]] = None) -> Dict[str, int]:
        """Every knob's value: ``given`` where it says, else the default. ValueError ``<knob>: ...`` for an
        unknown knob or a value out of its range."""
        given = dict(given or {})
        known = {k.name: k for k in self.knobs}
        for name in given:
            if name not in known:
                raise ValueError(f"{name}: preset {self.key} has no such knob; allowed: {', '.join(known) or 'none'}")
        out = {}
        for k in self.knobs:
            v = given.get(k.name, k.default)
            if isinstance(v, bool) or not isinstance(v, int) or not k.lo <= v <= k.hi:
                raise ValueError(f"{k.name}: must be an integer in {k.lo}..{k.hi}, got {v!r}")
            out[k.name] = v
        return out

    def specs(self, values: Optional[Dict[str, int]] = None) -> List[dict]:
        vals = self.values(values)
        return [{**BASE, **fill(v, vals), "name": f"{self.key}: {label}"} for label, v in self.variants.items()]

    def labels(self) -> List[str]:
        return list(self.variants)

    def check(self) -> Optional[str]:
        """None when every run of the preset is a valid spec (at the knobs' defaults and at each one's ends),
        else the reason it is not available."""
        for values in [{}] + [{k.name: v} for k in self.knobs for v in (k.lo, k.hi)]:
            for d in self.specs(values):
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
           {"dear": {**DEAR_BASE, "schedule": {"name": "bucket", "cap_mb": 2}, "comm": {"mode": "dear"},
                     "network": modeled(1)},
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


# cnn on digits over a modeled 0.1 Gbit/s link: every step's all-reduce costs about as much as the step's
# compute, so sending it once every H steps shows. DiLoCo's inner SGD runs at lr 0.02: at DDP's 0.05 the
# paper's outer Nesterov step (lr 0.7, momentum 0.9) overshoots within 150 steps.
LESS_OFTEN = {"network": modeled(0.1)}
H_KNOB = Knob("H", "H: steps between two syncs", 8, 2, 32,
              "local SGD averages the parameters, DiLoCo the pseudo-gradients, once every H steps; DDP all-reduces "
              "the gradients every step")

PRESETS.append(
    Preset("less-often", "Communicate less often: local SGD and DiLoCo",
           "A CNN on digits over a modeled 0.1 Gbit/s link: DDP all-reduces every step's gradients; local SGD "
           "averages the parameters every H steps; DiLoCo averages the pseudo-gradients every H steps and takes "
           "an outer Nesterov step. Slide H and watch the exchanges, the time and the accuracy move.",
           {"DDP": {**LESS_OFTEN},
            "local SGD": {**LESS_OFTEN, "method": {"name": "local_sgd", "H": Use("H")}},
            "DiLoCo": {**LESS_OFTEN, "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
                       "method": {"name": "diloco", "H": Use("H"), "outer_lr": 0.7, "outer_momentum": 0.9}}},
           claim="DiLoCo (Douillard et al. 2023) reaches synchronous training's accuracy with H times fewer "
                 "exchanges (8 workers matched it with 500x less communication), so on a slow link it finishes "
                 "sooner; Lin et al. (2018) found the same for local SGD's periodic averaging.",
           reference="DDP",
           effects=[Effect("DiLoCo against DDP, exchanges", "DiLoCo", "DDP", at_least=Use("H"), measure="exchanges"),
                    Effect("DiLoCo against DDP, mean step (its syncs amortized)", "DiLoCo", "DDP", at_least=1.2,
                           measure="step_mean"),
                    Effect("local SGD against DDP, mean step (its syncs amortized)", "local SGD", "DDP",
                           at_least=1.2, measure="step_mean")],
           knobs=[H_KNOB], exchanges=("DDP", ["local SGD", "DiLoCo"])))


# A CNN on digits on two workers an ocean apart: America and Asia, two of the three_continents cluster preset's
# regions (modeled links, each worker its own rate and delay; commlab/engine/cluster.py), Asia's link the slower.
# Every step's all-reduce waits for two ring steps of 85 ms each way, about 0.25 s against 0.03 s of compute, so DDP
# runs several times slower than in a datacenter while DiLoCo pays the crossing once every H steps. 60 steps keep
# the preset near a minute (DDP across the ocean is most of it). DiLoCo's inner SGD is DDP's; its outer Nesterov
# momentum is 0.6 (MuLoCo's setting): with the paper's 0.9 its six outer steps of H = 10 ended up to 5 points below
# DDP in 60 steps here, with 0.6 within one.
_REGIONS = cluster.PRESETS["three_continents"]["workers"]
OCEAN = {"link": "modeled", "cluster": {"workers": [dict(_REGIONS[0]), dict(_REGIONS[2])]}}
WIDE = {"steps": 60, "eval_every": 20, "network": OCEAN}
WIDE_H = Knob("H", "H: steps between two syncs", 10, 2, 30,
              "DiLoCo averages the pseudo-gradients once every H steps; DDP all-reduces the gradients every step")

PRESETS.append(
    Preset("across-the-internet", "Across the internet: DDP and DiLoCo between America and Asia",
           "A CNN on digits on two workers, one in America and one in Asia on a slower link (two regions of the "
           "three_continents cluster), over modeled wide-area links: DDP all-reduces every step's gradients "
           "across the ocean; DiLoCo trains H steps on each worker and syncs once. The same DDP in a datacenter "
           "shows what the distance costs.",
           {"DDP, datacenter": {**WIDE, "network": {"link": "modeled", "cluster": "datacenter"}},
            "DDP, across the ocean": {**WIDE},
            "DiLoCo, across the ocean": {**WIDE, "method": {"name": "diloco", "H": Use("H"), "outer_lr": 0.7,
                                                            "outer_momentum": 0.6}}},
           claim="DiLoCo (Douillard et al. 2023) matched synchronous training with 500x less communication; "
                 "INTELLECT-1 (Prime Intellect 2024) trained a 10B model across three continents with it. Across "
                 "the internet a per-step method pays every round's delay on every step.",
           reference="DDP, across the ocean",
           effects=[Effect("DDP: across the ocean against a datacenter, per iteration (what distance costs)",
                           "DDP, datacenter", "DDP, across the ocean", at_least=3.0),
                    Effect("DiLoCo against DDP across the ocean, mean step (its syncs amortized)",
                           "DiLoCo, across the ocean", "DDP, across the ocean", at_least=2.0, measure="step_mean"),
                    Effect("DiLoCo against DDP across the ocean, exchanges", "DiLoCo, across the ocean",
                           "DDP, across the ocean", at_least=Use("H"), measure="exchanges")],
           accuracy_floor=0.9, knobs=[WIDE_H], exchanges=("DDP, across the ocean", ["DiLoCo, across the ocean"])))


# A CNN on digits on two workers, each its own replica group on torchft (commlab/engine/ft.py): worker 1 dies at
# step KILL_AT. Without fault tolerance its rank exits and the run fails, as a torchrun job does. With it the lab
# restarts the dead worker half a second later; the restarted worker takes the live one's model and optimizer state
# and both train on. With two workers the survivor cannot go on alone: torchft's Lighthouse forms a quorum only of
# more than half the replicas that still heartbeat (a split-brain guard), and min_replicas 2 says so outright, so it
# waits for the restart (its half-second delay, the warm server's fork and the recovery). Per-step sync waits at the
# next step; DiLoCo trains on locally until its next sync and waits there, and loses the dead worker's inner steps
# since the last sync. Each faulted run is held to its fault-free twin's accuracy (what the kill cost), not DiLoCo to
# per-step sync's.
KILL_AT = 40
PLUG = {"steps": 120, "eval_every": 40, "comm": {"mode": "sync"}}
PLUG_FT = {"enabled": True, "min_replicas": 2, "join_timeout_ms": 500, "timeout_s": 20,
           "restart": {"max_restarts": 1, "delay_s": 0.5}}
PLUG_KILL = {**PLUG_FT, "faults": [{"kind": "kill", "replica": 1, "step": KILL_AT, "restart_after_s": 0.5}]}
PLUG_DILOCO = {"optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
               "method": {"name": "diloco", "H": 8, "outer_lr": 0.7, "outer_momentum": 0.9}}

PRESETS.append(
    Preset("pull-the-plug", "Pull the plug: a worker dies mid-training",
           f"A CNN on digits on two workers; worker 1 is killed at step {KILL_AT}. Without fault tolerance the run "
           f"fails, as a torch DDP job does. On torchft the lab restarts the dead worker, which takes its peer's "
           f"state and rejoins; the survivor, one of two, may not train on alone and waits (per-step sync at once, "
           f"DiLoCo at its next sync). Per-step sync and DiLoCo (H = 8), each set beside the same run without the "
           f"kill: what the kill cost each in time and accuracy.",
           {"no fault tolerance, a kill": {**PLUG, "fault": {"kind": "exit", "rank": 1, "step": KILL_AT}},
            "per-step sync, a kill": {**PLUG, "fault_tolerance": PLUG_KILL},
            "per-step sync, no fault": {**PLUG, "fault_tolerance": PLUG_FT},
            "DiLoCo, a kill": {**PLUG, **PLUG_DILOCO, "fault_tolerance": PLUG_KILL},
            "DiLoCo, no fault": {**PLUG, **PLUG_DILOCO, "fault_tolerance": PLUG_FT}},
           claim="torchft (Meta 2025) and INTELLECT-1 (Prime Intellect 2024) keep training when a worker dies: the "
                 "survivors go on, the restarted worker recovers from a live peer; INTELLECT-1 used 83-96% of its "
                 "compute with workers joining and leaving across three continents.",
           reference="per-step sync, no fault",
           faults=Faults("no fault tolerance, a kill", (("per-step sync, a kill", "per-step sync, no fault"),
                                                        ("DiLoCo, a kill", "DiLoCo, no fault")))))


def get(key: str) -> Preset:
    for p in PRESETS:
        if p.key == key:
            return p
    raise KeyError(f"preset: unknown key {key!r}; allowed: {', '.join(p.key for p in PRESETS)}")
