"""The proxy's HTTP front: an OpenAI-compatible server backed by P/D worker pairs.

A request moves through::

    API key (401, when one is set) -> concurrency limit (429) -> Content-Type (415)
    -> read body (size limit, 413) -> parse_request (400s stop here) -> model check (404)
    -> cache_aware: the prompt's token ids and block hashes (in a thread; none if it cannot be tokenized)
    -> every decode worker full: wait in the bounded queue (503 when full or timed out)
    -> Router picks the decode worker, then ``prefill_path`` decides where the prompt is computed: a short
       prompt, or one that decode worker mostly caches, is prefilled there (local: one call, to decode alone,
       whose stream brings the first token too); any other gets a prefill worker, avoiding pairs whose path
       failed lately while there are others (``pairs.PairHealth``); 503 if a role needed has no UP worker
    -> RequestId.new(p, d) -> PDCall: prefill and decode called at once (the id, which names both
       workers' addresses, goes to the workers only: the client's is the response id, see below; a local
       prefill's names the decode worker twice)
    -> a worker unreachable (or the path between the two failed) before the client got anything: it
       is marked down (the pair avoided) and the request starts over once on a fresh pair (new id)
    -> prefill's first token goes to the client as soon as it arrives (TTFT)
    -> decode's chunks follow as decode wrote them (it was told the response's id,
       created and model); its usage chunk if asked; [DONE]
       (a failure after the first byte ends the stream with an error event; so does the
       prefill worker going down before decode has the KV: see ``InFlight.worker_down``)

Where each step lives: admission (401, 429, the queue), dispatch (where a request goes, its call started
there and started over on a fresh pair; the pick in routing; for cache_aware, and for the local prefill
decision, also prompt_tokens, prefix_index and cache_feed, which the poller drives; pairs), prefill_path
(remote or local), pd_call (the two worker calls; their HTTP in client, worker_api, decode_stream,
upstream), inflight (calls in flight), relay (the JSON body or SSE stream),
http_errors (errors in OpenAI's shape).

To the client it looks like a single OpenAI/vLLM server: one response id and
``created`` per request, the served model name, and errors in OpenAI's shape.
As vLLM does, a client's ``X-Request-Id`` names the response (``cmpl-<it>``; checked:
``client_request_id``) and comes back in the ``X-Request-Id`` of every answer; without one,
a generation's ``X-Request-Id`` is its response id. Nothing the client reads names a
worker's address or the workers' request id (errors go through ``http_errors.Redactor``); with
``expose_worker_names`` every answer of a dispatched request (errors too) says which pair served it in
``x-xpyd-workers``, by opaque names (``worker_names``), set before the first byte of a stream.
``GET /cluster`` shows every worker with its health and load (and the online planner's target and recent
decisions, ``planner``: null when none runs); ``GET /metrics``
the proxy's Prometheus metrics (``xpyd.proxy.metrics``). With an API key set,
everything but ``GET /health`` needs ``Authorization: Bearer KEY`` (``/cluster``
shows internal addresses, ``/metrics`` traffic; Prometheus can send the key). The registry's
lifecycle (start/close) belongs to the caller; the app owns the pooled HTTP
session and the health poller (started before serving, stopped after). The app is an aiohttp.web
Application (served by ``http_server.serve``): one middleware (``http_errors.error_middleware``) checks the
API key before a route and adds the headers after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from xpyd.api.choices import several
from xpyd.api.identity import ResponseIdentity, client_request_id
from xpyd.api.timing import TIMING_HEADER
from xpyd.api.tool_output import check_tools
from xpyd.api.openai import APIError, CompletionRequest, RequestKind, check_content_type, parse_request
from xpyd.api.responses import models_response, new_response_id
from xpyd.discovery.base import Registry
from xpyd.discovery.planner_state import PlannerSource
from xpyd.discovery.types import Role
from xpyd.prefix_hash import hash_key
from xpyd.proxy.admission import ApiKey, ConcurrencyLimit, DecodeQueue, Slot, decode_room
from xpyd.proxy.cache_feed import CacheFeed
from xpyd.proxy.choices import serve_choices
from xpyd.proxy.client import WorkerClient, WorkerSessions, worker_sessions
from xpyd.proxy.config import ProxyConfig
from xpyd.proxy.http_errors import Redactor, error_middleware, json_response
from xpyd.proxy.http_server import read_body
from xpyd.proxy.dispatch import Dispatcher, prefill_alone
from xpyd.proxy.inflight import TrackedCall
from xpyd.proxy.metrics import Outcome, ProxyMetrics, RequestTimer, outcome_of
from xpyd.proxy.migration import MigratingCall
from xpyd.proxy.pairs import PairHealth
from xpyd.proxy.phases import joined
from xpyd.proxy.poller import HealthPoller
from xpyd.proxy.prefix_index import PromptKeys
from xpyd.proxy.prompt_tokens import PromptTokenizer
from xpyd.proxy.relay import complete_body, stream_response
from xpyd.proxy.upstream import UpstreamError
from xpyd.proxy.vllm_routes import max_model_len, register_vllm_routes
from xpyd.proxy.worker_api import REQUEST_ID_HEADER, ROUTES, FirstToken
from xpyd.proxy.worker_names import WORKERS_HEADER, WorkerNames
from xpyd.proxy.workers import Health, WorkerState, WorkerTable

log = logging.getLogger(__name__)

__all__ = ["ProxyConfig", "create_app"]

PROXY_KEY = web.AppKey("xpyd.proxy", object)  # the app's Proxy (tests reach it through the app)
# A request's key: the x-xpyd-workers value of the pair it was last dispatched to (aiohttp < 3.13: a string).
_WORKERS = web.RequestKey("xpyd_workers", str) if hasattr(web, "RequestKey") else "xpyd_workers"


class Proxy:
    """Request handling; one instance per app, holding the dispatcher (``dispatch``) and the worker client."""

    def __init__(self, config: ProxyConfig, registry: Registry, planner: PlannerSource | None = None) -> None:
        self.config = config
        self.registry = registry
        self.planner = planner  # the online planner's state, if one may run (etcd)
        self.table = WorkerTable()
        self.metrics = ProxyMetrics(etcd=getattr(registry, "ops", None))  # (an etcd registry counts its calls)
        self.api_key = ApiKey(config.api_key) if config.api_key is not None else None
        self.limit = ConcurrencyLimit(config.max_concurrent_requests)
        self.queue = DecodeQueue(self._decode_room, config.max_queue, config.queue_timeout)
        self.pairs = PairHealth(base=config.pair_cooldown)
        self.redactor = Redactor(lambda: [w for role in Role for w in self.registry.workers(role)])
        self.dispatch = Dispatcher(config, registry, self.table, self.pairs, self.metrics, on_end=self.queue.wake)
        self.index = self.dispatch.index  # (fed through the CacheFeed, open())
        self.names = WorkerNames(config.cluster_token, config.names_key) if config.expose_worker_names else None
        self.table.on_down(self.dispatch.inflight.worker_down)
        if (index := self.index) is not None:  # a worker back from down starts with a snapshot
            self.table.on_down(lambda worker, _reason, _unreachable: index.drop(worker))
        self._sessions: WorkerSessions | None = None
        self._client: WorkerClient | None = None
        self._poller: HealthPoller | None = None
        self._feed: CacheFeed | None = None

    async def open(self) -> None:
        c = self.config
        self._sessions = worker_sessions(c.connect_timeout, c.read_timeout, c.max_connections, c.cluster_token)
        self._client = WorkerClient(self._sessions, c.connect_timeout, c.cluster_token,
                                    timing=c.expose_worker_timing, heard=self.table.heard)
        if self.index is not None:
            self._feed = CacheFeed(self._sessions.control, self.index, hash_key=hash_key(c.cluster_token),
                                   heard=self.table.heard)
        self._poller = HealthPoller(self.registry, self.table, self._sessions.control,
                                    c.poll_interval, c.poll_timeout, on_probe=self.queue.wake, feed=self._feed)
        self._poller.start()

    async def close(self) -> None:
        if self._poller is not None:
            await self._poller.close()
            self._poller = None
        if self._feed is not None:
            await self._feed.close()
            self._feed = None
        if self._sessions is not None:
            await self._sessions.close()
            self._sessions = None

    def served_model(self) -> str | None:
        if self.config.model_name is not None:
            return self.config.model_name
        for role in Role:
            workers = self.registry.workers(role)
            if workers:
                return workers[0].model_id
        return None

    def health(self) -> web.Response:
        up = {role.value: sum(s.health is Health.UP
                              for s in self.table.sync(role, self.registry.workers(role)))
              for role in Role}
        ok = all(up.values())
        return json_response({"status": "ok" if ok else "unavailable", **up}, 200 if ok else 503)

    def models(self) -> web.Response:
        name = self.served_model()
        return json_response(models_response([name] if name else [], max_model_len=max_model_len(self.up_workers())))

    # (for xpyd.proxy.vllm_routes)
    def up_workers(self) -> list[WorkerState]:
        return [s for role in Role for s in self.table.sync(role, self.registry.workers(role)) if s.health is Health.UP]

    def prompt_tokenizer(self) -> PromptTokenizer | None:
        return self._feed.tokenizer if self._feed is not None else None

    def control_session(self) -> aiohttp.ClientSession | None:
        return self._sessions.control if self._sessions is not None else None

    def cluster(self) -> web.Response:
        workers = []
        for role in Role:
            for state in self.table.sync(role, self.registry.workers(role)):
                view = state.to_dict()
                view["cache"]["indexed_blocks"] = self.index.blocks(state.info) if self.index is not None else None
                if self.names is not None:  # which worker an x-xpyd-workers name stands for
                    view["name"] = self.names.of(state.info)
                workers.append(view)
        queue = {"waiting": self.queue.waiting, "max": self.config.max_queue,
                 "active_requests": self.limit.active}
        planner = self.planner.state if self.planner is not None else None
        return json_response({"workers": workers, "policy": self.dispatch.router.policy.value,
                              "tokenizer": self._feed.describe() if self._feed is not None else None,
                              "queue": queue, "avoided_pairs": self.pairs.to_dict(),
                              "planner": planner.to_dict() if planner is not None else None})

    def metrics_response(self) -> web.Response:
        for role in Role:
            states = self.table.sync(role, self.registry.workers(role))
            up = sum(s.health is Health.UP for s in states)
            self.metrics.set_workers(role.value, up, len(states) - up)
        self.metrics.set_queue(self.queue.waiting)
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    def check_api_key(self, request: web.Request) -> None:
        """Before every route but ``/health``: 401 unless the request carries the key (when one is set)."""
        if self.api_key is not None and request.path != "/health":
            self.api_key.check(request.headers.get("Authorization"))

    def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """After every route: as vLLM, the client's own ``X-Request-Id`` comes back (a generation's answer
        already has its id: the client's, or the response id); with ``expose_worker_names``, the pair the
        request was last dispatched to (``_generate``), by opaque names (nothing for one that reached no worker)."""
        headers = response.headers
        if REQUEST_ID_HEADER not in headers and (given := request.headers.get(REQUEST_ID_HEADER)) is not None:
            try:
                rid = client_request_id(given)
            except APIError:  # one that cannot name a response: refused where it would, never echoed
                rid = None
            if rid is not None:
                headers[REQUEST_ID_HEADER] = rid
        if (workers := request.get(_WORKERS)) is not None:
            headers[WORKERS_HEADER] = workers

    async def generate(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        timer = self.metrics.request(ROUTES[kind])
        slot: Slot | None = None
        try:
            slot = self.limit.acquire()
            return await self._generate(request, kind, timer, slot)
        except BaseException as e:
            timer.end(outcome_of(e))
            raise
        finally:
            if slot is not None and not slot.handed_off:
                slot.release()

    async def _read_request(self, request: web.Request,
                            kind: RequestKind) -> tuple[CompletionRequest, ResponseIdentity, str]:
        """The client's request, checked, what its response is called (id, created, model) and its
        ``X-Request-Id`` (the client's own, or the response id)."""
        client_id = client_request_id(request.headers.get(REQUEST_ID_HEADER))
        check_content_type(request.headers.get("Content-Type"))
        req = parse_request(await read_body(request), kind, self.config.trust_request_chat_template)
        if client_id is None and req.request_id is not None:  # (vLLM's request_id field names it as the header)
            client_id = client_request_id(req.request_id, "request_id")
        check_tools(req.tools, self.config.tool_call_parser)
        model = self.served_model()
        if model is None:
            raise APIError(503, "no workers available", type="server_error")
        if req.model is not None and req.model != model:
            raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                           code="model_not_found")
        try:
            identity = ResponseIdentity(new_response_id(kind, client_id), int(time.time()), model)
            return req, identity, client_id or identity.id
        except ValueError as e:  # a worker's served name no worker would accept back
            raise APIError(500, f"cannot serve model {model[:80]!r}: {e}", type="server_error") from None

    async def _generate(self, request: web.Request, kind: RequestKind, timer: RequestTimer,
                        slot: Slot) -> web.StreamResponse:
        if self._client is None:
            raise APIError(503, "proxy is not serving yet", type="server_error")
        req, identity, public_id = await self._read_request(request, kind)
        if several(req):
            if not prefill_alone(req):
                await self.queue.wait()
            return await serve_choices(self, req, identity, {REQUEST_ID_HEADER: public_id}, timer, slot)
        keys = await self.dispatch.keys(req, self.prompt_tokenizer())
        failed: UpstreamError | None = None
        retries = self.config.retries
        if not prefill_alone(req):
            await self.queue.wait()  # returns when a decode worker has room; route before the next await
        while True:
            call = self.dispatch.start(self._client, req, identity, failed, keys)
            if self.names is not None:  # (a retry on another pair names that one)
                request[_WORKERS] = self.names.pair(*call.pair)
            streaming = False
            try:
                first = await call.first_token()
                timer.first_token()
                call = self._migrating(call, req, identity, first, keys)
                headers = {REQUEST_ID_HEADER: public_id}
                if req.stream:
                    streaming = True  # from here the body owns the call, the timer and the slot
                    call.hold(slot)
                    return stream_response(call, req, first, headers, timer, self.worker_failed,
                                           self._public_error(call), timing=self.config.expose_worker_timing,
                                           tool_parser=self.config.tool_call_parser)
                body = await complete_body(call, req, first, timer, self.config.tool_call_parser)
                answer = json_response(body, headers=headers)
                timer.answered(first)  # (where its time went: xpyd.proxy.phases)
                timer.end(Outcome.OK)
                if self.config.expose_worker_timing:
                    said = joined(first, call.decode_timing, timer.phases)
                    if said.proxy is not None:
                        timer.network_known(said.proxy)
                    answer.headers[TIMING_HEADER] = said.header()
                return answer
            except UpstreamError as e:
                retries = self.dispatch.retry_or_raise(call, e, retries, self._public_error(call))
                failed = e
            finally:
                if not streaming:
                    await call.aclose()

    async def first_of(self, req: CompletionRequest, identity: ResponseIdentity,
                       prefer: tuple | None = None) -> tuple[MigratingCall, FirstToken]:
        """One choice of a request with several (``choices``): routed (to ``prefer``'s pair while it is up)
        and called, retried as ``_generate`` does, up to its first token; the caller closes the call."""
        keys = await self.dispatch.keys(req, self.prompt_tokenizer())
        call, first = await self._first_of(req, identity, keys, prefer)
        return self._migrating(call, req, identity, first, keys), first

    def _migrating(self, call: TrackedCall, req: CompletionRequest, identity: ResponseIdentity, first: FirstToken,
                   keys: PromptKeys | None) -> MigratingCall:
        """``call``, which has its first token, moving on to another pair if its workers fail mid-answer."""
        async def restart(resume: tuple[int, ...], failed: UpstreamError) -> tuple[TrackedCall, FirstToken]:
            return await self._first_of(req, identity, keys, resume=resume, failed=failed)

        return MigratingCall(call, first, req, restart, self.config.migration_limit, self.worker_failed,
                             self.metrics)

    async def _first_of(self, req: CompletionRequest, identity: ResponseIdentity, keys: PromptKeys | None,
                        prefer: tuple | None = None, resume: tuple[int, ...] = (),
                        failed: UpstreamError | None = None) -> tuple[TrackedCall, FirstToken]:
        """A call routed and started, retried as ``_generate`` does, up to its first token (``resume``: a
        migrated request's, after the output its client has; ``failed``: why it moves)."""
        if self._client is None:
            raise APIError(503, "proxy is not serving yet", type="server_error")
        retries = self.config.retries
        while True:
            call = self.dispatch.start(self._client, req, identity, failed, keys,
                                       prefer if failed is None else None, resume)
            try:
                return call, await call.first_token()
            except UpstreamError as e:
                await call.aclose()
                retries = self.dispatch.retry_or_raise(call, e, retries, self._public_error(call))
                failed = e
            except BaseException:  # (cancelled: the client left)
                call.abort()
                raise

    def _public_error(self, call: TrackedCall) -> Callable[[APIError], APIError]:
        """What the client may read of an error of ``call``: its request id named by the response's."""
        return lambda e: self.redactor.error(e, call.request_id, call.identity.id, call.workers)

    def _decode_room(self) -> int | None:
        return decode_room(self.table.sync(Role.DECODE, self.registry.workers(Role.DECODE)))

    def worker_failed(self, e: APIError) -> None:
        """Mark the worker behind ``e`` down if the failure says it is unhealthy (``Dispatcher.failed``)."""
        self.dispatch.failed(e)


