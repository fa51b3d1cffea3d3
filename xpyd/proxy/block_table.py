"""Block hash -> mask of slot bits, in numpy arrays: the storage under ``BlockHolders``.

An open-addressing table: ``_keys`` (uint64 hashes, 0 = an empty row) and ``_masks`` (uint64 words of slot
bits, ``words`` per row), linear probing::

    update(slot, hashes, stored)  -> a batch (distinct hashes) in a few array passes
    update_each(slot, events)     -> a few KV events, one at a time in Python over the arrays' views (array
                                     passes cost ~50 us a call, an event in Python ~0.7 us)
    masks_of(hashes) / mask_one(h) -> held masks as Python ints, the same two ways

A row's home is its mixed hash scaled onto ``capacity`` rows; probes run past the end into ``_PAD`` spare
rows instead of wrapping (an insert that would pass them rebuilds the table larger). A lookup in an array
pass reads windows of ``_WIN`` rows from the home while many are left, the last ``_FEW`` go on one row at
a time in Python; a batch's lookups also note each absent hash's first free row, where it is inserted. A
block no slot holds any more keeps its key with a zero mask (a tombstone): its own hash comes back to that
row, a new hash may take it. When rows with a key pass ``_MAX_LOAD`` of the capacity, the table is rebuilt
from its held rows at ``_REBUILD_LOAD``, every row placed in one sorted pass (at 6M blocks: ~0.5 s, as a
dict of that size takes to grow). Hash 0 (the empty marker) has a row of its own past the probed ones.
Memory: 8 bytes a row for the hash and 8 per mask word (one word up to 64 slots), 0.6 to 0.8 of the rows
held: 20-27 bytes per distinct block with one word, whatever the number of holders.

A write clears the bits of slots that are not ``live`` from the row it writes (a retired slot's bit means
nothing until ``clear`` has cleared it everywhere).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

_WIN = 8  # rows an array-pass lookup reads at once
_PAD = 4096  # rows past the capacity that probes may run into
_MAX_LOAD = 0.8  # rows with a key (held or tombstone) over the capacity: rebuild above this
_REBUILD_LOAD = 0.6  # held rows over the capacity just after a rebuild
_MIN_CAPACITY = 1024
_FEW = 16  # lookups left past a window go on one row at a time in Python once this few
_AR = np.arange(_WIN)
M64 = (1 << 64) - 1
_MIX = 0xD6E8FEB86659FD93  # odd: x -> x * _MIX mod 2**64 is one-to-one


def hash_array(hashes: Iterable[int], n: int) -> np.ndarray:
    return np.fromiter(hashes, np.uint64, n)


class BlockTable:
    def __init__(self) -> None:
        self.words = 1
        self.held = 0  # rows with a nonzero mask (distinct blocks held, retired bits included until cleared)
        self._used = 0  # probed rows with a key (held or tombstone)
        self.set_live(0)
        self._alloc(_MIN_CAPACITY)

    def _alloc(self, capacity: int) -> None:
        self._capacity = capacity
        rows = capacity + _PAD + _WIN + 1  # probed rows, rows a last window reads (always empty), hash 0's row
        self._keys = np.zeros(rows, np.uint64)
        self._masks = np.zeros((rows, self.words), np.uint64)
        self._nil = rows - 2  # an always empty row (lookups of absent hashes read its zero mask)
        self._zero = rows - 1  # hash 0's row
        self._views()

    def _views(self) -> None:
        """Python views of the arrays for one-by-one work (an item read is a Python int, no numpy scalar)."""
        self._key_view = memoryview(self._keys)
        self._mask_view = memoryview(self._masks.reshape(-1))

    def set_live(self, live: int) -> None:
        """The mask of the slots in use (writes clear the others' bits from their rows)."""
        self._live_list = [(live >> 64 * w) & M64 for w in range(self.words)]
        self._live_words = np.array(self._live_list, np.uint64)

    def widen(self, words: int, live: int) -> None:
        masks = np.zeros((len(self._masks), words), np.uint64)
        masks[:, :self.words] = self._masks
        self._masks, self.words = masks, words
        self._views()
        self.set_live(live)

    def clear(self) -> None:
        """Clear the bits of the slots not live from every row. O(rows), in array passes."""
        masks = self._masks
        masks &= self._live_words
        self.held = int(np.count_nonzero(masks.any(axis=1)))

    # ------------------------------------------------------------------ rows

    def _home(self, q: np.ndarray, capacity: int) -> np.ndarray:
        """Each hash's first row: its bits mixed (Fibonacci hashing of it folded once: a hash from anywhere
        may be regular), the top 32 scaled to the rows. ``_home_one`` is the same for one hash."""
        x = q ^ (q >> np.uint64(29))
        x *= np.uint64(_MIX)
        return ((x >> np.uint64(32)) * np.uint64(capacity) >> np.uint64(32)).astype(np.int64)

    def _home_one(self, h: int) -> int:
        return (((h ^ h >> 29) * _MIX & M64) >> 32) * self._capacity >> 32

    def _find(self, q: np.ndarray, free: np.ndarray | None = None) -> np.ndarray:
        """Each hash's row; ``_nil`` where it has none (hash 0: its own row). ``free`` (``_nil`` each, if
        given): set to the first free row (empty, or a tombstone) on each absent hash's way."""
        at = np.full(len(q), self._nil, np.int64)
        at[q == 0] = self._zero
        todo = np.flatnonzero(q)
        start = self._home(q[todo], self._capacity)
        while len(todo) > _FEW:
            rows = start[:, None] + _AR
            win = self._keys[rows]
            eq = win == q[todo, None]
            hit = eq.any(axis=1)
            at[todo[hit]] = start[hit] + eq[hit].argmax(axis=1)
            if free is not None:
                empty = (win == 0) | ~self._masks[rows].any(axis=2)
                first = empty.any(axis=1) & (free[todo] == self._nil)
                free[todo[first]] = start[first] + empty[first].argmax(axis=1)
            on = ~hit & (win != 0).all(axis=1)  # a hash is never past an empty row on its way (rows are
            todo, start = todo[on], start[on] + _WIN  # emptied only by rebuilds)
        keys, masks, words, nil = self._key_view, self._mask_view, self.words, self._nil
        for i, h, row in zip(todo.tolist(), q[todo].tolist(), start.tolist()):
            k = keys[row]
            first = free is None or free[i] != nil
            while k != h and k:
                if not first and not any(masks[row * words:(row + 1) * words]):
                    free[i], first = row, True
                row += 1
                k = keys[row]
            if k:
                at[i] = row
            elif not first:
                free[i] = row
        return at

    def _place(self, q: np.ndarray) -> np.ndarray:
        """A free row (empty, or a tombstone) on each absent hash's way."""
        at = np.zeros(len(q), np.int64)
        todo = np.arange(len(q))
        start = self._home(q, self._capacity)
        keys, masks = self._keys, self._masks
        while len(todo) > _FEW:  # the rows past the spare ones are empty: every way ends
            rows = start[:, None] + _AR
            free = (keys[rows] == 0) | ~masks[rows].any(axis=2)
            has = free.any(axis=1)
            at[todo[has]] = start[has] + free[has].argmax(axis=1)
            todo, start = todo[~has], start[~has] + _WIN
        key_view, mask_view, words = self._key_view, self._mask_view, self.words
        for i, row in zip(todo.tolist(), start.tolist()):
            while key_view[row] and any(mask_view[row * words:(row + 1) * words]):
                row += 1
            at[i] = row
        return at

    def _insert(self, q: np.ndarray, slot: int, at: np.ndarray | None = None) -> None:
        """Absent hashes (distinct, none 0), held by ``slot`` alone; ``at``: a free row on each one's way
        (found before this batch's writes), if known."""
        if self._used + len(q) > _MAX_LOAD * self._capacity:
            self._rebuild(len(q))
            at = None
        row = np.zeros(self.words, np.uint64)
        row[slot // 64] = np.uint64(1 << slot % 64)
        while len(q):
            if at is None:
                at = self._place(q)
            if at.max() >= self._capacity + _PAD:
                self._rebuild(len(q), grow=True)
                at = None
                continue
            empty = self._keys[at] == 0
            free = empty | ~self._masks[at].any(axis=1)  # (a tombstone held again since is not)
            tried, keys = at[free], q[free]
            self._keys[tried] = keys  # two hashes given one row: the last one written has it
            won = np.zeros(len(q), bool)
            won[free] = self._keys[tried] == keys
            self._masks[at[won]] = row
            self._used += int(np.count_nonzero(empty & won))
            self.held += int(np.count_nonzero(won))
            q, at = q[~won], None

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
        self._keys[at], self._masks[at] = keys[order], masks[order]
        self._masks[self._zero] = zero
        self._used = len(keys)
        self.held = len(keys) + bool(zero.any())

    # ------------------------------------------------------------------ writes

    def update(self, slot: int, hashes: np.ndarray, stored: np.ndarray) -> int:
        """``slot`` holds (``stored`` True) or no longer holds each of ``hashes`` (uint64, distinct); how many
        more blocks it holds than before (negative: fewer)."""
        free = np.full(len(hashes), self._nil, np.int64)
        at = self._find(hashes, free)
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
        self.held += int(np.count_nonzero(new.any(axis=1))) - int(np.count_nonzero(old.any(axis=1)))
        add = ~found & stored
        added = hashes[add]
        if len(added):
            self._insert(added, slot, free[add])
        return int(np.count_nonzero(on)) - int(np.count_nonzero(~on)) + len(added)

    def update_each(self, slot: int, events: Iterable[tuple[str, int]]) -> int:
        """``update`` of a few KV events (``("stored" | "removed", hash)``), one at a time in order, in Python
        over the arrays' views; how many more blocks ``slot`` holds than before."""
        if self.words > 1:
            return sum([self._update_one(slot, h, kind == "stored") for kind, h in events])
        keys, masks, capacity = self._key_view, self._mask_view, self._capacity  # (one mask word a row)
        bit, live, change = 1 << slot, self._live_list[0], 0
        for kind, h in events:
            stored = kind == "stored"
            row = self._zero
            if h:
                row, free = (((h ^ h >> 29) * _MIX & M64) >> 32) * capacity >> 32, None  # _home_one, inline
                k = keys[row]
                while k != h and k:
                    if free is None and not masks[row]:
                        free = row  # a tombstone: the first free row on its way
                    row += 1
                    k = keys[row]
                if not k:
                    if not stored:
                        continue
                    change += 1
                    if free is None:
                        free = row
                    if free >= capacity + _PAD or self._used + 1 > _MAX_LOAD * capacity:
                        self._insert(np.array([h], np.uint64), slot)  # (rebuilds first)
                        keys, masks, capacity = self._key_view, self._mask_view, self._capacity
                        continue
                    self._used += not keys[free]
                    self.held += 1
                    keys[free], masks[free] = h, bit
                    continue
            m = masks[row]
            if bool(m & bit) != stored:
                masks[row] = new = m & live | bit if stored else m & live & ~bit
                self.held += bool(new) - bool(m)
                change += 1 if stored else -1
        return change

    def _update_one(self, slot: int, h: int, stored: bool) -> int:
        """``update`` of one hash, in Python over the arrays' views, any number of mask words: +1, -1 or 0."""
        words, keys, masks = self.words, self._key_view, self._mask_view
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
                self.held += 1
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
        self.held += bool(any_bit(row)) - bool(was)
        return 1 if stored else -1

    # ------------------------------------------------------------------ reads

    def mask_one(self, h: int) -> int:
        """``h``'s held mask, looked up in Python over the views."""
        words, keys, masks = self.words, self._key_view, self._mask_view
        row = self._zero
        if h:
            row = (((h ^ h >> 29) * _MIX & M64) >> 32) * self._capacity >> 32  # _home_one, inline
            k = keys[row]
            while k != h:
                if not k:
                    return 0
                row += 1
                k = keys[row]
        if words == 1:
            return masks[row]
        return sum(masks[row * words + w] << 64 * w for w in range(words))

    def masks_of(self, hashes: Sequence[int]) -> list[int]:
        """Each of ``hashes``' held mask, looked up in array passes."""
        masks = self._masks[self._find(hash_array(hashes, len(hashes)))]
        if self.words == 1:
            return masks[:, 0].tolist()
        return [sum(w << 64 * i for i, w in enumerate(row)) for row in masks.tolist()]

    def hashes(self) -> set[int]:
        """Every hash some slot holds (a retired one included until cleared). O(rows)."""
        probed = slice(0, self._capacity + _PAD)
        out = set(self._keys[probed][self._masks[probed].any(axis=1)].tolist())
        if self._masks[self._zero].any():
            out.add(0)
        return out

    def nbytes(self) -> int:
        return self._keys.nbytes + self._masks.nbytes
