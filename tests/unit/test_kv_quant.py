"""The fp8 KV cache's numbers (xpyd.model.kv_quant): the codes' table against torch's own conversions, the
quantize/dequantize round trip within the format's precision times the scale, saturation instead of NaN,
power-of-two scales from calibration and their digest, and the layout and pool of an fp8 cache."""

from __future__ import annotations

import math

import pytest
import torch

from xpyd.model import paged
from xpyd.model.kv_layout import KVLayout
from xpyd.model.kv_pool import KVPool
from xpyd.model.kv_quant import FORMATS, MARGIN, KVCodec, KVScales, _exponent, lut, table_value

FMTS = sorted(FORMATS)


@pytest.mark.parametrize("name", FMTS)
def test_the_table_equals_torchs_conversion_for_all_256_codes(name):
    ours = lut(name)
    torchs = torch.arange(256, dtype=torch.uint8).view(FORMATS[name].torch_dtype).float()
    assert torch.equal(ours.isnan(), torchs.isnan())
    both = ~ours.isnan()
    assert torch.equal(ours[both].view(torch.int32), torchs[both].view(torch.int32))  # bit for bit (-0.0 too)
    finite = ours[ours.isfinite()]
    assert float(finite.max()) == FORMATS[name].max and float(finite.min()) == -FORMATS[name].max


@pytest.mark.parametrize("name", FMTS)
def test_every_code_quantizes_back_to_itself(name):
    scales = _scales(name, layers=1, heads=1, k=-3, v=5)
    codec = KVCodec(scales, torch.float32)
    codes = torch.arange(256, dtype=torch.uint8)
    keep = lut(name).isfinite()
    for layer_scale, which in ((2.0**-3, 0), (2.0**5, 1)):
        values = (lut(name) * layer_scale)[keep].view(-1, 1, 1)
        k, v = codec.encode(0, values, values)
        got = (k, v)[which].view(-1)
        assert torch.equal(got, codes[keep]), name


def _scales(name, layers, heads, k=0, v=0) -> KVScales:
    return KVScales(name, tuple((k,) * heads for _ in range(layers)), tuple((v,) * heads for _ in range(layers)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FMTS)
def test_round_trip_error_is_within_the_formats_precision_times_the_scale(name, dtype):
    fmt = FORMATS[name]
    heads, exps = 3, (-6, 0, 4)
    scales = KVScales(name, (exps,), (exps,))
    codec = KVCodec(scales, dtype)
    gen = torch.Generator().manual_seed(1)
    # per head: values spread over many binades up to the format's max times that head's scale
    mags = torch.exp2(torch.rand(4000, heads, 8, generator=gen) * -24)  # (0, 1]: within range
    signs = torch.where(torch.rand(4000, heads, 8, generator=gen) < 0.5, -1.0, 1.0)
    s = torch.tensor([2.0**e for e in exps]).view(1, heads, 1)
    x = (signs * mags * fmt.max * s).to(dtype)
    k, v = codec.encode(0, x, x)
    assert torch.equal(k, v) and k.dtype == torch.uint8
    back, _ = codec.decode(0, k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0))
    back = back[0].permute(1, 0, 2).double()
    x = x.double()
    # normal range: relative 2^-(m+1); below it (subnormal codes): half the smallest step, times the scale
    bias = (1 << (fmt.exponent_bits - 1)) - 1
    smallest_step = 2.0 ** (1 - bias - fmt.mantissa_bits)
    bound = torch.maximum(fmt.relative * x.abs(), torch.full_like(x, smallest_step / 2) * s)
    assert ((back - x).abs() <= bound).all()


@pytest.mark.parametrize("name", FMTS)
def test_values_past_the_range_saturate(name):
    codec = KVCodec(_scales(name, 1, 2, k=-2, v=1), torch.bfloat16)
    fmt_max = FORMATS[name].max
    x = torch.tensor([[[1e30, -1e30, 3 * fmt_max, float("inf")], [0.0, -0.0, 1e-30, -float("inf")]]]).to(torch.bfloat16)
    k, v = codec.encode(0, x, x)
    kd, vd = codec.decode(0, k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2))
    kd, vd = kd[0].transpose(0, 1).float(), vd[0].transpose(0, 1).float()
    assert kd.isfinite().all() and vd.isfinite().all()
    assert kd[0, 0].tolist() == [fmt_max / 4, -fmt_max / 4, fmt_max / 4, fmt_max / 4]  # head 0: scale 2^-2
    assert vd[0, 0].tolist() == [fmt_max * 2, -fmt_max * 2, fmt_max * 2, fmt_max * 2]  # head 0: scale 2^1
    assert kd[0, 1, 3] == -fmt_max / 4 and kd[0, 1, :3].abs().max() == 0


