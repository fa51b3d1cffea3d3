"""One client request split across a prefill and a decode worker: ``PDCall``.

Both upstream calls start at once::

    first_token(): prefill <- prefill_body  -> first token  (returned once decode has the request too)
                   decode  <- decode_body   -> open SSE stream, its chunks named ``identity``
    relay():       streaming: decode's events for tokens 2..n as the client gets them (bytes)
    rest():        or, for a JSON answer, decode's deltas (tokens 2..n)
                   (neither yields anything if the request ended on prefill)
    usage:         after rest(): decode's usage chunk, or prefill's, or what was counted
    aclose():      cancel what still runs; tell prefill to drop KV decode never pulled

The first error from either side is the call's error (an ``UpstreamError``).

Without a prefill worker the decode worker prefills the request itself (``xpyd.api.local_prefill``): one
call, whose stream's first token chunk is ``first_token()`` (``DecodeStream.first``) and whose chunks after
it are ``relay()``/``rest()``, as a P/D call's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

from xpyd.api.identity import ResponseIdentity
from xpyd.api.openai import CompletionRequest, RequestKind
from xpyd.api.responses import SSE_KEEPALIVE
from xpyd.api.timing import WorkerTiming
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.client import WorkerClient
from xpyd.proxy.decode_stream import DecodeStream
from xpyd.proxy.upstream import Fault, UpstreamError
from xpyd.proxy.worker_api import Delta, FirstToken, Usage, decode_body, prefill_body


class PDCall:
    """One client request split across a prefill and a decode worker, called concurrently.

    ``first_token()`` starts both calls and returns prefill's answer (or the first
    error from either side); ``relay()`` or ``rest()`` yields decode's part unless the
    request already ended on prefill. Always finish with ``aclose()`` (or ``abort()``
    where awaiting is impossible): it cancels whatever is still running.
    """

    def __init__(
        self,
        client: WorkerClient,
        req: CompletionRequest,
        prefill: WorkerInfo | None,
        decode: WorkerInfo | None,
        request_id: str,
        identity: ResponseIdentity,
        resume: tuple[int, ...] = (),
    ) -> None:
        """``decode`` None: a request that needs no decode step (max_tokens 1, or 0 with echo), answered by
        prefill alone; ``prefill`` None: a request its decode worker prefills itself. ``resume``: a migrated
        request's output so far (``xpyd.proxy.migration``)."""
        if (prefill is None and decode is None) or (prefill is not None and prefill.role is not Role.PREFILL) \
                or (decode is not None and decode.role is not Role.DECODE):
            raise ValueError("PDCall needs a prefill worker and a decode worker (or one of them)")
        self._client = client
        self._req = req
        self._prefill = prefill
        self._decode = decode
        self.request_id = request_id
        self.identity = identity  # the response's id, created and model, in decode's chunks too
        self.resume = resume
        self._prefill_task: asyncio.Task[FirstToken] | None = None
        self._decode_task: asyncio.Task[DecodeStream] | None = None
        self._first: FirstToken | None = None
        self._prefilled: FirstToken | None = None  # prefill's answer, even if first_token() failed after it
        self._stream: DecodeStream | None = None
        self._decoded = 0  # deltas (or relayed blocks) from decode so far
        self._completed = False  # decode's stream ended normally
        self._release_sent = False
        self._decode_sent = asyncio.Event()
        self._lost: asyncio.Future[UpstreamError] = asyncio.get_running_loop().create_future()

    @property
    def prefill_url(self) -> str | None:
        return self._prefill.http_url if self._prefill is not None else None

    @property
    def pair(self) -> tuple[WorkerInfo | None, WorkerInfo | None]:
        """(prefill, decode); decode None for a request prefill alone answers, prefill None for one its decode
        worker prefills"""
        return self._prefill, self._decode

    @property
    def local(self) -> bool:
        """The decode worker prefills the request itself."""
        return self._prefill is None

    @property
    def workers(self) -> tuple[WorkerInfo, ...]:
        """The workers called: prefill and decode, or one of them alone."""
        return tuple(w for w in (self._prefill, self._decode) if w is not None)

    def prefill_lost(self, error: UpstreamError) -> bool:
        """The prefill worker died: end the call with ``error`` unless decode already has the KV.

        Decode's first delta comes after its KV pull completed, so until then the
        request may be waiting for KV that will never come (a decode worker can be
        slow to notice). True if the call was ended.
        """
        if self._first is None:
            return False  # prefill has not answered: its own call fails (or times out)
        if self._decoded or self._first.finish_reason is not None or self._lost.done():
            return False
        self._lost.set_result(error)
        if self._stream is not None:
            self._stream.fail(error)
        return True

    async def first_token(self) -> FirstToken:
        """Prefill's answer, once decode has the request too (so nothing reaches the
        client while a dead decode worker could still mean a retry elsewhere)."""
        kind = self._req.kind
        if self._prefill is None:
            return await self._local_first(kind)
        self._prefill_task = asyncio.create_task(self._client.prefill(
            self._prefill, kind, prefill_body(self._req, self._prefill, self.resume), self.request_id))
        if self._decode is None:
            return await self._prefill_alone()
        self._decode_task = asyncio.create_task(self._open_decode(kind))
        pending: set[asyncio.Task] = {self._prefill_task, self._decode_task}
        watch: asyncio.Task | None = None  # decode's stream, watched for its end while prefill works
        try:
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if self._prefill_task in done and self._prefill_task.exception() is not None:
                    raise self._prefill_task.exception()
                if self._decode_task in done and self._decode_task.exception() is not None:
                    raise self._decode_task.exception()  # e.g. decode refused the body: 4xx
                if watch is not None and watch in done and watch.exception() is not None:
                    raise watch.exception()  # the decode worker died while prefill worked: retried elsewhere
                if self._prefill_task in done:
                    first = self._prefilled = self._prefill_task.result()
                    if first.finish_reason is None:
                        await self._decode_connected()
                    self._first = first
                    return first
                if self._decode_task in done and watch is None:
                    watch = asyncio.create_task(self._decode_task.result().watch())
                    pending.add(watch)
        finally:
            if watch is not None and not watch.done():
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

    async def _local_first(self, kind: RequestKind) -> FirstToken:
        """The first token of a request its decode worker prefills: its stream's first token chunk."""
        began = time.monotonic()  # (its span: xpyd.proxy.phases)
        self._decode_task = asyncio.create_task(self._open_decode(kind))
        stream = await self._decode_task
        first = await stream.first()
        first = self._prefilled = replace(first, span=(began, time.monotonic()))
        if first.finish_reason is not None:
            self._completed = True  # (``first()`` read the stream to its end)
        self._first = first
        return first

    async def _prefill_alone(self) -> FirstToken:
        """Prefill's answer to a request it alone serves: it must have ended the request."""
        assert self._prefill_task is not None
        first = self._prefilled = await self._prefill_task
        if first.finish_reason is None:
            raise UpstreamError(502, f"{self._prefill.http_url} did not end a request that needs no decode step",
                                worker=self._prefill, fault=Fault.NONE)
        self._first = first
        return first

    async def _open_decode(self, kind: RequestKind) -> DecodeStream:
        with self._path_faults():  # (decode refusing the prefill worker the id names: the pair's fault)
            return await self._client.open_decode(
                self._decode, kind, decode_body(self._req, self._decode, self.identity, self.resume,
                                                local=self._prefill is None),
                self.request_id, self._decode_sent)

    async def _decode_connected(self) -> None:
        """Wait until decode's request is sent or has failed (usually long done by now)."""
        task = self._decode_task
        assert task is not None
        if not (task.done() or self._decode_sent.is_set()):
            sent = asyncio.create_task(self._decode_sent.wait())
            try:
                await asyncio.wait({task, sent}, timeout=self._client.connect_timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                sent.cancel()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()

    async def _open_stream(self) -> DecodeStream | None:
        """Decode's open stream, or None if the request ended on prefill."""
        if self._first is None:
            raise RuntimeError("first_token() must succeed before decode's part")
        if self._first.finish_reason is not None:
            return None  # ended on prefill; aclose() drops the decode stream
        assert self._decode_task is not None
        if not self._decode_task.done():
            await asyncio.wait({self._decode_task, self._lost}, return_when=asyncio.FIRST_COMPLETED)
        if self._lost.done():
            raise self._lost.result()
        self._stream = await self._decode_task
        return self._stream

    async def relay(self) -> AsyncIterator[bytes]:
        """Decode's SSE events for tokens 2..n (and its usage chunk if the client asked), unchanged,
        without the final ``[DONE]``."""
        stream = await self._open_stream()
        if stream is None:
            return
        with self._path_faults():
            async for block in stream.relay(self.identity):
                if block != SSE_KEEPALIVE:
                    self._decoded += 1
                yield block
        self._completed = True

    async def rest(self) -> AsyncIterator[Delta]:
        stream = await self._open_stream()
        if stream is None:
            return
        with self._path_faults():
            async for delta in stream.deltas():
                self._decoded += 1
                yield delta  # the stream goes on to its usage chunk and [DONE]
        self._completed = True

    @property
    def client_tokens(self) -> list[int] | None:
        """The output tokens whose text went to the client from this call (prefill's first, then what decode's
        chunks named as they were passed on); None if a worker did not name them."""
        if self._first is None or self._first.token_ids is None:
            return None
        stream = self._stream
        if stream is None:
            return list(self._first.token_ids)
        return None if stream.token_ids is None else [*self._first.token_ids, *stream.token_ids]

    @property
    def completed(self) -> bool:
        """Decode's part ended normally (the KV crossed from prefill to decode)."""
        return self._completed

    @property
    def decode_timing(self) -> WorkerTiming | None:
        """Decode's own timing, once its stream ended with it (``DecodeStream.timing``)."""
        return self._stream.timing if self._stream is not None else None

    @contextlib.contextmanager
    def _path_faults(self) -> Iterator[None]:
        """A failure between the two workers names them both (the proxy avoids the pair)."""
        try:
            yield
        except UpstreamError as e:
            if e.fault is Fault.PATH and e.pair is None and self._decode is not None and self._prefill is not None:
                e.pair = (self._prefill, self._decode)
            raise

    @property
    def usage(self) -> Usage:
        """Token counts for the whole request (valid once ``rest()`` is exhausted)."""
        if self._first is None:
            raise RuntimeError("no usage before first_token()")
        if self._first.finish_reason is not None:
            return self._first.usage
        if self._stream is not None and self._stream.usage is not None:
            return self._stream.usage
        # The decode worker sent no usage chunk: count what we saw.
        first = self._first.usage  # (a migrated request's counts its output before this call's)
        return Usage(first.prompt_tokens, first.completion_tokens + self._decoded, first.cached_tokens)

    def abort(self) -> None:
        """Cancel both calls and drop the decode stream, without waiting.

        If prefill answered and decode did not finish, prefill may still hold the
        request's KV for a decode worker that will never pull it (dead, or it
        failed before the pull): tell prefill to drop it (a no-op if it was pulled).
        """
        first = self._prefilled
        # Prefill may hold KV nobody will pull whenever it was called and the request neither ended there
        # (a final first token: prefill freed it) nor completed on decode. Decode's own release does not
        # cover it: a decode worker whose HTTP call was cut right after it was sent may never register
        # the request (its handler is cancelled before it submits), and one that never got it cannot
        # either (both seen in the cancel storm: KV held until kv_ttl). A release of KV that decode did
        # pull, or of a request that never reaches prefill, is harmless (remembered, then forgotten).
        ended_on_prefill = first is not None and first.finish_reason is not None
        if self._prefill_task is not None and not ended_on_prefill and not self._completed \
                and not self._release_sent:
            self._release_sent = True
            self._client.release_later(self._prefill, self.request_id)
        for task in (self._prefill_task, self._decode_task):
            if task is None:
                continue
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                if isinstance(task.result(), DecodeStream):
                    task.result().close()
        if self._stream is not None:
            self._stream.close()

    async def aclose(self) -> None:
        self.abort()
        tasks = [t for t in (self._prefill_task, self._decode_task) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        # A decode task that completed while being cancelled still holds an open stream.
        self.abort()
