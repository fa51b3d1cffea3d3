"""The GPU engine's Triton decode attention and KV store (xpyd/model/gpu/paged_attention.py), run on the CPU
by Triton's interpreter (TRITON_INTERPRET=1) at tiny sizes, against a float64 reference computed from the same
pool through paged.gather.

Error bounds, per output element (b, h, d), relative to W = sum_t p_t |v_td| / sum_t p_t (p the exact
softmax weights): every error below is a relative error of a weight or of a sum of p_t v_td terms, and
W bounds both |out| and the size of those sums:
- scores: fp32 dot over D terms of products exact or rounded once: |ds| <= (D + 3) u A, u = 2^-24, A the
  largest scale * sum_d |q_d k_d| (Higham's gamma_D, plus the scale and log2(e) multiplies);
- weights exp(s - m): relative 2 |ds| + 4u (exp2 on the GPU is within 2 ulps);
- sums: within a tile a sequential dot over `tile` tokens at worst, across tiles and splits one rounding per
  step: (tile + 2 n_tiles + 32) u;
- float16/bfloat16 round the weights once for the second dot (relative u_h) and the output once (u_h):
  2 u_h more, u_h = 2^-11 (fp16) or 2^-8 (bf16).
Triton 3.6's interpreter multiplies bfloat16 as raw integers (no bf16 dot), so the half-precision path is
checked here in float16 (the same kernel code); tests/gpu/test_paged_attention_cuda.py checks bfloat16.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="the GPU engine's kernels need Triton, which is not installed here")

from xpyd.model import paged  # noqa: E402
from xpyd.model.gpu import paged_attention as pa  # noqa: E402

U32 = 2.0**-24
UNIT_HALF = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def reference(q, pool, layer, tables, seq_lens, scale):
    """float64 attention over each row's first seq_lens[b] positions; also the bound's inputs:
    A = max_t scale * sum_d |q_d k_td| per (b, h) and W per (b, h, d)."""
    batch, heads, _ = q.shape
    length = max(int(seq_lens.max()), 1)
    k, v = paged.gather(pool, layer, tables.long(), length)
    group = heads // pool.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    qd = q.double()
    valid = torch.arange(length)[None, :] < seq_lens.long()[:, None]  # [B, T]
    scores = torch.einsum("bhd,bhtd->bht", qd, k) * scale
    weights = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    out = torch.einsum("bht,bhtd->bhd", weights.nan_to_num(0.0), v)
    a = (torch.einsum("bhd,bhtd->bht", qd.abs(), k.abs()) * scale).masked_fill(~valid[:, None, :], 0).amax(-1)
    w = torch.einsum("bht,bhtd->bhd", weights.nan_to_num(0.0), v.abs())
    return out, a, w


def bound(q, a, w, seq_lens, tile):
    """The module docstring's bound, per (b, h, d)."""
    head_dim = q.shape[-1]
    n_tiles = (seq_lens.double() / tile).ceil()[:, None]
    fp32 = U32 * (2 * (head_dim + 3) * a + tile + 2 * n_tiles + 32)
    return w * (fp32 + 2 * UNIT_HALF[q.dtype])[..., None]


