"""Decode streams held for a whole generation cannot starve the proxy's other calls to workers: prefill POSTs
and control calls (health and stats probes) have pools of their own (`proxy.client.WorkerSessions`).

The shape of the first 16P48D run's failure at a size a test can hold: with one pool of 4 connections, 4 held
decode streams took them all, the probes of the decode worker timed out (it was marked down) and a fifth
request's prefill never reached its worker.
"""

from __future__ import annotations

import asyncio

from tests.integration.test_proxy_routing import MODEL, make_env  # noqa: F401 - make_env is a fixture
from tests.waiting import until

POOL = 4
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}


async def test_held_decode_streams_leave_prefill_posts_and_probes_their_own_connections(make_env):
    env = await make_env(n_prefill=1, n_decode=1, max_connections=POOL, poll_interval=0.1, poll_timeout=0.5)
    decode, prefill = env.decode[0], env.prefill[0]
    decode.capacity = 4 * POOL  # room at the worker: only the proxy's connections limit the streams
    decode.hold = asyncio.Event()

    async def stream() -> int:
        async with env.post(BODY) as r:
            await r.read()
            return r.status

    async def decode_up() -> bool:
        workers = (await env.cluster())["workers"]
        return [w["health"] for w in workers if w["role"] == "decode"] == ["up"]

    await until(decode_up, "the decode worker up")
    held = [asyncio.create_task(stream()) for _ in range(POOL)]
    try:
        await until(lambda: decode.active == POOL, f"{POOL} decode streams held")
        polls = decode.stats_polls
        await until(lambda: decode.stats_polls >= polls + 5, "the decode worker probed while its streams are held")
        assert await decode_up()  # (a probe starved of connections for 3 polls would have marked it down)
        fifth = asyncio.create_task(stream())
        await until(lambda: len(prefill.answered) == POOL + 1, "the fifth request's prefill answered")
    finally:
        decode.hold.set()
    assert await asyncio.gather(*held, fifth) == [200] * (POOL + 1)
