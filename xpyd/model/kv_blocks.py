"""Which KV blocks a worker's requests hold: reference counts, a prefix cache, and LRU eviction.

The paged KV pool is `num_blocks` fixed-size blocks; a request holds a list of them (its block table).
Every block is in exactly one of three states:

    free        ref 0, no hash: never filled, or its KV named nothing reusable
    evictable   ref 0, cached: holds the KV of a full block named by its hash, kept for a later request
    referenced  ref > 0, cached or not: part of at least one live request's block table

A full block is named by a hash chained over the tokens so far (`prefix_hash.block_hashes`). When it is
full, its request `commit`s it: the block is now cached (block hash -> block). A new request `match`es its
hashes against the cache, `acquire`s the blocks of the longest cached prefix (shared, ref += 1) and
`allocate`s fresh blocks for the rest. Acquire the hits before allocating: `allocate` may evict an
unreferenced hit. On `release` a cached block whose ref drops to 0 becomes evictable, not free; `allocate`
takes plain free blocks first and evicts the least recently released cached blocks only when it must.

Within one `release` call, later blocks become evictable as older than earlier ones: a prompt's tail
blocks are shared by fewer requests than its head, and a tail block is useless once its head is gone.

Cache changes are recorded as events (hashes stored, hashes removed) that `take_events` hands out, for a
worker that publishes its cache. Pure Python: no torch, no I/O; every operation is O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

_HASH_LIMIT = 2**64


class PoolFull(Exception):
    """Not enough free blocks: the caller waits until requests finish."""


class AllocatorCorrupt(ValueError):
    """An invariant of the block allocator is broken (a bug, not a caller's mistake)."""


class BlockAllocator:
    """Reference-counted KV blocks with a prefix cache (block hash -> block) and LRU eviction."""

    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._caching = bool(caching)
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest (evicted first) at the front
        self._cached: dict[int, int] = {}  # block hash -> block
        self._stored: dict[int, None] = {}  # events since take_events, net: a hash is in at most one
        self._removed: dict[int, None] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def caching(self) -> bool:
        return self._caching

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now: plain free ones plus cached unreferenced (evictable) ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self._num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        _check_count(n)
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """`n` blocks with ref 1 and no hash; plain free blocks first, then the least recently released
        cached ones (evicted: their hashes leave the cache). PoolFull, and nothing taken, if too few."""
        _check_count(n)
        if n > self.num_free:
            raise PoolFull(f"{n} KV blocks needed, {self.num_free} of {self._num_blocks} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def match(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes`, in order. Takes no reference and leaves
        the LRU order alone: `acquire` the blocks to keep them."""
        blocks = []
        if self._caching:
            for h in hashes:
                block = self._cached.get(h)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def acquire(self, blocks: Sequence[int]) -> None:
        """ref += 1 for each block (a cached unreferenced block stops being evictable). ValueError, and
        nothing changed, for a block that is neither referenced nor cached."""
        for block in blocks:
            self._check_id(block)
            if self._ref[block] == 0 and self._hash[block] is None:
                raise ValueError(f"KV block {block} is free: acquire takes only referenced or cached blocks")
        for block in blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """ref -= 1 for each block (a duplicate counts twice). At 0 a cached block becomes evictable (later
        blocks of the list older than earlier ones), an uncached one free. ValueError, and nothing
        changed, for a block released more often than it is referenced."""
        counts: dict[int, int] = {}
        for block in blocks:
            self._check_id(block)
            counts[block] = counts.get(block, 0) + 1
        for block, count in counts.items():
            if count > self._ref[block]:
                raise ValueError(f"KV block {block} has {self._ref[block]} references, released {count} "
                                 "times (double release?)")
        for block in reversed(blocks):  # the tail first: it is the oldest, evicted before the head
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def commit(self, block: int, block_hash: int) -> bool:
        """`block` (referenced, now full) holds the KV named by `block_hash`: cache it. True if it is now
        cached under that hash (also if it already was); False, and no change, when caching is off or
        another block holds that hash. ValueError if the block is unreferenced or has another hash."""
        self._check_id(block)
        if isinstance(block_hash, bool) or not isinstance(block_hash, int) or not 0 <= block_hash < _HASH_LIMIT:
            raise ValueError(f"a block hash is an int in [0, 2**64), got {block_hash!r}")
        if self._ref[block] == 0:
            raise ValueError(f"KV block {block} is not referenced: only a request's own block is committed")
        current = self._hash[block]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"KV block {block} is already cached under hash {current:#x}, not {block_hash:#x}")
            return True
        if not self._caching or block_hash in self._cached:
            return False
        self._cached[block_hash] = block
        self._hash[block] = block_hash
        if block_hash in self._removed:  # removed and stored again since the last take_events: no change
            del self._removed[block_hash]
        else:
            self._stored[block_hash] = None
        return True

    def ref(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def hash_of(self, block: int) -> int | None:
        self._check_id(block)
        return self._hash[block]

    def take_events(self) -> tuple[list[int], list[int]]:
        """(hashes stored, hashes removed) since the last call, each in order. The changes are net: a hash
        stored and then removed (or removed and stored again) between two calls is in neither list, so
        the two lists are disjoint and applying them in either order gives the cache's hashes now."""
        events = (list(self._stored), list(self._removed))
        self._stored, self._removed = {}, {}
        return events

    def clear_cache(self) -> int:
        """Move every cached unreferenced block to the plain free list; returns how many. Referenced
        blocks keep their hashes."""
        n = len(self._evictable)
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self._free.append(block)
        return n

    def check(self) -> None:
        """Raise AllocatorCorrupt if an invariant is broken. O(num_blocks): for tests and debugging."""
        n = self._num_blocks
        free = set(self._free)
        evictable = set(self._evictable)
        if len(free) != len(self._free):
            raise AllocatorCorrupt("a block is on the free list twice")
        strays = (free | evictable) - set(range(n))
        if strays:
            raise AllocatorCorrupt(f"free or evictable ids outside the pool: {sorted(strays, key=repr)}")
        if free & evictable:
            raise AllocatorCorrupt(f"blocks both free and evictable: {sorted(free & evictable)}")
        referenced = 0
        for block in range(n):
            ref, h = self._ref[block], self._hash[block]
            if ref < 0:
                raise AllocatorCorrupt(f"block {block} has ref {ref}")
            if ref > 0:
                referenced += 1
                if block in free or block in evictable:
                    raise AllocatorCorrupt(f"block {block} has ref {ref} and is also free or evictable")
            elif block in free:
                if h is not None:
                    raise AllocatorCorrupt(f"free block {block} still has hash {h:#x}")
            elif block in evictable:
                if h is None:
                    raise AllocatorCorrupt(f"evictable block {block} has no hash")
            else:
                raise AllocatorCorrupt(f"block {block} has ref 0 but is neither free nor evictable (leaked)")
            if h is not None and self._cached.get(h) != block:
                raise AllocatorCorrupt(f"block {block} has hash {h:#x}, which the cache maps to "
                                       f"{self._cached.get(h)}")
        for h, block in self._cached.items():
            if not (isinstance(block, int) and 0 <= block < n) or self._hash[block] != h:
                raise AllocatorCorrupt(f"the cache maps hash {h:#x} to block {block}, which does not hold it")
        if not self._caching and self._cached:
            raise AllocatorCorrupt(f"caching is off but {len(self._cached)} blocks are cached")
        if referenced + len(free) + len(evictable) != n:
            raise AllocatorCorrupt(f"{referenced} referenced + {len(free)} free + {len(evictable)} evictable "
                                   f"!= {n} blocks")

    def _uncache(self, block: int) -> None:
        h = self._hash[block]
        del self._cached[h]
        self._hash[block] = None
        if h in self._stored:  # stored since the last take_events: no net change
            del self._stored[h]
        else:
            self._removed[h] = None

    def _check_id(self, block: int) -> None:
        if type(block) is not int or not 0 <= block < self._num_blocks:
            raise ValueError(f"KV block {block!r} does not exist (the pool has {self._num_blocks})")


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a block count is an int >= 0, got {n!r}")
