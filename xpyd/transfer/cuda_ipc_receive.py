"""The cuda_ipc receiver's part of a transfer, from a claimed offer to DONE (``Receive.copy``).

The reader thread that claimed the offer opens the sender's pool, board and event, and prepares the copy,
all while the sender's forward still runs. Then one of two ways, by what the device operations can do:

- **armed** (``ops.can_arm``: the copy kernel, whose programs read a cancel flag first): the copy is
  enqueued at once on the connection's own stream, behind the decode engine's mark and the sender's event
  (``DeviceOps.arm``), so the device starts it the moment the forward ends, with no host step between;
  the connection's copier thread (``cuda_ipc_copier``) sleeps until it ran (``land``), checks the board
  and marks DONE. ``abort()`` calls armed copies off (``disarm``: the flag set, then either they had not
  started, or they are waited for), so once it returns no byte of them lands, at once while the forward
  still runs. A sender abort while armed voids the copy (the board, read after it).
- **host wait** (``copy_`` / ``_foreach_copy_``, no flag to read): the copier sleeps on the sender's event,
  reads the board (revoked: no copy at all), copies batch by batch under the transfer's lock, each fenced,
  reads the board again and marks DONE.

Either way the reader thread itself never waits on the sender's event (a wait on the event of a process
that died never ends, measured on an H200): it hands the rest to the copier and gives up when the receiver
aborted, the sender hung up or ``io_timeout`` passed; then that copier (and, armed, that stream, which
waits for good on a dead process's event) is left behind and the next transfer gets new ones.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Callable, Protocol

from xpyd.transfer import shm_segment
from xpyd.transfer.base import TransferState
from xpyd.transfer.cuda_ipc_copier import Copier, PeerPool
from xpyd.transfer.cuda_ipc_device import DeviceError, DeviceOps
from xpyd.transfer.cuda_ipc_kernel import batches
from xpyd.transfer.shm_wire import Offer
from xpyd.transfer.table import Transfer
from xpyd.transfer.tcp_wire import Conn

log = logging.getLogger("xpyd.transfer.cuda_ipc")

COPY_BATCH = 1 << 30  # host wait: bytes copied per lock hold and fence (abort latency vs. fences)
WAIT_POLL = 0.05  # seconds between the reader's checks while a sender's forward runs (abort, hang-up)
HELD = 1024  # armed copies left behind on a stream that may wait for good, kept alive


class Settings(Protocol):
    stamps: object  # cuda_ipc_stamps.Stamps or None
    io_timeout: float


class Receive:
    """The receiver's copies of one backend. Thread-safe: one reader thread per connection calls ``copy``;
    any thread ``abort``."""

    def __init__(self, ops: DeviceOps, settings: Settings, drop_mark: Callable[[str], object]) -> None:
        self._ops, self._settings, self._drop_mark = ops, settings, drop_mark
        self._lock = threading.Lock()
        self._armed: dict[str, object] = {}  # transfer id -> its armed copies, until they landed
        self._held: list = []
        self.stuck_waits = 0  # waits given up while the sender's forward had not ended (a dead sender?)

    def copy(self, rec: Transfer, peer: PeerPool, offer: Offer, conn: Conn) -> str | None:
        """Pull the offer's src into the claimed transfer's dst and mark it DONE; None or why it failed (the
        token failed then). Called on the connection's reader thread."""
        tid, stamps = offer.transfer_id, self._settings.stamps
        if stamps is not None:
            stamps(tid, "claimed")
        after = self._drop_mark(tid)
        if offer.board is None or offer.event is None:
            error = f"offer of {tid!r} has no abort board entry or event handle (an older cuda_ipc sender?)"
            rec.token._fail(error)
            return error
        armed = self._ops.can_arm
        try:
            src = peer.open(self._ops)
            ready = self._ops.open_mark(offer.event)
            if stamps is not None:
                stamps(tid, "opened")
            if armed and peer.stream is None:
                peer.stream = self._ops.new_stream()
            prepared = [self._ops.prepare(src, batch, armed, peer.stream)
                        for batch in batches(offer.src, rec.regions, COPY_BATCH)]
        except (DeviceError, shm_segment.SegmentError) as e:
            rec.token._fail(str(e))
            return str(e)
        if stamps is not None:
            stamps(tid, "prepared")
        rec.token._advance(TransferState.TRANSFERRING)
        if armed:
            return self._armed_copy(rec, peer, offer, prepared, after, ready, conn)
        return self._run(rec, peer, conn, ready, partial(self._copy_now, rec, peer, offer, prepared, after, ready))

    def abort(self, transfer_id: str) -> None:
        """After the token failed (under its lock): call its armed copies off; none of them lands after."""
        with self._lock:
            armed = self._armed.pop(transfer_id, None)
        if armed is not None:
            self._ops.disarm(armed)

    def close(self) -> None:
        with self._lock:
            armed, self._armed = list(self._armed.values()), {}
        for a in armed:
            self._ops.disarm(a)

    # -- the two ways -----------------------------------------------------
    def _armed_copy(self, rec: Transfer, peer: PeerPool, offer: Offer, prepared: list, after, ready,
                    conn: Conn) -> str | None:
        tid, stamps = offer.transfer_id, self._settings.stamps
        with rec.lock:
            if rec.token.finished():
                return f"transfer {tid!r} aborted by the receiver"
            try:
                armed = self._ops.arm(prepared, after, ready, peer.stream, stamps is not None)
            except DeviceError as e:
                rec.token._fail(str(e))
                return str(e)
            with self._lock:
                self._armed[tid] = armed
        try:
            return self._run(rec, peer, conn, ready, partial(self._land, rec, peer, offer, armed), armed)
        finally:
            with self._lock:
                self._armed.pop(tid, None)

    def _land(self, rec: Transfer, peer: PeerPool, offer: Offer, armed) -> str | None:
        """On the copier: until the armed copies ran, then the board and DONE."""
        tid, stamps = offer.transfer_id, self._settings.stamps
        try:
            times = self._ops.land(armed)
        except DeviceError as e:
            rec.token._fail(str(e))
            return str(e)
        if times is not None:
            stamps(tid, "launching", times.launching_ns)
            stamps(tid, "enqueued", times.enqueued_ns)
            stamps(tid, "synced")
            stamps.add_device(tid, times.device_s)
        return self._confirm(rec, peer, offer)

    def _copy_now(self, rec: Transfer, peer: PeerPool, offer: Offer, prepared: list, after, ready) -> str | None:
        """On the copier: until the device passed the sender's event, the board, the copies batch by batch
        (each under the transfer's lock, fenced), the board again and DONE."""
        tid, stamps = offer.transfer_id, self._settings.stamps
        self._ops.wait(ready)
        if stamps is not None:
            stamps(tid, "ready")
        if not peer.board.valid(*offer.board):  # (the sender aborted meanwhile: no copy at all)
            rec.token._fail(f"transfer {tid!r} aborted by the sender")
            return f"transfer {tid!r} aborted by the sender"
        for batch in prepared:
            with rec.lock:
                if rec.token.finished():
                    return f"transfer {tid!r} aborted by the receiver"
                try:
                    times = self._ops.copy(batch, after, stamps is not None)
                except DeviceError as e:
                    rec.token._fail(str(e))
                    return str(e)
            if times is not None:
                for step, ns in times.steps:
                    stamps(tid, f"copy:{step}", ns)
                stamps(tid, "launching", times.launching_ns)
                stamps(tid, "enqueued", times.enqueued_ns)
                stamps(tid, "synced")
                stamps.add_device(tid, times.device_s)
            after = None
        return self._confirm(rec, peer, offer)

    def _confirm(self, rec: Transfer, peer: PeerPool, offer: Offer) -> str | None:
        """The board read under the transfer's lock, after the copy was fenced (``shm_board``): the ticket
        still there means the source was valid for the whole copy; then DONE."""
        tid = offer.transfer_id
        with rec.lock:
            valid = peer.board.valid(*offer.board)
        if not valid:
            rec.token._fail(f"transfer {tid!r} aborted by the sender")
            return f"transfer {tid!r} aborted by the sender"
        if not rec.token._advance(TransferState.DONE):
            return f"transfer {tid!r} aborted by the receiver"
        if self._settings.stamps is not None:
            self._settings.stamps(tid, "done")
        return None

    # -- waiting without trusting the sender --------------------------------
    def _run(self, rec: Transfer, peer: PeerPool, conn: Conn, ready, work, armed=None) -> str | None:
        """``work`` inline if the sender's event passed already, else on the connection's copier while this
        thread watches for a reason to give up (then: fail the token under its lock, call armed copies off)."""
        if self._ops.passed(ready):
            return work()
        tid = rec.token.transfer_id
        if peer.copier is None:
            peer.copier = Copier(f"xpyd-cuda_ipc-copy-{tid}")
        deadline = time.monotonic() + self._settings.io_timeout
        done, outcome = peer.copier.run(work, partial(self._give_up, rec, conn, deadline), WAIT_POLL)
        if done:
            return outcome
        receiver_aborted = rec.token.finished()  # (then the sender is alive: its forward will end)
        with rec.lock:  # (a batch under way ends first; none starts after)
            rec.token._fail(outcome)
        if armed is not None and self._ops.disarm(armed):
            return outcome  # (they had started: they have run, nothing waits on the sender any more)
        if not receiver_aborted:
            # the sender is gone or stuck: its copier (and, armed, its stream) may wait for good
            self.stuck_waits += 1
            if armed is not None:
                self._held = (self._held + [armed])[-HELD:]
                peer.stream = None
            peer.copier.close()
            peer.copier = None
            log.warning("cuda_ipc: gave up waiting on the sender's event: %s", outcome)
        return outcome

    def _give_up(self, rec: Transfer, conn: Conn, deadline: float) -> str | None:
        tid = rec.token.transfer_id
        if rec.token.finished():
            return f"transfer {tid!r} aborted by the receiver"
        if conn.stale():
            return f"the sender hung up while the forward of {tid!r} ran"
        if time.monotonic() > deadline:
            return f"the sender's forward for {tid!r} did not finish within {self._settings.io_timeout:g} s"
        return None
