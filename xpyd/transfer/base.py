"""Transfer engine interface: move byte regions of a registered KV pool to a peer.

A backend owns one registered buffer (the whole KV pool). The sending side
pushes local ``src`` regions into the peer's buffer at ``dst`` regions; the
receiving side announces each incoming transfer with ``expect`` first, with a
fresh secret (``auth.new_secret``) that reaches the sender over the signal
plane: only a sender that proves it holds it may write the transfer's bytes
(``auth``). Both calls return a ``CompletionToken`` at once; the scheduler polls it every step
and never blocks on it, and calls ``progress()`` every step while a transfer is
in flight (backends that need the caller's thread to move bytes use it).

Token states are ordered and only move forward; failure is sticky::

    PENDING -> TRANSFERRING -> DONE
        \\------------\\------> FAILED
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol, Sequence, runtime_checkable

log = logging.getLogger(__name__)

MAX_TRANSFER_ID_LEN = 256
MAX_ADDRESS_LEN = 512
MAX_OFFERS = 8


@dataclass(frozen=True, slots=True)
class Region:
    """A contiguous byte range inside a registered buffer (the KV pool)."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"invalid region offset={self.offset} length={self.length}")

    @property
    def end(self) -> int:
        return self.offset + self.length


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


DEVICE_KINDS = ("cuda",)


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A KV pool in accelerator memory, for a backend that registers device memory itself (nixl: as
    NIXL ``VRAM``); tcp and shm move host bytes only, so a device pool reaches them through a host
    staging copy instead (``xpyd.worker.kv_staging``). ``address`` is the device pointer."""

    kind: str  # "cuda"
    device_index: int
    address: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"device memory kind must be one of {DEVICE_KINDS}, got {self.kind!r:.40}")
        if type(self.device_index) is not int or self.device_index < 0:
            raise ValueError(f"device_index must be an int >= 0, got {self.device_index!r:.40}")
        if type(self.address) is not int or self.address <= 0 or type(self.nbytes) is not int or self.nbytes <= 0:
            raise ValueError(f"device memory needs a positive address and size, got {self.address!r:.40}, "
                             f"{self.nbytes!r:.40}")
        if self.address + self.nbytes >= 1 << 64:
            raise ValueError("device memory ends beyond the 64-bit address space")


@dataclass(frozen=True, slots=True)
class BackendDescriptor:
    """How a peer reaches this backend's registered buffer (sent over the signal plane)."""

    backend: str  # backend name, e.g. "tcp"
    address: str  # backend-specific; "host:port" of the listener for tcp
    buffer_size: int  # bytes of the registered buffer
    # Other ways to reach the same buffer, as (backend, address) pairs, e.g. ("shm", ...) when the
    # worker also offers shared memory to peers on its host. Optional; peers that ignore it use ``backend``.
    offers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"descriptor backend must be a non-empty str, got {self.backend!r}")
        if not isinstance(self.address, str) or not 0 < len(self.address) <= MAX_ADDRESS_LEN:
            raise ValueError(f"descriptor address must be a str of 1..{MAX_ADDRESS_LEN} chars")
        if type(self.buffer_size) is not int or self.buffer_size <= 0:
            raise ValueError(f"descriptor buffer_size must be a positive int, got {self.buffer_size!r}")
        if not isinstance(self.offers, tuple) or len(self.offers) > MAX_OFFERS:
            raise ValueError(f"descriptor offers must be a tuple of at most {MAX_OFFERS} pairs")
        for pair in self.offers:
            if not (isinstance(pair, tuple) and len(pair) == 2
                    and all(isinstance(x, str) and 0 < len(x) <= MAX_ADDRESS_LEN for x in pair)):
                raise ValueError(f"descriptor offers must be (backend, address) str pairs, got {pair!r:.80}")

    def offer(self, backend: str) -> str | None:
        """The address this descriptor offers for ``backend`` (its own address if it is ``backend``)."""
        if backend == self.backend:
            return self.address
        return next((addr for name, addr in self.offers if name == backend), None)

    def to_dict(self) -> dict:
        d = {"backend": self.backend, "address": self.address, "buffer_size": self.buffer_size}
        if self.offers:
            d["offers"] = [list(pair) for pair in self.offers]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "BackendDescriptor":
        if not isinstance(d, dict):
            raise ValueError(f"descriptor must be a dict, got {type(d).__name__}")
        offers = d.get("offers", ())
        if not isinstance(offers, (list, tuple)) or len(offers) > MAX_OFFERS:
            raise ValueError(f"descriptor offers must be a list of at most {MAX_OFFERS} pairs")
        offers = tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in offers)
        try:
            return cls(backend=d["backend"], address=d["address"], buffer_size=d["buffer_size"], offers=offers)
        except KeyError as e:
            raise ValueError(f"descriptor is missing {e}") from None


