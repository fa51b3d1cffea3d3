"""The nixl backend's parts that need no NIXL: READ planning, the hello frame, the import guard, and the
receiver's door (with NIXL's agent faked out: a real listener refuses an offer without the transfer's MAC
before it loads the sender's metadata or posts a READ).

The backend itself runs the transfer contract suite (tests/integration/test_transfer_contract.py)
when NIXL is installed.
"""

from __future__ import annotations

import importlib
import sys

import msgpack
import pytest

from tests import door
from xpyd import PROTOCOL_VERSION
from xpyd.transfer import make_backend
from xpyd.transfer import nixl_backend
from xpyd.transfer.auth import new_secret
from xpyd.transfer.base import TransferState
from xpyd.transfer.shm_wire import Commit
from xpyd.transfer.base import DeviceMemory, Region, TransferError
from xpyd.transfer.nixl_agent import HOST, descs, memory_of, plan
from xpyd.transfer.nixl_wire import MAX_METADATA, Hello
from xpyd.transfer.tcp_wire import ProtocolError


def _bytes(requests):
    return [sum(n for _, _, n in r) for r in requests]


def test_plan_walks_both_region_lists_in_step_and_caps_each_request():
    src = [Region(0, 10), Region(100, 30)]
    dst = [Region(1000, 25), Region(2000, 15)]
    assert plan(src, dst, 1 << 20) == [[(0, 1000, 10), (100, 1010, 15), (115, 2000, 15)]]
    requests = plan(src, dst, 12)
    assert _bytes(requests) == [12, 12, 12, 4]
    flat = [p for r in requests for p in r]
    assert flat[0] == (0, 1000, 10) and flat[1] == (100, 1010, 2)
    # every byte once, in order, on both sides
    assert [s + i for s, _, n in flat for i in range(n)] == list(range(10)) + list(range(100, 130))
    assert [d + i for _, d, n in flat for i in range(n)] == list(range(1000, 1025)) + list(range(2000, 2015))


def test_plan_refuses_mismatched_totals_and_bad_chunks():
    with pytest.raises(ValueError, match="different byte counts"):
        plan([Region(0, 10)], [Region(0, 11)], 8)
    with pytest.raises(ValueError, match="chunk"):
        plan([Region(0, 10)], [Region(0, 10)], 0)


def test_hello_round_trips_and_rejects_bad_fields():
    for memory in (HOST, ("VRAM", 3)):
        h = Hello(1, "xpyd-1-ab", b"\x00md", 4096, 1 << 20, memory)
        frame = h.pack()
        assert Hello.parse(msgpack.unpackb(frame[4:], raw=False)) == h
    good = {"t": "hello", "v": 1, "agent": "a", "md": b"x", "addr": 4096, "size": 10, "mem": "DRAM", "dev": 0}
    assert Hello.parse(good).memory == ("DRAM", 0)
    for key, bad in [("md", "text"), ("md", b""), ("md", b"x" * (MAX_METADATA + 1)), ("agent", ""),
                     ("addr", 0), ("addr", -5), ("size", 0), ("size", 1 << 64), ("v", "1"), ("t", "offer"),
                     ("mem", "BLK"), ("mem", None), ("dev", -1), ("dev", "0"), ("dev", 1 << 16)]:
        with pytest.raises(ProtocolError):
            Hello.parse({**good, key: bad})


