"""Prefill side of the signal plane: one ZMQ ROUTER serving many decode workers.

Runs in its own thread so lookups are answered while a long prefill runs.
Every frame is size-limited and decoded into a typed message; a frame that is
not valid gets an ``error`` reply (when it can be addressed) and changes nothing.
A frame over the size limit makes ZMQ close that peer's connection; the ROUTER
keeps serving everyone else.

Sessions (``xpyd.signal.sessions``): a connection serves nothing but ``hello`` and ``proof`` until its
peer proved the cluster token (``xpyd.signal.auth``; the token itself is never sent); every other
message on it then acts as the decode worker named in its authenticated hello, and the handler sees only
that address. A session is bound to its connection, not to a name a client picks: decode DEALERs set no
routing id, so the ROUTER assigns one per connection (never sent on the wire), and the server remembers
the connection's file descriptor. A socket monitor reports each closed connection; its session ends then
(the handler hears ``on_session_closed``: what that decode worker claimed is freed). The monitor is read
before each message is served and before each push, so a message from a new connection that reuses a
routing id or a descriptor (a stranger naming a closed connection's routing id) is never taken for the
old session: a routing id that arrives on another descriptor ends the session.

No MAC on later messages: once open, a session is one TCP connection that only this process and the
authenticated peer's process hold; a stranger off the path cannot inject into it, and one on the path
who can rewrite its packets can rewrite the KV payloads just as well (the transfer backends MAC the frame
that opens a transfer, not the bytes behind it; ``xpyd.transfer.auth``) and reads everything (nothing is
encrypted). A MAC per signal message would therefore raise no bar that the data plane keeps; what would
is an encrypted, authenticated network (WireGuard, IPsec) between the workers.

``push`` (any thread) sends an unsolicited message (``notify``, seq 0) to one decode worker's open session:
it is queued and sent by the server thread, which owns the socket. The ROUTER is ``ROUTER_MANDATORY``: a
push that cannot be delivered (no open session, connection gone, its queue at the high-water mark) is
logged and reported to the handler (``on_undelivered``), never dropped silently; its state stays on the
prefill worker, whose answer to the decode worker's next lookup of that request is the whole result.

A lookup's reply that would not fit one frame (up to 1,024 results of up to ~530 KiB each) goes as
several: ``notify`` frames with the first results, then the reply with the last ones, each under the
cap (``messages.split_results``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from xpyd.cluster_tokens import check_accepted_tokens
from xpyd.netaddr import bracketed, host_port, is_ipv6
from xpyd.signal import messages as m
from xpyd.signal.counts import INVALID, MessageCounts
from xpyd.signal.sessions import Session, Sessions

log = logging.getLogger(__name__)


class SignalHandler(Protocol):
    """What the prefill worker answers. Called from the server thread, ``identity`` being the decode
    worker's address from the session's authenticated hello."""

    cluster_token: str | None  # what sessions must prove (None: nothing)
    accepted_tokens: tuple[str, ...]  # proved by a session too: a rotation window (this worker never proves them)

    def on_handshake(self, identity: str, msg: m.Handshake) -> m.HandshakeReply: ...
    def on_kv_map_init(self, identity: str, msg: m.KVMapInit) -> m.KVMapReply: ...
    def on_lookup_all(self, identity: str, msg: m.LookupAll) -> m.LookupReply: ...
    def on_release(self, identity: str, msg: m.Release) -> m.ReleaseReply: ...
    def on_heartbeat(self, identity: str, msg: m.Heartbeat) -> m.HeartbeatReply: ...
    def on_session_closed(self, identity: str, why: str) -> None: ...  # its current session ended
    def on_undelivered(self, identity: str, msg: m.Message, why: str) -> None: ...  # a push did not go out

    # Any of the request handlers may answer ``m.ErrorReply`` instead (e.g. a peer that has not shaken hands).


HEARTBEAT_IVL = 1.0  # seconds between ZMTP PINGs on each decode worker's connection
SEND_HWM = 1000  # messages queued for one decode worker's connection; a push beyond is reported undelivered


class SignalServer:
    def __init__(self, bind_host: str, port: int, handler: SignalHandler, peer_timeout: float = 10.0,
                 counts: MessageCounts | None = None) -> None:
        """``peer_timeout``: a decode worker's connection that answers no ZMTP PING for this long is closed
        (a cut link leaves it open otherwise), and with it its session. ``counts``: where the messages sent
        and received are counted (the worker's metrics; else a counter of its own)."""
        self._host = bind_host
        self._handler = handler
        self._token = handler.cluster_token
        self._accepted = check_accepted_tokens(handler.accepted_tokens)
        self._peer_timeout = peer_timeout
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._outbox: queue.SimpleQueue[tuple[str, m.Message]] = queue.SimpleQueue()
        self._sessions = Sessions()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.port = port
        self.undelivered = 0  # pushes that could not be sent
        self.counts = counts if counts is not None else MessageCounts()

    def push(self, identity: str, msg: m.Message) -> None:
        """Send ``msg`` unsolicited (seq 0) to decode worker ``identity``'s open session; from any thread."""
        self._outbox.put((identity, msg))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # pipe full: the server is awake anyway
            pass

    def start(self) -> None:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to no one raises instead of vanishing
        sock.setsockopt(zmq.IPV6, int(is_ipv6(self._host)))
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self._peer_timeout * 1000))
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if self.port == 0:
            self.port = int(sock.bind_to_random_port(f"tcp://{bracketed(self._host)}"))
        else:
            sock.bind(f"tcp://{host_port(self._host, self.port)}")
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="signal-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _serve(self) -> None:
        assert self._sock is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(100))
                self._read_monitor()
                if self._wake_r in events:
                    self._send_pushed()
                if self._sock in events:
                    self._serve_all()
                self._sessions.expire(time.monotonic())
            except Exception:  # never let one bad frame (or a bug) stop the signal plane
                log.exception("signal server: request dropped")

    # --- sessions ----------------------------------------------------------------
    def _read_monitor(self) -> None:
        """End the sessions of the connections that closed (before anything that came after is served)."""
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                for s in self._sessions.closed_fd(int(event["value"])):
                    self._closed(s, "its connection closed")

    def _closed(self, s: Session, why: str) -> None:
        log.info("signal session of decode worker %s (instance %s) ended: %s", s.sender, s.instance, why)
        try:
            self._handler.on_session_closed(s.sender, why)
        except Exception:
            log.exception("signal handler failed on a closed session")

    # --- sending -----------------------------------------------------------------
    def _send(self, routing_id: bytes, frame: bytes) -> str | None:
        """Send one frame to a connection; why it could not be sent, or None. A connection that is gone
        ends its session."""
        try:
            self._sock.send_multipart([routing_id, frame], zmq.NOBLOCK)
            self.counts.sent(m.kind_of(frame))
            return None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                s = self._sessions.close(routing_id)
                if s is not None:
                    self._closed(s, "its connection is gone")
                return "its connection is gone"
            if e.errno == zmq.EAGAIN:
                return "its send queue is full (high-water mark)"
            return str(e)

    def _send_pushed(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                identity, msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._read_monitor()
            s = self._sessions.route(identity)
            why = "no open session"
            if s is not None:
                frames = _notify_frames(msg) if isinstance(msg, m.Notify) else [m.encode(0, msg)]
                why = next((w for f in frames if (w := self._send(s.routing_id, f)) is not None), None)
            if why is not None:
                self.undelivered += 1
                log.warning("could not push %s to decode worker %r: %s", msg.TYPE, identity[:64], why)
                try:
                    self._handler.on_undelivered(identity, msg, why)
                except Exception:
                    log.exception("signal handler failed on an undelivered push")

    # --- serving -----------------------------------------------------------------
    def _serve_all(self) -> None:
        while True:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._read_monitor()
            self._serve_one(parts)

    def _serve_one(self, parts: list[zmq.Frame]) -> None:
        routing_id = parts[0].bytes
        if len(parts) != 2:
            log.warning("signal message with %d frames", len(parts) - 1)
            self.counts.received(INVALID)
            replies = [m.encode(0, m.ErrorReply(f"expected one frame per message, got {len(parts) - 1}"))]
        else:
            try:
                fd = parts[1].get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = None
            try:
                replies = self._dispatch(routing_id, fd if fd is not None and fd >= 0 else None, parts[1].bytes)
            except Exception as e:  # a bug in decoding or dispatch: still answer, and keep serving
                log.exception("signal server: cannot serve a request")
                replies = [m.encode(0, m.ErrorReply(f"internal error: {type(e).__name__}"))]
        for frame in replies:
            why = self._send(routing_id, frame)
            if why is not None:
                log.warning("could not reply to a decode worker: %s", why)
                return

    def _dispatch(self, routing_id: bytes, fd: int | None, frame: bytes) -> list[bytes]:
        """The frames that answer ``frame`` (the last one is the reply)."""
        try:
            env = m.decode(frame)
        except m.MessageError as e:
            self.counts.received(INVALID)
            return [m.encode(m.seq_of(frame), m.ErrorReply(str(e)[:1000]))]
        msg = env.msg
        self.counts.received(msg.TYPE)
        if isinstance(msg, m.Hello):
            return [m.encode(env.seq, self._sessions.hello(routing_id, fd, msg, frame, self._token,
                                                                  accepted=self._accepted))]
        if isinstance(msg, m.Proof):
            reply, replaced = self._sessions.prove(routing_id, fd, msg)
            if replaced is not None:
                self._closed(replaced, "a new session of the same decode worker opened")
            if reply.ok:
                s, _ = self._sessions.get(routing_id, fd)
                log.info("signal session of decode worker %s (instance %s) opened", s.sender, s.instance)
            else:
                log.warning("refused a decode worker's proof: %s", reply.error)
            return [m.encode(env.seq, reply)]
        session, stolen = self._sessions.get(routing_id, fd)
        if stolen is not None:
            self._closed(stolen, "its routing id arrived on another connection")
        if session is None:
            return [m.encode(env.seq, m.ErrorReply("handshake first"))]
        identity = session.sender
        if getattr(msg, "sender", identity) != identity:
            return [m.encode(env.seq, m.ErrorReply("sender does not match the session"))]
        try:
            if isinstance(msg, m.Handshake):
                reply = self._handler.on_handshake(identity, msg)
            elif isinstance(msg, m.KVMapInit):
                reply = self._handler.on_kv_map_init(identity, msg)
            elif isinstance(msg, m.LookupAll):
                reply = self._handler.on_lookup_all(identity, msg)
            elif isinstance(msg, m.Release):
                reply = self._handler.on_release(identity, msg)
            elif isinstance(msg, m.Heartbeat):
                reply = self._handler.on_heartbeat(identity, msg)
            else:
                reply = m.ErrorReply(f"{msg.TYPE} is not a request")
        except Exception as e:  # a handler bug must not kill the signal plane
            log.exception("signal handler failed")
            reply = m.ErrorReply(f"internal error: {type(e).__name__}")
        if isinstance(reply, m.LookupReply):
            *first, last = m.split_results(reply.results)  # (in order: the reply ends the answer)
            return [m.encode(0, m.Notify(g)) for g in first] + [m.encode(env.seq, m.LookupReply(last))]
        try:
            return [m.encode(env.seq, reply)]
        except m.MessageError as e:  # e.g. a reply that would exceed the frame limit
            return [m.encode(env.seq, m.ErrorReply(f"cannot send the reply: {e}"))]


def _notify_frames(msg: m.Notify) -> list[bytes]:
    return [m.encode(0, m.Notify(g)) for g in m.split_results(msg.results)]
