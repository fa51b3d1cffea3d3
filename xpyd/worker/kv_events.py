"""Which KV blocks this worker caches, as a log that routers follow (``GET /xpyd/kv_events`` and its stream).

The engine records the allocator's stored/removed block hashes after each step (``record``); a reader
asks for the events after the sequence number it has seen (``since``). A reader that is new, that
fell behind the bounded log, or that saw another process (``epoch`` changes on every start) gets a
snapshot of every cached hash instead. Streams (``xpyd.worker.kv_stream``) ``subscribe`` to be woken after
each ``record`` that changed something, instead of asking. Thread-safe: the engine writes, the HTTP thread
reads.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Iterable

MAX_EVENTS = 1 << 16  # events kept for readers that ask for the ones after their last


class KVEventLog:
    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.epoch = secrets.token_hex(8)
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, int]] = deque(maxlen=max_events)  # (seq, kind, hash)
        self._seq = 0
        self._cached: set[int] = set()
        self._subscribers: dict[int, Callable[[], None]] = {}
        self._next_id = 0
        self.closed = False  # set by close(): streams end

    def record(self, stored: Iterable[int], removed: Iterable[int]) -> None:
        with self._lock:
            before = self._seq
            for h in removed:  # (net changes since the last call: no hash is in both lists)
                self._seq += 1
                self._events.append((self._seq, "removed", h))
                self._cached.discard(h)
            for h in stored:
                self._seq += 1
                self._events.append((self._seq, "stored", h))
                self._cached.add(h)
            wake = list(self._subscribers.values()) if self._seq != before else ()
        for w in wake:  # (outside the lock: a wake-up only schedules work on a reader's event loop)
            w()

    def since(self, epoch: str | None, seq: int | None, limit: int | None = None) -> dict:
        """The events after ``seq`` of this ``epoch`` (the first ``limit`` of them, ``seq`` then being the
        last one's), or a snapshot when those are not all here."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if epoch == self.epoch and seq is not None and oldest - 1 <= seq <= self._seq:
                newer = list(islice(reversed(self._events), self._seq - seq))  # the newest are at the right
                newer.reverse()
                if limit is not None:
                    del newer[limit:]
                last = newer[-1][0] if newer else seq
                return {"epoch": self.epoch, "seq": last, "events": [[kind, h] for _, kind, h in newer]}
            return {"epoch": self.epoch, "seq": self._seq, "snapshot": sorted(self._cached)}

    @property
    def seq(self) -> int:
        return self._seq

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake()`` (from the engine thread: it must only hand over, e.g. ``call_soon_threadsafe``)
        after every ``record`` that added events, and once on ``close``; returns the unsubscribe."""
        with self._lock:
            key = self._next_id
            self._next_id += 1
            self._subscribers[key] = wake

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers.pop(key, None)

        return unsubscribe

    def close(self) -> None:
        """The worker is stopping: every stream ends (its readers reconnect elsewhere or follow it no more)."""
        with self._lock:
            self.closed = True
            wake = list(self._subscribers.values())
        for w in wake:
            w()

    @property
    def num_cached(self) -> int:
        return len(self._cached)
