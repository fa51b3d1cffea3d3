"""Who gets in, and when: the API key, the concurrency limit and the queue for decode room.

A generation request passes three gates, in this order::

    API key (when set)          -> 401, before anything else is read
    concurrency limit           -> 429 when ``max_concurrent`` requests are already in the proxy
                                   (queued ones count: they hold a connection and memory here)
    decode room (DecodeQueue)   -> every UP decode worker is full: wait in a FIFO queue of at most
                                   ``max_queue`` requests for up to ``timeout`` seconds, then 503;
                                   a full queue is a 503 at once

A decode worker is *full* when its load (``waiting + running + transferring``
as it last reported, plus what the proxy sent it since) reaches
``DECODE_DEPTH`` times its capacity (batch size): one batch running and one
batch behind it whose prefill and KV pulls are in progress keep the pipeline
busy; more than that would only wait inside the worker where nobody can time
it out. Everything runs on the proxy's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
from collections.abc import Callable, Iterable

from xpyd.api.openai import APIError
from xpyd.proxy.workers import Health, WorkerState

DECODE_DEPTH = 2  # a decode worker takes up to this many batches (capacity) before the proxy queues
RETRY_AFTER_SECONDS = 1


class ApiKey:
    """``Authorization: Bearer KEY`` checked in constant time (``hmac.compare_digest``)."""

    def __init__(self, key: str) -> None:
        if not key:
            raise ValueError("the API key must not be empty")
        self._key = key.encode()

    def check(self, authorization: str | None) -> None:
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.")
        if not hmac.compare_digest(token.strip().encode(), self._key):
            raise unauthorized("Incorrect API key provided.")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


def overloaded(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="server_overloaded")


class Slot:
    """One admitted request; ``release`` (idempotent) gives its place back.

    ``handed_off``: a streaming response's call now owns it (releases it when the stream ends).
    """

    __slots__ = ("_limit", "handed_off")

    def __init__(self, limit: "ConcurrencyLimit") -> None:
        self._limit: ConcurrencyLimit | None = limit
        self.handed_off = False

    def release(self) -> None:
        limit, self._limit = self._limit, None
        if limit is not None:
            limit.active -= 1


class ConcurrencyLimit:
    def __init__(self, max_concurrent: int) -> None:
        self.max_concurrent = max_concurrent
        self.active = 0

    def acquire(self) -> Slot:
        if self.active >= self.max_concurrent:
            raise APIError(429, f"Too many concurrent requests: this server takes at most "
                           f"{self.max_concurrent} at a time. Retry shortly.",
                           type="rate_limit_error", code="rate_limit_exceeded")
        self.active += 1
        return Slot(self)


def decode_room(states: Iterable[WorkerState]) -> int | None:
    """Free request places over the UP decode workers; None if none is UP (routing says 503)."""
    up = [s for s in states if s.health is Health.UP]
    if not up:
        return None
    free = 0
    for s in up:
        free += max(0, DECODE_DEPTH * max(s.info.capacity, 1) - s.load)
    return free


class DecodeQueue:
    """FIFO wait for room on a decode worker.

    ``room()`` gives the free places now (None: no decode worker is UP, so there
    is nothing to wait for). Call ``wake()`` whenever room may have appeared (a
    request ended, a load report came in, a worker came up); a woken request
    holds a reservation until it has been routed, so a newcomer cannot take its
    place in between.
    """

    def __init__(self, room: Callable[[], int | None], max_queue: int, timeout: float) -> None:
        self._room = room
        self.max_queue = max_queue
        self.timeout = timeout
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._reserved = 0

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._waiters)

    def _free(self) -> int | None:
        room = self._room()
        return None if room is None else room - self._reserved

    async def wait(self) -> None:
        """Return when the caller may route now (it must, before its next await); raise 503 otherwise."""
        free = self._free()
        if not self._waiters and (free is None or free > 0):
            return
        if self.waiting >= self.max_queue:
            raise overloaded(f"All decode workers are busy and {self.waiting} requests are already "
                             "queued. Retry shortly.")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            self.wake()
            async with asyncio.timeout(self.timeout):
                await asyncio.shield(fut)
        except TimeoutError:
            if not fut.done():
                fut.cancel()
                raise overloaded(f"All decode workers stayed busy for {self.timeout:g} s. "
                                 "Retry shortly.") from None
        except BaseException:  # the client went away
            if fut.done() and not fut.cancelled():
                self._reserved -= 1  # granted but not used: pass it on
                self.wake()
            else:
                fut.cancel()
            raise
        self._reserved -= 1

    def wake(self) -> None:
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()  # timed out or cancelled
        while self._waiters:
            free = self._free()
            if free is not None and free <= 0:
                return
            fut = self._waiters.popleft()
            if fut.done():
                continue
            fut.set_result(None)  # no UP decode worker at all: let it go and get its 503 from routing
            self._reserved += 1
