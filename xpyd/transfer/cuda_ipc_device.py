"""The device operations of the cuda_ipc transfer backend: export a pool, open a peer's, copy runs, fence.

``DeviceOps`` is what ``cuda_ipc`` asks of the device, and nothing more:

- ``attach(pool)``: take this worker's pool (its byte size; refuses one that is not on the device);
- ``uuid()``: which physical device the pool is on (two processes on one GPU report the same);
- ``export()``: the pool's IPC handle, made once (``Export``: what the sender's Hello carries);
- ``open(export)``: the peer's pool, opened from its handle (once per connection; a bad handle raises
  ``DeviceError``);
- ``mark()``: a point on the device's current stream (a CUDA event), recorded on the calling (engine)
  thread; ``shared_mark()``: the same as an event another process can wait on (an interprocess CUDA event,
  blocking: its waiter sleeps), with its handle (what the sender's Offer carries); ``open_mark(handle)``:
  the peer's mark, opened (a bad handle raises ``DeviceError``); ``wait(mark)``: the calling (transfer)
  thread waits until the device passed it (an opened mark: ~3 us after, measured on an H200);
- ``prepare(peer, pieces)``: the host work of copying the ``(src offset, dst offset, bytes)`` pieces from
  the peer's pool into ours, done ahead (the kernel's table built and uploaded) while the sender's forward
  may still run; ``copy(prepared, after, timed)``: launch it after ``after`` (a mark), then a fence: it
  returns once the bytes landed (``timed``: with when the copies were enqueued and how long the device
  took, ``CopyTimes``; else None). ``CudaOps`` makes one ``copy_`` per piece for up to ``FEW_PIECES``
  pieces (each a full-speed device memcpy), else one launch of the copy kernel for all of them
  (``cuda_ipc_kernel.Runs``, its ``copy_variant`` geometry; ``torch._foreach_copy_`` where Triton is
  missing).

Host time on the copy's critical path is kept to what a launch needs: each copying thread makes the pool's
device current once (not a device guard per copy), reuses its pair of timing events, and the kernel's
``Runs`` reuses the pools' word views.

Two implementations: ``CudaOps`` (torch's CUDA IPC: ``untyped_storage()._share_cuda_()`` on the sender,
``UntypedStorage._new_shared_cuda`` on the receiver, as ``torch.multiprocessing.reductions`` does; copies
on a stream of their own) and ``cuda_ipc_hostops.HostOps``, host memory standing in for the device so that
the protocol is tested for real on a CPU. torch is imported only by ``CudaOps``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from xpyd.transfer import cuda_ipc_kernel

log = logging.getLogger(__name__)

MAX_HANDLE = 4096  # bytes of one handle field (a cudaIpcMemHandle is 64; expandable segments carry more)
MAX_MARK_HANDLE = 128  # bytes of a mark's handle (a cudaIpcEventHandle is 64)

Piece = tuple[int, int, int]  # (src offset in the peer's pool, dst offset in ours, bytes)
FEW_PIECES = 2  # up to this many pieces: one copy_ each; more: one launch for all
BLOCKING_MARKS = True  # shared marks' waiters sleep (False: they spin a core in the driver, the GIL released)


@dataclass(frozen=True, slots=True)
class CopyTimes:
    """Of one timed ``copy``: when its copies started to be enqueued (the stream set up, its waits and the
    start event enqueued) and when they all were (``time.perf_counter_ns``), and the device time from the
    first to the last (CUDA events around them; the host clock for ``HostOps``), in seconds."""

    launching_ns: int
    enqueued_ns: int
    device_s: float
    steps: tuple[tuple[str, int], ...] = ()  # finer host stamps (name, perf_counter_ns), in order


class DeviceError(Exception):
    """A device operation failed (a handle that does not open, a copy that faulted)."""


@dataclass(frozen=True, slots=True)
class Export:
    """A pool's storage as torch's ``_share_cuda_`` describes it, plus where the pool lies inside it."""

    device: int  # the exporting process's device index (the receiver opens on its own, same UUID)
    handle: bytes  # the memory handle of the allocation that holds the storage
    storage_size: int  # bytes of the storage
    storage_offset: int  # bytes from the allocation's start to the storage's
    ref_handle: bytes  # torch's shared reference counter (a file name) ...
    ref_offset: int  # ... and the slot in it
    event_handle: bytes  # an event the producer recorded at export ...
    event_sync: bool  # ... that the opener waits on when set
    base: int  # bytes from the storage's start to the pool's first byte
    nbytes: int  # bytes of the pool

    def __post_init__(self) -> None:
        for name in ("handle", "ref_handle", "event_handle"):
            v = getattr(self, name)
            if type(v) is not bytes or len(v) > MAX_HANDLE:
                raise ValueError(f"export {name} must be at most {MAX_HANDLE} bytes")
        for name in ("device", "storage_size", "storage_offset", "ref_offset", "base", "nbytes"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v < 1 << 63:
                raise ValueError(f"export {name} must be an int >= 0, got {v!r:.40}")
        if type(self.event_sync) is not bool:
            raise ValueError("export event_sync must be a bool")
        if self.nbytes <= 0 or self.base + self.nbytes > self.storage_size:
            raise ValueError(f"export pool [{self.base}, +{self.nbytes}) outside its {self.storage_size}-byte storage")


class DeviceOps(Protocol):
    kind: str  # "cuda", or "host" for the stand-in

    def attach(self, pool) -> int: ...
    def uuid(self) -> str: ...
    def export(self) -> Export: ...
    def open(self, export: Export) -> object: ...
    def mark(self) -> object: ...
    def shared_mark(self) -> tuple[object, bytes]: ...
    def open_mark(self, handle: bytes) -> object: ...
    def passed(self, mark: object) -> bool: ...
    def wait(self, mark: object) -> None: ...
    def prepare(self, peer: object, pieces: Sequence[Piece]) -> object: ...
    def copy(self, prepared: object, after: object | None, timed: bool = False) -> CopyTimes | None: ...
    def close(self) -> None: ...


class CudaOps:
    """The real thing: torch CUDA IPC handles of the pool's storage, copies on a dedicated stream."""

    kind = "cuda"

    def __init__(self, copy_variant: str = cuda_ipc_kernel.DEFAULT_VARIANT) -> None:
        import torch

        if copy_variant not in cuda_ipc_kernel.VARIANTS:
            raise ValueError(f"copy_variant must be one of {cuda_ipc_kernel.VARIANTS}, got {copy_variant!r}")
        if not torch.cuda.is_available():
            raise DeviceError("cuda_ipc needs CUDA (torch.cuda.is_available() is False)")
        self._torch = torch
        self._pool = None  # the pool tensor (kept alive: peers hold handles to its memory)
        self._bytes = None  # its flat uint8 view
        self._device = None
        self._stream = None
        self._export: Export | None = None
        self._lock = threading.Lock()
        self._runs = None  # copies many pieces in one launch (cuda_ipc_kernel)
        self._variant = copy_variant
        self._local = threading.local()  # per copying thread: device made current, timing events

    def attach(self, pool) -> int:
        torch = self._torch
        if not isinstance(pool, torch.Tensor) or pool.device.type != "cuda":
            where = pool.device if isinstance(pool, torch.Tensor) else type(pool).__name__
            raise ValueError(f"cuda_ipc needs the KV pool on a CUDA device (--device cuda), got {where}")
        if not pool.is_contiguous() or pool.numel() == 0:
            raise ValueError("cuda_ipc needs a contiguous, non-empty pool tensor")
        self._pool, self._device = pool, pool.device
        self._bytes = pool.view(-1).view(torch.uint8)
        self._stream = torch.cuda.Stream(device=pool.device)
        self._runs = self._warm_runs(pool.device)
        return self._bytes.numel()

    def _warm_runs(self, device):
        """The copy of many pieces: the kernel, compiled now (not in the first transfer) for 16-byte-aligned
        pieces, the common case, or ``_foreach_copy_`` where Triton is missing or cannot compile it."""
        unavailable = cuda_ipc_kernel.why_unavailable(device)
        if unavailable is None:
            try:
                runs = cuda_ipc_kernel.Runs(self._variant)
                with self._torch.cuda.device(device):
                    scratch = self._torch.zeros(1 << 20, dtype=self._torch.uint8, device=device)
                    half = scratch.numel() // 2  # whole tiles and a partial one, 16-byte aligned
                    runs(scratch[half:], scratch[:half], [(0, 0, half // 2), (half // 2, half // 2 + 16, 4096 + 16)])
                    self._torch.cuda.synchronize(device)
                return runs
            except Exception as e:  # (a Triton that cannot build for this device)
                unavailable = f"the copy kernel did not build: {e}"
        log.warning("cuda_ipc: many pieces copy with torch._foreach_copy_ (%s)", unavailable)
        return cuda_ipc_kernel.copy_runs_foreach

    def uuid(self) -> str:
        return str(self._torch.cuda.get_device_properties(self._device).uuid)

    def export(self) -> Export:
        with self._lock:  # once: torch keeps the sharing state of the storage (its ref counter) alive
            if self._export is None:
                storage = self._pool.untyped_storage()
                (device, handle, size, offset, ref_handle, ref_offset, event_handle,
                 event_sync) = storage._share_cuda_()
                base = self._pool.storage_offset() * self._pool.element_size()
                self._export = Export(int(device), bytes(handle), int(size), int(offset), bytes(ref_handle or b""),
                                      int(ref_offset), bytes(event_handle or b""), bool(event_sync), base,
                                      self._bytes.numel())
            return self._export

    def open(self, export: Export):
        torch = self._torch
        try:
            with torch.cuda.device(self._device):  # the receiver's own index of the same device (same UUID)
                storage = torch.UntypedStorage._new_shared_cuda(
                    self._device.index, export.handle, export.storage_size, export.storage_offset,
                    export.ref_handle, export.ref_offset, export.event_handle, export.event_sync)
                whole = torch.empty(0, dtype=torch.uint8, device=self._device).set_(
                    storage, 0, (export.storage_size,), (1,))
        except Exception as e:  # (RuntimeError from the driver: not a handle, another process's context ...)
            raise DeviceError(f"cannot open the sender's CUDA IPC handle: {e}") from None
        return whole[export.base: export.base + export.nbytes]

    def mark(self):
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self._device))
        return event

    def shared_mark(self):
        torch = self._torch
        event = torch.cuda.Event(blocking=BLOCKING_MARKS, interprocess=True)
        event.record(torch.cuda.current_stream(self._device))
        return event, bytes(event.ipc_handle())

    def open_mark(self, handle: bytes):
        torch = self._torch
        try:
            with torch.cuda.device(self._device):
                return torch.cuda.Event.from_ipc_handle(self._device, handle)
        except Exception as e:  # (RuntimeError from the driver: not an event handle)
            raise DeviceError(f"cannot open the sender's event handle: {e}") from None

    def passed(self, mark) -> bool:
        return mark.query()

    def wait(self, mark) -> None:
        """Until the device passed ``mark``; unbounded (an opened mark whose recording process died is never
        passed: measured on an H200), so a caller that cannot trust the peer waits in a thread of its own."""
        self._thread()  # (this thread launches the copy next: its device and events set up first)
        if not mark.query():
            mark.synchronize()  # (the GIL is released meanwhile)

    def _thread(self):
        """This thread's state: the pool's device made current (once per thread), its timing events."""
        local = self._local
        if getattr(local, "events", None) is None:
            torch = self._torch
            torch.cuda.set_device(self._device)
            local.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        return local.events

    def prepare(self, peer, pieces: Sequence[Piece]):
        try:
            self._thread()
            if len(pieces) <= FEW_PIECES:  # (the views made now: the launch is the copy_ calls alone)
                rows = pieces.tolist() if isinstance(pieces, np.ndarray) else list(pieces)
                return _Few(peer, [(self._bytes[d: d + n], peer[s: s + n]) for s, d, n in rows])
            if self._runs is cuda_ipc_kernel.copy_runs_foreach:
                return _Foreach(peer, pieces)
            with self._torch.cuda.stream(self._stream):  # (the table's upload, on the stream the copy runs on)
                return self._runs.prepare(self._bytes, peer, pieces)
        except Exception as e:
            raise DeviceError(f"device copy failed: {e}") from None

    def copy(self, prepared, after, timed: bool = False) -> CopyTimes | None:
        torch, stream = self._torch, self._stream
        steps = [] if timed else None
        try:
            start, end = self._thread()
            with torch.cuda.stream(stream):
                if timed:
                    steps.append(("stream", time.perf_counter_ns()))
                if after is not None:
                    stream.wait_event(after)
                if timed:
                    steps.append(("waits", time.perf_counter_ns()))
                    start.record(stream)
                    launching = time.perf_counter_ns()
                if type(prepared) is _Few:
                    for dst, src in prepared.pieces:
                        dst.copy_(src, non_blocking=True)
                elif type(prepared) is _Foreach:
                    cuda_ipc_kernel.copy_runs_foreach(self._bytes, prepared.peer, prepared.pieces)
                else:
                    prepared()
                if timed:
                    steps.append(("launched", time.perf_counter_ns()))
                    end.record(stream)
                    enqueued = time.perf_counter_ns()
            stream.synchronize()
        except Exception as e:
            raise DeviceError(f"device copy failed: {e}") from None
        if not timed:
            return None
        return CopyTimes(launching, enqueued, start.elapsed_time(end) / 1e3, tuple(steps))

    def close(self) -> None:
        self._pool = self._bytes = None


class _Few:
    """A prepared copy of a few pieces: one ``copy_`` each (``pieces``: (dst view, src view) pairs)."""

    __slots__ = ("peer", "pieces")

    def __init__(self, peer, pieces: list) -> None:
        self.peer, self.pieces = peer, pieces


class _Foreach(_Few):
    """A prepared copy through ``torch._foreach_copy_`` (no Triton; ``pieces``: the piece table)."""

    __slots__ = ()