@runtime_checkable
class TransferBackend(Protocol):
    name: str

    def register(self, buffer: memoryview) -> BackendDescriptor:
        """Register the whole KV pool (writable, contiguous); once per backend."""
        ...

    def send(
        self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor, dst: Sequence[Region], *,
        secret: bytes,
    ) -> CompletionToken:
        """Push local ``src`` bytes into the peer's buffer at ``dst``; returns at once.

        ``secret``: the one the receiver ``expect``ed the transfer with (it came in the pull); the sender
        proves it holds it (``auth``). The token is DONE only after the receiver acknowledged that all
        bytes landed.
        """
        ...

    def expect(self, transfer_id: str, dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        """Announce an incoming transfer into local ``dst``, which only a sender proving it holds ``secret``
        (``auth.new_secret``, fresh per transfer) may open; anything else is refused and leaves it pending."""
        ...

    def abort(self, transfer_id: str) -> None:
        """Drop a queued/expected transfer (token FAILs "aborted"); safe if unknown."""
        ...

    def outstanding(self) -> set[str]:
        """Ids of transfers started (send) or announced (expect) and not yet finished or aborted."""
        ...

    def progress(self) -> None:
        """Move in-flight transfers along; cheap, never blocks. The engine calls it every loop iteration
        while it has a transfer in flight. A no-op where the backend's own threads move the bytes
        (tcp, shm); nixl makes UCX progress here (see docs/transfer.md)."""
        ...

    @property
    def progress_tick(self) -> float | None:
        """How often the engine must call ``progress()`` while a transfer is in flight (seconds), or None
        when the backend's own threads move the bytes and its tokens' ``on_finish`` wake the engine."""
        ...

    def forget_peer(self, address: str) -> None:
        """Drop cached connections to a peer that left (its descriptor's address)."""
        ...

    def close(self) -> None:
        """Stop threads, close sockets, fail outstanding tokens."""
        ...


# -- validation shared by backends -------------------------------------------


def check_transfer_id(transfer_id: object) -> str:
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_TRANSFER_ID_LEN:
        raise ValueError(
            f"transfer_id must be a str of 1..{MAX_TRANSFER_ID_LEN} chars, got {transfer_id!r:.80}"
        )
    return transfer_id


def check_regions(regions: Sequence[Region], buffer_size: int, what: str) -> tuple[tuple[Region, ...], int]:
    """Validate regions against a buffer of ``buffer_size`` bytes; return them as a tuple and their total."""
    if isinstance(regions, Region) or not isinstance(regions, Sequence):
        raise ValueError(f"{what} regions must be a sequence of Region")
    regions = tuple(regions)
    if not regions:
        raise ValueError(f"{what} regions are empty")
    total = 0
    for r in regions:
        if not isinstance(r, Region) or type(r.offset) is not int or type(r.length) is not int:
            raise ValueError(f"{what} regions must be Region(int, int), got {r!r:.80}")
        if r.end > buffer_size:
            raise ValueError(f"{what} region [{r.offset}, {r.end}) outside the {buffer_size}-byte buffer")
        total += r.length
    return regions, total


def check_send_regions(
    src: Sequence[Region], src_size: int, dst: Sequence[Region], dst_size: int
) -> tuple[tuple[Region, ...], tuple[Region, ...], int]:
    """Validate a send's local ``src`` and the peer's ``dst`` regions, which must hold as many bytes.

    Returns both as tuples and that byte count.
    """
    src, total = check_regions(src, src_size, "src")
    dst, dst_total = check_regions(dst, dst_size, "dst")
    if total != dst_total:
        raise ValueError(f"src regions hold {total} bytes but dst regions {dst_total}")
    return src, dst, total


def check_buffer(buffer: memoryview) -> memoryview:
    """Return ``buffer`` as a flat writable byte view."""
    if not isinstance(buffer, memoryview):
        raise ValueError(f"buffer must be a memoryview, got {type(buffer).__name__}")
    if buffer.readonly:
        raise ValueError("buffer must be writable")
    if not buffer.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if buffer.nbytes == 0:
        raise ValueError("buffer is empty")
    if buffer.format != "B" or buffer.ndim != 1:
        buffer = buffer.cast("B")
    return buffer
