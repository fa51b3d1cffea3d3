"""Shared-memory transfer backend: one copy between two KV pools on the same host.

A sending backend owns one segment in /dev/shm (``allocate``; see ``shm_segment``) and its KV pool
lives in it; a backend that only receives may register ordinary memory (it is written by its own
reader threads; anonymous memory keeps transparent huge pages, which tmpfs here does not).

A transfer is pulled, in one round trip: the sender publishes a ticket on its abort board (``shm_board``,
at the end of its segment) and offers its ``src`` regions over a small control connection, with a MAC
that proves it holds the transfer's secret (``auth``); the *receiver* checks it, maps the sender's
segment read-only (once per connection, at its first offer that checks out), copies straight from it into
its own ``dst`` regions, checks that the ticket is still on the board (the sender did not abort, so
its source stayed valid), marks DONE and replies (so a sender's DONE implies the receiver's). A sender
``abort()`` takes the ticket off the board before it returns. Messages are in ``shm_wire``; the
receiver's loop in ``pull``; framing, timeouts and the close pipe come from ``tcp_wire``; threads,
sender lanes and transfer tables, shared with ``tcp``, from ``endpoint``. The payload never crosses
a socket.

Same host only, and the segment's file mode is the boundary of the pool's bytes: it is created 0600
(owner only), and a receiver maps only a peer segment with no group or other permissions owned by its
own user (``shm_segment``). Who may *write* into the receiver's pool is the MAC's business, as with tcp.

Threads (daemon, started by ``register``/first ``send``, joined by ``close``): an acceptor, one
reader per inbound connection (it does the copy, in chunks, each under the transfer's lock, so once
``abort()`` returns no more bytes of that transfer land in the pool; a chunk of 8 MiB or more is split
with a helper thread, ``parallel_copy``), up to ``--kv-lanes`` (default 1) senders per peer (lanes, each with its
own connection: a long copy does not hold up the short ones).
"""

from __future__ import annotations

import logging
import socket
from queue import SimpleQueue
from typing import Callable, Sequence

import numpy as np

from xpyd import PROTOCOL_VERSION
from xpyd.cluster_tokens import check_accepted_tokens
from xpyd.netaddr import listen_tcp
from xpyd.transfer import auth, shm_board, shm_segment
from xpyd.transfer.base import (
    BackendDescriptor,
    CompletionToken,
    Region,
    TransferError,
    TransferState,
    check_buffer,
    check_send_regions,
    check_transfer_id,
)
from xpyd.transfer.endpoint import Endpoint
from xpyd.transfer.listener import Door
from xpyd.transfer.parallel_copy import ParallelCopy, default_threads
from xpyd.transfer.pull import offer_on_board, serve_offers
from xpyd.transfer.sender import connect, send_loop
from xpyd.transfer.shm_board import Board, BoardView
from xpyd.transfer.shm_wire import MAX_FRAME, Hello, Offer, Reply
from xpyd.transfer.table import Transfer
from xpyd.transfer.tcp_wire import (
    Closing,
    Conn,
    ProtocolError,
    Unproven,
    format_address,
    parse_address,
)

log = logging.getLogger(__name__)

HOST_OFFER = "shm-host"  # descriptor offer carrying the host key
COPY_CHUNK = 16 << 20  # bytes copied per lock hold (abort latency vs. overhead)
MAX_INBOUND = 256


def copy_regions(dst: np.ndarray, dst_regions: Sequence[Region], src: np.ndarray, src_regions: Sequence[Region],
                 chunk: int = COPY_CHUNK, copy: Callable[[np.ndarray, np.ndarray], None] = np.copyto):
    """Yield once per copied piece (at most ``chunk`` bytes), walking both region lists in step;
    ``copy(dst, src)`` copies one piece."""
    si = di = s_off = d_off = 0
    while si < len(src_regions):
        s, d = src_regions[si], dst_regions[di]
        n = min(s.length - s_off, d.length - d_off, chunk)
        copy(dst[d.offset + d_off: d.offset + d_off + n], src[s.offset + s_off: s.offset + s_off + n])
        yield n
        s_off += n
        d_off += n
        if s_off == s.length:
            si, s_off = si + 1, 0
        if d_off == d.length:
            di, d_off = di + 1, 0


