"""Who gets into the proxy and when (real proxy on a real port, fake workers from test_proxy_routing).

API key (401), the concurrency limit (429), the bounded queue when every decode
worker is full (503), bodies that are not JSON (415), and requests whose prefill
worker goes down after the first token (the proxy ends them itself).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest
from aiohttp import web

from tests.integration.test_proxy_routing import MODEL, Worker, make_env  # noqa: F401 - make_env is a fixture
from tests.waiting import until
from xpyd.api.openai import APIError
from xpyd.discovery.types import Role
from xpyd.proxy.admission import ApiKey, DecodeQueue
from xpyd.proxy.app import ProxyConfig
from xpyd.proxy.main import add_arguments, config_from_args


KEY = "sk-test-0123456789"
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 3}


def assert_openai_error(data: dict, status_type: str | None = None, code: str | None = None) -> None:
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["message"]
    if status_type is not None:
        assert data["error"]["type"] == status_type
    if code is not None:
        assert data["error"]["code"] == code


# ------------------------------------------------------------------ API key


@pytest.mark.parametrize("auth", [None, "", "Bearer", "Bearer wrong-key-000000", f"Basic {KEY}", KEY,
                                  f"Bearer {KEY}x", f"Bearer {KEY[:-1]}"])
async def test_api_key_required_on_everything_but_health(make_env, auth):
    env = await make_env(n_prefill=1, n_decode=1, api_key=KEY)
    headers = {} if auth is None else {"Authorization": auth}
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/cluster"), ("GET", "/metrics"), ("GET", "/nothing")]:
        async with env.http.request(method, env.url + path, json=BODY, headers=headers) as r:
            assert r.status == 401, (path, await r.text())
            assert r.headers["WWW-Authenticate"] == "Bearer"
            assert_openai_error(await r.json(), "invalid_request_error", "invalid_api_key")
    async with env.http.get(env.url + "/health") as r:
        assert r.status == 200  # probes need no key
    assert all(not w.received for w in (*env.prefill, *env.decode))


async def test_api_key_accepted(make_env):
    env = await make_env(n_prefill=1, n_decode=1, api_key=KEY)
    for auth in (f"Bearer {KEY}", f"bearer {KEY}", f"  Bearer   {KEY}  "):
        async with env.http.post(env.url + "/v1/completions", json=BODY, headers={"Authorization": auth}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["text"] == "Hi there!"
    for path in ("/cluster", "/metrics", "/v1/models"):
        async with env.http.get(env.url + path, headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200


def test_api_key_from_flag_or_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--prefill", "http://a:1", "--decode", "http://b:2"]
    monkeypatch.delenv("XPYD_API_KEY", raising=False)
    assert config_from_args(parser.parse_args(base)).api_key is None
    monkeypatch.setenv("XPYD_API_KEY", KEY)
    config = config_from_args(parser.parse_args(base))
    assert config.api_key == KEY and KEY not in repr(config)
    assert config_from_args(parser.parse_args([*base, "--api-key", "other-key-123"])).api_key == "other-key-123"
    for bad in ("short", "has space in it", "x" * 600, "caf\u00e9-key-1234"):
        with pytest.raises(ValueError):
            ProxyConfig(api_key=bad)
    args = parser.parse_args([*base, "--max-concurrent-requests", "7", "--max-queue", "3", "--queue-timeout", "2.5"])
    config = config_from_args(args)
    assert (config.max_concurrent_requests, config.max_queue, config.queue_timeout) == (7, 3, 2.5)
    for kw in ({"max_concurrent_requests": 0}, {"max_queue": -1}, {"queue_timeout": 0}):
        with pytest.raises(ValueError):
            ProxyConfig(**kw)


def test_api_key_check_is_constant_time_compare(monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    ApiKey(KEY).check(f"Bearer {KEY}")
    assert calls == [(KEY.encode(), KEY.encode())]


# ------------------------------------------------------------------ concurrency limit


async def test_concurrency_limit_is_429_and_frees_up(make_env):
    env = await make_env(n_prefill=1, n_decode=1, max_concurrent_requests=2)
    env.decode[0].delay = 0.6
    stream = {**BODY, "stream": True}

    async def one(body: dict) -> tuple[int, str]:
        async with env.post(body) as r:
            return r.status, await r.text()

    streams = [asyncio.create_task(one(stream)), asyncio.create_task(one(BODY))]
    await until(lambda: len(env.decode[0].received) >= 2, "both requests at the decode worker")
    async with env.post(BODY) as r:
        assert r.status == 429
        assert r.headers["Retry-After"] == "1"
        assert_openai_error(await r.json(), "rate_limit_error", "rate_limit_exceeded")
    async def active() -> int:
        return (await env.cluster())["queue"]["active_requests"]

    async def places_free() -> bool:
        return await active() == 0

    assert [s for s, _ in await asyncio.gather(*streams)] == [200, 200]
    await until(places_free, "both places given back")
    assert await env.complete() == 200 and await env.complete(stream=True) == 200
    # A client that leaves mid-stream gives its place back too.
    async with env.post(stream) as r:
        assert r.status == 200
        await until(lambda: len(env.decode[0].received) == 5, "the stream at the decode worker")
        assert await active() == 1  # it holds its place while it streams
    await until(places_free, "the place of the client that left given back")
    assert len(env.decode[0].received) == 5  # the refused request reached no worker


# ------------------------------------------------------------------ overload queue


async def test_full_decode_workers_queue_then_503(make_env):
    queue_timeout = 2.0
    env = await make_env(n_prefill=1, n_decode=2, max_queue=1, queue_timeout=queue_timeout)
    for d in env.decode:
        d.backlog = 8  # 2 x capacity 4: full
        await env.wait_reported(d, 8)
    t0 = time.monotonic()
    waiting = asyncio.create_task(env.complete())
    async def one_waiting() -> bool:
        return (await env.cluster())["queue"]["waiting"] == 1

    await until(one_waiting, "one request in the queue")
    async with env.http.get(env.url + "/metrics") as r:
        assert "xpyd_proxy_queue_waiting 1.0" in await r.text()
    async with env.post(BODY) as r:  # the queue (1) is full: refused at once
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert_openai_error(await r.json(), "server_error", "server_overloaded")
        assert "queued" in (await r.json())["error"]["message"]
    assert not waiting.done() and time.monotonic() - t0 < queue_timeout  # while the other one still waits
    assert await waiting == 503  # waited its queue_timeout, then gave up
    assert queue_timeout * 0.9 < time.monotonic() - t0 < queue_timeout + 5
    assert all(not w.received for w in (*env.prefill, *env.decode))
    # Room appears while a request waits: it goes through.
    waiting = asyncio.create_task(env.complete())
    await until(one_waiting, "the next request in the queue")
    env.decode[1].backlog = 0
    assert await waiting == 200
    assert len(env.decode[1].received) == 1 and not env.decode[0].received


async def test_queue_is_fifo_and_bounded_by_room():
    room = 0
    q = DecodeQueue(lambda: room, max_queue=10, timeout=5)
    order = []

    async def one(i: int) -> None:
        await q.wait()
        order.append(i)

    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(one(i)))
        await until(lambda: q.waiting == i + 1, f"request {i} in the queue")  # queued in this order
    assert order == []
    room = 2
    q.wake()
    await until(lambda: len(order) >= 2, "two requests let through")
    assert order == [0, 1] and q.waiting == 2  # two places: the two oldest, and nobody else
    tasks[2].cancel()  # a client that leaves while queued
    room = 1
    q.wake()
    await until(lambda: len(order) >= 3, "the next request let through")
    assert order == [0, 1, 3] and q.waiting == 0
    await asyncio.gather(*tasks, return_exceptions=True)
    room = None  # no decode worker UP at all: nothing to wait for (routing answers 503)
    await asyncio.wait_for(q.wait(), 0.1)


async def test_queue_place_granted_to_a_client_that_left_goes_to_the_next():
    q = DecodeQueue(lambda: 1, max_queue=10, timeout=5)
    q._reserved = 1  # the one place is promised to someone routing right now
    first = asyncio.create_task(q.wait())
    second = asyncio.create_task(q.wait())
    await until(lambda: q.waiting == 2, "both in the queue")
    q._reserved = 0  # ...who routed: the place is free again
    q.wake()  # granted to `first`, which has not run yet
    first.cancel()  # its client leaves before it could route
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # the place went on to the next in line
    assert q._reserved == 0 and q.waiting == 0


async def test_queue_timeout_and_zero_queue():
    q = DecodeQueue(lambda: 0, max_queue=0, timeout=5)
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        await q.wait()
    assert e.value.status == 503 and time.monotonic() - t0 < 1.0  # no queue: refused at once, not after 5 s
    q = DecodeQueue(lambda: 0, max_queue=3, timeout=0.2)
    with pytest.raises(APIError) as e:
        await q.wait()
    assert e.value.status == 503 and "0.2 s" in e.value.message and q.waiting == 0


# ------------------------------------------------------------------ bodies


@pytest.mark.parametrize("content_type, status", [
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
    ("application/vnd.api+json", 200), (None, 200),
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data; boundary=x", 415),
])
async def test_content_type(make_env, content_type, status):
    env = await make_env(n_prefill=1, n_decode=1)
    headers = {} if content_type is None else {"Content-Type": content_type}
    data = json.dumps(BODY).encode()
    async with env.http.post(env.url + "/v1/completions", data=data, headers=headers,
                             skip_auto_headers=["Content-Type"]) as r:
        assert r.status == status, await r.text()
        if status != 200:
            assert_openai_error(await r.json(), "invalid_request_error", "unsupported_media_type")
    assert len(env.prefill[0].received) == (status == 200)


async def test_lone_surrogate_is_400(make_env):
    env = await make_env(n_prefill=1, n_decode=1)
    data = b'{"model": "fake-model", "prompt": "a\\ud800b", "max_tokens": 3}'
    async with env.http.post(env.url + "/v1/completions", data=data,
                             headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert "Unicode" in (await r.json())["error"]["message"]


# ------------------------------------------------------------------ prefill worker dies after the first token


class StallingDecode(Worker):
    """Opens its stream and then sends nothing: waiting for KV that never comes."""

    async def _stream(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(60)
        return resp


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("decode_answered", [True, False])
async def test_prefill_down_ends_requests_waiting_for_its_kv(make_env, stream, decode_answered):
    env = await make_env(n_prefill=1, n_decode=1)
    stalling = StallingDecode(Role.DECODE, env.decode[0].signal_port)
    if not decode_answered:
        stalling.delay = 60  # not even the response headers
    await env.decode[0].stop()
    env.decode[0] = stalling
    env.registry.listed[1] = stalling
    await stalling.start()
    await env.wait_for(stalling, "up")
    stop_at = asyncio.get_running_loop().create_future()

    async def request() -> tuple[int, bytes]:
        async with env.post({**BODY, "stream": stream}) as r:
            if stream:
                first = await r.content.readline()
                assert json.loads(first[6:])["choices"][0]["text"] == "Hi"
                stop_at.set_result(None)
            return r.status, await r.read()

    task = asyncio.create_task(request())
    if not stream:
        await until(lambda: stalling.received, "the request at the stalling worker")
        stop_at.set_result(None)
    await stop_at
    await until(lambda: env.prefill[0].answered, "prefill's answer (the first token) on its way to the proxy")
    t0 = time.monotonic()
    await env.prefill[0].stop()  # the poller sees it refuse and marks it down
    status, body = await asyncio.wait_for(task, 30.0)
    assert time.monotonic() - t0 < 10.0  # at the next poll (every 0.2 s), not when decode gives up (60 s)
    if stream:
        assert status == 200
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        error = json.loads(events[-2])
        assert events[-1] == "[DONE]"
    else:  # retried on a fresh pair (the client had seen nothing), but there is no other prefill worker
        assert status == 503
        error = json.loads(body)
        assert "no prefill worker available" in error["error"]["message"]
    assert_openai_error(error, "server_error")
    assert "prefill worker" in error["error"]["message"] and "went down" in error["error"]["message"]
    # The decode call is dropped (which aborts it on a real worker) and the slot is free again.
    await until(lambda: stalling.active == 0, "the decode call dropped")

    async def places_free() -> bool:
        return (await env.cluster())["queue"]["active_requests"] == 0

    await until(places_free, "the request's place given back")


def test_xpyd_up_passes_routing_and_admission_flags_to_the_proxy():
    from xpyd.launcher import up as launcher

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args([])
    assert launcher._proxy_options(args) == [] and launcher._proxy_env(args) is None
    args = parser.parse_args(["--api-key", KEY, "--max-concurrent-requests", "9", "--max-queue", "0",
                              "--queue-timeout", "1.5", "--policy", "cache_aware"])
    assert launcher._proxy_options(args) == ["--policy", "cache_aware", "--max-concurrent-requests", "9",
                                             "--max-queue", "0", "--queue-timeout", "1.5"]
    assert launcher._proxy_env(args)["XPYD_API_KEY"] == KEY  # not on the command line
    with pytest.raises(ValueError, match="colocated"):
        launcher._plan(parser.parse_args(["--colocated", "--policy", "least_loaded"]))


# ------------------------------------------------------------------ decode fails after prefill answered


class AbortRecordingPrefill(Worker):
    """A prefill worker that also serves ``POST /xpyd/abort`` and records the ids it was told to drop."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.aborted: list[str] = []

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/xpyd/stats", self._stats)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/xpyd/abort", self._abort)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()
        self.port = self.runner.addresses[0][1]

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborted.append(request.headers["X-Request-Id"])
        return web.json_response({"aborted": request.headers["X-Request-Id"]})


