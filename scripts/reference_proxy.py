#!/usr/bin/env python3
"""The reference design's proxy, for comparison: the AWS Neuron disaggregated-inference guide's router, over
xpyd's workers (``docs/benchmarks.md``, "Proxy throughput against the reference design").

That design is a Quart app that, for every client request, opens a new aiohttp ``ClientSession``, starts the
prefill call (the body with ``max_tokens=1``) and the decode call at the same time, waits for prefill's first
token, sends it, then relays decode's stream; prefill and decode workers are each picked round robin. This is
our own minimal version of it, so it can be measured against ``xpyd proxy`` on the same workers::

    client -> Quart (hypercorn) -> new ClientSession
           -> prefill POST (max_tokens=1, stream=false) + decode POST (stream=true), started together
           -> prefill's first token as the first chunk -> decode's SSE events as they come -> [DONE]

What xpyd's workers need from it, and nothing more: the request id in ``X-Request-Id`` that names both workers'
signal-plane addresses (``xpyd.signal.request_id``: that is how a decode worker finds its prefill worker, as the
reference design encodes the connection in its request id), ``kv_transfer_params.role`` on each call, and the
client's ``max_tokens`` in prefill's ``kv_transfer_params``. The workers' addresses are read once at start from
``GET /xpyd/info`` (the reference design reads them from etcd). Workers must run without a cluster token (no
request-id signing here). No retries, no health checks, no admission, no routing by load or cache: those are
what the reference design does not have.

    .venv/bin/python scripts/reference_proxy.py --port 8000 \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 [--prefill ... --decode ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from quart import Quart, Response, request

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from xpyd.signal.request_id import RequestId  # noqa: E402  (the id format both workers read)

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 300.0  # each read from a worker
INFO_TIMEOUT = 120.0  # waiting for every worker's /xpyd/info at start
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class Worker:
    url: str
    signal_addr: str  # host:port of its signal plane, named in the request id
    model: str


class WorkerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def discover(urls: list[str], timeout: float = INFO_TIMEOUT) -> list[Worker]:
    """Each worker's signal address and model from ``GET /xpyd/info``, waiting until it answers."""
    deadline = time.monotonic() + timeout
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for url in urls:
            while True:
                try:
                    async with session.get(url + "/xpyd/info") as resp:
                        if resp.status == 200:
                            info = await resp.json()
                            out.append(Worker(url, str(info["signal_addr"]), str(info["model_id"])))
                            break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not answer /xpyd/info within {timeout:g}s")
                await asyncio.sleep(0.2)
    return out


def prefill_body(body: dict, model: str) -> dict:
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    out.update(model=model, max_tokens=1, stream=False,
               kv_transfer_params={"role": "prefill", "max_tokens": body.get("max_tokens", 16)})
    return out


def decode_body(body: dict, model: str) -> dict:
    return {**body, "model": model, "stream": True,
            "stream_options": {"include_usage": bool((body.get("stream_options") or {}).get("include_usage"))
                               or not body.get("stream")},
            "kv_transfer_params": {"role": "decode"}}


def first_chunk(prefill: dict, kind: str) -> tuple[str, str | None, bytes]:
    """Prefill's answer: its text, finish reason and the SSE chunk the client gets for it."""
    choice = prefill["choices"][0]
    if kind == "chat":
        text = choice["message"]["content"] or ""
        delta = {"index": 0, "delta": {"role": "assistant", "content": text},
                 "finish_reason": choice.get("finish_reason")}
        obj = "chat.completion.chunk"
    else:
        text = choice["text"] or ""
        delta = {"index": 0, "text": text, "finish_reason": choice.get("finish_reason")}
        obj = "text_completion"
    chunk = {"id": prefill["id"], "object": obj, "created": prefill["created"], "model": prefill["model"],
             "choices": [delta]}
    return text, choice.get("finish_reason"), b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def _post(session: aiohttp.ClientSession, worker: Worker, kind: str, body: dict,
                request_id: str) -> aiohttp.ClientResponse:
    resp = await session.post(worker.url + ROUTES[kind], json=body, headers={"X-Request-Id": request_id})
    if resp.status != 200:
        text = (await resp.text())[:300]
        resp.close()
        raise WorkerError(502 if resp.status >= 500 else resp.status, f"{worker.url}: HTTP {resp.status}: {text}")
    return resp


