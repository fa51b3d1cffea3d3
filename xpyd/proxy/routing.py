"""Choosing the worker pair for a request.

A ``Router`` picks one worker of a role from the registry's current list (read
on every request, so workers that joined are used at once and workers that
left are never chosen) and hears when a request on a worker starts and ends::

    pick(role, workers, keys, avoid)  -> skips DOWN workers (and those ``avoid`` names while others are
                                         UP); NoWorkerError if none is UP
    started(worker, keys)      -> counts towards its load until the next stats report
    finished(worker)

``keys`` (``PromptKeys``: the prompt's length and block hashes) is None when the
proxy could not tokenize the request, or did not need to (other policies).

Policies:
- ``cache_aware`` (default): the worker where the request costs least, in KV blocks
  (``block_size`` tokens)::

      prefill: blocks to compute (the prompt's, less the prefix it caches)
               + its queue (reported ``queued_tokens`` / block_size + blocks sent since)
      decode:  blocks to receive (likewise) + what it holds (reported ``blocks_used`` + the blocks of the
               requests sent since: all of each one's prompt, received or cached, since it holds them all)

  A request counts as cached on its workers at once (``PrefixIndex.expect``) and
  the blocks it lacked as their backlog until the next report: a conversation's
  next turn goes where its history is, while a burst sharing a prefix spreads (a
  worker still computing the prefix for the first request is no cheaper than one
  without it) and then every worker holds the prefix. A request that ended no
  longer weighs on its worker, whether or not the last report saw it: a
  conversation's next turn, sent right after the answer, finds its worker as
  free as it is. Load wins over cache: a worker whose load (requests, as
  least_loaded counts them, and never fewer than this proxy's own unfinished
  ones there, which a report can miss while they are on their way) exceeds the
  least loaded one's by more than its capacity (a batch) is not a candidate.
  Equal costs, and requests without keys, go as least_loaded.
- ``least_loaded``: the lowest (waiting + running + transferring +
  assigned-since-report) / capacity; the assigned count spreads a burst before
  the next stats poll. Ties go round-robin, in a freshly shuffled order each
  round: equal workers share evenly, and since each role shuffles on its own,
  prefill/decode pairs mix (with one fixed order, p0 would always meet d0).
- ``round_robin``: in turn over the UP workers, in list order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Protocol

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.prefix_index import PrefixIndex, PromptKeys
from xpyd.proxy.workers import Health, WorkerState, WorkerTable


class Policy(str, Enum):
    CACHE_AWARE = "cache_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class NoWorkerError(LookupError):
    def __init__(self, role: Role, down: int = 0) -> None:
        message = f"no {role.value} worker available"
        if down:
            message += ": the only one is down" if down == 1 else f": all {down} are down"
        super().__init__(message)
        self.role = role


class Router(Protocol):
    policy: Policy

    def pick(self, role: Role, workers: Sequence[WorkerInfo], keys: PromptKeys | None = None,
             avoid: Avoid | None = None) -> WorkerInfo:
        """One UP worker of ``workers`` (the registry's current list for ``role``) for a request; not one that
        ``avoid`` is true of unless every UP one is."""

    def started(self, worker: WorkerInfo, keys: PromptKeys | None = None) -> int:
        """A request was sent to ``worker``; returns its ticket for ``finished``."""

    def finished(self, worker: WorkerInfo, ticket: int = 0) -> None:
        """The request of ``ticket`` on ``worker`` ended (in any way)."""


Avoid = Callable[[WorkerInfo], bool]  # true of a worker to choose only when no other is UP


def _up(table: WorkerTable, role: Role, workers: Sequence[WorkerInfo], avoid: Avoid | None) -> list[WorkerState]:
    states = table.sync(role, workers)
    up = [s for s in states if s.health is Health.UP]
    if not up:
        raise NoWorkerError(role, down=len(states))
    if avoid is not None:
        return [s for s in up if not avoid(s.info)] or up
    return up


class RoundRobinRouter:
    policy = Policy.ROUND_ROBIN

    def __init__(self, table: WorkerTable) -> None:
        self._table = table
        self._next = {role: 0 for role in Role}

    def pick(self, role: Role, workers: Sequence[WorkerInfo], keys: PromptKeys | None = None,
             avoid: Avoid | None = None) -> WorkerInfo:
        up = _up(self._table, role, workers, avoid)
        i = self._next[role] % len(up)
        self._next[role] = i + 1
        return up[i].info

    def started(self, worker: WorkerInfo, keys: PromptKeys | None = None) -> int:
        return self._table.started(worker)

    def finished(self, worker: WorkerInfo, ticket: int = 0) -> None:
        self._table.finished(worker, ticket)


class _Turns:
    """Ties between equally good workers, per role: in turn, in a freshly shuffled order each round."""

    def __init__(self, rng: random.Random | None) -> None:
        self._rng = rng or random.Random()
        self._turns: dict[Role, list[str]] = {role: [] for role in Role}  # URLs yet to have their turn

    def least_loaded(self, role: Role, up: Sequence[WorkerState], among: Sequence[WorkerState]) -> WorkerInfo:
        """The lowest-scored of ``among`` (some of ``up``, the UP workers), ties in turn."""
        low = min(s.score for s in among)
        tied = {s.info.http_url: s for s in among if s.score == low}
        turns = self._turns[role]
        if not any(url in tied for url in turns):  # a new round
            turns[:] = [s.info.http_url for s in up]
            self._rng.shuffle(turns)
        url = next(url for url in turns if url in tied)
        turns.remove(url)
        return tied[url].info


class LeastLoadedRouter:
    policy = Policy.LEAST_LOADED

    def __init__(self, table: WorkerTable, rng: random.Random | None = None) -> None:
        self._table = table
        self._turns = _Turns(rng)

    def pick(self, role: Role, workers: Sequence[WorkerInfo], keys: PromptKeys | None = None,
             avoid: Avoid | None = None) -> WorkerInfo:
        up = _up(self._table, role, workers, avoid)
        return self._turns.least_loaded(role, up, up)

    def started(self, worker: WorkerInfo, keys: PromptKeys | None = None) -> int:
        return self._table.started(worker)

    def finished(self, worker: WorkerInfo, ticket: int = 0) -> None:
        self._table.finished(worker, ticket)


class CacheAwareRouter:
    policy = Policy.CACHE_AWARE

    def __init__(self, table: WorkerTable, index: PrefixIndex, rng: random.Random | None = None) -> None:
        self._table = table
        self._index = index
        self._turns = _Turns(rng)

    def pick(self, role: Role, workers: Sequence[WorkerInfo], keys: PromptKeys | None = None,
             avoid: Avoid | None = None) -> WorkerInfo:
        up = _up(self._table, role, workers, avoid)
        if keys is None:
            return self._turns.least_loaded(role, up, up)
        loads = [max(s.load, s.in_flight) for s in up]
        least = min(loads)
        candidates = [s for s, n in zip(up, loads) if n - least <= max(s.info.capacity, 1)]  # never a hot spot
        matched = self._index.match_all(keys.hashes, [s.info for s in candidates])  # one walk for all
        costs = [keys.num_blocks - m + self._backlog(s, keys.block_size) for s, m in zip(candidates, matched)]
        low = min(costs)
        return self._turns.least_loaded(role, up, [s for s, c in zip(candidates, costs) if c == low])

    def cost(self, state: WorkerState, keys: PromptKeys) -> float:
        """The request's cost on ``state``'s worker, in blocks: the blocks it lacks + its backlog (what
        ``pick`` weighs for each candidate)."""
        return self._missing(state.info, keys) + self._backlog(state, keys.block_size)

    def started(self, worker: WorkerInfo, keys: PromptKeys | None = None) -> int:
        if keys is None:
            return self._table.started(worker)
        # Prefill's queue grows by the blocks it computes; decode's memory (what ``blocks_used`` reports) by
        # every block of the prompt: those it receives and the cached ones it holds again. Until the next
        # report, or until the request ends, they count as its backlog; once it ends, they are released
        # from the report's numbers too (a report that saw it counted all of them).
        work = self._missing(worker, keys) if worker.role is Role.PREFILL else keys.num_blocks
        ticket = self._table.started(worker, work)
        self._index.expect(worker, keys.hashes)
        return ticket

    def finished(self, worker: WorkerInfo, ticket: int = 0) -> None:
        self._table.finished(worker, ticket)

    def _missing(self, worker: WorkerInfo, keys: PromptKeys) -> int:
        return keys.num_blocks - self._index.match(worker, keys.hashes)

    @staticmethod
    def _backlog(state: WorkerState, block_size: int) -> float:
        """Prefill: blocks queued to compute; decode: blocks held. As reported (unknown: 0), less what ended
        since, + sent since."""
        stats = state.stats
        if stats is None:
            reported = 0.0
        elif state.info.role is Role.PREFILL:
            reported = (stats.queued_tokens or 0) / block_size
        else:
            reported = float(stats.blocks_used or 0)
        # (a request the report saw that has ended since no longer weighs on it)
        return max(0.0, reported - state.released_blocks) + state.assigned_blocks


def make_router(policy: Policy, table: WorkerTable, index: PrefixIndex | None = None) -> Router:
    """``index`` (fed by the caller) is required for ``cache_aware``."""
    if policy is Policy.ROUND_ROBIN:
        return RoundRobinRouter(table)
    if policy is Policy.CACHE_AWARE:
        if index is None:
            raise ValueError("the cache_aware policy needs a prefix index")
        return CacheAwareRouter(table, index)
    return LeastLoadedRouter(table)
