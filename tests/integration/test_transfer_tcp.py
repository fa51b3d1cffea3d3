"""TCP transfer backend over real loopback sockets: real bytes, real threads, one real child process."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import struct
import threading
import time

import msgpack
import pytest

from xpyd import PROTOCOL_VERSION
from xpyd.transfer import make_backend
from xpyd.transfer.base import BackendDescriptor, Region, TransferError, TransferState
from xpyd.transfer.tcp import TcpTransferBackend
from xpyd.transfer import auth
from xpyd.transfer.tcp_wire import CHUNK, IOV_MAX, pack_header, parse_address
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one

SIZE = 12 << 20  # > 2 * CHUNK so big regions are chunked
FILL = 0xAA


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("xpyd-tcp")]


@pytest.fixture(autouse=True)
def no_thread_leak():
    yield
    deadline = time.monotonic() + 2
    while _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() == []


class Side:
    def __init__(self, data: bytes | None = None, **kw) -> None:
        self.backend = TcpTransferBackend(**{"io_timeout": 5.0, **kw})
        self.buf = bytearray(data) if data is not None else bytearray([FILL]) * SIZE
        self.desc = self.backend.register(memoryview(self.buf))


@pytest.fixture
def pair():
    a, b = Side(random.Random(1).randbytes(SIZE)), Side()
    yield a, b
    a.backend.close()
    b.backend.close()


def gather(buf: bytearray, regions) -> bytes:
    return b"".join(bytes(buf[r.offset : r.end]) for r in regions)


def expected_after(dst, payload: bytes, size: int = SIZE) -> bytearray:
    """What a FILL-initialised buffer must look like after ``payload`` lands at ``dst``."""
    out = bytearray([FILL]) * size
    pos = 0
    for r in dst:
        out[r.offset : r.end] = payload[pos : pos + r.length]
        pos += r.length
    return out


def untouched(buf: bytearray) -> bool:
    return buf == bytearray([FILL]) * len(buf)


def signed_header(tid: str, pairs, secret: bytes = SECRET) -> bytes:
    """The header a sender holding ``secret`` opens transfer ``tid`` into ``pairs`` ([offset, length]) with."""
    dst = [Region(*p) for p in pairs]
    mac = auth.transfer_mac(auth.transfer_key(secret, None), "tcp", tid, dst)
    return pack_header(tid, dst, sum(r.length for r in dst), mac)


def transfer(a: Side, b: Side, tid: str, src, dst, timeout: float = 5.0):
    rtok = b.backend.expect(tid, dst, secret=SECRET)
    stok = a.backend.send(tid, src, b.desc, dst, secret=SECRET)
    assert stok.wait(timeout) and rtok.wait(timeout)
    return stok, rtok


# -- happy paths ------------------------------------------------------------


def test_many_noncontiguous_regions_land_exactly(pair):
    a, b = pair
    src = [Region(3, 1000), Region(5000, 7), Region(CHUNK - 10, CHUNK + 300), Region(2 * CHUNK + 5, 123_457)]
    total = sum(r.length for r in src)
    dst = [Region(SIZE - 5000, 4000), Region(17, total - 4000 - 999), Region(SIZE // 2 + 1, 999)]
    stok, rtok = transfer(a, b, "req-1", src, dst)
    assert (stok.state(), rtok.state()) == (TransferState.DONE, TransferState.DONE)
    assert stok.error is None and rtok.error is None
    assert b.buf == expected_after(dst, gather(a.buf, src))
    assert a.buf == random.Random(1).randbytes(SIZE)  # the sender's pool is only read


def test_more_regions_than_iov_max(pair):
    a, b = pair
    src = [Region(i * 64, 33) for i in range(IOV_MAX + 500)]
    dst = [Region(1, 33 * len(src) // 2), Region(SIZE - 33 * len(src) // 2, 33 * len(src) // 2)]
    transfer(a, b, "iov", src, dst)
    assert b.buf == expected_after(dst, gather(a.buf, src))


def test_concurrent_transfers_share_one_connection(pair):
    a, b = pair
    n, length = 8, 300_000
    jobs = [(f"c{i}", [Region(i * 2 * length, length)], [Region(i * length, length)]) for i in range(n)]
    rtoks = [b.backend.expect(tid, dst, secret=SECRET) for tid, _, dst in jobs]
    stoks = [a.backend.send(tid, src, b.desc, dst, secret=SECRET) for tid, src, dst in jobs]  # all queued at once
    assert all(t.wait(5) for t in stoks + rtoks)
    assert all(t.done() for t in stoks + rtoks)
    assert bytes(b.buf[: n * length]) == b"".join(gather(a.buf, src) for _, src, _ in jobs)
    assert untouched(b.buf[n * length :])
    assert len([t for t in _threads() if t.startswith("xpyd-tcp-recv")]) == 1  # cached, reused


def test_make_backend_tcp_roundtrip():
    a = make_backend("tcp", io_timeout=5.0)
    assert _threads() == []  # nothing starts before register()
    b = Side()
    buf = bytearray(b"x" * 4096)
    a.register(memoryview(buf))
    try:
        dst = [Region(100, 4096)]
        rtok = b.backend.expect("mb", dst, secret=SECRET)
        assert a.send("mb", [Region(0, 4096)], b.desc, dst, secret=SECRET).wait(5) and rtok.done()
        assert bytes(b.buf[100:4196]) == b"x" * 4096
    finally:
        a.close()
        b.backend.close()


# -- validation ------------------------------------------------------------------


def test_invalid_arguments_rejected(pair):
    a, b = pair
    ok = [Region(0, 10)]
    with pytest.raises(ValueError, match="outside"):
        a.backend.send("x", [Region(SIZE - 5, 10)], b.desc, ok, secret=SECRET)
    with pytest.raises(ValueError, match="outside"):
        a.backend.send("x", ok, b.desc, [Region(SIZE, 10)], secret=SECRET)
    with pytest.raises(ValueError, match="outside"):
        b.backend.expect("x", [Region(SIZE - 1, 2)], secret=SECRET)
    with pytest.raises(ValueError, match="bytes"):
        a.backend.send("x", ok, b.desc, [Region(0, 11)], secret=SECRET)
    with pytest.raises(ValueError, match="transfer_id"):
        a.backend.send("y" * 257, ok, b.desc, ok, secret=SECRET)
    with pytest.raises(ValueError, match="transfer_id"):
        b.backend.expect("", ok, secret=SECRET)
    with pytest.raises(ValueError, match="empty"):
        b.backend.expect("x", [], secret=SECRET)
    with pytest.raises(ValueError):
        Region(-1, 10)
    with pytest.raises(ValueError, match="int"):
        b.backend.expect("x", [Region(0.5, 10)], secret=SECRET)
    with pytest.raises(ValueError, match="tcp"):
        a.backend.send("x", ok, BackendDescriptor("fake", "fake-0", SIZE), ok, secret=SECRET)
    with pytest.raises(ValueError, match="address"):
        a.backend.send("x", ok, BackendDescriptor("tcp", "nohost", SIZE), ok, secret=SECRET)
    b.backend.expect("dup", ok, secret=SECRET)
    with pytest.raises(TransferError, match="already expected"):
        b.backend.expect("dup", ok, secret=SECRET)
    with pytest.raises(TransferError, match="already registered"):
        a.backend.register(memoryview(bytearray(10)))
    with pytest.raises(ValueError, match="writable"):
        TcpTransferBackend().register(memoryview(b"readonly"))
    with pytest.raises(TransferError, match="register"):
        TcpTransferBackend().expect("x", ok, secret=SECRET)
    with pytest.raises(ValueError, match="advertise_host"):
        TcpTransferBackend(host="0.0.0.0")
    assert parse_address("[::1]:80") == ("::1", 80)


def test_advertise_host_is_what_peers_see():
    be = TcpTransferBackend(host="0.0.0.0", advertise_host="127.0.0.1")
    try:
        desc = be.register(memoryview(bytearray(64)))
        assert desc.address.startswith("127.0.0.1:") and desc.buffer_size == 64
        assert BackendDescriptor.from_dict(msgpack.unpackb(msgpack.packb(desc.to_dict()))) == desc
    finally:
        be.close()


# -- refusals ------------------------------------------------------------------


def test_unexpected_id_refused_and_the_next_transfer_reconnects(pair):
    """The receiver reads no byte behind a refused header and hangs up; the sender still learns why (the
    ack came before the hang-up, even with a payload larger than the socket buffers) and reconnects."""
    a, b = pair
    stok = a.backend.send("ghost", [Region(0, SIZE)], b.desc, [Region(0, SIZE)], secret=SECRET)
    assert stok.wait(5) and stok.failed()
    assert "unexpected transfer id 'ghost'" in stok.error
    assert untouched(b.buf) and b.backend.refused == 1
    stok, rtok = transfer(a, b, "real", [Region(0, 1000)], [Region(0, 1000)])
    assert stok.done() and rtok.done() and bytes(b.buf[:1000]) == bytes(a.buf[:1000])


def test_region_mismatch_refused(pair):
    a, b = pair
    rtok = b.backend.expect("m", [Region(0, 100), Region(200, 100)], secret=SECRET)
    stok = a.backend.send("m", [Region(0, 200)], b.desc, [Region(0, 100), Region(300, 100)], secret=SECRET)
    assert stok.wait(5) and stok.failed() and "differ" in stok.error
    assert rtok.wait(5) and rtok.failed() and "differ" in rtok.error
    assert untouched(b.buf)


def test_abort_expected_transfer(pair):
    a, b = pair
    rtok = b.backend.expect("ab", [Region(0, 100)], secret=SECRET)
    b.backend.abort("ab")
    assert rtok.failed() and rtok.error == "aborted"
    stok = a.backend.send("ab", [Region(0, 100)], b.desc, [Region(0, 100)], secret=SECRET)
    assert stok.wait(5) and stok.failed() and "unexpected" in stok.error
    assert untouched(b.buf)
    b.backend.abort("never-heard-of")  # safe
    stok, rtok = transfer(a, b, "fin", [Region(0, 10)], [Region(0, 10)])
    b.backend.abort("fin")
    a.backend.abort("fin")
    assert stok.done() and rtok.done()  # finished tokens stay finished


def test_abort_mid_transfer_stops_writes(pair):
    """Bytes arriving after abort() returned never reach the pool; the sender gets a refusal."""
    _, b = pair
    dst = [Region(0, 20_000)]
    rtok = b.backend.expect("mid", dst, secret=SECRET)
    sock = socket.create_connection(parse_address(b.desc.address), timeout=5)
    with sock:
        sock.sendall(signed_header("mid", [[0, 20_000]]) + b"\x01" * 1000)
        deadline = time.monotonic() + 5
        while b.buf[999] != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert rtok.state() is TransferState.TRANSFERRING
        b.backend.abort("mid")
        sock.sendall(b"\x02" * 19_000)
        (n,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        ack = msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL))
    assert ack["id"] == "mid" and ack["ok"] is False and "aborted" in ack["error"]
    assert rtok.failed() and rtok.error == "aborted"
    assert b.buf[:1000] == b"\x01" * 1000 and untouched(b.buf[1000:])


def test_sender_abort_mid_stream_stops_reading_the_pool():
    """Once abort() returns, no more bytes are read from the sender's pool; the connection is dropped."""
    listener = socket.create_server(("127.0.0.1", 0))
    a = Side(b"\x05" * SIZE)
    try:
        peer = BackendDescriptor("tcp", f"127.0.0.1:{listener.getsockname()[1]}", SIZE)
        stok = a.backend.send("big", [Region(0, SIZE)], peer, [Region(0, SIZE)], secret=SECRET)
        sock, _ = listener.accept()
        with sock:
            while stok.state() is not TransferState.TRANSFERRING:
                time.sleep(0.001)
            time.sleep(0.05)  # the socket buffers fill up; the peer has not read a byte
            a.backend.abort("big")
            assert stok.failed() and stok.error == "aborted"
            a.buf[:] = b"\x06" * SIZE  # anything sent from now on would carry 0x06
            sock.settimeout(5)
            received = bytearray()
            while chunk := sock.recv(1 << 20):
                received += chunk
        (n,) = struct.unpack(">I", received[:4])
        payload = received[4 + n :]
        assert msgpack.unpackb(received[4 : 4 + n])["id"] == "big"
        assert 0 < len(payload) < SIZE and payload == b"\x05" * len(payload)
    finally:
        a.backend.close()
        listener.close()


