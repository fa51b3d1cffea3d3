"""Each model family (tests/families.py) through ModelRunner, float32, against transformers.

For each family, on every path that covers it (the lean forward and the general one): the logits of a prompt
computed in chunks, of its tokens decoded one by one, and of a second request prefilled after the first one's
blocks (a prefix cache hit) are within float32 error of transformers' float64 forward; and greedy decoding of
two requests that share a prefix, batched, prompts computed in chunks, gives transformers' ``generate`` tokens.
The sliding-window families (gemma2, gemma3: local and global layers) also: chunks that end inside and past
the window, a request growing from shorter than the window to far past it, and a batch of requests at
different distances from their windows' edges. The latent-attention families (deepseek_v2: its KV one latent per
token and layer) as the others (test_model_latent.py checks what is particular to them). Then what is refused at
start, and why.
"""

from __future__ import annotations

import pytest
import torch

from tests.families import FAMILIES, LATENT_FAMILIES, SLIDING_FAMILIES, float64_copy, save_tiny
from tests.integration.test_model_runner import (assert_exact_greedy, assert_no_block_held, decode, exact_logits,
                                                 hf_generate, new_seq, prefill_chunked, release)
from tests.numerics import Reference
from xpyd.model.runner import SUPPORTED_MODEL_TYPES, ModelRunner, UnsupportedModel, kv_token_bytes

VOCAB = 500
BLOCK = 5  # odd: blocks end part-way through chunks and prompts
CHUNK = 8
# What covers each family: the lean forward (and the general path next to it) or the general path alone.
LEAN = {"qwen3": True, "llama3": True, "phi3": True, "phi3-partial": False, "mixtral": True, "qwen3_moe": True,
        "gemma2": False, "gemma3": False, "deepseek_v2": False, "deepseek_v2-q": False,
        "deepseek_v3": False}

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (runner, hf float32, hf float64), made on first use and shared by the module's tests."""
    cache = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            hf = save_tiny(family, folder, VOCAB)
            runner = ModelRunner(folder, torch.float32, num_blocks=60, max_seq_len=128, block_size=BLOCK)
            cache[family] = (runner, hf, float64_copy(hf), folder)
        return cache[family]

    return get


def _paths(runner: ModelRunner):
    """Each forward path that covers the runner's model, switched to in turn."""
    for fast in ((True, False) if runner.fast_path_active else (False,)):
        runner.use_fast_path(fast)
        yield "lean" if fast else "general"
    if runner.fast_path is not None:
        runner.use_fast_path(True)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES + ("phi3-partial",) + SLIDING_FAMILIES + LATENT_FAMILIES
                         + ("deepseek_v2-q",))
def test_logits_match_transformers_chunked_decoded_and_after_a_cached_prefix(made, family):
    runner, hf, hf64, _ = made(family)
    assert runner.fast_path_active == LEAN[family], runner.fast_path_reason
    prompt = prompt_of(60, 1)  # (past llama3's original context of 32)
    ref = exact_logits(hf, hf64, prompt)
    at = lambda pos: Reference(ref.exact[pos], ref.bound)
    cold = 41
    for path in _paths(runner):
        a = new_seq(runner.pool, prompt[:cold], seed=1)
        prefill_chunked(runner, a, CHUNK)
        at(cold - 1).check(a.logits[0], f"{path}: a's chunked prefill")
        for pos in range(cold, len(prompt)):
            a.out[-1] = prompt[pos]  # teacher-forced: the prompt's next token
            decode(runner, [a])
            at(pos).check(a.logits[-1], f"{path}: a's step at {pos}")
        b = new_seq(runner.pool, prompt[:47], seed=2, prefix=a.table[:6])  # a's first 30 tokens (> a window), cached
        prefill_chunked(runner, b, CHUNK)
        at(46).check(b.logits[0], f"{path}: b's prefill after a's blocks")
        release(runner.pool, [a, b])
    assert_no_block_held(runner)


