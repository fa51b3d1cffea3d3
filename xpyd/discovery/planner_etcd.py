"""The planner's state in etcd: written by the planner (``PlannerPublisher``), watched by the proxy (``PlannerWatch``).

    publish(state): grant a lease of ``ttl`` s -> put ``PLANNER_KEY`` under it (each interval: the key outlives
                    its planner by at most ``ttl``; older leases expire with nothing on them)
    clear():        delete the key (a planner that stops)
    watch:          get the key (revision R) -> watch it from R + 1; PUT -> decode (refused: logged, the state
                    is None), DELETE -> None; an error or the stream's end -> back off 0.1 .. 2 s, get again

Neither raises on an etcd failure: the planner goes on planning, the proxy keeps the last state it read (as the
registry keeps the last workers). Every call has a timeout (``OP_TIMEOUT``).
"""

from __future__ import annotations

import asyncio
import logging

import aetcd

from xpyd.discovery.etcd_common import (EXPECTED_ERRORS, OP_TIMEOUT, Backoff, close_client, connect, describe_error,
                                        split_endpoint)
from xpyd.discovery.planner_state import PLANNER_KEY, PlannerState, decode_state, encode_state

log = logging.getLogger(__name__)

__all__ = ["PlannerPublisher", "PlannerWatch"]

MIN_TTL = 2  # etcd's least lease TTL


class PlannerPublisher:
    def __init__(self, endpoint: str, ttl: int, key: str = PLANNER_KEY) -> None:
        """``ttl``: seconds the key outlives the last publish (a few of the planner's intervals)."""
        split_endpoint(endpoint)  # ValueError now
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < MIN_TTL:
            raise ValueError(f"the planner state's lease ttl must be an int >= {MIN_TTL} s, got {ttl!r}")
        self._endpoint = endpoint
        self._ttl = ttl
        self._key = key.encode()
        self._client: aetcd.Client | None = None
        self._failing = False

    async def publish(self, state: PlannerState) -> bool:
        """Write ``state``; False (logged once per outage) when etcd did not take it."""
        try:
            value = encode_state(state)
        except ValueError as e:
            log.warning("the planner's state not written: %s", e)
            return False
        try:
            self._client = self._client or connect(self._endpoint)
            lease = await asyncio.wait_for(self._client.lease(self._ttl), OP_TIMEOUT)
            await asyncio.wait_for(self._client.put(self._key, value, lease=lease.id), OP_TIMEOUT)
        except EXPECTED_ERRORS as e:
            await self._drop_client()
            if not self._failing:
                log.warning("etcd %s: the planner's state not written (%s); /cluster shows the last one until "
                            "its lease ends", self._endpoint, describe_error(e))
            self._failing = True
            return False
        if self._failing:
            log.info("etcd %s: the planner's state written again", self._endpoint)
        self._failing = False
        return True

    async def clear(self) -> None:
        """Delete the key (the planner stops); a failure is logged: the lease ends it anyway."""
        try:
            self._client = self._client or connect(self._endpoint)
            await asyncio.wait_for(self._client.delete(self._key), OP_TIMEOUT)
        except EXPECTED_ERRORS as e:
            log.warning("etcd %s: the planner's state not deleted (%s); it goes in %d s", self._endpoint,
                        describe_error(e), self._ttl)

    async def close(self) -> None:
        await self._drop_client()

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await close_client(client)


class PlannerWatch:
    """The planner's state as etcd has it now (``state``: None when no planner runs or its value was refused)."""

    def __init__(self, endpoint: str, key: str = PLANNER_KEY) -> None:
        split_endpoint(endpoint)
        self._endpoint = endpoint
        self._key = key.encode()
        self._client: aetcd.Client | None = None
        self._task: asyncio.Task | None = None
        self.state: PlannerState | None = None

    def start(self) -> None:
        """Start watching in the background (etcd unreachable: it keeps trying)."""
        if self._task is not None:
            raise RuntimeError("PlannerWatch.start() may be called once")
        self._task = asyncio.create_task(self._run(), name=f"planner-watch-{self._endpoint}")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=OP_TIMEOUT)
        await self._drop_client()

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            try:
                self._client = self._client or connect(self._endpoint)
                listing = await asyncio.wait_for(self._client.get_prefix(self._key), OP_TIMEOUT)  # (a header
                # with the store's revision even when the key is absent, as a plain get has not)
                self._read(next((kv.value for kv in listing if kv.key == self._key), None))
                watch = await asyncio.wait_for(
                    self._client.watch(self._key, start_revision=listing.header.revision + 1), OP_TIMEOUT)
                backoff.reset()
                async for event in watch:
                    self._read(event.kv.value if event.kind == aetcd.EventKind.PUT else None)
                reason = "watch stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the proxy must survive any etcd trouble
                if not isinstance(e, EXPECTED_ERRORS):
                    log.exception("etcd %s: unexpected error watching the planner's state", self._endpoint)
                reason = describe_error(e)
            log.debug("etcd %s: planner watch lost (%s); reading it again", self._endpoint, reason)
            await self._drop_client()
            await asyncio.sleep(backoff.next())

    def _read(self, value: bytes | None) -> None:
        if value is None:
            self.state = None
            return
        try:
            self.state = decode_state(value)
        except ValueError as e:
            log.warning("etcd %s: ignoring %s: %s", self._endpoint, self._key.decode(), e)
            self.state = None

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await close_client(client)
