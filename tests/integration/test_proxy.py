"""The proxy, served by aiohttp.web on a real port, against fake prefill/decode workers.

The fake workers (aiohttp.web) implement the worker HTTP contract with canned
tokens, record what they received (headers, bodies, arrival times, whether the
proxy hung up), and can be told to wait, fail, or end the request on prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.cluster import free_port
from xpyd import PROTOCOL_VERSION
from xpyd.discovery.base import Registry, RegistryError
from xpyd.discovery.static import StaticRegistry
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.netaddr import reserve_tcp
from xpyd.proxy import decode_stream
from xpyd.proxy.app import ProxyConfig, create_app
from xpyd.proxy.config import default_policy
from xpyd.proxy.http_server import serve
from xpyd.proxy.main import add_arguments, config_from_args
from xpyd.proxy.routing import Policy
from xpyd.signal.request_id import parse_request_id

MODEL = "fake-model"
TOKENS = ["Hello", ",", " wor", "ld", "!"]
PROMPT_TOKENS = 7
REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ fake workers


@dataclass
class Received:
    path: str
    headers: Mapping[str, str]
    body: dict
    at: float
    peer: tuple  # the proxy's (host, port): the same port again means a pooled connection


@dataclass
class FakeWorker:
    role: Role
    signal_port: int
    tokens: list[str] = field(default_factory=lambda: list(TOKENS))
    model: str = MODEL
    delay: float = 0.0  # prefill: before answering; decode: before the first chunk
    token_delay: float = 0.0  # decode: between chunks
    prefill_finish: str | None = None  # prefill: end the request on the first token
    fail: tuple[int, dict | str] | None = None  # answer (status, body) instead
    stream_error: dict | None = None  # decode: after the role chunk, this error event and [DONE]
    error_after: int = 0  # decode: tokens it sends before stream_error
    compact: bool = True  # decode: JSON as a worker writes it (xpyd.api.responses.dumps); False: json.dumps' spaces
    ignore_identity: bool = False  # decode: chunks named and opened as a worker told nothing does
    last_finish: str | None = "length"  # decode: the finish_reason of its last token
    chop: int = 0  # decode: hold the events back, then write them all in pieces of this many bytes
    sent: list[bytes] = field(default_factory=list)  # decode: the bytes of each SSE event it wrote
    received: list[Received] = field(default_factory=list)
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)
    health_checks: int = 0  # GET /health answered
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/xpyd/info", self._info)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        await self.runner.cleanup()

    @property
    def signal_addr(self) -> str:
        return f"127.0.0.1:{self.signal_port}"

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.json_response({"status": "ok"})

    async def _info(self, request: web.Request) -> web.Response:
        info = WorkerInfo(self.role, self.url, self.signal_addr, self.model, PROTOCOL_VERSION, 8)
        return web.Response(text=info.to_json(), content_type="application/json")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, request.headers.copy(), body, time.monotonic(),
                                      request.transport.get_extra_info("peername")))
        chat = request.path.endswith("chat/completions")
        try:
            if self.fail is not None:
                status, err = self.fail
                rid = request.headers["X-Request-Id"]  # "{rid}" in its text: as a worker names the request
                if isinstance(err, str):
                    return web.Response(status=status, text=err.replace("{rid}", rid))
                return web.json_response(json.loads(json.dumps(err).replace("{rid}", rid)), status=status)
            await asyncio.sleep(self.delay)
            if self.role is Role.PREFILL:
                return web.json_response(self._first_token(chat))
            return await self._stream(request, chat, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.hung_up.set()
            raise

    def _first_token(self, chat: bool) -> dict:
        text = self.tokens[0]
        choice = {"index": 0, "finish_reason": self.prefill_finish, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {
            "id": "ignored", "object": "chat.completion" if chat else "text_completion",
            "created": 1, "model": self.model, "choices": [choice],
            "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1,
                      "total_tokens": PROMPT_TOKENS + 1},
        }

    async def _stream(self, request: web.Request, chat: bool, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: dict | str) -> None:
            separators = (",", ":") if self.compact else None
            data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=separators)
            event = f"data: {data}\n\n".encode()
            self.sent.append(event)
            if not self.chop:
                await resp.write(event)

        async def end() -> None:
            if self.chop:  # events split anywhere and run together, as TCP may deliver them
                held = b"".join(self.sent)
                for i in range(0, len(held), self.chop):
                    await resp.write(held[i:i + self.chop])
                    await asyncio.sleep(0.001)
            await resp.write_eof()

        # As a worker: named by the proxy (kv_transfer_params.response), a chat stream has no role chunk.
        named = (body.get("kv_transfer_params") or {}).get("response")
        if self.ignore_identity:
            named = None
        name = named or {"id": "worker-own-id", "created": 1, "model": self.model}
        base = {"id": name["id"], "object": "chat.completion.chunk" if chat else "text_completion",
                "created": name["created"], "model": name["model"]}
        if chat and named is None:
            await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        rest = self.tokens[1:]
        for i, tok in enumerate(rest):
            if self.stream_error is not None and i == self.error_after:  # a worker failing mid-stream
                rid = request.headers["X-Request-Id"]
                await send({"error": json.loads(json.dumps(self.stream_error).replace("{rid}", rid))})
                await send("[DONE]")
                await end()
                return resp
            finish = self.last_finish if i == len(rest) - 1 else None
            choice = {"index": 0, **({"delta": {"content": tok}} if chat else {"text": tok}),
                      "logprobs": None, "finish_reason": finish}
            await send({**base, "choices": [choice]})
            await asyncio.sleep(self.token_delay)
        n = len(self.tokens)
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**base, "choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS,
                                                         "completion_tokens": n,
                                                         "total_tokens": PROMPT_TOKENS + n}})
        await send("[DONE]")
        await end()
        return resp


# ------------------------------------------------------------------ proxy harness


@dataclass
class Cluster:
    url: str
    prefill: FakeWorker
    decode: FakeWorker
    http: aiohttp.ClientSession
    decodes: list[FakeWorker]

    def post(self, path: str, body: dict | bytes, headers: dict | None = None, **kw):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.http.post(self.url + path, data=data,
                              headers={"Content-Type": "application/json", **(headers or {})}, **kw)

    def workers(self) -> list[FakeWorker]:
        return [self.prefill, *self.decodes]


async def start_proxy(config: ProxyConfig, registry: Registry):
    app = create_app(config, registry)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(app, stop, reserve_tcp(config.host, config.port), graceful_timeout=1))
    url = f"http://{config.host}:{config.port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            try:
                async with s.get(url + "/health"):
                    break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.02)
    return url, stop, task


async def make_cluster(n_decode: int = 1, **config_kw):
    prefill = FakeWorker(Role.PREFILL, signal_port=15555)
    decodes = [FakeWorker(Role.DECODE, signal_port=16666 + i) for i in range(n_decode)]
    for w in (prefill, *decodes):
        await w.start()
    registry = StaticRegistry([prefill.url], [d.url for d in decodes], timeout=5)
    await registry.start()
    # The policy `xpyd proxy` would choose for these workers: least_loaded for 1P1D.
    config_kw.setdefault("policy", default_policy(None, (prefill.url,), tuple(d.url for d in decodes)))
    config = ProxyConfig(port=free_port(), **config_kw)
    url, stop, task = await start_proxy(config, registry)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
    cluster = Cluster(url, prefill, decodes[0], http, decodes)

    async def close():
        await http.close()
        stop.set()
        await asyncio.wait_for(task, 5)
        await registry.close()
        for w in (prefill, *decodes):
            await w.stop()

    return cluster, close


@pytest.fixture
async def cluster():
    c, close = await make_cluster()
    yield c
    await close()


async def read_sse(resp: aiohttp.ClientResponse) -> list:
    """All SSE events: parsed JSON objects, and the string "[DONE]"."""
    events = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == b"", line
    return events


async def wait_health(c: Cluster, url: str, health: str, within: float = 15.0) -> float:
    """Seconds until ``GET /cluster`` shows the worker at ``url`` with ``health``."""
    t0 = time.monotonic()
    while True:
        async with c.http.get(c.url + "/cluster") as r:
            states = {w["http_url"]: w["health"] for w in (await r.json())["workers"]}
        if states.get(url) == health:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within, f"{url} is not {health} after {within}s: {states}"
        await asyncio.sleep(0.02)


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "Say hello", "max_tokens": 5, "temperature": 0, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 5, **kw}


def content_of(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice["delta"].get("content", "") if "delta" in choice else choice["text"]


# ------------------------------------------------------------------ happy paths


async def test_completion_non_stream_and_worker_bodies(cluster: Cluster):
    async with cluster.post("/v1/completions", completion(stream_options=None)) as r:
        assert r.status == 200, await r.text()
        assert r.content_type == "application/json"
        data = await r.json()
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion"
    assert data["model"] == MODEL and isinstance(data["created"], int)
    assert data["choices"] == [{"index": 0, "text": "".join(TOKENS), "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert data["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 5,
                             "total_tokens": PROMPT_TOKENS + 5, "prompt_tokens_details": {"cached_tokens": 0}}

    (p,), (d,) = cluster.prefill.received, cluster.decode.received
    assert p.path == d.path == "/v1/completions"
    assert p.body["max_tokens"] == 1 and p.body["stream"] is False
    assert "stream_options" not in p.body
    assert p.body["kv_transfer_params"] == {"role": "prefill", "max_tokens": 5, "token_ids": True}
    assert d.body["stream"] is True and d.body["stream_options"] == {"include_usage": True}  # for the JSON body
    # decode names its chunks as the client's response is named
    assert d.body["kv_transfer_params"] == {  # (and both name the tokens of what they answer: migration)
        "role": "decode", "response": {"id": data["id"], "created": data["created"], "model": MODEL},
        "token_ids": True}
    assert d.body["max_tokens"] == 5
    assert p.body["prompt"] == d.body["prompt"] == "Say hello"
    assert p.body["temperature"] == d.body["temperature"] == 0

    # One id for both workers, carrying both signal addresses.
    assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"]
    rid = parse_request_id(p.headers["X-Request-Id"])
    assert rid.prefill_addr == cluster.prefill.signal_addr
    assert rid.decode_addr == cluster.decode.signal_addr


async def test_chat_non_stream(cluster: Cluster):
    async with cluster.post("/v1/chat/completions", chat(max_completion_tokens=5)) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "".join(TOKENS)}
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 5
    (p,) = cluster.prefill.received
    assert p.body["max_tokens"] == 1 and "max_completion_tokens" not in p.body
    assert p.body["kv_transfer_params"] == {"role": "prefill", "max_tokens": 5, "token_ids": True}


@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_stream(cluster: Cluster, include_usage: bool):
    body = chat(stream=True, stream_options={"include_usage": include_usage})
    async with cluster.post("/v1/chat/completions", body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    # Exactly one role chunk, first (the proxy's: decode, continuing the stream, sends none).
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sum("role" in c["choices"][0]["delta"] for c in chunks if c["choices"]) == 1
    if include_usage:
        usage = chunks.pop()
        assert usage["choices"] == []
        assert usage["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 5,
                                  "total_tokens": PROMPT_TOKENS + 5}
    assert all("usage" not in c for c in chunks)
    content = chunks[1:]
    assert [content_of(c) for c in content] == TOKENS  # no empty chunks, in order
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * 4 + ["length"]


async def test_completion_stream(cluster: Cluster):
    body = completion(stream=True, stream_options={"include_usage": True})
    async with cluster.post("/v1/completions", body) as r:
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    *content, usage = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in events[:-1])
    assert [content_of(c) for c in content] == TOKENS
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------------ decode's stream, relayed


def sse_events(raw: bytes) -> list[bytes]:
    """Each event of an SSE body written as ``data: ...\\n\\n``, with its framing."""
    assert raw.endswith(b"\n\n"), raw[-100:]
    return [e + b"\n\n" for e in raw[:-2].split(b"\n\n")]


def stream_request(kind: str, include_usage: bool, **kw) -> tuple[str, dict]:
    extra = {"stream": True, "stream_options": {"include_usage": include_usage}, **kw}
    return ("/v1/chat/completions", chat(**extra)) if kind == "chat" else ("/v1/completions", completion(**extra))


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("how", ["compact", "spaced", "chopped"])
async def test_stream_relays_decode_bytes_unchanged(cluster: Cluster, kind: str, include_usage: bool, how: str):
    """After its own chunks (chat role, prefill's first token) the proxy sends what decode wrote, byte
    for byte: tokens 2..n, the usage chunk if asked, [DONE]. Whatever the JSON's spacing (only a worker's
    own compact form skips parsing) and however the events arrive (here in 7-byte pieces)."""
    cluster.decode.compact = how != "spaced"
    cluster.decode.chop = 7 if how == "chopped" else 0
    path, body = stream_request(kind, include_usage)
    async with cluster.post(path, body) as r:
        assert r.status == 200
        raw = await r.read()
    relayed = b"".join(cluster.decode.sent)
    assert relayed.endswith(b"data: [DONE]\n\n")
    assert raw.endswith(relayed) and len(raw) > len(relayed)
    own = sse_events(raw[:-len(relayed)])
    assert len(own) == (2 if kind == "chat" else 1)  # [role chunk,] prefill's token
    chunks = [json.loads(e[6:]) for e in own + cluster.decode.sent[:-1]]
    # One name for the whole stream, the one decode was given.
    (d,) = cluster.decode.received
    named = d.body["kv_transfer_params"]["response"]
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {(named["id"], named["created"], MODEL)}
    assert named["id"].startswith("chatcmpl-" if kind == "chat" else "cmpl-")
    assert d.body["stream_options"] == {"include_usage": include_usage}
    assert ("usage" in chunks[-1]) is include_usage
    content = [c for c in chunks if c["choices"]]
    if kind == "chat":
        assert content.pop(0)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [content_of(c) for c in content] == TOKENS


async def test_token_chunks_are_relayed_without_parsing(cluster: Cluster, monkeypatch):
    """Of decode's events only the last token chunk and the usage chunk are parsed."""
    parsed = []
    loads = decode_stream.json.loads
    monkeypatch.setattr(decode_stream, "json", SimpleNamespace(loads=lambda d: parsed.append(d) or loads(d)))
    cluster.prefill.tokens = cluster.decode.tokens = ["t"] * 40
    path, body = stream_request("chat", True, max_tokens=40)
    async with cluster.post(path, body) as r:
        events = await read_sse(r)
    assert "".join(content_of(c) for c in events[:-1] if c["choices"]) == "t" * 40
    assert events[-2]["usage"]["completion_tokens"] == 40
    assert [json.loads(d)["choices"] for d in parsed] == [
        [{"index": 0, "delta": {"content": "t"}, "logprobs": None, "finish_reason": "length"}], []]


