"""ModelRunner over the KV pool vs transformers: same tokens (SmolLM2, fp32) and same logits (tiny models)."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from xpyd.model.llama_fast import FastLlama
from xpyd.model.runner import ModelRunner, UnsupportedModel
from xpyd.model.tokenizer import encode_chat, encode_prompt, load_tokenizer

torch.set_num_threads(1)

NEW_TOKENS = 32


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    slot = runner.pool.allocate()
    try:
        out = [int(runner.prefill(slot, prompt).argmax())]
        for i in range(n - 1):
            out.append(int(runner.decode([slot], [out[-1]], [len(prompt) + i])[0].argmax()))
        return out
    finally:
        runner.pool.free(slot)


def batched_greedy(runner: ModelRunner, prompts: list[list[int]], n: int, join_at: list[int]) -> list[list[int]]:
    """Request i is prefilled before decode step join_at[i] and then decodes in one batch with the others."""
    slots = [runner.pool.allocate() for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    step = 0
    try:
        while any(len(o) < n for o in outs):
            for i, prompt in enumerate(prompts):
                if join_at[i] == step:
                    outs[i].append(int(runner.prefill(slots[i], prompt).argmax()))
            live = [i for i in range(len(prompts)) if outs[i] and len(outs[i]) < n]
            if live:
                logits = runner.decode(
                    [slots[i] for i in live],
                    [outs[i][-1] for i in live],
                    [len(prompts[i]) + len(outs[i]) - 1 for i in live],
                )
                for row, i in enumerate(live):
                    outs[i].append(int(logits[row].argmax()))
            step += 1
        return outs
    finally:
        for slot in slots:
            runner.pool.free(slot)


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             pad_token_id=2)
    return out[0, len(prompt):].tolist()


# --- SmolLM2 (the default model), float32: token-for-token against transformers' generate -----------------

@pytest.fixture(scope="module")
def smol(smollm_dir):
    tok = load_tokenizer(smollm_dir)
    runner = ModelRunner(smollm_dir, torch.float32, num_slots=4, max_seq_len=256)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    prompts = {
        "plain": encode_prompt(tok, "The three most important inventions of the twentieth century were"),
        "chat": encode_chat(tok, [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]),
        "non_ascii": encode_prompt(tok, "Voici une recette de crème brûlée (クレームブリュレ) 🍮 :"),
    }
    refs = {name: hf_generate(hf, p, NEW_TOKENS) for name, p in prompts.items()}
    for name, ref in refs.items():
        assert len(ref) == NEW_TOKENS and 2 not in ref, f"{name}: pick a prompt that does not hit eos early"
    return runner, prompts, refs


@pytest.mark.parametrize("name", ["plain", "chat", "non_ascii"])
def test_smollm_greedy_matches_generate(smol, name):
    runner, prompts, refs = smol
    assert greedy(runner, prompts[name], NEW_TOKENS) == refs[name]
    assert runner.pool.num_used == 0


def test_smollm_batched_decode_with_different_lengths_matches_generate(smol):
    runner, prompts, refs = smol
    names = ["plain", "chat", "non_ascii"]
    assert len({len(prompts[n]) for n in names}) == 3
    outs = batched_greedy(runner, [prompts[n] for n in names], NEW_TOKENS, join_at=[0, 3, 7])
    assert outs == [refs[n] for n in names]


def test_smollm_chat_answer(smol, smollm_dir):
    runner, _, _ = smol
    tok = load_tokenizer(smollm_dir)
    prompt = encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}])
    out = greedy(runner, prompt, 8)
    assert tok.decode(out[: out.index(2)]) == "The capital of France is Paris."
    assert runner.eos_token_ids == frozenset({2})


# --- tiny random Llama: logits against a full transformers forward at every step ---------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, torch.float32, num_slots=3, max_seq_len=128)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return runner, hf


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def prompt_of(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=g).tolist()


def test_tiny_prefill_and_decode_logits_match_forward(tiny):
    runner, hf = tiny
    prompt = prompt_of(11, 0)
    slot = runner.pool.allocate()
    logits = runner.prefill(slot, prompt)
    assert logits.shape == (runner.vocab_size,) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_last_logits(hf, prompt), rtol=1e-4, atol=1e-4)
    assert runner.pool.num_tokens(slot) == 11
    seq = prompt + [int(logits.argmax())]
    tokens = set()
    for _ in range(12):
        step = runner.decode([slot], [seq[-1]], [len(seq) - 1])
        assert step.shape == (1, runner.vocab_size)
        torch.testing.assert_close(step[0], hf_last_logits(hf, seq), rtol=1e-4, atol=1e-4)
        tokens.add(int(step[0].argmax()))
        seq.append(int(step[0].argmax()))
    assert runner.pool.num_tokens(slot) == len(seq) - 1
    assert len(tokens) > 1  # the random model is not constant, so a broken cache would show
    runner.pool.free(slot)


def test_tiny_greedy_matches_generate(tiny):
    runner, hf = tiny
    prompt = prompt_of(9, 1)
    ref = hf_generate(hf, prompt, 40)
    assert greedy(runner, prompt, len(ref)) == ref


def test_tiny_batched_equals_single(tiny):
    runner, _ = tiny
    prompts = [prompt_of(5, 2), prompt_of(17, 3), prompt_of(2, 4)]
    single = [greedy(runner, p, 20) for p in prompts]
    assert batched_greedy(runner, prompts, 20, join_at=[0, 2, 9]) == single


def test_freed_slot_reuse_ignores_stale_kv(tiny):
    runner, hf = tiny
    long_prompt, short_prompt = prompt_of(60, 5), prompt_of(4, 6)
    fresh = greedy(runner, short_prompt, 15)
    slots = [runner.pool.allocate() for _ in range(3)]
    for slot in slots:  # fill every slot with a long, unrelated context
        runner.prefill(slot, long_prompt)
    for slot in slots:
        runner.pool.free(slot)
    assert greedy(runner, short_prompt, 15) == fresh
    # and batched next to a long request, in a slot that held other tokens
    outs = batched_greedy(runner, [long_prompt, short_prompt], 15, join_at=[0, 0])
    assert outs[1] == fresh


def test_pool_holds_the_same_kv_as_transformers(tiny):
    runner, hf = tiny
    prompt = prompt_of(7, 7)
    slot = runner.pool.allocate()
    runner.prefill(slot, prompt)
    with torch.inference_mode():
        cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    for layer in range(2):
        keys = runner.pool.tensor[slot, :7, layer, 0].transpose(0, 1)  # [kv_heads, seq, head_dim]
        values = runner.pool.tensor[slot, :7, layer, 1].transpose(0, 1)
        torch.testing.assert_close(keys, cache.layers[layer].keys[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, cache.layers[layer].values[0], rtol=1e-5, atol=1e-5)
    runner.pool.free(slot)


def test_kv_moved_by_region_bytes_decodes_the_same(tiny, tiny_model_dir):
    """What the transfer engine does: copy a slot's region into another pool's slot, continue decoding there."""
    prefill_runner, _ = tiny
    decode_runner = ModelRunner(tiny_model_dir, torch.float32, num_slots=2, max_seq_len=64)
    assert decode_runner.pool.layout.compat() == prefill_runner.pool.layout.compat()
    prompt = prompt_of(13, 8)
    src = prefill_runner.pool.allocate()
    first = int(prefill_runner.prefill(src, prompt).argmax())
    decode_runner.pool.allocate()
    dst = decode_runner.pool.allocate()  # a different slot index, a different slot size
    a, b = prefill_runner.pool.byte_range(src, len(prompt)), decode_runner.pool.byte_range(dst, len(prompt))
    decode_runner.pool.buffer()[b.offset:b.end] = prefill_runner.pool.buffer()[a.offset:a.end]
    decode_runner.pool.set_num_tokens(dst, len(prompt))
    prefill_runner.pool.free(src)
    out = [first]
    for i in range(10):
        out.append(int(decode_runner.decode([dst], [out[-1]], [len(prompt) + i])[0].argmax()))
    assert out == greedy(prefill_runner, prompt, 11)


def test_decode_validation_and_warmup(tiny):
    runner, _ = tiny
    slot = runner.pool.allocate()
    runner.prefill(slot, [5, 6, 7])
    with pytest.raises(ValueError):
        runner.decode([slot], [1], [4])  # position 3 has no KV yet
    with pytest.raises(ValueError):
        runner.decode([slot, slot], [1, 2], [3, 3])
    with pytest.raises(ValueError):
        runner.decode([slot], [1, 2], [3])
    with pytest.raises(ValueError):
        runner.prefill(slot, [])
    with pytest.raises(ValueError):
        runner.prefill(slot, [runner.vocab_size])
    with pytest.raises(ValueError):
        runner.prefill(slot, [1] * (runner.max_model_len + 1))
    runner.pool.free(slot)
    with pytest.raises(ValueError):
        runner.prefill(slot, [1, 2])  # not allocated
    runner.warmup()
    assert runner.pool.num_used == 0 and runner.pool.used_bytes() == 0


def test_bfloat16_runs_close_to_transformers(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, torch.bfloat16, num_slots=1, max_seq_len=64)
    assert runner.pool.tensor.dtype == torch.bfloat16 and runner.pool.layout.dtype == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16).eval()
    prompt = prompt_of(10, 9)
    slot = runner.pool.allocate()
    ours = runner.prefill(slot, prompt)
    ref = hf_last_logits(hf, prompt)
    assert torch.corrcoef(torch.stack([ours, ref]))[0, 1] > 0.99


# --- other Llama-family architectures and refusals ---------------------------------------------------------

def _save_tiny(tmp_path, config_cls, model_cls, **extra):
    config = config_cls(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        initializer_range=0.5, **extra)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama-rope-scaled"])
def test_other_llama_family_models(tmp_path, arch):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch == "qwen2":  # q/k/v biases
        hf = _save_tiny(tmp_path, Qwen2Config, Qwen2ForCausalLM)
    elif arch == "mistral":
        hf = _save_tiny(tmp_path, MistralConfig, MistralForCausalLM, sliding_window=None)
    else:
        hf = _save_tiny(tmp_path, LlamaConfig, LlamaForCausalLM, attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    runner = ModelRunner(tmp_path, torch.float32, num_slots=1, max_seq_len=256)
    assert runner.fast_path_active, runner.fast_path_reason  # the lean forward covers all three
    prompt = torch.randint(0, 500, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    slot = runner.pool.allocate()
    torch.testing.assert_close(runner.prefill(slot, prompt[:60]), hf_last_logits(hf, prompt[:60]), rtol=1e-4, atol=1e-4)
    for pos in range(60, 70):
        step = runner.decode([slot], [prompt[pos]], [pos])[0]
        torch.testing.assert_close(step, hf_last_logits(hf, prompt[: pos + 1]), rtol=1e-4, atol=1e-4)


# --- the lean forward (llama_fast) against the general HF-module path ---------------------------------------

def _both_paths(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[torch.Tensor]]:
    """Prefill each prompt, then decode all of them in one batch; every logits tensor, per path."""
    results = []
    for fast in (True, False):
        runner.use_fast_path(fast)
        slots = [runner.pool.allocate() for _ in prompts]
        try:
            got = [runner.prefill(slot, p) for slot, p in zip(slots, prompts)]
            toks = [int(g.argmax()) for g in got]
            pos = [len(p) for p in prompts]
            for _ in range(steps):
                logits = runner.decode(slots, toks, pos)
                got.extend(logits)
                toks = logits.argmax(-1).tolist()
                pos = [q + 1 for q in pos]
            results.append(got)
        finally:
            for slot in slots:
                runner.pool.free(slot)
    runner.use_fast_path(True)
    return results


def test_fast_path_matches_general_path_float32(tiny):
    runner, _ = tiny
    assert runner.fast_path_active and runner.fast_path_reason is None
    fast, general = _both_paths(runner, [prompt_of(23, 10), prompt_of(6, 11), prompt_of(41, 12)], steps=8)
    assert len(fast) == len(general) == 3 + 3 * 8
    for a, b in zip(fast, general):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fast_path_close_to_general_path_bfloat16(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, torch.bfloat16, num_slots=2, max_seq_len=64)
    assert runner.fast_path_active
    fast, general = _both_paths(runner, [prompt_of(12, 13), prompt_of(5, 14)], steps=4)
    for a, b in zip(fast, general):
        assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.99


def test_model_the_fast_path_does_not_cover_falls_back(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = _save_tiny(tmp_path, LlamaConfig, LlamaForCausalLM, hidden_act="gelu_pytorch_tanh")
    runner = ModelRunner(tmp_path, torch.float32, num_slots=1, max_seq_len=128)
    assert not runner.fast_path_active and "activation" in runner.fast_path_reason
    with pytest.raises(ValueError, match="activation"):
        runner.use_fast_path(True)
    prompt = torch.randint(0, 500, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    slot = runner.pool.allocate()
    torch.testing.assert_close(runner.prefill(slot, prompt[:25]), hf_last_logits(hf, prompt[:25]), rtol=1e-4, atol=1e-4)
    for pos in range(25, 30):
        step = runner.decode([slot], [prompt[pos]], [pos])[0]
        torch.testing.assert_close(step, hf_last_logits(hf, prompt[: pos + 1]), rtol=1e-4, atol=1e-4)


def test_unsupported_architectures_are_refused(tmp_path):
    from transformers import GPT2Config, MistralConfig

    GPT2Config().save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModel, match="gpt2"):
        ModelRunner(tmp_path / "gpt2", torch.float32, num_slots=1, max_seq_len=64)
    MistralConfig(sliding_window=32).save_pretrained(tmp_path / "mistral")
    with pytest.raises(UnsupportedModel, match="sliding"):
        ModelRunner(tmp_path / "mistral", torch.float32, num_slots=1, max_seq_len=64)


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
@pytest.mark.parametrize("chosen", [[0, 1, 2], [2, 0, 1], [1, 4, 6], [0, 7]],
                         ids=["in-order", "out-of-order", "window-with-idle-rows", "per-request"])
def test_batched_decode_over_any_slot_layout_equals_single_requests(tiny_model_dir, chosen, attention):
    """The batch attends over a window of neighbouring slots (idle rows masked out and dropped) or,
    when the slots are far apart, per request; either way each request sees only its own KV."""
    runner = ModelRunner(tiny_model_dir, torch.float32, num_slots=8, max_seq_len=64)
    runner.fast_path.decode_attention = attention
    slots = [runner.pool.allocate() for _ in range(8)]
    for slot in slots:  # stale KV everywhere, which the masks must ignore
        runner.prefill(slot, prompt_of(30, 40 + slot))
    prompts = {s: prompt_of(3 + 5 * i, 50 + s) for i, s in enumerate(chosen)}
    first = {s: int(runner.prefill(s, prompts[s]).argmax()) for s in chosen}
    batched = runner.decode(chosen, [first[s] for s in chosen], [len(prompts[s]) for s in chosen])
    for i, s in enumerate(chosen):
        runner.pool.set_num_tokens(s, len(prompts[s]))
        alone = runner.decode([s], [first[s]], [len(prompts[s])])[0]
        torch.testing.assert_close(batched[i], alone, rtol=1e-4, atol=1e-4)  # M=1 vs M=B GEMMs round apart


def test_matmul_decode_attention_equals_sdpa(tiny_model_dir):
    """The matmul attention (bfloat16's default) computes what SDPA does, for single and batched steps."""
    runner = ModelRunner(tiny_model_dir, torch.float32, num_slots=4, max_seq_len=64)
    assert runner.fast_path.decode_attention == "sdpa"  # float32 keeps transformers' kernel
    slots = [runner.pool.allocate() for _ in range(3)]
    prompts = [prompt_of(7 + 9 * i, 60 + i) for i in range(3)]
    first = [int(runner.prefill(s, p).argmax()) for s, p in zip(slots, prompts)]
    positions = [len(p) for p in prompts]
    results = {}
    for attention in ("sdpa", "matmul"):
        runner.fast_path.decode_attention = attention
        results[attention] = [runner.decode(slots, first, positions), runner.decode(slots[1:2], first[1:2], positions[1:2])]
    for a, b in zip(results["sdpa"], results["matmul"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    bf16 = ModelRunner(tiny_model_dir, torch.bfloat16, num_slots=1, max_seq_len=64).fast_path
    assert bf16.decode_attention == "kernel"  # the native kernel (tests/integration/test_native_attention.py)
    with pytest.raises(ValueError, match="decode_attention"):
        FastLlama(runner.model, 64, torch.float32, decode_attention="flash")


def test_forward_passes_hold_the_cpu_board_and_release_it_when_done(tiny_model_dir, tmp_path, monkeypatch):
    from xpyd.worker import cpu_share

    monkeypatch.setattr(cpu_share, "BOARD_DIR", tmp_path)
    runner = ModelRunner(tiny_model_dir, torch.float32, num_slots=1, max_seq_len=64)
    runner.cpu_share = share = cpu_share.CpuShare("runner-test", cores=2)
    marks = []
    read = lambda: cpu_share._SLOT.unpack_from(share._map, share.slot * cpu_share._SLOT.size)[1]
    original = runner.fast_path.on_layer

    def on_layer():
        original()
        marks.append(read() - time.monotonic_ns())

    runner.fast_path.on_layer = on_layer
    slot = runner.pool.allocate()
    token = int(runner.prefill(slot, prompt_of(9, 70)).argmax())
    assert marks and min(marks) > 10**9  # held into the future during every layer
    assert read() <= time.monotonic_ns()  # released: an ordinary mark once the pass ended
    marks.clear()
    runner.decode([slot], [token], [9])
    assert marks and min(marks) > 10**9 and read() <= time.monotonic_ns()
    with pytest.raises(ValueError):
        runner.decode([slot], [token], [40])  # refused: the board is not left holding
    assert read() <= time.monotonic_ns()


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_ragged_batch_attends_per_request_and_equals_single_requests(tiny_model_dir, attention):
    """One long prompt among short ones: the window would cover rows x longest (3 x 50 > 2 x 59 live
    tokens), so each request attends over its own live KV; results equal single-request steps."""
    runner = ModelRunner(tiny_model_dir, torch.float32, num_slots=3, max_seq_len=64)
    runner.fast_path.decode_attention = attention
    slots = [runner.pool.allocate() for _ in range(3)]
    prompts = {s: prompt_of(n, 80 + s) for s, n in zip(slots, (49, 4, 3))}
    first = {s: int(runner.prefill(s, prompts[s]).argmax()) for s in slots}
    batched = runner.decode(slots, [first[s] for s in slots], [len(prompts[s]) for s in slots])
    for i, s in enumerate(slots):
        runner.pool.set_num_tokens(s, len(prompts[s]))
        alone = runner.decode([s], [first[s]], [len(prompts[s])])[0]
        torch.testing.assert_close(batched[i], alone, rtol=1e-4, atol=1e-4)
