"""A storm of cancelled streams through a real proxy + 1P1D (tiny random Llama): nothing leaks.

Streaming requests are cancelled at random points: before the proxy dispatched them, while prefill
runs, right after the first token (decode is pulling the KV then), and in the middle of decoding;
some run to the end. Afterwards both workers hold no request, no KV slot and no transfer, the
proxy still serves, and the workers counted aborts on both sides.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.cluster import start_1p1d

N_REQUESTS = int(os.environ.get("XPYD_CANCEL_STORM_N", "1000"))
CONCURRENCY = 32
WORDS = "the quick brown fox jumps over a lazy dog while prefill and decode share two small cores".split()


@pytest.fixture(scope="module")
def storm_cluster(tmp_path_factory, tiny_model_dir: Path):
    c, urls = start_1p1d(tmp_path_factory.mktemp("storm"), str(tiny_model_dir), dtype="float32",
                         batch_size=8, max_model_len=256)
    yield c, urls
    c.stop()


def _stats(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/xpyd/stats", timeout=5).read())


def _aborted(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    match = re.search(r'^xpyd_requests_total\{[^}]*outcome="aborted"[^}]*\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def _transfers(url: str, direction: str, outcome: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    pattern = rf'^xpyd_kv_transfers_total\{{(?=[^}}]*direction="{direction}")(?=[^}}]*outcome="{outcome}")[^}}]*\}} (\S+)$'
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> tuple[str, int]:
    """Run one streaming request and cancel it at a random point; (where it was cancelled, chunks seen)."""
    max_tokens = rng.randint(3, 12)
    body = {"prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 80))), "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True}
    point = rng.choices(["before", "prefill", "first", "decode", "complete"], weights=[2, 2, 3, 3, 1])[0]
    stop_after = {"first": 1, "decode": rng.randint(2, max_tokens)}.get(point)
    chunks = 0
    usage: dict = {}
    done = False

    async def run() -> None:
        nonlocal chunks, done
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    done = True
                    return
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("usage"):
                    usage.update(event["usage"])
                if event.get("choices"):
                    chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    return  # leaving the context closes the connection mid-stream

    if point in ("before", "prefill"):
        delay = rng.uniform(0, 0.003) if point == "before" else rng.uniform(0.003, 0.04)
        try:
            await asyncio.wait_for(run(), delay)
        except asyncio.TimeoutError:
            pass
    else:
        await asyncio.wait_for(run(), 60)
        if point == "complete":
            assert done and usage.get("completion_tokens") == max_tokens, (usage, max_tokens)
    return point, chunks


async def _storm(url: str) -> dict[str, int]:
    rng = random.Random(2026)
    seen: dict[str, int] = {}
    sem = asyncio.Semaphore(CONCURRENCY)
    # force_close: a cancelled request's connection is closed, never reused, so the proxy sees the disconnect.
    connector = aiohttp.TCPConnector(force_close=True, limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def guarded(r: random.Random) -> None:
            async with sem:
                point, chunks = await _one(session, url, r)
                key = point if point not in ("first", "decode") else f"{point}:{'ok' if chunks else 'none'}"
                seen[key] = seen.get(key, 0) + 1

        await asyncio.gather(*(guarded(random.Random(rng.random())) for _ in range(N_REQUESTS)))
    return seen


def test_cancel_storm_leaves_no_request_kv_or_transfer_behind(storm_cluster):
    _, urls = storm_cluster
    seen = asyncio.run(_storm(urls["proxy"]))
    assert sum(seen.values()) == N_REQUESTS
    assert seen.get("first:ok", 0) > 0 and seen.get("decode:ok", 0) > 0 and seen.get("complete", 0) > 0, seen
    deadline = time.monotonic() + 15
    while True:
        p, d = _stats(urls["prefill"]), _stats(urls["decode"])
        held = [(s["requests_held"], s["blocks_used"], s["kv_used_bytes"], s["transfers_in_flight"])
                for s in (p, d)]
        if held == [(0, 0, 0, 0)] * 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert held == [(0, 0, 0, 0)] * 2, (p, d, seen)
    assert _aborted(urls["prefill"]) > 0 and _aborted(urls["decode"]) > 0
    # Some were cancelled while their KV was on the wire: sends and receives that did not complete.
    assert _transfers(urls["prefill"], "send", "failed") > 0
    # Still serving, start to end.
    req = urllib.request.Request(urls["proxy"] + "/v1/completions",
                                 data=json.dumps({"prompt": "after the storm", "max_tokens": 5,
                                                  "ignore_eos": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    body = json.loads(urllib.request.urlopen(req, timeout=30).read())
    assert body["usage"]["completion_tokens"] == 5
