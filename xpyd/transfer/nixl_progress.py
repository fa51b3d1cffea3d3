"""Who makes UCX progress for the nixl backend: the engine's loop, with the backend's threads as a slow fallback.

The NIXL agent has no progress thread (it would spin a core), so UCX moves only inside calls into NIXL
(``nixl_agent.Agent.progress``). The target of a READ needs such calls too: for UCX's connection set-up
on every transport, and for each READ over transports without hardware RMA (UCX over TCP).

- ``tick()`` is the engine's call (``TransferBackend.progress()``), made every loop iteration while the
  engine has transfers in flight. It never waits: if a backend thread holds the agent, that thread is
  inside NIXL and UCX is progressing anyway. It pumps the agent and checks every posted READ, waking the
  reader thread of each one that ended.
- The backend's threads block on their sockets (``wait_reply``) or on their READ (``wait_read``) and
  call into NIXL themselves only
  - once ``fallback`` seconds passed without a tick (an engine busy in a long forward pass, a stopped
    one, or none: tools and tests drive a backend without an engine), then once per ``fallback``;
  - once kicked (``Agent.kick``: an abort or ``close()`` waits for the READ to end), then until it ends.
  ``fallback=None`` turns the first off; a test uses it to show that the ticks are what drive progress.

Every wait is bounded: a READ that makes no progress fails after the backend's ``io_timeout``.
"""

from __future__ import annotations

import select
import time
from typing import Callable

from xpyd.transfer.nixl_agent import DONE, PROC, Agent, Read
from xpyd.transfer.tcp_wire import Conn

FALLBACK = 0.05  # seconds without a tick after which the backend's threads make progress themselves
IDLE_CHECK = 0.1  # with no fallback, how often a waiting thread still checks for close and its deadline
KICKED_POLL = 0.0002  # a kicked reader's pause between checks of its READ


class Progress:
    """The progress policy of one nixl backend (one agent)."""

    def __init__(self, agent: Agent, fallback: float | None) -> None:
        self._agent = agent
        self._fallback = fallback
        self._last_tick = float("-inf")  # monotonic time of the last tick that made progress

    def tick(self) -> None:
        """The engine's loop: make progress if the agent is free; never waits."""
        if self._agent.progress(block=False):
            self._last_tick = time.monotonic()  # (a tick that found the agent busy does not count)

    def _stale(self) -> bool:
        """True if the backend's threads should make progress themselves (no recent tick)."""
        return self._fallback is not None and time.monotonic() - self._last_tick >= self._fallback

    def _interval(self, left: float) -> float:
        return max(0.0, min(left, self._fallback if self._fallback is not None else IDLE_CHECK))

    def wait_read(self, read: Read, timeout: float, closed: Callable[[], bool]) -> str | None:
        """Wait until ``read`` ended: None if DONE, else why not (failed, ``timeout`` passed, backend closed)."""
        deadline = time.monotonic() + timeout
        while read.state == PROC:
            if closed():
                return "backend closed"
            left = deadline - time.monotonic()
            if left <= 0:
                return f"NIXL READ made no progress within {timeout:g}s"
            if read.kicked:
                if self._agent.check(read) == PROC:
                    time.sleep(KICKED_POLL)
            elif not read.wake.wait(self._interval(left)) and self._stale():
                self._agent.progress(block=True)
        return None if read.state == DONE else f"NIXL READ failed: {read.state}"

    def wait_reply(self, conn: Conn, timeout: float) -> None:
        """Wait until ``conn`` has a frame to read; raises ``TimeoutError`` after ``timeout`` (``Closing`` on close)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply within {timeout:g}s")
            try:
                conn.wait(select.POLLIN, self._interval(left))
                return
            except TimeoutError:
                if self._stale():
                    self._agent.progress(block=True)
