"""The cuda_ipc backend's protocol on a CPU: real sockets and threads, host memory standing in for the GPU
(``HostOps``: the device operations' one fake). The real device operations run in
tests/gpu/test_cuda_ipc_transfer.py."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from tests import door
from xpyd import PROTOCOL_VERSION
from xpyd.transfer import cuda_ipc, cuda_ipc_kernel, cuda_ipc_receive, make_backend, shm_board
from xpyd.transfer.auth import new_secret
from xpyd.transfer.base import BackendDescriptor, Region, TransferState
from xpyd.transfer.cuda_ipc import GPU_OFFER, HOST_OFFER, CudaIpcTransferBackend, batches, pieces
from xpyd.transfer.cuda_ipc_device import MAX_HANDLE, Export
from xpyd.transfer.cuda_ipc_hostops import HostOps, HostRegistry
from xpyd.transfer.cuda_ipc_stamps import RECEIVER_STAGES, SENDER_STAGES, Stamps
from xpyd.transfer.cuda_ipc_wire import Hello
from xpyd.transfer.selection import make_worker_backend
from xpyd.transfer.tcp_wire import ProtocolError
from xpyd.worker.kv_staging import needs_staging, pool_memory

SIZE = 1 << 16
TIMEOUT = 10.0


class Side:
    def __init__(self, registry: HostRegistry, fill: int, uuid: str = "GPU-0", ops: HostOps | None = None) -> None:
        self.ops = ops or HostOps(registry, uuid)
        self.pool = np.full(SIZE, fill, dtype=np.uint8)
        self.backend = CudaIpcTransferBackend(io_timeout=5.0, ops=self.ops)
        self.desc = self.backend.register(self.pool)


@pytest.fixture
def pair():
    registry = HostRegistry()
    sender, receiver = Side(registry, 0), Side(registry, 0xAA)
    sender.pool[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8) ^ 0x5C
    yield sender, receiver
    sender.backend.close()
    receiver.backend.close()
    assert sender.backend.outstanding() == set() and receiver.backend.outstanding() == set()


def _expected(receiver_before: np.ndarray, sender: np.ndarray, src, dst) -> np.ndarray:
    out = receiver_before.copy()
    flat = np.concatenate([sender[r.offset: r.end] for r in src])
    at = 0
    for r in dst:
        out[r.offset: r.end] = flat[at: at + r.length]
        at += r.length
    return out


def test_the_piece_table_of_many_runs_is_the_walk_of_both_lists_in_step():
    """Over 16 runs ``piece_table`` works on the runs' cumulative ends (numpy): the same rows as walking
    both lists in step, including runs that end at the same point on both sides."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        total = int(rng.integers(40, 5000))

        def cut() -> list[Region]:
            ends = np.unique(np.concatenate((rng.integers(1, total, int(rng.integers(10, 30))), [total])))
            lengths = np.diff(np.concatenate(([0], ends)))
            return [Region(int(o), int(n)) for o, n in zip(np.cumsum(lengths + rng.integers(0, 9, len(lengths)))
                                                            - lengths, lengths)]

        src, dst = cut(), cut()
        assert len(src) + len(dst) > cuda_ipc_kernel.FEW_RUNS
        assert cuda_ipc_kernel.piece_table(src, dst).tolist() == [list(p) for p in cuda_ipc_kernel._walk(src, dst)]


def test_pieces_pair_runs_and_batches_keep_them_whole():
    src = [Region(0, 10), Region(100, 30)]
    dst = [Region(1000, 25), Region(2000, 15)]
    assert list(pieces(src, dst)) == [(0, 1000, 10), (100, 1010, 15), (115, 2000, 15)]
    assert [b.tolist() for b in batches(src, dst, 12)] == [[[0, 1000, 10], [100, 1010, 15]], [[115, 2000, 15]]]
    assert [b.tolist() for b in batches(src, dst, 25)] == [[[0, 1000, 10], [100, 1010, 15]], [[115, 2000, 15]]]
    assert [b.tolist() for b in batches(src, dst, 1 << 20)] == [[[0, 1000, 10], [100, 1010, 15], [115, 2000, 15]]]
    # a run of adjacent blocks on both sides is one piece, however long
    assert list(pieces([Region(0, 1 << 30)], [Region(4096, 1 << 30)])) == [(0, 4096, 1 << 30)]


