"""How the proxy learns which workers exist.

A registry is started once, answers ``workers(role)`` from memory (never blocks,
never does I/O on the request path), and is closed at shutdown. Implementations:
``static.StaticRegistry`` (addresses on the command line) and, later, an etcd
registry that lists and watches ``/workers/{role}/...``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from xpyd.discovery.types import Role, WorkerInfo


class RegistryError(RuntimeError):
    """The registry could not be started (unreachable or inconsistent workers)."""


@runtime_checkable
class Registry(Protocol):
    async def start(self) -> None:
        """Find the initial set of workers; raise RegistryError if that is impossible."""

    def workers(self, role: Role) -> list[WorkerInfo]:
        """The workers currently known for ``role`` (a snapshot; may be empty)."""

    async def close(self) -> None:
        """Stop background work and release resources."""
