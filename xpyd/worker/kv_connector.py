"""The KV connector: the seam between the role engines and the bytes of the KV they hand over.

As in vLLM v1's KV connectors, one side *decides* and the other *moves bytes*. The engines decide which
request's blocks move where (the schedulers give blocks, the signal plane carries the pulls) and call a
connector; the connector turns blocks into byte regions of the pool (``KVPool.byte_ranges``: that mapping
lives here, not in the engines), drives the transfer backend, and reports which requests' transfers
ended. The engines import no ``xpyd.transfer`` module (an import contract says so), so another way of
moving KV (a device backend, the simulated engine's) plugs in as a connector without touching them.

Decode, the receiving side (``KVReceiver``):

- ``register()`` once at start: the pool registered, what names it to prefill workers (``KVEndpoint``);
- ``receive(R, blocks, part_blocks)``: request R's KV lands in ``blocks`` (in parts of ``part_blocks``
  blocks, each sent as soon as prefill computed it; 0: one part); returns what the pull tells prefill
  (``PullOrder``: the transfer ids, the fresh secret that alone may write them, the part size) and a
  handle whose ``done()`` says the bytes are all here;
- ``finished()`` each step: the requests whose receive ended since the last call (``Finished``: the
  ids that landed, the ids that failed and why); a failed one's parts are withdrawn before it is
  reported, so its blocks may go to another request at once;
- ``abort(R)``: once it returns, no byte of R lands.

Prefill, the sending side, is ``KVSender`` (``kv_connector_send``). The real connectors drive a
``TransferBackend``; ``kv_connector_fake`` copies between two pools in process, for unit tests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Callable, Protocol, Sequence, runtime_checkable

from xpyd.signal.request_id import part_transfer_ids, transfer_id_of
from xpyd.transfer.auth import new_secret
from xpyd.transfer.base import CompletionToken, Region, TransferBackend, expect_parts
from xpyd.worker.kv_staging import pool_memory

MAX_FAILURE_LEN = 512  # characters of a failure's reason that are reported


class TransferHandle(Protocol):
    """How one request's transfer stands (what the schedulers keep; a ``CompletionToken`` in the real
    connectors)."""

    def done(self) -> bool: ...

    def failed(self) -> bool: ...

    def finished(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class KVEndpoint:
    """How prefill workers reach this worker's pool: ``address`` (also the worker's name in request ids)
    and the descriptor that goes in its ``KVMapInit``."""

    address: str
    descriptor: dict


@dataclass(frozen=True, slots=True)
class PullOrder:
    """What a pull tells prefill (the parts' transfer ids, their secret, the blocks in a part, 0 for one
    part), the bytes it moves, and the receive's handle."""

    transfer_ids: tuple[str, ...]
    secret: bytes
    part_blocks: int
    nbytes: int
    handle: TransferHandle

    def __post_init__(self) -> None:
        if not self.transfer_ids or self.part_blocks < 0 or self.nbytes <= 0:
            raise ValueError(f"a pull moves at least one part of bytes, got {len(self.transfer_ids)} parts, "
                             f"part_blocks={self.part_blocks}, nbytes={self.nbytes}")


@dataclass(frozen=True, slots=True)
class Finished:
    """Requests whose transfers ended since the last ``finished()``: ``done`` moved every byte, ``failed``
    (request id, why) did not (and none of their bytes moves any more)."""

    done: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.done or self.failed)


@runtime_checkable
class KVReceiver(Protocol):
    """Decode's connector (see the module docstring)."""

    def bind(self, pool, wake: Callable[[], None]) -> None:
        """The engine's KV pool, and how to wake its loop when a receive ends (once, before anything else)."""
        ...

    def register(self) -> KVEndpoint: ...

    def receive(self, request_id: str, blocks: Sequence[int], part_blocks: int) -> PullOrder: ...

    def finished(self) -> Finished: ...

    def abort(self, request_id: str) -> None: ...

    def in_flight(self) -> int:
        """Transfers announced and not ended (for stats)."""
        ...

    def progress(self) -> None:
        """Called every loop iteration while a receive is in flight (a backend that needs the caller's
        thread to move bytes moves them here); cheap, never blocks."""
        ...

    @property
    def progress_tick(self) -> float | None:
        """How often ``progress()`` must be called while a receive is in flight, or None (a receive that
        ends wakes the engine)."""
        ...

    def close(self) -> None: ...


