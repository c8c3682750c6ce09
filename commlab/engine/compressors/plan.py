"""Which compressor each bucket gets: one for all, or a rule list by bucket size (mixed strategies).

A spec's compressor section may carry ``per_bucket``, rules tried in order; a bucket takes the first
rule whose ``below_mb`` its gradient bytes are under, and the section's own compressor otherwise:

    compressor:
      name: powersgd          # buckets no rule takes
      rank: 4
      per_bucket:
        - {below_mb: 1, name: none}                  # small buckets: latency-bound, send them as they are
        - {below_mb: 8, name: fp16}
        - {below_mb: 16, name: topk, ratio: 0.1, error_feedback: true}

Each bucket builds its own instance, which owns that bucket's state (error-feedback residual,
PowerSGD's factors). A rule is a compressor section (``name``, ``error_feedback``, ``params``) plus
``below_mb`` (MB = 2**20 bytes, as ``cap_mb``). The spec checks the rules (commlab/engine/spec.py); ``Plan``
builds the instances (the communicators call ``make`` per bucket); ``section_for`` is the same choice
on plain dicts, for the performance model.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from commlab.engine import compressors
from commlab.engine.compressors.base import Compressor

MB = float(1 << 20)


def section_for(section: dict, nbytes: float) -> dict:
    """The compressor section (name, error_feedback, params; no per_bucket) a bucket of ``nbytes``
    gradient bytes gets under ``section`` (a spec's compressor section, rules or not)."""
    for rule in section.get("per_bucket") or ():
        if nbytes < rule["below_mb"] * MB:
            return {"name": rule["name"], "error_feedback": bool(rule.get("error_feedback")),
                    "params": dict(rule.get("params") or {})}
    return {"name": section["name"], "error_feedback": bool(section.get("error_feedback")),
            "params": dict(section.get("params") or {})}


def parts(section: dict) -> List[dict]:
    """Every compressor section ``section`` may give a bucket: the rules' in order, then its own."""
    rules = [section_for({**section, "per_bucket": [r]}, 0) for r in section.get("per_bucket") or ()]
    return rules + [section_for({**section, "per_bucket": []}, 0)]


def make_section(section: dict) -> Compressor:
    return compressors.make(section["name"], error_feedback=bool(section.get("error_feedback")),
                            **(section.get("params") or {}))


class Plan:
    """Makes each bucket's compressor: ``default`` for every bucket, except those under a rule's byte
    limit (rules tried in order: (below_bytes, factory))."""

    def __init__(self, default: Callable[[], Compressor],
                 rules: Sequence[Tuple[float, Callable[[], Compressor]]] = ()):
        self.default = default
        self.rules = list(rules)

    @classmethod
    def of(cls, name: str, error_feedback: bool = False, **params) -> "Plan":
        """One compressor for every bucket, by registry name: ``Plan.of("int8", error_feedback=True)``."""
        return cls(lambda: compressors.make(name, error_feedback=error_feedback, **params))

    @classmethod
    def from_section(cls, section: dict) -> "Plan":
        """From a spec's compressor section (a dict: name, error_feedback, params, per_bucket)."""
        own = section_for({**section, "per_bucket": []}, 0)
        rules = []
        for rule in section.get("per_bucket") or ():
            sec = section_for({**section, "per_bucket": [rule]}, 0)
            rules.append((rule["below_mb"] * MB, lambda sec=sec: make_section(sec)))
        return cls(lambda: make_section(own), rules)

    @property
    def mixed(self) -> bool:
        return bool(self.rules)

    def make(self, nbytes: float) -> Compressor:
        """A new instance for a bucket of ``nbytes`` gradient bytes."""
        for below, factory in self.rules:
            if nbytes < below:
                return factory()
        return self.default()

    def problem(self, check: Callable[[Compressor], Optional[str]]) -> Optional[str]:
        """The first of ``check``'s complaints about any compressor this plan can make, or None."""
        for factory in [f for _, f in self.rules] + [self.default]:
            c = factory()
            msg = check(c)
            if msg:
                return f"{c.name} {msg}"
        return None
