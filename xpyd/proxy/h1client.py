"""A lean HTTP/1.1 client for the proxy's hot calls to its workers: prefill POSTs and decode streams.

Each client request costs the proxy two calls to workers, and with instant workers aiohttp's client machinery
(request and response objects, URL handling, timers, tracing, a write for the headers and one for the body) was
the largest share of the proxy's CPU after its own HTTP server. The calls here are always the same shape (a POST
of a small JSON body to a worker we know, answered with JSON or a chunked SSE stream), so this client does only
that, on asyncio's transports:

- ``H1Pool``: keep-alive connections per worker (LIFO, so the warm ones are reused and the rest age out after
  ``keepalive`` seconds, below the workers' own idle timeout), at most ``limit`` of them in use at once (0: no
  limit; a call waits for a free one in order of arrival); connects bounded by ``connect_timeout``.
- A request goes out in one write (head and body together); the answer's head and body are parsed as they
  arrive (Content-Length, chunked, or until the connection closes); every wait for bytes is bounded by
  ``read_timeout`` since the last bytes (``TimeoutError``).
- ``Response`` (``xpyd.proxy.h1_body``): status, headers, the body as it arrives; released back to the pool.
- The connection and its parsing: ``xpyd.proxy.h1_conn``.

Failures: ``ConnectFailed`` (no connection: the worker is unreachable), ``Disconnected`` (the connection broke
before the whole answer; ``answered`` says whether its head had arrived, ``reused`` whether it was a pooled
one), both ``ConnectionFailed``; ``BadResponse`` (a ValueError) for bytes that are not an HTTP/1.1 answer or a
head over 64 KiB; ``TimeoutError``. Header values with a line break are refused (ValueError) before anything
is sent. No cookies, redirects, compression or proxies: a worker sends none of them.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from xpyd.proxy.h1_body import BadResponse, ConnectFailed, ConnectionFailed, Disconnected, Response
from xpyd.proxy.h1_conn import MAX_HEAD, PAUSE_AT, Connection, hostport

__all__ = ["BadResponse", "ConnectFailed", "ConnectionFailed", "Disconnected", "H1Pool", "MAX_HEAD", "PAUSE_AT",
           "Response"]


class H1Pool:
    """Keep-alive connections to workers for POSTs (see the module's docstring). ``headers`` go on every call."""

    def __init__(self, connect_timeout: float, read_timeout: float, limit: int = 0, keepalive: float = 3.0,
                 headers: Mapping[str, str] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.limit = limit
        self.keepalive = keepalive
        self._fixed = _header_lines(headers or {})
        self._idle: dict[tuple[str, int], collections.deque[tuple[Connection, float]]] = {}
        self._in_use: set[Connection] = set()
        self._taken = 0  # slots taken: connections in use or being made (at most ``limit``)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._targets: dict[str, tuple[tuple[str, int], str]] = {}
        self._closed = False

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    def idle(self) -> int:
        return sum(len(d) for d in self._idle.values())

    async def post(self, base_url: str, path: str, body: bytes, headers: Mapping[str, str],
                   sent: asyncio.Event | None = None, fresh: bool = False) -> Response:
        """POST ``body`` to ``base_url + path`` (``fresh``: on a new connection); its answer once its head came."""
        return await self.request("POST", base_url, path, body, headers, sent, fresh)

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None, sent: asyncio.Event | None = None,
                      fresh: bool = False) -> Response:
        key, host = self._target(base_url)
        head = (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n{self._fixed}"
                f"{_header_lines(headers) if headers else ''}\r\n")
        conn = await self._acquire(key, fresh)
        return await conn.exchange(head.encode("latin-1") + body, sent)

    def _target(self, base_url: str) -> tuple[tuple[str, int], str]:
        target = self._targets.get(base_url)
        if target is None:
            url = urlsplit(base_url)
            if url.scheme != "http" or url.hostname is None:
                raise ValueError(f"not an http:// worker address: {base_url!r}")
            target = (url.hostname, url.port or 80), url.netloc
            self._targets[base_url] = target
        return target

    async def _acquire(self, key: tuple[str, int], fresh: bool) -> Connection:
        if self._closed:
            raise ConnectFailed("the pool is closed")
        if self.limit and (self._taken >= self.limit or self._waiters):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter  # (resolved: a slot handed over by ``_free``)
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._free()  # (its slot passes on)
                else:
                    self._waiters.remove(waiter)
                raise
        else:
            self._taken += 1
        try:
            conn = self._pooled(key) if not fresh else None
            if conn is None:
                conn = await self._connect(key)
        except BaseException:
            self._free()
            raise
        self._in_use.add(conn)
        return conn

    def _pooled(self, key: tuple[str, int]) -> Connection | None:
        """The most recently used idle connection to ``key`` still open and young enough (None: none)."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn, since = idle.pop()
            if conn.closed or now - since > self.keepalive:
                conn.transport.close()
                continue
            conn.reused = True
            return conn
        return None

    async def _connect(self, key: tuple[str, int]) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: Connection(self, key), key[0], key[1])
        except TimeoutError:
            raise TimeoutError(f"connecting to {hostport(key)} took over {self.connect_timeout:g} s") from None
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else type(e).__name__
            raise ConnectFailed(f"cannot connect to {hostport(key)}: {why}") from e
        return conn

    def _done(self, conn: Connection, reuse: bool) -> None:
        if conn not in self._in_use:
            return
        self._in_use.discard(conn)
        if reuse and not self._closed:
            now = time.monotonic()
            idle = self._idle.setdefault(conn.key, collections.deque())
            while idle and (idle[0][0].closed or now - idle[0][1] > self.keepalive):  # (the oldest first)
                idle.popleft()[0].transport.close()
            idle.append((conn, now))
        self._free()

    def _lost(self, conn: Connection) -> None:
        idle = self._idle.get(conn.key)
        if idle:
            for i, (c, _) in enumerate(idle):
                if c is conn:
                    del idle[i]
                    break

    def _free(self) -> None:
        """A slot is free: handed to the first call still waiting, else given back."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._taken -= 1

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn, _ in idle:
                conn.transport.close()
        self._idle.clear()
        for conn in list(self._in_use):
            conn.transport.close()
        await asyncio.sleep(0)  # (the transports' connection_lost)


def _header_lines(headers: Mapping[str, str]) -> str:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if lines.count("\n") != len(headers) or "\r" in lines.replace("\r\n", ""):
        raise ValueError("a header name or value with a line break")
    return lines
