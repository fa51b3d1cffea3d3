"""`LayerAttention`'s window convention (transformers': from position q, keys (q - window, q]), the attention over
keys that start part-way (a local layer's), and `paged.gather` reading only the blocks from a first position."""

from __future__ import annotations

import pytest
import torch

from xpyd.model import paged
from xpyd.model.layer_attention import LayerAttention, attend, visible

torch.set_num_threads(1)


def test_a_window_holds_its_query_and_the_window_minus_one_before():
    spec = LayerAttention(scale=1.0, window=4)
    assert [spec.first_visible(p) for p in (0, 3, 4, 9)] == [0, 0, 1, 6]
    assert LayerAttention(scale=1.0).first_visible(100) == 0
    mask = visible(spec, 6, 2, 0, 8, torch.device("cpu"))  # queries 6, 7 over keys 0..7
    assert mask.tolist() == [[k in (3, 4, 5, 6) for k in range(8)], [k in (4, 5, 6, 7) for k in range(8)]]
    with pytest.raises(ValueError):
        LayerAttention(scale=1.0, window=0)
    with pytest.raises(ValueError):
        LayerAttention(scale=1.0, softcap=0.0)


def _dense(q, k, v, spec: LayerAttention) -> torch.Tensor:
    """Attention over every position from 0, masked: what the keys from a later start must give."""
    n = k.shape[2]
    k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(2, 3) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    m = q.shape[2]
    scores = scores.masked_fill(~visible(spec, n - m, m, 0, n, q.device), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_keys_from_the_first_visible_position_give_the_dense_masked_attention(softcap, m):
    gen = torch.Generator().manual_seed(m)
    n, spec = 20, LayerAttention(scale=0.4, window=5, softcap=softcap)
    q = torch.randn(1, 4, m, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    first = spec.first_visible(n - m)
    ours = attend(q, k[:, :, first:], v[:, :, first:], spec, q_start=n - m, k_start=first)
    torch.testing.assert_close(ours, _dense(q, k, v, spec))
    with pytest.raises(ValueError, match="do not end with the queries"):
        attend(q, k[:, :, first:-1], v[:, :, first:-1], spec, q_start=n - m, k_start=first)


@pytest.mark.parametrize("first,length", [(0, 13), (4, 13), (5, 10), (7, 8), (12, 15)])
def test_gather_from_a_first_position_is_the_full_gathers_tail(first, length):
    pool = torch.randn(6, 2, 3, 2, 5, 4)  # [blocks, kv_heads, layers, 2, block_size, head_dim]
    tables = torch.tensor([[4, 1, 5], [2, 0, 3]])
    k_all, v_all = paged.gather(pool, 1, tables, length)
    k, v = paged.gather(pool, 1, tables, length, first=first)
    assert torch.equal(k, k_all[:, :, first:]) and torch.equal(v, v_all[:, :, first:])
