"""One prefill worker's prefix cache in the fleet model: a bounded LRU of block ids.

A request reuses the leading blocks of its prompt the worker holds (a trace's block id names the whole prefix
up to it, as a chain hash does); once routed there, all its blocks are the most recently used, and the least
recently used go when there are more than ``capacity``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixLRU:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_blocks(self, hash_ids: Sequence[int]) -> int:
        """How many leading blocks of ``hash_ids`` are held."""
        n = 0
        for h in hash_ids:
            if h not in self._blocks:
                break
            n += 1
        return n

    def touch(self, hash_ids: Sequence[int]) -> None:
        """The blocks are in use now: held (the least recently used evicted past capacity), newest last."""
        if self.capacity == 0:
            return
        blocks = self._blocks
        for h in hash_ids[-self.capacity:]:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
