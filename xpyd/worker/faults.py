"""Containing a failure to the request whose work raised it, and the test-only fault injection.

Each piece of one request's work in a step (adding it, handling a signal-plane entry about it, starting
its transfer, handling its output) runs in a ``RequestScope``: an exception there fails just that
request, through its engine's normal fail path, and the step goes on. An exception outside every scope
escapes the step and is fatal (see ``loop.EngineThread``).

``XPYD_TEST_FAULT`` (tests only, read once when an engine starts) injects such exceptions:
``add:MARKER`` raises in the scope of adding a request that has MARKER among its ``stop`` strings (what
both roles see without tokenizing); ``step:MARKER`` raises once out of the step that added such a request.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Callable

from xpyd.worker.work_item import WorkItem

FAULT_ENV = "XPYD_TEST_FAULT"

# (request id, its work item if the scope knows it, the exception): fails the request, or raises if it cannot
RequestFailed = Callable[[str, "WorkItem | None", Exception], None]


class RequestScope:
    """``with``: an ``Exception`` raised inside fails the request instead of propagating."""

    __slots__ = ("_failed", "_request_id", "_item")

    def __init__(self, failed: RequestFailed, request_id: str, item: WorkItem | None) -> None:
        self._failed = failed
        self._request_id = request_id
        self._item = item

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        self._failed(self._request_id, self._item, exc)  # (if this raises, that escapes the step: fatal)
        return True


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection."""


class FaultSite(str, Enum):
    ADD = "add"  # in the scope of adding the request: fails that request
    STEP = "step"  # out of the step that added it: fails the engine


class FaultInjection:
    """Where to raise, and for requests with which marker among their stop strings."""

    def __init__(self, site: FaultSite, marker: str) -> None:
        self.site = site
        self.marker = marker
        self._fired = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FaultInjection | None:
        value = environ.get(FAULT_ENV)
        if not value:
            return None
        site, _, marker = value.partition(":")
        if site not in {s.value for s in FaultSite} or not marker:
            raise ValueError(f"{FAULT_ENV} must be add:MARKER or step:MARKER, not {value!r}")
        return cls(FaultSite(site), marker)

    def site_for(self, item: WorkItem) -> FaultSite | None:
        """Where to raise for this request being added (a step fault fires once)."""
        if self._fired or self.marker not in item.stop.stop:
            return None
        self._fired = self.site is FaultSite.STEP
        return self.site

    def error(self) -> InjectedFault:
        return InjectedFault(f"injected by {FAULT_ENV}={self.site.value}:{self.marker}")