@pytest.mark.parametrize("family", FAMILIES + SLIDING_FAMILIES + LATENT_FAMILIES)
def test_greedy_of_requests_sharing_a_prefix_matches_generate(made, family):
    """a, then b with a's first 4 blocks cached; both computed in chunks of 8, then decoded in one batch."""
    runner, hf, hf64, _ = made(family)
    a_prompt = prompt_of(37, 10)
    b_prompt = a_prompt[:23] + prompt_of(14, 11)
    n = 12
    expected = [hf_generate(hf, p, n) for p in (a_prompt, b_prompt)]
    for p, tokens in zip((a_prompt, b_prompt), expected):
        assert_exact_greedy(hf, hf64, p, tokens, family)  # so every float32 path must give them
    for path in _paths(runner):
        a = new_seq(runner.pool, a_prompt, seed=3)
        prefill_chunked(runner, a, CHUNK)
        b = new_seq(runner.pool, b_prompt, seed=4, prefix=a.table[:4])
        assert b.start == 20
        prefill_chunked(runner, b, CHUNK)
        try:
            while len(b.out) < n:
                decode(runner, [a, b])
        finally:
            release(runner.pool, [a, b])
        assert [a.out, b.out] == expected, path
    assert_no_block_held(runner)


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
@pytest.mark.parametrize("chunk", [4, 9, 13, 29])
def test_sliding_windows_chunks_inside_and_past_the_window(made, family, chunk):
    """Chunks shorter than the window (several per window), as long as gemma3's window, and longer than both
    windows (a chunk's first tokens fall out of its last tokens' window), cold and after a cached prefix
    longer than the window (which a local layer reads only the end of)."""
    runner, hf, hf64, _ = made(family)
    assert not runner.fast_path_active and "Gemma" in runner.fast_path_reason
    assert_chunks_exact(runner, hf, hf64, prompt_of(58, 20 + chunk), 43, 5, chunk)


def assert_chunks_exact(runner: ModelRunner, hf, hf64, prompt: list[int], first_len: int, cached_blocks: int,
                        chunk: int) -> None:
    """``prompt[:first_len]`` prefilled cold in chunks of ``chunk``, then the whole prompt after the first one's
    ``cached_blocks`` blocks (a prefix-cache hit) in chunks too: each last position's logits within float32 error
    of transformers' float64 forward; no block held after."""
    ref = exact_logits(hf, hf64, prompt)
    a = new_seq(runner.pool, prompt[:first_len], seed=5)
    prefill_chunked(runner, a, chunk)
    Reference(ref.exact[first_len - 1], ref.bound).check(a.logits[0], f"chunks of {chunk}")
    b = new_seq(runner.pool, prompt, seed=6, prefix=a.table[:cached_blocks])
    prefill_chunked(runner, b, chunk)
    cached = cached_blocks * runner.pool.layout.block_size
    Reference(ref.exact[len(prompt) - 1], ref.bound).check(b.logits[0], f"chunks of {chunk} after {cached} cached")
    release(runner.pool, [a, b])
    assert_no_block_held(runner)


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_sliding_windows_decode_across_the_edge_in_batches_of_different_lengths(made, family):
    """Three requests decoded in one batch, teacher-forced: one from 3 tokens (inside the window) to 33, one
    from 12 (just past it) and one from 40; every step's logits against transformers' float64 ones."""
    runner, hf, hf64, _ = made(family)
    assert_batch_decodes_exact(runner, hf, hf64, [prompt_of(33, 30), prompt_of(42, 31), prompt_of(70, 32)],
                               [3, 12, 40], CHUNK, 30)


def assert_batch_decodes_exact(runner: ModelRunner, hf, hf64, prompts: list[list[int]], starts: list[int],
                               chunk: int, steps: int) -> None:
    """Each prompt's first ``starts[i]`` tokens prefilled in chunks of ``chunk``, then ``steps`` decode steps of
    all of them in one batch, teacher-forced: every step's logits within float32 error of transformers' float64
    forward; no block held after."""
    refs = [exact_logits(hf, hf64, p) for p in prompts]
    seqs = [new_seq(runner.pool, p[:n], seed=7 + i) for i, (p, n) in enumerate(zip(prompts, starts))]
    for s, ref, n in zip(seqs, refs, starts):
        prefill_chunked(runner, s, chunk)
        Reference(ref.exact[n - 1], ref.bound).check(s.logits[0], f"prefill of {n}")
    for step in range(steps):
        for s, p, n in zip(seqs, prompts, starts):
            s.out[-1] = p[n + step]
        decode(runner, seqs)
        for s, ref, n in zip(seqs, refs, starts):
            Reference(ref.exact[n + step], ref.bound).check(s.logits[-1], f"step at {n + step}")
    release(runner.pool, seqs)
    assert_no_block_held(runner)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "mixtral"])
