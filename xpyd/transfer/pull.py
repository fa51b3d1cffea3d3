"""The receiver's side of a pull transfer (shm and nixl): the sender offers, the receiver pulls the bytes.

After the backend's own hello, each transfer on a connection is::

    Offer {id, src, dst, ...}  ->  claim, pull, confirm  ->  Reply {ok, error}

The receiver claims what it ``expect()``ed, if the offer's MAC proves that its sender holds the
transfer's secret (``auth``; else the offer is refused, the expected transfer stays as it was, and a
connection that has not opened a transfer before is hung up on), pulls ``src`` -> ``dst`` with the
backend's ``pull`` (a memcpy out of a shared-memory segment, NIXL READs; it runs under the transfer's
lock piece by piece, so a receiver ``abort()`` stops it, and returns None or why it failed), then
*confirms* with the backend's ``confirm`` that the sender did not abort meanwhile (so its source
stayed valid for the whole pull), marks its token DONE or FAILED, and only then replies: a sender's
DONE implies the receiver's. Confirming:

- shm reads the sender's abort board in the sender's segment (``shm_board``): no message at all;
- nixl asks the sender (``commit_round_trip``): Reply {ok} to the offer, then the sender's
  Commit {id, ok} (ok=False: it aborted meanwhile) — one more round trip;
- cuda_ipc's pull confirms (its sender's abort board, as shm) and marks the token DONE itself, the moment
  its copy is fenced, on the thread that copied; its ``confirm`` only says so.

The sender's side: ``offer_on_board`` (shm, cuda_ipc: one round trip) and ``offer_and_commit`` (nixl).
Frames are those of ``shm_wire``.
"""

from __future__ import annotations

import logging
from typing import Callable

from xpyd.transfer import auth, shm_board
from xpyd.transfer.base import TransferState
from xpyd.transfer.endpoint import Endpoint
from xpyd.transfer.shm_board import Board
from xpyd.transfer.shm_wire import MAX_FRAME, Commit, Offer, Reply
from xpyd.transfer.table import Transfer
from xpyd.transfer.tcp_wire import Conn

IDLE_TIMEOUT = 600.0  # an established sender may stay quiet this long between offers

Pull = Callable[[Transfer, Offer], "str | None"]
Confirm = Callable[[Conn, Transfer, Offer], bool]  # True: the sender still stands by the offer's source


def _no_stamp(stage: str) -> None:
    pass


def offer_and_commit(conn: Conn, job: Transfer, offer: memoryview, address: str, read_reply: Callable[[Conn], Reply],
                     stamp: Callable[[str], None] = _no_stamp) -> None:
    """The sender's side of a transfer confirmed by `commit_round_trip` (nixl, cuda_ipc): send the packed Offer,
    read the receiver's Reply (its bytes landed), answer Commit {ok: not aborted meanwhile}, read the last Reply;
    the token ends DONE or FAILED. A refusal that says ``bye`` raises ConnectionError (reconnect for the next).
    ``stamp(stage)``: "offered", "copied", "committed", "done" as each happens (a backend's timing hook)."""
    tid = job.token.transfer_id
    conn.send_all([offer])
    stamp("offered")
    reply = read_reply(conn)
    stamp("copied")
    if not reply.ok:
        job.token._fail(f"refused by {address}: {reply.error}")
        if reply.bye:
            raise ConnectionError("refused")  # the receiver hangs up: reconnect for the next
        return
    with job.lock:
        ok = not job.token.finished()  # aborted while the peer copied: its copy is void
    conn.send_all([memoryview(Commit(tid, ok).pack())])
    stamp("committed")
    reply = read_reply(conn)
    if ok and reply.ok:
        stamp("done")
        job.token._advance(TransferState.DONE)
    elif ok:
        job.token._fail(f"refused by {address}: {reply.error}")


