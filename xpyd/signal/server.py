"""Prefill side of the signal plane: one ZMQ ROUTER serving many decode workers.

Runs in its own thread so lookups are answered while a long prefill runs.
Every frame is size-limited and decoded into a typed message; a frame that is
not valid gets an ``error`` reply (when it can be addressed) and changes nothing.
A frame over the size limit makes ZMQ close that peer's connection; the ROUTER
keeps serving everyone else.

``push`` (any thread) sends an unsolicited message (``notify``, seq 0) to one decode
worker: it is queued and sent by the server thread, which owns the socket.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Protocol

import zmq

from xpyd.netaddr import bracketed, host_port, is_ipv6
from xpyd.signal import messages as m

log = logging.getLogger(__name__)


class SignalHandler(Protocol):
    """What the prefill worker answers. Called from the server thread."""

    def on_handshake(self, identity: str, msg: m.Handshake) -> m.HandshakeReply: ...
    def on_kv_map_init(self, identity: str, msg: m.KVMapInit) -> m.KVMapReply: ...
    def on_lookup_all(self, identity: str, msg: m.LookupAll) -> m.LookupReply: ...
    def on_release(self, identity: str, msg: m.Release) -> m.ReleaseReply: ...
    def on_heartbeat(self, identity: str, msg: m.Heartbeat) -> m.HeartbeatReply: ...

    # Any of them may answer ``m.ErrorReply`` instead (e.g. a peer that has not shaken hands).


HEARTBEAT_IVL = 1.0  # seconds between ZMTP PINGs on each decode worker's connection


class SignalServer:
    def __init__(self, bind_host: str, port: int, handler: SignalHandler, peer_timeout: float = 10.0) -> None:
        """``peer_timeout``: a decode worker's connection that answers no ZMTP PING for this long is closed
        (a cut link leaves it open otherwise, and the ROUTER would refuse that worker's reconnection: it
        keeps the old one under the same identity)."""
        self._host = bind_host
        self._handler = handler
        self._peer_timeout = peer_timeout
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._outbox: queue.SimpleQueue[tuple[str, m.Message]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.port = port

    def push(self, identity: str, msg: m.Message) -> None:
        """Send ``msg`` unsolicited (seq 0) to the decode worker ``identity``; from any thread."""
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
        sock.setsockopt(zmq.IPV6, int(is_ipv6(self._host)))
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self._peer_timeout * 1000))
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
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _serve(self) -> None:
        assert self._sock is not None
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(100))
                if self._wake_r in events:
                    self._send_pushed()
                if self._sock in events:
                    self._serve_one()
            except Exception:  # never let one bad frame (or a bug) stop the signal plane
                log.exception("signal server: request dropped")

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
            try:
                self._sock.send_multipart([identity.encode(), m.encode(0, msg)], zmq.NOBLOCK)
            except (zmq.ZMQError, m.MessageError) as e:  # gone, or queue full: its re-ask or timeout covers it
                log.warning("could not push %s to %r: %s", msg.TYPE, identity[:64], e)

    def _serve_one(self) -> None:
        try:
            parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return
        identity = parts[0]
        if len(parts) != 2:
            log.warning("signal message with %d frames from %r", len(parts) - 1, identity[:64])
            reply = m.encode(0, m.ErrorReply(f"expected one frame per message, got {len(parts) - 1}"))
        else:
            try:
                reply = self._dispatch(identity, parts[1])
            except Exception as e:  # a bug in decoding or dispatch: still answer, and keep serving
                log.exception("signal server: cannot serve a request from %r", identity[:64])
                reply = m.encode(0, m.ErrorReply(f"internal error: {type(e).__name__}"))
        try:
            self._sock.send_multipart([identity, reply], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("could not reply to %r: %s", identity[:64], e)

    def _dispatch(self, identity_b: bytes, frame: bytes) -> bytes:
        try:
            identity = identity_b.decode("utf-8")
        except UnicodeDecodeError:
            return m.encode(0, m.ErrorReply("identity is not UTF-8"))
        try:
            env = m.decode(frame)
        except m.MessageError as e:
            return m.encode(m.seq_of(frame), m.ErrorReply(str(e)[:1000]))
        msg = env.msg
        if getattr(msg, "sender", identity) != identity:
            return m.encode(env.seq, m.ErrorReply("sender does not match the connection identity"))
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
        try:
            return m.encode(env.seq, reply)
        except m.MessageError as e:  # e.g. a reply that would exceed the frame limit
            return m.encode(env.seq, m.ErrorReply(f"cannot send the reply: {e}"))
