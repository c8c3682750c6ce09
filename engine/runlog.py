"""Append-only JSON-lines writer: one write call per line, so lines from
several ranks never interleave and a killed process keeps every line it wrote; and the one
whole-or-nothing JSON file writer the engine and the lab share."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading


def write_json_atomic(path, obj, indent=1, mode: int = 0o644, **dump) -> None:
    """Write ``obj`` to ``path`` whole or not at all: a temporary file of this call's own (threads and
    processes never share one: ``.NAME.PID-THREAD-RANDOM.tmp`` beside it), fsynced, renamed over ``path``.
    Readers see the old file or the new one; a writer killed mid-write leaves at most its temporary file.
    ``mode``: the new file's permissions; ``dump``: more keywords for json.dump. Errors are raised, after the
    temporary file is removed."""
    path = os.fspath(path)
    d, name = os.path.split(path)
    tmp = os.path.join(d, f".{name}.{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent, **dump)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
