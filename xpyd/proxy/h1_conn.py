"""One keep-alive HTTP/1.1 connection to a worker (``xpyd.proxy.h1client``'s): one request at a time.

``exchange`` writes a request in one write and returns the answer (``xpyd.proxy.h1_body.Response``) once its
head is parsed; the body is parsed as it arrives (Content-Length, chunked, or until the connection closes: then
it is not reused) and fed to the response's ``Body``, reading paused past ``PAUSE_AT`` buffered bytes until the
reader takes them. Every wait for bytes is bounded by the pool's ``read_timeout`` since the last bytes came
(``TimeoutError``). Bytes nobody asked for, or that are not HTTP/1.1, close the connection (``BadResponse``).
"""

from __future__ import annotations

import asyncio
import time
from enum import Enum
from typing import Protocol

from xpyd.proxy.h1_body import BadResponse, Disconnected, Headers, Response

MAX_HEAD = 64 * 1024  # bytes of an answer's status line and headers
PAUSE_AT = 1 << 20  # buffered body bytes at which reading pauses (until the reader takes them)


class Owner(Protocol):
    """What a connection needs of its pool."""

    read_timeout: float

    def _done(self, conn: Connection, reuse: bool) -> None: ...
    def _lost(self, conn: Connection) -> None: ...


class _Phase(Enum):
    IDLE = "idle"  # no request on it (in the pool, or between calls)
    HEAD = "head"  # a request sent, its answer's head awaited
    LENGTH = "length"  # reading a body of known length
    CHUNKED = "chunked"  # reading a chunked body
    UNTIL_CLOSE = "until_close"  # reading a body that ends with the connection
    DONE = "done"  # the answer read to its end