def test_imports_without_nixl_and_construction_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # as if not installed
    for mod in ("xpyd.transfer.nixl_backend", "xpyd.transfer.nixl_agent", "xpyd.transfer.nixl_wire"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
        importlib.import_module(mod)
    with pytest.raises(ImportError, match=r"pip install 'xpyd\[nixl\]'.*pip install --no-deps nixl nixl-cu13"):
        make_backend("nixl")


def test_descriptors_name_the_device_of_each_side():
    pieces = [(0, 4096, 10), (100, 8192, 20)]
    src, dst = descs(pieces, 0, 1 << 20, device=2), descs(pieces, 1, 1 << 30)
    assert src.tolist() == [[(1 << 20) + 0, 10, 2], [(1 << 20) + 100, 20, 2]]
    assert dst.tolist() == [[(1 << 30) + 4096, 10, 0], [(1 << 30) + 8192, 20, 0]]
    assert memory_of("cpu", 0) == ("DRAM", 0) and memory_of("cuda", 1) == ("VRAM", 1)
    with pytest.raises(ValueError, match="host or CUDA"):
        memory_of("xla", 0)


def test_device_memory_is_validated():
    assert DeviceMemory("cuda", 0, 1 << 32, 4096).nbytes == 4096
    for args in [("xla", 0, 4096, 1), ("cuda", -1, 4096, 1), ("cuda", 0, 0, 1), ("cuda", 0, 4096, 0),
                 ("cuda", 0, (1 << 64) - 8, 16), ("cuda", 0.5, 4096, 1)]:
        with pytest.raises(ValueError):
            DeviceMemory(*args)


class _RecordingAgent:
    """Stands in for ``nixl_agent.Agent`` (no NIXL here): records what the backend registers and reads."""

    def __init__(self, name: str) -> None:
        self.name, self.registered, self.reads, self.closed = name, [], [], False
        self.loaded: list[bytes] = []  # metadata handed to add_peer
        self.dropped: list[str] = []

    def add_peer(self, metadata: bytes) -> str:
        self.loaded.append(metadata)
        return "sender-agent"

    def drop_peer(self, name: str) -> None:
        self.dropped.append(name)

    def register(self, addr, size, memory):
        self.registered.append((addr, size, memory))

    def metadata(self) -> bytes:
        return b"md"

    def read(self, peer, pieces, src_base, dst_base, src_memory, dst_memory):
        self.reads.append((peer, pieces, src_base, dst_base, src_memory, dst_memory))
        return "read"

    def release(self, read) -> None:
        pass

    def kick(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_gpu_pool_is_registered_as_vram_and_reads_name_both_sides_memory(monkeypatch):
    """The plumbing of a CUDA pool through the nixl backend, with NIXL faked out (no GPU, no NIXL needed):
    register() passes the device pointer as VRAM of its device, the Hello carries it, and a READ names the
    sender's memory (from its Hello) and ours. Whether NIXL/UCX then moves GPU bytes is untested here."""
    monkeypatch.setattr(nixl_backend, "load", lambda: None)
    monkeypatch.setattr(nixl_backend, "Agent", _RecordingAgent)
    backend = nixl_backend.NixlTransferBackend()
    try:
        assert backend.registers_device_memory
        desc = backend.register(DeviceMemory("cuda", 1, 0x7F0000000000, 1 << 20))
        assert desc.backend == "nixl" and desc.buffer_size == 1 << 20
        agent = backend._agent
        assert agent.registered == [(0x7F0000000000, 1 << 20, ("VRAM", 1))]
        sender = Hello(1, "peer", b"md", 0x10000, 1 << 20, HOST)  # a CPU sender
        monkeypatch.setattr(backend._progress, "wait_read", lambda read, timeout, closed: None)
        assert backend._read_one("peer", [(0, 4096, 64)], sender) is None
        assert agent.reads == [("peer", [(0, 4096, 64)], 0x10000, 0x7F0000000000, ("DRAM", 0), ("VRAM", 1))]
        with pytest.raises(TransferError, match="already registered"):
            backend.register(memoryview(bytearray(64)))
    finally:
        backend.close()
    host = nixl_backend.NixlTransferBackend()
    try:
        host.register(memoryview(bytearray(4096)))
        assert host._agent.registered[0][1:] == (4096, ("DRAM", 0))
    finally:
        host.close()


def test_a_strangers_offer_is_refused_before_its_metadata_is_loaded(monkeypatch):
    """A nixl receiver's listener, NIXL faked out: a third party's Hello (its own agent metadata) and an offer
    without the transfer's MAC, or with a wrong one, are refused and hung up on; its metadata never reaches
    NIXL and no READ is posted. The sender holding the secret then opens the transfer (metadata loaded, READ
    posted, committed, DONE)."""
    monkeypatch.setattr(nixl_backend, "load", lambda: None)
    monkeypatch.setattr(nixl_backend, "Agent", _RecordingAgent)
    token = "the-cluster-token"
    backend = nixl_backend.NixlTransferBackend(io_timeout=5.0, cluster_token=token)
    try:
        desc = backend.register(memoryview(bytearray(1 << 16)))
        monkeypatch.setattr(backend._progress, "wait_read", lambda read, timeout, closed: None)
        agent, secret = backend._agent, new_secret()
        src, dst = door.regions([[0, 4096]]), door.regions([[8192, 4096]])
        victim = backend.expect("victim", dst, secret=secret)
        hello = Hello(PROTOCOL_VERSION, "stranger", b"stranger-md", 0x10000, 1 << 20).pack()
        for mac, needle in [(door.NO_MAC, "no MAC"),
                            (door.mac_for("nixl", "victim", dst, new_secret(), token, src), "does not match"),
                            (door.mac_for("nixl", "victim", dst, secret, None, src), "does not match"),
                            (door.mac_for("shm", "victim", dst, secret, token, src), "does not match")]:
            answer = door.knock_pull(desc.address, hello, door.offer("victim", src, dst, mac, board=None))
            assert answer.replies[0]["ok"] and answer.replies[1]["ok"] is False, answer
            assert needle in answer.replies[1]["error"] and answer.replies[1]["bye"] and answer.hung_up
            assert victim.state() is TransferState.PENDING
        assert agent.loaded == [] and agent.reads == [] and backend.refused == 4
        with door.connect(desc.address) as sock:  # the real sender
            sock.sendall(Hello(PROTOCOL_VERSION, "sender", b"md", 0x10000, 1 << 20).pack())
            assert door.read_frame(sock)["ok"]
            mac = door.mac_for("nixl", "victim", dst, secret, token, src)
            sock.sendall(door.offer("victim", src, dst, mac, board=None))
            assert door.read_frame(sock)["ok"]  # READ done; now the sender commits
            sock.sendall(Commit("victim", True).pack())
            assert door.read_frame(sock)["ok"]
        assert victim.wait(5) and victim.done()
        assert agent.loaded == [b"md"] and agent.reads[0][:2] == ("sender-agent", [(0, 8192, 4096)])
    finally:
        backend.close()
