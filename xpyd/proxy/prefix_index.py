"""Which KV blocks each worker caches, as far as the proxy knows: the cache-aware router's map.

A worker's entry is the set of block hashes it reported, plus blocks the proxy expects it to hold::

    GET /xpyd/kv_events (each poll)  -> KVUpdate -> apply():
        events   ["stored", h] adds h, ["removed", h] drops it (also from the expected ones)
        snapshot replaces the set (first poll, a restarted worker, or events it no longer has)
    the proxy routes a request there -> expect(): the request's blocks count as held for
                                       ``expect_seconds``, until its events confirm them
    the worker goes down or leaves   -> drop() / retain(): forgotten, and its next poll starts afresh
    routing                          -> match(): how many leading blocks of a request's chain it holds

Hashes are chained (``xpyd.prefix_hash``): block i's hash names every token up to its end, so a run of
leading hits is a cached prefix. Everything runs on the proxy's event loop: no locks. Memory: about
80 bytes per cached block per worker (a set of ints); a 100,000-block worker costs ~8 MB.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from xpyd.discovery.types import Role, WorkerInfo

EXPECT_SECONDS = 10.0  # routed blocks count as cached this long unless the worker's events confirm them
MAX_EPOCH_CHARS = 64
_HASH_LIMIT = 2**64


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """A request's prompt as the index sees it: its length and the chained hashes of its full blocks
    (``xpyd.proxy.prompt_tokens`` computes them)."""

    num_tokens: int
    block_size: int
    hashes: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        """Blocks the prompt fills, the last one possibly in part (what a worker computes or holds)."""
        return math.ceil(self.num_tokens / self.block_size)


Hash = Annotated[int, msgspec.Meta(ge=0)]  # and < 2**64: checked after decoding (msgspec's bounds stop at int64)


class KVUpdate(msgspec.Struct, frozen=True):
    """One ``GET /xpyd/kv_events`` answer: the events after the cursor up to ``seq``, or a snapshot."""

    epoch: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_EPOCH_CHARS)]  # one life of its cache
    seq: Annotated[int, msgspec.Meta(ge=0)]
    events: tuple[tuple[Literal["stored", "removed"], Hash], ...] | None = None  # in order
    snapshot: set[Hash] | None = None  # every hash it caches as of ``seq`` (``apply`` adopts this set)

    @classmethod
    def from_json(cls, body: bytes | str) -> KVUpdate:
        """Decoded and checked in one pass (a 100,000-block snapshot: ~15 ms); ValueError if malformed."""
        update = _DECODER.decode(body)  # msgspec's DecodeError is a ValueError
        if (update.events is None) == (update.snapshot is None):
            raise ValueError("expected either 'events' or 'snapshot'")
        hashes = update.snapshot if update.snapshot is not None else [h for _, h in update.events or ()]
        if hashes and max(hashes) >= _HASH_LIMIT:
            raise ValueError("a hash is not in [0, 2**64)")
        return update


_DECODER = msgspec.json.Decoder(KVUpdate)


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a worker's event stream was read up to (sent back as ``?epoch=&since=``)."""

    epoch: str
    seq: int


@dataclass(eq=False, slots=True)
class WorkerBlocks:
    """One worker's entry."""

    cursor: Cursor | None = None  # None: nothing heard yet (its next poll asks for a snapshot)
    cached: set[int] = field(default_factory=set)  # as the worker reported
    # hash -> until when it counts as held, soonest first (one TTL for all: the latest goes last)
    expected: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def holds(self, h: int, now: float) -> bool:
        if h in self.cached:
            return True
        until = self.expected.get(h)
        return until is not None and until > now


def _key(worker: WorkerInfo) -> tuple[Role, str]:
    return worker.role, worker.http_url


class PrefixIndex:
    def __init__(self, expect_seconds: float = EXPECT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not expect_seconds >= 0:
            raise ValueError(f"expect_seconds must be >= 0, got {expect_seconds}")
        self._workers: dict[tuple[Role, str], WorkerBlocks] = {}
        self._expect_seconds = expect_seconds
        self._clock = clock

    def entry(self, worker: WorkerInfo) -> WorkerBlocks:
        """``worker``'s entry, created empty if it has none. A poll holds on to it: ``apply`` with it
        changes nothing once the worker was dropped meanwhile."""
        return self._workers.setdefault(_key(worker), WorkerBlocks())

    def get(self, worker: WorkerInfo) -> WorkerBlocks | None:
        return self._workers.get(_key(worker))

    def apply(self, worker: WorkerInfo, entry: WorkerBlocks, update: KVUpdate) -> bool:
        """Apply ``update`` (read with ``entry.cursor``); False if it does not follow on from the cursor
        (the entry is then reset, so the next poll asks for a snapshot) or the entry was dropped."""
        if self._workers.get(_key(worker)) is not entry:
            return False
        if update.snapshot is not None:
            entry.cached = update.snapshot
            for h in [h for h in entry.expected if h in entry.cached]:
                del entry.expected[h]
        elif entry.cursor is None or entry.cursor.epoch != update.epoch or update.seq < entry.cursor.seq:
            entry.cursor, entry.cached = None, set()  # events for another life of the cache, or going back
            return False
        else:
            cached, expected = entry.cached, entry.expected
            for kind, h in update.events or ():
                if kind == "stored":
                    cached.add(h)
                else:
                    cached.discard(h)
                expected.pop(h, None)
        entry.cursor = Cursor(update.epoch, update.seq)
        return True

    def reset(self, worker: WorkerInfo) -> None:
        """Forget where ``worker``'s events were read up to: its next poll asks for a snapshot."""
        entry = self._workers.get(_key(worker))
        if entry is not None:
            entry.cursor = None

    def expect(self, worker: WorkerInfo, hashes: Sequence[int]) -> None:
        """``worker`` was sent a request with these blocks: it will hold them soon."""
        if not hashes:
            return
        entry = self.entry(worker)
        now = self._clock()
        expected = entry.expected
        while expected and next(iter(expected.values())) <= now:  # lapsed: the worker never confirmed them
            expected.popitem(last=False)
        until = now + self._expect_seconds
        cached = entry.cached
        for h in hashes:
            if h not in cached:
                expected[h] = until
                expected.move_to_end(h)

    def match(self, worker: WorkerInfo, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` (one request's chain) ``worker`` holds."""
        entry = self._workers.get(_key(worker))
        if entry is None:
            return 0
        now = self._clock()
        n = 0
        for h in hashes:
            if not entry.holds(h, now):
                break
            n += 1
        return n

    def blocks(self, worker: WorkerInfo) -> int | None:
        """Blocks ``worker`` reported it caches; None if it reported nothing yet."""
        entry = self._workers.get(_key(worker))
        if entry is None or entry.cursor is None:
            return None
        return len(entry.cached)

    def drop(self, worker: WorkerInfo) -> None:
        self._workers.pop(_key(worker), None)

    def retain(self, workers: Iterable[WorkerInfo]) -> None:
        """Drop every worker not in ``workers`` (the registry's current list)."""
        keep = {_key(w) for w in workers}
        for key in [k for k in self._workers if k not in keep]:
            del self._workers[key]
