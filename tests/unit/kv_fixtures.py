"""A memoryless KV cache for scheduler tests: the real block allocator (pure Python), 4-token blocks."""

from xpyd.model.kv_blocks import BlockAllocator
from xpyd.worker.kv_cache import KVCache

BLOCK = 4


def kv_cache(num_blocks: int, block_size: int = BLOCK, caching: bool = True) -> KVCache:
    return KVCache(BlockAllocator(num_blocks, caching=caching), block_size, seed=0)


def next_prefill(sched):
    """An unchunked prefill scheduler's next step (one whole prompt): its request, or None."""
    chunks = sched.plan()
    assert len(chunks) <= 1 and all(c.last for c in chunks)
    return chunks[0].seq if chunks else None
