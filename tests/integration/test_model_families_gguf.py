"""GGUF files of the families transformers reads GGUF for (tests/gguf_files.py: float32 tensors, llama.cpp's
layout, a byte-level tokenizer) through the loader's conversion: the converted folder holds the
original weights, and the runner greedy-decodes from it what transformers generates from the original model,
a second request after the first one's cached blocks included. Gemma's as llama.cpp writes them (norms shifted by
one, soft-caps as metadata, no query_pre_attn_scalar: the tiny models' is their head size, as llama.cpp assumes
below 27B), gemma3 with its released layout (5 local : 1 global layers, rotary bases 10,000 and 1,000,000).
A GGUF whose rope scaling the conversion would drop, or that lacks weights of its model, is refused, saying why;
so is a deepseek2 one (transformers reads no DeepSeek-V2 GGUF)."""

from __future__ import annotations

import pytest
import torch

from tests.families import SLIDING_FAMILIES, float64_copy, tiny_model
from tests.gguf_files import EOS, VOCAB, write_gguf
from tests.integration.test_model_runner import (assert_exact_greedy, assert_no_block_held, decode,
                                                 exact_last_logits, hf_generate, new_seq, prefill_chunked, release)
from xpyd.model.loader import ensure_converted
from xpyd.model.runner import ModelRunner

IDS = dict(bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
_GEMMA_COMPUTES_WITH = ("head_dim", "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings")

torch.set_num_threads(1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XPYD_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("family,extra", [
    ("qwen3", {}), ("qwen3", {"head_dim": 128}), ("phi3", {}),
    ("qwen3_moe", {"mlp_only_layers": [], "moe_intermediate_size": 40}),  # (llama.cpp's qwen3moe: experts everywhere)
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma3", {"query_pre_attn_scalar": 32, "num_hidden_layers": 6, "layer_types": None, "rope_parameters": None,
                "final_logit_softcapping": None}),
], ids=["qwen3-head-dim-32", "qwen3-head-dim-128", "phi3", "qwen3_moe", "gemma2", "gemma3"])
def test_converted_gguf_serves_what_the_original_model_generates(tmp_path, cache, family, extra):
    hf = tiny_model(family, VOCAB, 256, **IDS, **extra)
    if family in SLIDING_FAMILIES:
        _norms_on_a_grid(hf)
    converted = ensure_converted(str(write_gguf(hf, tmp_path / f"tiny-{family}.gguf")),
                                 progress=False).path
    runner = ModelRunner(converted, torch.float32, num_blocks=40, max_seq_len=128, block_size=5)
    theirs = hf.state_dict()
    ours = runner.model.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    for field in _GEMMA_COMPUTES_WITH if family in SLIDING_FAMILIES else ():  # (from the metadata or llama.cpp's rules)
        assert getattr(runner.config, field) == getattr(hf.config, field), field
    a_prompt = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    b_prompt = a_prompt[:15] + [17, 200, 23]
    n = 10
    expected = [hf_generate(hf, p, n) for p in (a_prompt, b_prompt)]
    hf64 = float64_copy(hf)
    for p, tokens in zip((a_prompt, b_prompt), expected):
        assert_exact_greedy(hf, hf64, p, tokens, family)
    a = new_seq(runner.pool, a_prompt, seed=1)
    prefill_chunked(runner, a, 8)
    exact_last_logits(hf, hf64, a_prompt).check(a.logits[0], "a's prefill")  # (not only their argmax)
    b = new_seq(runner.pool, b_prompt, seed=2, prefix=a.table[:3])
    prefill_chunked(runner, b, 8)
    try:
        while len(b.out) < n:
            decode(runner, [a, b])
    finally:
        release(runner.pool, [a, b])
    assert [a.out, b.out] == expected
    assert_no_block_held(runner)


def _norms_on_a_grid(model) -> None:
    """Norm weights on a 2**-16 grid: llama.cpp stores Gemma's as 1 + weight, which then rounds nothing away."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.round(param * 2**16) / 2**16)


def test_gguf_whose_rope_scaling_the_conversion_drops_is_refused(tmp_path, cache):
    import numpy as np

    hf = tiny_model("llama3", VOCAB, 256, **IDS)
    freqs = np.linspace(1.0, 8.0, 8)  # what llama.cpp's converter writes for rope_type "llama3"
    path = write_gguf(hf, tmp_path / "tiny-llama3.gguf", rope_freqs=freqs)
    with pytest.raises(ValueError, match="rope_freqs.*safetensors folder"):
        ensure_converted(str(path))


def test_gguf_lacking_weights_of_its_model_is_refused(tmp_path, cache, monkeypatch):
    """transformers starts missing weights from random values (a Mixtral GGUF, whose experts the llama reader
    does not know, would serve noise): the conversion refuses, naming them."""
    import tests.gguf_files as files

    split = files._split_experts
    monkeypatch.setattr(files, "_split_experts", lambda state: {
        name: t for name, t in split(state).items() if name != "model.layers.1.mlp.gate_proj.weight"})
    path = write_gguf(tiny_model("qwen3", VOCAB, 256, **IDS), tmp_path / "tiny-qwen3.gguf")
    with pytest.raises(ValueError, match="lacks weights a qwen3 model needs: model.layers.1.mlp.gate_proj.weight"):
        ensure_converted(str(path))


def test_a_deepseek2_gguf_is_refused_naming_its_architecture(tmp_path, cache):
    """transformers' GGUF reader has no deepseek2 (DeepSeek-V2's latent attention): serve its safetensors folder."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny-deepseek2.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture deepseek2 is not supported"):
        ensure_converted(str(path))
