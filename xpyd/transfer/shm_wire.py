"""Control messages of the shm transfer backend (the payload never crosses the socket).

Per connection (sender -> receiver, over TCP loopback, framed as in ``tcp_wire``: u32 length + msgpack)::

    Hello  {v, segment, size, host, board} -> Reply {ok, error}  the receiver maps the sender's segment
                                                                (``size`` bytes; its abort board at
                                                                offset ``board``, the pool before it)
    per transfer:
    Offer  {id, src, dst, board, mac}    -> Reply {ok, error,   the receiver checked ``mac`` (``auth``: the
                                                   bye}         sender holds the transfer's secret), copied
                                                                src -> dst, checked the board entry
                                                                ``board`` = [slot, ticket] and marked its
                                                                token DONE (or why not; ``bye``: it hangs up
                                                                after this reply)

The receiver maps the sender's segment at the first offer whose MAC checks out, not at the Hello: a
connection that never proved it holds a transfer's secret gets nothing mapped, and is hung up on at its
first refused offer (one that did keeps serving: a refusal there is a transfer the receiver aborted).
The receiver copies (it owns the destination memory, so its ``abort`` stops the copy, as with tcp); the
sender's abort board (``shm_board``) tells it whether the source was still valid for the whole copy.
Every frame is bounded (``MAX_FRAME``) and validated; anything malformed raises ``ProtocolError``.

The nixl backend uses Offer (without ``board``; with ``mac``), Reply and ``Commit {id, ok}``: it confirms by a
second round trip instead (``pull.commit_round_trip``). cuda_ipc uses Offer with ``board`` (its sender's
board is a small segment of its own) and ``ev``, the handle of an interprocess CUDA event recorded behind
the forward that wrote ``src``: the Offer goes out at once and the receiver waits on the device's progress.
"""

from __future__ import annotations

from dataclasses import dataclass

from xpyd.transfer import shm_board
from xpyd.transfer.auth import MAC_BYTES
from xpyd.transfer.base import Region, check_transfer_id
from xpyd.transfer.shm_segment import SegmentError, check_name
from xpyd.transfer.tcp_wire import ProtocolError, pack_frame

MAX_FRAME = 1 << 20
MAX_ERROR_LEN = 1000
MAX_EVENT = 128  # bytes of an Offer's event handle (cuda_ipc: a cudaIpcEventHandle, 64)


def _regions(pairs: object, limit: int, what: str) -> tuple[Region, ...]:
    if not isinstance(pairs, list) or not pairs:
        raise ProtocolError(f"{what} is not a non-empty list")
    out = []
    for p in pairs:
        if not (isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)):
            raise ProtocolError(f"{what} entries must be [offset, length] ints")
        if p[0] < 0 or p[1] <= 0 or p[0] + p[1] > limit:
            raise ProtocolError(f"{what} region {p} outside the {limit}-byte buffer")
        out.append(Region(p[0], p[1]))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    segment: str
    size: int  # bytes of the segment
    host: str
    board: int  # offset of the abort board in the segment; the pool lies before it

    def pack(self) -> bytes:
        return pack_frame({"t": "hello", "v": self.version, "segment": self.segment, "size": self.size,
                           "host": self.host, "board": self.board})

    @classmethod
    def parse(cls, d: dict) -> "Hello":
        if d.get("t") != "hello" or type(d.get("v")) is not int:
            raise ProtocolError("expected a hello frame with an int version")
        seg, size, host, board = d.get("segment"), d.get("size"), d.get("host"), d.get("board")
        try:
            check_name(seg)
        except SegmentError as e:
            raise ProtocolError(str(e)) from None
        if type(size) is not int or size <= 0 or not isinstance(host, str) or not 0 < len(host) <= 512:
            raise ProtocolError("hello size/host invalid")
        if type(board) is not int or board <= 0 or board % 8 or board + shm_board.BYTES > size:
            raise ProtocolError(f"hello board offset {board!r:.40} invalid for a {size}-byte segment")
        return cls(d["v"], seg, size, host, board)


