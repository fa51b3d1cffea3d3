"""A bounded, time-limited memory of request ids the prefill worker no longer holds.

Two uses: requests that ended here (expired lease, aborted, failed prefill, or sent), so a
later lookup gets a clear answer instead of "unknown"; and
releases that arrived before the request itself (the decode side gave up first),
so the request is dropped on arrival instead of holding KV for a whole lease.
Both are bounded: at most ``max_entries`` ids (the least recently used goes first),
and an id is forgotten ``retention`` seconds after it was last set.

The memory is a plain ``cachetools.TTLCache`` (id -> value): ``cache[id] = value``,
``cache.get(id)``, ``id in cache``, ``cache.pop(id, None)``, and ``cache.expire()``
to drop what is past its time (setting an id does that too). Not thread-safe: the
engine touches it only under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cachetools import TTLCache


def recent_ids(retention: float, max_entries: int, timer: Callable[[], float] = time.monotonic) -> TTLCache:
    """An empty memory; ``timer`` (seconds, monotonic) is injectable for tests."""
    if retention <= 0 or max_entries < 1:
        raise ValueError("retention must be > 0 and max_entries >= 1")
    return TTLCache(maxsize=max_entries, ttl=retention, timer=timer)


class RequestMemory:
    """What a prefill worker remembers of requests it no longer holds (each a ``recent_ids`` memory):

    - ``ended``: request id -> the ``LookupResult`` a later lookup gets instead of "unknown": how a request
      that is no longer held ended here (expired, aborted, failed: its status and why; sent: SENDING with
      its first token, for a decode worker whose READY push was lost on the way);
    - ``released_early``: ids released before they arrived (dropped on arrival);
    - ``claimed_early``: ids their decode worker claimed before they arrived (claimed on arrival).
    """

    def __init__(self, retention: float, max_entries: int, timer: Callable[[], float] = time.monotonic) -> None:
        self.ended: TTLCache = recent_ids(retention, max_entries, timer)
        self.released_early: TTLCache = recent_ids(retention, max_entries, timer)
        self.claimed_early: TTLCache = recent_ids(retention, max_entries, timer)

    def expire(self) -> None:
        for memory in (self.ended, self.released_early, self.claimed_early):
            memory.expire()