async def _swap_prefill(env) -> AbortRecordingPrefill:
    prefill = AbortRecordingPrefill(Role.PREFILL, env.prefill[0].signal_port)
    await prefill.start()
    await env.prefill[0].stop()
    env.prefill[0] = env.registry.listed[0] = prefill
    await env.wait_for(prefill, "up")
    return prefill


@pytest.mark.parametrize("stream", [True, False])
async def test_decode_failing_after_prefill_answered_releases_the_kv_on_prefill(make_env, stream):
    env = await make_env(n_prefill=1, n_decode=1, retries=0)
    prefill = await _swap_prefill(env)
    env.decode[0].drop_mid_stream = True
    async with env.post({**BODY, "stream": stream}) as r:
        await r.read()
        assert r.status == (200 if stream else 502)
    await until(lambda: prefill.aborted, "an abort at the prefill worker")
    assert prefill.aborted == prefill.received  # the one request, by its id


async def test_a_client_gone_before_prefill_answered_releases_prefill_also_when_decode_got_it(make_env):
    """The decode worker may never register a request whose HTTP call was cut right after it was sent (its
    handler is cancelled before it submits), so it cannot release prefill's KV: the proxy does."""
    env = await make_env(n_prefill=1, n_decode=1)
    prefill = await _swap_prefill(env)
    prefill.delay = 1.0  # prefill has not answered when the client goes
    env.decode[0].delay = 5.0
    task = asyncio.create_task(env.complete(stream=True))
    await until(lambda: prefill.received and env.decode[0].received, "the request at both workers")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await until(lambda: prefill.aborted, "an abort at the prefill worker")
    assert prefill.aborted == prefill.received  # the one request, by its id


