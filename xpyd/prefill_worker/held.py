"""The requests a prefill worker holds, as its two threads share them: the engine thread (forward passes,
expiry, sends) and the signal-server thread (``signal_plane``: lookups, releases, sessions). Both touch
this state only under ``lock``.

What it holds: the scheduler (requests and their KV), the decode workers served (``peers``), which
requests each decode worker claimed (its session waits for their ``notify``), what is remembered of
requests no longer held (``recent.RequestMemory``) and the counts stats report. What it does, whichever
thread asks: claim a request, record how one ended here (and push that to its claimant), release one
(aborting its sends), account for one that reached a final state, and say what a decode worker is told
about one that is ready or prefilling.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Callable

from xpyd.prefill_worker.handover import ready_result
from xpyd.prefill_worker.peers import DecodePeers
from xpyd.prefill_worker.recent import RequestMemory
from xpyd.prefill_worker.scheduler import PrefillScheduler, PrefillSeq
from xpyd.signal import messages as m
from xpyd.signal.request_id import RequestIdError, parse_request_id
from xpyd.worker.kv_connector_send import KVSender
from xpyd.worker.metrics import WorkerMetrics
from xpyd.worker.request import RequestState
from xpyd.worker.work_item import ErrorEvent

RELEASED_EARLY = "released before it reached the prefill worker (its client went away)"
MAX_REMEMBERED = 16384  # ended / released-early request ids kept for clear answers
MIN_RETENTION = 60.0  # seconds those ids are kept (at least kv_ttl)
STREAM_PARTS = 4  # a streamed prompt's KV moves in parts of a quarter chunk (the last one after the prompt)


class HeldRequests:
    def __init__(self, sched: PrefillScheduler, connector: KVSender, metrics: WorkerMetrics,
                 kv_stream: bool, kv_ttl: float) -> None:
        self.lock = threading.RLock()  # (reentrant: a request whose work raises under it is failed under it)
        self.sched = sched
        self.connector = connector  # (plans pulls, moves their bytes)
        self.metrics = metrics
        self._kv_stream = kv_stream
        self.peers = DecodePeers()
        self.memory = RequestMemory(max(MIN_RETENTION, kv_ttl), MAX_REMEMBERED)
        self.claims: dict[str, set[str]] = {}  # decode worker -> ids of its live claimed requests
        self.sends: Counter[str] = Counter()  # KV sends started, by decode worker
        # expired, released_early (a release heard before its request), released_on_arrival, notifies_undelivered (the decode worker asks again), orphaned (freed
        # because the session of their decode worker ended)
        self.counts: Counter[str] = Counter()
        self.notify: Callable[[str, m.Message], None] | None = None  # the signal server's push (set by main)
        self.steps = 0  # forward passes run (a queued request's decode worker sees the queue move)

    @property
    def streams(self) -> bool:
        """Is a request's KV sent while its prompt computes (chunked, streaming on)?"""
        return self.sched.chunk > 0 and self._kv_stream

    def claim(self, seq: PrefillSeq) -> None:
        """Its decode worker claimed it (notified when ready; its KV waits for that worker's session)."""
        seq.claimed = True
        self.claims.setdefault(seq.peer, set()).add(seq.request_id)

    def record_end(self, request_id: str, status: m.LookupStatus, error: str, claimed: bool) -> None:
        """Remember how a request ended here unpulled; tell the decode worker that claimed it."""
        result = m.LookupResult(request_id, status, error=error)
        self.memory.ended[request_id] = result
        if claimed:
            self.push(request_id, result)

    def push(self, request_id: str, result: m.LookupResult) -> None:
        peer = decode_addr_of(request_id)
        if self.notify is not None and peer is not None:
            self.notify(peer, m.Notify((result,)))

    def ended(self, seq: PrefillSeq) -> None:
        """``seq`` reached a final state: count it (and its pull's bytes); if its prompt never finished, its
        HTTP call still waits: answer it."""
        claims = self.claims.get(seq.peer)
        if claims is not None:
            claims.discard(seq.request_id)
        plan = seq.pull.plan if seq.pull is not None else None
        if plan is not None:
            ok = seq.state is RequestState.FINISHED
            self.metrics.transfer_done("send", plan.nbytes, time.monotonic() - plan.started, ok)
            if ok:  # sent: a re-ask (its READY push may have been lost) is answered with the first token
                self.memory.ended[seq.request_id] = m.LookupResult(seq.request_id, m.LookupStatus.SENDING,
                                                                   seq.first_token, seq.prompt_len)
        self.metrics.request_done(_outcome(seq))
        output = getattr(seq.payload, "output", None)
        finished = output is not None and output.finished is not None  # (ended normally: a prompt-only request)
        if seq.first_token is None and seq.payload is not None and not seq.payload.sink.ended and not finished:
            sink = seq.payload.sink
            if seq.state is RequestState.FAILED:
                sink.put(ErrorEvent(500, seq.error or "prefill failed"))
            else:
                sink.put(ErrorEvent(409, f"request {seq.request_id} was released before its prefill ran to completion"))

    def release(self, request_id: str) -> int:
        """Drop a request (decode does not need it, or the client went away): 1 if it was held."""
        seq = self.sched.release(request_id)
        if seq is None:
            return 0
        self.connector.abort(seq)
        if seq.state.is_final:
            self.ended(seq)
        return 1

    def ready_result(self, seq: PrefillSeq, status: m.LookupStatus) -> m.LookupResult:
        """What its decode worker is told of a ready (READY/SENDING) or prefilling request."""
        part_blocks = 0  # one part (a prompt one step computes has nothing to overlap its KV with)
        block_size = self.sched.kv.block_size
        if status is m.LookupStatus.PREFILLING and seq.prompt_len - seq.kv.cached_tokens > self.sched.chunk:
            part_blocks = max(1, self.sched.chunk // STREAM_PARTS // block_size)
        return ready_result(seq, status, block_size, part_blocks,
                            self.steps if status is m.LookupStatus.PREFILLING else 0)


def _outcome(seq: PrefillSeq) -> str:
    """How a request ended here. KV released unpulled because the first token ended the
    request (decode did not need it) is a finished request, not an aborted one."""
    if seq.state is RequestState.ABORTED and seq.payload.output.finished is not None:
        return "finished"
    return seq.state.value


def decode_addr_of(request_id: str) -> str | None:
    try:
        return parse_request_id(request_id).decode_addr
    except RequestIdError:
        return None
