"""Transfers between one pair do not wait for each other (tcp and shm): a sender moves up to ``LANES`` at
once to one peer, each on a lane of its own (a thread and a connection, ``sender.Senders``).

Real backends over real sockets and shared memory, one sender and one receiver in this process. A large
transfer is held in flight by holding the receiver's lock of that transfer (white box: the receiver reads
or copies every piece under it, so it stops before its next piece and the sender cannot finish without
its ack); what the other transfers do meanwhile is asserted on the tokens' states, never on time.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from xpyd.transfer import make_backend
from xpyd.transfer.auth import new_secret
from xpyd.transfer.base import Region, TransferState
from xpyd.transfer.sender import LANES

SECRET = new_secret()
SIZE = 40 << 20
LARGE = 8 << 20  # (any size: held, it cannot finish)
SMALL = 64 << 10
TIMEOUT = 20.0
S = TransferState


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("xpyd-tcp", "xpyd-shm"))]


class Side:
    def __init__(self, name: str, data: bytes | None = None) -> None:
        self.backend = make_backend(name, host="127.0.0.1", io_timeout=30.0, lanes=LANES)
        mem = self.backend.allocate(SIZE) if name == "shm" else None
        self.buf = mem if mem is not None else memoryview(bytearray(SIZE))
        self.buf[:] = data if data is not None else bytes(SIZE)
        self.desc = self.backend.register(self.buf)
        self.address = self.desc.offer(name)


@pytest.fixture(params=["tcp", "shm"])
def pair(request):
    a, b = Side(request.param, random.Random(2).randbytes(SIZE)), Side(request.param)
    held: list[threading.Lock] = []
    yield a, b, held
    for lock in held:
        if lock.locked():
            lock.release()
    a.backend.close()
    b.backend.close()
    assert a.backend.outstanding() == set() and b.backend.outstanding() == set()
    deadline = time.monotonic() + 5
    while _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() == []  # close() stopped every lane and reader


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _start(a: Side, b: Side, tid: str, offset: int, length: int):
    region = [Region(offset, length)]
    rtok = b.backend.expect(tid, region, secret=SECRET)
    return a.backend.send(tid, region, b.desc, region, secret=SECRET), rtok


def _start_held(a: Side, b: Side, held: list, tid: str, offset: int):
    """A large transfer whose receiver has taken it and stops before its first piece: in flight until released."""
    region = [Region(offset, LARGE)]
    rtok = b.backend.expect(tid, region, secret=SECRET)
    lock = b.backend._endpoint.expected._recs[tid].lock
    lock.acquire()
    held.append(lock)
    stok = a.backend.send(tid, region, b.desc, region, secret=SECRET)
    _wait_for(lambda: rtok.state() is S.TRANSFERRING, f"{tid} to start")
    return stok, rtok, lock


def _landed(a: Side, b: Side, offset: int, length: int) -> bool:
    return bytes(b.buf[offset:offset + length]) == bytes(a.buf[offset:offset + length])


def test_a_small_transfer_overtakes_a_large_one_to_the_same_peer(pair):
    a, b, held = pair
    big, big_r, lock = _start_held(a, b, held, "large", 0)
    small, small_r = _start(a, b, "small", LARGE, SMALL)
    assert small.wait(TIMEOUT) and small.state() is S.DONE and small_r.state() is S.DONE
    assert _landed(a, b, LARGE, SMALL)
    assert big.state() is S.TRANSFERRING and big_r.state() is S.TRANSFERRING  # still in flight
    assert a.backend._endpoint.senders.lanes(b.address) == 2
    lock.release()
    assert big.wait(TIMEOUT) and big.state() is S.DONE and big_r.state() is S.DONE
    assert _landed(a, b, 0, LARGE)


def test_a_pair_with_one_transfer_at_a_time_keeps_one_lane(pair):
    a, b, _ = pair
    for i in range(5):
        tok, rtok = _start(a, b, f"t{i}", i * SMALL, SMALL)
        assert tok.wait(TIMEOUT) and tok.state() is S.DONE and rtok.state() is S.DONE
    assert _landed(a, b, 0, 5 * SMALL)
    assert a.backend._endpoint.senders.lanes(b.address) == 1


def test_at_most_LANES_transfers_move_at_once_and_the_next_takes_the_first_lane_that_frees(pair):
    a, b, held = pair
    larges = [_start_held(a, b, held, f"large{i}", i * LARGE) for i in range(LANES)]
    small, small_r = _start(a, b, "small", LANES * LARGE, SMALL)
    assert a.backend._endpoint.senders.lanes(b.address) == LANES  # no lane beyond the bound
    assert small.state() is S.PENDING and small_r.state() is S.PENDING  # every lane is held: it waits
    first, _, lock = larges[2]
    lock.release()
    assert first.wait(TIMEOUT) and first.state() is S.DONE
    assert small.wait(TIMEOUT) and small.state() is S.DONE and _landed(a, b, LANES * LARGE, SMALL)
    assert all(tok.state() is S.TRANSFERRING for i, (tok, _, _) in enumerate(larges) if i != 2)
    for _, _, lock in larges:
        if lock.locked():
            lock.release()
    for tok, rtok, _ in larges:
        assert tok.wait(TIMEOUT) and tok.state() is S.DONE and rtok.state() is S.DONE
    assert _landed(a, b, 0, LANES * LARGE)


def test_aborting_a_large_transfer_fails_it_alone_and_the_pair_goes_on(pair):
    a, b, held = pair
    big, big_r, lock = _start_held(a, b, held, "large", 0)
    small, _ = _start(a, b, "small", LARGE, SMALL)
    assert small.wait(TIMEOUT) and small.state() is S.DONE
    a.backend.abort("large")  # both sides drop it, as the engines do
    aborting = threading.Thread(target=b.backend.abort, args=("large",))  # (it waits out the held piece)
    aborting.start()
    _wait_for(big_r.failed, "the receiver's abort")
    lock.release()
    aborting.join(TIMEOUT)
    assert big.state() is S.FAILED and big.error == "aborted" and big_r.error == "aborted"
    assert a.backend.outstanding() == set() and b.backend.outstanding() == set()
    for i in range(2):  # the pair goes on (the aborted transfer's lane reconnects)
        tok, rtok = _start(a, b, f"after{i}", i * SMALL, SMALL)
        assert tok.wait(TIMEOUT) and tok.state() is S.DONE and rtok.state() is S.DONE
    assert _landed(a, b, 0, 2 * SMALL)


def test_close_fails_every_transfer_on_every_lane_and_in_the_queue(pair):
    a, b, held = pair
    larges = [_start_held(a, b, held, f"large{i}", i * LARGE) for i in range(LANES)]
    queued, _ = _start(a, b, "queued", LANES * LARGE, SMALL)
    a.backend.close()  # (the fixture then checks that every lane's thread is gone)
    for tok in [t for t, _, _ in larges] + [queued]:
        assert tok.state() is S.FAILED and tok.error == "backend closed"
