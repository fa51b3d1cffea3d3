"""Busy workers and dead ones under load, as the proxy tells them apart:

- a worker too busy to answer its probes is not taken for a stalled one while it streams to the proxy: a
  probe that timed out while the worker sent tokens (or KV event lines) does not count towards the
  ``STALLED_PROBES`` that mark it DOWN (the 16P48D run on 2 cores marked busy decode workers down 23 times);
  one that sends nothing is still marked down after them;
- a decode worker that dies while its request's prompt is still queued at prefill ends the request at once
  (SIGKILL of 8 of 48 under 1,000 streams: some streams ended 28 s after the kill, when prefill answered).

Fake workers (aiohttp), the real proxy in this process."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.test_proxy_routing import MODEL, make_env  # noqa: F401 - make_env is a fixture
from tests.waiting import until
from xpyd.proxy import decode_stream
from xpyd.proxy.poller import STALLED_PROBES

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}


@pytest.mark.parametrize("streaming", [True, False])
async def test_a_worker_streaming_to_the_proxy_is_not_marked_down_for_unanswered_probes(make_env, monkeypatch,
                                                                                         streaming):
    monkeypatch.setattr(decode_stream, "HEARD_EVERY", 0.05)  # (every probe of 0.3 s sees the stream's bytes)
    env = await make_env(n_prefill=1, n_decode=1, poll_interval=0.05, poll_timeout=0.3)
    decode = env.decode[0]
    await until(lambda: decode.stats_polls > 0, "the decode worker probed")
    decode.slow_chunks, decode.chunk_gap = 60, 0.05  # a 3 s stream: ~8 probe timeouts at 0.3 s + the gaps
    decode.stats_wait = asyncio.Event()  # from now on its probes go unanswered
    # A DOWN worker is probed on /health (and is UP again when it answers): those probes say it was marked down.
    if streaming:
        async with env.post(BODY) as r:
            body = await r.read()
            assert r.status == 200 and body.count(b" .") == 60
        assert decode.health_answers == []  # ~8 unanswered stats probes while it streamed, never marked down
    else:  # nothing streams
        await until(lambda: decode.health_answers, f"the silent worker marked down after {STALLED_PROBES} probes")
    decode.stats_wait.set()


async def test_a_decode_worker_that_dies_while_prefill_works_fails_the_request_before_prefill_answers(make_env):
    """The decode worker answered its headers and then died (SIGKILL) while the prompt was still queued at
    prefill: the proxy watches decode's stream from then on, so the request ends (and the client hears) at
    once, not when prefill answers, maybe a long queue later."""
    env = await make_env(n_prefill=1, n_decode=1)
    prefill, decode = env.prefill[0], env.decode[0]
    prefill.delay = 30.0  # a long queue at prefill
    decode.drop_before_tokens = True
    for stream in (True, False):
        async with env.post({**BODY, "stream": stream}) as r:
            body = await r.read()
        assert r.status in (502, 503) or b'"error"' in body, (r.status, body)
        assert prefill.answered == []  # prefill is still working on it: the error did not wait for it
