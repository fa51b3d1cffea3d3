"""Room for a decode step, made by preemption when the KV pool runs out (vLLM's recompute policy), for the
decode and colocated schedulers.

Requests are admitted with the blocks of their tokens so far, not of the output they may still generate
(``KVCache``), so the blocks of a decode step are taken just before it (``make_room``): each running request,
oldest first, gets the blocks of the tokens its KV holds after the step. When none is free, the newest request
that holds blocks it can give back (the scheduler's ``holders``: running requests, and on decode those
computing their prompt here) is preempted: the scheduler frees its blocks (its full ones stay in the prefix
cache, so it re-enters cheaply while nobody evicts them) and queues it ahead of every request that never ran,
to compute its KV again on this worker. Newest means latest to arrive: the oldest requests keep running, and a
request is never preempted for a younger one. If the newest is the request that needs the block, it is the one
preempted; it runs again once blocks are free (others holding blocks it cannot take, such as KV being received,
give them back by running to their end). A request whose tokens outgrow the whole pool could never run, even
alone: it fails (``outgrown``) rather than being preempted over and over.

Nothing else preempts: a request that waits for blocks (new, or preempted) waits for them to be freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Iterable, Protocol, Sequence, TypeVar

from xpyd.worker.kv_cache import KVCache, RequestKV


class Holder(Protocol):
    """A scheduler's request as ``make_room`` sees it."""

    request_id: str
    order: int  # arrival order: larger is newer
    kv: RequestKV | None  # None once preempted


T = TypeVar("T", bound=Holder)


@dataclass(slots=True)
class Room(Generic[T]):
    """What ``make_room`` did: the requests it preempted and those it failed (``outgrown``), in that order."""

    preempted: list[T] = field(default_factory=list)
    failed: list[T] = field(default_factory=list)


def outgrown(num_tokens: int, kv: KVCache) -> str:
    """Why a request of ``num_tokens`` tokens cannot run on this worker."""
    total = kv.allocator.num_blocks * kv.block_size
    return (f"the request needs the KV of {num_tokens} tokens, more than this worker's whole KV cache holds "
            f"({total} tokens)")


def make_room(kv: KVCache, running: Sequence[T], length: Callable[[T], int], holders: Callable[[], Iterable[T]],
              preempt: Callable[[T], None], fail: Callable[[T, str], None]) -> Room[T]:
    """Give each of ``running`` (oldest first) the blocks of ``length(seq)`` tokens. When none is free, the
    newest of ``holders()`` (which ``running`` are among, and which no longer lists a request once the
    scheduler's ``preempt`` took it back) is preempted, until the request fits or is itself the one preempted.
    A request longer than the whole pool is failed (``fail(seq, why)``)."""
    room: Room[T] = Room()
    for seq in sorted(running, key=_order):
        if seq.kv is None:  # preempted by an older request of this pass
            continue
        need = length(seq)
        if not kv.fits(need):
            fail(seq, outgrown(need, kv))
            room.failed.append(seq)
            continue
        while not kv.can_grow(seq.kv, need):
            victim = max(holders(), key=_order)  # (``seq`` is one: never empty)
            preempt(victim)
            room.preempted.append(victim)
            if victim is seq:
                break
        else:
            kv.grow(seq.kv, need)
    return room


def _order(seq: Holder) -> int:
    return seq.order