# -- dead peers, timeouts, polling --------------------------------------------------


def test_hung_peer_times_out_and_polls_never_block():
    """A peer that accepts but never answers: tokens poll instantly, queued jobs abort, the send times out."""
    listener = socket.create_server(("127.0.0.1", 0))
    io_timeout = 2.0
    a = Side(b"\x05" * SIZE, io_timeout=io_timeout)
    try:
        peer = BackendDescriptor("tcp", f"127.0.0.1:{listener.getsockname()[1]}", SIZE)
        t0 = time.monotonic()
        first = a.backend.send("h1", [Region(0, 1000)], peer, [Region(0, 1000)], secret=SECRET)
        queued = a.backend.send("h2", [Region(0, 1000)], peer, [Region(0, 1000)], secret=SECRET)
        slowest, states = 0.0, set()
        while not first.finished():
            p0 = time.perf_counter()
            states.add(first.state())
            first.done(), first.failed(), queued.state()
            slowest = max(slowest, time.perf_counter() - p0)
            if first.state() is TransferState.TRANSFERRING and not queued.finished():
                a.backend.abort("h2")
                assert queued.failed() and queued.error == "aborted"
            time.sleep(0.001)
        elapsed = time.monotonic() - t0
        assert TransferState.TRANSFERRING in states and queued.error == "aborted"
        assert first.failed() and f"no progress within {io_timeout:g}s" in first.error
        assert io_timeout * 0.8 < elapsed < io_timeout + 8
        assert slowest < io_timeout / 4  # a blocking poll would take the whole io_timeout
    finally:
        a.backend.close()
        listener.close()


