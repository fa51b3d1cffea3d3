"""How one layer attends (`LayerAttention`: its scale, sliding window, logit soft-cap and rotary table) and the
attention itself in torch, for the general path's queries over keys read from the paged pool.

A layer with a window attends from position q to the keys of positions (q - window, q]: ``window`` of them,
its own included (transformers' ``sliding_window_overlay``: kv > q - window; its sliding cache keeps the last
window - 1 and adds the new one). Prefill (cold, in chunks, after a cached prefix) and decode all mask by that
one rule, `LayerAttention.first_visible`, so every way of computing a position gives the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class LayerAttention:
    scale: float  # multiplies q . k
    window: int | None = None  # sliding window (positions seen, the query's own included); None: every earlier one
    softcap: float | None = None  # scores -> tanh(scores / softcap) * softcap, before the mask and the softmax
    rotary: str | None = None  # the rotary table this layer takes (Gemma 3: its layer type); None: the model's one

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must hold at least one position, not {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"a soft-cap must be positive, not {self.softcap}")

    def first_visible(self, position: int) -> int:
        """The earliest position whose key the query at ``position`` sees."""
        return 0 if self.window is None else max(0, position - self.window + 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerAttention, q_start: int,
           k_start: int) -> torch.Tensor:
    """Attention of q [B, heads, m, head_dim] at positions [q_start, q_start + m) over k, v [B, kv_heads, L,
    head_dim] at positions [k_start, k_start + L), which must end where the queries end: causal, and within
    ``spec``'s window. [B, heads, m, head_dim]."""
    m, length = q.shape[2], k.shape[2]
    if k_start + length != q_start + m:
        raise ValueError(f"keys [{k_start}, {k_start + length}) do not end with the queries [{q_start}, {q_start + m})")
    plain = spec.softcap is None
    if plain and m == 1 and k_start >= spec.first_visible(q_start):  # (one query seeing every key given)
        return F.scaled_dot_product_attention(q, k, v, scale=spec.scale, enable_gqa=True)
    if plain and k_start == q_start and (spec.window is None or m <= spec.window):  # (the window cuts nothing)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale, enable_gqa=True)
    mask = visible(spec, q_start, m, k_start, length, q.device)
    if plain:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale, enable_gqa=True)
    return _capped(q, k, v, spec, mask)


def visible(spec: LayerAttention, q_start: int, m: int, k_start: int, length: int,
            device: torch.device) -> torch.Tensor:
    """bool [m, length]: which keys each query sees (causal, and inside the window)."""
    q_pos = torch.arange(q_start, q_start + m, device=device).unsqueeze(1)
    k_pos = torch.arange(k_start, k_start + length, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if spec.window is not None:
        mask &= k_pos > q_pos - spec.window
    return mask


def _capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: LayerAttention,
            mask: torch.Tensor) -> torch.Tensor:
    """Soft-capped attention, as transformers' eager attention computes it: scaled scores, capped, masked,
    a softmax in float32, then the values."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * spec.scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
