"""The abort board: how a shm sender revokes an offer without a commit round trip.

The board is ``SLOTS`` u64 entries at the end of the sender's segment (after its pool, 64-byte
aligned), so every receiver that mapped the segment reads it. Per transfer:

1. sender, under the transfer's lock and only if it is not aborted: take a free entry and write a
   fresh ticket to it (``Board.publish``); the Offer carries ``(slot, ticket)``;
2. receiver: copy, then read the entry (``BoardView.valid``): the ticket still there means the
   sender had not aborted when the copy ended, so the copy is of a valid source: DONE, and reply;
3. sender ``abort()``: after failing its token (under the same lock as 1) it zeroes the entry
   (``revoke``) before returning; only then may the engine reuse the source memory. A receiver
   that reads the entry later sees it revoked and FAILs; one that read it earlier had finished
   copying before the abort, so its bytes are the valid ones;
4. sender, when the reply arrived (or the connection failed): zero the entry and free it (``retire``).

Tickets are never reused (a 64-bit counter), so an entry reused by a later transfer never validates
an earlier one. Ordering: the receiver's copy loads come before its board load, and the sender's
revoking store before any later overwrite of the source; x86-64 (TSO) keeps both orders, and the lock
release/acquire pairs around both accesses (the receiver reads under the transfer's lock, right
after its last chunk released it; the sender writes under the board's lock) order them elsewhere.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

SLOTS = 4096  # offers in flight at once per sender (one per peer it is sending to): 32 KiB
BYTES = SLOTS * 8
MAX_TICKET = (1 << 64) - 1


def board_offset(pool_size: int) -> int:
    """Where the board starts in a segment whose pool takes ``pool_size`` bytes."""
    return (pool_size + 63) // 64 * 64


def segment_size(pool_size: int) -> int:
    return board_offset(pool_size) + BYTES


class Board:
    """The sender's side: publish, revoke and retire its offers' entries. Thread-safe."""

    def __init__(self, mapping, offset: int) -> None:
        self._entries = np.frombuffer(mapping, dtype=np.uint64, count=SLOTS, offset=offset)
        self._lock = threading.Lock()
        self._free = list(range(SLOTS - 1, -1, -1))
        self._tickets = itertools.count(1)
        self._offered: dict[str, tuple[int, int]] = {}  # transfer id -> (slot, ticket)

    def publish(self, transfer_id: str) -> tuple[int, int] | None:
        """A fresh (slot, ticket) now valid for ``transfer_id``; None if every entry is in use."""
        with self._lock:
            if not self._free:
                return None
            slot, ticket = self._free.pop(), next(self._tickets)
            self._entries[slot] = ticket
            self._offered[transfer_id] = (slot, ticket)
            return slot, ticket

    def revoke(self, transfer_id: str) -> None:
        """The sender aborted ``transfer_id``: a receiver that has not confirmed yet must fail it."""
        with self._lock:
            entry = self._offered.get(transfer_id)
            if entry is not None:
                self._entries[entry[0]] = 0

    def retire(self, transfer_id: str) -> None:
        """The offer is answered (or its connection failed): zero its entry and free it."""
        with self._lock:
            entry = self._offered.pop(transfer_id, None)
            if entry is not None:
                self._entries[entry[0]] = 0
                self._free.append(entry[0])

    def in_use(self) -> int:
        with self._lock:
            return len(self._offered)


class BoardView:
    """The receiver's side: a read-only view of a sender's board."""

    def __init__(self, mapping, offset: int) -> None:
        self._entries = np.frombuffer(mapping, dtype=np.uint64, count=SLOTS, offset=offset)

    def valid(self, slot: int, ticket: int) -> bool:
        """True if the sender still stands by the offer with this ticket (not aborted, not retired)."""
        return int(self._entries[slot]) == ticket