async def test_completed_request_sends_no_abort(make_env):
    env = await make_env(n_prefill=1, n_decode=1)
    prefill = await _swap_prefill(env)
    assert await env.complete() == 200 and await env.complete(stream=True) == 200
    # A marker request that does need an abort (decode drops its stream): an abort for either request
    # above would have been sent before the marker's, so once the marker's is in, none came for them.
    env.decode[0].drop_mid_stream = True
    async with env.post({**BODY, "stream": True}) as r:
        await r.read()
    await until(lambda: prefill.aborted, "the marker's abort at the prefill worker")
    assert len(prefill.received) == 3 and prefill.aborted == prefill.received[2:]


async def test_prefill_answering_5xx_does_not_end_requests_waiting_for_its_kv(make_env):
    env = await make_env(n_prefill=1, n_decode=1)
    stalling = StallingDecode(Role.DECODE, env.decode[0].signal_port)
    stalling.delay = 0.8  # decode's stream starts late: the request waits for its KV meanwhile
    await env.decode[0].stop()
    env.decode[0] = env.registry.listed[1] = stalling
    await stalling.start()
    await env.wait_for(stalling, "up")
    task = asyncio.create_task(env.complete(stream=False))
    await until(lambda: stalling.received, "the request at the stalling worker")
    env.prefill[0].fail_status = 500  # the next request fails on prefill: marked down, but not gone
    checks = len(env.prefill[0].health_answers)
    async with env.post(BODY) as r:
        assert r.status == 502
    # prefill was marked down (only a down worker gets GET /health) and the poller saw it healthy again
    await until(lambda: len(env.prefill[0].health_answers) > checks, "a health poll of the prefill worker")
    await env.wait_for(env.prefill[0], "up")
    assert not task.done()  # the first request still waits for its KV (its stream stalls: test over)
    task.cancel()


class StallOnce(Worker):
    """Stalls its first stream (waiting for KV that never comes), serves later ones normally."""

    stalled: int = 0

    async def _stream(self, request: web.Request, body: dict) -> web.StreamResponse:
        if self.stalled:
            return await super()._stream(request, body)
        self.stalled += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(60)
        return resp


async def test_non_streaming_request_whose_prefill_died_starts_over_elsewhere(make_env):
    env = await make_env(n_prefill=2, n_decode=1)
    decode = StallOnce(Role.DECODE, env.decode[0].signal_port)
    await env.decode[0].stop()
    env.decode[0] = env.registry.listed[2] = decode
    await decode.start()
    await env.wait_for(decode, "up")
    task = asyncio.create_task(env.complete())
    await until(lambda: decode.stalled, "the decode worker to stall")
    (victim,) = [p for p in env.prefill if p.received]
    t0 = time.monotonic()
    await victim.stop()
    assert await asyncio.wait_for(task, 30.0) == 200  # the client saw nothing of the first try
    assert time.monotonic() - t0 < 10.0  # at the next poll (every 0.2 s), not when decode gives up (60 s)
    (other,) = [p for p in env.prefill if p is not victim]
    assert len(other.received) == 1 and len(decode.received) == 2