def test_the_exponent_is_the_power_of_two_at_or_above_amax_times_the_margin():
    for amax in (1.0, 3.0, 0.1, 100.0, 448.0 / 4, 448.0 / 4 * (1 + 2**-20), 1e-30):
        e = _exponent(amax, 448.0)
        assert 2.0**e >= amax * MARGIN / 448.0 > 2.0 ** (e - 1), amax
    assert _exponent(448.0 / 4, 448.0) == 0  # exactly a power of two: itself
    assert _exponent(0.0, 448.0) == 0 and _exponent(math.nan, 448.0) == 0


def test_calibrated_scales_are_per_layer_and_head_and_the_digest_names_them():
    pool = torch.zeros(3, 2, 4, 2, 8, 16)  # [blocks, kv_heads, layers, 2, block_size, hd]
    pool[1, 0, 2, 0, 3, 5] = -7.0  # layer 2, head 0, K
    pool[2, 1, 0, 1, 0, 0] = 0.3  # layer 0, head 1, V
    scales = KVScales.calibrated("fp8_e4m3", pool.to(torch.bfloat16))
    assert scales.k_exponents[2][0] == _exponent(7.0, 448.0) and scales.v_exponents[0][1] == _exponent(0.3, 448.0)
    assert scales.k_exponents[0] == (0, 0) and len(scales.k_exponents) == 4
    other = KVScales("fp8_e4m3", scales.k_exponents, ((1, 0),) + scales.v_exponents[1:])
    assert scales.digest() != other.digest() and scales.digest() == KVScales.calibrated("fp8_e4m3", pool).digest()
    assert KVScales("fp8_e5m2", scales.k_exponents, scales.v_exponents).digest() != scales.digest()
    with pytest.raises(ValueError, match="one exponent per layer and KV head"):
        KVScales("fp8_e4m3", ((0, 0),), ((0,),))
    with pytest.raises(ValueError, match="bfloat16"):
        KVScales("bfloat16", ((0,),), ((0,),))


def test_an_fp8_layout_halves_bfloat16s_bytes_and_names_its_scales():
    shape = dict(num_layers=30, num_kv_heads=3, head_dim=64, num_blocks=10, block_size=16)
    bf16 = KVLayout(dtype="bfloat16", **shape)
    fp8 = KVLayout(dtype="fp8_e4m3", scales="pow2:abc", **shape)
    assert fp8.token_bytes * 2 == bf16.token_bytes == 23040 and fp8.block_bytes * 2 == bf16.block_bytes
    assert "kv_scales" not in bf16.compat()  # (the 16-bit layouts' compat as before)
    assert fp8.compat() == {**bf16.compat(), "dtype": "fp8_e4m3", "kv_scales": "pow2:abc"}
    with pytest.raises(ValueError, match="scales exactly when"):
        KVLayout(dtype="fp8_e5m2", **shape)
    with pytest.raises(ValueError, match="scales exactly when"):
        KVLayout(dtype="bfloat16", scales="pow2:abc", **shape)


def test_an_fp8_pool_is_bytes_written_and_read_through_its_codec():
    name = "fp8_e4m3"
    scales = KVScales(name, ((-2, 1), (0, 3)), ((4, -1), (2, 2)))
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=name, num_blocks=6, block_size=4,
                      scales=scales.digest())
    memory = bytearray(layout.total_bytes)
    pool = KVPool(layout, buffer=memoryview(memory))
    assert pool.tensor.dtype == torch.uint8 and pool.tensor.shape == layout.shape
    codec = KVCodec(scales, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(7, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    table = [4, 1]
    where = paged.rows_of(table, torch.arange(7), 4, torch.device("cpu"))
    stored_k, stored_v = paged.write(pool.tensor, 1, where, k, v, codec)
    keys, values = paged.gather(pool.tensor, 1, paged.padded_tables([table], 2, torch.device("cpu")), 7, codec)
    # what the write says the pool now holds is what a read gives back (prefill attends over it)
    assert torch.equal(stored_k.transpose(0, 1).unsqueeze(0), keys)
    assert torch.equal(stored_v.transpose(0, 1).unsqueeze(0), values)
    k_codes, v_codes = codec.encode(1, k, v)
    expect_k, expect_v = codec.decode(1, k_codes.transpose(0, 1).unsqueeze(0), v_codes.transpose(0, 1).unsqueeze(0))
    assert torch.equal(keys, expect_k) and torch.equal(values, expect_v) and keys.dtype == torch.bfloat16
    assert (keys.float() - k.transpose(0, 1).float()).abs().max() <= 2.0**-4 * float(k.abs().max()) + 1e-6
    written = bytes(memory)  # the pool's bytes are the codes, in place in the buffer
    assert written.count(0) < len(written) and pool.buffer().nbytes == layout.total_bytes
    assert bytes(pool.tensor[4, :, 1, 0, 0].contiguous().numpy()) == bytes(k_codes[0].contiguous().numpy())
