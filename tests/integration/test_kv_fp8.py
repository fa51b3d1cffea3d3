"""The fp8 KV cache through the real forward passes: the native decode kernel over fp8 codes against itself
over the same values in bfloat16 (dequantization in the kernel is exact), the runner's attention paths
(kernel, torch matmul, SDPA, the general path) over one fp8 pool, and calibrated scales that do not depend
on the pool's size or the batch."""

from __future__ import annotations

import pytest
import torch

from xpyd.model import native
from xpyd.model.kv_quant import FORMATS, KVCodec, KVScales, lut
from xpyd.model.runner import ModelRunner

from tests.integration.test_model_runner import every_attention_path, prompt_of
from tests.integration.test_native_kernels import paged_case, reference
from tests.numerics import assert_roundings_apart

BF16 = torch.bfloat16
FMTS = sorted(FORMATS)


@pytest.fixture(scope="module")
def kernel() -> native.DecodeAttention:
    k = native.load_decode_attention()
    if k is None:
        pytest.fail(f"native decode attention did not build: {native.unavailable_reason()}")
    return k


def _fp8_case(name, heads, kv_heads, hd, block_size, lens, seed):
    """paged_case's pool and step quantized with random per-(layer, head) power-of-two scales: the fp8 pool
    (codes), the same pool's values in bfloat16, the codec, and q with the step's K/V."""
    pool, tables, q, k_new, v_new = paged_case(heads, kv_heads, hd, block_size, lens, seed=seed)
    layers = pool.shape[2]
    gen = torch.Generator().manual_seed(seed)
    exps = torch.randint(-3, 3, (2, layers, kv_heads), generator=gen).tolist()
    scales = KVScales(name, tuple(map(tuple, exps[0])), tuple(map(tuple, exps[1])))
    codec = KVCodec(scales, BF16)
    codes = torch.empty(pool.shape, dtype=torch.uint8)
    values = torch.empty(pool.shape, dtype=BF16)
    for layer in range(layers):
        per_row = pool[:, :, layer].permute(0, 3, 1, 2, 4).reshape(-1, kv_heads, hd)  # rows [*, kv_heads, hd]
        k, v = codec.encode(layer, per_row, per_row)
        shape = (pool.shape[0], block_size, kv_heads, 2, hd)
        codes[:, :, layer] = k.view(shape).permute(0, 2, 3, 1, 4)
        kv = codes[:, :, layer].permute(0, 1, 2, 3, 4)  # [blocks, kv_heads, 2, bs, hd]
        dk, dv = codec.decode(layer, kv[:, :, 0], kv[:, :, 1])
        values[:, :, layer, 0], values[:, :, layer, 1] = dk, dv
    return codes, values, tables, q, k_new, v_new, codec


