"""A decode worker that refuses the prefill worker a request id names (403: not one it knows, e.g. its etcd
watch is behind the proxy's) fails that pair, not the request: the proxy retries on another pair and avoids
this one (fake workers, the real proxy)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from tests.integration.test_proxy_routing import MODEL, TEXT, Worker, make_env  # noqa: F401 - make_env is a fixture
from xpyd.signal.request_id import parse_request_id


async def _refusing(self: Worker, request: web.Request) -> web.StreamResponse:
    """As a real decode worker without a cluster token answers an id naming a prefill worker it does not know."""
    if parse_request_id(request.headers["X-Request-Id"]).prefill_addr in self.cut_from:
        self.path_failures += 1
        error = {"message": "X-Request-Id: prefill worker is not one this decode worker knows",
                 "type": "permission_error", "param": "X-Request-Id", "code": None}
        return web.json_response({"error": error}, status=403)
    return await Worker._generate(self, request)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_decode_worker_refusing_the_named_prefill_worker_is_retried_on_another_pair(
        make_env, monkeypatch, stream):
    env = await make_env(pair_cooldown=30.0)
    (p0, p1), (d0, d1) = env.prefill, env.decode
    d0.cut_from = {p0.info.signal_addr}
    monkeypatch.setattr(d0, "_generate", _refusing.__get__(d0))
    await d0.stop()  # (its routes are bound when it starts)
    await d0.start()
    await env.wait_for(d0, "up")
    for _ in range(40):  # until the proxy routes a request to the pair (load ties are broken at random)
        async with env.post({"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}) as r:
            body = await r.text()
        assert r.status == 200, body
        if stream:
            events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
            errors = [e["error"]["message"] for e in events if "error" in e]
            # Retried on another pair if the refusal came before prefill's first token, else (the first token
            # was on its way to the client) the stream ends with it, as for any failure between a pair.
            assert (not errors and "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == TEXT
                    or len(errors) == 1 and "not one this decode worker knows" in errors[0]), events
        else:  # retried on another pair: the client sees nothing of it
            assert json.loads(body)["choices"][0]["text"] == TEXT
        if d0.path_failures:
            break
    assert d0.path_failures == 1
    for _ in range(8):  # the pair is avoided now
        async with env.post({"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}) as r:
            assert r.status == 200 and "not one this decode worker knows" not in await r.text()
    assert d0.path_failures == 1
    (avoided,) = (await env.cluster())["avoided_pairs"]
    assert (avoided["prefill"], avoided["decode"]) == (p0.url, d0.url)
    assert "not one this decode worker knows" in avoided["reason"]
    views = {v["http_url"]: v for v in (await env.cluster())["workers"]}
    assert all(views[w.url]["health"] == "up" for w in (p0, p1, d0, d1))
