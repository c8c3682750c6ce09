"""What a process keeps of what it computed: values under keys, the least recently used first out past a bound,
safe across the UI server's threads. The pages' figures, the previews, the predictions, the calibrations, the cost
curves and the built downloads each keep theirs in one.

Computing a value is the caller's, outside the lock: two threads asking at once for a key not kept yet may both
compute it (the callers that must not, a child process per model, hold a lock of their own around it).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, List

_MISSING = object()


class Kept:
    """At most ``most`` values, by key; a key asked for or put becomes the most recently used."""

    def __init__(self, most: int):
        self.most = most
        self._items: "OrderedDict[Hashable, Any]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key: Hashable, value: Any) -> Any:
        """Keep ``value`` under ``key`` (the oldest go past ``most``); returns it."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.most:
                self._items.popitem(last=False)
        return value

    def get_or(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value kept under ``key``, else ``make()``, kept (None included)."""
        hit = self.get(key, _MISSING)
        return self.put(key, make()) if hit is _MISSING else hit

    def values(self) -> List[Any]:
        with self._lock:
            return list(self._items.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
