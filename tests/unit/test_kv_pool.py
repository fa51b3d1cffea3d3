"""KVPool: slot allocation, token counts, contiguous regions, and a buffer that shares the pool's memory."""

import pytest
import torch

from xpyd.model.kv_pool import ByteRange, KVLayout, KVPool, PoolFull


def make_pool(dtype="float32", num_slots=3, max_seq_len=8) -> KVPool:
    return KVPool(KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, dtype=dtype, num_slots=num_slots,
                           max_seq_len=max_seq_len))


def test_layout_sizes_and_compat():
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", num_slots=4, max_seq_len=1024)
    assert layout.token_bytes == 23_040  # SmolLM2 bf16, facts.md
    assert layout.slot_bytes == 1024 * 23_040
    assert layout.total_bytes == 4 * 1024 * 23_040
    assert KVLayout(30, 3, 64, "float32", 1, 1).token_bytes == 46_080
    assert layout.compat() == {"layout": "slot-token-major/1", "num_layers": 30, "num_kv_heads": 3,
                               "head_dim": 64, "dtype": "bfloat16"}
    # slots and length are local choices: peers with different pools still exchange the same bytes
    assert layout.compat() == KVLayout(30, 3, 64, "bfloat16", 16, 4096).compat()


@pytest.mark.parametrize("kwargs", [dict(dtype="int8"), dict(num_slots=0), dict(head_dim=-1), dict(max_seq_len=1.5)])
def test_layout_validation(kwargs):
    args = dict(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", num_slots=1, max_seq_len=1) | kwargs
    with pytest.raises(ValueError):
        KVLayout(**args)


def test_preallocated_shape_and_dtype():
    pool = make_pool(dtype="bfloat16")
    assert pool.tensor.shape == (3, 8, 2, 2, 3, 4)
    assert pool.tensor.dtype == torch.bfloat16
    assert pool.tensor.is_contiguous()
    assert pool.tensor.numel() * 2 == pool.layout.total_bytes


def test_allocate_free_and_pool_full():
    pool = make_pool()
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    assert pool.num_used == 3 and pool.num_free == 0 and not pool.can_allocate()
    with pytest.raises(PoolFull):
        pool.allocate()
    pool.free(slots[1])
    assert pool.can_allocate() and pool.num_free == 1
    assert pool.allocate() == slots[1]


def test_double_free_and_unknown_slot_raise():
    pool = make_pool()
    slot = pool.allocate()
    pool.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slot)
    with pytest.raises(ValueError, match="does not exist"):
        pool.free(99)
    with pytest.raises(ValueError):
        pool.num_tokens(slot)


def test_token_counts_and_used_bytes():
    pool = make_pool()
    a, b = pool.allocate(), pool.allocate()
    assert pool.num_tokens(a) == 0 and pool.used_bytes() == 0
    pool.set_num_tokens(a, 5)
    pool.set_num_tokens(b, 8)
    assert pool.used_bytes() == 13 * pool.layout.token_bytes
    with pytest.raises(ValueError):
        pool.set_num_tokens(a, 9)
    pool.free(a)
    assert pool.used_bytes() == 8 * pool.layout.token_bytes
    assert pool.num_tokens(pool.allocate()) == 0  # a reused slot starts empty


def test_region_is_one_contiguous_range_of_the_slot():
    pool = make_pool()
    pool.allocate()
    slot = pool.allocate()
    region = pool.byte_range(slot, 5)
    assert region == ByteRange(slot * pool.layout.slot_bytes, 5 * pool.layout.token_bytes)
    with pytest.raises(ValueError):
        pool.byte_range(slot, 0)
    with pytest.raises(ValueError):
        pool.byte_range(slot, 9)
    with pytest.raises(ValueError):
        pool.byte_range(2, 1)  # not allocated
    # the region's bytes are exactly the K/V of tokens [0, 5) of that slot, all layers
    pool.tensor[slot, :5] = torch.arange(5 * 2 * 2 * 3 * 4, dtype=torch.float32).view(5, 2, 2, 3, 4)
    raw = bytes(pool.buffer()[region.offset:region.end])
    assert raw == pool.tensor[slot, :5].contiguous().numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_buffer_shares_memory_both_ways(dtype):
    pool = make_pool(dtype=dtype)
    buf = pool.buffer()
    assert not buf.readonly and buf.nbytes == pool.layout.total_bytes and buf.format == "B"
    pool.tensor[1, 2, 1, 0, 2, 3] = 1.5
    assert any(buf[pool.layout.slot_bytes:2 * pool.layout.slot_bytes])
    # writing bytes into the buffer (what a receive does) changes the tensor
    other = make_pool(dtype=dtype)
    other.buffer()[:] = buf
    assert torch.equal(other.tensor, pool.tensor)
