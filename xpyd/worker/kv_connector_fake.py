"""An in-process KV connector for unit tests: decode's side of it (a ``KVReceiver``), and the test, playing
prefill, sends into it by copying blocks from another pool (``send``): no sockets, no backend threads.

A receive is announced by ``receive`` (its transfer ids, a fresh secret, its parts, as the real connector
does); ``send`` copies a whole request's blocks (all its parts) from the source pool into the blocks it was
announced for, checking the secret; ``fail`` ends one as a broken transfer would. ``finished()`` reports
those that ended since the last call; an aborted receive takes no bytes (``send`` says False).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

from xpyd.signal.request_id import part_transfer_ids
from xpyd.worker.kv_connector import Finished, KVEndpoint, PullOrder

FAKE_ADDRESS = "127.0.0.1:1"


class FakeHandle:
    """A receive's state: pending, then done or failed (with why); only forward."""

    def __init__(self) -> None:
        self._state = "pending"
        self._error: str | None = None

    def done(self) -> bool:
        return self._state == "done"

    def failed(self) -> bool:
        return self._state == "failed"

    def finished(self) -> bool:
        return self._state != "pending"

    @property
    def error(self) -> str | None:
        return self._error

    def end(self, error: str | None = None) -> None:
        if self._state == "pending":
            self._state, self._error = ("failed", error) if error else ("done", None)


@dataclass(slots=True)
class _Receive:
    blocks: tuple[int, ...]
    secret: bytes
    handle: FakeHandle


class FakeReceiver:
    def __init__(self, address: str = FAKE_ADDRESS) -> None:
        self.address = address
        self.pool = None
        self._wake: Callable[[], None] = lambda: None
        self._receives: dict[str, _Receive] = {}  # announced, not reported ended
        self._ended: list[str] = []
        self.received: list[str] = []  # request ids whose bytes were copied in, in order

    def bind(self, pool, wake: Callable[[], None]) -> None:
        self.pool, self._wake = pool, wake

    def register(self) -> KVEndpoint:
        return KVEndpoint(self.address, {"backend": "fake", "address": self.address,
                                         "buffer_size": self.pool.layout.total_bytes})

    def receive(self, request_id: str, blocks: Sequence[int], part_blocks: int) -> PullOrder:
        if not blocks or request_id in self._receives:
            raise ValueError(f"request {request_id}: nothing to receive, or already receiving")
        size = part_blocks if 0 < part_blocks < len(blocks) else len(blocks)
        ids = part_transfer_ids(request_id, -(-len(blocks) // size))
        recv = _Receive(tuple(blocks), os.urandom(32), FakeHandle())
        self._receives[request_id] = recv
        return PullOrder(tuple(ids), recv.secret, size if len(ids) > 1 else 0,
                         len(blocks) * self.pool.layout.block_bytes, recv.handle)

    def send(self, request_id: str, src_pool, src_blocks: Sequence[int], secret: bytes) -> bool:
        """Prefill sends ``src_blocks`` of ``src_pool`` for ``request_id``: copied into the blocks announced
        for it, if it is still expected and ``secret`` is its own (else nothing is copied: False)."""
        recv = self._receives.get(request_id)
        if recv is None or recv.handle.finished() or secret != recv.secret or len(src_blocks) != len(recv.blocks):
            return False
        src, dst, size = src_pool.buffer(), self.pool.buffer(), self.pool.layout.block_bytes
        for s, d in zip(src_blocks, recv.blocks):
            dst[d * size : (d + 1) * size] = src[s * size : (s + 1) * size]
        self.received.append(request_id)
        self._end(request_id, None)
        return True

    def fail(self, request_id: str, why: str) -> None:
        self._end(request_id, why)

    def finished(self) -> Finished:
        ended, self._ended = self._ended, []
        done, failed = [], []
        for rid in ended:
            recv = self._receives.pop(rid, None)
            if recv is None:
                continue
            if recv.handle.done():
                done.append(rid)
            else:
                failed.append((rid, recv.handle.error or "failed"))
        return Finished(tuple(done), tuple(failed))

    def abort(self, request_id: str) -> None:
        recv = self._receives.pop(request_id, None)
        if recv is not None:
            recv.handle.end("aborted")

    def in_flight(self) -> int:
        return sum(not r.handle.finished() for r in self._receives.values())

    def progress(self) -> None:
        pass

    @property
    def progress_tick(self) -> float | None:
        return None

    def close(self) -> None:
        for rid in list(self._receives):
            self.abort(rid)

    def _end(self, request_id: str, error: str | None) -> None:
        recv = self._receives.get(request_id)
        if recv is not None and not recv.handle.finished():
            recv.handle.end(error)
            self._ended.append(request_id)
            self._wake()