@pytest.mark.parametrize("name", FMTS)
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (8, 2, 128), (12, 2, 96)])  # the last: the generic copy
@pytest.mark.parametrize("block_size", [1, 16])
def test_the_fp8_kernel_equals_the_bfloat16_kernel_over_the_dequantized_pool(kernel, name, heads, kv_heads, hd,
                                                                              block_size):
    bs = block_size
    lens = [1, bs, bs + 1, 3 * bs + 2, 67]
    codes, values, tables, q, k_new, v_new, codec = _fp8_case(name, heads, kv_heads, hd, bs, lens, seed=hd + bs)
    layer, lens_t, scale = 1, torch.tensor(lens), hd**-0.5
    k_codes, v_codes = codec.encode(layer, k_new, v_new)
    k_vals, v_vals = (c.view(codec.fp8).to(BF16) * s.view(kv_heads, 1).to(BF16)
                      for c, s in zip((k_codes, v_codes), codec.kernel_scales(layer)))
    before = codes.clone()
    out8 = torch.empty(len(lens), heads, hd, dtype=BF16)
    kernel.fp8(q, k_codes, v_codes, codes, layer, tables, lens_t, scale, out8, name, *codec.kernel_scales(layer))
    out16 = torch.empty_like(out8)
    kernel(q, k_vals, v_vals, values, layer, tables, lens_t, scale, out16)
    expected = before
    for b, n in enumerate(lens):  # the step's codes at each request's (block, row), nothing else touched
        block, row = int(tables[b, (n - 1) // bs]), (n - 1) % bs
        expected[block, :, layer, 0, row] = k_codes[b]
        expected[block, :, layer, 1, row] = v_codes[b]
    assert torch.equal(codes, expected)
    # the scales are powers of two: applied once per score and once per output, the same numbers
    assert_roundings_apart(out8, out16, 1, "fp8 kernel vs bf16 kernel")
    assert (out8 == out16).float().mean() > 0.97
    assert_roundings_apart(out8, reference(q, values, layer, tables, lens, scale), 1, "fp8 kernel vs reference")


def test_the_fp8_kernel_refuses_a_bad_table_or_scales(kernel):
    codes, _, tables, q, k_new, v_new, codec = _fp8_case("fp8_e4m3", 4, 2, 32, 8, [9], seed=1)
    k_codes, v_codes = codec.encode(0, k_new, v_new)
    out = torch.empty(1, 4, 32, dtype=BF16)
    k_s, v_s = codec.kernel_scales(0)
    with pytest.raises(ValueError, match="scales float32"):
        kernel.fp8(q, k_codes, v_codes, codes, 0, tables, torch.tensor([9]), 0.25, out, "fp8_e4m3", k_s[:1], v_s)
    with pytest.raises(ValueError, match="wants bfloat16 q and torch.uint8"):
        kernel.fp8(q, k_new, v_new, codes, 0, tables, torch.tensor([9]), 0.25, out, "fp8_e4m3", k_s, v_s)
    with pytest.raises(ValueError, match="bad pool"):  # a bfloat16 pool under the fp8 entry
        kernel.fp8(q, k_codes, v_codes, codes.to(BF16), 0, tables, torch.tensor([9]), 0.25, out, "fp8_e4m3", k_s, v_s)
    with pytest.raises(ValueError, match="format must be one of"):
        kernel.fp8(q, k_codes, v_codes, codes, 0, tables, torch.tensor([9]), 0.25, out, "int8", k_s, v_s)


@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("name", FMTS)
def test_the_kernels_fp8_conversion_equals_torchs_for_every_finite_code(kernel, name, vector):
    """The kernel converts codes through half precision (or bit arithmetic: csrc/fp8.h), not a table: bit for bit
    torch's conversion (and `kv_quant.lut`) for all 256 codes but NaN and infinities, which the writer never
    stores (it saturates); every code at every position of a vector (the codes rotated through 17 offsets)."""
    codes = torch.cat([torch.arange(256, dtype=torch.uint8).roll(k) for k in range(17)])
    torchs = codes.view(FORMATS[name].torch_dtype).float()
    ours = kernel.to_float(codes, name, vector)
    finite = torchs.isfinite()
    assert int(finite[:256].sum()) == {"fp8_e4m3": 254, "fp8_e5m2": 248}[name]
    assert torch.equal(ours[finite].view(torch.int32), torchs[finite].view(torch.int32))
    first = finite[:256]  # (the codes in order)
    assert torch.equal(ours[:256][first].view(torch.int32), lut(name)[first].view(torch.int32))


@pytest.mark.parametrize("name", FMTS)
def test_every_attention_path_over_one_fp8_pool_agrees(tiny_model_dir, kernel, name):
    """bfloat16 model, fp8 KV: the native kernel, torch's matmul and SDPA attention and the general
    (transformers modules) path decode the same requests from the same quantized KV; a request's tokens
    do not depend on its batch."""
    runner = ModelRunner(tiny_model_dir, BF16, num_blocks=64, max_seq_len=128, block_size=5, kv_cache_dtype=name)
    assert runner.pool.tensor.dtype == torch.uint8 and runner.pool.layout.dtype == name
    assert runner.fast_path.decode_attention == "kernel"
    logits, tokens = every_attention_path(runner, [prompt_of(7 + 13 * i, 200 + i) for i in range(3)])
    for path in ("matmul", "sdpa", "general"):
        assert tokens[path] == tokens["kernel"], path
    # matmul: float32 attention as the kernel's, only the sums in another order; SDPA (bfloat16 internals) and
    # the general path (transformers' modules, bf16 GEMMs of other shapes): within bfloat16 noise, which this
    # random model (weights of std 0.5) amplifies to a few percent of the logits' range
    scale = logits["kernel"].abs().amax(-1)
    for path, bound in (("matmul", 0.01), ("sdpa", 0.1), ("general", 0.1)):
        assert ((logits[path] - logits["kernel"]).abs().amax(-1) <= bound * scale).all(), path


def test_scales_are_calibrated_alike_whatever_the_pool_and_fp8_prefill_stays_close_to_bfloat16(tiny_model_dir):
    fp8 = ModelRunner(tiny_model_dir, BF16, num_blocks=64, max_seq_len=128, block_size=5, kv_cache_dtype="fp8_e4m3")
    other = ModelRunner(tiny_model_dir, BF16, num_blocks=9, max_seq_len=128, block_size=16, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_codec.scales == other.kv_codec.scales  # (block size and pool size do not change them)
    assert fp8.pool.layout.compat()["kv_scales"] == fp8.kv_codec.scales.digest()
    bf16 = ModelRunner(tiny_model_dir, BF16, num_blocks=64, max_seq_len=128, block_size=5)
    assert bf16.pool.layout.token_bytes == 2 * fp8.pool.layout.token_bytes
    prompt = prompt_of(40, 7)
    a, b = (r.prefill(r.pool.blocks.allocate(r.pool.layout.blocks_for(41)), prompt) for r in (fp8, bf16))
    # prefill attends over the prompt's K/V as the fp8 pool holds them: near bfloat16's, not equal (this random
    # model, weights of std 0.5, amplifies every rounding: a few percent of the logits' range)
    assert not torch.equal(a, b)
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.97, torch.nn.functional.cosine_similarity(a, b, dim=0)


def test_an_fp8_prompt_prefilled_in_chunks_matches_it_prefilled_whole(tiny_model_dir):
    """Prefill attends over the new tokens' K/V as the pool holds them, as a later chunk reads the earlier
    ones: where a prompt's chunks end does not change its numbers beyond rounding (had the new tokens been
    attended unquantized, the second chunk would see the first one's fp8 values and the whole prompt would
    not: differences of quantization's size)."""
    runner = ModelRunner(tiny_model_dir, BF16, num_blocks=32, max_seq_len=128, block_size=5, kv_cache_dtype="fp8_e4m3")
    prompt = prompt_of(40, 3)
    whole_blocks, chunk_blocks = (runner.pool.blocks.allocate(8) for _ in range(2))
    whole = runner.prefill(whole_blocks, prompt)
    runner.prefill(chunk_blocks, prompt[:20])
    chunked = runner.prefill(chunk_blocks, prompt, start=20)
    pool = runner.pool.tensor
    assert torch.equal(pool[whole_blocks[:4]], pool[chunk_blocks[:4]])  # the first chunk: the same codes
    assert (pool[whole_blocks[4:]] == pool[chunk_blocks[4:]]).float().mean() > 0.99
    assert (whole - chunked).abs().max() <= 0.01 * whole.abs().max()


def test_a_sliding_window_model_runs_on_an_fp8_pool_and_a_latent_one_is_refused(tmp_path):
    """Gemma's windowed reads go through the codec like the others' (chunks of 9 across its window of 10 and
    blocks of 5 give the whole prompt's numbers within quantization's rounding); DeepSeek's latent pool has no
    per-head K and V to scale: refused at start, saying so."""
    from tests.families import save_tiny

    save_tiny("gemma2", tmp_path / "gemma", 500)
    runner = ModelRunner(tmp_path / "gemma", BF16, num_blocks=32, max_seq_len=128, block_size=5,
                         kv_cache_dtype="fp8_e4m3")
    assert runner.pool.tensor.dtype == torch.uint8
    prompt = torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    whole_blocks, chunk_blocks = (runner.pool.blocks.allocate(8) for _ in range(2))
    whole = runner.prefill(whole_blocks, prompt)
    for start in range(0, len(prompt), 9):
        chunked = runner.prefill(chunk_blocks, prompt[:start + 9], start=start)
    assert torch.equal(runner.pool.tensor[whole_blocks[:1]], runner.pool.tensor[chunk_blocks[:1]])
    assert (whole - chunked).abs().max() <= 0.01 * whole.abs().max()
    save_tiny("deepseek_v2", tmp_path / "deepseek", 500)
    with pytest.raises(ValueError, match="not supported for latent attention"):
        ModelRunner(tmp_path / "deepseek", BF16, num_blocks=16, max_seq_len=64, block_size=4,
                    kv_cache_dtype="fp8_e4m3")
