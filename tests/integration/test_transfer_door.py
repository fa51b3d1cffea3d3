"""Nobody but the sender a transfer's secret went to writes into a KV pool (real listeners, real sockets).

A receiving backend (the decode side) expects a transfer ("victim") with a fresh secret, as a pull would
have it; a third party then connects to the listener's real address and tries to open that transfer, or
to replay a finished one: without a MAC, with a wrong secret, with the right secret under a wrong or no
cluster token, with the frame of a finished transfer (again after its id is expected anew), with a valid
MAC for other regions. Each is refused (error reply, connection closed), counted, and leaves both pools
byte for byte as they were and the expected transfer pending; its real sender then completes it.
The knocks (tests/door.py) take an address, so the multi-host test bed can run them across hosts.
"""

from __future__ import annotations

import os
import random

import pytest

from tests import door
from tests.door import NO_MAC
from xpyd.transfer import make_backend, shm_board, shm_segment
from xpyd.transfer.auth import new_secret
from xpyd.transfer.base import TransferState

TOKEN = "the-cluster-token"
SIZE = 1 << 20
FILL = 0xAA
EVIL = 0xEE
DONE_SRC = door.regions([[0, 4096]])
DONE_DST = door.regions([[0, 4096]])  # where a finished transfer landed (what a replay names)
VICTIM_SRC = door.regions([[8192, 4096], [65536, 8192]])
VICTIM_DST = door.regions([[16384, 8192], [131072, 4096]])
OTHER_DST = door.regions([[16384, 12288]])  # the victim's id and size, other regions

# (case id, the needle in the refusal)
CASES = [
    ("no-mac", "no MAC"),
    ("wrong-secret", "MAC does not match"),
    ("wrong-token", "MAC does not match"),  # the right secret, leaked, without the cluster token
    ("no-token", "MAC does not match"),
    ("replay", "unexpected transfer id"),  # the frame of a finished transfer
    ("replay-reexpected", "MAC does not match"),  # ... while its id is expected again, with a new secret
    ("other-regions", "MAC does not match"),  # the victim's valid MAC (sniffed) on a frame naming other regions
]


class Pair:
    """A receiver (ordinary memory, as a decode pool) and its real sender, both with the cluster token; one
    transfer already finished, the victim expected."""

    def __init__(self, receiver: str, sender: str) -> None:
        self.rx = make_backend(receiver, cluster_token=TOKEN, io_timeout=5.0)
        self.tx = make_backend(sender, cluster_token=TOKEN, io_timeout=5.0)
        allocate = getattr(self.tx, "allocate", None)
        self.src = allocate(SIZE) if allocate else memoryview(bytearray(SIZE))
        self.src[:] = random.Random(7).randbytes(SIZE)
        self.tx.register(self.src)
        self.dst = bytearray([FILL]) * SIZE
        self.desc = self.rx.register(memoryview(self.dst))
        self.done_secret = new_secret()
        rtok = self.rx.expect("done", DONE_DST, secret=self.done_secret)
        stok = self.tx.send("done", DONE_SRC, self.desc, DONE_DST, secret=self.done_secret)
        assert stok.wait(10) and stok.done() and rtok.done()
        self.secret = new_secret()
        self.victim = self.rx.expect("victim", VICTIM_DST, secret=self.secret)

    def snapshot(self) -> tuple[bytes, bytes]:
        return bytes(self.src), bytes(self.dst)

    def finish_victim(self) -> None:
        """The real sender completes the victim: its bytes land where expected, nothing else moves."""
        before = bytearray(self.dst)
        stok = self.tx.send("victim", VICTIM_SRC, self.desc, VICTIM_DST, secret=self.secret)
        assert stok.wait(10) and stok.done(), stok.error
        assert self.victim.wait(10) and self.victim.done()
        payload = b"".join(bytes(self.src[r.offset:r.end]) for r in VICTIM_SRC)
        pos = 0
        for r in VICTIM_DST:
            before[r.offset:r.end] = payload[pos:pos + r.length]
            pos += r.length
        assert self.dst == before

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def _attack_frame(case: str, backend: str, pair: Pair):
    """(tid, dst, src, mac) of the frame a third party opens with, for ``case`` (``src``: shm's, the third
    party's own regions, or the real sender's for a replay); re-expects 'done' for that case."""
    tid, dst, src, secret, token = "victim", VICTIM_DST, VICTIM_SRC, pair.secret, TOKEN
    if case == "wrong-secret":
        secret = new_secret()
    elif case == "wrong-token":
        token = "not-the-cluster-token"
    elif case == "no-token":
        token = None
    elif case in ("replay", "replay-reexpected"):
        tid, dst, src, secret = "done", DONE_DST, DONE_SRC, pair.done_secret
        if case == "replay-reexpected":
            pair.rx.expect("done", DONE_DST, secret=new_secret())
    src = src if backend == "shm" else ()
    if case == "no-mac":
        return tid, dst, src, NO_MAC
    mac = door.mac_for(backend, tid, dst, secret, token, src)
    if case == "other-regions":
        dst = OTHER_DST
    return tid, dst, src, mac


def _check_refused(pair: Pair, answer: door.Answer, needle: str, before: tuple[bytes, bytes], refused: int) -> None:
    reply = answer.replies[-1]
    assert reply["ok"] is False and needle in reply["error"], reply
    assert answer.hung_up  # the connection is closed: nothing more is read from it
    assert pair.snapshot() == before  # both pools, byte for byte
    assert pair.victim.state() is TransferState.PENDING  # still there for its real sender
    assert pair.rx.refused == refused + 1


@pytest.mark.parametrize("receiver", ["tcp", "auto"])
@pytest.mark.parametrize("case,needle", CASES, ids=[c for c, _ in CASES])
def test_a_third_party_cannot_open_a_tcp_transfer(receiver, case, needle):
    pair = Pair(receiver, "tcp")
    try:
        before, refused = pair.snapshot(), pair.rx.refused
        tid, dst, _, mac = _attack_frame(case, "tcp", pair)
        payload = bytes([EVIL]) * sum(r.length for r in dst)
        answer = door.knock_tcp(pair.desc.address, door.tcp_header(tid, dst, mac), payload)
        _check_refused(pair, answer, needle, before, refused)
        pair.rx.abort("done")  # (replay-reexpected: its new expectation)
        pair.finish_victim()
    finally:
        pair.close()


def _read_only_mappings(name: str) -> int:
    """This process's read-only mappings of /dev/shm/``name`` (a receiver maps a peer's segment so)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(f"/dev/shm/{name}") and line.split()[1].startswith("r-"))


@pytest.mark.parametrize("receiver", ["shm", "auto"])
@pytest.mark.parametrize("case,needle", CASES, ids=[c for c, _ in CASES])
def test_a_third_party_cannot_open_an_shm_transfer(receiver, case, needle):
    """Over the shm control connection: a Hello naming the third party's own segment (full of 0xEE; the
    replays name the real sender's, as its Hello did), then an offer. Nothing is mapped, nothing copied."""
    pair = Pair(receiver, receiver)
    intruder = shm_segment.create(shm_board.segment_size(SIZE), "intruder")
    try:
        intruder.buffer()[:SIZE] = bytes([EVIL]) * SIZE
        segment = intruder.name
        if case.startswith("replay"):  # (both segments hold a SIZE pool, then the board)
            segment = (pair.tx if receiver == "shm" else pair.tx.extras[0]).segment_name
        size, board = shm_board.segment_size(SIZE), shm_board.board_offset(SIZE)
        before, refused = pair.snapshot(), pair.rx.refused
        tid, dst, src, mac = _attack_frame(case, "shm", pair)
        hello = door.shm_hello(segment, size, shm_segment.host_key(), board)
        answer = door.knock_pull(pair.desc.offer("shm"), hello, door.offer(tid, src, dst, mac))
        assert answer.replies[0]["ok"] is True  # (the Hello itself is fine: same host, same version)
        assert answer.replies[-1]["bye"] is True  # a connection that never opened a transfer is hung up on
        _check_refused(pair, answer, needle, before, refused)
        assert _read_only_mappings(intruder.name) == 0  # the third party's segment was never even mapped
        pair.rx.abort("done")
        pair.finish_victim()
    finally:
        intruder.unlink()
        pair.close()


