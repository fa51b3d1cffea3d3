"""The TransferBackend contract, run against every backend available on this machine.

Real sockets, real threads, real shared memory; the peer-death tests use a real child process that is
SIGKILLed. Each test checks exact bytes, token states, and that nothing is left behind (outstanding
transfers, threads, shared-memory segments).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest

from tests.cluster import has_ipv6_loopback
from xpyd.transfer import make_backend
from xpyd.transfer.base import BackendDescriptor, Region, TransferError, TransferState, expect_parts
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one

SIZE = 6 << 20
FILL = 0xAA
TIMEOUT = 10.0


def _nixl_skip() -> str | None:
    if importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed (pip install --no-deps nixl nixl-cu13)"
    return None


BACKENDS = [
    "tcp",
    "shm",
    "auto",
    pytest.param("nixl", marks=pytest.mark.skipif(_nixl_skip() is not None, reason=str(_nixl_skip()))),
]


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"xpyd-kv-{os.getpid()}-")}


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("xpyd-tcp", "xpyd-shm", "xpyd-nixl"))]


class Side:
    """One backend with a registered buffer (from the backend when it places its own memory)."""

    def __init__(self, name: str, data: bytes | None = None, host: str = "127.0.0.1") -> None:
        self.backend = make_backend(name, host=host, io_timeout=5.0)
        allocate = getattr(self.backend, "allocate", None)
        mem = allocate(SIZE) if allocate is not None else None
        self.buf = mem if mem is not None else memoryview(bytearray(SIZE))
        self.buf[:] = data if data is not None else bytes([FILL]) * SIZE
        self.desc = self.backend.register(self.buf)

    def bytes(self) -> bytes:
        return bytes(self.buf)


@pytest.fixture(params=BACKENDS)
def name(request):
    before = _segments()
    yield request.param
    deadline = time.monotonic() + 3
    while _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() == []
    assert _segments() - before == set()  # every segment of a closed backend is unlinked


@pytest.fixture
def pair(name):
    a, b = Side(name, random.Random(1).randbytes(SIZE)), Side(name)
    yield a, b
    a.backend.close()
    b.backend.close()
    assert a.backend.outstanding() == set() and b.backend.outstanding() == set()


def _landed(src_buf: bytes, src, dst) -> bytes:
    """What a FILL buffer looks like after ``src`` of ``src_buf`` landed at ``dst``."""
    payload = b"".join(src_buf[r.offset : r.end] for r in src)
    out, pos = bytearray([FILL]) * SIZE, 0
    for r in dst:
        out[r.offset : r.end] = payload[pos : pos + r.length]
        pos += r.length
    return bytes(out)


def _transfer(a: Side, b: Side, tid: str, src, dst):
    rtok = b.backend.expect(tid, dst, secret=SECRET)
    stok = a.backend.send(tid, src, b.desc, dst, secret=SECRET)
    return stok, rtok


def test_many_regions_land_exactly(pair):
    a, b = pair
    src = [Region(7, 70_000), Region(1 << 20, (2 << 20) + 5), Region(SIZE - 100, 100)]
    total = 70_000 + (2 << 20) + 105
    dst = [Region(SIZE - 1_000_000, 1_000_000), Region(1000, 300), Region(2 << 20, total - 1_000_300)]
    stok, rtok = _transfer(a, b, "many", src, dst)
    assert stok.wait(TIMEOUT) and rtok.wait(TIMEOUT)
    assert (stok.state(), rtok.state()) == (TransferState.DONE, TransferState.DONE)
    assert b.bytes() == _landed(a.bytes(), src, dst)
    assert a.backend.outstanding() == set() and b.backend.outstanding() == set()


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
def test_a_transfer_over_the_ipv6_loopback(name):
    a, b = Side(name, random.Random(2).randbytes(SIZE), host="::1"), Side(name, host="::1")
    try:
        assert a.desc.address.startswith("[::1]:") and b.desc.address.startswith("[::1]:")
        src, dst = [Region(0, 1 << 20)], [Region(SIZE - (1 << 20), 1 << 20)]
        stok, rtok = _transfer(a, b, "v6", src, dst)
        assert stok.wait(TIMEOUT) and rtok.wait(TIMEOUT)
        assert (stok.state(), rtok.state()) == (TransferState.DONE, TransferState.DONE)
        assert b.bytes() == _landed(a.bytes(), src, dst)
    finally:
        a.backend.close()
        b.backend.close()


def test_finished_tokens_wake_their_waiters_without_being_polled(pair):
    """Backends whose threads move the bytes (``progress_tick`` None) finish tokens by themselves and fire
    ``on_finish``: an engine can sleep until then. A backend that needs ``progress()`` gets it here."""
    a, b = pair
    sent, landed = threading.Event(), threading.Event()
    stok, rtok = _transfer(a, b, "woken", [Region(0, 1 << 20)], [Region(4096, 1 << 20)])
    stok.on_finish(sent.set)
    rtok.on_finish(landed.set)
    deadline = time.monotonic() + TIMEOUT
    while not (sent.is_set() and landed.is_set()) and time.monotonic() < deadline:
        for side in (a, b):
            if side.backend.progress_tick is not None:
                side.backend.progress()
        (sent if not sent.is_set() else landed).wait(0.01)  # (no token is read while waiting)
    assert sent.is_set() and landed.is_set()
    assert stok.done() and rtok.done()


def test_sender_done_implies_receiver_done(pair):
    a, b = pair
    for i in range(20):
        stok, rtok = _transfer(a, b, f"t{i}", [Region(i * 4096, 4096)], [Region(i * 8192, 4096)])
        assert stok.wait(TIMEOUT) and stok.done()
        assert rtok.done()  # no wait: the receiver finished before it acknowledged


def test_concurrent_transfers_all_land(pair):
    a, b = pair
    n, size = 32, 64 << 10
    toks = [_transfer(a, b, f"c{i}", [Region(i * size, size)], [Region(SIZE - (i + 1) * size, size)])
            for i in range(n)]
    for stok, rtok in toks:
        assert stok.wait(TIMEOUT) and rtok.wait(TIMEOUT) and stok.done() and rtok.done()
    want = bytearray([FILL]) * SIZE
    src = a.bytes()
    for i in range(n):
        want[SIZE - (i + 1) * size : SIZE - i * size] = src[i * size : (i + 1) * size]
    assert b.bytes() == bytes(want)


def test_polling_never_blocks_and_states_only_move_forward(pair):
    a, b = pair
    stok, rtok = _transfer(a, b, "poll", [Region(0, SIZE)], [Region(0, SIZE)])
    seen = []
    deadline = time.monotonic() + TIMEOUT
    while not (stok.finished() and rtok.finished()) and time.monotonic() < deadline:
        t0 = time.monotonic()
        s = (stok.state(), rtok.state())
        assert time.monotonic() - t0 < TIMEOUT / 5  # a poll is a read, not a wait (for the transfer)
        if not seen or seen[-1] != s:
            seen.append(s)
        time.sleep(0.0005)
    assert (stok.state(), rtok.state()) == (TransferState.DONE, TransferState.DONE)
    for (s0, r0), (s1, r1) in zip(seen, seen[1:]):
        assert s1 >= s0 and r1 >= r0
    assert b.bytes() == a.bytes()


def test_receiver_abort_refuses_the_bytes(pair):
    a, b = pair
    rtok = b.backend.expect("ab", [Region(0, 4096)], secret=SECRET)
    b.backend.abort("ab")
    assert rtok.state() is TransferState.FAILED and rtok.error == "aborted"
    assert b.backend.outstanding() == set()
    stok = a.backend.send("ab", [Region(0, 4096)], b.desc, [Region(0, 4096)], secret=SECRET)
    assert stok.wait(TIMEOUT) and stok.failed() and "unexpected transfer id" in stok.error
    assert b.bytes() == bytes([FILL]) * SIZE
    b.backend.abort("never-heard-of")  # unknown: a no-op
    b.backend.abort("ab")  # twice: a no-op


def test_a_failed_part_withdraws_the_other_parts_of_its_receive(pair):
    """A receive in parts (a streamed pull) whose part 1 fails (its sender named other regions): once the
    receive reads FAILED, part 2 is no longer expected, so its sender is refused and none of it lands."""
    a, b = pair
    parts = [(f"parts.{i}", [Region(i * 4096, 4096)]) for i in range(3)]
    recv = expect_parts(b.backend, "parts", parts, secret=SECRET)
    first = a.backend.send("parts.0", [Region(0, 4096)], b.desc, [Region(0, 4096)], secret=SECRET)
    assert first.wait(TIMEOUT) and first.done()
    bad = a.backend.send("parts.1", [Region(0, 4096)], b.desc, [Region(0, 4096)], secret=SECRET)
    assert bad.wait(TIMEOUT) and bad.failed() and "differ" in bad.error
    assert recv.failed() and "differ" in recv.error
    assert b.backend.outstanding() == set()
    before = b.bytes()
    late = a.backend.send("parts.2", [Region(8192, 4096)], b.desc, [Region(8192, 4096)], secret=SECRET)
    assert late.wait(TIMEOUT) and late.failed() and "unexpected transfer id" in late.error
    assert b.bytes() == before and before[8192:12288] == bytes([FILL]) * 4096


def test_abort_after_done_changes_nothing(pair):
    a, b = pair
    stok, rtok = _transfer(a, b, "fin", [Region(0, 10)], [Region(0, 10)])
    assert stok.wait(TIMEOUT) and rtok.wait(TIMEOUT)
    a.backend.abort("fin")
    b.backend.abort("fin")
    assert stok.done() and rtok.done()


def test_bad_regions_and_ids_raise_at_the_call(pair):
    a, b = pair
    bad = [
        ([Region(SIZE - 10, 11)], [Region(0, 11)]),  # src outside the buffer
        ([Region(0, 10)], [Region(SIZE, 10)]),  # dst outside the peer's buffer
        ([Region(0, 10)], [Region(0, 11)]),  # totals differ
        ([], [Region(0, 10)]),
        (Region(0, 10), [Region(0, 10)]),  # not a sequence
    ]
    for src, dst in bad:
        with pytest.raises(ValueError):
            a.backend.send("bad", src, b.desc, dst, secret=SECRET)
    with pytest.raises(ValueError):
        b.backend.expect("bad", [Region(SIZE - 1, 2)], secret=SECRET)
    with pytest.raises(ValueError):
        b.backend.expect("", [Region(0, 2)], secret=SECRET)
    with pytest.raises(ValueError):
        b.backend.expect("x" * 1000, [Region(0, 2)], secret=SECRET)
    b.backend.expect("dup", [Region(0, 2)], secret=SECRET)
    with pytest.raises(TransferError):
        b.backend.expect("dup", [Region(0, 2)], secret=SECRET)
    b.backend.abort("dup")
    assert a.backend.outstanding() == set() and b.backend.outstanding() == set()


def test_region_mismatch_fails_both_sides(pair):
    a, b = pair
    rtok = b.backend.expect("mm", [Region(0, 100)], secret=SECRET)
    stok = a.backend.send("mm", [Region(0, 100)], b.desc, [Region(100, 100)], secret=SECRET)
    assert stok.wait(TIMEOUT) and stok.failed() and rtok.wait(TIMEOUT) and rtok.failed()
    assert "differ" in rtok.error
    assert b.bytes() == bytes([FILL]) * SIZE


def test_unknown_peer_fails_fast(name):
    a = Side(name)
    try:
        dead = Side(name)
        desc = dead.desc
        dead.backend.close()  # its listener is gone
        t0 = time.monotonic()
        stok = a.backend.send("nobody", [Region(0, 100)], desc, [Region(0, 100)], secret=SECRET)
        assert stok.wait(TIMEOUT) and stok.failed() and stok.error
        assert time.monotonic() - t0 < TIMEOUT
        assert a.backend.outstanding() == set()
        with pytest.raises(ValueError):
            a.backend.send("x", [Region(0, 1)], BackendDescriptor("other", "h:1", SIZE), [Region(0, 1)], secret=SECRET)
    finally:
        a.backend.close()


def test_unregistered_and_closed_backends_refuse(name):
    fresh = make_backend(name)
    try:
        with pytest.raises(TransferError):
            fresh.expect("x", [Region(0, 1)], secret=SECRET)
    finally:
        fresh.close()
    a = Side(name)
    rtok = a.backend.expect("pending", [Region(0, 10)], secret=SECRET)
    a.backend.close()
    assert rtok.state() is TransferState.FAILED and rtok.error == "backend closed"
    assert a.backend.outstanding() == set()
    with pytest.raises(TransferError):
        a.backend.expect("again", [Region(0, 10)], secret=SECRET)
    a.backend.close()  # idempotent


# -- peer death (a real child process, SIGKILLed) --------------------------------------------


def _child(name: str, role: str, conn) -> None:
    side = Side(name, bytes(range(256)) * (SIZE // 256))
    conn.send(side.desc.to_dict())
    if role == "receiver":  # the secret goes to the sender, as in a pull
        secret = new_secret()
        for i in range(64):
            side.backend.expect(f"k{i}", [Region(0, SIZE)], secret=secret)
        conn.send(("expecting", secret))
    else:
        desc, secret = conn.recv()
        peer = BackendDescriptor.from_dict(desc)
        i = 0
        while True:  # keep the parent busy until we are killed
            tok = side.backend.send(f"k{i}", [Region(0, SIZE)], peer, [Region(0, SIZE)], secret=secret)
            tok.wait(TIMEOUT)
            conn.send(tok.state().name)
            i += 1
    time.sleep(3600)


def _spawn(name: str, role: str):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(name, role, child), daemon=True)
    proc.start()
    assert parent.poll(30), "child did not start"
    return proc, parent, BackendDescriptor.from_dict(parent.recv())


def _kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)


def _swept_by_the_next_start(name: str, pid: int) -> None:
    """The SIGKILLed child ran no cleanup: a backend with a shared-memory segment left it behind, and the next
    backend start on this host (a worker's) removes it."""
    def left() -> list[str]:
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"xpyd-kv-{pid}-")]

    if name in ("shm", "auto"):
        assert left(), "the killed child left no segment to sweep"
    Side(name).backend.close()  # a worker starting
    assert left() == []


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_receiver_killed_fails_the_sender(name):
    proc, conn, peer = _spawn(name, "receiver")
    a = Side(name, b"\x07" * SIZE)
    try:
        assert conn.poll(TIMEOUT)
        said, secret = conn.recv()
        assert said == "expecting"
        first = a.backend.send("k0", [Region(0, SIZE)], peer, [Region(0, SIZE)], secret=secret)
        assert first.wait(TIMEOUT) and first.done()
        os.kill(proc.pid, signal.SIGSTOP)  # frozen: it takes in nothing sent from now on...
        _until(lambda: _state(proc.pid) == "T", "the receiver stopped")  # (...once the stop has taken effect)
        toks = [a.backend.send(f"k{i}", [Region(0, SIZE)], peer, [Region(0, SIZE)], secret=secret) for i in range(1, 30)]
        _until(lambda: toks[0].state() is TransferState.TRANSFERRING, "k1 on its way to the receiver")
        _kill(proc)  # k1 in flight, the rest queued
        for tok in toks:
            assert tok.wait(TIMEOUT), f"{tok!r} hangs after the peer died"
        assert all(tok.failed() and tok.error for tok in toks)  # k1 too: its receiver never took it in
        assert a.backend.outstanding() == set()
    finally:
        a.backend.close()
        if proc.is_alive():
            _kill(proc)
    _swept_by_the_next_start(name, proc.pid)