async def _prefill(session: aiohttp.ClientSession, worker: Worker, kind: str, body: dict, request_id: str) -> dict:
    resp = await _post(session, worker, kind, body, request_id)
    async with resp:
        return await resp.json()


def create_app(prefills: list[Worker], decodes: list[Worker]) -> Quart:
    app = Quart("reference_proxy")
    app.config.update(RESPONSE_TIMEOUT=None)
    next_prefill, next_decode = itertools.cycle(prefills), itertools.cycle(decodes)

    async def generate(kind: str) -> Response:
        body = await request.get_json(force=True)
        prefill, decode = next(next_prefill), next(next_decode)
        request_id = str(RequestId(uuid.uuid4().hex, prefill.signal_addr, decode.signal_addr))
        # The reference design's session per request (what xpyd's house style warns against: measured here).
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT))
        p_task = asyncio.create_task(_prefill(session, prefill, kind, prefill_body(body, prefill.model), request_id))
        d_task = asyncio.create_task(_post(session, decode, kind, decode_body(body, decode.model), request_id))

        async def close() -> None:
            for task in (p_task, d_task):
                task.cancel()
            for result in await asyncio.gather(p_task, d_task, return_exceptions=True):
                if isinstance(result, aiohttp.ClientResponse):
                    result.close()
            await session.close()

        try:
            first = await p_task
            text, finish, chunk = first_chunk(first, kind)
            if finish is not None:  # ended on prefill: decode's stream is not needed
                await close()
                if body.get("stream"):
                    return Response(_once(chunk), content_type="text/event-stream")
                return Response(json.dumps(first), content_type="application/json")
            decode_resp = await d_task
        except (WorkerError, aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
            await close()
            status = e.status if isinstance(e, WorkerError) else 502
            return Response(json.dumps({"error": {"message": str(e), "type": "server_error", "code": status}}),
                            status=status, content_type="application/json")
        if body.get("stream"):
            return Response(_relay(chunk, decode_resp, close), content_type="text/event-stream")
        try:
            return Response(json.dumps(await _collect(first, text, kind, decode_resp)),
                            content_type="application/json")
        finally:
            await close()

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate("completions")

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate("chat")

    @app.get("/health")
    async def health() -> Response:
        return Response('{"status":"ok"}', content_type="application/json")

    return app


async def _once(chunk: bytes):
    yield chunk
    yield b"data: [DONE]\n\n"


async def _relay(chunk: bytes, resp: aiohttp.ClientResponse, close):
    """Prefill's first token, then decode's events as they came (its own [DONE] included)."""
    try:
        yield chunk
        async for block in resp.content.iter_any():
            yield block
    finally:
        await close()


async def _collect(first: dict, text: str, kind: str, resp: aiohttp.ClientResponse) -> dict:
    """A JSON answer: prefill's token and decode's deltas joined, decode's usage."""
    parts, finish, usage = [text], None, first.get("usage")
    buf = b""
    async for block in resp.content.iter_any():
        buf += block
        *events, buf = buf.split(b"\n\n")
        for event in events:
            data = event.removeprefix(b"data: ").strip()
            if not data or data == b"[DONE]":
                continue
            obj = json.loads(data)
            usage = obj.get("usage") or usage
            for c in obj.get("choices") or ():
                parts.append((c.get("delta") or {}).get("content") or "" if kind == "chat" else c.get("text") or "")
                finish = c.get("finish_reason") or finish
    choice = first["choices"][0]
    if kind == "chat":
        choice = {**choice, "message": {"role": "assistant", "content": "".join(parts)}, "finish_reason": finish}
    else:
        choice = {**choice, "text": "".join(parts), "finish_reason": finish}
    return {**first, "choices": [choice], "usage": usage}


async def main_async(args: argparse.Namespace) -> None:
    prefills, decodes = await discover(args.prefill), await discover(args.decode)
    config = HypercornConfig()
    config.bind = [f"{args.host}:{args.port}"]
    config.accesslog = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"reference proxy on http://{args.host}:{args.port}: {len(prefills)} prefill, {len(decodes)} decode",
          flush=True)
    await serve(create_app(prefills, decodes), config, shutdown_trigger=stop.wait)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, metavar="URL")
    ap.add_argument("--decode", action="append", required=True, metavar="URL")
    asyncio.run(main_async(ap.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
