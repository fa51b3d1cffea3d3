"""The cuda_ipc receiver's part of a transfer, from a claimed offer to DONE (``Receive.copy``).

The reader thread that claimed the offer opens the sender's pool, board and event and prepares the copy (the
pieces paired, the copy kernel's table on the device), all while the sender's forward still runs. Then the
connection's copier thread (``cuda_ipc_copier``, long-lived: a thread's first CUDA calls cost ~0.1 ms) sleeps
on the sender's event, reads the board (revoked: the sender aborted, no copy at all), copies batch by batch
under the transfer's lock, each fenced (so once the receiver's ``abort()`` returns no more bytes land), reads
the board again (the ticket still there: the source was valid for the whole copy) and marks DONE.

The reader thread itself never waits on the sender's event (a wait on the event of a process that died never
ends, measured on an H200): it hands the rest to the copier and gives up when the receiver aborted (its
``abort()`` returns at once: the wait holds no lock), the sender hung up or ``io_timeout`` passed; then a
copier that may wait for good is left behind and the next transfer gets a new one.

(Enqueuing the copy on the device behind the sender's event before the forward ends was measured on an H200:
48% of a device copy from the forward's end to DONE against 41-44% this way, but calling such a copy off
either needs a write on the device, which waits behind the other process's kernels, or a flag in host memory
that every program of the kernel reads over the bus, which made the copy 500 times slower. Not used.)
"""

from __future__ import annotations

import logging
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


class Settings(Protocol):
    stamps: object  # cuda_ipc_stamps.Stamps or None
    io_timeout: float


class Receive:
    """The receiver's copies of one backend: one reader thread per connection calls ``copy``."""

    def __init__(self, ops: DeviceOps, settings: Settings, drop_mark: Callable[[str], object]) -> None:
        self._ops, self._settings, self._drop_mark = ops, settings, drop_mark
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
        try:
            src = peer.open(self._ops)
            ready = self._ops.open_mark(offer.event)
            if stamps is not None:
                stamps(tid, "opened")
            prepared = [self._ops.prepare(src, batch) for batch in batches(offer.src, rec.regions, COPY_BATCH)]
        except (DeviceError, shm_segment.SegmentError) as e:
            rec.token._fail(str(e))
            return str(e)
        if stamps is not None:
            stamps(tid, "prepared")
        rec.token._advance(TransferState.TRANSFERRING)
        return self._run(rec, peer, conn, ready, partial(self._copy_now, rec, peer, offer, prepared, after, ready))

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
        # the board read under the transfer's lock, after the last batch released it, so it follows the fenced
        # copy (``shm_board``): the ticket still there means the source was valid for the whole copy
        with rec.lock:
            valid = peer.board.valid(*offer.board)
        if not valid:
            rec.token._fail(f"transfer {tid!r} aborted by the sender")
            return f"transfer {tid!r} aborted by the sender"
        if not rec.token._advance(TransferState.DONE):
            return f"transfer {tid!r} aborted by the receiver"
        if stamps is not None:
            stamps(tid, "done")
        return None

    # -- waiting without trusting the sender --------------------------------
    def _run(self, rec: Transfer, peer: PeerPool, conn: Conn, ready, work) -> str | None:
        """``work`` inline if the sender's event passed already, else on the connection's copier while this
        thread watches for a reason to give up (then: fail the token under its lock)."""
        if self._ops.passed(ready):
            return work()
        tid = rec.token.transfer_id
        if peer.copier is None:
            peer.copier = Copier(f"xpyd-cuda_ipc-copy-{tid}")
        deadline = time.monotonic() + self._settings.io_timeout
        done, outcome = peer.copier.run(work, partial(self._give_up, rec, conn, deadline), WAIT_POLL)
        if done:
            return outcome
        with rec.lock:  # (a batch under way ends first; none starts after)
            rec.token._fail(outcome)
        self.stuck_waits += 1  # (its copier may sleep in the driver for good: the next transfer gets a new one)
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