async def test_decode_chunks_of_another_response_are_an_error(cluster: Cluster):
    """A decode worker that ignores the name it was given (e.g. one that does not speak this
    proxy's worker API): the client gets an error event, never chunks of two different ids."""
    cluster.decode.ignore_identity = True
    for kind in ("chat", "completion"):
        path, body = stream_request(kind, True)
        async with cluster.post(path, body) as r:
            assert r.status == 200
            events = await read_sse(r)
        assert content_of(events[-3]) == "Hello"
        error = events[-2]["error"]
        assert error["type"] == "server_error" and "sent a chunk of another response" in error["message"]
        assert events[-1] == "[DONE]"
        assert all(c["id"] != "worker-own-id" for c in events[:-2])


async def test_decode_error_after_some_tokens_is_an_error_event(cluster: Cluster):
    """The tokens decode sent go on unchanged; its error event does not: the proxy's own takes its place."""
    cluster.decode.error_after = 2
    cluster.decode.stream_error = {"message": "engine failed", "type": "server_error", "param": None, "code": 500}
    path, body = stream_request("chat", True)
    async with cluster.post(path, body) as r:
        raw = await r.read()
    tokens = b"".join(cluster.decode.sent[:2])
    assert tokens in raw and b"engine failed" in cluster.decode.sent[2]
    events = sse_events(raw)
    assert events[2:4] == cluster.decode.sent[:2] and events[-1] == b"data: [DONE]\n\n"
    error = json.loads(events[-2][6:])["error"]
    assert error == {"message": "decode worker failed: engine failed", "type": "server_error",  # (no address)
                     "param": None, "code": None}
    assert len(events) == 6  # role, Hello, 2 tokens, the error, [DONE]


