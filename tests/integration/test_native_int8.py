"""The native decode attention over an int8 KV pool (`DecodeAttention.int8`): rows of head_dim signed codes
and the row's float16 scale (little-endian), encoded here by a reference encoder written from the format's
spec, against a float32 torch attention over the dequantized rows, with a bound derived from the error of
the arithmetic (not tuned); the step's K/V encoded by the kernel into exactly the reference's bytes (in a
rotated basis: within the float32 rounding of the turn), written in place; bad tables and inputs refused."""

from __future__ import annotations

import pytest
import torch

from xpyd.model import kv_rotation, native

from tests.integration.test_native_kernels import paged_case

BF16 = torch.bfloat16
U = 2.0**-24  # float32's unit roundoff
EXP_ULPS = 4  # expf / torch's exp: within a few units in the last place
SHAPES = [(9, 3, 64), (12, 2, 96), (4, 2, 40)]  # SmolLM2-135M; the generic copy; a row with a scalar tail


@pytest.fixture(scope="module")
def kernel() -> native.DecodeAttention:
    k = native.load_decode_attention()
    if k is None:  # this machine has gcc: a failed build here is a defect, not a skip
        pytest.fail(f"native decode attention did not build: {native.unavailable_reason()}")
    return k


def encode(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., hd] -> uint8 [..., hd + 2], the format's spec: amax over the row in float32,
    s16 = float16(min(amax / 127, 65504)), codes = clamp(round_half_even(x / s16), -127, 127) (0 where s16 is 0),
    then s16's bits, low byte first."""
    xf = x.float()
    s16 = (xf.abs().amax(-1, keepdim=True) / 127).clamp_max(65504).to(torch.float16)
    s = s16.float()
    codes = torch.where(s > 0, torch.round(xf / s.clamp_min(torch.finfo(torch.float32).tiny)), 0.0)
    codes = codes.clamp(-127, 127).to(torch.int8).view(torch.uint8)
    bits = s16.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.cat([codes, (bits & 0xFF).to(torch.uint8), (bits >> 8).to(torch.uint8)], dim=-1)


def decode(rows: torch.Tensor) -> torch.Tensor:
    """uint8 rows [..., hd + 2] -> their values, float32 [..., hd]: code * scale (exact in float32)."""
    codes = rows[..., :-2].contiguous().view(torch.int8).float()
    bits = rows[..., -2].to(torch.int32) | rows[..., -1].to(torch.int32) << 8
    s16 = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.float16)
    return codes * s16.float().unsqueeze(-1)


def int8_case(heads, kv_heads, hd, block_size, lens, seed, spare=5):
    """paged_case's pool with rows of magnitudes 2^-3..2^3, some rows all zero (scale 0) and some tiny (a float16
    subnormal scale), encoded: (the uint8 pool, tables, q, the step's K and V values, bfloat16)."""
    values, tables, q, k_new, v_new = paged_case(heads, kv_heads, hd, block_size, lens, spare=spare,
                                                  seed=seed)
    gen = torch.Generator().manual_seed(seed)
    mags = 2.0 ** torch.randint(-3, 4, (*values.shape[:-1], 1), generator=gen).float()
    pick = torch.rand(mags.shape, generator=gen)
    mags[pick < 0.03] = 0.0
    mags[(pick >= 0.03) & (pick < 0.06)] = 2.0**-12  # amax / 127 ~ 2^-17: below float16's normals (2^-14)
    pool = encode(values.float() * mags)
    return pool, tables, q, k_new, v_new


