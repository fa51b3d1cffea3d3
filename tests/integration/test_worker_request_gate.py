"""Real workers (tiny random Llama): who may call a worker's HTTP API, and which prefill workers a request id
can send a decode worker to (xpyd.worker.request_gate).

A forged request id must not make a decode worker open a connection: each forgery names its own listening
socket (a stand-in for an attacker's host), and after the worker refused it, the socket has no connection
waiting. The control: an id the proxy's key signed, naming another such socket, does make the worker
connect there; the forgeries were refused before it, and the decode worker holds that one peer only.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port, wait_until
from xpyd.signal.request_id import ClusterKeys, RequestId, parse_request_id

TOKEN = "token-of-the-gate-tests"
KEYS = ClusterKeys(TOKEN)
AUTH = {"Authorization": f"Bearer {KEYS.http_bearer}"}
BODY = {"prompt": "hello world", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def workers(tmp_path_factory, tiny_model_dir: Path) -> Iterator[dict[str, str]]:
    """A prefill and a decode worker with the cluster token (in their environment), and a decode worker
    without one that knows one prefill worker (--prefill-peers)."""
    c = Cluster(tmp_path_factory.mktemp("gate"))
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
              "--batch-size", "2"]
    pp, ps, dp, op = free_port(), free_port(), free_port(), free_port()
    urls = {"prefill": f"http://127.0.0.1:{pp}", "signal": f"127.0.0.1:{ps}", "decode": f"http://127.0.0.1:{dp}",
            "open_decode": f"http://127.0.0.1:{op}"}
    token = {"XPYD_CLUSTER_TOKEN": TOKEN}
    c.start("prefill", ["prefill", *common, "--port", str(pp), "--signal-port", str(ps)], urls["prefill"], token)
    c.start("decode", ["decode", *common, "--port", str(dp), "--kv-port", str(free_port())], urls["decode"], token)
    c.start("open_decode", ["decode", *common, "--port", str(op), "--kv-port", str(free_port()),
                            "--prefill-peers", f"127.0.0.1:{free_port()},127.0.0.1:{ps}"], urls["open_decode"])
    try:
        c.wait_healthy()
        yield urls
    finally:
        c.stop()


def _call(method: str, url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw[:1] in (b"{", b"[") else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _stats(url: str, headers: dict | None = None) -> dict:
    return _call("GET", url + "/xpyd/stats", headers=headers)[1]


class Listener:
    """A listening TCP socket on loopback that is never accepted from: a connection to it waits in the
    backlog, where ``connected()`` sees it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=8)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def connected(self, timeout: float = 0.0) -> bool:
        return bool(select.select([self.sock], [], [], timeout)[0])

    def close(self) -> None:
        self.sock.close()


def _forgeries(decode_signal: str) -> dict[str, tuple[Listener, str]]:
    """name -> (the socket the forged id names as its prefill worker, the forged X-Request-Id)."""
    out = {}
    for name in ("unsigned", "wrong MAC", "another token's MAC", "a valid MAC over another address"):
        lst = Listener()
        forged = str(RequestId.new(lst.addr, decode_signal))
        real = KEYS.sign(str(RequestId.new("127.0.0.1:1", decode_signal)))
        signed = KEYS.sign(forged)
        out[name] = lst, {
            "unsigned": forged,
            "wrong MAC": signed[:-1] + ("0" if signed[-1] != "0" else "1"),
            "another token's MAC": ClusterKeys("not-the-cluster-token").sign(forged),
            "a valid MAC over another address": forged + real[real.index("~m~"):],
        }[name]
    return out


def test_without_the_cluster_credential_the_apis_answer_401(workers):
    rid = KEYS.sign(str(RequestId.new(workers["signal"], "127.0.0.1:2")))
    for role in ("prefill", "decode"):
        url = workers[role]
        for path in ("/v1/models", "/xpyd/info", "/xpyd/stats", "/xpyd/kv_events", "/xpyd/tokenizer"):
            for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": "Bearer " + "0" * 64}):
                status, body = _call("GET", url + path, headers=headers)
                assert status == 401 and body["error"]["type"] == "authentication_error", (role, path, headers)
            assert _call("GET", url + path, headers=AUTH)[0] == 200, (role, path)
        for path in ("/v1/completions", "/v1/chat/completions", "/xpyd/abort"):
            status, body = _call("POST", url + path, BODY, {"X-Request-Id": rid})
            assert status == 401, (role, path, body)
        assert _call("POST", url + "/xpyd/abort", None, {"X-Request-Id": rid, **AUTH})[0] == 200
        # open to the probes and Prometheus
        assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
        assert urllib.request.urlopen(url + "/metrics", timeout=5).status == 200
        assert _stats(url, AUTH)["waiting"] == 0  # nothing refused was queued