@dataclass(frozen=True, slots=True)
class Offer:
    transfer_id: str
    src: tuple[Region, ...]
    dst: tuple[Region, ...]
    board: tuple[int, int] | None = None  # shm, cuda_ipc: (slot, ticket) of the sender's abort board entry
    mac: bytes | None = None  # auth.transfer_mac over the id, dst and src: None only from a stranger
    event: bytes | None = None  # cuda_ipc: the handle of the event behind the forward that wrote src

    def pack(self) -> bytes:
        d = {"t": "offer", "id": self.transfer_id, "src": [[r.offset, r.length] for r in self.src],
             "dst": [[r.offset, r.length] for r in self.dst]}
        if self.board is not None:
            d["board"] = list(self.board)
        if self.mac is not None:
            d["mac"] = self.mac
        if self.event is not None:
            d["ev"] = self.event
        return pack_frame(d)

    @classmethod
    def parse(cls, d: dict, src_size: int, dst_size: int) -> "Offer":
        if d.get("t") != "offer":
            raise ProtocolError(f"expected an offer frame, got {d.get('t')!r:.40}")
        try:
            tid = check_transfer_id(d.get("id"))
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        src, dst = _regions(d.get("src"), src_size, "offer src"), _regions(d.get("dst"), dst_size, "offer dst")
        if sum(r.length for r in src) != sum(r.length for r in dst):
            raise ProtocolError("offer src and dst lengths differ")
        board = d.get("board")
        if board is not None:
            if not (isinstance(board, list) and len(board) == 2 and all(type(x) is int for x in board)
                    and 0 <= board[0] < shm_board.SLOTS and 0 < board[1] <= shm_board.MAX_TICKET):
                raise ProtocolError(f"offer board entry must be [slot, ticket], got {board!r:.80}")
            board = (board[0], board[1])
        mac = d.get("mac")
        if mac is not None and (type(mac) is not bytes or len(mac) != MAC_BYTES):
            raise ProtocolError(f"offer mac must be {MAC_BYTES} bytes")
        event = d.get("ev")
        if event is not None and (type(event) is not bytes or not 0 < len(event) <= MAX_EVENT):
            raise ProtocolError(f"offer event handle must be 1..{MAX_EVENT} bytes")
        return cls(tid, src, dst, board, mac, event)


@dataclass(frozen=True, slots=True)
class Commit:
    transfer_id: str
    ok: bool

    def pack(self) -> bytes:
        return pack_frame({"t": "commit", "id": self.transfer_id, "ok": self.ok})

    @classmethod
    def parse(cls, d: dict, transfer_id: str) -> "Commit":
        if d.get("t") != "commit" or d.get("id") != transfer_id or type(d.get("ok")) is not bool:
            raise ProtocolError(f"expected the commit of {transfer_id!r}, got {d!r:.200}")
        return cls(transfer_id, d["ok"])


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer to hello / offer / commit: ok, or the error (capped); ``bye``: the receiver hangs up after it."""

    ok: bool
    error: str | None = None
    bye: bool = False

    def pack(self) -> bytes:
        return pack_frame({"t": "reply", "ok": self.ok, "error": None if self.error is None
                           else self.error[:MAX_ERROR_LEN], "bye": self.bye})

    @classmethod
    def parse(cls, d: dict | None) -> "Reply":
        if d is None:
            raise ConnectionError("peer closed the connection before replying")
        if d.get("t") != "reply" or type(d.get("ok")) is not bool or type(d.get("bye", False)) is not bool:
            raise ProtocolError(f"bad reply {d!r:.200}")
        err = d.get("error")
        return cls(d["ok"], None if d["ok"] else str(err)[:MAX_ERROR_LEN], d.get("bye", False))