async def test_decode_stream_without_a_finish_reason_is_an_error(cluster: Cluster):
    cluster.decode.last_finish = None
    path, body = stream_request("completion", True)
    async with cluster.post(path, body) as r:
        events = await read_sse(r)
    assert [content_of(c) for c in events[:-3]] == TOKENS  # then the usage chunk, as decode sent it
    assert "without a finish_reason" in events[-2]["error"]["message"] and events[-1] == "[DONE]"


async def test_openai_client(cluster: Cluster):
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    try:
        c = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
        assert c.choices[0].text == "".join(TOKENS) and c.usage.completion_tokens == 5
        stream = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5, stream=True)
        assert "".join([ch.choices[0].text async for ch in stream]) == "".join(TOKENS)

        cc = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert cc.choices[0].message.content == "".join(TOKENS)
        assert cc.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            stream=True, stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "".join(TOKENS)
        assert chunks[-1].usage.completion_tokens == 5

        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="hi")
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt="hi", n=0)
    finally:
        await client.close()


async def test_concurrent_dispatch_and_ttft(cluster: Cluster):
    prefill_delay, decode_delay = 1.5, 3.5  # far enough apart to tell on a busy machine
    cluster.prefill.delay = prefill_delay
    cluster.decode.delay = decode_delay  # decode's first chunk comes long after prefill's token
    t0 = time.monotonic()
    first_at = None
    async with cluster.post("/v1/chat/completions", chat(stream=True)) as r:
        async for line in r.content:
            if line.startswith(b"data: {") and '"content":"Hello"' in line.decode():
                first_at = time.monotonic() - t0
        end = time.monotonic() - t0
    (p,), (d,) = cluster.prefill.received, cluster.decode.received
    assert abs(p.at - d.at) < prefill_delay / 2, "decode must be called with prefill, not after it"
    # prefill's token: TTFT is prefill's time, well before decode's first chunk
    assert first_at is not None and prefill_delay * 0.9 < first_at < (prefill_delay + decode_delay) / 2, first_at
    assert end >= decode_delay * 0.9
    assert end < decode_delay + prefill_delay / 2, \
        f"prefill and decode delays must overlap ({decode_delay} s), not add up ({prefill_delay + decode_delay} s)"


