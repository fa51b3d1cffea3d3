"""shm specifics: segments (create, lock, sweep after SIGKILL), the pool in a segment, hostile control frames,
and `xpyd bench transfer --backend shm --json`."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import struct
import time

import msgpack
import pytest

from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.transfer import Region, TransferError, TransferState, make_backend, shm_segment
from xpyd.transfer.shm_segment import SegmentError
from xpyd.transfer.shm_wire import Hello, Offer
from xpyd.transfer.tcp_wire import ProtocolError, parse_address
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one


def _path(name: str) -> str:
    return os.path.join(shm_segment.SHM_DIR, name)


def test_segment_is_zeroed_locked_and_unlinked():
    seg = shm_segment.create(1 << 20, "t1")
    try:
        assert seg.name == f"xpyd-kv-{os.getpid()}-t1" and os.path.getsize(_path(seg.name)) == 1 << 20
        assert bytes(seg.buffer()[:4096]) == bytes(4096)
        assert seg.name not in shm_segment.remove_stale()  # we hold its lock: never swept
        peer = shm_segment.map_peer(seg.name, 1 << 20)
        seg.buffer()[10:13] = b"abc"
        assert peer[10:13] == b"abc"  # the same memory, read-only for the peer
        with pytest.raises(TypeError):
            peer[0:1] = b"x"
        with pytest.raises(SegmentError, match="holds"):
            shm_segment.map_peer(seg.name, 2 << 20)
        with pytest.raises(SegmentError, match="invalid segment name"):
            shm_segment.map_peer("../etc/passwd", 10)
    finally:
        seg.unlink()
    assert not os.path.exists(_path(seg.name))
    seg.unlink()  # idempotent


def test_a_segment_larger_than_dev_shm_is_refused_up_front():
    with pytest.raises(SegmentError, match="free"):
        shm_segment.create(1 << 50, "huge")
    assert not [n for n in os.listdir("/dev/shm") if f"-{os.getpid()}-huge" in n]


def _owner(conn) -> None:
    seg = shm_segment.create(4096, "child")
    conn.send(seg.name)
    signal.pause()


def test_segment_of_a_sigkilled_worker_is_swept_on_next_start():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(30)
        name = parent.recv()
        assert name not in shm_segment.remove_stale()  # alive: its lock protects it
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        assert os.path.exists(_path(name))  # SIGKILL: nobody unlinked it
        seg = shm_segment.create(4096, "next-start")  # a new worker's start sweeps
        seg.unlink()
        assert not os.path.exists(_path(name))
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def test_kv_pool_in_a_segment_is_zero_and_shared():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", num_blocks=8, block_size=4)
    b = make_backend("shm")
    try:
        buf = b.allocate(layout.total_bytes)
        buf[:8] = b"\xff" * 8
        pool = KVPool(layout, buffer=buf)
        assert bytes(buf[:8]) == bytes(8) and float(pool.tensor.abs().sum()) == 0.0
        pool.tensor[1, 0, 0, 0, 0, 0] = 2.0
        r = Region(layout.block_bytes, 4)
        assert bytes(buf[r.offset:r.end]) == struct.pack("<f", 2.0)
        desc = b.register(pool.buffer())
        assert desc.backend == "shm" and desc.buffer_size == layout.total_bytes
        with pytest.raises(ValueError, match="layout needs"):
            KVPool(layout, buffer=memoryview(bytearray(8)))
    finally:
        b.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"xpyd-kv-{os.getpid()}-")]


def test_register_refuses_memory_outside_the_segment():
    b = make_backend("shm")
    try:
        b.allocate(4096)
        with pytest.raises(TransferError, match="inside the segment"):
            b.register(memoryview(bytearray(4096)))
    finally:
        b.close()


def test_a_receive_only_backend_takes_ordinary_memory_and_refuses_to_send():
    sender, receiver = make_backend("shm"), make_backend("shm")
    try:
        src = sender.allocate(1 << 16)
        src[:64] = bytes(range(64))
        d_sender = sender.register(src)
        dst = memoryview(bytearray(1 << 16))  # a decode worker's pool: no segment
        d_recv = receiver.register(dst)
        assert sender.reaches(d_recv) and not receiver.reaches(d_sender)
        rtok = receiver.expect("in", [Region(100, 64)], secret=SECRET)
        stok = sender.send("in", [Region(0, 64)], d_recv, [Region(100, 64)], secret=SECRET)
        assert stok.wait(10) and stok.done() and rtok.done() and bytes(dst[100:164]) == bytes(range(64))
        with pytest.raises(TransferError, match="receive-only"):
            receiver.send("out", [Region(0, 64)], d_sender, [Region(0, 64)], secret=SECRET)
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"xpyd-kv-{os.getpid()}-")] == [sender.segment_name]
    finally:
        sender.close()
        receiver.close()


def test_a_sender_abort_during_the_copy_voids_it():
    """Once the sender's abort() returns it may overwrite its source: the receiver must not report DONE
    for a copy that may have read overwritten bytes (it checks the sender's abort board after copying)."""
    n = 1 << 20
    sender, receiver = make_backend("shm"), make_backend("shm")
    try:
        src = sender.allocate(n)
        src[:] = b"\x01" * n
        sender.register(src)
        dst = memoryview(bytearray(n))
        d_recv = receiver.register(dst)
        rtok = receiver.expect("x", [Region(0, n)], secret=SECRET)
        rec = receiver._endpoint.expected._recs["x"]  # (its lock: the reader copies each chunk under it)
        with rec.lock:  # hold the receiver's reader just before its first chunk
            stok = sender.send("x", [Region(0, n)], d_recv, [Region(0, n)], secret=SECRET)
            deadline = time.monotonic() + 10
            while rtok.state() is not TransferState.TRANSFERRING and time.monotonic() < deadline:
                time.sleep(0.001)
            assert rtok.state() is TransferState.TRANSFERRING  # offered, claimed, about to copy
            sender.abort("x")
            assert stok.failed() and stok.error == "aborted"
            src[:] = b"\x02" * n  # allowed now: the sender's engine reuses the memory
        assert rtok.wait(10) and rtok.failed() and "aborted by the sender" in rtok.error
        assert sender.outstanding() == set() and receiver.outstanding() == set()
        rtok = receiver.expect("y", [Region(0, n)], secret=SECRET)  # the connection and the board entry are reusable
        stok = sender.send("y", [Region(0, n)], d_recv, [Region(0, n)], secret=SECRET)
        assert stok.wait(10) and stok.done() and rtok.done() and bytes(dst) == b"\x02" * n
        assert sender._board.in_use() == 0
    finally:
        sender.close()
        receiver.close()


def test_large_chunks_are_copied_by_two_threads_and_land_exactly():
    """24 MiB in 3 regions: pieces of 8 MiB and more are split with a helper thread (``parallel_copy``);
    every byte lands at its offset, nothing outside the regions is written, and close() stops the helper."""
    import threading

    import numpy as np

    n = 24 << 20
    sender, receiver = make_backend("shm"), make_backend("shm", copy_threads=2)
    try:
        src = sender.allocate(n + 4096)
        pattern = (np.arange(n, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
        np.frombuffer(src, dtype=np.uint8)[:n] = pattern
        d_send = sender.register(src)
        dst = np.zeros(n + 8192, dtype=np.uint8)
        d_recv = receiver.register(memoryview(dst))
        src_regions = [Region(0, 10 << 20), Region(10 << 20, 4 << 20), Region(14 << 20, 10 << 20)]
        dst_regions = [Region(4096, 20 << 20), Region((20 << 20) + 8192, 4 << 20)]
        rtok = receiver.expect("big", dst_regions, secret=SECRET)
        stok = sender.send("big", src_regions, d_recv, dst_regions, secret=SECRET)
        assert stok.wait(30) and stok.done() and rtok.done()
        assert np.array_equal(dst[4096:4096 + (20 << 20)], pattern[:20 << 20])
        assert np.array_equal(dst[(20 << 20) + 8192:], pattern[20 << 20:])
        assert not dst[:4096].any() and not dst[4096 + (20 << 20):(20 << 20) + 8192].any()
        assert d_send.buffer_size == n + 4096
        assert any(t.name.startswith("xpyd-copy") for t in threading.enumerate())
    finally:
        sender.close()
        receiver.close()
    assert not any(t.name.startswith("xpyd-copy") for t in threading.enumerate())


def test_a_receiver_abort_during_a_split_copy_waits_for_every_part(monkeypatch):
    """abort() returns only after both halves of a chunk being copied by two threads have landed; no
    byte of the transfer lands after it (the next chunk is never started)."""
    import threading

    import numpy as np

    from xpyd.transfer import parallel_copy

    real, in_helper = np.copyto, threading.Event()

    def slow_helper_copy(dst, src):
        if threading.current_thread().name.startswith("xpyd-copy"):
            in_helper.set()
            time.sleep(0.3)  # the helper's half is slow: abort() must wait for it
        real(dst, src)

    monkeypatch.setattr(parallel_copy.np, "copyto", slow_helper_copy)
    n = 32 << 20  # two 16 MiB chunks
    sender, receiver = make_backend("shm"), make_backend("shm", copy_threads=2)
    try:
        src = sender.allocate(n)
        np.frombuffer(src, dtype=np.uint8)[:] = 7
        sender.register(src)
        dst = np.zeros(n, dtype=np.uint8)
        d_recv = receiver.register(memoryview(dst))
        rtok = receiver.expect("x", [Region(0, n)], secret=SECRET)
        stok = sender.send("x", [Region(0, n)], d_recv, [Region(0, n)], secret=SECRET)
        assert in_helper.wait(10)  # the first chunk is being copied, its second half slowly
        receiver.abort("x")
        landed = int(np.count_nonzero(dst))
        assert landed == 16 << 20  # exactly the first chunk, both halves: nothing half-copied
        assert rtok.failed() and rtok.error == "aborted"
        assert stok.wait(10) and stok.failed()
        time.sleep(0.5)
        assert int(np.count_nonzero(dst)) == landed  # and nothing after abort() returned
    finally:
        sender.close()
        receiver.close()


def test_wire_frames_are_validated():
    with pytest.raises(ProtocolError):
        Hello.parse({"t": "hello", "v": 1, "segment": "../x", "size": 1, "host": "h"})
    with pytest.raises(ProtocolError):
        Offer.parse({"t": "offer", "id": "a", "src": [[0, 10]], "dst": [[0, 11]]}, 100, 100)
    with pytest.raises(ProtocolError):
        Offer.parse({"t": "offer", "id": "a", "src": [[95, 10]], "dst": [[0, 10]]}, 100, 100)
    o = Offer.parse({"t": "offer", "id": "a", "src": [[0, 10]], "dst": [[5, 10]]}, 100, 100)
    assert (o.src, o.dst, o.board) == ((Region(0, 10),), (Region(5, 10),), None)
    o = Offer.parse({"t": "offer", "id": "a", "src": [[0, 10]], "dst": [[5, 10]], "board": [3, 7]}, 100, 100)
    assert o.board == (3, 7) and Offer.parse(msgpack.unpackb(o.pack()[4:]), 100, 100) == o
    for board in ([3], [-1, 7], [3, 0], [1 << 20, 7], "3,7"):
        with pytest.raises(ProtocolError, match="board"):
            Offer.parse({"t": "offer", "id": "a", "src": [[0, 10]], "dst": [[5, 10]], "board": board}, 100, 100)
    hello = {"t": "hello", "v": 1, "segment": "xpyd-kv-1-a", "size": 1 << 20, "host": "h"}
    assert Hello.parse({**hello, "board": (1 << 20) - (32 << 10)}).board == (1 << 20) - (32 << 10)
    for board in (None, 0, 12, (1 << 20) - 8):  # missing, at 0, unaligned, no room for the entries
        with pytest.raises(ProtocolError, match="board"):
            Hello.parse({**hello, "board": board})


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff\xff",  # frame longer than the limit
    struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # undecodable
    struct.pack(">I", 9) + msgpack.packb({"t": "offer"}),  # offer before hello
])
def test_hostile_control_bytes_drop_the_connection_and_the_listener_keeps_serving(payload):
    a, b = make_backend("shm", io_timeout=2.0), make_backend("shm", io_timeout=2.0)
    try:
        ba, bb = a.allocate(1 << 16), b.allocate(1 << 16)
        ba[:100] = bytes(range(100))
        a.register(ba)
        desc = b.register(bb)
        with socket.create_connection(parse_address(desc.address), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(5)
            try:
                got = s.recv(1 << 16)
            except ConnectionResetError:
                got = b""
            assert got == b""  # the receiver dropped the connection (a timeout here would fail the test)
        rtok = b.expect("ok", [Region(0, 100)], secret=SECRET)
        stok = a.send("ok", [Region(0, 100)], desc, [Region(0, 100)], secret=SECRET)
        assert stok.wait(10) and stok.done() and rtok.done() and bytes(bb[:100]) == bytes(range(100))
    finally:
        a.close()
        b.close()


def test_bench_transfer_shm_json(tmp_path):
    from xpyd.bench import transfer_bench as tb

    path = tmp_path / "shm.json"
    parser = __import__("argparse").ArgumentParser()
    tb.add_arguments(parser)
    assert tb.run(parser.parse_args(["--backend", "shm", "--sizes", "64K,1M", "--repeats", "2",
                                     "--json", str(path)])) == 0
    report = json.loads(path.read_text())
    assert report["backend"] == "shm" and [r["size_bytes"] for r in report["results"]] == [64 << 10, 1 << 20]
    for r in report["results"]:
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["socket_gbps"] > 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("xpyd-kv-") and not _alive(n)]


def _alive(name: str) -> bool:
    pid = int(name.split("-")[2])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def test_auto_picks_shm_on_this_host_and_tcp_otherwise():
    from xpyd.transfer.base import BackendDescriptor

    auto, auto2, tcp = make_backend("auto"), make_backend("auto"), make_backend("tcp")
    try:
        bufs = [auto.allocate(1 << 16), auto2.allocate(1 << 16), memoryview(bytearray(1 << 16))]
        bufs[0][:100] = bytes(range(100))
        d_auto = auto.register(bufs[0])
        d_auto2, d_tcp = auto2.register(bufs[1]), tcp.register(bufs[2])
        assert d_auto.offer("shm") and d_auto.offer("shm-host") == d_auto2.offer("shm-host")
        assert d_auto2.backend == "tcp" and [n for n, _ in d_auto2.offers] == ["shm", "shm-host"]
        assert auto.pick(d_auto2)[0].name == "shm" and auto.pick(d_tcp)[0].name == "tcp"
        elsewhere = BackendDescriptor("tcp", d_auto2.address, d_auto2.buffer_size,
                                      offers=(("shm", d_auto2.offer("shm")), ("shm-host", "another-host")))
        assert auto.pick(elsewhere)[0].name == "tcp"  # same address, other host key: tcp
        # (so a prefill worker computes a streamed prompt's last KV part alone only for the peers tcp reaches)
        assert auto.same_host(d_auto2) and not auto.same_host(d_tcp) and not auto.same_host(elsewhere)
        assert not tcp.same_host(d_auto2) and auto.pick(d_auto2)[0].same_host(d_auto2)
        for i, (dst_backend, desc, buf) in enumerate([(auto2, d_auto2, bufs[1]), (tcp, d_tcp, bufs[2])]):
            rtok = dst_backend.expect(f"x{i}", [Region(1000, 100)], secret=SECRET)
            stok = auto.send(f"x{i}", [Region(0, 100)], desc, [Region(1000, 100)], secret=SECRET)
            assert stok.wait(10) and stok.done() and rtok.wait(10) and rtok.done()
            assert bytes(buf[1000:1100]) == bytes(range(100))
        rtok = auto2.expect("from-tcp", [Region(0, 100)], secret=SECRET)  # a tcp-only sender reaches an auto receiver
        stok = tcp.send("from-tcp", [Region(1000, 100)], d_auto2, [Region(0, 100)], secret=SECRET)
        assert stok.wait(10) and stok.done() and rtok.wait(10) and rtok.done()
        assert auto2.outstanding() == set()  # the shm announcement was withdrawn
        auto.forget_peer(d_auto2.address)
    finally:
        for b in (auto, auto2, tcp):
            b.close()
