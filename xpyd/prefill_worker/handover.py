"""What a prefill worker tells a decode worker about a prefilled request, and where its KV goes.

``ready_result``: the first token, the prompt's length, the chain hashes of its full blocks and the tokens
after them (decode finds and extends the prefix in its own cache), the tokens prefill reused.
``pull_regions``: a pull names decode's destination blocks for the request's blocks from ``first_block``
on; both sides become byte regions (adjacent blocks coalesced), or the reason the pull is refused.
"""

from __future__ import annotations

from xpyd.model.kv_pool import KVPool, block_ranges
from xpyd.prefill_worker.peers import PeerMap
from xpyd.prefill_worker.scheduler import PrefillSeq
from xpyd.signal import messages as m
from xpyd.transfer.base import Region


def ready_result(seq: PrefillSeq, status: m.LookupStatus, block_size: int) -> m.LookupResult:
    full = len(seq.hashes)
    return m.LookupResult(seq.request_id, status, seq.first_token, seq.prompt_len,
                          block_hashes=m.pack_hashes(seq.hashes),
                          tail=tuple(seq.prompt_ids[full * block_size:]),
                          cached_tokens=seq.kv.cached_tokens if seq.kv is not None else 0)


def pull_regions(pool: KVPool, seq: PrefillSeq, entry: m.LookupEntry,
                 peer: PeerMap) -> tuple[list[Region], list[Region]] | str:
    """(source regions in our pool, destination regions in decode's), or why the pull is refused."""
    blocks = seq.kv.blocks[entry.first_block:]
    if len(entry.dest_blocks) != len(blocks):
        return (f"the pull names {len(entry.dest_blocks)} blocks; the request has {len(blocks)} from block "
                f"{entry.first_block} on")
    try:
        dst = [Region(*r) for r in block_ranges(entry.dest_blocks, peer.block_bytes, peer.num_blocks)]
    except ValueError:
        return "destination outside the decode KV pool"
    return [Region(*r) for r in pool.byte_ranges(blocks)], dst
