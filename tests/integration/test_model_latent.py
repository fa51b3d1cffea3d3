"""What is particular to multi-head latent attention (deepseek_v2 and deepseek_v3, tests/families.py) through
ModelRunner, float32:
the pool holds one latent per token and layer, the very ones transformers caches; prompts computed in chunks
that do not divide the block size, cold and after a cached prefix, and a batch of requests of different
lengths decoded together, within float32 error of transformers' float64 forward; the KV bytes of a token are
the latents' (a P/D transfer moves those: blocks copied by their byte ranges into another pool decode as
generate does); the softmax scale (yarn's mscale included) as transformers';
bfloat16 close to transformers'; and on another device, no step's tensor made on the host.
(test_model_families.py runs these families through the tests every family takes.)
"""

from __future__ import annotations

import pytest
import torch

from tests.families import LATENT_FAMILIES, float64_copy, save_tiny
from tests.integration.test_model_families import (assert_batch_decodes_exact, assert_bfloat16_close,
                                                   assert_chunks_exact, assert_steps_stay_on_the_device)
from tests.integration.test_model_runner import (_copy_blocks, assert_exact_greedy, assert_no_block_held, decode,
                                                 greedy, hf_generate, new_seq, prefill, release)
from tests.numerics import Reference
from xpyd.model.runner import SUPPORTED_MODEL_TYPES, ModelRunner, kv_token_bytes

