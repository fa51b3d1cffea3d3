"""Wait for a condition, bounded: tests poll for what they expect instead of sleeping and hoping.

``wait_until`` (threads, real processes) and ``until`` (asyncio) call ``predicate`` until it returns
something true and return that; past ``timeout`` they fail with ``what`` and the last value seen.
The timeouts are generous on purpose (a busy 2-core machine): they bound a hang, they do not measure
speed. A test that is about speed asserts that separately.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 15.0, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {value!r})")
        time.sleep(interval)


async def until(predicate: Callable[[], Any], what: str, timeout: float = 15.0, interval: float = 0.01) -> Any:
    """As `wait_until`; ``predicate`` may return an awaitable."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {value!r})")
        await asyncio.sleep(interval)
