"""The outbound side shared by the socket backends (tcp and shm; nixl and cuda_ipc with one lane): lanes of
sender threads per peer address, so transfers to one peer do not wait for each other.

tcp and shm are stop-and-wait per connection: a tcp sender waits for each transfer's ack, an shm sender
for the receiver's reply after its copy. With one sender per peer, a long prompt's KV held up every
transfer after it to the same decode worker. A *lane* is a sender thread (``send_loop``) with its own
connection; the lanes of one peer address take jobs from one queue (``Senders``, guarded by the backend's
own lock), so a job goes to the first lane that is free. A new lane is started when a job comes while
every lane of its address is moving a transfer, up to ``lanes`` per address; a pair with one transfer at a
time keeps one connection. A lane that is still connecting (its job not moving yet) holds back the next
lane, so a sender opens one connection to a peer at a time, as the listener's door expects of one sender
(``listener.Door``: pending connections per source address are capped); jobs that come meanwhile wait
for the first free lane.

Bounded: at most ``lanes`` threads and connections per peer on the sender, and per sending process on a
receiver (each inbound connection takes one of the listener's reader threads, ``MAX_INBOUND``). Lanes live
until their peer is forgotten or the backend closes.

``send_loop`` is a lane's thread: it takes jobs in order, (re)connects with ``connect`` and hands each
job to the backend's ``push``; a failure fails that job only and the lane's next job reconnects. ``None``
on the queue stops one lane.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
from collections.abc import Callable
from queue import SimpleQueue

from xpyd.transfer.base import TransferState
from xpyd.transfer.table import Transfer, TransferTable
from xpyd.transfer.tcp_wire import Aborted, Closing, Conn, ProtocolError, parse_address

LANES = 4  # lanes per peer address for tcp and shm with --kv-lanes 4 (see the module docstring; docs/transfer.md)


class _Peer:
    """One peer address's queue, how many lanes take from it, and its jobs not known to have finished."""

    __slots__ = ("queue", "lanes", "jobs")

    def __init__(self) -> None:
        self.queue: SimpleQueue = SimpleQueue()
        self.lanes = 0
        self.jobs: list[Transfer] = []


class Senders:
    """Sender lanes by peer address; not locked itself, its owner holds its lock around each call."""

    __slots__ = ("_peers", "_max")

    def __init__(self, lanes: int = 1) -> None:
        if type(lanes) is not int or lanes < 1:
            raise ValueError(f"lanes must be an int >= 1, got {lanes!r}")
        self._max = lanes
        self._peers: dict[str, _Peer] = {}

    def submit(self, address: str, job: Transfer, start: Callable[[str, SimpleQueue], object]) -> None:
        """Queue ``job`` for ``address``, first calling ``start(address, queue)`` to start a lane that takes
        from ``queue`` when the address has none, or when each of its lanes is moving a transfer and it has
        fewer than ``lanes``."""
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = _Peer()
        peer.jobs = [j for j in peer.jobs if not j.token.finished()]
        moving = sum(j.token.state() is TransferState.TRANSFERRING for j in peer.jobs)
        if peer.lanes == 0 or (peer.lanes < self._max and moving >= peer.lanes):
            start(address, peer.queue)
            peer.lanes += 1
        peer.jobs.append(job)
        peer.queue.put(job)

    def lanes(self, address: str) -> int:
        """How many lanes ``address`` has."""
        peer = self._peers.get(address)
        return 0 if peer is None else peer.lanes

    def forget(self, address: str) -> int:
        """Stop tracking ``address``: each of its lanes ends once the jobs queued before are done; how many."""
        peer = self._peers.pop(address, None)
        return 0 if peer is None else _stop(peer)

    def take(self) -> None:
        """Stop every lane (``close()``), tracking none."""
        for peer in self._peers.values():
            _stop(peer)
        self._peers.clear()


def _stop(peer: _Peer) -> int:
    for _ in range(peer.lanes):
        peer.queue.put(None)
    return peer.lanes


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
    """Run one lane's sender thread until ``None`` is queued or the backend closes."""
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
