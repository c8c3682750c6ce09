"""Append-only JSON-lines writer: one write call per line, so lines from
several ranks never interleave and a killed process keeps every line it wrote."""
from __future__ import annotations

import json
import os

TRIALS = "trials.json"
"""A trial session's list of trials in its run directory (the advisor writes it, engine.worker runs it)."""


class JsonlWriter:
    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, obj: dict) -> None:
        os.write(self._fd, (json.dumps(obj, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_jsonl(path: str) -> list:
    """Read a JSONL file, skipping a torn last line of a killed writer."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out
