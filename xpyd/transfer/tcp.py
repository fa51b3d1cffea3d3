"""TCP transfer backend: zero-copy pushes between registered buffers over plain sockets.

Wire format, per transfer on a reused connection (sender -> receiver)::

    u32 big-endian length | msgpack {"v", "id", "dst": [[off, len], ...], "total"} | raw bytes
    <- u32 length | msgpack {"id", "ok", "error"}

Threads (all daemon, started by ``register``/first ``send``, joined by ``close``):

- acceptor: accepts inbound connections, one reader thread each;
- reader: header -> look up the expected transfer -> ``recv_into`` the pool -> DONE -> ack
  (so a sender's DONE implies the receiver's token is already DONE).
  A transfer that was not expected, or whose regions differ, is drained into a
  scratch buffer (never the pool) and refused; a malformed header closes the connection;
- sender, one per peer address: takes jobs from its queue, ``sendmsg`` straight from
  pool slices, waits for the ack; reconnects after a failure.

Sockets are non-blocking; every wait is a ``poll`` bounded by a timeout that also
wakes on ``close()``. Each pool read/write happens under the transfer's lock, so
once ``abort()`` returns no more bytes of that transfer touch the pool.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Sequence

import msgpack

from xpyd import PROTOCOL_VERSION
from xpyd.transfer.base import (
    BackendDescriptor,
    CompletionToken,
    Region,
    TransferError,
    TransferState,
    check_buffer,
    check_regions,
    check_transfer_id,
)

log = logging.getLogger(__name__)

CHUNK = 4 << 20  # largest single iovec / recv_into slice


def _iov_max() -> int:
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        n = -1
    return min(n, 1024) if n >= 16 else 1024


IOV_MAX = _iov_max()
MAX_HEADER = 1 << 20
MAX_ACK = 64 << 10
MAX_ERROR_LEN = 1000
IDLE_TIMEOUT = 600.0  # an inbound connection with no frame for this long is closed
SOCK_BUF = 4 << 20
MAX_INBOUND = 256  # concurrent inbound connections; more are closed at once
_LEN = struct.Struct(">I")
_WILDCARD_HOSTS = {"", "0.0.0.0", "::"}


class _ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the connection is dropped."""


class _Closing(Exception):
    """The backend is closing."""


class _Aborted(Exception):
    """The transfer was aborted (or failed) while its bytes were moving."""

    def __init__(self, done: int = 0) -> None:
        super().__init__("aborted")
        self.done = done  # bytes of the current view already moved


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid tcp address {address!r}, expected host:port")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _pack_frame(obj: dict) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _drain(conn: "_Conn", n: int) -> None:
    """Read and discard ``n`` payload bytes (into scratch, never the pool)."""
    if n <= 0:
        return
    scratch = memoryview(bytearray(min(CHUNK, n)))
    for off in range(0, n, len(scratch)):
        conn.recv_into(scratch[: min(len(scratch), n - off)])


def _slices(buffer: memoryview, regions: Sequence[Region]) -> list[memoryview]:
    """Views of ``buffer`` covering ``regions`` in order, none longer than CHUNK."""
    out = []
    for r in regions:
        for off in range(r.offset, r.end, CHUNK):
            out.append(buffer[off : min(off + CHUNK, r.end)])
    return out


