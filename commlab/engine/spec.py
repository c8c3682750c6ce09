"""The job spec: a tree of dataclasses with defaults, checked before anything starts.

A spec comes from YAML or JSON (commlab/lab/base/specs.py reads the file) as a plain dict.
``JobSpec.from_dict`` rejects unknown keys, wrong types, out-of-range values and
impossible combinations with a ``SpecError`` whose one-line message names the
field and what is allowed. ``to_dict`` gives the fully defaulted form that is
written to ``spec.json``; ``from_dict(to_dict(s)) == s``.

The full check runs once, where a run is admitted (``commlab run``, ``commlab.run`` and ``commlab.spec``, the UI's
form, ``commlab.wrap``): it is the one that reads the environment for the engine's switches left unset, and it
builds what the spec names to check it (compressor and method instances, the registries). Whatever reads the
checked document afterwards (the queue, the launcher, each rank) builds it with ``JobSpec.from_checked``, which
checks nothing again.

Fields that name code by import path (commlab.engine.codepath.code_fields) are imported while checking, except
in a process that serves viewers (commlab.engine.codepath.forbid_imports_when), where their syntax is checked.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import importlib.util
import itertools
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from commlab.engine import cluster
from commlab.engine.codepath import check_path, check_zoo_options, imports_allowed, is_import_path, zoo_kind
from commlab.engine.schedules import SCHEDULES


class SpecError(ValueError):
    """A bad spec. ``str(e)`` is one line: ``<field>: <problem>``."""

    def __init__(self, path: str, msg: str):
        self.path, self.msg = path, msg
        super().__init__(f"{path}: {msg}" if path else msg)


# The names a spec may use, each list in one place: the schedules are the engine's own table of them (its
# builders are pure functions, no torch); commlab/engine/comm/modes.py builds its communicators by COMM_AVAILABLE.
SCHEDULES_AVAILABLE = tuple(SCHEDULES)
COMM_AVAILABLE = ("sync", "wfbp", "dear")
LINKS_AVAILABLE = ("loopback", "shaped", "modeled")
CAP_MB = 25.0
"""schedule.cap_mb's default: the byte cap of a bucket (and of dear's buffers), as DDP's bucket_cap_mb."""
DEAR_CAP_MB = CAP_MB
"""dear's buffer cap when the spec gives none (schedule.cap_mb's default) and neither comm.layers nor comm.tune."""
DEAR_TUNE_STEPS = 5
"""dear with comm.tune: measured iterations per trial cap when comm.tune_steps is not given."""


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
        try:
            # external imports torch; a zoo model's name is checked without it
            if ":" in self.name:
                from commlab.engine import external
                external.check_model(self.name)  # unknown architecture or import failure: one line, now
            else:
                zoo_kind(self.name)
                check_zoo_options(self.name, self.options)
            if self.loss is not None:
                from commlab.engine import external
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


MUON_MOMENTUM = 0.95
"""optimizer.momentum's value for muon when the spec gives none (torch.optim.Muon's default)."""
MUON_ADAMW_LR = 1e-3
"""optimizer.adamw_lr's value for muon when the spec gives none (torch.optim.AdamW's default learning rate)."""