def test_bfloat16_lean_forward_runs_close_to_transformers(tmp_path, family):
    """The lean forward's bfloat16 path (oneDNN linears, native norms and rotary where they build) with the
    family's own parts: q/k norms, fused projections, experts."""
    save_tiny(family, tmp_path, VOCAB)
    runner = ModelRunner(tmp_path, torch.bfloat16, num_blocks=16, max_seq_len=64, block_size=4)
    assert runner.fast_path_active
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    prompt = prompt_of(12, 5)
    a = new_seq(runner.pool, prompt[:10], seed=1)
    prefill_chunked(runner, a, 10)
    a.out[-1] = prompt[10]
    decode(runner, [a])
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt[:11]])).logits[0, [9, 10]].float()
    for ours, row in zip(a.logits, theirs):
        assert torch.corrcoef(torch.stack([ours, row]))[0, 1] > 0.99
    release(runner.pool, [a])
    assert_no_block_held(runner)


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_bfloat16_gemma_runs_close_to_transformers(tmp_path, family):
    """Gemma's bfloat16 general path (norms in float32 inside transformers' modules, soft-caps and the scaled
    embeddings in bfloat16, as transformers), past the window, in chunks and decoded."""
    save_tiny(family, tmp_path, VOCAB)
    assert_bfloat16_close(ModelRunner(tmp_path, torch.bfloat16, num_blocks=30, max_seq_len=64, block_size=4), tmp_path)


