"""A worker's checks of credentials and request ids before it touches a request (xpyd.worker.request_gate)."""

from __future__ import annotations

import asyncio

import pytest

from xpyd.api.openai import APIError
from xpyd.signal.request_id import ClusterKeys, RequestId
from xpyd.worker.request_gate import PrefillPeers, RequestGate

TOKEN = "token-for-unit-tests"
DECODE = "10.0.0.9:8201"


def rid(prefill: str) -> str:
    return str(RequestId.new(prefill, DECODE))


def status_of(gate: RequestGate, text: str) -> int:
    try:
        asyncio.run(gate.admit(text))
    except APIError as e:
        return e.status
    return 200


def test_with_a_token_only_ids_the_proxy_signed_pass_whatever_address_they_name():
    keys = ClusterKeys(TOKEN)
    for role in ("prefill", "decode"):
        gate = RequestGate(role, TOKEN, PrefillPeers(["10.0.0.1:8101"]))
        assert status_of(gate, keys.sign(rid("203.0.113.7:9"))) == 200  # signed: followed
        assert status_of(gate, rid("10.0.0.1:8101")) == 403  # unsigned, though listed
        assert status_of(gate, ClusterKeys("another-token").sign(rid("10.0.0.1:8101"))) == 403
        assert status_of(gate, "xpyd-bogus") == 400
        assert status_of(gate, "") == 400


def test_the_bearer_guards_v1_and_xpyd_routes_only_with_a_token():
    gate = RequestGate("decode", TOKEN)
    assert all(gate.guards(p) for p in ("/v1/completions", "/v1/models", "/xpyd/info", "/xpyd/abort", "/v1", "/xpyd"))
    assert not any(gate.guards(p) for p in ("/health", "/metrics", "/v1x", "/xpydx"))
    assert gate.authorized(f"Bearer {ClusterKeys(TOKEN).http_bearer}")
    assert not gate.authorized(f"Bearer {TOKEN}") and not gate.authorized(None)
    open_gate = RequestGate("decode", None)
    assert not open_gate.guards("/v1/completions") and open_gate.authorized(None)


def test_without_a_token_or_peers_decode_takes_this_hosts_addresses_only():
    gate = RequestGate("decode", None, PrefillPeers(own_host="10.0.0.9"))
    for addr in ("127.0.0.1:8101", "127.3.4.5:1", "[::1]:8101", "localhost:8101", "10.0.0.9:8101"):
        assert status_of(gate, rid(addr)) == 200, addr
    for addr in ("10.0.0.1:8101", "[fe80::1]:8101", "example.com:8101", "0.0.0.0:1"):
        assert status_of(gate, rid(addr)) == 403, addr
    # prefill and colocated workers connect to nobody: no peer check
    assert status_of(RequestGate("prefill", None, PrefillPeers()), rid("203.0.113.7:9")) == 200


def test_listed_peers_replace_the_host_default():
    gate = RequestGate("decode", None, PrefillPeers(["10.0.0.1:8101"], own_host="10.0.0.9"))
    assert status_of(gate, rid("10.0.0.1:8101")) == 200
    assert status_of(gate, rid("10.0.0.1:8102")) == 403
    assert status_of(gate, rid("127.0.0.1:8101")) == 403


def test_with_etcd_a_prefill_worker_registered_while_its_request_waits_is_admitted():
    async def scenario() -> None:
        peers = PrefillPeers(registry=True)
        peers.update({"10.0.0.1:8101"})
        gate = RequestGate("decode", None, peers)
        assert (await gate.admit(rid("10.0.0.1:8101"))).prefill_addr == "10.0.0.1:8101"
        waiting = asyncio.create_task(peers.admits("10.0.0.2:8101", wait=30))
        await asyncio.sleep(0)
        assert not waiting.done()
        peers.update({"10.0.0.1:8101", "10.0.0.2:8101"})  # the watch saw it register
        assert await asyncio.wait_for(waiting, 5)
        peers.update({"10.0.0.2:8101"})  # 10.0.0.1 left
        assert not await peers.admits("10.0.0.1:8101", wait=0)
        assert not await peers.admits("127.0.0.1:8101", wait=0)  # no host default with a registry

    asyncio.run(scenario())
