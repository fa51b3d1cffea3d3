"""An HTTP/1.1 answer as ``xpyd.proxy.h1client`` hands it over: its failures, headers, body and response.

``Response``: ``status``, ``headers`` (case-insensitive ``get``), ``content`` (a ``Body``: ``readany``, ``read``,
``iter_any``, ``set_exception``), ``read()``, ``release()`` (the connection goes back to the pool if its answer
was read to the end, else it is closed), ``close()``; an async context manager that releases. The connection
(``xpyd.proxy.h1_conn``) feeds the body as bytes arrive and is told when the caller is done with it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import Protocol


class Feeder(Protocol):
    """What a body needs of its connection."""

    loop: asyncio.AbstractEventLoop

    def watch(self) -> None: ...  # someone waits for bytes (the read timeout runs)
    def consumed(self) -> None: ...  # the buffered bytes were taken (reading may resume)
    def finish(self, reuse: bool) -> None: ...  # the caller is done with the answer


class ConnectionFailed(ConnectionError):
    """The call to the worker failed on the network."""


class ConnectFailed(ConnectionFailed):
    """No connection to the worker could be made."""


class Disconnected(ConnectionFailed):
    """The connection broke before the whole answer came."""

    def __init__(self, message: str, answered: bool, reused: bool) -> None:
        super().__init__(message)
        self.answered = answered  # its head had arrived (the worker took the request)
        self.reused = reused  # it was a pooled connection (the worker may have closed it as idle)


class BadResponse(ValueError):
    """Bytes that are not an HTTP/1.1 answer."""


class Headers(dict):
    """An answer's headers: lower-case names; ``get`` takes any case."""

    def get(self, name: str, default=None):
        return dict.get(self, name.lower(), default)


class Body:
    """An answer's body as it arrives: read it with ``readany``/``read``/``iter_any`` (one reader)."""

    __slots__ = ("_conn", "_chunks", "_size", "_eof", "_exc", "_waiter")

    def __init__(self, conn: Feeder) -> None:
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    @property
    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self._wake()

    def _feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """End the reading with ``exc`` (from another task too: a waiting read raises it)."""
        if self._exc is None:
            self._exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        self._conn.watch()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def readany(self) -> bytes:
        """The bytes that have arrived (waiting for some); b"" at the body's end."""
        while True:
            if self._exc is not None:
                raise self._exc
            if self._chunks:
                data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._size = 0
                self._conn.consumed()
                return data
            if self._eof:
                return b""
            await self._wait()

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (-1: all) of the body, waiting for them or its end."""
        parts: list[bytes] = []
        got = 0
        while n < 0 or got < n:
            data = await self.readany()
            if not data:
                break
            if 0 <= n < got + len(data):
                keep = n - got
                self._chunks.appendleft(data[keep:])
                self._size += len(data) - keep
                data = data[:keep]
            parts.append(data)
            got += len(data)
        return b"".join(parts)

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.readany():
            yield data


class Response:
    """A worker's answer (see the module's docstring)."""

    __slots__ = ("status", "headers", "content", "_conn", "_done")

    def __init__(self, status: int, headers: Headers, conn: Feeder) -> None:
        self.status = status
        self.headers = headers
        self.content = Body(conn)
        self._conn = conn
        self._done = False

    async def read(self) -> bytes:
        return await self.content.read()

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the answer was read to its end, else closes."""
        if not self._done:
            self._done = True
            self._conn.finish(reuse=self.content.at_eof)

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._conn.finish(reuse=False)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()
