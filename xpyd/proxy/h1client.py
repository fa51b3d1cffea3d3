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
- ``Response``: ``status``, ``headers`` (case-insensitive ``get``), ``content`` (``readany``, ``read``,
  ``iter_any``, ``set_exception``), ``read()``, ``release()`` (the connection goes back to the pool if its answer
  was read to the end, else it is closed), ``close()``; an async context manager that releases.

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
from collections.abc import AsyncIterator, Mapping
from enum import Enum
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024  # bytes of an answer's status line and headers
PAUSE_AT = 1 << 20  # buffered body bytes at which reading from the socket pauses (resumes below RESUME_AT)
RESUME_AT = 1 << 18


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


class _Phase(Enum):
    IDLE = "idle"  # no request on it (in the pool, or between calls)
    HEAD = "head"  # a request sent, its answer's head awaited
    LENGTH = "length"  # reading a body of known length
    CHUNKED = "chunked"  # reading a chunked body
    UNTIL_CLOSE = "until_close"  # reading a body that ends with the connection
    DONE = "done"  # the answer read to its end


class Body:
    """An answer's body as it arrives: read it with ``readany``/``read``/``iter_any`` (one reader)."""

    __slots__ = ("_conn", "_chunks", "_size", "_eof", "_exc", "_waiter")

    def __init__(self, conn: _Connection) -> None:
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

    def __init__(self, status: int, headers: Headers, conn: _Connection) -> None:
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


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker: one request at a time."""

    def __init__(self, pool: H1Pool, key: tuple[str, int]) -> None:
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
            self._fail(Disconnected(f"the worker at {_hostport(self.key)} closed the connection before "
                                    f"{'the end of its answer' if answered else 'answering'}{why}",
                                    answered, self.reused))
        self.pool._lost(self)

    # --- the caller's side ----------------------------------------------------------------------------------------
    async def exchange(self, request: bytes, sent: asyncio.Event | None) -> Response:
        if self.closed:  # (the worker closed it as it left the pool)
            self.finish(reuse=False)
            raise Disconnected(f"the worker at {_hostport(self.key)} closed the connection before answering",
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
        self._fail(TimeoutError(f"no bytes from the worker at {_hostport(self.key)} for "
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


class H1Pool:
    """Keep-alive connections to workers for POSTs (see the module's docstring). ``headers`` go on every call."""

    def __init__(self, connect_timeout: float, read_timeout: float, limit: int = 0, keepalive: float = 3.0,
                 headers: Mapping[str, str] | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.limit = limit
        self.keepalive = keepalive
        self._fixed = _header_lines(headers or {})
        self._idle: dict[tuple[str, int], collections.deque[tuple[_Connection, float]]] = {}
        self._in_use: set[_Connection] = set()
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

    async def _acquire(self, key: tuple[str, int], fresh: bool) -> _Connection:
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

    def _pooled(self, key: tuple[str, int]) -> _Connection | None:
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

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), key[0], key[1])
        except TimeoutError:
            raise TimeoutError(f"connecting to {_hostport(key)} took over {self.connect_timeout:g} s") from None
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else type(e).__name__
            raise ConnectFailed(f"cannot connect to {_hostport(key)}: {why}") from e
        return conn

    def _done(self, conn: _Connection, reuse: bool) -> None:
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

    def _lost(self, conn: _Connection) -> None:
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


def _hostport(key: tuple[str, int]) -> str:
    return f"[{key[0]}]:{key[1]}" if ":" in key[0] else f"{key[0]}:{key[1]}"
