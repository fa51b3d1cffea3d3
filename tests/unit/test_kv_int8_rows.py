"""The int8 KV cache's rows (`xpyd.model.kv_int8`): head_dim signed codes and a float16 scale per row, the
layout's bytes, a pool written and read through the codec, and the rotation the rows are stored in
(`xpyd.model.kv_rotation`)."""

from __future__ import annotations

import pytest
import torch

from xpyd.model.kv_int8 import LEVELS, Int8RowCodec, decode_rows, encode_rows
from xpyd.model.kv_layout import ROW_ROTATION, KVLayout
from xpyd.model.kv_rotation import rotation, signs
from xpyd.model.kv_pool import KVPool, torch_dtype
from xpyd.model import paged


def _rows(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g).mul_(30)  # rows of any size
    return x.to(dtype)


def test_a_row_is_its_codes_then_its_float16_scale_little_endian():
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0 / 64]])
    rows = encode_rows(x)
    assert rows.dtype == torch.uint8 and rows.shape == (1, 6)
    scale = torch.tensor([2.0 / LEVELS]).to(torch.float16)  # max |x| = 2
    assert bytes(rows[0, 4:].tolist()) == scale.numpy().tobytes()  # (little-endian float16)
    codes = rows[0, :4].view(torch.int8).tolist()
    assert codes[1] == -127 and codes == [round(v / scale.float().item()) for v in x[0].tolist()]
    assert torch.equal(decode_rows(rows, torch.float32), rows[:, :4].view(torch.int8).float() * scale.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_value_comes_back_within_half_a_step_of_its_row(dtype):
    """|x - decoded| <= s/2 (rounding to the nearest code) + the rounding of the decoded value to ``dtype``,
    where s is the row's float16 scale (max|x| / 127, rounded: the code of the largest value may be clamped
    at 127 when the scale rounded down, which costs at most 127 * s * 2^-11 more)."""
    x = _rows((64, 3, 64), 1, dtype)
    rows = encode_rows(x)
    back = decode_rows(rows, dtype).float()
    s = rows[..., 64:].contiguous().view(torch.float16).float()
    eps = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}[dtype]
    bound = s / 2 + LEVELS * s * 2.0**-11 + x.float().abs() * eps * 2
    assert ((back - x.float()).abs() <= bound).all()
    assert (back - x.float()).abs().amax() > 0  # (it is a quantization)
    codes = rows[..., :64].view(torch.int8)
    assert codes.min() >= -LEVELS and codes.max() <= LEVELS


def test_zero_rows_tiny_rows_and_huge_rows():
    x = torch.zeros(2, 8)
    x[1, 3] = 1e-9  # (its scale underflows float16 to 0: the row reads back as zeros, an error of 1e-9)
    rows = encode_rows(x)
    assert rows[:, :8].view(torch.int8).eq(0).all() and decode_rows(rows, torch.float32).eq(0).all()
    huge = torch.full((1, 8), 1e7)  # (the scale saturates at float16's largest: values clamp to 127 steps)
    back = decode_rows(encode_rows(huge), torch.float32)
    assert torch.isfinite(back).all() and back.eq(127 * 65504.0).all()


def test_an_int8_layout_holds_a_scale_per_row_and_about_half_bfloat16s_bytes():
    bf16 = KVLayout(30, 3, 64, "bfloat16", 10, 16)
    int8 = KVLayout(30, 3, 64, "int8", 10, 16)
    assert int8.row_dim == 66 and int8.shape == (10, 3, 30, 2, 16, 66) and bf16.row_dim == 64
    assert int8.token_bytes == 30 * 2 * 3 * 66 == 11_880 and bf16.token_bytes == 23_040
    assert int8.compat()["dtype"] == "int8" and "kv_scales" not in int8.compat()  # (nothing calibrated)
    assert torch_dtype(int8) == torch.uint8
    latent = KVLayout(30, 1, 576, "int8", 10, 16, kind="latent")  # (a scale per latent row: DeepSeek's MLA)
    assert latent.shape == (10, 1, 30, 1, 16, 578) and latent.token_bytes == 30 * 578
    with pytest.raises(ValueError, match="not fp8"):
        KVLayout(30, 1, 576, "fp8_e4m3", 10, 16, kind="latent", scales="pow2:0")


