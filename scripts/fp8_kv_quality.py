"""The fp8 KV cache against KV in the model's dtype on the default model (SmolLM2-135M-Instruct; --dtype:
bfloat16, or float32), in one process through `ModelRunner` (the engines' forward passes), alternating the KV
dtypes. (Below, "bfloat16" names the model-dtype KV, whichever --dtype.)

    .venv/bin/python scripts/fp8_kv_quality.py [--threads 2] [--dtype bfloat16] [--kv fp8_e4m3,fp8_e5m2] [--text FILE]
        [--segments 8] [--segment-tokens 256] [--answer-tokens 48] [--concurrency 16] [--context 256]
        [--steps 24] [--rounds 9] [--parts perplexity,greedy,decode] [--json OUT]

1. Perplexity of a held-out text (default: the GPL-3 text in /usr/share/common-licenses; the scales are
   calibrated on seeded random ids, so any real text is held out): cut into --segments segments of
   --segment-tokens tokens, each read teacher-forced through decode steps, all segments in one batch, so
   every token attends over the K/V of the ones before it as the pool stores them, the way a generation's
   tokens do. Reports mean NLL and the ratio exp(NLL_fp8 - NLL_bf16).
2. Greedy answers: PROMPTS as chat turns (the chat template), up to --answer-tokens greedy tokens each (an
   answer ends at the model's end-of-turn token, as a worker's does), all in one batch; the share of answers
   identical to bfloat16 KV's (and the mean share of identical leading tokens). For scale, the same for the
   model-dtype KV with the other decode attention (the native kernel vs torch's matmuls: the same numbers
   summed in another order): how far answers move with rounding alone ("noise_floor"); with --dtype float32 also
   the answers with the K/V rounded to bfloat16 as written ("bfloat16_storage": the KV precision engines keep by
   default).
3. Decode speed: --concurrency requests with --context-token prompts; --steps decode steps timed, the KV
   dtypes taking turns for --rounds rounds (fair on a shared machine); median and best tokens/s per KV
   dtype.
Prints one JSON object (and writes it to --json).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from xpyd.cli import _env_defaults  # noqa: E402

_env_defaults()

import torch  # noqa: E402

from xpyd.model import paged  # noqa: E402
from xpyd.model.loader import ensure_converted  # noqa: E402
from xpyd.model.runner import ModelRunner  # noqa: E402
from xpyd.model.tokenizer import encode_chat, load_tokenizer  # noqa: E402

PROMPTS = [  # short factual, reasoning and writing requests, as a chat client sends them
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in one sentence what a CPU does.",
    "What is 12 times 12?",
    "Write a haiku about the sea.",
    "Give me a synonym for 'happy'.",
    "What does DNA stand for?",
    "How many days are there in a leap year?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "List the planets of the solar system in order.",
    "Who wrote 'Romeo and Juliet'?",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a pet goldfish.",
    "What is the opposite of 'ancient'?",
    "Describe a cat in two sentences.",
    "What is photosynthesis?",
    "Give one tip for sleeping better.",
    "What is the largest ocean on Earth?",
    "Write a short greeting for a birthday card.",
]


def runner_for(model: Path, kv: str, blocks: int, max_len: int, dtype: torch.dtype = torch.bfloat16) -> ModelRunner:
    return ModelRunner(model, dtype, num_blocks=blocks, max_seq_len=max_len, block_size=16,
                       kv_cache_dtype="auto" if kv == "bfloat16" else kv)


def teacher_forced_nll(runner: ModelRunner, segments: list[list[int]]) -> float:
    """Mean negative log-likelihood of each segment's tokens 1..n-1, every one read by a decode step."""
    pool = runner.pool
    tables = [pool.blocks.allocate(pool.layout.blocks_for(len(s))) for s in segments]
    total, count = 0.0, 0
    try:
        logits = runner.prefill_many([(t, s[:1], 0) for t, s in zip(tables, segments)])
        for pos in range(1, len(segments[0])):
            targets = torch.tensor([s[pos] for s in segments])
            logp = torch.log_softmax(logits.float(), -1)
            total -= float(logp[torch.arange(len(segments)), targets].sum())
            count += len(segments)
            if pos == len(segments[0]) - 1:
                break
            logits = runner.decode(tables, [s[pos] for s in segments], [pos] * len(segments))
    finally:
        for t in tables:
            pool.blocks.release(t)
    return total / count


