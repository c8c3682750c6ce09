"""Per-rank timeline of spans, written as Chrome trace events (JSON lines).

Spans are collected in memory during a step and written once per step, one
line per event, flushed, so a killed run keeps every finished step. Times are
host clocks (``perf_counter``) mapped onto wall-clock microseconds, so ranks
on one machine share a time base. Collective completions are stamped from
the communication thread through a future callback; appending to a list is
atomic under the GIL, so that needs no lock.

On CUDA, compute spans are measured with CUDA events instead (``Clock``):
an event is recorded at each mark and resolved one step later, when it has
surely completed, so recording never blocks the GPU.
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional

LANES = {
    "step": 0, "forward": 1, "backward": 2, "compress": 3, "comm": 4,
    "wait": 5, "decompress": 6, "optimizer": 7, "eval": 8, "ready": 9, "tune": 10,
    "advisor": 11,  # strategy auto: its profiling run's steps (written by the lab before the ranks start), the trials
    "outer": 12,  # a method's own exchanges (commlab/engine/methods/): local SGD's averages, DiLoCo's outer syncs, DeMo's
    "fragment": 13,  # Streaming DiLoCo: a fragment's exchange, in flight across inner steps
    "slow": 14,  # a slower worker (network.cluster's speed < 1): the wait that stretches its forward and backward
}
LANE_NAMES = {v: k for k, v in LANES.items()}


def ends_step(event: dict) -> bool:
    """Whether a timeline event is a step's ``step`` span: a step's spans are flushed together and end with it,
    so a reader counts steps by these (``commlab.engine.runlog.JsonlTail.last``)."""
    return event.get("tid") == LANES["step"]

_compact = json.JSONEncoder(separators=(",", ":")).encode
"""``json.dumps(obj, separators=(",", ":"))`` without building an encoder per call."""
_SCALARS = (str, int, float, bool, type(None))


class Clock:
    """Host clock in seconds, aligned to the wall clock at start."""

    def __init__(self):
        self.wall0 = time.time()
        self.perf0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter()

    def mark(self):
        """A time token for a compute span: a host time here, a CUDA event on GPU."""
        return time.perf_counter()

    def to_us(self, t: float) -> float:
        return (self.wall0 + (t - self.perf0)) * 1e6


class CudaClock(Clock):
    """Marks are CUDA events on the current stream; ``resolve`` turns one into
    host seconds once it has completed, relative to a reference event whose
    host time was taken when it completed."""

    def __init__(self, device):
        super().__init__()
        import torch
        self.torch = torch
        self.device = device
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record()
        self.ref.synchronize()
        self.ref_host = time.perf_counter()

    def mark(self):
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def resolve(self, e) -> float:
        return self.ref_host + self.ref.elapsed_time(e) / 1e3


class Timeline:
    def __init__(self, path: Optional[str], rank: int, enabled: bool = True, clock: Optional[Clock] = None):
        self.rank = rank
        self.enabled = enabled and path is not None
        self.clock = clock or Clock()
        self.events: List[tuple] = []
        self.pending_cuda: List[tuple] = []
        self._heads: Dict[tuple, str] = {}
        """(lane, name) -> the start of its event's JSON line, up to the timestamp."""
        self._args: Dict[int, tuple] = {}
        """id(args) -> (args, a copy of it, its JSON): args dicts passed again, encoded once."""
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if self.enabled else None

    def now(self) -> float:
        return self.clock.now()

    def mark(self):
        return self.clock.mark()

    def span(self, lane: str, name: str, t0, t1, args: Optional[dict] = None) -> None:
        """Record a span between two host times, or two marks (CUDA events are resolved later)."""
        if not self.enabled:
            return
        if isinstance(t0, float):
            self.events.append((lane, name, t0, t1, args))
        else:
            self.pending_cuda.append((lane, name, t0, t1, args))

    def flush(self) -> None:
        """Write the collected spans, one JSON line each, and flush them to the file."""
        if not self.enabled:
            return
        events, self.events = self.events, []
        if self.pending_cuda:
            # query each end event once: one that completes between two queries would fall in neither list
            done = [s[3].query() for s in self.pending_cuda]
            ready = [s for s, d in zip(self.pending_cuda, done) if d]
            self.pending_cuda = [s for s, d in zip(self.pending_cuda, done) if not d]
            for lane, name, e0, e1, args in ready:
                events.append((lane, name, self.clock.resolve(e0), self.clock.resolve(e1), args))
        if not events:
            return
        lines = []
        wall0, perf0 = self.clock.wall0, self.clock.perf0  # Clock.to_us, inlined
        heads, argc = self._heads, self._args
        if len(heads) > 4096:  # names that change every step ("step 12") would grow it without end
            heads.clear()
        if len(argc) > 4096:  # so would args made afresh every step ({"step": 12})
            argc.clear()
        for lane, name, t0, t1, args in events:
            head = heads.get((lane, name))
            if head is None:  # the part that does not change between steps, formatted once
                head = heads[lane, name] = (f'{{"ph":"X","name":{json.dumps(name)},"pid":{self.rank},'
                                            f'"tid":{LANES[lane]},"cat":"{lane}","ts":')
            # '%.1f' is round(v, 1)'s decimal (both round correctly), at a third of its cost
            line = f'{head}{(wall0 + (t0 - perf0)) * 1e6:.1f},"dur":{(t1 - t0) * 1e6:.1f}'
            if args:
                # the probe passes the same args dict for a layer every step: encode it once, and again
                # only if it changed (its copy is compared; only flat dicts of scalars are kept)
                hit = argc.get(id(args))
                if hit is not None and hit[0] is args and hit[1] == args:
                    enc = hit[2]
                else:
                    enc = _compact(args)
                    if all(type(v) in _SCALARS for v in args.values()):
                        argc[id(args)] = (args, dict(args), enc)
                lines.append(f'{line},"args":{enc}}}')
            else:
                lines.append(line + "}")
        # one write per step, to an O_APPEND file: cheap, and a killed rank loses at most its current step
        os.write(self._fd, ("\n".join(lines) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            for span in self.pending_cuda:  # the last steps' events: wait for them rather than drop them
                span[3].synchronize()
            self.flush()
            os.close(self._fd)
            self._fd = None