def test_a_signed_request_is_served_through_both_worker_apis(workers):
    decode_signal = _call("GET", workers["decode"] + "/xpyd/info", headers=AUTH)[1]["signal_addr"]
    rid = str(RequestId.new(workers["signal"], decode_signal))
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("d", _call(
        "POST", workers["decode"] + "/v1/completions", {**BODY, "kv_transfer_params": {"role": "decode"}},
        {"X-Request-Id": KEYS.sign(rid), **AUTH})))
    t.start()
    ps, pbody = _call("POST", workers["prefill"] + "/v1/completions",
                      {**BODY, "max_tokens": 1, "kv_transfer_params": {"role": "prefill", "max_tokens": 4}},
                      {"X-Request-Id": KEYS.sign(rid), **AUTH})
    t.join(60)
    ds, dbody = out["d"]
    assert ps == 200 and ds == 200, (pbody, dbody)
    assert pbody["id"] == dbody["id"] == "cmpl-" + parse_request_id(rid).uid  # keyed by the unsigned id (named by its random part)
    assert dbody["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_forged_ids_are_refused_with_403(workers, role):
    decode_signal = _call("GET", workers["decode"] + "/xpyd/info", headers=AUTH)[1]["signal_addr"]
    for name, (lst, forged) in _forgeries(decode_signal).items():
        try:
            status, body = _call("POST", workers[role] + "/v1/completions", BODY, {"X-Request-Id": forged, **AUTH})
            assert status == 403 and body["error"]["param"] == "X-Request-Id", (name, body)
            assert _call("POST", workers[role] + "/xpyd/abort", None, {"X-Request-Id": forged, **AUTH})[0] == 403
        finally:
            lst.close()


def test_a_forged_id_makes_the_decode_worker_connect_nowhere(workers):
    url = workers["decode"]
    decode_signal = _call("GET", url + "/xpyd/info", headers=AUTH)[1]["signal_addr"]
    forged = _forgeries(decode_signal)
    control = Listener()
    before = _stats(url, AUTH)["peers"]  # (prefill workers it already talks to)
    try:
        for name, (lst, rid) in forged.items():
            status, body = _call("POST", url + "/v1/completions", BODY, {"X-Request-Id": rid, **AUTH})
            assert status == 403, (name, body)
            assert not lst.connected(), name
        # The control: an id the proxy's key signed is followed to whatever prefill worker it names. (Nobody
        # answers there: the request fails once --signal-timeout passes; we do not wait for that.)
        signed = KEYS.sign(str(RequestId.new(control.addr, decode_signal)))
        threading.Thread(target=_call, args=("POST", url + "/v1/completions", BODY,
                                             {"X-Request-Id": signed, **AUTH}), daemon=True).start()
        assert control.connected(timeout=30), "the decode worker never connected to the signed id's address"
        # The engine handles requests in order: had it taken a forged one, it would have connected there first.
        for name, (lst, _) in forged.items():
            assert not lst.connected(), name
        wait_until(lambda: _stats(url, AUTH)["peers"] > before, 10, "the control's peer in the stats")
        assert _stats(url, AUTH)["peers"] == before + 1  # the control's, no other
    finally:
        control.close()
        for lst, _ in forged.values():
            lst.close()
    wait_until(lambda: _stats(url, AUTH)["waiting"] == 0, 30, "the control request failed and left")


def test_without_a_token_decode_takes_only_the_prefill_workers_it_knows(workers):
    url = workers["open_decode"]
    decode_signal = _call("GET", url + "/xpyd/info")[1]["signal_addr"]
    stranger = Listener()
    try:
        for rid in (str(RequestId.new(stranger.addr, decode_signal)),
                    KEYS.sign(str(RequestId.new(stranger.addr, decode_signal)))):  # (no token here to check a MAC)
            status, body = _call("POST", url + "/v1/completions", BODY, {"X-Request-Id": rid})
            assert status == 403 and stranger.addr in body["error"]["message"], body
            assert "--prefill-peers" in body["error"]["message"]
        assert not stranger.connected()
        assert _stats(url)["peers"] == 0
    finally:
        stranger.close()
    # A listed prefill worker is followed (it has a token, this decode worker none: the handshake is refused).
    status, body = _call("POST", url + "/v1/completions", BODY,
                         {"X-Request-Id": str(RequestId.new(workers["signal"], decode_signal))})
    assert status == 502, body
    wait_until(lambda: _stats(url)["peers"] == 1, 10, "the listed prefill worker as the one peer")
