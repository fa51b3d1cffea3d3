"""A static 1P1D cluster (tiny random Llama) bound to the IPv6 loopback ``::1``, end to end.

Every address a worker advertises (HTTP URL, signal plane, KV transfer) must be bracketed so it
fits request ids and URLs, and every socket (hypercorn, ZMQ ROUTER/DEALER, KV listener) must
bind or connect in the IPv6 family. A completion through the proxy, plain and streaming, moves
the KV from prefill to decode over ``[::1]`` (the tcp backend: on one host ``auto`` would pick shared
memory and no KV byte would cross the IPv6 socket).
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import has_ipv6_loopback, start_1p1d

MAX_TOKENS = 7


pytestmark = pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir: Path):
    c, urls = start_1p1d(tmp_path_factory.mktemp("ipv6"), str(tiny_model_dir), dtype="float32",
                         batch_size=4, max_model_len=256, host="::1", extra=["--kv-backend", "tcp"])
    yield urls
    c.stop()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def _body(**extra) -> dict:
    return {"prompt": "the quick brown fox jumps over", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **extra}


def _kv_sent(prefill_url: str) -> float:
    text = urllib.request.urlopen(prefill_url + "/metrics", timeout=10).read().decode()
    match = re.search(r'^xpyd_kv_transfers_total\{(?=[^}]*direction="send")(?=[^}]*outcome="ok")[^}]*\} (\S+)$',
                      text, re.M)
    return float(match.group(1)) if match else 0.0


def test_workers_advertise_bracketed_ipv6_addresses(cluster):
    assert all(url.startswith("http://[::1]:") for url in cluster.values())
    prefill, decode = _get(cluster["prefill"] + "/xpyd/info"), _get(cluster["decode"] + "/xpyd/info")
    assert prefill["http_url"] == cluster["prefill"] and decode["http_url"] == cluster["decode"]
    assert prefill["signal_addr"].startswith("[::1]:") and decode["signal_addr"].startswith("[::1]:")
    # KV can only move over TCP here (no shared-memory path), and decode's listener is on [::1].
    assert _get(cluster["prefill"] + "/xpyd/stats")["kv_backend"]["name"] == "tcp"
    assert _get(cluster["decode"] + "/xpyd/stats")["kv_backend"]["name"] == "tcp"


def test_completion_through_the_proxy(cluster):
    sent = _kv_sent(cluster["prefill"])
    with urllib.request.urlopen(_post(cluster["proxy"] + "/v1/completions", _body()), timeout=120) as r:
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    assert out["choices"][0]["finish_reason"] == "length"
    assert _kv_sent(cluster["prefill"]) == sent + 1  # the KV went prefill -> decode over [::1]


def test_streaming_completion_through_the_proxy(cluster):
    body = _body(stream=True, stream_options={"include_usage": True})
    usage, finish, done = None, None, False
    with urllib.request.urlopen(_post(cluster["proxy"] + "/v1/completions", body), timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line:
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
    assert done and finish == "length"
    assert usage["completion_tokens"] == MAX_TOKENS
