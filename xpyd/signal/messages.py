"""Typed, versioned signal-plane messages: msgspec Structs sent as msgpack (never pickle).

Decode workers (DEALER) send requests; the prefill worker (ROUTER) answers each
with exactly one reply carrying the same ``seq``.

- ``hello``       -> ``challenge``        (what the decode worker is; the prefill worker's proof of the
  cluster token, ``xpyd.signal.auth``) or ``handshake_reply`` (refused: a token on one side only)
- ``proof``       -> ``auth_reply``       (the decode worker's proof; the session opens)
- ``handshake``   -> ``handshake_reply``  (model, KV layout must match)
- ``kv_map_init`` -> ``kv_map_reply``     (where the decode side's KV pool can be written)
- ``lookup_all``  -> ``lookup_reply``     (status of many requests. An entry without a destination
  *claims* the request: prefill keeps its KV for this decode worker and pushes a ``notify`` the
  moment the request is ready or ended. An entry with a destination starts the KV send; it carries
  the transfer's secret, which the decode worker made fresh when it expected the transfer and which
  the prefill worker's transfer backend proves it holds, so only this session's peer may write
  those blocks.)
- ``release``     -> ``release_reply``    (decode no longer needs a request's KV)
- ``heartbeat``   -> ``heartbeat_reply``  (both sides learn the other is alive; claimed KV of a decode
  worker that stops sending anything is freed)

Unsolicited, prefill -> decode, with ``seq`` 0: ``notify`` (results of claimed requests that became
ready, failed or expired; also the results of a lookup that do not fit in its reply's frame, sent just
before the reply: ``split_results``).

A frame is one msgpack map, ``{"version": PROTOCOL_VERSION, "seq": n, "msg": {"type": "lookup_all", ...}}``:
the messages are a union tagged by ``type``. Lookup entries and results are arrays (``[request_id,
dest_blocks, first_block, secret]``), the rest maps keyed by field name. Decoding checks types, required fields
and bounds.

KV moves in blocks (the paged pool): a pull names the decode worker's destination blocks for the
request's blocks from ``first_block`` on (the ones before it decode already holds: a cached prefix).
A ready result names the chain hashes of the prompt's full blocks (packed, ``pack_hashes``) and the
prompt's tokens after them (``tail``), so decode can find and extend the prefix in its own cache.
"""

from __future__ import annotations

import struct
import typing
from enum import Enum
from typing import Annotated, Any

import msgspec

from xpyd import PROTOCOL_VERSION, TRANSFER_SECRET_BYTES
from xpyd.signal.auth import NONCE_BYTES, PROOF_BYTES
from xpyd.signal.request_id import MAX_LEN as MAX_REQUEST_ID_LEN

MAX_FRAME_BYTES = 4 << 20  # a signal-plane frame is small; anything bigger is refused
MAX_ENTRIES = 1024
MAX_BLOCKS = 1 << 16  # KV blocks of one request (max_model_len / block_size)
MAX_TAIL = 1024  # tokens after a prompt's last full block (< block_size)
MAX_ADDRESS = 300  # a worker's signal address (host:port, [v6]:port)
FRAME_SLACK = 256  # bytes of a frame around its results (envelope, tags, array header): ``split_results``

RequestIdText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_LEN)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]
TransferSecret = Annotated[bytes, msgspec.Meta(min_length=TRANSFER_SECRET_BYTES, max_length=TRANSFER_SECRET_BYTES)]
Address = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADDRESS)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
ProofBytes = Annotated[bytes, msgspec.Meta(min_length=PROOF_BYTES, max_length=PROOF_BYTES)]
InstanceId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class MessageError(ValueError):
    """A frame that is not a valid signal-plane message."""


class LookupStatus(str, Enum):  # sent as its value
    UNKNOWN = "unknown"  # the prefill worker has not seen this request (yet)
    NOT_READY = "not_ready"  # queued (or prefilling, on a prefill worker that does not stream)
    PREFILLING = "prefilling"  # its prompt is being computed: prompt facts attached; a pull now gets each part
    # of the KV as soon as it is computed (the KV streams while the rest of the prompt computes)
    READY = "ready"  # prefilled; KV held; first token known
    SENDING = "sending"  # KV send started (answer to a lookup with destination)
    FAILED = "failed"  # prefill failed, aborted there, or the pull was refused; `error` says why
    EXPIRED = "expired"  # the KV was held past the prefill worker's kv_ttl without a pull, and freed


class _Message(msgspec.Struct, frozen=True, tag_field="type"):
    @property
    def TYPE(self) -> str:
        """The wire tag of this message (``"lookup_all"``...)."""
        return self.__struct_config__.tag


