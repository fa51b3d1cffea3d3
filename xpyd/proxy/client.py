"""Posting to workers: the proxy's pooled HTTP sessions and the calls made over them.

Three pools, one per kind of call, so that none can starve another (`WorkerSessions`): decode streams are held
for a whole generation, prefill POSTs wait for a prompt's first token, and control calls (health and stats
probes, KV events, releases) are short and must get through whatever the others hold: with one pool, 1,000
streams waiting on their prefill held every connection, probes timed out and workers were marked down.

Prefill POSTs and decode streams, two calls a client request, go over ``xpyd.proxy.h1client`` (a lean HTTP/1.1
client: with instant workers it costs the proxy 38 us a JSON call where aiohttp's took 85); control calls,
a few a second, over aiohttp.

A POST that the worker's side of a pooled connection cut before answering (the worker let the connection go
as idle just as the proxy reused it: the two keep-alive clocks race, and on a loaded machine the proxy's event
loop lags seconds behind its own timer) is sent once more on a new connection, not counted as the worker being
unreachable: 64 workers on 2 cores lost 600 of 1,000 requests to this. A worker that refuses connections is
unreachable at once (no second try).

``WorkerClient.prefill`` returns prefill's first token; ``open_decode`` returns
the decode worker's open SSE stream (``DecodeStream``); ``release_later`` asks a
worker, in the background, to drop a request. Every failure is an
``UpstreamError`` (see ``xpyd.proxy.upstream``). How a client request uses
these calls is ``xpyd.proxy.pd_call``.

With the workers' cluster token, every call over the session carries the bearer derived from it
(``worker_headers``) and every request id sent is signed (``WorkerClient``): the request id the proxy
keeps, logs and names its calls by stays the unsigned one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import aiohttp

from xpyd.api.openai import RequestKind
from xpyd.api.responses import dumps
from xpyd.api.timing import ASK, TIMING_HEADER
from xpyd.discovery.types import WorkerInfo
from xpyd.netaddr import PROXY_KEEP_ALIVE
from xpyd.proxy.decode_stream import DecodeStream
from xpyd.proxy.h1client import Disconnected, H1Pool, Response
from xpyd.proxy.upstream import Fault, UpstreamError, raise_for_status, upstream_errors, who
from xpyd.proxy.worker_api import ABORT_PATH, REQUEST_ID_HEADER, ROUTES, FirstToken, parse_first_token
from xpyd.signal.request_id import ClusterKeys

log = logging.getLogger(__name__)

# Fault and UpstreamError are imported from here too (xpyd.proxy.upstream is their home).
__all__ = ["DecodeStream", "Fault", "UpstreamError", "WorkerClient", "WorkerSessions", "worker_headers",
           "worker_session", "worker_sessions"]

RELEASE_TIMEOUT = 2.0
CONTROL_PER_WORKER = 8  # control connections to one worker at most (a probe, a KV-events poll, releases)


def worker_headers(cluster_token: str | None) -> dict[str, str]:
    """The headers every call to a worker carries: the cluster's bearer, with a token (else none)."""
    if cluster_token is None:
        return {}
    return {"Authorization": f"Bearer {ClusterKeys(cluster_token).http_bearer}"}


@dataclass(frozen=True, slots=True)
class WorkerSessions:
    """The proxy's pools to its workers, one per kind of call (see the module's docstring)."""

    prefill: H1Pool  # prefill POSTs: up to max_connections in use
    decode: H1Pool  # decode streams: up to max_connections in use, each held for a generation
    control: aiohttp.ClientSession  # probes, KV events, tokenizer, releases: CONTROL_PER_WORKER per worker

    async def close(self) -> None:
        for session in (self.prefill, self.decode, self.control):
            await session.close()


def worker_sessions(connect_timeout: float, read_timeout: float, max_connections: int,
                    cluster_token: str | None = None) -> WorkerSessions:
    """The three pools, each with the cluster's bearer on every call when ``cluster_token`` is set."""
    headers = worker_headers(cluster_token)
    return WorkerSessions(
        prefill=H1Pool(connect_timeout, read_timeout, max_connections, PROXY_KEEP_ALIVE, headers),
        decode=H1Pool(connect_timeout, read_timeout, max_connections, PROXY_KEEP_ALIVE, headers),
        control=worker_session(connect_timeout, read_timeout, 0, cluster_token, per_worker=CONTROL_PER_WORKER),
    )


