"""KVPool: the paged layout, block byte ranges (coalesced), and a buffer that shares the pool's memory."""

import pytest
import torch

from xpyd.model.kv_pool import ByteRange, KVLayout, KVPool, block_ranges


def make_pool(dtype="float32", num_blocks=6, block_size=4, caching=True) -> KVPool:
    return KVPool(KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, dtype=dtype, num_blocks=num_blocks,
                           block_size=block_size), caching=caching)


def test_layout_sizes_and_compat():
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", num_blocks=64, block_size=16)
    assert layout.token_bytes == 23_040  # SmolLM2 bf16, facts.md
    assert layout.block_bytes == 16 * 23_040
    assert layout.total_bytes == 64 * 16 * 23_040
    assert layout.num_tokens == 1024
    assert [layout.blocks_for(n) for n in (1, 15, 16, 17, 32)] == [1, 1, 1, 2, 2]
    assert KVLayout(30, 3, 64, "float32", 1, 1).token_bytes == 46_080
    assert layout.compat() == {"layout": "block-head-major/1", "num_layers": 30, "num_kv_heads": 3,
                               "head_dim": 64, "dtype": "bfloat16", "block_size": 16}
    # the number of blocks is a local choice; the block size is not (a block's bytes must mean the same)
    assert layout.compat() == KVLayout(30, 3, 64, "bfloat16", 4096, 16).compat()
    assert layout.compat() != KVLayout(30, 3, 64, "bfloat16", 64, 32).compat()


@pytest.mark.parametrize("kwargs", [dict(dtype="int4"), dict(num_blocks=0), dict(head_dim=-1), dict(block_size=1.5),
                                    dict(block_size=True)])
def test_layout_validation(kwargs):
    args = dict(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", num_blocks=1, block_size=1) | kwargs
    with pytest.raises(ValueError):
        KVLayout(**args)


def test_preallocated_shape_and_dtype():
    pool = make_pool(dtype="bfloat16")
    assert pool.tensor.shape == (6, 3, 2, 2, 4, 4)  # blocks, kv heads, layers, K/V, rows, head_dim
    assert pool.tensor.dtype == torch.bfloat16
    assert pool.tensor.is_contiguous()
    assert pool.tensor.numel() * 2 == pool.layout.total_bytes
    assert pool.blocks.num_blocks == 6 and pool.blocks.caching
    assert not make_pool(caching=False).blocks.caching


def test_used_bytes_counts_referenced_blocks():
    pool = make_pool()
    blocks = pool.blocks.allocate(3)
    assert pool.num_used == 3 and pool.used_bytes() == 3 * pool.layout.block_bytes
    pool.blocks.release(blocks)
    assert pool.num_used == 0 and pool.used_bytes() == 0


def test_byte_ranges_coalesce_adjacent_blocks_in_order():
    pool = make_pool()
    size = pool.layout.block_bytes
    assert pool.byte_ranges([2, 3, 4, 0, 5]) == [ByteRange(2 * size, 3 * size), ByteRange(0, size),
                                                 ByteRange(5 * size, size)]
    assert pool.byte_ranges([1]) == [ByteRange(size, size)]
    assert pool.byte_ranges([]) == []
    assert pool.byte_ranges([3, 2]) == [ByteRange(3 * size, size), ByteRange(2 * size, size)]  # order kept
    for bad in ([6], [-1], [0, 99], [1.0]):
        with pytest.raises(ValueError, match="does not exist"):
            pool.byte_ranges(bad)
    assert block_ranges([7, 8], 10, 9) == [ByteRange(70, 20)]


def test_a_block_range_holds_every_layer_and_head_of_its_tokens():
    pool = make_pool()
    pool.tensor[4] = torch.arange(pool.tensor[4].numel(), dtype=torch.float32).view(pool.tensor[4].shape)
    (r,) = pool.byte_ranges([4])
    assert bytes(pool.buffer()[r.offset:r.end]) == pool.tensor[4].contiguous().numpy().tobytes()
    # one head slice of a block (what a decode worker of another tensor-parallel degree pulls) is one run
    head = pool.tensor[4, 1]
    start = r.offset + 1 * head.numel() * 4
    assert bytes(pool.buffer()[start:start + head.numel() * 4]) == head.contiguous().numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_buffer_shares_memory_both_ways(dtype):
    pool = make_pool(dtype=dtype)
    buf = pool.buffer()
    assert not buf.readonly and buf.nbytes == pool.layout.total_bytes and buf.format == "B"
    pool.tensor[1, 2, 1, 0, 2, 3] = 1.5
    assert any(buf[pool.layout.block_bytes:2 * pool.layout.block_bytes])
    # writing bytes into the buffer (what a receive does) changes the tensor
    other = make_pool(dtype=dtype)
    other.buffer()[:] = buf
    assert torch.equal(other.tensor, pool.tensor)


def test_pool_in_a_given_buffer():
    layout = make_pool().layout
    raw = bytearray(layout.total_bytes)
    raw[:4] = b"\xff" * 4
    pool = KVPool(layout, buffer=memoryview(raw))
    assert raw[:4] == b"\0" * 4  # zeroed
    pool.tensor[0, 0, 0, 0, 0, 0] = 2.0
    assert raw[:4] != b"\0" * 4
    with pytest.raises(ValueError, match="holds"):
        KVPool(layout, buffer=memoryview(bytearray(8)))