class Connection(asyncio.Protocol):
    """One keep-alive connection to a worker: one request at a time."""

    def __init__(self, pool: Owner, key: tuple[str, int]) -> None:
        self.loop = asyncio.get_running_loop()
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.keep_alive = True
        self._phase = _Phase.IDLE
        self._buf = bytearray()
        self._head: asyncio.Future | None = None
        self._resp: Response | None = None
        self._left = 0  # LENGTH: body bytes to come; CHUNKED: bytes of the current chunk to come (-1: a size line)
        self._paused = False
        self._last = 0.0  # when bytes last came (or the request went out)
        self._timer: asyncio.TimerHandle | None = None

    # --- the transport's side -------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._last = time.monotonic()
        if self._phase is _Phase.IDLE or self._phase is _Phase.DONE:
            self.keep_alive = False  # bytes nobody asked for: this connection cannot be trusted again
            self.transport.close()
            return
        self._buf += data
        try:
            self._parse()
        except BadResponse as e:
            self._fail(e)
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # (close our side too)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self._phase is _Phase.UNTIL_CLOSE:
            self._complete()
        elif self._phase is not _Phase.IDLE and self._phase is not _Phase.DONE:
            answered = self._phase is not _Phase.HEAD
            why = f": {exc}" if exc is not None else ""
            self._fail(Disconnected(f"the worker at {hostport(self.key)} closed the connection before "
                                    f"{'the end of its answer' if answered else 'answering'}{why}",
                                    answered, self.reused))
        self.pool._lost(self)

    # --- the caller's side ----------------------------------------------------------------------------------------
    async def exchange(self, request: bytes, sent: asyncio.Event | None) -> Response:
        if self.closed:  # (the worker closed it as it left the pool)
            self.finish(reuse=False)
            raise Disconnected(f"the worker at {hostport(self.key)} closed the connection before answering",
                               False, self.reused)
        self._phase = _Phase.HEAD
        self._head = self.loop.create_future()
        self._last = time.monotonic()
        self.transport.write(request)
        if sent is not None:
            sent.set()
        self.watch()
        try:
            return await self._head
        except BaseException:
            self.finish(reuse=False)  # (cancelled or failed halfway: the connection is in an unknown state)
            raise
        finally:
            self._head = None

    def finish(self, reuse: bool) -> None:
        """The caller is done with this connection (once per request)."""
        self._resp = None
        ok = (reuse and self._phase is _Phase.DONE and self.keep_alive and not self.closed and not self._buf)
        self._phase = _Phase.IDLE
        if not ok:
            self.keep_alive = False
            if self.transport is not None:
                self.transport.close()
        self.pool._done(self, ok)

    def consumed(self) -> None:
        """The reader took the buffered body bytes: reading from the socket goes on if it was paused."""
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def watch(self) -> None:
        """Someone waits for bytes: time it out ``read_timeout`` after the last bytes came."""
        if self._timer is None and not self.closed:
            self._timer = self.loop.call_later(self.pool.read_timeout, self._check_timeout)

    def _check_timeout(self) -> None:
        self._timer = None
        if self._phase is _Phase.IDLE or self._phase is _Phase.DONE:
            return
        waiting = self._head is not None or (self._resp is not None and self._resp.content._waiter is not None)
        if not waiting:
            return
        idle = time.monotonic() - self._last
        if idle < self.pool.read_timeout:
            self._timer = self.loop.call_later(self.pool.read_timeout - idle, self._check_timeout)
            return
        self._fail(TimeoutError(f"no bytes from the worker at {hostport(self.key)} for "
                                f"{self.pool.read_timeout:g} s"))
        self.keep_alive = False
        self.transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, exc: BaseException) -> None:
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
        elif self._resp is not None:
            self._resp.content.set_exception(exc)
        self.keep_alive = False

    # --- parsing --------------------------------------------------------------------------------------------------
    def _parse(self) -> None:
        if self._phase is _Phase.HEAD:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD:
                    raise BadResponse(f"an answer's head over {MAX_HEAD} bytes")
                return
            head = bytes(self._buf[:end])
            del self._buf[:end + 4]
            self._start(head)
        if self._phase is _Phase.LENGTH:
            if self._buf:
                take = min(self._left, len(self._buf))
                self._body(bytes(self._buf[:take]))
                del self._buf[:take]
                self._left -= take
            if self._left == 0:
                self._complete()
        elif self._phase is _Phase.CHUNKED:
            self._chunks()
        elif self._phase is _Phase.UNTIL_CLOSE and self._buf:
            self._body(bytes(self._buf))
            self._buf.clear()

    def _start(self, head: bytes) -> None:
        if self._head is None or self._head.done():  # (its caller was cancelled as the answer came)
            raise BadResponse("an answer nobody waits for")
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
            raise BadResponse(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        status = int(code)
        if status < 200:
            raise BadResponse(f"an informational answer ({status}) to a request that asked for none")
        headers = Headers()
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise BadResponse(f"a malformed header line: {line[:80]!r}")
            headers[name.decode("latin-1").lower()] = value.strip().decode("latin-1")
        connection = headers.get("connection", "").lower()
        self.keep_alive = ("close" not in connection) if version == b"HTTP/1.1" else ("keep-alive" in connection)
        self._resp = Response(status, headers, self)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._phase, self._left = _Phase.CHUNKED, -1
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise BadResponse(f"Content-Length {length[:40]!r}")
            self._phase, self._left = _Phase.LENGTH, int(length)
        elif status in (204, 304):
            self._phase, self._left = _Phase.LENGTH, 0
        else:
            self._phase = _Phase.UNTIL_CLOSE
            self.keep_alive = False
        self._head.set_result(self._resp)

    def _chunks(self) -> None:
        """Every whole chunk buffered, fed to the body at once (one wake-up)."""
        buf, pos, out = self._buf, 0, []
        while True:
            if self._left < 0:  # a size line
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if len(buf) - pos > 1024:
                        raise BadResponse("a chunk size line over 1 KiB")
                    break
                size_text = bytes(buf[pos:end]).split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise BadResponse(f"a chunk size {size_text[:20]!r}") from None
                if size < 0:
                    raise BadResponse("a negative chunk size")
                if size == 0:  # the last chunk: no trailers expected, then the blank line
                    close = buf.find(b"\r\n\r\n", end)
                    if close < 0:
                        if len(buf) - end > MAX_HEAD:
                            raise BadResponse(f"trailers over {MAX_HEAD} bytes")
                        break
                    pos = close + 4
                    del buf[:pos]
                    if out:
                        self._body(b"".join(out))
                    self._complete()
                    return
                pos, self._left = end + 2, size
            if len(buf) - pos < self._left + 2:  # (a chunk's data and its line end)
                if len(buf) - pos > 0 and self._left > 0:  # a part of a large chunk: pass it on now
                    take = min(self._left, len(buf) - pos)
                    out.append(bytes(buf[pos:pos + take]))
                    pos += take
                    self._left -= take
                break
            if self._left:
                out.append(bytes(buf[pos:pos + self._left]))
            if buf[pos + self._left:pos + self._left + 2] != b"\r\n":
                raise BadResponse("a chunk not followed by a line end")
            pos += self._left + 2
            self._left = -1
        del buf[:pos]
        if out:
            self._body(b"".join(out))

    def _body(self, data: bytes) -> None:
        if not data:
            return
        body = self._resp.content
        body._feed(data)
        if body._size > PAUSE_AT and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def _complete(self) -> None:
        self._phase = _Phase.DONE
        self._cancel_timer()
        if self._resp is not None:
            self._resp.content._feed_eof()


def hostport(key: tuple[str, int]) -> str:
    return f"[{key[0]}]:{key[1]}" if ":" in key[0] else f"{key[0]}:{key[1]}"
