"""Which KV blocks this worker caches, as a log that routers follow (``GET /xpyd/kv_events``).

The engine records the allocator's stored/removed block hashes after each step (``record``); a reader
asks for the events after the sequence number it has seen (``since``). A reader that is new, that
fell behind the bounded log, or that saw another process (``epoch`` changes on every start) gets a
snapshot of every cached hash instead. Thread-safe: the engine writes, the HTTP thread reads.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from typing import Iterable

MAX_EVENTS = 1 << 16  # events kept for readers that ask for the ones after their last


class KVEventLog:
    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.epoch = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, int]] = deque(maxlen=max_events)  # (seq, kind, hash)
        self._seq = 0
        self._cached: set[int] = set()

    def record(self, stored: Iterable[int], removed: Iterable[int]) -> None:
        with self._lock:
            for h in removed:  # (net changes since the last call: no hash is in both lists)
                self._seq += 1
                self._events.append((self._seq, "removed", h))
                self._cached.discard(h)
            for h in stored:
                self._seq += 1
                self._events.append((self._seq, "stored", h))
                self._cached.add(h)

    def since(self, epoch: str | None, seq: int | None) -> dict:
        """The events after ``seq`` of this ``epoch``, or a snapshot when those are not all here."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if epoch == self.epoch and seq is not None and oldest - 1 <= seq <= self._seq:
                events = [[kind, h] for s, kind, h in self._events if s > seq]
                return {"epoch": self.epoch, "seq": self._seq, "events": events}
            return {"epoch": self.epoch, "seq": self._seq, "snapshot": sorted(self._cached)}

    @property
    def num_cached(self) -> int:
        return len(self._cached)
