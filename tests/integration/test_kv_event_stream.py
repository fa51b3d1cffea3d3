"""A real colocated sim worker's KV event stream (``GET /xpyd/kv_events/stream``) followed by the proxy's real
``CacheFeed`` in this process: blocks the worker stores reach the index with no poll, a broken stream resumes
from its cursor (events, no second snapshot), the worker leaving ends its stream, and the worker serves at most
``MAX_STREAMS`` at once (503 past that, a place again once a stream ends)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.cluster import Cluster, free_port
from tests.waiting import until
from xpyd.discovery.types import WorkerInfo
from xpyd.proxy.cache_feed import CacheFeed
from xpyd.proxy.kv_follow import STREAM_PATH
from xpyd.proxy.prefix_index import PrefixIndex
from xpyd.signal.request_id import RequestId
from xpyd.worker.kv_stream import MAX_STREAMS

PROFILE = {
    "format": "xpyd-sim-profile/1", "model": "test", "machine": "test", "dtype": "float32", "threads": 1,
    "created": "2026-01-01T00:00:00Z",
    "prefill": {"new_tokens": [1, 1024], "cached_tokens": [0, 1024], "seconds": [[0.001, 0.001], [0.01, 0.01]]},
    "decode": {"batch": [1, 8], "context_tokens": [1, 4096], "seconds": [[0.001, 0.002], [0.002, 0.003]]},
}


@pytest.fixture(scope="module")
def worker(tmp_path_factory, smollm_dir: Path):
    """A colocated sim worker (blocks of 16 tokens); its WorkerInfo."""
    tmp = tmp_path_factory.mktemp("kv-stream")
    profile = tmp / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    c = Cluster(tmp)
    c.start("colocated", ["colocated", "--model", str(smollm_dir), "--engine", "sim", "--sim-profile", str(profile),
                          "--sim-speedup", "inf", "--threads", "1", "--batch-size", "4", "--max-model-len", "512",
                          "--block-size", "16", "--port", str(port)], url)
    try:
        c.wait_healthy()
        with urllib.request.urlopen(url + "/xpyd/info", timeout=30) as r:
            info = WorkerInfo.from_json(r.read())
        yield info
    finally:
        c.stop()


def _complete(info: WorkerInfo, prompt: str) -> None:
    """One request straight to the worker (its blocks are cached when it ends)."""
    rid = RequestId.new(info.signal_addr, info.signal_addr)
    req = urllib.request.Request(info.http_url + "/v1/completions",
                                 data=json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0}).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": str(rid)})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


async def _store(info: WorkerInfo, prompt: str) -> None:
    await asyncio.to_thread(_complete, info, prompt)


def _blocks(index: PrefixIndex, w: WorkerInfo) -> int:
    return index.blocks(w) or 0


class Relay:
    """A TCP relay on loopback in front of the worker; ``cut()`` breaks every connection through it."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self._target), 10)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> int:
        n = len(self._writers)
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()
        return n

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


async def test_stored_blocks_reach_the_index_without_a_poll(worker):
    index = PrefixIndex()
    async with aiohttp.ClientSession() as session:
        feed = CacheFeed(session, index)
        try:
            feed.tick([worker], [worker])
            await until(lambda: index.blocks(worker) is not None, "the first line (a snapshot)")
            before = _blocks(index, worker)
            await _store(worker, "the quick brown fox jumps over the lazy dog " * 8)  # ~80 tokens: 5 blocks
            await until(lambda: _blocks(index, worker) >= before + 4, "the stored blocks in the index")
            assert feed.streams.snapshots == 1 and feed.streams.connects == 1  # one stream, events after it
            assert not feed.streams.polls(worker)  # (and feed.poll was never called)
        finally:
            await feed.close()


async def test_a_broken_stream_resumes_from_its_cursor_without_a_snapshot(worker):
    relay = Relay(int(worker.http_url.rsplit(":", 1)[1]))
    await relay.start()
    via = WorkerInfo.from_dict({**json.loads(worker.to_json()), "http_url": f"http://127.0.0.1:{relay.port}"})
    index = PrefixIndex()
    async with aiohttp.ClientSession() as session:
        feed = CacheFeed(session, index)
        try:
            feed.tick([via], [via])
            await until(lambda: index.blocks(via) is not None, "the first line (a snapshot)")
            cursor = index.entry(via).cursor
            assert relay.cut() >= 2  # the stream's two ends (and the tokenizer fetch's, if still open)
            await _store(worker, "a broken stream picks up where it was cut " * 8)
            await until(lambda: (c := index.entry(via).cursor) is not None and c.seq > cursor.seq,
                        "the new events after the reconnect")
            await until(lambda: feed.streams.connects == 2, "the second stream")
            assert feed.streams.snapshots == 1  # only the first stream's
            assert index.entry(via).cursor.epoch == cursor.epoch
        finally:
            await feed.close()
            await relay.close()


async def test_streams_are_bounded_and_a_leaving_worker_ends_its_stream(worker):
    index = PrefixIndex()
    url = worker.http_url + STREAM_PATH
    async with aiohttp.ClientSession() as session, aiohttp.ClientSession() as others:
        feed = CacheFeed(session, index)
        held = []
        try:
            feed.tick([worker], [worker])
            await until(lambda: index.blocks(worker) is not None, "the feed's stream")

            def streams_open() -> int:
                with urllib.request.urlopen(worker.http_url + "/xpyd/stats", timeout=30) as r:
                    return json.loads(r.read())["kv_event_streams"]

            # (the earlier tests' streams end at the worker when it next writes to them: within a keep-alive)
            await until(lambda: streams_open() == 1, "the earlier tests' streams ended at the worker", timeout=60,
                        interval=0.1)
            for _ in range(MAX_STREAMS - 1):  # the rest of the worker's streams
                resp = await others.get(url, timeout=aiohttp.ClientTimeout(total=30))
                assert resp.status == 200
                assert json.loads(await asyncio.wait_for(resp.content.readline(), 30))["snapshot"] is not None
                held.append(resp)
            async with others.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "30"
            feed.tick([], [])  # the worker left the registry: its stream ends, and its place at the worker
            assert feed.streams.following() == 0

            async def a_place() -> bool:
                async with others.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
                    return r.status == 200

            await until(a_place, "a place freed at the worker")
            assert index.get(worker) is None
        finally:
            for resp in held:
                resp.close()
            await feed.close()
