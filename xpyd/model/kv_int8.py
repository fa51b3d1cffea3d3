"""The int8 KV cache (`--kv-cache-dtype int8`): one signed byte per value and a scale per row, in the row.

A row is one token's K (or V) of one KV head and layer: ``head_dim`` values. Stored as ``head_dim`` int8 codes
followed by the row's scale as a float16 (2 bytes, little-endian): ``kv_layout.KVLayout.row_dim`` =
``head_dim + 2`` bytes. Encoding a row x::

    s    = float16(min(max|x| / 127, 65504))          (0 for an all-zero row)
    code = clamp(round_half_even(x / s), -127, 127)    (float32 division; 0 where s is 0)

and reading it back: ``code * s`` in float32 (then the model's dtype in the torch paths; the native kernel
keeps float32). The error of a value is at most half a step, ``s / 2`` ~ max|x| / 254 of its row, plus the
scale's own float16 rounding (2^-11 relative): about the precision of bfloat16 for the row's largest values,
where fp8 e4m3 (`kv_quant`) keeps 3 mantissa bits for every value. Nothing is calibrated: each row carries its
scale, so the pool's bytes mean the same on every worker, blocks and transfers move the scales with the codes,
and a prefix-cache block is exactly what was computed. Measured against bfloat16 KV and fp8 in
docs/benchmarks.md ("int8 KV cache").
"""

from __future__ import annotations

import torch

from xpyd.model import kv_rotation
from xpyd.model.kv_layout import ROW_SCALE_BYTES

__all__ = ["FORMAT", "LEVELS", "Int8RowCodec", "decode_rows", "encode_rows"]

FORMAT = "int8"
LEVELS = 127  # codes in [-127, 127] (symmetric: -128 is never written)
_SCALE_MAX = 65504.0  # the largest finite float16


def encode_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> uint8 [..., head_dim + 2]: the int8 codes, then the row's float16 scale."""
    xf = x.float()
    s16 = (xf.abs().amax(-1, keepdim=True) / LEVELS).clamp_(max=_SCALE_MAX).to(torch.float16)
    s = s16.float().masked_fill_(s16 == 0, float("inf"))  # (a zero scale: x / inf = 0, every code 0)
    codes = (xf / s).round_().clamp_(-LEVELS, LEVELS).to(torch.int8)
    return torch.cat((codes.view(torch.uint8), s16.view(torch.uint8)), dim=-1)


def decode_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [..., head_dim + 2] (`encode_rows`) -> their values [..., head_dim] in ``dtype``."""
    head_dim = rows.shape[-1] - ROW_SCALE_BYTES
    codes = rows[..., :head_dim].view(torch.int8)
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()  # [..., 1]
    return codes.float().mul_(scale).to(dtype)


class Int8RowCodec:
    """Values <-> rows of an int8 pool for a model computing in ``dtype``: the same calls as `kv_quant.KVCodec`
    (``encode`` when K/V are written, ``decode``/``decode_rows`` when the torch paths read them); the native
    kernel reads the rows itself (`native.DecodeAttention.int8`). ``layer`` is taken and unused: no scale
    outlives its row.

    ``rotation`` (`kv_rotation.rotation`, float32 [head_dim, head_dim]; a per-head K/V pool's, None for latents):
    rows are the codes of ``x @ R`` and read back as ``values @ R.T`` (in float32, then the model's dtype). The
    native kernel reads the rows as stored and turns its queries and output itself (``kernel_rotation`` passed to it)."""

    format = FORMAT
    scales = None  # (nothing calibrated: `KVLayout.scales` stays None)

    def __init__(self, dtype: torch.dtype, rotation: torch.Tensor | None = None) -> None:
        self.dtype = dtype
        self.rotation = rotation
        self._back = None if rotation is None else rotation.T.contiguous()
        self.kernel_rotation = None if rotation is None else kv_rotation.both(rotation)  # (R, R^T: the native kernel's)

    def encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [T, kv_heads, head_dim] -> their rows, uint8 [T, kv_heads, head_dim + 2] (both in one pass: a
        decode step encodes a few rows per layer, where each torch call's own cost is what counts)."""
        both = torch.stack((k, v)).float()
        rows = encode_rows(both if self.rotation is None else both @ self.rotation)
        return rows[0], rows[1]

    def _values(self, rows: torch.Tensor) -> torch.Tensor:
        if self.rotation is None:
            return decode_rows(rows, self.dtype)
        return (decode_rows(rows, torch.float32) @ self._back).to(self.dtype)

    def decode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows k, v [B, kv_heads, n, head_dim + 2] -> values [B, kv_heads, n, head_dim] in the model's dtype."""
        return self._values(k), self._values(v)

    def decode_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` for T tokens' rows, k, v [T, kv_heads, head_dim + 2] (what `encode` returns)."""
        return self._values(k), self._values(v)
