"""The inbound side shared by the tcp and shm backends: their thread tracking and accept loop.

``Threads`` tracks the daemon threads a backend started, so ``close()`` can join them; the backend's
own lock guards it. ``accept_loop`` runs the acceptor thread: one reader thread per inbound
connection, at most ``max_inbound`` at once (more are closed at once). The outbound side is in ``sender``.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from xpyd.transfer.tcp_wire import Closing, Conn

ACCEPT_WAIT = 600.0  # the acceptor's poll timeout (it just polls again); close() wakes it at once


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
