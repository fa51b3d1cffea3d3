"""Helpers for the fault, token and fuzz tests (the workers themselves are the ``fault_workers`` fixture)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from xpyd.signal.request_id import ClusterKeys, RequestId

TOKEN = "s3cret-cluster-token"
KV_TTL = 2.0
PREFILL_WAIT = 3.0
BODY = {"prompt": "hello world", "temperature": 0, "ignore_eos": True}


# Workers started with a cluster token: their URL -> the keys the proxy would use with them (their HTTP
# API needs the bearer derived from the token, and request ids the proxy signed with it).
KEYS: dict[str, ClusterKeys] = {}


def headers(url: str, rid: str | None = None) -> dict[str, str]:
    """What the proxy sends ``url``: its credential and, for a request, the id signed (with a token)."""
    keys = KEYS.get(url)
    out = {} if keys is None else {"Authorization": f"Bearer {keys.http_bearer}"}
    if rid is not None:
        out["X-Request-Id"] = rid if keys is None else keys.sign(rid)
    return out


def _get(url: str, path: str) -> dict:
    req = urllib.request.Request(url + path, headers=headers(url))
    return json.loads(urllib.request.urlopen(req, timeout=5).read())


def info(url: str) -> dict:
    return _get(url, "/xpyd/info")


def stats(url: str) -> dict:
    return _get(url, "/xpyd/stats")


def post(url: str, body: dict, rid: str, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers(url, rid)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    """Poll /xpyd/stats until the worker holds nothing: no request, KV slot, or transfer."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(url)
        idle = (s["requests_held"] == 0 and s["blocks_used"] == 0 and s["kv_used_bytes"] == 0
                and s["transfers_in_flight"] == 0)
        if idle or time.monotonic() > deadline:
            assert idle, s
            return s
        time.sleep(0.05)


def prefill_body(max_tokens: int = 6) -> dict:
    return {**BODY, "max_tokens": 1, "kv_transfer_params": {"role": "prefill", "max_tokens": max_tokens}}


def decode_body(max_tokens: int = 6) -> dict:
    return {**BODY, "max_tokens": max_tokens, "kv_transfer_params": {"role": "decode"}}


def rid_for(urls: dict, prefill: str = "prefill", decode: str = "decode") -> str:
    return str(RequestId.new(urls[prefill + "_signal"], urls[decode + "_id"]))


def pair(urls: dict, rid: str) -> tuple[tuple[int, dict], tuple[int, dict]]:
    """The same request on the prefill and the decode worker at once, as the proxy sends it."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("d", post(urls["decode"], decode_body(), rid)))
    t.start()
    out["p"] = post(urls["prefill"], prefill_body(), rid)
    t.join(60)
    return out["p"], out["d"]
