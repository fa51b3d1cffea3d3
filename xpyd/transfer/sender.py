"""The outbound side shared by the tcp and shm backends: one sender thread and queue per peer address.

``Senders`` maps a peer address to its sender thread's queue (the backend's own lock guards it);
``send_loop`` is that thread: it takes jobs in order, (re)connects with ``connect`` and hands each
job to the backend's ``push``; a failure fails that job only and the next one reconnects. ``None``
on the queue stops it.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
from collections.abc import Callable
from queue import SimpleQueue

from xpyd.transfer.table import Transfer, TransferTable
from xpyd.transfer.tcp_wire import Aborted, Closing, Conn, ProtocolError, parse_address


class Senders:
    """Sender queues by peer address; not locked itself, its owner holds its lock around each call."""

    __slots__ = ("_queues",)

    def __init__(self) -> None:
        self._queues: dict[str, SimpleQueue] = {}

    def submit(self, address: str, job: Transfer, start: Callable[[str, SimpleQueue], object]) -> None:
        """Queue ``job`` for ``address``, first calling ``start(address, queue)`` if it has no sender yet."""
        queue = self._queues.get(address)
        if queue is None:
            queue = self._queues[address] = SimpleQueue()
            start(address, queue)
        queue.put(job)

    def forget(self, address: str) -> SimpleQueue | None:
        """Stop tracking ``address``; its queue (for the caller to stop), or None if it had none."""
        return self._queues.pop(address, None)

    def take(self) -> list[SimpleQueue]:
        """Every queue (for ``close()`` to stop), tracking none."""
        queues = list(self._queues.values())
        self._queues.clear()
        return queues


def connect(address: str, wake_fd: int, setup: Callable[[socket.socket], None],
            connect_timeout: float, io_timeout: float) -> Conn:
    """A connected non-blocking ``Conn`` to ``address`` ("host:port"), after ``setup`` of its socket."""
    host, port = parse_address(address)
    family, type_, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, type_, proto)
    try:
        setup(sock)
        conn = Conn(sock, wake_fd, io_timeout)
        err = sock.connect_ex(sockaddr)
        if err in (errno.EINPROGRESS, errno.EAGAIN):
            conn.wait(select.POLLOUT, connect_timeout)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise ConnectionError(f"cannot connect: {os.strerror(err)}")
        return conn
    except BaseException:
        sock.close()
        raise


def send_loop(
    address: str,
    queue: SimpleQueue,
    connect: Callable[[str], Conn],
    push: Callable[[Conn, Transfer, str], None],
    sending: TransferTable,
    log: logging.Logger,
) -> None:
    """Run one peer's sender thread until ``None`` is queued or the backend closes."""
    conn: Conn | None = None
    try:
        while (job := queue.get()) is not None:
            if job.token.finished():  # aborted while queued
                continue
            try:
                if conn is not None and conn.stale():
                    conn.sock.close()
                    conn = None
                if conn is None:
                    conn = connect(address)
                push(conn, job, address)
            except Closing:
                job.token._fail("backend closed")
                return
            except Aborted:  # the receiver sees a truncated transfer and fails it
                conn.sock.close()
                conn = None
            except Exception as e:  # any failure fails this job only; the next one reconnects
                if not isinstance(e, (ProtocolError, OSError)):
                    log.exception("sending transfer %r to %s", job.token.transfer_id, address)
                job.token._fail(f"send to {address} failed: {e or type(e).__name__}")
                if conn is not None:
                    conn.sock.close()
                    conn = None
            finally:
                sending.finish(job)
    finally:
        if conn is not None:
            conn.sock.close()