def test_closed_peer_fails_fast(pair):
    a, b = pair
    b.backend.close()
    t0 = time.monotonic()
    stok = a.backend.send("late", [Region(0, 100)], b.desc, [Region(0, 100)], secret=SECRET)
    assert stok.wait(10) and stok.failed() and "cannot connect" in stok.error
    assert time.monotonic() - t0 < 4  # refused at once: not the 5 s io_timeout
    assert untouched(b.buf)


def test_peer_that_hangs_up_fails_the_sender():
    listener = socket.create_server(("127.0.0.1", 0))
    a = Side(b"\x05" * SIZE)

    def hang_up():
        conn, _ = listener.accept()
        conn.close()

    t = threading.Thread(target=hang_up)
    t.start()
    try:
        peer = BackendDescriptor("tcp", f"127.0.0.1:{listener.getsockname()[1]}", SIZE)
        stok = a.backend.send("hu", [Region(0, SIZE)], peer, [Region(0, SIZE)], secret=SECRET)
        assert stok.wait(5) and stok.failed() and "send to" in stok.error
    finally:
        t.join()
        a.backend.close()
        listener.close()


# -- hostile input on the listener ------------------------------------------------------

_GARBAGE = [
    pytest.param(b"\xff" * 64, id="garbage"),
    pytest.param(struct.pack(">I", (1 << 20) + 1) + b"x" * 100, id="oversized-header"),
    pytest.param(struct.pack(">I", 0), id="empty-header"),
    pytest.param(struct.pack(">I", 100) + b"\x81" * 10, id="truncated-header"),
    pytest.param(struct.pack(">I", 3) + b"\xc1\xc1\xc1", id="bad-msgpack"),
    pytest.param(struct.pack(">I", 4) + msgpack.packb([1, 2, 3]), id="not-a-map"),
    pytest.param(msgpack.packb(dict(v=PROTOCOL_VERSION, id="victim", dst=[[0, 64]], total=64)),
                 id="no-length-prefix"),
]


