"""The receiver's side of a pull transfer (shm and nixl): the sender offers, the receiver pulls the bytes.

After the backend's own hello, each transfer on a connection is::

    Offer  {id, src, dst}  -> Reply {ok, error}   the receiver claims what it expect()ed and pulls src -> dst
    Commit {id, ok}        -> Reply {ok, error}   ok=False: the sender aborted meanwhile

Frames are those of ``shm_wire``. How the bytes move is the backend's ``pull`` (a memcpy out of a
shared-memory segment, NIXL READs); it runs under the transfer's lock piece by piece, so a receiver
``abort()`` stops it, and returns None or why it failed.
"""

from __future__ import annotations

import logging
from typing import Callable

from xpyd.transfer.base import TransferState
from xpyd.transfer.endpoint import Endpoint
from xpyd.transfer.shm_wire import MAX_FRAME, Commit, Offer, Reply
from xpyd.transfer.table import Transfer
from xpyd.transfer.tcp_wire import Conn

IDLE_TIMEOUT = 600.0  # an established sender may stay quiet this long between offers

Pull = Callable[[Transfer, Offer], "str | None"]


def serve_offers(conn: Conn, endpoint: Endpoint, src_size: int, dst_size: int, pull: Pull,
                 log: logging.Logger, addr) -> None:
    """Answer a sender's offers until it hangs up. Malformed frames raise ``ProtocolError`` (the caller
    drops the connection); a transfer in progress when anything goes wrong fails, never hangs."""
    rec: Transfer | None = None
    try:
        while True:
            frame = conn.read_frame(MAX_FRAME, first_byte_timeout=IDLE_TIMEOUT)
            if frame is None:
                return
            offer = Offer.parse(frame, src_size, dst_size)
            rec, error = endpoint.expected.claim(offer.transfer_id, offer.dst)
            if rec is not None:
                error = pull(rec, offer)
            conn.send_all([memoryview(Reply(error is None, error).pack())])
            if error is not None:
                log.warning("refused transfer %r from %s: %s", offer.transfer_id, addr, error)
                if rec is not None:  # the pull failed or was aborted: the transfer is over
                    endpoint.expected.finish(rec)
                    rec = None
                continue
            commit = Commit.parse(conn.read_frame(MAX_FRAME) or {}, offer.transfer_id)
            if not commit.ok:
                error = f"transfer {offer.transfer_id!r} aborted by the sender"
                rec.token._fail(error)
            elif not rec.token._advance(TransferState.DONE):
                error = f"transfer {offer.transfer_id!r} aborted by the receiver"
            endpoint.expected.finish(rec)
            rec = None
            conn.send_all([memoryview(Reply(error is None, error).pack())])
    finally:
        if rec is not None:  # the sender vanished (or the frame was bad) mid-transfer
            rec.token._fail("sender connection lost mid-transfer")
            endpoint.expected.finish(rec)
