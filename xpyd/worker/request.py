"""Request states shared by the schedulers, with an explicit transition table per role.

PREEMPTED (decode and colocated): a request that held blocks gave them all back because a running request needed
a block and none was free (``xpyd.worker.preemption``); it holds nothing, waits ahead of every request that never
ran, and re-enters by computing its KV again on this worker (its prompt, and the output generated so far: the
output's state stays in memory, so it continues exactly where it stopped).
"""

from __future__ import annotations

from enum import Enum


class RequestState(str, Enum):
    WAITING = "waiting"  # queued (decode: also waiting for prefill to be ready)
    RUNNING = "running"  # prefill forward (prefill) / in the decode batch (decode)
    TRANSFERRING = "transferring"  # KV held for / being sent to decode (prefill); being received (decode)
    PREFILLING = "prefilling"  # decode: its prompt computed on this worker, in chunks between decode steps
    PREEMPTED = "preempted"  # decode, colocated: its blocks given back; waits to compute its KV again here
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = frozenset({RequestState.FINISHED, RequestState.FAILED, RequestState.ABORTED})

S = RequestState
PREFILL_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.RUNNING, S.FAILED, S.ABORTED}),
    S.RUNNING: frozenset({S.TRANSFERRING, S.FINISHED, S.FAILED, S.ABORTED}),
    S.TRANSFERRING: frozenset({S.FINISHED, S.FAILED, S.ABORTED}),
}
DECODE_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.WAITING: frozenset({S.TRANSFERRING, S.PREFILLING, S.FINISHED, S.FAILED, S.ABORTED}),
    S.TRANSFERRING: frozenset({S.RUNNING, S.FINISHED, S.FAILED, S.ABORTED}),  # (finished: by its first token)
    # (a local prefill or a recompute: ``DecodeScheduler``)
    S.PREFILLING: frozenset({S.RUNNING, S.PREEMPTED, S.FINISHED, S.FAILED, S.ABORTED}),
    S.RUNNING: frozenset({S.PREEMPTED, S.FINISHED, S.FAILED, S.ABORTED}),
    S.PREEMPTED: frozenset({S.PREFILLING, S.FAILED, S.ABORTED}),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(table: dict[RequestState, frozenset[RequestState]], request_id: str,
                     old: RequestState, new: RequestState) -> None:
    if new not in table.get(old, frozenset()):
        raise IllegalTransition(f"request {request_id}: {old.value} -> {new.value} is not allowed")


class InvariantError(RuntimeError):
    pass


def require(cond: bool, message: str) -> None:
    if not cond:
        raise InvariantError(message)
