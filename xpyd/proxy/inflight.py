"""The proxy's P/D calls in flight, and what ends them besides the client.

A call moves through::

    InFlight.start -> router.started(prefill, decode; with the prompt's keys), tracked
    (streaming: hold(slot) -- the response body now owns the concurrency slot)
    abort/aclose, exactly once -> router.finished(both), untracked, slot released, on_end()
                                  (``PairHealth.ended`` with the call's pair ticket: completed on
                                  decode, the pair is healthy if the call started after its last failure)

When the table marks a prefill worker unreachable (``worker_down``), its calls
whose decode worker has not pulled the KV yet are ended at once with a 502:
their decode worker would otherwise wait for that KV until its own timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from xpyd.api.identity import ResponseIdentity
from xpyd.api.openai import CompletionRequest
from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.admission import Slot
from xpyd.proxy.client import WorkerClient
from xpyd.proxy.pairs import PairHealth
from xpyd.proxy.pd_call import PDCall
from xpyd.proxy.prefix_index import PromptKeys
from xpyd.proxy.routing import Router
from xpyd.proxy.upstream import Fault, UpstreamError

log = logging.getLogger(__name__)


class TrackedCall(PDCall):
    """A PDCall that tells its ``InFlight`` when it starts and, exactly once, when it ends.

    A streaming call also holds its request's concurrency slot until then.
    """

    def __init__(self, client: WorkerClient, req: CompletionRequest, prefill: WorkerInfo,
                 decode: WorkerInfo | None, request_id: str, identity: ResponseIdentity, inflight: InFlight,
                 keys: PromptKeys | None = None, resume: tuple[int, ...] = ()) -> None:
        super().__init__(client, req, prefill, decode, request_id, identity, resume)
        self._inflight = inflight
        self._workers: tuple[WorkerInfo, ...] = self.workers
        self._slot: Slot | None = None
        self.tickets, self.pair_ticket = inflight.started(self, self._workers, keys)

    def hold(self, slot: Slot) -> None:
        slot.handed_off = True
        self._slot = slot

    def abort(self) -> None:
        super().abort()
        workers, self._workers = self._workers, ()
        if workers:
            self._inflight.ended(self, workers, self._slot)


class InFlight:
    """Every TrackedCall between its start and its end; ``on_end`` runs after each end."""

    def __init__(self, router: Router, pairs: PairHealth, on_end: Callable[[], None]) -> None:
        self._router = router
        self._pairs = pairs
        self._on_end = on_end
        self._calls: set[TrackedCall] = set()

    def start(self, client: WorkerClient, req: CompletionRequest, prefill: WorkerInfo,
              decode: WorkerInfo | None, request_id: str, identity: ResponseIdentity,
              keys: PromptKeys | None = None, resume: tuple[int, ...] = ()) -> TrackedCall:
        return TrackedCall(client, req, prefill, decode, request_id, identity, self, keys, resume)

    def started(self, call: TrackedCall, workers: tuple[WorkerInfo, ...],
                keys: PromptKeys | None) -> tuple[tuple[int, ...], int]:
        """The router's ticket for each worker, and the pair's (``PairHealth.started``)."""
        tickets = tuple(self._router.started(worker, keys) for worker in workers)
        pair_ticket = self._pairs.started(*workers) if len(workers) == 2 else 0  # (prefill alone: no pair)
        self._calls.add(call)
        return tickets, pair_ticket

    def ended(self, call: TrackedCall, workers: tuple[WorkerInfo, ...], slot: Slot | None) -> None:
        for worker, ticket in zip(workers, call.tickets):
            self._router.finished(worker, ticket)
        if len(workers) == 2:
            self._pairs.ended(*workers, call.pair_ticket, completed=call.completed)
        self._calls.discard(call)
        if slot is not None:
            slot.release()
        self._on_end()

    def worker_down(self, worker: WorkerInfo, reason: str, unreachable: bool) -> None:
        """A prefill worker is gone: its requests whose KV decode has not pulled yet cannot finish.

        Their decode worker may wait for that KV until its own timeout; end them now
        (error event or 502) and drop their decode calls, which aborts them there.
        A prefill worker that answered an error or timed out is still there and may
        yet serve the pulls: its requests are left alone.
        """
        if worker.role is not Role.PREFILL or not unreachable:
            return  # a dead decode worker breaks its streams by itself
        message = f"prefill worker {worker.http_url} went down before the decode worker had the request's KV"
        # UNREACHABLE: a non-streaming request (the client has seen nothing yet) starts over on a fresh pair.
        ended = sum(call.prefill_lost(UpstreamError(502, f"{message} ({reason})", worker=worker,
                                                    fault=Fault.UNREACHABLE))
                    for call in list(self._calls) if call.prefill_url == worker.http_url)
        if ended:
            log.warning("ended %d request(s) waiting for KV from %s", ended, worker.http_url)