def attention_bound(q, kv, scale):
    """For one request and KV head's group of query heads q [g, hd] over its dequantized K/V kv [2, n, hd]: the
    float64 result, and how far a float32 evaluation may be from it, elementwise (first order in U).

    Scores: a dot product of hd terms, scaled twice (the row's scale, the attention scale), then the max
    subtracted: |error| <= D = ((hd + 4) U) * scale * max_j sum_i |q_i k_ji| for every score. Softmax: scores
    off by D move each weight p_j = e_j / sum e by at most a factor exp(2D) ~ 1 + 2D, exp adds EXP_ULPS, the
    n-term sum of the numerators n U, the division 2 U. Output: sum_j p_j v_j in float32 (n terms: n U
    relative to sum_j p_j |v_j|), the weight times the row's V scale U. So |error| <= (2D + (2n + EXP_ULPS + 4) U)
    * sum_j p_j |v_j| at each output element."""
    q64, k, v = q.double(), kv[0].double(), kv[1].double()
    n, hd = k.shape
    p = torch.softmax(q64 @ k.T * scale, dim=-1)  # [g, n]
    d = (hd + 4) * U * scale * float((q64.abs() @ k.abs().T).max())
    bound = (2 * d + (2 * n + EXP_ULPS + 4) * U) * (p @ v.abs())
    return p @ v, bound


