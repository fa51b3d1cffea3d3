"""Reading and writing K/V through block tables, in torch (the forward passes' paged-attention plumbing).

The pool is `[num_blocks, kv_heads, layers, 2, block_size, head_dim]` (kv_pool.py). A request's token t
sits in block `table[t // block_size]`, row `t % block_size`. Nothing here rearranges the pool: writes
scatter one step's rows into place, reads gather a layer's K/V of some requests into a fresh tensor.
The native decode kernel (native.py) reads the pool in place instead; these are the general path
(float32, other devices, no compiler) and prefill's.

An fp8 pool (uint8 codes) is written and read through its `kv_quant.KVCodec` (``codec``): values are
quantized on the way in and dequantized, exactly, on the way out; everything else sees bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import torch

if TYPE_CHECKING:
    from xpyd.model.kv_quant import KVCodec


class RowIndex(NamedTuple):
    """Where some tokens' rows are: block ids and rows inside them (int64 tensors on the pool's device)."""

    blocks: torch.Tensor
    rows: torch.Tensor


def rows_of(table: Sequence[int], positions: torch.Tensor, block_size: int, device: torch.device) -> RowIndex:
    """The (block, row) of each of ``positions`` (int64, any order) in one request's block ``table``."""
    table_t = torch.as_tensor(list(table), dtype=torch.int64, device=device)
    return RowIndex(table_t[positions // block_size], positions % block_size)


def write(pool: torch.Tensor, layer: int, where: RowIndex, k: torch.Tensor, v: torch.Tensor,
          codec: KVCodec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [T, kv_heads, head_dim]: the K/V of T tokens into their rows of ``layer`` (quantized by
    ``codec`` for an fp8 pool). Returns k, v as the pool now holds them: as given, or from an fp8 pool the
    values of their codes (what a later read gives; prefill attends over these, as decode does)."""
    if codec is not None:
        k_codes, v_codes = codec.encode(layer, k, v)
        pool[where.blocks, :, layer, 0, where.rows] = k_codes
        pool[where.blocks, :, layer, 1, where.rows] = v_codes
        return codec.decode_rows(layer, k_codes, v_codes)
    pool[where.blocks, :, layer, 0, where.rows] = k
    pool[where.blocks, :, layer, 1, where.rows] = v
    return k, v


def padded_tables(tables: Sequence[Sequence[int]], num_blocks: int, device: torch.device) -> torch.Tensor:
    """[B, num_blocks] int64 on ``device`` (made there, as `rows_of`'s): each table's first ``num_blocks``
    entries, rows padded with block 0."""
    rows = [list(table[:num_blocks]) for table in tables]
    return torch.tensor([row + [0] * (num_blocks - len(row)) for row in rows], dtype=torch.int64, device=device)


def gather(pool: torch.Tensor, layer: int, tables: torch.Tensor, length: int,
           codec: KVCodec | None = None, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` for positions [first, length) of each row of ``tables`` [B, nb]: two fresh
    [B, kv_heads, length - first, head_dim] tensors, read from the blocks that hold those positions only
    (positions past a request's own tokens hold whatever the padding blocks hold: mask them); from an fp8
    pool, dequantized by ``codec``."""
    kv_heads, block_size, head_dim = pool.shape[1], pool.shape[4], pool.shape[5]
    skipped = first // block_size  # (blocks wholly before ``first``: not read)
    tables = tables[:, skipped : -(-length // block_size)]
    batch, nb = tables.shape
    blocks = pool[:, :, layer][tables]  # [B, nb, kv_heads, 2, bs, hd], a copy
    both = blocks.permute(3, 0, 2, 1, 4, 5).reshape(2, batch, kv_heads, nb * block_size, head_dim)
    lo, hi = first - skipped * block_size, length - skipped * block_size
    if codec is not None:
        return codec.decode(layer, both[0, :, :, lo:hi], both[1, :, :, lo:hi])
    return both[0, :, :, lo:hi], both[1, :, :, lo:hi]
