"""Transfer interface pieces (token, descriptor, factory) and the in-process fake backend."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest

from xpyd.transfer import make_backend
from xpyd.transfer.base import (
    AllOf,
    BackendDescriptor,
    CompletionToken,
    Region,
    TransferBackend,
    TransferError,
    TransferState,
    expect_parts,
)
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.transfer.auth import new_secret

SECRET = new_secret()  # the transfers here that are not about their secret share one

SIZE = 4096
FILL = 0xAA


# -- CompletionToken ---------------------------------------------------------


def test_token_moves_forward_and_failure_is_sticky():
    t = CompletionToken("a")
    assert t.state() is TransferState.PENDING
    assert (t.done(), t.failed(), t.finished(), t.error) == (False, False, False, None)
    assert t._advance(TransferState.TRANSFERRING)
    assert t._fail("boom") and t.failed() and t.finished() and t.error == "boom"
    assert not t._advance(TransferState.DONE) and not t._fail("again")
    assert t.state() is TransferState.FAILED and t.error == "boom"


def test_token_done_is_final_and_illegal_transitions_raise():
    t = CompletionToken("a")
    assert t._advance(TransferState.DONE) and t.done() and t.finished() and not t.failed()
    assert not t._fail("late") and t.done() and t.error is None
    t2 = CompletionToken("b")
    t2._advance(TransferState.TRANSFERRING)
    with pytest.raises(ValueError, match="illegal"):
        t2._advance(TransferState.TRANSFERRING)
    with pytest.raises(ValueError, match="_fail"):
        t2._advance(TransferState.FAILED)
    with pytest.raises(ValueError, match="_fail"):
        t2._advance(TransferState.PENDING)
    assert TransferState.FAILED < TransferState.PENDING < TransferState.TRANSFERRING < TransferState.DONE


def test_token_wait():
    t = CompletionToken("w")
    t0 = time.monotonic()
    assert t.wait(0.05) is False and time.monotonic() - t0 >= 0.04
    threading.Timer(0.02, t._advance, args=(TransferState.DONE,)).start()
    assert t.wait(5) is True and t.done()
    with pytest.raises(ValueError):
        t.wait(-1)


# -- BackendDescriptor / factory --------------------------------------------------


def test_descriptor_roundtrip_and_validation():
    d = BackendDescriptor("tcp", "10.0.0.5:7000", 1 << 30)
    wire = msgpack.packb(d.to_dict())
    assert BackendDescriptor.from_dict(msgpack.unpackb(wire)) == d
    for bad in (
        {"backend": "tcp", "address": "h:1"},
        {"backend": "", "address": "h:1", "buffer_size": 1},
        {"backend": "tcp", "address": "", "buffer_size": 1},
        {"backend": "tcp", "address": "h:1", "buffer_size": 0},
        {"backend": "tcp", "address": "h:1", "buffer_size": True},
        {"backend": "tcp", "address": "h:1", "buffer_size": "10"},
        {"backend": "tcp", "address": "x" * 600, "buffer_size": 1},
        ["tcp", "h:1", 1],
    ):
        with pytest.raises(ValueError):
            BackendDescriptor.from_dict(bad)


def test_make_backend_is_lazy_and_checks_names():
    fake = make_backend("fake")
    assert isinstance(fake, FakeTransferBackend) and isinstance(fake, TransferBackend)
    tcp = make_backend("tcp", port=0)
    assert tcp.name == "tcp" and isinstance(tcp, TransferBackend)
    assert not [t for t in threading.enumerate() if t.name.startswith("xpyd-")]  # no threads in __init__
    tcp.close()
    with pytest.raises(ValueError, match="known: auto, cuda_ipc, fake, neuron, nixl, shm, tcp"):
        make_backend("rdma")


# -- FakeTransferBackend ------------------------------------------------------------


def fake(network=None, auto=False, fill=FILL):
    be = FakeTransferBackend(network, auto_complete=auto)
    buf = bytearray([fill]) * SIZE if isinstance(fill, int) else bytearray(fill)
    return be, buf, be.register(memoryview(buf))


def test_manual_mode_tokens_wait_for_the_test():
    a, _, _ = fake()
    b, bbuf, bdesc = fake()
    r = b.expect("t1", [Region(0, 10)], secret=SECRET)
    s = a.send("t1", [Region(0, 10)], bdesc, [Region(0, 10)], secret=SECRET)
    assert s.state() is r.state() is TransferState.PENDING
    a.start("t1")
    assert s.state() is TransferState.TRANSFERRING
    a.complete("t1")
    b.fail("t1", "link down")
    assert s.done() and r.failed() and r.error == "link down"
    assert (a.sent, b.expected, a.aborted) == (["t1"], ["t1"], [])
    assert a.outstanding() == set() == b.outstanding()
    assert bbuf == bytearray([FILL]) * SIZE  # manual mode moves no bytes
    with pytest.raises(KeyError):
        a.complete("t1")


def test_auto_complete_copies_exact_bytes():
    net = FakeNetwork()
    a, abuf, _ = fake(net, auto=True, fill=bytes(range(256)) * (SIZE // 256))
    b, bbuf, bdesc = fake(net, auto=True)
    src = [Region(0, 5), Region(100, 20), Region(4000, 15)]
    dst = [Region(3000, 30), Region(10, 10)]
    r = b.expect("x", dst, secret=SECRET)
    s = a.send("x", src, bdesc, dst, secret=SECRET)
    assert s.done() and r.done()
    payload = bytes(abuf[0:5] + abuf[100:120] + abuf[4000:4015])
    want = bytearray([FILL]) * SIZE
    want[3000:3030], want[10:20] = payload[:30], payload[30:]
    assert bbuf == want
    assert a.outstanding() == set() == b.outstanding()


def test_auto_complete_refuses_like_tcp():
    net = FakeNetwork()
    a, _, _ = fake(net, auto=True, fill=1)
    b, bbuf, bdesc = fake(net, auto=True)
    s = a.send("ghost", [Region(0, 10)], bdesc, [Region(0, 10)], secret=SECRET)
    assert s.failed() and "unexpected transfer id" in s.error
    r = b.expect("k", [Region(0, 10)], secret=SECRET)
    s = a.send("k", [Region(0, 10)], bdesc, [Region(0, 10)], secret=new_secret())  # not the sender it went to
    assert s.failed() and "MAC does not match" in s.error and r.state() is TransferState.PENDING
    assert a.send("k", [Region(0, 10)], bdesc, [Region(0, 10)], secret=SECRET).done() and r.done()
    r = b.expect("m", [Region(0, 10)], secret=SECRET)
    s = a.send("m", [Region(0, 10)], bdesc, [Region(10, 10)], secret=SECRET)
    assert s.failed() and r.failed() and "differ" in s.error
    b.close()
    s = a.send("gone", [Region(0, 10)], bdesc, [Region(0, 10)], secret=SECRET)
    assert s.failed() and "cannot reach" in s.error
    assert bbuf == bytearray([1]) * 10 + bytearray([FILL]) * (SIZE - 10)  # only what "k" moved


def test_abort_and_close():
    a, _, _ = fake()
    b, _, bdesc = fake()
    r = b.expect("e", [Region(0, 10)], secret=SECRET)
    s = a.send("s", [Region(0, 10)], bdesc, [Region(0, 10)], secret=SECRET)
    b.abort("e")
    a.abort("unknown")
    assert r.failed() and r.error == "aborted" and b.aborted == ["e"] and a.aborted == []
    r2 = b.expect("e2", [Region(0, 10)], secret=SECRET)
    a.close()
    b.close()
    assert s.failed() and s.error == "backend closed" and r2.failed()
    with pytest.raises(TransferError, match="closed"):
        a.send("late", [Region(0, 10)], bdesc, [Region(0, 10)], secret=SECRET)


def test_fake_validates_like_the_real_backends():
    a, _, _ = fake()
    b, _, bdesc = fake()
    with pytest.raises(ValueError, match="outside"):
        a.send("x", [Region(SIZE, 1)], bdesc, [Region(0, 1)], secret=SECRET)
    with pytest.raises(ValueError, match="outside"):
        b.expect("x", [Region(SIZE - 1, 2)], secret=SECRET)
    with pytest.raises(ValueError, match="bytes"):
        a.send("x", [Region(0, 2)], bdesc, [Region(0, 1)], secret=SECRET)
    with pytest.raises(ValueError, match="transfer_id"):
        b.expect("z" * 257, [Region(0, 1)], secret=SECRET)
    with pytest.raises(ValueError, match="fake"):
        a.send("x", [Region(0, 1)], BackendDescriptor("tcp", "h:1", SIZE), [Region(0, 1)], secret=SECRET)
    b.expect("dup", [Region(0, 1)], secret=SECRET)
    with pytest.raises(TransferError, match="already expected"):
        b.expect("dup", [Region(0, 1)], secret=SECRET)
    with pytest.raises(TransferError, match="register"):
        FakeTransferBackend().expect("x", [Region(0, 1)], secret=SECRET)
    with pytest.raises(ValueError, match="auto_complete"):
        FakeTransferBackend(auto_complete=True)
    for secret in (b"", b"x" * 31, "s" * 32, None):  # a secret is 32 bytes, for sends and expects alike
        with pytest.raises(ValueError, match="secret"):
            b.expect("s", [Region(0, 1)], secret=secret)
        with pytest.raises(ValueError, match="secret"):
            a.send("s", [Region(0, 1)], bdesc, [Region(0, 1)], secret=secret)


# -- a receive in parts (expect_parts / AllOf) -------------------------------


PARTS = [(f"r.{i}", [Region(100 * i, 100)]) for i in range(3)]


def test_a_failed_part_aborts_the_others_before_the_receive_reads_failed():
    """A part fails (its sender's connection broke); the sender reconnects and sends the next part: by the
    time the receive reads FAILED (and its blocks are freed) that part is no longer expected, so it is
    refused and nothing of it lands."""
    net = FakeNetwork()
    a, _, _ = fake(net, auto=True, fill=7)
    b, bbuf, bdesc = fake(net)
    recv = expect_parts(b, "r", PARTS, secret=SECRET)
    assert a.send("r.0", [Region(0, 100)], bdesc, [Region(0, 100)], secret=SECRET).done()
    b.fail("r.1", "sender connection lost mid-transfer")
    assert recv.failed() and recv.error == "sender connection lost mid-transfer"
    assert b.outstanding() == set() and b.aborted == ["r.2"]
    before = bytes(bbuf)
    late = a.send("r.2", [Region(0, 100)], bdesc, [Region(200, 100)], secret=SECRET)
    assert late.failed() and "unexpected transfer id" in late.error
    assert bytes(bbuf) == before and bbuf[200:300] == bytearray([FILL]) * 100


def test_aborting_a_receive_in_parts_aborts_every_part():
    b, _, _ = fake()
    recv = expect_parts(b, "r", PARTS, secret=SECRET)
    b.complete("r.0")
    recv.abort("client gone")
    assert recv.failed() and recv.error == "client gone"
    assert sorted(b.aborted) == ["r.1", "r.2"] and b.outstanding() == set()
    with pytest.raises(TypeError, match="cannot abort"):
        AllOf("x", [CompletionToken("x.0")]).abort()


def test_a_part_that_cannot_be_announced_withdraws_the_ones_before_it():
    b, _, _ = fake()
    b.expect("r.2", [Region(900, 10)], secret=SECRET)  # (its id is taken)
    with pytest.raises(TransferError, match="already expected"):
        expect_parts(b, "r", PARTS, secret=SECRET)
    assert b.aborted == ["r.0", "r.1"] and b.outstanding() == {"r.2"}


def test_a_receive_in_parts_is_done_when_every_part_is():
    b, _, _ = fake()
    recv = expect_parts(b, "r", PARTS, secret=SECRET)
    for tid, _ in PARTS:
        assert not recv.finished()
        b.complete(tid)
    assert recv.done() and b.aborted == [] and b.outstanding() == set()
