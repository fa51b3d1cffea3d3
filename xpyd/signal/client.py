"""Decode side of the signal plane: one ZMQ DEALER per prefill worker, opened on demand.

Used from the decode engine thread only (ZMQ sockets are not thread-safe).
Connecting a new peer opens a session (``hello``; the prefill worker's ``challenge`` proves it holds the
cluster token, and only then does this worker send its own ``proof``: ``xpyd.signal.auth``; the token
is never sent), then sends ``handshake`` and ``kv_map_init``; lookups are only sent to a peer once all
were accepted. The DEALER sets no routing id: the prefill worker's ROUTER names the connection, so
nobody can take this worker's session by naming it. Every request has a deadline; a peer that misses
one is marked FAILED and its requests fail (no hang). An ``error`` answer to a lookup fails that lookup's
requests only (each gets a FAILED result); one to anything else fails the peer.

Prefill pushes ``notify`` (seq 0) for requests this worker claimed; ``poll`` returns those with the
lookup replies. ``heartbeat`` keeps each ready peer that holds requests of this worker asking for an
answer, so that, through the reply's deadline, a prefill worker that stopped answering is noticed;
``close_idle`` ends the sessions of peers that hold none and were sent nothing for a while (a session
costs a ZMTP ping each way a second; the next request reopens it).

A socket monitor watches each connection: a prefill worker that dies (its TCP
connection drops) or refuses connections is marked FAILED at once, without
waiting for a deadline. A FAILED peer's socket is closed; the next request for
that address opens a new connection (reconnect on demand).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

import zmq
from zmq.utils.monitor import recv_monitor_message

from xpyd.cluster_tokens import check_accepted_tokens
from xpyd.signal import auth
from xpyd.signal import messages as m
from xpyd.signal.counts import INVALID, MessageCounts

log = logging.getLogger(__name__)

# The connection dropped, or a connect attempt was refused and will be retried.
_WATCHED_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class PeerState(str, Enum):
    AUTHENTICATING = "authenticating"
    HANDSHAKING = "handshaking"
    MAPPING = "mapping"
    READY = "ready"
    FAILED = "failed"


@dataclass(eq=False)
class PrefillPeer:
    addr: str
    sock: zmq.Socket
    monitor: zmq.Socket | None = None
    state: PeerState = PeerState.AUTHENTICATING
    error: str | None = None
    pending: dict[int, tuple[str, float]] = field(default_factory=dict)  # seq -> (type, deadline)
    lookups: dict[int, tuple[str, ...]] = field(default_factory=dict)  # seq -> request ids of a lookup
    hello: tuple[bytes, bytes] = (b"", b"")  # (our nonce, the hello frame as sent)
    lookup_in_flight: bool = False
    last_lookup: float = 0.0
    last_sent: float = 0.0  # monotonic time of the last message sent to this peer
    proved: str | None = None  # the token the peer proved (its primary: this worker's, or the one it also
    # accepts during a rotation window); None before its proof, or without tokens


class SignalClient:
    def __init__(self, identity: str, handshake: m.Handshake, kv_map: m.KVMapInit,
                 timeout: float = 5.0, cluster_token: str | None = None,
                 counts: MessageCounts | None = None, accepted_tokens: tuple[str, ...] = ()) -> None:
        """``identity``: this worker's signal address (named in its hello); ``cluster_token``: what it
        proves, and expects each prefill worker to prove (None: neither); ``accepted_tokens``: a prefill
        worker may prove one of these instead (a rotation window; never proved with); ``counts``: where the
        messages sent and received are counted (the worker's metrics; else a counter of its own)."""
        self.identity = identity
        self.instance = auth.new_instance()  # this process (a restarted worker is a new instance)
        self._token = cluster_token
        self._held = () if cluster_token is None else (cluster_token, *check_accepted_tokens(accepted_tokens))
        self._handshake = handshake
        self._kv_map = kv_map
        self._timeout = timeout
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._peers: dict[str, PrefillPeer] = {}
        self._by_sock: dict[zmq.Socket, PrefillPeer] = {}
        self._by_monitor: dict[zmq.Socket, PrefillPeer] = {}
        self._failed: list[PrefillPeer] = []  # failed since the last poll()
        self._seq = itertools.count(1)
        self.counts = counts if counts is not None else MessageCounts()

    # --- peers -------------------------------------------------------------
    def peer(self, addr: str) -> PrefillPeer:
        """The connection to a prefill worker, opened (and handshaken) on first use."""
        p = self._peers.get(addr)
        if p is not None and p.state is not PeerState.FAILED:
            return p
        if p is not None:
            self._drop(p)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)  # (no ROUTING_ID: the ROUTER names each connection itself)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES)
        sock.setsockopt(zmq.IPV6, int(addr.startswith("[")))  # '[v6]:port' (request ids bracket IPv6)
        monitor = sock.get_monitor_socket(_WATCHED_EVENTS)
        sock.connect(f"tcp://{addr}")
        p = PrefillPeer(addr, sock, monitor)
        self._peers[addr] = p
        self._by_sock[sock] = p
        self._by_monitor[monitor] = p
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        nonce = auth.new_nonce()
        hello = m.Hello(self.identity, self.instance, nonce, self._token is not None)
        seq = next(self._seq)
        p.hello = (nonce, m.encode(seq, hello))
        self._send_frame(p, seq, hello.TYPE, p.hello[1])
        return p

    def get(self, addr: str) -> PrefillPeer | None:
        return self._peers.get(addr)

    def peers(self) -> list[PrefillPeer]:
        return list(self._peers.values())

    def drop(self, addr: str) -> None:
        """Close the connection to a prefill worker that left; reopened on demand if it returns."""
        p = self._peers.get(addr)
        if p is not None:
            self._drop(p)

    def _drop(self, p: PrefillPeer) -> None:
        self._close_sockets(p)
        if self._peers.get(p.addr) is p:
            del self._peers[p.addr]

    def _close_sockets(self, p: PrefillPeer) -> None:
        if p.sock.closed:
            return
        self._poller.unregister(p.sock)
        self._by_sock.pop(p.sock, None)
        if p.monitor is not None:
            self._poller.unregister(p.monitor)
            self._by_monitor.pop(p.monitor, None)
            try:
                p.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            p.monitor.close(0)
        p.sock.close(0)

    def register_fd(self, fd: int) -> None:
        """Also wake ``poll`` when ``fd`` is readable (the engine's inbox pipe)."""
        self._poller.register(fd, zmq.POLLIN)

    # --- requests ----------------------------------------------------------
    def _send(self, p: PrefillPeer, msg: m.Message) -> int:
        seq = next(self._seq)
        self._send_frame(p, seq, msg.TYPE, m.encode(seq, msg))
        return seq

    def _send_frame(self, p: PrefillPeer, seq: int, kind: str, frame: bytes) -> None:
        try:
            p.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self._fail(p, "peer not reachable (send queue full)")
            return
        self.counts.sent(kind)
        p.last_sent = time.monotonic()
        p.pending[seq] = (kind, p.last_sent + self._timeout)

    def pending_requests(self) -> int:
        """Requests sent and not yet answered, over all peers (for stats)."""
        return sum(len(p.pending) for p in self._peers.values())

    def send_lookup(self, addr: str, entries: list[m.LookupEntry]) -> None:
        p = self._peers.get(addr)
        if p is None or p.state is not PeerState.READY:
            raise RuntimeError(f"prefill peer {addr} is not ready")
        p.lookup_in_flight = True
        p.last_lookup = time.monotonic()
        seq = self._send(p, m.LookupAll(self.identity, tuple(entries)))
        if seq in p.pending:
            p.lookups[seq] = tuple(e.request_id for e in entries)

    def send_release(self, addr: str, request_ids: list[str]) -> None:
        p = self._peers.get(addr)
        if p is not None and p.state is PeerState.READY and request_ids:
            self._send(p, m.Release(self.identity, tuple(request_ids)))

    def heartbeat(self, interval: float, busy: Collection[str]) -> None:
        """Send a heartbeat to every ready peer of ``busy`` (the prefill workers that hold requests of this
        worker) that was sent nothing for ``interval`` seconds. A pair with nothing between them exchanges
        nothing: idle pairs cost no messages, however many prefill x decode pairs there are."""
        now = time.monotonic()
        for addr in busy:
            p = self._peers.get(addr)
            if p is not None and p.state is PeerState.READY and now - p.last_sent >= interval:
                self._send(p, m.Heartbeat(self.identity))

    def close_idle(self, idle_after: float, busy: Collection[str]) -> list[str]:
        """Close the sessions of peers not in ``busy`` that were sent nothing for ``idle_after`` seconds (their
        ZMTP pings would go on for ever); the next request for one opens a new session. Their addresses."""
        now = time.monotonic()
        idle = [p for p in self._peers.values()
                if p.addr not in busy and not p.pending and now - p.last_sent >= idle_after]
        for p in idle:
            self._drop(p)
        return [p.addr for p in idle]

    # --- progress ----------------------------------------------------------
    def poll(self, timeout_ms: int) -> tuple[list[tuple[str, m.LookupReply | m.Notify]], list[PrefillPeer]]:
        """Wait up to timeout for replies. Returns (lookup replies and pushed notifies, peers that just
        failed)."""
        replies: list[tuple[str, m.LookupReply | m.Notify]] = []
        events = dict(self._poller.poll(timeout_ms))
        for mon, p in list(self._by_monitor.items()):
            if mon in events:
                self._on_monitor(p)
        for sock, p in list(self._by_sock.items()):
            if sock not in events:
                continue
            while p.state is not PeerState.FAILED:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_frame(p, frame, replies)
        now = time.monotonic()
        for p in list(self._peers.values()):
            if p.state is PeerState.FAILED:
                continue
            late = [typ for typ, deadline in p.pending.values() if deadline < now]
            if late:
                self._fail(p, f"prefill worker {p.addr} did not answer {late[0]} within {self._timeout:.1f}s")
        failed, self._failed = self._failed, []
        return replies, failed

    def _on_monitor(self, p: PrefillPeer) -> None:
        while p.state is not PeerState.FAILED and p.monitor is not None:
            try:
                event = recv_monitor_message(p.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._fail(p, f"prefill worker {p.addr} closed the connection (worker down?)")
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self._fail(p, f"prefill worker {p.addr} refused the connection (worker down?)")

    def _on_frame(self, p: PrefillPeer, frame: bytes, replies: list) -> None:
        try:
            env = m.decode(frame)
        except m.MessageError as e:
            self.counts.received(INVALID)
            self._fail(p, f"bad reply from {p.addr}: {e}")
            return
        self.counts.received(env.msg.TYPE)
        if env.seq == 0 and isinstance(env.msg, m.Notify):  # pushed, not a reply
            replies.append((p.addr, env.msg))
            return
        sent = p.pending.pop(env.seq, None)
        if sent is None:
            log.warning("unexpected reply seq %d from %s", env.seq, p.addr)
            return
        msg = env.msg
        asked = p.lookups.pop(env.seq, None)
        if isinstance(msg, m.ErrorReply) and asked is not None:  # this lookup's requests fail, not the peer
            p.lookup_in_flight = False
            error = f"prefill worker {p.addr} refused the lookup: {msg.error}"
            replies.append((p.addr, m.LookupReply(tuple(m.LookupResult(rid, m.LookupStatus.FAILED, error=error)
                                                         for rid in asked))))
        elif isinstance(msg, m.ErrorReply):
            self._fail(p, f"prefill worker {p.addr} refused {sent[0]}: {msg.error}")
        elif isinstance(msg, m.Challenge) and p.state is PeerState.AUTHENTICATING:
            self._on_challenge(p, msg)
        elif isinstance(msg, m.AuthReply):
            if not msg.ok:
                self._fail(p, f"handshake with {p.addr} refused: {msg.error}")
        elif isinstance(msg, m.HandshakeReply):
            if not msg.ok:
                self._fail(p, f"handshake with {p.addr} refused: {msg.error}")
            elif p.state is PeerState.HANDSHAKING:
                p.state = PeerState.MAPPING
                self._send(p, self._kv_map)
        elif isinstance(msg, m.KVMapReply):
            if not msg.ok:
                self._fail(p, f"kv_map_init with {p.addr} refused: {msg.error}")
            else:
                p.state = PeerState.READY
        elif isinstance(msg, m.LookupReply):
            p.lookup_in_flight = False
            replies.append((p.addr, msg))
        elif isinstance(msg, (m.ReleaseReply, m.HeartbeatReply)):
            pass

    def _on_challenge(self, p: PrefillPeer, msg: m.Challenge) -> None:
        """The prefill worker proved the cluster token (or neither side has one): prove it back, and shake
        hands (sent together: the prefill worker serves the handshake only once the proof opened the
        session). A wrong proof: nothing more is sent."""
        nonce, hello = p.hello
        expected = (None if self._token is None
                    else tuple(auth.prefill_proof(t, nonce, msg.nonce, hello) for t in self._held))
        which, refusal = auth.check_proof(expected, msg.proof, "prefill")
        if refusal is not None:
            self._fail(p, f"handshake with {p.addr} refused: the prefill worker's proof: {refusal}")
            return
        p.proved = None if which is None else self._held[which]
        proof = None if self._token is None else auth.decode_proof(self._token, msg.nonce, nonce, hello)
        p.state = PeerState.HANDSHAKING
        self._send(p, m.Proof(proof))
        if p.state is PeerState.HANDSHAKING:
            self._send(p, self._handshake)

    def _fail(self, p: PrefillPeer, error: str) -> None:
        log.warning("%s", error)
        p.state = PeerState.FAILED
        p.error = error
        p.pending.clear()
        p.lookups.clear()
        p.lookup_in_flight = False
        self._close_sockets(p)  # the record stays (FAILED, with its error); peer() reconnects
        self._failed.append(p)  # reported by the next poll()

    def close(self) -> None:
        for p in list(self._peers.values()):
            self._drop(p)
        self._ctx.term()
