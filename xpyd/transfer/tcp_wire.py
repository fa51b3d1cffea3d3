"""TCP transfer wire layer: framing, size caps and non-blocking socket I/O.

Wire format, per transfer on a reused connection (sender -> receiver)::

    u32 big-endian length | msgpack {"v", "id", "dst": [[off, len], ...], "total", "mac"} | raw bytes
    <- u32 length | msgpack {"id", "ok", "error"}

``mac`` (32 bytes) proves the sender holds the transfer's secret (``auth``); the receiver reads no byte
after a header it refuses: it acks the refusal and hangs up.

Frames are bounded (``MAX_HEADER``, ``MAX_ACK``); anything malformed raises
``ProtocolError``. ``Conn`` wraps a non-blocking socket: every wait is a ``poll``
bounded by a timeout that also wakes on the backend's close pipe (``Closing``).
Raw bytes move with ``recv_into`` / ``sendmsg`` over memoryview slices of at most
``CHUNK`` bytes, ``IOV_MAX`` iovecs per call, partial sends resumed.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import msgpack

from xpyd import PROTOCOL_VERSION
from xpyd.netaddr import host_port
from xpyd.transfer.auth import MAC_BYTES
from xpyd.transfer.base import Region, check_transfer_id

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
_LEN = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the connection is dropped."""


class Closing(Exception):
    """The backend is closing."""


class Unproven(ConnectionError):
    """The connection did not prove itself in time: its deadline passed before its opening frames came
    (``Conn.deadline``), or the listener closed it to make room for a newer one (``listener.Door``)."""


class Aborted(Exception):
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


format_address = host_port  # 'host:port' or '[v6]:port'


def pack_frame(obj: dict) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def pack_header(tid: str, dst: Sequence[Region], total: int, mac: bytes) -> bytes:
    """The frame that opens a transfer: where its ``total`` bytes land at the peer, and the sender's MAC."""
    pairs = [[r.offset, r.length] for r in dst]
    return pack_frame({"v": PROTOCOL_VERSION, "id": tid, "dst": pairs, "total": total, "mac": mac})


def pack_ack(tid: str, error: str | None) -> bytes:
    return pack_frame({"id": tid, "ok": error is None, "error": error})


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed transfer header; ``mac`` is None when the sender sent none."""

    transfer_id: str
    dst: tuple[Region, ...]
    total: int
    version: int
    mac: bytes | None


def parse_header(h: dict, buffer_size: int) -> Header:
    """Validate a transfer header. Raises ProtocolError."""
    tid, dst, total, ver, mac = h.get("id"), h.get("dst"), h.get("total"), h.get("v"), h.get("mac")
    if type(ver) is not int:
        raise ProtocolError("header without an int version")
    if mac is not None and (type(mac) is not bytes or len(mac) != MAC_BYTES):
        raise ProtocolError(f"header mac must be {MAC_BYTES} bytes")
    try:
        check_transfer_id(tid)
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    if type(total) is not int or not 0 < total <= buffer_size:
        raise ProtocolError(f"header total {total!r:.40} outside 1..{buffer_size}")
    if not isinstance(dst, list) or not dst:
        raise ProtocolError("header dst is not a non-empty list")
    regions = []
    for pair in dst:
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair)):
            raise ProtocolError("header dst entries must be [offset, length] ints")
        if pair[0] < 0 or pair[1] <= 0:
            raise ProtocolError(f"header dst region {pair} is invalid")
        regions.append(Region(pair[0], pair[1]))
    if sum(r.length for r in regions) != total:
        raise ProtocolError("header dst lengths do not add up to total")
    return Header(tid, tuple(regions), total, ver, mac)


def parse_ack(ack: dict | None, tid: str) -> str | None:
    """Validate the ack of transfer ``tid`` -> None if accepted, else the peer's error (capped)."""
    if ack is None:
        raise ConnectionError("peer closed the connection before acknowledging")
    if ack.get("id") != tid or type(ack.get("ok")) is not bool:
        raise ProtocolError(f"bad ack {ack!r:.200}")
    return None if ack["ok"] else str(ack.get("error"))[:MAX_ERROR_LEN]


def slices(buffer: memoryview, regions: Sequence[Region]) -> list[memoryview]:
    """Views of ``buffer`` covering ``regions`` in order, none longer than CHUNK."""
    out = []
    for r in regions:
        for off in range(r.offset, r.end, CHUNK):
            out.append(buffer[off : min(off + CHUNK, r.end)])
    return out


def drain(conn: Conn, n: int) -> None:
    """Read and discard ``n`` payload bytes (into scratch, never the pool)."""
    if n <= 0:
        return
    scratch = memoryview(bytearray(min(CHUNK, n)))
    for off in range(0, n, len(scratch)):
        conn.recv_into(scratch[: min(len(scratch), n - off)])


class Conn:
    """A non-blocking socket whose waits are bounded by a timeout and wake on backend close."""

    def __init__(self, sock: socket.socket, wake_fd: int, io_timeout: float) -> None:
        self.sock = sock
        self.io_timeout = io_timeout
        self.deadline: float | None = None  # (monotonic) every wait ends by then: ``Unproven``
        self._wake_fd = wake_fd
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._poll.register(wake_fd, select.POLLIN)

    def wait(self, events: int, timeout: float | None = None) -> None:
        """Wait until the socket is ready for ``events`` (or errored); raise on timeout/close."""
        self._poll.modify(self.sock, events)
        timeout = self.io_timeout if timeout is None else timeout
        left = None if self.deadline is None else self.deadline - time.monotonic()
        ready = self._poll.poll(1000 * (timeout if left is None else max(0.0, min(timeout, left))))
        if any(fd == self._wake_fd for fd, _ in ready):
            raise Closing()
        if not ready:
            if left is not None and left <= timeout:
                raise Unproven("its opening frames did not come in time")
            raise TimeoutError(f"no progress within {timeout:g}s")

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
                            raise Aborted(pos)
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
                            raise Aborted()
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
            raise ProtocolError(f"frame length {length} outside 1..{limit}")
        body = bytearray(length)
        self.recv_into(memoryview(body))
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises many types on garbage
            raise ProtocolError(f"undecodable frame: {e}") from None
        if not isinstance(obj, dict):
            raise ProtocolError(f"frame is a {type(obj).__name__}, not a map")
        return obj