def make_case(dtype, block_size, kv_heads, group, head_dim, seq_lens, layers=2, spare_blocks=3, seed=0):
    """A pool with random K/V everywhere and shuffled, non-contiguous block tables (padding past each
    table's end: block ids of other requests, as a stale table would hold)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    per_row = [-(-n // block_size) for n in seq_lens]
    width = max(max(per_row), 1)
    num_blocks = sum(per_row) + spare_blocks
    pool = torch.randn(num_blocks, kv_heads, layers, 2, block_size, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in per_row:
        row = ids[at:at + n]
        at += n
        tables.append(row + ids[-1:] * (width - n))
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    return pool, q, torch.tensor(tables, dtype=torch.int32), lens


def run(q, pool, layer, tables, lens, splits, tile):
    ws = pa.DecodeWorkspace(q.shape[0], q.shape[1], q.shape[2], splits, "cpu", tile_tokens=tile)
    ws.partial.fill_(float("nan"))
    ws.lse.fill_(float("nan"))
    out = torch.full_like(q, float("nan"))
    returned = pa.paged_decode_attention(q, pool, layer, tables, lens, 1 / math.sqrt(q.shape[-1]), out, ws)
    assert returned is out
    return out


# lengths: 1, an exact multiple of the block size (32: 4 blocks of 8, 1 of 32), ones that are not (37, 5, 61),
# a padding row (0); 61 spans four tiles, so with 4 splits every split holds some of it
SEQ_LENS = [1, 32, 0, 37, 5, 61]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("block_size", [8, 32])
def test_attention_matches_float64_reference(dtype, group, splits, block_size):
    tile = 16  # blocks of 8: a tile spans two blocks; blocks of 32: two tiles per block
    pool, q, tables, lens = make_case(dtype, block_size, kv_heads=2, group=group, head_dim=32, seq_lens=SEQ_LENS)
    scale = 1 / math.sqrt(32)
    pool_before = pool.clone()
    out = run(q, pool, 1, tables, lens, splits, tile)
    ref, a, w = reference(q, pool, 1, tables, lens, scale)
    assert torch.equal(pool, pool_before)
    err = (out.double() - ref).abs()
    assert not out.isnan().any()
    assert torch.all(out[2] == 0)  # the padding row: exact zeros
    assert torch.all(err <= bound(q, a, w, lens, tile)), f"max error {err.max().item():.3g}"


def test_attention_reads_the_named_layer_and_every_split_of_a_short_request():
    # 7 splits, 1 tile at most per request: splits past the end must write lse = -inf and weigh nothing
    pool, q, tables, lens = make_case(torch.float32, 8, kv_heads=1, group=2, head_dim=16, seq_lens=[3, 9, 1],
                                      layers=3)
    for layer in (0, 2):
        out = run(q, pool, layer, tables, lens, splits=7, tile=16)
        ref, a, w = reference(q, pool, layer, tables, lens, 0.25)
        assert torch.all((out.double() - ref).abs() <= bound(q, a, w, lens, 16))


def test_store_kv_writes_exactly_the_named_rows_of_the_named_layer():
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(1)
        pool = torch.randn(6, 3, 2, 2, 8, 16, generator=gen).to(dtype)
        k = torch.randn(4, 3, 16, generator=gen).to(dtype)
        v = torch.randn(4, 3, 16, generator=gen).to(dtype)
        blocks = torch.tensor([4, -1, 0, 4], dtype=torch.int32)  # row 1 is padding
        rows = torch.tensor([7, 3, 0, 2], dtype=torch.int32)
        expected = pool.clone()
        keep = torch.tensor([0, 2, 3])
        paged.write(expected, 1, paged.RowIndex(blocks[keep].long(), rows[keep].long()), k[keep], v[keep])
        pa.store_kv(pool, 1, k, v, blocks, rows)
        assert torch.equal(pool, expected)


def test_store_then_attend_sees_the_current_token():
    pool, q, tables, lens = make_case(torch.float32, 8, kv_heads=2, group=2, head_dim=16, seq_lens=[9, 4])
    last = lens.long() - 1
    blocks = tables[torch.arange(2), last // 8].contiguous()
    rows = (last % 8).to(torch.int32)
    k = 5 * torch.randn(2, 2, 16)  # large keys: the current token dominates, so a missing store shows
    v = torch.randn(2, 2, 16)
    expected = pool.clone()
    paged.write(expected, 0, paged.RowIndex(blocks.long(), rows.long()), k, v)
    pa.store_kv(pool, 0, k, v, blocks, rows)
    out = run(q, pool, 0, tables, lens, splits=2, tile=16)
    ref, a, w = reference(q, expected, 0, tables, lens, 0.25)
    assert torch.all((out.double() - ref).abs() <= bound(q, a, w, lens, 16))


def test_default_splits_fill_two_waves_for_one_request_and_one_split_for_many():
    assert pa.default_splits(1, 8, 132) == 33
    assert pa.default_splits(8, 8, 132) == 5
    assert pa.default_splits(64, 8, 132) == 1
    assert pa.default_splits(1, 1, 132) == 64  # capped
    with pytest.raises(ValueError):
        pa.default_splits(0, 8, 132)


def test_why_unavailable_says_why(monkeypatch):
    assert pa.why_unavailable(torch.device("cpu")) is None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET=1" in pa.why_unavailable(torch.device("cpu"))
    assert "meta" in pa.why_unavailable(torch.device("meta"))
    if not torch.cuda.is_available():
        assert "CUDA" in pa.why_unavailable(torch.device("cuda"))


def test_refuses_mismatched_inputs():
    pool, q, tables, lens = make_case(torch.float32, 8, kv_heads=2, group=2, head_dim=16, seq_lens=[9, 4])
    out = torch.empty_like(q)
    small = pa.DecodeWorkspace(1, 4, 16, 2, "cpu")
    with pytest.raises(ValueError, match="workspace"):
        pa.paged_decode_attention(q, pool, 0, tables, lens, 0.25, out, small)
    ws = pa.DecodeWorkspace(2, 4, 16, 2, "cpu")
    with pytest.raises(ValueError, match="int32"):
        pa.paged_decode_attention(q, pool, 0, tables.long(), lens, 0.25, out, ws)
    with pytest.raises(ValueError, match="layer"):
        pa.paged_decode_attention(q, pool, 2, tables, lens, 0.25, out, ws)
    with pytest.raises(ValueError, match="multiple"):
        three = pa.DecodeWorkspace(2, 3, 16, 2, "cpu")
        pa.paged_decode_attention(q[:, :3], pool, 0, tables, lens, 0.25, out[:, :3], three)
    with pytest.raises(ValueError):
        pa.DecodeWorkspace(2, 4, 16, 2, "cpu", tile_tokens=24)
    with pytest.raises(ValueError):
        pa.DecodeWorkspace(2, 4, 16, 2, "cpu", num_warps=3)


def test_workspace_warps_follow_the_tile_size():
    assert pa.DecodeWorkspace(1, 4, 128, 2, "cpu").num_warps == 8  # 64 x 128 tiles
    assert pa.DecodeWorkspace(1, 4, 128, 2, "cpu", tile_tokens=32).num_warps == 4
    assert pa.DecodeWorkspace(1, 4, 96, 2, "cpu").num_warps == 8  # head_dim 96 pads to 128
    assert pa.DecodeWorkspace(1, 4, 128, 2, "cpu", num_warps=2).num_warps == 2
