"""Fused pointwise kernels of a decode step (Triton): RMSNorm, the residual add fused into the next RMSNorm,
SiLU-and-multiply, and the rotary embedding fused with the split of the QKV projection into dense q, k, v.

Each kernel computes what the torch ops of `FastLlama` (xpyd/model/llama_fast.py) compute, step for step,
in one launch instead of two to eight, so a decoder layer is about ten launches:
- `rms_norm`: transformers' LlamaRMSNorm: h = x in float32; h * rsqrt(mean(h^2) + eps) in float32; that
  rounded to x's dtype; times the weight in x's dtype (the product rounded once);
- `add_rms_norm`: x + delta rounded to x's dtype (as torch's add), then `rms_norm` of that sum;
- `silu_mul`: silu(gate) in float32 rounded to the dtype, times up, rounded (torch's `F.silu(g).mul_(u)`);
- `rope_split`: q and k heads rotated as `FastLlama._rope` does (x*cos rounded, swap_halves(x)*sin rounded,
  their sum rounded; ``sin`` carries rotate_half's sign), v heads copied, cos/sin rows read by position in
  the kernel.
Every rounding to bfloat16/float16 is of a float32 value that the torch op also computes in float32, so
where the float32 arithmetic is the same (adds, multiplies; no fused multiply-add: the kernels are
compiled with fp fusion off) the results are bit-identical; the mean of squares (summed in another order),
rsqrt and exp (other implementations) differ from torch's by a few float32 ulps, which the rounding to the
dtype mostly absorbs (the tests derive the bound).

All four are safe to capture in a CUDA graph: no host reads of device values, the grid depends only on
shapes, and they allocate only an output that was not passed in. Inputs are dense rows (the last
dimension contiguous); float32, bfloat16 and float16, every tensor of one call in one dtype.

Triton is imported lazily through `paged_attention`; `why_unavailable` says why the kernels cannot run on a
device. On the CPU they run under Triton's interpreter (`TRITON_INTERPRET=1`), as the unit tests do.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from xpyd.model.gpu import paged_attention as _pa

triton, tl = _pa.triton, _pa.tl

__all__ = ["add_rms_norm", "rms_norm", "rope_split", "silu_mul", "why_unavailable"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SILU_BLOCK = 1024


def why_unavailable(device: torch.device) -> str | None:
    """None when the kernels can run on ``device``; otherwise why not (`paged_attention.why_unavailable`)."""
    return _pa.why_unavailable(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """LlamaRMSNorm of each row of x `[T, H]` with ``weight`` `[H]`; writes ``out`` (allocated if None) and
    returns it. ``out`` may be x itself."""
    _check_rows("rms_norm", x=x, weight=weight)
    _check_same("rms_norm", x, weight=(weight, (x.shape[1],)))
    if out is None:
        out = torch.empty_like(x)
    _check_same("rms_norm", x, out=(out, tuple(x.shape)))
    _launch_norm(x, None, weight, eps, None, out)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, out_sum: torch.Tensor,
                 out_norm: torch.Tensor) -> None:
    """out_sum = x + delta (rounded to x's dtype, as torch adds), out_norm = `rms_norm`(out_sum); all `[T, H]`.
    ``out_sum`` may be x (the residual stream updated in place); ``out_norm`` must not alias x, delta or
    out_sum."""
    _check_rows("add_rms_norm", x=x, weight=weight)
    shape = tuple(x.shape)
    _check_same("add_rms_norm", x, delta=(delta, shape), weight=(weight, (shape[1],)), out_sum=(out_sum, shape),
                out_norm=(out_norm, shape))
    for name, other in (("x", x), ("delta", delta), ("out_sum", out_sum)):
        if out_norm.data_ptr() == other.data_ptr() and out_norm.numel():
            raise ValueError(f"add_rms_norm: out_norm must not alias {name}")
    _launch_norm(x, delta, weight, eps, out_sum, out_norm)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out `[T, I]` = silu(gate) * up with gate, up = gate_up `[T, 2I]`.chunk(2, -1); returns out."""
    _check_rows("silu_mul", gate_up=gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_mul: gate_up's last dimension must be even, got {width}")
    inter = width // 2
    _check_same("silu_mul", gate_up, out=(out, (rows, inter)))
    if rows == 0:
        return out
    kern = _kernels(gate_up.device.type == "cpu")
    kern.silu_mul[(rows, triton.cdiv(inter, _SILU_BLOCK))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0),
        BLOCK=_SILU_BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor,
               q_out: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """Split qkv `[T, nh + 2 nkv, hd]` (q heads, then k, then v) into q_out `[T, nh, hd]`, k_out and v_out
    `[T, nkv, hd]`, q and k rotated: x*cos + swap_halves(x)*sin_signed with the rows `positions[t]` (int32 or
    int64 `[T]`) of cos and sin_signed `[max_pos, hd]` (`FastLlama.cos`, `.sin`). A position outside
    [0, max_pos) is the caller's error: its q and k rows come out NaN (no read outside the tables)."""
    _check_rows("rope_split", cos=cos, sin_signed=sin_signed)
    if qkv.dim() != 3 or qkv.stride(2) != 1 or qkv.stride(1) != qkv.shape[2]:
        raise ValueError(f"rope_split: qkv must be [T, heads, head_dim] with dense heads, got {tuple(qkv.shape)} "
                         f"strides {qkv.stride()}")
    rows, heads, head_dim = qkv.shape
    nh, nkv = q_out.shape[1] if q_out.dim() == 3 else -1, k_out.shape[1] if k_out.dim() == 3 else -1
    if nh <= 0 or nkv <= 0 or heads != nh + 2 * nkv or head_dim % 2:
        raise ValueError(f"rope_split: qkv {tuple(qkv.shape)} is not q_out {tuple(q_out.shape)} + 2 x k_out "
                         f"{tuple(k_out.shape)} heads of an even head_dim")
    _check_same("rope_split", qkv, cos=(cos, (cos.shape[0], head_dim)), sin_signed=(sin_signed, tuple(cos.shape)),
                q_out=(q_out, (rows, nh, head_dim)), k_out=(k_out, (rows, nkv, head_dim)),
                v_out=(v_out, (rows, nkv, head_dim)))
    for name, t in (("q_out", q_out), ("k_out", k_out), ("v_out", v_out)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"rope_split: {name} must have dense heads, got strides {t.stride()}")
    if positions.dtype not in (torch.int32, torch.int64) or positions.shape != (rows,) or \
            positions.device != qkv.device:
        raise ValueError(f"rope_split: positions must be int32/int64 [{rows}] on {qkv.device}, got "
                         f"{positions.dtype} {tuple(positions.shape)} on {positions.device}")
    if rows == 0:
        return
    kern = _kernels(qkv.device.type == "cpu")
    kern.rope_split[(rows, heads)](
        qkv, cos, sin_signed, positions, q_out, k_out, v_out,
        positions.stride(0), qkv.stride(0), cos.stride(0), sin_signed.stride(0),
        q_out.stride(0), k_out.stride(0), v_out.stride(0),
        nh, nkv, head_dim, cos.shape[0],
        BLOCK_D=_pa._next_power_of_2(head_dim), num_warps=1, enable_fp_fusion=False)


def _launch_norm(x, delta, weight, eps, out_sum, out_norm) -> None:
    rows, hidden = x.shape
    if rows == 0:
        return
    block = _pa._next_power_of_2(hidden)
    kern = _kernels(x.device.type == "cpu")
    has_delta = delta is not None
    kern.norm[(rows,)](
        x, delta if has_delta else x, weight, out_sum if has_delta else x, out_norm,
        hidden, float(eps), x.stride(0), (delta if has_delta else x).stride(0),
        (out_sum if has_delta else x).stride(0), out_norm.stride(0),
        HAS_DELTA=has_delta, BLOCK=block, num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16,
        enable_fp_fusion=False)


def _check_rows(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        reason = why_unavailable(t.device)
        if reason is not None:
            raise RuntimeError(f"{op}: the fused kernels cannot run on {t.device}: {reason}")
        if t.dim() not in (1, 2) or t.stride(-1) != 1 or t.dtype not in _DTYPES:
            raise ValueError(f"{op}: {name} must be a [rows, n] (or [n]) tensor of {', '.join(map(str, _DTYPES))} "
                             f"with a dense last dimension, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")


def _check_same(op: str, ref: torch.Tensor, **tensors: tuple[torch.Tensor, tuple[int, ...]]) -> None:
    """Each tensor has the given shape, ref's dtype and device, and a dense last dimension."""
    for name, (t, shape) in tensors.items():
        if tuple(t.shape) != shape or t.dtype != ref.dtype or t.device != ref.device or t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} is {t.dtype} {tuple(t.shape)} on {t.device}, expected {ref.dtype} "
                             f"{shape} on {ref.device} with a dense last dimension")


class _Kernels:
    def __init__(self, norm, silu_mul, rope_split) -> None:
        self.norm, self.silu_mul, self.rope_split = norm, silu_mul, rope_split


@lru_cache(maxsize=2)
def _kernels(interpret: bool) -> _Kernels:
    """The kernels, compiled for the GPU or wrapped for Triton's interpreter (as `paged_attention._kernels`)."""
    if interpret:
        _pa._fix_interpreter()
        _fix_interpreter_bf16_rounding()
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        return _Kernels(triton.jit(_norm_kernel), triton.jit(_silu_mul_kernel), triton.jit(_rope_split_kernel))


def _fix_interpreter_bf16_rounding() -> None:
    """Triton 3.6's interpreter converts float32 to bfloat16 by truncating (and its "rtne" mode rounds half
    away from zero and can overflow the mantissa); compiled kernels round to nearest even (`cvt.rn`). Make
    the interpreter round as the GPU does, through torch's conversion (round to nearest even)."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "xpyd_fixed", False):
        return

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            floats = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            return floats.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(data, input_dtype, output_dtype, rounding_mode)

    convert_float.xpyd_fixed = True
    interpreter._convert_float = convert_float


if triton is not None:

    def _norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, H, eps, sx, sd, ss, so,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * sd + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * ss + cols, x, mask=mask)
        h = x.to(tl.float32)
        mean = tl.sum(h * h, 0) / H
        h = (h * tl.math.rsqrt(mean + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = (h.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * so + cols, out, mask=mask)

    def _silu_mul_kernel(gu_ptr, out_ptr, I, sg, so, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        gate = tl.load(gu_ptr + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * sg + I + cols, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
        out = (silu.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * so + cols, out, mask=mask)

    def _rope_split_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
                           s_pos, s_qkv, s_cos, s_sin, s_q, s_k, s_v, NH, NKV, HD, MAX_POS,
                           BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HD
        half = HD // 2
        src = qkv_ptr + t * s_qkv + head * HD
        x = tl.load(src + d, mask=dmask, other=0.0)
        is_v = head >= NH + NKV
        # q and k heads: rotate; v heads: copy (their cos/sin reads are masked off)
        rot = dmask & (head < NH + NKV)
        pos = tl.load(pos_ptr + t * s_pos).to(tl.int64)
        valid = (pos >= 0) & (pos < MAX_POS)
        p = tl.where(valid, pos, 0)
        cos = tl.load(cos_ptr + p * s_cos + d, mask=rot, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + p * s_sin + d, mask=rot, other=0.0).to(tl.float32)
        swapped = tl.load(src + tl.where(d < half, d + half, d - half), mask=rot, other=0.0).to(tl.float32)
        dtype = x.dtype
        a = (x.to(tl.float32) * cos).to(dtype)
        b = (swapped * sin).to(dtype)
        rotated = tl.where(valid, a.to(tl.float32) + b.to(tl.float32), float("nan")).to(dtype)
        tl.store(q_ptr + t * s_q + head * HD + d, rotated, mask=dmask & (head < NH))
        tl.store(k_ptr + t * s_k + (head - NH) * HD + d, rotated, mask=rot & (head >= NH))
        tl.store(v_ptr + t * s_v + (head - NH - NKV) * HD + d, x, mask=dmask & is_v)
