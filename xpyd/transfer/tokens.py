"""Completion tokens: what ``TransferBackend.send`` / ``expect`` return, polled by the schedulers every step.

States are ordered and only move forward; failure is sticky::

    PENDING -> TRANSFERRING -> DONE
        \\------------\\------> FAILED

``DerivedToken``/``AllOf`` combine tokens (a receive in parts); ``expect_parts`` announces such a receive so
that the combined token owns its parts: when one fails the others are aborted before FAILED is read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from enum import IntEnum
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # (annotations only: base re-exports this module)
    from xpyd.transfer.base import Region, TransferBackend

log = logging.getLogger(__name__)


class TransferState(IntEnum):
    FAILED = 0
    PENDING = 1
    TRANSFERRING = 2
    DONE = 3


# Allowed transitions; anything else is a backend bug and raises. Leaving a
# finished state is not a transition but a no-op (abort/close race with I/O).
_ALLOWED = {
    TransferState.PENDING: {TransferState.TRANSFERRING, TransferState.DONE, TransferState.FAILED},
    TransferState.TRANSFERRING: {TransferState.DONE, TransferState.FAILED},
    TransferState.DONE: set(),
    TransferState.FAILED: set(),
}


class TransferError(Exception):
    """A transfer cannot be started (backend closed, not registered, duplicate id, ...)."""


class CompletionToken:
    """Progress of one transfer; thread-safe. Created by a backend, polled by a scheduler.

    ``on_finish(callback)`` runs ``callback()`` when the token is DONE or FAILED, on the thread that
    finished it (at once if it already is; a derived token may run it more than once): the engine wakes
    its loop with it instead of ticking.
    """

    __slots__ = ("transfer_id", "_cond", "_state", "_error", "_callbacks")

    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self._cond = threading.Condition(threading.Lock())
        self._state = TransferState.PENDING
        self._error: str | None = None
        self._callbacks: list[Callable[[], None]] = []

    def on_finish(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (cheap, never raising into the backend) when this token finishes."""
        with self._cond:
            if self._state not in (TransferState.DONE, TransferState.FAILED):
                self._callbacks.append(callback)
                return
        _call(callback)

    def state(self) -> TransferState:
        return self._state

    def done(self) -> bool:
        return self._state is TransferState.DONE

    def failed(self) -> bool:
        return self._state is TransferState.FAILED

    def finished(self) -> bool:
        return self._state in (TransferState.DONE, TransferState.FAILED)

    @property
    def error(self) -> str | None:
        return self._error

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True if finished. For tests and tools only."""
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        with self._cond:
            return self._cond.wait_for(self.finished, timeout)

    # -- used by backends -------------------------------------------------
    def _advance(self, state: TransferState) -> bool:
        """Move to TRANSFERRING or DONE. False (no change) if already finished."""
        if state not in (TransferState.TRANSFERRING, TransferState.DONE):
            raise ValueError(f"_advance to {state.name}; use _fail for failures")
        return self._set(state, None)

    def _fail(self, msg: str) -> bool:
        """Fail with ``msg``. False (no change) if already finished."""
        return self._set(TransferState.FAILED, msg or "failed")

    def _set(self, state: TransferState, error: str | None) -> bool:
        with self._cond:
            if self._state in (TransferState.DONE, TransferState.FAILED):
                return False
            if state not in _ALLOWED[self._state]:
                raise ValueError(f"illegal transition {self._state.name} -> {state.name}")
            self._state = state
            self._error = error
            callbacks: list[Callable[[], None]] = []
            if state in (TransferState.DONE, TransferState.FAILED):
                self._cond.notify_all()
                callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:  # outside the lock: a callback may read this token
            _call(callback)
        return True

    def __repr__(self) -> str:
        err = f", error={self._error!r}" if self._error else ""
        return f"CompletionToken({self.transfer_id!r}, {self._state.name}{err})"


def _call(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # a waker's bug must not break the backend's I/O thread
        log.exception("transfer completion callback failed")


class DerivedToken(CompletionToken):
    """A token whose progress follows other tokens (auto's per-backend children, a staged receive):
    every read first calls ``_sync()``, which the subclass defines and which moves this token forward.
    ``_followed()`` names those tokens: ``on_finish`` fires when one of them finishes (the reader's next
    ``_sync`` then settles this one)."""

    __slots__ = ()

    def _sync(self) -> None:
        raise NotImplementedError

    def _followed(self) -> Sequence[CompletionToken]:
        raise NotImplementedError

    def on_finish(self, callback: Callable[[], None]) -> None:
        for token in self._followed():
            token.on_finish(callback)
        CompletionToken.on_finish(self, callback)  # (also when this token itself is failed: an abort)

    def state(self) -> TransferState:
        self._sync()
        return CompletionToken.state(self)

    def done(self) -> bool:
        return self.state() is TransferState.DONE

    def failed(self) -> bool:
        return self.state() is TransferState.FAILED

    def finished(self) -> bool:
        return self.state() in (TransferState.DONE, TransferState.FAILED)

    @property
    def error(self) -> str | None:
        self._sync()
        return self._error


class AllOf(DerivedToken):
    """The parts of one receive (a pull streamed in parts, each ``expect``ed on its own): DONE when every part
    is, FAILED as soon as one part failed (with its error).

    Given the backend's ``abort`` (``expect_parts`` gives it), it owns its parts: before it reads FAILED it
    aborts every part, so a reader that sees it FAILED knows that no byte of any part lands any more and may
    give their blocks to another request (a part still expected would otherwise take the bytes of a sender
    that reconnected and sent it on). ``abort()`` does the same for a receive its owner gives up on.
    """

    __slots__ = ("_parts", "_abort_part")

    def __init__(self, transfer_id: str, parts: Sequence[CompletionToken],
                 abort: Callable[[str], None] | None = None) -> None:
        super().__init__(transfer_id)
        if not parts:
            raise ValueError("AllOf needs at least one part")
        self._parts = tuple(parts)
        self._abort_part = abort

    def abort(self, reason: str = "aborted") -> None:
        """Abort every part (once this returns, no byte of any of them lands) and fail this token."""
        if self._abort_part is None:
            raise TypeError(f"{self.transfer_id!r}: an AllOf made without the backend's abort cannot abort")
        self._abort_parts()
        self._set(TransferState.FAILED, reason)

    def _followed(self) -> Sequence[CompletionToken]:
        return self._parts

    def _sync(self) -> None:
        if CompletionToken.finished(self):
            return
        failed = next((p for p in self._parts if p.failed()), None)
        if failed is not None:
            self._abort_parts()  # first: FAILED tells the reader that the parts' blocks are free
            self._set(TransferState.FAILED, failed.error or "failed")
        elif all(p.done() for p in self._parts):
            self._set(TransferState.DONE, None)

    def _abort_parts(self) -> None:
        if self._abort_part is not None:
            for p in self._parts:
                self._abort_part(p.transfer_id)  # (a no-op for a part already finished)


def expect_parts(backend: TransferBackend, transfer_id: str, parts: Sequence[tuple[str, Sequence[Region]]], *,
                 secret: bytes) -> AllOf:
    """Announce a receive in ``parts`` ((part transfer id, dst regions) each, all with ``secret``) and return
    the token that owns them (``AllOf`` with ``backend.abort``). If announcing one raises, the ones announced
    before it are aborted first."""
    tokens: list[CompletionToken] = []
    try:
        for tid, dst in parts:
            tokens.append(backend.expect(tid, dst, secret=secret))
    except BaseException:
        for token in tokens:
            backend.abort(token.transfer_id)
        raise
    return AllOf(transfer_id, tokens, backend.abort)
