"""The native kernels (xpyd/model/csrc): the decode attention and the pointwise RMSNorm/rotary steps,
built here with the machine's compiler, checked against the float32 reference and the torch paths they
replace, and the fallback when they cannot be built."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from xpyd.model import native
from xpyd.model.llama_fast import FastLlama, _rms_norm
from xpyd.model.runner import ModelRunner

from tests.integration.test_model_runner import decode, new_seq, prefill, prompt_of, release, scattered
from tests.numerics import Reference, assert_roundings_apart, first_divergence

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernel() -> native.DecodeAttention:
    k = native.load_decode_attention()
    if k is None:  # this machine has gcc (facts.md): a failed build here is a defect, not a skip
        pytest.fail(f"native decode attention did not build: {native.unavailable_reason()}")
    return k


@pytest.fixture(scope="module")
def pointwise() -> native.Pointwise:
    p = native.load_pointwise()
    if p is None:
        pytest.fail(f"native pointwise kernels did not build: {native.unavailable_reason('pointwise.c')}")
    return p


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """Forget what this process has loaded and build into an empty cache."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reason", {})
    monkeypatch.setenv("XPYD_CACHE_DIR", str(tmp_path))
    return tmp_path


def reference(q, pool, layer, tables, lens, scale):
    """float32 softmax(q k^T * scale) v per request and query head (GQA: head h reads KV head h // group),
    each request's tokens gathered block by block through its table."""
    batch, heads, hd = q.shape
    kv_heads, block_size = pool.shape[1], pool.shape[4]
    group = heads // kv_heads
    out = torch.empty(batch, heads, hd)
    for b, n in enumerate(lens):
        blocks = [int(i) for i in tables[b, : -(-n // block_size)]]
        kv = torch.cat([pool[i, :, layer] for i in blocks], dim=2)[:, :, :n].float()  # [kvh, 2, n, hd]
        for h in range(heads):
            keys, values = kv[h // group, 0], kv[h // group, 1]
            scores = keys @ q[b, h].float() * scale
            out[b, h] = torch.softmax(scores, 0) @ values
    return out.to(BF16)


def paged_case(heads, kv_heads, hd, block_size, lens, *, layers=3, spare=5, row_pad=0, seed=0):
    """A random pool [blocks, kv_heads, layers, 2, block_size, hd] with `spare` blocks no request owns
    (row_pad > 0: rows of hd + row_pad elements, the pool a view of the first hd), shuffled block tables
    padded with 0, and q/k/v as FastLlama hands them over (strided views of one projection output)."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + spare
    pool = torch.randn(num_blocks, kv_heads, layers, 2, block_size, hd + row_pad, generator=gen).to(BF16)
    pool = pool[..., :hd]
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(used) + 2, dtype=torch.int64)
    at = 0
    for b, k in enumerate(used):
        tables[b, :k] = order[at : at + k]
        at += k
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, hd, generator=gen).to(BF16)
    q, k_new, v_new = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    return pool, tables, q, k_new, v_new


SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 32), (12, 2, 96), (16, 1, 256)]  # the last three: the generic copy


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads,hd", SHAPES)
def test_kernel_writes_the_new_kv_and_attends_like_the_reference(kernel, heads, kv_heads, hd, block_size):
    bs = block_size
    # one token, exactly one and three blocks, just past a boundary, mid-block, a long one
    lens = [1, bs, bs + 1, 3 * bs, 2 * bs + bs // 2 + 1, 67]
    pool, tables, q, k_new, v_new = paged_case(heads, kv_heads, hd, bs, lens, row_pad=8 if hd == 64 else 0,
                                               seed=heads * hd + bs)
    assert pool.stride(4) == (hd + 8 if hd == 64 else hd)  # the token stride is the pool's, not head_dim
    layer = 1
    before = pool.clone()
    out = torch.empty(len(lens), heads, hd, dtype=BF16)
    kernel(q, k_new, v_new, pool, layer, tables, torch.tensor(lens), hd**-0.5, out)

    expected = before.clone()
    for b, n in enumerate(lens):
        block, row = int(tables[b, (n - 1) // bs]), (n - 1) % bs
        expected[block, :, layer, 0, row] = k_new[b]
        expected[block, :, layer, 1, row] = v_new[b]
    assert torch.equal(pool, expected)  # the new K/V at each request's (block, row), nothing else touched
    ref = reference(q, pool, layer, tables, lens, hd**-0.5)
    assert_roundings_apart(out, ref, 1, "kernel vs reference")  # bf16: one rounding of float32 sums
    assert (out == ref).float().mean() > 0.97  # float32 sums in another order flip the odd rounding
    assert torch.equal(out[0], v_new[0].repeat_interleave(heads // kv_heads, 0))  # one token: its own V


def test_kernel_leaves_the_rest_of_the_pool_alone(kernel):
    """Every byte outside the written rows, padding columns of the pool's rows included, is unchanged."""
    lens = [5, 16, 33]
    pool, tables, q, k_new, v_new = paged_case(9, 3, 64, 16, lens, row_pad=8, seed=7)
    storage = pool._base
    raw_before = storage.view(torch.int16).clone()
    out = torch.empty(3, 9, 64, dtype=BF16)
    kernel(q, k_new, v_new, pool, 2, tables, torch.tensor(lens), 0.125, out)
    changed = (storage.view(torch.int16) != raw_before).nonzero().tolist()
    allowed = set()
    for b, n in enumerate(lens):
        block, row = int(tables[b, (n - 1) // 16]), (n - 1) % 16
        allowed |= {(block, h, 2, kv, row) for h in range(3) for kv in (0, 1)}
    assert changed and {tuple(c[:5]) for c in changed} <= allowed and all(c[5] < 64 for c in changed)


@pytest.mark.parametrize("bad", ["negative", "num_blocks", "huge"])
@pytest.mark.parametrize("where", [0, 2])  # a block it would only read, the block it would write
def test_a_bad_block_id_raises_before_anything_is_written(kernel, bad, where):
    lens = [20, 7]  # blocks of 8: 3 + 1, and no spare ones
    pool, tables, q, k_new, v_new = paged_case(4, 2, 32, 8, lens, spare=0)
    tables[0, where] = {"negative": -1, "num_blocks": pool.shape[0], "huge": 10**12}[bad]
    before = pool.clone()
    out = torch.zeros(2, 4, 32, dtype=BF16)
    with pytest.raises(ValueError, match=f"request 0's block {where} is"):
        kernel(q, k_new, v_new, pool, 0, tables, torch.tensor(lens), 0.25, out)
    assert torch.equal(pool, before) and not out.any()


def test_table_entries_past_a_requests_blocks_are_ignored(kernel):
    lens = [20, 7]
    pool, tables, q, k_new, v_new = paged_case(4, 2, 32, 8, lens, spare=0)
    clean = torch.empty(2, 4, 32, dtype=BF16)
    kernel(q, k_new, v_new, pool.clone(), 0, tables, torch.tensor(lens), 0.25, clean)
    tables[0, 3:], tables[1, 1:] = -5, 10**9  # padding: never read
    out = torch.empty(2, 4, 32, dtype=BF16)
    kernel(q, k_new, v_new, pool, 0, tables, torch.tensor(lens), 0.25, out)
    assert torch.equal(out, clean)
    with pytest.raises(ValueError, match="need 6 blocks, the tables hold 5"):  # longer than its table
        kernel(q, k_new, v_new, pool, 0, tables, torch.tensor([41, 7]), 0.25, out)


def test_the_c_side_refuses_a_negative_block_id(kernel):
    """The wrapper stops bad ids first; the kernel itself still refuses negative ones (code -4, nothing written)."""
    pool, tables, q, k_new, v_new = paged_case(4, 2, 32, 8, [9], spare=0)
    tables[0, 1] = -1
    before = pool.clone()
    out = torch.empty(1, 4, 32, dtype=BF16)
    lens = torch.tensor([9])
    rc = kernel._fn(q.data_ptr(), q.stride(0), k_new.data_ptr(), k_new.stride(0), v_new.data_ptr(), v_new.stride(0),
                    pool.data_ptr(), pool.stride(0), pool.stride(1), 0, pool.stride(3), pool.stride(4), 8,
                    tables.data_ptr(), tables.stride(0), lens.data_ptr(), 1, 4, 2, 32, 0.25, out.data_ptr(), 1)
    assert rc == -4 and torch.equal(pool, before)


def test_kernel_refuses_what_it_cannot_read(kernel):
    pool = torch.zeros(2, 2, 1, 2, 8, 16, dtype=BF16)
    q, kv = torch.zeros(1, 4, 16, dtype=BF16), torch.zeros(1, 2, 16, dtype=BF16)
    out = torch.empty(1, 4, 16, dtype=BF16)
    one, table = torch.tensor([1]), torch.tensor([[0]])
    with pytest.raises(ValueError, match="bfloat16"):
        kernel(q.float(), kv, kv, pool, 0, table, one, 0.25, out)
    with pytest.raises(ValueError, match="index dtypes"):
        kernel(q, kv, kv, pool, 0, table.int(), one, 0.25, out)
    with pytest.raises(ValueError, match="shapes disagree"):
        kernel(q, kv, kv, pool, 1, table, one, 0.25, out)  # the pool has one layer
    with pytest.raises(ValueError, match="shapes disagree"):
        kernel(q, kv, kv, pool.transpose(1, 2), 0, table, one, 0.25, out)
    with pytest.raises(ValueError, match="tables"):
        kernel(q, kv, kv, pool, 0, table[0], one, 0.25, out)
    with pytest.raises(RuntimeError, match="code -2"):  # a request with nothing to attend over
        kernel(q, kv, kv, pool, 0, table, torch.tensor([0]), 0.25, out)
    assert not pool.any()


def test_kernel_runs_on_torchs_openmp_runtime(kernel):
    """One OpenMP runtime per process: the library's libgomp.so.1 is the copy torch loaded."""
    with open("/proc/self/maps") as f:
        gomps = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomps) == 1, gomps


def test_bfloat16_runner_uses_the_kernel_and_batches_equal_single_requests(tiny_model_dir, kernel):
    """Scattered block tables over stale KV, the last request sharing the first one's leading blocks: the
    kernel's batch equals each request alone, and the torch matmul attention."""
    runner = ModelRunner(tiny_model_dir, BF16, num_blocks=96, max_seq_len=64, block_size=5)
    hf16, hf64 = (AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=d).eval() for d in (BF16, torch.float64))
    assert runner.fast_path.decode_attention == "kernel"
    pool = runner.pool
    stale = scattered(pool, pool.blocks.num_free, seed=1)
    for i in range(0, len(stale) - 8, 8):  # stale KV everywhere; each request must see only its own live tokens
        runner.prefill(stale[i : i + 8], prompt_of(40, 90 + i))
    pool.blocks.release(stale)
    prompts = [prompt_of(3 + 9 * i, 100 + i) for i in range(3)]
    seqs = [new_seq(pool, p, seed=2 + i) for i, p in enumerate(prompts)]
    try:
        for s in seqs:
            prefill(runner, s)
        seqs.append(new_seq(pool, prompts[2][:10] + prompt_of(8, 104), seed=5, prefix=seqs[2].table[:2]))
        prefill(runner, seqs[-1])
        positions = [len(s.prompt) for s in seqs]
        for s, pos in zip(seqs, positions):
            s.table += pool.blocks.allocate(pool.layout.blocks_for(pos + 1) - len(s.table))
        batched = runner.decode([s.table for s in seqs], [s.out[0] for s in seqs], positions)
        for i, s in enumerate(seqs):
            alone = runner.decode([s.table], [s.out[0]], [positions[i]])[0]
            runner.fast_path.decode_attention = "matmul"
            matmul = runner.decode([s.table], [s.out[0]], [positions[i]])[0]
            runner.fast_path.decode_attention = "kernel"
            # bf16 GEMMs at M=1 vs M=4, and two attentions: each within bfloat16 error of the exact step
            ids = torch.tensor([s.prompt + s.out[:1]])
            with torch.inference_mode():
                exact = Reference.measure(hf64(ids).logits[0, -1], hf16(ids).logits[0, -1])
            for name, logits in (("batched", batched[i]), ("alone", alone), ("matmul", matmul)):
                exact.check(logits, f"request {i}, {name}")
    finally:
        release(pool, seqs)
    assert pool.num_used == 0


def test_native_and_torch_steps_pick_the_same_greedy_tokens(smollm_dir, kernel, pointwise):
    """The real model, three requests of different lengths decoded together for 16 steps: native
    attention and pointwise steps vs torch's matmul attention and ops."""
    runner = ModelRunner(smollm_dir, BF16, num_blocks=32, max_seq_len=256)
    assert runner.fast_path.native_pointwise
    prompts = [[1, *range(100 + 7 * i, 160 + 11 * i)] for i in range(3)]
    prompts.append(prompts[2])  # the third again, prefilled after the third one's first two blocks
    tokens = {}
    for attention in ("kernel", "matmul"):
        runner.fast_path.decode_attention = attention
        runner.fast_path.native_pointwise = attention == "kernel"
        seqs = [new_seq(runner.pool, p, seed=i) for i, p in enumerate(prompts[:3])]
        try:
            for s in seqs:
                prefill(runner, s)
            seqs.append(new_seq(runner.pool, prompts[3], seed=3, prefix=seqs[2].table[:2]))
            prefill(runner, seqs[3])
            for _ in range(16):
                decode(runner, seqs)
        finally:
            release(runner.pool, seqs)
        tokens[attention] = [s.out for s in seqs]
    # Tokens agree wherever the exact top-2 margin exceeds twice the bfloat16 error (measured: transformers'
    # bfloat16 forward against float64); where it does not, either may be picked, and the rest differs.
    hf16, hf64 = (AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=d).eval() for d in (BF16, torch.float64))
    for prompt, ours, theirs in zip(prompts, tokens["kernel"], tokens["matmul"]):
        ids = torch.tensor([prompt + theirs[:-1]])
        with torch.inference_mode():
            ref = Reference.measure(hf64(ids).logits[0], hf16(ids).logits[0])
        rows = Reference(ref.exact[len(prompt) - 1 :], ref.bound)
        first_divergence(ours, theirs, rows.margins().tolist(), ref.bound)
    assert runner.pool.num_used == 0


def test_without_a_compiler_the_matmul_attention_is_used(fresh_native, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert native.load_decode_attention() is None
    assert "no C compiler" in native.unavailable_reason()
    runner = ModelRunner(tiny_model_dir, BF16, num_blocks=1, max_seq_len=64)
    assert runner.fast_path.decode_attention == "matmul" and not runner.fast_path.native_pointwise
    with pytest.raises(ValueError, match="unavailable: no C compiler"):
        runner.fast_path.decode_attention = "kernel"
    with pytest.raises(ValueError, match="unavailable: no C compiler"):
        runner.fast_path.native_pointwise = True


def test_native_kernels_can_be_turned_off(fresh_native, monkeypatch):
    monkeypatch.setenv("XPYD_NATIVE_KERNELS", "0")
    assert native.load_decode_attention() is None
    assert "XPYD_NATIVE_KERNELS=0" in native.unavailable_reason()


def test_a_build_is_cached_per_cpu(fresh_native, monkeypatch):
    path = native.build("decode_attention.c")
    assert path.parent == fresh_native / "kernels" and path.is_file()
    built = path.stat().st_mtime_ns
    assert native.build("decode_attention.c") == path and path.stat().st_mtime_ns == built  # not rebuilt
    monkeypatch.setattr(native, "_cpu_id", lambda: "another cpu")
    other = native.build("decode_attention.c")
    assert other != path and other.is_file()  # never loads code built for another CPU
    assert not [p for p in os.listdir(fresh_native / "kernels") if not p.endswith(".so")]  # no temp left


def test_float32_and_other_devices_keep_their_attention(tiny_model_dir, kernel):
    model = ModelRunner(tiny_model_dir, torch.float32, num_blocks=1, max_seq_len=64).model
    fp32 = FastLlama(model, 64, torch.float32)
    assert fp32.decode_attention == "sdpa" and not fp32.native_pointwise  # transformers' own ops
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        fp32.native_pointwise = True
    with pytest.raises(ValueError, match="bfloat16 on the CPU"):
        FastLlama(model, 64, torch.float32, decode_attention="kernel")


def test_rms_norm_is_transformers_rms_norm(pointwise):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(70, 2 * 576, generator=gen) * 4).to(BF16)[:, ::2]  # strided rows... and elements:
    with pytest.raises(ValueError, match="contiguous"):
        pointwise.rms_norm(x, torch.ones(576, dtype=BF16), 1e-5)
    x = (torch.randn(70, 1000, generator=gen) * 4).to(BF16)[:, 100:676]  # strided rows, contiguous elements
    weight = torch.randn(576, generator=gen).to(BF16)
    for rows in (1, 4, 70):  # 70 >= 64: spread over threads
        ours, theirs = pointwise.rms_norm(x[:rows], weight, 1e-5), _rms_norm(x[:rows], weight, 1e-5)
        assert_roundings_apart(ours, theirs, 1, f"{rows} rows")
        assert (ours == theirs).float().mean() > 0.995  # only the float32 sum's order differs
    with pytest.raises(ValueError, match="bfloat16"):
        pointwise.rms_norm(x.float(), weight, 1e-5)


def test_rope_is_the_torch_rotary_step(tiny_model_dir, pointwise):
    model = ModelRunner(tiny_model_dir, BF16, num_blocks=1, max_seq_len=64).model
    fast = FastLlama(model, 64, BF16)
    assert fast.native_pointwise
    heads = fast.num_heads + 2 * fast.num_kv_heads
    gen = torch.Generator().manual_seed(2)
    qkv = (torch.randn(70, heads, fast.head_dim, generator=gen) * 3).to(BF16)
    positions = torch.randint(0, 64, (70,), generator=gen)
    for rows in (1, 5, 70):
        cos, sin = fast.cos[positions[:rows]], fast.sin[positions[:rows]]
        ours = fast._rope(qkv[:rows], cos, sin)
        fast.native_pointwise = False
        theirs = fast._rope(qkv[:rows], cos, sin)
        fast.native_pointwise = True
        assert ours.shape == (rows, fast.num_heads + fast.num_kv_heads, fast.head_dim)
        assert torch.equal(ours, theirs)  # the same roundings, step by step
