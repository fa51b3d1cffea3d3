"""The fused pointwise kernels of a decode step (xpyd/model/gpu/fused.py), run on the CPU by Triton's
interpreter (TRITON_INTERPRET=1) at tiny sizes, against the torch ops they replace: transformers'
LlamaRMSNorm, torch's add, `F.silu(gate).mul_(up)` and `FastLlama._rope` itself. The `check_*` functions
are device-agnostic; tests/gpu/test_fused_kernels_cuda.py runs them at the Llama-3-8B shape.

Where exact, where bounded (u = 2^-24; u_h the output dtype's unit roundoff: bf16 2^-8, fp16 2^-11, fp32 u):
- rope_split and the sum of add_rms_norm: the same float32 operations, each rounded to the dtype where torch
  rounds (a product of two bf16/fp16 values and a sum of two are exact or rounded once in float32, and a
  float32 result rounded once more to bf16/fp16 is that of one rounding, as 24 >= 2 p + 2; float32 runs
  without fused multiply-adds): bit-equal.
- rms_norm: the mean of squares is summed in another order (and rsqrt, division differ on the GPU). Each
  implementation's float32 h = x * rsqrt(mean(x^2) + eps) is within delta |h| of the exact h:
  H squares and H - 1 adds in any order (H u), the division by H (2 ulps = 4u on the GPU), + eps (u),
  rsqrt halving that and adding its own 2 ulps (4u), the product (u): delta = (H / 2 + 8) u. Rounding h to
  the dtype (u_h) and the product with w (u_h) in both: |out - ref| <= |h w| (2 delta + 4 u_h + 2 delta u_h^2)
  + tiny (|w| + 1), tiny the dtype's subnormal spacing (a rounding into the subnormals errs by tiny / 2 at most).
  Where [h (1 - delta), h (1 + delta)] rounds to one value of the dtype, both round h alike and the outputs
  are bit-equal; the tests check that too (it fails if the rounding of h before the weight is skipped).
- silu_mul: silu(g) = g / (1 + exp(-g)) in float32 by each: exp within (2 |g| + 4) u (Triton's exp is
  exp2 of g log2(e), whose rounding scales with |g|; CUDA's expf 2 ulps), the add u, the division 4u:
  eps_s = (2 |g| + 10) u, and |out - ref| <= |silu(g) up| (2 eps_s + 4 u_h + 2 eps_s u_h^2) + tiny (|up| + 1);
  bit-equal where silu(g)'s interval rounds to one value, as above.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the GPU engine's kernels need Triton, which is not installed here")

from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from xpyd.model.gpu import fused  # noqa: E402
from xpyd.model.gpu import paged_attention as pa  # noqa: E402
from xpyd.model.llama_fast import FastLlama  # noqa: E402

U32 = 2.0**-24
UNIT = {torch.float32: U32, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TINY = {dtype: torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps for dtype in UNIT}  # subnormal spacing
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def determined(exact: torch.Tensor, rel: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """Where every float32 value within ``rel`` (relative) of ``exact`` (float64) rounds to one value of
    ``dtype`` (rounding is monotone, so the interval's two ends decide)."""
    lo = (exact * (1 - rel)).float().to(dtype)
    hi = (exact * (1 + rel)).float().to(dtype)
    return lo == hi


def check_exact_where_determined(out, ref, mask):
    assert torch.equal(out[mask], ref[mask]), f"{int((out[mask] != ref[mask]).sum())} determined elements differ"
    # not vacuous: in bf16/fp16 an interval of relative width 2 delta covers a rounding midpoint with
    # probability about 2 delta / 2^-p; float32 (delta >> its spacing) relies on the bound alone
    if out.dtype != torch.float32:
        assert mask.float().mean() > 0.25


def rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """``out`` (from the kernel) against LlamaRMSNorm of x: the module docstring's bound everywhere, bit-equal
    where the rounding of h is determined."""
    ref = rms_reference(x, weight, eps)
    x64, w64 = x.double(), weight.double()
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    delta = (x.shape[-1] / 2 + 8) * U32
    u_h = UNIT[x.dtype]
    bound = (h * w64).abs() * (2 * delta + 4 * u_h + 2 * delta * u_h**2) + TINY[x.dtype] * (w64.abs() + 1)
    err = (out.double() - ref.double()).abs()
    assert not out.isnan().any()
    assert torch.all(err <= bound), f"max error {err.max().item():.3g}, bound there {bound.flatten()[err.argmax()]:.3g}"
    check_exact_where_determined(out, ref, determined(h, delta, x.dtype))


def check_silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate).mul_(up)
    g64 = gate.double()
    silu = g64 * torch.sigmoid(g64)
    eps_s = (2 * g64.abs() + 10) * U32
    u_h = UNIT[gate_up.dtype]
    bound = (silu * up.double()).abs() * (2 * eps_s + 4 * u_h + 2 * eps_s * u_h**2) + TINY[gate_up.dtype] * (
        up.double().abs() + 1)
    err = (out.double() - ref.double()).abs()
    assert not out.isnan().any()
    assert torch.all(err <= bound), f"max error {err.max().item():.3g}"
    check_exact_where_determined(out, ref, determined(silu, eps_s, gate_up.dtype))


