"""Workers on the same cores lend each other the cores they are not using.

With prefill and decode workers sharing a host (`xpyd up`, one small box), fixed thread counts waste
the machine: one thread each leaves a core idle whenever the other role has nothing to do, and two
threads each make both slow down badly when they run at the same time (an OpenMP region waits for
its slowest thread, and that thread is sharing a core). So each worker on the host takes
`cores - (other workers busy right now)` threads, at least 1, re-decided before every decode step
and every prefill layer: alone it uses the whole machine, side by side each keeps its own core.

The "board" is a small file in /dev/shm (a shared page): one slot per worker holding its pid and
when it last ran a forward pass (CLOCK_MONOTONIC, the same clock in every process). A worker counts
as busy while that time is less than `window` old. No locks: each worker writes only its own slot,
and an aligned 8-byte store is read whole. The launcher removes the file when the cluster stops and, at
start, any board no live process holds (`sweep_stale_boards`); a slot of a dead process is reused.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import time
from pathlib import Path

SLOTS = 64
_SLOT = struct.Struct("<qq")  # pid, last active (monotonic ns)
HOLD = 2.0  # seconds a running forward pass counts as busy without a further mark
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
BOARD_DIR = Path("/dev/shm")


def board_path(name: str) -> Path:
    if not _NAME.fullmatch(name):
        raise ValueError(f"CPU share name must match {_NAME.pattern}, not {name!r}")
    return BOARD_DIR / f"xpyd-cpu-{name}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CpuShare:
    """This process's slot on the board of `name`; `threads()` is how many threads to use now."""

    def __init__(self, name: str, max_threads: int | None = None, cores: int | None = None,
                 window: float = 0.03) -> None:
        self.cores = cores or len(os.sched_getaffinity(0))
        self.max_threads = max_threads or self.cores
        if self.cores < 1 or self.max_threads < 1:
            raise ValueError("cores and max_threads must be >= 1")
        self.window_ns = int(window * 1e9)
        self.path = board_path(name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < SLOTS * _SLOT.size:
                os.ftruncate(fd, SLOTS * _SLOT.size)
            self._map = mmap.mmap(fd, SLOTS * _SLOT.size)
        finally:
            os.close(fd)
        self.pid = os.getpid()
        self.slot = self._claim()

    def _claim(self) -> int:
        for i in range(SLOTS):
            pid, _ = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid == self.pid or pid == 0 or not _alive(pid):
                _SLOT.pack_into(self._map, i * _SLOT.size, self.pid, 0)
                return i
        raise RuntimeError(f"CPU share board {self.path} is full ({SLOTS} workers)")

    def mark_busy(self) -> None:
        """Busy now (and for `window` after): the end of a forward pass."""
        struct.pack_into("<q", self._map, self.slot * _SLOT.size + 8, time.monotonic_ns())

    def hold(self, seconds: float = HOLD) -> None:
        """Busy until `seconds` from now, or until the next `mark_busy`: a forward pass is running.

        A prefill layer of a long prompt on one core takes longer than `window`; marking only when a
        layer starts let the other worker see us idle mid-layer and take both cores (measured: the
        prefill-stall scenario's stream ITL p99 went to ~1.8 s). A process killed mid-hold counts as
        busy for at most `seconds`.
        """
        struct.pack_into("<q", self._map, self.slot * _SLOT.size + 8, time.monotonic_ns() + int(seconds * 1e9))

    def busy_others(self) -> int:
        now = time.monotonic_ns()
        busy = 0
        for i in range(SLOTS):
            if i == self.slot:
                continue
            pid, last = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid and now - last < self.window_ns:
                busy += 1
        return busy

    def threads(self) -> int:
        return max(1, min(self.max_threads, self.cores - self.busy_others()))

    def close(self) -> None:
        if self._map is not None:
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0)
            self._map.close()
            self._map = None


def remove_board(name: str) -> None:
    try:
        board_path(name).unlink()
    except FileNotFoundError:
        pass


def sweep_stale_boards() -> list[Path]:
    """Remove boards no live process holds a slot on (left by a launcher that was SIGKILLed)."""
    removed = []
    for path in BOARD_DIR.glob("xpyd-cpu-*"):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        pids = [_SLOT.unpack_from(data, i * _SLOT.size)[0] for i in range(len(data) // _SLOT.size)]
        if not any(pid and _alive(pid) for pid in pids):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed
