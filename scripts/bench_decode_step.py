"""Time one ModelRunner decode step (and a 256-token prefill) on the default model.

    .venv/bin/python scripts/bench_decode_step.py [--threads 1] [--dtype bfloat16] [--steps 32]
                                                  [--batches 1,4,8] [--context 256] [--block-size 16]
                                                  [--reference | --compare] [--attention LIST]
                                                  [--profile B]

Prints the median ms per decode step for each batch size (each request prefilled with ~context
tokens first, into blocks scattered over the pool as a busy worker's are) and the median prefill time
for `context` tokens, cold and after a cached prefix of all its full blocks but the last (the
prefix cache's best case: only the tail is computed). --reference forces the general
(HF-module) path; --compare times both alternately in one run (the fair before/after on a
shared machine). --attention kernel,matmul times the lean forward with each decode attention
alternately, the same way (`kernel+torch-pointwise`: RMSNorm and rotary as torch ops). --profile B prints a torch.profiler table of decode steps at batch B.
Threads wait as a worker's do (the CLI's OMP_WAIT_POLICY/GOMP_SPINCOUNT defaults).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from xpyd.cli import _env_defaults  # noqa: E402

_env_defaults()

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--reference", action="store_true", help="use the general (HF-module) path")
    ap.add_argument("--compare", action="store_true",
                    help="time the fast and the general path alternately (in rounds of 4 steps) in one run")
    ap.add_argument("--attention", default="",
                    help="comma-separated decode attentions of the lean forward to time alternately (kernel,matmul,"
                         "sdpa); a '+torch-pointwise' suffix runs RMSNorm/rotary as torch ops instead of native calls")
    ap.add_argument("--profile", type=int, default=0, help="profile decode at this batch size")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from xpyd.worker.malloc_tuning import tune_malloc

    tune_malloc()  # as a worker does

    from xpyd.model.loader import ensure_converted
    from xpyd.model.runner import ModelRunner

    batches = [int(b) for b in args.batches.split(",")]
    model_dir = ensure_converted(None).path
    t0 = time.perf_counter()
    max_len = args.context + 2 * args.steps + 16
    per_request = -(-max_len // args.block_size)
    runner = ModelRunner(model_dir, getattr(torch, args.dtype), num_blocks=(max(batches) + 1) * per_request,
                         max_seq_len=max_len, block_size=args.block_size)
    blocks = runner.pool.blocks
    if args.attention:
        modes = [a.strip() for a in args.attention.split(",")]
    else:
        modes = ["fast", "general"] if args.compare else ["general" if args.reference else "fast"]

    def use(mode: str) -> None:
        runner.use_fast_path(mode != "general")
        if mode not in ("fast", "general"):
            attention, _, pointwise = mode.partition("+")
            runner.fast_path.decode_attention = attention
            runner.fast_path.native_pointwise = pointwise != "torch-pointwise"

    use(modes[0])
    print(f"load {time.perf_counter() - t0:.2f} s, fast path: {runner.fast_path_active}"
          f"{f' ({runner.fast_path.decode_attention} attention)' if runner.fast_path_active else ''}, "
          f"dtype {args.dtype}, threads {args.threads}")
    runner.warmup()
    gen = torch.Generator().manual_seed(0)

    def prompt(i: int) -> list[int]:
        return torch.randint(3, runner.vocab_size, (args.context - i,), generator=gen).tolist()

    def scattered(n: int) -> list[int]:
        """``n`` blocks spread over the pool in random order, as a worker's requests get them."""
        everything = blocks.allocate(blocks.num_free)
        order = torch.randperm(len(everything), generator=gen).tolist()
        blocks.release([everything[i] for i in order])
        return blocks.allocate(n)

    ids = prompt(0)
    cached = (len(ids) - 1) // args.block_size * args.block_size  # every full block but the last computed token's
    table = scattered(-(-len(ids) // args.block_size))
    for mode in modes[:1] if args.attention else modes:  # the attention does not change prefill
        use(mode)
        for start in (0, cached):
            times = []
            for _ in range(3):
                t = time.perf_counter()
                runner.prefill(table, ids, start=start)
                times.append(time.perf_counter() - t)
            print(f"[{mode}] prefill {args.context} tokens from {start}: {statistics.median(times) * 1e3:.1f} ms "
                  "(median of 3)")
    blocks.release(table)

    for batch in batches:
        prompts = [prompt(i) for i in range(batch)]  # slightly different lengths
        tables = [scattered(-(-len(p) // args.block_size)) for p in prompts]
        for table, p in zip(tables, prompts):
            runner.prefill(table, p)
        pos = [len(p) for p in prompts]
        toks = [5] * batch
        times: dict[str, list[float]] = {mode: [] for mode in modes}

        def grow() -> None:
            for table, p in zip(tables, pos):
                if p // args.block_size == len(table):
                    table += blocks.allocate(1)

        for step in range(args.steps * len(modes)):
            mode = modes[(step // 4) % len(modes)]
            use(mode)
            grow()
            t = time.perf_counter()
            logits = runner.decode(tables, toks, pos)
            times[mode].append(time.perf_counter() - t)
            toks = logits.argmax(-1).tolist()
            pos = [p + 1 for p in pos]
        for mode in modes:
            ts = times[mode]
            print(f"[{mode}] decode B={batch}: {statistics.median(ts) * 1e3:.2f} ms/step "
                  f"(min {min(ts) * 1e3:.2f}, {batch / statistics.median(ts):.0f} tok/s)")
        use(modes[0])
        if batch == args.profile:
            from torch.profiler import ProfilerActivity, profile

            grow()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(8):
                    runner.decode(tables, toks, pos)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        for table in tables:
            blocks.release(table)


if __name__ == "__main__":
    main()
