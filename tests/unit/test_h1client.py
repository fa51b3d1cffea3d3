"""The proxy's lean HTTP/1.1 client (xpyd.proxy.h1client) against real sockets: a raw asyncio server that answers
with the exact bytes each test gives it (Content-Length, chunked in pieces split anywhere, until-close, malformed),
so every parsing path, reuse rule, limit and timeout is checked on the wire."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.waiting import until
from xpyd.proxy.h1client import BadResponse, ConnectFailed, Disconnected, H1Pool

JSON = b'{"ok": true}'
CLOSE = "close"


class RawServer:
    """Answers each request with the next of ``answers`` (bytes, written in the pieces given: a list; a tuple
    ``(bytes, CLOSE)``: then the connection closes), or closes the connection for ``None``; records each request's
    head and body and each connection."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.hold = asyncio.Event()
        self.hold.set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
                body = await reader.readexactly(int(fields.get(b"Content-Length", b"0")))
                self.requests.append((head, body))
                await self.hold.wait()
                answer = self.answers.pop(0)
                if answer is None:
                    return
                close = isinstance(answer, tuple)
                answer = answer[0] if close else answer
                for piece in (answer if isinstance(answer, list) else [answer]):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001)
                if close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


def ok(body: bytes = JSON, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        extra, len(body), body)


def chunked(*chunks: bytes) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    for c in chunks:
        out += b"%x\r\n%s\r\n" % (len(c), c)
    return out + b"0\r\n\r\n"


@pytest.fixture
async def serve():
    servers: list[RawServer] = []
    pools: list[H1Pool] = []

    async def start(*answers, **pool_args) -> tuple[RawServer, H1Pool, str]:
        server = RawServer(*answers)
        url = await server.start()
        pool = H1Pool(**{"connect_timeout": 5, "read_timeout": 5, **pool_args})
        servers.append(server)
        pools.append(pool)
        return server, pool, url

    yield start
    for pool in pools:
        await pool.close()
    for server in servers:
        await server.stop()


