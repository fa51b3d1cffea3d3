"""The fp8 KV cache (`--kv-cache-dtype fp8_e4m3|fp8_e5m2`): one-byte codes in the pool, and the scales per
(layer, KV head) that turn them back into numbers.

Formats (vLLM's names): "fp8_e4m3" is torch's float8_e4m3fn (3 mantissa bits: 2^-4 relative error at
most, largest finite 448, no infinities), "fp8_e5m2" is float8_e5m2 (2 mantissa bits: 2^-3, largest 57344).
A K value x of layer l and KV head h is stored as ``code = fp8(clamp(x / k[l, h], -max, max))`` and read
as ``value(code) * k[l, h]``; V the same with its own ``v[l, h]`` (vLLM's k_scale / v_scale, one per head
rather than one per layer). Out-of-range values saturate to +-max instead of becoming NaN (a NaN input
stays NaN).

The scales come from a calibration pass at start (`calibrate`; `calibration_ids`: a seeded pseudo-random prompt
after the model's BOS token, `CALIBRATION_TOKENS` long, prefilled once into a scratch pool in the model's dtype):
each (layer, KV head)'s largest |K| and |V| times `MARGIN` (room for texts whose values run larger than the
calibration's), rounded UP to a power of two, divided by the format's max. Why powers of two:
- a prefill and a decode worker on different x86 CPUs compute the calibration's amax differently in the
  last bits; rounded up to a power of two they agree except when an amax sits right at a power of two
  (then the scales' digest differs and the handshake refuses the pair, saying so; never garbage);
- x / s and value * s are exact (an exponent shift), so quantizing is one rounding (torch's, to nearest
  even) and dequantizing is exact: into bfloat16 or float32 the dequantized values are the same numbers in
  the torch paths (`decode`) and in the native kernel (the code's value times the scale, applied once per
  score and once per output: csrc/fp8.h converts codes through half precision, 16 per instruction; a
  256-entry table read through gathers made the kernel 2.8x slower than bfloat16's on this CPU). `lut`
  is the table from the formats' definitions, what torch's and the kernel's conversions are tested against.
Checkpoint scales (vLLM's k_scale/v_scale tensors) are not read: the models served here ship none. Against
int8 with the same per-head scales, fp8 wins (a trial on SmolLM2-135M, torch's matmul attention, 20 chat
prompts, 64 greedy tokens: int8 at amax x 1-2 or x 4-8 over 127 kept 25% and 5% of bfloat16 KV's answers,
e4m3 35%); int8 with a scale per row (`kv_int8`, `--kv-cache-dtype int8`) beats both.

The pool, transfers and prefix cache only ever see the codes as bytes (`kv_pool`: a uint8 tensor); the
layout carries the scales' digest (`kv_layout.KVLayout.scales`), so the handshake and the prefix-cache
hashes tell quantized KV of other scales apart.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from xpyd.model.kv_layout import QUANTIZED, KVLayout
from xpyd.model.kv_pool import KVPool

__all__ = ["CALIBRATION_TOKENS", "FORMATS", "MARGIN", "FP8Format", "KVCodec", "KVScales", "calibrate",
           "calibration_ids", "lut", "table_value"]

CALIBRATION_TOKENS = 256
MARGIN = 4.0  # amax x 4, then up to a power of two: the calibration's largest value lands in [max/8, max/4)


class FP8Format(NamedTuple):
    torch_dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    max: float  # the largest finite value
    relative: float  # the largest relative rounding error of a normal value: 2^-(mantissa_bits + 1)


FORMATS = {
    "fp8_e4m3": FP8Format(torch.float8_e4m3fn, 4, 3, 448.0, 2.0**-4),
    "fp8_e5m2": FP8Format(torch.float8_e5m2, 5, 2, 57344.0, 2.0**-3),
}
assert set(FORMATS) == set(QUANTIZED)


def table_value(name: str, code: int) -> float:
    """The number fp8 ``code`` (0..255) stands for, from the format's definition (sign, exponent, mantissa;
    e4m3fn: no infinities, S.1111.111 is NaN; e5m2: IEEE-like)."""
    fmt = FORMATS[name]
    e_bits, m_bits = fmt.exponent_bits, fmt.mantissa_bits
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> m_bits) & ((1 << e_bits) - 1)
    mantissa = code & ((1 << m_bits) - 1)
    bias = (1 << (e_bits - 1)) - 1
    top = (1 << e_bits) - 1
    if name == "fp8_e4m3" and exponent == top and mantissa == (1 << m_bits) - 1:
        return math.nan
    if name == "fp8_e5m2" and exponent == top:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:
        return sign * mantissa * 2.0 ** (1 - bias - m_bits)
    return sign * (1 + mantissa / (1 << m_bits)) * 2.0 ** (exponent - bias)


def lut(name: str) -> torch.Tensor:
    """float32 [256]: each code's value from the format's definition (`table_value`): what torch's
    conversion and the native kernel's are tested against."""
    return torch.tensor([table_value(name, c) for c in range(256)], dtype=torch.float32)