def test_bytes_land_in_the_dst_regions_only_with_one_copy_per_piece(pair):
    sender, receiver = pair
    src = [Region(0, 4096), Region(8192, 4096 * 3)]
    dst = [Region(4096 * 5, 4096 * 2), Region(4096 * 10, 4096 * 2)]
    want = _expected(receiver.pool, sender.pool, src, dst)
    secret = new_secret()
    rtok = receiver.backend.expect("t1", dst, secret=secret)
    stok = sender.backend.send("t1", src, receiver.desc, dst, secret=secret)
    assert stok.wait(TIMEOUT) and stok.state() is TransferState.DONE
    assert rtok.state() is TransferState.DONE  # the sender's DONE implies the receiver's
    assert np.array_equal(receiver.pool, want)
    assert receiver.ops.copies == len(list(pieces(src, dst))) == 3
    assert sender.backend.outstanding() == set() and receiver.backend.outstanding() == set()


def test_a_wrong_mac_leaves_the_expected_transfer_pending_and_opens_nothing(pair):
    sender, receiver = pair
    rtok = receiver.backend.expect("t1", [Region(0, 4096)], secret=new_secret())
    stok = sender.backend.send("t1", [Region(0, 4096)], receiver.desc, [Region(0, 4096)], secret=new_secret())
    assert stok.wait(TIMEOUT) and stok.state() is TransferState.FAILED
    assert "MAC does not match" in stok.error
    assert rtok.state() is TransferState.PENDING and receiver.backend.outstanding() == {"t1"}
    assert receiver.ops.registry.opened == 0 and receiver.backend.refused == 1
    assert (receiver.pool == 0xAA).all()
    receiver.backend.abort("t1")


def test_the_offer_goes_out_at_once_and_the_receiver_copies_after_the_forward(pair):
    """The sender offers while its forward still runs; the receiver prepares the copy, then waits on the
    sender's mark (opened from the Offer's handle) and copies only once the forward finished."""
    sender, receiver = pair
    sender.ops.gate.clear()  # the forward is still running on the device
    secret = new_secret()
    rtok = receiver.backend.expect("t1", [Region(0, 4096)], secret=secret)
    stok = sender.backend.send("t1", [Region(0, 4096)], receiver.desc, [Region(0, 4096)], secret=secret)
    assert receiver.ops.waiting.wait(TIMEOUT)  # the receiver waits on the sender's mark; send() returned at once
    assert not sender.ops.waiting.is_set()  # (the sender's thread never waits on its own forward)
    assert receiver.ops.prepared == 1 and receiver.ops.copies == 0 and (receiver.pool == 0xAA).all()
    assert rtok.state() is TransferState.TRANSFERRING and not stok.finished()
    sender.ops.gate.set()
    assert stok.wait(TIMEOUT) and stok.state() is TransferState.DONE
    assert rtok.state() is TransferState.DONE
    assert np.array_equal(receiver.pool[:4096], sender.pool[:4096])


def test_a_sender_abort_before_its_forward_finished_fails_both_and_nothing_lands(pair):
    sender, receiver = pair
    sender.ops.gate.clear()
    secret = new_secret()
    rtok = receiver.backend.expect("t1", [Region(0, 4096)], secret=secret)
    stok = sender.backend.send("t1", [Region(0, 4096)], receiver.desc, [Region(0, 4096)], secret=secret)
    assert receiver.ops.waiting.wait(TIMEOUT)
    sender.backend.abort("t1")  # its board entry is revoked: the receiver must not count this copy
    sender.ops.gate.set()
    assert rtok.wait(TIMEOUT) and rtok.state() is TransferState.FAILED
    assert rtok.error == "transfer 't1' aborted by the sender"
    assert stok.state() is TransferState.FAILED and stok.error == "aborted"
    assert receiver.ops.copies == 0 and (receiver.pool == 0xAA).all()  # (the board is read before copying too)
    # the connection goes on to the next transfer
    tok2 = receiver.backend.expect("t2", [Region(4096, 4096)], secret=secret)
    assert sender.backend.send("t2", [Region(0, 4096)], receiver.desc, [Region(4096, 4096)],
                               secret=secret).wait(TIMEOUT)
    assert tok2.state() is TransferState.DONE
    assert np.array_equal(receiver.pool[4096:8192], sender.pool[:4096])


def test_a_receiver_abort_while_the_forward_runs_returns_at_once_and_nothing_lands(pair):
    sender, receiver = pair
    sender.ops.gate.clear()  # (stays clear until the abort has returned)
    secret = new_secret()
    rtok = receiver.backend.expect("t1", [Region(0, 4096)], secret=secret)
    stok = sender.backend.send("t1", [Region(0, 4096)], receiver.desc, [Region(0, 4096)], secret=secret)
    assert receiver.ops.waiting.wait(TIMEOUT)
    aborter = threading.Thread(target=receiver.backend.abort, args=("t1",))
    aborter.start()
    aborter.join(3.0)
    alive = aborter.is_alive()
    sender.ops.gate.set()  # (before asserting: a stuck receiver thread must not hang the teardown)
    assert not alive  # the receiver's wait for the forward holds no lock
    assert rtok.state() is TransferState.FAILED
    assert stok.wait(TIMEOUT) and stok.state() is TransferState.FAILED
    assert "aborted by the receiver" in stok.error
    assert receiver.ops.copies == 0 and (receiver.pool == 0xAA).all()


def test_a_sender_that_hangs_up_while_its_forward_runs_fails_the_transfer_not_the_receiver(pair):
    """A wait on the event of a process that died never ends (measured on an H200): the receiver waits in a
    thread of its own and gives up when the sender's connection closes; it keeps serving others."""
    sender, receiver = pair
    registry = sender.ops.registry
    dying = Side(registry, 0x11)
    dying.ops.gate.clear()  # its forward never finishes
    try:
        secret = new_secret()
        rtok = receiver.backend.expect("t1", [Region(0, 4096)], secret=secret)
        dying.backend.send("t1", [Region(0, 4096)], receiver.desc, [Region(0, 4096)], secret=secret)
        assert receiver.ops.waiting.wait(TIMEOUT)
        dying.backend.close()  # (its connection closes: the process is gone, for the receiver)
        assert rtok.wait(TIMEOUT) and rtok.state() is TransferState.FAILED
        assert rtok.error == "the sender hung up while the forward of 't1' ran"
        assert receiver.backend.stuck_waits == 1 and receiver.ops.copies == 0 and (receiver.pool == 0xAA).all()
        tok = receiver.backend.expect("t2", [Region(0, 16)], secret=secret)
        assert sender.backend.send("t2", [Region(0, 16)], receiver.desc, [Region(0, 16)], secret=secret).wait(TIMEOUT)
        assert tok.state() is TransferState.DONE
    finally:
        dying.ops.gate.set()  # (lets the waiting thread go)
        dying.backend.close()


def test_a_forward_that_never_finishes_fails_at_the_io_timeout(pair):
    sender, receiver = pair
    receiver.backend.io_timeout = 0.3
    sender.ops.gate.clear()
    try:
        secret = new_secret()
        rtok = receiver.backend.expect("t1", [Region(0, 4096)], secret=secret)
        stok = sender.backend.send("t1", [Region(0, 4096)], receiver.desc, [Region(0, 4096)], secret=secret)
        assert rtok.wait(TIMEOUT) and rtok.state() is TransferState.FAILED
        assert rtok.error == "the sender's forward for 't1' did not finish within 0.3 s"
        assert stok.wait(TIMEOUT) and stok.state() is TransferState.FAILED and "did not finish" in stok.error
        assert receiver.ops.copies == 0
    finally:
        sender.ops.gate.set()


