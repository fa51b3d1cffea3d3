"""The engine thread shell every role uses: an inbox, a wake pipe, start/stop, and what happens when a
step fails as a whole.

An exception that escapes ``step()`` leaves the engine's state unknown: the thread fails every request
it holds (``fail_all``), marks the engine failed (``ready()`` is False from then on, ``failure()`` says
why, ``post_unless_failed`` refuses), calls the handler set with ``on_failure`` (the process then
deregisters and exits non-zero) and ends. Failures of one request's work are contained earlier, by the
engine (``WorkerEngine.isolate``), and never reach this loop.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import time
from typing import Any, Callable

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
        self._failure: str | None = None  # why the engine failed (set once, under _failure_lock)
        self._failure_lock = threading.Lock()
        self._on_failure: Callable[[], None] | None = None

    # --- called from other threads -----------------------------------------
    def post(self, item: Any) -> None:
        self._inbox.put(item)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # pipe full: the loop is awake anyway
            pass

    def post_unless_failed(self, item: Any) -> bool:
        """Post ``item`` unless the engine failed (False: nothing will ever take it from the inbox)."""
        with self._failure_lock:  # (fail_all drains the inbox after the flag is set: nothing slips in)
            if self._failure is not None:
                return False
            self.post(item)
            return True

    def ready(self) -> bool:
        return self._ready.is_set() and not self._stop.is_set() and self._failure is None

    def failure(self) -> str | None:
        """Why the engine failed (the exception that escaped a step), or None while it is sound."""
        return self._failure

    def on_failure(self, handler: Callable[[], None]) -> None:
        """Call ``handler()`` (from the engine thread) once the engine failed; at once if it already has."""
        with self._failure_lock:
            if self._failure is None:
                self._on_failure = handler
                return
        handler()

    def idle(self) -> bool:
        """No request held in any state (safe to stop). Override."""
        return True

    def drain(self, timeout: float) -> bool:
        """Wait (from another thread) until idle or timeout; True if idle."""
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() >= deadline or self._failure is not None:
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
        try:
            while not self._stop.is_set():
                idle = self.step()
                if idle > 0 and not self._stop.is_set():
                    self.wait(idle)
        except BaseException as e:  # not one request's failure (step contains those): the state is unknown
            self._failed(e)
        finally:
            self.shutdown()

    def _failed(self, error: BaseException) -> None:
        log.critical("%s: a step failed; its state can no longer be trusted: failing every request it holds",
                     self.name, exc_info=error)
        with self._failure_lock:
            self._failure = f"{type(error).__name__}: {error}"
            handler = self._on_failure
        try:
            self.fail_all(self._failure)
        except Exception:  # the handler below must run whatever happens
            log.exception("%s: could not fail every request", self.name)
        if handler is not None:
            try:
                handler()
            except Exception:
                log.exception("%s: the failure handler failed", self.name)

    def step(self) -> float:
        raise NotImplementedError

    def fail_all(self, error: str) -> None:
        """After a failed step: end every request held or posted with an error (the engine thread is gone
        after this, so nothing else would). Override."""

    def shutdown(self) -> None:
        pass
