"""The Triton decode attention and KV store (xpyd/model/gpu/paged_attention.py) compiled for CUDA, at the
Llama-3-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bfloat16, contexts 1..8192), against
a float64 reference from paged.gather; and captured in a CUDA graph with store_kv, replayed on changed
inputs, matching eager runs bit for bit.

The error bound is tests/unit/test_paged_attention_triton.py's (its docstring derives it): per element,
W (u (2 (D + 3) A + tile + 2 n_tiles + 32) + 2 u_h), W = sum_t p_t |v_td| / sum_t p_t, u = 2^-24, u_h the
input dtype's unit roundoff (bf16 2^-8, fp16 2^-11, fp32 0); float32 must meet it with u_h = 0, which TF32
(10-bit products) would not.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU engine's kernels)")

triton = pytest.importorskip("triton", reason="the GPU engine's kernels need Triton")

from xpyd.model import paged  # noqa: E402
from xpyd.model.gpu import paged_attention as pa  # noqa: E402

U32 = 2.0**-24
UNIT_HALF = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DEV = torch.device("cuda")


def make_case(dtype, seq_lens, block_size=BLOCK, layers=2, heads=HEADS, kv_heads=KV_HEADS, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    per_row = [-(-n // block_size) for n in seq_lens]
    width = max(max(per_row), 1)
    num_blocks = sum(per_row) + 4
    pool = torch.randn(num_blocks, kv_heads, layers, 2, block_size, HEAD_DIM, generator=gen, device=DEV).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen, device=DEV).tolist()
    tables, at = [], 0
    for n in per_row:
        tables.append(ids[at:at + n] + ids[-1:] * (width - n))
        at += n
    # queries 4x a unit normal: scores of spread ~4, so a few tokens carry most weight even at 8192 and a token
    # read from the wrong place moves the output by O(1), far past the bound
    q = (4 * torch.randn(len(seq_lens), heads, HEAD_DIM, generator=gen, device=DEV)).to(dtype)
    return (pool, q, torch.tensor(tables, dtype=torch.int32, device=DEV),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEV))


def reference_and_bound(q, pool, layer, tables, lens, scale, tile):
    """float64 attention, row by row (one row of 8192 tokens in float64 is 64 MB per K/V), and the bound."""
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // pool.shape[1]
    refs, bounds = [], []
    for b in range(q.shape[0]):
        n = int(lens[b])
        if n == 0:
            refs.append(torch.zeros(heads, head_dim, dtype=torch.float64, device=DEV))
            bounds.append(torch.zeros(heads, head_dim, dtype=torch.float64, device=DEV))
            continue
        k, v = paged.gather(pool, layer, tables[b:b + 1].long(), n)
        k = k[0].double().repeat_interleave(group, 0)
        v = v[0].double().repeat_interleave(group, 0)
        qd = q[b].double()
        scores = torch.einsum("hd,htd->ht", qd, k) * scale
        refs.append(torch.einsum("ht,htd->hd", scores.softmax(-1), v))
        a = (torch.einsum("hd,htd->ht", qd.abs(), k.abs()) * scale).amax(-1)
        w = torch.einsum("ht,htd->hd", scores.softmax(-1), v.abs())
        fp32 = U32 * (2 * (head_dim + 3) * a + tile + 2 * math.ceil(n / tile) + 32)
        bounds.append(w * (fp32 + 2 * UNIT_HALF[q.dtype])[:, None])
    return torch.stack(refs), torch.stack(bounds)


def run(q, pool, layer, tables, lens, splits, tile=64):
    ws = pa.DecodeWorkspace(q.shape[0], q.shape[1], q.shape[2], splits, DEV, tile_tokens=tile)
    ws.partial.fill_(float("nan"))
    ws.lse.fill_(float("nan"))
    out = torch.full_like(q, float("nan"))
    pa.paged_decode_attention(q, pool, layer, tables, lens, 1 / math.sqrt(q.shape[-1]), out, ws)
    torch.cuda.synchronize()
    return out


SEQ_LENS = [1, 15, 16, 17, 0, 100, 1000, 4096, 8192]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("splits", [1, 8, 33])
def test_8b_shape_matches_float64_reference(dtype, splits):
    pool, q, tables, lens = make_case(dtype, SEQ_LENS)
    pool_before = pool.clone()
    out = run(q, pool, 1, tables, lens, splits)
    ref, bnd = reference_and_bound(q, pool, 1, tables, lens, 1 / math.sqrt(HEAD_DIM), 64)
    assert torch.equal(pool, pool_before)
    assert not out.isnan().any()
    assert torch.all(out[4] == 0)
    err = (out.double() - ref).abs()
    worst = (err / bnd).nan_to_num(0).max()
    assert torch.all(err <= bnd), f"max error {err.max().item():.3g}, max error / bound {worst:.3g}"


@pytest.mark.parametrize("group,block_size,tile", [(1, 8, 32), (3, 128, 64), (4, 64, 128)])
def test_other_groups_blocks_and_tiles(group, block_size, tile):
    pool, q, tables, lens = make_case(torch.bfloat16, [1, 63, 64, 65, 0, 700, 2048], block_size=block_size,
                                      heads=4 * group, kv_heads=4)
    out = run(q, pool, 0, tables, lens, splits=5, tile=tile)
    ref, bnd = reference_and_bound(q, pool, 0, tables, lens, 1 / math.sqrt(HEAD_DIM), tile)
    assert torch.all((out.double() - ref).abs() <= bnd)


def test_store_kv_writes_exactly_the_named_rows():
    pool, _, _, _ = make_case(torch.bfloat16, [1000])
    gen = torch.Generator(device=DEV).manual_seed(3)
    k = torch.randn(5, KV_HEADS, HEAD_DIM, generator=gen, device=DEV).to(torch.bfloat16)
    v = torch.randn(5, KV_HEADS, HEAD_DIM, generator=gen, device=DEV).to(torch.bfloat16)
    blocks = torch.tensor([3, -1, 60, 0, 3], dtype=torch.int32, device=DEV)
    rows = torch.tensor([15, 2, 0, 7, 1], dtype=torch.int32, device=DEV)
    keep = torch.tensor([0, 2, 3, 4], device=DEV)
    expected = pool.clone()
    paged.write(expected, 1, paged.RowIndex(blocks[keep].long(), rows[keep].long()), k[keep], v[keep])
    pa.store_kv(pool, 1, k, v, blocks, rows)
    torch.cuda.synchronize()
    assert torch.equal(pool, expected)


def test_cuda_graph_replay_of_store_and_attention_matches_eager():
    batch, maxb, splits = 4, 64, 8
    pool, _, _, _ = make_case(torch.bfloat16, [maxb * BLOCK] * batch)
    gen = torch.Generator(device=DEV).manual_seed(7)

    def inputs(lens):
        ids = torch.randperm(pool.shape[0], generator=gen, device=DEV)[: batch * maxb].view(batch, maxb).to(torch.int32)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
        last = (lens_t.long() - 1).clamp(min=0)
        blocks = torch.where(lens_t > 0, ids.gather(1, (last // BLOCK)[:, None])[:, 0], -1).to(torch.int32)
        return dict(q=torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=DEV).to(torch.bfloat16),
                    k=torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen, device=DEV).to(torch.bfloat16),
                    v=torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen, device=DEV).to(torch.bfloat16),
                    tables=ids, lens=lens_t, blocks=blocks, rows=(last % BLOCK).to(torch.int32))

    static = inputs([5, 300, 1, 1024])
    out = torch.empty_like(static["q"])
    ws = pa.DecodeWorkspace(batch, HEADS, HEAD_DIM, splits, DEV)
    scale = 1 / math.sqrt(HEAD_DIM)

    def step(x, pool_, out_):
        pa.store_kv(pool_, 1, x["k"], x["v"], x["blocks"], x["rows"])
        pa.paged_decode_attention(x["q"], pool_, 1, x["tables"], x["lens"], scale, out_, ws)

    step(static, pool.clone(), out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static, pool, out)
    for lens in ([1, 17, 1024, 0], [1000, 2, 64, 513]):
        new = inputs(lens)
        eager_pool, eager_out = pool.clone(), torch.empty_like(out)
        step(new, eager_pool, eager_out)
        for name, t in new.items():
            static[name].copy_(t)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(pool, eager_pool)
        assert torch.equal(out, eager_out)
        if 0 in lens:
            assert torch.all(out[lens.index(0)] == 0)
