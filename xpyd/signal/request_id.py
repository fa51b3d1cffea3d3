"""Request ids that carry the rendezvous addresses of both workers.

The proxy picks a prefill and a decode worker and builds one id for both. Each
worker uses it verbatim as the rendezvous key and reads its peer's signal-plane
address from it, so a worker that has never met that peer can connect on
demand. Format (strict)::

    xpyd-<32 lowercase hex>~p~<host>:<port>~d~<host>:<port>

``host`` is a DNS name, an IPv4 address, or a bracketed IPv6 address.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

_HOST = r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))"
_ADDR = rf"{_HOST}:[0-9]{{1,5}}"
_PATTERN = re.compile(rf"^xpyd-(?P<uid>[0-9a-f]{{32}})~p~(?P<p>{_ADDR})~d~(?P<d>{_ADDR})$")
MAX_LEN = 600


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
