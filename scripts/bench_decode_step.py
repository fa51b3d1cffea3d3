"""Time one ModelRunner decode step (and a 256-token prefill) on the default model.

    .venv/bin/python scripts/bench_decode_step.py [--threads 1] [--dtype bfloat16] [--steps 32]
                                                  [--batches 1,4,8] [--context 256]
                                                  [--reference | --compare] [--profile B]

Prints the median ms per decode step for each batch size (each request prefilled with ~context
tokens first) and the median prefill time for `context` tokens. --reference forces the general
(HF-module) path; --compare times both alternately in one run (the fair before/after on a
shared machine). --profile B prints a torch.profiler table
of decode steps at batch B.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reference", action="store_true", help="use the general (HF-module) path")
    ap.add_argument("--compare", action="store_true",
                    help="time the fast and the general path alternately (in rounds of 4 steps) in one run")
    ap.add_argument("--profile", type=int, default=0, help="profile decode at this batch size")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from xpyd.engine.malloc_tuning import tune_malloc

    tune_malloc()  # as a worker does

    from xpyd.engine.loader import ensure_converted
    from xpyd.engine.model_runner import ModelRunner

    batches = [int(b) for b in args.batches.split(",")]
    model_dir = ensure_converted(None).path
    t0 = time.perf_counter()
    runner = ModelRunner(model_dir, getattr(torch, args.dtype), num_slots=max(batches),
                         max_seq_len=args.context + 2 * args.steps + 16)
    modes = [True, False] if args.compare else [not args.reference]
    runner.use_fast_path(modes[0])
    print(f"load {time.perf_counter() - t0:.2f} s, fast path: {runner.fast_path_active}, "
          f"dtype {args.dtype}, threads {args.threads}")
    runner.warmup()
    gen = torch.Generator().manual_seed(0)

    def prompt(i: int) -> list[int]:
        return torch.randint(3, runner.vocab_size, (args.context - i,), generator=gen).tolist()

    def label(fast: bool) -> str:
        return "fast" if fast else "general"

    slot = runner.pool.allocate()
    for fast in modes:
        runner.use_fast_path(fast)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            runner.prefill(slot, prompt(0))
            times.append(time.perf_counter() - t)
        print(f"[{label(fast)}] prefill {args.context} tokens: {statistics.median(times) * 1e3:.1f} ms (median of 3)")
    runner.pool.free(slot)

    for batch in batches:
        slots = [runner.pool.allocate() for _ in range(batch)]
        prompts = [prompt(i) for i in range(batch)]  # slightly different lengths
        for s, p in zip(slots, prompts):
            runner.prefill(s, p)
        pos = [len(p) for p in prompts]
        toks = [5] * batch
        times: dict[bool, list[float]] = {fast: [] for fast in modes}
        for step in range(args.steps * len(modes)):
            fast = modes[(step // 4) % len(modes)]
            runner.use_fast_path(fast)
            t = time.perf_counter()
            logits = runner.decode(slots, toks, pos)
            times[fast].append(time.perf_counter() - t)
            toks = logits.argmax(-1).tolist()
            pos = [p + 1 for p in pos]
        for fast in modes:
            ts = times[fast]
            print(f"[{label(fast)}] decode B={batch}: {statistics.median(ts) * 1e3:.2f} ms/step "
                  f"(min {min(ts) * 1e3:.2f}, {batch / statistics.median(ts):.0f} tok/s)")
        runner.use_fast_path(modes[0])
        if batch == args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(8):
                    runner.decode(slots, toks, pos)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        for s in slots:
            runner.pool.free(s)


if __name__ == "__main__":
    main()
