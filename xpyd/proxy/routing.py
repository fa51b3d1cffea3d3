"""Choosing the worker pair for a request.

Round-robin per role over the registry's current list. The list may change
between calls (dynamic discovery); the counter simply wraps over whatever is
there. A least-loaded policy will replace this class behind the same ``pick``.
"""

from __future__ import annotations

from collections.abc import Sequence

from xpyd.discovery.types import Role, WorkerInfo


class NoWorkerError(LookupError):
    def __init__(self, role: Role) -> None:
        super().__init__(f"no {role.value} worker available")
        self.role = role


class Router:
    def __init__(self) -> None:
        self._next = {role: 0 for role in Role}

    def pick(self, role: Role, workers: Sequence[WorkerInfo]) -> WorkerInfo:
        if not workers:
            raise NoWorkerError(role)
        i = self._next[role] % len(workers)
        self._next[role] = i + 1
        return workers[i]
