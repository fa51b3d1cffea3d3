"""A third party at a worker's KV transfer listener: the frames it can send, and what it gets back.

Everything here speaks to a listener's real address (a ``host:port`` string), so the same knocks run on
loopback (tests/integration/test_transfer_door.py) and across a network boundary between two hosts of
the multi-host test bed. ``tcp_header`` and ``offer`` build the frame that opens a transfer as the
sender that holds (or does not hold) the transfer's secret and the cluster token would; ``knock_tcp``
and ``knock_pull`` (shm, nixl: a Hello, then an offer) send one and report the listener's answer and
whether it hung up right after.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from xpyd import PROTOCOL_VERSION
from xpyd.transfer import auth
from xpyd.transfer.base import Region
from xpyd.transfer.shm_wire import Hello, Offer
from xpyd.transfer.tcp_wire import pack_frame, parse_address

NO_MAC = object()  # ``mac=NO_MAC``: a frame without one


def regions(pairs: Sequence[Sequence[int]]) -> tuple[Region, ...]:
    return tuple(Region(o, n) for o, n in pairs)


def mac_for(backend: str, tid: str, dst: Sequence[Region], secret: bytes, token: str | None,
            src: Sequence[Region] = ()) -> bytes:
    """The MAC a sender holding ``secret`` and cluster ``token`` puts on the frame that opens ``tid``."""
    return auth.transfer_mac(auth.transfer_key(secret, token), backend, tid, dst, src)


def tcp_header(tid: str, dst: Sequence[Region], mac: object) -> bytes:
    """A tcp transfer header for ``dst`` carrying ``mac`` (bytes, or ``NO_MAC``)."""
    h = {"v": PROTOCOL_VERSION, "id": tid, "dst": [[r.offset, r.length] for r in dst],
         "total": sum(r.length for r in dst)}
    if mac is not NO_MAC:
        h["mac"] = mac
    return pack_frame(h)


def offer(tid: str, src: Sequence[Region], dst: Sequence[Region], mac: object,
          board: tuple[int, int] | None = (0, 1)) -> bytes:
    """A pull backend's offer (``board``: shm's abort board entry; None for nixl) carrying ``mac``."""
    return Offer(tid, tuple(src), tuple(dst), board, None if mac is NO_MAC else mac).pack()


def shm_hello(segment: str, size: int, host_key: str, board: int) -> bytes:
    return Hello(PROTOCOL_VERSION, segment, size, host_key, board).pack()


@dataclass
class Answer:
    replies: list[dict]  # the listener's frames, in order
    hung_up: bool  # it closed the connection after them


def knock_tcp(address: str, header: bytes, payload: bytes, timeout: float = 5.0) -> Answer:
    """Open a connection to a tcp transfer listener, push ``header`` and ``payload``; its ack."""
    with connect(address, timeout) as sock:
        try:
            sock.sendall(header + payload)
        except OSError:  # it may hang up before taking the payload; its ack is still readable
            pass
        ack = read_frame(sock)
        return Answer([] if ack is None else [ack], _hung_up(sock))


def knock_pull(address: str, hello: bytes, offer: bytes, timeout: float = 5.0, linger: float | None = None) -> Answer:
    """Say ``hello`` to a pull backend's listener (shm, nixl), then make ``offer``; its two replies. ``linger``:
    how long to wait for it to hang up after them (default ``timeout``; a listener that keeps the connection
    open costs all of it: a caller that does not read ``hung_up`` may pass less)."""
    with connect(address, timeout) as sock:
        sock.sendall(hello)
        replies = [r for r in [read_frame(sock)] if r is not None]
        if replies and replies[0].get("ok"):
            try:
                sock.sendall(offer)
            except OSError:
                pass
            reply = read_frame(sock)
            if reply is not None:
                replies.append(reply)
        if linger is not None:
            sock.settimeout(linger)
        return Answer(replies, _hung_up(sock))


def connect(address: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(parse_address(address), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_frame(sock: socket.socket) -> dict | None:
    """One length-prefixed msgpack frame from a transfer listener, or None if it hung up first."""
    head = _read_exact(sock, 4)
    if head is None:
        return None
    body = _read_exact(sock, struct.unpack(">I", head)[0])
    return None if body is None else msgpack.unpackb(body, raw=False)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


def _hung_up(sock: socket.socket) -> bool:
    """True once the peer closed (EOF or reset); False if it still waits for more (a timeout here)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
