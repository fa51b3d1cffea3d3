"""Opaque names of workers for the ``x-xpyd-workers`` response header (``xpyd proxy --expose-worker-names``).

A benchmark that wants goodput per worker must know which workers served each request, but nothing a client
reads may name a worker's address. With the option on, every completions/chat answer of a dispatched request
carries ``x-xpyd-workers: prefill=<name>, decode=<name>`` (``colocated=<name>`` in colocated mode), naming the
pair that answered (a request retried on another pair names the last). A name is the role's letter (``p``,
``d``, ``c``) and 8 hex digits of an HMAC-SHA256 of the worker's registry identity (its role and HTTP URL, what
``WorkerTable`` keys workers by). The HMAC's key comes from the cluster token when there is one (every proxy
holding it names a worker alike: replicas agree), else it is random per proxy (a name still stands
for its worker as long as the proxy runs, but cannot be recomputed from a guessed address by anyone; the
processes of ``xpyd proxy --workers N`` are given one by their parent). Two
workers whose 8 digits collide: the later one seen gets 16 (names never change once given). Off by default:
no header at all.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from xpyd.discovery.types import Role, WorkerInfo

__all__ = ["WORKERS_HEADER", "WorkerNames"]

WORKERS_HEADER = "x-xpyd-workers"
COLOCATED = "colocated"
_KEY_LABEL = b"xpyd worker names v1"
_LETTER = {Role.PREFILL.value: "p", Role.DECODE.value: "d", COLOCATED: "c"}
_DIGITS = 8


class WorkerNames:
    """Worker -> its opaque name, the same for the life of this object; distinct per worker."""

    __slots__ = ("_key", "_names", "_taken")

    def __init__(self, cluster_token: str | None = None, key: bytes | None = None) -> None:
        """``key``: without a cluster token, the HMAC's key (default: a random one)."""
        if cluster_token is not None and (not isinstance(cluster_token, str) or not cluster_token):
            raise ValueError("the cluster token must be a non-empty string")
        if key is not None and len(key) < 16:
            raise ValueError("a worker-names key must be at least 16 bytes")
        self._key = (hmac.new(cluster_token.encode("utf-8", "surrogatepass"), _KEY_LABEL, hashlib.sha256).digest()
                     if cluster_token is not None else key or os.urandom(32))
        self._names: dict[tuple[str, str], str] = {}  # (role, http_url) -> name
        self._taken: set[str] = set()

    def __repr__(self) -> str:
        return f"WorkerNames({len(self._names)} named)"

    def name(self, role: str, http_url: str) -> str:
        """The name of the ``role`` worker (prefill, decode, colocated) at ``http_url``."""
        if role not in _LETTER:
            raise ValueError(f"role must be one of {', '.join(_LETTER)}, got {role!r}")
        identity = (role, http_url)
        if (known := self._names.get(identity)) is not None:
            return known
        digest = hmac.new(self._key, f"{role}\n{http_url}".encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
        name = _LETTER[role] + digest[:_DIGITS]
        if name in self._taken:  # 32 bits collided (about 1 in 10^6 for 64 workers): a longer name
            name = _LETTER[role] + digest[:2 * _DIGITS]
        self._names[identity] = name
        self._taken.add(name)
        return name

    def of(self, worker: WorkerInfo) -> str:
        return self.name(worker.role.value, worker.http_url)

    def pair(self, prefill: WorkerInfo, decode: WorkerInfo | None) -> str:
        """The header's value for a P/D pair (a request prefill alone answered: its prefill worker)."""
        if decode is None:
            return f"prefill={self.of(prefill)}"
        return f"prefill={self.of(prefill)}, decode={self.of(decode)}"

    def colocated(self, http_url: str) -> str:
        """The header's value for the colocated worker at ``http_url``."""
        return f"{COLOCATED}={self.name(COLOCATED, http_url)}"
