"""The proxy's HTTP front: an OpenAI-compatible server backed by P/D worker pairs.

A request moves through::

    read body (size limit) -> parse_request (400s stop here) -> model check (404)
    -> Router picks prefill + decode (503 if none) -> RequestId.new(p, d)
    -> PDCall: prefill and decode called at once
    -> prefill's first token goes to the client as soon as it arrives (TTFT)
    -> decode's deltas follow; usage chunk if asked; [DONE]

To the client it looks like a single OpenAI/vLLM server: one response id and
``created`` per request, the served model name, and errors in OpenAI's shape.
The registry's lifecycle (start/close) belongs to the caller; the app owns the
pooled HTTP session (opened before serving, closed after).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from xpyd.api.openai import APIError, CompletionRequest, RequestKind, parse_request
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
from xpyd.discovery.types import Role
from xpyd.proxy.client import REQUEST_ID_HEADER, FirstToken, PDCall, WorkerClient
from xpyd.proxy.routing import NoWorkerError, Router
from xpyd.signal.request_id import RequestId

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # None: the model the workers report
    prefill_urls: tuple[str, ...] = ()  # static discovery
    decode_urls: tuple[str, ...] = ()
    connect_timeout: float = 10.0  # TCP connect to a worker
    read_timeout: float = 300.0  # each read from a worker: prefill's answer, each stream chunk
    discovery_timeout: float = 120.0  # static discovery: wait this long for workers to be ready
    max_body_bytes: int = 4 * 1024 * 1024  # larger client bodies get 413
    max_connections: int = 1024  # pooled connections to workers

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.model_name is not None and not self.model_name.strip():
            raise ValueError("model_name must not be blank")
        for name in ("connect_timeout", "read_timeout", "discovery_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for url in (*self.prefill_urls, *self.decode_urls):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"worker URL must look like http://host:port, got {url!r}")


def _json(obj: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(obj), status=status, content_type="application/json", headers=headers)


def _error(e: APIError) -> Response:
    return _json(e.to_dict(), e.status)


class Proxy:
    """Request handling; one instance per app, holding the router and the worker client."""

    def __init__(self, config: ProxyConfig, registry: Registry) -> None:
        self.config = config
        self.registry = registry
        self.router = Router()
        self._session: aiohttp.ClientSession | None = None
        self._client: WorkerClient | None = None

    async def open(self) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None,  # streams may run long; every read has its own limit instead
            sock_connect=self.config.connect_timeout,
            sock_read=self.config.read_timeout,
        )
        connector = aiohttp.TCPConnector(limit=self.config.max_connections)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self._client = WorkerClient(self._session)

    async def close(self) -> None:
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
        counts = {role.value: len(self.registry.workers(role)) for role in Role}
        ok = all(counts.values())
        return _json({"status": "ok" if ok else "unavailable", **counts}, 200 if ok else 503)

    def models(self) -> Response:
        name = self.served_model()
        return _json(models_response([name] if name else []))

    async def generate(self, kind: RequestKind) -> Response:
        if self._client is None:
            raise APIError(503, "proxy is not serving yet", type="server_error")
        req = parse_request(await request.get_data(cache=False), kind)
        model = self.served_model()
        if model is None:
            raise APIError(503, "no workers available", type="server_error")
        if req.model is not None and req.model != model:
            raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                           code="model_not_found")
        try:
            prefill = self.router.pick(Role.PREFILL, self.registry.workers(Role.PREFILL))
            decode = self.router.pick(Role.DECODE, self.registry.workers(Role.DECODE))
        except NoWorkerError as e:
            raise APIError(503, str(e), type="server_error") from None
        request_id = str(RequestId.new(prefill.signal_addr, decode.signal_addr))
        call = PDCall(self._client, req, prefill, decode, request_id)
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            first = await call.first_token()
        except BaseException as e:
            await call.aclose()
            if isinstance(e, APIError):  # a worker refused (4xx) or failed (5xx)
                level = logging.INFO if e.status < 500 else logging.WARNING
                log.log(level, "%s: %s (HTTP %d)", request_id, e.message, e.status)
            raise
        if req.stream:
            body = _stream(call, req, first, model)
            # If the client leaves before the body starts, the generator never runs
            # its finally; drop the upstream calls when it is collected instead.
            weakref.finalize(body, call.abort)
            headers["Cache-Control"] = "no-cache"
            return Response(body, status=200, content_type="text/event-stream", headers=headers)
        try:
            return _json(await _complete(call, req, first, model), headers=headers)
        finally:
            await call.aclose()


async def _complete(call: PDCall, req: CompletionRequest, first: FirstToken, model: str) -> dict:
    parts, finish_reason = [first.text], first.finish_reason
    async for delta in call.rest():
        parts.append(delta.text)
        finish_reason = delta.finish_reason or finish_reason
    usage = call.usage
    return completion_response(
        new_response_id(req.kind), int(time.time()), model, req.kind, "".join(parts),
        finish_reason, usage.prompt_tokens, usage.completion_tokens,
    )


async def _stream(
    call: PDCall, req: CompletionRequest, first: FirstToken, model: str
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
                if delta.finish_reason is not None or delta.text:
                    yield chunk(delta.text or None, delta.finish_reason)
        if req.include_usage:
            usage = call.usage
            yield sse(usage_chunk(rid, created, model, kind, usage.prompt_tokens,
                                  usage.completion_tokens))
        yield SSE_DONE
    except APIError as e:  # the status line is already sent: report in-stream, as vLLM does
        log.warning("%s: %s (in stream)", call.request_id, e.message)
        yield sse(APIError(e.status, e.message, type=e.type).to_dict())
        yield SSE_DONE
    except Exception:
        log.exception("%s: streaming failed", call.request_id)
        yield sse(APIError(500, "internal error in the proxy", type="server_error").to_dict())
        yield SSE_DONE
    finally:
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