VOCAB = 500
BLOCK = 5
LAYERS, LATENT = 3, 32 + 8  # (tests/families.py: kv_lora_rank 32, qk_rope_head_dim 8)

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=LATENT_FAMILIES)
def latent(request, tmp_path_factory):
    """(runner, hf float32, hf float64, folder) of each tiny latent-attention family (queries through
    q_lora_rank)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, folder, VOCAB)
    runner = ModelRunner(folder, torch.float32, num_blocks=60, max_seq_len=128, block_size=BLOCK)
    return runner, hf, float64_copy(hf), folder


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_pool_is_one_latent_per_token_and_layer_and_kv_bytes_follow(latent):
    runner, _, _, folder = latent
    layout = runner.pool.layout
    assert layout.kind == "latent" and runner.pool.tensor.shape == (60, 1, LAYERS, 1, BLOCK, LATENT)
    assert layout.token_bytes == LAYERS * LATENT * 4 == kv_token_bytes(folder, torch.float32)
    assert kv_token_bytes(folder, torch.bfloat16) == LAYERS * LATENT * 2
    per_head = LAYERS * 2 * 4 * (16 + 8) * 4  # what a K and a V per head (4 heads of 24) would take
    assert layout.token_bytes * 4 < per_head
    assert layout.compat() == {"layout": "block-latent/1", "num_layers": LAYERS, "latent_dim": LATENT,
                               "dtype": "float32", "block_size": BLOCK}
    assert "multi-head latent attention" in runner.fast_path_reason and not runner.fast_path_active


def test_the_pool_holds_the_latents_transformers_caches(latent):
    """Row t % block_size of block table[t // block_size] holds token t's normed compressed KV and rotated key
    part, as transformers' cache (keys: the compressed KV, values: the rotary part), cold and after a prefix."""
    runner, hf, hf64, _ = latent
    pool = runner.pool
    first = prompt_of(17, 7)
    a = new_seq(pool, first, seed=6)
    prefill(runner, a)
    b = new_seq(pool, first[:10] + prompt_of(9, 8), seed=7, prefix=a.table[:2])
    prefill(runner, b)
    for seq in (a, b):
        with torch.inference_mode():
            cache, cache64 = (m(torch.tensor([seq.prompt]), use_cache=True).past_key_values for m in (hf, hf64))
        rows = [(seq.table[t // BLOCK], t % BLOCK) for t in range(len(seq.prompt))]
        for layer in range(LAYERS):
            ours = torch.stack([pool.tensor[block, 0, layer, 0, row] for block, row in rows])  # [seq, latent]
            ref32, ref64 = (torch.cat((c.layers[layer].keys, c.layers[layer].values), -1)[0, 0]
                            for c in (cache, cache64))
            Reference.measure(ref64, ref32).check(ours, f"layer {layer}'s latents")
    release(pool, [a, b])
    assert_no_block_held(runner)


@pytest.mark.parametrize("chunk", [3, 7, 13])
def test_chunks_that_do_not_divide_the_block_cold_and_after_a_cached_prefix(latent, chunk):
    runner, hf, hf64, _ = latent
    assert_chunks_exact(runner, hf, hf64, prompt_of(52, 40 + chunk), 38, 4, chunk)  # (20 cached tokens)


def test_a_batch_of_requests_of_different_lengths_decodes_each_as_transformers(latent):
    """Three requests decoded in one batch, teacher-forced, from 3, 12 and 40 tokens; every step's logits
    against transformers' float64 ones."""
    runner, hf, hf64, _ = latent
    assert_batch_decodes_exact(runner, hf, hf64, [prompt_of(23, 30), prompt_of(32, 31), prompt_of(60, 32)],
                               [3, 12, 40], 8, 20)


def test_latent_blocks_moved_by_their_bytes_decode_as_generate(latent):
    """What a P/D transfer does: a prompt's blocks, as byte ranges, into other blocks of another pool (the
    latents: LAYERS * LATENT floats a token), then decoded there; generate's tokens."""
    prefill_runner, hf, hf64, folder = latent
    decode_runner = ModelRunner(folder, torch.float32, num_blocks=20, max_seq_len=128, block_size=BLOCK)
    assert decode_runner.pool.layout.compat() == prefill_runner.pool.layout.compat()
    prompt = prompt_of(23, 50)
    src = new_seq(prefill_runner.pool, prompt, seed=1)
    prefill(prefill_runner, src)
    dst = new_seq(decode_runner.pool, prompt, seed=3)
    assert dst.table != src.table
    moved = sum(r.length for r in prefill_runner.pool.byte_ranges(src.table))
    assert moved == len(src.table) * BLOCK * LAYERS * LATENT * 4
    _copy_blocks(prefill_runner, src.table, decode_runner, dst.table)
    release(prefill_runner.pool, [src])
    dst.out = src.out
    for _ in range(9):
        decode(decode_runner, [dst])
    release(decode_runner.pool, [dst])
    expected = hf_generate(hf, prompt, 10)
    assert_exact_greedy(hf, hf64, prompt, expected)
    assert dst.out == expected == greedy(prefill_runner, prompt, 10)
    assert_no_block_held(decode_runner)
    assert_no_block_held(prefill_runner)


def test_the_softmax_scale_is_transformers_with_yarn():
    from tests.families import tiny_model
    from xpyd.model.families import layer_attention

    assert {"deepseek_v2", "deepseek_v3"} <= set(SUPPORTED_MODEL_TYPES)
    for family in ("deepseek_v2", "deepseek_v2-q", "deepseek_v3"):
        model = tiny_model(family, VOCAB)
        scales = [spec.scale for spec in layer_attention(model.config)]
        assert scales == [layer.self_attn.scaling for layer in model.model.layers], family
    assert layer_attention(tiny_model("deepseek_v2-q", VOCAB).config)[0].scale > (16 + 8) ** -0.5 * 1.4  # (mscale)


def test_bfloat16_runs_close_to_transformers(tmp_path):
    """bfloat16 latents in the pool (the rotary part rotated in float32 and rounded, as transformers), in chunks
    and decoded."""
    save_tiny("deepseek_v2", tmp_path, VOCAB)
    runner = ModelRunner(tmp_path, torch.bfloat16, num_blocks=30, max_seq_len=64, block_size=4)
    assert runner.pool.tensor.dtype == torch.bfloat16 and runner.pool.layout.token_bytes == LAYERS * LATENT * 2
    assert_bfloat16_close(runner, tmp_path)


def test_runner_on_a_device_keeps_every_latent_step_there(tmp_path):
    """On another device ('meta' here) no per-step tensor of the latent attention is made on the host and
    nothing comes back but the logits' device (every layer dense: transformers' grouped expert GEMM does not run
    on 'meta')."""
    from tests.integration.test_engine_device import tensor_devices

    save_tiny("deepseek_v2", tmp_path, VOCAB, first_k_dense_replace=LAYERS)
    runner = ModelRunner(tmp_path, torch.float32, num_blocks=8, max_seq_len=64, block_size=4, device="meta")
    assert tensor_devices(runner.model) == {"meta"} and runner.pool.tensor.device.type == "meta"
    assert_steps_stay_on_the_device(runner, "latent")
