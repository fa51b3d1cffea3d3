"""Markdown table of the serving suite (scripts/bench_suite.sh) for a baseline and xpyd, with ratios.

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
]


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
        except (OSError, KeyError):
            continue
        print(f"| {label} | {metric} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