async def test_worker_connections_are_pooled(cluster: Cluster):
    for stream in (False, True, False):
        async with cluster.post("/v1/chat/completions", chat(stream=stream)) as r:
            assert r.status == 200
            await r.read()
    assert len({x.peer for x in cluster.prefill.received}) == 1
    assert len({x.peer for x in cluster.decode.received}) == 1


async def test_empty_first_token_is_not_sent(cluster: Cluster):
    cluster.prefill.tokens = ["", "a", "b"]
    cluster.decode.tokens = ["", "a", "b"]
    async with cluster.post("/v1/completions", completion(stream=True)) as r:
        events = await read_sse(r)
    assert [content_of(c) for c in events[:-1]] == ["a", "b"]


@pytest.mark.parametrize("stream", [True, False])
async def test_request_that_ends_on_prefill(cluster: Cluster, stream: bool):
    cluster.prefill.prefill_finish = "stop"
    cluster.decode.delay = 0.2
    cluster.decode.token_delay = 0.2
    body = chat(stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    async with cluster.post("/v1/chat/completions", body) as r:
        if stream:
            events = await read_sse(r)
            role, last, usage, done = events
            assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert last["choices"][0]["delta"] == {"content": "Hello"}
            assert last["choices"][0]["finish_reason"] == "stop"
            assert usage["usage"]["completion_tokens"] == 1 and done == "[DONE]"
        else:
            data = await r.json()
            assert data["choices"][0]["message"]["content"] == "Hello"
            assert data["choices"][0]["finish_reason"] == "stop"
            assert data["usage"]["completion_tokens"] == 1
    await asyncio.wait_for(cluster.decode.hung_up.wait(), 10)  # the decode call was dropped (it would end by itself)


async def test_client_disconnect_cancels_decode(cluster: Cluster):
    cluster.decode.tokens = ["t"] * 40
    cluster.decode.token_delay = 0.05
    async with cluster.post("/v1/completions", completion(stream=True, max_tokens=40)) as r:
        await r.content.readline()  # the first token arrived
        await r.content.readline()
    await asyncio.wait_for(cluster.decode.hung_up.wait(), 10)  # (uncancelled, its 40 tokens end in 2 s: no hang-up)


async def test_model_name_alias():
    c, close = await make_cluster(model_name="public-name")
    try:
        async with c.post("/v1/completions", completion(model="public-name")) as r:
            data = await r.json()
        assert data["model"] == "public-name"
        assert c.prefill.received[0].body["model"] == MODEL == c.decode.received[0].body["model"]
        async with c.post("/v1/completions", completion(model=MODEL)) as r:
            assert r.status == 404
        async with c.http.get(c.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["public-name"]
    finally:
        await close()


async def test_health_and_model_omitted(cluster: Cluster):
    async with cluster.http.get(cluster.url + "/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    body = completion()
    del body["model"]
    async with cluster.post("/v1/completions", body) as r:
        assert r.status == 200


# ------------------------------------------------------------------ errors


def assert_openai_error(data: dict) -> None:
    assert set(data) == {"error"}
    assert {"message", "type", "param", "code"} <= set(data["error"])
    assert data["error"]["message"]


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/completions", b"{bad json", 400),
        ("/v1/completions", b"[]", 400),
        ("/v1/completions", completion(max_tokens=0), 400),
        ("/v1/completions", completion(n=0), 400),
        ("/v1/completions", completion(logprobs=21), 400),
        ("/v1/completions", completion(echo=True, max_tokens=-1), 400),
        ("/v1/completions", {"model": MODEL}, 400),
        ("/v1/chat/completions", chat(tools=[{"type": "function"}]), 400),
        ("/v1/chat/completions", chat(messages=[]), 400),
        ("/v1/chat/completions", chat(temperature=-1), 400),
        ("/v1/chat/completions", chat(model="no-such-model"), 404),
        ("/v1/completions", completion(prompt="x" * (65 * 1024)), 413),
        ("/v1/nothing", completion(), 404),
    ],
)
async def test_bad_requests_never_reach_workers(path, body, status):
    c, close = await make_cluster(max_body_bytes=64 * 1024)
    try:
        async with c.post(path, body) as r:
            assert r.status == status
            assert r.content_type == "application/json"
            data = await r.json()
        assert_openai_error(data)
        if status == 404 and "model" in path:
            assert data["error"]["code"] == "model_not_found"
        assert all(not w.received for w in c.workers())
    finally:
        await close()


async def test_get_on_post_route_is_405_json(cluster: Cluster):
    async with cluster.http.get(cluster.url + "/v1/completions") as r:
        assert r.status == 405
        assert_openai_error(await r.json())


@pytest.mark.parametrize("failing", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
async def test_worker_4xx_is_passed_through(cluster: Cluster, failing: str, stream: bool):
    err = {"error": {"message": "prompt is too long", "type": "BadRequestError", "param": None,
                     "code": 400}}
    bad, other = (cluster.prefill, cluster.decode) if failing == "prefill" else (cluster.decode, cluster.prefill)
    bad.fail = (400, err)
    other.delay = 6.0
    t0 = time.monotonic()
    async with cluster.post("/v1/completions", completion(stream=stream)) as r:
        assert r.status == 400
        assert await r.json() == err
    assert time.monotonic() - t0 < other.delay / 2, "the error must not wait for the other worker"
    await asyncio.wait_for(other.hung_up.wait(), other.delay / 2)  # and the other call is cancelled


@pytest.mark.parametrize("failing", ["prefill", "decode"])
@pytest.mark.parametrize("worker_status, status", [(500, 502), (503, 503), (504, 504)])
async def test_worker_5xx(cluster: Cluster, failing: str, worker_status: int, status: int):
    getattr(cluster, failing).fail = (worker_status, "Internal Server Error")
    async with cluster.post("/v1/completions", completion()) as r:
        assert r.status == status
        data = await r.json()
    assert_openai_error(data)
    assert data["error"]["type"] == "server_error" and failing in data["error"]["message"]


@pytest.mark.parametrize("code, status", [(504, 504), (503, 503), (500, 502), (None, 502)])
async def test_decode_in_stream_error_keeps_a_503_or_504(cluster: Cluster, code, status: int):
    """A decode worker fails after its 200 (e.g. prefill's KV not ready in time: 504, in the
    event's ``code``). A client still waiting for its JSON body gets that status; a streaming
    client, whose status line went out with prefill's token, gets it as an error event."""
    cluster.decode.stream_error = {"message": "prefill not ready within 1s", "type": "server_error",
                                   "param": None, "code": code}
    async with cluster.post("/v1/completions", completion()) as r:
        assert r.status == status
        data = await r.json()
    assert_openai_error(data)
    assert data["error"]["type"] == "server_error"
    assert data["error"]["message"] == "decode worker failed: prefill not ready within 1s"
    async with cluster.post("/v1/chat/completions", chat(stream=True)) as r:
        assert r.status == 200
        events = await read_sse(r)
    assert content_of(events[1]) == "Hello"
    assert "prefill not ready" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    # The worker answered: it is not marked down, and serves the next request.
    cluster.decode.stream_error = None
    async with cluster.post("/v1/completions", completion()) as r:
        assert r.status == 200


async def test_worker_timeout_is_504():
    c, close = await make_cluster(read_timeout=0.3)
    try:
        c.prefill.delay = 2.0
        checks = c.prefill.health_checks
        async with c.post("/v1/completions", completion()) as r:
            assert r.status == 504
            assert_openai_error(await r.json())
        # The slow worker is down until the poller sees its /health answer 200 (the first one).
        await wait_health(c, c.prefill.url, "up")
        assert c.prefill.health_checks - checks == 1
        # Stalling after the first token: the status is sent, so the error is in-stream.
        c.prefill.delay = 0
        c.decode.delay = 2.0
        async with c.post("/v1/chat/completions", chat(stream=True)) as r:
            assert r.status == 200
            events = await read_sse(r)
        assert content_of(events[1]) == "Hello"
        assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    finally:
        await close()


async def test_worker_down_is_retried_and_proxy_keeps_serving():
    c, close = await make_cluster(n_decode=2)
    try:
        await c.decodes[1].stop()
        for _ in range(4):  # the dead worker is marked down at once and never chosen again
            async with c.post("/v1/completions", completion()) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["text"] == "".join(TOKENS)
        async with c.post("/v1/chat/completions", chat(stream=True)) as r:
            assert r.status == 200
            assert (await read_sse(r))[-1] == "[DONE]"
        assert len(c.decodes[0].received) == 5
        async with c.http.get(c.url + "/health") as r:
            assert r.status == 200 and (await r.json())["decode"] == 1
        # The last decode worker goes too: the retry finds none left, 503 says why.
        await c.decodes[0].stop()
        async with c.post("/v1/completions", completion()) as r:
            assert r.status == 503
            data = await r.json()
        assert_openai_error(data)
        assert "no decode worker available" in data["error"]["message"]
        assert "(after: decode worker unreachable: ConnectFailed" in data["error"]["message"]  # what led there
        assert not internal_names(c, data["error"]["message"])
        async with c.http.get(c.url + "/health") as r:
            assert r.status == 503
    finally:
        c.decodes.clear()  # already stopped
        await close()


async def test_health_503_without_workers():
    class Empty:
        async def start(self) -> None: ...
        def workers(self, role: Role) -> list[WorkerInfo]:
            return []
        async def close(self) -> None: ...

    assert isinstance(Empty(), Registry)
    url, stop, task = await start_proxy(ProxyConfig(port=free_port()), Empty())
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                assert r.status == 503
            async with s.post(url + "/v1/completions", json=completion()) as r:
                assert r.status == 503
                assert_openai_error(await r.json())
            async with s.get(url + "/v1/models") as r:
                assert (await r.json())["data"] == []
    finally:
        stop.set()
        await task


# ------------------------------------------------------------------ what the client sees of the cluster


def internal_names(c: Cluster, text: str) -> list[str]:
    """Every internal name in ``text``: a worker's URL, host:port or signal address, or a workers' request id."""
    names = [n for w in c.workers() for n in (w.url, w.url.removeprefix("http://"), w.signal_addr)]
    return [n for n in [*names, "xpyd-", "~p~", "127.0.0.1"] if n in text]


async def test_the_client_sees_the_public_id_and_no_internal_address(cluster: Cluster):
    """X-Request-Id is the response's id (the workers' id names both workers' addresses); a client's own
    X-Request-Id names the response and comes back, as vLLM does, on every answer."""
    for path, body, prefix in (("/v1/completions", completion(), "cmpl-"), ("/v1/chat/completions", chat(), "chatcmpl-")):
        async with cluster.post(path, body) as r:
            data = await r.json()
            assert r.status == 200 and r.headers["X-Request-Id"] == data["id"] and data["id"].startswith(prefix)
            assert not internal_names(cluster, json.dumps([dict(r.headers), data]))
        async with cluster.post(path, {**body, "stream": True}) as r:
            header, raw = r.headers["X-Request-Id"], await r.read()
        ids = {json.loads(e[6:])["id"] for e in sse_events(raw)[:-1]}
        assert ids == {header} and header.startswith(prefix) and not internal_names(cluster, raw.decode())
        async with cluster.post(path, body, headers={"X-Request-Id": "trace-7f3a/1;p=2"}) as r:
            assert r.headers["X-Request-Id"] == "trace-7f3a/1;p=2"
            assert (await r.json())["id"] == prefix + "trace-7f3a/1;p=2"
    # The workers still get the proxy's own id (both addresses in it), never the client's.
    assert all(parse_request_id(x.headers["X-Request-Id"]) for w in cluster.workers() for x in w.received)
    async with cluster.http.get(cluster.url + "/v1/models", headers={"X-Request-Id": "abc"}) as r:
        assert r.headers["X-Request-Id"] == "abc"
    async with cluster.post("/v1/completions", completion(model="other"), headers={"X-Request-Id": "abc"}) as r:
        assert r.status == 404 and r.headers["X-Request-Id"] == "abc"
    async with cluster.post("/v1/completions", completion()) as r:  # none sent: the response's id
        assert r.headers["X-Request-Id"] == (await r.json())["id"]


@pytest.mark.parametrize("rid", ["x" * 201, 'a"b', "a\\b", "a b", "caf\u00e9"])
async def test_a_client_request_id_that_cannot_name_a_response_is_a_400(cluster: Cluster, rid: str):
    """vLLM takes any X-Request-Id; here it names the response, so one that cannot is refused (rather than
    replaced: the client would get back an id it did not send) before the workers see anything."""
    async with cluster.http.post(cluster.url + "/v1/completions", data=json.dumps(completion()).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": rid.encode().decode("latin-1")}) as r:
        assert r.status == 400
        data = await r.json()
        assert "X-Request-Id" not in r.headers
    assert_openai_error(data)
    assert data["error"]["param"] == "X-Request-Id" and "X-Request-Id must be" in data["error"]["message"]
    assert all(not w.received for w in cluster.workers())


async def test_openai_client_reads_the_public_id(cluster: Cluster):
    """As a user of the official client reads them: the response's id and its X-Request-Id header."""
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        answer = raw.parse()
        assert raw.headers["x-request-id"] == answer.id and answer.id.startswith("chatcmpl-")
        raw = await client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=5, stream=True,
                                                                 extra_headers={"X-Request-Id": "mine-42"})
        chunks = [ch async for ch in raw.parse()]
        assert raw.headers["x-request-id"] == "mine-42" and {ch.id for ch in chunks} == {"cmpl-mine-42"}
        assert "".join(ch.choices[0].text for ch in chunks) == "".join(TOKENS)
        cluster.decode.stream_error = {"message": "KV transfer failed: {rid}", "type": "server_error",
                                       "param": None, "code": 502}
        with pytest.raises(openai.APIStatusError) as e:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=5,
                                            extra_headers={"X-Request-Id": "mine-43"})
        assert e.value.status_code == 502 and e.value.response.headers["x-request-id"] == "mine-43"
        assert e.value.message.endswith("decode worker failed: KV transfer failed: cmpl-mine-43")
    finally:
        await client.close()


# A worker's own message naming the cluster's inside: its request id, its peer, other hosts.
LEAKY = ("KV transfer failed for {rid} (xpyd-0123456789abcdef0123456789abcdef.1): prefill at {prefill} and "
         "10.1.2.3:7000 and [fd00::5]:7001 and fd00::6 did not answer; see http://prefill-0.internal:8100/x or "
         "etcd.kube-system.svc:2379; Connect call failed ('10.1.2.4', 8100)")
LEAKY_REDACTED = ("KV transfer failed for {public} ([internal id]): prefill at [internal address] and [internal "
                  "address] and [internal address] and [internal address] did not answer; see [internal address] "
                  "or [internal address]; Connect call failed [internal address]")


@pytest.mark.parametrize("where", ["decode in stream, JSON answer", "decode in stream, streaming",
                                   "prefill 4xx body", "decode 5xx text"])
async def test_worker_error_texts_reach_the_client_without_internal_names(cluster: Cluster, where: str):
    """A worker's error text is passed on, but what it says of the cluster's inside is not: addresses become
    [internal address], the workers' request id the response's id, any other such id [internal id]."""
    leaky = LEAKY.replace("{prefill}", cluster.prefill.signal_addr)
    headers = {"X-Request-Id": "req-1"}
    body, stream = completion(), where.endswith("streaming")
    if where.startswith("decode in stream"):
        cluster.decode.stream_error = {"message": leaky, "type": "server_error", "param": None, "code": 502}
    elif where == "prefill 4xx body":
        cluster.prefill.fail = (400, {"error": {"message": leaky, "type": "BadRequestError", "param": "{rid}",
                                                "code": 400, "detail": [leaky]}})
    else:
        cluster.decode.fail = (500, {"error": {"message": leaky}})  # (a text body is cut at 200 characters)
    async with cluster.post("/v1/completions", {**body, "stream": stream}, headers=headers) as r:
        raw = await r.read()
        assert r.headers["X-Request-Id"] == "req-1"
        assert not internal_names(cluster, json.dumps(dict(r.headers)))
    assert not internal_names(cluster, raw.decode())
    for name in ("10.1.2", "fd00", "prefill-0.internal", "etcd.kube", "8100", "7001", "2379"):
        assert name not in raw.decode()
    expected = LEAKY_REDACTED.replace("{public}", "cmpl-req-1")
    if stream:
        error = json.loads(sse_events(raw)[-2][6:])["error"]
        assert error["message"] == f"decode worker failed: {expected}"
    else:
        error = json.loads(raw)["error"]
        if where == "prefill 4xx body":  # the worker's own body, otherwise as it sent it
            assert r.status == 400 and error == {"message": expected, "type": "BadRequestError",
                                                 "param": "cmpl-req-1", "code": 400, "detail": [expected]}
        elif where == "decode 5xx text":
            assert r.status == 502 and error["message"] == f"decode worker failed with HTTP 500: {expected}"
        else:
            assert r.status == 502 and error["message"] == f"decode worker failed: {expected}"


# ------------------------------------------------------------------ static discovery


async def test_static_registry_checks_roles_and_models():
    p = FakeWorker(Role.PREFILL, 15555)
    d = FakeWorker(Role.DECODE, 16666, model="another-model")
    await p.start()
    await d.start()
    try:
        with pytest.raises(RegistryError, match=f"worker {re.escape(d.url)} was given as prefill but reports role decode"):
            await StaticRegistry([d.url], [p.url], timeout=2).start()
        with pytest.raises(RegistryError, match="different models"):
            await StaticRegistry([p.url], [d.url], timeout=2).start()
        d.model = MODEL
        reg = StaticRegistry([p.url + "/"], [d.url], timeout=2)
        await reg.start()
        assert [w.http_url for w in reg.workers(Role.PREFILL)] == [p.url]
        assert [w.signal_addr for w in reg.workers(Role.DECODE)] == [d.signal_addr]
    finally:
        await p.stop()
        await d.stop()


async def test_static_registry_names_unreachable_worker():
    p = FakeWorker(Role.PREFILL, 15555)
    await p.start()
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    try:
        with pytest.raises(RegistryError, match=f"decode worker {re.escape(dead)} not ready after 0.5s"):
            await StaticRegistry([p.url], [dead], timeout=0.5).start()
        assert time.monotonic() - t0 < 10  # its own timeout, not the default 60 s
        with pytest.raises(RegistryError, match="invalid URL"):
            await StaticRegistry([p.url], ["http://127.0.0.1:999999"], timeout=0.5).start()
    finally:
        await p.stop()


async def test_main_serves_and_stops_on_sigterm():
    p, d = FakeWorker(Role.PREFILL, 15555), FakeWorker(Role.DECODE, 16666)
    await p.start()
    await d.start()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "xpyd.proxy.main", "--port", str(port),
        "--prefill", p.url, "--decode", d.url, "--worker-wait", "10",
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=completion()) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["text"] == "".join(TOKENS)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await p.stop()
        await d.stop()


async def test_main_dynamic_mode_discovers_workers_in_etcd(etcd):
    from xpyd.discovery.etcd_registration import EtcdRegistration

    p, d = FakeWorker(Role.PREFILL, 15555), FakeWorker(Role.DECODE, 16666)
    await p.start()
    await d.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "xpyd.proxy.main", "--port", str(port), "--etcd", etcd.endpoint,
        "--policy", "round_robin",
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    regs = [EtcdRegistration(etcd.endpoint, WorkerInfo(w.role, w.url, w.signal_addr, MODEL, PROTOCOL_VERSION, 8))
            for w in (p, d)]  # (the proxy ignores workers of another protocol version)

    async def cluster_size(s: aiohttp.ClientSession, n: int) -> None:
        for _ in range(100):
            async with s.get(url + "/cluster") as r:
                data = await r.json()
            if len(data["workers"]) == n:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the proxy never saw {n} workers: {data}")

    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(300):  # serving with no workers at all: 503, not a crash
                try:
                    async with s.get(url + "/health") as r:
                        assert r.status == 503
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            async with s.post(url + "/v1/completions", json=completion()) as r:
                assert r.status == 503
            for reg in regs:
                await reg.start()
            await cluster_size(s, 2)
            async with s.get(url + "/cluster") as r:
                assert (await r.json())["policy"] == "round_robin"
            async with s.post(url + "/v1/completions", json=completion()) as r:
                assert r.status == 200
                assert (await r.json())["choices"][0]["text"] == "".join(TOKENS)
            await regs[1].close()  # decode leaves: forgotten at once
            await cluster_size(s, 1)
            async with s.post(url + "/v1/completions", json=completion()) as r:
                assert r.status == 503
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        for reg in regs:
            await reg.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await p.stop()
        await d.stop()


# ------------------------------------------------------------------ configuration


def test_cli_builds_a_valid_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--port", "9000", "--prefill", "http://a:1", "--prefill", "http://b:2",
                              "--decode", "http://c:3", "--model-name", "m", "--read-timeout", "30",
                              "--pair-cooldown", "2.5"])
    config = config_from_args(args)
    assert config.pair_cooldown == 2.5
    assert config.prefill_urls == ("http://a:1", "http://b:2") and config.decode_urls == ("http://c:3",)
    assert (config.port, config.model_name, config.read_timeout, config.host) == (9000, "m", 30.0, "127.0.0.1")
    assert config.etcd is None and config.policy is Policy.CACHE_AWARE  # two prefill workers: a choice
    one_each = ["--prefill", "http://a:1", "--decode", "http://c:3"]
    assert config_from_args(parser.parse_args(one_each)).policy is Policy.LEAST_LOADED  # no choice
    assert config_from_args(parser.parse_args([*one_each, "--policy", "cache_aware"])).policy is Policy.CACHE_AWARE
    assert config_from_args(parser.parse_args(["--etcd", "e:2379"])).policy is Policy.CACHE_AWARE
    for argv in (["--prefill", "http://a:1"], [], ["--etcd", "e:2379", "--decode", "http://c:3"]):
        with pytest.raises(ValueError):  # static needs both roles; etcd excludes static
            config_from_args(parser.parse_args(argv))
    config = config_from_args(parser.parse_args(["--etcd", "10.0.0.9:2379", "--policy", "round_robin"]))
    assert config.etcd == "10.0.0.9:2379" and config.policy is Policy.ROUND_ROBIN
    assert config.prefill_urls == config.decode_urls == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["--etcd", "e:1", "--policy", "random"])


@pytest.mark.parametrize(
    "kw",
    [
        {"port": 0},
        {"port": 70000},
        {"host": ""},
        {"model_name": " "},
        {"read_timeout": 0},
        {"connect_timeout": float("inf")},
        {"discovery_timeout": -1},
        {"max_body_bytes": 10},
        {"max_connections": 0},
        {"prefill_urls": ("localhost:8100",)},
        {"decode_urls": ("ftp://x:1",)},
        {"etcd": "localhost"},
        {"etcd": "e:1", "prefill_urls": ("http://a:1",)},
        {"policy": "least_loaded"},
        {"poll_interval": 0},
        {"retries": -1},
        {"pair_cooldown": 0},
        {"pair_cooldown": 61},
    ],
)
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        ProxyConfig(**kw)
