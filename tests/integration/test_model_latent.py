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
from tests.integration.test_model_families import assert_bfloat16_close
from tests.integration.test_model_runner import (_copy_blocks, assert_exact_greedy, assert_no_block_held, decode,
                                                 exact_logits, greedy, hf_generate, new_seq, prefill,
                                                 prefill_chunked, release)
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
    prompt = prompt_of(52, 40 + chunk)
    ref = exact_logits(hf, hf64, prompt)
    a = new_seq(runner.pool, prompt[:38], seed=5)
    prefill_chunked(runner, a, chunk)
    Reference(ref.exact[37], ref.bound).check(a.logits[0], f"chunks of {chunk}")
    b = new_seq(runner.pool, prompt, seed=6, prefix=a.table[:4])  # 20 cached tokens
    prefill_chunked(runner, b, chunk)
    Reference(ref.exact[51], ref.bound).check(b.logits[0], f"chunks of {chunk} after 20 cached tokens")
    release(runner.pool, [a, b])
    assert_no_block_held(runner)


def test_a_batch_of_requests_of_different_lengths_decodes_each_as_transformers(latent):
    """Three requests decoded in one batch, teacher-forced, from 3, 12 and 40 tokens; every step's logits
    against transformers' float64 ones."""
    runner, hf, hf64, _ = latent
    prompts = [prompt_of(23, 30), prompt_of(32, 31), prompt_of(60, 32)]
    starts = [3, 12, 40]
    refs = [exact_logits(hf, hf64, p) for p in prompts]
    seqs = [new_seq(runner.pool, p[:n], seed=7 + i) for i, (p, n) in enumerate(zip(prompts, starts))]
    for s, ref, n in zip(seqs, refs, starts):
        prefill_chunked(runner, s, 8)
        Reference(ref.exact[n - 1], ref.bound).check(s.logits[0], f"prefill of {n}")
    for step in range(20):
        for s, p, n in zip(seqs, prompts, starts):
            s.out[-1] = p[n + step]
        decode(runner, seqs)
        for s, ref, n in zip(seqs, refs, starts):
            Reference(ref.exact[n + step], ref.bound).check(s.logits[-1], f"step at {n + step}")
    release(runner.pool, seqs)
    assert_no_block_held(runner)


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
    from tests.integration.test_engine_device import DeviceLedger, tensor_devices

    save_tiny("deepseek_v2", tmp_path, VOCAB, first_k_dense_replace=LAYERS)
    runner = ModelRunner(tmp_path, torch.float32, num_blocks=8, max_seq_len=64, block_size=4, device="meta")
    assert tensor_devices(runner.model) == {"meta"} and runner.pool.tensor.device.type == "meta"
    tables = [runner.pool.blocks.allocate(2), runner.pool.blocks.allocate(1)]
    with DeviceLedger(fill=0) as ledger:
        runner.prefill(tables[0], [1, 5, 9, 2, 7])
        runner.prefill(tables[1], [4, 4, 8])
        runner.pool.blocks.acquire(tables[0][:1])
        tables.append(tables[0][:1] + runner.pool.blocks.allocate(1))
        runner.prefill(tables[2], [1, 5, 9, 2, 6, 6], start=4)  # after the first one's first block
        logits = runner.decode(tables, [3, 6, 9], [5, 3, 6])
    assert logits.device.type == "meta" and logits.shape == (3, runner.vocab_size)
    assert ledger.mixed == [] and ledger.to_host() == [], (ledger.mixed, ledger.copies)
    for table in tables:
        runner.pool.blocks.release(table)
    assert runner.pool.num_used == 0