def worker_session(
    connect_timeout: float, read_timeout: float, max_connections: int, cluster_token: str | None = None,
    per_worker: int = 0,
) -> aiohttp.ClientSession:
    """A pooled session to workers of at most ``max_connections`` connections (0: no total limit) and
    ``per_worker`` to one worker (0: no limit), with the cluster's bearer on every call when ``cluster_token``
    is set (the control calls' pool)."""
    timeout = aiohttp.ClientTimeout(
        total=None,  # streams may run long; every read has its own limit instead
        sock_connect=connect_timeout,
        sock_read=read_timeout,
    )
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=per_worker,
                                     keepalive_timeout=PROXY_KEEP_ALIVE)  # (below the workers')
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=worker_headers(cluster_token))


class WorkerClient:
    """Posts to workers over the pools of ``worker_sessions`` (owned by the caller): prefill POSTs, decode
    streams and releases each over their own; with ``cluster_token``, each request id goes out signed."""

    def __init__(self, sessions: WorkerSessions, connect_timeout: float,
                 cluster_token: str | None = None, timing: bool = False,
                 heard: Callable[[WorkerInfo], None] | None = None) -> None:
        self._sessions = sessions
        self._heard = heard  # told when a worker's answer or stream brings bytes (``WorkerTable.heard``)
        self._ask = {TIMING_HEADER: ASK} if timing else {}  # the workers' own timing (xpyd.api.timing)
        self.connect_timeout = connect_timeout
        self._keys = ClusterKeys(cluster_token) if cluster_token is not None else None
        self._releases: set[asyncio.Task] = set()

    def wire_id(self, request_id: str) -> str:
        """``request_id`` as the workers are sent it: signed when the proxy has the cluster token."""
        return request_id if self._keys is None else self._keys.sign(request_id)

    def release_later(self, worker: WorkerInfo, request_id: str) -> None:
        """In the background: ``POST /xpyd/abort`` so ``worker`` drops ``request_id`` (best effort)."""
        try:
            task = asyncio.get_running_loop().create_task(self._release(worker, request_id))
        except RuntimeError:  # no loop (shutting down): the worker's kv_ttl frees it
            return
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, worker: WorkerInfo, request_id: str) -> None:
        try:
            async with self._sessions.control.post(worker.http_url + ABORT_PATH,
                                          headers={REQUEST_ID_HEADER: self.wire_id(request_id)},
                                          timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT)) as resp:
                await resp.read()
        except (TimeoutError, aiohttp.ClientError, RuntimeError) as e:  # RuntimeError: session closed
            log.debug("%s: abort on %s failed: %s", request_id, worker.http_url, e)

    async def _send(self, pool: H1Pool, worker: WorkerInfo, kind: RequestKind, body: dict,
                    request_id: str, sent: asyncio.Event | None = None) -> Response:
        """POST over ``pool``; if the worker cut the connection before answering (not a refused connect: that
        worker is unreachable), once more over a new connection (see the module's docstring)."""
        data = dumps(body)
        headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: self.wire_id(request_id), **self._ask}
        try:
            return await pool.post(worker.http_url, ROUTES[kind], data, headers, sent)
        except Disconnected as e:
            if e.answered:
                raise
            log.info("%s: %s cut its %sconnection before answering; once more on a new one", request_id,
                     worker.http_url, "pooled " if e.reused else "")
            resp = await pool.post(worker.http_url, ROUTES[kind], data, headers, sent, fresh=True)
            if resp.status == 409:  # it had taken the first one after all (then lost its answer): a duplicate
                resp.close()
                self.release_later(worker, request_id)  # (the first one, which nobody waits for)
                raise UpstreamError(502, f"{who(worker)} cut the connection of a request it had taken (its second "
                                    "try was a duplicate)", worker=worker, fault=Fault.UNREACHABLE) from e
            return resp

    async def prefill(
        self, worker: WorkerInfo, kind: RequestKind, body: dict, request_id: str
    ) -> FirstToken:
        began = time.monotonic()  # (its span: xpyd.proxy.phases)
        with upstream_errors(worker):
            async with await self._send(self._sessions.prefill, worker, kind, body, request_id) as resp:
                await raise_for_status(resp, worker)
                data = json.loads(await resp.read())
            if self._heard is not None:
                self._heard(worker)
            first = parse_first_token(data, kind, resp.headers.get(TIMING_HEADER) if self._ask else None)
            return replace(first, span=(began, time.monotonic()))

    async def open_decode(
        self, worker: WorkerInfo, kind: RequestKind, body: dict, request_id: str,
        sent: asyncio.Event | None = None,
    ) -> DecodeStream:
        """Post to decode; ``sent`` is set once the request is on the wire (before any answer)."""
        with upstream_errors(worker):
            resp = await self._send(self._sessions.decode, worker, kind, body, request_id, sent)
            try:
                await raise_for_status(resp, worker)
            except BaseException:
                resp.close()
                raise
        if self._heard is not None:
            self._heard(worker)
        return DecodeStream(resp, worker, kind, self._heard)
