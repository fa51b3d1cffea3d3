"""ModelRunner.decode_rows (block tables kept between steps) against decode over lists: the same logits and
the same KV written, bit for bit, on every decode path (native kernel, matmul, SDPA, the general path), with
requests grown a block at a time through the KV cache as a worker's are, in batches that take the padded and
the per-request attention; a bad step over rows is refused with nothing written; the rows are all returned."""

from __future__ import annotations

import random

import pytest
import torch

from xpyd.model.block_tables import BlockTables
from xpyd.model.kv_pool import KVPool
from xpyd.model.runner import ModelRunner
from xpyd.worker.kv_cache import KVCache, RequestKV

torch.set_num_threads(1)

BS = 4


def scatter(pool: KVPool, seed: int) -> None:
    """The free list shuffled, as a busy worker's is."""
    alloc = pool.blocks
    everything = alloc.allocate(alloc.num_free)
    random.Random(seed).shuffle(everything)
    alloc.release(everything)


def admit(runner: ModelRunner, cache: KVCache, prompt: list[int]) -> tuple[RequestKV, int]:
    kv = cache.admit([], len(prompt), 0)
    return kv, int(runner.prefill(kv.blocks, prompt).argmax())


def both_ways(runner: ModelRunner, cache: KVCache, kvs: list[RequestKV], ids: list[int],
              positions: list[int]) -> torch.Tensor:
    """One step over lists, the pool put back, the same step over rows: logits and pools equal; the logits."""
    for kv, pos in zip(kvs, positions):
        cache.grow(kv, pos + 1)
    before = runner.pool.tensor.clone()
    want = runner.decode([kv.blocks for kv in kvs], ids, positions)
    after = runner.pool.tensor.clone()
    runner.pool.tensor.copy_(before)
    got = runner.decode_rows(cache.tables, [cache.table_row(kv) for kv in kvs], ids, positions)
    assert torch.equal(got, want)
    assert torch.equal(runner.pool.tensor, after)
    return got


@pytest.mark.parametrize("dtype, path", [
    (torch.bfloat16, "kernel"), (torch.bfloat16, "matmul"), (torch.float32, "sdpa"), (torch.float32, "general")])
def test_decode_over_kept_rows_equals_decode_over_lists(tiny_model_dir, dtype, path):
    runner = ModelRunner(tiny_model_dir, dtype, num_blocks=64, max_seq_len=128, block_size=BS)
    if path == "general":
        runner.use_fast_path(False)
    else:
        runner.fast_path.decode_attention = path
    scatter(runner.pool, seed=1)
    cache = KVCache(runner.pool.blocks, BS, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 2, 31, 9)]
    steps = 7
    seqs = [admit(runner, cache, p) for p in prompts]
    outs = [[first] for _, first in seqs]
    # each round: all four (one long among short ones: per-request attention), the three short ones (padded),
    # then one alone; the long one joins at the second round (its row opened last)
    for round_ in range(steps):
        for live in ([0, 1, 2, 3] if round_ else [0, 1, 3], [0, 1, 3], [1]):
            kvs = [seqs[i][0] for i in live]
            positions = [len(prompts[i]) + len(outs[i]) - 1 for i in live]
            logits = both_ways(runner, cache, kvs, [outs[i][-1] for i in live], positions)
            for i, row in zip(live, logits):
                outs[i].append(int(row.argmax()))
    assert [kv.row for kv, _ in seqs] == [0, 1, 3, 2]
    assert cache.tables.num_open == 4
    assert [cache.tables.blocks(kv.row) for kv, _ in seqs] == [kv.blocks for kv, _ in seqs]
    for kv, _ in seqs:
        cache.free(kv)
    assert cache.tables.num_open == 0 and runner.pool.num_used == 0


def test_a_bad_step_over_rows_is_refused_and_writes_nothing(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, torch.bfloat16, num_blocks=16, max_seq_len=64, block_size=BS)
    cache = KVCache(runner.pool.blocks, BS, seed=0)
    a, first = admit(runner, cache, [5, 6, 7])
    b, _ = admit(runner, cache, [9, 9])
    rows = [cache.table_row(a), cache.table_row(b)]
    runner.pool.blocks.acquire(b.blocks[:1])  # b's block shared (a caller's bug): not written
    before = runner.pool.tensor.clone()
    for bad_rows, ids, positions, match in [
        ([rows[0]], [1], [BS], "cannot hold position 4"), (rows, [1, 2], [3, 2], "shared by 2"),
        ([rows[0], rows[0]], [1, 2], [3, 3], "row appears twice"), ([5], [1], [3], "not an open row"),
        ([rows[0]], [runner.vocab_size], [3], "vocabulary"), ([rows[0]], [1], [64], "position 64"),
        ([], [], [], "non-empty")]:
        with pytest.raises(ValueError, match=match):
            runner.decode_rows(cache.tables, bad_rows, ids, positions)
    with pytest.raises(ValueError, match="block tables of a 17-block pool"):
        runner.decode_rows(BlockTables(17), [0], [1], [3])
    assert torch.equal(runner.pool.tensor, before)
    assert runner.decode_rows(cache.tables, rows[:1], [first], [3]).shape == (1, runner.vocab_size)
    runner.pool.blocks.release(b.blocks[:1])
    cache.free(a)
    cache.free(b)
    assert cache.tables.num_open == 0 and runner.pool.num_used == 0


def test_the_kernel_checks_a_steps_tables_once_before_any_layer_writes(tiny_model_dir, monkeypatch):
    """The native kernel's block-id check runs once per step (not per layer), before the first layer: an id
    outside the pool among a request's blocks is refused with nothing written; padding past them is not read."""
    from xpyd.model import native

    runner = ModelRunner(tiny_model_dir, torch.bfloat16, num_blocks=8, max_seq_len=64, block_size=BS)
    fast = runner.fast_path
    assert fast.decode_attention == "kernel"
    calls = []
    check = native.check_tables
    monkeypatch.setattr(native, "check_tables", lambda *a: calls.append(a[0].tolist()) or check(*a))
    pool = runner.pool.tensor
    before = pool.clone()
    ids = torch.tensor([3, 4])
    with torch.inference_mode():
        for bad in ([[1, 8], [2, 0]], [[1, 2], [-1, 0]]):
            with pytest.raises(ValueError, match="block 1 is 8|block 0 is -1"):
                fast.decode_tables(pool, torch.tensor(bad), [5, 2], ids)
        assert torch.equal(pool, before)
        calls.clear()
        logits = fast.decode_tables(pool, torch.tensor([[1, 2], [3, 99]]), [5, 2], ids)  # 99: padding
    assert calls == [[[1, 2], [3, 99]]] and len(fast.layers) > 1 and logits.shape == (2, runner.vocab_size)