def calibration_ids(vocab_size: int, length: int, bos: int | None) -> list[int]:
    """The calibration prompt: BOS (when the model has one), then seeded pseudo-random ids (torch's CPU
    generator: the same ids on every machine)."""
    gen = torch.Generator().manual_seed(27)
    ids = torch.randint(0, vocab_size, (length,), generator=gen).tolist()
    if bos is not None and 0 <= bos < vocab_size:
        ids[0] = bos
    return ids


def calibrate(kv_cache_dtype: str, layout: KVLayout, device: torch.device, dtype: torch.dtype, max_model_len: int,
              vocab_size: int, bos: object, prefill: Callable[[KVPool, list[int]], object]) -> KVCodec:
    """The codec of an fp8 pool of ``layout`` (the model's, in ``dtype``): ``prefill(scratch, ids)`` runs the
    calibration prompt (`calibration_ids`, after the model's ``bos`` when it is one id) through the model into
    ``scratch``, a pool of that layout in ``dtype`` just long enough, and the scales come from its K/V."""
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(FORMATS)}, not {kv_cache_dtype!r}")
    if device.type != "cpu":
        raise ValueError(f"an fp8 KV cache runs on the CPU, not {device}")
    length = min(CALIBRATION_TOKENS, max_model_len)
    scratch = KVPool(layout.with_blocks(layout.blocks_for(length)), device=device, caching=False)
    prefill(scratch, calibration_ids(vocab_size, length, bos if isinstance(bos, int) else None))
    return KVCodec(KVScales.calibrated(kv_cache_dtype, scratch.tensor), dtype, device)


def _exponent(amax: float, fmt_max: float) -> int:
    """e with 2^e the smallest power of two >= amax * MARGIN / fmt_max (0 for an all-zero head)."""
    if not amax > 0 or not math.isfinite(amax):
        return 0
    m, e = math.frexp(amax * MARGIN / fmt_max)  # x = m 2^e, m in [0.5, 1): exact, no log rounding
    return e - 1 if m == 0.5 else e