def test_the_board_lives_in_a_segment_of_its_own_until_close(pair):
    import os

    sender, receiver = pair
    secret = new_secret()
    receiver.backend.expect("t1", [Region(0, 16)], secret=secret)
    assert sender.backend.send("t1", [Region(0, 16)], receiver.desc, [Region(0, 16)], secret=secret).wait(TIMEOUT)
    seg = sender.backend._board_seg
    assert os.path.exists(seg.path) and os.path.getsize(seg.path) == shm_board.BYTES
    assert receiver.backend._board_seg is None  # (a worker that never sent has none)
    assert sender.backend._board.in_use() == 0  # retired with the reply
    sender.backend.close()
    assert not os.path.exists(seg.path)


class BlockingOps(HostOps):
    """Holds the first copy until the test releases it (``entered`` once it is inside)."""

    def __init__(self, registry: HostRegistry, uuid: str = "GPU-0") -> None:
        super().__init__(registry, uuid)
        self.entered, self.release = threading.Event(), threading.Event()

    def copy(self, prepared, after, timed=False):
        self.entered.set()
        assert self.release.wait(TIMEOUT)
        return super().copy(prepared, after, timed)


def test_a_sender_abort_while_the_receiver_copies_fails_both(pair):
    sender, _ = pair
    receiver = Side(sender.ops.registry, 0xAA, ops=BlockingOps(sender.ops.registry))
    try:
        secret = new_secret()
        rtok = receiver.backend.expect("t1", [Region(0, 4096)], secret=secret)
        stok = sender.backend.send("t1", [Region(0, 4096)], receiver.desc, [Region(0, 4096)], secret=secret)
        assert receiver.ops.entered.wait(TIMEOUT)
        sender.backend.abort("t1")  # its blocks may be reused now: the copy must not count
        receiver.ops.release.set()
        assert rtok.wait(TIMEOUT) and rtok.state() is TransferState.FAILED
        assert rtok.error == "transfer 't1' aborted by the sender"
        assert stok.state() is TransferState.FAILED
    finally:
        receiver.ops.release.set()
        receiver.backend.close()


def test_a_receiver_abort_while_copying_stops_before_the_next_batch(pair, monkeypatch):
    monkeypatch.setattr(cuda_ipc_receive, "COPY_BATCH", 4096)
    sender, _ = pair
    receiver = Side(sender.ops.registry, 0xAA, ops=BlockingOps(sender.ops.registry))
    try:
        secret = new_secret()
        dst = [Region(0, 4096), Region(8192, 4096)]  # two batches
        rtok = receiver.backend.expect("t1", dst, secret=secret)
        stok = sender.backend.send("t1", [Region(0, 8192)], receiver.desc, dst, secret=secret)
        assert receiver.ops.entered.wait(TIMEOUT)
        aborter = threading.Thread(target=receiver.backend.abort, args=("t1",))
        aborter.start()  # (it waits out the batch in progress)
        assert rtok.wait(TIMEOUT) and rtok.state() is TransferState.FAILED  # failed before the batch ends
        receiver.ops.release.set()
        aborter.join(TIMEOUT)
        assert not aborter.is_alive()
        assert stok.wait(TIMEOUT) and stok.state() is TransferState.FAILED
        assert "aborted by the receiver" in stok.error
        assert receiver.ops.copies == 1 and (receiver.pool[8192:12288] == 0xAA).all()
    finally:
        receiver.ops.release.set()
        receiver.backend.close()