def check_attention(out, q, pool, layer, tables, lens, scale):
    """out (bfloat16) against (a) the float32 torch attention over the dequantized rows rounded to bfloat16, and
    (b) the float64 one. got = bf16(o_kernel), ref = bf16(o_torch): each rounding moves a value by at most half a
    bfloat16 unit, 2^-8 of its magnitude; the two float32 results are each within `attention_bound` of the
    exact one. So |got - ref| <= 2^-8 (|got| + |ref|) + 2 bound, and |got - exact| <= 2^-8 |got| + bound."""
    batch, heads, hd = q.shape
    kv_heads, block_size = pool.shape[1], pool.shape[4]
    group = heads // kv_heads
    for b, n in enumerate(lens):
        blocks = [int(i) for i in tables[b, : -(-n // block_size)]]
        kv = decode(torch.cat([pool[i, :, layer] for i in blocks], dim=2)[:, :, :n])  # [kvh, 2, n, hd] float32
        for h in range(kv_heads):
            qh = q[b, h * group : (h + 1) * group].float()
            exact, bound = attention_bound(qh, kv[h], scale)
            ref = (torch.softmax(qh @ kv[h, 0].T * scale, dim=-1) @ kv[h, 1]).to(BF16).double()
            got = out[b, h * group : (h + 1) * group].double()
            over = (got - ref).abs() > 2.0**-8 * (got.abs() + ref.abs()) + 2 * bound
            assert not over.any(), (f"request {b}, KV head {h}: {int(over.sum())} elements beyond the bound vs "
                                    f"float32 torch: {got[over][:3].tolist()} vs {ref[over][:3].tolist()}")
            over = (got - exact).abs() > 2.0**-8 * got.abs() + bound
            assert not over.any(), (f"request {b}, KV head {h}: {int(over.sum())} elements beyond the bound vs "
                                    f"float64: {got[over][:3].tolist()} vs {exact[over][:3].tolist()}")


def test_the_reference_encoder_follows_the_spec():
    """Round half to even, the clamp at 127, a zero row, the scale's bytes low first, and decode(encode(x)) within
    half a step of x."""
    x = torch.tensor([[254.0, 127.0, -1.0, 3.0, -3.0, 0.0], [0.0] * 6, [1.0, 2.5, 0.5, -0.5, 1.5, -2.5]])
    rows = encode(x)
    assert rows.shape == (3, 8)
    assert rows[0, :6].view(torch.int8).tolist() == [127, 64, 0, 2, -2, 0]  # scale 2: 63.5 -> 64, -0.5 -> 0, 1.5 -> 2
    assert rows[0, 6:].tolist() == [0x00, 0x40]  # float16 2.0 = 0x4000
    assert not rows[1].any()
    scale = float(torch.tensor(2.5 / 127).to(torch.float16))
    assert (decode(rows[2:]) - x[2]).abs().max() <= scale / 2
    assert torch.equal(decode(rows[:1]), torch.tensor([[254.0, 128.0, 0.0, 4.0, -4.0, 0.0]]))


@pytest.mark.parametrize("heads,kv_heads,hd", SHAPES)
def test_with_rows_stored_rotated_the_kernel_attends_over_them_turned_back(kernel, heads, kv_heads, hd):
    """Rows holding the codes of x R (`kv_rotation`; 40 -> blocks of 8, 96 -> of 32): with ``rotation`` the
    kernel's output is the attention of q over the rows' values turned back (values R^T), in float64 here.

    The kernel computes q' = q R in float32 (each element off by at most hd U (|q| |R|)), attends over the
    rotated rows (`attention_bound` in the rotated basis, its score term counting q's turn too: (2 hd + 4) U
    against |q| |R|), then turns the result back: o = o' R^T, off by |R| times o''s error plus hd U (|o'| |R^T|),
    and rounds it to bfloat16 (2^-8 of it)."""
    bs, layer, scale = 16, 1, hd**-0.5
    lens = [1, bs + 1, 3 * bs, 67]
    pool, tables, q, k_new, v_new = int8_case(heads, kv_heads, hd, bs, lens, seed=7 * hd)
    r = kv_rotation.rotation(hd)
    out = torch.empty(len(lens), heads, hd, dtype=BF16)
    plain = kernel.int8(q, k_new, v_new, pool.clone(), layer, tables, torch.tensor(lens), scale, out.clone())
    kernel.int8(q, k_new, v_new, pool, layer, tables, torch.tensor(lens), scale, out, rotation=kv_rotation.both(r))
    assert not torch.equal(plain, out)  # (the rotation is used)
    r64, group = r.double(), heads // kv_heads
    for b, n in enumerate(lens):  # the step's rows: codes of x R, each value within half its row's step of x R
        block, row = int(tables[b, (n - 1) // bs]), (n - 1) % bs
        for x, rows in ((k_new[b], pool[block, :, layer, 0, row]), (v_new[b], pool[block, :, layer, 1, row])):
            exact = x.double() @ r64
            step = decode(rows).double().abs().amax(-1, keepdim=True) / 127 * (1 + 2.0**-10)
            turn = hd * U * (x.double().abs() @ r64.abs())  # (the kernel's float32 turn)
            assert ((decode(rows).double() - exact).abs() <= step / 2 + turn + 2.0**-24 * step).all()
    for b, n in enumerate(lens):
        blocks = [int(i) for i in tables[b, : -(-n // bs)]]
        kv = decode(torch.cat([pool[i, :, layer] for i in blocks], dim=2)[:, :, :n]).double()  # rotated basis
        for h in range(kv_heads):
            qh = q[b, h * group : (h + 1) * group].double()
            k, v = kv[h, 0], kv[h, 1]
            p = torch.softmax((qh @ r64) @ k.T * scale, dim=-1)
            turned = p @ v  # o' (rotated basis), exact
            d = (2 * hd + 4) * U * scale * float(((qh.abs() @ r64.abs()) @ k.abs().T).max())
            bound_turned = (2 * d + (2 * n + EXP_ULPS + 4) * U) * (p @ v.abs())
            exact = turned @ r64.T
            bound = bound_turned @ r64.abs().T + hd * U * (turned.abs() @ r64.abs().T)
            got = out[b, h * group : (h + 1) * group].double()
            over = (got - exact).abs() > 2.0**-8 * got.abs() + bound
            assert not over.any(), (f"request {b}, KV head {h}: {int(over.sum())} elements beyond the bound: "
                                    f"{got[over][:3].tolist()} vs {exact[over][:3].tolist()}")


def test_a_rotation_of_another_size_or_dtype_is_refused(kernel):
    pool, tables, q, k_new, v_new = int8_case(9, 3, 64, 16, [5], seed=1)
    out = torch.empty(1, 9, 64, dtype=BF16)
    r = kv_rotation.both(kv_rotation.rotation(64))
    for bad in (kv_rotation.both(kv_rotation.rotation(32)), r.double(), r[0], r.transpose(1, 2)):
        with pytest.raises(ValueError, match="rotation"):
            kernel.int8(q, k_new, v_new, pool, 0, tables, torch.tensor([5]), 0.125, out, rotation=bad)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads,kv_heads,hd", SHAPES)
def test_the_int8_kernel_writes_the_step_and_attends_like_torch_over_the_dequantized_rows(kernel, heads, kv_heads,
                                                                                         hd, block_size):
    bs = block_size
    # the new token only, exactly one and three blocks, just past a boundary, mid-block, a long one
    lens = [1, bs, bs + 1, 3 * bs, 2 * bs + bs // 2 + 1, 67]
    pool, tables, q, k_new, v_new = int8_case(heads, kv_heads, hd, bs, lens, seed=heads * hd + bs)
    assert pool.shape[-1] == hd + 2 and pool.dtype == torch.uint8
    k_rows, v_rows = encode(k_new), encode(v_new)  # (the reference encoder's bytes: what the kernel must write)
    layer, scale = 1, hd**-0.5
    expected = pool.clone()
    for b, n in enumerate(lens):  # the step's rows at each request's (block, row), byte for byte
        block, row = int(tables[b, (n - 1) // bs]), (n - 1) % bs
        expected[block, :, layer, 0, row] = k_rows[b]
        expected[block, :, layer, 1, row] = v_rows[b]
    out = torch.empty(len(lens), heads, hd, dtype=BF16)
    assert kernel.int8(q, k_new, v_new, pool, layer, tables, torch.tensor(lens), scale, out) is out
    assert torch.equal(pool, expected)  # nothing else touched
    check_attention(out, q, pool, layer, tables, lens, scale)
    # one token: its own V, code * scale exactly (the weight is 1), rounded once
    assert torch.equal(out[0], decode(v_rows[0]).to(BF16).repeat_interleave(heads // kv_heads, 0))


def test_rows_with_zero_and_subnormal_scales_and_lens_of_one(kernel):
    """Every request attends over its new token only: out = its V row's values (code * scale), whatever the scale."""
    heads, kv_heads, hd = 9, 3, 64
    lens = [1] * 4
    pool, tables, q, _, _ = int8_case(heads, kv_heads, hd, 16, lens, seed=3)
    v = torch.randn(4, kv_heads, hd, generator=torch.Generator().manual_seed(4))
    v[1] = 0.0
    v[2] *= 2.0**-12  # a float16 subnormal scale
    v[3] *= 2.0**21  # amax / 127 near float16's largest
    v = v.to(BF16)
    v_rows = encode(v)
    assert not v_rows[1].any() and (v_rows[2, :, -1] < 4).all()  # scale 0; scales below 2^-14 (high byte < 4)
    out = torch.empty(4, heads, hd, dtype=BF16)
    kernel.int8(q, v.flip(0), v, pool, 0, tables, torch.tensor(lens), 0.125, out)
    assert torch.equal(pool[tables[:, 0], :, 0, 1, 0], v_rows)  # the kernel's rows are the reference's, byte for byte
    assert torch.equal(out, decode(v_rows).to(BF16).repeat_interleave(3, 1))


@pytest.mark.parametrize("bad", ["negative", "num_blocks", "huge"])
@pytest.mark.parametrize("where", [0, 2])  # a block it would only read, the block it would write
def test_a_bad_table_is_refused_with_nothing_written(kernel, bad, where):
    lens = [20, 7]  # blocks of 8: 3 + 1, and no spare ones
    pool, tables, q, k_new, v_new = int8_case(4, 2, 32, 8, lens, seed=5, spare=0)
    tables[0, where] = {"negative": -1, "num_blocks": pool.shape[0], "huge": 10**12}[bad]
    before = pool.clone()
    out = torch.zeros(2, 4, 32, dtype=BF16)
    with pytest.raises(ValueError, match=f"request 0's block {where} is"):
        kernel.int8(q, k_new, v_new, pool, 0, tables, torch.tensor(lens), 0.25, out)
    assert torch.equal(pool, before) and not out.any()


def test_the_c_side_refuses_a_negative_block_id(kernel):
    """With the wrapper's table check skipped (tables_checked), the kernel itself refuses a negative id (code -4)
    before writing anything."""
    pool, tables, q, k_new, v_new = int8_case(4, 2, 32, 8, [9], seed=6)
    tables[0, 1] = -1
    before = pool.clone()
    out = torch.zeros(1, 4, 32, dtype=BF16)
    with pytest.raises(RuntimeError, match="code -4"):
        kernel.int8(q, k_new, v_new, pool, 0, tables, torch.tensor([9]), 0.25, out, tables_checked=True)
    assert torch.equal(pool, before) and not out.any()


def test_the_int8_kernel_refuses_what_it_cannot_read(kernel):
    pool, tables, q, k_new, v_new = int8_case(4, 2, 32, 8, [9], seed=7)
    out = torch.empty(1, 4, 32, dtype=BF16)
    nine = torch.tensor([9])
    k_rows, v_rows = encode(k_new), encode(v_new)
    with pytest.raises(ValueError, match="wants bfloat16 q and torch.bfloat16"):  # rows already encoded
        kernel.int8(q, k_rows, v_rows, pool, 0, tables, nine, 0.25, out)
    with pytest.raises(ValueError, match="wants bfloat16 q and torch.bfloat16"):  # float32 values
        kernel.int8(q, k_new.float(), v_new.float(), pool, 0, tables, nine, 0.25, out)
    with pytest.raises(ValueError, match="shapes disagree"):  # an fp8-shaped pool (rows of head_dim bytes)
        kernel.int8(q, k_new, v_new, pool[..., :32].contiguous(), 0, tables, nine, 0.25, out)
    with pytest.raises(ValueError, match="bad pool"):  # a bfloat16 pool under the int8 entry
        kernel.int8(q, k_new, v_new, pool.to(BF16), 0, tables, nine, 0.25, out)
    with pytest.raises(ValueError, match="shapes disagree"):
        kernel.int8(q, k_new, v_new, pool, 3, tables, nine, 0.25, out)  # the pool has 3 layers
    with pytest.raises(RuntimeError, match="code -2"):  # a request with nothing to attend over
        kernel.int8(q, k_new, v_new, pool, 0, tables, torch.tensor([0]), 0.25, out)


@pytest.mark.parametrize("vector", [True, False])
def test_the_kernels_scale_conversion_equals_torchs_for_every_half(kernel, vector):
    """The rows' scales convert through F16C (vector) or bit arithmetic: bit for bit torch's float16 -> float32
    for all 65536 halves (subnormals and infinities included; NaNs stay NaN)."""
    halves = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    torchs = halves.float()
    ours = kernel.half_to_float(halves, vector)
    nan = torchs.isnan()
    assert torch.equal(ours.isnan(), nan) and int(nan.sum()) == 2 * 1023
    assert torch.equal(ours[~nan].view(torch.int32), torchs[~nan].view(torch.int32))


@pytest.mark.parametrize("vector", [True, False])
def test_the_kernels_half_rounding_equals_torchs(kernel, vector):
    """The scales the kernel encodes round float32 -> float16 through F16C (vector) or bit arithmetic: bit for bit
    torch's (round to nearest even) for every float32 whose exponent a scale can have, with the mantissas that
    matter (ties, just below and above them, carries into the exponent), subnormal halves, zero, overflow."""
    exps = torch.arange(-40, 17, dtype=torch.float64)
    low = torch.tensor([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FE000, 0x7FF000, 0x7FFFFF])
    mants = torch.cat([low, torch.randint(0, 1 << 23, (200,), generator=torch.Generator().manual_seed(0))])
    values = ((1 + mants.double() / 2**23)[None, :] * 2.0**exps[:, None]).float().flatten()
    values = torch.cat([values, torch.tensor([0.0, 65504.0, 65519.0, 65520.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25])])
    got = kernel.to_half(values.contiguous(), vector)
    assert torch.equal(got.view(torch.int16), values.to(torch.float16).view(torch.int16))
