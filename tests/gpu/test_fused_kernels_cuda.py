"""The fused pointwise kernels (xpyd/model/gpu/fused.py) compiled for CUDA at the Llama-3-8B shape (hidden
4096, 32 query heads, 8 KV heads, head_dim 128, intermediate 14336), against the torch ops they replace on
the same GPU; and the four captured in one CUDA graph, replayed on new inputs, matching eager runs bit for bit.

The checks and their bounds are tests/unit/test_fused_kernels.py's (its docstring derives them): rope_split
and the residual sum bit-equal (float32 too: the kernels are compiled without fused multiply-adds, and torch
runs x*cos, swapped*sin and their sum as three rounded ops); rms_norm and silu_mul within the bound, and
bit-equal wherever the bound leaves only one rounding of the intermediate value possible.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the fused kernels)")

pytest.importorskip("triton", reason="the GPU engine's kernels need Triton")

from tests.unit.test_fused_kernels import (  # noqa: E402
    check_rms_norm,
    check_rope_split,
    check_silu_mul,
    poisoned,
    rope_case,
    rows,
    weight,
)
from xpyd.model.gpu import fused  # noqa: E402

DEV = torch.device("cuda")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, MAX_POS = 4096, 32, 8, 128, 14336, 8192
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
BATCHES = [1, 3, 256]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", BATCHES)
def test_rms_norm_and_add_rms_norm_at_the_8b_shape(dtype, t):
    x, delta = rows(t, HIDDEN, dtype, seed=t, device=DEV), rows(t, HIDDEN, dtype, seed=t + 1, device=DEV)
    w, eps = weight(HIDDEN, dtype, seed=2, device=DEV), 1e-5
    out = poisoned((t, HIDDEN), dtype, DEV)
    fused.rms_norm(x, w, eps, out=out)
    check_rms_norm(x, w, eps, out)
    stream, norm = x.clone(), poisoned((t, HIDDEN), dtype, DEV)
    fused.add_rms_norm(stream, delta, w, eps, stream, norm)
    total = x + delta
    assert torch.equal(stream, total)
    check_rms_norm(total, w, eps, norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", BATCHES)
def test_silu_mul_at_the_8b_shape(dtype, t):
    gate_up = rows(t, 2 * INTER, dtype, seed=5, device=DEV, scales=(3.0, 1.0, 8.0))
    out = poisoned((t, INTER), dtype, DEV)
    fused.silu_mul(gate_up, out)
    check_silu_mul(gate_up, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", BATCHES)
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64])
def test_rope_split_at_the_8b_shape(dtype, t, positions_dtype):
    qkv, cos, sin, positions, (q, k, v) = rope_case(dtype, t, HEADS, KV_HEADS, HEAD_DIM, max_pos=MAX_POS,
                                                    positions_dtype=positions_dtype, device=DEV)
    fused.rope_split(qkv, cos, sin, positions, q, k, v)
    check_rope_split(qkv, cos, sin, positions, q, k, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_graph_of_the_four_kernels_replays_on_new_inputs(dtype):
    t, eps = 8, 1e-5
    gen = torch.Generator(device=DEV).manual_seed(0)

    def fresh(shape, scale=1.0):
        return (scale * torch.randn(shape, generator=gen, device=DEV)).to(dtype)

    x, delta, w = fresh((t, HIDDEN)), fresh((t, HIDDEN)), weight(HIDDEN, dtype, seed=1, device=DEV)
    gate_up, qkv = fresh((t, 2 * INTER), 3.0), fresh((t, HEADS + 2 * KV_HEADS, HEAD_DIM))
    cos, sin = fresh((MAX_POS, HEAD_DIM)), fresh((MAX_POS, HEAD_DIM))
    positions = torch.randint(0, MAX_POS, (t,), generator=gen, device=DEV, dtype=torch.int32)
    inputs = (x, delta, gate_up, qkv, positions)
    outs = {"norm": poisoned((t, HIDDEN), dtype, DEV), "sum": poisoned((t, HIDDEN), dtype, DEV),
            "norm2": poisoned((t, HIDDEN), dtype, DEV), "act": poisoned((t, INTER), dtype, DEV),
            "q": poisoned((t, HEADS, HEAD_DIM), dtype, DEV), "k": poisoned((t, KV_HEADS, HEAD_DIM), dtype, DEV),
            "v": poisoned((t, KV_HEADS, HEAD_DIM), dtype, DEV)}

    def step(o):
        fused.rms_norm(x, w, eps, out=o["norm"])
        fused.add_rms_norm(x, delta, w, eps, o["sum"], o["norm2"])
        fused.silu_mul(gate_up, o["act"])
        fused.rope_split(qkv, cos, sin, positions, o["q"], o["k"], o["v"])

    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):  # compile outside the capture
        step(outs)
    torch.cuda.current_stream(DEV).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(outs)
    for value in outs.values():
        value.fill_(float("nan"))
    for round_ in range(2):
        for buf in inputs[:4]:
            buf.copy_((torch.randn(buf.shape, generator=gen, device=DEV) * (1 + round_)).to(dtype))
        positions.copy_(torch.randint(0, MAX_POS, (t,), generator=gen, device=DEV, dtype=torch.int32))
        graph.replay()
        eager = {name: poisoned(value.shape, dtype, DEV) for name, value in outs.items()}
        step(eager)
        torch.cuda.synchronize(DEV)
        for name in outs:
            assert torch.equal(outs[name], eager[name]), name
        check_rms_norm(x, w, eps, outs["norm"])
        assert torch.equal(outs["sum"], x + delta)
        check_rms_norm(x + delta, w, eps, outs["norm2"])
        check_silu_mul(gate_up, outs["act"])
        check_rope_split(qkv, cos, sin, positions, outs["q"], outs["k"], outs["v"])