def _frame(obj) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack(">I", len(body)) + body


_BAD_HEADERS = [
    pytest.param(dict(v=PROTOCOL_VERSION, id="victim", dst=[[0, 64]], total=2 * SIZE), id="total-too-big"),
    pytest.param({"v": PROTOCOL_VERSION, "id": "victim", "dst": [[0, 32]], "total": 64}, id="total-mismatch"),
    pytest.param({"v": PROTOCOL_VERSION, "id": "victim", "dst": [[0, True]], "total": 64}, id="bool-length"),
    pytest.param({"v": PROTOCOL_VERSION, "id": 7, "dst": [[0, 64]], "total": 64}, id="int-id"),
    pytest.param(dict(v=PROTOCOL_VERSION, id="victim", dst=[[-1, 65]], total=64), id="negative-offset"),
    pytest.param({"id": "victim", "dst": [[0, 64]], "total": 64}, id="no-version"),
]


def _expect_closed(sock: socket.socket) -> None:
    sock.settimeout(5)
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


_HOSTILE = _GARBAGE + [pytest.param(_frame(p.values[0]), id=p.id) for p in _BAD_HEADERS]


@pytest.mark.parametrize("payload", _HOSTILE)
def test_hostile_bytes_close_connection_and_listener_keeps_serving(pair, payload):
    a, b = pair
    victim = b.backend.expect("victim", [Region(0, 64)], secret=SECRET)
    with socket.create_connection(parse_address(b.desc.address), timeout=5) as sock:
        sock.sendall(payload)
        if len(payload) < 20:  # short frames: make the reader see EOF rather than wait for more
            sock.shutdown(socket.SHUT_WR)
        _expect_closed(sock)
    assert untouched(b.buf) and victim.state() is TransferState.PENDING
    stok = a.backend.send("victim", [Region(0, 64)], b.desc, [Region(0, 64)], secret=SECRET)
    assert stok.wait(5) and stok.done() and victim.wait(5) and victim.done()
    assert bytes(b.buf[:64]) == bytes(a.buf[:64]) and untouched(b.buf[64:])


