"""The model families the engine serves, what it refuses at start, and the attention input of each.

Every family here is a decoder of pre-norm layers (RMSNorm, attention with rotary positions, an MLP or a
mixture of experts) whose KV is one K and one V vector per token, KV head and layer: the pool's layout
(kv_pool.py) fits all of them. They differ in how a layer makes q, k and v:
- llama, mistral, qwen2, mixtral: q_proj, k_proj, v_proj (qwen2: with biases);
- qwen3, qwen3_moe: the same, then an RMSNorm over each head of q and of k (q_norm, k_norm) before rotary;
- phi3: one fused qkv_proj, and rotary over the first ``partial_rotary_factor`` of each head.
and in the MLP (mixtral, qwen3_moe: sparse experts; phi3: a fused gate_up_proj), which the general path
calls as transformers' module whatever it is.

`check_supported` refuses, before the weights load, a model type outside `SUPPORTED_MODEL_TYPES`, sliding-window
attention narrower than the context (its KV would have to be dropped as it leaves the window), and rotary
scalings whose frequencies depend on the sequence length (longrope: a batch's would follow its longest request).
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe")
# (sliding_window is set in their configs but used only with use_sliding_window)
_WINDOW_WHEN_ASKED = ("qwen2", "qwen3", "qwen3_moe")
_LENGTH_DEPENDENT_ROPE = ("longrope", "su")


class UnsupportedModel(ValueError):
    pass


def rope_type(config) -> str:
    """The config's rotary scaling type ("default" when none): transformers' ``rope_parameters`` (or an older
    config's ``rope_scaling``)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if isinstance(params, dict) and ("rope_type" in params or "type" in params):
            return str(params.get("rope_type", params.get("type")))
    return "default"


def check_model_type(config) -> None:
    """UnsupportedModel, listing what is supported, for a model type outside `SUPPORTED_MODEL_TYPES`."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def check_supported(config, max_model_len: int) -> None:
    """UnsupportedModel, saying why and what is supported, for a model this engine cannot serve exactly."""
    check_model_type(config)
    model_type = config.model_type
    window = getattr(config, "sliding_window", None)
    if model_type in _WINDOW_WHEN_ASKED and not getattr(config, "use_sliding_window", False):
        window = None
    if window is not None and window < max_model_len:
        raise UnsupportedModel(
            f"{model_type} with sliding-window attention ({window} < context {max_model_len}) is not supported; "
            f"serve it with --max-model-len {window} or less"
        )
    rope = rope_type(config)
    if rope in _LENGTH_DEPENDENT_ROPE:
        raise UnsupportedModel(
            f"{model_type} with rope scaling {rope!r} is not supported (its frequencies change with the sequence "
            f"length); the short-context variants without rope scaling are"
        )


def project_qkv(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's q [batch, heads, seq, head_dim] and k, v [batch, kv_heads, seq, head_dim] from its normed input
    ``x`` [batch, seq, hidden], q and k rotated by ``cos``/``sin`` [batch, seq, rotary dim], as the family's
    attention module computes them."""
    batch, seq, _ = x.shape
    if hasattr(attn, "qkv_proj"):
        q, k, v = attn.qkv_proj(x).split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = q.view(batch, seq, num_heads, head_dim)
    k = k.view(batch, seq, num_kv_heads, head_dim)
    v = v.view(batch, seq, num_kv_heads, head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions on q and k [batch, heads, seq, head_dim]; over the first cos.shape[-1] of each head when
    that is less (partial rotary: the rest passes through), as transformers' phi3 does."""
    dim = cos.shape[-1]
    if dim == q.shape[-1]:
        return apply_rotary_pos_emb(q, k, cos, sin)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = []
    for t in (q, k):
        part, rest = t[..., :dim], t[..., dim:]
        rotated.append(torch.cat([(part * cos) + (rotate_half(part) * sin), rest], dim=-1))
    return rotated[0], rotated[1]
