"""Elastic routing through the real proxy (aiohttp.web, real ports) over fake aiohttp workers.

The fake workers report their load on ``GET /xpyd/stats`` (their own in-flight
requests plus a configurable backlog), can be stopped and restarted on the same
port, answer ``/health`` with a chosen status, fail with a 5xx, or drop the
connection in the middle of a stream. The registry is an in-test fake whose
worker lists the tests change while the proxy runs, as etcd would.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from xpyd import PROTOCOL_VERSION
from xpyd.discovery.base import Registry
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.netaddr import reserve_tcp
from xpyd.proxy.app import ProxyConfig, create_app
from xpyd.proxy.http_server import serve
from xpyd.proxy.routing import Policy
from xpyd.signal.request_id import parse_request_id
from tests.cluster import free_port
from tests.waiting import until

MODEL = "fake-model"
TEXT = "Hi there!"


# ------------------------------------------------------------------ fakes


@dataclass
class Worker:
    role: Role
    signal_port: int
    capacity: int = 4
    backlog: int = 0  # reported as waiting, on top of the requests it is handling
    delay: float = 0.0  # before answering (prefill) or streaming (decode)
    health_status: int = 200
    fail_status: int | None = None  # answer generation requests with this status
    drop_mid_stream: bool = False  # decode: close the connection after the first chunk
    drop_before_tokens: bool = False  # decode: close the connection right after the headers (the process died)
    hold: asyncio.Event | None = None  # decode: after the first chunk, wait for this before the rest
    cut_from: set[str] = field(default_factory=set)  # decode: prefill signal addresses it "cannot reach"
    path_failures: int = 0  # decode: requests it failed with a kv_path error (a prefill in cut_from)
    received: list[str] = field(default_factory=list)  # request ids
    answered: list[str] = field(default_factory=list)  # prefill: request ids whose whole answer was written
    health_answers: list[int] = field(default_factory=list)  # the status of each GET /health answered
    stats_polls: int = 0  # GET /xpyd/stats answered
    stats_wait: asyncio.Event | None = None  # /xpyd/stats answers only once this is set (a starved loop)
    slow_chunks: int = 0  # decode: this many more chunks before the last, ``chunk_gap`` seconds apart
    chunk_gap: float = 0.0
    active: int = 0
    port: int = 0  # kept across stop()/start()
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(self.role, self.url, f"127.0.0.1:{self.signal_port}", MODEL, PROTOCOL_VERSION,
                          self.capacity)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/xpyd/stats", self._stats)
        app.router.add_post("/v1/completions", self._generate)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        self.health_answers.append(self.health_status)
        return web.Response(status=self.health_status, text="ok")

    async def _stats(self, request: web.Request) -> web.Response:
        if self.stats_wait is not None:
            await self.stats_wait.wait()
        self.stats_polls += 1
        return web.json_response({"role": self.role.value, "waiting": self.backlog + self.active,
                                  "running": 0, "transferring": 0})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(request.headers["X-Request-Id"])
        self.active += 1
        try:
            if self.fail_status is not None:
                return web.Response(status=self.fail_status, text="boom")
            await asyncio.sleep(self.delay)
            if self.role is Role.PREFILL:
                resp = web.json_response({
                    "choices": [{"index": 0, "text": "Hi", "finish_reason": None}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
                await resp.prepare(request)
                await resp.write_eof()
                self.answered.append(request.headers["X-Request-Id"])
                return resp
            return await self._stream(request, body)
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.drop_before_tokens:
            request.transport.close()
            return resp
        if parse_request_id(request.headers["X-Request-Id"]).prefill_addr in self.cut_from:
            self.path_failures += 1  # as a real decode worker says it: an in-stream error, kv_path set
            error = {"message": "prefill worker unreachable", "type": "server_error", "param": None,
                     "code": 502, "kv_path": True}
            await resp.write(f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        name = {**body["kv_transfer_params"]["response"], "object": "text_completion"}  # as the proxy said
        for i, text in enumerate([" there", *[" ."] * self.slow_chunks, "!"]):
            if i > 1 or (i == 1 and self.slow_chunks):
                await asyncio.sleep(self.chunk_gap)
            last = i == self.slow_chunks + 1
            chunk = {**name, "choices": [{"index": 0, "text": text, "finish_reason": "length" if last else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.drop_mid_stream:
                request.transport.close()
                return resp
            if self.hold is not None and i == 0:
                await self.hold.wait()
        usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        await resp.write(f"data: {json.dumps({**name, 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp


class FakeRegistry:
    """The Registry protocol over lists the test changes at will (etcd's watch, in effect)."""

    def __init__(self, workers: list[Worker]) -> None:
        self.listed: list[Worker] = list(workers)

    async def start(self) -> None: ...

    def workers(self, role: Role) -> list[WorkerInfo]:
        return [w.info for w in self.listed if w.role is role]

    async def close(self) -> None: ...


@dataclass
class Env:
    url: str
    http: aiohttp.ClientSession
    registry: FakeRegistry
    prefill: list[Worker]
    decode: list[Worker]

    def post(self, body: dict | None = None):
        body = body or {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        return self.http.post(self.url + "/v1/completions", json=body)

    async def complete(self, stream: bool = False) -> int:
        async with self.post({"model": MODEL, "prompt": "hello", "max_tokens": 3,
                              "stream": stream}) as r:
            if r.status == 200:
                text = await r.text()
                assert ("Hi" in text and "!" in text) if stream else json.loads(text)["choices"][0]["text"] == TEXT
            return r.status

    async def cluster(self) -> dict:
        async with self.http.get(self.url + "/cluster") as r:
            assert r.status == 200
            return await r.json()

    async def worker_view(self, w: Worker) -> dict | None:
        views = [v for v in (await self.cluster())["workers"] if v["http_url"] == w.url]
        return views[0] if views else None

    async def wait_reported(self, w: Worker, waiting: int) -> None:
        """Until the proxy has polled ``w``'s stats (every ~200 ms) and seen ``waiting``."""
        async def seen() -> bool:
            return ((await self.worker_view(w)) or {}).get("load", {}).get("waiting") == waiting

        await until(seen, f"the proxy to report {waiting} waiting on {w.url}")

    async def wait_for(self, w: Worker, health: str) -> None:
        async def reached() -> bool:
            view = await self.worker_view(w)
            return view is not None and view["health"] == health

        await until(reached, f"{w.url} {health} in the proxy's view")


@pytest.fixture
async def make_env() -> AsyncIterator:
    cleanups = []

    async def make(n_prefill: int = 2, n_decode: int = 2, listed: bool = True, **config_kw) -> Env:
        prefill = [Worker(Role.PREFILL, 15000 + i) for i in range(n_prefill)]
        decode = [Worker(Role.DECODE, 16000 + i) for i in range(n_decode)]
        for w in (*prefill, *decode):
            await w.start()
        registry = FakeRegistry([*prefill, *decode] if listed else [])
        config = ProxyConfig(port=free_port(), **config_kw)
        stop = asyncio.Event()
        task = asyncio.create_task(serve(create_app(config, registry), stop, reserve_tcp("127.0.0.1", config.port),
                                         graceful_timeout=1))
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        env = Env(f"http://127.0.0.1:{config.port}", http, registry, prefill, decode)

        async def close() -> None:
            await http.close()
            stop.set()
            await asyncio.wait_for(task, 5)
            for w in (*env.prefill, *env.decode):
                await w.stop()

        cleanups.append(close)

        async def listening() -> bool:
            try:
                async with http.get(env.url + "/cluster"):
                    return True
            except aiohttp.ClientConnectionError:
                return False

        await until(listening, f"the proxy to listen on {env.url}")
        return env

    yield make
    for close in cleanups:
        await close()


def counts(workers: list[Worker]) -> list[int]:
    return [len(w.received) for w in workers]


# ------------------------------------------------------------------ spreading load


async def test_requests_spread_over_two_prefill_and_two_decode(make_env):
    env = await make_env()
    # One at a time: equal loads, so they take turns. (A poll that lands while a request
    # is on its way to a worker may miss it once, hence the slack of one.)
    for _ in range(8):
        assert await env.complete() == 200
    for workers in (env.prefill, env.decode):
        assert sorted(counts(workers)) in ([4, 4], [3, 5])
    for w in (*env.prefill, *env.decode):
        w.delay = 0.1
    statuses = await asyncio.gather(*(env.complete(stream=i % 2 == 0) for i in range(20)))
    assert statuses == [200] * 20
    for workers in (env.prefill, env.decode):  # a burst spreads too, before any poll sees it
        assert sum(counts(workers)) == 28 and min(counts(workers)) >= 12
    # Each worker saw one request id per request, carrying the pair's signal addresses.
    for p in env.prefill:
        for rid in p.received:
            assert parse_request_id(rid).prefill_addr == p.info.signal_addr


async def test_worker_reporting_high_load_gets_fewer_requests(make_env):
    env = await make_env(n_prefill=1)
    busy, idle = env.decode
    busy.backlog = 12  # (12 + 0) / 4: three times over capacity
    await env.wait_reported(busy, 12)
    for _ in range(6):
        assert await env.complete() == 200
    assert counts(env.decode) == [0, 6]
    # Requests sent since the last report count as load (even finished ones) until the next poll.
    async def idle_reported() -> bool:
        return (await env.worker_view(idle))["load"]["assigned"] == 0

    await until(idle_reported, "a poll of the idle worker after its requests")
    # A burst fills the idle worker up to the busy one's load (12) before sharing.
    idle.delay = busy.delay = 0.3
    assert await asyncio.gather(*(env.complete() for _ in range(16))) == [200] * 16
    assert len(busy.received) <= 3 and len(idle.received) >= 6 + 13
    view = await env.worker_view(busy)
    assert view["load"]["score"] >= 3.0 and view["requests"] == len(busy.received)


# ------------------------------------------------------------------ failures


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
async def test_stopped_worker_is_retried_marked_down_and_comes_back(make_env, role):
    env = await make_env()
    workers = env.prefill if role is Role.PREFILL else env.decode
    alive, dead = workers
    await dead.stop()
    before = counts(workers)
    for stream in (True, False, True, False):  # whether a request or a poll finds it first
        assert await env.complete(stream=stream) == 200
    assert counts(workers) == [before[0] + 4, before[1]]
    assert (await env.worker_view(dead))["health"] == "down"
    async with env.http.get(env.url + "/health") as r:
        assert r.status == 200 and (await r.json())[role.value] == 1

    # Back on its port, but not healthy yet: still down, still skipped.
    dead.health_status = 503
    await dead.start()
    await until(lambda: dead.health_answers.count(503) >= 2, "two health polls answered 503")
    assert (await env.worker_view(dead))["health"] == "down"
    for _ in range(4):
        assert await env.complete() == 200
    assert counts(workers)[1] == before[1]

    dead.health_status = 200  # the poller sees it healthy at its next health poll
    await env.wait_for(dead, "up")
    assert dead.health_answers.count(200) == 1  # up on the first healthy answer
    for _ in range(4):
        assert await env.complete() == 200
    assert 1 <= counts(workers)[1] - before[1] <= 3  # it shares again (the other's load may differ)
    assert sum(counts(workers)) == sum(before) + 12


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
@pytest.mark.parametrize("stream", [False, True])
async def test_unreachable_worker_means_one_retry_on_a_fresh_pair(make_env, caplog, role, stream):
    env = await make_env(poll_interval=60)  # one poll at start: only requests find the dead one
    workers = env.prefill if role is Role.PREFILL else env.decode
    await workers[1].stop()
    for _ in range(2):  # equal loads: both take a turn in two requests
        assert await env.complete(stream=stream) == 200
    retries = [r for r in caplog.records if "retrying on another pair" in r.getMessage()]
    assert len(retries) == 1 and workers[1].url in retries[0].getMessage()
    view = await env.worker_view(workers[1])
    assert view["health"] == "down" and view["requests"] == 1
    assert len(workers[0].received) == 2
    ids = [rid for w in env.decode for rid in w.received]
    assert len(ids) == len(set(ids))  # the retry had a new request id


async def test_stopped_worker_is_marked_down_without_any_request(make_env):
    env = await make_env(n_prefill=1)
    live = env.decode[0]
    await env.decode[1].stop()
    polls = live.stats_polls
    await env.wait_for(env.decode[1], "down")
    assert live.stats_polls - polls <= 2  # by the first poll after it stopped (each tick polls both)
    assert counts(env.decode) == [0, 0]


async def test_every_worker_of_a_role_down_is_503_at_once(make_env):
    env = await make_env(n_prefill=1, n_decode=1, queue_timeout=30.0)
    env.decode[0].health_status = 503  # stays down once marked
    env.decode[0].fail_status = 500
    async with env.post() as r:
        assert r.status == 502  # the worker's 5xx: not retried, but it is marked down
    t0 = time.monotonic()
    async with env.post() as r:
        assert r.status == 503
        assert "no decode worker available: the only one is down" in (await r.json())["error"]["message"]
    assert time.monotonic() - t0 < 5.0  # at once: not queued for a place (queue_timeout 30 s)
    async with env.http.get(env.url + "/health") as r:
        assert r.status == 503 and (await r.json())["decode"] == 0
    env.decode[0].fail_status, env.decode[0].health_status = None, 200
    await env.wait_for(env.decode[0], "up")
    assert await env.complete() == 200


async def test_connection_lost_mid_stream(make_env):
    env = await make_env(n_prefill=1)
    flaky, good = env.decode
    flaky.drop_mid_stream = True
    env.registry.listed.remove(good)  # for now
    # Streaming: the first token reached the client, so the stream ends with an error event.
    async with env.post({"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}) as r:
        assert r.status == 200
        body = (await r.read()).decode()
    data = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert json.loads(data[0])["choices"][0]["text"] == "Hi"
    assert "error" in json.loads(data[-2]) and data[-1] == "[DONE]"
    assert flaky.received and (await env.worker_view(flaky))["health"] == "down"
    # Not streaming: nothing was sent yet, so the request starts over on the other worker.
    good.backlog = 5  # so that the flaky worker is chosen first (and good is not full: < 2 x 4)
    env.registry.listed.append(good)
    await env.wait_for(flaky, "up")
    await env.wait_reported(good, 5)
    assert await env.complete() == 200  # chosen first, dropped mid-response: retried on the good one
    assert len(flaky.received) == 2 and len(good.received) == 1
    flaky.health_status = 503  # keep it down (its health poll would otherwise bring it back at once)
    assert await env.complete() == 200
    assert len(flaky.received) == 2 and len(good.received) == 2  # retried, then avoided
    assert (await env.worker_view(flaky))["health"] == "down"


# ------------------------------------------------------------------ a broken path between two workers


async def _request(env: Env, stream: bool) -> str | None:
    """One request; None if it completed with the whole text, else its error message."""
    async with env.post({"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}) as r:
        body = await r.text()
    if r.status != 200:
        return json.loads(body)["error"]["message"]
    if not stream:
        assert json.loads(body)["choices"][0]["text"] == TEXT
        return None
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    errors = [e["error"]["message"] for e in events if "error" in e]
    if errors:
        return errors[0]
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == TEXT
    return None


def _pairs_of(decode: Worker, since: int = 0) -> set[str]:
    """The prefill signal addresses of the requests ``decode`` received (from the ``since``-th on)."""
    return {parse_request_id(rid).prefill_addr for rid in decode.received[since:]}


@pytest.mark.parametrize("stream", [True, False])
async def test_a_broken_path_between_two_workers_is_routed_around(make_env, caplog, stream):
    """d0 cannot reach p0 (both healthy, each serving others): after the first request that fails between
    them, the pair is avoided and every request completes on the other pairs; neither worker is marked
    down. A request the client saw nothing of (not streaming) is retried on another pair at once."""
    env = await make_env(pair_cooldown=30.0)
    (p0, p1), (d0, d1) = env.prefill, env.decode
    d0.cut_from = {p0.info.signal_addr}
    errors = []
    for _ in range(40):  # until the proxy routes a request to the pair (load ties are broken at random)
        errors.append(await _request(env, stream))
        if d0.path_failures:
            break
    assert d0.path_failures == 1
    assert errors[:-1] == [None] * (len(errors) - 1)
    if stream:  # the first token was sent: the stream ends with the decode worker's error
        assert "prefill worker unreachable" in errors[-1]
    else:
        assert errors[-1] is None
        assert sum("retrying on another pair" in r.getMessage() for r in caplog.records) == 1
    n0 = len(d0.received)
    for _ in range(16):
        assert await _request(env, stream) is None
    assert d0.path_failures == 1
    assert _pairs_of(d0, n0) == {p1.info.signal_addr}  # d0 still serves, with p1 only
    assert p0.info.signal_addr in _pairs_of(d1)  # p0 still serves, with d1
    views = {v["http_url"]: v for v in (await env.cluster())["workers"]}
    assert all(views[w.url]["health"] == "up" for w in (p0, p1, d0, d1))
    (avoided,) = (await env.cluster())["avoided_pairs"]
    assert (avoided["prefill"], avoided["decode"], avoided["failures"]) == (p0.url, d0.url, 1)
    assert 0 < avoided["cooling_for"] <= 30 and "prefill worker unreachable" in avoided["reason"]
    async with env.http.get(env.url + "/metrics") as r:
        assert "xpyd_proxy_pair_failures_total 1.0" in await r.text()


async def test_an_avoided_pair_is_tried_again_after_its_cooldown_and_healthy_once_it_serves(make_env):
    env = await make_env(n_decode=1, pair_cooldown=0.5)
    (p0, p1), (d0,) = env.prefill, env.decode
    d0.cut_from = {p0.info.signal_addr}
    while not d0.path_failures:
        await _request(env, stream=True)
    t_failed = time.monotonic()
    n0 = len(d0.received)
    while time.monotonic() - t_failed < 0.3:  # cooling: only p1 is chosen
        assert await _request(env, stream=True) is None
    assert _pairs_of(d0, n0) == {p1.info.signal_addr}
    d0.cut_from.clear()  # the path is back
    await asyncio.sleep(0.5)  # (the cool-down is the time under test)
    n1 = len(d0.received)
    for _ in range(8):
        assert await _request(env, stream=True) is None
    assert p0.info.signal_addr in _pairs_of(d0, n1)  # tried again, and it served
    assert (await env.cluster())["avoided_pairs"] == []  # healthy again: a later failure starts at 0.5 s


async def test_a_stream_that_started_before_the_path_broke_does_not_clear_the_pair(make_env):
    """A stream whose KV crossed before the path broke completes after it broke: the pair stays avoided.
    A request that started after the failure and completes clears it."""
    env = await make_env(n_prefill=1, n_decode=1, pair_cooldown=30.0)
    (p0,), (d0,) = env.prefill, env.decode
    d0.hold = asyncio.Event()

    async def idle() -> bool:
        return (await env.cluster())["queue"]["active_requests"] == 0

    async with env.post({"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}) as old:
        assert old.status == 200
        while b" there" not in await old.content.readline():  # decode's first chunk: its KV crossed
            pass
        d0.cut_from = {p0.info.signal_addr}  # the path breaks
        assert "prefill worker unreachable" in await _request(env, stream=True)
        assert d0.path_failures == 1
        d0.cut_from.clear()
        d0.hold.set()
        assert b'"finish_reason": "length"' in await old.read()  # the old stream completes
    await until(idle, "the old stream to end in the proxy")
    (avoided,) = (await env.cluster())["avoided_pairs"]
    assert (avoided["prefill"], avoided["decode"], avoided["failures"]) == (p0.url, d0.url, 1)
    assert await _request(env, stream=True) is None  # (routed there anyway: no other pair), started after it
    await until(idle, "the new stream to end in the proxy")
    assert (await env.cluster())["avoided_pairs"] == []


# ------------------------------------------------------------------ membership changes


async def test_added_worker_gets_requests_within_a_poll_or_two(make_env):
    env = await make_env(n_prefill=1, n_decode=1)
    old = env.decode[0]
    new = Worker(Role.DECODE, 16009)
    await new.start()
    env.decode.append(new)
    polls = old.stats_polls
    env.registry.listed.append(new)  # every poll tick syncs with the registry first

    async def new_served() -> bool:
        assert await env.complete() == 200
        return bool(new.received)

    await until(new_served, "a request on the added worker")
    assert old.stats_polls - polls <= 2, "the added worker should be chosen from the next poll tick on"
    assert (await env.worker_view(new))["health"] == "up"


async def test_removed_worker_is_never_chosen_again(make_env):
    env = await make_env(n_prefill=1)
    keep, gone = env.decode
    keep.delay = gone.delay = 0.3
    in_flight = [asyncio.create_task(env.complete(stream=True)) for _ in range(2)]
    await until(lambda: gone.received and keep.received, "a request on each worker (two at once: one each)")
    env.registry.listed.remove(gone)  # while it still serves a request
    assert await asyncio.gather(*in_flight) == [200, 200]
    assert await env.worker_view(gone) is None
    keep.delay = 0
    for _ in range(6):
        assert await env.complete() == 200
    assert counts(env.decode) == [7, 1]


async def test_dynamic_start_with_no_workers(make_env):
    env = await make_env(listed=False)
    assert isinstance(env.registry, Registry)
    async with env.http.get(env.url + "/health") as r:
        assert r.status == 503
    async with env.post() as r:
        assert r.status == 503
    assert (await env.cluster())["workers"] == []
    env.registry.listed.extend([env.prefill[0], env.decode[0]])
    async with env.http.get(env.url + "/health") as r:
        assert r.status == 200
    assert await env.complete() == 200


# ------------------------------------------------------------------ /cluster


@pytest.mark.parametrize("policy", list(Policy))
async def test_cluster_json(make_env, policy):
    env = await make_env(n_prefill=1, policy=policy)
    for _ in range(3):
        assert await env.complete() == 200
    env.decode[1].backlog = 2

    async def reported() -> dict | None:  # a poll of each worker since the requests: nothing assigned
        data = await env.cluster()
        loads = [w["load"] for w in data["workers"]]
        return data if loads[2]["waiting"] == 2 and all(load["assigned"] == 0 for load in loads) else None

    data = await until(reported, "a poll of every worker that sees the backlog")
    assert data["policy"] == policy.value
    assert [(w["role"], w["http_url"]) for w in data["workers"]] == [
        ("prefill", env.prefill[0].url), ("decode", env.decode[0].url), ("decode", env.decode[1].url)]
    p, d0, d1 = data["workers"]
    assert p == {"role": "prefill", "http_url": env.prefill[0].url, "signal_addr": "127.0.0.1:15000",
                 "model_id": MODEL, "capacity": 4, "health": "up",
                 "load": {"waiting": 0, "running": 0, "transferring": 0, "assigned": 0, "score": 0.0,
                          "queued_tokens": None, "assigned_blocks": 0},
                 # These fake workers report no blocks and have no KV events (as older workers).
                 "cache": {"blocks_total": None, "blocks_used": None, "blocks_cached": None, "hit_rate": None,
                           "indexed_blocks": None},
                 "preemptions": None, "requests": 3, "prefill_paths": None}
    assert sorted([d0["requests"], d1["requests"]]) == [1, 2]
    assert d1["load"] == {"waiting": 2, "running": 0, "transferring": 0, "assigned": 0, "score": 0.5,
                          "queued_tokens": None, "assigned_blocks": 0}
