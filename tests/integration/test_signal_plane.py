"""The signal plane over real ZMQ sockets: typed messages, refusals, bad frames, sessions that nobody can
join without the cluster token or take over by naming a connection."""

from __future__ import annotations

import select
import socket
import threading
import time

import msgpack
import pytest
import zmq

from types import SimpleNamespace

from tests.cluster import has_ipv6_loopback
from tests.unit.kv_fixtures import next_prefill
from tests.waiting import wait_until
from xpyd import PROTOCOL_VERSION
from xpyd.model.sampling import TorchSampler
from xpyd.signal import auth
from xpyd.signal import messages as m
from xpyd.signal.client import PeerState, SignalClient
from xpyd.signal.request_id import RequestId
from xpyd.model.kv_pool import KVLayout, KVPool
from xpyd.prefill_worker.engine import PrefillEngine
from xpyd.prefill_worker.scheduler import PrefillSeq
from xpyd.signal import server as signal_server
from xpyd.signal.server import SignalServer
from xpyd.transfer.auth import new_secret
from xpyd.transfer.fake import FakeNetwork, FakeTransferBackend
from xpyd.worker.config import WorkerConfig

COMPAT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": "float32", "layout": "block-head-major/1", "block_size": 16}
TRANSFER = {"backend": "tcp", "address": "127.0.0.1:9", "buffer_size": 4096}


