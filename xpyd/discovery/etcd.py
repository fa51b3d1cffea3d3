"""Dynamic discovery through etcd: the proxy's registry (watching side).

Each worker writes ``/workers/{role}/{ip}/{port}`` -> ``WorkerInfo`` JSON under a lease
(``etcd_registration.EtcdRegistration``, re-exported here). ``EtcdRegistry`` keeps the
set in memory:

    start: list the prefix (snapshot revision R) -> watch from R + 1
    event: PUT -> parse and store by key; DELETE -> drop the key (lease expiry carries no value)
    error or stream end: healthy = False, keep the last-known set, back off 0.1 s .. 2 s,
                         list again (replace the map) and re-watch

aetcd 1.0 does not resume a watch after the connection breaks, so the resync is ours.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aetcd

from xpyd.discovery.base import RegistryError
from xpyd.discovery.counts import EtcdOps
from xpyd.discovery.etcd_common import (
    EXPECTED_ERRORS,
    OP_TIMEOUT,
    PREFIX,
    Backoff,
    close_client,
    describe_error,
    connect,
    parse_worker,
    split_endpoint,
    worker_key,
)
from xpyd.discovery.etcd_registration import EtcdRegistration
from xpyd.discovery.types import Role, WorkerInfo

__all__ = ["PREFIX", "EtcdRegistration", "EtcdRegistry", "worker_key"]

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0  # seconds start() keeps trying to reach etcd before RegistryError (it may start later)


class EtcdRegistry:
    def __init__(
        self,
        endpoint: str,
        prefix: str = PREFIX,
        model_id: str | None = None,
        *,
        start_timeout: float = START_TIMEOUT,
        ops: EtcdOps | None = None,
    ) -> None:
        """``ops``: where its etcd operations are counted (the owner's metrics; else a counter of its own)."""
        if not prefix.endswith("/"):
            raise ValueError(f"prefix must end with '/', got {prefix!r}")
        if start_timeout <= 0:
            raise ValueError(f"start_timeout must be > 0, got {start_timeout}")
        split_endpoint(endpoint)  # ValueError now, not at start()
        self._endpoint = endpoint
        self._prefix = prefix
        self._model_id = model_id
        self._start_timeout = start_timeout
        self._entries: dict[str, WorkerInfo] = {}  # etcd key -> info (valid entries only)
        self._by_role: dict[Role, list[WorkerInfo]] = {Role.PREFILL: [], Role.DECODE: []}
        self._callbacks: list[Callable[[], None]] = []
        self._client: aetcd.Client | None = None
        self._watch: aetcd.Watch | None = None
        self._task: asyncio.Task | None = None
        self._healthy = False
        self._closed = False
        self.ops = ops if ops is not None else EtcdOps()

    @property
    def healthy(self) -> bool:
        """The watch is connected (False while etcd is unreachable and before start)."""
        return self._healthy

    def workers(self, role: Role) -> list[WorkerInfo]:
        return list(self._by_role[role])

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (in the event loop) after the worker set changed."""
        self._callbacks.append(callback)

    async def start(self) -> None:
        if self._task is not None or self._closed:
            raise RuntimeError("EtcdRegistry.start() may be called once")
        deadline = time.monotonic() + self._start_timeout
        backoff = Backoff()
        while True:
            try:
                await self._sync()
                break
            except EXPECTED_ERRORS as e:
                await self._drop_client()
                if time.monotonic() + backoff.peek() >= deadline:
                    raise RegistryError(
                        f"etcd at {self._endpoint} unreachable for {self._start_timeout:g}s: {describe_error(e)}"
                    ) from e
                await asyncio.sleep(backoff.next())
        self._task = asyncio.create_task(self._run(), name=f"etcd-registry-{self._endpoint}")

    async def close(self) -> None:
        self._closed = True
        self._healthy = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=OP_TIMEOUT)
        await self._drop_client()
        self._entries = {}
        self._by_role = {Role.PREFILL: [], Role.DECODE: []}

    # --- background ----------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            try:
                if self._watch is None:
                    await self._sync()
                    log.info("etcd %s: watching %s again (%d workers)",
                             self._endpoint, self._prefix, len(self._entries))
                backoff.reset()
                async for event in self._watch:
                    self._apply(event)
                reason = "watch stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure means: resync
                if not isinstance(e, EXPECTED_ERRORS):
                    log.exception("etcd %s: unexpected error in the watch loop", self._endpoint)
                reason = describe_error(e)
            if self._healthy:
                log.warning("etcd %s: watch lost (%s); keeping the last %d workers and resyncing",
                            self._endpoint, reason, len(self._entries))
            self._healthy = False
            await self._drop_client()
            await asyncio.sleep(backoff.next())

    async def _sync(self) -> None:
        """List the prefix, replace the map, and watch from the snapshot revision + 1."""
        self._client = self._client or connect(self._endpoint)
        prefix = self._prefix.encode()
        self.ops.count("get_prefix")
        listing = await asyncio.wait_for(self._client.get_prefix(prefix), OP_TIMEOUT)
        entries = {}
        for kv in listing:
            info = self._parse(kv.key, kv.value)
            if info is not None:
                entries[kv.key.decode()] = info
        self.ops.count("watch_start")
        self._watch = await asyncio.wait_for(
            self._client.watch_prefix(prefix, start_revision=listing.header.revision + 1), OP_TIMEOUT
        )
        self._healthy = True
        self._replace(entries)

    def _apply(self, event: aetcd.Event) -> None:
        self.ops.count("watch_event")
        key = event.kv.key.decode()
        if event.kind == aetcd.EventKind.PUT:
            info = self._parse(event.kv.key, event.kv.value)
            entries = dict(self._entries)
            if info is None:
                entries.pop(key, None)
            else:
                entries[key] = info
        else:
            entries = {k: v for k, v in self._entries.items() if k != key}
        self._replace(entries)

    def _parse(self, key: bytes, value: bytes) -> WorkerInfo | None:
        try:
            return parse_worker(key.decode(), value, self._prefix, self._model_id)
        except ValueError as e:
            log.warning("etcd %s: ignoring %s: %s", self._endpoint, key.decode(errors="replace"), e)
            return None

    def _replace(self, entries: dict[str, WorkerInfo]) -> None:
        if entries == self._entries:
            return
        self._entries = entries
        by_url = sorted(entries.values(), key=lambda i: i.http_url)
        self._by_role = {role: [i for i in by_url if i.role is role] for role in Role}
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception:  # noqa: BLE001 - one bad listener must not stop discovery
                log.exception("EtcdRegistry on_change callback failed")

    async def _drop_client(self) -> None:
        client, self._client, self._watch = self._client, None, None
        if client is not None:
            await close_client(client)
