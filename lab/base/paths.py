"""Where the lab's own files are: the source tree it runs from (``SOURCE``: the workers' PYTHONPATH, the app's
entry, the shipped examples and notebooks) and the runs directory every command defaults to."""
from __future__ import annotations

import os
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2]
"""The folder that holds engine/, lab/, app/ and commlab/ (a checkout, or site-packages for a wheel)."""


def default_root() -> Path:
    """The runs directory: $COMMLAB_RUNS, else ./runs."""
    return Path(os.environ.get("COMMLAB_RUNS") or "runs")