TOKEN = "s3cret-cluster-token"
BIG_HASHES = bytes(range(256)) * (8 * m.MAX_BLOCKS // 256)  # the most block hashes one result may carry (512 KiB)


class Handler:
    """A prefill-side handler with canned state (the real one is tested end to end)."""

    def __init__(self, cluster_token: str | None = None, accepted: tuple[str, ...] = ()) -> None:
        self.cluster_token = cluster_token
        self.accepted_tokens = accepted
        self.handshakes: list[str] = []
        self.maps: dict[str, m.KVMapInit] = {}
        self.ready: dict[str, int] = {}
        self.released: list[str] = []
        self.pulls: list[tuple[str, int]] = []
        self.secrets: list[bytes] = []  # of the pulls, as the prefill worker's handler got them
        self.closed: list[tuple[str, str]] = []  # sessions that ended: (address, why)
        self.undelivered: list[tuple[str, m.Message, str]] = []
        self.heartbeats = 0
        self.big = False  # ready results name the most block hashes a result may

    def on_session_closed(self, identity, why):
        self.closed.append((identity, why))

    def on_undelivered(self, identity, msg, why):
        self.undelivered.append((identity, msg, why))

    def on_heartbeat(self, identity, msg):
        self.heartbeats += 1
        return m.HeartbeatReply()

    def on_handshake(self, identity, msg):
        self.handshakes.append(identity)
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
            if "boom" in e.request_id:
                raise RuntimeError("a handler bug")
            if self.big:
                out.append(m.LookupResult(e.request_id, m.LookupStatus.READY, 5, m.MAX_BLOCKS * 16,
                                          block_hashes=BIG_HASHES))
            elif e.request_id not in self.ready:
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


@pytest.fixture
def secured():
    """A server whose decode workers must prove TOKEN."""
    h = Handler(TOKEN)
    s = SignalServer("127.0.0.1", 0, h)
    s.start()
    yield s, h
    s.close()


def _client(identity="127.0.0.1:7001", model="m", compat=COMPAT, timeout=2.0, token=None,
            accepted: tuple[str, ...] = ()) -> SignalClient:
    return SignalClient(identity, m.Handshake(identity, model, compat),
                        m.KVMapInit(identity, TRANSFER, 1024, 4), timeout=timeout, cluster_token=token,
                        accepted_tokens=accepted)


def _ready(c: SignalClient, addr: str) -> None:
    p = c.peer(addr)
    _pump(c, lambda r, f: p.state is PeerState.READY or f)
    assert p.state is PeerState.READY, p.error


def _raw_session(ctx: zmq.Context, port: int, sender: str = "raw:1", token: str | None = None,
                 routing_id: bytes | None = None) -> zmq.Socket:
    """A DEALER that opened a session the way a decode worker does (hello, challenge, proof)."""
    sock = ctx.socket(zmq.DEALER)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    hello = m.Hello(sender, "raw-instance", auth.new_nonce(), token is not None)
    frame = m.encode(100, hello)
    sock.send(frame)
    challenge = m.decode(sock.recv()).msg
    assert isinstance(challenge, m.Challenge), challenge
    proof = None if token is None else auth.decode_proof(token, challenge.nonce, hello.nonce, frame)
    sock.send(m.encode(101, m.Proof(proof)))
    assert m.decode(sock.recv()).msg == m.AuthReply(True)
    return sock


def _pump(client, until, timeout=3.0):
    deadline = time.monotonic() + timeout
    replies, failed = [], []
    while time.monotonic() < deadline and not until(replies, failed):
        r, f = client.poll(20)
        replies += r
        failed += f
    return replies, failed


@pytest.mark.parametrize("token", [None, TOKEN])
def test_handshake_map_lookup_pull_release(token):
    h = Handler(token)
    s = SignalServer("127.0.0.1", 0, h)
    s.start()
    addr = f"127.0.0.1:{s.port}"
    c = _client(token=token)
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
        assert h.released == [rid] and h.handshakes == ["127.0.0.1:7001"]
    finally:
        c.close()
        s.close()


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
        _ready(c, addr)
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


def _raw_roundtrip(port: int, frame: bytes, session: bool = True) -> m.Envelope:
    """``frame``'s answer, sent on a connection with an open session (or none)."""
    ctx = zmq.Context()
    if session:
        sock = _raw_session(ctx, port)
    else:
        sock = ctx.socket(zmq.DEALER)
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
    (_frame(8, {"type": "release", "sender": "someone-else", "request_ids": []}), 8, "does not match the session"),
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
    ok = m.encode(3, m.Release("raw:1", ()))
    reply = _raw_roundtrip(s.port, ok)
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
    sock = _raw_session(ctx, s.port, "raw:3")
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


def _zmtp_dealer(port: int, identity: str, token: str | None) -> socket.socket:
    """A TCP connection that speaks ZMTP 3.1 as a DEALER, opens a session as decode worker ``identity`` and
    then says nothing more: a decode worker whose link went silent (a cut cable drops packets; no FIN, no
    RST ever arrives)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    got = bytearray()  # everything the server sent so far

    def read_until(needle: bytes) -> None:
        while needle not in got:
            chunk = sock.recv(4096)
            assert chunk, f"the server hung up before {needle!r}"
            got.extend(chunk)

    props = b"".join(bytes([len(k)]) + k + len(v).to_bytes(4, "big") + v for k, v in ((b"Socket-Type", b"DEALER"),))
    ready = b"\x05READY" + props
    msg = m.Hello(identity, "stale", auth.new_nonce(), token is not None)
    hello = m.encode(1, msg)
    sock.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + bytes(32))  # greeting
    read_until(b"NULL")
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    read_until(b"ROUTER")  # (its READY)
    sock.sendall(bytes([0x00, len(hello)]) + hello)
    read_until(b"challenge")
    nonce = got[got.index(b"nonce\xc4\x20") + 7:][:32]  # (the challenge's nonce: a msgpack bin 8 of 32 bytes)
    proof = m.encode(2, m.Proof(None if token is None else auth.decode_proof(token, nonce, msg.nonce, hello)))
    sock.sendall(bytes([0x00, len(proof)]) + proof)
    read_until(b"auth_reply")  # the session is open
    return sock


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_silent_connection_is_closed_so_its_worker_can_connect_again(token):
    """After a silent cut, the decode worker's old connection never closes by itself: the server's
    heartbeats (ZMTP PING, ``peer_timeout``) close it, and its session with it. With a cluster token the
    worker's new connection is served at once (its proof makes it the worker: its session replaces the
    silent one); without one, only once the silent connection is closed (else anyone naming a live
    worker would take its session)."""
    h = Handler(token)
    s = SignalServer("127.0.0.1", 0, h, peer_timeout=1.0)
    s.start()
    identity = "127.0.0.1:7009"
    stale = _zmtp_dealer(s.port, identity, token)
    c = _client(identity, timeout=5.0, token=token)
    try:
        t0 = time.monotonic()
        p = c.peer(f"127.0.0.1:{s.port}")
        _, failed = _pump(c, lambda r, f: p.state is PeerState.READY or f, timeout=5)
        if token is not None:
            assert failed == [] and h.closed == [(identity, "a new session of the same decode worker opened")]
        else:
            assert failed == [p] and "has an open session on another connection" in p.error
            while p.state is not PeerState.READY:  # (the worker tries again, as its next request would)
                assert time.monotonic() - t0 < 8, "the new connection was not served"
                p = c.peer(f"127.0.0.1:{s.port}")
                _pump(c, lambda r, f: p.state is PeerState.READY or f, timeout=5)
            assert h.closed == [(identity, "its connection closed")]
        assert p.state is PeerState.READY
        stale.settimeout(5)
        while stale.recv(1 << 16):  # (PINGs came; then) the server closed the stale connection
            pass
        assert len(h.closed) == 1  # (its session had ended already)
    finally:
        stale.close()
        c.close()
        s.close()


# --- who may join, and what a stranger gets ------------------------------------------------------


def _stranger(ctx: zmq.Context, port: int, routing_id: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def test_a_stranger_on_a_taken_routing_id_without_the_token_gets_nothing_and_the_worker_reconnects(secured):
    """The decode worker's connection closes (restart, failure, cut); a stranger without the token connects
    under its old name (its address, as routing ids were before) or under the exact routing id the ROUTER
    had given the closed connection. Every request gets "handshake first", a push for the worker goes to
    nobody (and is reported), and the real worker opens a new session and gets its pushes."""
    s, h = secured
    addr, me = f"127.0.0.1:{s.port}", "127.0.0.1:7001"
    real = _client(me, token=TOKEN)
    _ready(real, addr)
    rid = str(RequestId.new(addr, me))
    h.ready[rid] = 42
    taken = s._sessions.route(me).routing_id  # (test only: the name the ROUTER gave the connection)
    assert taken[:1] == b"\0" and taken != me.encode()
    real.close()  # the worker's DEALER is gone
    wait_until(lambda: h.closed, "the session to end with its connection")
    assert h.closed == [(me, "its connection closed")]
    ctx = zmq.Context()
    try:
        for n, name in enumerate((me.encode(), taken), start=1):
            sock = _stranger(ctx, s.port, name)
            for seq, msg in enumerate([
                m.KVMapInit(me, TRANSFER, 1024, 4),
                m.LookupAll(me, (m.LookupEntry(rid), m.LookupEntry(rid, (0,), 0, new_secret()))),
                m.Release(me, (rid,)), m.Heartbeat(me), m.Handshake(me, "m", COMPAT)], start=1):
                sock.send(m.encode(seq, msg))
                assert m.decode(sock.recv()).msg == m.ErrorReply("handshake first"), msg.TYPE
            sock.send(m.encode(9, m.Hello(me, "stranger", auth.new_nonce(), False)))  # no token to prove
            assert "cluster token required" in m.decode(sock.recv()).msg.error
            sock.send(m.encode(10, m.Hello(me, "stranger", auth.new_nonce(), True)))  # claims one, cannot prove it
            assert isinstance(m.decode(sock.recv()).msg, m.Challenge)
            sock.send(m.encode(11, m.Proof(bytes(32))))
            assert m.decode(sock.recv()).msg == m.AuthReply(False, "cluster token mismatch")
            notify = m.Notify((m.LookupResult(rid, m.LookupStatus.READY, 42, 3),))
            s.push(me, notify)
            wait_until(lambda: len(h.undelivered) == n, "the push to be reported undelivered")
            assert sock.poll(0) == 0  # nothing came to the stranger
            sock.close(0)
        assert h.handshakes == [me] and list(h.maps) == [me] and h.released == [] and h.pulls == []
        assert h.heartbeats == 0 and [u[1:] for u in h.undelivered] == [(notify, "no open session")] * 2
        again = _client(me, token=TOKEN)  # the real worker, back: a new session
        try:
            _ready(again, addr)
            s.push(me, notify)
            replies, _ = _pump(again, lambda r, f: r)
            assert replies == [(addr, notify)] and len(h.undelivered) == 2
        finally:
            again.close()
    finally:
        ctx.destroy(linger=0)


class _Relay:
    """A TCP relay between one client and the server that records the bytes each way (a capture)."""

    def __init__(self, port: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = port
        self.up, self.down = bytearray(), bytearray()  # client -> server, server -> client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client, _ = self._listener.accept()
        server = socket.create_connection(("127.0.0.1", self._target))
        with client, server:
            while not self._stop.is_set():
                readable, _, _ = select.select([client, server], [], [], 0.05)
                for src in readable:
                    data = src.recv(65536)
                    if not data:
                        return
                    (server if src is client else client).sendall(data)
                    (self.up if src is client else self.down).extend(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()


def test_the_handshake_on_the_wire_holds_no_token_and_replaying_it_opens_nothing(secured):
    s, h = secured
    relay = _Relay(s.port)
    c = _client(token=TOKEN)
    try:
        _ready(c, f"127.0.0.1:{relay.port}")  # through the relay: everything it said is captured
    finally:
        c.close()
        relay.close()
    captured = bytes(relay.up + relay.down)
    assert b"auth_reply" in relay.down and b"kv_map_reply" in relay.down  # (the whole exchange was captured)
    for form in (TOKEN.encode(), TOKEN.encode().hex().encode(), TOKEN.upper().encode()):
        assert form not in captured
    assert h.handshakes == ["127.0.0.1:7001"]
    # Replay every byte the decode worker sent (greeting, hello, proof, handshake, kv_map_init) on a new connection.
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as replay:
        answer = bytearray()

        def read_until(needle: bytes) -> None:
            while needle not in answer:
                chunk = replay.recv(65536)
                assert chunk, f"the server hung up before {needle!r}: {bytes(answer)!r}"
                answer.extend(chunk)

        replay.sendall(bytes(relay.up[:64]))  # the ZMTP greeting, then (once the server's came) the rest
        read_until(b"ROUTER")
        replay.sendall(bytes(relay.up[64:]))
        read_until(b"handshake first")  # (the answer to the replayed kv_map_init)
    assert b"cluster token mismatch" in answer and b"handshake first" in answer  # a fresh nonce: the old proof fails
    assert b"handshake_reply" not in answer and b"kv_map_reply" not in answer
    assert h.handshakes == ["127.0.0.1:7001"] and list(h.maps) == ["127.0.0.1:7001"]


def test_a_wrong_token_fails_on_both_sides(secured):
    s, h = secured
    addr = f"127.0.0.1:{s.port}"
    c = _client(token="another-token-456")  # the decode side finds the prefill worker's proof wrong ...
    try:
        p = c.peer(addr)
        _, failed = _pump(c, lambda r, f: f)
        assert failed == [p] and "the prefill worker's proof: cluster token mismatch" in p.error
    finally:
        c.close()
    ctx = zmq.Context()  # ... and the prefill side a decode worker's proof made with another token
    try:
        sock = _stranger(ctx, s.port, None)
        hello = m.Hello("127.0.0.1:7001", "i", auth.new_nonce(), True)
        frame = m.encode(1, hello)
        sock.send(frame)
        challenge = m.decode(sock.recv()).msg
        sock.send(m.encode(2, m.Proof(auth.decode_proof("another-token-456", challenge.nonce, hello.nonce, frame))))
        assert m.decode(sock.recv()).msg == m.AuthReply(False, "cluster token mismatch")
        sock.send(m.encode(3, m.Handshake("127.0.0.1:7001", "m", COMPAT)))
        assert m.decode(sock.recv()).msg == m.ErrorReply("handshake first")
    finally:
        ctx.destroy(linger=0)
    for token, needle in ((None, "cluster token required"), (TOKEN, "has none")):
        h2 = Handler(None if token else TOKEN)
        s2 = SignalServer("127.0.0.1", 0, h2)
        s2.start()
        c = _client(token=token)
        try:
            p = c.peer(f"127.0.0.1:{s2.port}")
            _, failed = _pump(c, lambda r, f: f)
            assert failed == [p] and "handshake" in p.error and needle in p.error, p.error
        finally:
            c.close()
            s2.close()
        assert h2.handshakes == []
    assert h.handshakes == []


OLD, NEW = TOKEN, "the-next-cluster-token"


# (the prefill worker's token and accepted, the decode worker's, the token the prefill worker proved or the
# side that refuses): the three steps of a rotation and the mixed pairs each step's rollout makes
ROTATION = [
    pytest.param((OLD, ()), (OLD, (NEW,)), OLD, id="step1-old-with-accepting"),
    pytest.param((OLD, (NEW,)), (NEW, (OLD,)), OLD, id="step2-accepting-with-switched"),
    pytest.param((NEW, (OLD,)), (OLD, (NEW,)), NEW, id="step2-switched-with-accepting"),
    pytest.param((NEW, (OLD,)), (NEW, ()), NEW, id="step3-switched-with-new"),
    pytest.param((NEW, ()), (OLD, (NEW,)), "prefill", id="new-with-accepting-is-refused"),  # D proves OLD
    pytest.param((OLD, (NEW,)), (NEW, ()), "decode", id="accepting-with-new-is-refused"),  # P proves OLD
]


@pytest.mark.parametrize("prefill,decode,outcome", ROTATION)
def test_a_rotation_window_opens_sessions_between_old_and_new_primaries(prefill, decode, outcome):
    """Each worker proves with its own token only and accepts a proof of either token it holds: every pair a
    three-step rotation can make shakes hands, and a pair where one side does not hold the other's token
    does not (the token held only as accepted is never proved with)."""
    h = Handler(prefill[0], prefill[1])
    s = SignalServer("127.0.0.1", 0, h)
    s.start()
    c = _client(token=decode[0], accepted=decode[1])
    try:
        p = c.peer(f"127.0.0.1:{s.port}")
        _pump(c, lambda r, f: p.state is PeerState.READY or f)
        if outcome in (OLD, NEW):
            assert p.state is PeerState.READY and p.proved == outcome, p.error
            assert h.handshakes == ["127.0.0.1:7001"]
        else:
            assert p.state is PeerState.FAILED and "cluster token mismatch" in p.error, p.error
            # (refused by the prefill side: it never saw the handshake; by the decode side: nothing was sent)
            assert h.handshakes == []
            assert ("the prefill worker's proof" in p.error) == (outcome == "decode"), p.error
    finally:
        c.close()
        s.close()


# --- what a lookup's answer may be --------------------------------------------------------------


def test_a_lookup_answer_over_the_frame_cap_arrives_whole(server):
    """64 prompts of 128k tokens, ready at once: 64 results of 512 KiB of block hashes each (32 MiB), against
    a 4 MiB frame cap. All arrive (the reply and the notifies before it) and the peer stays up."""
    s, h = server
    addr = f"127.0.0.1:{s.port}"
    h.big = True
    c = _client(timeout=30)
    try:
        _ready(c, addr)
        rids = [str(RequestId.new(addr, "127.0.0.1:7001")) for _ in range(64)]
        c.send_lookup(addr, [m.LookupEntry(rid) for rid in rids])
        replies, failed = _pump(c, lambda r, f: f or any(isinstance(x, m.LookupReply) for _, x in r), timeout=60)
        assert failed == [] and c.get(addr).state is PeerState.READY
        assert isinstance(replies[-1][1], m.LookupReply) and len(replies) > 1
        results = [r for _, x in replies for r in x.results]
        assert [r.request_id for r in results] == rids
        assert all(r.status is m.LookupStatus.READY and r.block_hashes == BIG_HASHES for r in results)
    finally:
        c.close()


def test_an_error_answer_to_a_lookup_fails_that_lookups_requests_only(server):
    s, h = server
    addr = f"127.0.0.1:{s.port}"
    c = _client()
    try:
        _ready(c, addr)
        bad = [str(RequestId.new(addr, "127.0.0.1:7001")).replace("xpyd-", "xpyd-boom") for _ in range(2)]
        c.send_lookup(addr, [m.LookupEntry(rid) for rid in bad])
        replies, failed = _pump(c, lambda r, f: r or f)
        assert failed == [] and c.get(addr).state is PeerState.READY
        ((_, reply),) = replies
        assert [(r.request_id, r.status) for r in reply.results] == [(rid, m.LookupStatus.FAILED) for rid in bad]
        assert "refused the lookup: internal error: RuntimeError" in reply.results[0].error
        good = str(RequestId.new(addr, "127.0.0.1:7001"))
        h.ready[good] = 3
        c.send_lookup(addr, [m.LookupEntry(good)])
        replies, _ = _pump(c, lambda r, f: r)
        assert replies[0][1].results[0].status is m.LookupStatus.READY  # the peer serves on
    finally:
        c.close()


# --- claims belong to a session (a real prefill engine behind the server) -----------------------


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=6, block_size=4)
DECODE = "127.0.0.1:7001"


@pytest.fixture
def prefill():
    """A prefill engine (fake model and transfers, stepped by hand) serving the signal plane with TOKEN."""
    runner = SimpleNamespace(pool=KVPool(LAYOUT), max_model_len=8, eos_token_ids=frozenset(), sampler=TorchSampler())
    net = FakeNetwork()
    transfer, decode_side = FakeTransferBackend(net), FakeTransferBackend(net)
    engine = PrefillEngine(runner, None, WorkerConfig(role="prefill", port=8100, cluster_token=TOKEN), transfer, "m")
    transfer.register(engine.pool.buffer())
    desc = decode_side.register(memoryview(bytearray(LAYOUT.total_bytes)))
    server = SignalServer("127.0.0.1", 0, engine)
    engine.notify = server.push
    server.start()
    yield engine, server, desc
    server.close()
    transfer.close()
    decode_side.close()


def _prefilled(engine: PrefillEngine, rid: str) -> None:
    """``rid``'s prompt (3 tokens: one block) prefilled, its KV held for DECODE."""
    payload = SimpleNamespace(output=SimpleNamespace(finished=None))
    with engine._lock:
        engine.sched.add(PrefillSeq(rid, [1, 2, 3], payload=payload, peer=DECODE))
        engine.sched.prefilled(next_prefill(engine.sched), 42, time.monotonic())


