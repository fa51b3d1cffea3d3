"""Time one ModelRunner decode step (and a 256-token prefill) on the default model.

    .venv/bin/python scripts/bench_decode_step.py [--threads 1] [--dtype bfloat16] [--steps 32]
                                                  [--batches 1,4,8] [--context 256] [--block-size 16]
                                                  [--reference | --compare] [--attention LIST]
                                                  [--tables lists,rows] [--skip-prefill] [--profile B]

Prints the median ms per decode step for each batch size (each request prefilled with ~context
tokens first, into blocks scattered over the pool as a busy worker's are) and the median prefill time
for `context` tokens, cold and after a cached prefix of all its full blocks but the last (the
prefix cache's best case: only the tail is computed). --reference forces the general
(HF-module) path; --compare times both alternately in one run (the fair before/after on a
shared machine). --attention kernel,matmul times the lean forward with each decode attention
alternately, the same way (`kernel+torch-pointwise`: RMSNorm and rotary as torch ops). --profile B prints a
torch.profiler table of decode steps at batch B.
--tables lists,rows times the lean forward's step with the block tables passed as Python lists
(`ModelRunner.decode`: every id checked, the padded tensor rebuilt each step: the decode step before the tables
were kept) and as rows of the KV cache's kept tables (`decode_rows`, what the engines run), alternately; it
also times the host work that differs (checks and tables, no forward pass: "host") on its own, many times.
Requests grow through a `KVCache` as a worker's do. --skip-prefill fills the pool with random normal values instead
of prefilling each request (the step's cost does not depend on what the KV holds; long contexts at large
batches take minutes to prefill on a CPU).
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
    ap.add_argument("--tables", default="", help="lists,rows: the block tables as lists or kept rows, alternately")
    ap.add_argument("--skip-prefill", action="store_true", help="random KV instead of prefilled requests")
    ap.add_argument("--host-reps", type=int, default=200, help="repetitions of the host-only timing (--tables)")
    ap.add_argument("--profile", type=int, default=0, help="profile decode at this batch size")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from xpyd.worker.malloc_tuning import tune_malloc

    tune_malloc()  # as a worker does

    from xpyd.model.loader import ensure_converted
    from xpyd.model.runner import ModelRunner
    from xpyd.worker.kv_cache import KVCache

    batches = [int(b) for b in args.batches.split(",")]
    model_dir = ensure_converted(None).path
    t0 = time.perf_counter()
    max_len = args.context + 4 * args.steps + 16  # (up to 4 modes take turns, each `steps` steps)
    per_request = -(-max_len // args.block_size)
    runner = ModelRunner(model_dir, getattr(torch, args.dtype), num_blocks=(max(batches) + 1) * per_request,
                         max_seq_len=max_len, block_size=args.block_size)
    blocks = runner.pool.blocks
    if args.tables:
        modes = [t.strip() for t in args.tables.split(",")]
        if not set(modes) <= {"lists", "rows"}:
            ap.error("--tables takes lists and/or rows")
    elif args.attention:
        modes = [a.strip() for a in args.attention.split(",")]
    else:
        modes = ["fast", "general"] if args.compare else ["general" if args.reference else "fast"]

    def use(mode: str) -> None:
        runner.use_fast_path(mode != "general")
        if mode not in ("fast", "general", "lists", "rows"):
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
    if args.skip_prefill:
        runner.pool.tensor.normal_(generator=gen)  # (normal numbers: no denormals to slow the math down)
    for mode in [] if args.skip_prefill else modes[:1] if args.attention or args.tables else modes:
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

    cache = KVCache(blocks, args.block_size, seed=0)
    for batch in batches:
        prompts = [prompt(i) for i in range(batch)]  # slightly different lengths
        kvs = []
        for p in prompts:
            scattered(0)
            kvs.append(cache.admit([], len(p), 0))  # (its steps grow it: the pool holds the batch at full length)
            if not args.skip_prefill:
                runner.prefill(kvs[-1].blocks, p)
        pos = [len(p) for p in prompts]
        toks = [5] * batch
        times: dict[str, list[float]] = {mode: [] for mode in modes}

        def step(mode: str) -> torch.Tensor:
            """One decode step as the engine runs it (growing first; rows, or lists for the step before)."""
            for kv, p in zip(kvs, pos):
                cache.grow(kv, p + 1)
            if mode == "rows":
                return runner.decode_rows(cache.tables, [cache.table_row(kv) for kv in kvs], toks, pos)
            return runner.decode([kv.blocks for kv in kvs], toks, pos)

        for i in range(args.steps * len(modes)):
            mode = modes[(i // 4) % len(modes)]
            use(mode)
            t = time.perf_counter()
            logits = step(mode)
            times[mode].append(time.perf_counter() - t)
            toks = logits.argmax(-1).tolist()
            pos = [p + 1 for p in pos]
        context = statistics.mean(pos)
        for mode in modes:
            ts = times[mode]
            print(f"[{mode}] decode B={batch} (context ~{context:.0f}): {statistics.median(ts) * 1e3:.2f} ms/step "
                  f"(min {min(ts) * 1e3:.2f}, {batch / statistics.median(ts):.0f} tok/s)")
        if args.tables:
            host = host_times(runner, cache, kvs, toks, pos, modes, args.host_reps)
            print(f"host B={batch} (context ~{context:.0f}): "
                  + ", ".join(f"[{m}] {statistics.median(ts) * 1e6:.0f} us" for m, ts in host.items())
                  + f" per step (median of {args.host_reps}, alternating)")
        use(modes[0])
        if batch == args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(8):
                    step(modes[0])
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        for kv in kvs:
            cache.free(kv)


def host_times(runner, cache, kvs, toks, pos, modes, reps) -> dict[str, list[float]]:
    """The host work of one step that the kept tables change, without the forward pass: checking the batch
    and making the int64 tables tensor the forward reads (lists: `decode_batch` and `padded_tables`; rows:
    the rows, `decode_rows` and the gather), alternately, ``reps`` times each."""
    import numpy as np

    from xpyd.model import batch_checks, paged

    layout, alloc, max_len = runner.pool.layout, runner.pool.blocks, runner.max_model_len
    width = layout.blocks_for(max(pos) + 1)

    def lists() -> torch.Tensor:
        tables = batch_checks.decode_batch(layout, alloc, max_len, [kv.blocks for kv in kvs], toks, pos)
        return paged.padded_tables(tables, width, runner.device)

    def rows() -> torch.Tensor:
        picked = [cache.table_row(kv) for kv in kvs]
        batch_checks.decode_rows(layout, alloc, max_len, cache.tables, picked, toks, pos)
        kept = np.frombuffer(cache.tables.data, dtype=np.int32).reshape(cache.tables.capacity, cache.tables.width)
        return torch.from_numpy(kept[picked, :width].astype(np.int64))

    for kv, p in zip(kvs, pos):
        cache.grow(kv, p + 1)
    made = {"lists": lists, "rows": rows}
    assert all(torch.equal(made[m](), made[modes[0]]()) for m in modes)
    out: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(reps):
        for m in modes:
            t = time.perf_counter()
            made[m]()
            out[m].append(time.perf_counter() - t)
    return out

if __name__ == "__main__":
    main()