class Hello(_Message, frozen=True, tag="hello"):
    """Opens a connection's session (``xpyd.signal.auth``): what the decode worker is, and its nonce."""

    sender: Address  # the decode worker's signal address (request ids name it; prefill sends KV there)
    instance: InstanceId  # its process: a restarted worker on the same address is a new instance
    nonce: Nonce
    token: bool  # it proves a cluster token


class Challenge(_Message, frozen=True, tag="challenge"):
    nonce: Nonce
    proof: ProofBytes | None  # the prefill worker's proof of the cluster token; None: it has none


class Proof(_Message, frozen=True, tag="proof"):
    proof: ProofBytes | None  # the decode worker's proof; None: it has no cluster token


class AuthReply(_Message, frozen=True, tag="auth_reply"):
    ok: bool
    error: str | None = None


class Handshake(_Message, frozen=True, tag="handshake"):
    sender: str  # the decode worker's own signal address (the session's, from its hello)
    model_id: str
    kv_compat: dict[str, Any]  # KVLayout.compat() of the sender, compared whole


class HandshakeReply(_Message, frozen=True, tag="handshake_reply"):
    ok: bool
    error: str | None = None
    model_id: str = ""


class KVMapInit(_Message, frozen=True, tag="kv_map_init"):
    sender: str
    transfer: dict[str, Any]  # BackendDescriptor.to_dict() of the decode worker's registered pool
    block_bytes: Positive
    num_blocks: Positive


class KVMapReply(_Message, frozen=True, tag="kv_map_reply"):
    ok: bool
    error: str | None = None


class LookupEntry(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    request_id: RequestIdText
    # The decode worker's blocks (of the pool registered with kv_map_init) that receive the request's
    # blocks first_block, first_block + 1, ... (all the rest). None asks for the status only (a claim).
    dest_blocks: Annotated[tuple[NonNegative, ...], msgspec.Meta(min_length=1, max_length=MAX_BLOCKS)] | None = None
    first_block: NonNegative = 0
    # A pull's transfer secret (the decode worker expects the transfer with it); a claim has none.
    secret: TransferSecret | None = None
    # A pull's blocks go in parts of this many blocks (transfer ids "<id>.<i>"), each sent once computed;
    # 0: one transfer (id "<id>").
    part_blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)] = 0

    def __post_init__(self) -> None:
        if (self.dest_blocks is None) != (self.secret is None):
            raise ValueError("a pull (an entry with dest_blocks) carries a transfer secret, a claim none")


class LookupAll(_Message, frozen=True, tag="lookup_all"):
    sender: str
    entries: Annotated[tuple[LookupEntry, ...], msgspec.Meta(max_length=MAX_ENTRIES)]


class LookupResult(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    request_id: RequestIdText
    status: LookupStatus
    first_token: NonNegative | None = None
    num_tokens: NonNegative = 0  # prompt tokens whose KV will be sent
    error: str | None = None
    block_hashes: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_BLOCKS)] = b""  # the prompt's full blocks
    tail: Annotated[tuple[NonNegative, ...], msgspec.Meta(max_length=MAX_TAIL)] = ()  # prompt tokens after them
    cached_tokens: NonNegative = 0  # prompt tokens prefill found in its prefix cache (not computed)
    part_blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)] = 0  # prefilling: blocks a step computes
    steps: NonNegative = 0  # not ready or prefilling: forward passes the prefill worker has run so far (it grows:
    # progress)


class LookupReply(_Message, frozen=True, tag="lookup_reply"):
    results: Annotated[tuple[LookupResult, ...], msgspec.Meta(max_length=MAX_ENTRIES)]


class Release(_Message, frozen=True, tag="release"):
    sender: str
    request_ids: Annotated[tuple[RequestIdText, ...], msgspec.Meta(max_length=MAX_ENTRIES)]


class ReleaseReply(_Message, frozen=True, tag="release_reply"):
    released: NonNegative


class Heartbeat(_Message, frozen=True, tag="heartbeat"):
    sender: str


class HeartbeatReply(_Message, frozen=True, tag="heartbeat_reply"):
    pass


class Notify(_Message, frozen=True, tag="notify"):
    """Pushed by prefill (seq 0) to the decode worker that claimed these requests."""

    results: Annotated[tuple[LookupResult, ...], msgspec.Meta(max_length=MAX_ENTRIES)]


class ErrorReply(_Message, frozen=True, tag="error"):
    """Sent instead of a typed reply when a request frame cannot be served."""

    error: str