def _decode_client(desc) -> SignalClient:
    # (the fake runner's weights are named by the served name: "m")
    return SignalClient(DECODE, m.Handshake(DECODE, "m", {**LAYOUT.compat(), "weights": "m"}),
                        m.KVMapInit(DECODE, desc.to_dict(), LAYOUT.block_bytes, LAYOUT.num_blocks), timeout=5.0,
                        cluster_token=TOKEN)


def _lookup(c: SignalClient, addr: str, rids: list[str]) -> dict[str, m.LookupResult]:
    c.send_lookup(addr, [m.LookupEntry(rid) for rid in rids])
    replies, failed = _pump(c, lambda r, f: r or f)
    assert failed == []
    return {r.request_id: r for _, reply in replies for r in reply.results}


def test_a_restarted_decode_worker_frees_what_its_predecessor_claimed(prefill):
    """The decode worker restarts on the same address (a new process instance): once the new one opens its
    session, the KV the old one claimed is freed at once (not kept alive by the new one's heartbeats), KV
    nobody claimed stays for the new one, and the old connection is served nothing more."""
    engine, server, desc = prefill
    addr = f"127.0.0.1:{server.port}"
    claimed = [str(RequestId.new(addr, DECODE)) for _ in range(2)]
    unclaimed = str(RequestId.new(addr, DECODE))
    for rid in claimed + [unclaimed]:
        _prefilled(engine, rid)
    old = _decode_client(desc)
    new = _decode_client(desc)
    try:
        _ready(old, addr)
        assert {r.status for r in _lookup(old, addr, claimed).values()} == {m.LookupStatus.READY}
        assert engine.pool.num_used == 3 and all(engine.sched.get(rid).claimed for rid in claimed)
        assert old.instance != new.instance
        _ready(new, addr)  # (the old process's connection is still open: a restart it did not see)
        wait_until(lambda: engine.pool.num_used == 1, "the old instance's claimed KV to be freed")
        assert [rid for rid in claimed if engine.sched.get(rid) is not None] == []
        stats = engine.stats()
        assert stats["orphaned"] == 2 and stats["expired"] == 2 and stats["handshaken"] == 1
        got = _lookup(new, addr, claimed + [unclaimed])
        assert {got[rid].status for rid in claimed} == {m.LookupStatus.EXPIRED}
        assert "signal session ended" in got[claimed[0]].error
        assert got[unclaimed].status is m.LookupStatus.READY and got[unclaimed].first_token == 42
        old.heartbeat(0.0, [addr])  # the old process, should it still be there, is served nothing
        _, failed = _pump(old, lambda r, f: f)
        assert len(failed) == 1 and "handshake first" in failed[0].error
    finally:
        old.close()
        new.close()


