"""The background poll of every known worker (every ``interval``, one probe per worker at a time)::

    UP worker   -> GET /xpyd/stats -> 200: its load is reported
                                   -> refused / 5xx: DOWN
                                   -> other status or a bad body: no stats (the proxy counts alone)
                   then, with a CacheFeed (cache-aware routing), its KV events if it has no stream for
                   them (an older worker): ``CacheFeed.poll``; each tick tells the feed which workers are
                   UP, so that it follows their streams (``xpyd.proxy.kv_follow``)
    DOWN worker -> GET /health     -> 200: UP again

Each tick first syncs the table with the registry, so workers that left are
forgotten even when no request comes. One probe that times out changes nothing:
a worker that is slow to answer is busy, not dead (requests to it have their
own timeouts, and those do mark it down). But a worker that answered none of
``STALLED_PROBES`` probes in a row (each waited ``timeout``) is stalled (stopped,
swapping, its event loop blocked): it is marked DOWN so no new request waits on
it, and UP again when its /health answers. A probe that timed out while the worker
sent this proxy bytes anyway (token streams, KV event lines: ``WorkerTable.heard``)
does not count: the worker is busy (1,000 streams on 2 cores starved its probes),
not stalled. A worker that hangs gets no second
probe while the first is pending, so one slow worker never delays the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from xpyd.discovery.base import Registry
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.cache_feed import CacheFeed
from xpyd.proxy.workers import Health, Stats, WorkerTable

log = logging.getLogger(__name__)

MAX_STATS_BYTES = 64 * 1024
STALLED_PROBES = 3  # probes in a row without an answer: the worker is stalled, not just busy
CLOSE_TIMEOUT = 2.0


class HealthPoller:
    def __init__(
        self,
        registry: Registry,
        table: WorkerTable,
        session: aiohttp.ClientSession,
        interval: float,
        timeout: float,
        on_probe: Callable[[], None] | None = None,
        feed: CacheFeed | None = None,
    ) -> None:
        self._registry = registry
        self._table = table
        self._session = session
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._task: asyncio.Task | None = None
        self._probes: dict[tuple[Role, str], asyncio.Task] = {}
        self._on_probe = on_probe  # after every probe: what the table says may have changed
        self._unanswered: dict[tuple[Role, str], int] = {}  # UP worker -> probes in a row that timed out
        self._feed = feed  # told about every tick, and polls each UP worker's KV events after its stats
        self._refused: set[str] = set()  # workers whose stats answered 401 (warned about once)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="xpyd-proxy-poller")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._probes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._probes.clear()

    async def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a broken registry must not stop the health checks for good
                log.exception("polling the workers failed")
            await asyncio.sleep(self._interval)

    def tick(self) -> None:
        """Sync with the registry and start a probe for every worker that has none running."""
        live = set()
        listed, up = [], []
        for role in Role:
            for state in self._table.sync(role, self._registry.workers(role)):
                key = (role, state.info.http_url)
                live.add(key)
                listed.append(state.info)
                if state.health is Health.UP:
                    up.append(state.info)
                probe = self._probes.get(key)
                if probe is None or probe.done():
                    self._probes[key] = asyncio.create_task(self._probe(state.info))
        for key in [k for k in self._probes if k not in live]:
            self._probes.pop(key).cancel()
        if self._feed is not None:
            self._feed.tick(listed, up)

    async def _probe(self, worker: WorkerInfo) -> None:
        state = self._table.get(worker)
        if state is None:
            return
        key = (worker.role, worker.http_url)
        stats_read = False
        asked = time.monotonic()
        try:
            if state.health is Health.UP:
                await self._read_stats(worker)
                stats_read = True
            else:
                await self._check_health(worker)
            self._unanswered.pop(key, None)
        except TimeoutError:  # also aiohttp's ServerTimeoutError: slow is not dead, stalled is
            if state.heard_at >= asked:  # it streamed tokens or KV events meanwhile: busy, not stalled
                self._unanswered.pop(key, None)
            elif state.health is not Health.DOWN:
                self._unanswered[key] = missed = self._unanswered.get(key, 0) + 1
                if missed >= STALLED_PROBES:
                    del self._unanswered[key]
                    self._table.mark_down(worker, f"poll: no answer to {missed} probes in a row (stalled?)")
        except aiohttp.ClientError as e:
            self._table.mark_down(worker, f"poll: {type(e).__name__}: {e}",
                                  unreachable=isinstance(e, aiohttp.ClientConnectionError))
        finally:
            if self._on_probe is not None:
                self._on_probe()
        if stats_read and self._feed is not None and state.health is Health.UP:
            await self._feed.poll(worker)  # after the stats (and on_probe): they come first

    async def _check_health(self, worker: WorkerInfo) -> None:
        async with self._session.get(worker.http_url + "/health", timeout=self._timeout) as resp:
            if resp.status == 200:
                self._table.mark_up(worker)

    async def _read_stats(self, worker: WorkerInfo) -> None:
        mark = self._table.report_mark(worker)
        url = worker.http_url + "/xpyd/stats"
        async with self._session.get(url, timeout=self._timeout) as resp:
            if resp.status >= 500:
                self._table.mark_down(worker, f"poll: GET /xpyd/stats answered HTTP {resp.status}")
                return
            if resp.status == 401 and worker.http_url not in self._refused:
                self._refused.add(worker.http_url)  # (said once per worker)
                log.warning("%s worker %s refuses the proxy (HTTP 401): it has a --cluster-token the proxy "
                            "lacks (or another one)", worker.role.value, worker.http_url)
            body = await resp.content.read(MAX_STATS_BYTES)  # read even a 404: keeps the connection
        stats = None
        if resp.status == 200:
            try:
                stats = Stats.from_dict(json.loads(body))
            except ValueError as e:
                log.debug("%s: unusable stats: %s", url, e)
        self._table.report(worker, stats, mark)
