"""What a socket backend (tcp, shm) holds from ``register()`` to ``close()``, apart from its pool.

One ``Endpoint`` per backend: its lock and closed flag, the listener and the close pipe (written once
by ``close()`` to wake every poll), its threads (``listener.Threads``), its per-peer sender lanes
(``sender.Senders``) and its two transfer tables (``table.TransferTable``): ``sending`` and
``expected``, and a count of the transfers it refused to open (``refuse``: no or a wrong MAC, an id
not expected, ...). The backend keeps the pool and what it does with the bytes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from functools import partial
from queue import SimpleQueue

from xpyd.transfer.base import CompletionToken, Region, TransferError, check_regions
from xpyd.transfer.listener import Threads, accept_loop
from xpyd.transfer.sender import Senders
from xpyd.transfer.table import Transfer, TransferTable


class Endpoint:
    """The lifecycle and bookkeeping of one socket backend; its public methods lock as they need."""

    def __init__(self, lanes: int = 1) -> None:
        """``lanes``: sender lanes per peer address (``sender.Senders``)."""
        self.lock = threading.Lock()  # guards closed, listener, wake, threads, senders
        self.closed = False
        self.listener: socket.socket | None = None
        self.wake: tuple[int, int] | None = None  # pipe; written once by close() to wake every poll
        self.threads = Threads()
        self.senders = Senders(lanes)
        self.sending = TransferTable("is already being sent")
        self.expected = TransferTable("is already expected")
        self.refused = 0  # frames that opened a transfer and were refused (see ``refuse``)

    def check_open(self) -> None:
        """Raise if closed (caller holds ``lock``)."""
        if self.closed:
            raise TransferError("backend is closed")

    def listen(self, listener: socket.socket) -> None:
        """Keep the (bound, listening) socket and open the close pipe (caller holds ``lock``)."""
        listener.setblocking(False)
        self.listener = listener
        self.wake = os.pipe()

    def start_acceptor(self, name: str, serve: Callable[[socket.socket, tuple], None],
                       setup: Callable[[socket.socket], None], max_inbound: int, log: logging.Logger) -> None:
        """Start the thread "xpyd-{name}-accept" (``listener.accept_loop``) after ``listen`` (caller holds ``lock``)."""
        loop = partial(accept_loop, self.listener, self.wake[0], self.lock, lambda: self.closed, self.threads,
                       serve=serve, setup=setup, name=name, max_inbound=max_inbound, log=log)
        self.threads.start(loop, f"xpyd-{name}-accept")

    def send(self, job: Transfer, address: str, start_sender: Callable[[str, SimpleQueue], object]) -> None:
        """Track ``job`` and queue it for the sender thread of ``address`` (started on first use)."""
        with self.lock:
            self.check_open()
            self.sending.add(job)
            self.senders.submit(address, job, start_sender)

    def expect(self, transfer_id: str, dst: Sequence[Region], buffer_size: int, key: bytes,
               accepted: tuple[bytes, ...] = ()) -> CompletionToken:
        """Track a transfer into ``dst`` (of a ``buffer_size``-byte pool) announced by ``expect()``; only a
        sender that proves it holds ``key`` (``auth.transfer_key``) or one of ``accepted`` may open it."""
        dst, total = check_regions(dst, buffer_size, "dst")
        rec = Transfer(CompletionToken(transfer_id), dst, total, key=key, accepted=accepted)
        with self.lock:
            self.check_open()
            self.expected.add(rec)
        return rec.token

    def refuse(self, log: logging.Logger, name: str, transfer_id: str, addr, error: str) -> None:
        """Count and log a frame that tried to open a transfer and was refused (nothing of it reached the pool)."""
        with self.lock:
            self.refused += 1
        log.warning("%s: refused transfer %r from %s: %s", name, transfer_id, addr, error)

    def abort(self, transfer_id: str) -> None:
        self.expected.abort(transfer_id)
        self.sending.abort(transfer_id)

    def outstanding(self) -> set[str]:
        return self.sending.ids() | self.expected.ids()

    def forget_peer(self, address: str) -> None:
        with self.lock:
            self.senders.forget(address)

    def close(self, join_timeout: float) -> bool:
        """Stop every thread, fail every tracked transfer, close the listener; False if already closed.

        The close pipe is kept open if a thread is stuck, so it never polls a reused fd.
        """
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            threads = self.threads.take()
            self.senders.take()  # (a None for each lane; one busy on its socket wakes on the close pipe)
            recs = self.expected.take() + self.sending.take()
        if self.wake is not None:
            os.write(self.wake[1], b"x")
        for t in threads:
            t.join(timeout=join_timeout)
        for rec in recs:
            rec.token._fail("backend closed")
        if self.listener is not None:
            self.listener.close()
        if self.wake is not None and not any(t.is_alive() for t in threads):
            for fd in self.wake:
                os.close(fd)
            self.wake = None
        return True
