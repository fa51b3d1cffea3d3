"""A worker's own etcd key: ``/workers/{role}/{ip}/{port}`` -> ``WorkerInfo`` JSON, under a lease.

    start:   grant lease (ttl) -> put key with the lease     (raises if etcd stays unreachable)
    every ttl/3: refresh the lease (aetcd has no keepalive loop)
        TTL <= 0 (expired, revoked, or etcd lost its data) -> grant a new lease, put again
        key missing or not ours                              -> put again
        etcd unreachable -> retry with backoff, log once per outage, never raise
    close:   revoke the lease (the key disappears at once)

Leases survive an etcd restart (etcd extends them by their TTL when it comes back), so a
short outage usually ends with a plain refresh.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aetcd

from xpyd.discovery.base import RegistryError
from xpyd.discovery.counts import EtcdOps
from xpyd.discovery.etcd_common import (
    EXPECTED_ERRORS,
    OP_TIMEOUT,
    Backoff,
    close_client,
    connect,
    describe_error,
    split_endpoint,
    worker_key,
)
from xpyd.discovery.types import WorkerInfo

log = logging.getLogger(__name__)

MIN_TTL = 2  # etcd's minimum lease TTL, seconds
START_TIMEOUT = 30.0  # seconds start() keeps trying before it raises (etcd may start after the workers: a
#                       Kubernetes rollout, 64 workers starting on a loaded machine)


class EtcdRegistration:
    def __init__(
        self, endpoint: str, info: WorkerInfo, ttl: int = 5, *, start_timeout: float = START_TIMEOUT,
        ops: EtcdOps | None = None,
    ) -> None:
        """``ops``: where its etcd operations are counted (the worker's metrics; else a counter of its own)."""
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < MIN_TTL:
            raise ValueError(f"lease ttl must be an int >= {MIN_TTL} seconds (etcd's minimum), got {ttl!r}")
        if start_timeout <= 0:
            raise ValueError(f"start_timeout must be > 0, got {start_timeout}")
        split_endpoint(endpoint)  # ValueError now, not at start()
        self._endpoint = endpoint
        self._key = worker_key(info).encode()
        self._value = info.to_json().encode()
        self._ttl = ttl
        self._start_timeout = start_timeout
        self._client: aetcd.Client | None = None
        self._lease_id: int | None = None
        self._task: asyncio.Task | None = None
        self._registered = False
        self._closed = False
        self.ops = ops if ops is not None else EtcdOps()

    @property
    def key(self) -> str:
        return self._key.decode()

    @property
    def registered(self) -> bool:
        """Our key was in etcd under a live lease at the last check (every ttl/3)."""
        return self._registered

    async def start(self) -> None:
        if self._task is not None or self._closed:
            raise RuntimeError("EtcdRegistration.start() may be called once")
        deadline = time.monotonic() + self._start_timeout
        backoff = Backoff()
        while True:
            try:
                await self._register()
                break
            except EXPECTED_ERRORS as e:
                await self._drop_client()
                if time.monotonic() + backoff.peek() >= deadline:
                    raise RegistryError(
                        f"could not register {self.key} in etcd at {self._endpoint} "
                        f"within {self._start_timeout:g}s: {describe_error(e)}"
                    ) from e
                await asyncio.sleep(backoff.next())
        log.info("registered %s in etcd %s (lease ttl %ds)", self.key, self._endpoint, self._ttl)
        self._task = asyncio.create_task(self._keep_alive(), name=f"etcd-lease-{self.key}")

    async def close(self) -> None:
        """Revoke the lease so the key disappears now; bounded (about 2 x OP_TIMEOUT at worst)."""
        if self._closed:
            return
        self._closed = True
        self._registered = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=OP_TIMEOUT)
        if self._lease_id is not None:
            try:
                client = self._client or connect(self._endpoint)
                self._client = client
                self.ops.count("lease_revoke")
                await asyncio.wait_for(client.revoke_lease(self._lease_id), OP_TIMEOUT)
                log.info("unregistered %s from etcd %s", self.key, self._endpoint)
            except Exception as e:  # noqa: BLE001 - shutting down: the lease will expire anyway
                log.warning("could not revoke the etcd lease of %s (%s); the key goes in %ds",
                            self.key, describe_error(e), self._ttl)
            self._lease_id = None
        await self._drop_client()

    # --- internals -------------------------------------------------------------------

    async def _register(self) -> None:
        """Grant a fresh lease and put the key under it."""
        self._client = self._client or connect(self._endpoint)
        self.ops.count("lease_grant")
        lease = await asyncio.wait_for(self._client.lease(self._ttl), OP_TIMEOUT)
        self._lease_id = lease.id
        self.ops.count("put")
        await asyncio.wait_for(self._client.put(self._key, self._value, lease=lease.id), OP_TIMEOUT)
        self._registered = True

    async def _check(self) -> None:
        """Refresh the lease; register again if it is gone, rewrite the key if it is not ours."""
        self._client = self._client or connect(self._endpoint)
        self.ops.count("lease_refresh")
        reply = await asyncio.wait_for(self._client.refresh_lease(self._lease_id), OP_TIMEOUT)
        if reply is None or reply.TTL <= 0:
            log.warning("etcd lease of %s is gone (expired or revoked); registering again", self.key)
            self._registered = False
            await self._register()
            return
        self.ops.count("get")
        kv = await asyncio.wait_for(self._client.get(self._key), OP_TIMEOUT)
        if kv is None or kv.lease != self._lease_id or kv.value != self._value:
            log.warning("etcd key %s is %s; writing it again", self.key,
                        "missing" if kv is None else "not ours")
            self.ops.count("put")
            await asyncio.wait_for(
                self._client.put(self._key, self._value, lease=self._lease_id), OP_TIMEOUT
            )
        self._registered = True

    async def _keep_alive(self) -> None:
        interval = self._ttl / 3
        backoff = Backoff(cap=interval)
        outage = False
        while True:
            await asyncio.sleep(backoff.next() if outage else interval)
            try:
                await self._check()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a worker must survive any etcd trouble
                if not isinstance(e, EXPECTED_ERRORS):
                    log.exception("etcd %s: unexpected error keeping %s registered", self._endpoint, self.key)
                self._registered = False
                await self._drop_client()
                if not outage:
                    log.warning("etcd %s unreachable (%s); %s stays served, retrying",
                                self._endpoint, describe_error(e), self.key)
                outage = True
                continue
            if outage:
                log.info("etcd %s reachable again; %s registered", self._endpoint, self.key)
                outage = False
                backoff.reset()

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await close_client(client)
