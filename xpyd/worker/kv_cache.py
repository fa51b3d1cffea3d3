"""The worker's paged KV cache as the schedulers see it: the blocks each request holds and prefix reuse.

A request is admitted with the blocks it needs now (cached prefix blocks reused, the rest allocated) and
takes more as it grows (``grow``), one block at a time: nothing is reserved for the output it may still
generate, so the pool runs as many requests as their tokens so far fit in. When a running request needs a
block and none is free, its scheduler preempts a request (``xpyd.worker.preemption``); ``can_grow`` says
whether it must, ``fits`` whether a request could ever run here at all.

Prefix reuse: a full block is named by a hash chained over the tokens so far (`prefix_hash`); a
request's leading full blocks that the cache holds are shared (reference-counted), not computed or
moved again. Once a block's KV is complete its hash is recorded (`cache_blocks`, `append_tokens`),
so the next request with that prefix finds it; blocks of ended requests stay cached until the pool
needs the memory (least recently used first). The hashes are keyed with the deployment's secret, and a
request's ``cache_salt`` moves the start of its chain (``BlockChain.root``), prompt and generated blocks
alike: requests with different salts never share a block.

Block tables: a request that decodes holds a row of ``tables`` (`block_tables.BlockTables`, opened by
``table_row`` at its first step), which takes each block ``grow`` allocates and is handed back by ``free``; a
decode step passes the rows (`stepping.decode_and_sample`) instead of rebuilding lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from xpyd.model.block_tables import BlockTables
from xpyd.model.kv_blocks import BlockAllocator, PoolFull
from xpyd.prefix_hash import block_hashes, salted_seed


class BlockChain(list):
    """A request's chain hashes (a list of ints) and ``root``, the h_-1 they chain from: the cache's seed,
    salted with the request's ``cache_salt`` if it has one. ``KVCache.admit`` hands the root to the request's
    KV, whose generated blocks continue the same chain."""

    __slots__ = ("root",)

    def __init__(self, hashes: Sequence[int], root: int) -> None:
        super().__init__(hashes)
        self.root = root


@dataclass(eq=False, slots=True)
class RequestKV:
    """The KV blocks one request holds, in token order."""

    blocks: list[int]
    hashes: list[int]  # chain hashes of the request's full blocks known so far (prompt, then generated)
    cached_tokens: int  # leading tokens found in the cache (not computed / not moved)
    committed: int = 0  # leading blocks whose hashes are recorded in the cache (or skipped as duplicates)
    tail: list[int] = field(default_factory=list)  # tokens after the last hashed block (decode's chain)
    root: int | None = None  # h_-1 of its chain (the seed salted with its cache_salt); None: the cache's seed
    row: int | None = None  # its row of the cache's block tables, from its first decode step on


class KVCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, seed: int, key: bytes = b"") -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.seed = seed
        self.key = key  # the deployment's block-hash key (prefix_hash.hash_key); b"": unkeyed
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # ... and found there
        self.tables = BlockTables(allocator.num_blocks)  # the decoding requests' blocks (``table_row``)

    @property
    def caching(self) -> bool:
        return self.allocator.caching

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hashes(self, token_ids: Sequence[int], salt: str | None = None, key: bytes | None = None) -> BlockChain:
        """The chain hashes of the full blocks of ``token_ids`` of a request with ``cache_salt`` = ``salt``
        (also with caching off here: prefill names a prompt's blocks to its decode worker, whose cache may
        be on). ``key``: another block-hash key than this cache's (how a peer keyed with the other token of a
        rotation window names them)."""
        key = self.key if key is None else key
        root = salted_seed(self.seed, salt, key)
        return BlockChain(block_hashes(token_ids, self.block_size, root, key=key), root)

    def chain(self, hashes: Sequence[int], salt: str | None = None) -> BlockChain:
        """``hashes`` (named by another worker) as the chain of a request with ``cache_salt`` = ``salt``."""
        return BlockChain(hashes, salted_seed(self.seed, salt, self.key))

    def fits(self, num_tokens: int) -> bool:
        """Could a request of ``num_tokens`` tokens run here at all (with the whole pool to itself)?"""
        return self.blocks_for(num_tokens) <= self.allocator.num_blocks

    def admit(self, hashes: Sequence[int], num_tokens: int, reuse_tokens: int) -> RequestKV | None:
        """Blocks for a request of ``num_tokens`` tokens: the cached blocks of its longest cached prefix (at most
        ``reuse_tokens`` tokens of it, whole blocks) and new blocks for the rest. None (nothing changed) when
        they do not fit."""
        alloc = self.allocator
        hits = alloc.match(hashes[: max(0, reuse_tokens) // self.block_size]) if self.caching else []
        now = self.blocks_for(num_tokens)
        taken_from_free = sum(1 for b in hits if alloc.ref(b) == 0)  # acquiring them takes them off the free list
        if alloc.num_free < taken_from_free + (now - len(hits)):
            return None
        alloc.acquire(hits)
        try:
            fresh = alloc.allocate(now - len(hits))
        except PoolFull:  # (cannot happen after the check above; keep the pool consistent if it does)
            alloc.release(hits)
            return None
        self.query_tokens += num_tokens if self.caching else 0
        self.hit_tokens += len(hits) * self.block_size
        return RequestKV(hits + fresh, list(hashes), len(hits) * self.block_size, committed=len(hits),
                         root=hashes.root if isinstance(hashes, BlockChain) else None)

    def can_grow(self, kv: RequestKV, num_tokens: int) -> bool:
        """Are there free (or evictable) blocks for ``kv`` to hold ``num_tokens`` tokens?"""
        return self.blocks_for(num_tokens) - len(kv.blocks) <= self.allocator.num_free

    def grow(self, kv: RequestKV, num_tokens: int) -> None:
        """Make ``kv`` hold ``num_tokens`` tokens (PoolFull, and nothing taken, when the blocks are not free)."""
        extra = self.blocks_for(num_tokens) - len(kv.blocks)
        if extra <= 0:
            return
        fresh = self.allocator.allocate(extra)
        kv.blocks.extend(fresh)
        if kv.row is not None:
            self.tables.extend(kv.row, fresh)

    def table_row(self, kv: RequestKV) -> int:
        """``kv``'s row of ``tables`` (opened with its blocks the first time), kept up to date by ``grow``."""
        if kv.row is None:
            kv.row = self.tables.open(kv.blocks)
        return kv.row

    def cache_blocks(self, kv: RequestKV, upto_tokens: int) -> None:
        """The KV of ``kv``'s first ``upto_tokens`` tokens is complete: record the hashes of its full blocks
        among them (those ``kv.hashes`` names) so later requests reuse them."""
        if not self.caching:
            return
        end = min(upto_tokens // self.block_size, len(kv.hashes), len(kv.blocks))
        for i in range(kv.committed, end):
            self.allocator.commit(kv.blocks[i], kv.hashes[i])  # (False: another block holds it; ours stays private)
        kv.committed = max(kv.committed, end)

    def prompt_done(self, kv: RequestKV, prompt_len: int, tail: Sequence[int]) -> None:
        """The KV of the whole prompt is in ``kv``'s blocks (computed or received): cache its full blocks;
        ``tail`` are the prompt's tokens after them, where the chain of generated blocks starts."""
        self.cache_blocks(kv, prompt_len)
        if self.caching:
            kv.tail = list(tail)

    def append_tokens(self, kv: RequestKV, tokens: Sequence[int]) -> None:
        """Tokens whose KV was just written after the hashed ones (``kv.tail`` holds those before them):
        extend the hash chain over each block they complete and cache it (decode's generated tokens)."""
        if not self.caching:
            return
        kv.tail.extend(tokens)
        while len(kv.tail) >= self.block_size and len(kv.hashes) < len(kv.blocks):
            # (the chain starts from its root, h_-1: the seed, salted with the request's cache_salt)
            parent = kv.hashes[-1] if kv.hashes else (self.seed if kv.root is None else kv.root)
            (h,) = block_hashes(kv.tail[: self.block_size], self.block_size, parent, key=self.key)
            kv.hashes.append(h)
            del kv.tail[: self.block_size]
            self.cache_blocks(kv, len(kv.hashes) * self.block_size)

    def free(self, kv: RequestKV) -> None:
        """The request ended or was preempted: drop its references (cached blocks stay for reuse)."""
        self.allocator.release(kv.blocks)
        kv.blocks = []
        if kv.row is not None:
            self.tables.close(kv.row)
            kv.row = None

    def stats(self) -> dict:
        a = self.allocator
        return {"blocks_total": a.num_blocks, "blocks_used": a.num_referenced, "blocks_cached": a.num_cached,
                "blocks_free": a.num_free, "blocks_evictable": a.num_evictable,
                "prefix_query_tokens": self.query_tokens, "prefix_hit_tokens": self.hit_tokens}