async def test_a_post_goes_out_whole_and_the_connection_is_reused(serve):
    server, pool, url = await serve(ok(), ok(b'{"n": 2}'), headers={"Authorization": "Bearer t"})
    sent = asyncio.Event()
    async with await pool.post(url, "/v1/completions", b'{"a": 1}', {"X-Request-Id": "r1"}, sent) as resp:
        assert sent.is_set() and resp.status == 200
        assert resp.headers.get("content-type") == resp.headers.get("Content-Type") == "application/json"
        assert json.loads(await resp.read()) == {"ok": True}
    async with await pool.post(url, "/v1/completions", b"{}", {"X-Request-Id": "r2"}) as resp:
        assert await resp.read() == b'{"n": 2}'
    assert server.connections == 1 and pool.idle() == 1 and pool.in_use == 0
    head, body = server.requests[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Authorization: Bearer t\r\n" in head and b"X-Request-Id: r1\r\n" in head and body == b'{"a": 1}'


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
async def test_a_chunked_stream_split_anywhere_reads_back_exactly(serve, split):
    events = [b'data: {"t": %d}\n\n' % i for i in range(20)]
    raw = chunked(*events)
    pieces = [raw[i:i + split] for i in range(0, len(raw), split)]
    server, pool, url = await serve(pieces, ok())
    resp = await pool.post(url, "/s", b"{}", {})
    got = b"".join([c async for c in resp.content.iter_any()])
    assert got == b"".join(events)
    resp.release()
    async with await pool.post(url, "/p", b"{}", {}) as again:  # (the stream ended cleanly: reused)
        assert await again.read() == JSON
    assert server.connections == 1


async def test_a_body_until_close_and_connection_close_are_never_reused(serve):
    server, pool, url = await serve((b"HTTP/1.1 200 OK\r\n\r\nall of it", CLOSE), ok(extra=b"Connection: close\r\n"), ok())
    async with await pool.post(url, "/a", b"", {}) as resp:
        assert await resp.read() == b"all of it"
    async with await pool.post(url, "/b", b"", {}) as resp:
        assert await resp.read() == JSON
    async with await pool.post(url, "/c", b"", {}) as resp:
        assert await resp.read() == JSON
    assert server.connections == 3


async def test_a_stream_left_unread_closes_its_connection(serve):
    server, pool, url = await serve([chunked(b"a" * 10)[:-5]], ok())  # (the stream never ends)
    resp = await pool.post(url, "/s", b"", {})
    assert await resp.content.readany() == b"a" * 10
    resp.release()  # (not at its end: closed, not pooled)
    assert pool.idle() == 0 and pool.in_use == 0
    async with await pool.post(url, "/p", b"", {}) as resp:
        assert await resp.read() == JSON
    assert server.connections == 2


async def test_read_with_a_limit_keeps_the_rest(serve):
    _, pool, url = await serve(ok(b"0123456789"))
    resp = await pool.post(url, "/p", b"", {})
    assert await resp.content.read(4) == b"0123"
    assert await resp.content.read() == b"456789"
    resp.release()


@pytest.mark.parametrize("answer, what", [
    (b"SPDY/9 200 OK\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n", "malformed header"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd", "line end"),
    (b"HTTP/1.1 100 Continue\r\n\r\n", "informational"),
])
async def test_what_is_not_http_is_a_bad_response(serve, answer, what):
    _, pool, url = await serve(answer)
    with pytest.raises(BadResponse, match=what):
        resp = await pool.post(url, "/p", b"", {})
        await resp.read()


async def test_a_head_over_the_limit_is_refused(serve):
    _, pool, url = await serve([b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000])
    with pytest.raises(BadResponse, match="head over"):
        await pool.post(url, "/p", b"", {})


async def test_a_cut_before_the_answer_and_in_the_middle_say_which(serve):
    server, pool, url = await serve(None, (chunked(b"abc")[:-5], CLOSE))
    with pytest.raises(Disconnected) as e:
        await pool.post(url, "/p", b"", {})
    assert not e.value.answered and not e.value.reused
    resp = await pool.post(url, "/s", b"", {})
    with pytest.raises(Disconnected) as e:
        await resp.read()
    assert e.value.answered


async def test_a_pooled_connection_the_worker_closed_is_not_used(serve):
    server, pool, url = await serve(ok(), None)
    async with await pool.post(url, "/p", b"", {}) as resp:
        await resp.read()
    await until(lambda: server.requests and len(server.answers) == 1, "answered")
    # The server's next answer closes the connection when a request arrives: the pooled one is cut unanswered.
    with pytest.raises(Disconnected) as e:
        await pool.post(url, "/p", b"", {})
    assert e.value.reused and not e.value.answered


async def test_nothing_listening_is_connect_failed(serve):
    server, pool, url = await serve()
    await server.stop()
    with pytest.raises(ConnectFailed, match="cannot connect to 127.0.0.1:.*: Connection refused"):
        await pool.post(url, "/p", b"", {})
    assert pool.in_use == 0
    server.server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # (for the fixture's stop)


async def test_no_bytes_within_the_read_timeout_is_a_timeout(serve):
    server, pool, url = await serve(ok(), read_timeout=0.3)
    server.hold.clear()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError, match="no bytes"):
        await pool.post(url, "/p", b"", {})
    assert 0.25 <= loop.time() - t0 < 3
    assert pool.in_use == 0 and pool.idle() == 0


async def test_at_most_limit_calls_hold_connections_the_rest_wait_in_order(serve):
    events = [chunked(b"x")] * 5
    server, pool, url = await serve(*events, limit=2)
    server.hold.clear()
    order: list[int] = []

    async def call(i: int) -> None:
        resp = await pool.post(url, "/s", b"", {"X-I": str(i)})
        async with resp:
            await resp.read()
        order.append(i)

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(call(i)))
        await asyncio.sleep(0.01)
    await until(lambda: len(server.requests) == 2, "two requests on the wire")
    await asyncio.sleep(0.05)
    assert len(server.requests) == 2 and pool.in_use == 2  # (the other three wait for a slot)
    server.hold.set()
    await asyncio.gather(*tasks)
    assert sorted(order) == [0, 1, 2, 3, 4] and server.connections == 2 and pool.in_use == 0


async def test_calls_waiting_for_a_slot_get_it_in_their_order(serve):
    server, pool, url = await serve(*[chunked(b"x")] * 4, limit=1)
    server.hold.clear()
    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(_call(pool, url, i)))
        await asyncio.sleep(0.01)
    server.hold.set()
    await asyncio.gather(*tasks)
    assert [h.split(b"X-I: ")[1][:1] for h, _ in server.requests] == [b"0", b"1", b"2", b"3"]


async def _call(pool: H1Pool, url: str, i: int) -> None:
    async with await pool.post(url, "/s", b"", {"X-I": str(i)}) as resp:
        await resp.read()


