"""The job spec: a tree of dataclasses with defaults, checked before anything starts.

A spec comes from YAML or JSON (``lab`` reads the file) as a plain dict.
``JobSpec.from_dict`` rejects unknown keys, wrong types, out-of-range values and
impossible combinations with a ``SpecError`` whose one-line message names the
field and what is allowed. ``to_dict`` gives the fully defaulted form that is
written to ``spec.json``; ``from_dict(to_dict(s)) == s``.

Fields that name code by import path (commlab.engine.codepath.code_fields) are imported while checking, except
in a process that serves viewers (commlab.engine.codepath.forbid_imports_when), where their syntax is checked.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from commlab.engine.codepath import check_path, imports_allowed, is_import_path


class SpecError(ValueError):
    """A bad spec. ``str(e)`` is one line: ``<field>: <problem>``."""

    def __init__(self, path: str, msg: str):
        self.path, self.msg = path, msg
        super().__init__(f"{path}: {msg}" if path else msg)


# What the engine can do today. The names the contract fixes that are not here
# yet are rejected with a message saying so, instead of silently falling back.
SCHEDULES_AVAILABLE = ("layerwise", "allinone", "bucket", "mergecomp", "layerfusion")
SCHEDULES_PLANNED = ()
COMM_AVAILABLE = ("sync", "wfbp", "dear")
COMM_PLANNED = ()
DEAR_CAP_MB = 25.0
"""dear's buffer cap when the spec gives neither comm.cap_mb, comm.layers nor comm.tune."""
DEAR_TUNE_STEPS = 5
"""dear with comm.tune: measured iterations per trial cap when comm.tune_steps is not given."""
LINKS_AVAILABLE = ("loopback", "shaped", "modeled")
LINKS_PLANNED = ()


@dataclass
class ModelSpec:
    name: str = "cnn"
    """A model of the zoo (mlp | cnn | resnet | transformer, commlab/engine/models.py), torchvision:<arch>,
    hf:<model_type> (a transformers causal LM from its config), or package.module:factory."""
    options: dict = field(default_factory=dict)
    """Keyword arguments for the model builder, e.g. {width: 64} for resnet, {n_layer: 4} for hf:gpt2."""
    loss: Optional[str] = None
    """package.module:fn taking (model output, y) and returning a scalar; default: cross entropy
    (per image, or per next token)."""

    def __post_init__(self):
        from commlab.engine import external, models
        try:
            if external.is_external(self.name):
                external.check_model(self.name)  # unknown architecture or import failure: one line, now
            else:
                models.kind(self.name)
            if self.loss is not None:
                external.check_import(self.loss, "model.loss")
        except ValueError as e:
            field_, _, msg = str(e).partition(": ")
            raise SpecError(field_ if field_.startswith("model.") else "model.name", msg or str(e)) from None


DATASETS = ("digits", "mnist", "text", "synthetic")


@dataclass
class DataSpec:
    name: str = "digits"
    """A data set that needs no download (digits | mnist | text | synthetic, commlab/engine/data.py), or
    package.module:loader returning (train, held_out) map-style data sets of (x, y) items."""
    shape: Optional[list] = None
    """synthetic only: image shape [C, H, W], default [3, 32, 32]."""
    classes: Optional[int] = None
    """synthetic only: number of classes, default 10."""
    size: Optional[int] = None
    """synthetic only: training examples (or token windows), default 2048."""
    block: Optional[int] = None
    """text, or synthetic with vocab: context length in tokens, default 64."""
    vocab: Optional[int] = None
    """synthetic only: make token sequences of this vocabulary (for language models) instead of images."""
    options: dict = field(default_factory=dict)
    """A package.module:loader only: its keyword arguments."""

    @property
    def kind(self) -> Optional[str]:
        """"image" or "text"; None for a user loader (its first item decides)."""
        if ":" in self.name:
            return None
        return "text" if self.name == "text" or self.vocab is not None else "image"

    def __post_init__(self):
        if ":" in self.name:
            for key in ("shape", "classes", "size", "block", "vocab"):
                if getattr(self, key) is not None:
                    raise SpecError(f"dataset.{key}", f"a loader takes its arguments as dataset options, not {key}")
            from commlab.engine import external
            try:
                external.check_import(self.name, "dataset.name")
            except ValueError as e:
                raise SpecError("dataset.name", str(e).partition(": ")[2]) from None
            return
        if self.name not in DATASETS:
            raise SpecError("dataset.name", f"unknown data set {self.name!r}; allowed: {', '.join(DATASETS)}, "
                                            f"package.module:loader")
        if self.options:
            raise SpecError("dataset.options", "only a package.module:loader takes options")
        if self.vocab is not None:
            if self.name != "synthetic":
                raise SpecError("dataset.vocab", "only the synthetic data set takes vocab")
            if not 2 <= self.vocab <= 1_000_000:
                raise SpecError("dataset.vocab", f"must be in 2..1000000, got {self.vocab}")
            for key in ("shape", "classes"):
                if getattr(self, key) is not None:
                    raise SpecError(f"dataset.{key}", "synthetic tokens (vocab) take no image shape or classes")
        if self.shape is not None:
            if self.name != "synthetic":
                raise SpecError("dataset.shape", "only the synthetic data set takes a shape")
            if len(self.shape) != 3 or not all(isinstance(d, int) and 1 <= d <= 1024 for d in self.shape):
                raise SpecError("dataset.shape", f"must be [C, H, W] with integers in 1..1024, got {self.shape}")
        for key, lo, hi, owner in (("classes", 2, 10000, "synthetic"), ("size", 16, 10_000_000, "synthetic"),
                                   ("block", 2, 4096, "text")):
            v = getattr(self, key)
            if v is None:
                continue
            if key == "block" and self.name == "synthetic" and self.vocab is not None:
                pass  # synthetic tokens have a context length too
            elif self.name != owner:
                raise SpecError(f"dataset.{key}", f"only the {owner} data set (or synthetic with vocab) takes {key}"
                                if key == "block" else f"only the {owner} data set takes {key}")
            if not lo <= v <= hi:
                raise SpecError(f"dataset.{key}", f"must be in {lo}..{hi}, got {v}")


