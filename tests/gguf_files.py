"""Tiny GGUF files of the families transformers reads GGUF for, written from a tiny HF model the way llama.cpp's
converter lays them out (tensor names from gguf-py's map; llama's q/k rows permuted; float32 tensors, so
nothing is lost), with a byte-level BPE tokenizer of `VOCAB` tokens (the 256 bytes, one merge, and an
end-of-text token: the models' vocabulary must be that size). Gemma's as llama.cpp's converter writes them too:
its RMSNorm weights shifted by +1 (transformers' reader takes the 1 off again), the lm_head left out (tied to the
embeddings), the window and the soft-caps as metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB = 258
EOS = 257
ARCHES = {"llama": "llama", "qwen3": "qwen3", "phi3": "phi3", "qwen3_moe": "qwen3moe",  # HF model_type -> GGUF
          "gemma2": "gemma2", "gemma3_text": "gemma3"}
_GEMMA = ("gemma2", "gemma3")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for llama's q/k projections (transformers' GGUF reader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, rope_freqs: np.ndarray | None = None) -> Path:
    """``model`` (llama, qwen3 or phi3, float32) as a GGUF at ``path``; ``rope_freqs``: the per-frequency
    factors llama.cpp stores for Llama 3.1's rope scaling, as its converter writes them."""
    import gguf

    config = model.config
    arch = ARCHES[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny " + config.model_type)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope["full_attention"] if "full_attention" in rope else rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if hasattr(config, "num_experts"):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch in _GEMMA:
        writer.add_sliding_window(config.sliding_window)
        for cap, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                         ("final_logit_softcapping", writer.add_final_logit_softcapping)):
            if getattr(config, cap, None) is not None:
                add(getattr(config, cap))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _byte_tokenizer(writer)

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     config.num_hidden_layers)
    for hf_name, tensor in _split_experts(model.state_dict()).items():
        base, suffix = hf_name.rsplit(".", 1)
        if base == "lm_head" and getattr(config, "tie_word_embeddings", False):
            continue  # (the embeddings)
        name = names.get_name(base)
        assert name is not None, hf_name
        data = tensor.detach().float().numpy().copy()
        if arch == "llama" and base.endswith("q_proj"):
            data = _permute(data, config.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            data = _permute(data, config.num_key_value_heads)
        elif arch in _GEMMA and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        writer.add_tensor(f"{name}.{suffix}", data)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _split_experts(state: dict) -> dict:
    """transformers' stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as llama.cpp's three
    per-kind stacks, named as gguf-py's map expects them."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            stem = name.removesuffix("gate_up_proj")
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return out


def _byte_tokenizer(writer) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([chars[b] for b in range(256)] + ["ab", "<|endoftext|>"])
    writer.add_token_types([1] * 257 + [3])  # normal, then control
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(EOS)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(EOS)
