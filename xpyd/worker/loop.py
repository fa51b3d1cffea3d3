"""The engine thread shell both workers use: an inbox, a wake pipe, start/stop."""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

# How long a worker's loop may sleep with nothing to do. New work (``post``) and a finished KV transfer
# (its token's ``on_finish``) wake it at once; a backend that moves bytes only inside ``progress()``
# (nixl) names its own ``progress_tick``.
IDLE_SLEEP = 0.05


class EngineThread:
    """Runs ``step()`` in a dedicated thread; other threads talk to it through ``post``.

    ``step()`` returns how long the loop may sleep (seconds) when it has nothing
    to do; ``post`` wakes it at once.
    """

    name = "engine"

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # --- called from other threads -----------------------------------------
    def post(self, item: Any) -> None:
        self._inbox.put(item)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # pipe full: the loop is awake anyway
            pass

    def ready(self) -> bool:
        return self._ready.is_set() and not self._stop.is_set()

    def idle(self) -> bool:
        """No request held in any state (safe to stop). Override."""
        return True

    def drain(self, timeout: float) -> bool:
        """Wait (from another thread) until idle or timeout; True if idle."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.post(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- engine thread -----------------------------------------------------
    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def drain_inbox(self) -> list[Any]:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        items = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return items
            if item is not None:
                items.append(item)

    def wait(self, timeout: float) -> None:
        """Sleep until posted to or timeout (override to wait on more fds)."""
        if timeout > 0:
            select.select([self._wake_r], [], [], timeout)

    def _run(self) -> None:
        self._ready.set()
        while not self._stop.is_set():
            try:
                idle = self.step()
            except Exception:  # keep serving; the failing requests were failed by step()
                log.exception("engine step failed")
                idle = 0.01
            if idle > 0 and not self._stop.is_set():
                self.wait(idle)
        self.shutdown()

    def step(self) -> float:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
