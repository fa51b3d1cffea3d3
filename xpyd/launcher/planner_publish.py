"""`xpyd up --planner`'s planner state in the local etcd (for the proxy's /cluster), from its synchronous loop.

The publisher's calls run one at a time on an event loop of its own (an ``asyncio.Runner`` kept for the run, so
its etcd client is made once), each bounded by the etcd timeouts; a failure is logged and the launcher goes on.
"""

from __future__ import annotations

import asyncio
import math

from xpyd.discovery.planner_etcd import PlannerPublisher
from xpyd.discovery.planner_state import PlannerState


def state_ttl(interval_s: float) -> int:
    """Seconds the state outlives its last write: three intervals, at least 10 s."""
    return max(10, math.ceil(3 * interval_s))


class BlockingPublisher:
    def __init__(self, endpoint: str, interval_s: float) -> None:
        self._publisher = PlannerPublisher(endpoint, state_ttl(interval_s))
        self._runner = asyncio.Runner()

    def publish(self, state: PlannerState) -> bool:
        return self._runner.run(self._publisher.publish(state))

    def close(self) -> None:
        """Delete the state (no planner runs any more) and close the client."""
        try:
            self._runner.run(self._publisher.clear())
            self._runner.run(self._publisher.close())
        finally:
            self._runner.close()
