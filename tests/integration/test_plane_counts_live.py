"""The control plane's counters over real sockets: a signal server and client in this process exchange
every kind of message once and both count exactly what went over the wire; an etcd registration and
watcher against a real etcd count exactly the calls they made and the events they saw."""

from __future__ import annotations

import zmq

from tests.integration.test_etcd_discovery import make_info
from tests.integration.test_signal_plane import Handler, _client, _pump
from tests.waiting import until, wait_until
from xpyd.discovery.counts import OPS, EtcdOps
from xpyd.discovery.etcd import EtcdRegistration, EtcdRegistry
from xpyd.discovery.local_etcd import LocalEtcd
from xpyd.discovery.types import Role
from xpyd.signal import messages as m
from xpyd.signal.client import PeerState
from xpyd.signal.counts import MessageCounts
from xpyd.signal.request_id import RequestId
from xpyd.signal.server import SignalServer

DECODE = "127.0.0.1:7001"

# What the decode worker sends over one session, and what the prefill worker answers, each once: opening it
# (hello, proof, handshake, kv_map_init), a heartbeat, a lookup, a release; and one push (notify).
DEALER_SENT = ("hello", "proof", "handshake", "kv_map_init", "heartbeat", "lookup_all", "release")
ROUTER_SENT = ("challenge", "auth_reply", "handshake_reply", "kv_map_reply", "heartbeat_reply", "lookup_reply",
               "release_reply", "notify")


def _counts(sent: tuple[str, ...], received: tuple[str, ...]) -> dict[tuple[str, str], int]:
    return {**{("sent", k): 1 for k in sent}, **{("received", k): 1 for k in received}}


def test_server_and_client_count_every_message_by_kind():
    shared = MessageCounts()  # as a worker's metrics give it
    s = SignalServer("127.0.0.1", 0, Handler(), counts=shared)
    assert s.counts is shared
    s.start()
    addr = f"127.0.0.1:{s.port}"
    c = _client(DECODE)
    try:
        p = c.peer(addr)
        _pump(c, lambda r, f: p.state is PeerState.READY or f)
        assert p.state is PeerState.READY, p.error
        c.heartbeat(0.0, [addr])
        rid = str(RequestId.new(addr, DECODE))
        c.send_lookup(addr, [m.LookupEntry(rid)])
        _pump(c, lambda r, f: r)
        c.send_release(addr, [rid])
        _pump(c, lambda r, f: not p.pending)
        assert not p.pending
        s.push(DECODE, m.Notify((m.LookupResult(rid, m.LookupStatus.UNKNOWN),)))
        replies, _ = _pump(c, lambda r, f: r)
        assert [type(msg) for _, msg in replies] == [m.Notify]
        assert c.counts.snapshot() == _counts(DEALER_SENT, ROUTER_SENT)
        wait_until(lambda: s.counts.snapshot() == _counts(ROUTER_SENT, DEALER_SENT),
                   "the server's counts to mirror the client's")
        assert s.counts.snapshot() == _counts(ROUTER_SENT, DEALER_SENT)
    finally:
        c.close()
        s.close()


def test_server_counts_a_frame_that_is_no_message_as_invalid():
    s = SignalServer("127.0.0.1", 0, Handler())
    s.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        sock.connect(f"tcp://127.0.0.1:{s.port}")
        sock.send(b"\xc1 not msgpack")
        assert isinstance(m.decode(sock.recv()).msg, m.ErrorReply)
        sock.send(m.encode(5, m.Heartbeat(DECODE)))  # no session yet: refused, counted as what it is
        assert m.decode(sock.recv()).msg == m.ErrorReply("handshake first")
        wait_until(lambda: s.counts.total("sent") == 2, "both refusals counted")
        assert s.counts.snapshot() == {("received", "invalid"): 1, ("received", "heartbeat"): 1,
                                       ("sent", "error"): 2}
    finally:
        sock.close(0)
        ctx.term()
        s.close()


async def test_registration_and_watcher_count_their_etcd_operations(etcd: LocalEtcd):
    ops = {"registry": EtcdOps(), "registration": EtcdOps()}
    registry = EtcdRegistry(etcd.endpoint, ops=ops["registry"])
    await registry.start()
    reg = EtcdRegistration(etcd.endpoint, make_info(Role.DECODE, 18000), ttl=60, ops=ops["registration"])
    try:
        await reg.start()
        await until(lambda: registry.workers(Role.DECODE), "the watcher to see the worker")
        await reg._check()  # one keep-alive (every ttl/3 = 20 s: none of its own within this test)
        await reg.close()
        await until(lambda: not registry.workers(Role.DECODE), "the watcher to see it leave")
    finally:
        await reg.close()
        await registry.close()
    zero = dict.fromkeys(OPS, 0)
    assert ops["registration"].snapshot() == {**zero, "lease_grant": 1, "put": 1, "lease_refresh": 1, "get": 1,
                                              "lease_revoke": 1}
    assert ops["registry"].snapshot() == {**zero, "get_prefix": 1, "watch_start": 1, "watch_event": 2}
