"""The inbound side shared by the socket backends (tcp, shm, nixl): threads, accept loop, admission.

``Threads`` tracks the daemon threads a backend started, so ``close()`` can join them; the backend's
own lock guards it. ``accept_loop`` runs the acceptor thread: one reader thread per inbound
connection, at most ``max_inbound`` at once (more are closed at once). ``Door`` decides how long a
connection that has proven nothing yet may stay, and how many such may (see its docstring). The
outbound side is in ``sender``.
"""

from __future__ import annotations

import ipaddress
import logging
import select
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from xpyd.transfer.tcp_wire import Closing, Conn, Unproven

ACCEPT_WAIT = 600.0  # the acceptor's poll timeout (it just polls again); close() wakes it at once
OPEN_TIMEOUT = 1.0  # seconds from accept by which a connection's opening frames must have come
MAX_PENDING = 64  # connections still owing their opening frames, from all sources together
MAX_PENDING_PER_SOURCE = 16  # ... from one source address
DROP_LOG_EVERY = 60.0  # seconds between warnings about connections dropped at the door
_EVICTED = "closed by the listener to make room for a newer connection"


class Threads:
    """Daemon threads started by one backend; not locked itself, its owner holds its lock around each call."""

    __slots__ = ("_threads",)

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def start(self, target, name: str, *args) -> threading.Thread:
        """Start a daemon thread and track it (finished ones are dropped first)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()
        return t

    def alive(self, prefix: str) -> int:
        """How many tracked threads whose name starts with ``prefix`` are still running."""
        return sum(t.name.startswith(prefix) and t.is_alive() for t in self._threads)

    def take(self) -> list[threading.Thread]:
        """Hand every tracked thread over (to ``close()``, which joins them) and track none."""
        threads, self._threads = self._threads, []
        return threads


def accept_loop(
    listener: socket.socket,
    wake_fd: int,
    lock: threading.Lock,
    is_closed: Callable[[], bool],
    threads: Threads,
    *,
    serve: Callable[[socket.socket, tuple], None],
    setup: Callable[[socket.socket], None],
    name: str,
    max_inbound: int,
    log: logging.Logger,
) -> None:
    """Accept until ``close()``; each connection gets ``setup`` then a ``serve`` thread "xpyd-{name}-recv-host:port".

    ``is_closed`` and ``threads`` are read under ``lock``, the backend's own.
    """
    conn = Conn(listener, wake_fd, ACCEPT_WAIT)
    prefix = f"xpyd-{name}-recv"
    while True:
        try:
            conn.wait(select.POLLIN)
            sock, addr = listener.accept()
        except (TimeoutError, BlockingIOError, ConnectionAbortedError):
            continue
        except Closing:
            return
        except OSError as e:  # e.g. out of file descriptors: back off, keep listening
            log.error("%s transfer listener cannot accept: %s", name, e)
            time.sleep(0.1)
            continue
        setup(sock)
        with lock:
            if is_closed():
                sock.close()
                return
            if threads.alive(prefix) >= max_inbound:
                log.error("refusing %s transfer connection from %s: %d already open", name, addr, max_inbound)
                sock.close()
                continue
            threads.start(serve, f"{prefix}-{addr[0]}:{addr[1]}", sock, addr)


class Door:
    """Who may hold a transfer listener's connection: only a sender that proves itself at once.

    A connection is *pending* from accept until its opening frames came: tcp's first transfer header,
    shm's and nixl's Hello and first offer. The last of them carries the transfer's MAC (``auth``), and
    the backend checks it as soon as it is read: the connection is then *in* (it opened a transfer; it
    may stay, idle up to the backend's idle timeout, for the next) or refused and closed. A real sender
    sends them right after it connects, so pending connections are bounded, and idle ones cannot crowd
    out real senders:

    - in time: every wait for the opening frames ends ``open_timeout`` after accept (``Unproven``);
    - per source (an IPv4 address, an IPv6 /64: ``source_of``): at most ``max_per_source`` pending;
      one more evicts the oldest from that source (so a flood evicts its own connections; refusing the
      newest instead would let a flood that renews its connections keep every real sender out);
    - in all: at most ``max_pending``; one more evicts the oldest from the source with the most pending.

    A connection that is in is never evicted. The listener's own cap (``accept_loop``'s ``max_inbound``,
    above ``max_pending``) refuses new connections once that many readers are open. Thread-safe.
    """

    def __init__(self, open_timeout: float = OPEN_TIMEOUT, max_pending: int = MAX_PENDING,
                 max_per_source: int = MAX_PENDING_PER_SOURCE) -> None:
        if not open_timeout > 0:
            raise ValueError(f"open_timeout must be > 0 seconds, got {open_timeout!r}")
        if not 0 < max_per_source <= max_pending:
            raise ValueError(f"need 0 < max_per_source <= max_pending, got {max_per_source}, {max_pending}")
        self.open_timeout, self.max_pending, self.max_per_source = open_timeout, max_pending, max_per_source
        self._lock = threading.Lock()
        self._pending: defaultdict[str, list[_Guest]] = defaultdict(list)  # by source, oldest first
        self._count = 0  # pending connections in all
        self._dropped = 0
        self._logged_at: float | None = None

    def enter(self, sock: socket.socket, addr, wake_fd: int, io_timeout: float, opening_frames: int,
              log: logging.Logger) -> "DoorConn":
        """A just-accepted connection: its ``Conn``, pending until ``opening_frames`` frames were read;
        it may evict an older pending one (see the class). ``close()`` it when done."""
        guest = _Guest(source_of(str(addr[0])), sock, time.monotonic() + self.open_timeout)
        with self._lock:
            mine = self._pending[guest.source]
            if len(mine) >= self.max_per_source:
                self._evict(mine[0])
            elif self._count >= self.max_pending:
                self._evict(max(self._pending.values(), key=len)[0])
            self._pending[guest.source].append(guest)
            self._count += 1
        return DoorConn(sock, wake_fd, io_timeout, self, guest, opening_frames, log)

    @property
    def pending(self) -> int:
        """Connections accepted that have not sent their opening frames yet."""
        with self._lock:
            return self._count

    def pending_by_source(self) -> dict[str, int]:
        """Pending connections per source (``source_of``)."""
        with self._lock:
            return {source: len(guests) for source, guests in self._pending.items()}

    @property
    def dropped(self) -> int:
        """Connections closed before their opening frames came: past the deadline, or evicted."""
        with self._lock:
            return self._dropped

    def _evict(self, guest: "_Guest") -> None:
        """(under the lock) Take a pending connection out; its reader wakes to a shut-down socket."""
        self._remove(guest)
        guest.evicted = True
        try:
            guest.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # (its reader closed it meanwhile)
            pass

    def _remove(self, guest: "_Guest") -> bool:
        """(under the lock) Stop counting ``guest`` as pending; False if it no longer was."""
        mine = self._pending.get(guest.source)
        if mine is None or guest not in mine:
            return False
        mine.remove(guest)
        if not mine:
            del self._pending[guest.source]
        self._count -= 1
        return True

    def _let_in(self, guest: "_Guest") -> bool:
        """Its opening frames came: in, for good, unless it was evicted meanwhile (False)."""
        with self._lock:
            return self._remove(guest)

    def _leave(self, guest: "_Guest", unproven: bool, log: logging.Logger) -> None:
        with self._lock:
            self._remove(guest)
            if not unproven:
                return
            self._dropped += 1
            now = time.monotonic()
            if self._logged_at is not None and now - self._logged_at < DROP_LOG_EVERY:
                return
            self._logged_at, dropped = now, self._dropped
        log.warning("transfer listener: closed a connection from %s that sent no transfer within %gs or was "
                    "evicted by newer ones (%d so far; a flood of idle connections?)", guest.source,
                    self.open_timeout, dropped)


def source_of(host: str) -> str:
    """The source a connection counts against: its IPv4 address, or its IPv6 /64 (one host's, or one
    site's, share of addresses: whoever has one address there usually has them all)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network((ip, 64), strict=False)) if ip.version == 6 else str(ip)


class _Guest:
    __slots__ = ("source", "sock", "deadline", "evicted")

    def __init__(self, source: str, sock: socket.socket, deadline: float) -> None:
        self.source, self.sock, self.deadline, self.evicted = source, sock, deadline, False


class DoorConn(Conn):
    """An accepted connection's ``Conn`` while the ``Door`` holds it: every wait ends at the door's deadline
    until ``opening_frames`` frames were read, then it is in and waits as any ``Conn``. A connection the
    door evicted, or whose deadline passed, raises ``Unproven``."""

    def __init__(self, sock: socket.socket, wake_fd: int, io_timeout: float, door: Door, guest: _Guest,
                 opening_frames: int, log: logging.Logger) -> None:
        super().__init__(sock, wake_fd, io_timeout)
        self.deadline = guest.deadline
        self._door, self._guest, self._to_open, self._log = door, guest, opening_frames, log
        self._unproven = False

    def read_frame(self, limit: int, first_byte_timeout: float | None = None) -> dict | None:
        if not self._to_open:
            return super().read_frame(limit, first_byte_timeout)
        try:
            frame = super().read_frame(limit, first_byte_timeout)
        except Unproven:
            self._unproven = True
            raise
        except OSError:
            if self._guest.evicted:
                self._unproven = True
                raise Unproven(_EVICTED) from None
            raise
        if frame is None and not self._guest.evicted:
            return None
        self._to_open -= 1
        if frame is None or (not self._to_open and not self._door._let_in(self._guest)):
            self._unproven = True
            raise Unproven(_EVICTED)
        if not self._to_open:
            self.deadline = None
        return frame

    def close(self) -> None:
        """Leave the door (counted as dropped if it proved nothing in time) and close the socket."""
        self._door._leave(self._guest, self._unproven or self._guest.evicted, self._log)
        self.sock.close()