async def test_a_waiter_cancelled_gives_its_turn_on(serve):
    server, pool, url = await serve(chunked(b"x"), chunked(b"y"), limit=1)
    server.hold.clear()
    first = asyncio.create_task(pool.post(url, "/s", b"", {}))
    await until(lambda: pool.in_use == 1 and server.requests, "the first call on the wire")
    second = asyncio.create_task(pool.post(url, "/s", b"", {}))
    third = asyncio.create_task(pool.post(url, "/s", b"", {}))
    await asyncio.sleep(0.02)
    second.cancel()
    server.hold.set()
    resp = await first
    assert await resp.read() == b"x"
    resp.release()
    resp = await asyncio.wait_for(third, 5)
    assert await resp.read() == b"y"
    resp.release()
    assert pool.in_use == 0


async def test_a_caller_cancelled_while_waiting_for_the_answer_closes_the_connection(serve):
    server, pool, url = await serve(ok(), ok())
    server.hold.clear()
    call = asyncio.create_task(pool.post(url, "/p", b"", {}))
    await until(lambda: server.requests, "the request on the wire")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert pool.in_use == 0 and pool.idle() == 0
    server.hold.set()
    async with await pool.post(url, "/p", b"", {}) as resp:
        assert await resp.read() == JSON
    assert server.connections == 2


async def test_a_header_value_with_a_line_break_is_refused_before_sending(serve):
    server, pool, url = await serve(ok())
    with pytest.raises(ValueError, match="line break"):
        await pool.post(url, "/p", b"", {"X-Request-Id": "a\r\nX-Evil: 1"})
    assert not server.requests and pool.in_use == 0


async def test_set_exception_ends_a_waiting_read(serve):
    server, pool, url = await serve([chunked(b"a")[:-5]])
    resp = await pool.post(url, "/s", b"", {})
    assert await resp.content.readany() == b"a"
    reader = asyncio.create_task(resp.content.readany())
    await asyncio.sleep(0.01)
    resp.content.set_exception(RuntimeError("stop"))
    with pytest.raises(RuntimeError, match="stop"):
        await reader
    resp.close()
    assert pool.in_use == 0


class _Wire:
    """A transport that keeps what is written (for a test that must order events within one loop turn)."""

    def __init__(self) -> None:
        self.written, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


async def test_an_answer_arriving_after_its_caller_was_cancelled_closes_the_connection():
    """The caller is cancelled and, before its task runs again, the answer's head arrives: the connection is closed
    (never pooled), nothing raises in the transport's callback."""
    from xpyd.proxy.h1_conn import Connection

    pool = H1Pool(5, 5)
    conn = Connection(pool, ("127.0.0.1", 1))
    wire = _Wire()
    conn.connection_made(wire)
    pool._in_use.add(conn)
    pool._taken = 1
    call = asyncio.create_task(conn.exchange(b"POST / HTTP/1.1\r\n\r\n", None))
    await asyncio.sleep(0)
    assert wire.written and conn._head is not None
    call.cancel()  # (its future is cancelled now; the task runs later)
    conn.data_received(ok())  # (within the same turn: the answer came)
    assert wire.closed
    with pytest.raises(asyncio.CancelledError):
        await call
    assert pool.in_use == 0 and pool.idle() == 0


async def test_a_body_larger_than_the_buffer_limit_pauses_reading_and_arrives_whole(serve):
    """A body over PAUSE_AT (a prefill answer with many prompt logprobs) is buffered up to the limit, the socket's
    reading paused until the reader takes it, and every byte arrives in order."""
    from xpyd.proxy import h1client

    big = bytes(range(256)) * (3 * h1client.PAUSE_AT // 256 + 7)
    _, pool, url = await serve([ok(big)[i:i + 65536] for i in range(0, len(ok(big)), 65536)])
    resp = await pool.post(url, "/p", b"", {})
    await until(lambda: resp._conn._paused, "reading paused at the buffer limit")
    # (at most one socket read past the limit: asyncio's transports read up to 256 KiB at a time)
    assert h1client.PAUSE_AT < resp.content._size <= h1client.PAUSE_AT + 256 * 1024
    got = bytearray()
    while data := await resp.content.readany():
        got += data
        await asyncio.sleep(0)
    assert bytes(got) == big and not resp._conn._paused
    resp.release()
    assert pool.idle() == 1