def test_segments_are_private_and_a_shared_one_is_not_mapped(tmp_path):
    """The file mode is shm's boundary: segments are created 0600, and a receiver maps no segment that
    other users could have written (group/other bits) or that another user owns."""
    seg = shm_segment.create(4096, "mode")
    try:
        assert os.stat(seg.path).st_mode & 0o777 == 0o600
        os.chmod(seg.path, 0o644)  # (as if another process had opened it up)
        with pytest.raises(shm_segment.SegmentError, match="not private"):
            shm_segment.map_peer(seg.name, 4096)
        os.chmod(seg.path, 0o600)
        assert shm_segment.map_peer(seg.name, 4096)[:1] == b"\0"
    finally:
        seg.unlink()
    old = os.umask(0)  # a permissive umask does not widen it
    try:
        seg = shm_segment.create(4096, "umask")
        assert os.stat(seg.path).st_mode & 0o777 == 0o600
        seg.unlink()
    finally:
        os.umask(old)


def test_a_proven_shm_connection_survives_a_refusal():
    """A refusal on a connection whose sender already opened a transfer (the receiver aborted the next one
    before its offer came) keeps the connection: no reconnect, no second mapping of the sender's segment."""
    pair = Pair("shm", "shm")
    try:
        pair.rx.abort("victim")
        stok = pair.tx.send("victim", VICTIM_SRC, pair.desc, VICTIM_DST, secret=pair.secret)
        assert stok.wait(10) and stok.failed() and "unexpected transfer id" in stok.error
        secret = new_secret()
        rtok = pair.rx.expect("again", VICTIM_DST, secret=secret)
        stok = pair.tx.send("again", VICTIM_SRC, pair.desc, VICTIM_DST, secret=secret)
        assert stok.wait(10) and stok.done() and rtok.done()
        assert _read_only_mappings(pair.tx.segment_name) == 1  # still the first connection's mapping
        assert pair.rx.refused == 1
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["tcp", "shm", "auto"])
def test_in_a_rotation_window_a_receiver_takes_either_tokens_sender_and_no_third(backend):
    """A receiver that switched to the new token and still accepts the old one (the second step of a rotation)
    receives from a sender still on the old token and from one on the new; a transfer MACed with a token it
    does not hold (its secret leaked) is refused and leaves the pool as it was."""
    new = "the-next-cluster-token"
    rx = make_backend(backend, cluster_token=new, accepted_tokens=(TOKEN,), io_timeout=5.0)
    senders = [make_backend(backend, cluster_token=t, io_timeout=5.0) for t in (TOKEN, new, "a-third-token")]
    try:
        dst = bytearray([FILL]) * SIZE
        desc = rx.register(memoryview(dst))
        for i, tx in enumerate(senders):
            src = tx.allocate(SIZE) if hasattr(tx, "allocate") else memoryview(bytearray(SIZE))
            src[:] = bytes([i + 1]) * SIZE
            tx.register(src)
            secret, region = new_secret(), door.regions([[i * 8192, 4096]])
            rtok = rx.expect(f"t{i}", region, secret=secret)
            stok = tx.send(f"t{i}", region, desc, region, secret=secret)
            assert stok.wait(10)
            if i < 2:
                assert stok.done() and rtok.wait(10) and rtok.done(), stok.error
                assert dst[i * 8192:i * 8192 + 4096] == bytes([i + 1]) * 4096
            else:
                assert stok.failed() and "MAC does not match" in stok.error, stok.error
                assert rtok.state() is TransferState.PENDING and rx.refused == 1
                assert dst[i * 8192:] == bytes([FILL]) * (SIZE - i * 8192)  # nothing of it landed
    finally:
        for b in (*senders, rx):
            b.close()


@pytest.mark.parametrize("backend", ["tcp", "shm", "auto"])
@pytest.mark.parametrize("accepted", [(None,), ("",), "the-old-token", (b"the-old-token",)])
def test_a_receiver_accepts_no_none_or_empty_token_beside_its_own(backend, accepted):
    """The key of "no token" is one any sender can derive: a receiver told to accept it (or an empty token, or a
    bare string whose characters would each be a token) refuses to start rather than take transfers from anyone."""
    with pytest.raises(ValueError, match="accepted tokens"):
        make_backend(backend, cluster_token=TOKEN, accepted_tokens=accepted, io_timeout=5.0)
