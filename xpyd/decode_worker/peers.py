"""A decode worker's prefill workers as peers (its engine thread alone): the signal-plane sessions kept with
them, and their requests failed when one fails or takes too long.

Heartbeats go to the prefill workers that hold requests of this one (a silent one is noticed through the
replies' deadline); a session with nothing in it for ``SESSION_IDLE`` is closed, so idle pairs cost nothing
(the next request reopens it). A prefill worker that fails (its socket monitor) fails its requests at once; one
that leaves the cluster keeps answering for the requests it holds. A request past its deadline (the engine sets
it ``prefill_wait_timeout`` ahead: at arrival, when its prefill worker's queue moves, when its pull starts)
fails with 504: not ready at its prefill worker, or its KV not here.
"""

from __future__ import annotations

from typing import Callable

from xpyd.decode_worker.lookups import Lookups
from xpyd.decode_worker.scheduler import DecodeScheduler
from xpyd.decode_worker.seq import DecodeSeq
from xpyd.signal.client import SignalClient
from xpyd.worker.request import RequestState

HEARTBEAT_INTERVAL = 1.0  # a prefill peer holding requests of this worker sent nothing this long gets a heartbeat
SESSION_IDLE = 600.0  # a prefill peer holding none, sent nothing this long: its session is closed (a new one
# costs a handshake, which a congested link can hold up past --signal-timeout: rare, after a long idle)


class PrefillPeers:
    """``fail(seq, status, error, cause, release=...)`` is the engine's way to fail a request;
    ``wait_timeout`` its ``prefill_wait_timeout``."""

    def __init__(self, sched: DecodeScheduler, lookups: Lookups, fail: Callable[..., None],
                 wait_timeout: float) -> None:
        self._sched = sched
        self._lookups = lookups
        self._fail = fail
        self._wait_timeout = wait_timeout
        self._next_keep = 0.0  # when heartbeats and idle sessions are next looked at

    def keep_sessions(self, signal: SignalClient, now: float) -> None:
        """Heartbeats to the prefill workers holding requests of this worker; idle sessions closed."""
        if now < self._next_keep:
            return
        self._next_keep = now + HEARTBEAT_INTERVAL / 2
        busy = {s.prefill_addr for s in (*self._sched.waiting(), *self._sched.transferring())}
        signal.heartbeat(HEARTBEAT_INTERVAL, busy)
        for addr in signal.close_idle(SESSION_IDLE, busy):
            self._lookups.drop(addr)

    def failed(self, addr: str, error: str) -> None:
        """The connection to prefill worker ``addr`` failed: the requests waiting on it fail."""
        self._lookups.drop(addr)  # (their requests fail below)
        for seq in self._sched.waiting() + self._sched.transferring():
            if seq.prefill_addr == addr:
                self._fail(seq, 502, error, "peer")

    def left(self, signal: SignalClient, addr: str) -> None:
        """A prefill worker left the cluster. One that drains (SIGTERM) still answers for the requests it
        holds, so those keep going; its connection is closed now if nothing waits on it, else when it
        goes away (the socket monitor fails what still waits then)."""
        if not any(s.prefill_addr == addr for s in self._sched.waiting() + self._sched.transferring()):
            signal.drop(addr)
            self._lookups.drop(addr)

    def fail_overdue(self, now: float) -> None:
        """The requests past their deadline fail: not ready at their prefill worker, or their KV not here."""
        limit = self._wait_timeout
        for seq in self._sched.overdue(now):
            if seq.state is RequestState.WAITING:
                error = f"prefill worker {seq.prefill_addr} did not have the request ready within {limit:g}s"
            else:
                error = f"KV from prefill worker {seq.prefill_addr} did not arrive within {limit:g}s"
            self._fail(seq, 504, error, "timeout", release=True)
