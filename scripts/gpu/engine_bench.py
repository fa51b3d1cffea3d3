"""The CUDA engine's speed against the device's own ceilings (issue #28's goals), in one process.

    python3 scripts/gpu/engine_bench.py --model DIR [--json OUT]

DIR: a Llama-3-8B-shaped folder (`scripts/gpu/make_shape_model.py --preset llama3-8b`), served with seeded random
bf16 weights made on the device (the shape, not the values, sets the speed). Measured in this run, in order:
- ceilings: a device-to-device copy of 4 GiB (bytes read + written per second, as the issue counts them)
  and an 8192^3 bf16 matmul (random data, median of 10 after warm-up);
- decode at batch 1 (128-token prompt): wall time per step, forward + device sampling + the copy of the
  sampled id (what a decode worker's step waits for), CUDA graphs and eager; against the HBM floor
  (bytes of the weights a step reads / the copy rate);
- decode at batch 64 (512-token prompts): time per step and output tokens/s;
- prefill of 4,096 tokens: model FLOPs per second (2 x non-embedding params x tokens + causal attention)
  against the matmul rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from xpyd.model.runner import ModelRunner
from xpyd.model.sampling_params import SamplingParams


def timed_cuda(fn, repeat: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def ceilings() -> dict:
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy = timed_cuda(lambda: dst.copy_(src), 10)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm = timed_cuda(lambda: a @ b, 10)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n / copy, "matmul_flops_per_s": 2 * 8192**3 / mm}


def decode_steps(runner: ModelRunner, tables, positions, tokens, steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` decode steps (forward + sampling + the sampled ids on the host)."""
    greedy = [SamplingParams(temperature=0.0)] * len(tables)
    gens = [runner.sampler.new_generator(0) for _ in tables]
    out = []
    positions = list(positions)
    for _ in range(steps):
        t = time.perf_counter()
        logits = runner.decode(tables, tokens, positions)
        tokens = runner.sampler.sample(logits, greedy, gens)
        out.append(time.perf_counter() - t)
        positions = [p + 1 for p in positions]
    return out


def prefilled(runner: ModelRunner, count: int, length: int, extra: int):
    g = torch.Generator().manual_seed(1)
    tables, tokens = [], []
    for _ in range(count):
        ids = torch.randint(100, 30000, (length,), generator=g).tolist()
        table = runner.pool.blocks.allocate(runner.pool.layout.blocks_for(length + extra))
        logits = runner.prefill(table, ids)
        tokens.append(int(logits.argmax()))
        tables.append(table)
    torch.cuda.synchronize()
    return tables, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--json", default=None)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res.update(ceilings())
    t0 = time.perf_counter()
    runner = ModelRunner(args.model, getattr(torch, args.dtype), num_blocks=64 * 40 + 4096 // 16 + 64,
                         max_seq_len=8192, device="cuda", load_format="dummy", max_batch=64)
    res["build_s"] = time.perf_counter() - t0
    res["graph_sizes"] = list(runner.decoder.graph_sizes) if runner.decoder else []
    params = sum(t.numel() for t in runner.model.parameters())  # (the fused copies are the lean forward's)
    fast = runner.fast_path
    fused = sum(t.numel() for layer in fast.layers for t in (layer.qkv.weight, layer.o.weight, layer.gate_up.weight,
                                                              layer.down.weight))
    embed, head = fast.embed.numel(), fast.lm_head.weight.numel()
    norms = sum(layer.ln1.numel() + layer.ln2.numel() for layer in fast.layers) + fast.norm.numel()
    elem = fast.embed.element_size()
    res["params"] = fused + embed + head + norms
    step_bytes = (fused + head + norms) * elem  # what one decode step must read (one embedding row aside)
    res["decode_weight_bytes"] = step_bytes
    res["hbm_floor_s"] = step_bytes / res["copy_bytes_per_s"]
    print(f"device {res['device']}: copy {res['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{res['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s; model {res['params'] / 1e9:.2f} B params, built in "
          f"{res['build_s']:.1f}s, graphs {res['graph_sizes']}; {params} module params left", flush=True)

    tables, tokens = prefilled(runner, 1, 128, args.steps + 8)
    graph = decode_steps(runner, tables, [128], tokens, args.steps)[4:]
    decoder = runner.decoder
    saved, decoder._graphs = decoder._graphs, {}
    eager = decode_steps(runner, tables, [128], tokens, 24)[4:]
    if decoder.fused:  # the same step without the fused pointwise kernels, in graphs too
        decoder.fused = False
        decoder._capture()
        unfused = decode_steps(runner, tables, [128], tokens, 24)[4:]
        decoder.fused = True
        res["itl_b1_graph_unfused_s"] = statistics.median(unfused)
    decoder._graphs = saved
    for t in tables:
        runner.pool.blocks.release(t)
    res["itl_b1_graph_s"] = statistics.median(graph)
    res["itl_b1_eager_s"] = statistics.median(eager)
    print(f"decode batch 1: {res['itl_b1_graph_s'] * 1e3:.2f} ms/step with graphs "
          f"({res['itl_b1_graph_s'] / res['hbm_floor_s']:.2f}x the HBM floor {res['hbm_floor_s'] * 1e3:.2f} ms), "
          f"{res['itl_b1_eager_s'] * 1e3:.2f} ms eager, "
          f"{res.get('itl_b1_graph_unfused_s', float('nan')) * 1e3:.2f} ms in graphs without the fused kernels",
          flush=True)

    tables, tokens = prefilled(runner, 64, 512, args.steps + 8)
    big = decode_steps(runner, tables, [512] * 64, tokens, args.steps)[4:]
    for t in tables:
        runner.pool.blocks.release(t)
    res["itl_b64_s"] = statistics.median(big)
    res["tok_s_b64"] = 64 / res["itl_b64_s"]
    print(f"decode batch 64: {res['itl_b64_s'] * 1e3:.2f} ms/step, {res['tok_s_b64']:.0f} output tok/s", flush=True)

    n = 4096
    table = runner.pool.blocks.allocate(runner.pool.layout.blocks_for(n))
    ids = torch.randint(100, 30000, (n,)).tolist()
    prefill = timed_cuda(lambda: runner.prefill(table, ids), 5, warmup=2)
    runner.pool.blocks.release(table)
    cfg = runner.config
    heads_dim = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    flops = 2 * (fused + norms) * n + 2 * head + cfg.num_hidden_layers * 2 * n * n * heads_dim  # causal: QK^T + PV, half each
    res["prefill_4096_s"] = prefill
    res["prefill_flops_per_s"] = flops / prefill
    print(f"prefill {n} tokens: {prefill * 1e3:.1f} ms, {flops / prefill / 1e12:.0f} TFLOP/s = "
          f"{flops / prefill / res['matmul_flops_per_s']:.0%} of the matmul rate", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
