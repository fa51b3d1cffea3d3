"""The KV connector's sending side: a prefill worker's pulls, from the decode worker's pool map to bytes moved.

A decode worker registers its pool (``accept_peer``: its descriptor must name this worker's backend and fit
its blocks); its pull names destination blocks for the request's blocks from ``first_block`` on, sent in
parts of ``part_blocks`` blocks. ``plan_pull`` (deciding, no bytes) turns each part into byte regions on
both sides (adjacent blocks coalesced: the pools' ``byte_ranges``/``block_ranges``) and the number of prompt
tokens that must be computed before it can go (its last block full, or the whole prompt for the part holding
the prompt's last block), or says why the pull is refused. ``send_due`` starts every part whose blocks are
computed, in order; ``abort_sends`` stops them all. ``KVSender`` is what the prefill engine holds;
``TransferSender`` is it over a ``TransferBackend``.

The request (``seq``) and the scheduler these take are the prefill role's (``PrefillSeq``, ``PrefillScheduler``:
``seq.kv.blocks``, ``seq.computed``, ``seq.pull``, ``sched.part_sent``), read by name: this layer does not
import a role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from xpyd.model.kv_layout import block_ranges
from xpyd.signal import messages as m
from xpyd.signal.request_id import part_transfer_ids
from xpyd.transfer.base import BackendDescriptor, Region, TransferBackend
from xpyd.worker.kv_staging import pool_memory


@dataclass(frozen=True, slots=True)
class PeerMap:
    """A decode worker's registered KV pool, from its kv_map_init."""

    transfer: BackendDescriptor
    block_bytes: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class Part:
    transfer_id: str
    src: tuple[Region, ...]  # in our pool
    dst: tuple[Region, ...]  # in the decode worker's
    ready_at: int  # prompt tokens computed before it can be sent


@dataclass(frozen=True, slots=True)
class PullPlan:
    parts: tuple[Part, ...]
    peer: BackendDescriptor
    secret: bytes
    nbytes: int
    started: float  # monotonic time of the pull

    def transfer_ids(self, sent: int) -> list[str]:
        return [p.transfer_id for p in self.parts[:sent]]


