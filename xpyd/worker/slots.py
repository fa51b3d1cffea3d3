"""The slot-allocation view of the KV pool that the schedulers need."""

from __future__ import annotations

from typing import Protocol


class SlotAllocator(Protocol):
    def can_allocate(self) -> bool: ...
    def allocate(self) -> int: ...
    def free(self, slot: int) -> None: ...


class FakeSlots:
    """A slot allocator without memory, for scheduler unit tests."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"double free of slot {slot}")
        self._free.append(slot)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)
