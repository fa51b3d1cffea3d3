"""Where a worker's KV pool lives for its transfer backend: the glue between the model's pool and transfer.

`adopt_pool` moves a CPU pool into memory the backend provides (shm: the prefill pool in a /dev/shm
segment). Everything else here is host staging for a pool that is not host memory (a pool on a GPU)
under the tcp and shm backends. Those backends move bytes between host buffers. For a pool on a device the worker keeps a host copy of
the pool's bytes at the same offsets (`HostStaging`; pinned when it allocates it, the shm segment when
the backend provides one), registers that copy with the backend, and wraps the backend in
`StagedTransfer`:

- send: the request's source regions are copied device -> host, then the backend sends them;
- expect: the backend receives into the host copy; once its token is DONE, the first poll of the
  returned token copies those regions host -> device and only then reports DONE.

Offsets, descriptors and the wire are unchanged: a peer cannot tell a staged pool from a CPU one.
Copies are synchronous, on the thread that calls `send` or polls the token. nixl does not stage: it
registers the device pool itself (`registers_device_memory`; NIXL VRAM, never run on a GPU: see
docs/devices.md), and `pool_memory` hands it the pool as `DeviceMemory`; cuda_ipc does not stage either: it
takes the pool tensor itself (`registers_tensor`) and copies device to device. A CPU pool never stages,
except in tests that force it to prove the round trip.

torch is imported only where a torch pool is handled: a simulated worker's host pool (`HostKVPool`) goes
through `shared_pool_memory` and `pool_memory` without it.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import TYPE_CHECKING, Sequence

from xpyd.transfer.base import (
    BackendDescriptor,
    CompletionToken,
    DerivedToken,
    DeviceMemory,
    Region,
    TransferState,
    check_buffer,
    check_regions,
)
from xpyd.transfer.shm_segment import SegmentError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class HostStaging:
    """A host copy of a pool tensor's bytes, region for region at the same offsets."""

    def __init__(self, pool_tensor: torch.Tensor, buffer: memoryview | None = None, pin: bool | None = None) -> None:
        """``buffer``: host memory of the pool's size to stage in (e.g. the shm segment); else allocated
        here, pinned (page-locked, for fast device copies) when ``pin`` (default: on a CUDA pool)."""
        import torch

        if not pool_tensor.is_contiguous():
            raise ValueError("the staged pool tensor must be contiguous")
        self._device = pool_tensor.view(-1).view(torch.uint8)
        size = self._device.numel()
        if buffer is None:
            if pin is None:
                pin = pool_tensor.device.type == "cuda"
            self._host = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
        else:
            buffer = check_buffer(buffer)
            if buffer.nbytes != size:
                raise ValueError(f"staging buffer holds {buffer.nbytes} bytes, the pool {size}")
            self._host = torch.frombuffer(buffer, dtype=torch.uint8)
        self._view = memoryview(self._host.numpy())  # numpy keeps the tensor alive

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    def buffer(self) -> memoryview:
        """The host copy, as the writable byte view a transfer backend registers."""
        return self._view

    def to_host(self, regions: Sequence[Region]) -> None:
        """Copy ``regions`` of the pool into the host copy (before they are sent)."""
        regions, _ = check_regions(regions, self.nbytes, "staged")
        for r in regions:
            self._host[r.offset : r.end].copy_(self._device[r.offset : r.end])

    def to_device(self, regions: Sequence[Region]) -> None:
        """Copy ``regions`` of the host copy into the pool (after they were received)."""
        regions, _ = check_regions(regions, self.nbytes, "staged")
        for r in regions:
            self._device[r.offset : r.end].copy_(self._host[r.offset : r.end])


def needs_staging(transfer, device: torch.device) -> bool:
    """A pool on ``device`` reaches ``transfer`` through a host copy: a device pool, unless the backend
    registers device memory itself (nixl)."""
    return device.type != "cpu" and not _registers_device_memory(transfer)


def _registers_device_memory(transfer) -> bool:
    return getattr(transfer, "registers_device_memory", False)


