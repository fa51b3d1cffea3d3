"""The CUDA engine's decode step (`xpyd.model.gpu.decoder.PagedDecoder`), run eagerly on the CPU through Triton's
interpreter: the same Python and the same kernels a GPU worker runs (CUDA graphs aside), checked against the
lean forward's own decode over the same pool.

Both are float32 paths of one computation over a 2-layer model (64-wide dots, contexts under 64 tokens): their
logits differ by float32 rounding, ~1e-6 of the logits' scale; 1e-4 of it is the bound (100x headroom), and
the argmax (the greedy token) must be the same wherever the top-2 margin is wider than that bound.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA engine's kernels are Triton kernels")

from xpyd.model.gpu.decoder import PagedDecoder  # noqa: E402
from xpyd.model.runner import ModelRunner  # noqa: E402


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _prefilled(runner: ModelRunner, prompts: list[list[int]], room: int):
    tables, tokens = [], []
    for ids in prompts:
        table = runner.pool.blocks.allocate(runner.pool.layout.blocks_for(len(ids) + room))
        tokens.append(int(runner.prefill(table, ids).argmax()))
        tables.append(table)
    return tables, tokens


@pytest.fixture(params=["llama", "qwen3"])
def model_dir(request, tmp_path):
    """The tiny Llama, and a tiny Qwen3 (q/k norms before rotary, head_dim 32 of a 64-wide hidden)."""
    if request.param == "llama":
        return request.getfixturevalue("tiny_model_dir")
    from tests.families import save_tiny

    save_tiny("qwen3", tmp_path, 500)
    return tmp_path


@pytest.mark.parametrize("use_fused", [True, False], ids=["fused-kernels", "torch-ops"])
def test_paged_decoder_steps_match_the_lean_forward_and_padding_writes_nothing(model_dir, interpreter, use_fused):
    runner = ModelRunner(model_dir, torch.float32, num_blocks=48, max_seq_len=128, block_size=4)
    fast, pool = runner.fast_path, runner.pool.tensor
    g = torch.Generator().manual_seed(3)
    for weight in [w for layer in fast.layers for w in (layer.ln1, layer.ln2)] + [fast.norm]:
        weight.copy_(torch.rand(weight.shape, generator=g) + 0.5)  # (transformers inits norm scales to 1: all alike)
    decoder = PagedDecoder(fast, pool, runner.pool.layout.blocks_for(128), max_batch=4, graphs=False,
                           use_fused=use_fused)
    assert decoder.fused is use_fused
    assert decoder.sizes == (1, 2, 4) and decoder.graph_sizes == ()
    prompts = [[5, 9, 13, 2, 7, 7, 1], [4, 8, 15, 16, 23, 42, 3, 3, 9, 11, 30], [6, 6, 1]]
    tables, tokens = _prefilled(runner, prompts, room=8)
    positions = [len(p) for p in prompts]
    for step in range(5):  # a batch of 3 runs padded to 4; positions cross block boundaries on the way
        before = pool.clone()
        logits = decoder.step(tables, positions, tokens)
        after = pool.clone()
        pool.copy_(before)
        expected = fast.decode(pool, tables, positions, torch.tensor(tokens))
        written = after.ne(before).any(dim=(1, 2, 3, 5))  # [blocks, rows]: which rows the step wrote
        want = torch.zeros_like(written)
        for table, p in zip(tables, positions):
            want[table[p // 4], p % 4] = True
        assert torch.equal(written, want), f"step {step}: rows written {written.nonzero().tolist()}"
        assert torch.allclose(after, pool, rtol=0, atol=1e-5 * float(pool.abs().max())), "K/V rows differ"
        scale = float(expected.abs().max())
        assert logits.shape == expected.shape and float((logits - expected).abs().max()) <= 1e-4 * scale
        top = expected.topk(2, dim=-1).values
        decided = (top[:, 0] - top[:, 1]) > 2e-4 * scale
        assert torch.equal(logits.argmax(-1)[decided], expected.argmax(-1)[decided])
        tokens = expected.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    for table in tables:
        runner.pool.blocks.release(table)


def test_a_batch_over_the_largest_size_is_refused(tiny_model_dir, interpreter):
    runner = ModelRunner(tiny_model_dir, torch.float32, num_blocks=16, max_seq_len=64, block_size=4)
    decoder = PagedDecoder(runner.fast_path, runner.pool.tensor, 16, max_batch=2, graphs=False)
    with pytest.raises(ValueError, match="a decode batch of 3 is over this decoder's 2"):
        decoder.step([[0], [1], [2]], [0, 0, 0], [1, 1, 1])


def test_graphs_need_cuda_and_the_kernels_say_why_they_cannot_run(tiny_model_dir, monkeypatch):
    runner = ModelRunner(tiny_model_dir, torch.float32, num_blocks=16, max_seq_len=64, block_size=4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="interpreter"):
        PagedDecoder(runner.fast_path, runner.pool.tensor, 16, max_batch=2, graphs=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        PagedDecoder(runner.fast_path, runner.pool.tensor, 16, max_batch=2, graphs=True)


def test_the_runner_hands_the_decoder_its_kept_rows_as_it_hands_it_lists(tiny_model_dir, interpreter):
    """`ModelRunner.decode_rows` with the decoder in place (as on CUDA) gives the step of `decode` over lists:
    the same logits and the same rows written."""
    from xpyd.worker.kv_cache import KVCache

    runner = ModelRunner(tiny_model_dir, torch.float32, num_blocks=48, max_seq_len=128, block_size=4)
    runner.decoder = PagedDecoder(runner.fast_path, runner.pool.tensor, runner.pool.layout.blocks_for(128),
                                  max_batch=4, graphs=False)
    cache = KVCache(runner.pool.blocks, 4, seed=0)
    prompts = [[5, 9, 13, 2, 7, 7, 1], [4, 8, 15, 16, 23, 42, 3, 3, 9, 11, 30], [6, 6, 1]]
    kvs = [cache.admit([], len(p) + 8, 0) for p in prompts]
    tokens = [int(runner.prefill(kv.blocks, p).argmax()) for kv, p in zip(kvs, prompts)]
    positions = [len(p) for p in prompts]
    pool = runner.pool.tensor
    for _ in range(5):  # across block boundaries
        for kv, p in zip(kvs, positions):
            cache.grow(kv, p + 1)
        before = pool.clone()
        want = runner.decode([kv.blocks for kv in kvs], tokens, positions)
        after = pool.clone()
        pool.copy_(before)
        got = runner.decode_rows(cache.tables, [cache.table_row(kv) for kv in kvs], tokens, positions)
        assert torch.equal(got, want) and torch.equal(pool, after)
        tokens = got.argmax(-1).tolist()
        positions = [p + 1 for p in positions]
    for kv in kvs:
        cache.free(kv)
    assert cache.tables.num_open == 0 and runner.pool.num_used == 0