def receiver_for(kv: "KVReceiver | TransferBackend") -> KVReceiver:
    """The connector a decode engine is given, or the one over the transfer backend it is given."""
    return kv if isinstance(kv, KVReceiver) else TransferReceiver(kv)


class Ended:
    """Requests whose handle may have ended, as the backends' threads say so (``on_finish``); read by the
    engine thread alone, which reports those whose handle has really finished (``take``)."""

    def __init__(self) -> None:
        self._handles: dict[str, CompletionToken] = {}  # request id -> its live handle
        self._news: deque[tuple[str, CompletionToken]] = deque()  # (appended by any thread)
        self.wake: Callable[[], None] = lambda: None

    def __len__(self) -> int:
        return len(self._handles)

    def watch(self, request_id: str, handle: CompletionToken) -> None:
        if request_id in self._handles:
            raise ValueError(f"request {request_id} already has a transfer in flight")
        self._handles[request_id] = handle
        handle.on_finish(partial(self._heard, request_id, handle))

    def forget(self, request_id: str) -> CompletionToken | None:
        """Stop watching (aborted): it is not reported."""
        return self._handles.pop(request_id, None)

    def take(self) -> Finished:
        done, failed = [], []
        for _ in range(len(self._news)):
            rid, handle = self._news.popleft()
            if self._handles.get(rid) is not handle or not handle.finished():  # (a part ended: not yet all)
                continue
            del self._handles[rid]
            if handle.done():
                done.append(rid)
            else:
                failed.append((rid, (handle.error or "KV transfer failed")[:MAX_FAILURE_LEN]))
        return Finished(tuple(done), tuple(failed))

    def _heard(self, request_id: str, handle: CompletionToken) -> None:
        self._news.append((request_id, handle))
        self.wake()


class TransferReceiver:
    """``KVReceiver`` over a ``TransferBackend`` (tcp, shm, nixl, ... and the fake backend of tests)."""

    def __init__(self, backend: TransferBackend) -> None:
        self.backend = backend
        self.pool = None
        self._ended = Ended()
        self._parts: dict[str, list[str]] = {}  # request id -> its parts' transfer ids

    def bind(self, pool, wake: Callable[[], None]) -> None:
        self.pool = pool
        self._ended.wake = wake

    def register(self) -> KVEndpoint:
        desc = self.backend.register(pool_memory(self.pool, self.backend))
        return KVEndpoint(desc.address, desc.to_dict())

    def receive(self, request_id: str, blocks: Sequence[int], part_blocks: int) -> PullOrder:
        if not blocks:
            raise ValueError(f"request {request_id}: nothing to receive")
        size = part_blocks if 0 < part_blocks < len(blocks) else len(blocks)
        ids = part_transfer_ids(request_id, -(-len(blocks) // size))
        secret = new_secret()  # only the prefill worker the pull goes to may write these blocks
        parts = [(tid, [Region(*r) for r in self.pool.byte_ranges(blocks[i * size : (i + 1) * size])])
                 for i, tid in enumerate(ids)]
        # One handle owns the parts: when one fails, the others are aborted before it reads FAILED (a later
        # part, sent on by a sender that reconnected, must not land in blocks another request holds by then).
        handle = expect_parts(self.backend, transfer_id_of(request_id), parts, secret=secret)
        self._parts[request_id] = ids
        self._ended.watch(request_id, handle)
        nbytes = sum(r.length for _, regions in parts for r in regions)
        return PullOrder(tuple(ids), secret, size if len(ids) > 1 else 0, nbytes, handle)

    def finished(self) -> Finished:
        out = self._ended.take()
        for rid in (*out.done, *(rid for rid, _ in out.failed)):
            self._parts.pop(rid, None)
        return out

    def abort(self, request_id: str) -> None:
        self._ended.forget(request_id)
        for tid in self._parts.pop(request_id, ()):
            self.backend.abort(tid)

    def in_flight(self) -> int:
        return len(self.backend.outstanding())

    def progress(self) -> None:
        self.backend.progress()

    @property
    def progress_tick(self) -> float | None:
        return self.backend.progress_tick

    def close(self) -> None:
        self.backend.close()
