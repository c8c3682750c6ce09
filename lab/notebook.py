"""Small conveniences shared by the notebooks in notebooks/ (no engine logic here either).

``COMMLAB_QUICK=1`` (set by the test that executes the notebooks in CI) shortens every
experiment so each notebook runs in well under three minutes; without it the notebooks
run their full-length settings (a few minutes each on a 2-core laptop).
"""
from __future__ import annotations

import os
from pathlib import Path

QUICK = os.environ.get("COMMLAB_QUICK", "") not in ("", "0")


def pick(full, quick):
    """``quick`` under COMMLAB_QUICK, else ``full``."""
    return quick if QUICK else full


def runs_dir() -> str:
    """Where the notebooks' runs go: $COMMLAB_RUNS, else runs/ at the repository root (the UI's default),
    so every run a notebook starts also shows up in the lab UI."""
    env = os.environ.get("COMMLAB_RUNS")
    if env:
        return env
    return str(Path(__file__).resolve().parent.parent / "runs")
