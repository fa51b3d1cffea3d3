"""Transfer engine interface: move byte regions of a registered KV pool to a peer.

A backend owns one registered buffer (the whole KV pool). The sending side
pushes local ``src`` regions into the peer's buffer at ``dst`` regions; the
receiving side announces each incoming transfer with ``expect`` first, with a
fresh secret (``auth.new_secret``) that reaches the sender over the signal
plane: only a sender that proves it holds it may write the transfer's bytes
(``auth``). Both calls return a ``CompletionToken`` at once; the scheduler polls it every step
and never blocks on it, and calls ``progress()`` every step while a transfer is
in flight (backends that need the caller's thread to move bytes use it).

Tokens and their states (ordered, only forward, failure sticky) are in ``tokens``; this module
re-exports them with the interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from xpyd.transfer.tokens import (  # noqa: F401 (re-exported: part of the interface)
    AllOf,
    CompletionToken,
    DerivedToken,
    TransferError,
    TransferState,
    expect_parts,
)

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

    def same_host(self, peer: BackendDescriptor) -> bool:
        """Do sends to ``peer`` stay on this host (shared memory, one GPU's IPC: bytes move at memory speed, a
        part in about a millisecond), rather than cross a network?"""
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
