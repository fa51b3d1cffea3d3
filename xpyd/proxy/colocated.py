"""Colocated mode: the same proxy API in front of one worker that does prefill and decode itself.

This is the traditional setup disaggregation is compared against (``xpyd up
--colocated``): requests are validated the same way, then forwarded as they are
and the worker's answer (JSON or SSE) is passed back unchanged, but for its errors: as with the P/D proxy,
no internal address or request id reaches the client (``http_errors.Redactor``), and ``X-Request-Id`` is
the client's own or the response id. With ``expose_worker_names`` every answer the worker gave carries
``x-xpyd-workers: colocated=<name>`` (an opaque name: ``worker_names``). With ``expose_worker_timing`` the
worker is asked for its own timing (``xpyd.api.timing``) and the client gets it with the proxy's phases joined
(``xpyd.api.phases``: ingress, the worker's call to its first chunk with text or its answer, network, egress):
in the stream's timing comment, or a JSON answer's ``X-Xpyd-Timing`` header; without, a timing comment is
dropped. The proxy's phases are recorded (``xpyd_proxy_phase_seconds``) either way, network only with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import json
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from xpyd.api.identity import client_request_id
from xpyd.api.openai import APIError, RequestKind, check_content_type, parse_request
from xpyd.api.responses import dumps, has_text, models_response, new_response_id
from xpyd.api.timing import ASK, COMMENT_PREFIX, TIMING_HEADER, WorkerTiming, decode_timing, timing_of_comment
from xpyd.discovery.types import WorkerInfo
from xpyd.netaddr import PROXY_KEEP_ALIVE
from xpyd.proxy.admission import ApiKey, ConcurrencyLimit, Slot
from xpyd.proxy.http_errors import Redactor, error_middleware, json_response
from xpyd.proxy.http_server import StreamedResponse, read_body
from xpyd.proxy.metrics import Outcome, ProxyMetrics, RequestTimer
from xpyd.proxy.phases import colocated_own_us, split
from xpyd.proxy.vllm_routes import register_vllm_routes
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


class _ColocatedWorker:
    """The colocated worker as ``vllm_routes`` sees a cluster: one worker, asked for /tokenize and /detokenize."""

    def __init__(self, state: dict, model: Callable[[], str]) -> None:
        self._state = state
        self._model = model

    def served_model(self) -> str | None:
        return self._model() if "info" in self._state else None

    def up_workers(self) -> list:
        return [SimpleNamespace(info=self._state["info"], stats=None)] if "info" in self._state else []

    def prompt_tokenizer(self) -> None:
        return None  # (forwarded: the worker's own tokenizer answers)

    def control_session(self) -> aiohttp.ClientSession | None:
        return self._state.get("session")


def create_colocated_app(config, url: str) -> web.Application:
    """``config`` is the proxy's ProxyConfig; ``url`` the colocated worker's HTTP URL."""
    url = url.rstrip("/")
    metrics = ProxyMetrics()
    state: dict = {}
    api_key = ApiKey(config.api_key) if config.api_key is not None else None
    limit = ConcurrencyLimit(config.max_concurrent_requests)  # as the P/D proxy: 429 beyond it
    redactor = Redactor(lambda: [state["info"]] if "info" in state else [])
    worker_name = WorkerNames(config.cluster_token).colocated(url) if config.expose_worker_names else None

    def check_api_key(request: web.Request) -> None:  # as the P/D proxy: all but /health need the key when set
        if api_key is not None and request.path != "/health":
            api_key.check(request.headers.get("Authorization"))

    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[error_middleware(config.max_body_bytes, redactor, before=check_api_key)])

    async def open_session(_app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout,
                                        sock_read=config.read_timeout)
        state["session"] = aiohttp.ClientSession(timeout=timeout,
                                                 connector=aiohttp.TCPConnector(limit=config.max_connections,
                                                                                keepalive_timeout=PROXY_KEEP_ALIVE))
        state["info"] = await fetch_info(state["session"], url, config.discovery_timeout)

    async def close_session(_app: web.Application) -> None:
        if "session" in state:
            await state["session"].close()

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)

    def model() -> str:
        return config.model_name or state["info"].model_id

    async def health(_request: web.Request) -> web.Response:
        return json_response({"status": "ok", "colocated": 1})

    async def models(_request: web.Request) -> web.Response:
        return json_response(models_response([model()]))

    async def metrics_route(_request: web.Request) -> web.Response:
        metrics.set_workers("colocated", 1, 0)
        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def completions(request: web.Request) -> web.StreamResponse:
        return await forward(request, RequestKind.COMPLETION)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await forward(request, RequestKind.CHAT)

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    register_vllm_routes(app, _ColocatedWorker(state, model), config.trust_request_chat_template)  # /tokenize, /detokenize forwarded; /version

    async def forward(request: web.Request, kind: RequestKind) -> web.StreamResponse:
        timer = metrics.request(_ENDPOINTS[kind])
        slot: Slot | None = None
        try:
            return await _forward(request, kind, timer, slot := limit.acquire())
        except APIError as e:
            if slot is None:  # refused at the door
                timer.end(Outcome.CLIENT_ERROR)
            raise
        finally:
            if slot is not None and not slot.handed_off:
                slot.release()

    async def _forward(request: web.Request, kind: RequestKind, timer, slot: Slot) -> web.StreamResponse:
        try:
            client_id = client_request_id(request.headers.get("X-Request-Id"))
            check_content_type(request.headers.get("Content-Type"))
            req = parse_request(await read_body(request), kind, config.trust_request_chat_template)
            if client_id is None and req.request_id is not None:  # (vLLM's request_id field: as the header)
                client_id = client_request_id(req.request_id, "request_id")
            if req.model is not None and req.model != model():
                raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                               code="model_not_found")
            info: WorkerInfo = state["info"]
            body = dict(req.raw)
            body["model"] = info.model_id
            # (the workers' own parameters are the proxies' to set: a client's would resume outputs, name responses)
            body.pop("kv_transfer_params", None)
            rid = RequestId.new(info.signal_addr, info.signal_addr)
            asked = {TIMING_HEADER: ASK} if config.expose_worker_timing else {}
            began = time.monotonic()  # (the worker's call: xpyd.proxy.phases)
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
            read = time.monotonic()
            resp.release()
            if resp.status == 200:
                timer.first_token()
            else:
                data = _redacted(data, redactor, str(rid), headers["X-Request-Id"])
            answer = web.Response(body=data, status=resp.status, content_type="application/json", headers=headers)
            if resp.status == 200:
                own = _header_timing(resp.headers.get(TIMING_HEADER)) if asked else None
                timer.settle(split(timer.received, (began, read), time.monotonic(), colocated_own_us(own)))
                if asked:
                    answer.headers[TIMING_HEADER] = _joined(own, timer).header()
            timer.end(Outcome.OK if resp.status == 200 else
                      (Outcome.CLIENT_ERROR if resp.status < 500 else Outcome.UPSTREAM_ERROR))
            return answer
        slot.handed_off = True  # the stream now holds the place until it ends

        def redact(data: bytes) -> bytes:
            return _redacted(data, redactor, str(rid), headers["X-Request-Id"])
        return StreamedResponse(_relay(resp, timer, slot, redact, began, timing=bool(asked)), status=200,
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


def _header_timing(value: str | None) -> WorkerTiming | None:
    try:
        return decode_timing(value) if value is not None else None
    except ValueError:  # a worker's broken timing never fails an answer: it is left out
        return None


def _has_text(line: bytes) -> bool:
    """A ``data:`` line with generated text (a content chunk, as the worker's TTFT and the client's count it)."""
    try:
        chunk = json.loads(line[len(b"data: "):])
    except ValueError:  # (not the proxy's to judge: passed on as it came)
        return False
    return isinstance(chunk, dict) and has_text(chunk)


def _joined(own: WorkerTiming | None, timer: RequestTimer) -> WorkerTiming:
    """The worker's own timing with the proxy's phases (``timer.phases``) added."""
    own = own if own is not None else WorkerTiming()
    return WorkerTiming(ttft_us=own.ttft_us, gaps_us=own.gaps_us, gaps=own.gaps, colocated=own.colocated,
                        proxy=timer.phases)


async def _relay(resp: aiohttp.ClientResponse, timer: RequestTimer, slot: Slot,
                 redact: Callable[[bytes], bytes], began: float, timing: bool = False) -> AsyncIterator[bytes]:
    """The worker's stream, line by line; the proxy's phases once its timing comment (or its end) says the
    worker's own part: ``span``, the call up to its first chunk with text read, ``written``, that chunk sent."""
    outcome = Outcome.ABORTED
    first = True
    span: tuple[float, float] | None = None
    written = 0.0

    def settle(own: WorkerTiming | None) -> None:
        if span is not None:
            timer.settle(split(timer.received, span, written, colocated_own_us(own)))

    try:
        async for line in resp.content:  # line by line: an error event is redacted before it is sent
            if line.startswith(COMMENT_PREFIX):
                if not timing:
                    continue  # (the blank line after it goes on: an empty event, skipped by every reader)
                try:
                    own = timing_of_comment(line)
                except ValueError:
                    own = None
                settle(own)
                line = COMMENT_PREFIX + _joined(own, timer).to_json() + b"\n"
            elif line.startswith(b'data: {"error"'):
                line = b"data: " + redact(line[6:].strip()) + b"\n"
            elif line.startswith(b"data: {"):
                if first:
                    timer.first_token()
                    first = False
                else:
                    timer.token()
                if span is None and _has_text(line):  # (parsed until the first with text)
                    span = (began, time.monotonic())
                    written = time.monotonic()  # (handed to the connection: xpyd.proxy.phases)
                    yield line
                    continue
            yield line
        outcome = Outcome.OK
        settle(None)  # (no timing comment: the proxy's phases without network; a no-op after one)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        outcome = Outcome.UPSTREAM_ERROR
        log.warning("colocated stream failed: %s", e)
        error = APIError(502, "colocated worker failed", type="server_error").to_dict()
        yield b"data: " + dumps(error) + b"\n\ndata: [DONE]\n\n"
    finally:
        resp.release()
        slot.release()
        timer.end(outcome)
