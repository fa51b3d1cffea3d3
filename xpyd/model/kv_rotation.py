"""The rotation an int8 KV row is quantized in (`kv_int8`): a fixed orthonormal matrix R, head_dim x head_dim.

A K or V row x is stored as the int8 codes of ``x @ R`` with that row's scale, and read back as
``decoded @ R.T``. Attention is unchanged by it in exact arithmetic (``(q R) . (k R) = q . k``, and the output
of values stored rotated is the output rotated), but the quantization error is not: a row with a few large
channels (K's outlier channels) sets a scale that leaves its other values only a handful of levels; rotated,
every channel is a mix of all of them, the row's largest value is a few times its RMS instead of many, and the
small values get more of the 255 levels (QuaRot and SpinQuant rotate a model's activations the same way).

R is a normalized Walsh-Hadamard matrix (Sylvester's construction) on blocks of the largest power of two that
divides head_dim (64 -> one block of 64; 96 -> three of 32), with its rows' signs flipped by a fixed pattern
(bits of SHA-256 of ``SEED``): the same R on every worker and every machine, nothing drawn at random, so a pool's
bytes mean the same everywhere (`kv_layout.ROW_ROTATION` names it in the handshake). Measured in
docs/benchmarks.md ("int8 KV cache").
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["SEED", "both", "rotation", "signs"]

SEED = b"xpyd int8 KV row rotation/1"


def signs(n: int) -> list[float]:
    """n signs (+1.0 / -1.0): the bits of SHA-256(SEED), then of SHA-256 of that digest, and so on."""
    out: list[float] = []
    digest = SEED
    while len(out) < n:
        digest = hashlib.sha256(digest).digest()
        out.extend(-1.0 if byte >> bit & 1 else 1.0 for byte in digest for bit in range(8))
    return out[:n]


def rotation(head_dim: int) -> torch.Tensor:
    """R, float32 [head_dim, head_dim], orthonormal (R R^T = I up to float32 rounding; exactly where the block
    is a power of 4)."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    block = head_dim & -head_dim  # the largest power of two that divides head_dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    r = torch.block_diag(*[h] * (head_dim // block)) / math.sqrt(block)
    return (torch.tensor(signs(head_dim), dtype=torch.float64)[:, None] * r).float()


def both(r: torch.Tensor) -> torch.Tensor:
    """R and R^T in one contiguous float32 [2, hd, hd] tensor (what the native decode kernel takes)."""
    return torch.stack((r, r.T)).contiguous()
