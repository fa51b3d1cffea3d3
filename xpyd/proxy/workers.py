"""What the proxy knows about each worker: health, reported load, and its own counts.

The registry says which workers exist; this table adds what the proxy has
learned about them::

    registry list --sync()--> WorkerState (UP on first sight)
    request fails (refused, timeout, 5xx) --mark_down()--> DOWN (never chosen)
    poller sees GET /health == 200 --mark_up()--> UP
    poller reads GET /xpyd/stats --report()--> load = reported + assigned since
                                               (in requests, and in KV blocks for the cache-aware router)

A worker that leaves the registry is forgotten with everything known about it;
calls about a forgotten worker (a request that finishes after it left) are
ignored. Everything runs on the proxy's event loop: no locks.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from xpyd.discovery.types import Role, WorkerInfo

log = logging.getLogger(__name__)


class Health(str, Enum):
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class Stats:
    """A worker's own count of its requests and KV blocks (``GET /xpyd/stats``).

    The block and prefix-cache counts are None when the worker does not report them (older workers).
    """

    waiting: int
    running: int
    transferring: int
    queued_tokens: int | None = None  # prefill: prompt tokens waiting or running, not computed yet
    blocks_total: int | None = None
    blocks_used: int | None = None  # held by requests
    blocks_cached: int | None = None  # held by no request, kept for their prefix
    prefix_query_tokens: int | None = None  # prompt tokens looked up in its prefix cache, ever
    prefix_hit_tokens: int | None = None  # ... and found there
    max_model_len: int | None = None  # the longest request (prompt + output) it takes
    preemptions: int | None = None  # decode, colocated: requests that gave their KV blocks back, ever

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not (_is_count(value) or (value is None and name not in _REQUIRED)):
                raise ValueError(f"stats: {name} must be a non-negative integer, got {value!r}")

    @classmethod
    def from_dict(cls, d: object) -> "Stats":
        """The request counts are required; a block or cache count that is missing or not a count is unknown."""
        if not isinstance(d, dict):
            raise ValueError(f"stats must be a JSON object, got {type(d).__name__}")
        try:
            required = [d[name] for name in _REQUIRED]
        except KeyError as e:
            raise ValueError(f"stats: missing {e}") from None
        return cls(*required, **{name: d[name] for name in _OPTIONAL if _is_count(d.get(name))})

    @property
    def total(self) -> int:
        return self.waiting + self.running + self.transferring

    @property
    def hit_rate(self) -> float | None:
        """Share of the prompt tokens looked up in its prefix cache that were found; None before any."""
        if not self.prefix_query_tokens or self.prefix_hit_tokens is None:
            return None
        return self.prefix_hit_tokens / self.prefix_query_tokens


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_REQUIRED = ("waiting", "running", "transferring")
_OPTIONAL = tuple(name for name in Stats.__slots__ if name not in _REQUIRED)


class ReportMark(NamedTuple):
    """What the proxy had sent a worker when it asked for stats (see ``WorkerTable.report_mark``)."""

    requests: int
    blocks: int


def _key(worker: WorkerInfo) -> tuple[Role, str]:
    return worker.role, worker.http_url


@dataclass(slots=True)
class WorkerState:
    info: WorkerInfo
    health: Health = Health.UP
    stats: Stats | None = None  # the last report; None: none yet (or the worker has no stats)
    requests: int = 0  # routed to this worker by this proxy, ever
    in_flight: int = 0  # routed and not finished yet
    reported_requests: int = 0  # ``requests`` when the last report was asked for
    blocks: int = 0  # KV blocks routed here that it lacked, ever (prefill computes them, decode receives them)
    # Requests routed since the last report was asked for and not finished: their number (``requests`` when
    # sent) -> the blocks of work they bring. A finished request is done work, not backlog.
    pending_blocks: dict[int, int] = field(default_factory=dict)
    covered_blocks: dict[int, int] = field(default_factory=dict)  # the same for unfinished ones the report saw
    released_blocks: int = 0  # blocks of requests the last report saw that have finished since
    down_reason: str = ""
    since: float = field(default_factory=time.monotonic)  # of the current health
    heard_at: float = 0.0  # when this proxy last got bytes from it outside probes (a stream, a KV event line)
    # decode: the requests routed here by where their prompt was computed ("remote": a prefill worker; "local":
    # this one, ``xpyd.proxy.prefill_path``)
    prefill_paths: dict[str, int] = field(default_factory=lambda: {"remote": 0, "local": 0})

    @property
    def assigned(self) -> int:
        """Requests the last report cannot include: sent since it was asked for.

        Without any report, the proxy's own count of unfinished requests stands in.
        """
        if self.stats is None:
            return self.in_flight
        return self.requests - self.reported_requests

    @property
    def load(self) -> int:
        """Requests on the worker: waiting + running + transferring as reported, + assigned since."""
        return (self.stats.total if self.stats is not None else 0) + self.assigned

    @property
    def score(self) -> float:
        """Load relative to capacity."""
        return self.load / max(self.info.capacity, 1)

    @property
    def assigned_blocks(self) -> int:
        """KV blocks of work sent since the last report was asked for and not finished yet."""
        return sum(self.pending_blocks.values())

    def to_dict(self) -> dict:
        stats = self.stats
        hit_rate = stats.hit_rate if stats else None
        return {
            "role": self.info.role.value,
            "http_url": self.info.http_url,
            "signal_addr": self.info.signal_addr,
            "model_id": self.info.model_id,
            "capacity": self.info.capacity,
            "health": self.health.value,
            "load": {
                "waiting": stats.waiting if stats else None,
                "running": stats.running if stats else None,
                "transferring": stats.transferring if stats else None,
                "assigned": self.assigned,
                "score": round(self.score, 4),
                "queued_tokens": stats.queued_tokens if stats else None,
                "assigned_blocks": self.assigned_blocks,
            },
            "cache": {
                "blocks_total": stats.blocks_total if stats else None,
                "blocks_used": stats.blocks_used if stats else None,
                "blocks_cached": stats.blocks_cached if stats else None,
                "hit_rate": round(hit_rate, 4) if hit_rate is not None else None,
            },
            "preemptions": stats.preemptions if stats else None,
            "requests": self.requests,
            "prefill_paths": dict(self.prefill_paths) if self.info.role is Role.DECODE else None,
        }


class WorkerTable:
    def __init__(self) -> None:
        self._states: dict[tuple[Role, str], WorkerState] = {}
        self._synced: dict[Role, tuple[list[WorkerInfo], list[WorkerState]]] = {}  # role -> its last sync
        self._down_listeners: list[Callable[[WorkerInfo, str, bool], None]] = []

    def on_down(self, listener: Callable[[WorkerInfo, str, bool], None]) -> None:
        """Call ``listener(worker, reason, unreachable)`` whenever a worker goes from UP to DOWN."""
        self._down_listeners.append(listener)

    def sync(self, role: Role, workers: Sequence[WorkerInfo]) -> list[WorkerState]:
        """Adopt the registry's current list for ``role``; return its states in list order.

        New workers start UP; workers no longer listed are forgotten; a worker
        whose registration changed (e.g. restarted with a new capacity) keeps its
        health and counts under the new info.
        """
        last = self._synced.get(role)  # (the same registry list as last time, object for object: nothing changed)
        if last is not None and len(last[0]) == len(workers) and all(map(operator.is_, workers, last[0])):
            return list(last[1])
        listed = {_key(w): w for w in workers if w.role is role}
        for key in [k for k in self._states if k[0] is role and k not in listed]:
            del self._states[key]
        states = []
        for key, info in listed.items():
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = WorkerState(info)
            elif state.info != info:
                state.info = info
            states.append(state)
        self._synced[role] = (list(workers), list(states))
        return states

    def get(self, worker: WorkerInfo) -> WorkerState | None:
        return self._states.get(_key(worker))

    def started(self, worker: WorkerInfo, blocks: int = 0) -> int:
        """A request was sent to ``worker``; ``blocks``: the KV blocks of work it brings (if known). Returns
        its ticket for ``finished``."""
        state = self.get(worker)
        if state is None:
            return 0
        state.requests += 1
        state.in_flight += 1
        state.blocks += blocks
        if blocks:
            state.pending_blocks[state.requests] = blocks
        return state.requests

    def finished(self, worker: WorkerInfo, ticket: int = 0) -> None:
        state = self.get(worker)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1
            if state.pending_blocks.pop(ticket, None) is None:
                state.released_blocks += state.covered_blocks.pop(ticket, 0)  # the report's numbers include it

    def prefill_path(self, decode: WorkerInfo, path: str) -> None:
        """A request routed to ``decode`` has its prompt computed on ``path`` (remote or local)."""
        state = self._states.get(_key(decode))
        if state is not None:
            state.prefill_paths[path] = state.prefill_paths.get(path, 0) + 1

    def heard(self, worker: WorkerInfo) -> None:
        """Bytes came from ``worker`` (a token stream, its KV events): it is alive, however slow its probes."""
        state = self._states.get(_key(worker))
        if state is not None:
            state.heard_at = time.monotonic()

    def mark_down(self, worker: WorkerInfo, reason: str, unreachable: bool = False) -> bool:
        """Stop choosing ``worker`` until it is seen healthy; True if it was UP.

        ``unreachable``: its connection was refused or broke (the process is likely gone),
        as opposed to an error answer or a timeout from a worker that is still there.
        """
        state = self.get(worker)
        if state is None:
            return False
        state.down_reason = reason
        if state.health is Health.DOWN:
            return False
        state.health, state.since, state.stats = Health.DOWN, time.monotonic(), None
        log.warning("%s worker %s is down: %s", worker.role.value, worker.http_url, reason)
        for listener in self._down_listeners:
            try:
                listener(state.info, reason, unreachable)
            except Exception:
                log.exception("a worker-down listener failed")
        return True

    def mark_up(self, worker: WorkerInfo) -> bool:
        """``worker`` answered its health check; True if it was DOWN."""
        state = self.get(worker)
        if state is None or state.health is Health.UP:
            return False
        state.health, state.since, state.down_reason = Health.UP, time.monotonic(), ""
        log.info("%s worker %s is up", worker.role.value, worker.http_url)
        return True

    def report_mark(self, worker: WorkerInfo) -> ReportMark:
        """Call when asking for stats; pass the result to ``report`` with the answer."""
        state = self.get(worker)
        return ReportMark(state.requests, state.blocks) if state is not None else ReportMark(0, 0)

    def report(self, worker: WorkerInfo, stats: Stats | None, mark: ReportMark) -> None:
        """The worker's stats as of when ``mark`` was taken (None: it reports none)."""
        state = self.get(worker)
        if state is None or state.health is Health.DOWN:
            return  # a report from before the mark-down must not revive old numbers
        state.stats, state.reported_requests = stats, mark.requests
        state.covered_blocks.update((t, b) for t, b in state.pending_blocks.items() if t <= mark.requests)
        state.pending_blocks = {t: b for t, b in state.pending_blocks.items() if t > mark.requests}
        state.released_blocks = 0
