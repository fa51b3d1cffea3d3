"""Colocated mode: the same proxy API in front of one worker that does prefill and decode itself.

This is the traditional setup disaggregation is compared against (``xpyd up
--colocated``): requests are validated the same way, then forwarded as they are
and the worker's answer (JSON or SSE) is passed back unchanged, but for its errors: as with the P/D proxy,
no internal address or request id reaches the client (``http_errors.Redactor``), and ``X-Request-Id`` is
the client's own or the response id. With ``expose_worker_names`` every answer the worker gave carries
``x-xpyd-workers: colocated=<name>`` (an opaque name: ``worker_names``). With ``expose_worker_timing`` the
worker is asked for its own timing of a streamed answer and its comment (``xpyd.api.timing``) is passed on;
without, a timing comment is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
import json
from collections.abc import AsyncIterator, Callable

import aiohttp
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from xpyd.api.identity import client_request_id
from xpyd.api.openai import APIError, RequestKind, check_content_type, parse_request
from xpyd.api.responses import dumps, models_response, new_response_id
from xpyd.api.timing import ASK, COMMENT_PREFIX, TIMING_HEADER
from xpyd.discovery.types import WorkerInfo
from xpyd.netaddr import PROXY_KEEP_ALIVE
from xpyd.proxy.admission import ApiKey, ConcurrencyLimit, Slot
from xpyd.proxy.http_errors import Redactor
from xpyd.proxy.metrics import Outcome, ProxyMetrics
from xpyd.proxy.worker_names import WORKERS_HEADER, WorkerNames
from xpyd.signal.request_id import RequestId

log = logging.getLogger(__name__)

_PATHS = {RequestKind.COMPLETION: "/v1/completions", RequestKind.CHAT: "/v1/chat/completions"}
_ENDPOINTS = _PATHS  # metric label: the route


async def fetch_info(session: aiohttp.ClientSession, url: str, timeout: float) -> WorkerInfo:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(url + "/xpyd/info", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status == 200:
                    return WorkerInfo.from_json(await r.read())
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"colocated worker {url} not ready within {timeout:g}s")
        await asyncio.sleep(0.25)


def _error(e: APIError) -> Response:
    return Response(dumps(e.to_dict()), status=e.status, content_type="application/json")


def create_colocated_app(config, url: str) -> Quart:
    """``config`` is the proxy's ProxyConfig; ``url`` the colocated worker's HTTP URL."""
    url = url.rstrip("/")
    app = Quart("xpyd.proxy.colocated")
    app.config.update(MAX_CONTENT_LENGTH=config.max_body_bytes, RESPONSE_TIMEOUT=None)
    metrics = ProxyMetrics()
    state: dict = {}
    api_key = ApiKey(config.api_key) if config.api_key is not None else None
    limit = ConcurrencyLimit(config.max_concurrent_requests)  # as the P/D proxy: 429 beyond it
    redactor = Redactor(lambda: [state["info"]] if "info" in state else [])
    worker_name = WorkerNames(config.cluster_token).colocated(url) if config.expose_worker_names else None

    @app.before_request
    async def check_api_key() -> None:  # as the P/D proxy: all but /health need the key when set
        if api_key is not None and request.path != "/health":
            api_key.check(request.headers.get("Authorization"))

    @app.before_serving
    async def open_session() -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout,
                                        sock_read=config.read_timeout)
        state["session"] = aiohttp.ClientSession(timeout=timeout,
                                                 connector=aiohttp.TCPConnector(limit=config.max_connections,
                                                                                keepalive_timeout=PROXY_KEEP_ALIVE))
        state["info"] = await fetch_info(state["session"], url, config.discovery_timeout)

    @app.after_serving
    async def close_session() -> None:
        await state["session"].close()

    def model() -> str:
        return config.model_name or state["info"].model_id

    @app.get("/health")
    async def health() -> Response:
        return Response(dumps({"status": "ok", "colocated": 1}), content_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(dumps(models_response([model()])), content_type="application/json")

    @app.get("/metrics")
    async def metrics_route() -> Response:
        metrics.set_workers("colocated", 1, 0)
        body, content_type = metrics.render()
        return Response(body, content_type=content_type)

    @app.errorhandler(APIError)
    async def api_error(e: APIError) -> Response:
        return _error(e)

    @app.errorhandler(413)
    async def too_large(_e) -> Response:
        return _error(APIError(413, f"Request body larger than {config.max_body_bytes} bytes."))

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException) -> Response:  # 404, 405 ...: JSON like every other error
        status = e.code or 500
        message = f"{e.name}: {e.description}" if e.description else str(e.name)
        return _error(APIError(status, message, type="invalid_request_error" if status < 500 else "server_error"))

    @app.errorhandler(Exception)
    async def internal_error(_e: Exception) -> Response:
        log.exception("unhandled error")
        return _error(APIError(500, "internal error in the proxy", type="server_error"))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await forward(RequestKind.COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return await forward(RequestKind.CHAT)

    async def forward(kind: RequestKind) -> Response:
        timer = metrics.request(_ENDPOINTS[kind])
        slot: Slot | None = None
        try:
            return await _forward(kind, timer, slot := limit.acquire())
        except APIError as e:
            if slot is None:  # refused at the door
                timer.end(Outcome.CLIENT_ERROR)
            raise
        finally:
            if slot is not None and not slot.handed_off:
                slot.release()

    async def _forward(kind: RequestKind, timer, slot: Slot) -> Response:
        try:
            client_id = client_request_id(request.headers.get("X-Request-Id"))
            check_content_type(request.headers.get("Content-Type"))
            req = parse_request(await request.get_data(cache=False), kind)
            if req.model is not None and req.model != model():
                raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                               code="model_not_found")
            info: WorkerInfo = state["info"]
            body = dict(req.raw)
            body["model"] = info.model_id
            rid = RequestId.new(info.signal_addr, info.signal_addr)
            asked = {TIMING_HEADER: ASK} if config.expose_worker_timing and req.stream else {}
            resp = await state["session"].post(url + _PATHS[kind], json=body,
                                               headers={"X-Request-Id": str(rid), **asked})
        except APIError as e:
            timer.end(Outcome.CLIENT_ERROR if e.status < 500 else Outcome.UNAVAILABLE)
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            timer.end(Outcome.UPSTREAM_ERROR)
            log.warning("colocated worker %s unreachable: %s", url, e)
            raise APIError(502, "colocated worker unreachable", type="server_error") from None
        # (the worker names an answer it was not given a name for by the id's random part)
        headers = {"X-Request-Id": client_id or new_response_id(kind, rid.uid)}
        if worker_name is not None:
            headers[WORKERS_HEADER] = worker_name
        if resp.status != 200 or not req.stream:
            data = await resp.read()
            resp.release()
            if resp.status == 200:
                timer.first_token()
            else:
                data = _redacted(data, redactor, str(rid), headers["X-Request-Id"])
            timer.end(Outcome.OK if resp.status == 200 else
                      (Outcome.CLIENT_ERROR if resp.status < 500 else Outcome.UPSTREAM_ERROR))
            return Response(data, status=resp.status, content_type="application/json", headers=headers)
        slot.handed_off = True  # the stream now holds the place until it ends

        def redact(data: bytes) -> bytes:
            return _redacted(data, redactor, str(rid), headers["X-Request-Id"])
        return Response(_relay(resp, timer, slot, redact, timing=bool(asked)), status=200,
                        content_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})

    return app


def _redacted(data: bytes, redactor: Redactor, request_id: str, public_id: str) -> bytes:
    """A worker's error body (JSON, or one SSE event's data) without internal addresses or ids."""
    try:
        doc = json.loads(data)
    except ValueError:
        return data
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return data
    error["message"] = redactor.text(error["message"], request_id, public_id)
    return dumps(doc)


async def _relay(resp: aiohttp.ClientResponse, timer, slot: Slot,
                 redact: Callable[[bytes], bytes], timing: bool = False) -> AsyncIterator[bytes]:
    outcome = Outcome.ABORTED
    first = True
    try:
        async for line in resp.content:  # line by line: an error event is redacted before it is sent
            if line.startswith(COMMENT_PREFIX) and not timing:
                continue  # (the blank line after it goes on: an empty event, skipped by every reader)
            if line.startswith(b'data: {"error"'):
                line = b"data: " + redact(line[6:].strip()) + b"\n"
            elif line.startswith(b"data: {"):
                if first:
                    timer.first_token()
                    first = False
                else:
                    timer.token()
            yield line
        outcome = Outcome.OK
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        outcome = Outcome.UPSTREAM_ERROR
        log.warning("colocated stream failed: %s", e)
        error = APIError(502, "colocated worker failed", type="server_error").to_dict()
        yield b"data: " + dumps(error) + b"\n\ndata: [DONE]\n\n"
    finally:
        resp.release()
        slot.release()
        timer.end(outcome)
