"""``x-xpyd-workers`` on the proxy's answers (``--expose-worker-names``), served by aiohttp.web on a real port
against the fake workers of ``test_proxy``: absent by default; with the option, on streamed and JSON answers
of both routes (and on an error a worker gave), naming the pair that answered by the names ``/cluster``
shows, never an address; a request retried on another pair names that pair."""

from __future__ import annotations

import pytest

from tests.integration.test_proxy import Cluster, chat, completion, make_cluster, read_sse
from xpyd.proxy.routing import Policy
from xpyd.proxy.worker_names import WORKERS_HEADER

pytestmark = pytest.mark.timeout(120)

BODIES = [("/v1/completions", completion(stream_options=None)), ("/v1/completions", completion(stream=True)),
          ("/v1/chat/completions", chat()), ("/v1/chat/completions", chat(stream=True))]


async def answer_header(c: Cluster, path: str, body: dict) -> str | None:
    """The header of a 200 answer, read to its end (a stream to [DONE])."""
    async with c.post(path, body) as r:
        assert r.status == 200, await r.text()
        if body.get("stream"):
            assert r.content_type == "text/event-stream"
            assert (await read_sse(r))[-1] == "[DONE]"
        else:
            await r.json()
        return r.headers.get(WORKERS_HEADER)


async def names_by_url(c: Cluster) -> dict[str, str]:
    async with c.http.get(c.url + "/cluster") as r:
        return {w["http_url"]: w["name"] for w in (await r.json())["workers"]}


async def test_no_header_by_default():
    c, close = await make_cluster()
    try:
        for path, body in BODIES:
            assert await answer_header(c, path, body) is None
        async with c.http.get(c.url + "/cluster") as r:
            assert all("name" not in w for w in (await r.json())["workers"])
    finally:
        await close()


async def test_streamed_and_json_answers_name_the_pair():
    c, close = await make_cluster(expose_worker_names=True)
    try:
        names = await names_by_url(c)
        expected = f"prefill={names[c.prefill.url]}, decode={names[c.decode.url]}"
        for path, body in BODIES * 2:  # the same names every time
            value = await answer_header(c, path, body)
            assert value == expected
            for w in c.workers():
                assert w.url.rsplit(":", 1)[1] not in value and "127.0.0.1" not in value
        # An error the worker gave after the request was dispatched names the pair too; a request refused
        # before any worker was chosen names none.
        c.decode.fail = (400, {"error": {"message": "bad request", "type": "invalid_request_error"}})
        async with c.post("/v1/completions", completion()) as r:
            assert r.status == 400
            assert r.headers.get(WORKERS_HEADER) == expected
        async with c.post("/v1/completions", completion(model="no-such-model")) as r:
            assert r.status == 404
            assert WORKERS_HEADER not in r.headers
    finally:
        await close()


async def test_a_retried_request_names_the_pair_that_answered():
    # round_robin: of the first two requests one goes to each decode worker; the health poll (every 60 s)
    # has not seen the dead one yet, so the request sent there fails to connect and starts over on the other.
    c, close = await make_cluster(n_decode=2, expose_worker_names=True, policy=Policy.ROUND_ROBIN,
                                  poll_interval=60.0)
    try:
        names = await names_by_url(c)
        dead, alive = c.decodes[1], c.decodes[0]
        await dead.stop()
        expected = f"prefill={names[c.prefill.url]}, decode={names[alive.url]}"
        for stream in (False, True):
            assert await answer_header(c, "/v1/completions", completion(stream=stream)) == expected
        assert len(alive.received) == 2 and len(c.prefill.received) == 3  # one of them was sent twice
    finally:
        c.decodes.remove(c.decodes[1])  # already stopped
        await close()
