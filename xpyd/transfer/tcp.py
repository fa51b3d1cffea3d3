"""TCP transfer backend: zero-copy pushes between registered buffers over plain sockets.

The wire format, framing and socket I/O live in ``tcp_wire``; the threads, the per-peer
sender lanes and the transfer tables, shared with ``shm``, in ``endpoint`` (built from
``listener``, ``sender`` and ``table``); this module owns what happens to the bytes.

Threads (all daemon, started by ``register``/first ``send``, joined by ``close``):

- acceptor: accepts inbound connections, one reader thread each;
- reader: header -> look up the expected transfer, check the header's MAC (``auth``) -> ``recv_into``
  the pool -> DONE -> ack (so a sender's DONE implies the receiver's token is already DONE).
  A header without a valid MAC, for a transfer not (or no longer) expected, or whose regions differ,
  is refused before a byte behind it is read: error ack, connection closed, the expected transfer
  left to its real sender (regions that differ under a valid MAC fail it: its real sender erred);
  a malformed header closes the connection;
- sender, up to ``--kv-lanes`` (default 1) per peer address (lanes, each with its own connection, taking jobs from
  the peer's queue: a long transfer does not hold up the short ones): ``sendmsg`` straight from pool
  slices, waits for the ack; reconnects after a failure.

Sockets are non-blocking; every wait is a ``poll`` bounded by a timeout that also
wakes on ``close()``, and a connection whose peer acknowledges nothing for
``stall_timeout`` (a cut link) fails in the kernel (``fail_when_stalled``). Each pool
read/write happens under the transfer's lock, so once ``abort()`` returns no more
bytes of that transfer touch the pool.
"""

from __future__ import annotations

import logging
import select
import socket
from queue import SimpleQueue
from typing import Sequence

from xpyd import PROTOCOL_VERSION
from xpyd.cluster_tokens import check_accepted_tokens
from xpyd.transfer import auth
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
from xpyd.transfer.sender import connect, send_loop
from xpyd.transfer.table import Transfer
from xpyd.transfer.tcp_wire import (
    MAX_ACK,
    MAX_HEADER,
    Aborted,
    Closing,
    Conn,
    Header,
    ProtocolError,
    Unproven,
    drain,
    format_address,
    pack_ack,
    pack_header,
    parse_ack,
    parse_address,
    parse_header,
    slices,
)

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 600.0  # an established inbound connection with no frame for this long is closed
SOCK_BUF = 4 << 20
MAX_INBOUND = 256  # concurrent inbound connections; more are closed at once (see also ``listener.Door``)
STALL_TIMEOUT = 10.0  # default: a peer that acknowledges nothing for this long fails the connection
_WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


def _setup(sock: socket.socket, stall_timeout: float = STALL_TIMEOUT) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
    fail_when_stalled(sock, stall_timeout)