def plan_pull(pool, seq: Any, entry: m.LookupEntry, peer: PeerMap, now: float) -> PullPlan | str:
    """Where each part of a pull goes and when it can, or why the pull is refused."""
    blocks = seq.kv.blocks[entry.first_block:]
    if len(entry.dest_blocks) != len(blocks):
        return (f"the pull names {len(entry.dest_blocks)} blocks; the request has {len(blocks)} from block "
                f"{entry.first_block} on")
    size = entry.part_blocks or len(blocks)
    count = -(-len(blocks) // size)
    block_size = pool.layout.block_size
    parts = []
    for i, tid in enumerate(part_transfer_ids(seq.request_id, count)):
        ours, theirs = blocks[i * size : (i + 1) * size], entry.dest_blocks[i * size : (i + 1) * size]
        try:
            dst = tuple(Region(*r) for r in block_ranges(theirs, peer.block_bytes, peer.num_blocks))
        except ValueError:
            return "destination outside the decode KV pool"
        end_block = entry.first_block + i * size + len(ours)
        parts.append(Part(tid, tuple(Region(*r) for r in pool.byte_ranges(ours)), dst,
                          min(end_block * block_size, seq.prompt_len)))
    nbytes = sum(r.length for p in parts for r in p.src)
    return PullPlan(tuple(parts), peer.transfer, entry.secret, nbytes, now)


def send_due(transfer: TransferBackend, sched: Any, seq: Any, wake: Callable[[], None]) -> int:
    """Start the sends of ``seq``'s parts whose blocks are computed (in order); how many started."""
    pull = seq.pull
    plan: PullPlan = pull.plan
    started = 0
    while not pull.all_sent and not seq.cancel_requested:
        part = plan.parts[len(pull.tokens)]
        if part.ready_at > seq.computed:
            break
        token = transfer.send(part.transfer_id, part.src, plan.peer, part.dst, secret=plan.secret)
        sched.part_sent(seq, token)
        token.on_finish(wake)
        started += 1
    return started


def abort_sends(transfer: TransferBackend, seq: Any) -> None:
    """Abort the sends of ``seq``'s parts that are in flight (their tokens fail; no byte leaves after)."""
    if seq.pull is None:
        return
    for tid, token in zip(seq.pull.plan.transfer_ids(len(seq.pull.tokens)), seq.pull.tokens):
        if not token.finished():
            transfer.abort(tid)


@runtime_checkable
class KVSender(Protocol):
    """Prefill's connector: its pool registered, decode workers' pools accepted, pulls planned and their
    parts sent as their blocks are computed (each send's handle kept in the request's pull: the scheduler
    reads them), aborted; ``progress`` as ``KVReceiver``'s."""

    name: str

    def bind(self, pool, wake: Callable[[], None]) -> None: ...

    def register(self) -> None: ...

    def accept_peer(self, descriptor: dict, block_bytes: int, num_blocks: int) -> PeerMap | str: ...

    def plan(self, seq: Any, entry: m.LookupEntry, peer: PeerMap, now: float) -> PullPlan | str: ...

    def send_due(self, sched: Any, seq: Any) -> int: ...

    def split_last_part(self, peer: PeerMap) -> bool:
        """Should a streamed prompt's last KV part be computed in a step of its own (so that only it is left to
        move once the prompt is computed)? Worth an extra step's fixed cost only where a part crosses a network;
        on the same host it moves in about a millisecond."""
        ...

    def abort(self, seq: Any) -> None: ...

    def forget_peer(self, peer: PeerMap) -> None: ...

    def in_flight(self) -> int: ...

    def progress(self) -> None: ...

    @property
    def progress_tick(self) -> float | None: ...

    def close(self) -> None: ...


def sender_for(kv: "KVSender | TransferBackend") -> KVSender:
    """The connector a prefill engine is given, or the one over the transfer backend it is given."""
    return kv if isinstance(kv, KVSender) else TransferSender(kv)


class TransferSender:
    """``KVSender`` over a ``TransferBackend``."""

    def __init__(self, backend: TransferBackend) -> None:
        self.backend = backend
        self.name = backend.name
        self.pool = None
        self._wake: Callable[[], None] = lambda: None

    def bind(self, pool, wake: Callable[[], None]) -> None:
        self.pool, self._wake = pool, wake

    def register(self) -> None:
        self.backend.register(pool_memory(self.pool, self.backend))

    def accept_peer(self, descriptor: dict, block_bytes: int, num_blocks: int) -> PeerMap | str:
        """A decode worker's pool (its kv_map_init), or why it is refused."""
        try:
            desc = BackendDescriptor.from_dict(descriptor)
        except (ValueError, TypeError, KeyError) as e:
            return f"bad transfer descriptor: {e}"
        if desc.backend != self.backend.name:
            return f"transfer backend mismatch: prefill uses {self.backend.name}, decode uses {desc.backend}"
        if block_bytes != self.pool.layout.block_bytes:
            return (f"KV block size mismatch: prefill blocks hold {self.pool.layout.block_bytes} bytes, decode "
                    f"blocks {block_bytes}")
        if block_bytes * num_blocks > desc.buffer_size:
            return "KV map does not fit the registered buffer"
        return PeerMap(desc, block_bytes, num_blocks)

    def plan(self, seq: Any, entry: m.LookupEntry, peer: PeerMap, now: float) -> PullPlan | str:
        return plan_pull(self.pool, seq, entry, peer, now)

    def send_due(self, sched: Any, seq: Any) -> int:
        return send_due(self.backend, sched, seq, self._wake)

    def split_last_part(self, peer: PeerMap) -> bool:
        return not self.backend.same_host(peer.transfer)

    def abort(self, seq: Any) -> None:
        abort_sends(self.backend, seq)

    def forget_peer(self, peer: PeerMap) -> None:
        self.backend.forget_peer(peer.transfer.address)

    def in_flight(self) -> int:
        return len(self.backend.outstanding())

    def progress(self) -> None:
        self.backend.progress()

    @property
    def progress_tick(self) -> float | None:
        return self.backend.progress_tick

    def close(self) -> None:
        self.backend.close()
