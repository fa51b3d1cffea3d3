"""Following each UP worker's KV event stream (``GET /xpyd/kv_events/stream``, ``xpyd.worker.kv_stream``)::

    worker UP (sync)      -> a task: GET stream?epoch=&since= (the entry's cursor; none: a snapshot first)
    each line             -> KVUpdate -> PrefixIndex.apply (a line that does not follow on: reconnect, which
                             asks for a snapshot)
    stream breaks / ends  -> after a back-off, again from the entry's cursor (the worker answers with the
                             events since, a snapshot only when it no longer has them)
    no line for READ_TIMEOUT (the worker sends a keep-alive every 5 s) -> the stream is dead: reconnect
    404 (older worker)    -> this worker is polled instead (``polls``), as long as it stays UP
    503 (its streams are all taken) -> polled for BUSY_RETRY_SECONDS, then the stream is tried again
    worker DOWN or gone   -> the task is cancelled, its connection closed

The streams have a pool of their own (one connection per worker, held), so that they never take a slot from
POSTs or probes. Errors never touch a worker's health: the stats probes judge that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence

import aiohttp

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.prefix_index import KVUpdate, PrefixIndex

log = logging.getLogger(__name__)

STREAM_PATH = "/xpyd/kv_events/stream"
MAX_LINE_BYTES = 64 * 1024 * 1024  # one line: a snapshot of a large cache (100,000 blocks: ~2 MB)
MAX_ERROR_BYTES = 64 * 1024
PARSE_INLINE_BYTES = 64 * 1024  # lines up to this size are parsed on the event loop, larger ones in a thread
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 15.0  # three of the worker's keep-alives missed: the stream is dead
MIN_BACKOFF, MAX_BACKOFF = 0.1, 5.0
BUSY_RETRY_SECONDS = 30.0
CLOSE_TIMEOUT = 2.0

Key = tuple[Role, str]


class KVStreams:
    """One task per followed worker; ``polls(worker)``: whether it must be polled instead."""

    def __init__(self, index: PrefixIndex, headers: dict[str, str],
                 clock: Callable[[], float] = time.monotonic,
                 heard: Callable[[WorkerInfo], None] | None = None) -> None:
        self._index = index
        self._heard = heard  # told on every line (keep-alives included): the worker is alive
        self._headers = headers
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[Key, asyncio.Task] = {}
        self._polled: dict[Key, float] = {}  # worker -> polled until (inf: it has no stream endpoint)
        self.lines = 0  # lines applied (keep-alives included)
        self.snapshots = 0  # lines that were snapshots
        self.connects = 0  # streams opened (200)

    def sync(self, up: Sequence[WorkerInfo]) -> None:
        """Follow every worker in ``up``; stop following the others."""
        keys = {(w.role, w.http_url): w for w in up}
        for key in [k for k in self._tasks if k not in keys]:
            self._tasks.pop(key).cancel()
            self._polled.pop(key, None)
        for key in [k for k in self._polled if k not in keys]:
            del self._polled[key]
        for key, worker in keys.items():
            task = self._tasks.get(key)
            if task is None or task.done():
                self._tasks[key] = asyncio.create_task(self._follow(worker), name=f"xpyd-kv-stream {key[1]}")

    def polls(self, worker: WorkerInfo) -> bool:
        return self._polled.get((worker.role, worker.http_url), 0.0) > self._clock()

    def following(self) -> int:
        """Workers with a stream task (connected or reconnecting)."""
        return sum(not t.done() for t in self._tasks.values())

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _pool(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT),
                headers=self._headers)
        return self._session

    async def _follow(self, worker: WorkerInfo) -> None:
        key = (worker.role, worker.http_url)
        url = worker.http_url + STREAM_PATH
        backoff = MIN_BACKOFF
        while True:
            entry = self._index.entry(worker)
            cursor = entry.cursor
            params = {} if cursor is None else {"epoch": cursor.epoch, "since": str(cursor.seq)}
            try:
                async with self._pool().get(url, params=params) as resp:
                    if resp.status in (404, 503):
                        await resp.content.read(MAX_ERROR_BYTES)
                        retry = math.inf if resp.status == 404 else BUSY_RETRY_SECONDS
                        log.info("%s: no KV event stream (HTTP %d); polling it %s", worker.http_url, resp.status,
                                 "instead" if retry == math.inf else f"for {retry:g}s")
                        self._polled[key] = self._clock() + retry
                        if retry == math.inf:
                            return
                        await asyncio.sleep(retry)
                        continue
                    if resp.status != 200:
                        raise ValueError(f"HTTP {resp.status}")
                    self.connects += 1
                    async for line in read_lines(resp, MAX_LINE_BYTES):
                        if len(line) <= PARSE_INLINE_BYTES:
                            update = KVUpdate.from_json(line)
                        else:
                            update = await asyncio.to_thread(KVUpdate.from_json, line)
                        self.lines += 1
                        if self._heard is not None:
                            self._heard(worker)
                        self.snapshots += update.snapshot is not None
                        if not self._index.apply(worker, entry, update):
                            log.debug("%s: events did not follow on; reconnecting for a snapshot", url)
                            break
                        backoff = MIN_BACKOFF
            except (TimeoutError, aiohttp.ClientError) as e:
                log.debug("%s: %s: %s", url, type(e).__name__, e)
            except ValueError as e:
                log.warning("%s: unusable line (%s); asking for a snapshot next", url, e)
                self._index.reset(worker)
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF, backoff * 2)


async def read_lines(resp: aiohttp.ClientResponse, limit: int) -> AsyncIterator[bytes]:
    """The body's newline-ended lines (empty ones skipped); ValueError for one longer than ``limit``."""
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        scan = len(buf)  # (what is in buf already has no newline)
        buf += chunk
        start = 0
        while (end := buf.find(b"\n", scan)) >= 0:
            if end > start:
                yield bytes(buf[start:end])
            start = scan = end + 1
        del buf[:start]
        if len(buf) > limit:
            raise ValueError(f"a line longer than {limit} bytes")
