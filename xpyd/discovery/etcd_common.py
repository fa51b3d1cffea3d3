"""What the etcd registration, registry and ``xpyd status`` share: key layout, value check, client."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import aetcd

from xpyd import PROTOCOL_VERSION
from xpyd.discovery.types import WorkerInfo

log = logging.getLogger(__name__)

PREFIX = "/workers/"
OP_TIMEOUT = 2.0  # seconds, any single etcd call (also passed to gRPC as its deadline)
BACKOFF_MIN = 0.1
# What an unreachable, restarting or frozen etcd raises through aetcd (anything else is a bug).
EXPECTED_ERRORS = (aetcd.ClientError, asyncio.TimeoutError, OSError)
BACKOFF_MAX = 2.0

# gRPC channel: reconnect quickly after an etcd restart (the default backoff grows to 120 s),
# and notice a silently dead connection (partition) on a long-lived watch stream. etcd refuses
# pings more often than every 5 s (--grpc-keepalive-min-time).
CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.ping_timeout_ms": 5_000,  # without it an unanswered ping is not noticed for minutes
    "grpc.http2.max_pings_without_data": 0,
}


def worker_key(info: WorkerInfo, prefix: str = PREFIX) -> str:
    """``/workers/{role}/{ip}/{port}``, host and port taken from ``info.http_url``."""
    parts = urlsplit(info.http_url)
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"invalid http_url {info.http_url!r}: {e}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"http_url must be http://HOST:PORT, got {info.http_url!r}")
    return f"{prefix}{info.role.value}/{parts.hostname}/{port}"


def parse_worker(key: str, value: bytes, prefix: str = PREFIX, model_id: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo`` stored at ``key``; ValueError (with the reason) if it must be ignored."""
    try:
        info = WorkerInfo.from_json(value)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"not WorkerInfo JSON ({e})") from None
    if info.protocol_version != PROTOCOL_VERSION:
        raise ValueError(f"protocol version {info.protocol_version}, this xpyd speaks {PROTOCOL_VERSION}")
    if model_id is not None and info.model_id != model_id:
        raise ValueError(f"serves model {info.model_id!r}, expected {model_id!r}")
    expected = worker_key(info, prefix)
    if key != expected:
        raise ValueError(f"key does not match its value (expected {expected})")
    return info


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (an ``http://`` prefix is tolerated) -> (host, port)."""
    text = endpoint.split("://", 1)[-1].rstrip("/")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint must be HOST:PORT, got {endpoint!r}")
    return host, int(port)


def connect(endpoint: str) -> aetcd.Client:
    """A client for ``endpoint`` (no I/O yet: aetcd connects lazily on the first call)."""
    host, port = split_endpoint(endpoint)
    return aetcd.Client(host=host, port=port, timeout=OP_TIMEOUT, options=CHANNEL_OPTIONS)


async def close_client(client: aetcd.Client) -> None:
    try:
        await asyncio.wait_for(client.close(), OP_TIMEOUT)
    except Exception as e:  # noqa: BLE001 - closing a broken channel must not raise
        log.debug("closing etcd client: %r", e)


def describe_error(e: BaseException) -> str:
    """One line for a log or error message (TimeoutError has no text of its own)."""
    if isinstance(e, asyncio.TimeoutError):
        return f"no answer within {OP_TIMEOUT:g}s"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Backoff:
    """Delays for retries: BACKOFF_MIN, doubling up to ``cap``; ``reset()`` after a success."""

    def __init__(self, cap: float = BACKOFF_MAX) -> None:
        self._cap = max(BACKOFF_MIN, cap)
        self._delay = BACKOFF_MIN

    def peek(self) -> float:
        return self._delay

    def next(self) -> float:
        delay = self._delay
        self._delay = min(self._cap, delay * 2)
        return delay

    def reset(self) -> None:
        self._delay = BACKOFF_MIN

