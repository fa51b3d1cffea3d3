"""The endpoints vLLM users script against, on a worker: ``POST /tokenize``, ``POST /detokenize``,
``GET /version`` (shapes and parsing: ``xpyd.api.tokenize``), answered with the worker's own tokenizer.

Tokenizing runs in the worker's tokenize thread (the one that tokenizes generation requests), so a long
prompt does not stop the event loop that streams other requests' tokens. Errors are OpenAI-style JSON:
400 (a bad body, a token id out of the vocabulary), 404 (another model), 415 (not JSON).
"""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import Executor
from typing import Any, Callable

from quart import Quart, Response, request

import xpyd
from xpyd.api.openai import APIError, check_content_type
from xpyd.api.tokenize import (check_model, detokenize, parse_detokenize, parse_tokenize, tokenize,
                               version_response)


def _answer(obj: dict, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), status=status, mimetype="application/json")


def register_vllm_routes(app: Quart, engine: Any, executor: Executor, trusted_templates: bool = False) -> None:
    """Add the routes to ``app``; ``engine`` offers ``tokenizer``, ``max_model_len`` and ``info.model_id``;
    ``trusted_templates``: /tokenize runs a request's own chat_template."""

    async def run(parse: Callable[[bytes], Any], answer: Callable[[Any], dict]) -> Response:
        try:
            check_content_type(request.headers.get("Content-Type"))
            req = parse(await request.get_data(cache=False))
            check_model(req.model, engine.info.model_id)
            return _answer(await asyncio.get_running_loop().run_in_executor(executor, answer, req))
        except APIError as e:
            return _answer(e.to_dict(), e.status)

    @app.post("/tokenize")
    async def tokenize_route() -> Response:
        return await run(functools.partial(parse_tokenize, trusted_templates=trusted_templates),
                         lambda req: tokenize(engine.tokenizer, req, engine.max_model_len))

    @app.post("/detokenize")
    async def detokenize_route() -> Response:
        return await run(parse_detokenize, lambda req: detokenize(engine.tokenizer, req))

    @app.get("/version")
    async def version_route() -> Response:
        return _answer(version_response(xpyd.__version__))