def test_an_int8_pool_is_bytes_written_and_read_through_its_codec():
    layout = KVLayout(2, 3, 64, "int8", 4, 4)
    pool = KVPool(layout).tensor
    assert pool.shape == layout.shape and pool.dtype == torch.uint8
    r = rotation(64)
    codec = Int8RowCodec(torch.bfloat16, r)
    k, v = _rows((6, 3, 64), 2, torch.bfloat16), _rows((6, 3, 64), 3, torch.bfloat16)
    table = [2, 0]
    where = paged.rows_of(table, torch.arange(6), 4, torch.device("cpu"))
    k_back, v_back = paged.write(pool, 1, where, k, v, codec)  # (what the pool now holds, as values)
    assert torch.equal(pool[2, :, 1, 0, 0], encode_rows(k[0].float() @ r))  # token 0's K rows (turned), byte for byte
    tables = paged.padded_tables([table], 2, torch.device("cpu"))
    k_read, v_read = paged.gather(pool, 1, tables, 6, codec)  # [1, kv_heads, 6, 64]
    assert torch.equal(k_read[0].transpose(0, 1), k_back) and torch.equal(v_read[0].transpose(0, 1), v_back)
    # each turned value within half a step (amax of the turned row / 127, its float16 scale up to 2^-11 over) and
    # the float32 turns; R orthonormal keeps the error's length; bfloat16 rounds the result (2^-8 of it)
    for x, back in ((k, k_back), (v, v_back)):
        x = x.float()
        step = (x @ r).abs().amax(-1) / LEVELS * (1 + 2.0**-10)
        err = torch.linalg.vector_norm(back.float() - x, dim=-1)
        assert (err <= (step / 2 + 2.0**-20 * x.abs().amax(-1)) * 64**0.5
                + 2.0**-8 * torch.linalg.vector_norm(x, dim=-1)).all()


@pytest.mark.parametrize("hd,block", [(16, 16), (40, 8), (64, 64), (96, 32), (128, 128), (256, 256)])
def test_the_rotation_is_orthonormal_signed_hadamard_blocks(hd, block):
    assert rotation(hd).dtype == torch.float32 and rotation(hd).is_contiguous()
    r = rotation(hd).double()
    assert r.shape == (hd, hd)
    assert torch.allclose(r @ r.T, torch.eye(hd, dtype=torch.float64), atol=2**-21)
    assert torch.equal(r.abs() > 0, torch.block_diag(*[torch.ones(block, block)] * (hd // block)).bool())
    assert torch.allclose(r.abs()[r.abs() > 0], torch.full((hd * block,), block**-0.5, dtype=torch.float64))
    assert torch.equal(torch.sign(r[:, :1].flatten()[:block]), torch.tensor(signs(block), dtype=torch.float64))


def test_the_rotation_is_the_same_everywhere():
    """Fixed bits (SHA-256 of a constant), not a random generator: every worker stores rows in one basis. A change
    here changes what int8 pools mean: `kv_layout.ROW_ROTATION` must change with it (the handshake names it)."""
    assert [int(x) for x in signs(16)] == [1, -1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, -1, -1, 1, 1]
    assert torch.equal(rotation(64), rotation(64)) and ROW_ROTATION == "hadamard-signed/1"


def test_a_row_with_an_outlier_channel_keeps_its_small_values_when_turned():
    """K's rows often have a channel or two far larger than the rest. Quantized as they are, the scale follows the
    outlier and the small values get a few levels; turned, the row's largest value is close to its length / 8
    (64 values), and the small values' error falls with it."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 64, generator=g) * 0.1
    x[:, 7] = 20.0  # (the outlier channel)
    plain = decode_rows(encode_rows(x), torch.float32) - x
    r = rotation(64)
    turned = decode_rows(encode_rows(x @ r), torch.float32) @ r.T - x
    small = torch.arange(64) != 7
    rms = lambda e: float(e[:, small].pow(2).mean().sqrt())  # noqa: E731
    assert rms(turned) < rms(plain) / 4, (rms(turned), rms(plain))


def test_an_int8_layout_names_its_rotation_and_a_latent_one_does_not():
    assert KVLayout(30, 3, 64, "int8", 10, 16).compat()["row_rotation"] == ROW_ROTATION
    assert "row_rotation" not in KVLayout(30, 3, 64, "bfloat16", 10, 16).compat()
    assert "row_rotation" not in KVLayout(30, 1, 576, "int8", 10, 16, kind="latent").compat()