def test_a_claim_dies_with_its_session_and_a_lost_notify_loses_nothing(prefill):
    engine, server, desc = prefill
    addr = f"127.0.0.1:{server.port}"
    rid, later = str(RequestId.new(addr, DECODE)), str(RequestId.new(addr, DECODE))
    _prefilled(engine, rid)
    c = _decode_client(desc)
    try:
        _ready(c, addr)
        assert _lookup(c, addr, [rid])[rid].status is m.LookupStatus.READY and engine.sched.get(rid).claimed
    finally:
        c.close()  # its connection closes: the session, and its claim, end with it
    wait_until(lambda: engine.pool.num_used == 0, "the closed session's claimed KV to be freed")
    c = _decode_client(desc)
    try:
        _ready(c, addr)
        assert _lookup(c, addr, [later])[later].status is m.LookupStatus.UNKNOWN  # claimed before it arrives
        engine.notify = lambda peer, msg: None  # its "ready" push is lost on the way
        _prefilled(engine, later)
        with engine._lock:
            seq = engine.sched.get(later)
            seq.claimed = True  # (as _add does for a request claimed before it arrived)
        result = _lookup(c, addr, [later])[later]  # the decode worker asks again: the whole answer is there
        assert (result.status, result.first_token, result.num_tokens, result.tail) == (m.LookupStatus.READY, 42, 3,
                                                                                       (1, 2, 3))
    finally:
        c.close()