def greedy(runner: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's greedy answer: ``n`` tokens, cut after the first end-of-sequence token."""
    out = _greedy(runner, prompts, n)
    ends = runner.eos_token_ids
    return [o[: next((i + 1 for i, t in enumerate(o) if t in ends), len(o))] for o in out]


def _greedy(runner: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    pool = runner.pool
    tables = [pool.blocks.allocate(pool.layout.blocks_for(len(p) + n)) for p in prompts]
    try:
        logits = runner.prefill_many([(t, p, 0) for t, p in zip(tables, prompts)])
        out = [[int(row.argmax())] for row in logits]
        for step in range(1, n):
            positions = [len(p) + step - 1 for p in prompts]
            logits = runner.decode(tables, [o[-1] for o in out], positions)
            for o, row in zip(out, logits):
                o.append(int(row.argmax()))
    finally:
        for t in tables:
            pool.blocks.release(t)
    return out


def greedy_kv_rounded(runner: ModelRunner, prompts: list[list[int]], n: int, dtype: torch.dtype) -> list[list[int]]:
    """`greedy` with every K/V the forward writes rounded to ``dtype`` first (its pool keeps them in the model's
    dtype): what storing the KV in ``dtype`` alone does to the answers."""
    write = paged.write

    def rounded(pool, layer, where, k, v, codec=None):
        return write(pool, layer, where, k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype), codec)

    paged.write = rounded
    try:
        return greedy(runner, prompts, n)
    finally:
        paged.write = write


def decode_rate(runner: ModelRunner, concurrency: int, context: int, steps: int) -> float:
    """Tokens per second of ``steps`` decode steps of ``concurrency`` requests after ``context``-token prompts."""
    pool = runner.pool
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, runner.vocab_size, (context,), generator=gen).tolist() for _ in range(concurrency)]
    tables = [pool.blocks.allocate(pool.layout.blocks_for(context + steps + 1)) for _ in prompts]
    try:
        for t, p in zip(tables, prompts):
            runner.prefill(t, p)
        tokens = [1] * concurrency
        runner.decode(tables, tokens, [context] * concurrency)  # (warm)
        start = time.perf_counter()
        for step in range(1, steps + 1):
            runner.decode(tables, tokens, [context + step] * concurrency)
        return concurrency * steps / (time.perf_counter() - start)
    finally:
        for t in tables:
            pool.blocks.release(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--kv", default="fp8_e4m3,fp8_e5m2", help="KV dtypes compared with bfloat16 KV")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--segment-tokens", type=int, default=256)
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--parts", default="perplexity,greedy,decode")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = ensure_converted(None, progress=False).path
    tok = load_tokenizer(model)
    kinds = ["bfloat16", *[k for k in args.kv.split(",") if k]]
    max_len = max(args.segment_tokens, args.context + args.steps + 2, 512)
    blocks = max(args.segments * -(-args.segment_tokens // 16), len(PROMPTS) * 8,
                 args.concurrency * -(-(args.context + args.steps + 2) // 16)) + 8
    dtype = getattr(torch, args.dtype)
    runners = {k: runner_for(model, k, blocks, max_len, dtype) for k in kinds}
    for r in runners.values():
        r.warmup()
    result: dict = {"model": str(model), "dtype": args.dtype, "threads": args.threads, "kv": kinds,
                    "attention": {k: r.fast_path.decode_attention for k, r in runners.items()},
                    "token_bytes": {k: r.pool.layout.token_bytes for k, r in runners.items()}}

    parts = args.parts.split(",")
    if "perplexity" in parts:
        result["perplexity"] = perplexity(runners, tok, args)
    if "greedy" in parts:
        result["greedy"] = answers(runners, tok, args)
    if "decode" in parts:
        result["decode"] = speed(runners, args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


def perplexity(runners: dict[str, ModelRunner], tok, args: argparse.Namespace) -> dict:
    kinds = list(runners)
    ids = tok(Path(args.text).read_text(), add_special_tokens=False).input_ids
    n = args.segment_tokens
    if len(ids) < args.segments * n:
        raise SystemExit(f"{args.text}: {len(ids)} tokens, fewer than {args.segments} x {n}")
    segments = [ids[i * n : (i + 1) * n] for i in range(args.segments)]
    nll = {k: teacher_forced_nll(r, segments) for k, r in runners.items()}
    return {"text": args.text, "tokens": args.segments * (n - 1), "nll": nll,
            "ppl": {k: math.exp(v) for k, v in nll.items()},
            "ratio_vs_bfloat16": {k: math.exp(nll[k] - nll["bfloat16"]) for k in kinds[1:]}}


def answers(runners: dict[str, ModelRunner], tok, args: argparse.Namespace) -> dict:
    kinds = list(runners)
    prompts = [encode_chat(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    outs = {k: greedy(r, prompts, args.answer_tokens) for k, r in runners.items()}
    base = outs["bfloat16"]
    fast = runners["bfloat16"].fast_path
    usual = fast.decode_attention
    other = {"kernel": "matmul", "matmul": "kernel", "sdpa": "matmul"}[usual]
    fast.decode_attention = other
    try:
        floor = greedy(runners["bfloat16"], prompts, args.answer_tokens)
    finally:
        fast.decode_attention = usual

    def leading(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))

    stored = None  # float32 weights: the KV every engine keeps by default, bfloat16, as another point of scale
    if runners["bfloat16"].fast_path is not None and next(iter(runners.values())).dtype == torch.float32:
        rounded = greedy_kv_rounded(runners["bfloat16"], prompts, args.answer_tokens, torch.bfloat16)
        stored = {"kv": "float32 K/V rounded to bfloat16 as written",
                  "identical": sum(a == b for a, b in zip(rounded, base)) / len(base),
                  "leading_tokens_identical": statistics.mean(leading(a, b) / len(b) for a, b in zip(rounded, base))}

    return {"prompts": len(PROMPTS), "tokens": args.answer_tokens, "bfloat16_storage": stored,
        "noise_floor": {"attention": f"{other} vs {usual}", "identical": sum(a == b for a, b in zip(floor, base)) /
                        len(base), "leading_tokens_identical": statistics.mean(leading(a, b) / len(b)
                                                                              for a, b in zip(floor, base))},
        "identical": {
        k: sum(a == b for a, b in zip(outs[k], base)) / len(base) for k in kinds[1:]},
        "leading_tokens_identical": {k: statistics.mean(leading(a, b) / len(b) for a, b in zip(outs[k], base))
                                     for k in kinds[1:]},
        "differing": {k: [{"prompt": PROMPTS[i], "bfloat16": tok.decode(base[i]), k: tok.decode(a)}
                          for i, a in enumerate(outs[k]) if a != base[i]] for k in kinds[1:]}}


def speed(runners: dict[str, ModelRunner], args: argparse.Namespace) -> dict:
    kinds = list(runners)
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k, r in runners.items():
            rates[k].append(decode_rate(r, args.concurrency, args.context, args.steps))
    med = {k: statistics.median(v) for k, v in rates.items()}
    best = {k: max(v) for k, v in rates.items()}
    return {"concurrency": args.concurrency, "context": args.context, "steps": args.steps, "tokens_per_s": rates,
            "median": med, "best": best, "ratio_vs_bfloat16": {k: med[k] / med["bfloat16"] for k in kinds[1:]},
            "best_ratio_vs_bfloat16": {k: best[k] / best["bfloat16"] for k in kinds[1:]}}


if __name__ == "__main__":
    main()
