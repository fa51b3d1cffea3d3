"""Colocated scheduler: the traditional setup DI is compared against.

One engine does both phases in the same continuous batch. As in classic
continuous batching, a new prefill is preferred whenever the batch has room:
while it runs (batch size 1), every running decode waits — the prefill stall
that disaggregation removes.

Queues: waiting --(room: batch and KV blocks)--> running (after its prefill) --> finished.

Blocks are taken as requests grow, nothing is reserved for the output to come: a request is admitted with the
blocks of its prompt and its first decoded token, and before each step ``reserve_decode`` gives every running
request the blocks of its next token, oldest first, preempting the newest running request when the pool has
none left (``xpyd.worker.preemption``)::

    running --(preempted: its blocks freed, its full ones left in the prefix cache)--> preempted (at the
    front of the waiting queue, oldest first) --(room)--> running, once its prompt and output so far but the
    last token (``recompute``) are computed again, its cached prefix skipped; nothing sampled: its output's
    state never left this worker

Invariant: RUNNING <= batch_size; every RUNNING request holds the blocks of its tokens so far (after
``reserve_decode``, of its next one); a waiting or preempted request holds none, and the preempted ones come
first, oldest first. A prompt's cached prefix is reused, not computed again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from xpyd.worker.request import RequestState, check_transition, require
from xpyd.worker.kv_cache import BlockChain, KVCache, RequestKV
from xpyd.worker.preemption import Room, make_room

S = RequestState
COLOCATED_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.RUNNING, S.FAILED, S.ABORTED}),
    S.RUNNING: frozenset({S.PREEMPTED, S.FINISHED, S.FAILED, S.ABORTED}),
    S.PREEMPTED: frozenset({S.RUNNING, S.FAILED, S.ABORTED}),
}


@dataclass(eq=False, slots=True)
class ColocatedSeq:
    request_id: str
    prompt_ids: list[int]
    payload: Any = None
    state: RequestState = S.WAITING
    hashes: list[int] = field(default_factory=list)  # chain hashes of the prompt's full blocks (then its context's)
    kv: RequestKV | None = None
    error: str | None = None
    reuse: bool = True  # may start after a cached prefix (not when every prompt token's logprob is wanted)
    order: int = 0  # arrival order (set by the scheduler): the newest is preempted first
    preemptions: int = 0  # times it gave its blocks back
    recompute: Sequence[int] = ()  # preempted: its prompt and output but the last token, computed when it re-enters

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def set_state(self, new: RequestState) -> None:
        check_transition(COLOCATED_TRANSITIONS, self.request_id, self.state, new)
        self.state = new


@dataclass(slots=True)
class ColocatedScheduler:
    batch_size: int
    kv: KVCache
    _waiting: deque[ColocatedSeq] = field(default_factory=deque)
    _running: "OrderedDict[str, ColocatedSeq]" = field(default_factory=OrderedDict)
    _arrivals: int = 0
    preemptions: int = 0  # requests preempted, ever

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_preempted(self) -> int:
        """Preempted requests waiting to compute their KV again (counted as waiting too)."""
        n = 0
        for seq in self._waiting:  # (they come first)
            if seq.state is not S.PREEMPTED:
                break
            n += 1
        return n

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def get(self, request_id: str) -> ColocatedSeq | None:
        if request_id in self._running:
            return self._running[request_id]
        return next((s for s in self._waiting if s.request_id == request_id), None)

    def running(self) -> list[ColocatedSeq]:
        return list(self._running.values())

    def add(self, seq: ColocatedSeq) -> None:
        if self.get(seq.request_id) is not None:
            raise ValueError(f"duplicate request id {seq.request_id}")
        seq.order = self._arrivals
        self._arrivals += 1
        self._waiting.append(seq)

    def next_prefill(self) -> ColocatedSeq | None:
        """The oldest waiting request, given its KV blocks (for what it computes and its first decoded token), if
        the batch and the pool have room (prefill first). A preempted one comes back with ``recompute`` to
        compute, sampling nothing."""
        if not self._waiting or self.num_running >= self.batch_size:
            return None
        seq = self._waiting[0]
        n = len(seq.recompute) or seq.prompt_len
        kv = self.kv.admit(seq.hashes, n + 1, reuse_tokens=n - 1 if seq.reuse or seq.recompute else 0)
        if kv is None:
            return None
        self._waiting.popleft()
        seq.kv = kv
        seq.set_state(S.RUNNING)
        self._running[seq.request_id] = seq
        return seq

    def reserve_decode(self, length: Callable[[ColocatedSeq], int],
                       context: Callable[[ColocatedSeq], Sequence[int]]) -> Room[ColocatedSeq]:
        """Before a decode step: every running request (oldest first) gets the blocks of ``length(seq)`` tokens,
        its KV after the step; when the pool has none left, the newest running request is preempted
        (``xpyd.worker.preemption``). ``context(seq)``: its prompt and output but the last token, what it
        computes again when it re-enters. A request longer than the whole pool fails."""
        return make_room(self.kv, list(self._running.values()), length, lambda: self._running.values(),
                         lambda seq: self._preempt(seq, context), self.fail)

    def finish(self, seq: ColocatedSeq) -> None:
        self._end(seq, S.FINISHED)

    def fail(self, seq: ColocatedSeq, error: str) -> None:
        seq.error = error
        self._end(seq, S.FAILED)

    def abort(self, request_id: str) -> ColocatedSeq | None:
        seq = self.get(request_id)
        if seq is not None:
            self._end(seq, S.ABORTED)
        return seq

    def _preempt(self, seq: ColocatedSeq, context: Callable[[ColocatedSeq], Sequence[int]]) -> None:
        """Free ``seq``'s blocks (its full ones stay cached under the hashes its KV named) and queue it ahead of
        every request that never ran, oldest first, to compute its KV again."""
        seq.recompute = context(seq)
        require(len(seq.recompute) >= seq.prompt_len, "a preempted request's context is shorter than its prompt")
        kv = seq.kv
        seq.hashes = BlockChain(kv.hashes, kv.root) if kv.root is not None else list(kv.hashes)
        seq.set_state(S.PREEMPTED)
        del self._running[seq.request_id]
        self.kv.free(kv)
        seq.kv = None
        seq.preemptions += 1
        self.preemptions += 1
        at = next((i for i, s in enumerate(self._waiting) if s.state is not S.PREEMPTED or s.order > seq.order),
                  len(self._waiting))
        self._waiting.insert(at, seq)

    def _end(self, seq: ColocatedSeq, state: RequestState) -> None:
        if seq.state in (S.WAITING, S.PREEMPTED):
            self._waiting.remove(seq)
        seq.set_state(state)
        self._running.pop(seq.request_id, None)
        if seq.kv is not None:
            self.kv.free(seq.kv)
            seq.kv = None

    def check_invariants(self) -> None:
        require(self.num_running <= self.batch_size, "batch exceeded")
        for seq in self._running.values():
            require(seq.state is S.RUNNING and seq.kv is not None and
                    len(seq.kv.blocks) >= self.kv.blocks_for(seq.prompt_len), "bad running seq")
        preempted = [s for s in self._waiting if s.state is S.PREEMPTED]
        require(list(self._waiting)[: len(preempted)] == preempted, "a preempted request behind a new one")
        require([s.order for s in preempted] == sorted(s.order for s in preempted), "preempted not oldest first")
        for seq in self._waiting:
            require(seq.state in (S.WAITING, S.PREEMPTED) and seq.kv is None, "bad waiting seq")
            require((seq.state is S.PREEMPTED) == (seq.preemptions > 0 and len(seq.recompute) >= seq.prompt_len),
                    "a preempted request without its context")
