"""Which workers hold each KV block: one bitmask per block hash, one bit (a *slot*) per worker.

The prefix index's storage. A worker takes a slot when the index first hears of it; a block's mask has
the slots of the workers that hold it::

    held      block hash -> mask, in numpy arrays  blocks the workers reported (KV events, snapshots)
    expected  {hash: mask}                         blocks routed to them and not confirmed yet (the index
                                                   lapses these; few, so a dict)
    apply(slot, events), store(slot, snapshot)
                          -> a batch in a few array passes (each hash as its last event says); up to
                             ``_SMALL`` events one by one in Python (array passes cost ~50 us a call)
    walk(chain, slots)    -> how many leading blocks each slot holds: one pass down the chain, its first
                             ``_ONE_BY_ONE`` blocks looked up one by one, the rest in chunks of array
                             passes, stopping when no slot's run goes on

``held`` is an open-addressing table: ``_keys`` (uint64 hashes, 0 = an empty row) and ``_masks``
(uint64 words of slot bits, ``words`` per row), linear probing. A row's home is its mixed hash scaled onto
``capacity`` rows; probes run past the end into ``_PAD`` spare rows instead of wrapping (a probe that would
pass them rebuilds the table larger). A lookup in an array pass reads a window of ``_WIN`` rows from the
home, and goes on one row at a time past it (a few lookups in a hundred). A block no worker holds any more
keeps its key with a zero mask (a tombstone): its own hash comes back to that row, a new hash may take it.
When rows with a key pass ``_MAX_LOAD`` of the capacity, the table is rebuilt from its held rows at
``_REBUILD_LOAD``, every row placed in one sorted pass. Hash 0 (the empty marker) has a row of its own past
the probed ones. Memory: 8 bytes a row for the hash, 8 per mask word (one word up to 64 slots), at 0.6 to
0.8 of the rows held: 20-27 bytes per distinct block with one word, whatever the number of holders.

A slot is retired (its worker left, or its cache was replaced by a snapshot) by clearing it from the
live mask: a retired bit left in a mask means nothing, and is cleared when that block is next written.
Retired slots are reused only after a sweep has cleared them everywhere (one pass over the masks); a
sweep runs when no clean slot is left and either the slot numbers have reached twice the workers (+32) or
a new slot would need another mask word. Everything runs on the proxy's event loop: no locks.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterable, Sequence

import numpy as np

_MIN_SLOTS = 32  # slot numbers may reach 2 x workers + this before retired slots are swept for reuse
_WIN = 8  # rows a probe reads at once (a lookup reads one window in an array pass, then goes on in Python)
_PAD = 4096  # rows past the capacity that probes may run into
_MAX_LOAD = 0.8  # rows with a key (held or tombstone) over the capacity: rebuild above this
_REBUILD_LOAD = 0.6  # held rows over the capacity just after a rebuild
_MIN_CAPACITY = 1024
_ONE_BY_ONE = 64  # a chain's first blocks looked up in Python (array passes cost ~30 us a call)
_CHUNK = 256  # then chunks of this many blocks in array passes, each next one 4 times as long
_SMALL = 32  # updates of up to this many events are applied one by one (array passes cost ~50 us a batch)
_AR = np.arange(_WIN)
_M64 = (1 << 64) - 1
_MIX = 0xD6E8FEB86659FD93  # odd: x -> x * _MIX mod 2**64 is one-to-one


def _hash_array(hashes: Iterable[int], n: int) -> np.ndarray:
    return np.fromiter(hashes, np.uint64, n)


class BlockHolders:
    def __init__(self) -> None:
        self.expected: dict[int, int] = {}
        self._live = 0  # mask of the slots in use
        self._retired = 0  # mask of the slots retired since the last sweep (their bits may linger in ``held``)
        self._free: list[int] = []  # swept slots, lowest first (a heap)
        self._next = 0  # slots ever made
        self._words = 1
        self._set_live(0)
        self._held = 0  # rows with a nonzero mask (distinct blocks held, counting retired bits until swept)
        self._used = 0  # probed rows with a key (held or tombstone)
        self._alloc(_MIN_CAPACITY)

    def _alloc(self, capacity: int) -> None:
        self._capacity = capacity
        rows = capacity + _PAD + _WIN + 1  # probed rows, rows a last window reads (always empty), hash 0's row
        self._keys = np.zeros(rows, np.uint64)
        self._masks = np.zeros((rows, self._words), np.uint64)
        self._nil = rows - 2  # an always empty row (lookups of absent hashes read its zero mask)
        self._zero = rows - 1  # hash 0's row
        self._views()

    def _views(self) -> None:
        """Python views of the arrays for one-by-one updates (an item read is a Python int, no numpy scalar)."""
        self._key_view = memoryview(self._keys)
        self._mask_view = memoryview(self._masks.reshape(-1))

    @property
    def slots(self) -> int:
        """Slot numbers made so far (the widest mask)."""
        return self._next

    @property
    def words(self) -> int:
        """Mask words per block."""
        return self._words

    # ------------------------------------------------------------------ slots

    def take(self, workers: int) -> int:
        """A clean slot for a new worker (``workers``: how many hold one now)."""
        if not self._free and self._retired and (self._next >= 2 * workers + _MIN_SLOTS
                                                 or self._next >= 64 * self._words):
            self.sweep()
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot, self._next = self._next, self._next + 1
        if slot >= 64 * self._words:
            self._widen(slot // 64 + 1)
        self._set_live(self._live | 1 << slot)
        return slot

    def retire(self, slot: int, expected: Iterable[int]) -> None:
        """``slot`` no longer stands for its worker; ``expected``: the blocks it expected (cleared now)."""
        bit = 1 << slot
        for h in expected:
            self.unexpect(slot, h)
        self._set_live(self._live & ~bit)
        self._retired |= bit

    def sweep(self) -> None:
        """Clear the retired slots from every mask and make them free. O(rows), in array passes."""
        masks = self._masks
        masks &= self._live_words
        self._held = int(np.count_nonzero(masks.any(axis=1)))
        retired, self._retired = self._retired, 0
        while retired:
            low = retired & -retired
            heapq.heappush(self._free, low.bit_length() - 1)
            retired ^= low

    def _set_live(self, live: int) -> None:
        self._live = live
        self._live_list = [(live >> 64 * w) & _M64 for w in range(self._words)]
        self._live_words = np.array(self._live_list, np.uint64)

    def _widen(self, words: int) -> None:
        masks = np.zeros((len(self._masks), words), np.uint64)
        masks[:, :self._words] = self._masks
        self._masks, self._words = masks, words
        self._views()
        self._set_live(self._live)

    # ------------------------------------------------------------------ the table

    def _home(self, q: np.ndarray, capacity: int) -> np.ndarray:
        """Each hash's first row: its bits mixed (Fibonacci hashing of it folded once: a hash from anywhere
        may be regular), the top 32 scaled to the rows. ``_home_one`` is the same for one hash."""
        x = q ^ (q >> np.uint64(29))
        x *= np.uint64(_MIX)
        return ((x >> np.uint64(32)) * np.uint64(capacity) >> np.uint64(32)).astype(np.int64)

    def _find(self, q: np.ndarray) -> np.ndarray:
        """Each hash's row; ``_nil`` where it has none (hash 0: its own row). One window read in an array
        pass; a way longer than the window (a few in a hundred at most) goes on one row at a time."""
        at = np.full(len(q), self._nil, np.int64)
        at[q == 0] = self._zero
        todo = np.flatnonzero(q)
        start = self._home(q[todo], self._capacity)
        win = self._keys[start[:, None] + _AR]
        eq = win == q[todo, None]
        hit = eq.any(axis=1)
        at[todo[hit]] = start[hit] + eq[hit].argmax(axis=1)
        on = np.flatnonzero(~hit & (win != 0).all(axis=1))  # a hash is never past an empty row on its way
        if len(on):  # (rows are emptied only by rebuilds)
            keys = self._key_view
            for i, h, row in zip(todo[on].tolist(), q[todo[on]].tolist(), (start[on] + _WIN).tolist()):
                k = keys[row]
                while k != h and k:
                    row += 1
                    k = keys[row]
                if k:
                    at[i] = row
        return at

    def _place(self, q: np.ndarray) -> np.ndarray | None:
        """A free row (empty, or a tombstone) on each absent hash's way; None if one is past the spare rows."""
        at = np.zeros(len(q), np.int64)
        todo = np.arange(len(q))
        start = self._home(q, self._capacity)
        keys, masks = self._keys, self._masks
        while len(todo):  # the rows past the spare ones are empty: every way ends
            rows = start[:, None] + _AR
            free = (keys[rows] == 0) | ~masks[rows].any(axis=2)
            has = free.any(axis=1)
            at[todo[has]] = start[has] + free[has].argmax(axis=1)
            todo, start = todo[~has], start[~has] + _WIN
        return None if len(q) and at.max() >= self._capacity + _PAD else at

    def _insert(self, q: np.ndarray, slot: int) -> None:
        """Absent hashes (distinct, none 0), held by ``slot`` alone."""
        if self._used + len(q) > _MAX_LOAD * self._capacity:
            self._rebuild(len(q))
        row = np.zeros(self._words, np.uint64)
        row[slot // 64] = np.uint64(1 << slot % 64)
        while len(q):
            at = self._place(q)
            if at is None:
                self._rebuild(len(q), grow=True)
                continue
            empty = self._keys[at] == 0
            self._keys[at] = q  # two hashes given one row: the last one written has it
            won = self._keys[at] == q
            self._masks[at[won]] = row
            self._used += int(np.count_nonzero(empty[won]))
            self._held += int(np.count_nonzero(won))
            q = q[~won]

    def _rebuild(self, extra: int, grow: bool = False) -> None:
        """The held rows into a new table with room for ``extra`` more (tombstones dropped)."""
        probed = slice(0, self._capacity + _PAD)
        keep = self._masks[probed].any(axis=1)
        keys, masks = self._keys[probed][keep], self._masks[probed][keep]
        zero = self._masks[self._zero].copy()
        capacity = max(_MIN_CAPACITY, int((len(keys) + extra) / _REBUILD_LOAD))
        if grow:
            capacity = max(capacity, self._capacity * 5 // 4)
        while True:
            home = self._home(keys, capacity)
            order = np.argsort(home, kind="stable")
            home = home[order]
            ranks = np.arange(len(keys))
            at = ranks + np.maximum.accumulate(home - ranks) if len(keys) else ranks  # linear probing, in order
            if not len(at) or at[-1] < capacity + _PAD:
                break
            capacity = capacity * 5 // 4
        self._alloc(capacity)
        self._keys[at], self._masks[at] = keys[order], masks[order]  # (the views see the new arrays' rows)
        self._masks[self._zero] = zero
        self._used = len(keys)
        self._held = len(keys) + bool(zero.any())

    # ------------------------------------------------------------------ one slot's blocks

    def update(self, slot: int, hashes: np.ndarray, stored: np.ndarray) -> int:
        """``slot``'s worker holds (``stored`` True) or no longer holds each of ``hashes`` (uint64, distinct);
        how many more blocks it holds than before (negative: fewer)."""
        at = self._find(hashes)
        word, bit = slot // 64, np.uint64(1 << slot % 64)
        found = at != self._nil
        rows, on = at[found], stored[found]
        old = self._masks[rows]
        had = (old[:, word] & bit) != 0
        change = on != had
        rows, on, old = rows[change], on[change], old[change]
        new = old & self._live_words
        new[:, word] = np.where(on, new[:, word] | bit, new[:, word] & ~bit)
        self._masks[rows] = new
        self._held += int(np.count_nonzero(new.any(axis=1))) - int(np.count_nonzero(old.any(axis=1)))
        added = hashes[~found & stored]
        if len(added):
            self._insert(added, slot)
        return int(np.count_nonzero(on)) - int(np.count_nonzero(~on)) + len(added)

    def apply(self, slot: int, events: Sequence[tuple[str, int]]) -> int:
        """KV events of ``slot``'s worker, in order (``("stored" | "removed", hash)``); the change in the
        blocks it holds. Each hash ends as its last event says."""
        n = len(events)
        if n <= _SMALL:
            return sum([self._update_one(slot, h, kind == "stored") for kind, h in events])
        hashes = _hash_array((h for _, h in events), n)
        stored = np.fromiter((kind == "stored" for kind, _ in events), bool, n)
        if n > 1:
            _, last = np.unique(hashes[::-1], return_index=True)
            last = n - 1 - last
            hashes, stored = hashes[last], stored[last]
        return self.update(slot, hashes, stored)

    def _update_one(self, slot: int, h: int, stored: bool) -> int:
        """``update`` of one hash, in Python over the arrays' views: +1, -1 or 0."""
        words, keys, masks = self._words, self._key_view, self._mask_view
        if words == 1:
            any_bit = masks.__getitem__  # row -> whether a slot holds it
        else:
            def any_bit(row: int) -> bool:
                return any(masks[row * words + w] for w in range(words))
        row = self._zero
        if h:
            row, free = self._home_one(h), None
            while keys[row] != h and keys[row]:
                if free is None and not any_bit(row):
                    free = row  # a tombstone: the first free row on its way
                row += 1
            if not keys[row]:
                if not stored:
                    return 0
                if free is None:
                    free = row
                if free >= self._capacity + _PAD or self._used + 1 > _MAX_LOAD * self._capacity:
                    self._insert(np.array([h], np.uint64), slot)  # (rebuilds first)
                    return 1
                self._used += not keys[free]
                self._held += 1
                keys[free] = h
                for w in range(words):
                    masks[free * words + w] = 0
                masks[free * words + slot // 64] = 1 << slot % 64
                return 1
        at, bit = row * words + slot // 64, 1 << slot % 64
        if bool(masks[at] & bit) == stored:
            return 0
        was = any_bit(row)
        for w, live in enumerate(self._live_list):
            masks[row * words + w] &= live
        masks[at] = masks[at] | bit if stored else masks[at] & ~bit
        self._held += bool(any_bit(row)) - bool(was)
        return 1 if stored else -1

    def _home_one(self, h: int) -> int:
        """``_home`` of one hash, in Python ints."""
        return (((h ^ h >> 29) * _MIX & _M64) >> 32) * self._capacity >> 32

    def store(self, slot: int, hashes: Iterable[int], n: int) -> int:
        """``slot``'s worker holds the ``n`` distinct ``hashes`` (a snapshot); how many it did not before."""
        return self.update(slot, _hash_array(hashes, n), np.ones(n, bool))

    def holds(self, slot: int, hashes: Sequence[int]) -> list[bool]:
        """Whether ``slot``'s worker holds each of ``hashes`` (expected ones aside)."""
        if len(hashes) <= _ONE_BY_ONE:
            return [bool(self._mask_one(h) >> slot & 1) for h in hashes]
        masks = self._masks[self._find(_hash_array(hashes, len(hashes))), slot // 64]
        return ((masks >> np.uint64(slot % 64)) & np.uint64(1)).astype(bool).tolist()

    def expect(self, slot: int, h: int) -> None:
        self.expected[h] = self.expected.get(h, 0) | 1 << slot

    def unexpect(self, slot: int, h: int) -> None:
        expected = self.expected
        m = expected.get(h, 0) & ~(1 << slot)
        if m:
            expected[h] = m
        else:
            expected.pop(h, None)

    # ------------------------------------------------------------------ matching

    def walk(self, hashes: Sequence[int], slots: Sequence[int | None]) -> list[int]:
        """For each of ``slots`` (a worker's slot, or None for a worker without one), how many leading blocks
        of ``hashes`` its worker holds or is expected to hold: one pass down the chain, its first
        ``_ONE_BY_ONE`` blocks looked up one by one, the rest in chunks of array passes, until no slot's run goes on."""
        alive = 0
        for s in slots:
            if s is not None:
                alive |= 1 << s
        ends: dict[int, int] = {}  # bit -> its match length
        expected = self.expected
        n, size = 0, _ONE_BY_ONE
        while n < len(hashes) and alive:
            chunk = hashes[n:n + size]
            masks = [self._mask_one(h) for h in chunk] if n == 0 else self._masks_of(chunk)
            for h, m in zip(chunk, masks):
                m = (m | expected.get(h, 0)) & alive if expected else m & alive
                gone = alive ^ m
                while gone:
                    low = gone & -gone
                    ends[low] = n
                    gone ^= low
                alive = m
                if not alive:
                    break
                n += 1
            size = _CHUNK if n == _ONE_BY_ONE else size * 4
        while alive:
            low = alive & -alive
            ends[low] = n
            alive ^= low
        return [0 if s is None else ends.get(1 << s, 0) for s in slots]

    def _mask_one(self, h: int) -> int:
        """``h``'s held mask, looked up in Python over the views."""
        words, keys, masks = self._words, self._key_view, self._mask_view
        row = self._zero
        if h:
            row = (((h ^ h >> 29) * _MIX & _M64) >> 32) * self._capacity >> 32  # _home_one, inline
            k = keys[row]
            while k != h:
                if not k:
                    return 0
                row += 1
                k = keys[row]
        if words == 1:
            return masks[row]
        return sum(masks[row * words + w] << 64 * w for w in range(words))

    def _masks_of(self, hashes: Sequence[int]) -> list[int]:
        """Each of ``hashes``' held mask, looked up in array passes."""
        masks = self._masks[self._find(_hash_array(hashes, len(hashes)))]
        if self._words == 1:
            return masks[:, 0].tolist()
        return [sum(w << 64 * i for i, w in enumerate(row)) for row in masks.tolist()]

    # ------------------------------------------------------------------ for tests and benchmarks

    def mask(self, h: int) -> int:
        """``h``'s held mask (retired bits included until swept)."""
        return self._masks_of([h])[0]

    def distinct(self) -> int:
        """Blocks some slot holds (a retired one included until swept)."""
        return self._held

    def hashes(self) -> set[int]:
        """Every block some slot holds (a retired one included until swept). O(rows)."""
        probed = slice(0, self._capacity + _PAD)
        out = set(self._keys[probed][self._masks[probed].any(axis=1)].tolist())
        if self._masks[self._zero].any():
            out.add(0)
        return out

    def nbytes(self) -> int:
        """Bytes of the table's arrays and of the expected blocks' dict (its hashes and masks)."""
        total = self._keys.nbytes + self._masks.nbytes + sys.getsizeof(self.expected)
        for h, m in self.expected.items():
            total += sys.getsizeof(h) + sys.getsizeof(m)
        return total