def _state(pid: int) -> str:
    """The process's state letter in /proc (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _freeze_mid_transfer(proc, toks) -> int:
    """Stop the sender (SIGSTOP) at a moment one of ``toks`` is TRANSFERRING; that one's index. A transfer takes
    about a millisecond, too short to see coming under load: the sender is stopped at random moments, and let
    go again when nothing was in flight, until one stop lands inside a transfer (skipped, saying so, if none did
    before every transfer was sent: on a loaded machine stops can keep falling between transfers)."""
    rng = random.Random(0)
    while True:
        os.kill(proc.pid, signal.SIGSTOP)
        _until(lambda: _state(proc.pid) == "T", "the sender stopped")  # (states settle once it has)
        moving = [i for i, t in enumerate(toks) if t.state() is TransferState.TRANSFERRING]
        if moving:
            return moving[0]
        if not any(t.state() is TransferState.PENDING for t in toks):
            # (a loaded machine: every stop fell between transfers; the case was not exercised, so not passed)
            os.kill(proc.pid, signal.SIGKILL)
            pytest.skip("no stop of the sender landed inside one of its 256 transfers on this run")
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(rng.uniform(0, 0.002))


def test_sender_killed_never_leaves_a_transfer_hanging(name):
    proc, conn, peer = _spawn(name, "sender")
    b = Side(name)
    try:
        toks = [b.backend.expect(f"k{i}", [Region(0, SIZE)], secret=SECRET) for i in range(256)]
        conn.send((b.desc.to_dict(), SECRET))
        assert conn.poll(TIMEOUT) and conn.recv() == "DONE"
        moving = _freeze_mid_transfer(proc, toks)
        _kill(proc)  # toks[moving] was in flight when its sender stopped for good
        _until(lambda: TransferState.TRANSFERRING not in [t.state() for t in toks], "every transfer ended")
        assert toks[moving].finished()  # DONE (its bytes had all reached us) or FAILED, never stuck
        assert toks[0].done() and b.bytes() == bytes(range(256)) * (SIZE // 256)  # only the sender's bytes
        for i, t in enumerate(toks):
            if t.state() is TransferState.PENDING:  # never started: the engine's own timeout aborts it
                b.backend.abort(f"k{i}")
        assert b.backend.outstanding() == set()
    finally:
        b.backend.close()
        if proc.is_alive():
            _kill(proc)
    _swept_by_the_next_start(name, proc.pid)
