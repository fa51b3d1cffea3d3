"""Choosing the worker pair for a request.

A ``Router`` picks one worker of a role from the registry's current list (read
on every request, so workers that joined are used at once and workers that
left are never chosen) and hears when a request on a worker starts and ends::

    pick(role, workers)  -> skips DOWN workers; NoWorkerError if none is UP
    started(worker)      -> counts towards its load until the next stats report
    finished(worker)

Policies:
- ``least_loaded`` (default): the lowest (waiting + running + transferring +
  assigned-since-report) / capacity; the assigned count spreads a burst before
  the next stats poll. Ties go round-robin, in a freshly shuffled order each
  round: equal workers share evenly, and since each role shuffles on its own,
  prefill/decode pairs mix (with one fixed order, p0 would always meet d0).
- ``round_robin``: in turn over the UP workers, in list order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from enum import Enum
from typing import Protocol

from xpyd.discovery.types import Role, WorkerInfo
from xpyd.proxy.workers import Health, WorkerState, WorkerTable


class Policy(str, Enum):
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

    def pick(self, role: Role, workers: Sequence[WorkerInfo]) -> WorkerInfo:
        """One UP worker of ``workers`` (the registry's current list for ``role``)."""

    def started(self, worker: WorkerInfo) -> None:
        """A request was sent to ``worker``."""

    def finished(self, worker: WorkerInfo) -> None:
        """A request on ``worker`` ended (in any way)."""


def _up(table: WorkerTable, role: Role, workers: Sequence[WorkerInfo]) -> list[WorkerState]:
    states = table.sync(role, workers)
    up = [s for s in states if s.health is Health.UP]
    if not up:
        raise NoWorkerError(role, down=len(states))
    return up


class RoundRobinRouter:
    policy = Policy.ROUND_ROBIN

    def __init__(self, table: WorkerTable) -> None:
        self._table = table
        self._next = {role: 0 for role in Role}

    def pick(self, role: Role, workers: Sequence[WorkerInfo]) -> WorkerInfo:
        up = _up(self._table, role, workers)
        i = self._next[role] % len(up)
        self._next[role] = i + 1
        return up[i].info

    def started(self, worker: WorkerInfo) -> None:
        self._table.started(worker)

    def finished(self, worker: WorkerInfo) -> None:
        self._table.finished(worker)


class LeastLoadedRouter:
    policy = Policy.LEAST_LOADED

    def __init__(self, table: WorkerTable, rng: random.Random | None = None) -> None:
        self._table = table
        self._rng = rng or random.Random()
        # Per role: the URLs yet to have their turn at a tie this round, in turn order.
        self._turns: dict[Role, list[str]] = {role: [] for role in Role}

    def pick(self, role: Role, workers: Sequence[WorkerInfo]) -> WorkerInfo:
        up = _up(self._table, role, workers)
        low = min(s.score for s in up)
        tied = {s.info.http_url: s for s in up if s.score == low}
        turns = self._turns[role]
        if not any(url in tied for url in turns):  # a new round
            turns[:] = [s.info.http_url for s in up]
            self._rng.shuffle(turns)
        url = next(url for url in turns if url in tied)
        turns.remove(url)
        return tied[url].info

    def started(self, worker: WorkerInfo) -> None:
        self._table.started(worker)

    def finished(self, worker: WorkerInfo) -> None:
        self._table.finished(worker)


def make_router(policy: Policy, table: WorkerTable) -> Router:
    if policy is Policy.ROUND_ROBIN:
        return RoundRobinRouter(table)
    return LeastLoadedRouter(table)
