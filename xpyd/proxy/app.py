"""The proxy's HTTP front: an OpenAI-compatible server backed by P/D worker pairs.

A request moves through::

    API key (401, when one is set) -> concurrency limit (429) -> Content-Type (415)
    -> read body (size limit, 413) -> parse_request (400s stop here) -> model check (404)
    -> every decode worker full: wait in the bounded queue (503 when full or timed out)
    -> Router picks prefill + decode among the UP workers (503 if a role has none)
    -> RequestId.new(p, d) -> PDCall: prefill and decode called at once
    -> a worker unreachable before the client got anything: it is marked down and
       the request starts over once on a fresh pair (new id)
    -> prefill's first token goes to the client as soon as it arrives (TTFT)
    -> decode's deltas follow; usage chunk if asked; [DONE]
       (a failure after the first byte ends the stream with an error event; so does the
       prefill worker going down before decode has the KV: see ``Proxy._worker_down``)

To the client it looks like a single OpenAI/vLLM server: one response id and
``created`` per request, the served model name, and errors in OpenAI's shape.
``GET /cluster`` shows every worker with its health and load; ``GET /metrics``
the proxy's Prometheus metrics (``xpyd.proxy.metrics``). With an API key set,
everything but ``GET /health`` needs ``Authorization: Bearer KEY`` (``/cluster``
shows internal addresses, ``/metrics`` traffic; Prometheus can send the key). The registry's
lifecycle (start/close) belongs to the caller; the app owns the pooled HTTP
session and the health poller (started before serving, stopped after).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable

import aiohttp
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from xpyd.api.openai import APIError, CompletionRequest, RequestKind, check_content_type, parse_request
from xpyd.api.responses import (
    SSE_DONE,
    completion_response,
    dumps,
    models_response,
    new_response_id,
    sse,
    stream_chunk,
    usage_chunk,
)
from xpyd.discovery.base import Registry
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.admission import (
    RETRY_AFTER_SECONDS,
    ApiKey,
    ConcurrencyLimit,
    DecodeQueue,
    Slot,
    decode_room,
)
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.client import (
    REQUEST_ID_HEADER,
    Fault,
    FirstToken,
    PDCall,
    UpstreamError,
    WorkerClient,
    worker_session,
)
from xpyd.proxy.metrics import Outcome, ProxyMetrics, RequestTimer, outcome_of
from xpyd.proxy.poller import HealthPoller
from xpyd.proxy.routing import NoWorkerError, Router, make_router
from xpyd.proxy.workers import Health, WorkerTable
from xpyd.signal.request_id import RequestId

log = logging.getLogger(__name__)

__all__ = ["ProxyConfig", "create_app"]

_ENDPOINTS = {RequestKind.COMPLETION: "/v1/completions", RequestKind.CHAT: "/v1/chat/completions"}


def _json(obj: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(obj), status=status, content_type="application/json", headers=headers)


def _error(e: APIError) -> Response:
    headers = None
    if e.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif e.status in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return _json(e.to_dict(), e.status, headers)


class Proxy:
    """Request handling; one instance per app, holding the router and the worker client."""

    def __init__(self, config: ProxyConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.table = WorkerTable()
        self.router: Router = make_router(config.policy, self.table)
        self.metrics = ProxyMetrics()
        self.api_key = ApiKey(config.api_key) if config.api_key is not None else None
        self.limit = ConcurrencyLimit(config.max_concurrent_requests)
        self.queue = DecodeQueue(self._decode_room, config.max_queue, config.queue_timeout)
        self._calls: set[_TrackedCall] = set()  # in flight, to end them when their prefill worker dies
        self.table.on_down(self._worker_down)
        self._session: aiohttp.ClientSession | None = None
        self._client: WorkerClient | None = None
        self._poller: HealthPoller | None = None

    async def open(self) -> None:
        c = self.config
        self._session = worker_session(c.connect_timeout, c.read_timeout, c.max_connections)
        self._client = WorkerClient(self._session, c.connect_timeout)
        self._poller = HealthPoller(self.registry, self.table, self._session,
                                    c.poll_interval, c.poll_timeout, on_probe=self.queue.wake)
        self._poller.start()

    async def close(self) -> None:
        if self._poller is not None:
            await self._poller.close()
            self._poller = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def served_model(self) -> str | None:
        if self.config.model_name is not None:
            return self.config.model_name
        for role in Role:
            workers = self.registry.workers(role)
            if workers:
                return workers[0].model_id
        return None

    def health(self) -> Response:
        up = {role.value: sum(s.health is Health.UP
                              for s in self.table.sync(role, self.registry.workers(role)))
              for role in Role}
        ok = all(up.values())
        return _json({"status": "ok" if ok else "unavailable", **up}, 200 if ok else 503)

    def models(self) -> Response:
        name = self.served_model()
        return _json(models_response([name] if name else []))

    def cluster(self) -> Response:
        workers = [state.to_dict() for role in Role
                   for state in self.table.sync(role, self.registry.workers(role))]
        queue = {"waiting": self.queue.waiting, "max": self.config.max_queue,
                 "active_requests": self.limit.active}
        return _json({"workers": workers, "policy": self.router.policy.value, "queue": queue})

    def metrics_response(self) -> Response:
        for role in Role:
            states = self.table.sync(role, self.registry.workers(role))
            up = sum(s.health is Health.UP for s in states)
            self.metrics.set_workers(role.value, up, len(states) - up)
        self.metrics.set_queue(self.queue.waiting)
        body, content_type = self.metrics.render()
        return Response(body, content_type=content_type)

    def check_api_key(self) -> None:
        """Before every route but ``/health``: 401 unless the request carries the key (when one is set)."""
        if self.api_key is not None and request.path != "/health":
            self.api_key.check(request.headers.get("Authorization"))

    async def generate(self, kind: RequestKind) -> Response:
        timer = self.metrics.request(_ENDPOINTS[kind])
        slot: Slot | None = None
        try:
            slot = self.limit.acquire()
            return await self._generate(kind, timer, slot)
        except BaseException as e:
            timer.end(outcome_of(e))
            raise
        finally:
            if slot is not None and not slot.handed_off:
                slot.release()

    async def _generate(self, kind: RequestKind, timer: RequestTimer, slot: Slot) -> Response:
        if self._client is None:
            raise APIError(503, "proxy is not serving yet", type="server_error")
        check_content_type(request.headers.get("Content-Type"))
        req = parse_request(await request.get_data(cache=False), kind)
        model = self.served_model()
        if model is None:
            raise APIError(503, "no workers available", type="server_error")
        if req.model is not None and req.model != model:
            raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                           code="model_not_found")
        failed: UpstreamError | None = None
        retries = self.config.retries
        await self.queue.wait()  # returns when a decode worker has room; route before the next await
        while True:
            call = self._start(self._client, req, failed)
            streaming = False
            try:
                first = await call.first_token()
                timer.first_token()
                headers = {REQUEST_ID_HEADER: call.request_id}
                if req.stream:
                    streaming = True  # from here the body owns the call, the timer and the slot
                    call.hold(slot)
                    return self._stream_response(call, req, first, model, headers, timer)
                body = await _complete(call, req, first, model, timer)
                timer.end(Outcome.OK)
                return _json(body, headers=headers)
            except UpstreamError as e:
                self.worker_failed(e)
                if e.fault is Fault.UNREACHABLE and retries > 0:
                    log.warning("%s: %s; retrying on another pair", call.request_id, e.message)
                    failed, retries = e, retries - 1
                    continue
                level = logging.INFO if e.status < 500 else logging.WARNING
                log.log(level, "%s: %s (HTTP %d)", call.request_id, e.message, e.status)
                raise
            finally:
                if not streaming:
                    await call.aclose()

    def _start(self, client: WorkerClient, req: CompletionRequest,
               failed: UpstreamError | None) -> "_TrackedCall":
        try:
            prefill = self.router.pick(Role.PREFILL, self.registry.workers(Role.PREFILL))
            decode = self.router.pick(Role.DECODE, self.registry.workers(Role.DECODE))
        except NoWorkerError as e:
            why = f" (after: {failed.message})" if failed is not None else ""
            raise APIError(503, f"{e}{why}", type="server_error") from None
        request_id = str(RequestId.new(prefill.signal_addr, decode.signal_addr))
        return _TrackedCall(client, req, prefill, decode, request_id, self)

    def _decode_room(self) -> int | None:
        return decode_room(self.table.sync(Role.DECODE, self.registry.workers(Role.DECODE)))

    def _worker_down(self, worker: WorkerInfo, reason: str, unreachable: bool) -> None:
        """A prefill worker is gone: its requests whose KV decode has not pulled yet cannot finish.

        Their decode worker may wait for that KV until its own timeout; end them now
        (error event or 502) and drop their decode calls, which aborts them there.
        A prefill worker that answered an error or timed out is still there and may
        yet serve the pulls: its requests are left alone.
        """
        if worker.role is not Role.PREFILL or not unreachable:
            return  # a dead decode worker breaks its streams by itself
        message = f"prefill worker {worker.http_url} went down before the decode worker had the request's KV"
        # UNREACHABLE: a non-streaming request (the client has seen nothing yet) starts over on a fresh pair.
        ended = sum(call.prefill_lost(UpstreamError(502, f"{message} ({reason})", worker=worker,
                                                    fault=Fault.UNREACHABLE))
                    for call in list(self._calls) if call.prefill_url == worker.http_url)
        if ended:
            log.warning("ended %d request(s) waiting for KV from %s", ended, worker.http_url)

    def worker_failed(self, e: APIError) -> None:
        """Mark the worker behind ``e`` down if the failure says it is unhealthy."""
        if isinstance(e, UpstreamError) and e.worker is not None and e.fault is not Fault.NONE:
            self.table.mark_down(e.worker, e.message, unreachable=e.fault is Fault.UNREACHABLE)

    def _stream_response(self, call: "_TrackedCall", req: CompletionRequest, first: FirstToken,
                         model: str, headers: dict, timer: RequestTimer) -> Response:
        body = _stream(call, req, first, model, self.worker_failed, timer)
        # If the client leaves before the body starts, the generator never runs
        # its finally; drop the upstream calls when it is collected instead.
        weakref.finalize(body, _abandon, call, timer)
        headers["Cache-Control"] = "no-cache"
        return Response(body, status=200, content_type="text/event-stream", headers=headers)


class _TrackedCall(PDCall):
    """A PDCall that tells the router (and the proxy) when it starts and, exactly once, when it ends.

    A streaming call also holds its request's concurrency slot until then.
    """

    def __init__(self, client: WorkerClient, req: CompletionRequest, prefill: WorkerInfo,
                 decode: WorkerInfo, request_id: str, proxy: Proxy) -> None:
        super().__init__(client, req, prefill, decode, request_id)
        self._proxy = proxy
        self._workers = (prefill, decode)
        self._slot: Slot | None = None
        for worker in self._workers:
            proxy.router.started(worker)
        proxy._calls.add(self)

    def hold(self, slot: Slot) -> None:
        slot.handed_off = True
        self._slot = slot

    def abort(self) -> None:
        super().abort()
        workers, self._workers = self._workers, ()
        if not workers:
            return
        for worker in workers:
            self._proxy.router.finished(worker)
        self._proxy._calls.discard(self)
        if self._slot is not None:
            self._slot.release()
        self._proxy.queue.wake()


def _abandon(call: PDCall, timer: RequestTimer) -> None:
    call.abort()
    timer.end(Outcome.ABORTED)  # no-op if the body ran to its end


async def _complete(call: PDCall, req: CompletionRequest, first: FirstToken, model: str,
                    timer: RequestTimer) -> dict:
    parts, finish_reason = [first.text], first.finish_reason
    async for delta in call.rest():
        timer.token()
        parts.append(delta.text)
        finish_reason = delta.finish_reason or finish_reason
    usage = call.usage
    return completion_response(
        new_response_id(req.kind), int(time.time()), model, req.kind, "".join(parts),
        finish_reason, usage.prompt_tokens, usage.completion_tokens,
    )


async def _stream(
    call: PDCall, req: CompletionRequest, first: FirstToken, model: str,
    on_error: Callable[[APIError], None], timer: RequestTimer,
) -> AsyncIterator[bytes]:
    kind, rid, created = req.kind, new_response_id(req.kind), int(time.time())

    def chunk(text: str | None, finish_reason: str | None, role: bool = False) -> bytes:
        return sse(stream_chunk(rid, created, model, kind, text, finish_reason, role=role))

    try:
        if kind is RequestKind.CHAT:
            yield chunk(None, None, role=True)
        if first.finish_reason is not None:
            yield chunk(first.text or None, first.finish_reason)
        else:
            if first.text:
                yield chunk(first.text, None)
            async for delta in call.rest():
                timer.token()
                if delta.finish_reason is not None or delta.text:
                    yield chunk(delta.text or None, delta.finish_reason)
        if req.include_usage:
            usage = call.usage
            yield sse(usage_chunk(rid, created, model, kind, usage.prompt_tokens,
                                  usage.completion_tokens))
        timer.end(Outcome.OK)
        yield SSE_DONE
    except APIError as e:  # the status line is already sent: report in-stream, as vLLM does
        timer.end(outcome_of(e))
        on_error(e)
        log.warning("%s: %s (in stream)", call.request_id, e.message)
        yield sse(APIError(e.status, e.message, type=e.type).to_dict())
        yield SSE_DONE
    except Exception:
        timer.end(Outcome.INTERNAL_ERROR)
        log.exception("%s: streaming failed", call.request_id)
        yield sse(APIError(500, "internal error in the proxy", type="server_error").to_dict())
        yield SSE_DONE
    finally:
        timer.end(Outcome.ABORTED)  # no-op unless the client went away
        await call.aclose()


def create_app(config: ProxyConfig, registry: Registry) -> Quart:
    """An OpenAI-compatible proxy over ``registry``'s workers (start the registry first)."""
    app = Quart("xpyd.proxy")
    app.config.update(
        MAX_CONTENT_LENGTH=config.max_body_bytes,
        RESPONSE_TIMEOUT=None,  # Quart's default (60 s) would cut long streams silently
    )
    proxy = Proxy(config, registry)
    app.extensions["xpyd.proxy"] = proxy

    app.before_serving(proxy.open)
    app.after_serving(proxy.close)
    app.before_request(proxy.check_api_key)

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await proxy.generate(RequestKind.COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await proxy.generate(RequestKind.CHAT)

    @app.get("/v1/models")
    async def models() -> Response:
        return proxy.models()

    @app.get("/health")
    async def health() -> Response:
        return proxy.health()

    @app.get("/cluster")
    async def cluster() -> Response:
        return proxy.cluster()

    @app.get("/metrics")
    async def metrics() -> Response:
        return proxy.metrics_response()

    @app.errorhandler(APIError)
    async def api_error(e: APIError) -> Response:
        return _error(e)

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException) -> Response:
        status = e.code or 500
        if status == 413:
            message = f"request body is larger than {config.max_body_bytes} bytes"
        else:
            message = f"{e.name}: {e.description}" if e.description else str(e.name)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return _error(APIError(status, message, type=kind))

    @app.errorhandler(Exception)
    async def internal_error(e: Exception) -> Response:
        log.exception("unhandled error")
        return _error(APIError(500, "internal error in the proxy", type="server_error"))

    return app