def fail_when_stalled(sock: socket.socket, stall_timeout: float) -> None:
    """Let the kernel fail the connection once its peer has acknowledged nothing for ``stall_timeout``.

    A cut link drops packets without a reset: a sender's data then stays unacknowledged, and a side that
    waits (the receiver for bytes, the sender for the ack) sees an idle connection. Linux retransmits for
    15 minutes and keepalive starts after 2 hours by default, and our own waits are bounded only by
    ``io_timeout`` each, which must also cover a healthy slow link draining 8 MiB of socket buffer.
    ``TCP_USER_TIMEOUT`` bounds how long sent data may stay unacknowledged, and keepalive probes (every
    third of the bound once idle) put data in flight on an idle connection, so either way the socket
    errors (ETIMEDOUT) about ``stall_timeout`` after the peer went silent, and the poll waiting on it wakes.
    On a live link, even a slow or lossy one, acknowledgements keep coming and nothing fires."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if not hasattr(socket, "TCP_USER_TIMEOUT"):  # (not Linux: the io_timeout waits still bound it)
        return
    probe = max(1, int(stall_timeout / 3))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(stall_timeout * 1000)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, probe)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, probe)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


class TcpTransferBackend:
    name = "tcp"

    def same_host(self, peer: BackendDescriptor) -> bool:
        return False

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout: float = 5.0,
        io_timeout: float = 30.0,
        advertise_host: str | None = None,
        cluster_token: str | None = None,
        accepted_tokens: tuple[str, ...] = (),
        stall_timeout: float = STALL_TIMEOUT,
        lanes: int = 1,
    ) -> None:
        """``cluster_token``: the workers' shared token (``--cluster-token``), or None; it keys every
        transfer's MAC together with the transfer's secret (``auth``); a transfer MACed with one of
        ``accepted_tokens`` is received too (a rotation window). ``stall_timeout``: a connection
        whose peer acknowledges nothing for this long fails (``fail_when_stalled``), and with it the
        transfer on it; ``io_timeout`` bounds each wait for the peer's next frame or bytes. ``lanes``: transfers
        that may move to one peer at once (``sender``)."""
        if not isinstance(host, str):
            raise ValueError(f"host must be a str, got {host!r}")
        if type(port) is not int or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not connect_timeout > 0 or not io_timeout > 0 or not stall_timeout > 0:
            raise ValueError("connect_timeout, io_timeout and stall_timeout must be > 0")
        if advertise_host is None and host in _WILDCARD_HOSTS:
            raise ValueError(f"binding to {host!r} needs advertise_host (the address peers connect to)")
        self.host, self.port = host, port
        self.connect_timeout, self.io_timeout, self.stall_timeout = connect_timeout, io_timeout, stall_timeout
        self.advertise_host = advertise_host or host
        self._cluster_token = auth.check_cluster_token(cluster_token)
        self._accepted_tokens = check_accepted_tokens(accepted_tokens)  # (rotation)
        self._endpoint = Endpoint(lanes)
        self._door = Door()
        self._buffer: memoryview | None = None
        self._descriptor: BackendDescriptor | None = None

    # -- public API -------------------------------------------------------
    def register(self, buffer: memoryview) -> BackendDescriptor:
        buffer = check_buffer(buffer)
        with self._endpoint.lock:
            self._endpoint.check_open()
            if self._buffer is not None:
                raise TransferError("a buffer is already registered with this backend")
            family, _, _, _, addr = socket.getaddrinfo(self.host or None, self.port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
            listener = socket.create_server(addr[:2], family=family, backlog=128)
            self._endpoint.listen(listener)
            self._buffer = buffer
            port = listener.getsockname()[1]
            address = format_address(self.advertise_host, port)
            self._descriptor = BackendDescriptor(self.name, address, buffer.nbytes)
            self._endpoint.start_acceptor(self.name, self._serve, self._setup_socket, MAX_INBOUND, log)
        return self._descriptor

    @property
    def descriptor(self) -> BackendDescriptor | None:
        return self._descriptor

    def send(
        self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor, dst: Sequence[Region], *,
        secret: bytes,
    ) -> CompletionToken:
        check_transfer_id(transfer_id)
        key = auth.transfer_key(secret, self._cluster_token)
        if not isinstance(peer, BackendDescriptor) or peer.backend != self.name:
            raise ValueError(f"peer must be a tcp BackendDescriptor, got {peer!r}")
        parse_address(peer.address)
        buffer = self._require_buffer()
        src, dst, total = check_send_regions(src, buffer.nbytes, dst, peer.buffer_size)
        job = Transfer(CompletionToken(transfer_id), src, total, dst, key=key)
        self._endpoint.send(job, peer.address, self._start_sender)
        return job.token

    def expect(self, transfer_id: str, dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        check_transfer_id(transfer_id)
        key, accepted = auth.receive_keys(secret, self._cluster_token, self._accepted_tokens)
        return self._endpoint.expect(transfer_id, dst, self._require_buffer().nbytes, key, accepted)

    @property
    def refused(self) -> int:
        """Transfer headers refused so far (no or a wrong MAC, an id not expected, ...)."""
        return self._endpoint.refused

    @property
    def unproven(self) -> int:
        """Inbound connections closed before they opened a transfer: no header within the listener's
        deadline, or evicted by newer ones from the same source (``listener.Door``)."""
        return self._door.dropped

    def abort(self, transfer_id: str) -> None:
        self._endpoint.abort(transfer_id)

    def outstanding(self) -> set[str]:
        """Ids of transfers being sent or expected (not yet finished or aborted)."""
        return self._endpoint.outstanding()

    progress_tick = None  # the backend's threads move the bytes; tokens wake the engine when finished

    def progress(self) -> None:
        """Nothing to do: the backend's threads move the bytes."""

    def forget_peer(self, address: str) -> None:
        """Close the cached connection and sender thread to a peer that left the cluster.

        Sends already queued to it run (and fail) first; a later send reconnects.
        """
        self._endpoint.forget_peer(address)

    def close(self) -> None:
        self._endpoint.close(join_timeout=self.connect_timeout + 5)

    # -- internals --------------------------------------------------------
    def _setup_socket(self, sock: socket.socket) -> None:
        _setup(sock, self.stall_timeout)

    def _require_buffer(self) -> memoryview:
        if self._buffer is None:
            raise TransferError("register() a buffer first")
        return self._buffer

    # -- receiver ---------------------------------------------------------
    def _serve(self, sock: socket.socket, addr) -> None:
        # A sender connects right before its first transfer: its header must come at once (``Door``);
        # once one opened a transfer, the connection may wait for the next.
        conn = self._door.enter(sock, addr, self._endpoint.wake[0], self.io_timeout, 1, log)
        try:
            while True:
                frame = conn.read_frame(MAX_HEADER, first_byte_timeout=IDLE_TIMEOUT)
                if frame is None:
                    return
                header = parse_header(frame, self._buffer.nbytes)
                tid = header.transfer_id
                rec, error = self._claim(header)
                if rec is None:  # not a byte behind the header is read: say why, and hang up
                    self._endpoint.refuse(log, self.name, tid, addr, error)
                    conn.send_all([memoryview(pack_ack(tid, error))])
                    return
                error = self._receive(conn, rec)
                if error is not None:
                    log.warning("transfer %r from %s: %s", tid, addr, error)
                elif not rec.token._advance(TransferState.DONE):  # DONE before the ack: sender DONE => ours
                    error = f"transfer {tid!r} aborted by the receiver"
                self._endpoint.expected.finish(rec)
                conn.send_all([memoryview(pack_ack(tid, error))])
        except (Closing, Unproven):  # (the door counts and logs the unproven)
            return
        except (ProtocolError, OSError) as e:
            log.warning("dropping transfer connection from %s: %s", addr, e)
        except Exception:
            log.exception("dropping transfer connection from %s", addr)
        finally:
            conn.close()

    def _claim(self, header: Header) -> tuple[Transfer | None, str | None]:
        """The expected transfer these bytes may be written to, else why they are refused."""
        if header.version != PROTOCOL_VERSION:
            return None, f"protocol version {header.version} != {PROTOCOL_VERSION}"
        if header.mac is None:
            return None, "the header carries no MAC (a sender without the transfer's secret)"
        return self._endpoint.expected.claim(
            header.transfer_id, header.dst,
            lambda key: auth.mac_matches(key, header.mac, self.name, header.transfer_id, header.dst))

    def _receive(self, conn: Conn, rec: Transfer) -> str | None:
        """recv_into the claimed regions; the error to refuse with, or None when all bytes landed."""
        rec.token._advance(TransferState.TRANSFERRING)
        views = slices(self._buffer, rec.regions)
        try:
            for i, view in enumerate(views):
                conn.recv_into(view, rec.lock, rec.token)
        except Aborted as e:  # aborted (or closed): the rest goes to scratch, not the pool
            drain(conn, sum(len(v) for v in views[i:]) - e.done)
            return f"transfer {rec.token.transfer_id!r} aborted by the receiver"
        except BaseException as e:
            rec.token._fail("backend closed" if isinstance(e, Closing) else f"receive failed: {e}")
            self._endpoint.expected.finish(rec)
            raise
        return None

    # -- sender -----------------------------------------------------------
    def _start_sender(self, address: str, queue: SimpleQueue) -> None:
        self._endpoint.threads.start(send_loop, f"xpyd-tcp-send-{address}", address, queue, self._connect,
                                     self._push, self._endpoint.sending, log)

    def _connect(self, address: str) -> Conn:
        return connect(address, self._endpoint.wake[0], self._setup_socket, self.connect_timeout, self.io_timeout)

    def _push(self, conn: Conn, job: Transfer, address: str) -> None:
        tid = job.token.transfer_id
        header = pack_header(tid, job.dst, job.total, auth.transfer_mac(job.key, self.name, tid, job.dst))
        if not job.token._advance(TransferState.TRANSFERRING):
            return  # aborted just now; nothing was sent
        try:
            conn.send_all([memoryview(header), *slices(self._buffer, job.regions)], job.lock, job.token)
        except OSError:  # a receiver that refuses the header hangs up without reading on: its ack says why
            error = _ack_if_any(conn, tid)
            if error is not None:
                job.token._fail(f"refused by {address}: {error}")
            raise
        error = parse_ack(conn.read_frame(MAX_ACK), tid)
        if error is None:
            job.token._advance(TransferState.DONE)
        else:
            job.token._fail(f"refused by {address}: {error}")
            raise ConnectionError("refused")  # (a refused header is hung up on): reconnect for the next


def _ack_if_any(conn: Conn, tid: str) -> str | None:
    """The refusal the receiver acked before it hung up, if it reached us (None: no ack, or not a refusal)."""
    try:
        conn.wait(select.POLLIN, 0)
        return parse_ack(conn.read_frame(MAX_ACK), tid)
    except (OSError, ProtocolError):
        return None
