"""A 4P8D cluster of simulated workers (`xpyd up --engine sim`: etcd, 12 worker processes, the real proxy)
under 300 concurrent streams: every stream completes, and each gives exactly the text a colocated sim worker
gives for the same request, greedy and seeded sampling alike. The prompts share prefixes (ten system
prompts), so prefix caches on both roles, cache-aware routing and KV transfers of cached and new blocks all
take part; the simulated KV records make a wrong transfer visible as other tokens or an error.

Only the forward pass is simulated (`--sim-speedup inf`: no simulated time); tokenizer, schedulers, block
manager, signal plane, KV transfers of real bytes, etcd and the proxy are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.cluster import Cluster, UpProcess, free_port

STREAMS = 300
PREFILL, DECODE = 4, 8
SIM = ["--served-model-name", "m", "--engine", "sim", "--sim-speedup", "inf", "--max-model-len", "1024", "--batch-size", "32"]


def _requests() -> list[dict]:
    rng = random.Random(7)
    words = "river field ship tree road plan food sea table door bed cat dog girl boy king queen garden".split()
    systems = [" ".join(rng.choice(words) for _ in range(rng.randint(60, 240))) for _ in range(10)]
    out = []
    for i in range(STREAMS):
        body = {"prompt": f"{rng.choice(systems)}\nQuestion {i}: " + " ".join(rng.choice(words) for _ in range(20)),
                "max_tokens": rng.randint(4, 24), "temperature": 0}
        if i % 3 == 0:
            body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        out.append(body)
    return out


async def _stream(session: aiohttp.ClientSession, url: str, body: dict) -> str:
    async with session.post(url + "/v1/completions", json={**body, "model": "m", "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        text, done = [], False
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
        assert done, "the stream ended without [DONE]"
        return "".join(text)


async def _all(url: str, bodies: list[dict], concurrency: int) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(body: dict) -> str:
            async with gate:
                return await asyncio.wait_for(_stream(session, url, body), 600)

        return await asyncio.gather(*(one(b) for b in bodies))


def _wait_idle(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(url)
        if s["requests_held"] == s["blocks_used"] == s["transfers_in_flight"] == 0:
            return
        assert time.monotonic() < deadline, f"{url} still holds work: {s}"
        time.sleep(0.05)


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/xpyd/stats", timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, smollm_dir: Path):
    c = Cluster(tmp_path_factory.mktemp("sim-colocated"))
    port, proxy = free_port(), free_port()
    url, proxy_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{proxy}"
    try:
        c.start("colocated", ["colocated", "--model", str(smollm_dir), *SIM, "--port", str(port)], url)
        # (the proxy serves, and answers /health, once the worker answered its /xpyd/info)
        c.start("proxy", ["proxy", "--port", str(proxy), "--colocated", url], proxy_url)
        c.wait_healthy()
        yield proxy_url
    finally:
        c.stop()


def test_300_streams_through_a_4p8d_sim_cluster_give_the_colocated_tokens(tmp_path: Path, smollm_dir: Path,
                                                                           colocated: str):
    bodies = _requests()
    up = UpProcess(smollm_dir, tmp_path / "up.log", *SIM, "--prefill", str(PREFILL), "--decode", str(DECODE))
    try:
        reference = asyncio.run(_all(colocated, bodies, 32))  # (from the colocated worker, while the cluster starts)
        up.wait_ready()
        got = asyncio.run(_all(up.url, bodies, STREAMS))  # all at once
        wrong = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
        assert not wrong, f"{len(wrong)} of {STREAMS} streams differ from colocated, e.g. #{wrong[0]}: " \
                          f"{got[wrong[0]]!r} != {reference[wrong[0]]!r}"
        assert all(reference), "every reference answer has text"
        workers = [f"http://127.0.0.1:{up.pp + 2 * i}" for i in range(PREFILL)]
        workers += [f"http://127.0.0.1:{up.dp + 2 * j}" for j in range(DECODE)]
        for url in workers:
            _wait_idle(url)  # every request, KV block and transfer let go
        hits = {url: _stats(url)["prefix_hit_tokens"] for url in workers}
        assert sum(hits[u] for u in workers[:PREFILL]) > 0 and sum(hits[u] for u in workers[PREFILL:]) > 0, hits
    finally:
        up.stop()
