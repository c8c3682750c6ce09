"""Append-only JSON-lines writer: one write call per line, so lines from
several ranks never interleave and a killed process keeps every line it wrote; and the one
whole-or-nothing file writer and the "keep a damaged file aside" the engine and the lab share."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
from typing import IO, Callable, Optional


def write_atomic(path, write: Callable[[IO], None], mode: int = 0o644, binary: bool = False) -> None:
    """Write ``path`` whole or not at all: ``write(f)`` fills a temporary file of this call's own (threads and
    processes never share one: ``.NAME.PID-THREAD-RANDOM.tmp`` beside it), which is fsynced and renamed over
    ``path``. Readers see the old file or the new one; a writer killed mid-write leaves at most its temporary
    file. ``mode``: the new file's permissions. Errors are raised, after the temporary file is removed."""
    path = os.fspath(path)
    d, name = os.path.split(path)
    tmp = os.path.join(d, f".{name}.{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path, obj, indent=1, mode: int = 0o644, **dump) -> None:
    """``obj`` as JSON, written whole or not at all (``write_atomic``); ``dump``: more keywords for json.dump."""
    write_atomic(path, lambda f: json.dump(obj, f, indent=indent, **dump), mode)


def set_aside(path, read: Optional[os.stat_result] = None, said: str = "kept as") -> str:
    """Rename a damaged file to ``<name>.corrupt-<time>-<pid>`` (kept for a look, never deleted and never written
    over); says where it went (``said`` and the new name), for the line that reports it. With ``read`` (the stat
    of the file that was found damaged), a file another process has put there since (a good one) is left alone."""
    path = os.fspath(path)
    base = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    aside, k = base, 0
    while os.path.exists(aside):  # one kept aside earlier in the same second: never written over
        k += 1
        aside = f"{base}-{k}"
    try:
        if read is not None:
            now = os.stat(path)
            if (now.st_dev, now.st_ino) != (read.st_dev, read.st_ino):
                return "another process has replaced it already"
        os.replace(path, aside)
    except FileNotFoundError:
        return "another process has moved it aside already"
    except OSError as e:
        return f"it could not be moved aside ({e})"
    return f"{said} {os.path.basename(aside)}"


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
