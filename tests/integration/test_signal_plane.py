"""The signal plane over real ZMQ sockets: typed messages, refusals, bad frames."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq

from tests.cluster import has_ipv6_loopback
from xpyd import PROTOCOL_VERSION
from xpyd.signal import messages as m
from xpyd.signal.client import PeerState, SignalClient
from xpyd.signal.request_id import RequestId
from xpyd.signal.server import SignalServer
from xpyd.transfer.auth import new_secret

COMPAT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": "float32", "layout": "block-head-major/1", "block_size": 16}
TRANSFER = {"backend": "tcp", "address": "127.0.0.1:9", "buffer_size": 4096}


class Handler:
    """A prefill-side handler with canned state (the real one is tested end to end)."""

    def __init__(self) -> None:
        self.maps: dict[str, m.KVMapInit] = {}
        self.ready: dict[str, int] = {}
        self.released: list[str] = []
        self.pulls: list[tuple[str, int]] = []
        self.secrets: list[bytes] = []  # of the pulls, as the prefill worker's handler got them

    def on_handshake(self, identity, msg):
        if msg.model_id != "m":
            return m.HandshakeReply(False, f"model mismatch: {msg.model_id!r}", "m")
        if msg.kv_compat != COMPAT:
            return m.HandshakeReply(False, "KV layout mismatch", "m")
        return m.HandshakeReply(True, None, "m")

    def on_kv_map_init(self, identity, msg):
        self.maps[identity] = msg
        return m.KVMapReply(True)

    def on_lookup_all(self, identity, msg):
        out = []
        for e in msg.entries:
            if e.request_id not in self.ready:
                out.append(m.LookupResult(e.request_id, m.LookupStatus.UNKNOWN))
            elif e.dest_blocks is None:
                out.append(m.LookupResult(e.request_id, m.LookupStatus.READY, self.ready[e.request_id], 3))
            else:
                self.pulls.append((e.request_id, e.dest_blocks))
                self.secrets.append(e.secret)
                out.append(m.LookupResult(e.request_id, m.LookupStatus.SENDING, self.ready[e.request_id], 3))
        return m.LookupReply(tuple(out))

    def on_release(self, identity, msg):
        self.released.extend(msg.request_ids)
        return m.ReleaseReply(len(msg.request_ids))


@pytest.fixture
def server():
    h = Handler()
    s = SignalServer("127.0.0.1", 0, h)
    s.start()
    yield s, h
    s.close()


def _client(identity="127.0.0.1:7001", model="m", compat=COMPAT, timeout=2.0) -> SignalClient:
    return SignalClient(identity, m.Handshake(identity, model, compat),
                        m.KVMapInit(identity, TRANSFER, 1024, 4), timeout=timeout)


def _pump(client, until, timeout=3.0):
    deadline = time.monotonic() + timeout
    replies, failed = [], []
    while time.monotonic() < deadline and not until(replies, failed):
        r, f = client.poll(20)
        replies += r
        failed += f
    return replies, failed


def test_handshake_map_lookup_pull_release(server):
    s, h = server
    addr = f"127.0.0.1:{s.port}"
    c = _client()
    try:
        p = c.peer(addr)
        _pump(c, lambda r, f: p.state is PeerState.READY)
        assert p.state is PeerState.READY
        assert h.maps["127.0.0.1:7001"].block_bytes == 1024
        rid = str(RequestId.new(addr, "127.0.0.1:7001"))
        c.send_lookup(addr, [m.LookupEntry(rid)])
        replies, _ = _pump(c, lambda r, f: r)
        assert replies[0][1].results[0].status is m.LookupStatus.UNKNOWN
        h.ready[rid] = 42
        secret = new_secret()  # the decode worker expects the transfer with it; only this session learns it
        c.send_lookup(addr, [m.LookupEntry(rid), m.LookupEntry(rid, (2, 3), 0, secret)])
        replies, _ = _pump(c, lambda r, f: r)
        res = replies[0][1].results
        assert [x.status for x in res] == [m.LookupStatus.READY, m.LookupStatus.SENDING]
        assert res[0].first_token == 42 and res[0].num_tokens == 3
        assert h.pulls == [(rid, (2, 3))] and h.secrets == [secret]
        c.send_release(addr, [rid])
        _pump(c, lambda r, f: h.released)
        assert h.released == [rid]
    finally:
        c.close()


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
@pytest.mark.parametrize("fixed_port", [False, True])
def test_ipv6_server_and_client_with_bracketed_addresses(fixed_port):
    port = 0
    if fixed_port:
        with socket.create_server(("::1", 0), family=socket.AF_INET6) as probe:
            port = probe.getsockname()[1]
    h = Handler()
    s = SignalServer("::1", port, h)
    s.start()
    c = _client(identity="[::1]:7001")
    try:
        assert s.port > 0 and (not fixed_port or s.port == port)
        addr = f"[::1]:{s.port}"
        p = c.peer(addr)
        _pump(c, lambda r, f: p.state is not PeerState.HANDSHAKING and p.state is not PeerState.MAPPING)
        assert p.state is PeerState.READY, p.error
        rid = str(RequestId.new(addr, "[::1]:7001"))
        h.ready[rid] = 5
        c.send_lookup(addr, [m.LookupEntry(rid)])
        replies, _ = _pump(c, lambda r, f: r)
        assert replies[0][1].results[0].status is m.LookupStatus.READY
        assert h.maps["[::1]:7001"].block_bytes == 1024
    finally:
        c.close()
        s.close()


@pytest.mark.parametrize("model,compat,needle", [
    ("other-model", COMPAT, "model mismatch"),
    ("m", {**COMPAT, "dtype": "bfloat16"}, "KV layout mismatch"),
])
def test_handshake_refuses_mismatch_with_clear_message(server, model, compat, needle):
    s, _ = server
    addr = f"127.0.0.1:{s.port}"
    c = _client(model=model, compat=compat)
    try:
        p = c.peer(addr)
        _, failed = _pump(c, lambda r, f: f)
        assert failed == [p] and p.state is PeerState.FAILED
        assert needle in p.error and "handshake" in p.error
    finally:
        c.close()


def _raw_roundtrip(port: int, frame: bytes, identity: bytes = b"raw:1") -> m.Envelope:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(frame)
        return m.decode(sock.recv())
    finally:
        sock.close(0)
        ctx.term()


def _frame(seq: int, msg: dict, version: int = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"version": version, "seq": seq, "msg": msg})


@pytest.mark.parametrize("frame,seq,needle", [
    (b"\xc1garbage", 0, "undecodable"),
    (msgpack.packb([1, 2, 3]), 0, "invalid message"),
    (_frame(1, {"type": "handshake"}, PROTOCOL_VERSION + 1), 1, "protocol version mismatch"),
    (msgpack.packb({"v": 3, "t": "handshake", "seq": 2, "b": {}}), 2, "protocol version mismatch: peer speaks 3"),
    (_frame(5, {"type": "evil"}), 5, "$.msg.type"),
    (_frame(5, {"type": [1.5, 2.5]}), 5, "$.msg.type"),
    (_frame(6, {"type": "handshake", "sender": 3}), 6, "$.msg.sender"),
    (_frame(7, {"type": "lookup_all", "sender": "raw:1", "entries": [["x", -5]]}), 7, "$.msg.entries[0][1]"),
    (_frame(8, {"type": "release", "sender": "someone-else", "request_ids": []}), 8, "does not match"),
    # A pull without its transfer secret (nobody could prove it to the decode worker's listener), or with
    # one of the wrong size, is refused whole: no KV send starts.
    (_frame(9, {"type": "lookup_all", "sender": "raw:1", "entries": [["x", [2, 3], 0]]}), 9,
     "carries a transfer secret"),
    (_frame(10, {"type": "lookup_all", "sender": "raw:1", "entries": [["x", [2, 3], 0, b"short"]]}), 10,
     "$.msg.entries[0][3]"),
])
def test_bad_frames_get_error_replies_and_change_nothing(server, frame, seq, needle):
    s, h = server
    reply = _raw_roundtrip(s.port, frame)
    assert isinstance(reply.msg, m.ErrorReply) and needle in reply.msg.error and reply.seq == seq
    assert h.maps == {} and h.released == [] and h.pulls == []


def test_oversized_frame_is_dropped_and_server_keeps_serving(server):
    s, h = server
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{s.port}")
    sock.send(b"x" * (m.MAX_FRAME_BYTES + 10))  # zmq MAXMSGSIZE drops this connection
    sock.close(0)
    ctx.term()
    ok = m.encode(3, m.Release("raw:2", ()))
    reply = _raw_roundtrip(s.port, ok, identity=b"raw:2")
    assert reply.msg == m.ReleaseReply(0) and reply.seq == 3


def test_unresponsive_peer_fails_after_timeout():
    # A listener that accepts TCP connections but never speaks: the handshake gets no answer.
    import socket
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        c = _client(timeout=0.3)
        try:
            p = c.peer(f"127.0.0.1:{port}")
            _, failed = _pump(c, lambda r, f: f, timeout=3)
            assert failed == [p] and p.state is PeerState.FAILED and "did not answer" in (p.error or "")
            assert p.sock.closed  # dropped; the next peer() reconnects
        finally:
            c.close()


def test_refused_connection_fails_at_once_and_reconnects_on_demand(server):
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]  # nothing listens here
    c = _client(timeout=30)  # far longer than the test: the failure must come from the socket monitor
    try:
        t0 = time.monotonic()
        p = c.peer(f"127.0.0.1:{port}")
        _, failed = _pump(c, lambda r, f: f, timeout=15)
        assert failed == [p] and "refused the connection" in p.error and time.monotonic() - t0 < 10  # not 30 s
        s, _ = server
        addr = f"127.0.0.1:{s.port}"
        q = c.peer(addr)
        _pump(c, lambda r, f: q.state is PeerState.READY)
        assert q.state is PeerState.READY
    finally:
        c.close()


def test_peer_that_dies_fails_at_once_and_a_new_one_is_reached(server):
    h = Handler()
    s = SignalServer("127.0.0.1", 0, h)
    s.start()
    addr = f"127.0.0.1:{s.port}"
    c = _client(timeout=30)
    try:
        p = c.peer(addr)
        _pump(c, lambda r, f: p.state is PeerState.READY)
        assert p.state is PeerState.READY
        t0 = time.monotonic()
        s.close()  # its connection drops, like a killed process
        _, failed = _pump(c, lambda r, f: f, timeout=15)
        assert failed == [p] and "closed the connection" in p.error and time.monotonic() - t0 < 10  # not 30 s
        assert c.get(addr) is p and p.sock.closed
        s2 = SignalServer("127.0.0.1", s.port, h)  # back on the same address
        s2.start()
        try:
            q = c.peer(addr)
            assert q is not p
            _pump(c, lambda r, f: q.state is PeerState.READY)
            assert q.state is PeerState.READY
        finally:
            s2.close()
    finally:
        c.close()


def test_multipart_and_unknown_requests_get_error_replies(server):
    s, h = server
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"raw:3")
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(f"tcp://127.0.0.1:{s.port}")
    try:
        sock.send_multipart([m.encode(1, m.Release("raw:3", ())), b"extra"])
        reply = m.decode(sock.recv())
        assert isinstance(reply.msg, m.ErrorReply) and "one frame" in reply.msg.error
        sock.send(m.encode(2, m.ReleaseReply(3)))  # a reply type sent as a request
        reply = m.decode(sock.recv())
        assert reply.msg == m.ErrorReply("release_reply is not a request") and reply.seq == 2
    finally:
        sock.close(0)
        ctx.term()
    assert h.maps == {} and h.released == []


def _zmtp_dealer(port: int, identity: str) -> socket.socket:
    """A TCP connection that speaks ZMTP 3.1 as a DEALER with ``identity``, has the server answer one
    handshake on it, and then says nothing more: a decode worker whose link went silent (a cut cable
    drops packets; no FIN, no RST ever arrives)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    got = bytearray()  # everything the server sent so far

    def read_until(needle: bytes) -> None:
        while needle not in got:
            chunk = sock.recv(4096)
            assert chunk, f"the server hung up before {needle!r}"
            got.extend(chunk)

    props = b"".join(bytes([len(k)]) + k + len(v).to_bytes(4, "big") + v
                     for k, v in ((b"Socket-Type", b"DEALER"), (b"Identity", identity.encode())))
    ready = b"\x05READY" + props
    hello = m.encode(1, m.Handshake(identity, "m", COMPAT))
    sock.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + bytes(32))  # greeting
    read_until(b"NULL")
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    read_until(b"ROUTER")  # (its READY)
    sock.sendall(bytes([0x00, len(hello)]) + hello)
    read_until(b"handshake_reply")  # the identity is this connection's now
    return sock


