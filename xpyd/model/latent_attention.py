"""Multi-head latent attention (DeepSeek-V2 and V3: MLA) over the paged pool, as transformers' attention modules.

A layer projects each token's normed input to a compressed KV (kv_a_proj_with_mqa: ``kv_lora_rank`` values,
then kv_a_layernorm) and one rotary key part shared by every head (``qk_rope_head_dim``, rotated in interleaved
pairs); those two, side by side, are the token's latent: what the pool keeps for the layer (a latent `KVLayout`,
one vector per token and layer, not a K and a V per head). Attending, a layer reads the latents its queries
see, up-projects them (kv_b_proj) to each head's non-rotary key part and value, and appends the shared rotary
part to every head's key: the plain computation, not the absorbed one (q through kv_b_proj), so every position
computes the keys and values transformers does. Queries come from q_proj, or through a low-rank q_a_proj,
q_a_layernorm, q_b_proj; each head's last ``qk_rope_head_dim`` are rotated as the key part is.

DeepSeek-V3's attention is V2's but for its rotary embedding, (cos, sin) rather than complex: with
``rope_interleave`` (its default) the interleaved pairs come out de-interleaved, halves rotated as rotate_half
does, and that is what its cache, and so the pool, keeps; without, the plain rotate_half rotation.

The pool is `[num_blocks, 1, num_layers, 1, block_size, latent_dim]`; token t of a request sits in block
`table[t // block_size]`, row `t % block_size` (as `paged`'s rows). An int8 pool (`--kv-cache-dtype int8`,
`kv_int8`) keeps each latent as latent_dim codes and the row's float16 scale (`latent_dim + 2` bytes); a layer
then attends over its own tokens' latents as stored, as it reads the cached ones (fp8's per-head scales have no
head to scale here: refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb, apply_rotary_pos_emb_interleave

from xpyd.model.kv_int8 import decode_rows, encode_rows
from xpyd.model.kv_layout import KVLayout
from xpyd.model.layer_attention import LayerAttention, attend
from xpyd.model.paged import RowIndex


@dataclass(frozen=True, slots=True)
class LatentShape:
    """The sizes of a model's latent attention (its config's)."""

    num_heads: int
    kv_lora_rank: int  # the compressed KV
    qk_nope_head_dim: int  # each head's key part without rotary
    qk_rope_head_dim: int  # the rotary key part (one for every head) and each query's rotary part
    v_head_dim: int

    @classmethod
    def of(cls, config) -> LatentShape:
        return cls(config.num_attention_heads, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                   config.v_head_dim)

    @property
    def latent_dim(self) -> int:
        """A token's latent in one layer: the compressed KV, then the rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def layout(self, num_layers: int, dtype: str, num_blocks: int, block_size: int) -> KVLayout:
        return KVLayout(num_layers=num_layers, num_kv_heads=1, head_dim=self.latent_dim, dtype=dtype,
                        num_blocks=num_blocks, block_size=block_size, kind="latent")


def project(attn, x: torch.Tensor, rotation: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
            shape: LatentShape) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's queries [batch, heads, seq, qk head dim] and latents [batch, seq, latent_dim] from its normed
    input ``x`` [batch, seq, hidden], rotated by ``rotation`` (the model's rotary embedding of the positions:
    complex [batch, seq, qk_rope_head_dim / 2] for V2, (cos, sin) [batch, seq, qk_rope_head_dim] for V3)."""
    batch, seq, _ = x.shape
    q_proj = getattr(attn, "q_proj", None)  # (None where queries go through q_lora_rank)
    q = q_proj(x) if q_proj is not None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(batch, seq, shape.num_heads, -1).transpose(1, 2)
    q_nope, q_rope = q.split([shape.qk_nope_head_dim, shape.qk_rope_head_dim], dim=-1)
    compressed, k_rope = attn.kv_a_proj_with_mqa(x).split([shape.kv_lora_rank, shape.qk_rope_head_dim], dim=-1)
    if isinstance(rotation, tuple):
        rotate = apply_rotary_pos_emb_interleave if attn.config.rope_interleave else apply_rotary_pos_emb
        q_rope, k_rope = rotate(q_rope, k_rope.unsqueeze(1), *rotation)
    else:
        q_rope, k_rope = apply_rotary_emb(q_rope, k_rope.unsqueeze(1), rotation)
    return torch.cat((q_nope, q_rope), dim=-1), torch.cat((attn.kv_a_layernorm(compressed), k_rope[:, 0]), dim=-1)


def expand(attn, latents: torch.Tensor, shape: LatentShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [batch, heads, L, qk head dim] and values [batch, heads, L, v_head_dim] of latents [batch, L,
    latent_dim]: kv_b_proj's per-head key parts and values, each key ending with the shared rotary part."""
    batch, length, _ = latents.shape
    compressed, k_rope = latents.split([shape.kv_lora_rank, shape.qk_rope_head_dim], dim=-1)
    kv = attn.kv_b_proj(compressed).view(batch, length, shape.num_heads, -1).transpose(1, 2)
    k_nope, v = kv.split([shape.qk_nope_head_dim, shape.v_head_dim], dim=-1)
    k_rope = k_rope.unsqueeze(1).expand(-1, shape.num_heads, -1, -1)
    return torch.cat((k_nope, k_rope), dim=-1), v


