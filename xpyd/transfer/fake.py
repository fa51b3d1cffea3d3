"""In-process fake transfer backend for scheduler unit tests: no sockets, no threads.

Manual mode (default): tokens stay PENDING until the test calls ``complete(id)`` or
``fail(id, msg)``; no bytes move. With ``auto_complete=True``, fakes that share a
``FakeNetwork`` copy the bytes and finish both tokens inside ``send`` — with the tcp
backend's rules: the receiver must have ``expect``-ed the id with the same secret (else the
sender's token FAILs and the receiver's stays PENDING, for its real sender) and the same
regions (else both FAIL), otherwise nothing is written.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from xpyd.transfer.auth import check_secret
from xpyd.transfer.base import (
    BackendDescriptor,
    CompletionToken,
    Region,
    TransferError,
    TransferState,
    check_buffer,
    check_regions,
    check_send_regions,
    check_transfer_id,
)


class FakeNetwork:
    """Address book for fakes, so an auto-completing sender can find its receiver."""

    def __init__(self) -> None:
        self._backends: dict[str, FakeTransferBackend] = {}
        self._ids = itertools.count()

    def attach(self, backend: "FakeTransferBackend") -> str:
        address = f"fake-{next(self._ids)}"
        self._backends[address] = backend
        return address

    def detach(self, address: str) -> None:
        self._backends.pop(address, None)

    def lookup(self, address: str) -> "FakeTransferBackend | None":
        return self._backends.get(address)


class FakeTransferBackend:
    name = "fake"

    def same_host(self, peer: BackendDescriptor) -> bool:
        return False

    def __init__(self, network: FakeNetwork | None = None, auto_complete: bool = False) -> None:
        if auto_complete and network is None:
            raise ValueError("auto_complete needs a FakeNetwork shared with the peer")
        self.network = network or FakeNetwork()
        self.auto_complete = auto_complete
        self.buffer: memoryview | None = None
        self.descriptor: BackendDescriptor | None = None
        self.closed = False
        # What happened, in order, for tests to assert on.
        self.sent: list[str] = []
        self.expected: list[str] = []
        self.aborted: list[str] = []
        self.forgotten: list[str] = []
        self.progress_calls = 0
        self.secrets: dict[str, bytes] = {}  # id -> the secret of its last send or expect
        # id -> (token, src, peer, dst) / (token, dst)
        self._sending: dict[str, tuple[CompletionToken, tuple[Region, ...], BackendDescriptor, tuple]] = {}
        self._expecting: dict[str, tuple[CompletionToken, tuple[Region, ...]]] = {}

    # -- TransferBackend ---------------------------------------------------
    def register(self, buffer: memoryview) -> BackendDescriptor:
        buffer = check_buffer(buffer)
        self._check_open()
        if self.buffer is not None:
            raise TransferError("a buffer is already registered with this backend")
        self.buffer = buffer
        self.descriptor = BackendDescriptor(self.name, self.network.attach(self), buffer.nbytes)
        return self.descriptor

    def send(
        self, transfer_id: str, src: Sequence[Region], peer: BackendDescriptor, dst: Sequence[Region], *,
        secret: bytes,
    ) -> CompletionToken:
        check_transfer_id(transfer_id)
        check_secret(secret)
        if not isinstance(peer, BackendDescriptor) or peer.backend != self.name:
            raise ValueError(f"peer must be a fake BackendDescriptor, got {peer!r}")
        src, dst, _ = check_send_regions(src, self._require_buffer().nbytes, dst, peer.buffer_size)
        self._check_open()
        if transfer_id in self._sending:
            raise TransferError(f"transfer {transfer_id!r} is already being sent")
        token = CompletionToken(transfer_id)
        self._sending[transfer_id] = (token, src, peer, dst)
        self.secrets[transfer_id] = secret
        self.sent.append(transfer_id)
        if self.auto_complete:
            self._deliver(transfer_id)
        return token

    def expect(self, transfer_id: str, dst: Sequence[Region], *, secret: bytes) -> CompletionToken:
        check_transfer_id(transfer_id)
        check_secret(secret)
        dst, _ = check_regions(dst, self._require_buffer().nbytes, "dst")
        self._check_open()
        if transfer_id in self._expecting:
            raise TransferError(f"transfer {transfer_id!r} is already expected")
        token = CompletionToken(transfer_id)
        self._expecting[transfer_id] = (token, dst)
        self.secrets[transfer_id] = secret
        self.expected.append(transfer_id)
        return token

    def abort(self, transfer_id: str) -> None:
        entries = [self._sending.pop(transfer_id, None), self._expecting.pop(transfer_id, None)]
        if any(entries):
            self.aborted.append(transfer_id)
        for entry in entries:
            if entry is not None:
                entry[0]._fail("aborted")

    def forget_peer(self, address: str) -> None:
        self.forgotten.append(address)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for token, *_ in [*self._sending.values(), *self._expecting.values()]:
            token._fail("backend closed")
        self._sending.clear()
        self._expecting.clear()
        if self.descriptor is not None:
            self.network.detach(self.descriptor.address)

    # -- test controls -----------------------------------------------------
    def complete(self, transfer_id: str) -> None:
        """Finish every outstanding token of this id on this backend as DONE (no bytes move)."""
        for token in self._pop(transfer_id):
            token._advance(TransferState.DONE)

    def fail(self, transfer_id: str, msg: str = "failed by test") -> None:
        for token in self._pop(transfer_id):
            token._fail(msg)

    def start(self, transfer_id: str) -> None:
        """Move this id's outstanding tokens to TRANSFERRING."""
        tokens = [e[0] for e in (self._sending.get(transfer_id), self._expecting.get(transfer_id)) if e]
        if not tokens:
            raise KeyError(f"no outstanding transfer {transfer_id!r}")
        for token in tokens:
            token._advance(TransferState.TRANSFERRING)

    def outstanding(self) -> set[str]:
        """Ids whose tokens are not finished yet (for leak checks)."""
        return set(self._sending) | set(self._expecting)

    progress_tick = None  # tokens finish when a test completes or fails them

    def progress(self) -> None:
        """Nothing moves by itself here (tests call ``complete``/``fail``); counted for engine tests."""
        self.progress_calls += 1

    # -- internals ---------------------------------------------------------
    def _pop(self, transfer_id: str) -> list[CompletionToken]:
        entries = [self._sending.pop(transfer_id, None), self._expecting.pop(transfer_id, None)]
        tokens = [e[0] for e in entries if e is not None]
        if not tokens:
            raise KeyError(f"no outstanding transfer {transfer_id!r}")
        return tokens

    def _deliver(self, transfer_id: str) -> None:
        token, src, peer, dst = self._sending.pop(transfer_id)
        receiver = self.network.lookup(peer.address)
        if receiver is None or receiver.closed:
            token._fail(f"cannot reach {peer.address}")
            return
        expected = receiver._expecting.get(transfer_id)
        if expected is None:
            token._fail(f"refused by {peer.address}: unexpected transfer id {transfer_id!r}")
            return
        rtoken, rdst = expected
        if receiver.secrets.get(transfer_id) != self.secrets.get(transfer_id):
            token._fail(f"refused by {peer.address}: the MAC does not match")
            return
        del receiver._expecting[transfer_id]
        if rdst != dst:
            error = f"dst regions differ from the ones expected for {transfer_id!r}"
            rtoken._fail(error)
            token._fail(f"refused by {peer.address}: {error}")
            return
        data = b"".join(self.buffer[r.offset : r.end] for r in src)
        pos = 0
        for r in dst:
            receiver.buffer[r.offset : r.end] = data[pos : pos + r.length]
            pos += r.length
        rtoken._advance(TransferState.DONE)
        token._advance(TransferState.DONE)

    def _require_buffer(self) -> memoryview:
        if self.buffer is None:
            raise TransferError("register() a buffer first")
        return self.buffer

    def _check_open(self) -> None:
        if self.closed:
            raise TransferError("backend is closed")