class _Conn:
    """A non-blocking socket whose waits are bounded by a timeout and wake on backend close."""

    def __init__(self, sock: socket.socket, wake_fd: int, io_timeout: float) -> None:
        self.sock = sock
        self.io_timeout = io_timeout
        self._wake_fd = wake_fd
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._poll.register(wake_fd, select.POLLIN)

    def wait(self, events: int, timeout: float | None = None) -> None:
        """Wait until the socket is ready for ``events`` (or errored); raise on timeout/close."""
        self._poll.modify(self.sock, events)
        ready = self._poll.poll(1000 * (self.io_timeout if timeout is None else timeout))
        if any(fd == self._wake_fd for fd, _ in ready):
            raise _Closing()
        if not ready:
            raise TimeoutError(f"no progress within {self.io_timeout if timeout is None else timeout:g}s")

    def stale(self) -> bool:
        """An idle connection that is readable has been closed (or spoken to out of turn)."""
        self._poll.modify(self.sock, select.POLLIN)
        return any(fd == self.sock.fileno() for fd, _ in self._poll.poll(0))

    def recv_into(self, view: memoryview, lock: threading.Lock | None = None, token=None) -> None:
        """Fill ``view`` exactly. With ``lock``, each copy runs under it and stops once ``token`` finished."""
        pos, n_total = 0, len(view)
        while pos < n_total:
            try:
                if lock is None:
                    n = self.sock.recv_into(view[pos:])
                else:
                    with lock:
                        if token.finished():
                            raise _Aborted(pos)
                        n = self.sock.recv_into(view[pos:])
            except BlockingIOError:
                self.wait(select.POLLIN)
                continue
            if n == 0:
                raise ConnectionError("peer closed the connection mid-frame")
            pos += n

    def send_all(self, views: list[memoryview], lock: threading.Lock | None = None, token=None) -> None:
        """Send ``views`` with sendmsg (IOV_MAX at a time, partial sends resumed); lock as in recv_into."""
        pending = deque(views)
        while pending:
            batch = [pending[i] for i in range(min(len(pending), IOV_MAX))]
            try:
                if lock is None:
                    n = self.sock.sendmsg(batch)
                else:
                    with lock:
                        if token.finished():
                            raise _Aborted()
                        n = self.sock.sendmsg(batch)
            except BlockingIOError:
                self.wait(select.POLLOUT)
                continue
            while n:
                head = pending[0]
                if n >= len(head):
                    n -= len(head)
                    pending.popleft()
                else:
                    pending[0] = head[n:]
                    n = 0

    def read_frame(self, limit: int, first_byte_timeout: float | None = None) -> dict | None:
        """Read one length-prefixed msgpack map; None on a clean EOF before the frame."""
        head = bytearray(_LEN.size)
        view = memoryview(head)
        while True:
            try:
                n = self.sock.recv_into(view)
                break
            except BlockingIOError:
                self.wait(select.POLLIN, first_byte_timeout)
        if n == 0:
            return None
        self.recv_into(view[n:])
        (length,) = _LEN.unpack(head)
        if not 0 < length <= limit:
            raise _ProtocolError(f"frame length {length} outside 1..{limit}")
        body = bytearray(length)
        self.recv_into(memoryview(body))
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises many types on garbage
            raise _ProtocolError(f"undecodable frame: {e}") from None
        if not isinstance(obj, dict):
            raise _ProtocolError(f"frame is a {type(obj).__name__}, not a map")
        return obj


def _parse_header(h: dict, buffer_size: int) -> tuple[str, tuple[Region, ...], int, int]:
    """Validate a transfer header -> (id, dst, total, version). Raises _ProtocolError."""
    tid, dst, total, ver = h.get("id"), h.get("dst"), h.get("total"), h.get("v")
    if type(ver) is not int:
        raise _ProtocolError("header without an int version")
    try:
        check_transfer_id(tid)
    except ValueError as e:
        raise _ProtocolError(str(e)) from None
    if type(total) is not int or not 0 < total <= buffer_size:
        raise _ProtocolError(f"header total {total!r:.40} outside 1..{buffer_size}")
    if not isinstance(dst, list) or not dst:
        raise _ProtocolError("header dst is not a non-empty list")
    regions = []
    for pair in dst:
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair)):
            raise _ProtocolError("header dst entries must be [offset, length] ints")
        if pair[0] < 0 or pair[1] <= 0:
            raise _ProtocolError(f"header dst region {pair} is invalid")
        regions.append(Region(pair[0], pair[1]))
    if sum(r.length for r in regions) != total:
        raise _ProtocolError("header dst lengths do not add up to total")
    return tid, tuple(regions), total, ver


