"""Markdown table of the serving suites (scripts/bench_suite.sh, scripts/bench_prefix.sh) for a baseline and
xpyd, with ratios (rows whose JSON is missing are left out).

    python scripts/ratio_table.py docs/bench/vllm docs/bench/xpyd_di [--names "vLLM CPU" "xpyd 1P1D"]
"""

from __future__ import annotations

import argparse
import json

ROWS = [  # (file suffix, label, metric, lower is better)
    ("c1", "concurrency 1", "TTFT p50 (ms)", lambda d: d["ttft_ms"]["p50"]),
    ("c1", "concurrency 1", "ITL p50 (ms)", lambda d: d["itl_ms"]["p50"]),
    ("c1", "concurrency 1", "output tok/s", lambda d: d["output_tokens_per_s"]),
    ("c4", "concurrency 4", "TTFT p50 (ms)", lambda d: d["ttft_ms"]["p50"]),
    ("c4", "concurrency 4", "ITL p50 (ms)", lambda d: d["itl_ms"]["p50"]),
    ("c4", "concurrency 4", "output tok/s", lambda d: d["output_tokens_per_s"]),
    ("stall", "prefill-stall", "short-stream ITL p99 (ms)", lambda d: d["classes"]["short"]["itl_ms"]["p99"]),
    ("stall", "prefill-stall", "ITL p99, all (ms)", lambda d: d["itl_ms"]["p99"]),
    ("stall", "prefill-stall", "output tok/s", lambda d: d["output_tokens_per_s"]),
    ("shared", "shared-prefix", "TTFT p50 (ms)", lambda d: d["ttft_ms"]["p50"]),
    ("shared", "shared-prefix", "ITL p50 (ms)", lambda d: d["itl_ms"]["p50"]),
    ("shared", "shared-prefix", "output tok/s", lambda d: d["output_tokens_per_s"]),
    ("shared", "shared-prefix", "prefix-cache hit rate", lambda d: d["prefix_cache"]["hit_rate"]),
    ("multiturn", "multi-turn", "TTFT p50 (ms)", lambda d: d["ttft_ms"]["p50"]),
    ("multiturn", "multi-turn", "ITL p50 (ms)", lambda d: d["itl_ms"]["p50"]),
    ("multiturn", "multi-turn", "output tok/s", lambda d: d["output_tokens_per_s"]),
    ("multiturn", "multi-turn", "prefix-cache hit rate", lambda d: d["prefix_cache"]["hit_rate"]),
]


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("baseline", help="path prefix of the baseline's JSONs (PREFIX_c1.json ...)")
    ap.add_argument("ours", help="path prefix of xpyd's JSONs")
    ap.add_argument("--names", nargs=2, default=["baseline", "xpyd"])
    args = ap.parse_args()
    print(f"| workload | metric | {args.names[0]} | {args.names[1]} | {args.names[1]} / {args.names[0]} |")
    print("|---|---|---|---|---|")
    for suffix, label, metric, get in ROWS:
        try:
            a = get(json.load(open(f"{args.baseline}_{suffix}.json")))
            b = get(json.load(open(f"{args.ours}_{suffix}.json")))
        except (OSError, KeyError, TypeError):
            continue
        if a is None or b is None:
            print(f"| {label} | {metric} | {_fmt(a)} | {_fmt(b)} | |")
            continue
        digits = 2 if "rate" in metric else 1
        ratio = f"{b / a:.2f}" if a else ""
        print(f"| {label} | {metric} | {a:.{digits}f} | {b:.{digits}f} | {ratio} |")


if __name__ == "__main__":
    main()
