"""Reading the decode worker's SSE answer: tokens 2..n, then usage, then ``[DONE]``.

``xpyd.api.sse`` splits the body into events; an error event ends the stream
with an UpstreamError (``in_stream_error``), and so does a stream that ends
without a finish reason. After ``[DONE]`` the (empty) rest of the body is read
briefly so the connection goes back to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp

from xpyd.api.openai import RequestKind
from xpyd.api.responses import DONE_DATA
from xpyd.api.sse import sse_data
from xpyd.discovery.types import WorkerInfo
from xpyd.proxy.upstream import UpstreamError, in_stream_error, upstream_errors
from xpyd.proxy.worker_api import Delta, Usage, parse_delta, parse_usage

DRAIN_TIMEOUT = 1.0  # after [DONE], wait this long for the stream's end before dropping it


class DecodeStream:
    """The decode worker's SSE response; ``deltas()`` yields tokens 2..n, then ``usage`` is set."""

    def __init__(self, resp: aiohttp.ClientResponse, worker: WorkerInfo, kind: RequestKind) -> None:
        self._resp = resp
        self._worker = worker
        self._kind = kind
        self.usage: Usage | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        finished = False
        with upstream_errors(self._worker):
            async with contextlib.aclosing(sse_data(self._resp.content.iter_any())) as events:
                async for data in events:
                    if data.strip() == DONE_DATA:
                        await self._release()
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        raise in_stream_error(obj["error"], self._worker)
                    if obj.get("usage"):
                        self.usage = parse_usage(obj["usage"])
                    for choice in obj.get("choices") or ():
                        delta = parse_delta(choice, self._kind)
                        if delta is not None:
                            finished = finished or delta.finish_reason is not None
                            yield delta
        if not finished:
            raise UpstreamError(502, f"decode worker {self._worker.http_url} ended the stream "
                                "without a finish_reason", worker=self._worker)

    async def _release(self) -> None:
        """Read the (empty) rest of the body so the connection goes back to the pool."""
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with asyncio.timeout(DRAIN_TIMEOUT):
                while await self._resp.content.readany():
                    pass
        self._resp.release()  # closes instead if the body did not end

    def fail(self, error: UpstreamError) -> None:
        """End ``deltas()`` with ``error`` from another task (it may be waiting for a read)."""
        self._resp.content.set_exception(error)

    def close(self) -> None:
        self._resp.close()