@dataclass(eq=False, slots=True)
class _Transfer:
    """One side of a transfer: its token plus the lock that guards its pool I/O."""

    token: CompletionToken
    regions: tuple[Region, ...]  # src (sender) or dst (receiver)
    total: int
    dst: tuple[Region, ...] = ()  # sender: where the bytes land at the peer
    lock: threading.Lock = field(default_factory=threading.Lock)
    claimed: bool = False  # receiver: a connection is writing it


class TcpTransferBackend:
    name = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout: float = 5.0,
        io_timeout: float = 30.0,
        advertise_host: str | None = None,
    ) -> None:
        if not isinstance(host, str):
            raise ValueError(f"host must be a str, got {host!r}")
        if type(port) is not int or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        if not connect_timeout > 0 or not io_timeout > 0:
            raise ValueError("connect_timeout and io_timeout must be > 0")
        if advertise_host is None and host in _WILDCARD_HOSTS:
            raise ValueError(f"binding to {host!r} needs advertise_host (the address peers connect to)")
        self.host, self.port = host, port
        self.connect_timeout, self.io_timeout = connect_timeout, io_timeout
        self.advertise_host = advertise_host or host
        self._lock = threading.Lock()
        self._buffer: memoryview | None = None
        self._descriptor: BackendDescriptor | None = None
        self._listener: socket.socket | None = None
        self._wake: tuple[int, int] | None = None  # pipe; written once by close() to wake every poll
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._senders: dict[str, tuple[SimpleQueue, threading.Thread]] = {}
        self._sending: dict[str, _Transfer] = {}
        self._expected: dict[str, _Transfer] = {}

    # -- public API -------------------------------------------------------
    def register(self, buffer: memoryview) -> BackendDescriptor:
        buffer = check_buffer(buffer)
        with self._lock:
            if self._closed:
                raise TransferError("backend is closed")
            if self._buffer is not None:
                raise TransferError("a buffer is already registered with this backend")
            family, _, _, _, addr = socket.getaddrinfo(self.host or None, self.port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
            listener = socket.create_server(addr[:2], family=family, backlog=128)
            listener.setblocking(False)
            self._listener, self._buffer = listener, buffer
            self._wake = os.pipe()
            port = listener.getsockname()[1]
            address = format_address(self.advertise_host, port)
            self._descriptor = BackendDescriptor(self.name, address, buffer.nbytes)
            self._start_thread(self._accept_loop, "xpyd-tcp-accept")
        return self._descriptor

    @property
    def descriptor(self) -> BackendDescriptor | None:
        return self._descriptor

    def send(
        self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor, dst: Sequence[Region]
    ) -> CompletionToken:
        check_transfer_id(transfer_id)
        if not isinstance(peer, BackendDescriptor) or peer.backend != self.name:
            raise ValueError(f"peer must be a tcp BackendDescriptor, got {peer!r}")
        parse_address(peer.address)
        buffer = self._require_buffer()
        src, total = check_regions(src, buffer.nbytes, "src")
        dst, dst_total = check_regions(dst, peer.buffer_size, "dst")
        if total != dst_total:
            raise ValueError(f"src regions hold {total} bytes but dst regions {dst_total}")
        job = _Transfer(CompletionToken(transfer_id), src, total, dst)
        with self._lock:
            if self._closed:
                raise TransferError("backend is closed")
            if transfer_id in self._sending:
                raise TransferError(f"transfer {transfer_id!r} is already being sent")
            self._sending[transfer_id] = job
            entry = self._senders.get(peer.address)
            if entry is None:
                queue: SimpleQueue = SimpleQueue()
                name = f"xpyd-tcp-send-{peer.address}"
                thread = self._start_thread(self._send_loop, name, peer.address, queue)
                entry = self._senders[peer.address] = (queue, thread)
            entry[0].put(job)
        return job.token

    def expect(self, transfer_id: str, dst: Sequence[Region]) -> CompletionToken:
        check_transfer_id(transfer_id)
        dst, total = check_regions(dst, self._require_buffer().nbytes, "dst")
        rec = _Transfer(CompletionToken(transfer_id), dst, total)
        with self._lock:
            if self._closed:
                raise TransferError("backend is closed")
            if transfer_id in self._expected:
                raise TransferError(f"transfer {transfer_id!r} is already expected")
            self._expected[transfer_id] = rec
        return rec.token

    def abort(self, transfer_id: str) -> None:
        with self._lock:
            recs = [self._expected.pop(transfer_id, None), self._sending.pop(transfer_id, None)]
        for rec in recs:
            if rec is not None:
                with rec.lock:  # waits out an in-progress copy; none follows
                    rec.token._fail("aborted")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads, self._threads = self._threads, []
            senders, self._senders = list(self._senders.values()), {}
            recs = list(self._expected.values()) + list(self._sending.values())
            self._expected.clear()
            self._sending.clear()
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        for queue, _ in senders:
            queue.put(None)
        for t in threads:
            t.join(timeout=self.connect_timeout + 5)
        for rec in recs:
            rec.token._fail("backend closed")
        if self._listener is not None:
            self._listener.close()
        if self._wake is not None and not any(t.is_alive() for t in threads):
            for fd in self._wake:  # (kept open if a thread is stuck, so it never polls a reused fd)
                os.close(fd)
            self._wake = None

    # -- internals --------------------------------------------------------
    def _require_buffer(self) -> memoryview:
        if self._buffer is None:
            raise TransferError("register() a buffer first")
        return self._buffer

    def _start_thread(self, target, name: str, *args) -> threading.Thread:
        """Start a daemon thread and track it (caller holds self._lock)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()
        return t

    def _setup(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)

    def _finish(self, table: dict[str, _Transfer], rec: _Transfer) -> None:
        with self._lock:
            if table.get(rec.token.transfer_id) is rec:
                del table[rec.token.transfer_id]

    # -- receiver ---------------------------------------------------------
    def _accept_loop(self) -> None:
        conn = _Conn(self._listener, self._wake[0], IDLE_TIMEOUT)
        while True:
            try:
                conn.wait(select.POLLIN)
                sock, addr = self._listener.accept()
            except (TimeoutError, BlockingIOError, ConnectionAbortedError):
                continue
            except _Closing:
                return
            except OSError as e:  # e.g. out of file descriptors: back off, keep listening
                log.error("tcp transfer listener cannot accept: %s", e)
                time.sleep(0.1)
                continue
            self._setup(sock)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                inbound = sum(t.name.startswith("xpyd-tcp-recv") and t.is_alive() for t in self._threads)
                if inbound >= MAX_INBOUND:
                    log.error("refusing transfer connection from %s: %d already open", addr, MAX_INBOUND)
                    sock.close()
                    continue
                self._start_thread(self._serve, f"xpyd-tcp-recv-{addr[0]}:{addr[1]}", sock, addr)

    def _serve(self, sock: socket.socket, addr) -> None:
        conn = _Conn(sock, self._wake[0], self.io_timeout)
        try:
            while True:
                header = conn.read_frame(MAX_HEADER, first_byte_timeout=IDLE_TIMEOUT)
                if header is None:
                    return
                tid, dst, total, ver = _parse_header(header, self._buffer.nbytes)
                rec, error = self._claim(tid, dst, ver)
                if rec is None:
                    _drain(conn, total)  # take what the sender pushes, but never into the pool
                else:
                    error = self._receive(conn, rec)
                if error is not None:
                    log.warning("refused transfer %r from %s: %s", tid, addr, error)
                if rec is not None and error is None:  # DONE before the ack, so sender DONE => receiver DONE
                    if not rec.token._advance(TransferState.DONE):
                        error = f"transfer {tid!r} aborted by the receiver"
                    self._finish(self._expected, rec)
                conn.send_all([memoryview(_pack_frame({"id": tid, "ok": error is None, "error": error}))])
                if ver != PROTOCOL_VERSION:
                    return
        except _Closing:
            return
        except (_ProtocolError, OSError) as e:
            log.warning("dropping transfer connection from %s: %s", addr, e)
        except Exception:
            log.exception("dropping transfer connection from %s", addr)
        finally:
            sock.close()

    def _claim(self, tid: str, dst: tuple[Region, ...], ver: int) -> tuple[_Transfer | None, str | None]:
        """The expected transfer these bytes may be written to, else why they are refused."""
        if ver != PROTOCOL_VERSION:
            return None, f"protocol version {ver} != {PROTOCOL_VERSION}"
        with self._lock:
            rec = self._expected.get(tid)
            if rec is None:
                return None, f"unexpected transfer id {tid!r}"
            if rec.claimed:
                return None, f"transfer {tid!r} is already being received"
            if rec.regions != dst:
                del self._expected[tid]
                error = f"dst regions differ from the ones expected for {tid!r}"
                with rec.lock:
                    rec.token._fail(error)
                return None, error
            rec.claimed = True
        return rec, None

    def _receive(self, conn: _Conn, rec: _Transfer) -> str | None:
        """recv_into the claimed regions; the error to refuse with, or None when all bytes landed."""
        rec.token._advance(TransferState.TRANSFERRING)
        views = _slices(self._buffer, rec.regions)
        try:
            for i, view in enumerate(views):
                conn.recv_into(view, rec.lock, rec.token)
        except _Aborted as e:  # aborted (or closed): the rest goes to scratch, not the pool
            _drain(conn, sum(len(v) for v in views[i:]) - e.done)
            return f"transfer {rec.token.transfer_id!r} aborted by the receiver"
        except BaseException as e:
            rec.token._fail("backend closed" if isinstance(e, _Closing) else f"receive failed: {e}")
            self._finish(self._expected, rec)
            raise
        return None

    # -- sender -----------------------------------------------------------
    def _connect(self, address: str) -> _Conn:
        host, port = parse_address(address)
        family, type_, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, type_, proto)
        try:
            self._setup(sock)
            conn = _Conn(sock, self._wake[0], self.io_timeout)
            err = sock.connect_ex(sockaddr)
            if err in (errno.EINPROGRESS, errno.EAGAIN):
                conn.wait(select.POLLOUT, self.connect_timeout)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise ConnectionError(f"cannot connect: {os.strerror(err)}")
            return conn
        except BaseException:
            sock.close()
            raise

    def _send_loop(self, address: str, queue: SimpleQueue) -> None:
        conn: _Conn | None = None
        try:
            while (job := queue.get()) is not None:
                if job.token.finished():  # aborted while queued
                    continue
                try:
                    if conn is not None and conn.stale():
                        conn.sock.close()
                        conn = None
                    if conn is None:
                        conn = self._connect(address)
                    self._push(conn, job, address)
                except _Closing:
                    job.token._fail("backend closed")
                    return
                except _Aborted:  # the receiver sees a truncated transfer and fails it
                    conn.sock.close()
                    conn = None
                except Exception as e:  # any failure fails this job only; the next one reconnects
                    if not isinstance(e, (_ProtocolError, OSError)):
                        log.exception("sending transfer %r to %s", job.token.transfer_id, address)
                    job.token._fail(f"send to {address} failed: {e or type(e).__name__}")
                    if conn is not None:
                        conn.sock.close()
                        conn = None
                finally:
                    self._finish(self._sending, job)
        finally:
            if conn is not None:
                conn.sock.close()

    def _push(self, conn: _Conn, job: _Transfer, address: str) -> None:
        tid = job.token.transfer_id
        dst = [[r.offset, r.length] for r in job.dst]
        header = _pack_frame({"v": PROTOCOL_VERSION, "id": tid, "dst": dst, "total": job.total})
        if not job.token._advance(TransferState.TRANSFERRING):
            return  # aborted just now; nothing was sent
        conn.send_all([memoryview(header), *_slices(self._buffer, job.regions)], job.lock, job.token)
        ack = conn.read_frame(MAX_ACK)
        if ack is None:
            raise ConnectionError("peer closed the connection before acknowledging")
        if ack.get("id") != tid or type(ack.get("ok")) is not bool:
            raise _ProtocolError(f"bad ack {ack!r:.200}")
        if ack["ok"]:
            job.token._advance(TransferState.DONE)
        else:
            job.token._fail(f"refused by {address}: {str(ack.get('error'))[:MAX_ERROR_LEN]}")
