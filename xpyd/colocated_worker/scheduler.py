"""Colocated scheduler: the traditional setup DI is compared against.

One engine does both phases in the same continuous batch. As in classic
continuous batching, a new prefill is preferred whenever the batch has room:
while it runs (batch size 1), every running decode waits — the prefill stall
that disaggregation removes.

Queues: waiting --(room: batch and KV blocks)--> running (after its prefill) --> finished.
Invariant: RUNNING <= batch_size; every RUNNING request holds the blocks of its tokens so far and a
reservation for the rest (prompt + max_tokens, `KVCache.admit`); a waiting request holds none. Its
prompt's cached prefix is reused, not computed again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from xpyd.worker.request import RequestState, check_transition, require
from xpyd.worker.kv_cache import KVCache, RequestKV

S = RequestState
COLOCATED_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.RUNNING, S.FAILED, S.ABORTED}),
    S.RUNNING: frozenset({S.FINISHED, S.FAILED, S.ABORTED}),
}


@dataclass(eq=False, slots=True)
class ColocatedSeq:
    request_id: str
    prompt_ids: list[int]
    payload: Any = None
    state: RequestState = S.WAITING
    final_len: int = 0  # prompt + max_tokens: the most tokens it can reach (its KV reservation)
    hashes: list[int] = field(default_factory=list)  # chain hashes of the prompt's full blocks
    kv: RequestKV | None = None
    error: str | None = None
    reuse: bool = True  # may start after a cached prefix (not when every prompt token's logprob is wanted)

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

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

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
        self._waiting.append(seq)

    def next_prefill(self) -> ColocatedSeq | None:
        """The oldest waiting request, given its KV blocks, if the batch and the pool have room (prefill first)."""
        if not self._waiting or self.num_running >= self.batch_size:
            return None
        seq = self._waiting[0]
        kv = self.kv.admit(seq.hashes, seq.prompt_len, max(seq.final_len, seq.prompt_len),
                           reuse_tokens=seq.prompt_len - 1 if seq.reuse else 0)
        if kv is None:
            return None
        self._waiting.popleft()
        seq.kv = kv
        seq.set_state(S.RUNNING)
        self._running[seq.request_id] = seq
        return seq

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

    def _end(self, seq: ColocatedSeq, state: RequestState) -> None:
        if seq.state is S.WAITING:
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
        for seq in self._waiting:
            require(seq.state is S.WAITING and seq.kv is None, "bad waiting seq")
