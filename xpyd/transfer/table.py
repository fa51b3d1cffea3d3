"""The in-flight transfers of one side of a socket backend (tcp, shm): being sent, or expected.

A backend keeps two ``TransferTable``s: ``sending`` (``send`` until the peer acks) and ``expected``
(``expect`` until the bytes landed). An entry leaves its table when it finishes (``finish``), is
aborted (``abort``) or the backend closes (``take``); a reader thread ``claim``s an expected entry
before writing its regions, so no two connections write the same transfer, and only with a frame that
proves its sender holds the entry's key (``auth``): anything else is refused and leaves the entry as it
was, for its real sender.

Lock order: a backend may call ``add``/``take`` while holding its own lock (so its closed check and
the insert are one step); the table never takes the backend's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from xpyd.transfer.base import CompletionToken, Region, TransferError


@dataclass(eq=False, slots=True)
class Transfer:
    """One side of a transfer: its token, its key (``auth.transfer_key``) and the lock that guards its pool I/O."""

    token: CompletionToken
    regions: tuple[Region, ...]  # src (sender) or dst (receiver)
    total: int = 0  # bytes in ``regions``
    dst: tuple[Region, ...] = ()  # sender: where the bytes land at the peer
    key: bytes = b""  # sender: signs the frame that opens the transfer; receiver: checks it
    accepted: tuple[bytes, ...] = ()  # receiver: keys that open it too (a token rotation's other token)
    lock: threading.Lock = field(default_factory=threading.Lock)
    claimed: bool = False  # receiver: a connection is writing it


class TransferTable:
    """Transfers by id; thread-safe. ``duplicate`` completes "transfer 'id' ..." when an id is added twice."""

    __slots__ = ("_duplicate", "_lock", "_recs")

    def __init__(self, duplicate: str) -> None:
        self._lock = threading.Lock()
        self._recs: dict[str, Transfer] = {}
        self._duplicate = duplicate

    def add(self, rec: Transfer) -> None:
        tid = rec.token.transfer_id
        with self._lock:
            if tid in self._recs:
                raise TransferError(f"transfer {tid!r} {self._duplicate}")
            self._recs[tid] = rec

    def claim(self, tid: str, dst: tuple[Region, ...],
              authentic: Callable[[bytes], bool]) -> tuple[Transfer | None, str | None]:
        """The entry whose regions these bytes may be written to, else why they are refused.

        ``authentic(key)``: does the frame that opens the transfer carry a MAC made with the entry's key (or one
        of its accepted keys)?
        If not (a sender without the transfer's secret), it is refused and the entry stays as it was. An
        entry its real sender names other regions for than ``dst`` is dropped and its token FAILs.
        """
        with self._lock:
            rec = self._recs.get(tid)
            if rec is None:
                return None, f"unexpected transfer id {tid!r} (not expected here, or already finished)"
            if not (authentic(rec.key) | any([authentic(k) for k in rec.accepted])):  # (each checked)
                return None, f"transfer {tid!r}: the MAC does not match (not the sender the transfer's secret went to)"
            if rec.claimed:
                return None, f"transfer {tid!r} is already being received"
            if rec.regions != dst:
                del self._recs[tid]
                error = f"dst regions differ from the ones expected for {tid!r}"
                with rec.lock:
                    rec.token._fail(error)
                return None, error
            rec.claimed = True
        return rec, None

    def finish(self, rec: Transfer) -> None:
        """Drop ``rec`` (its token is already finished); a no-op if aborted or replaced meanwhile."""
        with self._lock:
            if self._recs.get(rec.token.transfer_id) is rec:
                del self._recs[rec.token.transfer_id]

    def abort(self, tid: str) -> None:
        """Drop ``tid`` and FAIL its token "aborted"; safe if unknown."""
        with self._lock:
            rec = self._recs.pop(tid, None)
        if rec is not None:
            # Fail first, then wait out the piece of I/O in progress (the I/O loops check the token under
            # the lock before every piece, so none follows). Failing under the lock instead let the I/O
            # thread, which releases and re-takes the lock at once, win it again and again (Python's
            # locks are not fair): an abort then waited for whole transfers, not for one piece.
            rec.token._fail("aborted")
            with rec.lock:
                pass

    def ids(self) -> set[str]:
        with self._lock:
            return set(self._recs)

    def take(self) -> list[Transfer]:
        """Remove and return every entry (``close()`` fails their tokens)."""
        with self._lock:
            recs = list(self._recs.values())
            self._recs.clear()
        return recs
