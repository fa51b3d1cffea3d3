"""What a forward pass checks of its batch before it writes any KV, for every runner (the torch one and the
simulated one): block tables that exist and do not repeat a block, new KV only into a request's own blocks,
positions and starts in range, no two parts writing one block or one row. Torch-free.

A bad batch is a ValueError and nothing is written: a bad block id must never reach an in-place write.
A decode step through the kept block tables (`decode_rows`) checks O(batch) things: the tables' ids were
checked when they were written (`block_tables`).
"""

from __future__ import annotations

from collections.abc import Sequence

from xpyd.model.block_tables import BlockTables
from xpyd.model.kv_blocks import BlockAllocator
from xpyd.model.kv_layout import KVLayout


def table(layout: KVLayout, blocks: Sequence[int], num_tokens: int) -> list[int]:
    """The leading blocks of ``blocks`` that hold ``num_tokens`` tokens. Every id of ``blocks`` must be a
    block of the pool, and none may repeat among those (two positions, one row); a forward pass sees only
    these, so no block past them is ever read."""
    need = layout.blocks_for(num_tokens)
    if len(blocks) < need:
        raise ValueError(f"{len(blocks)} KV blocks cannot hold {num_tokens} tokens (need {need})")
    count = layout.num_blocks
    for b in blocks:
        if type(b) is not int or not 0 <= b < count:
            raise ValueError(f"KV block {b!r} does not exist (pool has {count})")
    out = list(blocks[:need])
    if len(set(out)) != need:
        raise ValueError(f"a block appears twice in one request's blocks {out}: two positions, one row")
    return out


def check_own(allocator: BlockAllocator, blocks: Sequence[int]) -> None:
    """New KV goes only into blocks exactly one request holds: a shared block is another request's (cached)
    prefix, and an unheld one may be handed out or evicted meanwhile."""
    for b in blocks:
        ref = allocator.ref(b)
        if ref != 1:
            held = "not held by any request" if ref == 0 else f"shared by {ref} requests"
            raise ValueError(f"KV block {b} is {held}: new KV is written only into a request's own blocks")


def prefill_parts(layout: KVLayout, allocator: BlockAllocator, max_model_len: int,
                  parts: Sequence[tuple[Sequence[int], Sequence[int], int]]) -> list[list[int]]:
    """Each part's table (``table``) after checking every part: (blocks, token_ids so far, start) with
    1 <= len(token_ids) <= max_model_len and 0 <= start < len(token_ids); the blocks of [start, n) its own,
    and no block written by two parts."""
    if not parts:
        raise ValueError("prefill_many needs at least one part")
    tables = []
    own: set[int] = set()
    for blocks, token_ids, start in parts:
        n = len(token_ids)
        if not 1 <= n <= max_model_len:
            raise ValueError(f"prompt of {n} tokens outside [1, {max_model_len}]")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < n:
            raise ValueError(f"prefill from position {start!r} of a {n}-token prompt: start is an int in "
                             f"[0, {n}) (at least one token is computed)")
        t = table(layout, blocks, n)
        written = t[start // layout.block_size :]
        check_own(allocator, written)
        if own.intersection(written):
            raise ValueError("two parts of one forward pass write the same KV block")
        own.update(written)
        tables.append(t)
    return tables


def _positions(positions: Sequence[int], max_model_len: int) -> None:
    for pos in positions:
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < max_model_len:
            raise ValueError(f"position {pos!r} outside [0, {max_model_len})")


def decode_batch(layout: KVLayout, allocator: BlockAllocator, max_model_len: int, tables: Sequence[Sequence[int]],
                 token_ids: Sequence[int], positions: Sequence[int]) -> list[list[int]]:
    """Each request's table after checking the batch: token i sits at positions[i] < max_model_len of the
    request whose blocks are tables[i]; the block of that position its own, and no two requests writing one
    row."""
    batch = len(tables)
    if batch == 0 or len(token_ids) != batch or len(positions) != batch:
        raise ValueError("decode needs equally long, non-empty tables, token_ids and positions")
    _positions(positions, max_model_len)
    bs = layout.block_size
    out = [table(layout, t, p + 1) for t, p in zip(tables, positions)]
    written = [(t[p // bs], p % bs) for t, p in zip(out, positions)]
    if len(set(written)) != batch:
        raise ValueError("two requests of one decode batch write the same KV row")
    check_own(allocator, [b for b, _ in written])
    return out


def decode_rows(layout: KVLayout, allocator: BlockAllocator, max_model_len: int, tables: BlockTables,
                rows: Sequence[int], token_ids: Sequence[int], positions: Sequence[int]) -> list[int]:
    """`decode_batch` for requests whose blocks are rows of ``tables`` (this pool's): token i sits at
    positions[i] < max_model_len of the request of open row rows[i], which holds that position's block; no
    row twice, the blocks written the requests' own and no two requests writing one KV row. The block each
    request writes, in batch order. O(batch): the rows' ids were checked when they were written."""
    batch = len(rows)
    if batch == 0 or len(token_ids) != batch or len(positions) != batch:
        raise ValueError("decode needs equally long, non-empty rows, token_ids and positions")
    if tables.num_blocks != layout.num_blocks:
        raise ValueError(f"block tables of a {tables.num_blocks}-block pool, not this {layout.num_blocks}-block one")
    _positions(positions, max_model_len)
    if len(set(rows)) != batch:
        raise ValueError("a block-table row appears twice in one decode batch")
    bs = layout.block_size
    written = []
    for row, pos in zip(rows, positions):
        held = tables.length(row)
        if pos // bs >= held:
            raise ValueError(f"row {row}'s {held} KV blocks cannot hold position {pos} (need {pos // bs + 1})")
        written.append(tables.block(row, pos // bs))
    if len(set(zip(written, (p % bs for p in positions)))) != batch:
        raise ValueError("two requests of one decode batch write the same KV row")
    check_own(allocator, written)
    return written
