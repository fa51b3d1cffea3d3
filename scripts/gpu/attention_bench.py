"""Time the Triton paged decode attention (xpyd/model/gpu/paged_attention.py) against torch SDPA over gathered
blocks, on CUDA.

    PYTHONPATH=. python3 scripts/gpu/attention_bench.py [--batches 1,8,64] [--contexts 512,4096]
        [--splits N] [--tile 64] [--warps N]

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128), bfloat16, block size 16, each
request's blocks drawn from a shuffled order. One call is one layer of one decode step: every request
attends over `context` tokens. Times are medians of `triton.testing.do_bench` (warm, L2 cleared before each
call), in microseconds; GB/s is the K+V bytes the step must read (batch * context * 8 heads * 128 * 2 (K, V)
* 2 bytes) over that time, for both (SDPA also reads and writes its gathered copy, which is its cost).
Splits: `default_splits(batch, 8, SMs)` unless --splits. err/bound: the largest |out - ref| over the bound
of tests/gpu/test_paged_attention_cuda.py (bf16: 2^-7 W, W = softmax-weighted |v|), ref in float32 without
TF32 from the same inputs; "ok" when Triton's is <= 1.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

from xpyd.model import paged
from xpyd.model.gpu import paged_attention as pa

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


def case(batch: int, context: int, gen: torch.Generator):
    blocks_per = -(-context // BLOCK)
    num_blocks = batch * blocks_per + 1
    pool = torch.randn(num_blocks, KV_HEADS, 1, 2, BLOCK, HEAD_DIM, device=DEVICE, generator=gen).to(DTYPE)
    ids = torch.randperm(num_blocks, device=DEVICE, generator=gen)[: batch * blocks_per]
    tables = ids.view(batch, blocks_per).to(torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE, generator=gen).to(DTYPE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return pool, q, tables, lens


def sdpa(pool, q, tables64, context, scale):
    k, v = paged.gather(pool, 0, tables64, context)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]


def error_over_bound(out, pool, q, tables64, context, scale) -> float:
    k, v = paged.gather(pool, 0, tables64, context)
    batch, group = q.shape[0], HEADS // KV_HEADS
    qf = q.float().view(batch, KV_HEADS, group, HEAD_DIM)
    weights = (torch.matmul(qf, k.float().transpose(-1, -2)) * scale).softmax(-1)  # [B, KVH, G, T]
    ref = torch.matmul(weights, v.float()).view(batch, HEADS, HEAD_DIM)
    w = torch.matmul(weights, v.float().abs()).view(batch, HEADS, HEAD_DIM)
    return float(((out.float() - ref).abs() / (w * 2.0**-7)).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--splits", type=int, default=0, help="splits per (row, KV head); 0: default_splits")
    parser.add_argument("--tile", type=int, default=64, help="tokens per inner-loop tile")
    parser.add_argument("--warps", type=int, default=0, help="warps of the attention kernel; 0: the workspace's choice")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_bench: needs a CUDA device", file=sys.stderr)
        return 2
    reason = pa.why_unavailable(torch.device("cuda"))
    if reason:
        print(f"attention_bench: {reason}", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"{props.name}, {sms} SMs; {HEADS} heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16, block {BLOCK}, "
          f"tile {args.tile}, warps {args.warps or 'auto'}")
    print(f"{'batch':>5} {'ctx':>5} {'splits':>6} | {'triton us':>9} {'GB/s':>6} | {'sdpa us':>8} {'GB/s':>6} | "
          f"{'speedup':>7} | {'err/bound triton':>16} {'sdpa':>6}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    scale = 1 / math.sqrt(HEAD_DIM)
    started = time.monotonic()
    failed = False
    for batch in (int(x) for x in args.batches.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            pool, q, tables, lens = case(batch, context, gen)
            tables64 = tables.long()
            splits = args.splits or pa.default_splits(batch, KV_HEADS, sms)
            ws = pa.DecodeWorkspace(batch, HEADS, HEAD_DIM, splits, DEVICE, tile_tokens=args.tile,
                                    num_warps=args.warps or None)
            out = torch.empty_like(q)

            def triton_call():
                pa.paged_decode_attention(q, pool, 0, tables, lens, scale, out, ws)

            triton_call()
            ratio = error_over_bound(out, pool, q, tables64, context, scale)
            sdpa_ratio = error_over_bound(sdpa(pool, q, tables64, context, scale), pool, q, tables64, context, scale)
            t_triton = do_bench(triton_call, return_mode="median") * 1e3
            t_sdpa = do_bench(lambda: sdpa(pool, q, tables64, context, scale), return_mode="median") * 1e3
            kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * pool.element_size()
            ok = ratio <= 1.0
            failed |= not ok
            print(f"{batch:>5} {context:>5} {splits:>6} | {t_triton:>9.1f} {kv_bytes / t_triton / 1e3:>6.0f} | "
                  f"{t_sdpa:>8.1f} {kv_bytes / t_sdpa / 1e3:>6.0f} | {t_sdpa / t_triton:>6.2f}x | "
                  f"{ratio:>13.3f} {'ok' if ok else 'BAD':>2} {sdpa_ratio:>6.3f}")
            del pool, q, tables, tables64, ws, out
            torch.cuda.empty_cache()
    print(f"({time.monotonic() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
