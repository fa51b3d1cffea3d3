"""The prefill worker's signal-plane sessions, one per decode worker's connection (pure bookkeeping).

A session is keyed by the connection's ZMQ routing id, which the ROUTER assigns per connection (decode
DEALERs set none; it never goes on the wire), and remembers the connection's file descriptor. It opens
once the peer proved the cluster token (``xpyd.signal.auth``); what the peer is (its signal address, its
process instance) comes from its authenticated hello. It closes when its connection closes (the server
sees the descriptor go), when a message under its routing id arrives on another connection (a stranger
that took the routing id after the connection closed), when a send to it finds no such peer, or when a
newer session of the same address opens (a decode worker that reconnected or restarted: one open session
per address, and pushes go to that one). Without a cluster token nobody proves anything, so a newer
session does not replace an open one (else anyone could take a live worker's session by naming it): the
worker waits until the old connection closes (a cut one: after the server's heartbeats time out).

Unauthenticated sessions are bounded: at most ``max_pending``, each for at most ``auth_timeout``
seconds (the oldest goes first); open sessions at most ``max_open``. Not thread-safe: the server
thread owns it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from xpyd.signal import auth
from xpyd.signal import messages as m

MAX_PENDING = 1024
MAX_OPEN = 4096
AUTH_TIMEOUT = 10.0  # seconds from hello to proof


@dataclass(eq=False, slots=True)
class Session:
    routing_id: bytes
    fd: int | None  # the connection's file descriptor (None: unknown)
    sender: str  # the decode worker's signal address (authenticated once open)
    instance: str
    started: float
    expected: tuple[bytes, ...] | None = None  # the decode worker's proofs this worker accepts, one per token
    # it holds (the primary first; None: no token)
    open: bool = False


class Sessions:
    def __init__(self, max_pending: int = MAX_PENDING, max_open: int = MAX_OPEN,
                 auth_timeout: float = AUTH_TIMEOUT) -> None:
        self._max_pending = max_pending
        self._max_open = max_open
        self._auth_timeout = auth_timeout
        self._pending: OrderedDict[bytes, Session] = OrderedDict()  # oldest first
        self._open: dict[bytes, Session] = {}
        self._current: dict[str, Session] = {}  # address -> its open session

    # --- opening ---------------------------------------------------------------
    def hello(self, routing_id: bytes, fd: int | None, msg: m.Hello, frame: bytes, token: str | None,
              now: float | None = None, accepted: tuple[str, ...] = ()) -> m.Challenge | m.HandshakeReply:
        """A hello on a connection: the challenge to answer it with, or a refusal. ``token``: what this worker
        proves; ``accepted``: tokens it also accepts a proof of (a rotation window; never proved with)."""
        if routing_id in self._open:
            return m.HandshakeReply(False, "this connection's session is open already")
        self._pending.pop(routing_id, None)
        refusal = auth.presence_refusal(token, msg.token, "decode")
        if refusal is not None:
            return m.HandshakeReply(False, refusal)
        nonce = auth.new_nonce()
        expected = proof = None
        if token is not None:
            proof = auth.prefill_proof(token, msg.nonce, nonce, frame)
            expected = tuple(auth.decode_proof(t, nonce, msg.nonce, frame) for t in (token, *accepted))
        self._pending[routing_id] = Session(routing_id, fd, msg.sender, msg.instance,
                                            time.monotonic() if now is None else now, expected)
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
        return m.Challenge(nonce, proof)

    def prove(self, routing_id: bytes, fd: int | None, msg: m.Proof) -> tuple[m.AuthReply, Session | None]:
        """The decode worker's proof: the reply, and the session of the same address this one replaced
        (closed now), if any."""
        s = self._pending.pop(routing_id, None)
        if s is None or (s.fd is not None and fd is not None and s.fd != fd):
            return m.AuthReply(False, "hello first"), None
        _, refusal = auth.check_proof(s.expected, msg.proof, "decode")
        if refusal is not None:
            return m.AuthReply(False, refusal), None
        if len(self._open) >= self._max_open and s.sender not in self._current:
            return m.AuthReply(False, f"too many decode workers ({self._max_open})"), None
        replaced = self._current.get(s.sender)
        if replaced is not None and s.expected is None:  # (no token: anyone could say they are that worker)
            return m.AuthReply(False, f"decode worker {s.sender} has an open session on another connection (one "
                                      "on a cut link is closed after --peer-timeout)"), None
        if replaced is not None:
            self._open.pop(replaced.routing_id, None)
            replaced.open = False
        s.open, s.expected = True, None
        self._open[routing_id] = s
        self._current[s.sender] = s
        return m.AuthReply(True), replaced

    # --- using -------------------------------------------------------------------
    def get(self, routing_id: bytes, fd: int | None) -> tuple[Session | None, Session | None]:
        """The open session of a message from ``routing_id`` on connection ``fd``, and the session closed
        because the routing id now comes from another connection (it was the current one of its address)."""
        s = self._open.get(routing_id)
        if s is None:
            return None, None
        if s.fd is not None and fd is not None and s.fd != fd:
            return None, self._close(s)
        return s, None

    def route(self, address: str) -> Session | None:
        """Where a push to decode worker ``address`` goes: its open session, if any."""
        return self._current.get(address)

    # --- closing -----------------------------------------------------------------
    def close(self, routing_id: bytes) -> Session | None:
        """Its connection is gone: forget it; the session if it was its address's current one."""
        self._pending.pop(routing_id, None)
        s = self._open.get(routing_id)
        return self._close(s) if s is not None else None

    def closed_fd(self, fd: int) -> list[Session]:
        """Connection ``fd`` closed: its sessions end; those that were their address's current one."""
        for rid in [rid for rid, s in self._pending.items() if s.fd == fd]:
            del self._pending[rid]
        return [c for s in [s for s in self._open.values() if s.fd == fd] if (c := self._close(s)) is not None]

    def expire(self, now: float) -> None:
        """Forget hellos that were not followed by a proof within the auth timeout."""
        while self._pending:
            rid, s = next(iter(self._pending.items()))
            if now - s.started < self._auth_timeout:
                return
            del self._pending[rid]

    def _close(self, s: Session) -> Session | None:
        self._open.pop(s.routing_id, None)
        s.open = False
        if self._current.get(s.sender) is s:
            del self._current[s.sender]
            return s
        return None

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def num_pending(self) -> int:
        return len(self._pending)
