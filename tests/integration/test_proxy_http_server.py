"""The proxy's HTTP server (``xpyd.proxy.http_server``) on a real port: a streamed body and its last chunk, a
client that leaves mid-stream, a stop with a request in flight, a body over the limit; and the event loop
``xpyd proxy --event-loop`` picks."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.cluster import free_port
from xpyd.netaddr import reserve_tcp
from xpyd.proxy.http_server import LastChunk, StreamedResponse, read_body, serve
from xpyd.proxy.main import loop_factory


class Server:
    def __init__(self, app: web.Application) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(serve(app, self.stop, reserve_tcp("127.0.0.1", self.port),
                                              graceful_timeout=5))

    async def ready(self, http: aiohttp.ClientSession) -> None:
        for _ in range(500):
            try:
                async with http.get(self.url + "/nothing"):
                    return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.01)
        raise AssertionError("the server did not start")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


async def test_last_chunk_ends_the_body_and_the_body_is_closed_after(http):
    closed = asyncio.Event()
    after_last = []

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"one,"
            yield LastChunk(b"two")
            after_last.append(True)  # never reached: the body ends with its last chunk
            yield b"three"
        finally:
            closed.set()

    async def handler(_r: web.Request) -> web.StreamResponse:
        return StreamedResponse(body(), content_type="text/event-stream", headers={"X-Test": "1"})

    app = web.Application()
    app.router.add_get("/s", handler)
    server = Server(app)
    await server.ready(http)
    async with http.get(server.url + "/s") as r:
        assert r.status == 200 and r.content_type == "text/event-stream" and r.headers["X-Test"] == "1"
        assert await r.read() == b"one,two"
    await asyncio.wait_for(closed.wait(), 5)
    assert after_last == []
    server.stop.set()
    await asyncio.wait_for(server.task, 10)


async def test_client_leaving_mid_stream_cancels_the_body(http):
    started, closed = asyncio.Event(), asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"first\n"
            started.set()
            await asyncio.Event().wait()  # a worker that never sends more
            yield b"never\n"
        finally:
            closed.set()

    async def handler(_r: web.Request) -> web.StreamResponse:
        return StreamedResponse(body(), content_type="text/event-stream")

    app = web.Application()
    app.router.add_get("/s", handler)
    server = Server(app)
    await server.ready(http)
    async with aiohttp.ClientSession() as own:  # its connection closes with it
        async with own.get(server.url + "/s") as r:
            assert await r.content.readline() == b"first\n"
            await asyncio.wait_for(started.wait(), 5)
    await asyncio.wait_for(closed.wait(), 5)
    server.stop.set()
    await asyncio.wait_for(server.task, 10)


async def test_stop_lets_a_request_in_flight_finish_and_refuses_new_ones(http):
    entered, release = asyncio.Event(), asyncio.Event()
    cleaned = []

    async def handler(_r: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.Response(text="done")

    async def cleanup(_app: web.Application) -> None:
        cleaned.append(True)

    app = web.Application()
    app.router.add_get("/slow", handler)
    app.on_cleanup.append(cleanup)
    server = Server(app)
    await server.ready(http)
    request = asyncio.create_task(http.get(server.url + "/slow"))
    await asyncio.wait_for(entered.wait(), 5)
    server.stop.set()
    async with aiohttp.ClientSession() as other:  # the port stops listening first
        for _ in range(500):
            try:
                async with other.get(server.url + "/nothing"):
                    await asyncio.sleep(0.01)
            except aiohttp.ClientConnectionError:
                break
        else:
            raise AssertionError("the server still accepts connections after stop")
    assert not server.task.done() and cleaned == []
    release.set()
    async with await asyncio.wait_for(request, 5) as r:
        assert r.status == 200 and await r.text() == "done"
    await asyncio.wait_for(server.task, 10)
    assert cleaned == [True]


@pytest.mark.parametrize("chunked", [False, True])
async def test_body_over_the_limit_is_413(http, chunked: bool):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=str(len(await read_body(request))))

    app = web.Application(client_max_size=1000)
    app.router.add_post("/b", handler)
    server = Server(app)
    await server.ready(http)

    async def chunks(data: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(data), 100):
            yield data[i:i + 100]

    for size, status in ((1000, 200), (1001, 413)):
        data = b"x" * size
        async with http.post(server.url + "/b", data=chunks(data) if chunked else data) as r:
            assert r.status == status
            if status == 200:
                assert await r.text() == "1000"
    server.stop.set()
    await asyncio.wait_for(server.task, 10)


def test_event_loop_choice(monkeypatch):
    assert loop_factory("asyncio") is None
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None:
        assert loop_factory(None) is uvloop.new_event_loop and loop_factory("uvloop") is uvloop.new_event_loop
    monkeypatch.setitem(sys.modules, "uvloop", None)  # (not installed)
    assert loop_factory(None) is None
    with pytest.raises(ValueError, match="uvloop is not installed"):
        loop_factory("uvloop")
