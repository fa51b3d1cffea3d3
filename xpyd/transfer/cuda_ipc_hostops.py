"""``HostOps``: the cuda_ipc device operations over host memory, the one fake of ``cuda_ipc_device.DeviceOps``.

Host memory stands in for the device so that the cuda_ipc protocol is tested for real on a CPU (real sockets,
threads, board and copies): a shared ``HostRegistry`` plays the driver's table of exported handles, and a
``threading.Event`` a CUDA event (set: the device passed it).
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Sequence

import numpy as np

from xpyd.transfer.cuda_ipc_device import CopyTimes, DeviceError, Export, Piece


class HostRegistry:
    """The stand-in for the driver: what ``HostOps`` exported, by handle (share one between both sides)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[bytes, np.ndarray] = {}
        self._marks: dict[bytes, threading.Event] = {}
        self.opened = 0  # handles opened so far (tests check that strangers open nothing)

    def add(self, array: np.ndarray) -> bytes:
        handle = secrets.token_bytes(16)
        with self._lock:
            self._pools[handle] = array
        return handle

    def get(self, handle: bytes) -> np.ndarray:
        with self._lock:
            array = self._pools.get(handle)
            if array is None:
                raise DeviceError("cannot open the sender's handle: no such exported memory")
            self.opened += 1
            return array

    def add_mark(self, gate: threading.Event) -> bytes:
        handle = secrets.token_bytes(64)
        with self._lock:
            self._marks[handle] = gate
        return handle

    def get_mark(self, handle: bytes) -> threading.Event:
        with self._lock:
            gate = self._marks.pop(handle, None)  # (each shared mark is opened once)
        if gate is None:
            raise DeviceError("cannot open the sender's event handle: no such event")
        return gate

    def drop(self, array: np.ndarray) -> None:
        with self._lock:
            self._pools = {h: a for h, a in self._pools.items() if a is not array}


class HostOps:
    """``DeviceOps`` over host memory (a writable buffer), for the protocol's tests on a CPU.

    ``gate``: what ``mark()`` and ``shared_mark()`` return and ``wait()`` waits on; set (the forward has
    finished) unless a test clears it (a receiver waits on the gate of the sender's ``HostOps``, opened
    through the registry). ``waiting`` is set once a ``wait()`` started. ``copies`` counts the device
    copies made, ``prepared`` the copies prepared."""

    kind = "host"

    def __init__(self, registry: HostRegistry, device_uuid: str = "GPU-host-stand-in") -> None:
        self.registry = registry
        self.device_uuid = device_uuid
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()
        self.copies = 0
        self.prepared = 0
        self._array: np.ndarray | None = None
        self._export: Export | None = None

    def attach(self, pool) -> int:
        if not isinstance(pool, (memoryview, bytearray, np.ndarray)):
            raise ValueError(f"cuda_ipc needs the KV pool on a CUDA device (--device cuda), got {type(pool).__name__}")
        self._array = np.frombuffer(pool, dtype=np.uint8) if not isinstance(pool, np.ndarray) else pool.view(np.uint8)
        if not self._array.size:
            raise ValueError("cuda_ipc needs a non-empty pool")
        return self._array.size

    def uuid(self) -> str:
        return self.device_uuid

    def export(self) -> Export:
        if self._export is None:
            n = self._array.size
            self._export = Export(0, self.registry.add(self._array), n, 0, b"", 0, b"", False, 0, n)
        return self._export

    def open(self, export: Export) -> np.ndarray:
        array = self.registry.get(export.handle)
        if export.base + export.nbytes > array.size:
            raise DeviceError("cannot open the sender's handle: the pool it names is larger than its memory")
        return array[export.base: export.base + export.nbytes]

    def mark(self) -> threading.Event:
        return self.gate

    def shared_mark(self) -> tuple[threading.Event, bytes]:
        return self.gate, self.registry.add_mark(self.gate)

    def open_mark(self, handle: bytes) -> threading.Event:
        return self.registry.get_mark(handle)

    def passed(self, mark: threading.Event) -> bool:
        return mark.is_set()

    def wait(self, mark: threading.Event) -> None:
        self.waiting.set()
        mark.wait()

    def prepare(self, peer: np.ndarray, pieces: Sequence[Piece]):
        self.prepared += 1
        return peer, (pieces.tolist() if isinstance(pieces, np.ndarray) else list(pieces))

    def copy(self, prepared, after, timed: bool = False) -> CopyTimes | None:
        peer, pieces = prepared
        if after is not None:
            after.wait()
        start = time.perf_counter_ns()
        for s, d, n in pieces:
            self._array[d: d + n] = peer[s: s + n]
            self.copies += 1
        end = time.perf_counter_ns()
        return CopyTimes(start, end, (end - start) / 1e9) if timed else None

    def close(self) -> None:
        if self._array is not None:
            self.registry.drop(self._array)
