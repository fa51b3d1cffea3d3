"""The model families the engine serves, what it refuses at start, and how each one's layers compute.

Every family here is a decoder of pre-norm layers (RMSNorm, attention with rotary positions, an MLP or a
mixture of experts) whose KV is one K and one V vector per token, KV head and layer (the latent-attention ones
aside: below): the pool's layout (kv_pool.py) fits all of them. They differ in how a layer makes q, k and v:
- llama, mistral, qwen2, mixtral: q_proj, k_proj, v_proj (qwen2: with biases);
- qwen3, qwen3_moe, gemma3_text: the same, then an RMSNorm over each head of q and of k (q_norm, k_norm) before
  rotary;
- phi3: one fused qkv_proj, and rotary over the first ``partial_rotary_factor`` of each head.
in the MLP (mixtral, qwen3_moe: sparse experts; phi3: a fused gate_up_proj), which the general path calls as
transformers' module whatever it is; and in how a layer attends (`layer_attention`) and ends (`finish_layer`):
- gemma2, gemma3_text: scores scaled by query_pre_attn_scalar ** -0.5; layers of ``layer_types``
  "sliding_attention" see only the last ``sliding_window`` positions, "full_attention" ones every position;
  RMSNorms after attention and around the MLP too; gemma2 soft-caps the attention scores
  (attn_logit_softcapping: transformers' Gemma 3 attention does not, whatever its config says); both soft-cap
  the final logits when final_logit_softcapping is set (`final_softcap`); gemma3_text's local layers rotate
  with their own base (rope_local_base_freq: one rotary table per layer type). Their embeddings are scaled by
  sqrt(hidden_size) inside transformers' embedding module.

Sliding windows and the KV pool: the engine keeps every token's KV in every layer (one block holds all layers'
rows of its tokens). A block could be freed only once its tokens left every layer's window; Gemma's global
layers see every position, so no block ever does, and nothing is freed early. Local layers read only the blocks
their window reaches. A model whose every layer is windowed, narrower than the context, is refused: its KV
would outlive the window in the pool, which it could have dropped, and the lean forward does not mask windows.

Latent attention (deepseek_v2, deepseek_v3: DeepSeek's multi-head latent attention; V3's differs in its rotary
embedding's form and its router) keeps no K and V per head: its pool
holds one latent per token and layer (`latent_attention`, a latent KV layout). Its softmax scale is the query
head size's (non-rotary and rotary parts) ** -0.5, times yarn's mscale squared where the rope scaling is yarn with
mscale_all_dim (`yarn_apply_mscale`, as transformers); its layers' MLPs (dense for the first
first_k_dense_replace, then routed experts beside shared ones; V3's routed by sigmoid scores within groups) run
as transformers' modules.

`check_supported` refuses, before the weights load, a model type outside `SUPPORTED_MODEL_TYPES` (the multimodal
"gemma3" wrapper included: its text model, "gemma3_text", is served), such all-windowed attention, bidirectional
attention (embedding models), and rotary scalings whose frequencies depend on the sequence length (longrope: a
batch's would follow its longest request).
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

from xpyd.model.layer_attention import LayerAttention

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text",
                         "deepseek_v2", "deepseek_v3")
# multi-head latent attention: one latent per token and layer in the pool (latent_attention)
_LATENT = ("deepseek_v2", "deepseek_v3")
# (sliding_window is set in their configs but used only with use_sliding_window)
_WINDOW_WHEN_ASKED = ("qwen2", "qwen3", "qwen3_moe")
# windows per layer (config.layer_types), "sliding_attention" or "full_attention"
_LAYER_TYPED = ("gemma2", "gemma3_text")
_SLIDING = "sliding_attention"
_LENGTH_DEPENDENT_ROPE = ("longrope", "su")


class UnsupportedModel(ValueError):
    pass


def rope_types(config) -> tuple[str, ...]:
    """The config's rotary scaling types ("default" when none): transformers' ``rope_parameters`` (or an older
    config's ``rope_scaling``), one per layer type where the config has one table per layer type (Gemma 3)."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if not isinstance(params, dict):
            continue
        if "rope_type" in params or "type" in params:
            return (str(params.get("rope_type", params.get("type"))),)
        per_type = [p for p in params.values() if isinstance(p, dict) and ("rope_type" in p or "type" in p)]
        if per_type:
            return tuple(str(p.get("rope_type", p.get("type"))) for p in per_type)
    return ("default",)


def check_model_type(config) -> None:
    """UnsupportedModel, listing what is supported, for a model type outside `SUPPORTED_MODEL_TYPES`."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = ""
        if model_type == "gemma3":
            hint = " (the multimodal Gemma 3; its text-only checkpoints, model type 'gemma3_text', are)"
        raise UnsupportedModel(
            f"model type {model_type!r} is not supported{hint}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def check_supported(config, max_model_len: int) -> None:
    """UnsupportedModel, saying why and what is supported, for a model this engine cannot serve exactly."""
    check_model_type(config)
    model_type = config.model_type
    windows = [spec.window for spec in layer_attention(config)]
    narrow = [w for w in windows if w is not None and w < max_model_len]
    if narrow and len(narrow) == len(windows):
        window = max(narrow)
        raise UnsupportedModel(
            f"{model_type} with sliding-window attention in every layer ({window} < context {max_model_len}) is not "
            f"supported: the engine keeps every token's KV (it serves windows beside global layers, as Gemma's) and "
            f"would hold what falls out of the window; serve it with --max-model-len {window} or less"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{model_type} with bidirectional attention (an embedding model) is not supported")
    for rope in rope_types(config):
        if rope in _LENGTH_DEPENDENT_ROPE:
            raise UnsupportedModel(
                f"{model_type} with rope scaling {rope!r} is not supported (its frequencies change with the sequence "
                f"length); the short-context variants without rope scaling are"
            )


def is_latent(config) -> bool:
    """Whether the model's KV is one latent per token and layer (multi-head latent attention)."""
    return config.model_type in _LATENT


def layer_attention(config) -> tuple[LayerAttention, ...]:
    """How each layer attends, as the family's transformers attention module does (a supported model type)."""
    if is_latent(config):
        scale = yarn_apply_mscale(config.rope_parameters, (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5)
        return (LayerAttention(scale=scale),) * config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    model_type = config.model_type
    if model_type in _LAYER_TYPED:
        scale = config.query_pre_attn_scalar**-0.5
        softcap = getattr(config, "attn_logit_softcapping", None) if model_type == "gemma2" else None
        kinds = list(config.layer_types)[:layers]
        return tuple(LayerAttention(scale=scale, window=config.sliding_window if kind == _SLIDING else None,
                                    softcap=softcap, rotary=kind if model_type == "gemma3_text" else None)
                     for kind in kinds)
    window = getattr(config, "sliding_window", None)
    if model_type in _WINDOW_WHEN_ASKED and not getattr(config, "use_sliding_window", False):
        window = None
    return (LayerAttention(scale=head_dim**-0.5, window=window),) * layers


def final_softcap(config) -> float | None:
    """The cap of the final logits' tanh soft-capping (gemma2, gemma3_text), None for none."""
    return getattr(config, "final_logit_softcapping", None) if config.model_type in _LAYER_TYPED else None


def finish_layer(layer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """A layer's output from its input ``hidden`` [batch, seq, hidden] and its attention's heads ``attn``
    [batch, seq, heads * head_dim]: o_proj and the MLP, each added to the residual (Gemma: each normed before it
    is added, and the MLP's input normed by pre_feedforward_layernorm)."""
    out = layer.self_attn.o_proj(attn)
    if hasattr(layer, "pre_feedforward_layernorm"):
        hidden = hidden + layer.post_attention_layernorm(out)
        return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
    hidden = hidden + out
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


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
