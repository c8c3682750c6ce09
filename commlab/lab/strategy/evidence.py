"""The measured accuracy that strategy choice leans on where the lab's own runs say nothing: the accuracy
benchmarks' results, shipped with the lab as package data (evidence.json, written by
scripts/publish_evidence.py from bench/results; the product never reads bench/)."""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import List, Optional


@lru_cache(maxsize=1)
def _load() -> dict:
    return json.loads(resources.files("commlab.lab.strategy").joinpath("evidence.json").read_text())


def compressor_results() -> List[dict]:
    """The compressor accuracy benchmark's results, each {file, measured, steps, cells}; a later entry's
    cells replace an earlier one's (a rerun)."""
    return _load().get("compressor_accuracy") or []


def strategy_results() -> Optional[dict]:
    """The strategy accuracy benchmark's result {file, measured, steps, cells}, or None."""
    return _load().get("strategy_accuracy")
