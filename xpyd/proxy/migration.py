"""Request migration: a P/D request whose decode worker dies (or whose prefill worker dies before decode has
the KV, or whose pair's path fails) after the client got tokens goes on on another pair, and the client's
stream continues with no error and no repeated or missing token.

    MigratingCall(call, first)            the request's call, once prefill's first token is in
    relay() / rest()                      the call's part; when it fails with a fault that says the worker or
                                          the path is gone (not the request's own error):
      -> the tokens the client has: prefill's first and every one decode's chunks named (``xpyd.api.resume``)
      -> the failed worker marked down (or the pair avoided), the call dropped
      -> restart(those tokens): a new P/D call on a fresh pair, as a new request's (retried as one), whose prefill
         computes the prompt and those tokens as one context (prefix caches make it cheap) and samples the next
         token with the random draw the stream was at, and whose decode replays them and goes on
      -> its first token goes to the client as a token chunk (or a delta), then its decode's chunks
    usage                                 the last call's (the workers count the resumed output as output)

At most ``limit`` migrations a request (``--migration-limit``); a request that cannot move (the limit, no
worker left, a worker that did not name its tokens) ends as before: with the failure.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from xpyd.api.openai import APIError, CompletionRequest
from xpyd.api.responses import sse, stream_chunk, usage_chunk
from xpyd.api.timing import WorkerTiming
from xpyd.proxy.admission import Slot
from xpyd.proxy.inflight import TrackedCall
from xpyd.proxy.metrics import ProxyMetrics
from xpyd.proxy.upstream import Fault, UpstreamError
from xpyd.proxy.worker_api import Delta, FirstToken, Usage

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 3
# Faults that say a worker or the path between the two is gone; Fault.NONE is the request's own error (a 4xx, a
# worker's answer it would give again).
MOVABLE = frozenset({Fault.UNREACHABLE, Fault.UNHEALTHY, Fault.PATH})

Restart = Callable[[tuple[int, ...], UpstreamError], Awaitable[tuple[TrackedCall, FirstToken]]]


class MigratingCall:
    """A P/D call that moves to another pair when its workers fail mid-answer (the interface of ``PDCall`` that
    the relay, the JSON answer and several choices use)."""

    def __init__(self, call: TrackedCall, first: FirstToken, req: CompletionRequest, restart: Restart,
                 limit: int, failed: Callable[[APIError], None], metrics: ProxyMetrics | None = None) -> None:
        """``restart(tokens, error)``: a new call resuming after ``tokens``, with its first token (raises as a new
        request's call would); ``failed(error)``: what the proxy does with a worker's failure (marks it down)."""
        self._call = call
        self._first = first
        self._req = req
        self._restart = restart
        self._limit = limit
        self._failed = failed
        self._metrics = metrics
        self._earlier: list[int] = []  # the tokens the client got from the calls before this one
        self._slot: Slot | None = None
        self.migrations = 0

    # --- what the relay and the app read (the current call's) ---
    @property
    def identity(self):
        return self._call.identity

    @property
    def request_id(self) -> str:
        return self._call.request_id

    @property
    def workers(self):
        return self._call.workers

    @property
    def pair(self):
        return self._call.pair

    @property
    def completed(self) -> bool:
        return self._call.completed

    @property
    def usage(self) -> Usage:
        return self._call.usage

    @property
    def decode_timing(self) -> WorkerTiming | None:
        """Decode's own timing (``PDCall.decode_timing``); None once the request moved on (it would be another
        decode worker's, after a resumed first token)."""
        return self._call.decode_timing if self.migrations == 0 else None

    def hold(self, slot: Slot) -> None:
        """The request's concurrency slot, released when the last call ends (not when one moves on)."""
        slot.handed_off = True
        self._slot = slot

    def abort(self) -> None:
        self._call.abort()
        if self._slot is not None:
            self._slot.release()

    async def aclose(self) -> None:
        await self._call.aclose()
        self.abort()

    # --- decode's part, moved on as often as it may ---
    async def relay(self) -> AsyncIterator[bytes]:
        """As ``PDCall.relay``; a resumed call's first token goes as a token chunk (with the usage chunk if the
        client asked and the request ended there)."""
        while True:
            try:
                async for block in self._call.relay():
                    yield block
                return
            except UpstreamError as e:
                first = await self._move_on(e)
            name, kind = self.identity, self._req.kind
            if first.text or first.logprobs is not None or first.finish_reason is not None:
                yield sse(stream_chunk(name.id, name.created, name.model, kind, first.text or None,
                                       first.finish_reason, stop_reason=first.stop_reason, logprobs=first.logprobs))
            if first.finish_reason is not None:
                if self._req.include_usage:
                    u = first.usage
                    yield sse(usage_chunk(name.id, name.created, name.model, kind, u.prompt_tokens,
                                          u.completion_tokens, u.cached_tokens))
                return

    async def rest(self) -> AsyncIterator[Delta]:
        """As ``PDCall.rest``; a resumed call's first token comes as a delta."""
        while True:
            try:
                async for delta in self._call.rest():
                    yield delta
                return
            except UpstreamError as e:
                first = await self._move_on(e)
            if first.text or first.logprobs is not None or first.finish_reason is not None:
                yield Delta(first.text, first.finish_reason, first.stop_reason, first.logprobs)
            if first.finish_reason is not None:
                return

    async def _move_on(self, error: UpstreamError) -> FirstToken:
        """The call failed with ``error``: a new call resuming after the client's tokens, and its first token;
        ``error`` raised if the request cannot move."""
        tokens = self._call.client_tokens
        if error.fault not in MOVABLE or self.migrations >= self._limit or tokens is None:
            raise error
        self._failed(error)
        old = self._call
        resume = (*self._earlier, *tokens)
        log.warning("%s (%s): %s; moving it on after %d tokens (migration %d of at most %d)", old.identity.id,
                    old.request_id, error.message, len(resume), self.migrations + 1, self._limit)
        await old.aclose()
        self.migrations += 1
        if self._metrics is not None:
            self._metrics.migrated()
        call, first = await self._restart(resume, error)  # (its failures are the request's now)
        self._call, self._earlier = call, list(resume)
        return first