def test_a_peer_on_another_gpu_or_host_is_refused_by_both_sides(pair):
    sender, receiver = pair
    other_gpu = Side(sender.ops.registry, 0xAA, uuid="GPU-1")
    try:
        with pytest.raises(ValueError, match="one GPU only"):
            sender.backend.send("t1", [Region(0, 16)], other_gpu.desc, [Region(0, 16)], secret=new_secret())
        other_host = BackendDescriptor("cuda_ipc", receiver.desc.address, SIZE,
                                       offers=((HOST_OFFER, "another-host"), (GPU_OFFER, "GPU-0")))
        with pytest.raises(ValueError, match="not on this host"):
            sender.backend.send("t1", [Region(0, 16)], other_host, [Region(0, 16)], secret=new_secret())
        # a descriptor that lies about the GPU: the receiver's own check refuses the sender's Hello
        lying = BackendDescriptor("cuda_ipc", other_gpu.desc.address, SIZE,
                                  offers=((HOST_OFFER, sender.backend.host_key), (GPU_OFFER, "GPU-0")))
        secret = new_secret()
        rtok = other_gpu.backend.expect("t1", [Region(0, 16)], secret=secret)
        stok = sender.backend.send("t1", [Region(0, 16)], lying, [Region(0, 16)], secret=secret)
        assert stok.wait(TIMEOUT) and stok.state() is TransferState.FAILED
        assert "sender's pool is on GPU GPU-0, ours on GPU-1" in stok.error
        assert rtok.state() is TransferState.PENDING and other_gpu.ops.registry.opened == 0
        # a Hello from another host
        hello = Hello(PROTOCOL_VERSION, "another-host", "GPU-0", sender.ops.export(), "xpyd-kv-1-b").pack()
        answer = door.knock_pull(receiver.desc.address, hello, b"")
        assert answer.replies[0]["ok"] is False and "not on this host" in answer.replies[0]["error"]
        assert answer.hung_up
    finally:
        other_gpu.backend.close()


def test_a_handle_that_does_not_open_fails_the_transfer_not_the_backend(pair):
    sender, receiver = pair
    stranger = Side(HostRegistry(), 0x11)  # its handle is in a registry the receiver cannot open from
    try:
        secret = new_secret()
        rtok = receiver.backend.expect("t1", [Region(0, 16)], secret=secret)
        stok = stranger.backend.send("t1", [Region(0, 16)], receiver.desc, [Region(0, 16)], secret=secret)
        assert stok.wait(TIMEOUT) and stok.state() is TransferState.FAILED
        assert "cannot open the sender's handle" in stok.error and rtok.state() is TransferState.FAILED
        tok = receiver.backend.expect("t2", [Region(0, 16)], secret=secret)  # the receiver keeps serving
        assert sender.backend.send("t2", [Region(0, 16)], receiver.desc, [Region(0, 16)], secret=secret).wait(TIMEOUT)
        assert tok.state() is TransferState.DONE
    finally:
        stranger.backend.close()


def test_hello_round_trips_and_bounds_every_field():
    export = Export(0, b"h" * 64, 1 << 20, 0, b"ref", 8, b"e" * 64, True, 4096, 8192)
    hello = Hello(PROTOCOL_VERSION, "host", "GPU-0", export, "xpyd-kv-12-cuda_ipc-board-0")
    assert Hello.parse(msgpack.unpackb(hello.pack()[4:], raw=False)) == hello
    good = msgpack.unpackb(hello.pack()[4:], raw=False)
    for key, bad in [("h", b""), ("h", "text"), ("h", b"x" * (MAX_HANDLE + 1)), ("ev", b"x" * (MAX_HANDLE + 1)),
                     ("ref", None), ("host", ""), ("gpu", "g" * 513), ("size", -1), ("n", 0), ("base", 1 << 20),
                     ("dev", "0"), ("sync", 1), ("v", "1"), ("t", "offer"), ("bseg", None),
                     ("bseg", "../../etc/passwd"), ("bseg", "xpyd-kv-1-a/b")]:
        with pytest.raises(ProtocolError):
            Hello.parse({**good, key: bad})
    with pytest.raises(ValueError, match="at most"):  # (what the sender itself would export)
        Export(0, b"h" * (MAX_HANDLE + 1), 1 << 20, 0, b"", 0, b"", False, 0, 8192)


def test_an_offer_carries_its_event_handle_bounded():
    from xpyd.transfer.shm_wire import MAX_EVENT, Offer

    offer = Offer("t1", (Region(0, 16),), (Region(32, 16),), (3, 7), b"m" * 32, b"e" * 64)
    frame = msgpack.unpackb(offer.pack()[4:], raw=False)
    assert Offer.parse(frame, 64, 64) == offer
    assert Offer.parse({k: v for k, v in frame.items() if k != "ev"}, 64, 64).event is None  # (shm, nixl)
    for bad in (b"", b"x" * (MAX_EVENT + 1), "text", 5):
        with pytest.raises(ProtocolError, match="event handle"):
            Offer.parse({**frame, "ev": bad}, 64, 64)


