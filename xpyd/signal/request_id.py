"""Request ids that carry the rendezvous addresses of both workers.

The proxy picks a prefill and a decode worker and builds one id for both. Each
worker uses it verbatim as the rendezvous key and reads its peer's signal-plane
address from it, so a worker that has never met that peer can connect on
demand. Format (strict)::

    xpyd-<32 lowercase hex>~p~<host>:<port>~d~<host>:<port>

``host`` is a DNS name, an IPv4 address, or a bracketed IPv6 address.

With a cluster token the proxy signs each id it sends a worker: it appends ``~m~<64 lowercase hex>``, the
HMAC-SHA256 of the whole id under a key derived from the token (``ClusterKeys``). A worker checks the MAC
(constant time) when the request arrives and refuses an id without one or with a wrong one before it does
anything with it, so a decode worker only ever connects to a prefill worker the proxy named. The MAC is a
credential of the HTTP call only: the id the workers key the request by, send each other on the signal
plane and derive transfer ids from is the unsigned one (``str(RequestId)``). The workers' HTTP APIs take
another key derived from the token, as a bearer (``ClusterKeys.http_bearer``): the token itself never goes
over the wire, so reading HTTP traffic gives neither the signal plane's secret nor a way to sign an id.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from dataclasses import dataclass

_HOST = r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))"
_ADDR = rf"{_HOST}:[0-9]{{1,5}}"
_PATTERN = re.compile(rf"^xpyd-(?P<uid>[0-9a-f]{{32}})~p~(?P<p>{_ADDR})~d~(?P<d>{_ADDR})$")
MAX_LEN = 600
SIGNATURE_SEP = "~m~"
_MAC_HEX = 64  # HMAC-SHA256, hex
MAX_SIGNED_LEN = MAX_LEN + len(SIGNATURE_SEP) + _MAC_HEX
_SIGNED = re.compile(rf"^(?P<id>.+){SIGNATURE_SEP}(?P<mac>[0-9a-f]{{{_MAC_HEX}}})$", re.DOTALL)
_ID_KEY_LABEL = b"xpyd-request-id-key\0"
_HTTP_LABEL = b"xpyd-http-bearer\0"


class RequestIdError(ValueError):
    """The request id does not follow the xpyd format."""


@dataclass(frozen=True, slots=True)
class RequestId:
    uid: str
    prefill_addr: str  # host:port of the prefill worker's signal plane (ZMQ ROUTER)
    decode_addr: str  # host:port of the decode worker's signal plane

    def __str__(self) -> str:
        return f"xpyd-{self.uid}~p~{self.prefill_addr}~d~{self.decode_addr}"

    @classmethod
    def new(cls, prefill_addr: str, decode_addr: str) -> "RequestId":
        rid = cls(uuid.uuid4().hex, prefill_addr, decode_addr)
        return parse_request_id(str(rid))  # validates the addresses

    @property
    def short(self) -> str:
        return f"xpyd-{self.uid}"


def _check_port(addr: str) -> None:
    port = int(addr.rsplit(":", 1)[1])
    if not 1 <= port <= 65535:
        raise RequestIdError(f"port out of range in {addr!r}")


def check_signal_addr(addr: str) -> str:
    """``addr`` if it is a ``host:port`` a request id may name (as in the id: IPv6 bracketed); else RequestIdError."""
    if not isinstance(addr, str) or not re.fullmatch(_ADDR, addr):
        raise RequestIdError(f"not a host:port address: {addr!r}")
    _check_port(addr)
    return addr


def parse_request_id(text: str) -> RequestId:
    """Parse strictly; raise RequestIdError with a clear message otherwise."""
    if not isinstance(text, str) or not text:
        raise RequestIdError("missing request id")
    if len(text) > MAX_LEN:
        raise RequestIdError(f"request id longer than {MAX_LEN} characters")
    m = _PATTERN.fullmatch(text)
    if m is None:
        raise RequestIdError(
            "malformed request id: expected 'xpyd-<32 hex>~p~<host:port>~d~<host:port>', "
            f"got {text[:80]!r}"
        )
    _check_port(m["p"])
    _check_port(m["d"])
    return RequestId(m["uid"], m["p"], m["d"])


def transfer_id_of(request_id: str) -> str:
    """The short id a KV transfer is known by (``xpyd-<hex>``; fits the transfer header limit)."""
    return request_id.split("~", 1)[0]


def part_transfer_ids(request_id: str, parts: int) -> list[str]:
    """The transfer ids of a pull in ``parts`` parts: the short id itself for one part, else ``<id>.<i>``."""
    short = transfer_id_of(request_id)
    return [short] if parts == 1 else [f"{short}.{i}" for i in range(parts)]


def split_signature(text: str) -> tuple[RequestId, str | None]:
    """A request id as a worker receives it: the id (parsed strictly) and its MAC's hex, None when unsigned."""
    if not isinstance(text, str) or not text:
        raise RequestIdError("missing request id")
    if len(text) > MAX_SIGNED_LEN:
        raise RequestIdError(f"request id longer than {MAX_SIGNED_LEN} characters")
    m = _SIGNED.fullmatch(text)
    if m is None:
        return parse_request_id(text), None
    return parse_request_id(m["id"]), m["mac"]