Message = (Hello | Challenge | Proof | AuthReply | Handshake | HandshakeReply | KVMapInit | KVMapReply | LookupAll | LookupReply | Release
           | ReleaseReply | Heartbeat | HeartbeatReply | Notify | ErrorReply)
_TAGS = frozenset(t.__struct_config__.tag for t in typing.get_args(Message))


class Envelope(msgspec.Struct, frozen=True):
    """One frame on the wire."""

    version: int
    seq: NonNegative
    msg: Message


class _Head(msgspec.Struct):
    """What can be read from a frame that is not a valid message (to say why, and to answer it)."""

    version: Any = None
    v: Any = None  # where protocol versions up to 3 put it
    seq: Any = None


# Garbage, truncated, trailing bytes (DecodeError); a string that is not UTF-8; nested too deep.
_UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
# Encoders and decoders are thread-safe (msgspec >= 0.16): the server thread and the engine share them.
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)
_head_decoder = msgspec.msgpack.Decoder(_Head)


class _Kind(msgspec.Struct):
    type: Any = None


class _KindHead(msgspec.Struct):
    msg: _Kind = msgspec.field(default_factory=_Kind)


_kind_decoder = msgspec.msgpack.Decoder(_KindHead)


def pack_hashes(hashes: list[int]) -> bytes:
    """Block hashes (64-bit) as the bytes a ready result carries."""
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hashes(data: bytes) -> list[int]:
    if len(data) % 8:
        raise MessageError(f"block hashes of {len(data)} bytes (not a multiple of 8)")
    return list(struct.unpack(f"<{len(data) // 8}Q", data))


def split_results(results: tuple[LookupResult, ...],
                  limit: int = MAX_FRAME_BYTES - FRAME_SLACK) -> list[tuple[LookupResult, ...]]:
    """``results`` in groups that each fit one frame (``limit`` bytes of results), in order; at least one
    group (maybe empty). Any legal set of results gets through this way: one result is at most ~530 KiB
    (MAX_BLOCKS hashes, MAX_TAIL tokens); one that is larger anyway (a huge error text) goes as FAILED
    with a short error instead."""
    groups: list[tuple[LookupResult, ...]] = []
    group: list[LookupResult] = []
    size = 0
    for r in results:
        n = len(_encoder.encode(r))
        if n > limit:
            r = LookupResult(r.request_id, LookupStatus.FAILED, error=f"its result ({n} bytes) exceeds a "
                             "signal frame")
            n = len(_encoder.encode(r))
        if group and size + n > limit:
            groups.append(tuple(group))
            group, size = [], 0
        group.append(r)
        size += n
    groups.append(tuple(group))
    return groups


def encode(seq: int, msg: Message) -> bytes:
    frame = _encoder.encode(Envelope(PROTOCOL_VERSION, seq, msg))
    if len(frame) > MAX_FRAME_BYTES:
        raise MessageError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return frame


def decode(frame: bytes) -> Envelope:
    """Decode a frame; raise MessageError (never anything else) for bad input."""
    if len(frame) > MAX_FRAME_BYTES:
        raise MessageError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        env = _decoder.decode(frame)
    except msgspec.ValidationError as e:
        head = _peek(frame)
        version = head.v if head.version is None else head.version
        if version is not None and version != PROTOCOL_VERSION:  # a peer of another version: say so
            raise _version_mismatch(version) from None
        raise MessageError(f"invalid message: {e}") from None
    except _UNDECODABLE as e:
        raise MessageError(f"undecodable frame: {e}") from None
    if env.version != PROTOCOL_VERSION:
        raise _version_mismatch(env.version)
    return env


def seq_of(frame: bytes) -> int:
    """Best effort: the seq of a frame that does not decode, so its refusal can be matched (else 0)."""
    seq = _peek(frame).seq
    return seq if type(seq) is int and seq >= 0 else 0


def kind_of(frame: bytes) -> str:
    """The wire tag of an encoded frame, for counting what was sent (``"invalid"`` if it has none)."""
    try:
        kind = _kind_decoder.decode(frame).msg.type
    except (*_UNDECODABLE, msgspec.ValidationError):
        return "invalid"
    return kind if type(kind) is str and kind in _TAGS else "invalid"


def _peek(frame: bytes) -> _Head:
    try:
        return _head_decoder.decode(frame)
    except _UNDECODABLE:
        return _Head()


def _version_mismatch(version: Any) -> MessageError:
    return MessageError(f"protocol version mismatch: peer speaks {version!r:.40}, "
                        f"this worker speaks {PROTOCOL_VERSION}")
