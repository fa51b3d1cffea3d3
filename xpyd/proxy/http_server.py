"""The proxy's HTTP server: aiohttp.web on a socket bound beforehand, until a stop event.

aiohttp's server parses HTTP in C and runs a handler as one task per request; that task is cancelled when
the client goes away (``handler_cancellation``), so a request's calls to its workers are dropped at once,
whether the client waited for a JSON body or read a stream. A streamed answer is a ``StreamedResponse``:
its body, an async iterator of bytes, is written after the status line and the headers, inside the same
task (a middleware can still add headers to it), and closed however it ends.

A server's life::

    serve(): runner set up (on_startup: the app's sessions and pollers) -> listening on the socket
    stop set -> the socket closes (new connections are refused) -> idle connections close
             -> requests in flight get ``graceful_timeout`` seconds to end, then are cancelled
             -> on_cleanup (sessions closed) -> serve() returns
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

from aiohttp import web

KEEP_ALIVE_SECONDS = 75.0  # an idle client connection is kept this long (longer than clients' own pools keep one)
BACKLOG = 1024  # connections the kernel queues before the loop accepts them (a burst of 1,000 clients)


class LastChunk(bytes):
    """A body's last chunk: written together with the end of the chunked body (one send, not two)."""


class StreamedResponse(web.StreamResponse):
    """A response whose body is written from ``body`` as it yields (chunked: its length is not known); a
    ``LastChunk`` ends it (the body is closed then, its ``finally`` run after the client has the end)."""

    def __init__(self, body: AsyncIterator[bytes], *, status: int = 200, content_type: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status=status, headers=headers)
        self.content_type = content_type
        self._body_iter = body

    async def write_eof(self, data: bytes = b"") -> None:
        body = self._body_iter
        try:
            async for chunk in body:
                if isinstance(chunk, LastChunk):
                    data = bytes(chunk)
                    break
                await self.write(chunk)
            await super().write_eof(data)
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()


async def serve(app: web.Application, stop: asyncio.Event, sock: socket.socket,
                graceful_timeout: float = 5.0) -> None:
    """Serve ``app`` on ``sock`` (bound, not yet listening: ``netaddr.reserve_tcp``) until ``stop`` is set;
    ``sock`` is closed when this returns."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=KEEP_ALIVE_SECONDS,
                           shutdown_timeout=graceful_timeout)
    try:
        await runner.setup()
        site = web.SockSite(runner, sock, backlog=BACKLOG)
        await site.start()
        await stop.wait()
    finally:
        try:
            await runner.cleanup()
        finally:
            sock.close()


async def read_body(request: web.Request) -> bytes:
    """The request's body, at most the app's ``client_max_size`` bytes: a larger one is a 413, refused by its
    Content-Length before it is read, or once it grows past the limit (chunked)."""
    length = request.content_length
    if length is not None and length > request.client_max_size:
        raise web.HTTPRequestEntityTooLarge(max_size=request.client_max_size, actual_size=length)
    return await request.read()
