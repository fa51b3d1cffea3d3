"""The int8 KV cache (a float16 scale per row) through the real forward passes: the runner's attention paths
(the native kernel, torch's matmul and SDPA attention, the general path) over one int8 pool, a prompt
prefilled in chunks against whole, a sliding-window model on it and a latent one refused, and int8 near
bfloat16 KV."""

from __future__ import annotations

import pytest
import torch

from xpyd.model import kv_rotation
from xpyd.model.kv_int8 import encode_rows
from xpyd.model.runner import ModelRunner

from tests.integration.test_model_runner import every_attention_path, prompt_of

BF16 = torch.bfloat16


def test_every_attention_path_over_one_int8_pool_agrees(tiny_model_dir):
    """bfloat16 model, int8 KV: the native kernel, torch's matmul and SDPA attention and the general path decode
    the same requests from the same rows to the same tokens; the logits differ by roundings only (the kernel
    keeps each dequantized value in float32, the torch paths round it to bfloat16 first: 2^-8 of it)."""
    runner = ModelRunner(tiny_model_dir, BF16, num_blocks=64, max_seq_len=128, block_size=5, kv_cache_dtype="int8")
    assert runner.pool.tensor.dtype == torch.uint8 and runner.pool.layout.dtype == "int8"
    assert runner.fast_path.decode_attention == "kernel"
    prompts = [prompt_of(7 + 13 * i, 200 + i) for i in range(3)]
    logits, tokens = every_attention_path(runner, prompts)
    # (this random model, weights of std 0.5, amplifies each rounding to a few percent of the logits' range, as
    # for the fp8 pool: tests/integration/test_kv_fp8.py). While a request's tokens agree its logits are within
    # that; where a path picks another token than the kernel, it is a near tie in the kernel's own logits
    # (and the histories part, so the comparison of that request ends there).
    for path in ("matmul", "sdpa", "general"):
        agreed = 0
        for r in range(len(prompts)):
            for step, (ours, theirs) in enumerate(zip(tokens["kernel"][r], tokens[path][r])):
                got, ref = logits[path][r, step], logits["kernel"][r, step]
                bound = 0.1 * ref.abs().max()
                assert (got - ref).abs().max() <= bound, (path, r, step)
                if ours != theirs:
                    assert ref[ours] - ref[theirs] <= 2 * bound, (path, r, step)  # a near tie
                    break
                agreed += 1
        assert agreed >= 0.8 * sum(len(t) for t in tokens["kernel"]), (path, agreed)


def test_an_int8_prompt_prefilled_in_chunks_matches_it_prefilled_whole(tiny_model_dir):
    """Prefill attends over the new tokens' K/V as the pool holds them, as a later chunk reads the earlier ones:
    layer 0's rows (straight from the embeddings) are the same bytes, the others differ only where bfloat16's
    rounding in a matmul of another shape moved a value across a code's boundary (int8's steps are fine: a
    few codes by one)."""
    runner = ModelRunner(tiny_model_dir, BF16, num_blocks=32, max_seq_len=128, block_size=5, kv_cache_dtype="int8")
    prompt = prompt_of(40, 3)
    whole_blocks, chunk_blocks = (runner.pool.blocks.allocate(8) for _ in range(2))
    whole = runner.prefill(whole_blocks, prompt)
    runner.prefill(chunk_blocks, prompt[:20])
    chunked = runner.prefill(chunk_blocks, prompt, start=20)
    pool = runner.pool.tensor
    assert torch.equal(pool[whole_blocks, :, 0], pool[chunk_blocks, :, 0])
    assert (pool[whole_blocks] == pool[chunk_blocks]).float().mean() > 0.98
    codes = [pool[b][..., :16].view(torch.int8).int() for b in (whole_blocks, chunk_blocks)]
    assert (codes[0] - codes[1]).abs().max() <= 1
    assert (whole - chunked).abs().max() <= 0.01 * whole.abs().max()


def test_int8_kv_is_far_closer_to_bfloat16_than_fp8(tiny_model_dir):
    """The same prompt's last logits with bfloat16, int8 and fp8 e4m3 KV: int8 rounds each value to 1/254 of its
    row's largest, fp8 to 2^-4 of itself; int8's logits sit nearer bfloat16's than fp8's do."""
    runners = {kv: ModelRunner(tiny_model_dir, BF16, num_blocks=16, max_seq_len=128, block_size=16, kv_cache_dtype=kv)
               for kv in ("auto", "int8", "fp8_e4m3")}
    assert runners["int8"].pool.layout.token_bytes == 2 * 2 * 2 * (16 + 2)  # (2 layers, K/V, 2 heads: codes + scale)
    prompt = prompt_of(60, 11)
    out = {kv: r.prefill(r.pool.blocks.allocate(4), prompt) for kv, r in runners.items()}
    err = {kv: (out[kv] - out["auto"]).norm() / out["auto"].norm() for kv in ("int8", "fp8_e4m3")}
    assert err["int8"] < err["fp8_e4m3"] / 2, err
    assert torch.nn.functional.cosine_similarity(out["int8"], out["auto"], dim=0) > 0.99