def test_a_push_to_a_connection_that_takes_nothing_is_reported_not_dropped_silently(monkeypatch):
    """A decode worker that stops reading: once its connection's queue is full, each further push is reported
    undelivered (the ROUTER is ROUTER_MANDATORY; without it, ZMQ drops at the high-water mark without a
    word) and the session stays open (the worker's re-ask gets the state)."""
    monkeypatch.setattr(signal_server, "SEND_HWM", 4)
    h = Handler()
    s = SignalServer("127.0.0.1", 0, h)
    s.start()
    ctx = zmq.Context()
    try:
        sock = _raw_session(ctx, s.port, "raw:1")
        sock.setsockopt(zmq.RCVHWM, 1)
        notify = m.Notify((m.LookupResult("r", m.LookupStatus.READY, 1, 1, block_hashes=BIG_HASHES[: 64 << 10]),))
        for _ in range(600):  # 38 MiB: more than the socket buffers hold
            s.push("raw:1", notify)
        wait_until(lambda: h.undelivered, "a push to be reported undelivered")
        assert h.undelivered[0] == ("raw:1", notify, "its send queue is full (high-water mark)")
        assert h.closed == [] and s._sessions.route("raw:1") is not None
        sock.close(0)
    finally:
        ctx.destroy(linger=0)
        s.close()