def pool_memory(pool, transfer) -> memoryview | DeviceMemory | torch.Tensor:
    """What a worker registers with its backend: the pool's host bytes (or its staging copy), the device
    pool itself for a backend that registers device memory (nixl on a GPU), or the pool tensor for one that
    takes it as it is (cuda_ipc: it refuses a pool that is not on a CUDA device)."""
    device = getattr(pool, "device", None)  # (a host pool has none: its memory is host memory)
    if device is not None and getattr(transfer, "registers_tensor", False) and pool.staging is None:
        return pool.tensor
    if pool.staging is None and device is not None and device.type != "cpu" and _registers_device_memory(transfer):
        import torch

        t = pool.tensor
        index = device.index if device.index is not None else torch.cuda.current_device()
        return DeviceMemory(device.type, index, t.data_ptr(), t.numel() * t.element_size())
    return pool.buffer()


def stage_pool(pool, buffer: memoryview | None = None, pin: bool | None = None) -> HostStaging:
    """Attach a host staging copy to ``pool`` (a `KVPool`); ``pool.buffer()`` is that copy from now on."""
    if pool.staging is not None:
        raise ValueError("this KV pool already has a staging copy")
    pool.staging = HostStaging(pool.tensor, buffer, pin)
    return pool.staging


def stage_transfer(transfer, pool, sender: bool) -> "StagedTransfer":
    """Wrap a worker's tcp/shm/auto ``transfer`` for its ``pool`` on a device; before the engine is built.

    ``sender`` (prefill): the host copy is the memory the backend provides for sending, if any (shm: its
    segment, exactly as `adopt_pool` puts a CPU pool there); else pinned memory.
    """
    buffer = _backend_host_memory(transfer, pool.layout) if sender else None
    return StagedTransfer(transfer, stage_pool(pool, buffer))


def _backend_host_memory(transfer, layout) -> memoryview | None:
    # adopt_pool reads `runner.pool.layout` and, when the backend hands out memory, replaces
    # `runner.pool` with a CPU pool over it: reuse its policy (auto falls back to tcp) for the host copy.
    holder = SimpleNamespace(pool=SimpleNamespace(layout=layout))
    placeholder = holder.pool
    adopt_pool(transfer, holder)
    return None if holder.pool is placeholder else holder.pool.buffer()


def adopt_pool(transfer, runner) -> None:
    """Move ``runner.pool`` (a torch `KVPool` on the CPU) into memory the backend provides (shm: its segment),
    if it provides any.

    For the *sending* (prefill) worker only: with shm the receiver copies out of the sender's segment
    into its own pool, which stays in ordinary memory. Call before the engine is built (engines hold
    ``runner.pool``). ``auto`` falls back to tcp only when no segment can be created; ``shm`` raises.
    A runner whose pool is not a torch pool takes the memory at construction instead (`shared_pool_memory`).
    """
    layout = runner.pool.layout
    buffer = shared_pool_memory(transfer, layout.total_bytes)
    if buffer is not None:
        from xpyd.model.kv_pool import KVPool

        blocks = getattr(runner.pool, "blocks", None)
        runner.pool = KVPool(layout, buffer=buffer, caching=blocks.caching if blocks is not None else True,
                             zeroed=True)  # (a new segment: zero-filled already)


def shared_pool_memory(transfer, nbytes: int) -> memoryview | None:
    """Memory of ``nbytes`` for the sending (prefill) worker's pool that the backend provides (shm: a segment
    the receivers copy out of), or None (tcp; or ``auto`` when no segment can be created: it then uses tcp
    only; ``shm`` raises)."""
    allocate = getattr(transfer, "allocate", None)
    if allocate is None:
        return None
    try:
        return allocate(nbytes)
    except SegmentError as e:
        if getattr(transfer, "extras", None) is None:
            raise
        log.warning("kv-backend auto: no shared-memory segment (%s); using tcp only", e)
        for extra in transfer.extras:
            extra.close()
        transfer.extras = []
        return None


