"""The ``auto`` transfer backend: tcp for every peer, shm for peers on the same host.

It wraps a primary backend (tcp) and extras (shm) registered on the same buffer. Its descriptor is the
primary's, plus ``offers`` naming the extras' addresses, so an old or tcp-only peer simply uses tcp.

- ``send``: the first extra that ``reaches(peer)`` (shm: the peer offers shm and shares our host key),
  else the primary. The sending side therefore picks per peer, from the receiver's descriptor.
- ``expect``: announced to every child (the receiver does not know which one the sender will pick);
  the returned token follows whichever child the bytes arrive on, and the others' announcements
  are withdrawn as soon as it finishes (on the next poll of the token or of ``outstanding()``).
- ``used()``: how many transfers each child sent and received so far (which one ``auto`` chose).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Sequence

from xpyd.transfer.base import BackendDescriptor, CompletionToken, DerivedToken, Region, TransferError, TransferState


class _EitherToken(DerivedToken):
    """A receive token that follows the child token the transfer actually arrives on."""

    __slots__ = ("_children", "_owner")

    def __init__(self, transfer_id: str, children: list[tuple[object, CompletionToken]], owner) -> None:
        super().__init__(transfer_id)
        self._children = children
        self._owner = owner

    def _followed(self) -> list[CompletionToken]:
        return [tok for _, tok in self._children]

    def _sync(self) -> None:
        if CompletionToken.finished(self):
            return
        winner = None
        for backend, tok in self._children:
            state = tok.state()
            if state is TransferState.DONE:
                if self._set(TransferState.DONE, None):
                    self._owner._count("received", backend)
                winner = backend
                break
            if state is TransferState.FAILED:
                self._set(TransferState.FAILED, tok.error or "failed")
                winner = backend
                break
            if state is TransferState.TRANSFERRING and CompletionToken.state(self) is TransferState.PENDING:
                self._set(TransferState.TRANSFERRING, None)
        if winner is not None:
            self._owner._settle(self.transfer_id, winner)

    def wait(self, timeout: float) -> bool:
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        deadline = time.monotonic() + timeout
        while not self.finished():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for _, tok in self._children:
                if tok.wait(min(left, 0.002)):
                    break
        return True


class AutoTransferBackend:
    def __init__(self, primary, extras: Sequence[object]) -> None:
        self.primary = primary
        self.extras = list(extras)
        self.name = primary.name  # peers compare descriptor backend names with this
        self._lock = threading.Lock()
        self._expected: dict[str, _EitherToken] = {}
        self._peer_extra: dict[str, list[tuple[object, str]]] = {}  # primary address -> (extra, its address)
        self._used: dict[str, Counter[str]] = {"sent": Counter(), "received": Counter()}  # by child name

    @property
    def children(self) -> list:
        return [self.primary, *self.extras]

    @property
    def copy_threads(self) -> int | None:
        """The shm part's copy threads (None when running tcp only)."""
        return next((e.copy_threads for e in self.extras if hasattr(e, "copy_threads")), None)

    def allocate(self, size: int) -> memoryview | None:
        """The buffer from the first extra that needs its own memory (shm), if any."""
        for extra in self.extras:
            if hasattr(extra, "allocate"):
                return extra.allocate(size)
        return None

    def register(self, buffer: memoryview) -> BackendDescriptor:
        desc = self.primary.register(buffer)
        offers = list(desc.offers)
        for extra in self.extras:
            d = extra.register(buffer)
            offers += [(extra.name, d.address), *d.offers]
        return BackendDescriptor(desc.backend, desc.address, desc.buffer_size, offers=tuple(offers))

    def pick(self, peer: BackendDescriptor):
        """The child that sends to ``peer``, and the descriptor to hand it."""
        for extra in self.extras:
            if extra.reaches(peer):
                return extra, peer
        address = peer.offer(self.primary.name)
        if address is None:
            raise ValueError(f"peer offers neither {self.primary.name} nor a reachable "
                             f"{'/'.join(e.name for e in self.extras) or 'extra'} backend: {peer!r:.200}")
        return self.primary, BackendDescriptor(self.primary.name, address, peer.buffer_size)

    def same_host(self, peer: BackendDescriptor) -> bool:
        child, desc = self.pick(peer)  # (the child it sends to that peer with)
        return child.same_host(desc)

    def send(self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor,
             dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        if not isinstance(peer, BackendDescriptor):
            raise ValueError(f"peer must be a BackendDescriptor, got {peer!r:.80}")
        child, desc = self.pick(peer)
        self._count("sent", child)
        if child is not self.primary:
            with self._lock:
                self._peer_extra.setdefault(peer.address, [])
                if (child, child_addr := peer.offer(child.name)) not in self._peer_extra[peer.address]:
                    self._peer_extra[peer.address].append((child, child_addr))
        return child.send(transfer_id, src, desc, dst, secret=secret)

    def expect(self, transfer_id: str, dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        with self._lock:
            if transfer_id in self._expected:
                raise TransferError(f"transfer {transfer_id!r} is already expected")
        children = []  # (one secret for all: each child's MACs name its backend, so a tcp header is no shm offer)
        try:
            for child in self.children:
                children.append((child, child.expect(transfer_id, dst, secret=secret)))
        except BaseException:
            for child, _ in children:
                child.abort(transfer_id)
            raise
        token = _EitherToken(transfer_id, children, self)
        with self._lock:
            self._expected[transfer_id] = token
        return token

    def _count(self, what: str, child) -> None:
        with self._lock:
            self._used[what][child.name] += 1

    def used(self) -> dict[str, dict[str, int]]:
        """Transfers started by ``send`` ("sent") and landed ("received") so far, by the child that
        carried them, e.g. ``{"sent": {"tcp": 3}, "received": {}}``."""
        with self._lock:
            return {what: dict(counts) for what, counts in self._used.items()}

    def _settle(self, transfer_id: str, winner) -> None:
        with self._lock:
            token = self._expected.pop(transfer_id, None)
        if token is not None:
            for child, _ in token._children:
                if child is not winner:
                    child.abort(transfer_id)

    def abort(self, transfer_id: str) -> None:
        with self._lock:
            token = self._expected.pop(transfer_id, None)
        for child in self.children:
            child.abort(transfer_id)
        if token is not None:
            token._fail("aborted")

    def outstanding(self) -> set[str]:
        with self._lock:
            tokens = list(self._expected.values())
        for token in tokens:
            token._sync()
        out: set[str] = set()
        for child in self.children:
            out |= child.outstanding()
        return out

    @property
    def refused(self) -> int:
        """Transfers the children refused to open so far (no or a wrong MAC, an id not expected, ...)."""
        return sum(child.refused for child in self.children)

    @property
    def unproven(self) -> int:
        """Inbound connections the children closed before they opened a transfer (``listener.Door``)."""
        return sum(child.unproven for child in self.children)

    def progress(self) -> None:
        for child in self.children:
            child.progress()

    @property
    def progress_tick(self) -> float | None:
        ticks = [c.progress_tick for c in self.children if c.progress_tick is not None]
        return min(ticks) if ticks else None

    def forget_peer(self, address: str) -> None:
        self.primary.forget_peer(address)
        with self._lock:
            extras = self._peer_extra.pop(address, [])
        for child, child_addr in extras:
            child.forget_peer(child_addr)

    def close(self) -> None:
        for child in self.children:
            child.close()
        with self._lock:
            tokens, self._expected = list(self._expected.values()), {}
        for token in tokens:
            token._sync()
            token._fail("backend closed")


def make_auto_backend(host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                      tag: str | None = None, copy_threads: int | None = None, stall_timeout: float | None = None,
                      **kw) -> AutoTransferBackend:
    """tcp on ``port`` (what request ids and tcp-only peers use) plus shm for peers on this host
    (``tag`` names its segment, default: the port when set; ``copy_threads``: shm's, see ``ShmTransferBackend``;
    ``stall_timeout``: tcp's, see ``TcpTransferBackend``; ``kw``, e.g. ``cluster_token``, go to both)."""
    from xpyd.transfer.shm import ShmTransferBackend
    from xpyd.transfer.tcp import TcpTransferBackend

    tcp_kw = {} if stall_timeout is None else {"stall_timeout": stall_timeout}
    return AutoTransferBackend(TcpTransferBackend(host=host, port=port, advertise_host=advertise_host, **kw, **tcp_kw),
                               [ShmTransferBackend(host=host, port=0, advertise_host=advertise_host,
                                                   tag=tag or (str(port) if port else None),
                                                   copy_threads=copy_threads, **kw)])
