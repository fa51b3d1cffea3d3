"""Typed, versioned signal-plane messages (msgpack maps; never pickle).

Decode workers (DEALER) send requests; the prefill worker (ROUTER) answers each
with exactly one reply carrying the same ``seq``.

- ``handshake``   -> ``handshake_reply``  (protocol version, model, KV layout must match)
- ``kv_map_init`` -> ``kv_map_reply``     (where the decode side's KV pool can be written)
- ``lookup_all``  -> ``lookup_reply``     (status of many requests; entries with a
  destination also start the KV send when the request is ready)
- ``release``     -> ``release_reply``    (decode no longer needs a request's KV)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import msgpack

from xpyd import PROTOCOL_VERSION
from xpyd.signal.request_id import MAX_LEN as MAX_REQUEST_ID_LEN

MAX_FRAME_BYTES = 1 << 20  # a signal-plane frame is small; anything bigger is refused
MAX_ENTRIES = 1024


class MessageError(ValueError):
    """A frame that is not a valid signal-plane message."""


class LookupStatus(str, Enum):
    UNKNOWN = "unknown"  # the prefill worker has not seen this request (yet)
    NOT_READY = "not_ready"  # queued or prefilling
    READY = "ready"  # prefilled; KV held; first token known
    SENDING = "sending"  # KV send started (answer to a lookup with destination)
    FAILED = "failed"  # prefill failed, aborted there, or the pull was refused; `error` says why
    EXPIRED = "expired"  # the KV was held past the prefill worker's kv_ttl without a pull, and freed


def _req(d: dict, key: str, typ: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise MessageError(f"missing field {key!r}")
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise MessageError(f"field {key!r} has the wrong type")
    return v


def _opt(d: dict, key: str, typ: type | tuple[type, ...]) -> Any:
    v = d.get(key)
    if v is not None and not isinstance(v, typ):
        raise MessageError(f"field {key!r} has the wrong type")
    return v


@dataclass(frozen=True, slots=True)
class Handshake:
    TYPE: ClassVar[str] = "handshake"
    sender: str  # the decode worker's own signal address (its identity)
    model_id: str
    kv_compat: dict  # KVLayout.compat() of the sender
    cluster_token: str | None = None

    def body(self) -> dict:
        return {"sender": self.sender, "model_id": self.model_id, "kv_compat": self.kv_compat,
                "cluster_token": self.cluster_token}

    @classmethod
    def from_body(cls, d: dict) -> "Handshake":
        return cls(_req(d, "sender", str), _req(d, "model_id", str), _req(d, "kv_compat", dict),
                   _opt(d, "cluster_token", str))


@dataclass(frozen=True, slots=True)
class HandshakeReply:
    TYPE: ClassVar[str] = "handshake_reply"
    ok: bool
    error: str | None = None
    model_id: str = ""

    def body(self) -> dict:
        return {"ok": self.ok, "error": self.error, "model_id": self.model_id}

    @classmethod
    def from_body(cls, d: dict) -> "HandshakeReply":
        return cls(_req(d, "ok", bool), _opt(d, "error", str), _opt(d, "model_id", str) or "")


@dataclass(frozen=True, slots=True)
class KVMapInit:
    TYPE: ClassVar[str] = "kv_map_init"
    sender: str
    transfer: dict  # BackendDescriptor.to_dict() of the decode worker's registered pool
    slot_bytes: int
    num_slots: int

    def body(self) -> dict:
        return {"sender": self.sender, "transfer": self.transfer, "slot_bytes": self.slot_bytes,
                "num_slots": self.num_slots}

    @classmethod
    def from_body(cls, d: dict) -> "KVMapInit":
        return cls(_req(d, "sender", str), _req(d, "transfer", dict), _req(d, "slot_bytes", int),
                   _req(d, "num_slots", int))


@dataclass(frozen=True, slots=True)
class KVMapReply:
    TYPE: ClassVar[str] = "kv_map_reply"
    ok: bool
    error: str | None = None

    def body(self) -> dict:
        return {"ok": self.ok, "error": self.error}

    @classmethod
    def from_body(cls, d: dict) -> "KVMapReply":
        return cls(_req(d, "ok", bool), _opt(d, "error", str))


@dataclass(frozen=True, slots=True)
class LookupEntry:
    request_id: str
    # Byte offset of the destination slot in the decode worker's pool (registered
    # with kv_map_init). None asks for the status only.
    dest_offset: int | None = None

    def to_list(self) -> list:
        return [self.request_id, self.dest_offset]

    @classmethod
    def from_list(cls, x: Any) -> "LookupEntry":
        if not isinstance(x, list) or len(x) != 2 or not isinstance(x[0], str):
            raise MessageError("bad lookup entry")
        if not 0 < len(x[0]) <= MAX_REQUEST_ID_LEN:
            raise MessageError(f"lookup entry request id not 1..{MAX_REQUEST_ID_LEN} characters")
        if x[1] is not None and (not isinstance(x[1], int) or isinstance(x[1], bool) or x[1] < 0):
            raise MessageError("bad lookup destination")
        return cls(x[0], x[1])


@dataclass(frozen=True, slots=True)
class LookupAll:
    TYPE: ClassVar[str] = "lookup_all"
    sender: str
    entries: tuple[LookupEntry, ...]

    def body(self) -> dict:
        return {"sender": self.sender, "entries": [e.to_list() for e in self.entries]}

    @classmethod
    def from_body(cls, d: dict) -> "LookupAll":
        raw = _req(d, "entries", list)
        if len(raw) > MAX_ENTRIES:
            raise MessageError(f"too many lookup entries (max {MAX_ENTRIES})")
        return cls(_req(d, "sender", str), tuple(LookupEntry.from_list(x) for x in raw))


@dataclass(frozen=True, slots=True)
class LookupResult:
    request_id: str
    status: LookupStatus
    first_token: int | None = None
    num_tokens: int = 0  # prompt tokens whose KV will be sent
    error: str | None = None

    def to_list(self) -> list:
        return [self.request_id, self.status.value, self.first_token, self.num_tokens, self.error]

    @classmethod
    def from_list(cls, x: Any) -> "LookupResult":
        try:
            rid, st, tok, n, err = x
            return cls(str(rid), LookupStatus(st), None if tok is None else int(tok), int(n),
                       None if err is None else str(err))
        except (TypeError, ValueError) as e:
            raise MessageError(f"bad lookup result: {e}") from e


@dataclass(frozen=True, slots=True)
class LookupReply:
    TYPE: ClassVar[str] = "lookup_reply"
    results: tuple[LookupResult, ...]

    def body(self) -> dict:
        return {"results": [r.to_list() for r in self.results]}

    @classmethod
    def from_body(cls, d: dict) -> "LookupReply":
        raw = _req(d, "results", list)
        if len(raw) > MAX_ENTRIES:
            raise MessageError("too many lookup results")
        return cls(tuple(LookupResult.from_list(x) for x in raw))


@dataclass(frozen=True, slots=True)
class Release:
    TYPE: ClassVar[str] = "release"
    sender: str
    request_ids: tuple[str, ...]

    def body(self) -> dict:
        return {"sender": self.sender, "request_ids": list(self.request_ids)}

    @classmethod
    def from_body(cls, d: dict) -> "Release":
        ids = _req(d, "request_ids", list)
        if len(ids) > MAX_ENTRIES or not all(isinstance(i, str) and 0 < len(i) <= MAX_REQUEST_ID_LEN for i in ids):
            raise MessageError("bad request_ids")
        return cls(_req(d, "sender", str), tuple(ids))


@dataclass(frozen=True, slots=True)
class ReleaseReply:
    TYPE: ClassVar[str] = "release_reply"
    released: int

    def body(self) -> dict:
        return {"released": self.released}

    @classmethod
    def from_body(cls, d: dict) -> "ReleaseReply":
        return cls(_req(d, "released", int))


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """Sent instead of a typed reply when a request frame cannot be served."""

    TYPE: ClassVar[str] = "error"
    error: str

    def body(self) -> dict:
        return {"error": self.error}

    @classmethod
    def from_body(cls, d: dict) -> "ErrorReply":
        return cls(str(_req(d, "error", str)))


Message = (Handshake | HandshakeReply | KVMapInit | KVMapReply | LookupAll | LookupReply | Release
           | ReleaseReply | ErrorReply)
_TYPES: dict[str, type] = {c.TYPE: c for c in (Handshake, HandshakeReply, KVMapInit, KVMapReply,
                                                LookupAll, LookupReply, Release, ReleaseReply,
                                                ErrorReply)}


@dataclass(frozen=True, slots=True)
class Envelope:
    seq: int
    msg: Any = field()


def encode(seq: int, msg: Message) -> bytes:
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "t": msg.TYPE, "seq": seq, "b": msg.body()},
                          use_bin_type=True)
    if len(frame) > MAX_FRAME_BYTES:
        raise MessageError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return frame


def decode(frame: bytes) -> Envelope:
    """Decode a frame; raise MessageError (never anything else) for bad input."""
    if len(frame) > MAX_FRAME_BYTES:
        raise MessageError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        d = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage/truncation
        raise MessageError(f"undecodable frame: {type(e).__name__}") from None
    if not isinstance(d, dict):
        raise MessageError("frame is not a map")
    v = d.get("v")
    if v != PROTOCOL_VERSION:
        raise MessageError(f"protocol version mismatch: peer speaks {v!r:.40}, this worker speaks {PROTOCOL_VERSION}")
    seq = d.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise MessageError("bad seq")
    t = d.get("t")
    cls = _TYPES.get(t) if isinstance(t, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {t!r:.80}")
    body = d.get("b")
    if not isinstance(body, dict):
        raise MessageError("message body is not a map")
    try:
        return Envelope(seq, cls.from_body(body))
    except MessageError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise MessageError(f"bad {cls.TYPE} body: {e}") from None
