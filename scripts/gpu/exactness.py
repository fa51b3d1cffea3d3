"""Token-exactness of xpyd's CUDA engine against transformers on the same device (issue #28, must-be-true 1).

    python3 scripts/gpu/exactness.py --model DIR [--dtype float32] [--tokens 48] [--prompts 6] [--json OUT]

DIR is a model folder (config + tokenizer; `scripts/gpu/make_shape_model.py`); both sides make the same seeded
random weights on the device (`xpyd.model.dummy_weights`). The reference is transformers' own forward with its
DynamicCache, greedy, one request at a time. xpyd's `ModelRunner` prefills each prompt (lean forward over the
paged pool), samples on the device, then decodes all the prompts together in one batch (the paged Triton
kernels in CUDA graphs; the batch padded to the graph's size), as a decode worker does. Prints, per prompt,
whether the token sequences are equal and where they first differ, and for a difference the float64 top-2
margin there (a margin inside float32 error is a legitimate tie, anything else is a defect).
Runs on the CPU too (`--device cpu`, a tiny model) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoConfig, DynamicCache

from xpyd.model.dummy_weights import dummy_model
from xpyd.model.runner import ModelRunner
from xpyd.model.sampling_params import SamplingParams


def prompts(count: int, vocab: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 40, 64, 100, 250, 31, 8][:count] + [23] * max(0, count - 8)
    return [torch.randint(10, min(vocab, 30000), (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def reference(model, ids: list[int], new: int, device) -> tuple[list[int], list[torch.Tensor]]:
    cache = DynamicCache()
    x = torch.tensor([ids], device=device)
    out, logits_seen = [], []
    for _ in range(new):
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1].float()
        logits_seen.append(logits)
        token = int(logits.argmax())
        out.append(token)
        x = torch.tensor([[token]], device=device)
    return out, logits_seen


@torch.inference_mode()
def ours(runner: ModelRunner, all_ids: list[list[int]], new: int) -> list[list[int]]:
    greedy = SamplingParams(temperature=0.0)
    blocks = runner.pool.blocks
    tables, outs = [], []
    for ids in all_ids:
        table = blocks.allocate(runner.pool.layout.blocks_for(len(ids) + new))
        logits = runner.prefill(table, ids)
        token = runner.sampler.sample([logits], [greedy], [runner.sampler.new_generator(0)])[0]
        tables.append(table)
        outs.append([token])
    gens = [runner.sampler.new_generator(0) for _ in all_ids]
    for step in range(new - 1):
        positions = [len(ids) + step for ids in all_ids]
        logits = runner.decode(tables, [o[-1] for o in outs], positions)
        tokens = runner.sampler.sample(logits, [greedy] * len(all_ids), gens)
        for o, t in zip(outs, tokens):
            o.append(t)
    for table in tables:
        blocks.release(table)
    return outs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    config = AutoConfig.from_pretrained(args.model)
    all_ids = prompts(args.prompts, config.vocab_size)
    t0 = time.perf_counter()
    runner = ModelRunner(args.model, dtype, num_blocks=sum(len(i) + args.tokens + 32 for i in all_ids) // 16 + 8,
                         max_seq_len=512, device=device, load_format="dummy", max_batch=8,
                         cuda_graphs=device.type == "cuda" and not args.eager)
    built = time.perf_counter() - t0
    got = ours(runner, all_ids, args.tokens)
    graphs = runner.decoder.graph_sizes if runner.decoder is not None else ()
    del runner
    model = dummy_model(config, dtype, device)
    model64 = None
    results = []
    for ids, mine in zip(all_ids, got):
        ref, seen = reference(model, ids, args.tokens, device)
        first = next((i for i, (a, b) in enumerate(zip(ref, mine)) if a != b), None)
        row = {"prompt_len": len(ids), "equal": first is None, "first_difference": first}
        if first is not None:  # how close was the exact (float64) race at that step?
            if model64 is None:
                model64 = dummy_model(config, torch.float64, device)
            _, seen64 = reference(model64, ids + ref[:first], 1, device)
            top = seen64[0].topk(2).values
            row["margin64"] = float(top[0] - top[1])
            row["ref_vs_ours_logit_gap"] = float(seen[first][ref[first]] - seen[first][mine[first]])
        results.append(row)
        print(f"prompt {len(ids):4d} tokens: {'EQUAL' if first is None else f'differs at {first}: {row}'}")
    equal = sum(r["equal"] for r in results)
    print(f"exactness: {equal}/{len(results)} prompts token-exact over {args.tokens} tokens ({args.dtype} on "
          f"{device}; decode graphs {graphs or 'none'}; runner built in {built:.1f}s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "tokens": args.tokens, "graphs": list(graphs), "results": results}, f,
                      indent=1)
    return 0 if equal == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
