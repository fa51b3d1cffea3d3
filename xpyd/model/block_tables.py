"""The block tables of running requests, kept in one int32 array between decode steps.

A decode step used to rebuild every request's table from its Python list of block ids and check each id
again; here a request gets a *row* when it starts decoding (`open`), the row takes each block the request
grows into (`extend`) and is handed back when the request ends (`close`), so a step passes row indices and
the runner reads the rows it needs in one gather. Each id is checked once, when it is written: it is a block
of the pool (0 <= id < ``num_blocks``) and appears once in its row. A step then checks O(batch) things only
(`batch_checks.decode_rows`).

Storage is ``data``, a stdlib ``array('i')`` of ``capacity`` x ``width`` row-major int32 entries, past a row's
``length(row)`` blocks zeros (block 0: a valid id to pad with; nothing attends past a request's length). It is
torch- and numpy-free, so the simulated engine's workers (which import neither) keep the same store; the torch
runner reads it through a zero-copy view (``numpy.frombuffer(data, int32).reshape(capacity, width)``). Growing
(more rows, wider rows: doubling) replaces ``data`` with a new array instead of resizing it, so a view still
held somewhere never pins the old one's size: take a fresh view per step.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_INT32 = "i" if array("i").itemsize == 4 else "l"


class BlockTables:
    def __init__(self, num_blocks: int, rows: int = 8, width: int = 16) -> None:
        """Tables of block ids in [0, ``num_blocks``); room for ``rows`` rows of ``width`` blocks to start
        with (both double when a row more, or a longer row, is needed)."""
        for name, value in (("num_blocks", num_blocks), ("rows", rows), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks = num_blocks
        self.capacity = rows
        self.width = width
        self.data = array(_INT32, bytes(4 * rows * width))
        self._lengths = [0] * rows
        self._open = [False] * rows
        self._free = list(range(rows - 1, -1, -1))  # a stack: the lowest row first, a returned row reused next

    @property
    def num_open(self) -> int:
        """Rows handed out and not returned."""
        return self.capacity - len(self._free)

    def open(self, blocks: Sequence[int]) -> int:
        """A free row holding ``blocks`` (a request's blocks in token order); its index."""
        self._check_ids(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"a block appears twice in one request's blocks {list(blocks)}: two positions, one row")
        if not self._free:
            self._resize(self.capacity * 2, self.width)
        row = self._free.pop()
        self._open[row] = True
        self._write(row, 0, blocks)
        return row

    def extend(self, row: int, blocks: Sequence[int]) -> None:
        """``blocks`` after row ``row``'s (the request grew into them)."""
        n = self.length(row)
        self._check_ids(blocks)
        base = row * self.width
        held = set(self.data[base : base + n]) if blocks else set()
        if len(set(blocks)) != len(blocks) or held.intersection(blocks):
            raise ValueError(f"a block of {list(blocks)} appears twice in row {row}: two positions, one row")
        self._write(row, n, blocks)

    def close(self, row: int) -> None:
        """Hand row ``row`` back (its request ended); its entries become zeros again."""
        n = self.length(row)
        base = row * self.width
        self.data[base : base + n] = array(_INT32, bytes(4 * n))
        self._lengths[row] = 0
        self._open[row] = False
        self._free.append(row)

    def length(self, row: int) -> int:
        """Blocks in row ``row`` (an open row: ValueError otherwise)."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.capacity or not self._open[row]:
            raise ValueError(f"block-table row {row!r} is not an open row")
        return self._lengths[row]

    def block(self, row: int, index: int) -> int:
        """Block ``index`` of open row ``row`` (0 <= index < its length)."""
        if not 0 <= index < self.length(row):
            raise ValueError(f"row {row} holds {self._lengths[row]} blocks, not block {index}")
        return self.data[row * self.width + index]

    def blocks(self, row: int) -> list[int]:
        """Row ``row``'s blocks, as a list."""
        n = self.length(row)
        base = row * self.width
        return self.data[base : base + n].tolist()

    def _check_ids(self, blocks: Sequence[int]) -> None:
        count = self.num_blocks
        for b in blocks:
            if type(b) is not int or not 0 <= b < count:
                raise ValueError(f"KV block {b!r} does not exist (pool has {count})")

    def _write(self, row: int, at: int, blocks: Sequence[int]) -> None:
        end = at + len(blocks)
        if end > self.width:
            width = self.width
            while width < end:
                width *= 2
            self._resize(self.capacity, width)
        base = row * self.width
        self.data[base + at : base + end] = array(_INT32, blocks)
        self._lengths[row] = end

    def _resize(self, capacity: int, width: int) -> None:
        """A new ``data`` of ``capacity`` rows of ``width`` (neither smaller), the open rows copied over."""
        data = array(_INT32, bytes(4 * capacity * width))
        for row in range(self.capacity):
            n = self._lengths[row]
            if n:
                data[row * width : row * width + n] = self.data[row * self.width : row * self.width + n]
        added = range(capacity - 1, self.capacity - 1, -1)
        self._free[:0] = added  # the new rows under the returned ones: those are reused first
        self._lengths += [0] * (capacity - self.capacity)
        self._open += [False] * (capacity - self.capacity)
        self.data, self.capacity, self.width = data, capacity, width