def _setup(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class ShmTransferBackend:
    name = "shm"

    def same_host(self, peer: BackendDescriptor) -> bool:
        return True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, connect_timeout: float = 5.0,
                 io_timeout: float = 30.0, advertise_host: str | None = None, tag: str | None = None,
                 copy_threads: int | None = None, cluster_token: str | None = None,
                 accepted_tokens: tuple[str, ...] = (), lanes: int = 1) -> None:
        """``copy_threads``: threads that copy one large piece of a transfer into this (receiving) backend's
        pool (``parallel_copy``; default 2, or 1 on a single CPU). ``cluster_token``: the workers' shared
        token, or None; it keys every transfer's MAC together with the transfer's secret (``auth``).
        ``lanes``: transfers that may move to one peer at once (``sender``)."""
        if type(port) is not int or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not connect_timeout > 0 or not io_timeout > 0:
            raise ValueError("connect_timeout and io_timeout must be > 0")
        if advertise_host is None and host in ("", "0.0.0.0", "::"):
            raise ValueError(f"binding to {host!r} needs advertise_host (the address peers connect to)")
        self.host, self.port, self.tag = host, port, tag
        self.advertise_host = advertise_host or host
        self.connect_timeout, self.io_timeout = connect_timeout, io_timeout
        self.host_key = shm_segment.host_key()
        self._cluster_token = auth.check_cluster_token(cluster_token)
        self._accepted_tokens = check_accepted_tokens(accepted_tokens)  # (rotation)
        self._copier = ParallelCopy(default_threads() if copy_threads is None else copy_threads)
        self._endpoint = Endpoint(lanes)
        self._door = Door()
        self._segment: shm_segment.Segment | None = None
        self._board: Board | None = None  # (sender) at the end of the segment, after the pool
        self._pool_end = 0  # bytes of the segment before the board
        self._buffer: memoryview | None = None
        self._array: np.ndarray | None = None
        self._base = 0  # offset of the registered buffer inside the segment
        self._descriptor: BackendDescriptor | None = None

    # -- public API -------------------------------------------------------
    def allocate(self, size: int) -> memoryview:
        """Create this backend's segment; its first ``size`` bytes (zero-filled) are returned, to register
        (or a slice of them) next; the abort board follows them."""
        if type(size) is not int or size <= 0:
            raise ValueError(f"size must be a positive int, got {size!r}")
        with self._endpoint.lock:
            self._endpoint.check_open()
            if self._segment is not None:
                raise TransferError("this backend already allocated its segment")
            seg = shm_segment.create(shm_board.segment_size(size), self.tag)
            self._pool_end = shm_board.board_offset(size)
            self._board = Board(seg.mapping, self._pool_end)
            self._segment = seg
            return seg.buffer()[:size]

    @property
    def copy_threads(self) -> int:
        """Threads that copy one large piece of an incoming transfer (``parallel_copy``)."""
        return self._copier.threads

    @property
    def segment_name(self) -> str | None:
        return None if self._segment is None else self._segment.name

    def register(self, buffer: memoryview) -> BackendDescriptor:
        buffer = check_buffer(buffer)
        with self._endpoint.lock:
            self._endpoint.check_open()
            if self._buffer is not None:
                raise TransferError("a buffer is already registered with this backend")
            seg = self._segment
            if seg is None:
                shm_segment.remove_stale()  # (allocate() did it otherwise) leftovers of SIGKILLed workers
            array = np.frombuffer(buffer, dtype=np.uint8)
            base = 0  # no segment: receive-only (peers copy into ordinary memory, which keeps huge pages)
            if seg is not None:
                base = array.ctypes.data - np.frombuffer(seg.mapping, dtype=np.uint8).ctypes.data
                if base < 0 or base + buffer.nbytes > self._pool_end:
                    raise TransferError("the registered buffer must lie inside the segment from allocate()")
            listener = listen_tcp(self.host, self.port)
            self._endpoint.listen(listener)
            self._buffer, self._array, self._base = buffer, array, base
            address = format_address(self.advertise_host, listener.getsockname()[1])
            self._descriptor = BackendDescriptor(self.name, address, buffer.nbytes,
                                                 offers=((HOST_OFFER, self.host_key),))
            self._endpoint.start_acceptor(self.name, self._serve, _setup, MAX_INBOUND, log)
        return self._descriptor

    @property
    def descriptor(self) -> BackendDescriptor | None:
        return self._descriptor

    def can_send(self) -> bool:
        """Sending needs the registered buffer in this backend's segment (peers map it to copy from)."""
        return self._segment is not None

    def reaches(self, peer: BackendDescriptor) -> bool:
        """True if this backend can send to ``peer``: we have a segment, it offers shm on this host."""
        return self.can_send() and peer.offer(self.name) is not None and peer.offer(HOST_OFFER) == self.host_key

    def send(self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor,
             dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        check_transfer_id(transfer_id)
        key = auth.transfer_key(secret, self._cluster_token)
        if not isinstance(peer, BackendDescriptor) or peer.offer(self.name) is None:
            raise ValueError(f"peer must offer shm, got {peer!r:.200}")
        if peer.offer(HOST_OFFER) != self.host_key:
            raise ValueError("peer is not on this host (different /dev/shm or network namespace); use tcp")
        address = peer.offer(self.name)
        parse_address(address)
        buffer = self._require_buffer()
        if not self.can_send():
            raise TransferError("this shm backend is receive-only: a sender's buffer must be allocate()d "
                                "in its shared-memory segment")
        src, dst, total = check_send_regions(src, buffer.nbytes, dst, peer.buffer_size)
        job = Transfer(CompletionToken(transfer_id), src, total, dst, key=key)
        self._endpoint.send(job, address, self._start_sender)
        return job.token

    def expect(self, transfer_id: str, dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        check_transfer_id(transfer_id)
        key, accepted = auth.receive_keys(secret, self._cluster_token, self._accepted_tokens)
        return self._endpoint.expect(transfer_id, dst, self._require_buffer().nbytes, key, accepted)

    @property
    def refused(self) -> int:
        """Offers refused so far (no or a wrong MAC, an id not expected, ...)."""
        return self._endpoint.refused

    @property
    def unproven(self) -> int:
        """Inbound connections closed before they opened a transfer: no Hello and offer within the
        listener's deadline, or evicted by newer ones (``listener.Door``)."""
        return self._door.dropped

    def abort(self, transfer_id: str) -> None:
        self._endpoint.abort(transfer_id)  # (waits out an in-progress chunk copy; none follows)
        if self._board is not None:  # after its token failed: a receiver that has not confirmed yet fails
            self._board.revoke(transfer_id)

    def outstanding(self) -> set[str]:
        return self._endpoint.outstanding()

    progress_tick = None  # the receiver's threads copy the bytes; tokens wake the engine when finished

    def progress(self) -> None:
        """Nothing to do: the receiver's reader threads copy the bytes."""

    def forget_peer(self, address: str) -> None:
        self._endpoint.forget_peer(address)

    def close(self) -> None:
        if self._endpoint.close(join_timeout=self.connect_timeout + 5):
            self._copier.close()
            if self._segment is not None:
                self._segment.unlink()  # the mapping (the pool) stays valid until the process exits

    # -- internals --------------------------------------------------------
    def _require_buffer(self) -> memoryview:
        if self._buffer is None:
            raise TransferError("register() a buffer first")
        return self._buffer

    # -- receiver ---------------------------------------------------------
    def _serve(self, sock: socket.socket, addr) -> None:
        # A sender says Hello and offers its first transfer right after it connects: both must come
        # at once (``Door``); once an offer opened a transfer, the connection may wait for the next.
        conn = self._door.enter(sock, addr, self._endpoint.wake[0], self.io_timeout, 2, log)
        try:
            hello = Hello.parse(conn.read_frame(MAX_FRAME, first_byte_timeout=self.io_timeout) or {})
            error = None
            if hello.version != PROTOCOL_VERSION:
                error = f"protocol version {hello.version} != {PROTOCOL_VERSION}"
            elif hello.host != self.host_key:
                error = "sender is not on this host (different /dev/shm or network namespace)"
            conn.send_all([memoryview(Reply(error is None, error).pack())])
            if error is not None:
                log.warning("refused shm peer %s: %s", addr, error)
                return
            peer = _PeerSegment(hello)  # mapped at the first offer whose MAC checks out
            serve_offers(conn, self._endpoint, self.name, hello.board, self._buffer.nbytes,
                         lambda rec, offer: self._copy(rec, peer, offer),
                         lambda conn, rec, offer: _confirm(peer, rec, offer), log, addr)
        except (Closing, Unproven):  # (the door counts and logs the unproven)
            return
        except (ProtocolError, OSError) as e:
            log.warning("dropping shm connection from %s: %s", addr, e)
        except Exception:
            log.exception("dropping shm connection from %s", addr)
        finally:
            conn.close()

    def _copy(self, rec: Transfer, peer: "_PeerSegment", offer: Offer) -> str | None:
        if offer.board is None:  # (confirming needs it)
            error = f"offer of {offer.transfer_id!r} has no abort board entry (an older shm sender?)"
            rec.token._fail(error)
            return error
        try:
            src = peer.source()
        except shm_segment.SegmentError as e:
            rec.token._fail(str(e))
            return str(e)
        rec.token._advance(TransferState.TRANSFERRING)
        pieces = copy_regions(self._array, rec.regions, src, offer.src, copy=self._copier.copy)
        while True:
            with rec.lock:
                if rec.token.finished():
                    return f"transfer {offer.transfer_id!r} aborted by the receiver"
                if next(pieces, None) is None:
                    return None

    # -- sender -----------------------------------------------------------
    def _start_sender(self, address: str, queue: SimpleQueue) -> None:
        self._endpoint.threads.start(send_loop, f"xpyd-shm-send-{address}", address, queue, self._connect,
                                     self._push, self._endpoint.sending, log)

    def _connect(self, address: str) -> Conn:
        conn = connect(address, self._endpoint.wake[0], _setup, self.connect_timeout, self.io_timeout)
        try:
            seg = self._segment
            hello = Hello(PROTOCOL_VERSION, seg.name, seg.size, self.host_key, self._pool_end)
            conn.send_all([memoryview(hello.pack())])
            reply = Reply.parse(conn.read_frame(MAX_FRAME))
            if not reply.ok:
                raise ConnectionError(f"refused: {reply.error}")
            log.info("shm transfer: connected to %s; it copies from segment %s", address, seg.name)
            return conn
        except BaseException:
            conn.sock.close()
            raise

    def _push(self, conn: Conn, job: Transfer, address: str) -> None:
        tid = job.token.transfer_id
        src = tuple(Region(r.offset + self._base, r.length) for r in job.regions)
        offer_on_board(conn, job, self._board, lambda entry: Offer(
            tid, src, job.dst, entry, auth.transfer_mac(job.key, self.name, tid, job.dst, src)), address)


class _PeerSegment:
    """The segment a sender's Hello names; mapped (read-only) when the first offer that checks out needs it."""

    __slots__ = ("hello", "src", "board")

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self.src: np.ndarray | None = None
        self.board: BoardView | None = None

    def source(self) -> np.ndarray:
        if self.src is None:
            mapping = shm_segment.map_peer(self.hello.segment, self.hello.size)
            self.src, self.board = np.frombuffer(mapping, dtype=np.uint8), BoardView(mapping, self.hello.board)
        return self.src


def _confirm(peer: _PeerSegment, rec: Transfer, offer: Offer) -> bool:
    """After the copy: is the sender's ticket still on its board? (Read under the transfer's lock, after
    the last chunk released it, so the read follows the copy; see ``shm_board``.)"""
    with rec.lock:
        return peer.board.valid(*offer.board)