def create_app(config: ProxyConfig, registry: Registry, planner: PlannerSource | None = None) -> web.Application:
    """An OpenAI-compatible proxy over ``registry``'s workers (start the registry first); ``planner``: where
    ``/cluster`` reads the online planner's state (its lifecycle is the caller's, as the registry's)."""
    proxy = Proxy(config, registry, planner)
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[error_middleware(config.max_body_bytes, proxy.redactor,
                                                        before=proxy.check_api_key, after=proxy.add_headers)])
    app[PROXY_KEY] = proxy

    async def open_proxy(_app: web.Application) -> None:
        await proxy.open()

    async def close_proxy(_app: web.Application) -> None:
        await proxy.close()

    app.on_startup.append(open_proxy)
    app.on_cleanup.append(close_proxy)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await proxy.generate(request, RequestKind.COMPLETION)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await proxy.generate(request, RequestKind.CHAT)

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", _route(proxy.models))
    app.router.add_get("/health", _route(proxy.health))
    app.router.add_get("/cluster", _route(proxy.cluster))
    app.router.add_get("/metrics", _route(proxy.metrics_response))
    register_vllm_routes(app, proxy, config.trust_request_chat_template)  # POST /tokenize, POST /detokenize, GET /version (vLLM's)
    return app


def _route(answer: Callable[[], web.Response]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_request: web.Request) -> web.Response:
        return answer()
    return handler