def test_an_offer_without_an_event_or_board_entry_is_refused_and_nothing_lands(pair):
    """What an older sender (or a stranger with the secret) would send: refused with a reason, no copy."""
    from xpyd.transfer.shm_wire import Offer

    sender, receiver = pair
    secret = new_secret()
    key = cuda_ipc.auth.transfer_key(secret, None)
    for board, event in ((None, b"e" * 64), ((0, 1), None)):
        tid = f"old-{board is None}"
        rtok = receiver.backend.expect(tid, [Region(0, 16)], secret=secret)
        src, dst = (Region(0, 16),), (Region(0, 16),)
        offer = Offer(tid, src, dst, board, cuda_ipc.auth.transfer_mac(key, "cuda_ipc", tid, dst, src), event)
        hello = Hello(PROTOCOL_VERSION, sender.backend.host_key, "GPU-0", sender.ops.export(), "xpyd-kv-1-b").pack()
        # (the refusal is in the replies; whether the listener hangs up after it is not what this test reads)
        answer = door.knock_pull(receiver.desc.address, hello, offer.pack(), linger=0.1)
        assert answer.replies[1]["ok"] is False and "no abort board entry or event handle" in answer.replies[1]["error"]
        assert rtok.state() is TransferState.FAILED and receiver.ops.copies == 0
    assert (receiver.pool == 0xAA).all()


def test_the_worker_refuses_cuda_ipc_on_a_cpu_pool_and_without_cuda():
    with pytest.raises(ValueError, match="needs --device cuda"):
        make_worker_backend("cuda_ipc", "127.0.0.1", 0, None, device="cpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_ipc needs CUDA"):
            make_backend("cuda_ipc")
    backend = CudaIpcTransferBackend(ops=HostOps(HostRegistry()))
    try:
        with pytest.raises(ValueError, match=r"on a CUDA device \(--device cuda\)"):
            backend.register(torch.zeros(16, dtype=torch.uint8))
    finally:
        backend.close()


def test_the_worker_hands_cuda_ipc_its_pool_tensor_unstaged():
    import torch

    backend = CudaIpcTransferBackend(ops=HostOps(HostRegistry()))
    tensor = object()
    pool = SimpleNamespace(device=torch.device("cuda", 0), staging=None, tensor=tensor)
    assert pool_memory(pool, backend) is tensor
    assert not needs_staging(backend, torch.device("cuda", 0))
    backend.close()


def test_stamps_note_every_stage_of_both_sides_in_order_and_the_device_time(pair):
    sender, receiver = pair
    assert sender.backend.stamps is None  # off by default
    sender.backend.stamps, receiver.backend.stamps = Stamps(), Stamps()
    secret = new_secret()
    src, dst = [Region(0, 4096), Region(8192, 4096)], [Region(4096, 8192)]
    receiver.backend.expect("t1", dst, secret=secret)
    assert sender.backend.send("t1", src, receiver.desc, dst, secret=secret).wait(TIMEOUT)
    sent, sent_device = sender.backend.stamps.take("t1")
    got, device = receiver.backend.stamps.take("t1")
    assert list(sent) == list(SENDER_STAGES) and sent_device is None
    assert list(got) == list(RECEIVER_STAGES) and device is not None and device >= 0
    # one clock for both sides (perf_counter_ns: CLOCK_MONOTONIC): each stage after what caused it. (A
    # write's stamp follows the write, so the peer may read it first: "offered" is ordered on the sender's
    # own thread only.)
    times = [sent["send"], got["claimed"], got["opened"], got["prepared"], got["ready"], got["launching"],
             got["enqueued"], got["synced"], got["done"], sent["done"]]
    assert times == sorted(times)
    assert sent["send"] <= sent["offered"] <= sent["done"]
    assert receiver.backend.stamps.take("t1") == ({}, None)  # taken: forgotten


def test_stamps_keep_the_last_transfers_only():
    stamps = Stamps(keep=2)
    for tid in ("a", "b", "c"):
        stamps(tid, "send", 1)
    stamps.add_device("c", 0.5)
    assert set(stamps.stages) == {"b", "c"}
    assert stamps.take("c") == ({"send": 1}, 0.5) and stamps.take("a") == ({}, None)


