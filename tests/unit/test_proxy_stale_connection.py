"""A worker that cuts a pooled connection just as the proxy reuses it (its keep-alive clock ran out first: on a
loaded machine the proxy's loop lags its own timer) costs the request nothing: the POST goes once more on a new
connection (``WorkerClient._send``). A worker that refuses connections is unreachable at once.

The worker here is a raw asyncio HTTP server (real sockets): the first request on each connection is answered
with keep-alive; a second request on that connection is met by closing it unanswered, which is what a worker
does whose idle timer fired as the request arrived.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.waiting import until
from xpyd.api.openai import RequestKind
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.client import WorkerClient, worker_sessions
from xpyd.proxy.upstream import Fault, UpstreamError

ANSWER = json.dumps({"choices": [{"text": "hi", "finish_reason": None}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()


class CuttingWorker:
    """Answers the first request of a connection; cuts the connection on its second (``took``: after taking it,
    as a worker that read the request and lost the connection; a request id it has taken is a 409 after)."""

    def __init__(self, took: bool = False) -> None:
        self.connections = 0
        self.answered = 0
        self.cut = 0
        self.took = took
        self.ids: list[str] = []  # request ids taken, in order
        self.aborts: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                field = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:] if line)}
                await reader.readexactly(int(field.get(b"content-length", b"0")))
                rid = field.get(b"x-request-id", b"").decode()
                if lines[0].startswith(b"POST /xpyd/abort"):
                    self.aborts.append(rid)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                    await writer.drain()
                    continue
                if served:  # (its keep-alive ran out as this request came in)
                    self.cut += 1
                    if self.took:
                        self.ids.append(rid)
                    return
                served += 1
                if rid in self.ids:
                    writer.write(b"HTTP/1.1 409 Conflict\r\nContent-Length: 2\r\n\r\n{}")
                    await writer.drain()
                    continue
                self.ids.append(rid)
                self.answered += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


def _worker(url: str) -> WorkerInfo:
    return WorkerInfo(Role.PREFILL, url, "127.0.0.1:1", "m", 1, 8)


async def test_a_post_on_a_connection_the_worker_cut_goes_again_on_a_new_one():
    worker = CuttingWorker()
    url = await worker.start()
    sessions = worker_sessions(5, 5, 4)
    client = WorkerClient(sessions, 5)
    try:
        body = {"model": "m", "prompt": "hello", "max_tokens": 1}
        first = await client.prefill(_worker(url), RequestKind.COMPLETION, body, "r1")
        second = await client.prefill(_worker(url), RequestKind.COMPLETION, body, "r2")  # (the pooled one: cut)
        assert first.text == second.text == "hi"
        assert worker.cut == 1 and worker.answered == 2 and worker.connections == 2
    finally:
        await sessions.close()
        await worker.stop()


async def test_a_second_try_the_worker_calls_a_duplicate_is_unreachable_and_the_first_is_released():
    """The worker had taken the first request before the connection broke (then lost its answer): the second
    try is a duplicate (409). The request goes on to another pair (fault: unreachable), and the first one,
    which nobody waits for, is released at the worker."""
    worker = CuttingWorker(took=True)
    url = await worker.start()
    sessions = worker_sessions(5, 5, 4)
    client = WorkerClient(sessions, 5)
    try:
        body = {"model": "m", "prompt": "hello", "max_tokens": 1}
        await client.prefill(_worker(url), RequestKind.COMPLETION, body, "r1")
        with pytest.raises(UpstreamError) as e:
            await client.prefill(_worker(url), RequestKind.COMPLETION, body, "r2")
        assert e.value.fault is Fault.UNREACHABLE and "duplicate" in e.value.message
        await until(lambda: worker.aborts, "the first request released")
        assert worker.ids == ["r1", "r2"] and worker.aborts == ["r2"]
    finally:
        await sessions.close()
        await worker.stop()


async def test_a_worker_that_refuses_connections_is_unreachable_without_a_second_try():
    worker = CuttingWorker()
    url = await worker.start()
    await worker.stop()  # (nothing listens there now)
    sessions = worker_sessions(5, 5, 4)
    client = WorkerClient(sessions, 5)
    try:
        with pytest.raises(UpstreamError) as e:
            await client.prefill(_worker(url), RequestKind.COMPLETION, {"prompt": "x"}, "r1")
        assert e.value.fault is Fault.UNREACHABLE and "ConnectFailed: cannot connect" in e.value.message
    finally:
        await sessions.close()