@dataclass
class OptimizerSpec:
    name: Literal["sgd", "adam", "adamw", "muon"] = "sgd"
    """A stock torch.optim optimizer; the engine hands it averaged gradients. muon: torch.optim.Muon over the 2-D
    weight matrices and torch.optim.AdamW over every other parameter (biases, norms, convolution kernels,
    embedding tables), one optimizer object (commlab/engine/muon.py says which parameter goes where)."""
    lr: float = 0.05
    """The learning rate (muon: Muon's, for the matrices; 0.02 is the usual recipe's)."""
    momentum: Optional[float] = None
    """sgd and muon only (muon: Muon's momentum, Nesterov). Unset: 0, and 0.95 for muon; spec.json holds the value."""
    weight_decay: float = 0.0
    """muon: decoupled, for both parts."""
    betas: Optional[list] = None
    """adam/adamw only, and muon's AdamW part; default [0.9, 0.999]."""
    adamw_lr: Optional[float] = None
    """muon only: the learning rate of the parameters Muon does not take (AdamW's). Unset: 0.001; spec.json holds
    the value."""
    decay: Literal["none", "cosine"] = "none"
    """The learning rate over the run: none keeps it; cosine takes every rate (muon's adamw_lr too) from its value
    at the first step down to 0 at ``steps`` along half a cosine (commlab.engine.stepper.decay_lr). Only the spec's
    own optimizer decays: with your own optimizer in commlab.wrap, use a torch.optim.lr_scheduler."""

    def __post_init__(self):
        if self.momentum is None:
            self.momentum = MUON_MOMENTUM if self.name == "muon" else 0.0
        if self.adamw_lr is None and self.name == "muon":
            self.adamw_lr = MUON_ADAMW_LR
        if not 0 < self.lr <= 10:
            raise SpecError("optimizer.lr", f"must be in (0, 10], got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise SpecError("optimizer.momentum", f"must be in [0, 1), got {self.momentum}")
        if self.momentum and self.name not in ("sgd", "muon"):
            raise SpecError("optimizer.momentum", f"only sgd and muon take momentum (got optimizer {self.name}); "
                                                  f"use betas")
        if self.weight_decay < 0:
            raise SpecError("optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        if self.betas is not None:
            if self.name == "sgd":
                raise SpecError("optimizer.betas", "only adam, adamw and muon (its AdamW part) take betas")
            if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
                raise SpecError("optimizer.betas", f"must be two numbers in [0, 1), got {self.betas}")
        if self.adamw_lr is not None:
            if self.name != "muon":
                raise SpecError("optimizer.adamw_lr", f"only muon takes adamw_lr (the learning rate of what Muon "
                                                      f"does not step); got optimizer {self.name}")
            if not 0 < self.adamw_lr <= 10:
                raise SpecError("optimizer.adamw_lr", f"must be in (0, 10], got {self.adamw_lr}")

    @property
    def elementwise(self) -> bool:
        """Whether each element's update depends on that element alone (sgd, adam, adamw): then stepping flat
        shards of the parameters (comm dear) equals stepping the parameters. Muon orthogonalizes whole matrices."""
        return self.name != "muon"


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


def _check_cap(where: str, v: Any) -> None:
    """A byte cap in MB (schedule.cap_mb, or its old name comm.cap_mb): a number in (0, 4096]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SpecError(where, f"must be a number, got {v!r}")
    if not 0 < v <= 4096:
        raise SpecError(where, f"must be in (0, 4096], got {v}")


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
    cap_mb: float = CAP_MB
    """The byte cap in MB (2**20 bytes) of a bucket (schedule bucket, as DDP's bucket_cap_mb) and of a buffer of
    comm.mode dear (unless comm.layers or comm.tune sizes them). Older specs' comm.cap_mb, dear's cap, is read
    as this field."""
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
        if self.name not in SCHEDULES_AVAILABLE:
            raise SpecError("schedule.name", f"unknown schedule {self.name!r}; allowed: {', '.join(SCHEDULES_AVAILABLE)}")
        _check_cap("schedule.cap_mb", self.cap_mb)
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
    (reduce-scatter in backward, all-gather before each buffer's next forward; its buffers are capped by
    schedule.cap_mb unless layers or tune is given)."""
    layers: Optional[int] = None
    """dear only: fuse this many nearby layers per buffer instead of a byte cap (schedule.cap_mb)."""
    tune: bool = False
    """dear only: search the buffer cap online by measured iteration time (rank 0 decides), instead of
    schedule.cap_mb."""
    tune_steps: Optional[int] = None
    """dear with tune only: iterations measured per trial cap (default 5, written into spec.json; the
    first of each is not counted)."""

    def __post_init__(self):
        if self.mode not in COMM_AVAILABLE:
            raise SpecError("comm.mode", f"unknown mode {self.mode!r}; allowed: {', '.join(COMM_AVAILABLE)}")
        if self.mode != "dear":
            for key in ("layers", "tune_steps"):
                if getattr(self, key) is not None:
                    raise SpecError(f"comm.{key}", f"only comm.mode dear takes {key} (other modes fuse by schedule)")
            if self.tune:
                raise SpecError("comm.tune", "only comm.mode dear takes tune")
            return
        if self.layers is not None and not 1 <= self.layers <= 100_000:
            raise SpecError("comm.layers", f"must be in 1..100000, got {self.layers}")
        if self.layers is not None and self.tune:
            raise SpecError("comm.layers", "give one of schedule.cap_mb, comm.layers or comm.tune")
        if self.tune_steps is not None:
            if not self.tune:
                raise SpecError("comm.tune_steps", "needs comm.tune: true")
            if not 2 <= self.tune_steps <= 1000:
                raise SpecError("comm.tune_steps", f"must be in 2..1000, got {self.tune_steps}")
        # the spec written to spec.json is fully defaulted: it says what the run used
        if self.tune and self.tune_steps is None:
            self.tune_steps = DEAR_TUNE_STEPS


MAX_GBPS = 400.0
"""The highest rate (Gbit/s) of a shaped or modeled link; the advice, ``commlab predict`` and its clusters'
inter-node links keep to the same range, so a rate one command takes the others take too."""


@dataclass
class NetworkSpec:
    link: str = "loopback"
    """loopback | shaped (tc on an emulated cluster) | modeled (alpha-beta delay)."""
    gbps: Optional[float] = None
    """The rate of every rank's link (Gbit/s); beside a cluster, the rate of every worker that gives none."""
    latency_us: Optional[float] = None
    """modeled only: the latency of every step of a ring algorithm (alpha), us."""
    cluster: Optional[dict] = None
    """Unequal workers, each rank its own link and compute speed (commlab/engine/cluster.py): a preset's name
    (datacenter | two_regions | three_continents | home_broadband) or {workers: [{gbps_up, gbps_down, delay_ms,
    jitter_ms, speed, count}, ...]} (count repeats a worker; one entry without count: every rank alike). A
    modeled link uses all of them, a shaped one the rates (no delay or jitter), a loopback one only speed.
    spec.json holds it resolved: {preset, workers} with one worker per rank, every field given."""

    def __post_init__(self):
        if self.link not in LINKS_AVAILABLE:
            raise SpecError("network.link", f"unknown link {self.link!r}; allowed: {', '.join(LINKS_AVAILABLE)}")
        if isinstance(self.cluster, str):
            self.cluster = {"preset": self.cluster}
        if self.link == "loopback" and (self.gbps is not None or self.latency_us is not None):
            raise SpecError("network.gbps", "a loopback link takes no gbps or latency_us")
        if self.cluster is not None and self.latency_us is not None:
            raise SpecError("network.latency_us", "a cluster gives each worker's delay_ms (a modeled hop crosses "
                                                  "both ends' delays); leave latency_us out")
        if self.link in ("shaped", "modeled") and self.cluster is not None:
            if self.gbps is not None and not 0.001 <= self.gbps <= MAX_GBPS:
                raise SpecError("network.gbps", f"must be in [0.001, {MAX_GBPS:g}] (the rate of every worker "
                                                f"that gives none), got {self.gbps}")
        elif self.link in ("shaped", "modeled"):
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
    (commlab/engine/methods/): local_sgd, post_local_sgd, diloco, streaming_diloco, demo, sparseloco, muloco,
    desloc, or package.module:Class."""
    name: str = "none"
    """none (the default: the communicator averages every step's gradients) | a name from
    commlab.engine.methods.names() | package.module:Class (a subclass of commlab.engine.methods.base.Method)."""
    params: dict = field(default_factory=dict)
    """The method's own parameters (H, outer_lr, outer_momentum, warmup, fragments, tau, alpha, Hx, ...). In YAML
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


ENGINE_ENV = {"fused": "COMMLAB_FUSED", "fused_launch": "COMMLAB_FUSED_LAUNCH", "graphs": "COMMLAB_GRAPHS",
              "buffer_pool": "COMMLAB_BUFFER_POOL", "timeout_s": "COMMLAB_TIMEOUT_S"}
"""engine field -> the environment variable that gives its value where a spec leaves it unset. The engine's code
reads these variables; a rank sets them from its spec before anything reads them (EngineSpec.environment)."""
ENGINE_DEFAULTS = {"fused": True, "fused_launch": "direct", "graphs": False, "buffer_pool": True, "timeout_s": 300.0}
"""engine field -> its value where neither the spec nor the environment gives one."""
_ENGINE_TEXT = {"fused": {"1": True, "0": False, "interpret": "interpret"},
                "fused_launch": {"direct": "direct", "triton": "triton"},
                "graphs": {"1": True, "0": False}, "buffer_pool": {"1": True, "0": False}}
"""engine field -> {the environment variable's text: the spec's value} (timeout_s: a number of seconds)."""
MAX_TIMEOUT_S = 604800.0
"""The largest timeout_s of the engine section: a week."""


@dataclass
class EngineSpec:
    """The engine's switches: how a rank computes (which kernels, which buffers, how long it waits), not what it
    trains. A switch the spec leaves unset takes the value of its environment variable (``COMMLAB_FUSED``,
    ``COMMLAB_FUSED_LAUNCH``, ``COMMLAB_GRAPHS``, ``COMMLAB_BUFFER_POOL``, ``COMMLAB_TIMEOUT_S``) in the process
    that admits the run (``commlab run``, the UI's server, ``commlab.run``; each rank's own for ``commlab.wrap``),
    else its default. spec.json holds the values so resolved, and a rerun of it runs alike in any environment;
    resolved.json's ``engine_from_env`` names those that came from the environment. The ranks put the spec's
    values into their own environment before anything reads them."""
    fused: Union[bool, Literal["interpret"], None] = None
    """The fused GPU kernels of the elementwise codecs (commlab/engine/compressors/fused.py): true (where the GPU
    and Triton allow), false (the eager torch codecs), or interpret (also on the CPU under Triton's interpreter,
    TRITON_INTERPRET=1). Unset: COMMLAB_FUSED (1, 0 or interpret), else true."""
    fused_launch: Optional[Literal["direct", "triton"]] = None
    """How the fused kernels are launched: direct (their compiled kernel called directly, cheaper on the host)
    or triton (Triton's own launch). Unset: COMMLAB_FUSED_LAUNCH, else direct."""
    graphs: Optional[bool] = None
    """Replay the codecs' compress and fused decoding from CUDA graphs on a GPU
    (commlab/engine/compressors/graphs.py). Unset: COMMLAB_GRAPHS (1 or 0), else false."""
    buffer_pool: Optional[bool] = None
    """Reuse the large CPU buffers of the collectives (commlab/engine/comm/buffers.py). Unset:
    COMMLAB_BUFFER_POOL (1 or 0), else true."""
    timeout_s: Optional[float] = None
    """Seconds a collective waits for the other ranks before the process group gives up, at most 604800.
    Unset: COMMLAB_TIMEOUT_S, else 300."""

    def __post_init__(self):
        self._from_env = {}
        for key, var in ENGINE_ENV.items():
            v = getattr(self, key)
            if v is None:
                text = os.environ.get(var, "").strip()
                if not text:
                    setattr(self, key, ENGINE_DEFAULTS[key])
                    continue
                v = _engine_value(key, var, text)
                self._from_env[key] = f"{var}={text}"
                setattr(self, key, v)
            if key == "timeout_s" and not 0 < v <= MAX_TIMEOUT_S:
                raise SpecError("engine.timeout_s", f"must be in (0, {MAX_TIMEOUT_S:g}], got {v:g}"
                                + (f" (from {self._from_env[key]} in the environment)" if key in self._from_env
                                   else ""))

    @property
    def from_env(self) -> dict:
        """{field: "VARIABLE=text"} of the switches the admitting process's environment set (its check); {} for a
        section read from a checked document (JobSpec.from_checked)."""
        return dict(self.__dict__.get("_from_env") or {})

    def keep_from_env(self, earlier: "EngineSpec") -> None:
        """Checked again from ``earlier``'s values (a JobSpec given to commlab.run or commlab.wrap): the switches
        ``earlier``'s check took from the environment, where they still hold its value, came from there."""
        mine = self.__dict__.setdefault("_from_env", {})
        for key, origin in earlier.from_env.items():
            if getattr(self, key) == getattr(earlier, key):
                mine.setdefault(key, origin)

    def environment(self) -> dict:
        """{variable: text} of the switches this section sets, as the engine's code reads them; a switch left
        unset (a spec.json written before this section existed) is left out, and the rank keeps its own."""
        out = {}
        for key, var in ENGINE_ENV.items():
            v = getattr(self, key)
            if v is None:
                continue
            if key == "timeout_s":
                out[var] = repr(float(v))
                continue
            text = next((t for t, x in _ENGINE_TEXT[key].items() if x == v and type(x) is type(v)), None)
            if text is None:  # a document edited by hand after its check
                raise SpecError(f"engine.{key}", f"{v!r} is not a value of this switch")
            out[var] = text
        return out


def _engine_value(key: str, var: str, text: str):
    """The spec's value of engine.``key`` for its environment variable's ``text``; a one-line SpecError naming the
    field, the variable and what it may say otherwise."""
    if key == "timeout_s":
        try:
            return float(text)
        except ValueError:
            raise SpecError("engine.timeout_s", f"{var}={text!r} in the environment: must be a number of "
                                                f"seconds") from None
    words = _ENGINE_TEXT[key]
    if text not in words:
        raise SpecError(f"engine.{key}", f"{var}={text!r} in the environment: must be "
                                         f"{' or '.join(words)} (or unset)")
    return words[text]


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
class RestartSpec:
    """What the lab does when a replica group's process dies (a fault's kill, or a crash)."""
    max_restarts: int = 3
    """Restarts of dead replicas over the whole run; 0: a dead replica stays dead (the others go on while at
    least min_replicas are left)."""
    delay_s: float = 2.0
    """Seconds from a replica's death to its restart, unless its fault gives restart_after_s."""

    def __post_init__(self):
        if not 0 <= self.max_restarts <= 1000:
            raise SpecError("fault_tolerance.restart.max_restarts", f"must be in 0..1000, got {self.max_restarts}")
        if not 0 <= self.delay_s <= 3600:
            raise SpecError("fault_tolerance.restart.delay_s", f"must be in [0, 3600], got {self.delay_s}")


FT_TORCHFT = "0.2.0"
"""The torchft fault tolerance is written against (commlab/engine/ft.py)."""
FT_FAULT_KINDS = ("kill", "cut", "slow", "hang")
"""The faults of a fault-tolerant run: kill (the lab SIGKILLs the replica's process, and restarts it), cut (the lab
stops the replica's process for ``seconds``, SIGSTOP then SIGCONT: its peers and the Lighthouse hear nothing from it,
as across a cut link), slow (the replica computes at ``speed`` for ``steps`` steps, as a worker on a busy or
throttled machine; its own Stepper stretches its forward and backward passes) and hang (the lab stops the replica's
process for good, as a worker stuck in a deadlock: the others go on without it, and only a kill, of the spec or
asked for, brings it back, restarted)."""

@dataclass
class FaultToleranceSpec:
    """Replica groups on torchft (commlab/engine/ft.py): a Lighthouse keeps the membership, every step (a method's: every sync) starts with a
    quorum and commits only where every participant succeeded, and a replica that (re)joins recovers the model and
    optimizer from a peer. Each replica group is one process (one rank), so world_size is the number of replica
    groups."""
    enabled: bool = False
    """Run the replica groups on torchft (each one process); false: the run as always."""
    replica_groups: Optional[int] = None
    """Replica groups (processes); unset: world_size. spec.json holds it."""
    min_replicas: int = 1
    """Fewest replica groups a step needs to commit (the Lighthouse's min_replicas, each Manager's
    min_replica_size)."""
    join_timeout_ms: int = 1000
    """How long the Lighthouse waits for every heartbeating replica to join a quorum once one has; after a kill the
    survivors wait min(join_timeout_ms, heartbeat_timeout_ms) for the dead one."""
    heartbeat_timeout_ms: int = 5000
    """A replica without a heartbeat for this long counts as gone."""
    quorum_tick_ms: int = 100
    """The Lighthouse's polling period while a quorum waits."""
    timeout_s: float = 30.0
    """Collectives, commit and recovery transfers: a peer silent for this long fails the step (not the run)."""
    quorum_timeout_s: float = 120.0
    """How long a replica waits for a quorum (slow starters, restarts) before it fails."""
    restart: RestartSpec = field(default_factory=RestartSpec)
    """Restarts of replicas that die: how many over the run, after how long."""
    faults: list = field(default_factory=list)
    """Faults, each {kind: kill, replica: r, step: s, restart_after_s: x}: the lab SIGKILLs replica r once it has
    logged step s (once per fault), and restarts it restart_after_s later (unset: restart.delay_s; null in
    spec.json means that); or {kind: slow, replica: r, step: s, steps: n, speed: x}: replica r computes at x
    (0 < x < 1) of its speed from step s for n steps (unset: to the end; null in spec.json means that); or
    {kind: cut, replica: r, step: s, seconds: t}: the lab cuts replica r off for t seconds once it has logged
    step s (its process stopped: no traffic, no heartbeat), then lets it go on; or {kind: hang, replica: r,
    step: s}: the lab stops replica r's process for good once it has logged step s (a hung worker)."""

    def __post_init__(self):
        p = "fault_tolerance"
        if self.replica_groups is not None and not 1 <= self.replica_groups <= 1024:
            raise SpecError(f"{p}.replica_groups", f"must be in 1..1024, got {self.replica_groups}")
        if not 1 <= self.min_replicas <= 1024:
            raise SpecError(f"{p}.min_replicas", f"must be in 1..1024, got {self.min_replicas}")
        for key, lo, hi in (("join_timeout_ms", 1, 3_600_000), ("heartbeat_timeout_ms", 10, 3_600_000),
                            ("quorum_tick_ms", 1, 60_000)):
            v = getattr(self, key)
            if not lo <= v <= hi:
                raise SpecError(f"{p}.{key}", f"must be in {lo}..{hi}, got {v}")
        for key in ("timeout_s", "quorum_timeout_s"):
            v = getattr(self, key)
            if not 0.1 <= v <= MAX_TIMEOUT_S:
                raise SpecError(f"{p}.{key}", f"must be in [0.1, {MAX_TIMEOUT_S:g}], got {v}")
        self.faults = [_ft_fault(f, i) for i, f in enumerate(self.faults)]

    def check_job(self, spec: "JobSpec") -> None:
        """What a fault-tolerant run allows so far (SpecError naming the field otherwise); fills replica_groups."""
        p = "fault_tolerance"
        if not self.enabled:
            if self.faults:
                raise SpecError(f"{p}.faults", "needs fault_tolerance.enabled: true")
            return
        if self.replica_groups is None:
            self.replica_groups = spec.world_size
        if self.replica_groups != spec.world_size:
            raise SpecError(f"{p}.replica_groups", f"each replica group is one rank, so it must equal world_size "
                                                   f"{spec.world_size}, got {self.replica_groups} (or leave it out)")
        if self.min_replicas > self.replica_groups:
            raise SpecError(f"{p}.min_replicas", f"must be at most replica_groups {self.replica_groups}, "
                                                 f"got {self.min_replicas}")
        for i, f in enumerate(self.faults):
            if f["replica"] >= self.replica_groups:
                raise SpecError(f"{p}.faults[{i}].replica", f"must be below replica_groups {self.replica_groups}, "
                                                            f"got {f['replica']}")
            if f["step"] >= spec.steps:
                raise SpecError(f"{p}.faults[{i}].step", f"must be below steps {spec.steps}, got {f['step']}")
        if spec.comm.mode == "dear":
            raise SpecError("comm.mode", "dear shards parameters over a fixed world, which fault tolerance changes "
                                         "from step to step; use comm sync or wfbp")
        # mergecomp and layerfusion: the lab searches before the replicas start, in a run without fault tolerance,
        # and every replica trains the partition it chose (commlab/lab/strategy/ftsearch.py)
        overlap = spec.method.params.get("overlap", "none")
        if overlap != "none" and spec.method.params.get("fragments", 1) > 1:
            raise SpecError("method.overlap", f"under fault tolerance one sync is in flight at a time; overlap "
                                              f"{overlap} keeps each of {spec.method.params['fragments']} fragments' "
                                              f"in flight for H steps: use one fragment, or tau instead of overlap")
        if spec.method.name == "streaming_diloco":
            prm = spec.method.params
            h, frags, tau = prm["H"], prm["fragments"], prm["tau"]
            dues = [h * (f + 1) // frags for f in range(frags)]
            gap = min([dues[0]] + [b - a for a, b in zip(dues, dues[1:])])
            if tau > gap:
                raise SpecError("method.tau", f"under fault tolerance one fragment's sync is in flight at a time: "
                                              f"tau must be at most {gap} (H {h} over {frags} fragments), got {tau}")
        # every per-step compressor, error feedback and per-bucket rules included: their rounds are all-reduces and
        # all-gathers (only dear's shards, refused above, need more), and the Stepper hands over what replicas share
        # of each bucket's compressor state, keeps each replica's residuals its own and puts the state back on a
        # step that does not commit
        # strategy auto: the advisor's space lists dear without ranking it (commlab/lab/strategy/space.py)
        if spec.fault.kind != "none":
            raise SpecError("fault.kind", "under fault tolerance give faults as fault_tolerance.faults "
                                          "({kind: kill, replica: 1, step: 5})")
        if importlib.util.find_spec("torchft") is None:
            raise SpecError(f"{p}.enabled", f"needs torchft {FT_TORCHFT}, which is not installed here (./setup.sh "
                                            f"installs it: pip install --no-deps torchft=={FT_TORCHFT} and the ft "
                                            f"extra, pip install -e '.[ft]')")


_FT_FAULT_KEYS = {"kill": ("kind", "replica", "step", "restart_after_s"),
                  "cut": ("kind", "replica", "step", "seconds"),
                  "slow": ("kind", "replica", "step", "steps", "speed"),
                  "hang": ("kind", "replica", "step")}


def _ft_fault(f: Any, i: int) -> dict:
    """One of fault_tolerance.faults, checked and fully defaulted."""
    where = f"fault_tolerance.faults[{i}]"
    if not isinstance(f, dict):
        raise SpecError(where, f"must be a mapping such as {{kind: kill, replica: 1, step: 5}}, got {f!r}")
    kind = f.get("kind", "kill")
    if kind not in FT_FAULT_KINDS:
        raise SpecError(f"{where}.kind", f"{kind!r} is not allowed; allowed: {', '.join(FT_FAULT_KINDS)}")
    unknown = sorted(set(f) - set(_FT_FAULT_KEYS[kind]))
    if unknown:
        raise SpecError(f"{where}.{unknown[0]}", f"unknown field for a {kind} fault; allowed: "
                                                 f"{', '.join(_FT_FAULT_KEYS[kind])}")
    out = {"kind": kind}
    for key in ("replica", "step"):
        v = f.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise SpecError(f"{where}.{key}", f"must be an integer >= 0, got {v!r}")
        out[key] = v
    if kind == "slow":
        speed = f.get("speed")
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.01 <= speed < 1:
            raise SpecError(f"{where}.speed", f"must be a number in [0.01, 1) (the share of its speed the replica "
                                              f"keeps), got {speed!r}")
        n = f.get("steps")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise SpecError(f"{where}.steps", f"must be an integer >= 1 (or unset: to the end), got {n!r}")
        out.update(speed=float(speed), steps=n)
        return out
    if kind == "hang":
        return out
    if kind == "cut":
        t = f.get("seconds")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise SpecError(f"{where}.seconds", f"must be a number in (0, 3600] (how long the replica is cut off), "
                                                f"got {t!r}")
        out["seconds"] = float(t)
        return out
    after = f.get("restart_after_s")
    if after is not None and (isinstance(after, bool) or not isinstance(after, (int, float)) or not 0 <= after <= 3600):
        raise SpecError(f"{where}.restart_after_s", f"must be a number in [0, 3600] (or unset), got {after!r}")
    out["restart_after_s"] = None if after is None else float(after)
    return out


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
    stop_at_acc: float = 0.0
    """Stop after the first evaluation (every ``eval_every`` steps) at or above this held-out accuracy; the run
    ends done, its steps those trained. 0: train every step. The advisor's to-target trials use it."""
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
    engine: EngineSpec = field(default_factory=EngineSpec)
    """The engine's switches (fused kernels, CUDA graphs, the buffer pool, the process group's timeout); unset
    ones come from the environment at admission, and spec.json holds them resolved."""
    fault_tolerance: FaultToleranceSpec = field(default_factory=FaultToleranceSpec)
    """Replica groups on torchft that train on when one dies (docs/how-to/fault-tolerance.md)."""

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
        if not 0 <= self.stop_at_acc <= 1:
            raise SpecError("stop_at_acc", f"must be in [0, 1] (0: off), got {self.stop_at_acc}")
        if self.stop_at_acc and not self.eval_every:
            raise SpecError("stop_at_acc", "needs eval_every > 0: the run stops at an evaluation")
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
        if self.comm.mode == "dear" and not self.optimizer.elementwise:
            raise SpecError("comm.mode", f"dear steps each rank's flat 1-D shard of its buffers, which optimizer "
                                         f"{self.optimizer.name} cannot (Muon orthogonalizes whole matrices); use comm "
                                         f"sync or wfbp")
        if self.comm.mode == "dear":
            from commlab.engine import compressors
            from commlab.engine.compressors.plan import make_section, parts
            c = self.compressor
            for i, part in enumerate(parts(dataclasses.asdict(c))):
                if is_import_path(part["name"]) and not imports_allowed():
                    continue  # checked where the run is queued, in a child that may import it (commlab.lab.base.sandbox)
                problem = make_section(part).capabilities.shard_problem()
                if problem:
                    where = f"compressor.per_bucket[{i}].name" if i < len(c.per_bucket) else "compressor.name"
                    raise SpecError(where, f"comm.mode dear reduce-scatters the payload, so it needs a single-round "
                                           f"compressor that is summable and keeps the gradient's shape, or a "
                                           f"shard codec; {part['name']} {problem}; allowed: "
                                           f"{', '.join(compressors.shardable())}")
            if self.schedule.name != "bucket":
                raise SpecError("schedule", f"comm.mode dear fuses its own buffers, by schedule.cap_mb, comm.layers "
                                            f"or comm.tune; leave schedule.name at bucket, got {self.schedule.name}")
            if (self.comm.layers is not None or self.comm.tune) and self.schedule.cap_mb != CAP_MB:
                raise SpecError("comm.layers" if self.comm.layers is not None else "comm.tune",
                                "give one of schedule.cap_mb, comm.layers or comm.tune")
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

        if self.network.cluster is not None:
            self._check_cluster()
        self.fault_tolerance.check_job(self)
        self._check_method()

    def _check_cluster(self) -> None:
        """network.cluster resolved for world_size ranks: one worker per rank, every field given."""
        net = self.network
        try:
            net.cluster = cluster.resolve(net.cluster, self.world_size, net.link, net.gbps)
        except cluster.ClusterError as e:
            raise SpecError(e.path, e.msg) from None

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
        if self.fault_tolerance.enabled and not m.fault_tolerant:
            raise SpecError("method.name", f"{name} {m.NOT_FAULT_TOLERANT}; every built-in method does "
                                           f"(commlab/engine/methods/base.py)")
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
            scan = min(self.steps, SCAN_STEPS)  # a check's cost does not grow with the run's steps
            due = list(itertools.islice((s for s in range(scan) if m.exchanges_at(s)), 4))
            none = "none in the run" if scan == self.steps else f"none in its first {scan} steps"
            raise SpecError("fault.step", f"method {name} has no exchange of its own in step {self.fault.step} "
                                          f"(its first: {', '.join(map(str, due)) or none})")

    # -- conversion -------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any) -> "JobSpec":
        """The full check: a spec as a user wrote it (short forms, older field names) checked and fully defaulted,
        its unset engine switches taken from this process's environment. Admission runs it once
        (commlab/lab/base/specs.py load_spec, commlab.spec, commlab.wrap); what it wrote is read back with
        ``from_checked``."""
        check_size(data)
        data = _shorthand(data)
        return _build(cls, data, "")

    @classmethod
    def from_checked(cls, data: Any, from_env: Optional[dict] = None) -> "JobSpec":
        """The spec a checked document holds (spec.json: ``to_dict`` of a spec ``from_dict`` made), built as it is,
        without checking it again: no registry, no import of the code it names, no torch, no environment. A field
        older versions named otherwise is read under its name now (``upgrade``); a field the document lacks (an
        older spec.json) takes its default, and an engine switch it lacks stays unset (the rank keeps its
        environment's). The queue, the launcher and the ranks read spec.json with this. ``from_env``: the engine
        switches a check made in another process took from its environment (``EngineSpec.from_env`` there;
        commlab.lab.base.specs.admit_spec)."""
        spec = _trusted(cls, upgrade(data), "")
        if from_env:
            spec.engine.__dict__["_from_env"] = {str(k): str(v) for k, v in from_env.items()}
        return spec

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def with_checked(spec: JobSpec, **sections) -> JobSpec:
    """A copy of ``spec`` with some of its fields replaced by those of other checked specs (a trial's strategy),
    not checked again (``dataclasses.replace`` would run JobSpec's checks)."""
    out = copy.copy(spec)
    for key, value in sections.items():
        if key not in {f.name for f in dataclasses.fields(JobSpec)}:
            raise TypeError(f"with_checked: JobSpec has no field {key!r}")
        object.__setattr__(out, key, value)
    return out


def upgrade(data: Any) -> Any:
    """``data`` (a spec as written, or an older run's spec.json) with the fields older versions named otherwise
    under their names now: ``comm.cap_mb``, dear's buffer cap, is ``schedule.cap_mb`` (the one byte cap of buckets
    and of dear's buffers). Older checks made a dear spec's schedule.cap_mb the default (25) and kept dear's cap in
    comm.cap_mb, so that pair reads as the comm's value; two different caps given are a one-line SpecError naming
    both fields. Returns ``data`` itself when nothing is to change, else a changed copy."""
    comm = data.get("comm") if isinstance(data, dict) else None
    if not isinstance(comm, dict) or "cap_mb" not in comm:
        return data
    data, comm = dict(data), dict(comm)
    old = comm.pop("cap_mb")
    data["comm"] = comm
    if old is None:  # an older spec.json of a mode other than dear, or of dear by layers or tune
        return data
    if comm.get("mode", CommSpec.mode) != "dear":
        raise SpecError("comm.cap_mb", f"only comm.mode dear took comm.cap_mb; the byte cap of buckets is "
                                       f"schedule.cap_mb (write schedule: {{cap_mb: {_shown(old)}}})")
    _check_cap("comm.cap_mb", old)
    sched = data.get("schedule")
    sched = {"name": sched} if isinstance(sched, str) else dict(sched or {}) if isinstance(sched, (dict, type(None))) \
        else sched
    if not isinstance(sched, dict):
        return data  # the schedule's own check says what is wrong with it
    now = sched.get("cap_mb")
    if now is not None and now != old and now != CAP_MB:
        raise SpecError("comm.cap_mb", f"is schedule.cap_mb's old name, and the two differ ({_shown(old)} and "
                                       f"{_shown(now)}); give schedule.cap_mb only")
    sched["cap_mb"] = old
    data["schedule"] = sched
    return data


def _shown(v: Any) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)


SCAN_STEPS = 100_000
"""Steps a spec's check looks through for a method's first exchanges (to name them when ``fault.step`` misses)."""
MAX_NAME = 200
"""Characters in a run's name: it is shown on every list, and starts the run's id."""
MAX_VALUES = 100_000
MAX_TEXT = 1_000_000
"""At most this many values (numbers, strings, lists, mappings) and characters of text in one spec: far more than
any real spec has (one has some dozens), and small enough that checking and copying it costs nothing. A mapping
that repeats one list by reference (YAML aliases) is counted as often as it appears, as a copy would be."""


_PLAIN = (str, int, float, bool, type(None))
"""What a spec's values are besides mappings and lists: what JSON holds (spec.json is JSON)."""


def check_size(data: Any) -> None:
    """SpecError when ``data`` has more than MAX_VALUES values or MAX_TEXT characters of text, or a value JSON
    cannot hold (YAML reads an unquoted ``2024-01-01`` as a date, ``!!set`` as a set). Counts as it walks and stops
    at the first limit passed, so a structure that expands to billions (a YAML alias bomb) costs what MAX_VALUES
    visits cost."""
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
        elif not isinstance(x, _PLAIN):
            raise _not_plain(data, x)
        if values > MAX_VALUES or text > MAX_TEXT:
            raise SpecError("spec", f"too large: a spec holds at most {MAX_VALUES} values and {MAX_TEXT} "
                                    "characters of text")


def _not_plain(data: Any, bad: Any) -> SpecError:
    """The SpecError for ``bad``, a value of ``data`` that JSON cannot hold, naming where it is."""
    kind = ("a date and time" if isinstance(bad, datetime.datetime) else "a date" if isinstance(bad, datetime.date)
            else "bytes" if isinstance(bad, (bytes, bytearray)) else f"a {type(bad).__name__}")
    shown = str(bad) if isinstance(bad, (datetime.date, set, frozenset)) else repr(bad)
    todo = [(data, "")]
    where = "spec"
    while todo:  # the first path that leads to it (the walk above passed the size limits, so this one ends)
        x, path = todo.pop()
        if x is bad:
            where = path or "spec"
            break
        if isinstance(x, dict):
            todo.extend((v, f"{path}.{k}" if path else str(k)) for k, v in x.items())
            todo.extend((k, f"{path} (a field name)" if path else "spec (a field name)") for k in x)
        elif isinstance(x, (list, tuple)):
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(x))
    return SpecError(where, f"{shown[:60]} is {kind}, which a spec cannot hold (only text, numbers, true/false, "
                            f"null, lists and mappings); in YAML, put it in quotes to make it text")


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
    data = upgrade(data)
    if isinstance(data.get("network"), str):
        data["network"] = {"link": data["network"]}
    net = data.get("network")
    if isinstance(net, dict) and isinstance(net.get("cluster"), str):  # a preset's name
        data["network"] = {**net, "cluster": {"preset": net["cluster"]}}
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
    hints = _hints(cls)
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


def _trusted(cls, data: Any, path: str):
    """``cls`` from a checked document's ``data``, its fields set as they are (JobSpec.from_checked)."""
    if not isinstance(data, dict):
        raise SpecError(path or "spec", f"must be a mapping, got {data!r}")
    fields = dataclasses.fields(cls)
    unknown = sorted(set(data) - {f.name for f in fields})
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}" if path else unknown[0],
                        "unknown field; this is not a spec.json that commlab's check wrote")
    hints = _hints(cls)
    obj = object.__new__(cls)
    for f in fields:
        sub = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            value = _trusted(hints[f.name], data.get(f.name, {}), sub)
        elif f.name in data:
            value = copy.deepcopy(data[f.name])
        else:
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        object.__setattr__(obj, f.name, value)
    return obj


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    """The resolved field types of a spec section (read only; resolving them again on every build was most of a
    spec's parse time)."""
    return typing.get_type_hints(cls)


def _convert(tp, value, path):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is typing.Union:  # Optional[X], or one of several (the engine's fused: a bool or interpret)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return _convert(args[0], value, path)
        for a in args:
            try:
                return _convert(a, value, path)
            except SpecError:
                continue
        shown = [w for a in args for w in (("true", "false") if a is bool else map(str, typing.get_args(a)))]
        raise SpecError(path, f"must be {', '.join(shown[:-1])} or {shown[-1]}, got {value!r}")
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
