"""nixl: UCX moves only when someone calls into NIXL, and the engine's loop is who does (``progress()``).

Each backend here is built with ``fallback_progress=None``, so its own threads never step in on a timer:
whatever moves, moves because a test thread called ``progress()`` the way an engine loop does (every
millisecond) or because an abort asked a reader to finish its READ. Real agents, real UCX, one host.

What needs the target's progress depends on UCX's transport: connection set-up always does; on one
host UCX then reads with cma (``process_vm_readv``), which needs no call from the target, while over
UCX's tcp transport (``UCX_TLS=tcp``, what two hosts without RDMA get) every READ does.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from contextlib import contextmanager

import pytest

from xpyd.transfer import make_backend
from xpyd.transfer.base import Region, TransferState
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                reason="NIXL is not installed (pip install --no-deps nixl nixl-cu13)")

SIZE = 4 << 20
TIMEOUT = 10.0
STALL = 0.8  # how long a transfer is watched not moving


class Side:
    def __init__(self, fill: int, io_timeout: float = TIMEOUT) -> None:
        self.backend = make_backend("nixl", io_timeout=io_timeout, fallback_progress=None)
        self.buf = memoryview(bytearray([fill]) * SIZE)
        self.desc = self.backend.register(self.buf)


@pytest.fixture
def pair():
    a, b = Side(0x11), Side(0x00)
    a.buf[:] = bytes(range(256)) * (SIZE // 256)
    yield a, b
    a.backend.close()
    b.backend.close()
    assert a.backend.outstanding() == set() and b.backend.outstanding() == set()


@contextmanager
def engine_loop(side: Side):
    """What an engine does while a transfer is in flight: call ``progress()`` every millisecond."""
    stop = threading.Event()

    def run():
        while not stop.is_set():
            side.backend.progress()
            time.sleep(0.001)

    t = threading.Thread(target=run, name="test-engine-loop", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def _start(a: Side, b: Side, tid: str, n: int = SIZE):
    rtok = b.backend.expect(tid, [Region(0, n)], secret=SECRET)
    stok = a.backend.send(tid, [Region(0, n)], b.desc, [Region(0, n)], secret=SECRET)
    return stok, rtok


def _stalls(*tokens) -> bool:
    time.sleep(STALL)
    return not any(t.finished() for t in tokens)


def test_a_transfer_waits_for_the_senders_engine_loop(pair):
    a, b = pair
    with engine_loop(b):
        stok, rtok = _start(a, b, "first")
        assert _stalls(stok, rtok)  # the receiver's READ waits for the sender's agent (connection set-up)
        assert rtok.state() is TransferState.TRANSFERRING
        with engine_loop(a):
            assert stok.wait(TIMEOUT) and rtok.wait(TIMEOUT)
    assert stok.done() and rtok.done()
    assert bytes(b.buf) == bytes(a.buf)


@pytest.fixture
def tcp_pair(monkeypatch):
    """A pair over UCX's tcp transport (read from the environment when an agent is created), connected:
    from here on a READ moves only while both sides call into NIXL."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    a, b = Side(0x11), Side(0x00)
    a.buf[:] = bytes(range(256)) * (SIZE // 256)
    try:
        with engine_loop(a), engine_loop(b):  # connection set-up
            stok, rtok = _start(a, b, "setup", 4096)
            assert stok.wait(TIMEOUT) and rtok.wait(TIMEOUT) and rtok.done()
        yield a, b
    finally:
        a.backend.close()
        b.backend.close()
    assert a.backend.outstanding() == set() and b.backend.outstanding() == set()


def test_over_ucx_tcp_every_read_needs_both_engine_loops(tcp_pair):
    a, b = tcp_pair
    stok, rtok = _start(a, b, "read")
    with engine_loop(b):
        assert _stalls(stok, rtok)  # the target (sender) must serve the emulated READ
    with engine_loop(a):
        assert _stalls(stok, rtok)  # and the reader must take its data in
    with engine_loop(a), engine_loop(b):
        assert stok.wait(TIMEOUT) and rtok.wait(TIMEOUT)
    assert stok.done() and rtok.done()
    assert bytes(b.buf) == bytes(a.buf)


def test_receiver_abort_finishes_the_read_without_the_engine(tcp_pair):
    a, b = tcp_pair
    with engine_loop(a):
        stok, rtok = _start(a, b, "ab")
        assert _stalls(rtok)  # READ posted; nobody checks it on the receiver (its engine is "busy": this test)
        assert rtok.state() is TransferState.TRANSFERRING
        t0 = time.monotonic()
        b.backend.abort("ab")  # the engine thread's abort: the reader checks its READ itself and lets go
        assert time.monotonic() - t0 < 5.0  # not the 10 s io_timeout
        assert rtok.failed() and rtok.error == "aborted"
        assert stok.wait(TIMEOUT) and stok.failed() and "aborted by the receiver" in stok.error


def test_progress_never_waits_for_the_agent(pair):
    a, _ = pair
    with a.backend._agent._lock:  # a backend thread inside NIXL
        t0 = time.monotonic()
        a.backend.progress()
        assert time.monotonic() - t0 < 1.0  # (waiting for the lock this thread holds would never return)


def test_without_any_progress_timeouts_fire_and_close_works():
    a, b = Side(0x11, io_timeout=1.0), Side(0x00, io_timeout=1.0)
    try:
        stok, rtok = _start(a, b, "stuck")
        t0 = time.monotonic()
        assert stok.wait(TIMEOUT) and rtok.wait(TIMEOUT)
        assert time.monotonic() - t0 < 5.0
        assert stok.failed() and rtok.failed() and "no progress within 1s" in rtok.error
        stok, rtok = _start(a, b, "closed-under-it")
        assert _stalls(stok, rtok)
        t0 = time.monotonic()
        b.backend.close()
        a.backend.close()
        assert time.monotonic() - t0 < 5.0
        assert stok.failed() and rtok.failed()
    finally:
        a.backend.close()
        b.backend.close()
