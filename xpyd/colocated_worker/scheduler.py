"""Colocated scheduler: the traditional setup DI is compared against.

One engine does both phases in the same continuous batch. As in classic
continuous batching, a new prefill is preferred whenever the batch has room:
while it runs (batch size 1), every running decode waits — the prefill stall
that disaggregation removes.

Queues: waiting --(room)--> running (after its prefill) --> finished.
Invariant: RUNNING <= batch_size; every RUNNING request owns one slot.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from xpyd.worker.request import RequestState, check_transition, require
from xpyd.worker.slots import SlotAllocator

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
    slot: int | None = None
    error: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def set_state(self, new: RequestState) -> None:
        check_transition(COLOCATED_TRANSITIONS, self.request_id, self.state, new)
        self.state = new


@dataclass(slots=True)
class ColocatedScheduler:
    batch_size: int
    slots: SlotAllocator
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
        """The oldest waiting request, given a slot, if the batch has room (prefill first)."""
        if not self._waiting or self.num_running >= self.batch_size or not self.slots.can_allocate():
            return None
        seq = self._waiting.popleft()
        seq.slot = self.slots.allocate()
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
            if seq.state is S.WAITING:
                self._waiting.remove(seq)
            self._end(seq, S.ABORTED)
        return seq

    def _end(self, seq: ColocatedSeq, state: RequestState) -> None:
        seq.set_state(state)
        self._running.pop(seq.request_id, None)
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None

    def check_invariants(self) -> None:
        require(self.num_running <= self.batch_size, "batch exceeded")
        for seq in self._running.values():
            require(seq.state is S.RUNNING and seq.slot is not None, "bad running seq")
        for seq in self._waiting:
            require(seq.state is S.WAITING and seq.slot is None, "bad waiting seq")
