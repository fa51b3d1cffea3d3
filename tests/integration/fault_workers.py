"""Real worker processes for the fault, token and fuzz tests (tiny random Llama, short limits).

One session-wide set, shared by test_worker_faults.py and test_signal_fuzz.py:

- ``prefill``: requires the cluster token, kv_ttl 1 s;
- ``decode``: presents the token, prefill-wait timeout 3 s;
- ``decode_wrong`` / ``decode_none``: a wrong token / none;
- ``prefill_victim``: no token required; the SIGKILL test kills it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port

TOKEN = "s3cret-cluster-token"
KV_TTL = 1.0
PREFILL_WAIT = 3.0


@pytest.fixture(scope="session")
def fault_workers(tmp_path_factory, tiny_model_dir: Path):
    c = Cluster(tmp_path_factory.mktemp("fault-workers"))
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1", "--max-model-len", "256",
              "--batch-size", "4"]
    urls: dict[str, str] = {}
    for name, extra in (("prefill", ["--cluster-token", TOKEN, "--kv-ttl", str(KV_TTL)]),
                        ("prefill_victim", [])):
        port, sig = free_port(), free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        urls[name + "_signal"] = f"127.0.0.1:{sig}"
        c.start(name, ["prefill", *common, *extra, "--port", str(port), "--signal-port", str(sig)], urls[name])
    for name, token in (("decode", TOKEN), ("decode_wrong", "not-the-cluster-token"), ("decode_none", None)):
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        extra = ["--prefill-wait-timeout", str(PREFILL_WAIT)] + (["--cluster-token", token] if token else [])
        c.start(name, ["decode", *common, *extra, "--port", str(port), "--kv-port", str(free_port())], urls[name])
    try:
        c.wait_healthy()
        for name in ("decode", "decode_wrong", "decode_none"):
            urls[name + "_id"] = info(urls[name])["signal_addr"]
    except BaseException:
        c.stop()
        raise
    yield c, urls
    c.stop()


def info(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/xpyd/info", timeout=5).read())


def stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/xpyd/stats", timeout=5).read())


def post(url: str, body: dict, rid: str, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
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
        idle = (s["requests_held"] == 0 and s["kv_slots_used"] == 0 and s["kv_used_bytes"] == 0
                and s["transfers_in_flight"] == 0)
        if idle or time.monotonic() > deadline:
            assert idle, s
            return s
        time.sleep(0.05)