def test_chunk_table_cuts_each_piece_in_order_and_words_fit_every_offset():
    table = cuda_ipc_kernel.chunk_table([(0, 1000, 10), (100, 16, 25)], chunk=8)
    assert table.tolist() == [[0, 8, 100, 108, 116, 124],
                              [1000, 1008, 16, 24, 32, 40],
                              [8, 2, 8, 8, 8, 1]]
    assert cuda_ipc_kernel.word_bytes(table, 4096, 64) == 1  # lengths 2 and 1
    even = cuda_ipc_kernel.chunk_table([(64, 4096, 48), (4096, 0, 32)], chunk=32)
    assert cuda_ipc_kernel.word_bytes(even, 4096, 64) == 8 and cuda_ipc_kernel.vector(even, 4096, 64)
    assert cuda_ipc_kernel.word_bytes(even, 4096, 68) == 4 and not cuda_ipc_kernel.vector(even, 4096, 68)
    with pytest.raises(ValueError, match="lengths > 0"):
        cuda_ipc_kernel.chunk_table([(0, 0, 0)])


def _runs_reference(dst, src, pieces):
    want = dst.clone()
    for s, d, n in pieces:
        want[d: d + n] = src[s: s + n]
    return want


# scattered pieces: misaligned (1-byte words) and 16-byte aligned ones (8-byte words, vector hints),
# several chunks per piece, a last chunk shorter than a step
RUNS = [[(0, 1000, 520), (1024, 2048, 16), (3001, 3, 77)],
        [(0, 1024, 512), (2048, 16, 256), (1536, 3072, 48), (512, 3584, 272)]]


# each variant at a small geometry: several rows per piece, rows of several tiles, partial last tiles
GEOMETRY = {"tiles": {"tile": 64, "sub": 256}, "flat": {"tile": 64}, "loop": {"chunk": 256, "block": 64}}


def _counting(monkeypatch) -> list:
    launches = []
    real = cuda_ipc_kernel._kernel

    class Counting:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launches.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(cuda_ipc_kernel, "_kernel", lambda name, interpret: Counting(real(name, interpret)))
    return launches