def assert_bfloat16_close(runner: ModelRunner, folder) -> None:
    """A bfloat16 runner's logits of a prompt prefilled in chunks of 7 and then decoded correlate > 0.99 with
    transformers' bfloat16 forward of the model in ``folder``; no block is held after."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    prompt = prompt_of(36, 6)
    a = new_seq(runner.pool, prompt[:30], seed=1)
    prefill_chunked(runner, a, 7)
    for pos in range(30, 35):
        a.out[-1] = prompt[pos]
        decode(runner, [a])
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt[:35]])).logits[0, 29:35].float()
    for ours, row in zip(a.logits, theirs):
        assert torch.corrcoef(torch.stack([ours, row]))[0, 1] > 0.99
    release(runner.pool, [a])
    assert_no_block_held(runner)


def test_kv_token_bytes_follow_the_head_dim_of_the_config(made):
    _, _, _, folder = made("qwen3")  # head_dim 32, not hidden / heads = 16
    assert kv_token_bytes(folder, torch.float32) == 2 * 2 * 2 * 32 * 4


def test_what_is_refused_at_start_says_why(tmp_path):
    from transformers import GPT2Config, Phi3Config, Qwen3Config

    GPT2Config().save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModel) as refused:
        ModelRunner(tmp_path / "gpt2", torch.float32, num_blocks=1, max_seq_len=64)
    assert "gpt2" in str(refused.value) and ", ".join(SUPPORTED_MODEL_TYPES) in str(refused.value)
    assert {"qwen3", "phi3", "mixtral", "qwen3_moe"} <= set(SUPPORTED_MODEL_TYPES)
    Phi3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, original_max_position_embeddings=64,
               rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
               ).save_pretrained(tmp_path / "phi3-128k")
    with pytest.raises(UnsupportedModel, match="longrope"):
        ModelRunner(tmp_path / "phi3-128k", torch.float32, num_blocks=1, max_seq_len=64)
    Phi3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, sliding_window=48
               ).save_pretrained(tmp_path / "phi3-window")
    with pytest.raises(UnsupportedModel, match="--max-model-len 48"):
        ModelRunner(tmp_path / "phi3-window", torch.float32, num_blocks=1, max_seq_len=64)
    Qwen3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, use_sliding_window=True,
                sliding_window=32).save_pretrained(tmp_path / "qwen3-window")
    with pytest.raises(UnsupportedModel, match="sliding"):
        ModelRunner(tmp_path / "qwen3-window", torch.float32, num_blocks=1, max_seq_len=64)


def test_sliding_windows_are_served_beside_global_layers_and_refused_in_every_layer(tmp_path):
    """Gemma's local layers (window < context) are served: its global layers see every position, so the pool
    keeps every token's KV anyway. A model whose every layer is windowed narrower than the context (Mistral's
    original configs) is refused, saying why and what context it can serve."""
    from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig, MistralConfig

    from xpyd.model.families import check_supported, layer_attention

    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert {"gemma2", "gemma3_text"} <= set(SUPPORTED_MODEL_TYPES)
    for config in (Gemma2Config(num_hidden_layers=4, sliding_window=16, **small),
                   Gemma3TextConfig(num_hidden_layers=6, sliding_window=16, **small)):
        check_supported(config, 4096)
        windows = [spec.window for spec in layer_attention(config)]
        assert None in windows and 16 in windows, windows
    MistralConfig(num_hidden_layers=1, sliding_window=32, **small).save_pretrained(tmp_path / "mistral-window")
    with pytest.raises(UnsupportedModel, match=r"sliding-window attention in every layer \(32 < context 64\).*"
                                               r"keeps every token's KV.*--max-model-len 32"):
        ModelRunner(tmp_path / "mistral-window", torch.float32, num_blocks=1, max_seq_len=64)
    check_supported(MistralConfig(num_hidden_layers=1, sliding_window=64, **small), 64)  # (never reached)
    all_local = Gemma2Config(num_hidden_layers=2, sliding_window=16, layer_types=["sliding_attention"] * 2, **small)
    with pytest.raises(UnsupportedModel, match="every layer"):
        check_supported(all_local, 64)
    with pytest.raises(UnsupportedModel, match="bidirectional"):
        check_supported(Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True, **small), 64)
    with pytest.raises(UnsupportedModel, match="'gemma3' is not supported .*'gemma3_text'"):
        check_supported(Gemma3Config(), 64)


def test_a_worker_refuses_an_unsupported_model_at_start_with_the_list(tmp_path):
    """A one-line error naming the type and every supported one, exit code 2, before any weights load."""
    import subprocess
    import sys

    from transformers import GPT2Config

    from tests.cluster import free_port

    GPT2Config(n_layer=1, n_embd=64, n_head=4).save_pretrained(tmp_path)
    r = subprocess.run([sys.executable, "-m", "xpyd", "colocated", "--model", str(tmp_path), "--port",
                        str(free_port())], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"model type 'gpt2' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("family", ["qwen3", "llama3", "phi3", "phi3-partial", "gemma2", "gemma3"])
def test_runner_on_a_device_keeps_every_step_of_the_familys_parts_there(tmp_path, family):
    """q/k norms, fused projections, partial rotary, windows and soft-caps: on another device ('meta' here), on
    every path that covers the family, no per-step tensor is made on the host and nothing comes back but the
    logits' device.
    (Not the mixtures of experts: transformers' grouped expert GEMM does not run on 'meta'.)"""
    from tests.integration.test_engine_device import tensor_devices

    save_tiny(family, tmp_path, VOCAB)
    runner = ModelRunner(tmp_path, torch.float32, num_blocks=8, max_seq_len=64, block_size=4, device="meta")
    assert tensor_devices(runner.model) == {"meta"} and runner.pool.tensor.device.type == "meta"
    for path in _paths(runner):
        assert_steps_stay_on_the_device(runner, path)


def assert_steps_stay_on_the_device(runner: ModelRunner, what: str = "") -> None:
    """Prefills (cold, and after another request's cached block) and a batched decode step on a 'meta' runner
    make no per-step tensor on the host and bring nothing back but logits on the device; no block held after."""
    from tests.integration.test_engine_device import DeviceLedger

    tables = [runner.pool.blocks.allocate(2), runner.pool.blocks.allocate(1)]
    with DeviceLedger(fill=0) as ledger:
        runner.prefill(tables[0], [1, 5, 9, 2, 7])
        runner.prefill(tables[1], [4, 4, 8])
        runner.pool.blocks.acquire(tables[0][:1])
        tables.append(tables[0][:1] + runner.pool.blocks.allocate(1))
        runner.prefill(tables[2], [1, 5, 9, 2, 6, 6], start=4)  # after the first one's first block
        logits = runner.decode(tables, [3, 6, 9], [5, 3, 6])
    assert logits.device.type == "meta" and logits.shape == (3, runner.vocab_size)
    assert ledger.mixed == [], (what, ledger.mixed)
    assert ledger.to_host() == [], (what, ledger.copies)
    for table in tables:
        runner.pool.blocks.release(table)
    assert runner.pool.num_used == 0
