"""Which KV blocks each worker caches, as far as the proxy knows: the cache-aware router's map.

A worker's entry is the blocks it reported, plus blocks the proxy expects it to hold::

    GET /xpyd/kv_events (each poll)  -> KVUpdate -> apply():
        events   ["stored", h] adds h, ["removed", h] drops it (also from the expected ones)
        snapshot replaces its blocks (first poll, a restarted worker, or events it no longer has)
    the proxy routes a request there -> expect(): the request's blocks count as held for
                                       ``expect_seconds``, until its events confirm them
    the worker goes down or leaves   -> drop() / retain(): forgotten, and its next poll starts afresh
    routing                          -> match_all(): how many leading blocks of a request's chain each
                                        worker holds, in one walk down the chain (match(): one worker)

Hashes are chained (``xpyd.prefix_hash``): block i's hash names every token up to its end, so a run of
leading hits is a cached prefix. The blocks live in ``BlockHolders`` (block hash -> bitmask of workers, in
numpy arrays): an update is applied and a request's chain looked up in a few array passes, whatever the
number of workers, and memory goes with the distinct blocks (~20-27 bytes each up to 64 workers, ~10-13
more per 64 workers beyond), not with (worker, block) pairs.
Everything runs on the proxy's event loop: no locks.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.block_holders import BlockHolders

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
    """One worker's entry: its slot in the index's block masks and what it has told the proxy."""

    slot: int
    cursor: Cursor | None = None  # None: nothing heard yet (its next poll asks for a snapshot)
    reported: int = 0  # blocks it reported it holds
    # hash -> until when it counts as held (routed here, not confirmed yet), the latest last
    expected: dict[int, float] = field(default_factory=dict)


def _key(worker: WorkerInfo) -> tuple[Role, str]:
    return worker.role, worker.http_url


class PrefixIndex:
    def __init__(self, expect_seconds: float = EXPECT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not expect_seconds >= 0:
            raise ValueError(f"expect_seconds must be >= 0, got {expect_seconds}")
        self._workers: dict[tuple[Role, str], WorkerBlocks] = {}
        self._blocks = BlockHolders()
        self._lapses: deque[tuple[float, WorkerBlocks, int]] = deque()  # expectations, soonest lapse first
        self._expect_seconds = expect_seconds
        self._clock = clock

    def entry(self, worker: WorkerInfo) -> WorkerBlocks:
        """``worker``'s entry, created empty if it has none. A poll holds on to it: ``apply`` with it
        changes nothing once the worker was dropped meanwhile."""
        key = _key(worker)
        entry = self._workers.get(key)
        if entry is None:
            entry = self._workers[key] = WorkerBlocks(self._blocks.take(len(self._workers)))
        return entry

    def get(self, worker: WorkerInfo) -> WorkerBlocks | None:
        return self._workers.get(_key(worker))

    def apply(self, worker: WorkerInfo, entry: WorkerBlocks, update: KVUpdate) -> bool:
        """Apply ``update`` (read with ``entry.cursor``); False if it does not follow on from the cursor
        (the entry is then reset, so the next poll asks for a snapshot) or the entry was dropped."""
        if self._workers.get(_key(worker)) is not entry:
            return False
        blocks = self._blocks
        if update.snapshot is not None:
            self._clear(entry)
            slot, expected, snapshot = entry.slot, entry.expected, update.snapshot
            blocks.store(slot, snapshot, len(snapshot))
            for h in [h for h in expected if h in snapshot]:
                del expected[h]
                blocks.unexpect(slot, h)
            entry.reported = len(snapshot)
        elif entry.cursor is None or entry.cursor.epoch != update.epoch or update.seq < entry.cursor.seq:
            self._clear(entry)  # events for another life of the cache, or going back
            entry.cursor = None
            return False
        elif update.events:
            slot, expected = entry.slot, entry.expected
            entry.reported += blocks.apply(slot, update.events)
            if expected:
                for _, h in update.events:
                    if expected.pop(h, None) is not None:
                        blocks.unexpect(slot, h)
        entry.cursor = Cursor(update.epoch, update.seq)
        return True

    def _clear(self, entry: WorkerBlocks) -> None:
        """Forget the blocks ``entry``'s worker reported (its expected ones stay): a fresh slot."""
        if not entry.reported:
            return  # no block under its slot
        blocks = self._blocks
        blocks.retire(entry.slot, entry.expected)
        entry.slot, entry.reported = blocks.take(len(self._workers)), 0
        for h in entry.expected:
            blocks.expect(entry.slot, h)

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
        self._lapse(now)
        until = now + self._expect_seconds
        blocks, slot, expected, lapses = self._blocks, entry.slot, entry.expected, self._lapses
        for h, held in zip(hashes, blocks.holds(slot, hashes)):
            if held:
                continue
            if expected.pop(h, None) is None:
                blocks.expect(slot, h)
            expected[h] = until
            lapses.append((until, entry, h))

    def _lapse(self, now: float) -> None:
        """Expectations whose time is up no longer count (one TTL for all: the queue is in time order)."""
        lapses, blocks = self._lapses, self._blocks
        while lapses and lapses[0][0] <= now:
            until, entry, h = lapses.popleft()
            if entry.expected.get(h) == until:  # not confirmed, renewed or dropped since
                del entry.expected[h]
                blocks.unexpect(entry.slot, h)

    def match_all(self, hashes: Sequence[int], workers: Sequence[WorkerInfo]) -> list[int]:
        """For each of ``workers``, how many leading blocks of ``hashes`` (one request's chain) it holds:
        one walk down the chain for all of them."""
        self._lapse(self._clock())
        entries = self._workers
        slots = []
        for w in workers:
            entry = entries.get(_key(w))
            slots.append(entry.slot if entry is not None else None)
        return self._blocks.walk(hashes, slots)

    def match(self, worker: WorkerInfo, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` (one request's chain) ``worker`` holds."""
        return self.match_all(hashes, (worker,))[0]

    def blocks(self, worker: WorkerInfo) -> int | None:
        """Blocks ``worker`` reported it caches; None if it reported nothing yet."""
        entry = self._workers.get(_key(worker))
        if entry is None or entry.cursor is None:
            return None
        return entry.reported

    def drop(self, worker: WorkerInfo) -> None:
        self._drop(_key(worker))

    def _drop(self, key: tuple[Role, str]) -> None:
        entry = self._workers.pop(key, None)
        if entry is not None:
            self._blocks.retire(entry.slot, entry.expected)
            entry.expected.clear()  # (its queued lapses find nothing)

    def retain(self, workers: Iterable[WorkerInfo]) -> None:
        """Drop every worker not in ``workers`` (the registry's current list)."""
        keep = {_key(w) for w in workers}
        for key in [k for k in self._workers if k not in keep]:
            self._drop(key)

    def nbytes(self) -> int:
        """Bytes the block tables take (their arrays, and the expected blocks' dict)."""
        return self._blocks.nbytes()

    def distinct_blocks(self) -> int:
        """Block hashes some worker reported (each counted once, however many hold it)."""
        return self._blocks.distinct()
