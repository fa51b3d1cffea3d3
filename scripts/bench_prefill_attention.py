"""Prefill with the native prefill attention against torch's, side by side in one process.

    PYTHONPATH=. .venv/bin/python scripts/bench_prefill_attention.py [--lengths 512,1900,4000] [--chunk 512]
        [--threads 2] [--rounds 5] [--json OUT]

Two measurements, each alternating the two attentions round by round (the same process, the same inputs):
- one attention call (SmolLM2-135M's shape: 9 heads, 3 KV heads, head_dim 64) over a whole prompt: the
  native kernel (`native.PrefillAttention`) against `F.scaled_dot_product_attention(is_causal=True)`;
- the lean forward's whole prefill of a prompt through `ModelRunner.prefill` (SmolLM2-135M-Instruct, bfloat16,
  the default pool), whole and in `--chunk`-token chunks, with `FastLlama.prefill_attention` "kernel" and "sdpa".
Prints the medians in milliseconds and the ratios; the attention's share of the forward is their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from xpyd.cli import _env_defaults  # noqa: E402

_env_defaults()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from xpyd.model import native  # noqa: E402
from xpyd.model.loader import ensure_converted  # noqa: E402
from xpyd.model.runner import ModelRunner  # noqa: E402

BF16 = torch.bfloat16


def _median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _alternate(variants: dict, rounds: int) -> dict[str, float]:
    """Each variant once untimed, then ``rounds`` rounds in which each runs once, the order rotating."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}


def attention_calls(kernel, lengths: list[int], rounds: int) -> dict:
    out = {}
    gen = torch.Generator().manual_seed(0)
    for length in lengths:
        q, k, v = (torch.randn(length, h, 64, generator=gen).to(BF16) for h in (9, 3, 3))
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        res = _alternate({
            "kernel": lambda: kernel(q, k, v, 0.125),
            "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=0.125, enable_gqa=True),
        }, rounds)
        res["sdpa / kernel"] = round(res["sdpa"] / res["kernel"], 2)
        out[length] = res
        print(f"attention call, {length} tokens: {res}", flush=True)
    return out


def forward(lengths: list[int], chunk: int, rounds: int) -> dict:
    model = ensure_converted(None, progress=False).path
    runner = ModelRunner(model, BF16, num_blocks=(max(lengths) + 15) // 16 + 4, max_seq_len=max(lengths) + 16,
                         block_size=16)
    fast = runner.fast_path
    out = {}
    for length in lengths:
        ids = torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        table = runner.pool.blocks.allocate(runner.pool.layout.blocks_for(length))

        def run(mode: str, chunked: bool):
            def go():
                fast.prefill_attention = mode
                if not chunked:
                    runner.prefill(table, ids)
                    return
                for start in range(0, length, chunk):
                    runner.prefill(table, ids[: min(length, start + chunk)], start)
            return go

        res = _alternate({f"{mode} {'chunks' if chunked else 'whole'}": run(mode, chunked)
                          for mode in ("kernel", "sdpa") for chunked in (False, True)}, rounds)
        res["kernel / sdpa, whole"] = round(res["kernel whole"] / res["sdpa whole"], 3)
        res["chunks / whole, kernel"] = round(res["kernel chunks"] / res["kernel whole"], 3)
        res["chunks / whole, sdpa"] = round(res["sdpa chunks"] / res["sdpa whole"], 3)
        runner.pool.blocks.release(table)
        out[length] = res
        print(f"forward, {length} tokens (chunks of {chunk}): {res}", flush=True)
    fast.prefill_attention = "kernel"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1900,4000")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native.load_prefill_attention()
    if kernel is None:
        raise SystemExit(f"no native prefill attention here: {native.unavailable_reason('prefill_attention.c')}")
    lengths = [int(x) for x in args.lengths.split(",")]
    result = {"threads": args.threads, "rounds": args.rounds, "chunk": args.chunk,
              "load_before": os.getloadavg()[0],
              "attention_call_ms": attention_calls(kernel, lengths, args.rounds * 3),
              "forward_ms": forward(lengths, args.chunk, args.rounds), "load_after": os.getloadavg()[0]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
