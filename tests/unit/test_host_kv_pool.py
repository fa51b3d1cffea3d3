"""The KV pool's layout and the host pool need no torch (the simulated engine's workers never import it); the
torch pool over the same layout names the same bytes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xpyd.model.kv_layout import HostKVPool, KVLayout
from xpyd.model.kv_pool import KVPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", num_blocks=6, block_size=4)


def test_a_host_pool_imports_no_torch():
    code = ("import sys, xpyd.model.kv_layout, xpyd.model.sampling_params, xpyd.worker.stepping, "
            "xpyd.worker.work_item; print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_host_and_torch_pools_agree_on_sizes_and_ranges():
    host, torch_pool = HostKVPool(LAYOUT), KVPool(LAYOUT)
    assert LAYOUT.token_bytes == 2 * 2 * 2 * 4 * 2 and LAYOUT.block_bytes == 4 * LAYOUT.token_bytes
    assert host.buffer().nbytes == torch_pool.buffer().nbytes == LAYOUT.total_bytes
    assert host.byte_ranges([1, 2, 4]) == torch_pool.byte_ranges([1, 2, 4])
    assert host.byte_ranges([1, 2, 4]) == [(LAYOUT.block_bytes, 2 * LAYOUT.block_bytes),
                                           (4 * LAYOUT.block_bytes, LAYOUT.block_bytes)]


def test_a_host_pool_is_zeroed_writable_memory_and_counts_held_blocks():
    buffer = memoryview(bytearray(b"\xff" * LAYOUT.total_bytes))
    pool = HostKVPool(LAYOUT, buffer=buffer)
    assert bytes(buffer) == bytes(LAYOUT.total_bytes)  # a given buffer is zeroed: no stale KV
    pool.buffer()[5] = 7
    assert buffer[5] == 7  # the pool is that memory
    blocks = pool.blocks.allocate(2)
    assert pool.num_used == 2 and pool.used_bytes() == 2 * LAYOUT.block_bytes
    pool.blocks.release(blocks)
    assert pool.num_used == 0


def test_a_buffer_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="the layout needs"):
        HostKVPool(LAYOUT, buffer=memoryview(bytearray(LAYOUT.total_bytes - 1)))


def test_a_buffer_known_to_hold_zeros_is_not_written():
    """A new shared-memory segment is zero-filled: the pool does not write it again (``zeroed``)."""
    buffer = memoryview(bytearray(b"\x01" * LAYOUT.total_bytes))  # (not zeros: shows whether it was written)
    HostKVPool(LAYOUT, buffer=buffer, zeroed=True)
    KVPool(LAYOUT, buffer=buffer, zeroed=True)
    assert bytes(buffer) == b"\x01" * LAYOUT.total_bytes
