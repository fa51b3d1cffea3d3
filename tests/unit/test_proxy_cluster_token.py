"""The proxy's side of the cluster token: its flag, the credential and signed ids it sends the workers, and
what it makes of a worker refusing it (in-process HTTP servers, no model)."""

from __future__ import annotations

import argparse

import aiohttp
import pytest
from aiohttp import web

from xpyd.api.openai import RequestKind
from xpyd.discovery.base import RegistryError
from xpyd.discovery.static import StaticRegistry
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy import main as proxy_main
from xpyd.proxy.client import WorkerClient, WorkerSessions, worker_headers, worker_sessions
from xpyd.proxy.upstream import Fault, UpstreamError
from xpyd.signal.request_id import ClusterKeys, RequestId

TOKEN = "token-of-the-proxy-tests"
KEYS = ClusterKeys(TOKEN)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    proxy_main.add_arguments(p)
    return p.parse_args(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", *argv])


def test_the_cluster_token_comes_from_the_flag_or_the_environment_and_stays_out_of_repr(monkeypatch):
    monkeypatch.delenv("XPYD_CLUSTER_TOKEN", raising=False)
    assert proxy_main.config_from_args(_args()).cluster_token is None
    assert proxy_main.config_from_args(_args("--cluster-token", TOKEN)).cluster_token == TOKEN
    monkeypatch.setenv("XPYD_CLUSTER_TOKEN", TOKEN)
    config = proxy_main.config_from_args(_args())
    assert config.cluster_token == TOKEN and TOKEN not in repr(config)
    with pytest.raises(ValueError, match="8-256"):
        proxy_main.config_from_args(_args("--cluster-token", "short"))


class Recorder:
    """A worker stand-in that records the headers of each call and answers with ``status``."""

    def __init__(self, status: int = 200, body: dict | None = None) -> None:
        self.status, self.body = status, body or {}
        self.seen: list[tuple[str, dict]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, {k.lower(): v for k, v in request.headers.items()}))
        return web.json_response(self.body, status=self.status)

    async def serve(self, aiohttp_server):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return await aiohttp_server(app)


@pytest.fixture
async def aiohttp_server():
    runners = []

    async def start(app: web.Application):
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for r in runners:
        await r.cleanup()


async def test_every_call_carries_the_credential_and_every_id_goes_signed(aiohttp_server):
    rec = Recorder(body={"id": "x", "choices": [{"text": "a", "finish_reason": None}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    url = await rec.serve(aiohttp_server)
    worker = WorkerInfo(Role.PREFILL, url, "127.0.0.1:1", "m", 1, 8)
    rid = str(RequestId.new("127.0.0.1:1", "127.0.0.1:2"))
    sessions = worker_sessions(5, 5, 4, TOKEN)
    try:
        client = WorkerClient(sessions, 5, TOKEN)
        await client.prefill(worker, RequestKind.COMPLETION, {"prompt": "a"}, rid)
        async with sessions.control.get(url + "/xpyd/stats") as resp:  # (the poller's and the cache feed's calls)
            await resp.read()
        await client._release(worker, rid)
        async with await sessions.decode.request("GET", url, "/health") as resp:  # (the decode streams' pool)
            await resp.read()
    finally:
        await sessions.close()
    paths = [p for p, _ in rec.seen]
    assert paths == ["/v1/completions", "/xpyd/stats", "/xpyd/abort", "/health"]
    for path, headers in rec.seen:
        assert headers["authorization"] == f"Bearer {KEYS.http_bearer}", path
        assert TOKEN not in str(headers)
    for _, headers in (rec.seen[0], rec.seen[2]):
        assert headers["x-request-id"] != rid and str(KEYS.verify(headers["x-request-id"])) == rid


@pytest.mark.parametrize("status, role, fault", [
    (401, Role.DECODE, Fault.NONE), (401, Role.PREFILL, Fault.NONE), (403, Role.PREFILL, Fault.NONE),
    (403, Role.DECODE, Fault.PATH),  # decode refuses the prefill worker named: that pair is avoided, retried
])
async def test_a_worker_refusing_the_proxy_is_a_502_to_the_client(aiohttp_server, status, role, fault):
    rec = Recorder(status, {"error": {"message": "refused", "type": "authentication_error"}})
    url = await rec.serve(aiohttp_server)
    worker = WorkerInfo(role, url, "127.0.0.1:1", "m", 1, 8)
    sessions = worker_sessions(5, 5, 4)
    try:
        client = WorkerClient(sessions, 5)
        with pytest.raises(UpstreamError) as caught:
            if role is Role.DECODE:
                await client.open_decode(worker, RequestKind.COMPLETION, {}, "xpyd-x")
            else:
                await client.prefill(worker, RequestKind.COMPLETION, {}, "xpyd-x")
    finally:
        await sessions.close()
    e = caught.value
    assert e.status == 502 and e.fault is fault and "--cluster-token" in e.message
    assert e.to_dict()["error"]["type"] == "server_error"


async def test_static_discovery_sends_the_credential_and_gives_up_at_once_on_401(aiohttp_server):
    rec = Recorder(401)
    url = await rec.serve(aiohttp_server)
    registry = StaticRegistry([url], [url + "/d"], timeout=3, headers=worker_headers(TOKEN))
    with pytest.raises(RegistryError, match="401.*--cluster-token"):  # at once, saying why (not "not ready")
        await registry.start()
    assert rec.seen and all(h["authorization"] == f"Bearer {KEYS.http_bearer}" for _, h in rec.seen)
    assert worker_headers(None) == {}


async def test_the_proxy_lets_idle_connections_go_before_a_worker_would():
    """A pooled connection the worker is closing must never carry a POST (aiohttp does not retry it: the
    request failed as "Server disconnected"): the proxy's keep-alive is shorter than the workers'."""
    from xpyd.netaddr import PROXY_KEEP_ALIVE, WORKER_KEEP_ALIVE

    sessions = worker_sessions(5, 5, 4)
    try:
        assert sessions.control.connector._keepalive_timeout == PROXY_KEEP_ALIVE < WORKER_KEEP_ALIVE
        for pool in (sessions.prefill, sessions.decode):
            assert pool.keepalive == PROXY_KEEP_ALIVE
    finally:
        await sessions.close()
