"""``--gpu-memory-utilization`` turned into a block count (``xpyd.model.gpu.memory.share_blocks``): what is left
of the share after the measured prefill peak and the graphs' reserve, in whole blocks; a share that cannot hold
one request of ``--max-model-len`` is refused. The device's own numbers are faked (no CUDA here); their
arithmetic is tested with them in tests/gpu."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xpyd.model.gpu import memory
from xpyd.model.kv_pool import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", num_blocks=1, block_size=16)


def _runner() -> SimpleNamespace:
    return SimpleNamespace(layout_template=LAYOUT, max_model_len=256, fast_path=None, device="cpu",
                           config=SimpleNamespace(hidden_size=64, intermediate_size=128), vocab_size=1000)


def test_the_share_left_after_the_peaks_is_whole_blocks_and_one_request_must_fit(monkeypatch):
    seen = {}

    def budget(device, fraction, peak, graphs):
        seen.update(fraction=fraction, peak=peak, graphs=graphs)
        return 10 * LAYOUT.block_bytes + 7  # (a part block is no block)

    monkeypatch.setattr(memory, "prefill_peak_bytes", lambda fast, layout, tokens, device: tokens * 1000)
    monkeypatch.setattr(memory, "kv_budget_bytes", budget)
    assert memory.share_blocks(0.4, 8, 64, 160, "decode")(_runner()) == 10
    assert seen["fraction"] == 0.4 and seen["peak"] == 64 * 1000  # (the prefill chunk, not the whole context)
    assert seen["graphs"] == memory.graph_reserve_bytes(8, 1000, 64, 128, 4)
    with pytest.raises(ValueError, match="not one request of --max-model-len 161"):
        memory.share_blocks(0.4, 8, 64, 161, "decode")(_runner())


def test_the_prefill_peak_is_measured_on_the_general_path_too(monkeypatch, tmp_path):
    """A family the lean forward does not cover (Gemma here) is measured by the runner's general prefill over the
    scratch pool, which the runner does not keep (the device's counters faked: a CPU runner)."""
    import torch

    from tests.families import save_tiny
    from xpyd.model.runner import ModelRunner

    save_tiny("gemma2", tmp_path, 500)
    runner = ModelRunner(tmp_path, torch.float32, num_blocks=4, max_seq_len=64, block_size=4)
    assert runner.fast_path is None
    real_pool = runner.pool
    del runner.pool  # (as when share_blocks runs: before the pool exists)
    seen = []
    real_prefill = runner.prefill
    monkeypatch.setattr(runner, "prefill", lambda table, ids: seen.append((runner.pool, list(table), len(ids)))
                        or real_prefill(table, ids))
    for name, value in (("synchronize", None), ("memory_allocated", 100), ("reset_peak_memory_stats", None),
                        ("max_memory_allocated", 4196), ("empty_cache", None)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)
    assert memory.prefill_peak_bytes(runner, real_pool.layout, 10, torch.device("cpu")) == 4096
    ((pool, table, n),) = seen
    assert pool is not real_pool and pool.layout.num_blocks == 3 and table == [0, 1, 2] and n == 10
    assert not hasattr(runner, "pool")
