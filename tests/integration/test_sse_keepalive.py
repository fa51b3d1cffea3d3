"""A streamed answer that waits a long time on its decode worker (queued behind another request: batch size 1)
keeps its connections alive with SSE comments: through a proxy whose read timeout is shorter than the wait it
completes with the tokens it gives alone, and the client sees the keep-alives; with keep-alives rarer than the
proxy's read timeout the same wait ends in a timeout error (what the comments prevent).

Simulated workers (`--engine sim` at the measured SmolLM2 profile's pace: ~80 ms a decode step), the real
proxy, tokenizer, schedulers and KV transfers.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import Cluster, free_port

READ_TIMEOUT = 1.5  # the proxy's, between two reads from a worker
SIM = ["--served-model-name", "m", "--engine", "sim", "--max-model-len", "512", "--batch-size", "1"]
LONG = {"prompt": "the river town kept its records in a stone tower", "max_tokens": 60, "ignore_eos": True,
        "temperature": 0}  # ~5 s of decode steps: longer than the read timeout
SHORT = {"prompt": "every spring the clerks climbed the stairs", "max_tokens": 6, "ignore_eos": True,
         "temperature": 0}


@pytest.fixture(scope="module", params=[0.3, 30.0], ids=["keepalive-0.3s", "keepalive-30s"])
def cluster(request, tmp_path_factory, smollm_dir: Path):
    c = Cluster(tmp_path_factory.mktemp("keepalive"))
    pp, ps, dp, dk, xp = (free_port() for _ in range(5))
    url = lambda port: f"http://127.0.0.1:{port}"
    common = ["--model", str(smollm_dir), *SIM]
    try:
        c.start("prefill", ["prefill", *common, "--port", str(pp), "--signal-port", str(ps)], url(pp))
        c.start("decode", ["decode", *common, "--port", str(dp), "--kv-port", str(dk), "--sse-keepalive",
                           str(request.param), "--prefill-wait-timeout", "60"], url(dp))
        # (the proxy serves, and answers /health, once both workers answered their /xpyd/info)
        c.start("proxy", ["proxy", "--port", str(xp), "--prefill", url(pp), "--decode", url(dp), "--read-timeout",
                          str(READ_TIMEOUT)], url(xp))
        c.wait_healthy()
        yield request.param, url(xp), url(dp)
    finally:
        c.stop()


def _stream(url: str, body: dict) -> tuple[str, list[bytes], list[dict]]:
    """(text, the SSE comment lines, the error events) of a streamed completion."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text, comments, errors = [], [], []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b":"):
                comments.append(line)
            elif line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                else:
                    text.extend(c["text"] for c in event["choices"])
    return "".join(text), comments, errors


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/xpyd/stats", timeout=10) as r:
        return json.loads(r.read())


def test_a_stream_queued_longer_than_the_proxys_read_timeout_lives_on_keepalives(cluster):
    keepalive, proxy, decode = cluster
    alone, _, errors = _stream(proxy, SHORT)  # (nothing ahead of it: no wait)
    assert alone and not errors
    with cf.ThreadPoolExecutor(2) as ex:
        long = ex.submit(_stream, proxy, LONG)
        deadline = time.monotonic() + 30
        while _stats(decode)["running"] == 0:  # the long one holds the decode worker's one place
            assert time.monotonic() < deadline and not long.done(), "the long request never ran on decode"
            time.sleep(0.02)
        started = time.monotonic()
        text, comments, errors = _stream(proxy, SHORT)  # queued behind it on decode
        waited = time.monotonic() - started
        long_text, _, long_errors = long.result()
    assert long_text and not long_errors
    if keepalive < READ_TIMEOUT:
        assert not errors and text == alone, (errors, text, alone)
        assert waited > 2 * READ_TIMEOUT, f"the short request waited only {waited:.1f} s: the test shows nothing"
        assert b": keep-alive" in comments, comments  # the proxy passed them on to the client
    else:  # (the control: without keep-alives the proxy gives up on the silent stream)
        assert len(errors) == 1 and "timed out" in errors[0]["message"], errors
