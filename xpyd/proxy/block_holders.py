"""Which workers hold each KV block: one bitmask per block hash, one bit (a *slot*) per worker.

The prefix index's storage. A worker takes a slot when the index first hears of it; a block's mask has
the slots of the workers that hold it::

    held      block hash -> mask (``BlockTable``: numpy arrays)  blocks the workers reported (KV events,
                                                                snapshots)
    expected  {hash: mask}                    blocks routed to them and not confirmed yet (the index lapses
                                              these; few, so a dict)
    apply(slot, events)   -> each hash as its last event says: in a few array passes, or up to ``_SMALL``
                             events one by one in Python
    walk(chain, slots)    -> how many leading blocks each slot holds: one pass down the chain, its masks
                             looked up in chunks (``_ONE_BY_ONE`` blocks one by one first, then array
                             passes), until no slot's run goes on

Memory goes with the distinct blocks (20-27 bytes each up to 64 slots, see ``block_table``), not with
(worker, block) pairs, and matching a chain costs the same whatever the number of workers.

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

from xpyd.proxy.block_table import BlockTable, hash_array

_MIN_SLOTS = 32  # slot numbers may reach 2 x workers + this before retired slots are swept for reuse
_ONE_BY_ONE = 64  # a chain's first blocks looked up in Python (array passes cost ~30 us a call)
_CHUNK = 256  # then chunks of this many blocks in array passes, each next one 4 times as long
_SMALL = 64  # updates of up to this many events are applied one by one (array passes cost ~50 us a batch)


class BlockHolders:
    def __init__(self) -> None:
        self.table = BlockTable()
        self.expected: dict[int, int] = {}
        self._live = 0  # mask of the slots in use
        self._retired = 0  # mask of the slots retired since the last sweep (their bits may linger in ``held``)
        self._free: list[int] = []  # swept slots, lowest first (a heap)
        self._next = 0  # slots ever made
        self._version = 0  # changes with every write to the masks
        self._memo: tuple[Sequence[int] | None, int, list[int]] = (None, 0, [])  # a chain's masks (``_chain``)

    @property
    def slots(self) -> int:
        """Slot numbers made so far (the widest mask)."""
        return self._next

    @property
    def words(self) -> int:
        """Mask words per block."""
        return self.table.words

    # ------------------------------------------------------------------ slots

    def take(self, workers: int) -> int:
        """A clean slot for a new worker (``workers``: how many hold one now)."""
        if not self._free and self._retired and (self._next >= 2 * workers + _MIN_SLOTS
                                                 or self._next >= 64 * self.words):
            self.sweep()
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot, self._next = self._next, self._next + 1
        self._live |= 1 << slot
        if slot >= 64 * self.words:
            self.table.widen(slot // 64 + 1, self._live)
        self.table.set_live(self._live)
        return slot

    def retire(self, slot: int, expected: Iterable[int]) -> None:
        """``slot`` no longer stands for its worker; ``expected``: the blocks it expected (cleared now)."""
        bit = 1 << slot
        for h in expected:
            self.unexpect(slot, h)
        self._live &= ~bit
        self.table.set_live(self._live)
        self._retired |= bit

    def sweep(self) -> None:
        """Clear the retired slots from every mask and make them free. O(rows), in array passes."""
        self._version += 1
        self.table.clear()
        retired, self._retired = self._retired, 0
        while retired:
            low = retired & -retired
            heapq.heappush(self._free, low.bit_length() - 1)
            retired ^= low

    # ------------------------------------------------------------------ one slot's blocks

    def apply(self, slot: int, events: Sequence[tuple[str, int]]) -> int:
        """KV events of ``slot``'s worker, in order (``("stored" | "removed", hash)``); the change in the
        blocks it holds. Each hash ends as its last event says."""
        n = len(events)
        self._version += 1
        if n <= _SMALL:
            return self.table.update_each(slot, events)
        hashes = hash_array((h for _, h in events), n)
        stored = np.fromiter((kind == "stored" for kind, _ in events), bool, n)
        _, last = np.unique(hashes[::-1], return_index=True)
        last = n - 1 - last
        return self.table.update(slot, hashes[last], stored[last])

    def store(self, slot: int, hashes: Iterable[int], n: int) -> int:
        """``slot``'s worker holds the ``n`` distinct ``hashes`` (a snapshot); how many it did not before."""
        self._version += 1
        return self.table.update(slot, hash_array(hashes, n), np.ones(n, bool))

    def holds(self, slot: int, hashes: Sequence[int]) -> list[bool]:
        """Whether ``slot``'s worker holds each of ``hashes`` (expected ones aside)."""
        return [bool(m >> slot & 1) for m in self._chain(hashes, len(hashes))[:len(hashes)]]

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
        of ``hashes`` its worker holds or is expected to hold: one pass down the chain, in chunks, until no
        slot's run goes on."""
        alive = 0
        for s in slots:
            if s is not None:
                alive |= 1 << s
        ends: dict[int, int] = {}  # bit -> its match length
        expected = self.expected
        n, size = 0, _ONE_BY_ONE
        while n < len(hashes) and alive:
            chunk = hashes[n:n + size]
            for h, m in zip(chunk, self._chain(hashes, n + size)[n:n + size]):
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

    def _chain(self, hashes: Sequence[int], end: int) -> list[int]:
        """The held masks of ``hashes[:end]`` (or more), remembered for the same chain object until the table
        changes (a request's chain is walked and expected by prefill, then by decode): up to
        ``_ONE_BY_ONE`` more looked up one by one, more than that in array passes."""
        if self._memo[0] is not hashes or self._memo[1] != self._version or not isinstance(hashes, tuple):
            self._memo = (hashes, self._version, [])
        masks = self._memo[2]
        n, end = len(masks), min(end, len(hashes))
        if end - n > _ONE_BY_ONE:
            masks += self.table.masks_of(hashes[n:end])
        elif end > n:
            masks += [self.table.mask_one(h) for h in hashes[n:end]]
        return masks

    # ------------------------------------------------------------------ for tests and benchmarks

    def mask(self, h: int) -> int:
        """``h``'s held mask (retired bits included until swept)."""
        return self.table.masks_of([h])[0]

    def distinct(self) -> int:
        """Blocks some slot holds (a retired one included until swept)."""
        return self.table.held

    def hashes(self) -> set[int]:
        """Every block some slot holds (a retired one included until swept). O(rows)."""
        return self.table.hashes()

    def nbytes(self) -> int:
        """Bytes of the table's arrays and of the expected blocks' dict (its hashes and masks)."""
        total = self.table.nbytes() + sys.getsizeof(self.expected)
        for h, m in self.expected.items():
            total += sys.getsizeof(h) + sys.getsizeof(m)
        return total
