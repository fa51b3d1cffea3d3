"""What the cache-aware router learns from the workers, driven by the health poller::

    each poller tick         -> tick(listed, up): workers that left the registry leave the index; every UP
                                worker's KV event stream is followed (``kv_follow.KVStreams``), the others'
                                streams are closed; with no tokenizer yet (or the worker it came from is
                                gone): GET /xpyd/tokenizer from an UP worker, in the background
                                -> PromptTokenizer (built in a thread)
    each worker's stream     -> a snapshot or the events since the entry's cursor, then each batch of events
                                as the worker records them -> PrefixIndex.apply (no request per interval)
    each UP worker's probe,  -> poll(worker), only for a worker without a stream (older versions: 404; or
    after its stats             all its streams taken: 503): GET /xpyd/kv_events?epoch=E&since=N
                                -> events since N, or a snapshot (first poll, a new epoch, N too old)

The poll, where it is used, is one request per UP worker per poll interval (200 ms) on top of its stats.
Measured on the proxy (2-vCPU EPYC, worker on the same host): 0.21 ms of CPU per poll with no events (as much
as the stats poll), 0.44 ms with 1,000 events (~30 KB); a 100,000-block snapshot (2.1 MB) 31 ms, decoded in a
thread, though the decoder holds the GIL (the event loop waited up to 31 ms): once per worker start or resync.
A stream costs nothing while its worker's cache does not change (a keep-alive line every 5 s).

A failed or malformed answer never touches the worker's health (its stats do that): the worker's index
entry waits for the next line or poll, which asks for a snapshot after a malformed one. Workers without these
endpoints (older versions) answer 404 to both: requests are then routed by load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import aiohttp

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.kv_follow import KVStreams
from xpyd.proxy.prefix_index import KVUpdate, PrefixIndex
from xpyd.proxy.prompt_tokens import PromptTokenizer, TokenizerSpec

log = logging.getLogger(__name__)

KV_EVENTS_PATH = "/xpyd/kv_events"
TOKENIZER_PATH = "/xpyd/tokenizer"
MAX_EVENTS_BYTES = 64 * 1024 * 1024
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024
EVENTS_TIMEOUT = 5.0  # one kv_events answer (a snapshot may take a while on a busy worker)
TOKENIZER_TIMEOUT = 30.0
TOKENIZER_RETRY_SECONDS = 10.0  # after a failed fetch
PARSE_INLINE_BYTES = 64 * 1024  # answers up to this size are parsed on the event loop, larger ones in a thread
CLOSE_TIMEOUT = 2.0


class CacheFeed:
    """Keeps a ``PrefixIndex`` and the proxy's ``PromptTokenizer`` up to date; ``HealthPoller`` drives it."""

    def __init__(self, session: aiohttp.ClientSession, index: PrefixIndex,
                 clock: Callable[[], float] = time.monotonic, hash_key: bytes = b"",
                 heard: Callable[[WorkerInfo], None] | None = None) -> None:
        self._session = session
        self.index = index
        self._hash_key = hash_key  # the workers' block-hash key (prefix_hash.hash_key of the cluster token)
        self.tokenizer: PromptTokenizer | None = None  # None: requests are routed without their blocks
        self._clock = clock
        self._source: tuple[Role, str] | None = None  # the worker the tokenizer came from
        self._fetch: asyncio.Task | None = None
        self._next_fetch = 0.0
        self._attempts = 0
        self.streams = KVStreams(index, dict(session.headers), clock, heard)  # a pool of its own

    async def close(self) -> None:
        await self.streams.close()
        if self._fetch is not None:
            self._fetch.cancel()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await asyncio.gather(self._fetch, return_exceptions=True)
            self._fetch = None

    def describe(self) -> dict | None:
        """For ``GET /cluster``: where the tokenizer came from; None while requests go by load alone."""
        if self.tokenizer is None or self._source is None:
            return None
        return {"from": self._source[1], "block_size": self.tokenizer.spec.block_size}

    def tick(self, listed: Sequence[WorkerInfo], up: Sequence[WorkerInfo]) -> None:
        """``listed``: the registry's workers; ``up``: those of them that are UP (prefill first)."""
        self.index.retain(listed)
        self.streams.sync(up)
        if self._fetch is not None and not self._fetch.done():
            return
        if self.tokenizer is not None and self._source in {(w.role, w.http_url) for w in up}:
            return
        if not up or self._clock() < self._next_fetch:
            return
        worker = up[self._attempts % len(up)]  # after a failure, the next one
        self._attempts += 1
        self._fetch = asyncio.create_task(self._fetch_tokenizer(worker), name="xpyd-proxy-tokenizer")

    async def poll(self, worker: WorkerInfo) -> None:
        """For a worker without a KV event stream: bring its index entry up to date with its KV events
        (never raises but on cancel)."""
        if not self.streams.polls(worker):
            return
        url = worker.http_url + KV_EVENTS_PATH
        entry = self.index.entry(worker)
        cursor = entry.cursor
        params = {} if cursor is None else {"epoch": cursor.epoch, "since": str(cursor.seq)}
        try:
            async with self._session.get(url, params=params,
                                         timeout=aiohttp.ClientTimeout(total=EVENTS_TIMEOUT)) as resp:
                if resp.status != 200:
                    await resp.content.read(MAX_ERROR_BYTES)  # an old worker's 404: keeps the connection
                    return
                body = await read_limited(resp, MAX_EVENTS_BYTES)
            if len(body) <= PARSE_INLINE_BYTES:
                update = KVUpdate.from_json(body)
            else:
                update = await asyncio.to_thread(KVUpdate.from_json, body)
        except (TimeoutError, aiohttp.ClientError) as e:  # the stats poll judges its health
            log.debug("%s: %s", url, e)
            return
        except ValueError as e:
            log.warning("%s: unusable answer (%s); asking for a snapshot next", url, e)
            self.index.reset(worker)
            return
        if not self.index.apply(worker, entry, update):
            log.debug("%s: events did not follow on from %s; asking for a snapshot next", url, cursor)

    async def _fetch_tokenizer(self, worker: WorkerInfo) -> None:
        url = worker.http_url + TOKENIZER_PATH
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=TOKENIZER_TIMEOUT)) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                body = await read_limited(resp, MAX_TOKENIZER_BYTES)
            tokenizer = await asyncio.to_thread(self._build, body)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            self._next_fetch = self._clock() + TOKENIZER_RETRY_SECONDS
            level = logging.WARNING if self._attempts == 1 else logging.DEBUG
            log.log(level, "no tokenizer from %s (%s): requests are routed by load alone until one is "
                    "fetched (retrying every %gs)", url, e, TOKENIZER_RETRY_SECONDS)
            return
        if tokenizer is not self.tokenizer:
            log.info("cache-aware routing: tokenizer from %s (blocks of %d tokens)", worker.http_url,
                     tokenizer.spec.block_size)
        self.tokenizer, self._source = tokenizer, (worker.role, worker.http_url)

    def _build(self, body: bytes) -> PromptTokenizer:
        spec = TokenizerSpec.from_json(body)
        current = self.tokenizer
        if current is not None and current.digest == spec.digest():
            return current  # the same as the one in use (e.g. fetched again after its worker left)
        return PromptTokenizer(spec, self._hash_key)


async def read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body; ValueError past ``limit`` bytes."""
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > limit:
            raise ValueError(f"answer larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