def test_a_silent_connection_is_dropped_so_its_worker_can_connect_again():
    """A ROUTER keeps a connection's identity until that connection closes, and ignores a new connection
    with the same identity meanwhile. After a silent cut, the decode worker's old connection never
    closes by itself: the server's heartbeats (ZMTP PING, ``peer_timeout``) close it, so the worker's
    new connection is served."""
    h = Handler()
    s = SignalServer("127.0.0.1", 0, h, peer_timeout=1.0)
    s.start()
    identity = "127.0.0.1:7009"
    stale = _zmtp_dealer(s.port, identity)
    c = _client(identity, timeout=1.0)
    try:
        t0 = time.monotonic()
        p = c.peer(f"127.0.0.1:{s.port}")
        _, failed = _pump(c, lambda r, f: p.state is PeerState.READY or f, timeout=5)
        while failed:  # (a handshake sent while the stale connection held the identity: tried again)
            p = c.peer(f"127.0.0.1:{s.port}")
            _, failed = _pump(c, lambda r, f: p.state is PeerState.READY or f, timeout=5)
            assert time.monotonic() - t0 < 8, "the new connection was not served"
        assert p.state is PeerState.READY
        assert stale.recv(1 << 16, socket.MSG_DONTWAIT) is not None  # (PINGs came; then it was closed)
        stale.settimeout(5)
        while stale.recv(1 << 16):  # the server closed the stale connection
            pass
    finally:
        stale.close()
        c.close()
        s.close()