def test_version_mismatch_refused(pair):
    _, b = pair
    victim = b.backend.expect("victim", [Region(0, 64)], secret=SECRET)
    with socket.create_connection(parse_address(b.desc.address), timeout=5) as sock:
        header = _frame({"v": PROTOCOL_VERSION + 1, "id": "victim", "dst": [[0, 64]], "total": 64})
        sock.sendall(header + b"z" * 64)
        (n,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
        ack = msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL))
        _expect_closed(sock)
    assert ack["ok"] is False and "protocol version" in ack["error"]
    assert untouched(b.buf) and victim.state() is TransferState.PENDING


def test_truncated_payload_fails_receiver(pair):
    _, b = pair
    rtok = b.backend.expect("cut", [Region(0, 1000)], secret=SECRET)
    with socket.create_connection(parse_address(b.desc.address), timeout=5) as sock:
        sock.sendall(signed_header("cut", [[0, 1000]]) + b"q" * 10)
    assert rtok.wait(5) and rtok.failed() and "closed" in rtok.error
    assert untouched(b.buf[10:])


# -- shutdown -------------------------------------------------------------------


def test_close_fails_outstanding_and_joins_threads():
    listener = socket.create_server(("127.0.0.1", 0))
    a = Side(b"\x05" * SIZE, io_timeout=30)
    peer = BackendDescriptor("tcp", f"127.0.0.1:{listener.getsockname()[1]}", SIZE)
    rtok = a.backend.expect("in", [Region(0, 10)], secret=SECRET)
    stok = a.backend.send("out", [Region(0, 10)], peer, [Region(0, 10)], secret=SECRET)
    while stok.state() is not TransferState.TRANSFERRING:  # stuck waiting for an ack that never comes
        time.sleep(0.001)
    t0 = time.monotonic()
    a.backend.close()
    assert time.monotonic() - t0 < 10  # close wakes blocked threads, no waiting out io_timeout (30 s)
    assert _threads() == []
    assert rtok.failed() and stok.failed() and "closed" in rtok.error and "closed" in stok.error
    a.backend.close()  # idempotent
    with pytest.raises(TransferError, match="closed"):
        a.backend.expect("again", [Region(0, 10)], secret=SECRET)
    listener.close()


# -- two processes ---------------------------------------------------------------


