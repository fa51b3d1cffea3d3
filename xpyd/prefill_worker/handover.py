"""What a prefill worker tells a decode worker about a prefilled request, and where its KV goes.

``ready_result``: the first token, the prompt's length, the chain hashes of its full blocks and the tokens
after them (decode finds and extends the prefix in its own cache), the tokens prefill reused.
``plan_pull``: a pull names decode's destination blocks for the request's blocks from ``first_block``
on, sent in parts of ``part_blocks`` blocks; each part becomes byte regions on both sides (adjacent blocks
coalesced) and the number of prompt tokens that must be computed before it can go (its last block full,
or the whole prompt for the part holding the prompt's last block), or the reason the pull is refused.
``send_due`` starts every part whose blocks are computed, in order; ``abort_sends`` stops them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from xpyd.model.kv_layout import HostKVPool, block_ranges
from xpyd.prefill_worker.peers import PeerMap
from xpyd.prefill_worker.scheduler import PrefillScheduler, PrefillSeq
from xpyd.signal import messages as m
from xpyd.signal.request_id import part_transfer_ids
from xpyd.transfer.base import BackendDescriptor, Region, TransferBackend


def ready_result(seq: PrefillSeq, status: m.LookupStatus, block_size: int, part_blocks: int = 0) -> m.LookupResult:
    """The prompt's facts (and its first token once it is known: READY/SENDING; PREFILLING: not yet, with
    the blocks one step computes as the suggested part size)."""
    full = len(seq.hashes)
    return m.LookupResult(seq.request_id, status, seq.first_token, seq.prompt_len,
                          block_hashes=m.pack_hashes(seq.hashes),
                          tail=tuple(seq.prompt_ids[full * block_size:]),
                          cached_tokens=seq.kv.cached_tokens if seq.kv is not None else 0,
                          part_blocks=part_blocks)


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


def plan_pull(pool: HostKVPool, seq: PrefillSeq, entry: m.LookupEntry, peer: PeerMap, now: float) -> PullPlan | str:
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


def send_due(transfer: TransferBackend, sched: PrefillScheduler, seq: PrefillSeq, wake: Callable[[], None]) -> int:
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


def abort_sends(transfer: TransferBackend, seq: PrefillSeq) -> None:
    """Abort the sends of ``seq``'s parts that are in flight (their tokens fail; no byte leaves after)."""
    if seq.pull is None:
        return
    for tid, token in zip(seq.pull.plan.transfer_ids(len(seq.pull.tokens)), seq.pull.tokens):
        if not token.finished():
            transfer.abort(tid)