def offer_on_board(conn: Conn, job: Transfer, board: Board, make_offer: Callable[[tuple[int, int]], Offer],
                   address: str, stamp: Callable[[str], None] = _no_stamp,
                   on_unanswered: Callable[[], None] | None = None) -> None:
    """The sender's side of a transfer confirmed on its abort board (shm, cuda_ipc): publish a board entry
    (under the transfer's lock, unless it was aborted), send ``make_offer(entry)``, read the Reply, retire the
    entry (also when the connection failed: a receiver still copying then sees it revoked); the token ends
    DONE or FAILED. ``on_unanswered``: called when no Reply came. A refusal that says ``bye`` raises
    ConnectionError (reconnect for the next). ``stamp``: "offered", "done" as each happens."""
    tid = job.token.transfer_id
    with job.lock:  # (abort() fails the token under this lock, then revokes what was published)
        if not job.token._advance(TransferState.TRANSFERRING):
            return
        entry = board.publish(tid)
    if entry is None:
        job.token._fail(f"all {shm_board.SLOTS} abort board entries are in use (offers in flight)")
        return
    replied = False
    try:
        conn.send_all([memoryview(make_offer(entry).pack())])
        stamp("offered")
        reply = Reply.parse(conn.read_frame(MAX_FRAME))
        replied = True
    finally:
        board.retire(tid)
        if not replied and on_unanswered is not None:
            on_unanswered()
    if reply.ok:
        stamp("done")
        job.token._advance(TransferState.DONE)
    else:
        job.token._fail(f"refused by {address}: {reply.error}")
        if reply.bye:
            raise ConnectionError("refused")  # the receiver hangs up: reconnect for the next


def commit_round_trip(conn: Conn, rec: Transfer, offer: Offer) -> bool:
    """Confirm by asking: tell the sender the bytes landed, read its Commit."""
    conn.send_all([memoryview(Reply(True).pack())])
    return Commit.parse(conn.read_frame(MAX_FRAME) or {}, offer.transfer_id).ok


def serve_offers(conn: Conn, endpoint: Endpoint, name: str, src_size: int, dst_size: int, pull: Pull,
                 confirm: Confirm, log: logging.Logger, addr) -> None:
    """Answer a sender's offers until it hangs up (``name``: the backend's, in the offers' MACs). Malformed
    frames raise ``ProtocolError`` (the caller drops the connection); a transfer in progress when anything
    goes wrong fails, never hangs. The backend's ``pull`` is the first thing that touches the sender's
    memory (map it, load its agent), so a connection that never opened a transfer gets nothing of that."""
    rec: Transfer | None = None
    proven = False  # has an offer on this connection opened a transfer (its sender holds our secrets)?
    try:
        while True:
            frame = conn.read_frame(MAX_FRAME, first_byte_timeout=IDLE_TIMEOUT)
            if frame is None:
                return
            offer = Offer.parse(frame, src_size, dst_size)
            tid = offer.transfer_id
            rec, error = _claim(endpoint, name, offer)
            if rec is None:
                endpoint.refuse(log, name, tid, addr, error)
                conn.send_all([memoryview(Reply(False, error, bye=not proven).pack())])
                if not proven:
                    return
                continue
            proven = True
            error = pull(rec, offer)  # (a failed or aborted pull has failed the token)
            if error is None:
                if not confirm(conn, rec, offer):
                    error = f"transfer {tid!r} aborted by the sender"
                    rec.token._fail(error)
                elif rec.token.state() is not TransferState.DONE and not rec.token._advance(TransferState.DONE):
                    error = f"transfer {tid!r} aborted by the receiver"
            endpoint.expected.finish(rec)
            rec = None
            if error is not None:
                log.warning("transfer %r from %s: %s", tid, addr, error)
            conn.send_all([memoryview(Reply(error is None, error).pack())])
    finally:
        if rec is not None:  # the sender vanished (or the frame was bad) mid-transfer
            rec.token._fail("sender connection lost mid-transfer")
            endpoint.expected.finish(rec)


def _claim(endpoint: Endpoint, name: str, offer: Offer) -> tuple[Transfer | None, str | None]:
    if offer.mac is None:
        return None, "the offer carries no MAC (a sender without the transfer's secret)"
    return endpoint.expected.claim(
        offer.transfer_id, offer.dst,
        lambda key: auth.mac_matches(key, offer.mac, name, offer.transfer_id, offer.dst, offer.src))