def _child(conn) -> None:
    """Serve commands from the parent: ('expect'|'send', ..., secret) -> result; None -> close and exit."""
    side = Side(bytes(range(256)) * (SIZE // 256))
    conn.send(side.desc.to_dict())
    tokens = {}
    while (cmd := conn.recv()) is not None:
        op, tid, *args = cmd
        if op == "expect":
            tokens[tid] = side.backend.expect(tid, [Region(*r) for r in args[0]], secret=args[1])
            conn.send("ok")
        elif op == "send":
            src, peer, dst, secret = args
            tok = side.backend.send(tid, [Region(*r) for r in src], BackendDescriptor.from_dict(peer),
                                    [Region(*r) for r in dst], secret=secret)
            conn.send((tok.wait(10), tok.state().name, tok.error))
        elif op == "result":
            tok = tokens[tid]
            conn.send((tok.wait(10), tok.state().name, tok.error, bytes(side.buf)))
    side.backend.close()
    conn.send(_threads())


def test_two_processes_both_directions_then_peer_dies():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,), daemon=True)
    proc.start()
    a = Side(random.Random(2).randbytes(SIZE), io_timeout=2.0)
    try:
        assert parent.poll(30), "child did not start"
        peer = BackendDescriptor.from_dict(parent.recv())
        # parent -> child, many regions on both sides
        src = [Region(7, 70_000), Region(CHUNK - 1, CHUNK + 5), Region(SIZE - 100, 100)]
        dst = [Region(SIZE - 1_000_000, 1_000_000), Region(1000, CHUNK + 5 + 70_100 - 1_000_000)]
        parent.send(("expect", "p2c", [[r.offset, r.length] for r in dst], SECRET))  # (a pull carries it)
        assert parent.recv() == "ok"
        stok = a.backend.send("p2c", src, peer, dst, secret=SECRET)
        assert stok.wait(10) and stok.done()
        parent.send(("result", "p2c"))
        finished, state, error, child_buf = parent.recv()
        assert (finished, state, error) == (True, "DONE", None)
        want = bytearray(bytes(range(256)) * (SIZE // 256))
        pos, payload = 0, gather(a.buf, src)
        for r in dst:
            want[r.offset : r.end] = payload[pos : pos + r.length]
            pos += r.length
        assert child_buf == want
        # child -> parent, into a fresh FILL buffer
        b = Side()
        try:
            rtok = b.backend.expect("c2p", [Region(50, 300), Region(9000, 700)], secret=SECRET)
            parent.send(("send", "c2p", [[0, 500], [1000, 500]], b.desc.to_dict(), [[50, 300], [9000, 700]],
                         SECRET))
            assert parent.recv() == (True, "DONE", None) and rtok.wait(5) and rtok.done()
            src_bytes = bytes(want[0:500] + want[1000:1500])  # the child's buffer after the first transfer
            assert b.buf == expected_after([Region(50, 300), Region(9000, 700)], src_bytes)
        finally:
            b.backend.close()
        # a clean shutdown in the child leaves no threads there either
        parent.send(None)
        assert parent.recv() == []
        proc.join(10)
        # the peer process is gone: the next send fails instead of hanging
        stok = a.backend.send("dead", [Region(0, 100)], peer, [Region(0, 100)], secret=SECRET)
        assert stok.wait(5) and stok.failed() and "send to" in stok.error
    finally:
        a.backend.close()
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def test_killed_peer_mid_stream_fails_sender():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,), daemon=True)
    proc.start()
    a = Side(b"\x07" * SIZE, io_timeout=2.0)
    try:
        assert parent.poll(30)
        peer = BackendDescriptor.from_dict(parent.recv())
        parent.send(("expect", "warm", [[0, 10]], SECRET))
        assert parent.recv() == "ok"
        assert a.backend.send("warm", [Region(0, 10)], peer, [Region(0, 10)], secret=SECRET).wait(10)  # connection cached
        os.kill(proc.pid, 9)
        proc.join(5)
        t0 = time.monotonic()
        stok = a.backend.send("after-kill", [Region(0, SIZE)], peer, [Region(0, SIZE)], secret=SECRET)
        assert stok.wait(5) and stok.failed() and "send to" in stok.error
        assert time.monotonic() - t0 < 3
    finally:
        a.backend.close()
        proc.join(5)


def test_a_connection_that_never_sends_a_header_is_dropped_and_a_real_peer_still_works():
    """Idle slots cannot be hoarded: a new connection must send its first header within the listener's
    deadline (``listener.OPEN_TIMEOUT``; a real sender connects right before its first transfer); a known
    peer may idle much longer (floods: tests/integration/test_transfer_listener_flood.py)."""
    a, b = Side(random.Random(2).randbytes(SIZE)), Side(io_timeout=0.5)
    try:
        host, port = parse_address(b.desc.address)
        silent = socket.create_connection((host, port), timeout=5)
        silent.settimeout(5)
        started = time.monotonic()
        assert silent.recv(1) == b""  # the receiver closed it
        assert time.monotonic() - started < 4
        silent.close()
        src, dst = [Region(0, 4096)], [Region(8192, 4096)]
        transfer(a, b, "xpyd-after-silent", src, dst)
        assert b.buf == expected_after(dst, gather(a.buf, src))
        time.sleep(1.0)  # idle longer than io_timeout between transfers: still fine
        transfer(a, b, "xpyd-after-idle", [Region(0, 4096)], [Region(0, 4096)])
    finally:
        a.backend.close()
        b.backend.close()
