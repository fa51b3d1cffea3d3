"""Which models the lean forward (`llama_fast.FastLlama`) computes exactly as transformers does, and the names under
which it finds their linear layers: `why_not_covered` says why not for the others, which keep the general path."""

from __future__ import annotations

import torch


def why_not_covered(model) -> str | None:
    """None when `FastLlama` can run this model exactly like transformers; otherwise the reason."""
    config = model.config
    if getattr(config, "kv_lora_rank", None) is not None:
        return "multi-head latent attention (a latent per token in the pool, not K and V): the general path serves it"
    if any(hasattr(layer, "pre_feedforward_layernorm") for layer in getattr(model.model, "layers", ())):
        return ("Gemma's layers (norms after attention and around the MLP, soft-capping, local and global layers): "
                "the general path serves them")
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} (only silu)"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        return "no shared rotary embedding"
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if "dynamic" in rope_type or "longrope" in rope_type:
        return f"rope type {rope_type!r} depends on the sequence length"
    if not _is_rms_norm(inner.norm):
        return "final norm is not RMSNorm"
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        return "a rotary embedding without inv_freq"
    rotary_dim = 2 * inv_freq.shape[-1]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rotary_dim != head_dim:
        return f"partial rotary ({rotary_dim} of {head_dim} dimensions)"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for names in (QKV_NAMES, (("o_proj",),)):
            if not _plain(attn, names):
                return f"attention without plain {_either(names)}"
        if not is_sparse_moe(mlp):
            for names in (GATE_UP_NAMES, (("down_proj",),)):
                if not _plain(mlp, names):
                    return f"MLP without plain {_either(names)}"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
            if not all(_is_rms_norm(n) and n.weight.shape == (head_dim,) for n in norms):
                return "q/k norms that are not RMSNorms over each head"
        if not (_is_rms_norm(layer.input_layernorm) and _is_rms_norm(layer.post_attention_layernorm)):
            return "layer norms are not RMSNorm"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention"
    return None


QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("qkv_proj",))  # separate, or fused as phi3's
GATE_UP_NAMES = (("gate_proj", "up_proj"), ("gate_up_proj",))


def _plain(module, options) -> bool:
    """The module has plain Linear layers under all the names of one of ``options`` (tuples of names)."""
    return any(all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in option) for option in options)


def is_sparse_moe(mlp) -> bool:
    """A mixture-of-experts block (mixtral's, qwen3_moe's): a router (``gate``) and the ``experts``, called
    as the module on [1, tokens, hidden]."""
    return type(mlp).__name__.endswith("SparseMoeBlock") and hasattr(mlp, "gate") and hasattr(mlp, "experts")


def _either(options) -> str:
    return " or ".join("/".join(option) for option in options)


def linears(module, options) -> list:
    """The Linear layers of the first of ``options`` (tuples of names) the module has, in order."""
    for option in options:
        if all(hasattr(module, n) for n in option):
            return [getattr(module, n) for n in option]
    raise ValueError(f"{type(module).__name__} has none of {options}")


def _is_rms_norm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