def test_sliding_window_and_latent_attention_models_run_on_int8_pools(tmp_path):
    """Gemma's windowed reads and DeepSeek's latents (one row per token and layer, its own scale) go through the
    int8 rows like the others': chunks give the whole prompt's numbers within rounding, and the latent pool's
    logits stay near those over bfloat16 latents."""
    from tests.families import save_tiny

    save_tiny("gemma2", tmp_path / "gemma", 500)
    runner = ModelRunner(tmp_path / "gemma", BF16, num_blocks=32, max_seq_len=128, block_size=5, kv_cache_dtype="int8")
    prompt = torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    whole_blocks, chunk_blocks = (runner.pool.blocks.allocate(8) for _ in range(2))
    whole = runner.prefill(whole_blocks, prompt)
    for start in range(0, len(prompt), 9):
        chunked = runner.prefill(chunk_blocks, prompt[:start + 9], start=start)
    assert torch.equal(runner.pool.tensor[whole_blocks, :, 0], runner.pool.tensor[chunk_blocks, :, 0])
    assert (whole - chunked).abs().max() <= 0.01 * whole.abs().max()
    save_tiny("deepseek_v2", tmp_path / "deepseek", 500)
    latent = ModelRunner(tmp_path / "deepseek", BF16, num_blocks=32, max_seq_len=128, block_size=4,
                         kv_cache_dtype="int8")
    plain = ModelRunner(tmp_path / "deepseek", BF16, num_blocks=32, max_seq_len=128, block_size=4)
    layout = latent.pool.layout
    assert layout.kind == "latent" and layout.dtype == "int8" and layout.row_dim == plain.pool.layout.head_dim + 2
    apart = {}
    for name, runner in (("int8", latent), ("bfloat16", plain)):
        whole_blocks, chunk_blocks = (runner.pool.blocks.allocate(10) for _ in range(2))
        whole = runner.prefill(whole_blocks, prompt)
        for start in range(0, len(prompt), 9):
            chunked = runner.prefill(chunk_blocks, prompt[:start + 9], start=start)
        assert torch.equal(runner.pool.tensor[whole_blocks, :, 0], runner.pool.tensor[chunk_blocks, :, 0])
        apart[name] = (whole - chunked).abs().max()
        if name == "int8":
            int8_whole, int8_blocks = whole, whole_blocks
        else:
            reference = whole
    # (the general path's bfloat16 matmuls of other shapes already move this random model's logits by ~1% of
    # their range between chunked and whole: int8's rows add at most that much again)
    assert apart["int8"] <= 2 * apart["bfloat16"] + 0.01 * reference.abs().max(), apart
    # (near the bfloat16 latents' logits, not equal: this random model, weights of std 0.5, amplifies every
    # rounding of a latent through 4 layers: 0.975 here, as the fp8 pool's tiny Llama sees 0.97)
    assert torch.nn.functional.cosine_similarity(int8_whole, reference, dim=0) > 0.95
    step = latent.decode([int8_blocks], [int(int8_whole.argmax())], [len(prompt)])  # (reads the rows back)
    assert torch.isfinite(step).all()
    with pytest.raises(ValueError, match="not supported for latent attention"):
        ModelRunner(tmp_path / "deepseek", BF16, num_blocks=16, max_seq_len=64, block_size=4,
                    kv_cache_dtype="fp8_e4m3")


def test_the_rows_a_prefill_writes_are_the_encoding_of_its_own_keys(tiny_model_dir):
    """What lands in the pool is `encode_rows` of the K/V the forward computed, turned by the rotation: the bf16
    pool of the same prompt holds those K/V, and the int8 pool their rows."""
    bf16 = ModelRunner(tiny_model_dir, BF16, num_blocks=8, max_seq_len=64, block_size=16)
    int8 = ModelRunner(tiny_model_dir, BF16, num_blocks=8, max_seq_len=64, block_size=16, kv_cache_dtype="int8")
    prompt = prompt_of(10, 5)  # (one chunk: layer 0's K/V do not depend on the KV dtype)
    for r in (bf16, int8):
        r.prefill(r.pool.blocks.allocate(1), prompt)
    b = bf16.pool.tensor[0, :, 0, :, :10]  # layer 0 [kv_heads, 2, 10, hd]
    turned = b.float() @ kv_rotation.rotation(b.shape[-1])  # (the rows are of the K/V turned: kv_rotation)
    assert torch.equal(int8.pool.tensor[0, :, 0, :, :10], encode_rows(turned))