@dataclass(frozen=True, slots=True)
class KVScales:
    """The scales of one fp8 pool: K's 2^k_exponents[l][h] and V's 2^v_exponents[l][h]."""

    dtype: str  # "fp8_e4m3" | "fp8_e5m2"
    k_exponents: tuple[tuple[int, ...], ...]  # [layers][kv_heads]
    v_exponents: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.dtype not in FORMATS:
            raise ValueError(f"KV scales are for {QUANTIZED}, not {self.dtype!r}")
        shape = [len(row) for row in self.k_exponents]
        if not shape or shape != [len(row) for row in self.v_exponents] or len(set(shape)) != 1:
            raise ValueError("KV scales: K and V need one exponent per layer and KV head, alike")
        if not all(-126 <= e <= 127 for rows in (self.k_exponents, self.v_exponents) for row in rows for e in row):
            raise ValueError("KV scale exponents must be in [-126, 127] (float32 normal powers of two)")

    @classmethod
    def calibrated(cls, dtype: str, pool: torch.Tensor) -> "KVScales":
        """From a pool [blocks, kv_heads, layers, 2, block_size, hd] holding (only) the calibration prompt's
        K/V in the model's dtype (unused rows zero)."""
        amax = pool.abs().amax(dim=(0, 4, 5)).float().cpu()  # [kv_heads, layers, 2]
        fmt_max = FORMATS[dtype].max
        k = tuple(tuple(_exponent(float(amax[h, l, 0]), fmt_max) for h in range(amax.shape[0]))
                  for l in range(amax.shape[1]))
        v = tuple(tuple(_exponent(float(amax[h, l, 1]), fmt_max) for h in range(amax.shape[0]))
                  for l in range(amax.shape[1]))
        return cls(dtype, k, v)

    def digest(self) -> str:
        """What names these scales in the KV layout (exact: integers only)."""
        text = json.dumps([self.dtype, self.k_exponents, self.v_exponents], separators=(",", ":"))
        return "pow2:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V scales, float32 [layers, kv_heads]."""
        def pow2(exps) -> torch.Tensor:
            return torch.tensor([[2.0**e for e in row] for row in exps], dtype=torch.float32)

        return pow2(self.k_exponents), pow2(self.v_exponents)


class KVCodec:
    """Values <-> codes of one fp8 pool, for a model computing in ``dtype`` on ``device``: `encode` when K/V
    are written (torch's rounding, saturated), `decode` when they are read by the torch paths. The native
    kernel takes the format and the layer's `kernel_scales` instead."""

    def __init__(self, scales: KVScales, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.scales = scales
        self.format = scales.dtype  # (as `kv_int8.Int8RowCodec.format`)
        fmt = FORMATS[scales.dtype]
        self.fp8 = fmt.torch_dtype
        self.max = fmt.max
        self.dtype = dtype
        k, v = scales.tensors()
        heads = k.shape[1]
        # per layer: (K, V) scales [kv_heads] float32 (the kernel's), and in `dtype` shaped to broadcast
        self._kernel = [(k[l].contiguous(), v[l].contiguous()) for l in range(k.shape[0])]
        self._inverse = [tuple((1.0 / s[l]).to(dtype).to(device).view(heads, 1) for s in (k, v))
                         for l in range(k.shape[0])]
        self._scale = [tuple(s[l].to(dtype).to(device).view(heads, 1, 1) for s in (k, v)) for l in range(k.shape[0])]

    def encode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [T, kv_heads, head_dim] in the model's dtype -> their uint8 codes (same shape)."""
        k_inv, v_inv = self._inverse[layer]
        return self._codes(k, k_inv), self._codes(v, v_inv)

    def _codes(self, x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        y = x * inverse  # exact: a power of two
        return y.clamp_(-self.max, self.max).to(self.fp8).view(torch.uint8)

    def decode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 codes k, v [B, kv_heads, n, head_dim] -> their values in the model's dtype (exact)."""
        k_scale, v_scale = self._scale[layer]
        return (k.view(self.fp8).to(self.dtype).mul_(k_scale), v.view(self.fp8).to(self.dtype).mul_(v_scale))

    def decode_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` for codes of T tokens' rows, k, v [T, kv_heads, head_dim] (what `encode` returns)."""
        k_scale, v_scale = self._scale[layer]
        return (k.view(self.fp8).to(self.dtype).mul_(k_scale[:, 0]), v.view(self.fp8).to(self.dtype).mul_(v_scale[:, 0]))

    def kernel_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V scales, float32 [kv_heads] on the CPU (for `native.DecodeAttention.fp8`)."""
        return self._kernel[layer]
