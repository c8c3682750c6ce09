"""Append-only JSON-lines writer: one write call per line, so lines from
several ranks never interleave and a killed process keeps every line it wrote; its one reader
(``JsonlTail``, incremental, tolerant of a torn last line); and the one whole-or-nothing file writer
and the "keep a damaged file aside" the engine and the lab share."""
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


CHUNK = 1 << 18
"""Bytes a reader that starts near a file's end (``JsonlTail.last``) reads first; it reads four times as far back
each time that is not enough."""


class JsonlTail:
    """The rows appended to a JSON-lines file since the last ``read``: the one reader of the files the ranks append to
    (metrics.jsonl, the timelines), whether it follows a run (the launcher's progress, the live page), reads the last
    steps (``last``) or a whole file (``read_jsonl``).

    - Each read takes the bytes appended since the last one, up to the size the file has as it starts;
      ``bytes_read`` counts them all (a reader that follows a run reads each byte once).
    - A last line without its newline (a writer mid-line, or one killed there) waits for its end;
      ``read(final=True)`` takes it when it parses (the writer is done: a whole object is kept, a torn one skipped).
    - A line that does not parse (a killed writer's torn line) is skipped; so is a blank one.
    - A file replaced (another inode) or cut shorter is read again from its start, and ``restarted`` is True after
      that read: the rows start again.
    - A file that is not there (yet) reads as no rows.
    """

    def __init__(self, path, offset: int = 0):
        self.path = os.fspath(path)
        self.offset = offset
        self.buf = b""
        self.ino: Optional[int] = None
        self.bytes_read = 0
        self.restarted = False

    @classmethod
    def last(cls, path, n: Optional[int], marks: Callable[[dict], bool], chunk: int = CHUNK,
             max_bytes: Optional[int] = None) -> "JsonlTail":
        """A tail that starts late in the file: where more than ``n`` rows for which ``marks`` holds follow (the
        timeline's last ``n`` steps: ``commlab.engine.timeline.ends_step``), or at the start when the file holds no
        more than that. The file is read backwards from its end, so a long run costs no more than a short one.
        With ``max_bytes``, at most that much of the file's end is read: fewer steps when they do not fit,
        starting after the first marked row of that end (whole steps only; the file's end when none fits); ``n``
        None: as many steps as fit."""
        return cls(path, _start_of_last(os.fspath(path), n, marks, chunk, max_bytes))

    def read(self, final: bool = False) -> list:
        self.restarted = False
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            if (self.ino is not None and st.st_ino != self.ino) or st.st_size < self.offset:
                self.offset, self.buf, self.restarted = 0, b"", True
            self.ino = st.st_ino
            data = b""
            if st.st_size > self.offset:
                f.seek(self.offset)
                data = f.read(st.st_size - self.offset)
        self.offset += len(data)
        self.bytes_read += len(data)
        *lines, self.buf = (self.buf + data).split(b"\n")
        if final and self.buf:
            lines.append(self.buf)
            self.buf = b""
        return _parse(lines)


def _parse(lines) -> list:
    lines = [x for x in lines if x.strip()]
    if len(lines) > 64:  # one parse of them all as an array (a long timeline: about twice as fast); a line that
        try:             # is not one whole object (a torn line) makes it fail, and then each is read alone
            rows = json.loads(b"[" + b",".join(lines) + b"]")
            if len(rows) == len(lines) and all(type(r) is dict for r in rows):
                return rows
        except ValueError:
            pass
    out = []
    for line in lines:
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a torn line of a killed writer
    return out


def _start_of_last(path: str, n: Optional[int], marks: Callable[[dict], bool], chunk: int,
                   max_bytes: Optional[int] = None) -> int:
    """The byte offset ``JsonlTail.last`` starts at."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return 0
    if n is None:  # as many as fit: the bound's window at once, parsed once (by the read that follows)
        if max_bytes is None:
            raise ValueError("JsonlTail.last: n=None needs max_bytes")
        chunk = max_bytes
    with open(path, "rb") as f:
        while True:
            capped = max_bytes is not None and chunk >= max_bytes
            start = max(0, size - (min(chunk, max_bytes) if capped else chunk))
            f.seek(start)
            data = f.read(size - start)
            if start == 0:
                return 0
            cut = data.find(b"\n") + 1  # the first line is cut: start after it
            lines = data[cut:].split(b"\n")
            if n is not None and sum(1 for e in _parse(lines) if marks(e)) > n:
                return start + cut
            if capped:  # no more may be read: begin after the first mark, so that whole steps follow
                at = start + cut
                for line in lines:
                    at += len(line) + 1
                    if any(marks(e) for e in _parse([line])):
                        return min(at, size)
                return size
            chunk *= 4


def read_jsonl(path) -> list:
    """Every row of a JSONL file, read in one go (``JsonlTail``'s rules: a torn line of a killed writer is skipped,
    a last whole object without its newline is kept); [] when there is no file."""
    return JsonlTail(path).read(final=True)
