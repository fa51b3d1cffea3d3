"""Tiny random models of each family the engine serves, saved as safetensors folders (the tests' models).

Each is a few layers of hidden size 64 with a fixed seed, weights drawn with a large initializer range (0.5)
so the outputs depend on the context, and every RMSNorm's weight drawn too (transformers starts them at
one, which would hide a norm applied with the wrong weight). What makes each family itself:
- qwen3: q/k norms over each head, and a head_dim that is not hidden / heads;
- llama3: Llama with rope scaling "llama3", its original context (32) shorter than the prompts;
- phi3: fused qkv_proj and gate_up_proj (``partial`` : rotary over half of each head, as Phi-4-mini);
- mixtral: 4 experts, 2 per token, in every layer;
- qwen3_moe: q/k norms, 4 experts, 2 per token, the last layer a dense MLP (mlp_only_layers).
The sliding-window families (`SLIDING_FAMILIES`), each with local and global layers, a window (10; 9) shorter
than the tests' prompts, and a query_pre_attn_scalar that is not the head size:
- gemma2: layers local, global, local; attention scores soft-capped at 8 and the final logits at 12 (both bite
  with these weights);
- gemma3: q/k norms, layers local, global, local; the local layers' rotary base (100) far from the global ones'
  (linear rope scaling x2 over base 10000); final logits soft-capped at 15.
Their RMSNorms scale by (1 + weight), so their weights are drawn around zero.
The latent-attention families (`LATENT_FAMILIES`: DeepSeek-V2's multi-head latent attention, whose KV is one
latent per token and layer), each 3 layers, the first dense (first_k_dense_replace 1) and the others mixtures of
4 routed experts, 2 per token, and a shared one; a compressed KV of 32, a rotary key part of 8 (interleaved
pairs), a non-rotary one of 16 and values of 24 per head:
- deepseek_v2: queries through a low-rank projection (q_lora_rank 24) and its norm;
- deepseek_v2-q: queries through one q_proj (q_lora_rank None), and yarn rope scaling (its softmax scale's mscale
  bites);
- deepseek_v3: as deepseek_v2, its rotary pairs interleaved (rope_interleave), its experts routed by sigmoid scores
  in 2 groups (1 chosen), with a drawn score correction bias.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen3", "llama3", "phi3", "mixtral", "qwen3_moe")
SLIDING_FAMILIES = ("gemma2", "gemma3")
LATENT_FAMILIES = ("deepseek_v2", "deepseek_v3")
_GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


def tiny_config(family: str, vocab_size: int, max_positions: int = 256, **extra):
    """The family's config (``extra``: fields to set or override, e.g. the tokenizer's bos/eos/pad ids)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  initializer_range=0.5, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**{**common, "head_dim": 32, **extra})
    if family == "llama3":
        return tf.LlamaConfig(**{**common, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, **extra})
    if family in ("phi3", "phi3-partial"):
        # (phi3's default token ids, 32000 and up, lie outside a small vocabulary)
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if family == "phi3-partial":
            rope["partial_rotary_factor"] = 0.5
        return tf.Phi3Config(**{**common, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                                "sliding_window": None, "rope_parameters": rope, **extra})
    if family == "mixtral":
        return tf.MixtralConfig(**{**common, "num_local_experts": 4, "num_experts_per_tok": 2, **extra})
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**{**common, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                    "mlp_only_layers": [1], "norm_topk_prob": True, **extra})
    if family == "gemma2":
        return tf.Gemma2Config(**{**common, "num_hidden_layers": 3, "layer_types": _GEMMA_LAYERS, "head_dim": 16,
                                  "query_pre_attn_scalar": 24, "sliding_window": 10, "attn_logit_softcapping": 8.0,
                                  "final_logit_softcapping": 12.0, "tie_word_embeddings": True, **extra})
    if family == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
        return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3, "layer_types": _GEMMA_LAYERS, "head_dim": 32,
                                      "query_pre_attn_scalar": 48, "sliding_window": 9, "rope_parameters": rope,
                                      "final_logit_softcapping": 15.0, "tie_word_embeddings": True, **extra})
    if family in ("deepseek_v2", "deepseek_v2-q"):
        latent = dict(num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4,
                      num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=48, kv_lora_rank=32,
                      q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
                      eos_token_id=None)  # (its default, 2, would stop generate where the tests decode on)
        if family == "deepseek_v2-q":
            latent.update(q_lora_rank=None, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
        return tf.DeepseekV2Config(**{**common, **latent, **extra})
    if family == "deepseek_v3":
        latent = dict(num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4,
                      num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=48, kv_lora_rank=32,
                      q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, n_group=2,
                      topk_group=1, routed_scaling_factor=2.5, eos_token_id=None)
        return tf.DeepseekV3Config(**{**common, **latent, **extra})
    raise ValueError(f"no tiny model for {family!r}")


def tiny_model(family: str, vocab_size: int, max_positions: int = 256, seed: int = 0, **extra):
    """The family's tiny model (float32, eval mode), its weights drawn from ``seed``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, vocab_size, max_positions, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    around = 0.0 if family in SLIDING_FAMILIES else 1.0  # (Gemma's norms scale by 1 + weight)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(around - 0.5, around + 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (DeepSeek-V3's router: zeros would hide it)
                buffer.uniform_(-0.2, 0.2)
    return model


def save_tiny(family: str, out: Path, vocab_size: int, max_positions: int = 256, seed: int = 0, tokenizer=None,
              **extra):
    """`tiny_model` saved as safetensors in ``out`` (with ``tokenizer`` when given); the model."""
    if tokenizer is not None:
        extra = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, **extra)
    model = tiny_model(family, vocab_size, max_positions, seed, **extra)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return model


def float64_copy(model):
    """``model`` in float64, for exact references (experts run eagerly: the grouped GEMM has no float64)."""
    import copy

    exact = copy.deepcopy(model).double().eval()
    if _has_experts(exact):
        exact.set_experts_implementation("eager")
    return exact


def _has_experts(model) -> bool:
    return any(type(m).__name__.endswith("Experts") for m in model.modules())