@pytest.mark.parametrize("variant", cuda_ipc_kernel.VARIANTS)
@pytest.mark.parametrize("pieces", RUNS)
def test_one_launch_copies_every_run_exactly(pieces, variant, monkeypatch):
    pytest.importorskip("triton", reason="the copy kernel needs Triton")
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = _counting(monkeypatch)
    src = (torch.arange(4096) * 7 % 251).to(torch.uint8)
    dst = torch.full((4096,), 0xAA, dtype=torch.uint8)
    want = _runs_reference(dst, src, pieces)
    runs = cuda_ipc_kernel.Runs(variant, **GEOMETRY[variant])
    rows = runs.rows(pieces).shape[1]
    longest = int(runs.rows(pieces)[2].max())
    grid = {"tiles": (-(-longest // 64), rows), "flat": (rows, 1), "loop": (rows,)}[variant]
    n = runs(dst, src, pieces)
    assert launches == [grid] and n == math.prod(grid)
    assert torch.equal(dst, want)
    dst[:] = 0xAA  # a second launch through the same Runs (its cached views) copies the same again
    assert runs(dst, src, pieces) == n and torch.equal(dst, want)
    other = RUNS[1 - RUNS.index(pieces)]  # then pieces of another word size, same pools
    dst[:] = 0xAA
    want = _runs_reference(dst, src, other)
    runs(dst, src, other)
    assert torch.equal(dst, want)


def test_runs_lets_go_of_a_pool_once_its_owner_does(monkeypatch):
    """A receiver's Runs caches each pool's word view; a peer's pool dropped by its connection must not be
    kept alive by that cache (its memory is the peer's)."""
    pytest.importorskip("triton", reason="the copy kernel needs Triton")
    import weakref

    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs = cuda_ipc_kernel.Runs("tiles", tile=64, sub=256)
    dst = torch.zeros(4096, dtype=torch.uint8)
    peer = (torch.arange(4096) % 251).to(torch.uint8)
    storage = weakref.ref(peer.untyped_storage())
    runs(dst, peer, RUNS[1])
    del peer
    runs(dst, (torch.arange(4096) % 13).to(torch.uint8), RUNS[1])  # the next launch lets the old view go
    assert storage() is None


def test_the_tiles_variant_launches_once_per_65535_rows(monkeypatch):
    pytest.importorskip("triton", reason="the copy kernel needs Triton")
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cuda_ipc_kernel, "MAX_GRID_Y", 2)
    launches = _counting(monkeypatch)
    src = (torch.arange(4096) * 7 % 251).to(torch.uint8)
    dst = torch.full((4096,), 0xAA, dtype=torch.uint8)
    pieces = RUNS[1]
    want = _runs_reference(dst, src, pieces)
    assert cuda_ipc_kernel.copy_runs(dst, src, pieces, "tiles", tile=64, sub=256) == 4 * 6
    assert launches == [(4, 2)] * 3  # rows: 512 -> 256 x2, 256, 48, 272 -> 256 + 16: 6 rows of <= 4 tiles
    assert torch.equal(dst, want)


def test_a_variant_and_its_geometry_are_checked():
    with pytest.raises(ValueError, match="variant must be one of"):
        cuda_ipc_kernel.Runs("fast")
    with pytest.raises(ValueError, match="power of two"):
        cuda_ipc_kernel.Runs("tiles", tile=48)
    with pytest.raises(ValueError, match="tile must divide sub"):
        cuda_ipc_kernel.Runs("tiles", tile=512, sub=256)


def test_the_foreach_fallback_copies_every_run_exactly():
    import torch

    src = (torch.arange(4096) * 7 % 251).to(torch.uint8)
    for pieces in RUNS:
        dst = torch.full((4096,), 0xAA, dtype=torch.uint8)
        want = _runs_reference(dst, src, pieces)
        assert cuda_ipc_kernel.copy_runs_foreach(dst, src, pieces) == len(pieces)
        assert torch.equal(dst, want)


def test_the_copy_kernel_says_why_it_cannot_run(monkeypatch):
    pytest.importorskip("triton", reason="without Triton it says that instead")
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in cuda_ipc_kernel.why_unavailable(torch.device("cpu"))
    with pytest.raises(ValueError, match="past the end"):
        cuda_ipc_kernel.copy_runs_foreach(torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8),
                                          [(0, 8, 9)])


@pytest.mark.parametrize("name", ["tiles", "chunks"])
def test_the_kernel_moves_16_bytes_per_load_and_store_for_aligned_pieces(name):
    """Compiled for an H100/H200 (sm_90) here, without a GPU: the PTX of 16-byte-aligned pieces (the
    ``VEC`` hint) loads and stores the data in 16-byte vectors; without the hint, 8 bytes at a time."""
    triton = pytest.importorskip("triton", reason="the copy kernel needs Triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def data_ops(vec: int, **constexprs) -> set[str]:
        if name == "tiles":
            constexprs = {"TILE": 4096, "VEC": vec, **constexprs}
        else:
            constexprs = {"CHUNK": 4096, "BLOCK": 2048, "VEC": vec}
        signature = {"src": "*i64", "dst": "*i64", "table": "*i64", **{k: "constexpr" for k in constexprs}}
        source = ASTSource(cuda_ipc_kernel._kernel(name, False), signature=signature, constexprs=constexprs,
                           attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
        try:
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        except Exception as e:  # (a Triton build without the CUDA backend's tools)
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        ops = {line.split()[1] for line in ptx.splitlines() if line.strip().startswith(("@", "ld.", "st."))}
        return {op for op in ops if op.startswith(("ld.global", "st.global"))}

    for flat in ([False, True] if name == "tiles" else [None]):
        extra = {} if flat is None else {"FLAT": flat}
        assert data_ops(2, **extra) == {"ld.global.v2.b64", "st.global.v2.b64"}
        assert data_ops(1, **extra) == {"ld.global.b64", "st.global.b64"}
