"""ParallelCopy: large pieces split over threads, every byte exactly once, and copy() returns only after
every part landed (the shm receiver relies on that to keep its abort guarantee)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from xpyd.transfer import parallel_copy
from xpyd.transfer.parallel_copy import ParallelCopy


def _pattern(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


def _recording(monkeypatch) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []
    real = np.copyto

    def copyto(dst, src):
        calls.append((threading.current_thread().name, len(src)))
        real(dst, src)

    monkeypatch.setattr(parallel_copy.np, "copyto", copyto)
    return calls


@pytest.mark.parametrize("n", [1 << 16, (1 << 16) + 12345, 3 * (1 << 16) - 1])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_byte_lands_once_at_its_offset(n, threads):
    copier = ParallelCopy(threads, min_split=4096 * threads)
    try:
        src, dst = _pattern(n), np.zeros(n + 64, dtype=np.uint8)
        copier.copy(dst[32:32 + n], src)
        assert np.array_equal(dst[32:32 + n], src)
        assert not dst[:32].any() and not dst[32 + n:].any()
    finally:
        copier.close()


def test_large_pieces_are_split_over_helper_threads_and_small_ones_copied_inline(monkeypatch):
    calls = _recording(monkeypatch)
    copier = ParallelCopy(2, min_split=1 << 20)
    try:
        src, dst = _pattern(3 << 20), np.zeros(3 << 20, dtype=np.uint8)
        copier.copy(dst, src)
        me = threading.current_thread().name
        assert sorted(n for _, n in calls) == [3 << 19, 3 << 19]  # two page-aligned halves
        assert {name for name, _ in calls if name != me} and any(name == me for name, _ in calls)
        assert all(name == me or name.startswith("xpyd-copy") for name, _ in calls)
        calls.clear()
        copier.copy(dst[: (1 << 20) - 1], src[: (1 << 20) - 1])  # below min_split: one inline copy
        assert calls == [(me, (1 << 20) - 1)]
        assert np.array_equal(dst, src)
    finally:
        copier.close()
    calls.clear()
    copier.copy(dst, src)  # closed: inline, still correct
    assert calls == [(threading.current_thread().name, 3 << 20)]


def test_copy_waits_for_the_helper_parts_even_when_its_own_part_fails(monkeypatch):
    real = np.copyto
    helper_done = threading.Event()

    def copyto(dst, src):
        if threading.current_thread().name.startswith("xpyd-copy"):
            threading.Event().wait(0.2)  # a slow helper part
            real(dst, src)
            helper_done.set()
        else:
            raise MemoryError("own part failed")

    monkeypatch.setattr(parallel_copy.np, "copyto", copyto)
    copier = ParallelCopy(2, min_split=8192)
    try:
        with pytest.raises(MemoryError, match="own part failed"):
            copier.copy(np.zeros(1 << 16, dtype=np.uint8), _pattern(1 << 16))
        assert helper_done.is_set()  # no helper still writing once copy() has returned
    finally:
        copier.close()


def test_a_failing_helper_part_is_raised_to_the_caller(monkeypatch):
    real = np.copyto

    def copyto(dst, src):
        if threading.current_thread().name.startswith("xpyd-copy"):
            raise ValueError("helper failed")
        real(dst, src)

    monkeypatch.setattr(parallel_copy.np, "copyto", copyto)
    copier = ParallelCopy(2, min_split=8192)
    try:
        with pytest.raises(ValueError, match="helper failed"):
            copier.copy(np.zeros(1 << 16, dtype=np.uint8), _pattern(1 << 16))
    finally:
        copier.close()


def test_bad_arguments_are_refused():
    for threads in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="copy threads"):
            ParallelCopy(threads)
    with pytest.raises(ValueError, match="min_split"):
        ParallelCopy(2, min_split=4096)
    with pytest.raises(ValueError, match="copy of 10 bytes into 9"):
        ParallelCopy(1).copy(np.zeros(9, np.uint8), np.zeros(10, np.uint8))
