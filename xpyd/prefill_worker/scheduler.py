"""Prefill scheduler: decides, never moves bytes.

Queues a request moves through::

    waiting --(nothing running, room)--> running --(first token)--> transferring
    transferring: KV held in the pool until a decode worker pulls it; then the
    send's completion token is polled each step --> finished (blocks released)
    KV held (no send started) and not claimed by its decode worker longer than the
    lease (kv_ttl) is ``expired``: the engine releases it. Claimed KV stays until it
    is pulled, released, or its decode worker is gone (the engine decides that).

Invariants: at most one request RUNNING; RUNNING + TRANSFERRING <= batch_size;
every RUNNING/TRANSFERRING request holds the KV blocks of its whole prompt (its cached prefix shared
with other requests, the rest its own); a waiting request holds none. A request starts only when the
pool has the blocks it still needs (`KVCache.admit`); the oldest eligible request waits for them
rather than being overtaken.

Admission per decode worker: KV waits here for the decode worker named in the request id,
so one slow or full decode worker must not take every place from the others. A decode worker
may hold at most ``batch_size`` minus one place for each other live decode worker, and while
requests for other decode workers wait, at most its fair share (``batch_size`` over the decode
workers that have work here). The oldest request whose decode worker is under its cap runs next.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from xpyd.worker.request import PREFILL_TRANSITIONS, RequestState, check_transition, require
from xpyd.worker.kv_cache import KVCache, RequestKV
from xpyd.transfer.base import CompletionToken

S = RequestState


@dataclass(eq=False, slots=True)
class PrefillSeq:
    request_id: str
    prompt_ids: list[int]
    payload: Any = None  # the worker's per-request extras (sampling, output sink)
    state: RequestState = S.WAITING
    hashes: list[int] = field(default_factory=list)  # chain hashes of the prompt's full blocks
    kv: RequestKV | None = None  # its KV blocks while running / transferring
    first_token: int | None = None
    send_token: CompletionToken | None = None
    error: str | None = None
    cancel_requested: bool = False  # abort/release while a send is in flight
    held_since: float = 0.0  # monotonic time the KV started waiting for a pull (set by prefilled)
    peer: str = ""  # the decode worker this request's KV waits for (its address in the request id)
    claimed: bool = False  # that decode worker claimed it: no kv_ttl; kept while the worker lives

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def set_state(self, new: RequestState) -> None:
        check_transition(PREFILL_TRANSITIONS, self.request_id, self.state, new)
        self.state = new


@dataclass(slots=True)
class PrefillScheduler:
    batch_size: int
    kv: KVCache
    _waiting: deque[PrefillSeq] = field(default_factory=deque)
    _live: "OrderedDict[str, PrefillSeq]" = field(default_factory=OrderedDict)  # not final
    _running: PrefillSeq | None = None
    _transferring: dict[str, PrefillSeq] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")

    # --- queries -----------------------------------------------------------
    def get(self, request_id: str) -> PrefillSeq | None:
        return self._live.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return 0 if self._running is None else 1

    @property
    def num_transferring(self) -> int:
        return len(self._transferring)

    def transferring(self) -> list[PrefillSeq]:
        return list(self._transferring.values())

    def expired(self, now: float, ttl: float) -> list[PrefillSeq]:
        """Unclaimed requests whose KV has waited for a pull (no send started) for ``ttl`` seconds or more."""
        return [s for s in self.held() if not s.claimed and now - s.held_since >= ttl]

    def held(self) -> list[PrefillSeq]:
        """Requests whose KV waits for a pull (no send started, not being dropped)."""
        return [s for s in self._transferring.values() if s.send_token is None and not s.cancel_requested]

    def queued_tokens(self) -> int:
        """Prompt tokens still to compute: the waiting requests' and the running one's (its cached prefix
        excluded); what a router weighs as this worker's queue."""
        queued = sum(s.prompt_len for s in self._waiting)
        if self._running is not None and self._running.kv is not None:
            queued += self._running.prompt_len - self._running.kv.cached_tokens
        return queued

    def sends_in_flight(self) -> bool:
        return any(s.send_token is not None for s in self._transferring.values())

    def has_work(self) -> bool:
        return bool(self._live)

    # --- transitions -------------------------------------------------------
    def add(self, seq: PrefillSeq) -> None:
        if seq.request_id in self._live:
            raise ValueError(f"duplicate request id {seq.request_id}")
        self._live[seq.request_id] = seq
        self._waiting.append(seq)

    def next_to_run(self, live_peers: int = 1) -> PrefillSeq | None:
        """Start the next prefill if nothing runs and there is room (``live_peers``: decode workers alive)."""
        if self._running is not None or not self._waiting:
            return None
        if self.num_transferring + 1 > self.batch_size:
            return None
        held = Counter(s.peer for s in self._transferring.values())
        demand = {s.peer for s in self._waiting}
        peers = max(live_peers, len(demand | set(held)))
        seq = next((s for s in self._waiting if held[s.peer] < self._cap(s.peer, peers, demand)), None)
        if seq is None:
            return None
        n = seq.prompt_len
        kv = self.kv.admit(seq.hashes, n, n, reuse_tokens=n - 1)  # (the last token is computed: its logits)
        if kv is None:
            return None  # not enough free KV blocks yet: it runs when requests release theirs
        self._waiting.remove(seq)
        seq.kv = kv
        seq.set_state(S.RUNNING)
        self._running = seq
        return seq

    def prefilled(self, seq: PrefillSeq, first_token: int, now: float = 0.0) -> None:
        """The forward pass is done: hold the KV (leased from ``now``) until a decode worker pulls it."""
        self._expect_running(seq)
        self._running = None
        seq.first_token = first_token
        seq.held_since = now
        if seq.cancel_requested:
            self._end(seq, S.ABORTED)
            return
        seq.set_state(S.TRANSFERRING)
        self._transferring[seq.request_id] = seq

    def fail_running(self, seq: PrefillSeq, error: str) -> None:
        self._expect_running(seq)
        self._running = None
        seq.error = error
        self._end(seq, S.FAILED)

    def start_send(self, request_id: str, token: CompletionToken) -> PrefillSeq:
        seq = self._transferring.get(request_id)
        if seq is None or seq.send_token is not None or seq.cancel_requested:
            raise ValueError(f"request {request_id} has no KV waiting to be sent")
        seq.send_token = token
        return seq

    def poll(self) -> list[PrefillSeq]:
        """Check send tokens without blocking; release the blocks of finished sends."""
        ended = []
        for seq in list(self._transferring.values()):
            tok = seq.send_token
            if tok is None or not tok.finished():
                continue
            if tok.done() and not seq.cancel_requested:
                self._end(seq, S.FINISHED)
            elif tok.done() or seq.cancel_requested:
                self._end(seq, S.ABORTED)
            else:
                seq.error = tok.error or "transfer failed"
                self._end(seq, S.FAILED)
            ended.append(seq)
        return ended

    def release(self, request_id: str, state: RequestState = S.ABORTED) -> PrefillSeq | None:
        """Drop a request (decode does not need it, or the client went away).

        A send in flight is left to finish or fail (the caller aborts it in the
        backend); its blocks are released only when its token is finished.
        """
        seq = self._live.get(request_id)
        if seq is None:
            return None
        if seq.state is S.WAITING:
            self._waiting.remove(seq)
            self._end(seq, state)
        elif seq.state is S.RUNNING:
            seq.cancel_requested = True  # ended by prefilled()/fail_running()
        elif seq.send_token is None:
            self._end(seq, state)
        else:
            seq.cancel_requested = True
        return seq

    # --- internals ---------------------------------------------------------
    def _cap(self, peer: str, peers: int, demand: set[str]) -> int:
        """How many requests' KV for ``peer`` may be held (see the module docstring)."""
        cap = self.batch_size - min(self.batch_size - 1, peers - 1)
        if demand - {peer}:
            cap = min(cap, -(-self.batch_size // len(demand | {peer})))
        return max(1, cap)

    def _expect_running(self, seq: PrefillSeq) -> None:
        if self._running is not seq:
            raise ValueError(f"request {seq.request_id} is not the running prefill")

    def _end(self, seq: PrefillSeq, state: RequestState) -> None:
        seq.set_state(state)
        self._transferring.pop(seq.request_id, None)
        self._live.pop(seq.request_id, None)
        if seq.kv is not None:
            self.kv.free(seq.kv)
            seq.kv = None

    def check_invariants(self) -> None:
        """Raise InvariantError if the scheduling rules are broken (used by tests)."""
        require(self.num_running <= 1, "more than one prefill running")
        require(self.num_running + self.num_transferring <= self.batch_size, "batch exceeded")
        for seq in self._transferring.values():
            require(seq.state is S.TRANSFERRING and _holds_prompt(seq, self.kv), "bad transferring seq")
        if self._running is not None:
            require(self._running.state is S.RUNNING and _holds_prompt(self._running, self.kv), "bad running seq")
        for seq in self._waiting:
            require(seq.state is S.WAITING and seq.kv is None, "bad waiting seq")
        require(len(self._live) == len(self._waiting) + self.num_running + self.num_transferring,
                "lost track of a request")


def _holds_prompt(seq: PrefillSeq, kv: KVCache) -> bool:
    return seq.kv is not None and len(seq.kv.blocks) == kv.blocks_for(seq.prompt_len)