def write(pool: torch.Tensor, layer: int, where: RowIndex, latents: torch.Tensor) -> torch.Tensor:
    """latents [T, latent_dim]: T tokens' latents into their rows of ``layer``; returns them as the pool now
    holds them (an int8 pool: the values of their rows, what a later read gives)."""
    if pool.dtype == torch.uint8:
        rows = encode_rows(latents)
        pool[where.blocks, 0, layer, 0, where.rows] = rows
        return decode_rows(rows, latents.dtype)
    pool[where.blocks, 0, layer, 0, where.rows] = latents
    return latents


def gather(pool: torch.Tensor, layer: int, tables: torch.Tensor, length: int, first: int = 0,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """The latents of ``layer`` for positions [first, length) of each row of ``tables`` [B, nb]: a fresh
    [B, length - first, latent_dim] tensor, read from the blocks that hold those positions only (from an int8
    pool, their values in ``dtype``)."""
    block_size, dim = pool.shape[4], pool.shape[5]
    skipped = first // block_size
    tables = tables[:, skipped : -(-length // block_size)]
    batch, nb = tables.shape
    rows = pool[:, 0, layer, 0][tables].reshape(batch, nb * block_size, dim)  # a copy
    rows = rows[:, first - skipped * block_size : length - skipped * block_size]
    return decode_rows(rows, dtype) if pool.dtype == torch.uint8 else rows


def prefill_layer(layer, spec: LayerAttention, shape: LatentShape, pool: torch.Tensor, index: int,
                  hidden: torch.Tensor, rotation: torch.Tensor, where: RowIndex, prefix: torch.Tensor | None,
                  start: int) -> torch.Tensor:
    """One layer's attention for one request's tokens [start, start + m) (``hidden`` [1, m, hidden], the
    layer's input): their latents written at ``where``, the cached ones of [first visible, start) read through
    ``prefix`` [1, nb]; the heads' outputs [1, heads, m, v_head_dim]."""
    attn = layer.self_attn
    q, latents = project(attn, layer.input_layernorm(hidden), rotation, shape)
    latents = write(pool, index, where, latents[0]).unsqueeze(0)  # (as stored: what later chunks read of them)
    first = spec.first_visible(start)
    if first < start:
        latents = torch.cat((gather(pool, index, prefix, start, first=first, dtype=latents.dtype), latents), dim=1)
    k, v = expand(attn, latents, shape)
    return attend(q, k, v, spec, q_start=start, k_start=first)


def decode_layer(layer, spec: LayerAttention, shape: LatentShape, pool: torch.Tensor, index: int,
                 hidden: torch.Tensor, rotation: torch.Tensor, where: RowIndex, singles: list[torch.Tensor],
                 positions: list[int]) -> torch.Tensor:
    """One layer's attention for a decode step of B requests (``hidden`` [B, 1, hidden]; request i's token at
    positions[i], its latent written at row i of ``where``, its block table ``singles[i]`` [1, nb]); the heads'
    outputs [B, heads, 1, v_head_dim]."""
    attn = layer.self_attn
    q, latents = project(attn, layer.input_layernorm(hidden), rotation, shape)
    write(pool, index, where, latents[:, 0])
    outs = []
    for i, table in enumerate(singles):
        first = spec.first_visible(positions[i])
        k, v = expand(attn, gather(pool, index, table, positions[i] + 1, first=first, dtype=latents.dtype), shape)
        outs.append(attend(q[i : i + 1], k, v, spec, q_start=positions[i], k_start=first))
    return torch.cat(outs) if len(outs) > 1 else outs[0]