def rope_reference(qkv, cos, sin, positions, nh, nkv):
    """FastLlama._rope itself (its torch path) over the gathered cos/sin rows."""
    fast = types.SimpleNamespace(_pointwise=None, num_heads=nh, num_kv_heads=nkv, head_dim=qkv.shape[-1])
    pos = positions.long()
    return FastLlama._rope(fast, qkv, cos[pos], sin[pos])


def check_rope_split(qkv, cos, sin, positions, q, k, v) -> None:
    nh, nkv = q.shape[1], k.shape[1]
    ref = rope_reference(qkv, cos, sin, positions, nh, nkv)
    assert torch.equal(q, ref[:, :nh])
    assert torch.equal(k, ref[:, nh:])
    assert torch.equal(v, qkv[:, nh + nkv :])


def rows(t, h, dtype, seed, device="cpu", scales=(1.0, 1e-3, 30.0)):
    """Random rows, row i scaled by scales[i % 3]: ~1, one where eps dominates the mean of squares, a large one."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, h, generator=gen, device=device, dtype=torch.float64)
    scale = torch.tensor([scales[i % len(scales)] for i in range(t)], device=device, dtype=torch.float64)
    return (x * scale[:, None]).to(dtype)


def weight(h, dtype, seed, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (1 + 0.5 * torch.randn(h, generator=gen, device=device, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("hidden", [576, 64])  # SmolLM2's hidden (not a power of two) and one that is
def test_rms_norm_matches_llama_rms_norm(dtype, t, hidden):
    x, w, eps = rows(t, hidden, dtype, seed=t), weight(hidden, dtype, seed=1), 1e-5
    before = x.clone()
    out = poisoned((t, hidden), dtype, "cpu")
    assert fused.rms_norm(x, w, eps, out=out) is out
    check_rms_norm(x, w, eps, out)
    assert torch.equal(x, before)
    allocated = fused.rms_norm(x, w, eps)
    assert torch.equal(allocated, out)
    in_place = x.clone()
    fused.rms_norm(in_place, w, eps, out=in_place)
    assert torch.equal(in_place, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3])
def test_add_rms_norm_adds_as_torch_then_normalises(dtype, t):
    hidden, eps = 576, 1e-6
    x, delta, w = rows(t, hidden, dtype, seed=2), rows(t, hidden, dtype, seed=3), weight(hidden, dtype, seed=4)
    out_sum, out_norm = poisoned((t, hidden), dtype, "cpu"), poisoned((t, hidden), dtype, "cpu")
    fused.add_rms_norm(x, delta, w, eps, out_sum, out_norm)
    total = x + delta
    assert torch.equal(out_sum, total)
    check_rms_norm(total, w, eps, out_norm)
    # the residual stream updated in place
    stream, norm2 = x.clone(), poisoned((t, hidden), dtype, "cpu")
    fused.add_rms_norm(stream, delta, w, eps, stream, norm2)
    assert torch.equal(stream, total)
    assert torch.equal(norm2, out_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3])
def test_silu_mul_matches_torch(dtype, t):
    inter = 1536 + 40  # two column blocks of 1024, the second partial
    gate_up = rows(t, 2 * inter, dtype, seed=5, scales=(3.0, 1.0, 8.0))
    out = poisoned((t, inter), dtype, "cpu")
    assert fused.silu_mul(gate_up, out) is out
    check_silu_mul(gate_up, out)


def rope_case(dtype, t, nh, nkv, hd, max_pos=40, seed=6, positions_dtype=torch.int32, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(t, nh + 2 * nkv, hd, generator=gen, device=device).to(dtype)
    cos = torch.randn(max_pos, hd, generator=gen, device=device).to(dtype)
    sin = torch.randn(max_pos, hd, generator=gen, device=device).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=gen, device=device)
    positions[0] = max_pos - 1
    outs = tuple(poisoned((t, n, hd), dtype, device) for n in (nh, nkv, nkv))
    return qkv, cos, sin, positions.to(positions_dtype), outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("heads", [(9, 3), (4, 2)])  # SmolLM2's GQA, and another
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
def test_rope_split_is_fast_llamas_rope_bit_for_bit(dtype, t, heads, positions_dtype):
    nh, nkv = heads
    qkv, cos, sin, positions, (q, k, v) = rope_case(dtype, t, nh, nkv, 64, positions_dtype=positions_dtype)
    before = qkv.clone()
    fused.rope_split(qkv, cos, sin, positions, q, k, v)
    check_rope_split(qkv, cos, sin, positions, q, k, v)
    assert torch.equal(qkv, before)
    # positions as a strided view (every other element of a longer buffer)
    spread = torch.zeros(2 * t, dtype=positions_dtype)
    spread[::2] = positions
    spread[1::2] = 10**6  # read instead of the real positions, these would give NaN rows
    for out in (q, k, v):
        out.fill_(float("nan"))
    fused.rope_split(qkv, cos, sin, spread[::2], q, k, v)
    check_rope_split(qkv, cos, sin, positions, q, k, v)


def test_rope_split_head_dim_not_a_power_of_two_and_a_position_outside_the_tables():
    qkv, cos, sin, positions, (q, k, v) = rope_case(torch.bfloat16, 3, 4, 2, 48, max_pos=8)
    fused.rope_split(qkv, cos, sin, positions, q, k, v)
    check_rope_split(qkv, cos, sin, positions, q, k, v)
    positions[1] = 8  # past the tables: NaN rows for q and k, nothing read outside, v still copied
    positions[2] = -1
    fused.rope_split(qkv, cos, sin, positions, q, k, v)
    assert q[1:].isnan().all() and k[1:].isnan().all()
    check_rope_split(qkv[:1], cos, sin, positions[:1], q[:1], k[:1], v[:1])
    assert torch.equal(v, qkv[:, 6:])


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64)
    assert fused.rms_norm(x, torch.ones(64), 1e-5).shape == (0, 64)
    fused.add_rms_norm(x, x.clone(), torch.ones(64), 1e-5, x, torch.empty(0, 64))
    fused.silu_mul(torch.empty(0, 8), torch.empty(0, 4))
    fused.rope_split(torch.empty(0, 4, 8), torch.ones(2, 8), torch.ones(2, 8), torch.empty(0, dtype=torch.int32),
                     torch.empty(0, 2, 8), torch.empty(0, 1, 8), torch.empty(0, 1, 8))


def test_refuses_mismatched_inputs():
    x, w = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, w.to(torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="out"):
        fused.rms_norm(x, w, 1e-5, out=torch.empty(2, 32))
    with pytest.raises(ValueError, match="dense"):
        fused.rms_norm(torch.randn(64, 2).t(), w, 1e-5)
    with pytest.raises(ValueError, match="alias"):
        fused.add_rms_norm(x, x.clone(), w, 1e-5, x, x)
    with pytest.raises(ValueError, match="delta"):
        fused.add_rms_norm(x, torch.randn(3, 64), w, 1e-5, x, torch.empty(2, 64))
    with pytest.raises(ValueError, match="even"):
        fused.silu_mul(torch.randn(2, 7), torch.empty(2, 3))
    with pytest.raises(ValueError, match="out"):
        fused.silu_mul(torch.randn(2, 8), torch.empty(2, 8))
    qkv, cos, sin, positions, (q, k, v) = rope_case(torch.float32, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="positions"):
        fused.rope_split(qkv, cos, sin, positions.float(), q, k, v)
    with pytest.raises(ValueError, match="heads"):
        fused.rope_split(qkv, cos, sin, positions, q[:, :3], k, v)
    with pytest.raises(ValueError, match="sin_signed"):
        fused.rope_split(qkv, cos, sin[:, :4], positions, q, k, v)
    with pytest.raises(ValueError, match="dense heads"):
        fused.rope_split(qkv, cos, sin, positions, torch.empty(2, 4, 16)[..., :8], k, v)


def test_why_unavailable_is_paged_attentions(monkeypatch):
    assert fused.why_unavailable(torch.device("cpu")) is None
    monkeypatch.delenv("TRITON_INTERPRET")
    reason = fused.why_unavailable(torch.device("cpu"))
    assert reason == pa.why_unavailable(torch.device("cpu")) and "TRITON_INTERPRET=1" in reason
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused.rms_norm(torch.randn(1, 8), torch.ones(8), 1e-5)