class SignatureError(RequestIdError):
    """A request id without the proxy's MAC, or with a wrong one."""


class ClusterKeys:
    """The keys the proxy and the workers derive from the cluster token: one signs request ids, the other
    is the bearer the workers' HTTP APIs require (``Authorization: Bearer <http_bearer>``). ``accepted``:
    tokens whose signatures and bearers are accepted too (a rotation window), never used to sign."""

    __slots__ = ("_id_keys", "_bearers", "http_bearer")

    def __init__(self, cluster_token: str, accepted: tuple[str, ...] = ()) -> None:
        tokens = (cluster_token, *accepted)
        if not all(isinstance(t, str) and t for t in tokens):
            raise ValueError("the cluster token must be a non-empty string")
        raw = [t.encode("utf-8", "surrogatepass") for t in tokens]
        self._id_keys = tuple(hmac.new(t, _ID_KEY_LABEL, hashlib.sha256).digest() for t in raw)
        self._bearers = tuple(hmac.new(t, _HTTP_LABEL, hashlib.sha256).hexdigest().encode() for t in raw)
        self.http_bearer = self._bearers[0].decode()

    def __repr__(self) -> str:
        return "ClusterKeys(<hidden>)"

    @staticmethod
    def _mac(key: bytes, request_id: str) -> str:
        return hmac.new(key, request_id.encode(), hashlib.sha256).hexdigest()

    def sign(self, request_id: str) -> str:
        """``request_id`` (unsigned, as ``str(RequestId)``) with its MAC appended (the primary token's)."""
        return f"{request_id}{SIGNATURE_SEP}{self._mac(self._id_keys[0], request_id)}"

    def verify(self, text: str) -> RequestId:
        """The id of a signed ``text``: RequestIdError when it is malformed, SignatureError when it is unsigned or
        its MAC is none of the held tokens'."""
        rid, mac = split_signature(text)
        if mac is None:
            raise SignatureError("the request id is not signed (the proxy signs it with the cluster token)")
        if not _any_equal([self._mac(k, str(rid)).encode() for k in self._id_keys], mac.encode()):
            raise SignatureError("the request id's signature does not match (another cluster token?)")
        return rid

    def http_authorized(self, authorization: str | None) -> bool:
        """Does an ``Authorization`` header carry this cluster's bearer (or an accepted token's)? (constant-time
        compares)"""
        scheme, _, credential = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and _any_equal(self._bearers, credential.strip().encode())


def _any_equal(candidates, value: bytes) -> bool:
    """Is ``value`` one of ``candidates``? Each is compared in constant time, and all of them are."""
    return sum(hmac.compare_digest(c, value) for c in candidates) > 0
