"""The native prefill attention (csrc/prefill_attention.c, AVX512-BF16): causal attention of a prompt's new
tokens over its prefix and themselves, bfloat16 in and out. Checked against float64 under a bound derived from
its roundings, for bit-identical answers whatever the chunks a prompt arrives in, for causality, for reading any
strides in place, and in the lean forward: a prompt prefilled in chunks leaves the same logits and the same KV
as prefilled whole."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_kv_fp8 import prompt_of
from xpyd.model import native
from xpyd.model.runner import ModelRunner

KERNEL = native.load_prefill_attention()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"no native prefill attention here: "
                                f"{native.unavailable_reason('prefill_attention.c')}")
BF16 = torch.bfloat16


def _qkv(n: int, start: int, heads: int, kv_heads: int, hd: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, hd, generator=gen).to(BF16)
    k = torch.randn(start + n, kv_heads, hd, generator=gen).to(BF16)
    v = torch.randn(start + n, kv_heads, hd, generator=gen).to(BF16)
    return q, k, v


def _call(q, k, v, start: int, scale: float) -> torch.Tensor:
    """The kernel over the new tokens [start, start + len(q)) with the prefix [0, start) given head-major, as
    `paged.gather` returns it."""
    prefix = () if start == 0 else (k[:start].transpose(0, 1), v[:start].transpose(0, 1))
    return KERNEL(q, k[start:], v[start:], scale, *prefix)


def _exact(q, k, v, start: int, scale: float) -> torch.Tensor:
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    qd = q.double().transpose(0, 1)
    kd, vd = (t.double().transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
    scores = qd @ kd.transpose(1, 2) * scale
    visible = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(n))[:, None]
    return (torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ vd).transpose(0, 1)


@pytest.mark.parametrize("n,start,heads,kv_heads,hd", [(37, 0, 4, 2, 16), (100, 50, 9, 3, 64), (1, 70, 8, 8, 128),
                                                       (513, 1000, 6, 2, 64), (33, 31, 4, 1, 32), (8, 24, 2, 2, 256),
                                                       (45, 150, 8, 2, 96)])
def test_within_three_bfloat16_roundings_of_the_exact_attention(n, start, heads, kv_heads, hd):
    """Scores are exact products summed in float32; the softmax weights are rounded to bfloat16 for the P V
    products (half a unit, 2^-9 relative, each), the running sum is of the unrounded weights (another 2^-9 at
    most in the normalization), the output rounded once (2^-9 of it): at most 3 x 2^-9 x max|v| off the exact
    value, plus float32's own error (~2^-24 per term over a few thousand keys) and the exp polynomial's (~2
    units of float32): 4 x 2^-9 x max|v| holds them."""
    q, k, v = _qkv(n, start, heads, kv_heads, hd, seed=n + start + hd)
    scale = hd**-0.5
    ours = _call(q, k, v, start, scale)
    assert ours.dtype == BF16 and ours.shape == (n, heads, hd) and ours.is_contiguous()
    err = float((ours.double() - _exact(q, k, v, start, scale)).abs().max())
    assert err <= 4 * 2**-9 * float(v.abs().max()), err


def test_a_prompt_in_any_chunks_gives_the_bits_of_the_whole_prompt():
    q, k, v = _qkv(300, 0, 9, 3, 64, seed=1)
    whole = _call(q, k, v, 0, 0.125)
    for cuts in ([77, 200], [1, 2, 3, 255], [150], list(range(32, 300, 32))):
        edges = [0, *cuts, 300]
        parts = [_call(q[a:b], k[:b], v[:b], a, 0.125) for a, b in zip(edges, edges[1:])]
        assert torch.equal(torch.cat(parts), whole), cuts


def test_a_query_sees_no_key_after_its_own_position():
    q, k, v = _qkv(64, 40, 4, 2, 32, seed=2)
    before = _call(q, k, v, 40, 0.2)
    k2, v2 = k.clone(), v.clone()
    k2[40 + 31:] = 100.0  # every key and value after the 31st new token (position 70) changed
    v2[40 + 31:] = -7.0
    after = _call(q, k2, v2, 40, 0.2)
    assert torch.equal(after[:31], before[:31])  # (queries 0..30 see positions up to 40 + 30)
    assert not torch.equal(after[31:], before[31:])


def test_strided_inputs_are_read_in_place():
    """q and the new K/V as the lean forward holds them (slices of one [T, heads + 2 kv_heads, hd] tensor), the
    prefix head-major: the same bits as from contiguous copies."""
    heads, kv_heads, hd, start, n = 6, 2, 64, 20, 45
    q, k, v = _qkv(n, start, heads, kv_heads, hd, seed=3)
    fused = torch.cat((q, k[start:], v[start:]), dim=1)  # [n, heads + 2 kv_heads, hd]
    pre_k, pre_v = (t[:start].transpose(0, 1) for t in (k, v))  # [kv_heads, start, hd], strided
    got = KERNEL(fused[:, :heads], fused[:, heads : heads + kv_heads], fused[:, heads + kv_heads :], 0.125, pre_k, pre_v)
    want = KERNEL(q.contiguous(), k[start:].contiguous(), v[start:].contiguous(), 0.125, pre_k.contiguous(),
                  pre_v.contiguous())
    assert torch.equal(got, want)


@pytest.mark.parametrize("start,block_size", [(1, 16), (16, 16), (45, 16), (130, 8), (77, 32)])
def test_a_prefix_read_in_place_from_the_paged_pool_gives_the_bits_of_the_gathered_one(start, block_size):
    """`paged`: the prefix's rows read through a block table from the pool (shuffled blocks, a layer in the middle,
    a partly filled last block), no copy: the same bits as the prefix gathered head-major."""
    heads, kv_heads, hd, n, layers, layer = 6, 2, 64, 23, 3, 1
    q, k, v = _qkv(n, start, heads, kv_heads, hd, seed=start)
    nb = -(-start // block_size)
    num_blocks = nb + 5
    gen = torch.Generator().manual_seed(7)
    pool = torch.randn(num_blocks, kv_heads, layers, 2, block_size, hd, generator=gen).to(BF16)
    table = torch.randperm(num_blocks, generator=gen)[:nb]
    for t in range(start):  # the prefix's rows where the table puts them
        pool[table[t // block_size], :, layer, 0, t % block_size] = k[t]
        pool[table[t // block_size], :, layer, 1, t % block_size] = v[t]
    got = KERNEL.paged(q, k[start:], v[start:], 0.125, pool, layer, table, start)
    assert torch.equal(got, _call(q, k, v, start, 0.125))


def test_a_paged_prefix_with_a_block_outside_the_pool_is_refused():
    q, k, v = _qkv(4, 20, 4, 2, 64, seed=8)
    pool = torch.zeros(4, 2, 1, 2, 16, 64, dtype=BF16)
    for bad in ([0, 4], [-1, 0], [2]):  # past the pool, negative, too few for 20 tokens
        with pytest.raises(ValueError, match="prefill attention \\(paged\\)"):
            KERNEL.paged(q, k[20:], v[20:], 0.1, pool, 0, torch.tensor(bad), 20)
    with pytest.raises(ValueError, match="paged"):
        KERNEL.paged(q, k[20:], v[20:], 0.1, pool.float(), 0, torch.tensor([0, 1]), 20)


def test_arguments_it_cannot_take_are_refused():
    q, k, v = _qkv(4, 0, 4, 2, 64, seed=4)
    with pytest.raises(ValueError, match="bfloat16"):
        KERNEL(q.float(), k, v, 0.1)
    with pytest.raises(ValueError, match="shapes"):
        KERNEL(q, k[:3], v, 0.1)
    with pytest.raises(ValueError, match="both"):
        KERNEL(q, k, v, 0.1, k.transpose(0, 1), None)
    q8, k8, v8 = _qkv(4, 0, 4, 2, 24, seed=5)  # head_dim not a multiple of 16
    with pytest.raises(ValueError, match="refused"):
        KERNEL(q8, k8, v8, 0.1)


def test_the_lean_forward_prefills_a_prompt_in_chunks_to_the_same_logits_and_kv(tiny_model_dir):
    """bfloat16 tiny Llama (head_dim 16): with the kernel, chunks of 20 and 13 give the whole prompt's logits and
    K/V bit for bit; torch's SDPA (one causal call whole, a masked one per chunk) agrees within bfloat16 noise."""
    runner = ModelRunner(tiny_model_dir, BF16, num_blocks=48, max_seq_len=128, block_size=5)
    fast = runner.fast_path
    assert fast.prefill_attention == "kernel"
    prompt = prompt_of(70, 11)
    whole_blocks, chunk_blocks = (runner.pool.blocks.allocate(14) for _ in range(2))
    whole = runner.prefill(whole_blocks, prompt)
    for start, end in ((0, 20), (20, 33), (33, 70)):
        chunked = runner.prefill(chunk_blocks, prompt[:end], start=start)
    pool = runner.pool.tensor
    assert torch.equal(chunked, whole)
    assert torch.equal(pool[whole_blocks], pool[chunk_blocks])
    fast.prefill_attention = "sdpa"
    sdpa_blocks = runner.pool.blocks.allocate(14)
    sdpa = runner.prefill(sdpa_blocks, prompt)
    # (bfloat16 noise through a random model of weights of std 0.5: a few percent of the logits' range)
    assert float((sdpa - whole).abs().max()) <= 0.1 * float(whole.abs().max())
    assert not torch.equal(sdpa, whole)  # (two kernels indeed: the check above is not of one path with itself)
    with pytest.raises(ValueError, match="prefill_attention"):
        fast.prefill_attention = "flash"


def test_float32_keeps_torchs_attention(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, torch.float32, num_blocks=8, max_seq_len=64, block_size=16)
    assert runner.fast_path.prefill_attention == "sdpa"
    with pytest.raises(ValueError, match="bfloat16"):
        runner.fast_path.prefill_attention = "kernel"
