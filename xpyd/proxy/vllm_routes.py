"""The endpoints vLLM users script against, on the proxy: ``POST /tokenize``, ``POST /detokenize``,
``GET /version``, and the cluster's ``max_model_len`` for ``/v1/models``.

    /tokenize   -> the proxy's copy of the workers' tokenizer (cache_aware routing fetches one:
                   ``cache_feed``), with the workers' max_model_len, in a thread: the same tokens a worker
                   gives (``xpyd.api.tokenize`` on both sides)
                   no copy (another policy, or not fetched yet) or no max_model_len reported yet
                -> forwarded to one UP worker, its answer passed on
    /detokenize -> forwarded to one UP worker (the copy lacks the worker's decode-time clean-up setting,
                   which can change the text of some tokenizers)
    /version    -> the proxy's own version

``max_model_len``: the smallest any UP worker reports in its stats (a request must fit on both workers of its
pair); None while none has. Requests are checked here first (400, 404, 415, as the generation routes are).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence
from typing import Protocol

import aiohttp
from aiohttp import web

import xpyd
from xpyd.api.openai import APIError, check_content_type
from xpyd.api.tokenize import check_model, parse_detokenize, parse_tokenize, tokenize, version_response
from xpyd.api.responses import dumps
from xpyd.proxy.cache_feed import read_limited
from xpyd.proxy.http_errors import json_response
from xpyd.proxy.http_server import read_body
from xpyd.proxy.prompt_tokens import PromptTokenizer
from xpyd.proxy.workers import WorkerState

FORWARD_TIMEOUT = 30.0
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class Cluster(Protocol):
    def served_model(self) -> str | None: ...
    def up_workers(self) -> list[WorkerState]: ...  # prefill first
    def prompt_tokenizer(self) -> PromptTokenizer | None: ...
    def control_session(self) -> aiohttp.ClientSession | None: ...


def max_model_len(up: Sequence[WorkerState]) -> int | None:
    lens = [s.stats.max_model_len for s in up if s.stats is not None and s.stats.max_model_len is not None]
    return min(lens) if lens else None


def register_vllm_routes(app: web.Application, cluster: Cluster, trusted_templates: bool = False) -> None:
    """Add the routes to ``app``; ``trusted_templates``: /tokenize runs a request's own chat_template."""

    async def read(request: web.Request, parse):
        check_content_type(request.headers.get("Content-Type"))
        body = await read_body(request)
        req = parse(body)
        served = cluster.served_model()
        if served is None:
            raise APIError(503, "no workers available", type="server_error")
        check_model(req.model, served)
        return req, body

    async def tokenize_route(request: web.Request) -> web.Response:
        req, body = await read(request, functools.partial(parse_tokenize, trusted_templates=trusted_templates))
        copy, up = cluster.prompt_tokenizer(), cluster.up_workers()
        limit = max_model_len(up)
        if copy is None or limit is None:
            return await _forward(cluster, up, "/tokenize", body)
        return json_response(await asyncio.to_thread(tokenize, copy.tokenizer, req, limit))

    async def detokenize_route(request: web.Request) -> web.Response:
        _, body = await read(request, parse_detokenize)
        return await _forward(cluster, cluster.up_workers(), "/detokenize", body)

    async def version_route(_request: web.Request) -> web.Response:
        return json_response(version_response(xpyd.__version__))

    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_get("/version", version_route)


async def _forward(cluster: Cluster, up: Sequence[WorkerState], path: str, body: bytes) -> web.Response:
    """``body`` (checked already; without its ``model``, which may be the proxy's alias of the workers' name) to
    the first UP worker's ``path``; its status and JSON answer."""
    session = cluster.control_session()
    if session is None or not up:
        raise APIError(503, "no workers available", type="server_error")
    d = json.loads(body)
    d.pop("model", None)
    url = up[0].info.http_url + path
    try:
        async with session.post(url, data=dumps(d), headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT)) as resp:
            answer = await read_limited(resp, MAX_ANSWER_BYTES)
            status = resp.status
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        raise APIError(502, f"the worker did not answer {path}: {type(e).__name__}", type="server_error") from None
    return web.Response(body=answer, status=status, content_type="application/json")