class _LandingToken(DerivedToken):
    """A receive token that reports DONE only after the received bytes were copied into the device pool."""

    __slots__ = ("_inner", "_regions", "_owner", "_landing")

    def __init__(self, inner: CompletionToken, regions: tuple[Region, ...], owner: "StagedTransfer") -> None:
        super().__init__(inner.transfer_id)
        self._inner = inner
        self._regions = regions
        self._owner = owner
        self._landing = threading.Lock()  # one copy into the pool, never after an abort

    def _followed(self) -> list[CompletionToken]:
        return [self._inner]

    def _sync(self) -> None:
        if CompletionToken.finished(self):
            return
        with self._landing:
            if CompletionToken.finished(self):
                return
            state = self._inner.state()
            if state is TransferState.DONE:
                try:
                    self._owner.staging.to_device(self._regions)
                except Exception as e:  # (a device error): the request fails, the worker keeps going
                    self._fail(f"copying the received KV into the device pool failed: {e}")
                else:
                    self._advance(TransferState.DONE)
            elif state is TransferState.FAILED:
                self._fail(self._inner.error or "failed")
            elif state is TransferState.TRANSFERRING and CompletionToken.state(self) is TransferState.PENDING:
                self._advance(TransferState.TRANSFERRING)
        if CompletionToken.finished(self):
            self._owner._settle(self.transfer_id, self)

    def _abort(self, reason: str) -> None:
        with self._landing:
            self._fail(reason)

    def wait(self, timeout: float) -> bool:
        self._inner.wait(timeout)
        return self.finished()


class StagedTransfer:
    """A `TransferBackend` around another one, for a pool whose bytes live in a `HostStaging` copy."""

    def __init__(self, inner, staging: HostStaging) -> None:
        self.inner = inner
        self.name = inner.name
        self.staging = staging
        self._lock = threading.Lock()
        self._receiving: dict[str, _LandingToken] = {}  # expected, not yet landed or failed

    def same_host(self, peer: BackendDescriptor) -> bool:
        return self.inner.same_host(peer)

    def register(self, buffer: memoryview) -> BackendDescriptor:
        """Register the host copy (what the pool's `buffer()` returns once staged)."""
        if check_buffer(buffer).nbytes != self.staging.nbytes:
            raise ValueError(f"registered buffer holds {buffer.nbytes} bytes, the staged pool "
                             f"{self.staging.nbytes}")
        return self.inner.register(buffer)

    def send(self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor,
             dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        self.staging.to_host(src)  # the pool's bytes are final: the forward that wrote them has run
        return self.inner.send(transfer_id, src, peer, dst, secret=secret)

    def expect(self, transfer_id: str, dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        regions, _ = check_regions(dst, self.staging.nbytes, "dst")
        token = _LandingToken(self.inner.expect(transfer_id, regions, secret=secret), regions, self)
        with self._lock:
            self._receiving[transfer_id] = token
        return token

    def abort(self, transfer_id: str) -> None:
        self.inner.abort(transfer_id)
        with self._lock:
            token = self._receiving.pop(transfer_id, None)
        if token is not None:
            token._abort("aborted")

    def outstanding(self) -> set[str]:
        with self._lock:
            landing = {tid for tid, tok in self._receiving.items() if not CompletionToken.finished(tok)}
        return self.inner.outstanding() | landing

    def progress(self) -> None:
        self.inner.progress()

    @property
    def progress_tick(self) -> float | None:
        return self.inner.progress_tick

    def forget_peer(self, address: str) -> None:
        self.inner.forget_peer(address)

    def close(self) -> None:
        self.inner.close()
        with self._lock:
            tokens, self._receiving = list(self._receiving.values()), {}
        for token in tokens:
            token._abort("transfer backend closed")

    def _settle(self, transfer_id: str, token: _LandingToken) -> None:
        with self._lock:
            if self._receiving.get(transfer_id) is token:
                del self._receiving[transfer_id]
