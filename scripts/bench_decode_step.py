"""Time one ModelRunner decode step (and a 256-token prefill) on the default model.

    .venv/bin/python scripts/bench_decode_step.py [--threads 1] [--dtype bfloat16] [--steps 32]
                                                  [--batches 1,4,8] [--context 256]
                                                  [--reference | --compare] [--attention LIST]
                                                  [--profile B]

Prints the median ms per decode step for each batch size (each request prefilled with ~context
tokens first) and the median prefill time for `context` tokens. --reference forces the general
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
    runner = ModelRunner(model_dir, getattr(torch, args.dtype), num_slots=max(batches),
                         max_seq_len=args.context + 2 * args.steps + 16)
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

    slot = runner.pool.allocate()
    for mode in modes[:1] if args.attention else modes:  # the attention does not change prefill
        use(mode)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            runner.prefill(slot, prompt(0))
            times.append(time.perf_counter() - t)
        print(f"[{mode}] prefill {args.context} tokens: {statistics.median(times) * 1e3:.1f} ms (median of 3)")
    runner.pool.free(slot)

    for batch in batches:
        slots = [runner.pool.allocate() for _ in range(batch)]
        prompts = [prompt(i) for i in range(batch)]  # slightly different lengths
        for s, p in zip(slots, prompts):
            runner.prefill(s, p)
        pos = [len(p) for p in prompts]
        toks = [5] * batch
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for step in range(args.steps * len(modes)):
            mode = modes[(step // 4) % len(modes)]
            use(mode)
            t = time.perf_counter()
            logits = runner.decode(slots, toks, pos)
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

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(8):
                    runner.decode(slots, toks, pos)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        for s in slots:
            runner.pool.free(s)


if __name__ == "__main__":
    main()
