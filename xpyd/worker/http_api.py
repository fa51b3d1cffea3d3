"""The OpenAI-compatible HTTP API both workers serve (Quart), in front of an engine thread.

The prefill worker answers with the first token (the proxy calls it with
``max_tokens=1``); the decode worker streams tokens 2..n. Both take the
``X-Request-Id`` header verbatim as the rendezvous key, and drop a request on
``POST /xpyd/abort`` with that header. Every error is OpenAI-style JSON: bodies
that are not JSON (415), too large (413), invalid (400), unknown routes (404/405).
Before any of that, ``request_gate`` checks the caller's credentials and the id: with a cluster token
``/v1/*`` and ``/xpyd/*`` need the cluster's bearer (401) and an id the proxy signed (403); a decode worker
without one takes only ids that name a prefill worker it knows (403). Nothing is read, queued or
connected for a request refused there.

A response is called by the request id, the time it arrived and the served
model, unless the proxy names it (``kv_transfer_params.response``, see
``xpyd.api.identity``): then every chunk carries the proxy's id, ``created`` and
model, and a chat stream has no role chunk (it continues the one the proxy
opened), so the proxy passes the stream on unchanged.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import AsyncIterator, Callable, Protocol

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from xpyd.api.choices import Child, join_json, join_streams, several, split
from xpyd.api.identity import response_identity
from xpyd.api.tool_output import ToolOutput, check_tools
from xpyd.api.openai import APIError, CompletionRequest, RequestKind, check_content_type, parse_request
from xpyd.api.resume import TOKEN_IDS_KEY
from xpyd.api.responses import models_response, new_response_id
from xpyd.discovery.types import WorkerInfo
from xpyd.worker.answers import StreamShape, collect, error_body, stream_events
from xpyd.worker.config import WorkerConfig
from xpyd.worker.kv_cache import KVCache
from xpyd.worker.kv_events import KVEventLog
from xpyd.worker.kv_stream import register_kv_stream
from xpyd.worker.logprob_format import ResponseExtras
from xpyd.worker.metrics import WorkerMetrics
from xpyd.model.loader import GenerationDefaults
from xpyd.worker.work_item import EventDispatch, WorkItem
from xpyd.worker.request_params import build_work_item
from xpyd.model.tokenizer import describe_tokenizer
from xpyd.signal.request_id import RequestId
from xpyd.worker.request_gate import REQUEST_ID_HEADER, PrefillPeers, RequestGate
from xpyd.worker.timing import TIMING_HEADER, AnswerClock
from xpyd.worker.vllm_routes import register_vllm_routes

log = logging.getLogger(__name__)


class Engine(Protocol):
    info: WorkerInfo
    tokenizer: object
    max_model_len: int
    eos_token_ids: frozenset[int]
    metrics: WorkerMetrics

    def ready(self) -> bool: ...
    def failure(self) -> str | None: ...
    def submit(self, item: WorkItem) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def stats(self) -> dict: ...
    kv_cache: KVCache
    kv_events: KVEventLog


def _error(e: APIError) -> Response:
    return Response(json.dumps(e.to_dict()), status=e.status, mimetype="application/json")


def _json(obj: dict, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status, mimetype="application/json")


def create_worker_app(engine: Engine, config: WorkerConfig, kv_backend: Callable[[], dict] | None = None,
                      prefill_peers: PrefillPeers | None = None,
                      defaults: GenerationDefaults = GenerationDefaults()) -> Quart:
    """The worker's HTTP API; ``kv_backend()`` describes its transfer backend in ``/xpyd/stats``;
    ``prefill_peers``: the prefill workers a decode worker without a cluster token may be sent to (default:
    this host's); ``defaults``: the sampling defaults of the model's generation_config."""
    app = Quart(f"xpyd-{config.role}")
    gate = RequestGate(config.role, config.cluster_token,
                       prefill_peers if prefill_peers is not None else PrefillPeers(own_host=config.public_host),
                       own_addr=lambda: engine.info.signal_addr if getattr(engine, "info", None) else None,
                       accepted_tokens=config.accepted_tokens)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams last as long as generation does
    app.config["BODY_TIMEOUT"] = 30
    single_event = config.role == "prefill"  # prefill answers with the first token only
    # Tokenizing a long prompt (and rendering a chat template) takes milliseconds to tens of them: done in
    # a thread of its own so the event loop keeps streaming other requests' tokens meanwhile.
    tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xpyd-tokenize")
    dispatches: dict[asyncio.AbstractEventLoop, EventDispatch] = {}  # (one loop when serving)

    def dispatch_for(loop: asyncio.AbstractEventLoop) -> EventDispatch:
        d = dispatches.get(loop)
        if d is None:
            d = dispatches[loop] = EventDispatch(loop)
        return d

    @app.before_request
    async def authenticate() -> Response | None:
        """With a cluster token: 401 on /v1/* and /xpyd/* without the cluster's bearer (nothing read yet)."""
        engine.metrics.http_request(request.url_rule.rule if request.url_rule is not None else "unmatched")
        if gate.guards(request.path) and not gate.authorized(request.headers.get("Authorization")):
            resp = _error(APIError(401, "this worker's API needs the cluster's credential (the proxy sends it)",
                                   "authentication_error"))
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        return None

    @app.after_serving
    async def stop_tokenizer() -> None:
        tokenize.shutdown(wait=False, cancel_futures=True)

    @app.get("/health")
    async def health() -> Response:
        if engine.ready():
            return Response("ok", status=200)
        failure = engine.failure()
        return Response("starting" if failure is None else f"engine failed: {failure}", status=503)

    @app.get("/xpyd/info")
    async def info() -> Response:
        return Response(engine.info.to_json(), mimetype="application/json")

    @app.get("/xpyd/stats")
    async def stats() -> Response:
        out = engine.stats() | {"max_model_len": engine.max_model_len, "kv_event_streams": event_streams.active}
        if kv_backend is not None:
            out["kv_backend"] = kv_backend()
        return _json(out)

    described: list[bytes] = []  # the tokenizer's description, made on first request

    @app.get("/xpyd/tokenizer")
    async def tokenizer() -> Response:
        """How to tokenize and name KV blocks exactly as this worker does (for a cache-aware router)."""
        if not described:
            desc = await asyncio.get_running_loop().run_in_executor(tokenize, describe_tokenizer, engine.tokenizer)
            desc |= {"block_size": engine.kv_cache.block_size, "hash_seed": engine.kv_cache.seed}
            described.append(json.dumps(desc, ensure_ascii=False).encode())
        return Response(described[0], mimetype="application/json")

    @app.get("/xpyd/kv_events")
    async def kv_events() -> Response:
        """The block hashes this worker stored and evicted after ``since`` (of ``epoch``), or a snapshot."""
        since = request.args.get("since")
        if since is not None and not since.isdigit():
            return _error(APIError(400, "since must be a non-negative integer", param="since"))
        return _json(engine.kv_events.since(request.args.get("epoch"), int(since) if since is not None else None))

    event_streams = register_kv_stream(app, engine.kv_events)  # GET /xpyd/kv_events/stream: the same, pushed
    register_vllm_routes(app, engine, tokenize, config.trust_request_chat_template)  # POST /tokenize, POST /detokenize, GET /version (vLLM's)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = engine.metrics.render()
        return Response(body, content_type=content_type)

    @app.post("/xpyd/abort")
    async def abort() -> Response:
        """Drop the request named in ``X-Request-Id`` wherever it is (unknown ids: nothing to do).

        The proxy calls it on a prefill worker when a request ends before its decode
        worker finished, e.g. because that worker died: the KV is freed now instead
        of after ``kv_ttl``.
        """
        try:
            rid = gate.parse(request.headers.get(REQUEST_ID_HEADER))
        except APIError as e:
            return _error(e)
        engine.abort(str(rid))
        return _json({"aborted": str(rid)})

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(models_response([engine.info.model_id], max_model_len=engine.max_model_len))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _generate(RequestKind.COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _generate(RequestKind.CHAT)

    @app.errorhandler(413)
    async def too_large(_e) -> Response:
        engine.metrics.request_done("rejected")
        return _error(APIError(413, f"Request body larger than {config.max_body_bytes} bytes."))

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException) -> Response:  # 404, 405, a bad request line ...: JSON too
        status = e.code or 500
        message = f"{e.name}: {e.description}" if e.description else str(e.name)
        return _error(APIError(status, message, "invalid_request_error" if status < 500 else "server_error"))

    @app.errorhandler(Exception)
    async def internal_error(_e: Exception) -> Response:
        log.exception("unhandled error in the %s worker's HTTP API", config.role)
        return _error(APIError(500, f"internal error in the {config.role} worker", "server_error"))

    async def _generate(kind: RequestKind) -> Response:
        clock = AnswerClock.start(request.headers.get(TIMING_HEADER))  # (xpyd.api.timing, xpyd.api.phases)
        try:  # first: a forged id connects nothing and queues nothing
            rid = await gate.admit(request.headers.get(REQUEST_ID_HEADER))
        except APIError as e:
            engine.metrics.request_done("rejected")
            return _error(e)
        if not engine.ready():
            failure = engine.failure()
            return _error(APIError(503, "worker is starting" if failure is None else
                                   f"the {config.role} worker's engine failed ({failure}); it is restarting",
                                   "service_unavailable"))
        try:
            check_content_type(request.headers.get("Content-Type"))
            body = await request.get_data(cache=False)
            req = parse_request(body, kind, config.trust_request_chat_template)
            named = response_identity(req.kv_transfer_params)
            children = _children(req, config.role)
            if config.role == "colocated":
                check_tools(req.tools, config.tool_call_parser)
            loop = asyncio.get_running_loop()
            items = []
            for child in children:  # (a colocated worker's choices: one engine request each, ids of their own)
                sink = engine.metrics.sink(dispatch_for(loop))  # (counts the vllm:* tokens and ends)
                child_rid = rid if child is None else child_request_id(rid, child.index)
                items.append(await loop.run_in_executor(tokenize, build_work_item, engine, config,
                                                        req if child is None else child.req, child_rid, sink,
                                                        defaults))
        except APIError as e:
            if e.status < 500:
                engine.metrics.request_done("rejected")
            return _error(e)
        answers = config.role == "colocated"  # (P/D: the proxy writes the client's answer from the two workers')
        extras = [ResponseExtras(req if child is None else child.req, item, engine.tokenizer,
                                 echo_here=config.role != "decode",
                                 tools=ToolOutput(req.tools, config.tool_call_parser)
                                 if answers and req.tools is not None and req.tools.parsed else None)
                  for child, item in zip(children, items)]
        for item in items:  # (a prompt's first choice first: the others find its blocks cached)
            engine.submit(item)
        token_ids = (req.kv_transfer_params or {}).get(TOKEN_IDS_KEY) is True  # (the P/D proxy asks)
        if named is None:  # called directly (or by the colocated proxy): named by the id's random part only
            shape = StreamShape(kind, new_response_id(kind, items[0].request_id.uid), int(time.time()),
                                engine.info.model_id, req.include_usage, role_chunk=True, token_ids=token_ids)
        else:  # the proxy's name; its stream has its own role chunk
            shape = StreamShape(kind, named.id, named.created, named.model, req.include_usage, role_chunk=False,
                                token_ids=token_ids)
        if children[0] is not None:
            return await _several(req, children, items, extras, shape)
        item, rid = items[0], str(items[0].request_id)
        clock.follow(config.role, item.stamps, item.arrival, engine.metrics.observe_phases)
        if req.stream:
            gen = stream_events(engine, rid, shape, item.sink, single_event, clock, item, extras[0],
                                keepalive=config.sse_keepalive)
            return _sse_response(gen)
        ended = False
        try:
            answer = await collect(item, extras[0], shape, single_event)
            ended = True
            if isinstance(answer, APIError):
                return _error(answer)
            resp = _json(answer)
            clock.answered()
            if clock.wanted:
                resp.headers[TIMING_HEADER] = clock.header()
            return resp
        finally:
            if not ended:  # the client went away: drop the request everywhere
                engine.abort(rid)

    async def _several(req: CompletionRequest, children: list[Child], items: list[WorkItem],
                       extras: list[ResponseExtras], shape: StreamShape) -> Response:
        """A colocated worker's answer to a request with several choices (``xpyd.api.choices``)."""
        if req.stream:
            child_shape = replace(shape, include_usage=True)
            streams = [(child, stream_events(engine, str(item.request_id), child_shape, item.sink, False, None, item,
                                             ex, keepalive=None)) for child, item, ex in zip(children, items, extras)]
            return _sse_response(join_streams(req, streams, (shape.id, shape.created, shape.model),
                                              keepalive=config.sse_keepalive))
        ended = False
        try:
            answers = await asyncio.gather(*(collect(item, ex, shape, False) for item, ex in zip(items, extras)))
            ended = True
            failed = next((a for a in answers if isinstance(a, APIError)), None)
            if failed is not None:
                for item in items:
                    engine.abort(str(item.request_id))
                return _error(failed)
            return _json(join_json(req, list(zip(children, answers))))
        finally:
            if not ended:
                for item in items:
                    engine.abort(str(item.request_id))

    return app


def _children(req: CompletionRequest, role: str) -> list[Child | None]:
    """[None] for a one-choice request; a colocated worker's choices of one with several (the P/D proxy
    splits those itself: prefill and decode workers take one choice a request)."""
    if not several(req):
        return [None]
    if role != "colocated":
        raise APIError(400, f"a {role} worker takes one choice a request (n 1, one prompt): the proxy splits "
                            "the others", param="n")
    return list(split(req))


def child_request_id(rid: RequestId, index: int) -> RequestId:
    """Choice ``index``'s id: the request's, its random part derived anew (unique per choice)."""
    uid = hashlib.sha256(f"{rid.uid}/{index}".encode()).hexdigest()[:32]
    return RequestId(uid, rid.prefill_addr, rid.decode_addr)


def _sse_response(gen: AsyncIterator[bytes]) -> Response:
    resp = Response(gen, mimetype="text/event-stream")
    resp.headers["Cache-Control"] = "no-cache"
    resp.timeout = None
    return resp