@dataclass
class OptimizerSpec:
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    """A stock torch.optim optimizer; the engine hands it averaged gradients."""
    lr: float = 0.05
    momentum: float = 0.0
    """sgd only."""
    weight_decay: float = 0.0
    betas: Optional[list] = None
    """adam/adamw only, default [0.9, 0.999]."""

    def __post_init__(self):
        if not 0 < self.lr <= 10:
            raise SpecError("optimizer.lr", f"must be in (0, 10], got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise SpecError("optimizer.momentum", f"must be in [0, 1), got {self.momentum}")
        if self.momentum and self.name != "sgd":
            raise SpecError("optimizer.momentum", f"only sgd takes momentum (got optimizer {self.name}); use betas")
        if self.weight_decay < 0:
            raise SpecError("optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        if self.betas is not None:
            if self.name == "sgd":
                raise SpecError("optimizer.betas", "only adam and adamw take betas")
            if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
                raise SpecError("optimizer.betas", f"must be two numbers in [0, 1), got {self.betas}")


@dataclass
class CompressorSpec:
    name: str = "none"
    """A name from commlab.engine.compressors.names(), or package.module:Class naming a subclass of
    commlab.Compressor (its parameters are checked against its declared ``params``, as a built-in's)."""
    error_feedback: bool = False
    """Add the residual before compressing and keep what was dropped."""
    params: dict = field(default_factory=dict)
    """The compressor's own keyword parameters (ratio, levels, rank, ...).
    In YAML they may be written inline: {name: topk, ratio: 0.01}."""
    per_bucket: list = field(default_factory=list)
    """Mixed strategies: rules tried in order, each a compressor section (name, error_feedback, its
    parameters inline or under params) with ``below_mb``: a bucket whose gradient bytes are under
    below_mb (MB = 2**20 bytes) takes the first such rule's compressor; the others take name/params
    above. E.g. [{below_mb: 1, name: none}] with name powersgd, rank 4: small buckets uncompressed,
    the rest PowerSGD. Each bucket has its own instance and state (commlab/engine/compressors/plan.py).
    spec.json holds the rules fully defaulted (params under params)."""

    def __post_init__(self):
        _check_compressor("compressor", self.name, self.error_feedback, self.params)
        self.per_bucket = [_bucket_rule(r, i, self.per_bucket[:i]) for i, r in enumerate(self.per_bucket)]


def _check_compressor(where: str, name: Any, error_feedback: bool, params: dict) -> None:
    """A compressor section's name and parameters, as the registry would make it: ``<where>.name`` for the
    name, ``<where>`` with the parameter's own message otherwise. A class named by import path is imported
    and held to its declared parameters, except where this process may not import (it serves viewers):
    there its syntax is checked, and the rest where the run is queued (a child with limits, commlab.lab.base.sandbox)."""
    from commlab.engine import compressors  # the registry validates names and parameters (and pulls in torch)
    if not isinstance(name, str):
        raise SpecError(f"{where}.name", f"must be a compressor name or package.module:Class, got {name!r}")
    if is_import_path(name) and not imports_allowed():
        try:
            check_path(name, f"{where}.name")
        except ValueError as e:
            raise SpecError(f"{where}.name", str(e).partition(": ")[2]) from None
        return
    try:
        compressors.resolve(name, f"{where}.name")
    except ValueError as e:
        raise SpecError(f"{where}.name", str(e).partition(": ")[2]) from None
    try:
        compressors.check(name, error_feedback=error_feedback, **params)
    except ValueError as e:
        raise SpecError(where, str(e)) from None


def _bucket_rule(rule: Any, i: int, earlier: list) -> dict:
    """One ``compressor.per_bucket`` rule, checked and in its full form (below_mb, name, error_feedback, params)."""
    where = f"compressor.per_bucket[{i}]"
    if not isinstance(rule, dict):
        raise SpecError(where, f"must be a mapping like {{below_mb: 1, name: none}}, got {rule!r}")
    if "per_bucket" in rule:
        raise SpecError(f"{where}.per_bucket", "a rule cannot hold rules of its own")
    below = rule.get("below_mb")
    if isinstance(below, bool) or not isinstance(below, (int, float)) or not 0 < below <= 4096:
        raise SpecError(f"{where}.below_mb", f"must be a number in (0, 4096] (MB of gradient), got {below!r}")
    for j, e in enumerate(earlier):
        if e["below_mb"] >= below:
            raise SpecError(f"{where}.below_mb", f"never matches: rule {j} (below_mb {e['below_mb']:g}) takes every "
                                                 f"bucket under {below:g} MB first; give rules in increasing below_mb")
    name = rule.get("name")
    ef = rule.get("error_feedback", False)
    if not isinstance(ef, bool):
        raise SpecError(f"{where}.error_feedback", f"must be true or false, got {ef!r}")
    params = rule.get("params") or {}
    if not isinstance(params, dict):
        raise SpecError(f"{where}.params", f"must be a mapping, got {params!r}")
    params = {**params, **{k: v for k, v in rule.items() if k not in ("below_mb", "name", "error_feedback", "params")}}
    _check_compressor(where, name, ef, params)
    return {"below_mb": float(below), "name": name, "error_feedback": ef, "params": params}


# schedule option -> (the schedule that takes it, default, lowest, highest)
_SCHEDULE_OPTIONS = {
    "warmup_steps": ("mergecomp", 2, 0, 1000),
    "steps_per_candidate": ("mergecomp", 5, 1, 1000),
    "max_groups": ("mergecomp", 8, 1, 1024),
    "max_candidates": ("mergecomp", 24, 1, 1000),
    "retune": ("mergecomp", False, None, None),
    "profile_steps": ("layerfusion", 3, 1, 1000),
}


@dataclass
class ScheduleSpec:
    name: str = "bucket"
    """How gradients are fused into buckets: layerwise | allinone | bucket | mergecomp | layerfusion."""
    cap_mb: float = 25.0
    """bucket only: the byte cap of a bucket in MB (2**20 bytes), as DDP's bucket_cap_mb."""
    warmup_steps: Optional[int] = None
    """mergecomp only (default 2): steps before the first candidate is timed."""
    steps_per_candidate: Optional[int] = None
    """mergecomp only (default 5): timed steps per candidate partition; their median counts."""
    max_groups: Optional[int] = None
    """mergecomp only (default 8): the largest number of groups the search tries."""
    max_candidates: Optional[int] = None
    """mergecomp only (default 24): the search measures at most this many partitions."""
    retune: Optional[bool] = None
    """mergecomp only (default false): search again even if the cache beside the runs has an answer."""
    profile_steps: Optional[int] = None
    """layerfusion only (default 3): steps whose per-layer ready times are profiled."""

    def __post_init__(self):
        allowed = SCHEDULES_AVAILABLE + SCHEDULES_PLANNED
        if self.name not in allowed:
            raise SpecError("schedule.name", f"unknown schedule {self.name!r}; allowed: {', '.join(allowed)}")
        if self.name in SCHEDULES_PLANNED:
            raise SpecError("schedule.name", f"{self.name!r} is not implemented yet; available: {', '.join(SCHEDULES_AVAILABLE)}")
        if not 0 < self.cap_mb <= 4096:
            raise SpecError("schedule.cap_mb", f"must be in (0, 4096], got {self.cap_mb}")
        for key, (owner, default, lo, hi) in _SCHEDULE_OPTIONS.items():
            v = getattr(self, key)
            if v is None:
                if self.name == owner:
                    setattr(self, key, default)  # the spec written to spec.json is fully defaulted
                continue
            if self.name != owner:
                raise SpecError(f"schedule.{key}", f"only the {owner} schedule takes {key}, not {self.name}")
            if lo is not None and not lo <= v <= hi:
                raise SpecError(f"schedule.{key}", f"must be in {lo}..{hi}, got {v}")


@dataclass
class CommSpec:
    mode: str = "wfbp"
    """sync (all buckets after backward) | wfbp (each bucket as soon as it is ready) | dear
    (reduce-scatter in backward, all-gather before each buffer's next forward)."""
    cap_mb: Optional[float] = None
    """dear only: byte cap of a fused buffer in MB (default 25 when neither layers nor tune is set,
    written into spec.json)."""
    layers: Optional[int] = None
    """dear only: fuse this many nearby layers per buffer instead of a byte cap."""
    tune: bool = False
    """dear only: search the buffer cap online by measured iteration time (rank 0 decides)."""
    tune_steps: Optional[int] = None
    """dear with tune only: iterations measured per trial cap (default 5, written into spec.json; the
    first of each is not counted)."""

    def __post_init__(self):
        allowed = COMM_AVAILABLE + COMM_PLANNED
        if self.mode not in allowed:
            raise SpecError("comm.mode", f"unknown mode {self.mode!r}; allowed: {', '.join(allowed)}")
        if self.mode in COMM_PLANNED:
            raise SpecError("comm.mode", f"{self.mode!r} is not implemented yet; available: {', '.join(COMM_AVAILABLE)}")
        if self.mode != "dear":
            for key in ("cap_mb", "layers", "tune_steps"):
                if getattr(self, key) is not None:
                    raise SpecError(f"comm.{key}", f"only comm.mode dear takes {key} (other modes fuse by schedule)")
            if self.tune:
                raise SpecError("comm.tune", "only comm.mode dear takes tune")
            return
        if self.cap_mb is not None and not 0 < self.cap_mb <= 4096:
            raise SpecError("comm.cap_mb", f"must be in (0, 4096], got {self.cap_mb}")
        if self.layers is not None and not 1 <= self.layers <= 100_000:
            raise SpecError("comm.layers", f"must be in 1..100000, got {self.layers}")
        if sum((self.cap_mb is not None, self.layers is not None, self.tune)) > 1:
            raise SpecError("comm.layers" if self.layers is not None else "comm.tune",
                            "give one of cap_mb, layers or tune")
        if self.tune_steps is not None:
            if not self.tune:
                raise SpecError("comm.tune_steps", "needs comm.tune: true")
            if not 2 <= self.tune_steps <= 1000:
                raise SpecError("comm.tune_steps", f"must be in 2..1000, got {self.tune_steps}")
        # the spec written to spec.json is fully defaulted: it says what the run used
        if self.tune and self.tune_steps is None:
            self.tune_steps = DEAR_TUNE_STEPS
        if not self.tune and self.layers is None and self.cap_mb is None:
            self.cap_mb = DEAR_CAP_MB


MAX_GBPS = 400.0
"""The highest rate (Gbit/s) of a shaped or modeled link; the advice, ``commlab predict`` and its clusters'
inter-node links keep to the same range, so a rate one command takes the others take too."""


@dataclass
class NetworkSpec:
    link: str = "loopback"
    """loopback | shaped (tc on an emulated cluster) | modeled (alpha-beta delay)."""
    gbps: Optional[float] = None
    latency_us: Optional[float] = None

    def __post_init__(self):
        allowed = LINKS_AVAILABLE + LINKS_PLANNED
        if self.link not in allowed:
            raise SpecError("network.link", f"unknown link {self.link!r}; allowed: {', '.join(allowed)}")
        if self.link in LINKS_PLANNED:
            raise SpecError("network.link", f"{self.link!r} is not implemented yet; available: {', '.join(LINKS_AVAILABLE)}")
        if self.link == "loopback" and (self.gbps is not None or self.latency_us is not None):
            raise SpecError("network.gbps", "a loopback link takes no gbps or latency_us")
        if self.link in ("shaped", "modeled"):
            if self.gbps is None or not 0.001 <= self.gbps <= MAX_GBPS:
                raise SpecError("network.gbps", f"a {self.link} link needs gbps in [0.001, {MAX_GBPS:g}], "
                                                f"got {self.gbps}")
        if self.latency_us is not None:
            if self.link != "modeled":
                raise SpecError("network.latency_us", "only a modeled link takes latency_us (shaped links have "
                                                      "the real latency of the emulated cluster)")
            if not 0 <= self.latency_us <= 1e6:
                raise SpecError("network.latency_us", f"must be in [0, 1000000], got {self.latency_us}")


# strategy option -> (default with mode auto, lowest, highest)
_STRATEGY_OPTIONS = {"measure": (True, None, None), "trials": (3, 1, 20), "trial_steps": (8, 4, 1000)}


@dataclass
class StrategySpec:
    """Who chooses the compressor, schedule and comm: the spec (fixed) or the lab's advisor (auto)."""
    mode: Literal["fixed", "auto"] = "fixed"
    """fixed: compressor, schedule and comm as written. auto: the lab runs its advisor (commlab/lab/strategy/advisor.py) at
    the start of the run, on the run's link, and writes its choice into spec.json before any rank starts;
    the candidates, trials and decision go to tuning.json."""
    measure: Optional[bool] = None
    """auto only (default true): run short trials of the top candidates and choose by measurement."""
    trials: Optional[int] = None
    """auto only (default 3): candidates tried."""
    trial_steps: Optional[int] = None
    """auto only (default 8): steps per trial (PowerSGD's uncompressed start is added)."""
    penalties: dict = field(default_factory=dict)
    """auto only: declared convergence penalties, compressor name (or the advisor's key) -> steps to
    accuracy relative to none, e.g. {topk: 1.3}."""
    decided: bool = False
    """Set by the lab when auto has chosen: compressor, schedule and comm are then the advisor's choice
    and a run of this spec uses them as they are."""

    def __post_init__(self):
        auto = self.mode == "auto"
        for key, (default, lo, hi) in _STRATEGY_OPTIONS.items():
            v = getattr(self, key)
            if v is None:
                if auto:
                    setattr(self, key, default)  # spec.json says what the advisor was asked to do
                continue
            if not auto:
                raise SpecError(f"strategy.{key}", "only strategy.mode auto takes it")
            if lo is not None and not lo <= v <= hi:
                raise SpecError(f"strategy.{key}", f"must be in {lo}..{hi}, got {v}")
        if not auto and (self.penalties or self.decided):
            raise SpecError("strategy.penalties" if self.penalties else "strategy.decided",
                            "only strategy.mode auto takes it")
        for k, v in self.penalties.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.1 <= v <= 100:
                raise SpecError(f"strategy.penalties.{k}", f"must be a number in [0.1, 100], got {v!r}")


@dataclass
class MethodSpec:
    """How often ranks communicate: every step's gradients (none), or a method's own exchanges
    (commlab/engine/methods/): local_sgd, post_local_sgd, diloco, streaming_diloco, demo, or package.module:Class."""
    name: str = "none"
    """none (the default: the communicator averages every step's gradients) | a name from
    commlab.engine.methods.names() | package.module:Class (a subclass of commlab.engine.methods.base.Method)."""
    params: dict = field(default_factory=dict)
    """The method's own parameters (H, outer_lr, outer_momentum, warmup, fragments, tau, alpha, ...). In YAML
    they may be written inline: {name: diloco, H: 50}. spec.json holds every one, defaulted (streaming_diloco's
    alpha, the local fragment's weight when mixed with the new global one: 0.5 with tau > 0, 0 with tau 0)."""
    compressor: dict = field(default_factory=dict)
    """The compressor of the method's exchanges (diloco, streaming_diloco: the pseudo-gradients), a
    compressor section as the top-level one: {name: topk, ratio: 0.01, error_feedback: true}. Default none;
    spec.json holds it fully defaulted for a method that takes one."""

    def __post_init__(self):
        from commlab.engine import methods  # lazy: the methods pull in torch
        if self.name == methods.NONE:
            if self.params:
                raise SpecError(f"method.{next(iter(self.params))}", "method none takes no parameters")
            if self.compressor:
                raise SpecError("method.compressor", "method none has no exchange of its own; the top-level "
                                                     "compressor compresses the gradients")
            return
        if is_import_path(self.name) and not imports_allowed():
            try:
                check_path(self.name, "method.name")  # a viewer's process: the syntax only
            except ValueError as e:
                raise SpecError("method.name", str(e).partition(": ")[2]) from None
            return
        try:
            m = methods.make(self.name, **self.params)
        except ValueError as e:
            where, _, msg = str(e).partition(": ")
            raise SpecError(f"method.{where}", msg) from None
        self.params = m.values()  # spec.json says what the run used
        if self.compressor and not m.takes_compressor:
            takers = [n for n in methods.names()[1:] if methods.resolve(n).takes_compressor]
            raise SpecError("method.compressor", f"{self.name} exchanges nothing a compressor applies to; "
                                                 f"methods that take one: {', '.join(takers)}")
        if m.takes_compressor:
            comp = _build(CompressorSpec, _compressor_shorthand(self.compressor), "method.compressor",
                          prefix="method.")
            self.compressor = dataclasses.asdict(comp)

    def build(self):
        """The method's instance (commlab.engine.methods.base.Method), or None for none."""
        from commlab.engine import methods  # lazy: the methods pull in torch
        return None if self.name == methods.NONE else methods.make(self.name, **self.params)


@dataclass
class FaultSpec:
    """Fault injection, for testing how the lab handles failing runs."""
    kind: Literal["none", "raise", "exit", "nan"] = "none"
    """raise: an exception in the rank; exit: the rank process dies without a word (os._exit);
    nan: the rank's loss becomes NaN (the run must stop as diverged)."""
    step: int = 0
    """The step at which the fault fires."""
    rank: int = 0
    at: Literal["start", "sync"] = "start"
    """start: at the start of the step; sync: right after the method's exchange of that step is issued
    (a rank dies mid-sync while the others wait in it)."""

    def __post_init__(self):
        if self.step < 0:
            raise SpecError("fault.step", f"must be >= 0, got {self.step}")
        if self.rank < 0:
            raise SpecError("fault.rank", f"must be >= 0, got {self.rank}")
        if self.at == "sync" and self.kind == "nan":
            raise SpecError("fault.at", "sync takes kind raise or exit (a NaN loss happens at a step's start)")


@dataclass
class JobSpec:
    name: str = "run"
    """Free text; also the start of the run id."""
    model: ModelSpec = field(default_factory=ModelSpec)
    dataset: DataSpec = field(default_factory=DataSpec)
    world_size: int = 2
    """Number of ranks (processes)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl on GPU, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    steps: int = 300
    batch_size: int = 32
    """Per rank."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    seed: int = 0
    compressor: CompressorSpec = field(default_factory=CompressorSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    comm: CommSpec = field(default_factory=CommSpec)
    network: NetworkSpec = field(default_factory=NetworkSpec)
    eval_every: int = 50
    """Evaluate on the held-out split every N steps (and at the end). 0: only at the end."""
    final_eval: bool = True
    """Evaluate at the end. The lab's profiling runs turn it off: they are timed steps only, and the
    transformer's held-out split takes longer to evaluate than 20 steps take to train."""
    threads: int = 0
    """torch threads per rank; 0 picks cores // world_size (at least 1)."""
    timeline: bool = True
    """Record per-layer timeline spans (cheap: the DDP benchmark measures their overhead, docs/benchmarks)."""
    fault: FaultSpec = field(default_factory=FaultSpec)
    """Testing only: make one rank fail at one step."""
    strategy: StrategySpec = field(default_factory=StrategySpec)
    """fixed (as written) or auto (the lab's advisor chooses compressor, schedule and comm)."""
    method: MethodSpec = field(default_factory=MethodSpec)
    """none (every step's gradients) or a method that communicates less often (commlab/engine/methods/)."""

    def __post_init__(self):
        if len(self.name) > MAX_NAME:
            raise SpecError("name", f"at most {MAX_NAME} characters, got {len(self.name)}")
        if not 1 <= self.world_size <= 1024:
            raise SpecError("world_size", f"must be in 1..1024, got {self.world_size}")
        if not 1 <= self.steps <= 10_000_000:
            raise SpecError("steps", f"must be in 1..10000000, got {self.steps}")
        if not 1 <= self.batch_size <= 65536:
            raise SpecError("batch_size", f"must be in 1..65536, got {self.batch_size}")
        if not 0 <= self.eval_every <= 10_000_000:
            raise SpecError("eval_every", f"must be >= 0, got {self.eval_every}")
        if not 0 <= self.threads <= 1024:
            raise SpecError("threads", f"must be in 0..1024, got {self.threads}")
        if self.seed < 0:
            raise SpecError("seed", f"must be >= 0, got {self.seed}")
        if self.fault.kind != "none" and self.fault.rank >= self.world_size:
            raise SpecError("fault.rank", f"must be below world_size {self.world_size}, got {self.fault.rank}")
        if self.backend == "nccl" and self.device == "cpu":
            raise SpecError("backend", "nccl needs device cuda (or auto); use gloo on cpu")
        if self.strategy.mode == "auto" and not self.strategy.decided:
            if (self.compressor, self.schedule, self.comm) != (CompressorSpec(), ScheduleSpec(), CommSpec()):
                raise SpecError("strategy.mode", "auto chooses compressor, schedule and comm; leave them out")
            if self.network.link == "loopback":
                raise SpecError("strategy.mode", "auto plans for a link rate: use network.link modeled or "
                                                 "shaped with gbps (loopback has none)")
        if self.comm.mode == "dear":
            from commlab.engine import compressors
            from commlab.engine.compressors.plan import make_section, parts
            c = self.compressor
            for i, part in enumerate(parts(dataclasses.asdict(c))):
                if is_import_path(part["name"]) and not imports_allowed():
                    continue  # checked where the run is queued, in a child that may import it (commlab.lab.base.sandbox)
                problem = make_section(part).shard_problem()
                if problem:
                    where = f"compressor.per_bucket[{i}].name" if i < len(c.per_bucket) else "compressor.name"
                    raise SpecError(where, f"comm.mode dear reduce-scatters the payload, so it needs a single-round "
                                           f"compressor that is summable and keeps the gradient's shape, or a "
                                           f"shard codec; {part['name']} {problem}; allowed: "
                                           f"{', '.join(compressors.shardable())}")
            if self.schedule != ScheduleSpec():
                raise SpecError("schedule", "comm.mode dear fuses by comm.cap_mb, comm.layers or comm.tune; "
                                            "leave schedule at its default (bucket, cap_mb 25)")
        from commlab.engine import models  # local import: models pulls in torch
        if not models.compatible(self.model.name, self.dataset.kind):
            want = ("token data (the text data set, or synthetic with vocab)" if models.kind(self.model.name) == "text"
                    else "an image data set (digits, mnist, synthetic)")
            raise SpecError("model.name", f"{self.model.name} needs {want}, got dataset {self.dataset.name}")
        side = models.MIN_SIDE.get(self.model.name)
        if side and self.dataset.shape and min(self.dataset.shape[1:]) < side:
            h, w = self.dataset.shape[1:]
            raise SpecError("dataset.shape", f"{self.model.name} takes images of at least {side}x{side}, got {h}x{w}")
        if self.model.name.startswith("torchvision:") and self.dataset.kind == "image":
            channels = 1 if self.dataset.name in ("digits", "mnist") else (self.dataset.shape or [3])[0]
            if channels != 3:
                raise SpecError("dataset", f"{self.model.name} takes 3-channel images, {self.dataset.name} has "
                                           f"{channels}; use {{name: synthetic, shape: [3, 64, 64], classes: 10}}")

        self._check_method()

    def _check_method(self) -> None:
        """The combinations a method allows (commlab/engine/methods/); fault.at sync needs a sync at fault.step."""
        m = None if is_import_path(self.method.name) and not imports_allowed() \
            else self.method.build()
        if m is None:
            if self.fault.at == "sync" and self.method.name == "none":
                raise SpecError("fault.at", "sync fires in a method's exchange; method none has none (use start)")
            return
        name = self.method.name
        if self.comm.mode == "dear":
            raise SpecError("comm.mode", f"method {name} skips the gradient exchange on local steps, which dear "
                                         f"cannot (its parameters live in shards); use comm sync or wfbp")
        if self.strategy.mode == "auto":
            raise SpecError("strategy.mode", f"auto does not plan method {name} yet; use strategy fixed")
        if self.schedule.name in ("mergecomp", "layerfusion"):
            raise SpecError("schedule.name", f"{self.schedule.name} times steps to tune the buckets, and method "
                                             f"{name} sends no gradients on local steps; use layerwise, allinone "
                                             f"or bucket")
        if not m.exchanges_gradients and (self.compressor.name != "none" or self.compressor.per_bucket):
            raise SpecError("compressor.name", f"method {name} exchanges no gradients; give the compressor of its "
                                               f"own exchange as method.compressor"
                                               + ("" if m.takes_compressor else f" (which {name} does not take)"))
        try:
            m.check_job({k: dataclasses.asdict(getattr(self, k)) for k in ("optimizer", "compressor", "schedule",
                                                                            "comm", "network")})
        except ValueError as e:
            where, _, msg = str(e).partition(": ")
            raise SpecError(where, msg) from None
        if self.fault.at == "sync" and self.fault.kind != "none" and not m.exchanges_at(self.fault.step):
            due = [s for s in range(self.steps) if m.exchanges_at(s)][:4]
            raise SpecError("fault.step", f"method {name} has no exchange of its own in step {self.fault.step} "
                                          f"(its first: {', '.join(map(str, due)) or 'none in the run'})")

    # -- conversion -------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any) -> "JobSpec":
        check_size(data)
        data = _shorthand(data)
        return _build(cls, data, "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


MAX_NAME = 200
"""Characters in a run's name: it is shown on every list, and starts the run's id."""
MAX_VALUES = 100_000
MAX_TEXT = 1_000_000
"""At most this many values (numbers, strings, lists, mappings) and characters of text in one spec: far more than
any real spec has (one has some dozens), and small enough that checking and copying it costs nothing. A mapping
that repeats one list by reference (YAML aliases) is counted as often as it appears, as a copy would be."""


def check_size(data: Any) -> None:
    """SpecError when ``data`` has more than MAX_VALUES values or MAX_TEXT characters of text. Counts as it
    walks and stops at the first limit passed, so a structure that expands to billions (a YAML alias bomb)
    costs what MAX_VALUES visits cost."""
    values = text = 0
    todo = [data]
    while todo:
        x = todo.pop()
        values += 1
        if isinstance(x, dict):
            for k, v in x.items():
                todo.append(k)
                todo.append(v)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, str):
            text += len(x)
        if values > MAX_VALUES or text > MAX_TEXT:
            raise SpecError("spec", f"too large: a spec holds at most {MAX_VALUES} values and {MAX_TEXT} "
                                    "characters of text")


def _shorthand(data: Any) -> Any:
    """Accept the short forms users write: `model: resnet`, and compressor
    parameters inline next to `name` instead of under `params`."""
    if not isinstance(data, dict):
        raise SpecError("", f"a spec must be a mapping of fields, got {type(data).__name__}")
    data = dict(data)
    for key in ("model", "dataset", "optimizer", "compressor", "schedule"):
        if isinstance(data.get(key), str):
            data[key] = {"name": data[key]}
    if isinstance(data.get("comm"), str):
        data["comm"] = {"mode": data["comm"]}
    if isinstance(data.get("network"), str):
        data["network"] = {"link": data["network"]}
    if isinstance(data.get("strategy"), str):
        data["strategy"] = {"mode": data["strategy"]}
    if isinstance(data.get("method"), str):
        data["method"] = {"name": data["method"]}
    data["compressor"] = _compressor_shorthand(data.get("compressor"))
    if data["compressor"] is None:
        del data["compressor"]
    meth = data.get("method")
    if isinstance(meth, dict):
        own = ("name", "params", "compressor")
        extra = {k: v for k, v in meth.items() if k not in own}
        data["method"] = {**{k: v for k, v in meth.items() if k in own},
                          **({"params": {**(meth.get("params") or {}), **extra}} if extra else {})}
        if isinstance(meth.get("compressor"), str):
            data["method"]["compressor"] = {"name": meth["compressor"]}
    model = data.get("model")
    if isinstance(model, dict):
        extra = {k: v for k, v in model.items() if k not in ("name", "options", "loss")}
        if extra:
            data["model"] = {**{k: v for k, v in model.items() if k in ("name", "loss")},
                             "name": model.get("name", "cnn"), "options": {**(model.get("options") or {}), **extra}}
    ds = data.get("dataset")
    if isinstance(ds, dict) and ":" in str(ds.get("name", "")):  # a user loader's arguments, inline
        own = {f.name for f in dataclasses.fields(DataSpec)}
        extra = {k: v for k, v in ds.items() if k not in own}
        if extra:
            data["dataset"] = {**{k: v for k, v in ds.items() if k in own},
                               "options": {**(ds.get("options") or {}), **extra}}
    return data


def _compressor_shorthand(comp: Any) -> Any:
    """A compressor section with its parameters inline next to ``name`` moved under ``params``."""
    if isinstance(comp, dict):
        known = {"name", "error_feedback", "params", "per_bucket"}
        extra = {k: v for k, v in comp.items() if k not in known}
        if extra:
            params = dict(comp.get("params") or {})
            params.update(extra)
            return {**{k: v for k, v in comp.items() if k in known}, "params": params}
    return comp


def _build(cls, data: Any, path: str, prefix: str = ""):
    """``cls`` from ``data``; ``prefix`` goes before the field of any error its checks raise (a section
    nested in another, such as method.compressor, whose checks name their own fields from the top)."""
    if prefix:
        try:
            return _build(cls, data, path)
        except SpecError as e:
            where = e.path if e.path.startswith(prefix) else prefix + e.path
            raise SpecError(where, e.msg) from None
    if not isinstance(data, dict):
        raise SpecError(path or "spec", f"must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise SpecError(where, f"unknown field; allowed: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        sub = f"{path}.{name}" if path else name
        kwargs[name] = _convert(hints[name], value, sub)
    return cls(**kwargs)


def _convert(tp, value, path):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, path)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise SpecError(path, f"{value!r} is not allowed; allowed: {', '.join(map(str, allowed))}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, f"must be a string, got {value!r}")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise SpecError(path, f"must be a mapping, got {value!r}")
        return dict(value)
    if tp is list or origin is list:
        if not isinstance(value, (list, tuple)):
            raise SpecError(path, f"must be a list, got {value!r}")
        return list(value)
    raise TypeError(f"spec field {path} has an unsupported type {tp}")
