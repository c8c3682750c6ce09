"""dear's buffer-cap search: golden-section search over caps by measured iteration time.

``CapTuner`` is pure (fed times); ``CapSearch`` is the tuner the driver (commlab/engine/tuners/driver.py)
runs in a dear run with ``comm.tune``: each trial cap runs ``comm.tune_steps`` steps (the first,
after its relayout, is not counted), rank 0 decides the next cap or the best one.
"""
from __future__ import annotations

import math
import statistics
from typing import Dict, List, Optional, Sequence

from commlab.engine.schedules import MB, layout_cap
from commlab.engine.tuners.driver import Decision, Tuner


def cap_candidates(total_bytes: int, lo_mb: float = 1 / 16) -> List[float]:
    """Caps to search: powers of two from ``lo_mb`` up to the first that holds the whole model."""
    caps = [lo_mb]
    while caps[-1] * MB < total_bytes:
        caps.append(caps[-1] * 2)
    return caps


class CapTuner:
    """Search the buffer cap by measured iteration time, with no extra dependency:
    golden-section search over the candidates (powers of two, so over log cap),
    assuming iteration time is unimodal in log cap (small caps pay per-collective
    latency, large caps start the first collective late and overlap less).

    ``propose()`` gives the next cap to try (None when the search is over),
    ``report(cap, times)`` its measured iteration times (the median counts).
    ``best`` is the fastest cap measured. Pure: the communicator's owner measures,
    rank 0 decides and broadcasts."""

    INVPHI = (math.sqrt(5) - 1) / 2

    def __init__(self, caps: Sequence[float]):
        if not caps:
            raise ValueError("cap candidates: need at least one")
        self.caps = list(caps)
        self.measured: Dict[int, float] = {}
        self.a, self.b = 0, len(self.caps) - 1
        self.trials: List[tuple] = []

    def _probe_points(self):
        a, b = self.a, self.b
        c = b - round((b - a) * self.INVPHI)
        d = a + round((b - a) * self.INVPHI)
        return (c, d) if c < d else (c, min(c + 1, b))

    def _next_index(self) -> Optional[int]:
        while self.b - self.a > 2:
            c, d = self._probe_points()
            for i in (c, d):
                if i not in self.measured:
                    return i
            if self.measured[c] <= self.measured[d]:
                self.b = d
            else:
                self.a = c
        for i in range(self.a, self.b + 1):  # three or fewer left: measure them all
            if i not in self.measured:
                return i
        return None

    def propose(self) -> Optional[float]:
        i = self._next_index()
        return None if i is None else self.caps[i]

    def report(self, cap: float, times: Sequence[float]) -> None:
        t = statistics.median(times)
        self.measured[self.caps.index(cap)] = t
        self.trials.append((cap, t))

    @property
    def best(self) -> float:
        return self.caps[min(self.measured, key=self.measured.get)]


class CapSearch(Tuner):
    name = "dear-cap"

    def __init__(self, spec, comm, run_dir: Optional[str]):
        super().__init__(spec, comm, run_dir)
        self.window, self.skip = spec.comm.tune_steps, 1
        total = sum(p.numel * p.element_size for p in comm.infos)
        self.search = CapTuner(cap_candidates(total))
        self.cap = self.search.propose()

    def _layout(self, cap: float):
        return layout_cap(self.comm.infos, cap)

    def start(self) -> Decision:
        return Decision(self._layout(self.cap), what=f"dear cap {self.cap:g} MB")

    def decide(self, times, ready_steps, measured) -> Decision:
        self.search.report(self.cap, times)
        nxt = self.search.propose()
        final = nxt is None
        cap = self.search.best if final else nxt
        log = {"cap_mb": self.cap, "median_ms": 1e3 * statistics.median(times), "next_cap_mb": cap, "done": final}
        self.info["trace"] = [{"cap_mb": c, "ms": 1e3 * t} for c, t in self.search.trials]
        if final:
            self.info["chosen"] = {"cap_mb": cap}
        layout = None if cap == self.cap else self._layout(cap)
        self.cap = cap
        return Decision(layout, final=final, what=f"dear cap {cap:g} MB", log=log)
