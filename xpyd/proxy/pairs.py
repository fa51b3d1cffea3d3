"""Which prefill/decode pairs to avoid: ``PairHealth``.

Both workers of a pair can be healthy while the path between them is not (a cut or lossy link between
two hosts, a firewall, a KV transfer that stalls): each answers the proxy, yet every request routed to
the two of them fails once decode tries to reach prefill. A decode worker says so in the error it sends
(``kv_path`` in its in-stream error event); the pair then cools down: the router chooses other pairs while
there are any (``Router.pick``'s ``avoid``). The cool-down starts at ``base`` seconds and doubles with each failure that follows one
(up to ``cap``); when it has passed, one request tries the pair again (``started``; others still avoid it
while that one runs, since a broken path takes seconds to show): if it completes the pair is healthy
(``ended``), if it fails the next cool-down is twice as long, if it ends otherwise (the client left,
the answer ended on prefill) the next request tries (``ended``). With no other pair left, the router uses a cooling one anyway: a request that
may fail beats a 503 that surely does.

Only a request that started after the pair's last failure says anything about the path now: ``started``
hands each request a ticket (a count of the requests started), and a completed request whose ticket is not
newer than the failure clears nothing. A stream whose KV crossed before the path broke completes normally
after it broke; before tickets, that completion ended the cool-down and routed new requests onto the broken
path again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from xpyd.discovery.types import WorkerInfo

BASE_COOLDOWN = 5.0  # seconds a pair is avoided after its first failure
MAX_COOLDOWN = 60.0  # at most this long, however often it failed


@dataclass(slots=True)
class _Cooling:
    until: float
    cooldown: float
    reason: str
    failures: int
    since: int  # the last ticket handed out when it failed: only a later one may clear the pair
    trial: int | None = None  # the ticket of the request trying the pair once the cool-down passed


def _key(prefill: WorkerInfo, decode: WorkerInfo) -> tuple[str, str]:
    return prefill.http_url, decode.http_url


class PairHealth:
    def __init__(self, base: float = BASE_COOLDOWN, cap: float = MAX_COOLDOWN,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"pair cool-down must satisfy 0 < base ({base}) <= cap ({cap})")
        self._base, self._cap, self._clock = base, cap, clock
        self._pairs: dict[tuple[str, str], _Cooling] = {}
        self._tickets = 0  # requests started on any pair so far (the last ticket handed out)

    def failed(self, prefill: WorkerInfo, decode: WorkerInfo, reason: str) -> float:
        """The path between the two failed a request: avoid the pair; returns the cool-down in seconds.

        Requests started before now (their tickets) can no longer clear the pair by completing."""
        key, now = _key(prefill, decode), self._clock()
        old = self._pairs.get(key)
        if old is not None and now < old.until:
            old.reason = reason  # (requests that were in flight when it broke: the same failure)
            old.since = self._tickets
            return old.cooldown
        cooldown = self._base if old is None else min(self._cap, old.cooldown * 2)
        self._pairs[key] = _Cooling(now + cooldown, cooldown, reason, 1 if old is None else old.failures + 1,
                                    since=self._tickets)
        return cooldown

    def started(self, prefill: WorkerInfo, decode: WorkerInfo) -> int:
        """A request was routed to the pair: its ticket (for ``ended``); if the pair's cool-down has passed and
        no request is trying it, this one is the trial."""
        self._tickets += 1
        cooling = self._pairs.get(_key(prefill, decode))
        if cooling is not None and cooling.trial is None and self._clock() >= cooling.until:
            cooling.trial = self._tickets
        return self._tickets

    def ended(self, prefill: WorkerInfo, decode: WorkerInfo, ticket: int, completed: bool) -> None:
        """The request with ``ticket`` on the pair ended. ``completed`` (decode's part ended normally) makes
        the pair healthy if the request started after the pair's last failure; a trial that ended otherwise
        (unless it failed on the path: ``failed`` said so first) lets the next request try."""
        key = _key(prefill, decode)
        cooling = self._pairs.get(key)
        if cooling is None:
            return
        if completed and ticket > cooling.since:
            del self._pairs[key]
        elif cooling.trial == ticket:
            cooling.trial = None

    def usable(self, prefill: WorkerInfo, decode: WorkerInfo) -> bool:
        cooling = self._pairs.get(_key(prefill, decode))
        return cooling is None or (self._clock() >= cooling.until and cooling.trial is None)

    def stranded(self, prefill: WorkerInfo, decodes: Iterable[WorkerInfo]) -> bool:
        """Is every pair of ``prefill`` with ``decodes`` being avoided (and there are some)?"""
        decodes = list(decodes)
        return bool(self._pairs) and bool(decodes) and not any(self.usable(prefill, d) for d in decodes)

    def stranded_decode(self, decode: WorkerInfo, prefills: Iterable[WorkerInfo]) -> bool:
        """Is every pair of ``decode`` with ``prefills`` being avoided (and there are some)?"""
        prefills = list(prefills)
        return bool(self._pairs) and bool(prefills) and not any(self.usable(p, decode) for p in prefills)

    def to_dict(self) -> list[dict]:
        """The pairs avoided now or tried again after a failure (``/cluster``)."""
        now = self._clock()
        return [{"prefill": p, "decode": d, "cooling_for": round(max(0.0, c.until - now), 3),
                 "failures": c.failures, "trying": c.trial is not None, "reason": c.reason}
                for (p, d), c in sorted(self._pairs.items())]
