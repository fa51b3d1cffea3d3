"""A bounded, time-limited memory of request ids the prefill worker no longer holds.

Two uses: requests that ended here without being pulled (expired lease, aborted,
failed prefill), so a later lookup gets a clear answer instead of "unknown"; and
releases that arrived before the request itself (the decode side gave up first),
so the request is dropped on arrival instead of holding KV for a whole lease.
Both are bounded: the oldest entries go first, and nothing is kept past
``retention`` seconds.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class RecentIds(Generic[V]):
    def __init__(self, retention: float, max_entries: int) -> None:
        if retention <= 0 or max_entries < 1:
            raise ValueError("retention must be > 0 and max_entries >= 1")
        self.retention = retention
        self.max_entries = max_entries
        self._items: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def add(self, key: str, value: V, now: float) -> None:
        self._items.pop(key, None)
        self._items[key] = (now, value)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, key: str) -> V | None:
        entry = self._items.get(key)
        return None if entry is None else entry[1]

    def pop(self, key: str) -> V | None:
        entry = self._items.pop(key, None)
        return None if entry is None else entry[1]

    def prune(self, now: float) -> None:
        while self._items:
            key, (added, _) = next(iter(self._items.items()))
            if now - added < self.retention:
                return
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)
