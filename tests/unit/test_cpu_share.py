"""The host CPU board: workers take the cores the others leave idle, one each when all are busy."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from xpyd.worker import cpu_share
from xpyd.worker.cpu_share import SLOTS, CpuShare, board_path, remove_board


@pytest.fixture()
def name(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_share, "BOARD_DIR", tmp_path)
    return "test-board"


def _peer_busy(share: CpuShare, slot: int, pid: int, ago: float = 0.0) -> None:
    """Another worker's slot on the same board: its pid and when it last ran."""
    cpu_share._SLOT.pack_into(share._map, slot * cpu_share._SLOT.size, pid, time.monotonic_ns() - int(ago * 1e9))


def test_alone_takes_every_core_and_busy_peers_take_one_each(name):
    a = CpuShare(name, cores=4, window=0.5)
    assert a.slot == 0 and CpuShare(name, cores=4).slot == 0  # the same process reuses its slot
    assert a.threads() == 4
    _peer_busy(a, 1, os.getppid())
    assert a.threads() == 3
    _peer_busy(a, 2, os.getppid())
    assert a.threads() == 2
    _peer_busy(a, 3, os.getppid())
    _peer_busy(a, 4, os.getppid())
    assert a.threads() == 1  # never below one
    a.mark_busy()
    assert a.busy_others() == 4  # our own slot never counts


def test_busy_expires_after_the_window(name):
    a = CpuShare(name, cores=2, window=0.05)
    _peer_busy(a, 1, os.getppid())
    assert a.busy_others() == 1 and a.threads() == 1
    time.sleep(0.08)
    assert a.busy_others() == 0
    assert a.threads() == 2
    _peer_busy(a, 1, os.getppid(), ago=0.2)
    assert a.threads() == 2


def test_max_threads_caps(name):
    assert CpuShare(name, max_threads=1, cores=8).threads() == 1


def _child(name: str, board_dir, queue) -> None:
    cpu_share.BOARD_DIR = board_dir
    share = CpuShare(name, cores=2, window=5.0)
    share.mark_busy()
    queue.put(share.slot)


def test_other_process_gets_its_own_slot_and_a_dead_ones_slot_is_reused(name, tmp_path):
    mine = CpuShare(name, cores=2, window=5.0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, tmp_path, queue))
    proc.start()
    child_slot = queue.get(timeout=60)
    proc.join(timeout=60)
    assert child_slot != mine.slot
    assert mine.busy_others() == 1 and mine.threads() == 1  # the child marked itself busy just now
    # the child is dead: the next claimant that is not us takes its slot
    mine.pid = -1
    assert mine._claim() == child_slot


def test_board_file_size_and_cleanup(name):
    share = CpuShare(name, cores=2)
    path = board_path(name)
    assert path.stat().st_size == SLOTS * 16
    share.close()
    remove_board(name)
    assert not path.exists()
    remove_board(name)  # twice is fine


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "x" * 65, "sp ace"])
def test_bad_names_are_refused(bad):
    with pytest.raises(ValueError):
        board_path(bad)


def test_slot_of_a_dead_pid_is_claimed(name):
    first = CpuShare(name, cores=2)
    # pretend slot 0 belongs to a process that no longer exists
    dead = 2**22 + 12345
    while True:
        try:
            os.kill(dead, 0)
            dead += 1
        except ProcessLookupError:
            break
    cpu_share._SLOT.pack_into(first._map, 0, dead, time.monotonic_ns())
    first.pid = -1  # so _claim does not match on our own pid
    assert first._claim() == 0


def test_sweep_removes_only_boards_nobody_alive_holds(name, tmp_path):
    from xpyd.worker.cpu_share import sweep_stale_boards

    live = CpuShare(name, cores=2)  # this process holds a slot
    dead = tmp_path / "xpyd-cpu-dead"
    dead.write_bytes(cpu_share._SLOT.pack(2**22 + 7777, 1) + bytes(SLOTS * 16 - 16))  # a pid that is gone
    empty = tmp_path / "xpyd-cpu-empty"
    empty.write_bytes(bytes(SLOTS * 16))
    other = tmp_path / "unrelated"
    other.write_bytes(b"x")
    assert sorted(p.name for p in sweep_stale_boards()) == ["xpyd-cpu-dead", "xpyd-cpu-empty"]
    assert board_path(name).exists() and other.exists()
    live.close()
    assert [p.name for p in sweep_stale_boards()] == [f"xpyd-cpu-{name}"]  # closed: our slot is free


def test_a_hold_keeps_a_worker_busy_past_the_window_until_it_marks_or_expires(name, monkeypatch):
    """A forward pass holds its slot (one prefill layer of a long prompt can outlast the window)."""
    mine = CpuShare(name, cores=2, window=0.05)
    with monkeypatch.context() as m:
        m.setattr(cpu_share.os, "getpid", lambda: 2**31 - 5)  # another worker, on another slot
        other = CpuShare(name, cores=2, window=0.05)
    assert other.slot != mine.slot
    other.hold(seconds=5.0)
    time.sleep(0.15)  # three windows, no new mark
    assert mine.threads() == 1  # still busy: its forward pass has not ended
    other.mark_busy()  # the forward pass ended
    assert mine.threads() == 1
    time.sleep(0.15)
    assert mine.threads() == 2
    other.hold(seconds=0.1)  # a holder that died mid-pass counts as busy only until the hold runs out
    assert mine.threads() == 1
    time.sleep(0.25)
    assert mine.threads() == 2
